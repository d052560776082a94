"""Model-level benchmarks of TaperForCausalLM.

1. Training throughput. CPU: tokens/s of forward+backward of the tiny preset (fp32). CUDA: whole training
   steps (forward + backward + fused AdamW, bf16) side by side: ours eager, per-part compiled
   (`TaperModel.compile_layers`), the whole layer stack compiled, each with the step captured as one CUDA graph
   (modes graph, stack_graph), the dense variant,
   flash-linear-attention's KDA model and a Llama of matching size (SDPA); tokens/s, MFU against the bf16
   matmul rate measured in the same run (6 x active non-embedding params + lm_head per token, plus KDA and
   attention FLOPs), kernels per step and host syncs in forward+backward. fla's first step autotunes its
   kernels for minutes (343 s at 1 x 8K on an H200).
2. Decode memory vs context length: cache bytes per sequence after a prefill of T tokens and the decode
   latency per token, against a same-size standard-attention model (transformers' Llama). KDA layers'
   state is constant in T; only the MLA layers' keys/values grow.
Prints tables and writes JSON. On CUDA it first runs correctness checks (Triton vs torch paths, compiled vs
eager).

    python benchmarks/model.py                   # CPU: the tiny preset
    python benchmarks/model.py --device cuda     # GPU: the small preset, ours vs fla's KDA model and a Llama
    python benchmarks/model.py --device cuda --no-decode --runs taper:graph,llama:eager --shapes 4x8192
    python benchmarks/model.py --quick           # fewer/shorter runs (smoke test)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import platform
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import model.layers.kda as kda_layer  # noqa: E402
from kernels.kda.chunk_torch import chunk_kda_torch  # noqa: E402
from kernels.kda.common import preprocess  # noqa: E402
from model import TaperCache, TaperConfig, TaperForCausalLM  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# ---- KDA backends ----------------------------------------------------------------------------------
def _torch_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, lower_bound=None, A_log=None,
                     dt_bias=None, cu_seqlens=None, chunk_size=64, use_beta_sigmoid_in_kernel=False):
    """kernels.kda.chunk_kda's pure-torch path, forced on any device (the CPU path, for comparison)."""
    qe, ke, ve, ge, be = preprocess(
        q, k, v, g, beta, dtype=torch.float32, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias,
    )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, final = chunk_kda_torch(qe, ke, ve, ge, be, scale, initial_state, cu_seqlens, chunk_size)
    return o.to(q.dtype), (final.float() if output_final_state else None)


@contextlib.contextmanager
def kda_backend(name: str) -> Iterator[None]:
    """'kernels' = kernels.kda.chunk_kda as shipped (Triton on CUDA, torch on CPU); 'torch' = torch path."""
    original = kda_layer.chunk_kda
    if name == "torch":
        kda_layer.chunk_kda = _torch_chunk_kda
    try:
        yield
    finally:
        kda_layer.chunk_kda = original


