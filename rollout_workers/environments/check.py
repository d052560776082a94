"""`taper env check`: run an environment's tasks and demonstrations locally, the way a linter would, before
anyone registers it. Each task's demonstration is replayed through the environment's own tools and the
recorded episode is scored by its `outcome` and `process_steps`."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from rollout_workers.chat import tool_call_text
from rollout_workers.environments.base import Environment, ToolError, check_arguments, validate_tool_schemas
from rollout_workers.trajectory import Step, ToolCall, Trajectory


@dataclass
class TaskCheck:
    """What one task's demonstration did."""

    task_id: str
    tool_calls: int = 0
    outcome: float | None = None
    process: list[dict[str, float]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@dataclass
class CheckReport:
    environment: str
    tasks: list[TaskCheck]
    problems: list[str]  # environment-wide

    @property
    def ok(self) -> bool:
        return not self.problems and not any(t.problems for t in self.tasks)


def check_environment(cls: type[Environment], n: int = 8, seed: int = 0,
                      options: dict[str, Any] | None = None) -> CheckReport:
    """Generate `n` tasks twice (the generator must be deterministic, ids unique) and replay each task's
    demonstration: every tool answer must equal the demonstration's, the outcome must be 1.0, and every
    reward must lie in [0, 1]."""
    options = options or {}
    problems: list[str] = []
    checked = cls.Options.model_validate(options).model_dump(exclude_unset=True)
    env = cls(**checked)
    try:
        validate_tool_schemas(env.tools(), field=f"{cls.__name__}.tools()")
    except ValueError as e:
        problems.append(str(e))
    tasks = cls.generate_tasks(n, seed, **checked)
    if len(tasks) != n:
        problems.append(f"generate_tasks({n}, ...) returned {len(tasks)} tasks")
    ids = [t.get("id") for t in tasks]
    if len(set(map(str, ids))) != len(ids) or None in ids:
        problems.append("task ids are missing or repeat")
    if json.dumps(cls.generate_tasks(n, seed, **checked), sort_keys=True, default=str) != json.dumps(
            tasks, sort_keys=True, default=str):
        problems.append(f"generate_tasks is not deterministic: seed {seed} gave different tasks twice")
    return CheckReport(cls.name or cls.__name__, [_check_task(cls, checked, t) for t in tasks], problems)


def _check_task(cls: type[Environment], options: dict[str, Any], task: dict[str, Any]) -> TaskCheck:
    result = TaskCheck(task_id=str(task.get("id")))
    env = cls(**options)
    try:
        messages = env.demonstration(task)
    except NotImplementedError as e:
        result.problems.append(f"no demonstration: {e}")
        return result
    try:
        trajectory = asyncio.run(_replay(env, task, messages, result))
    except Exception as e:  # the check reports what broke instead of stopping at the first task
        result.problems.append(f"replaying the demonstration raised {e!r}")
        return result
    result.outcome = env.outcome(trajectory)
    if result.outcome != 1.0:
        result.problems.append(f"the demonstration's outcome is {result.outcome}, not 1.0")
    result.process = env.process_steps(trajectory)
    for i, components in enumerate(result.process):
        bad = {k: v for k, v in components.items() if not 0.0 <= v <= 1.0}
        if bad:
            result.problems.append(f"process components of step {i} outside [0, 1]: {bad}")
    return result


async def _replay(env: Environment, task: dict[str, Any], messages: list[dict[str, Any]],
                  result: TaskCheck) -> Trajectory:
    """The demonstration as a recorded episode, its tool answers produced by the environment's own tools."""
    await env.reset(task)
    tools = {t["name"]: t for t in env.tools()}
    steps: list[Step] = []
    answers = iter(m for m in messages if m.get("role") == "tool")
    for message in messages:
        if message.get("role") != "assistant":
            continue
        calls = []
        for call in message.get("tool_calls") or []:
            name, args = call["function"]["name"], call["function"]["arguments"]
            if isinstance(args, str):
                args = json.loads(args)
            record = ToolCall(raw=tool_call_text(name, args), name=name, arguments=args)
            bad_args = check_arguments(tools[name], args) if name in tools else f"unknown tool {name!r}"
            if bad_args:
                result.problems.append(f"demonstration call {name}: {bad_args}")
            try:
                record.result = await env.call(name, args)
            except ToolError as e:
                record.error, record.error_kind = str(e), "tool_error"
                result.problems.append(f"demonstration call {name}({args}) is refused by the tool: {e}")
            expected = next(answers, {}).get("content")
            if record.result is not None and expected is not None and str(expected) != record.result:
                result.problems.append(f"tool {name} answered {record.result!r}, the demonstration says {expected!r}")
            calls.append(record)
        result.tool_calls += len(calls)
        text = "".join(c.raw for c in calls) if calls else str(message.get("content") or "")
        steps.append(Step(action_ids=[], action_logprobs=[], action_text=text, weight_version=0, tool_calls=calls,
                          is_final=not calls))
    await env.close()
    return Trajectory(env=env.name, task_id=str(task.get("id")), task=task, group_id="check", prompt_ids=[],
                      prompt_text="", steps=steps, metadata=env.episode_metadata())
