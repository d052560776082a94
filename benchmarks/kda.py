"""KDA kernels on a CUDA GPU: correctness against the fp64 naive recurrence and fla-core's `chunk_kda`
(reference only, never our implementation), then ours vs fla side by side (triton.testing.do_bench,
median): B=1, H=32, K=V=128, T in {8K, 32K, 128K}, forward and forward+backward, plus decode for 64 and
256 sequences. Prints a table with ratios and writes JSON.

    python benchmarks/kda.py [--out benchmarks/results/kda.json] [--quick] [--profile]

Settings of the side-by-side: bf16 inputs, in-kernel bounded gate (lower_bound=-5; fla with A_log=None
and safe_gate=True computes the same lower_bound*sigmoid(f + dt_bias)), q/k l2norm and beta sigmoid in
the kernels' wrappers, fp32 states.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.kda import chunk_kda, fused_recurrent_kda, naive_recurrent_kda  # noqa: E402

try:
    from fla.ops.kda import chunk_kda as fla_chunk_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_recurrent_fwd
except Exception as exc:  # noqa: BLE001 - the script still times ours without the reference
    fla_chunk_kda = fla_recurrent_fwd = None
    FLA_ERROR = repr(exc)
else:
    FLA_ERROR = None

LB = -5.0
DEV = os.environ.get("KDA_BENCH_DEVICE", "cuda")  # "cpu": smoke-test the checks' plumbing


def cap_autotune(warmup_ms: int, rep_ms: int) -> None:
    """Triton's autotuner (fla's kernels use it) times each candidate config with `triton.testing.do_bench`
    at 25 + 100 ms; shorten that. Our timings keep the full default (`bench` holds the original)."""
    import functools

    import triton.testing

    triton.testing.do_bench = functools.partial(_DO_BENCH, warmup=warmup_ms, rep=rep_ms)


try:
    from triton.testing import do_bench as _DO_BENCH
except Exception:  # noqa: BLE001 - no Triton: CPU smoke test
    _DO_BENCH = None


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("nan")
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def make(B: int, T: int, H: int, HV: int, K: int, V: int, dtype=torch.bfloat16, seed: int = 0, f_shift: float = 0.0):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, device=DEV, generator=g) * scale).to(dtype)

    return dict(
        q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=r(B, T, HV, K) + f_shift, beta=r(B, T, HV),
        dt_bias=torch.randn(HV * K, device=DEV, generator=g) * 0.5,
    )


def ours(x, h0=None, out_state=False, cu=None, lower_bound=LB, A_log=None, config=None):
    if config is not None:  # a kernel-config variant: the Triton entry point directly
        from kernels.kda.triton_chunk import chunk_kda_triton

        return chunk_kda_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=x["q"].shape[-1] ** -0.5,
                                initial_state=h0, output_final_state=out_state, use_qk_l2norm_in_kernel=True,
                                use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound,
                                A_log=A_log, dt_bias=x["dt_bias"], cu_seqlens=cu, chunk_size=64, config=config)
    return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0, output_final_state=out_state,
                     use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                     lower_bound=lower_bound, A_log=A_log, dt_bias=x["dt_bias"], cu_seqlens=cu)


def fla(x, h0=None, out_state=False, cu=None):
    return fla_chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0, output_final_state=out_state,
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                         safe_gate=True, lower_bound=LB, A_log=None, dt_bias=x["dt_bias"], cu_seqlens=cu)


def naive(x, h0=None, cu=None, lower_bound=LB, A_log=None):
    return naive_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0, output_final_state=True,
                               use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                               lower_bound=lower_bound, A_log=A_log, dt_bias=x["dt_bias"], cu_seqlens=cu,
                               compute_dtype=torch.float64)


GRAD_KEYS = ("q", "k", "v", "g", "beta", "dt_bias")


def grads(fn, x, h0, do, dht):
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in GRAD_KEYS}
    h0l = h0.detach().clone().requires_grad_(True)
    xx = dict(x, **leaves)
    o, s = fn(xx, h0l)
    loss = (o.double() * do.double()).sum() + (s.double() * dht.double()).sum()
    gs = torch.autograd.grad(loss, [*leaves.values(), h0l])
    return o.detach(), s.detach(), dict(zip([*GRAD_KEYS, "h0"], gs, strict=True))


def check_vs_naive(name, B, T, H, HV, K, V, cu=None, unbounded=False, f_shift=0.0, seed=0) -> dict:
    x = make(B, T, H, HV, K, V, seed=seed, f_shift=f_shift)
    N = B if cu is None else len(cu) - 1
    cu_t = None if cu is None else torch.tensor(cu, device=DEV)
    h0 = torch.randn(N, HV, K, V, device=DEV) * 0.5
    do = torch.randn(B, T, HV, V, device=DEV)
    dht = torch.randn(N, HV, K, V, device=DEV)
    kw = dict(lower_bound=None, A_log=torch.randn(HV, device=DEV) * 0.5) if unbounded else {}
    o, s, g = grads(lambda xx, h: ours(xx, h, True, cu_t, **kw), x, h0, do, dht)
    o_r, s_r, g_r = grads(lambda xx, h: naive(xx, h, cu_t, **kw), x, h0, do, dht)
    res = {"o": rel(o, o_r), "final_state": rel(s, s_r)}
    res.update({f"d{n}": rel(g[n], g_r[n]) for n in g})
    with torch.no_grad():  # the forward without autograd runs other kernels (bounded gates)
        o_ng, s_ng = ours(x, h0, True, cu_t, **kw)
    res["o_nograd"], res["state_nograd"] = rel(o_ng, o_r), rel(s_ng, s_r)
    if fla_chunk_kda is not None and not unbounded:
        o_f, s_f, g_f = grads(lambda xx, h: fla(xx, h, True, cu_t), x, h0, do, dht)
        res["fla_o"] = rel(o_f, o_r)
        res["fla_dq"] = rel(g_f["q"], g_r["q"])
        res["fla_dg"] = rel(g_f["g"], g_r["g"])
    print(f"  vs fp64 naive [{name}]: " + " ".join(f"{k}={v:.1e}" for k, v in res.items()), flush=True)
    return res


def check_vs_fla(T: int) -> dict:
    x = make(1, T, 32, 32, 128, 128, seed=1)
    h0 = torch.randn(1, 32, 128, 128, device=DEV) * 0.5
    do = torch.randn(1, T, 32, 128, device=DEV, dtype=torch.bfloat16)
    dht = torch.randn(1, 32, 128, 128, device=DEV)
    o, s, g = grads(lambda xx, h: ours(xx, h, True), x, h0, do, dht)
    o_f, s_f, g_f = grads(lambda xx, h: fla(xx, h, True), x, h0, do, dht)
    res = {"o": rel(o, o_f), "final_state": rel(s, s_f)}
    res.update({f"d{n}": rel(g[n], g_f[n]) for n in g})
    with torch.no_grad():
        o_ng, s_ng = ours(x, h0, True)
    res["o_nograd"], res["state_nograd"] = rel(o_ng, o_f), rel(s_ng, s_f)
    print(f"  ours vs fla T={T}: " + " ".join(f"{k}={v:.1e}" for k, v in res.items()), flush=True)
    return res


def check_decode() -> dict:
    """Both decode layouts (see decode_inputs; "rows" runs the one-token kernel when it is on) against the fp64
    recurrence, on a pool with a padded row."""
    N, HV, K, V, slots = 64, 32, 128, 128, 80
    x = make(1, N, HV, HV, K, V, seed=3)
    pool0 = torch.randn(slots, HV, K, V, device=DEV) * 0.5
    idx = torch.randperm(slots, device=DEV)[:N]
    idx[5] = -1
    valid = idx >= 0
    xv = {k: (v[:, valid] if v.dim() > 1 else v) for k, v in x.items()}
    xv1 = {k: (v.transpose(0, 1) if v.dim() > 1 else v) for k, v in xv.items()}  # one sequence per row
    o_r, s_r = naive(xv1, pool0[idx[valid]])
    res = {}
    # cu_seqlens over N tokens with lengths 0 and 2 among them: the one-token kernel's token-by-token loop
    cu_mixed = torch.arange(N + 1, device=DEV)
    cu_mixed[1], cu_mixed[10] = 0, 9  # sequences 0 and 9 empty, 1 and 10 of two tokens
    o_m, s_m = naive(x, pool0[idx.clamp(min=0)], cu=cu_mixed)
    lens = cu_mixed[1:] - cu_mixed[:-1]
    tok_valid = torch.repeat_interleave(valid, lens)
    pool = pool0.clone()
    o, _ = fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool, cu_seqlens=cu_mixed,
                               ssm_state_indices=idx, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                               use_beta_sigmoid_in_kernel=True, lower_bound=LB, dt_bias=x["dt_bias"])
    res["cu_mixed_lengths"] = {"o": rel(o[0, tok_valid], o_m[0, tok_valid]), "slots": rel(pool[idx[valid]], s_m[valid]),
                               "padded_row_zero": bool((o[0, ~tok_valid] == 0).all()), "lengths": sorted(set(lens.tolist()))}
    for layout in ("cu", "rows"):
        xl = x if layout == "cu" else {k: (v.transpose(0, 1).contiguous() if v.dim() > 1 else v) for k, v in x.items()}
        cu = torch.arange(N + 1, device=DEV) if layout == "cu" else None
        pool = pool0.clone()
        o, _ = fused_recurrent_kda(xl["q"], xl["k"], xl["v"], xl["g"], xl["beta"], initial_state=pool, cu_seqlens=cu,
                                   ssm_state_indices=idx, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                   use_beta_sigmoid_in_kernel=True, lower_bound=LB, dt_bias=xl["dt_bias"])
        o = o.reshape(N, HV, V)
        res[layout] = {"o": rel(o[valid], o_r[:, 0]), "slots": rel(pool[idx[valid]], s_r),
                       "padded_row_zero": bool((o[~valid] == 0).all()),
                       "others_untouched": bool(torch.equal(pool[~torch.isin(torch.arange(slots, device=DEV), idx)],
                                                            pool0[~torch.isin(torch.arange(slots, device=DEV), idx)]))}
    print("  decode vs fp64 naive: " + str(res), flush=True)
    return res


def bench(fn, grad_to_none=None) -> float:
    return float(_DO_BENCH(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median"))


def time_chunk(T: int, impls: tuple[str, ...] = ("ours", "fla"), parts: tuple[str, ...] = ("fwd", "fwdbwd"),
               res: dict | None = None, save=lambda: None) -> dict:
    """Forward and forward+backward ms at B=1, H=32, K=V=128; fills `res` and calls `save` after each
    number (fla's first call of each kernel autotunes for minutes, so partial results must survive a limit)."""
    x = make(1, T, 32, 32, 128, 128, seed=2)
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in GRAD_KEYS}
    xx = dict(x, **leaves)
    do = torch.randn(1, T, 32, 128, device=DEV, dtype=torch.bfloat16)
    res = {} if res is None else res
    fns = {"ours": ours, "fla": fla}
    for name in impls:
        if name == "fla" and fla_chunk_kda is None:
            continue
        fn = fns[name]
        for part in parts:
            start = time.time()
            if part == "fwd":
                with torch.no_grad():
                    res[f"{name}_fwd_ms"] = bench(lambda fn=fn: fn(x))
            else:
                def fwd_bwd(fn=fn):
                    o, _ = fn(xx)
                    o.backward(do)

                res[f"{name}_fwdbwd_ms"] = bench(fwd_bwd, grad_to_none=list(leaves.values()))
            print(f"  T={T} {name} {part}: {res[f'{name}_{part}_ms']:.3f} ms (incl. compile/autotune "
                  f"{time.time() - start:.0f} s)", flush=True)
            save()
        torch.cuda.empty_cache()
    return res


