"""Unit conversion: "How many m are in 37 km?" -> one `convert` call -> "The answer is 37000."

The guide's complete example of a Python environment (docs/environments.md): tools, call, the outcome
verifier, process components, a seeded task generator and demonstrations (`reset` is the default one: the
task's question opens the episode).
"""

from __future__ import annotations

import random
import re
from typing import Any

from pydantic import Field

from rollout_workers.environments.base import (
    Environment,
    EnvironmentOptions,
    ToolError,
    extract_answer,
    final_answer_text,
    parse_int,
    tool,
    tool_call_message,
)

# Integer factors to one base unit per quantity, so every answer is a whole number.
UNITS: dict[str, tuple[str, int]] = {
    "mm": ("length", 1), "cm": ("length", 10), "m": ("length", 1000), "km": ("length", 1_000_000),
    "g": ("mass", 1), "kg": ("mass", 1000),
    "s": ("time", 1), "min": ("time", 60), "h": ("time", 3600),
}
# The conversions tasks ask for: (from, to) with a whole-number factor.
PAIRS = [("km", "m"), ("m", "cm"), ("m", "mm"), ("cm", "mm"), ("kg", "g"), ("h", "min"), ("min", "s")]
_NUMBER = re.compile(r"-?\d+")


def convert(value: int, from_unit: str, to_unit: str) -> int:
    """Exact integer conversion; ToolError (shown to the model) for unknown units or a fractional result."""
    for unit in (from_unit, to_unit):
        if unit not in UNITS:
            raise ToolError(f"unknown unit {unit!r}; known: {', '.join(UNITS)}")
    (q_from, f_from), (q_to, f_to) = UNITS[from_unit], UNITS[to_unit]
    if q_from != q_to:
        raise ToolError(f"cannot convert {q_from} ({from_unit}) to {q_to} ({to_unit})")
    base = value * f_from
    if base % f_to:
        raise ToolError(f"{value} {from_unit} is not a whole number of {to_unit}")
    return base // f_to


class UnitConvertOptions(EnvironmentOptions):
    """What a tenant may set per job (declared and bounded: anything else is refused)."""

    max_value: int = Field(99, ge=1, le=1_000_000, description="Largest quantity a task asks to convert.")


class UnitConvertEnv(Environment):
    name = "unit_convert"
    Options = UnitConvertOptions
    cooperative = True  # no method blocks: the agent loop may run them on its own event loop

    def tools(self) -> list[dict[str, Any]]:
        return [tool("convert", "Convert a whole-number quantity between units (mm, cm, m, km, g, kg, s, min, h).", {
            "value": {"type": "integer"},
            "from_unit": {"type": "string", "enum": list(UNITS)},
            "to_unit": {"type": "string", "enum": list(UNITS)},
        })]

    async def call(self, tool: str, args: dict[str, Any]) -> str:
        if tool != "convert":
            raise ToolError(f"unknown tool {tool!r}")
        return str(convert(int(args["value"]), str(args["from_unit"]), str(args["to_unit"])))

    def outcome(self, trajectory: Any) -> float:
        """1.0 when the final answer states the right number."""
        stated = parse_int(extract_answer(final_answer_text(trajectory)))
        return float(stated is not None and stated == int(trajectory.task["answer"]))

    def process(self, trajectory: Any, step_index: int) -> dict[str, float]:
        """Per step: a call converts the task's quantity between the task's units; a final answer
        restates the last tool result."""
        step = trajectory.steps[step_index]
        task = trajectory.task
        if step.tool_calls:
            right = [(c.arguments or {}) == {"value": task["value"], "from_unit": task["from_unit"],
                                              "to_unit": task["to_unit"]} for c in step.tool_calls]
            return {"call_matches_task": float(any(right))}
        if step.is_final:
            results = [c.result for s in trajectory.steps[:step_index] for c in s.tool_calls
                       if c.result is not None and _NUMBER.fullmatch(c.result)]
            stated = parse_int(extract_answer(step.action_text))
            return {"answer_matches_tool": float(bool(results) and stated == int(results[-1]))}
        return {}

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **options: Any) -> list[dict[str, Any]]:
        o = UnitConvertOptions.model_validate(options)
        rng = random.Random(seed)
        tasks = []
        for i in range(n):
            from_unit, to_unit = rng.choice(PAIRS)
            value = rng.randint(1, o.max_value)
            tasks.append({
                "id": f"unit_convert-{seed}-{i}",
                "question": f"How many {to_unit} are in {value} {from_unit}?",
                "value": value, "from_unit": from_unit, "to_unit": to_unit,
                "answer": convert(value, from_unit, to_unit),
            })
        return tasks

    def demonstration(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        args = {"value": task["value"], "from_unit": task["from_unit"], "to_unit": task["to_unit"]}
        result = convert(**args)
        return [
            {"role": "user", "content": task["question"]},
            tool_call_message("convert", args),
            {"role": "tool", "content": str(result)},
            {"role": "assistant", "content": f"The answer is {result}."},
        ]
