"""Agent-loop control flow, driven by a scripted engine (pure logic: a random model cannot write tool
calls). Token exactness on the real engine is in test_agent_vllm.py."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import numpy as np
import pytest
from scripted_engine import ScriptedEngine

from rollout_workers.agent import AgentLoop, EpisodeSpec, make_group_specs, run_groups
from rollout_workers.chat import tool_call_text
from rollout_workers.environments import (
    EnvironmentRegistration,
    generate_tasks,
    make_env_factory,
    validate_registration,
)
from rollout_workers.environments.calculator import CalculatorEnv
from rollout_workers.environments.http_env import post_json
from rollout_workers.environments.policy import EnvironmentPolicy
from rollout_workers.sampling import SamplingConfig
from rollout_workers.trajectory import TrajectoryStatus

from helper_envs import CooperativeToyEnv, ToyEnv  # isort: skip


def plan_script(ctx: str, turn: int) -> str:
    """The user message is a JSON list: what the 'policy' writes on each turn."""
    user = ctx.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    plan = json.loads(user)
    return plan[turn] if turn < len(plan) else "The answer is 7."


def call(name: str, **args: Any) -> str:
    return tool_call_text(name, args)


def run_plans(plans: list[list[str]], sampling: SamplingConfig | None = None, tokenizer: Any = None,
              env_factory: Any = ToyEnv) -> tuple[list[Any], ScriptedEngine, AgentLoop]:
    engine = ScriptedEngine(tokenizer, plan_script)
    loop = AgentLoop(engine, env_factory, sampling or SamplingConfig(tool_timeout_s=1.0, max_total_tokens=2048), env_name="toy")
    specs = [EpisodeSpec(task={"id": f"t{i}", "question": json.dumps(p)}, group_id=f"g{i}") for i, p in enumerate(plans)]
    try:
        groups = run_groups(loop, [[s] for s in specs])
    finally:
        loop.close()
        engine.close()
    return [g[0] for g in groups], engine, loop


def test_calculator_episodes_share_engine_steps(tokenizer: Any) -> None:
    import re

    def script(ctx: str, turn: int) -> str:
        if turn == 0:
            expr = re.findall(r"What is (.*)\?", ctx)[-1]
            return call("calculator", expression=expr)
        return "The answer is " + re.findall(r"<tool_response>(.*?)</tool_response>", ctx)[-1] + "."

    engine = ScriptedEngine(tokenizer, script, step_delay_s=0.002)
    loop = AgentLoop(engine, make_env_factory("calculator"), SamplingConfig(), env_name="calculator", train_step=3)
    groups = run_groups(loop, make_group_specs(generate_tasks("calculator", 6, seed=0), 4))
    engine.close()
    # one token per live sequence per step: the 48 turns' tokens came out of far fewer, shared steps
    turn_tokens = sum(len(s.action_ids) for g in groups for t in g for s in t.steps)
    assert len(engine.prompts) == 48 and len(engine.step_log) < turn_tokens / 4
    assert max(len(live) for live in engine.step_log) >= 12
    env = CalculatorEnv()
    for group in groups:
        assert len({t.group_id for t in group}) == 1 and len(group) == 4
        for t in group:
            assert t.status == TrajectoryStatus.OK and t.train_step == 3
            assert [s.is_final for s in t.steps] == [False, True]
            assert t.steps[0].tool_calls[0].result == str(t.task["answer"])
            assert env.outcome(t) == 1.0
    stats = loop.stats.snapshot()
    assert stats["trajectories"] == 24 and stats["turns"] == 48 and stats["tool_calls"] == 24
    assert stats["tool_latency_p50_ms"] < 50


def test_errors_are_steps_the_model_sees(tokenizer: Any) -> None:
    plans = [
        ['<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', call("add", a=3, b=4), "The answer is 7."],
        [call("mul", a=1, b=2), "The answer is 7."],
        [call("add", a="x", b=2), "The answer is 7."],
        [call("reject"), "The answer is 7."],
    ]
    trajs, _, loop = run_plans(plans, tokenizer=tokenizer)
    kinds = [t.steps[0].tool_calls[0].error_kind for t in trajs]
    assert kinds == ["format", "unknown_tool", "bad_arguments", "tool_error"]
    for t in trajs:
        assert t.status == TrajectoryStatus.OK
        first = t.steps[0]
        assert first.observation_text.count("<tool_response>Error: ") == 1
        assert first.tool_calls[0].error in first.observation_text
    assert trajs[0].steps[1].tool_calls[0].result == "7"
    stats = loop.stats.snapshot()
    assert stats["tool_errors_format"] == 1 and stats["tool_calls"] == 5
    # only the two calls that reached the environment (the add, and `reject`, which raised) are latency samples
    assert stats["tool_calls_run"] == 2


def test_a_lone_surrogate_in_model_written_code_is_a_tool_result(tokenizer: Any) -> None:
    """JSON tool-call arguments may carry a lone surrogate (`"\\ud800"`), which no UTF-8 holds: the python
    environment's sandbox runs the code with U+FFFD in its place and the episode goes on, never env_error."""
    plans = [[call("run_python", code='print("x\ud800y")'), "The answer is 7."]]
    assert "\\ud800" in plans[0][0]  # the model's text is ASCII; the parsed argument holds the surrogate
    trajs, _, _ = run_plans(plans, tokenizer=tokenizer, env_factory=make_env_factory("python"))
    first = trajs[0].steps[0]
    assert trajs[0].status == TrajectoryStatus.OK, trajs[0].error
    assert first.tool_calls[0].error is None and first.tool_calls[0].result == "x\ufffdy\n"
    assert "x\ufffdy" in first.observation_text