def time_decode(N: int) -> dict:
    """Ours and fla's decode step at N sequences in both input layouts (see decode_inputs): "rows" is how the
    model serves ([N, 1, ...] without cu_seqlens), "cu" the layout of earlier rounds' numbers."""
    H, K, V = 32, 128, 128
    pool = torch.randn(N + 8, H, K, V, device=DEV)
    idx = torch.randperm(N + 8, device=DEV)[:N].to(torch.int32)
    res = {}
    for layout in ("rows", "cu"):
        x, cu = decode_inputs(N, layout)
        suffix = "" if layout == "rows" else "_cu"

        def run_ours(x=x, cu=cu):
            fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool, cu_seqlens=cu,
                                ssm_state_indices=idx, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                use_beta_sigmoid_in_kernel=True, lower_bound=LB, dt_bias=x["dt_bias"])

        res[f"ours_us{suffix}"] = bench(run_ours) * 1e3
        if fla_recurrent_fwd is not None:
            def run_fla(x=x, cu=cu):
                fla_recurrent_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=None, dt_bias=x["dt_bias"],
                                  initial_state=pool, inplace_final_state=True,
                                  cu_seqlens=None if cu is None else cu.long(), ssm_state_indices=idx,
                                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                  use_beta_sigmoid_in_kernel=True, lower_bound=LB)
            try:
                res[f"fla_us{suffix}"] = bench(run_fla) * 1e3
            except Exception as exc:  # noqa: BLE001
                res[f"fla_error{suffix}"] = repr(exc)[:300]
    state_bytes = 2 * N * H * K * V * 4
    res["ours_state_TBps"] = state_bytes / (res["ours_us"] * 1e-6) / 1e12
    return res


