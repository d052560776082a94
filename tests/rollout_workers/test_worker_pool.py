"""Ray rollout workers and the pool, on a real local Ray: a real vLLM worker keeps going past a crashing
environment, takes weight pushes, inserts real tool results and times out a hanging tool; a vLLM worker
killed mid-batch, or a worker whose engine broke, loses no group, and a replacement starts on the latest
weights."""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any

import helper_envs
import pytest
import scripted_engine
import torch

from rollout_workers.engine import EngineConfig
from rollout_workers.pool import RolloutPool
from rollout_workers.sampling import SamplingConfig
from rollout_workers.trajectory import TrajectoryStatus


@pytest.fixture(scope="module")
def by_value(ray_local: Any) -> Any:
    # test-only modules are not installed on the workers: ship them inside the pickles
    ray_local.cloudpickle.register_pickle_by_value(helper_envs)
    ray_local.cloudpickle.register_pickle_by_value(scripted_engine)
    return ray_local


@pytest.fixture(scope="module")
def vllm_pool(by_value: Any, tiny_llama_dir: Path) -> Any:
    pool = RolloutPool(
        EngineConfig(model_dir=str(tiny_llama_dir), max_model_len=1024, kv_cache_gib=0.25),
        helper_envs.ToyEnv,
        num_workers=1,
        num_cpus_per_worker=1,
    )
    yield pool
    pool.shutdown()


SAMPLING = SamplingConfig(max_tokens_per_turn=6, max_turns=2, max_total_tokens=1024, seed=0)


def test_vllm_worker_contains_env_crashes_and_keeps_going(vllm_pool: RolloutPool) -> None:
    tasks = [
        {"id": "a", "question": "[]"},
        {"id": "boom", "question": "[]", "crash_on_reset": True},
        {"id": "c", "question": "[]"},
    ]
    groups = vllm_pool.generate(tasks, n=2, sampling=SAMPLING, train_step=4, job_id="job-1")
    assert [[t.task_id for t in g] for g in groups] == [["a", "a"], ["boom", "boom"], ["c", "c"]]
    assert all(t.status == TrajectoryStatus.ENV_ERROR for t in groups[1])
    for g in (groups[0], groups[2]):
        assert len({t.group_id for t in g}) == 1
        for t in g:
            assert t.status in (TrajectoryStatus.OK, TrajectoryStatus.TRUNCATED)
            assert t.steps and t.steps[0].action_ids and t.job_id == "job-1" and t.train_step == 4
    # the same worker serves the next batch
    again = vllm_pool.generate(tasks[:1], n=3, sampling=SAMPLING)
    assert len(again[0]) == 3 and all(t.steps for t in again[0])
    stats = vllm_pool.stats()
    assert stats["trajectories"] == 9 and stats["status_env_error"] == 2 and stats["failures"] == 2
    assert stats["sampled_tokens"] > 0 and stats["tokens_per_s"] > 0 and stats["turns_per_s"] > 0
    assert stats["worker_restarts"] == 0


def test_weight_push_reaches_the_worker_engine(vllm_pool: RolloutPool, tiny_llama_dir: Path) -> None:
    from safetensors.torch import load_file

    original = load_file(str(tiny_llama_dir / "model.safetensors"))
    zero_head = {**original, "lm_head.weight": torch.zeros_like(original["lm_head.weight"])}
    assert vllm_pool.push_weights(zero_head, version=3) > 0
    (group,) = vllm_pool.generate([{"id": "a", "question": "[]"}], n=2, sampling=SAMPLING)
    assert all(t.weight_versions() == [3] * len(t.steps) for t in group)
    assert vllm_pool.stats()["weight_version"] == 3
    # the worker's engine samples from the pushed weights: a zero head gives every token the same logprob
    uniform = -math.log(original["lm_head.weight"].shape[0])
    assert all(abs(lp - uniform) < 1e-4 for t in group for s in t.steps for lp in s.action_logprobs)

    vllm_pool.push_weights(original, version=4)
    (group,) = vllm_pool.generate([{"id": "a", "question": "[]"}], n=2, sampling=SAMPLING)
    assert all(t.weight_versions() == [4] * len(t.steps) for t in group)
    assert any(abs(lp - uniform) > 0.1 for t in group for s in t.steps for lp in s.action_logprobs)