def test_tool_latency_percentiles_come_from_the_calls_that_ran(tokenizer: Any) -> None:
    waits_ms = [20 * (i + 1) for i in range(10)]  # 20 .. 200 ms
    plans = [[call("wait", ms=ms)] for ms in waits_ms] + [['<tool_call>{"name": }</tool_call>']]
    trajs, _, loop = run_plans(plans, tokenizer=tokenizer)
    assert all(t.status == TrajectoryStatus.OK for t in trajs)
    stats = loop.stats.snapshot()
    assert stats["tool_calls"] == 11 and stats["tool_calls_run"] == 10
    # a call takes at least its wait; the slack above it is for a loaded machine
    for q in (50, 90, 99):
        nominal = float(np.percentile(waits_ms, q))
        assert nominal <= stats[f"tool_latency_p{q}_ms"] < nominal + 500, q


def test_hanging_tool_is_timed_out_and_others_continue(tokenizer: Any) -> None:
    plans = [[call("hang")], [call("add", a=1, b=2), call("add", a=3, b=4)], [call("block")], [call("add", a=5, b=6)]]
    t0 = time.monotonic()
    trajs, _, loop = run_plans(plans, SamplingConfig(tool_timeout_s=0.5, max_total_tokens=2048), tokenizer=tokenizer)
    elapsed = time.monotonic() - t0
    hang, ok, block, ok2 = trajs
    for t, tool in ((hang, "hang"), (block, "block")):
        assert t.status == TrajectoryStatus.TOOL_TIMEOUT
        c = t.steps[-1].tool_calls[0]
        assert c.error_kind == "timeout" and tool in (c.error or "")
        assert 0.45 <= c.latency_s < 4.0  # timed out at 0.5 s, with room for a loaded machine
        assert t.steps[-1].observation_ids == []  # nothing inserted after an infrastructure failure
    assert ok.status == ok2.status == TrajectoryStatus.OK
    assert [c.result for s in ok.steps for c in s.tool_calls] == ["3", "7"]
    assert elapsed < 8.0  # the blocked tools loop was replaced instead of stalling everyone for 10 s
    assert loop.tool_runner.retired_loops >= 1
    assert loop.stats.snapshot()["status_tool_timeout"] == 2


def test_a_cooperative_environment_runs_on_the_agent_loop_and_its_hanging_tool_times_out(tokenizer: Any) -> None:
    CooperativeToyEnv.loops.clear()
    plans = [[call("hang")], [call("add", a=1, b=2), call("add", a=3, b=4)], [call("add", a=5, b=6)]]
    trajs, _, _ = run_plans(plans, SamplingConfig(tool_timeout_s=0.5, max_total_tokens=2048), tokenizer=tokenizer,
                            env_factory=CooperativeToyEnv)
    hang, ok, ok2 = trajs
    assert hang.status == TrajectoryStatus.TOOL_TIMEOUT and hang.steps[-1].tool_calls[0].error_kind == "timeout"
    assert ok.status == ok2.status == TrajectoryStatus.OK
    assert [c.result for s in ok.steps for c in s.tool_calls] == ["3", "7"]
    # every call of every episode ran on one event loop, the agent loop's (lanes would use a loop each)
    assert len(CooperativeToyEnv.loops) == 4 and len(set(map(id, CooperativeToyEnv.loops))) == 1