# name -> (KDAKernelConfig overrides, layout): "rows" is the serving call's [N, 1, ...] inputs without cu_seqlens
# (the one-token kernel's case), "cu" one row of N tokens with cu_seqlens = arange (the general kernel always).
# Earlier rounds swept the general kernel's block_v 8-128 at 1-8 warps, its evict-first hint, and several units per
# program with the next state prefetched into registers (commit 6d432ff): 351-816 us, none better than 32 / 1 warp.
# Session 18's first call also timed the one-token kernel with pointer loads at 16 columns / 1 warp, 2 and 3 stages
# (528, 432 us) and TMA at 16 columns with 4 stages or 16 programs per SM (356, 333 us).
# Session 18's second call: TMA 32 / 2 / 3 at 3 per SM 333.6 us, 2 stages at 6 per SM 319.8, 4 stages at 3 per SM
# 332.9, 64 columns / 4 warps / 2 stages 363.6; pointer loads 32 / 2 / 3 / 4 322.2 (the default, TMA, 299.3).
# Session 19's first call (the default 288-289 us): 4 warps 377; each program's units as one contiguous range
# 344; TMA loads with pointer stores 313 (4 stages 312, 5 or 6 per SM 317, 314; 4 warps 361; contiguous 345).
DECODE_SWEEP = {
    "general_bv32_w1_cu": (dict(decode_step=False), "cu"),
    "step_cu": ({}, "cu"),
    "step_tma_rows": ({}, "rows"),
    "step_pointers_rows": (dict(decode_step_tma=False), "rows"),
    "step_cu_again": ({}, "cu"),
    "step_tma_rows_again": ({}, "rows"),
}


