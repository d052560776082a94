"""Builders for hand-made trajectories and a small in-test environment (pure-logic unit tests)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from rollout_workers.trajectory import Step, ToolCall, Trajectory, TrajectoryStatus


def make_step(
    n_action: int = 3,
    n_obs: int = 2,
    calls: list[ToolCall] | None = None,
    process: dict[str, float] | None = None,
    is_final: bool = False,
    start_id: int = 10,
) -> Step:
    return Step(
        action_ids=list(range(start_id, start_id + n_action)),
        action_logprobs=[-0.5] * n_action,
        action_text="",
        weight_version=0,
        tool_calls=calls or [],
        observation_ids=list(range(start_id + 100, start_id + 100 + n_obs)),
        is_final=is_final,
        process_rewards=dict(process or {}),
    )


def make_traj(
    group: str,
    outcome: float | None,
    steps: list[Step] | None = None,
    status: TrajectoryStatus = TrajectoryStatus.OK,
    task: dict[str, Any] | None = None,
    tid: str | None = None,
) -> Trajectory:
    kw = {"id": tid} if tid else {}
    return Trajectory(
        env="calc",
        task_id="t",
        task=task or {},
        group_id=group,
        prompt_ids=[1, 2, 3],
        prompt_text="",
        steps=steps if steps is not None else [make_step()],
        status=status,
        outcome_reward=outcome,
        **kw,
    )


def call(
    name: str | None, args: dict[str, Any] | None = None, result: str | None = "ok", **kw: Any
) -> ToolCall:
    raw = json.dumps({"name": name, "arguments": args}) if name else "{not json"
    if name is None:
        return ToolCall(raw=raw, error="could not parse", error_kind="format")
    return ToolCall(raw=raw, name=name, arguments=args, result=result, **kw)


class CalcEnv:
    """A calculator environment with the interface of rollout_workers.environments.base.Environment."""

    name = "calc"

    def tools(self) -> list[dict[str, Any]]:
        return [
            {
                "name": "calculate",
                "description": "Evaluate an arithmetic expression.",
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string"}},
                    "required": ["expression"],
                    "additionalProperties": False,
                },
            }
        ]

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": task["question"]}]

    async def call(self, tool: str, args: dict[str, Any]) -> str:
        return str(eval(args["expression"], {"__builtins__": {}}))  # test-only toy tool

    def outcome(self, trajectory: Trajectory) -> float:
        final = trajectory.steps[-1].action_text if trajectory.steps else ""
        m = re.search(r"-?\d+", final)
        return float(m is not None and int(m.group()) == trajectory.task["answer"])

    def process(self, trajectory: Trajectory, step_index: int) -> dict[str, float]:
        step = trajectory.steps[step_index]
        return {"calc_short": 1.0 if len(step.action_ids) <= 4 else 0.0}

    def checkable_values(self, trajectory: Trajectory, step_index: int) -> list[Any]:
        earlier = [c.result for s in trajectory.steps[:step_index] for c in s.tool_calls if c.result]
        return [trajectory.task["question"], *earlier]


@pytest.fixture
def calc_env() -> CalcEnv:
    return CalcEnv()


@pytest.fixture(scope="session")
def b() -> Any:
    """The builders, as one namespace (tests import nothing from conftest directly)."""

    class Builders:
        step = staticmethod(make_step)
        traj = staticmethod(make_traj)
        call = staticmethod(call)
        Status = TrajectoryStatus

    return Builders