def test_crashing_environment_marks_env_error_only_for_its_episode(tokenizer: Any) -> None:
    plans = [[call("crash")], [call("add", a=1, b=1)]]
    trajs, _, _ = run_plans(plans, tokenizer=tokenizer)
    assert trajs[0].status == TrajectoryStatus.ENV_ERROR and "environment bug" in (trajs[0].error or "")
    assert trajs[0].status.is_infra_failure
    assert trajs[1].status == TrajectoryStatus.OK

    engine = ScriptedEngine(tokenizer, plan_script)
    loop = AgentLoop(engine, ToyEnv, SamplingConfig(max_total_tokens=2048), env_name="toy")
    specs = [EpisodeSpec(task={"id": "a", "question": "[]", "crash_on_reset": True}, group_id="g"),
             EpisodeSpec(task={"id": "b", "question": "[]"}, group_id="g")]
    a, b = run_groups(loop, [specs])[0]
    engine.close()
    assert a.status == TrajectoryStatus.ENV_ERROR and "reset exploded" in (a.error or "") and a.steps == []
    assert b.status == TrajectoryStatus.OK


def test_limits_truncate(tokenizer: Any) -> None:
    many = [call("add", a=1, b=1)] * 10
    (t,), _, _ = run_plans([many], SamplingConfig(max_turns=3, max_total_tokens=2048), tokenizer=tokenizer)
    assert t.status == TrajectoryStatus.TRUNCATED and len(t.steps) == 3 and t.metadata["stop_reason"] == "max_turns"
    assert t.steps[-1].observation_ids == []

    (t,), _, _ = run_plans([many], SamplingConfig(max_turns=20, max_total_tokens=700, max_tokens_per_turn=64), tokenizer=tokenizer)
    assert t.status == TrajectoryStatus.TRUNCATED and t.metadata["stop_reason"] == "max_total_tokens"
    assert 2 <= len(t.steps) < 10 and t.num_tokens <= 700

    # a turn cut off by max_tokens_per_turn is a format error the model sees; the episode goes on
    (t,), _, _ = run_plans([["x " * 50, "The answer is 7."]], SamplingConfig(max_tokens_per_turn=10, max_total_tokens=2048), tokenizer=tokenizer)
    assert t.status == TrajectoryStatus.OK
    assert t.steps[0].finish_reason == "length" and t.steps[0].tool_calls[0].error_kind == "format"
    assert t.steps[0].observation_text.startswith("<|im_end|>\n<|im_start|>tool\n")  # the loop closed the turn


# the tool server listens on 127.0.0.1, which only an operator's allow-list admits (net_guard)
LOCAL_TOOLS = EnvironmentPolicy(http_allow=("127.0.0.1",))