def decode_inputs(N: int, layout: str, seed: int = 4) -> tuple[dict, torch.Tensor | None]:
    """Decode inputs of N sequences, one token each: [1, N, ...] with cu_seqlens (layout "cu") or [N, 1, ...]
    without (layout "rows"); the same values either way."""
    H, K, V = 32, 128, 128
    x = make(1, N, H, H, K, V, seed=seed)
    if layout == "cu":
        return x, torch.arange(N + 1, device=DEV, dtype=torch.int32)
    return {n: (t.transpose(0, 1).contiguous() if t.dim() > 1 else t) for n, t in x.items()}, None


def decode_sweep(N: int = 256) -> dict:
    """Decode kernels and block sizes at N sequences: us, TB/s of state traffic, and the relative difference of
    output and slots from the default general kernel's (each variant on the same inputs and pool)."""
    from kernels.kda.triton_config import KDAKernelConfig
    from kernels.kda.triton_recurrent import fused_recurrent_kda_triton

    H, K, V = 32, 128, 128
    pool0 = torch.randn(N + 8, H, K, V, device=DEV)
    idx = torch.randperm(N + 8, device=DEV)[:N].to(torch.int32)

    def call(pool, cfg, layout):
        x, cu = decode_inputs(N, layout)
        return fused_recurrent_kda_triton(
            x["q"], x["k"], x["v"], x["g"], x["beta"], scale=K ** -0.5, initial_state=pool,
            output_final_state=False, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, lower_bound=LB, A_log=None, dt_bias=x["dt_bias"], cu_seqlens=cu,
            ssm_state_indices=idx, inplace_final_state=True, config=cfg)[0].reshape(N, H, V)

    ref_pool = pool0.clone()
    ref_o = call(ref_pool, KDAKernelConfig(decode_step=False), "cu")
    out = {}
    for name, (overrides, layout) in DECODE_SWEEP.items():
        cfg = KDAKernelConfig(**overrides)
        try:
            pool = pool0.clone()
            o = call(pool, cfg, layout)
            r = {"o_rel": rel(o, ref_o), "slots_rel": rel(pool, ref_pool)}
            x, cu = decode_inputs(N, layout)
            from kernels.kda.triton_recurrent import fused_recurrent_kda_triton as fr

            def run(cfg=cfg, x=x, cu=cu, pool=pool):
                fr(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=K ** -0.5, initial_state=pool,
                   output_final_state=False, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                   use_beta_sigmoid_in_kernel=True, lower_bound=LB, A_log=None, dt_bias=x["dt_bias"], cu_seqlens=cu,
                   ssm_state_indices=idx, inplace_final_state=True, config=cfg)

            r["us_runs"] = [bench(run) * 1e3 for _ in range(3)]
            r["us"] = sorted(r["us_runs"])[1]
            r["state_TBps"] = 2 * N * H * K * V * 4 / (r["us"] * 1e-6) / 1e12
        except Exception as exc:  # noqa: BLE001 - the other variants still run
            r = {"error": repr(exc)[:300]}
        out[name] = r
        print(f"  decode N={N} {name}: " + " ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
    return out


def decode_overhead(sizes=(256, 128, 64, 32, 16), repeats: int = 3) -> dict:
    """Where decode time goes at small sequence counts: per kernel path and sequence count, do_bench's median
    (several times), the host time of one call (calls enqueued back to back, no sync: the Python wrapper, argument
    handling, Triton's launcher, the TMA descriptor) and the GPU time of one call from a CUDA graph's replays (no
    launch cost; the pool stays in L2 where it fits). do_bench clears L2 with a 256 MB memset before each call:
    a call whose host time exceeds that memset's GPU time shows its host time in the measurement."""
    from kernels.kda.triton_config import KDAKernelConfig
    from kernels.kda.triton_recurrent import fused_recurrent_kda_triton

    H, K, V = 32, 128, 128
    # session 19's first call also timed session 18's host side (every call built cu_seqlens on the host and copied
    # it through pinned memory: ~10 us more GPU time per call at every size, 299 us at 256 sequences)
    paths = {
        "public_rows": None, "public_cu": None,
        "step_tma": KDAKernelConfig(decode_step_tma_min_bytes=0), "step_pointers": KDAKernelConfig(decode_step_tma=False),
        "general_rows": KDAKernelConfig(decode_step=False), "general_cu": KDAKernelConfig(decode_step=False),
        "fla_rows": None,
    }
    out = {}
    for N in sizes:
        pool = torch.randn(N + 8, H, K, V, device=DEV)
        idx = torch.randperm(N + 8, device=DEV)[:N].to(torch.int32)
        rows, _ = decode_inputs(N, "rows")
        xcu, cu = decode_inputs(N, "cu")
        fns = {}
        for name, cfg in paths.items():
            if name == "public_rows" or name == "public_cu":
                x, c = (rows, None) if name == "public_rows" else (xcu, cu)

                def fn(x=x, c=c, pool=pool, idx=idx):
                    fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool, cu_seqlens=c,
                                        ssm_state_indices=idx, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                        use_beta_sigmoid_in_kernel=True, lower_bound=LB, dt_bias=x["dt_bias"])
            elif name == "fla_rows":
                if fla_recurrent_fwd is None:
                    continue

                def fn(x=rows, pool=pool, idx=idx):
                    fla_recurrent_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=None, dt_bias=x["dt_bias"],
                                      initial_state=pool, inplace_final_state=True, cu_seqlens=None,
                                      ssm_state_indices=idx, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                      use_beta_sigmoid_in_kernel=True, lower_bound=LB)
            else:
                def fn(cfg=cfg, x=xcu if name.endswith("_cu") else rows, c=cu if name.endswith("_cu") else None,
                       pool=pool, idx=idx):
                    fused_recurrent_kda_triton(
                        x["q"], x["k"], x["v"], x["g"], x["beta"], scale=K ** -0.5, initial_state=pool,
                        output_final_state=False, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                        use_beta_sigmoid_in_kernel=True, lower_bound=LB, A_log=None, dt_bias=x["dt_bias"],
                        cu_seqlens=c, ssm_state_indices=idx, inplace_final_state=True, config=cfg)
            fns[name] = fn
        for name, fn in fns.items():
            r = {}
            try:
                fn()
                torch.cuda.synchronize()
                r["do_bench_us"] = [round(bench(fn) * 1e3, 1) for _ in range(repeats)]
                torch.cuda.synchronize()
                host = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    for _ in range(50):
                        fn()
                    host.append((time.perf_counter() - t0) / 50 * 1e6)
                    torch.cuda.synchronize()
                r["host_us"] = [round(h, 1) for h in host]
                try:
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        fn()
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        for _ in range(10):
                            fn()
                    graph.replay()
                    torch.cuda.synchronize()
                    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                    ev[0].record()
                    for _ in range(10):
                        graph.replay()
                    ev[1].record()
                    torch.cuda.synchronize()
                    r["graph_us"] = round(ev[0].elapsed_time(ev[1]) * 1e3 / 100, 1)
                    del graph
                except Exception as exc:  # noqa: BLE001 - fla's wrapper may not capture
                    r["graph_error"] = repr(exc)[:200]
            except Exception as exc:  # noqa: BLE001
                r["error"] = repr(exc)[:300]
            out[f"{N}_{name}"] = r
            print(f"  decode overhead N={N} {name}: {r}", flush=True)
        del pool, fns, fn
        torch.cuda.empty_cache()
    return out


