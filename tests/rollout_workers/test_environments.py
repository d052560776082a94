"""Built-in environments: the gold demonstration passes the verifier, a wrong answer does not, the
process components check the steps against the task; the python sandbox's limits hold (its isolation
is attacked in test_sandbox.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rollout_workers.environments import BUILTIN_ENVIRONMENTS, ToolError
from rollout_workers.environments.calculator import evaluate_expression
from rollout_workers.environments.sandbox import SandboxLimits, run_python
from rollout_workers.trajectory import Step, ToolCall, Trajectory


def _replay(env: Any, task: dict[str, Any], messages: list[dict[str, Any]]) -> Trajectory:
    """Run a conversation's tool calls against the environment; build the trajectory it implies."""

    async def run() -> Trajectory:
        await env.reset(task)
        traj = Trajectory(env=env.name, task_id=task["id"], task=task, group_id="g", prompt_ids=[], prompt_text="")
        for m in messages:
            if m["role"] != "assistant":
                continue
            calls = []
            for tc in m.get("tool_calls", []):
                f = tc["function"]
                calls.append(ToolCall(raw="", name=f["name"], arguments=f["arguments"],
                                      result=await env.call(f["name"], f["arguments"])))
            traj.steps.append(Step(action_ids=[], action_logprobs=[], action_text=m["content"] + "<|im_end|>",
                                   weight_version=0, tool_calls=calls, is_final=not calls))
        return traj

    return asyncio.run(run())


@pytest.mark.parametrize("name", sorted(BUILTIN_ENVIRONMENTS))
def test_demonstration_is_verified_and_tool_results_match(name: str) -> None:
    cls = BUILTIN_ENVIRONMENTS[name]
    for task in cls.generate_tasks(4, seed=11):
        env = cls()
        demo = env.demonstration(task)
        traj = _replay(env, task, demo)
        # the tool answers in the demonstration are what the environment really returns
        demo_results = [m["content"] for m in demo if m["role"] == "tool"]
        replay_results = [c.result for s in traj.steps for c in s.tool_calls]
        assert [r.strip() for r in demo_results] == [r.strip() for r in replay_results]
        assert env.outcome(traj) == 1.0
        for i in range(len(traj.steps)):
            comps = env.process(traj, i)
            assert comps and all(v == 1.0 for v in comps.values()), (name, i, comps)
        wrong = traj.model_copy(deep=True)
        wrong.steps[-1].action_text = "The answer is 123456789.<|im_end|>"
        assert env.outcome(wrong) == 0.0
        assert env.process(wrong, len(wrong.steps) - 1) and min(env.process(wrong, len(wrong.steps) - 1).values()) == 0.0


@pytest.mark.parametrize("name", sorted(BUILTIN_ENVIRONMENTS))
def test_a_task_file_line_in_messages_form_works_like_its_question(name: str) -> None:
    """A task uploaded in chat form (`messages`, no `question`; OpenAI's `developer` role) opens the episode
    with its messages, and the environment's tools, demonstration and verifier work on it as on the original."""
    import json

    from rl_service.task_files import TaskFileLimits, check_line

    cls = BUILTIN_ENVIRONMENTS[name]
    for original in cls.generate_tasks(2, seed=5):
        line = {k: v for k, v in original.items() if k != "question"}
        line["messages"] = [{"role": "developer", "content": "Think first."},
                            {"role": "user", "content": original["question"]}]
        task = check_line(json.dumps(line).encode(), 1, TaskFileLimits())
        env = cls()
        opening = asyncio.run(env.reset(task))
        assert opening == [{"role": "system", "content": "Think first."},
                           {"role": "user", "content": original["question"]}]
        demo = env.demonstration(task)
        assert demo[:2] == opening
        assert env.outcome(_replay(env, task, demo)) == 1.0


def test_calculator_tasks_are_short_integer_arithmetic() -> None:
    tasks = BUILTIN_ENVIRONMENTS["calculator"].generate_tasks(50, seed=0)
    for t in tasks:
        assert t["question"] == f"What is {t['expression']}?"
        assert t["answer"] == evaluate_expression(t["expression"]) >= 0
        assert len(t["expression"].split()) == 3
    with pytest.raises(ToolError, match="unsupported"):
        evaluate_expression("__import__('os')")
    with pytest.raises(ToolError, match="division by zero"):
        evaluate_expression("1 // 0")