# ---- helpers ---------------------------------------------------------------------------------------
def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str, warmup: int, iters: int) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def matmul_tflops(device: str, dtype: torch.dtype, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = timed(lambda: a @ b, device, warmup=3, iters=10)
    return 2 * n**3 / seconds / 1e12


def step_flops(config: TaperConfig, batch: int, seq_len: int) -> float:
    """Model FLOPs of one forward+backward: 6 * active non-embedding params (+ lm_head) per token, plus the
    token mixers' sequence work (MLA causal attention; KDA chunked state work, chunk size 64)."""
    counts = config.parameter_counts()
    tokens = batch * seq_len
    dense = 6 * (counts["active"] - counts["embeddings"] + config.vocab_size * config.hidden_size) * tokens
    mla = len(config.full_attn_layers) * 3 * 2 * batch * seq_len**2 * config.num_attention_heads * (
        config.qk_head_dim + config.v_head_dim) / 2
    H, K, V, C = config.kda_num_v_heads, config.kda_head_dim, config.kda_v_head_dim, 64
    kda_per_token = 2 * H * (4 * K * V + C * (K + V))  # state read/write/update + intra-chunk scores
    kda = len(config.kda_layers) * 3 * kda_per_token * tokens
    return dense + mla + kda


# ---- 0. CUDA correctness checks -------------------------------------------------------------------
def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def cuda_checks(preset: str, device: str = "cuda", compile_scopes: tuple[str, ...] = ("parts", "stack")) -> dict:
    """On CUDA: one KDA layer through the Triton kernels vs the torch path, exactly as the model calls it
    (output and every gradient, bf16 and fp32); the grouped-GEMM experts vs the per-expert loop (bf16); the
    whole model (fp32) Triton vs torch and cached decode vs the full forward. Random-init models route
    near-ties, so whole-model comparisons are only meaningful in fp32."""
    from model.layers.moe import LatentExperts

    torch.manual_seed(0)
    config = TaperConfig.preset(preset)
    results: dict = {}

    def run(module: torch.nn.Module, x: torch.Tensor, backend: str, grouped: bool) -> dict[str, torch.Tensor]:
        module.zero_grad(set_to_none=True)
        x = x.detach().requires_grad_(True)
        LatentExperts.use_grouped_mm = grouped
        with kda_backend(backend):
            out = module(x)
            out = out[0] if isinstance(out, tuple) else out
            (out.float() * torch.linspace(-1, 1, out.shape[-1], device=out.device)).sum().backward()
        grads = {"out": out.detach(), "d_input": x.grad}
        grads.update({n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None})
        return grads

    def compare(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict:
        errors = {name: _rel(got[name], ref[name]) for name in ref}
        worst = max(errors, key=errors.get)
        return {"out_rel": errors["out"], "worst": worst, "worst_rel": errors[worst], "tensors": len(errors)}

    from model.layers.kda import KimiDeltaAttention
    from model.layers.moe import StableLatentMoE

    def guarded(name: str, check: Callable[[], object]) -> None:
        try:
            results[name] = check()
        except Exception as exc:  # noqa: BLE001 - record it and run the other checks
            results[name] = {"error": repr(exc)[:400]}

    for dtype in (torch.bfloat16, torch.float32):
        layer = KimiDeltaAttention(config).to(device)
        layer.reset_gate_parameters()
        layer = layer.to(dtype)
        x = torch.randn(2, 1024, config.hidden_size, device=device, dtype=dtype)
        guarded(f"kda_layer_{str(dtype)[6:]}_triton_vs_torch",
                lambda layer=layer, x=x: compare(run(layer, x, "kernels", False), run(layer, x, "torch", False)))
    def attn_res_fused_vs_torch(dtype: torch.dtype) -> dict:
        """The fused AttnRes kernels (CUDA path) against the torch path, 4 candidates [2, 2048, d], random query
        and gamma (the zero init would give uniform weights), output and every gradient."""
        from model.layers.attn_res import BlockAttnRes

        mix = BlockAttnRes(config.hidden_size).to(device=device, dtype=dtype)
        with torch.no_grad():
            mix.query.normal_(0.0, 0.5)
            mix.norm.weight.uniform_(0.5, 1.5)
        cands = [torch.randn(2, 2048, config.hidden_size, device=device, dtype=dtype) * (0.5 + i) for i in range(4)]
        weight = torch.randn_like(cands[0], dtype=torch.float32)
        results = []
        for fused in (True, False):
            BlockAttnRes.use_fused = fused
            leaves = [c.detach().clone().requires_grad_(True) for c in cands]
            mix.zero_grad(set_to_none=True)
            out = mix(leaves)
            (out.float() * weight).sum().backward()
            results.append({"out": out.detach(), **{f"d_cand{i}": c.grad for i, c in enumerate(leaves)},
                            "d_query": mix.query.grad, "d_gamma": mix.norm.weight.grad})
        BlockAttnRes.use_fused = True
        return compare(*results)

    for dtype in (torch.bfloat16, torch.float32):
        guarded(f"attn_res_{str(dtype)[6:]}_fused_vs_torch", lambda dtype=dtype: attn_res_fused_vs_torch(dtype))

    def short_conv_fused_vs_torch(dtype: torch.dtype) -> dict:
        """The KDA layer's short conv + SiLU through the fused Triton op against the torch path, on the pre-conv
        channels sliced from the layer's own input GEMM (as the layer calls it): q, k, v and the gradients of the
        projection output and the three conv weights."""
        layer = KimiDeltaAttention(config).to(device=device, dtype=dtype)
        x = torch.randn(2, 2048, config.hidden_size, device=device, dtype=dtype)
        probes = None
        results = []
        for fused in (True, False):
            KimiDeltaAttention.use_fused_conv = fused
            layer.zero_grad(set_to_none=True)
            wide = torch.nn.functional.linear(x, torch.cat([layer.q_proj.weight, layer.k_proj.weight,
                                                            layer.v_proj.weight, layer.f_a_proj.weight])).detach()
            wide.requires_grad_(True)
            q, k, v, _ = layer.short_conv(wide[..., :layer.conv_channels])
            probes = probes or [torch.randn_like(t, dtype=torch.float32) for t in (q, k, v)]
            sum((t.float() * p).sum() for t, p in zip((q, k, v), probes, strict=True)).backward()
            results.append({"out": torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1).detach(),
                            "d_input": wide.grad, **{f"d_{n}": getattr(layer, n).weight.grad
                                                     for n in ("q_conv1d", "k_conv1d", "v_conv1d")}})
        KimiDeltaAttention.use_fused_conv = True
        return compare(*results)

    for dtype in (torch.bfloat16, torch.float32):
        guarded(f"short_conv_{str(dtype)[6:]}_fused_vs_torch", lambda dtype=dtype: short_conv_fused_vs_torch(dtype))
    moe = StableLatentMoE(config).to(device)
    with torch.no_grad():
        for p in moe.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.05)
    moe = moe.to(torch.bfloat16)
    x = torch.randn(2048, config.hidden_size, device=device, dtype=torch.bfloat16)
    guarded("moe_bf16_grouped_vs_loop", lambda: compare(run(moe, x, "torch", True), run(moe, x, "torch", False)))

    def moe_compiled_vs_eager() -> dict:
        compiled = StableLatentMoE(config).to(device=device, dtype=torch.bfloat16)
        compiled.load_state_dict(moe.state_dict())
        compiled.compile()
        return compare(run(compiled, x, "torch", True), run(moe, x, "torch", True))

    guarded("moe_bf16_compiled_vs_eager", moe_compiled_vs_eager)

    def router_bf16_vs_fp32() -> dict:
        """The router's bf16 GEMM with an fp32 result against the fp32 product of the same bf16 values:
        scores, and the gradients of x and W_r (the bf16 path rounds the logits' gradient to bf16)."""
        router = moe.router
        xr = x.detach().requires_grad_(True)
        got = router.scores(xr)
        weights = torch.randn_like(got)
        got_dx, got_dw = torch.autograd.grad((got * weights).sum(), [xr, router.weight])
        x32 = x.detach().float().requires_grad_(True)
        w32 = router.weight.detach().float().requires_grad_(True)
        ref = torch.sigmoid(x32 @ w32.t())
        ref_dx, ref_dw = torch.autograd.grad((ref * weights).sum(), [x32, w32])
        return {"scores_rel": _rel(got, ref), "dx_rel": _rel(got_dx, ref_dx), "dw_rel": _rel(got_dw, ref_dw)}

    guarded("router_bf16_vs_fp32", router_bf16_vs_fp32)
    LatentExperts.use_grouped_mm = hasattr(torch, "_grouped_mm")

    @torch.no_grad()
    def whole_model(model_config: TaperConfig) -> dict:
        torch.manual_seed(1)
        lm = TaperForCausalLM(model_config).to(device).eval()
        ids = torch.randint(0, model_config.vocab_size, (1, 256), device=device)
        full = lm(ids, use_cache=False).logits
        with kda_backend("torch"):
            triton_vs_torch = _rel(full, lm(ids, use_cache=False).logits)
        cache = TaperCache(model_config)
        prefill = lm(ids[:, :192], past_key_values=cache, use_cache=True).logits
        steps = [lm(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(192, 256)]
        return {"logits_triton_vs_torch_rel": triton_vs_torch,
                "decode_vs_full_rel": _rel(torch.cat([prefill, *steps], 1), full)}

    # Random-init routers score experts nearly alike, so kernel rounding flips top-k choices and the MoE
    # model's logits move far more than the kernels' error; the dense variant (no routed layers) isolates it.
    guarded("model_fp32", lambda: whole_model(config))
    dense = TaperConfig.preset(preset, first_k_dense=config.num_hidden_layers)
    guarded("model_fp32_dense", lambda: whole_model(dense))

    def compiled_vs_eager(model_config: TaperConfig, dtype: torch.dtype, scope: str) -> dict:
        """One training forward+backward of the compiled model (`compile_layers(scope)`) against the same weights
        eager."""
        torch.manual_seed(2)
        eager = TaperForCausalLM(model_config).to(device=device, dtype=dtype).train()
        compiled = TaperForCausalLM(model_config).to(device=device, dtype=dtype).train()
        compiled.load_state_dict(eager.state_dict())
        compiled.model.compile_layers(scope)
        ids = torch.randint(0, model_config.vocab_size, (2, 1024), device=device)
        losses, grads = [], []
        for lm in (eager, compiled):
            loss = lm(ids, labels=ids, use_cache=False).loss
            loss.backward()
            losses.append(loss.detach())
            grads.append({n: p.grad for n, p in lm.named_parameters() if p.grad is not None})
        errors = {n: _rel(grads[1][n], g) for n, g in grads[0].items()}
        worst = max(errors, key=errors.get)
        return {"loss_rel": _rel(losses[1], losses[0]), "worst_grad": worst, "worst_grad_rel": errors[worst],
                "grads": len(errors), "same_grad_set": grads[0].keys() == grads[1].keys()}

    def bf16_vs_fp32(model_config: TaperConfig, scope: str) -> dict:
        """bf16 eager and bf16 compiled (`scope`), each against the fp32 eager model on the same bf16-rounded
        weights: which of the two bf16 paths is closer to the exact computation."""
        torch.manual_seed(2)
        ref = TaperForCausalLM(model_config).to(device=device, dtype=torch.bfloat16).float().train()
        ids = torch.randint(0, model_config.vocab_size, (2, 1024), device=device)

        def loss_and_grads(lm: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss = lm(ids, labels=ids, use_cache=False).loss
            loss.backward()
            return loss.detach(), {n: p.grad for n, p in lm.named_parameters() if p.grad is not None}

        ref_loss, ref_grads = loss_and_grads(ref)
        out = {}
        for name in ("eager", scope):
            lm = TaperForCausalLM(model_config).to(device=device, dtype=torch.bfloat16).train()
            lm.load_state_dict(ref.state_dict())
            if name != "eager":
                lm.model.compile_layers(scope)
            loss, grads = loss_and_grads(lm)
            errors = sorted((_rel(grads[n], g), n) for n, g in ref_grads.items())
            out[name] = {"loss_rel": _rel(loss, ref_loss), "worst_grad": errors[-1][1], "worst_grad_rel": errors[-1][0],
                         "median_grad_rel": errors[len(errors) // 2][0]}
        return out

    # dense: no routed layers, so rounding cannot flip a top-k choice and the difference is the fusion's own
    for scope in compile_scopes:
        suffix = "" if scope == "parts" else f"_{scope}"
        guarded(f"compiled_vs_eager_fp32_dense{suffix}",
                lambda scope=scope: compiled_vs_eager(dense, torch.float32, scope))
        if scope == "parts":
            guarded("compiled_vs_eager_bf16_dense", lambda: compiled_vs_eager(dense, torch.bfloat16, "parts"))
        else:
            guarded(f"bf16_vs_fp32_dense_{scope}", lambda scope=scope: bf16_vs_fp32(dense, scope))
    from kernels.kda.triton_config import DEFAULT_CONFIG

    results["kda_fp32_dot_precision"] = DEFAULT_CONFIG.fp32_dot_precision
    return results


def attn_res_sweep(hidden: int, tokens: int = 32768, candidates: int = 4) -> dict:
    """The fused AttnRes kernels' launch shapes (tokens per program, warps) at the model's width: forward and
    backward ms each (bf16, `candidates` inputs of [tokens, hidden]); sets the fastest of each in
    kernels.attn_res and returns every timing."""
    import triton

    import kernels.attn_res as ar

    cands = [torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(candidates)]
    gamma = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    query = torch.randn(hidden, device="cuda", dtype=torch.bfloat16) * 0.05
    grad = torch.randn_like(cands[0])
    launches = [(bt, w) for bt in (8, 16, 32) for w in (2, 4, 8)]
    out: dict = {"fwd": {}, "bwd": {}}
    for launch in launches:
        ar.FWD_LAUNCH = ar.BWD_LAUNCH = launch
        name = f"{launch[0]}x{launch[1]}"
        try:
            out["fwd"][name] = triton.testing.do_bench(lambda: ar.attn_res_mix_op(cands, gamma, query, 1e-6), return_mode="median")
            out["bwd"][name] = triton.testing.do_bench(
                lambda tokens=launch[0]: ar.attn_res_mix_bwd_op(grad, cands, gamma, query, 1e-6, tokens), return_mode="median")
        except Exception as exc:  # noqa: BLE001 - e.g. out of resources; the others still run
            out["fwd"].setdefault(name, repr(exc)[:200])
    best = {part: min((v, k) for k, v in out[part].items() if isinstance(v, float))[1] for part in ("fwd", "bwd")}
    ar.FWD_LAUNCH, ar.BWD_LAUNCH = (tuple(int(n) for n in best[part].split("x")) for part in ("fwd", "bwd"))
    out["chosen"] = best
    return out


def conv_sweep(config: TaperConfig, batch: int = 4, seq_len: int = 8192) -> dict:
    """The fused short conv (kernels/short_conv.py) at the KDA layer's shape: its input a column slice of the
    layer's input GEMM output (bf16 [batch, seq_len, C + 256]). Times the forward and backward kernels for each
    launch shape and sets the fastest; then forward and forward+backward of the op (autograd, the weight gradient
    finished) against the torch path compiled (conv + SiLU + split, as the model compiled it before); and the op's
    errors against an fp64 reference at [2, 2048] (fp32 and bf16 inputs)."""
    import triton

    import kernels.short_conv as sc

    H, HV, K, V = config.kda_num_heads, config.kda_num_v_heads, config.kda_head_dim, config.kda_v_head_dim
    split = [H * K, H * K, HV * V]
    C, W = sum(split), config.kda_conv_size
    wide = torch.randn(batch, seq_len, C + 256, device="cuda", dtype=torch.bfloat16)
    x = wide[..., :C]
    weight = (torch.randn(C, 1, W, device="cuda") * 0.5).to(torch.bfloat16)
    grads = [torch.randn(batch, seq_len, n, device="cuda", dtype=torch.bfloat16) for n in split]
    out: dict = {"shape": [batch, seq_len, C], "fwd": {}, "bwd": {}}
    bench = functools.partial(triton.testing.do_bench, return_mode="median")
    for launch in [(32, 64, 4), (16, 128, 4), (64, 64, 8), (32, 128, 4), (64, 128, 8)]:
        sc.FWD_LAUNCH = launch
        out["fwd"]["x".join(map(str, launch))] = bench(lambda: sc.short_conv_silu_op(x, weight, split))
    for launch in [(16, 64, 2), (32, 64, 2), (16, 64, 1), (8, 64, 2), (16, 32, 2), (32, 64, 4)]:
        for tokens in (128, 256, 512):
            sc.BWD_LAUNCH, sc.BWD_TOKENS = launch, tokens
            name = "x".join(map(str, launch)) + f"_t{tokens}"
            try:
                out["bwd"][name] = bench(lambda tokens=tokens: sc.short_conv_silu_bwd_op(x, weight, grads, tokens))
            except Exception as exc:  # noqa: BLE001 - e.g. out of resources; the others still run
                out["bwd"][name] = repr(exc)[:200]
    best_fwd = min((v, k) for k, v in out["fwd"].items())[1]
    best_bwd = min((v, k) for k, v in out["bwd"].items() if isinstance(v, float))[1]
    sc.FWD_LAUNCH = tuple(int(n) for n in best_fwd.split("x"))
    shape, tokens = best_bwd.split("_t")
    sc.BWD_LAUNCH, sc.BWD_TOKENS = tuple(int(n) for n in shape.split("x")), int(tokens)
    out["chosen"] = {"fwd": best_fwd, "bwd": best_bwd}
    moved = batch * seq_len * C * 2
    out["fwd_tb_per_s"] = 2 * moved / out["fwd"][best_fwd] / 1e9
    out["bwd_tb_per_s"] = 3 * moved / out["bwd"][best_bwd] / 1e9

    def torch_path(x, weight):
        y, _ = kda_layer.causal_conv1d(x, weight)
        return [t.contiguous() for t in torch.nn.functional.silu(y).to(x.dtype).split(split, dim=-1)]

    compiled = torch.compile(torch_path)
    leaf_w = weight.clone().requires_grad_(True)
    leaf_wide = wide.clone().requires_grad_(True)
    for name, fn in (("fused", sc.short_conv_silu), ("torch_compiled", compiled)):
        if name == "fused":
            fn = functools.partial(fn, split=split)  # noqa: PLW2901
        out[f"{name}_fwd_ms"] = bench(lambda fn=fn: fn(x, weight))
        out[f"{name}_fwd_bwd_ms"] = bench(lambda fn=fn: torch.autograd.grad(
            fn(leaf_wide[..., :C], leaf_w), [leaf_wide, leaf_w], grads))

    def errors(dtype: torch.dtype) -> dict:
        xs = torch.randn(2, 2048, C, device="cuda").to(dtype).requires_grad_(True)
        ws = (torch.randn(C, 1, W, device="cuda") * 0.5).to(dtype).requires_grad_(True)
        probes = [torch.randn(2, 2048, n, device="cuda") for n in split]
        got = sc.short_conv_silu(xs, ws, split)
        got_grads = torch.autograd.grad(sum((o.float() * p).sum() for o, p in zip(got, probes, strict=True)), [xs, ws])
        xr, wr = xs.detach().double().requires_grad_(True), ws.detach().double().requires_grad_(True)
        y = torch.nn.functional.conv1d(torch.nn.functional.pad(xr.transpose(1, 2), (W - 1, 0)), wr, groups=C)
        ref = torch.nn.functional.silu(y).transpose(1, 2)
        want = torch.autograd.grad((ref * torch.cat(probes, -1).double()).sum(), [xr, wr])
        return {"out": _rel(torch.cat(got, -1), ref), "dx": _rel(got_grads[0], want[0]),
                "dw": _rel(got_grads[1], want[1])}

    out["errors_vs_fp64"] = {str(dtype)[6:]: errors(dtype) for dtype in (torch.float32, torch.bfloat16)}
    return out


# ---- 1. training throughput ------------------------------------------------------------------------
def train_throughput(preset: str, device: str, dtype: torch.dtype, batch: int, seq_len: int, backend: str,
                     iters: int) -> dict:
    torch.manual_seed(0)
    config = TaperConfig.preset(preset)
    lm = TaperForCausalLM(config).to(device=device, dtype=dtype).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq_len), device=device)

    def step() -> None:
        lm.zero_grad(set_to_none=True)
        out = lm(ids, labels=ids, use_cache=False)
        out.loss.backward()
        for moe in lm.model.moe_layers():
            moe.clear_recorded_scores()

    with kda_backend(backend):
        seconds = timed(step, device, warmup=2, iters=iters)
    result = {"preset": preset, "device": device, "dtype": str(dtype).removeprefix("torch."), "batch": batch,
              "seq_len": seq_len, "kda_backend": backend, "step_s": seconds,
              "tokens_per_s": batch * seq_len / seconds, "model_tflop_per_step": step_flops(config, batch, seq_len) / 1e12}
    return result


# ---- 1b. CUDA: whole training steps of ours and the references, side by side -----------------------
# Each row: forward + backward + fused AdamW (+ the MoE balancing update for ours) on random tokens, bf16
# weights. MFU counts 6 x (active non-embedding parameters + lm_head) per token plus the token mixers'
# sequence work, over the bf16 matmul rate measured in the same run.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def _llama_with_params(config: TaperConfig, target: int):
    """A transformers Llama (SDPA) of our width, depth and heads, its MLP sized to `target` non-embedding
    parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d, L = config.hidden_size, config.num_hidden_layers
    intermediate = max(64, int((target - L * (4 * d * d + 2 * d)) / (3 * d * L)) // 64 * 64)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=d, num_hidden_layers=L, intermediate_size=intermediate,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_attention_heads,
        head_dim=d // config.num_attention_heads, max_position_embeddings=1 << 20, tie_word_embeddings=False,
        attn_implementation="sdpa",
    ))


def _fla_kda_model(config: TaperConfig):
    """flash-linear-attention's own KDA model (reference only) at our width, depth and KDA heads: every layer
    KDA (bounded gate, lower bound -5), dense SwiGLU MLP of our dense width, AttnRes over blocks of our size."""
    from fla.models import KDAConfig, KDAForCausalLM

    return KDAForCausalLM(KDAConfig(
        hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers, num_heads=config.kda_num_heads,
        head_dim=config.kda_head_dim, intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
        safe_gate=True, lower_bound=config.gate_lower_bound, conv_size=config.kda_conv_size,
        attnres_block_size=2 * config.attn_res_block_size, tie_word_embeddings=False,
    ))


def _non_embedding_params(model: torch.nn.Module) -> int:
    embed = model.get_input_embeddings().weight
    return sum(p.numel() for p in model.parameters() if p is not embed)


def reference_flops(params_with_head: int, batch: int, seq_len: int, attn_layers: int, attn_width: int,
                    kda_layers: int, kda_heads: int, kda_dim: int) -> float:
    """The same FLOP count as `step_flops` for a model described by its parameter count and mixers."""
    tokens = batch * seq_len
    attn = attn_layers * 3 * 2 * batch * seq_len**2 * attn_width / 2
    kda = kda_layers * 3 * 2 * kda_heads * (4 * kda_dim * kda_dim + 64 * 2 * kda_dim) * tokens
    return 6 * params_with_head * tokens + attn + kda


def build_model(name: str, preset: str, batch: int, seq_len: int) -> tuple[torch.nn.Module, int, float]:
    """(model on CUDA in bf16, active parameters without embeddings (with lm_head), FLOPs per step)."""
    config = TaperConfig.preset(preset)
    if name in ("taper", "taper_dense"):
        cfg = config if name == "taper" else TaperConfig.preset(preset, first_k_dense=config.num_hidden_layers)
        model = TaperForCausalLM(cfg)
        counts = cfg.parameter_counts()
        active = counts["active"] - counts["embeddings"] + cfg.vocab_size * cfg.hidden_size
        flops = step_flops(cfg, batch, seq_len)
    elif name == "fla_kda":
        model = _fla_kda_model(config)
        active = _non_embedding_params(model)
        flops = reference_flops(active, batch, seq_len, 0, 0, config.num_hidden_layers, config.kda_num_heads,
                                config.kda_head_dim)
    elif name == "llama":
        dense = TaperConfig.preset(preset, first_k_dense=config.num_hidden_layers).parameter_counts()
        model = _llama_with_params(config, dense["active"] - dense["embeddings"])
        active = _non_embedding_params(model)
        d = config.hidden_size
        flops = reference_flops(active, batch, seq_len, config.num_hidden_layers, 2 * d, 0, 0, 0)
    else:
        raise ValueError(f"unknown model {name!r}")
    return model.to(device="cuda", dtype=torch.bfloat16).train(), active, flops


def _count_profile(step: Callable[[], None], table_path: Path | None) -> dict:
    """Kernels (GPU-side ops: kernels, copies, memsets) and host-synchronising runtime calls in one step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.events()
    gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    syncs = {name: sum(1 for e in events if e.name == name) for name in SYNC_CALLS}
    if table_path is not None:
        table_path.write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=45))
        names: dict[str, list[float]] = {}
        for e in gpu:
            entry = names.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += getattr(e, "device_time_total", 0.0) / 1e3
        lines = [f"{n:6d} {ms:9.3f} ms  {name[:160]}" for name, (n, ms) in sorted(names.items(), key=lambda i: -i[1][0])]
        table_path.with_name(table_path.name.replace("profile_", "kernels_")).write_text(
            "count  GPU time  kernel (one step)\n" + "\n".join(lines) + "\n")
    return {"gpu_ops_per_step": len(gpu),
            "kernels_per_step": sum(1 for e in gpu if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()),
            "d2h_copies_per_step": sum(1 for e in gpu if "DtoH" in e.name),
            "sync_calls_per_step": {k: v for k, v in syncs.items() if v}}