def copy_bandwidth(gib: int = 4) -> float:
    """The decode target's ceiling: a large device-to-device copy, bytes read plus written per second (TB/s)."""
    src = torch.randn(gib * 2**28, device=DEV)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e12


VARIANTS = {  # KDAKernelConfig overrides compared side by side by --variants (session 18 also timed a forward state
    # kernel on the transposed state, and score blocks above the diagonal left unwritten: commit 25e88df; session
    # 17-18: separate kernels, the scores grid chunk first, warps and stages of each kernel; session 19's first call:
    # e^Gam in the scores kernel as e^(Gam - ref) e^ref (2.471 ms against 2.472), the gate kernel's K tile 32 at 2 or
    # 4 warps (2.505, 2.508) and 64 at 2 warps (2.487), against the default 2.459 / 2.474)
    "default": {},
    "upper_akk_written": dict(infer_skip_upper_akk=False),
    "default_again": {},
    "upper_akk_written_again": dict(infer_skip_upper_akk=False),
}
# also timed forward+backward under --forward-only (variants that change the training path)
FWDBWD_VARIANTS: tuple[str, ...] = ()


def time_variants(T: int = 32768, forward_only: bool = False) -> dict:
    """Each config variant: relative errors vs fp64 naive (H=32, T=300, bf16) and fwd / fwd+bwd ms at T."""
    from kernels.kda.triton_config import KDAKernelConfig

    xc = make(1, 300, 32, 32, 128, 128, seed=0)
    h0 = torch.randn(1, 32, 128, 128, device=DEV) * 0.5
    do_c = torch.randn(1, 300, 32, 128, device=DEV)
    dht = torch.randn(1, 32, 128, 128, device=DEV)
    o_r, s_r, g_r = grads(lambda xx, h: naive(xx, h), xc, h0, do_c, dht)
    x = make(1, T, 32, 32, 128, 128, seed=2)
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in GRAD_KEYS}
    xx = dict(x, **leaves)
    do = torch.randn(1, T, 32, 128, device=DEV, dtype=torch.bfloat16)
    out = {}
    for name, overrides in VARIANTS.items():
        cfg = KDAKernelConfig(**overrides)
        try:
            o, s, g = grads(lambda xx_, h, cfg=cfg: ours(xx_, h, True, config=cfg), xc, h0, do_c, dht)
            r = {"o": rel(o, o_r), "final_state": rel(s, s_r)}
            r.update({f"d{n}": rel(g[n], g_r[n]) for n in g})
            with torch.no_grad():  # the forward without autograd runs other kernels (bounded gates)
                o_ng, s_ng = ours(xc, h0, True, config=cfg)
                r["o_nograd"], r["state_nograd"] = rel(o_ng, o_r), rel(s_ng, s_r)
                r["fwd_ms"] = bench(lambda cfg=cfg: ours(x, config=cfg))

            def fwd_bwd(cfg=cfg):
                ours(xx, config=cfg)[0].backward(do)

            if not forward_only or name in FWDBWD_VARIANTS:
                r["fwdbwd_ms"] = bench(fwd_bwd, grad_to_none=list(leaves.values()))
        except Exception as exc:  # noqa: BLE001 - the other variants still run
            r = {"error": repr(exc)[:300]}
        out[name] = r
        print(f"  variant {name}: " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                             for k, v in r.items()), flush=True)
    return out