def test_retrieval_search_finds_the_document_and_bad_ids_are_tool_errors() -> None:
    env = BUILTIN_ENVIRONMENTS["retrieval"]()
    task = env.generate_tasks(1, seed=5)[0]
    listing = asyncio.run(env.call("search", {"query": task["title"]}))
    assert listing.splitlines()[0].startswith(task["doc_id"])
    with pytest.raises(ToolError, match="no document"):
        asyncio.run(env.call("read", {"doc_id": "doc-999999"}))


# ---------------------------------------------------------------- python sandbox

LIMITS = SandboxLimits(cpu_seconds=2, memory_bytes=128 * 1024 * 1024, output_bytes=1000, wall_seconds=2.0)


def test_sandbox_runs_code() -> None:
    r = run_python("print(sum(range(10)))", LIMITS)
    assert (r.stdout, r.exit_code, r.timed_out) == ("45\n", 0, False)


def test_sandbox_memory_cap() -> None:
    r = run_python("x = bytearray(512 * 1024 * 1024)\nprint('ALLOCATED')", LIMITS)
    assert "ALLOCATED" not in r.stdout
    assert "MemoryError" in r.stderr
    # below the cap works
    assert run_python("x = bytearray(16 * 1024 * 1024)\nprint('ok')", LIMITS).stdout == "ok\n"


def test_sandbox_wall_clock_kill_and_output_cap() -> None:
    r = run_python("import time\nprint('start', flush=True)\ntime.sleep(30)", LIMITS)
    assert r.timed_out and r.duration_s < 10 and r.stdout == "start\n"  # killed at 2 s, not after 30
    assert "wall-clock" in r.summary()
    r = run_python("print('x' * 100000)", LIMITS)
    assert r.output_truncated and len(r.stdout) == LIMITS.output_bytes


def test_sandbox_cpu_limit() -> None:
    r = run_python("while True:\n    pass", SandboxLimits(cpu_seconds=1, wall_seconds=20.0))
    assert not r.timed_out and r.exit_code is not None and r.exit_code < 0  # killed by SIGXCPU/SIGKILL
    assert r.duration_s < 15


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_tool_chain_needs_k_dependent_calls(k: int) -> None:
    from rollout_workers.environments.tool_chain import ToolChainEnv, chain_values

    tasks = ToolChainEnv.generate_tasks(30, seed=k, k=k)
    for t in tasks:
        assert len(t["steps"]) == k and t["question"].count("then") == k
        values = chain_values(t)
        assert values[-1] == t["answer"] and min(values) >= 0
        demo = ToolChainEnv().demonstration(t)
        calls = [m["tool_calls"][0]["function"]["arguments"]["expression"] for m in demo if m.get("tool_calls")]
        # each call starts from the previous call's result
        assert [int(c.split()[0]) for c in calls] == values[:-1]
    assert len({t["answer"] for t in tasks}) > 10
    env = ToolChainEnv()
    asyncio.run(env.reset(tasks[0]))
    with pytest.raises(ToolError, match="one operation"):  # the whole chain in one call is refused
        asyncio.run(env.call("calculator", {"expression": "(37 + 5) * 3"}))


def test_tool_builds_a_strict_schema_and_reset_opens_with_the_question() -> None:
    from rollout_workers.environments.base import Environment, check_arguments, tool, validate_tool_schemas

    convert = tool("convert", "Convert units.", {"value": {"type": "integer"}, "unit": {"type": "string"}},
                   required=["value"])
    assert validate_tool_schemas([convert, tool("ping", "No arguments.", {})]) is not None
    assert check_arguments(convert, {"value": 3}) is None
    assert "unit" in str(check_arguments(convert, {"value": 3, "unit": 5}))
    assert "additional" in str(check_arguments(convert, {"value": 3, "extra": 1})).lower()
    assert "required" in str(check_arguments(tool("t", "", {"a": {"type": "string"}}), {})).lower()

    class Minimal(Environment):
        name = "minimal"

        def tools(self) -> list[dict[str, Any]]:
            return [convert]

        async def call(self, tool: str, args: dict[str, Any]) -> str:
            return ""

        def outcome(self, trajectory: Any) -> float:
            return 0.0

    env, task = Minimal(), {"id": "t-0", "question": "How many m are in 3 km?"}
    assert asyncio.run(env.reset(task)) == [{"role": "user", "content": "How many m are in 3 km?"}]
    assert env.task is task
