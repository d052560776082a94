"""Python: integer puzzles the model solves by running code in the sandbox (`run_python_async`)."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

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
from rollout_workers.environments.policy import context_policy
from rollout_workers.environments.sandbox import SandboxLimits, check_sandbox, run_python_async

if TYPE_CHECKING:
    from rollout_workers.trajectory import Trajectory


def _primes_below(n: int) -> list[int]:
    return [p for p in range(2, n) if all(p % d for d in range(2, int(p**0.5) + 1))]


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


# (question template, reference code template, answer function); each takes one integer parameter.
_PUZZLES: list[tuple[str, str, Any, tuple[int, int]]] = [
    (
        "What is the sum of the squares of the integers from 1 to {k}?",
        "print(sum(i * i for i in range(1, {k} + 1)))",
        lambda k: sum(i * i for i in range(1, k + 1)),
        (5, 200),
    ),
    (
        "How many prime numbers are there below {k}?",
        "print(sum(all(p % d for d in range(2, int(p ** 0.5) + 1)) for p in range(2, {k})))",
        lambda k: len(_primes_below(k)),
        (10, 500),
    ),
    (
        "What is the {k}th Fibonacci number (F(0) = 0, F(1) = 1)?",
        "a, b = 0, 1\nfor _ in range({k}):\n    a, b = b, a + b\nprint(a)",
        _fib,
        (5, 60),
    ),
    (
        "What is the sum of the digits of 2 to the power {k}?",
        "print(sum(int(c) for c in str(2 ** {k})))",
        lambda k: sum(int(c) for c in str(2**k)),
        (10, 200),
    ),
]


_CAPPED = ("cpu_seconds", "memory_mb", "output_bytes", "wall_seconds")


class PythonOptions(EnvironmentOptions):
    """Per-call sandbox limits a job may choose, within the operator's maxima (EnvironmentPolicy.python_max)."""

    cpu_seconds: int = Field(5, ge=1, le=3600, description="CPU time per call, all its processes together.")
    memory_mb: int = Field(256, ge=16, le=65536, description="Memory per call, all its processes together.")
    output_bytes: int = Field(16 * 1024, ge=1024, le=16 * 1024 * 1024, description="Captured output per call.")
    wall_seconds: float = Field(10.0, gt=0.0, le=3600.0, description="Wall-clock time per call.")

    @model_validator(mode="before")
    @classmethod
    def _defaults_within_operator_maxima(cls, data: Any, info: ValidationInfo) -> Any:
        """An option the job leaves out gets its default, or the operator's maximum where that is lower."""
        policy = context_policy(info)
        if policy is None or not isinstance(data, dict):
            return data
        filled = dict(data)
        for name in _CAPPED:
            limit, default = getattr(policy.python_max, name), cls.model_fields[name].default
            if name not in filled and default > limit:
                filled[name] = limit
        return filled

    @field_validator(*_CAPPED)
    @classmethod
    def _within_operator_maxima(cls, value: float, info: ValidationInfo) -> float:
        policy = context_policy(info)
        if policy is not None:
            limit = getattr(policy.python_max, str(info.field_name))
            if value > limit:
                raise ValueError(f"at most {limit} (the operator's maximum), got {value}")
        return value


class PythonEnv(Environment):
    name = "python"
    cooperative = True
    Options = PythonOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        o: Any = self.Options.model_validate(options)
        self.limits = SandboxLimits(
            cpu_seconds=o.cpu_seconds,
            memory_bytes=o.memory_mb * 1024 * 1024,
            output_bytes=o.output_bytes,
            wall_seconds=o.wall_seconds,
        )
        self.sandbox = check_sandbox()  # refuse to start where model-written code cannot be sandboxed

    def tools(self) -> list[dict[str, Any]]:
        return [tool("run_python", "Run a Python program (no network, limited CPU/memory/time) and return what it prints.",
                     {"code": {"type": "string", "description": "Python source; print the result."}})]

    async def call(self, tool: str, args: dict[str, Any]) -> str:
        if tool != "run_python":
            raise ToolError(f"unknown tool {tool!r}")
        result = await run_python_async(str(args["code"]), self.limits, config=self.sandbox)
        return result.summary()

    def outcome(self, trajectory: Trajectory) -> float:
        answer = parse_int(extract_answer(final_answer_text(trajectory)))
        return float(answer is not None and answer == int(trajectory.task["answer"]))

    def process(self, trajectory: Trajectory, step_index: int) -> dict[str, float]:
        """Step consistency: the program printed the task's answer / the final answer restates output."""
        step = trajectory.steps[step_index]
        target = str(trajectory.task["answer"])
        if step.tool_calls:
            return {"output_has_answer": float(any(target in (c.result or "").split() for c in step.tool_calls))}
        if step.is_final:
            outputs = [c.result or "" for s in trajectory.steps[:step_index] for c in s.tool_calls]
            stated = extract_answer(step.action_text)
            return {"answer_matches_tool": float(bool(outputs) and stated is not None and stated in outputs[-1].split())}
        return {}

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **_: Any) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        tasks = []
        for i in range(n):
            kind = rng.randrange(len(_PUZZLES))
            question, code, answer_fn, (lo, hi) = _PUZZLES[kind]
            k = rng.randint(lo, hi)
            tasks.append(
                {
                    "id": f"python-{seed}-{i}",
                    "question": question.format(k=k),
                    "reference_code": code.format(k=k),
                    "answer": answer_fn(k),
                }
            )
        return tasks

    def demonstration(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            *task_messages(task),
            tool_call_message("run_python", {"code": task["reference_code"]}),
            {"role": "tool", "content": f"{task['answer']}\n"},
            {"role": "assistant", "content": f"The answer is {task['answer']}."},
        ]