def profile_32k(forward_only: bool = False) -> list[tuple[str, float]]:
    """Kernel times of ours at 32K: forward+backward, or the forward without autograd."""
    x = make(1, 32768, 32, 32, 128, 128, seed=5)
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in GRAD_KEYS}
    xx = dict(x, **leaves)
    do = torch.randn(1, 32768, 32, 128, device=DEV, dtype=torch.bfloat16)

    def step():
        if forward_only:
            with torch.no_grad():
                ours(x)
        else:
            ours(xx)[0].backward(do)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t:
            rows.append((e.key[:60], t / 3 / 1e3))
    rows.sort(key=lambda r: -r[1])
    print(f"  profile ours {'fwd (no autograd)' if forward_only else 'fwd+bwd'} T=32K (ms per step):")
    for k, t in rows[:14]:
        print(f"    {t:8.3f}  {k}")
    return rows[:20]


def attempt(fn, *args):
    """Run one check or timing; a failure is reported and recorded, and the rest still runs."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001
        import traceback

        traceback.print_exc(limit=3)
        torch.cuda.empty_cache()
        return {"error": repr(exc)[:500]}


def print_tables(out: dict) -> None:
    print("\n| T | ours fwd ms | fla fwd ms | fla/ours | ours fwd+bwd ms | fla fwd+bwd ms | fla/ours |")
    print("|---|---|---|---|---|---|---|")
    for T, r in out["chunk"].items():
        nan = float("nan")
        o_f, o_b = r.get("ours_fwd_ms", nan), r.get("ours_fwdbwd_ms", nan)
        f_f, f_b = r.get("fla_fwd_ms", nan), r.get("fla_fwdbwd_ms", nan)
        print(f"| {T} | {o_f:.3f} | {f_f:.3f} | {f_f / o_f:.2f} | {o_b:.3f} | {f_b:.3f} | {f_b / o_b:.2f} |")
    copy = out.get("copy_TBps")
    print("\n| decode seqs | layout | ours us | fla us | fla/ours | ours % of copy |")
    print("|---|---|---|---|---|---|")
    for N, r in out["decode"].items():
        if "error" in r:
            print(f"| {N} | error |")
            continue
        for layout, suffix in (("rows", ""), ("cu", "_cu")):
            ou, fu = r.get(f"ours_us{suffix}", float("nan")), r.get(f"fla_us{suffix}", float("nan"))
            tbps = 2 * N * 32 * 128 * 128 * 4 / (ou * 1e-6) / 1e12
            pct = tbps / copy * 100 if isinstance(copy, float) else float("nan")
            print(f"| {N} | {layout} | {ou:.1f} | {fu:.1f} | {fu / ou:.2f} | {pct:.0f}% |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/kda.json")
    ap.add_argument("--quick", action="store_true", help="T=32K only")
    ap.add_argument("--fla-autotune-ms", type=int, nargs=2, metavar=("WARMUP", "REP"), default=None,
                    help="time each of fla's autotune candidates for this long (Triton's default: 25 100)")
    ap.add_argument("--forward-only", action="store_true", help="time forwards only (skips fla's backward autotuning)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--variants", action="store_true", help="only: kernel-config variants at 32K (errors, ms)")
    ap.add_argument("--decode-sweep", action="store_true", help="only: decode block sizes at 256 sequences")
    ap.add_argument("--decode-overhead", action="store_true",
                    help="only: decode paths at 16-256 sequences: do_bench, host time per call, CUDA-graph time")
    ap.add_argument("--all-checks", action="store_true",
                    help="also check other shapes/options vs naive (each new shape compiles every kernel again)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
            "fla_error": FLA_ERROR}
    from benchmarks.machine import machine_info

    info["machine"] = machine_info()
    import triton

    info["triton"] = triton.__version__
    try:
        import fla

        info["fla"] = fla.__version__
    except Exception:  # noqa: BLE001
        info["fla"] = None
    print(info, flush=True)
    out: dict = {"info": info, "chunk": {}, "decode": {}}
    t0 = time.time()
    dest = Path(args.out)
    dest.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        dest.write_text(json.dumps(out, indent=1, default=str))

    if args.decode_overhead:
        if args.fla_autotune_ms:
            cap_autotune(*args.fla_autotune_ms)
        out["decode_vs_naive"] = attempt(check_decode)
        save()
        out["decode_overhead"] = decode_overhead()
        save()
        print(f"wrote {args.out} ({time.time() - t0:.0f}s)")
        return
    if args.decode_sweep:
        out["copy_TBps"] = attempt(copy_bandwidth)
        out["decode_sweep_256"] = decode_sweep()
        save()
        print(f"wrote {args.out} ({time.time() - t0:.0f}s)")
        return
    if args.variants:
        out["variants_32k"] = time_variants(forward_only=args.forward_only)
        if args.profile:
            out["profile_fwd_32k"] = attempt(profile_32k, True)
        save()
        print(f"wrote {args.out} ({time.time() - t0:.0f}s)")
        return
    def timed_part(T: int, impls: tuple[str, ...], parts: tuple[str, ...]) -> None:
        r = attempt(time_chunk, T, impls, parts, out["chunk"][T], save)
        if "error" in r and r is not out["chunk"][T]:
            out["chunk"][T].setdefault("errors", []).append(r["error"])
            save()

    out["copy_TBps"] = attempt(copy_bandwidth)
    print(f"  device-to-device copy: {out['copy_TBps']} TB/s (bytes read + written)", flush=True)
    if args.fla_autotune_ms:
        cap_autotune(*args.fla_autotune_ms)
    # timing first (the speed bar). Ours (fixed configs) and the decode before fla's chunk timings, whose
    # first calls autotune; fla's forward before its backward. Every number is saved as it comes.
    sizes = [32768] if args.quick else [8192, 32768, 131072]
    for T in sizes:
        out["chunk"][T] = {}
        timed_part(T, ("ours",), ("fwd",) if args.forward_only else ("fwd", "fwdbwd"))
    for N in (64, 256):
        out["decode"][N] = r = attempt(time_decode, N)
        print(f"  decode N={N}: " + " ".join(f"{k}={v}" for k, v in r.items()), flush=True)
        save()
    for part in ("fwd",) if args.forward_only else ("fwd", "fwdbwd"):
        for T in sizes:
            timed_part(T, ("fla",), (part,))
    print_tables(out)
    print("correctness (relative error, bf16 inputs):", flush=True)
    out["vs_naive"] = {"H32": attempt(check_vs_naive, "H=32 K=V=128 B=1 T=300", 1, 300, 32, 32, 128, 128)}
    save()
    if fla_chunk_kda is not None:
        out["vs_fla"] = attempt(check_vs_fla, 8192)
        save()
    out["decode_vs_naive"] = attempt(check_decode)
    save()
    if args.all_checks:
        out["vs_naive"].update({
            "bounded": attempt(check_vs_naive, "bounded B=2 T=300", 2, 300, 4, 4, 128, 128),
            "at_bound": attempt(check_vs_naive, "gates at the bound", 1, 256, 2, 2, 128, 128, None, False, 8.0, 1),
            "varlen_gva": attempt(check_vs_naive, "varlen, HV=2H", 1, 333, 2, 4, 128, 64, [0, 17, 200, 201, 333],
                                  False, 0.0, 2),
            "unbounded": attempt(check_vs_naive, "unbounded gate", 1, 200, 2, 2, 64, 64, None, True, 0.0, 3),
        })
        save()
    if args.profile:
        out["profile_fwd_32k"] = attempt(profile_32k, True)
        if not args.forward_only:
            out["profile_32k"] = attempt(profile_32k)
        save()
    print(f"wrote {args.out} ({time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()