def test_a_vllm_worker_inserts_real_tool_results_and_times_out_a_hanging_tool(
    by_value: Any, tool_calling_llama_dir: Path, vllm_pool: RolloutPool
) -> None:
    """The tool-calling tiny Llama on a real vLLM worker: every turn calls `probe`. Its answers are inserted
    token-exactly (mask 0); where the tool hangs, the call times out and is recorded, and the rest of the
    batch finishes. (`vllm_pool` is requested so that its CPU is taken before this pool's: Ray has 2.)"""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tool_calling_llama_dir)
    pool = RolloutPool(
        EngineConfig(model_dir=str(tool_calling_llama_dir), max_model_len=1024, kv_cache_gib=0.25),
        helper_envs.ProbeEnv,
        num_workers=1,
        num_cpus_per_worker=0.5,
    )
    try:
        tasks = [{"id": "answers", "question": "call it"}, {"id": "hangs", "question": "call it", "probe": "hang"}]
        sampling = SamplingConfig(max_tokens_per_turn=4, max_turns=2, max_total_tokens=1024, tool_timeout_s=1.0)
        answers, hangs = pool.generate(tasks, n=2, sampling=sampling)
        for t in answers:
            assert t.status == TrajectoryStatus.TRUNCATED and len(t.steps) == 2  # a call on every turn
            for step in t.steps:
                (call,) = step.tool_calls
                assert (call.name, call.arguments, call.result, call.error) == ("probe", {}, "42", None)
            first = t.steps[0]
            assert "<tool_response>42</tool_response>" in first.observation_text
            assert first.observation_ids == tok.encode(first.observation_text, add_special_tokens=False)
            n_act, n_obs = len(first.action_ids), len(first.observation_ids)
            assert t.loss_mask()[: n_act + n_obs] == [1] * n_act + [0] * n_obs
            assert len(t.completion_logprobs()) == len(t.completion_ids())
            assert tok.decode(t.prompt_ids + t.completion_ids()) == t.prompt_text + "".join(
                s.action_text + s.observation_text for s in t.steps
            )
        for t in hangs:
            assert t.status == TrajectoryStatus.TOOL_TIMEOUT and len(t.steps) == 1
            (call,) = t.steps[0].tool_calls
            assert call.error_kind == "timeout" and 1.0 <= call.latency_s < 5.0
        stats = pool.stats()
        assert stats["status_tool_timeout"] == 2 and stats["tool_calls_run"] == 6  # 2 x 2 answers, 2 hangs
    finally:
        pool.shutdown()


def test_killing_a_vllm_worker_mid_batch_loses_no_group(by_value: Any, tool_calling_llama_dir: Path) -> None:
    from safetensors.torch import load_file

    pool = RolloutPool(
        EngineConfig(model_dir=str(tool_calling_llama_dir), max_model_len=1024, kv_cache_gib=0.25),
        helper_envs.ProbeEnv,
        num_workers=1,
        num_cpus_per_worker=0.5,
        groups_per_call=2,
    )
    try:
        pool.push_weights(load_file(str(tool_calling_llama_dir / "model.safetensors")), version=5)
        tasks = [{"id": f"t{i}", "question": "call it", "wait_s": 0.5} for i in range(4)]
        sampling = SamplingConfig(max_tokens_per_turn=4, max_turns=2, max_total_tokens=1024)
        future = pool.submit(tasks, n=2, sampling=sampling)
        deadline = time.monotonic() + 60
        while pool.stats().get("tool_calls", 0) == 0:  # the first chunk's episodes are waiting on their tools
            assert time.monotonic() < deadline
            time.sleep(0.05)
        victim = pool.workers[0]
        by_value.kill(victim, no_restart=True)
        groups = future.result(timeout=300)
        assert [[t.task_id for t in g] for g in groups] == [[f"t{i}"] * 2 for i in range(4)]
        for t in (t for g in groups for t in g):
            assert t.status == TrajectoryStatus.TRUNCATED and [c.result for s in t.steps for c in s.tool_calls] == ["42"] * 2
        assert pool.restarts == 1 and pool.workers[0] is not victim
        # the replacement loaded the latest weights before its first batch
        assert all(t.weight_versions() == [5, 5] for g in groups for t in g), [t.weight_versions() for g in groups for t in g]
    finally:
        pool.shutdown()