def _trace_kernels(step: Callable[[], None], path: Path) -> None:
    """Which host op launched each kernel of one (non-graphed) step: kernels grouped by name and the nearest
    aten op above them with its input shapes, and the Python frame that called it (the compiled graph's own
    code shows as its generated file). Written to `path`, largest counts first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_stack=True) as prof:
        step()
        torch.cuda.synchronize()
    groups: dict[tuple[str, str, str, str], int] = {}
    for e in prof.events():  # CPU ops carry the kernels launched inside them (the innermost op's list)
        kernels = [k.name for k in getattr(e, "kernels", []) if "memcpy" not in k.name.lower()
                   and "memset" not in k.name.lower()]
        if e.device_type != torch.autograd.DeviceType.CPU or not kernels:
            continue
        op, shapes, frame, node = e.name, str(e.input_shapes)[:120], "", e
        while node is not None:  # the outermost aten / custom op above it, and the Python frame calling that
            if node.name.startswith(("aten::", "taper::")):
                op, shapes = node.name, str(node.input_shapes)[:120]
                frames = [f for f in (node.stack or []) if "torch/" not in f and "contextlib" not in f]
                frame = frames[0] if frames else frame
            elif node.name.startswith("autograd::engine::evaluate_function: ") and not frame:
                frame = node.name.removeprefix("autograd::engine::evaluate_function: ")
            elif node.name.startswith(("CompiledFunction", "## Call CompiledFxGraph")) and not frame:
                frame = node.name
            node = node.cpu_parent
        for name in kernels:
            key = (name[:70], op, shapes, frame[-100:])
            groups[key] = groups.get(key, 0) + 1
    lines = [f"{n:5d}  {k[0]}  <- {k[1]} {k[2]}  @ {k[3]}" for k, n in sorted(groups.items(), key=lambda i: -i[1])]
    path.write_text("count  kernel  <- outermost aten op, input shapes  @ caller\n" + "\n".join(lines) + "\n")


def _sync_debug_count(fn: Callable[[], None]) -> int:
    """Synchronising CUDA calls torch flags (torch.cuda.set_sync_debug_mode) while fn runs."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum(1 for w in caught if "synchroniz" in str(w.message).lower())


