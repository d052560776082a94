"""`check_environment` (behind `taper env check`): the built-ins pass; each kind of broken environment is named."""

from __future__ import annotations

import random
from typing import Any

import pytest

from rollout_workers.environments.calculator import CalculatorEnv
from rollout_workers.environments.check import check_environment
from rollout_workers.environments.registry import BUILTIN_ENVIRONMENTS


@pytest.mark.parametrize("name", sorted(BUILTIN_ENVIRONMENTS))
def test_builtins_pass(name: str) -> None:
    report = check_environment(BUILTIN_ENVIRONMENTS[name], n=3, seed=1)
    assert report.ok, (report.problems, [t.problems for t in report.tasks])
    assert all(t.outcome == 1.0 and t.tool_calls >= 1 for t in report.tasks)


class WrongDemo(CalculatorEnv):
    name = "wrong_demo"

    def demonstration(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        messages = super().demonstration(task)
        messages[2] = {"role": "tool", "content": "12345"}
        messages[3] = {"role": "assistant", "content": "The answer is 12345."}
        return messages


class Unseeded(CalculatorEnv):
    name = "unseeded"

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **options: Any) -> list[dict[str, Any]]:
        return super().generate_tasks(n, random.randrange(10**9), **options)


class OutOfRange(CalculatorEnv):
    name = "out_of_range"

    def process(self, trajectory: Any, step_index: int) -> dict[str, float]:
        return {"too_much": 2.0}


class NoDemo(CalculatorEnv):
    name = "no_demo"

    def demonstration(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        raise NotImplementedError("none")


def test_broken_environments_are_named() -> None:
    wrong = check_environment(WrongDemo, n=2)
    assert not wrong.ok
    assert any("the demonstration says '12345'" in p for p in wrong.tasks[0].problems)
    assert any("outcome is 0.0" in p for p in wrong.tasks[0].problems)

    assert any("not deterministic" in p for p in check_environment(Unseeded, n=4).problems)
    assert any("outside [0, 1]" in p for p in check_environment(OutOfRange, n=1).tasks[0].problems)
    assert check_environment(NoDemo, n=1).tasks[0].problems == ["no demonstration: none"]
