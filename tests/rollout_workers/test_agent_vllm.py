"""The agent loop on a real vLLM engine (tiny random Llama, CPU): token-exact records, masks, logprobs,
weight pushes into the running engine."""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout_workers.agent import AgentLoop, make_group_specs, run_groups
from rollout_workers.chat import as_template_tools
from rollout_workers.engine import EngineCounters, TurnOutput, TurnRequest
from rollout_workers.environments import generate_tasks, make_env_factory
from rollout_workers.sampling import SamplingConfig
from rollout_workers.trajectory import Trajectory

SAMPLING = SamplingConfig(max_tokens_per_turn=8, max_turns=3, max_total_tokens=600, seed=1)


class RecordingEngine:
    """Delegates to the real engine and remembers exactly what went in and came out."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.log: list[tuple[list[int], TurnOutput]] = []

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def submit(self, request: TurnRequest, sampling: SamplingConfig, stop_token_ids: list[int]) -> Future[TurnOutput]:
        future = self.engine.submit(request, sampling, stop_token_ids)
        prompt = list(request.prompt_ids)
        future.add_done_callback(lambda f: self.log.append((prompt, f.result())))
        return future

    def load_weights(self, state_dict: Any, version: int) -> None:
        self.engine.load_weights(state_dict, version)

    def counters(self) -> EngineCounters:
        return self.engine.counters()


def _run(engine: Any, tasks: list[dict[str, Any]], n: int, sampling: SamplingConfig = SAMPLING) -> list[Trajectory]:
    loop = AgentLoop(engine, make_env_factory("calculator"), sampling, env_name="calculator")
    try:
        return [t for g in run_groups(loop, make_group_specs(tasks, n)) for t in g]
    finally:
        loop.close()


@pytest.fixture(scope="module")
def recorded(vllm_engine: Any) -> tuple[list[Trajectory], RecordingEngine]:
    rec = RecordingEngine(vllm_engine)
    return _run(rec, generate_tasks("calculator", 3, seed=0), n=2), rec


def _rendered_conversation(tokenizer: Any, traj: Trajectory) -> str:
    """The conversation as the chat template renders it, built independently of the loop."""
    env = make_env_factory("calculator")()
    messages = asyncio.run(env.reset(traj.task))
    eos = tokenizer.eos_token
    for step in traj.steps:
        content = step.action_text.removesuffix(eos) if step.action_text.endswith(eos) else step.action_text
        messages.append({"role": "assistant", "content": content})
        if step.observation_ids:
            for c in step.tool_calls:
                messages.append({"role": "tool", "content": c.result if c.error is None else f"Error: {c.error}"})
    tools = as_template_tools(env.tools())
    ends_with_tools = bool(traj.steps and traj.steps[-1].observation_ids)
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=ends_with_tools)
    if traj.steps and not ends_with_tools:
        last = traj.steps[-1]
        # the template closes the last assistant turn; the ids hold only what the policy wrote
        closing = "<|im_end|>\n"
        assert text.endswith(closing)
        text = text[: -len(closing)] + (eos if last.action_text.endswith(eos) else "")
    return text


def test_prompt_and_turn_ids_decode_to_the_rendered_conversation(recorded: Any, tokenizer: Any) -> None:
    trajs, _ = recorded
    assert any(len(t.steps) >= 2 for t in trajs), "need multi-turn episodes"
    for t in trajs:
        env = make_env_factory("calculator")()
        prompt = tokenizer.apply_chat_template(
            asyncio.run(env.reset(t.task)), tools=as_template_tools(env.tools()), tokenize=False, add_generation_prompt=True
        )
        assert t.prompt_text == prompt
        assert t.prompt_ids == tokenizer.encode(prompt, add_special_tokens=False)
        decoded = tokenizer.decode(t.prompt_ids + t.completion_ids(), skip_special_tokens=False)
        assert decoded == _rendered_conversation(tokenizer, t)


def test_sampled_ids_are_never_retokenised(recorded: Any) -> None:
    trajs, rec = recorded
    for t in trajs:
        context = list(t.prompt_ids)
        for step in t.steps:
            # the engine was asked to continue exactly the ids recorded so far, and answered these ids
            assert any(
                prompt == context and out.token_ids == step.action_ids and out.logprobs == step.action_logprobs
                for prompt, out in rec.log
            )
            context += step.action_ids + step.observation_ids


def test_masks_are_zero_exactly_on_inserted_tokens(recorded: Any, tokenizer: Any) -> None:
    trajs, _ = recorded
    inserted_total = 0
    for t in trajs:
        mask, ids, owner = t.loss_mask(), t.completion_ids(), t.step_index()
        assert len(mask) == len(ids) == len(owner) == len(t.completion_logprobs())
        pos = 0
        for i, step in enumerate(t.steps):
            n_act, n_obs = len(step.action_ids), len(step.observation_ids)
            assert mask[pos : pos + n_act] == [1] * n_act
            assert mask[pos + n_act : pos + n_act + n_obs] == [0] * n_obs
            assert ids[pos + n_act : pos + n_act + n_obs] == step.observation_ids
            assert set(owner[pos : pos + n_act + n_obs]) <= {i}
            # inserted ids are the tokenisation of ONLY the inserted template text
            assert step.observation_ids == tokenizer.encode(step.observation_text, add_special_tokens=False)
            if n_obs:
                assert step.observation_text.endswith("<|im_start|>assistant\n")
                assert "<tool_response>" in step.observation_text
            pos += n_act + n_obs
            inserted_total += n_obs
    assert inserted_total > 0


def test_logprobs_for_every_sampled_token_match_the_model(recorded: Any, tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    trajs, _ = recorded
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    for t in trajs:
        for step in t.steps:
            assert len(step.action_logprobs) == len(step.action_ids) > 0
            assert all(math.isfinite(lp) and lp <= 0.0 for lp in step.action_logprobs)
        mask, lps = t.loss_mask(), t.completion_logprobs()
        assert all(lp == 0.0 for lp, m in zip(lps, mask, strict=True) if m == 0)
        # temperature 1: the engine's logprobs are the model's next-token log-probabilities
        full = torch.tensor([t.prompt_ids + t.completion_ids()])
        with torch.no_grad():
            logits = model(full).logits.float()
        ref = torch.log_softmax(logits[0, :-1], dim=-1).gather(1, full[0, 1:, None])[:, 0]
        ref = ref[len(t.prompt_ids) - 1 :]
        got = torch.tensor(lps)
        sel = torch.tensor(mask, dtype=torch.bool)
        assert torch.allclose(got[sel], ref[sel], atol=2e-3, rtol=0), (got[sel] - ref[sel]).abs().max()


def test_weight_push_updates_the_running_engine(vllm_engine: Any, tiny_llama_dir: Path) -> None:
    from safetensors.torch import load_file

    original = load_file(str(tiny_llama_dir / "model.safetensors"))
    tasks = generate_tasks("calculator", 1, seed=7)
    before = _run(vllm_engine, tasks, n=1)[0]
    start_version = vllm_engine.weight_version
    flat = dict(original)
    flat["lm_head.weight"] = torch.zeros_like(original["lm_head.weight"])  # uniform next-token distribution
    try:
        vllm_engine.load_weights(flat, start_version + 1)
        pushed = _run(vllm_engine, tasks, n=1)[0]
        assert pushed.weight_versions() == [start_version + 1] * len(pushed.steps)
        uniform = -math.log(len(vllm_engine.tokenizer))
        assert all(abs(lp - uniform) < 1e-4 for s in pushed.steps for lp in s.action_logprobs)
    finally:
        vllm_engine.load_weights(original, start_version + 2)
    after = _run(vllm_engine, tasks, n=1)[0]
    assert after.completion_ids() == before.completion_ids()  # same seed, same weights: same episode
    assert after.weight_versions() == [start_version + 2] * len(after.steps)


def test_a_later_turn_continues_its_session_as_a_fresh_request_would(vllm_engine: Any, tiny_llama_dir: Path) -> None:
    """keep_turn_state: vLLM holds an episode's request between its turns, and the next turn, which
    prefills only the ids after the previous one, samples (greedy) what a fresh request over the whole
    context samples. end_session frees it. A weight push drops it (its KV came from the old weights),
    so the next turn is computed afresh under the new weights."""
    from safetensors.torch import load_file

    engine = vllm_engine
    greedy = SamplingConfig(max_tokens_per_turn=10, max_total_tokens=600, temperature=0.0)
    gen = torch.Generator().manual_seed(11)
    vocab = len(engine.tokenizer) - 100

    def ids(n: int) -> list[int]:
        return torch.randint(10, vocab, (n,), generator=gen).tolist()

    def turn(prompt: list[int], session: str | None) -> TurnOutput:
        return engine.submit(TurnRequest(prompt, 10, session=session), greedy, []).result(timeout=120)

    def held() -> int:
        return engine.call(engine.llm.llm_engine.get_num_unfinished_requests)

    def assert_same(a: TurnOutput, b: TurnOutput) -> None:
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)

    prompt = ids(70)
    first = turn(prompt, "episode")
    assert len(first.token_ids) == 10
    assert held() == 1  # the session waits for its next turn
    second_prompt = prompt + first.token_ids + ids(9)
    second = turn(second_prompt, "episode")
    assert_same(second, turn(second_prompt, None))
    third_prompt = second_prompt + second.token_ids + ids(5)
    assert_same(turn(third_prompt, "episode"), turn(third_prompt, None))
    engine.end_session("episode")
    assert held() == 0

    original = load_file(str(tiny_llama_dir / "model.safetensors"))
    changed = dict(original)
    name = "model.layers.0.self_attn.v_proj.weight"  # changes every cached value vector
    changed[name] = original[name] * 2.0
    version = engine.weight_version
    first = turn(prompt, "episode-2")
    try:
        engine.load_weights(changed, version + 1)
        assert held() == 0
        second_prompt = prompt + first.token_ids + ids(9)
        assert_same(turn(second_prompt, "episode-2"), turn(second_prompt, None))
    finally:
        engine.end_session("episode-2")
        engine.load_weights(original, version + 2)


def test_min_tokens_holds_a_turn_past_its_stop_ids(vllm_engine: Any) -> None:
    greedy = SamplingConfig(max_tokens_per_turn=10, max_total_tokens=600, temperature=0.0)
    prompt = torch.randint(10, len(vllm_engine.tokenizer) - 100, (40,), generator=torch.Generator().manual_seed(5))

    def turn(stop: list[int], min_tokens: int = 0) -> TurnOutput:
        request = TurnRequest(prompt.tolist(), 10, min_tokens=min_tokens)
        return vllm_engine.submit(request, greedy, stop).result(timeout=120)

    free = turn([])
    stop_id = free.token_ids[2]
    k = free.token_ids.index(stop_id)
    stopped = turn([stop_id])
    assert stopped.token_ids == free.token_ids[: k + 1] and stopped.finish_reason == "stop"
    held = turn([stop_id], min_tokens=10)
    assert len(held.token_ids) == 10 and held.finish_reason == "length"
    assert held.token_ids[:k] == free.token_ids[:k] and stop_id not in held.token_ids


@contextlib.contextmanager
def _engine_held(engine: Any) -> Iterator[None]:
    """Hold the engine thread between two steps while the body submits, then let it go."""
    started, gate = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        gate.wait(timeout=60)

    holder = threading.Thread(target=lambda: engine.call(hold, drain=False))
    holder.start()
    assert started.wait(timeout=60)
    try:
        yield
    finally:
        gate.set()
        holder.join()


def test_seeded_turn_is_the_same_alone_or_joining_a_running_batch(tiny_llama_dir: Path, vllm_env: dict[str, str]) -> None:
    """Continuous batching on the real engine: a seeded turn samples the same tokens whether it runs alone,
    is prefilled in pieces (it arrives with others that take most of a step's token budget), or joins
    a batch mid-decode. The piecewise prefill needs the exact CPU generator rewind."""
    from rollout_workers import vllm_engine as engine_module
    from rollout_workers.engine import EngineConfig
    from rollout_workers.vllm_engine import VLLMEngine

    budget = 256
    engine = VLLMEngine(EngineConfig(model_dir=str(tiny_llama_dir), max_model_len=512, kv_cache_gib=0.1, seed=0,
                                     engine_kwargs={"max_num_batched_tokens": budget}))
    sampling = SamplingConfig(max_tokens_per_turn=24, max_total_tokens=512, temperature=1.0)
    gen = torch.Generator().manual_seed(5)
    vocab = len(engine.tokenizer) - 100

    def prompt(n: int) -> list[int]:
        return torch.randint(10, vocab, (n,), generator=gen).tolist()

    target = TurnRequest(prompt_ids=prompt(150), max_tokens=24, seed=1234)
    try:
        alone = engine.submit(target, sampling, []).result(timeout=120)

        rewinds = engine_module.CPU_GENERATOR_REWINDS
        engine.call(engine.llm.reset_prefix_cache)  # else the cached prompt needs no prefill to split
        with _engine_held(engine):  # all three requests enter the same step
            fillers = [engine.submit(TurnRequest(prompt(100), 24, seed=i), sampling, []) for i in range(2)]
            split_future = engine.submit(target, sampling, [])
        split = split_future.result(timeout=120)  # 200 of 256 tokens taken by the fillers: split prefill
        assert engine_module.CPU_GENERATOR_REWINDS > rewinds
        [f.result(timeout=120) for f in fillers]

        long = [engine.submit(TurnRequest(prompt(40), 300, seed=10 + i), sampling, []) for i in range(4)]
        probe = TurnRequest(prompt(8), 2, seed=99)
        engine.submit(probe, sampling, []).result(timeout=120)  # the long ones are decoding now
        assert not all(f.done() for f in long)
        joined = engine.submit(target, sampling, []).result(timeout=120)
        [f.result(timeout=120) for f in long]
    finally:
        engine.close()
    assert len(alone.token_ids) == 24
    for other in (split, joined):
        assert other.token_ids == alone.token_ids
        assert torch.allclose(torch.tensor(other.logprobs), torch.tensor(alone.logprobs), atol=1e-4, rtol=0)