def train_step_cuda(name: str, preset: str, batch: int, seq_len: int, mode: str, iters: int,
                    profile_dir: Path | None, trace_kernels: bool = False) -> dict:
    """mode: "eager"; "compiled" (ours: per-part torch.compile); "graph" (compiled, and the whole step, forward
    + backward + AdamW + balancing update, captured once as a CUDA graph and replayed: what a learner with a
    fixed batch shape can do once the step has no host syncs); "stack" and "stack_graph": the same with the
    whole layer stack compiled as one graph (`compile_layers("stack")`)."""
    torch.manual_seed(0)
    model, active, flops = build_model(name, preset, batch, seq_len)
    if mode != "eager":
        model.model.compile_layers("stack" if mode.startswith("stack") else "parts")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=mode.endswith("graph"))
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq_len), device="cuda")
    moe = model.model.moe_layers() if hasattr(model.model, "moe_layers") else []
    from model.layers.moe import update_balancing

    def forward_backward() -> None:
        out = model(ids, labels=ids, use_cache=False)
        out.loss.backward()

    def update() -> None:
        forward_backward()
        opt.step()
        update_balancing(moe)  # every MoE layer at once: one sort, one multi-tensor bias update

    def step() -> None:
        update()
        opt.zero_grad(set_to_none=True)

    start = time.perf_counter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture wants
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - start
    syncs = _sync_debug_count(forward_backward)
    opt.zero_grad(set_to_none=True)
    for layer in moe:
        layer.clear_recorded_scores()
    if trace_kernels and profile_dir is not None:
        step()
        _trace_kernels(step, profile_dir / f"trace_{name}_{mode}_{batch}x{seq_len}.txt")
    if mode in ("graph", "stack_graph"):
        with torch.cuda.stream(side):
            step()
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            update()
        step = graph.replay  # noqa: F811 - the replay is the step from here on
    seconds = timed(step, "cuda", warmup=2, iters=iters)
    tag = f"{name}_{mode}_{batch}x{seq_len}"
    counts = _count_profile(step, profile_dir / f"profile_{tag}.txt" if profile_dir else None)
    row = {"model": name, "mode": mode, "batch": batch, "seq_len": seq_len, "step_s": seconds,
           "first_step_s": first_s, "tokens_per_s": batch * seq_len / seconds, "active_params": active,
           "model_tflop_per_step": flops / 1e12, "fwd_bwd_sync_warnings": syncs, **counts,
           "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}
    row["tokens_per_s_per_active_param"] = row["tokens_per_s"] / active
    return row


# ---- 2. decode memory vs context -------------------------------------------------------------------
def same_size_llama(config: TaperConfig):
    """A transformers Llama with the same width, depth, attention heads and vocab, its MLP width chosen so the
    total parameter count matches ours."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d, L = config.hidden_size, config.num_hidden_layers
    target = config.parameter_counts()["total"]
    fixed = 2 * config.vocab_size * d + L * (4 * d * d + 2 * d) + d
    intermediate = max(64, int((target - fixed) / (3 * d * L)))
    llama_config = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=d, num_hidden_layers=L, intermediate_size=intermediate,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_attention_heads,
        head_dim=d // config.num_attention_heads, max_position_embeddings=1 << 20, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(llama_config)


def cache_bytes(cache) -> int:
    if isinstance(cache, TaperCache):
        return cache.state_bytes()
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


@torch.no_grad()
def decode_profile(model, device: str, context: int, new_tokens: int, make_cache: Callable[[], object]) -> dict:
    ids = torch.randint(3, model.config.vocab_size, (1, context), device=device)
    cache = make_cache()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    sync(device)
    prefill_s = time.perf_counter() - start
    cache = out.past_key_values
    token = out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(new_tokens):
        start = time.perf_counter()
        out = model(token, past_key_values=cache, use_cache=True)
        sync(device)
        times.append(time.perf_counter() - start)
        token = out.logits[:, -1:].argmax(-1)
    result = {"context": context, "cache_bytes": cache_bytes(cache), "prefill_s": prefill_s,
              "decode_ms_per_token": 1e3 * sorted(times)[len(times) // 2]}
    if device == "cuda":
        result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return result


def decode_memory(preset: str, device: str, dtype: torch.dtype, contexts: list[int], new_tokens: int) -> dict:
    from transformers import DynamicCache

    torch.manual_seed(0)
    config = TaperConfig.preset(preset)
    ours = TaperForCausalLM(config).to(device=device, dtype=dtype).eval()
    llama = same_size_llama(config).to(device=device, dtype=dtype).eval()
    rows = []
    for context in contexts:
        rows.append({
            "taper": decode_profile(ours, device, context, new_tokens, lambda: TaperCache(config)),
            "llama": decode_profile(llama, device, context, new_tokens, lambda: DynamicCache(config=llama.config)),
        })
    return {"preset": preset, "device": device, "dtype": str(dtype).removeprefix("torch."),
            "taper_params": sum(p.numel() for p in ours.parameters()),
            "llama_params": sum(p.numel() for p in llama.parameters()), "rows": rows}


# ---- main ------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--preset", default=None, help="default: tiny on cpu, small on cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--checks-only", action="store_true", help="CUDA: run the correctness checks only")
    parser.add_argument("--no-checks", action="store_true", help="CUDA: skip the correctness checks")
    parser.add_argument("--compile-checks", default="parts,stack",
                        help="CUDA: compile_layers scopes checked against eager (each compiles the dense model; "
                             "'' for none)")
    parser.add_argument("--runs", default="taper:eager,taper:compiled,taper:graph,taper_dense:graph,llama:eager,"
                                          "fla_kda:eager",
                        help="CUDA: model:mode pairs (models taper, taper_dense, fla_kda, llama; modes eager, "
                             "compiled = per-part torch.compile, graph = compiled + the step as one CUDA graph, "
                             "stack / stack_graph = the same with the whole layer stack as one compiled graph; "
                             "all but eager for ours only)")
    parser.add_argument("--shapes", default="1x8192,4x8192", help="CUDA: batch x sequence length list")
    parser.add_argument("--profile-dir", type=Path, default=None, help="CUDA: write one profiled step's table per run")
    parser.add_argument("--no-decode", action="store_true", help="CUDA: skip the decode-memory part")
    parser.add_argument("--attn-res", default="fused", choices=["fused", "torch"],
                        help="CUDA training rows: the fused AttnRes kernels or the torch path")
    parser.add_argument("--attn-res-sweep", action="store_true",
                        help="CUDA: time the fused AttnRes kernels' launch shapes first and use the fastest")
    parser.add_argument("--conv", default="fused", choices=["fused", "torch"],
                        help="CUDA training rows: the KDA short conv as the fused Triton op or the torch path")
    parser.add_argument("--conv-sweep", action="store_true",
                        help="CUDA: time the fused short conv's launch shapes first (and against the compiled torch "
                             "path), check it against fp64, and use the fastest")
    parser.add_argument("--trace-kernels", action="store_true",
                        help="CUDA: with --profile-dir, also write which host op launched each kernel of one step")
    parser.add_argument("--fla-autotune-ms", type=int, nargs=2, metavar=("WARMUP", "REP"), default=None,
                        help="time each of fla's autotune candidates for this long (Triton's default: 25 100)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    cuda = device == "cuda"
    preset = args.preset or ("small" if cuda else "tiny")
    dtype = torch.bfloat16 if cuda else torch.float32
    from benchmarks.machine import machine_info

    report: dict = {"machine": platform.node(), "machine_info": machine_info(), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if cuda else None, "cpu_threads": torch.get_num_threads()}

    if cuda:
        if not args.no_checks:
            report["checks"] = cuda_checks(preset, compile_scopes=tuple(filter(None, args.compile_checks.split(","))))
            print(json.dumps(report["checks"], indent=2))
        if args.checks_only:
            return
        report["bf16_matmul_tflops"] = matmul_tflops(device, torch.bfloat16)
        if args.fla_autotune_ms:  # Triton's autotuner times each candidate with do_bench; ours use fixed configs
            import triton.testing

            triton.testing.do_bench = functools.partial(triton.testing.do_bench, warmup=args.fla_autotune_ms[0],
                                                        rep=args.fla_autotune_ms[1])
            report["fla_autotune_ms"] = args.fla_autotune_ms
        from model.layers.attn_res import BlockAttnRes

        BlockAttnRes.use_fused = args.attn_res == "fused"
        report["attn_res"] = args.attn_res
        kda_layer.KimiDeltaAttention.use_fused_conv = args.conv == "fused"
        report["conv"] = args.conv
        if args.conv_sweep:
            try:
                report["conv_sweep"] = conv_sweep(TaperConfig.preset(preset))
            except Exception as exc:  # noqa: BLE001 - the training rows still run (with the default launch shapes)
                report["conv_sweep"] = {"error": repr(exc)[:400]}
            print(json.dumps(report["conv_sweep"]), flush=True)
        if args.attn_res_sweep:
            report["attn_res_sweep"] = attn_res_sweep(TaperConfig.preset(preset).hidden_size)
            print(json.dumps(report["attn_res_sweep"]), flush=True)
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
        train = []
        for batch, seq_len in shapes:
            for run in filter(None, args.runs.split(",")):
                name, mode = run.split(":")
                try:
                    train.append(train_step_cuda(name, preset, batch, seq_len, mode, 3 if args.quick else 8,
                                                 args.profile_dir, args.trace_kernels))
                except Exception as exc:  # noqa: BLE001 - keep measuring the other settings
                    train.append({"model": name, "mode": mode, "batch": batch, "seq_len": seq_len,
                                  "error": repr(exc)[:400]})
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                if "step_s" in train[-1]:
                    train[-1]["mfu"] = train[-1]["model_tflop_per_step"] / train[-1]["step_s"] / \
                        report["bf16_matmul_tflops"]
                print(json.dumps(train[-1]), flush=True)
                report["train_step"] = train
                _write(report, args.out or RESULTS_DIR / "model_cuda.json")
        report["train_step"] = train
        _write(report, args.out or RESULTS_DIR / "model_cuda.json")
        print_train_table(train, preset, report["bf16_matmul_tflops"])
        if args.no_decode:
            return
    else:
        shapes = [(1, 256)] if args.quick else [(1, 512), (4, 512)]
        train = [train_throughput(preset, device, dtype, batch, seq_len, "kernels", 3 if args.quick else 5)
                 for batch, seq_len in shapes]  # on CPU chunk_kda is the torch path
        report["train"] = train
        print(f"\n== training step (forward+backward), {preset}, {device} ==")
        print(f"{'batch':>5} {'T':>6} {'step ms':>9} {'tokens/s':>10}")
        for row in train:
            print(f"{row['batch']:>5} {row['seq_len']:>6} {1e3 * row['step_s']:>9.1f} {row['tokens_per_s']:>10.0f}")

    contexts = ([256, 1024] if args.quick else [256, 1024, 4096]) if not cuda else (
        [1024, 4096] if args.quick else [1024, 4096, 16384, 32768])
    memory = decode_memory(preset, device, dtype, contexts, new_tokens=4 if args.quick else 16)
    report["decode"] = memory
    print(f"\n== decode cache vs context, batch 1, {preset} ({memory['taper_params'] / 1e6:.1f}M) vs Llama "
          f"({memory['llama_params'] / 1e6:.1f}M), {device} ==")
    print(f"{'context':>8} {'taper KiB':>10} {'llama KiB':>10} {'ratio':>6} {'taper ms/tok':>13} {'llama ms/tok':>13}")
    for row in memory["rows"]:
        t, ll = row["taper"], row["llama"]
        print(f"{t['context']:>8} {t['cache_bytes'] / 1024:>10.1f} {ll['cache_bytes'] / 1024:>10.1f} "
              f"{t['cache_bytes'] / ll['cache_bytes']:>6.2f} {t['decode_ms_per_token']:>13.2f} "
              f"{ll['decode_ms_per_token']:>13.2f}")

    _write(report, args.out or RESULTS_DIR / f"model_{device}.json")


def _write(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}")


def print_train_table(train: list[dict], preset: str, matmul: float) -> None:
    print(f"\n== training step (forward + backward + fused AdamW), bf16, preset {preset}; bf16 matmul {matmul:.0f} "
          "TFLOP/s ==")
    print(f"{'model':>12} {'mode':>8} {'B x T':>8} {'step ms':>8} {'tokens/s':>9} {'MFU':>6} {'active M':>8} "
          f"{'tok/s/param':>11} {'kernels':>7} {'syncs':>5}")
    for row in train:
        mode = row["mode"]
        shape = f"{row['batch']}x{row['seq_len']}"
        if "error" in row:
            print(f"{row['model']:>12} {mode:>8} {shape:>8}  error: {row['error'][:150]}")
            continue
        print(f"{row['model']:>12} {mode:>8} {shape:>8} {1e3 * row['step_s']:>8.1f} {row['tokens_per_s']:>9.0f} "
              f"{row['mfu']:>6.1%} {row['active_params'] / 1e6:>8.1f} {row['tokens_per_s_per_active_param']:>11.5f} "
              f"{row['kernels_per_step']:>7} {row['fwd_bwd_sync_warnings']:>5}")


if __name__ == "__main__":
    main()