def test_a_worker_whose_engine_broke_is_replaced_and_its_groups_rerun(by_value: Any, tokenizer_dir: Path,
                                                                       tmp_path: Path) -> None:
    import functools

    factory = functools.partial(scripted_engine.make_engine_breaking_once, str(tokenizer_dir),
                                str(tmp_path / "broken-once"), 3)
    pool = RolloutPool(factory, helper_envs.ToyEnv, num_workers=1, num_cpus_per_worker=0.5)
    try:
        pool.push_weights({}, version=2)
        tasks = [{"id": f"t{i}", "question": "[]"} for i in range(4)]
        groups = pool.generate(tasks, n=2, sampling=SamplingConfig(max_total_tokens=2048))
        assert [[t.task_id for t in g] for g in groups] == [[f"t{i}"] * 2 for i in range(4)]
        assert all(t.status == TrajectoryStatus.OK for g in groups for t in g)
        assert pool.restarts == 1
        assert all(t.weight_versions() == [2] for g in groups for t in g)
    finally:
        pool.shutdown()


def test_a_hung_worker_is_replaced_after_the_chunk_deadline_and_its_groups_rerun(by_value: Any,
                                                                                  tokenizer_dir: Path) -> None:
    import functools
    import os
    import signal

    factory = functools.partial(scripted_engine.make_answering_engine, str(tokenizer_dir))
    pool = RolloutPool(factory, helper_envs.ToyEnv, num_workers=1, num_cpus_per_worker=0.5, chunk_timeout_s=5.0)
    hung_pid = by_value.get(pool.workers[0].ping.remote())["pid"]
    try:
        os.kill(hung_pid, signal.SIGSTOP)  # alive to Ray, but it will never answer
        tasks = [{"id": f"t{i}", "question": "[]"} for i in range(3)]
        t0 = time.monotonic()
        groups = pool.generate(tasks, n=2, sampling=SamplingConfig(max_total_tokens=2048))
        assert time.monotonic() - t0 >= 5.0
        assert [[t.task_id for t in g] for g in groups] == [[f"t{i}"] * 2 for i in range(3)]
        assert all(t.status == TrajectoryStatus.OK for g in groups for t in g)
        assert pool.stalls == 1 and pool.restarts == 1
        assert by_value.get(pool.workers[0].ping.remote())["pid"] != hung_pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(hung_pid, signal.SIGKILL)
        pool.shutdown()


def test_an_http_environment_in_a_ray_worker_runs_under_the_operator_policy(
    by_value: Any, tokenizer_dir: Path, tool_server: tuple[str, Any]
) -> None:
    """The job hands the operator's policy to its workers: with the allow-list they reach the local tool
    server; without it (the safe default) the same registration is refused at connect time."""
    import functools

    from rollout_workers.environments import EnvironmentRegistration, validate_registration
    from rollout_workers.environments.policy import EnvironmentPolicy

    url, _ = tool_server
    local = EnvironmentPolicy(http_allow=("127.0.0.1",))
    add = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    reg = validate_registration(EnvironmentRegistration(kind="http", name="remote-add", base_url=url, retries=0,
                                                        tools=[{"name": "add", "parameters": add}]), local)
    factory = functools.partial(scripted_engine.make_add_calling_engine, str(tokenizer_dir))
    sampling = SamplingConfig(max_total_tokens=2048)
    results = {}
    for label, policy in (("allowed", local), ("default", None)):
        pool = RolloutPool(factory, reg, num_workers=1, num_cpus_per_worker=0.5, env_policy=policy)
        try:
            (group,) = pool.generate([{"id": "t", "question": "What is 3 + 4?"}], n=1, sampling=sampling)
            results[label] = group[0]
        finally:
            pool.shutdown()
    assert results["allowed"].status == TrajectoryStatus.OK
    assert results["allowed"].steps[0].tool_calls[0].result == "7"
    refused = results["default"]
    assert refused.status == TrajectoryStatus.ENV_ERROR and not refused.steps  # its /reset never left the worker
    assert "target refused: 127.0.0.1 is a loopback address" in (refused.error or ""), refused.error
