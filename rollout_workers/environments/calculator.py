"""Calculator: short integer arithmetic ("What is 37 * 12?"), one tool call, then "The answer is 444."

Kept small enough for a ~1-2M parameter model to learn: the gold behaviour is to copy the expression
into one `calculator` call and restate the tool's result.
"""

from __future__ import annotations

import ast
import operator
import random
from typing import TYPE_CHECKING, Any

from pydantic import Field, field_validator, model_validator

from rollout_workers.environments.base import (
    Environment,
    EnvironmentOptions,
    ToolError,
    extract_answer,
    final_answer_text,
    parse_int,
    task_messages,
    tool,
    tool_call_message,
)

if TYPE_CHECKING:
    from rollout_workers.trajectory import Trajectory

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}
_MAX_ABS = 10**12


def evaluate_expression(expression: str) -> int:
    """Integer arithmetic with + - * // and parentheses; raises ToolError on anything else."""
    if len(expression) > 200:
        raise ToolError("expression too long (max 200 characters)")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse expression {expression!r}") from None

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.FloorDiv) and right == 0:
                raise ToolError("division by zero")
            value = _BINOPS[type(node.op)](left, right)
            if abs(value) > _MAX_ABS:
                raise ToolError("result too large")
            return value
        raise ToolError(f"unsupported element in expression: {ast.dump(node)[:40]}")

    return ev(tree)


class CalculatorOptions(EnvironmentOptions):
    ops: str = Field("+-*", min_length=1, max_length=3, description="Operators the tasks use, a subset of '+-*'.")
    min_operand: int = Field(2, ge=0, le=1_000_000)
    max_operand: int = Field(99, ge=0, le=1_000_000)

    @field_validator("ops")
    @classmethod
    def _known_ops(cls, v: str) -> str:
        if set(v) - set("+-*"):
            raise ValueError(f"must be a non-empty subset of '+-*', got {v!r}")
        return v

    @model_validator(mode="after")
    def _ordered(self) -> CalculatorOptions:
        if self.min_operand > self.max_operand:
            raise ValueError("min_operand/max_operand: need min_operand <= max_operand")
        return self


class CalculatorEnv(Environment):
    name = "calculator"
    cooperative = True
    Options = CalculatorOptions

    def tools(self) -> list[dict[str, Any]]:
        return [tool("calculator", "Evaluate an integer arithmetic expression (+, -, *, //, parentheses).",
                     {"expression": {"type": "string", "description": "e.g. 37 * 12"}})]

    async def call(self, tool: str, args: dict[str, Any]) -> str:
        if tool != "calculator":
            raise ToolError(f"unknown tool {tool!r}")
        return str(evaluate_expression(str(args["expression"])))

    def outcome(self, trajectory: Trajectory) -> float:
        answer = parse_int(extract_answer(final_answer_text(trajectory)))
        return float(answer is not None and answer == int(trajectory.task["answer"]))

    def process(self, trajectory: Trajectory, step_index: int) -> dict[str, float]:
        """Step consistency: a call computes the task's expression; a final answer restates the
        last tool result."""
        step = trajectory.steps[step_index]
        task_value = int(trajectory.task["answer"])
        if step.tool_calls:
            values = []
            for c in step.tool_calls:
                try:
                    values.append(evaluate_expression(str((c.arguments or {}).get("expression", ""))))
                except ToolError:
                    values.append(None)
            return {"call_matches_task": float(any(v == task_value for v in values))}
        if step.is_final:
            results = [
                parse_int(c.result)
                for s in trajectory.steps[:step_index]
                for c in s.tool_calls
                if c.result is not None
            ]
            stated = parse_int(extract_answer(step.action_text))
            return {"answer_matches_tool": float(bool(results) and stated is not None and stated == results[-1])}
        return {}

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **options: Any) -> list[dict[str, Any]]:
        o: Any = cls.Options.model_validate(options)
        rng = random.Random(seed)
        tasks = []
        for i in range(n):
            a, b = rng.randint(o.min_operand, o.max_operand), rng.randint(o.min_operand, o.max_operand)
            op = rng.choice(o.ops)
            if op == "-" and b > a:  # non-negative answers: one less thing for a tiny model to learn
                a, b = b, a
            expression = f"{a} {op} {b}"
            tasks.append(
                {
                    "id": f"calculator-{seed}-{i}",
                    "question": f"What is {expression}?",
                    "expression": expression,
                    "answer": evaluate_expression(expression),
                }
            )
        return tasks

    def demonstration(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        result = evaluate_expression(task["expression"])
        return [
            *task_messages(task),
            tool_call_message("calculator", {"expression": task["expression"]}),
            {"role": "tool", "content": str(result)},
            {"role": "assistant", "content": f"The answer is {result}."},
        ]
