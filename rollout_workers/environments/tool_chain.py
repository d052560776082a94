"""Tool chain: a start value and k operations; the calculator here does one operation per call, so the
answer needs k dependent calls, each starting from the previous call's result.

    "Start with 37, then + 5, then * 3. What is the result?"
    calculator("37 + 5") -> 42, calculator("42 * 3") -> 126, "The answer is 126."

The outcome is sparse by construction: it pays only when every call in the chain was right. The process
components judge each node against the task, so they cannot be earned by format alone: a call is one
operation on two integers; call number j computes step j from the correct intermediate (the task's own
value before step j, the start value for j = 0); the final answer restates the last tool result.
"""

from __future__ import annotations

import random
import re
from typing import TYPE_CHECKING, Any

from pydantic import Field

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
from rollout_workers.environments.calculator import evaluate_expression

if TYPE_CHECKING:
    from rollout_workers.trajectory import Trajectory

_ONE_STEP = re.compile(r"^\s*(-?\d{1,12})\s*([-+*])\s*(\d{1,12})\s*$")
_OPS = "+-*"


def one_step(expression: str) -> tuple[int, str, int] | None:
    """"42 * 3" -> (42, "*", 3); None for anything that is not one operation on two integers."""
    m = _ONE_STEP.match(expression)
    return (int(m.group(1)), m.group(2), int(m.group(3))) if m else None


def chain_values(task: dict[str, Any]) -> list[int]:
    """The task's intermediates: the start value, then the value after each step."""
    values = [int(task["start"])]
    for op, operand in task["steps"]:
        values.append(evaluate_expression(f"{values[-1]} {op} {operand}"))
    return values


class ToolChainOptions(EnvironmentOptions):
    k: int = Field(2, ge=1, le=4, description="Dependent tool calls each task needs.")
    max_start: int = Field(99, ge=2, le=9999, description="Largest start value.")
    max_operand: int = Field(9, ge=2, le=99, description="Largest operand of a step.")


class ToolChainEnv(Environment):
    name = "tool_chain"
    cooperative = True
    Options = ToolChainOptions

    def tools(self) -> list[dict[str, Any]]:
        return [tool("calculator", "Apply one operation to two integers: 'a + b', 'a - b' or 'a * b'.",
                     {"expression": {"type": "string", "maxLength": 40, "description": "e.g. 42 * 3"}})]

    async def call(self, tool: str, args: dict[str, Any]) -> str:
        if tool != "calculator":
            raise ToolError(f"unknown tool {tool!r}")
        expression = str(args["expression"])
        if one_step(expression) is None:
            raise ToolError(f"one operation on two integers per call, like '42 * 3'; got {expression[:40]!r}")
        return str(evaluate_expression(expression))

    def outcome(self, trajectory: Trajectory) -> float:
        answer = parse_int(extract_answer(final_answer_text(trajectory)))
        return float(answer is not None and answer == int(trajectory.task["answer"]))

    def process(self, trajectory: Trajectory, step_index: int) -> dict[str, float]:
        step = trajectory.steps[step_index]
        if step.tool_calls:
            task = trajectory.task
            values = chain_values(task)
            j = sum(len(s.tool_calls) for s in trajectory.steps[:step_index])  # the chain node this call is
            parsed = one_step(str((step.tool_calls[0].arguments or {}).get("expression", "")))
            correct = (j < len(task["steps"]) and parsed is not None
                       and parsed == (values[j], task["steps"][j][0], task["steps"][j][1]))
            return {"call_is_one_step": float(parsed is not None), "call_uses_intermediate": float(correct)}
        if step.is_final:
            results = [parse_int(c.result) for s in trajectory.steps[:step_index] for c in s.tool_calls
                       if c.result is not None]
            stated = parse_int(extract_answer(step.action_text))
            return {"answer_restates_result": float(bool(results) and stated is not None and stated == results[-1])}
        return {}

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **options: Any) -> list[dict[str, Any]]:
        o: Any = cls.Options.model_validate(options)
        rng = random.Random(seed)
        tasks = []
        for i in range(n):
            start = rng.randint(2, o.max_start)
            value, steps = start, []
            for _ in range(o.k):
                op, operand = rng.choice(_OPS), rng.randint(2, o.max_operand)
                if op == "-" and operand > value:  # non-negative intermediates, as on calculator
                    op = "+"
                steps.append([op, operand])
                value = evaluate_expression(f"{value} {op} {operand}")
            said = ", ".join(f"then {op} {operand}" for op, operand in steps)
            tasks.append({
                "id": f"tool_chain-{o.k}-{seed}-{i}",
                "question": f"Start with {start}, {said}. What is the result?",
                "start": start,
                "steps": steps,
                "answer": value,
            })
        return tasks

    def demonstration(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        values = chain_values(task)
        messages: list[dict[str, Any]] = task_messages(task)
        for value, (op, operand), result in zip(values, task["steps"], values[1:], strict=False):
            messages.append(tool_call_message("calculator", {"expression": f"{value} {op} {operand}"}))
            messages.append({"role": "tool", "content": str(result)})
        messages.append({"role": "assistant", "content": f"The answer is {values[-1]}."})
        return messages
