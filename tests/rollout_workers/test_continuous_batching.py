"""The continuous-batching scheduler, driven by the scripted engine (one token per live sequence per
step): a turn joins the running batch as soon as its episode's tools return, a weight push lands
between steps with no turn spanning two versions, and failures stay contained."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from scripted_engine import ScriptedEngine, answer_script

from rollout_workers.agent import AgentLoop, EpisodeSpec, run_groups
from rollout_workers.chat import tool_call_text
from rollout_workers.engine import TurnRequest
from rollout_workers.sampling import SamplingConfig

from helper_envs import ToyEnv  # isort: skip
from test_agent_loop import plan_script  # isort: skip

SAMPLING = SamplingConfig(tool_timeout_s=1.0, max_total_tokens=2048, max_tokens_per_turn=256)


def _specs(plans: list[list[str]]) -> list[list[EpisodeSpec]]:
    return [[EpisodeSpec(task={"id": f"t{i}", "question": json.dumps(p)}, group_id=f"g{i}")] for i, p in enumerate(plans)]


def test_a_turn_joins_the_running_batch_when_its_tools_return(tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, plan_script, step_delay_s=0.002)
    loop = AgentLoop(engine, ToyEnv, SAMPLING, env_name="toy")
    long_answer = "The answer is " + "seven " * 60
    plans = [[tool_call_text("add", {"a": 3, "b": 4}), "The answer is 7."], [long_answer]]
    try:
        (short,), (long,) = run_groups(loop, _specs(plans))
    finally:
        loop.close()
        engine.close()
    assert [len(t.steps) for t in (short, long)] == [2, 1]
    assert short.steps[0].tool_calls[0].result == "7"
    second_turn = next(rid for rid, p in engine.prompts.items() if "<tool_response>" in tokenizer.decode(p))
    long_turn = next(rid for rid, p in engine.prompts.items() if "seven" in tokenizer.decode(p))
    # the short episode's second turn ran in the same steps as the long episode's first turn
    assert any(second_turn in live and long_turn in live for live in engine.step_log)
    steps_of_long = [i for i, live in enumerate(engine.step_log) if long_turn in live]
    steps_of_second = [i for i, live in enumerate(engine.step_log) if second_turn in live]
    assert len(steps_of_long) == len(long.steps[0].action_ids)
    assert steps_of_second[-1] < steps_of_long[-1]  # the short episode was done while the long turn ran


def test_weight_push_waits_for_live_turns_and_holds_later_ones(tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, plan_script, step_delay_s=0.003)
    loop = AgentLoop(engine, ToyEnv, SAMPLING, env_name="toy")
    turn = tool_call_text("add", {"a": 1, "b": 2})
    plans = [[turn] * 3 + ["The answer is 7."] for _ in range(6)]
    result: list[Any] = []
    runner = threading.Thread(target=lambda: result.append(run_groups(loop, _specs(plans))))
    runner.start()
    try:
        while len(engine.step_log) < 5:
            time.sleep(0.001)
        steps_at_push = len(engine.step_log)
        engine.load_weights({}, version=1)
        runner.join(timeout=30)
    finally:
        loop.close()
        engine.close()
    trajs = [g[0] for g in result[0]]
    (pushed_after,) = engine.weight_log
    assert pushed_after > steps_at_push  # live turns ran on to their end first
    for i, live in enumerate(engine.step_log):
        assert {engine.versions[rid] for rid in live} == ({0} if i < pushed_after else {1}), i
    for t in trajs:
        versions = t.weight_versions()
        assert len(versions) == 4 and versions == sorted(versions)
    assert any(t.weight_versions()[0] == 0 and t.weight_versions()[-1] == 1 for t in trajs)
    assert engine.weight_version == 1


def test_bad_request_fails_alone_and_close_fails_the_rest(tokenizer: Any) -> None:
    class Picky(ScriptedEngine):
        def _add(self, request_id: str, request: TurnRequest, sampling: SamplingConfig, stop: list[int]) -> None:
            if not request.prompt_ids:
                raise ValueError("prompt_ids: empty")
            super()._add(request_id, request, sampling, stop)

    engine = Picky(tokenizer, answer_script, step_delay_s=0.01)
    ok_ids = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    bad = engine.submit(TurnRequest(prompt_ids=[], max_tokens=4), SAMPLING, [])
    good = engine.submit(TurnRequest(prompt_ids=ok_ids, max_tokens=4), SAMPLING, [])
    with pytest.raises(ValueError, match="prompt_ids"):
        bad.result(timeout=10)
    out = good.result(timeout=10)
    assert out.finish_reason == "length" and len(out.token_ids) == 4 and out.weight_version == 0
    assert engine.call(lambda: 41 + 1) == 42
    counters = engine.counters()
    assert counters.finished_turns == 1 and counters.sampled_tokens == 4 and counters.steps == 4

    slow = engine.submit(TurnRequest(prompt_ids=ok_ids, max_tokens=200), SAMPLING, [])
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        slow.result(timeout=10)
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(TurnRequest(prompt_ids=ok_ids, max_tokens=2), SAMPLING, [])


def test_an_engine_error_reaches_the_caller_of_the_loop(tokenizer: Any) -> None:
    class Broken(ScriptedEngine):
        def _add(self, request_id: str, request: TurnRequest, sampling: SamplingConfig, stop: list[int]) -> None:
            raise RuntimeError("engine refused the request")

    engine = Broken(tokenizer, answer_script)
    loop = AgentLoop(engine, ToyEnv, SAMPLING, env_name="toy")
    try:
        with pytest.raises(RuntimeError, match="engine refused"):
            run_groups(loop, _specs([["The answer is 7."]] * 3))
    finally:
        loop.close()
        engine.close()