def test_http_environment_end_to_end(tokenizer: Any, tool_server: tuple[str, Any]) -> None:
    url, state = tool_server
    int_pair = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
    seconds = {"type": "object", "properties": {"seconds": {"type": "number"}}}
    reg = validate_registration(
        EnvironmentRegistration(
            kind="http",
            name="remote-toy",
            base_url=url,
            tools=[
                {"name": "add", "description": "a+b", "parameters": int_pair},
                {"name": "slow", "description": "sleeps", "parameters": seconds},
                {"name": "flaky", "description": "503 first", "parameters": {"type": "object"}},
                {"name": "missing", "description": "server lacks it", "parameters": {"type": "object"}},
                {"name": "leaky", "description": "400 with a secret body", "parameters": {"type": "object"}},
            ],
            timeout_s=0.5,
            retries=3,
            backoff_s=0.01,
            concurrency=2,
        ),
        LOCAL_TOOLS,
    )
    state.flaky_failures_left = 2
    plans = [[call("add", a=3, b=4), "The answer is 7."], [call("flaky")], [call("missing")], [call("leaky")]]
    plans += [[call("slow", seconds=0.1)]] * 6
    sampling = SamplingConfig(tool_timeout_s=3.0, max_total_tokens=2048)
    factory = make_env_factory(reg, policy=LOCAL_TOOLS)
    trajs, _, _ = run_plans(plans, sampling, tokenizer=tokenizer, env_factory=factory)
    add, flaky, missing, leaky, *slow = trajs
    assert leaky.status == TrajectoryStatus.ENV_ERROR and "HTTP 400" in (leaky.steps[0].tool_calls[0].error or "")
    assert leaky.steps[0].tool_calls[0].error_kind == "env_error"  # the server's failure, not the model's
    assert "SECRET" not in leaky.model_dump_json()  # the target's error body is not echoed
    assert add.status == TrajectoryStatus.OK and add.steps[0].tool_calls[0].result == "7"
    assert factory().outcome(add) == 1.0  # the server's /outcome verifier
    assert flaky.steps[0].tool_calls[0].result == "ok"  # retried past two 503s
    assert missing.steps[0].tool_calls[0].error_kind == "tool_error"
    assert "no tool missing" in (missing.steps[0].tool_calls[0].error or "")
    assert all(t.status == TrajectoryStatus.OK for t in slow)
    assert state.max_in_flight == 2  # six concurrent slow calls, capped by the registration's limit
    assert any(r["path"] == "/reset" for r in state.requests)  # 404 -> default first message

    (too_slow,), _, _ = run_plans([[call("slow", seconds=10)]], sampling, tokenizer=tokenizer, env_factory=factory)
    assert too_slow.status == TrajectoryStatus.TOOL_TIMEOUT  # the registration's 0.5 s per-request timeout
    assert too_slow.steps[0].tool_calls[0].latency_s < 5.0  # not the 10 s the server takes


def test_http_retries_back_off_exponentially_then_give_up_with_the_cause(tool_server: tuple[str, Any]) -> None:
    url, state = tool_server
    reg = validate_registration(
        EnvironmentRegistration(
            kind="http", name="backoff-toy", base_url=url, retries=3, backoff_s=0.1,
            tools=[{"name": "flaky", "description": "503 first", "parameters": {"type": "object"}}],
        ),
        LOCAL_TOOLS,
    )

    def attempts_at() -> list[float]:
        return [r["received_at"] for r in state.requests if r.get("tool") == "flaky" and r["received_at"] > t0]

    t0 = time.monotonic()
    state.flaky_failures_left = 3
    assert post_json(reg, "call", {"session": None, "tool": "flaky", "arguments": {}}, LOCAL_TOOLS.allow_list) == {"result": "ok"}
    times = attempts_at()
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert len(times) == 4  # three 503s, then the answer
    for gap, delay in zip(gaps, (0.1, 0.2, 0.4), strict=True):  # each wait doubles the last
        assert gap >= delay, gaps

    t0 = time.monotonic()
    state.flaky_failures_left = 10
    with pytest.raises(RuntimeError, match="failed after 4 attempts: .*HTTP 503"):
        post_json(reg, "call", {"session": None, "tool": "flaky", "arguments": {}}, LOCAL_TOOLS.allow_list)
    assert len(attempts_at()) == 4
    state.flaky_failures_left = 0


@pytest.mark.parametrize("bad", [{"max_tokens_per_turn": 600, "max_total_tokens": 512}, {"temperature": -1}])
def test_sampling_config_validation(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SamplingConfig(**bad)


def test_prompt_rendered_once_per_distinct_prompt(tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, lambda ctx, turn: "The answer is 7.")
    loop = AgentLoop(engine, make_env_factory("calculator"), SamplingConfig(), env_name="calculator")
    rendered: list[str] = []
    render = loop.chat.render_prompt
    loop.chat.render_prompt = lambda messages, tools: rendered.append(messages[-1]["content"]) or render(messages, tools)
    tasks = generate_tasks("calculator", 3, seed=0)
    try:
        groups = run_groups(loop, make_group_specs(tasks, 4))
    finally:
        loop.close()
        engine.close()
    assert len(rendered) == 3
    for task, group in zip(tasks, groups, strict=True):
        first = group[0]
        env = CalculatorEnv()
        text, ids = render(asyncio.run(env.reset(task)), env.tools())
        assert first.prompt_text == text and first.prompt_ids == ids
        assert all(t.prompt_ids == ids and t.prompt_ids is not first.prompt_ids for t in group[1:])
