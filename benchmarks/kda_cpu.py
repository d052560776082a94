"""KDA on the CPU, one torch thread, thread-CPU time (steady on a shared box): `chunk_kda` without autograd
(the compiled recurrence the engine's prefill runs) against the chunked torch path (what it ran before,
and what training still runs), at the serving benchmark's KDA shape (4 heads, K = V = 64, bounded gate,
bf16 inputs as served); the prefill's short conv + SiLU as one compiled pass against its torch form (the
engine's layer, C = 768 channels sliced from the input projection, bf16); the one-token decode of
`fused_recurrent_kda` over a slot pool; and a training forward+backward (the chunked path, for
no-regression). With `--threads`, also the compiled prefill's wall time on that many torch threads (its C
recurrence splits over them). Prints a table and writes JSON.

    python benchmarks/kda_cpu.py [--lengths 4096 16384] [--threads 1 2] [--out benchmarks/results/kda_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import describe, machine_info  # noqa: E402
from kernels.kda import chunk_kda, fused_recurrent_kda  # noqa: E402
from kernels.kda.chunk_torch import chunk_kda_torch  # noqa: E402
from kernels.kda.common import preprocess  # noqa: E402
from kernels.kda.recurrent_cpu import conv_silu_prefill_cpu  # noqa: E402
from model.config import TaperConfig  # noqa: E402
from model.layers.kda import KimiDeltaAttention  # noqa: E402
from model.vllm_plugin import kda_ops  # noqa: E402

H, K = 4, 64
GATE = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)


def inputs(B: int, T: int, dtype: torch.dtype, seed: int = 0) -> tuple[list[torch.Tensor], dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    args = [rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H)]
    return args, dict(GATE, dt_bias=torch.randn(H * K, generator=gen) * 0.5)


def cpu_seconds(fn, repeats: int, clock=time.thread_time) -> float:
    """The fastest of `repeats` calls, in thread-CPU seconds (after one warm-up call); with
    `clock=time.perf_counter`, in wall seconds (`wall_seconds`: work spread over threads)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


wall_seconds = partial(cpu_seconds, clock=time.perf_counter)


def thread_rows(lengths: list[int], threads: list[int], repeats: int) -> list[dict[str, Any]]:
    """The compiled prefill (`chunk_kda` without autograd, one prompt) on each number of torch threads."""
    rows = []
    for T in lengths:
        args, kw = inputs(1, T, torch.bfloat16)
        for n in threads:
            torch.set_num_threads(n)
            with torch.no_grad():
                rows.append(dict(case=f"prefill 1 x {T}, {n} threads (wall)",
                                 compiled_s=wall_seconds(partial(chunk_kda, *args, **kw), repeats)))
    torch.set_num_threads(1)
    return rows


def chunked_forward(args: list[torch.Tensor], kw: dict[str, Any]) -> torch.Tensor:
    """The chunked torch path's forward, as `chunk_kda` runs it when a gradient is needed."""
    pre = preprocess(*args, dtype=torch.float32, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, lower_bound=kw["lower_bound"], A_log=None,
                     dt_bias=kw["dt_bias"])
    return chunk_kda_torch(*pre, K**-0.5, None, None, 64)[0]


def run(lengths: list[int], repeats: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    rows = []
    for T in lengths:
        args, kw = inputs(1, T, torch.bfloat16)
        with torch.no_grad():
            compiled = cpu_seconds(partial(chunk_kda, *args, **kw), repeats)
            chunked = cpu_seconds(partial(chunked_forward, args, kw), repeats)
            o_fast = chunk_kda(*args, **kw)[0].float()
            o_ref = chunked_forward(args, kw)
        rows.append(dict(case=f"prefill 1 x {T}", compiled_s=compiled, chunked_s=chunked,
                         speedup=chunked / compiled,
                         rel_diff=float((o_fast - o_ref).norm() / o_ref.norm())))
    for T in lengths:
        rows.append(conv_row(T, repeats))
    for n in (8, 64):  # decode: one token per sequence, states in a pool of 4n slots
        args, kw = inputs(n, 1, torch.bfloat16)
        pool = torch.randn(4 * n, H, K, K) * 0.1
        slots = torch.randperm(4 * n)[:n]
        with torch.no_grad():
            step = cpu_seconds(partial(fused_recurrent_kda, *args, initial_state=pool, ssm_state_indices=slots,
                                       inplace_final_state=True, **kw), repeats * 5)
        rows.append(dict(case=f"decode {n} sequences", compiled_s=step))
    args, kw = inputs(4, 320, torch.float32)
    for t in args:
        t.requires_grad_(True)

    def train() -> None:
        o, _ = chunk_kda(*args, **kw)
        o.square().sum().backward()

    rows.append(dict(case="training fwd+bwd 4 x 320 (chunked)", chunked_s=cpu_seconds(train, repeats)))
    return dict(machine=machine_info(), threads=1, heads=H, head_dim=K, rows=rows)


def conv_row(T: int, repeats: int) -> dict[str, Any]:
    """The prefill conv + SiLU of one T-token prompt, both forms ending with q, k, v as the recurrence reads
    them and the conv state's slot advanced."""
    layer = KimiDeltaAttention(TaperConfig.preset("tiny", hidden_size=256, kda_num_heads=H, kda_head_dim=K),
                               0).eval().to(torch.bfloat16)
    C = layer.conv_channels
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(T, C + 4 * H + 2 * K, generator=gen).to(torch.bfloat16)[:, :C]  # a projection's slice
    pool = torch.randn(2, layer.conv_size - 1, C, generator=gen)  # [slots, W-1, C], fp32
    bounds, slots, keep = torch.tensor([0, T]), torch.tensor([1]), torch.tensor([True])
    weight = kda_ops._conv_weight_rows(layer)

    def torch_form() -> list[torch.Tensor]:
        init = pool.transpose(1, 2).index_select(0, slots)
        q, k, v, new = kda_ops._prefill_conv(layer, qkv, init, bounds)
        pool.transpose(1, 2).index_copy_(0, slots, new.float())
        return [t.reshape(T, -1).contiguous() for t in (q, k, v)]

    def compiled() -> tuple[torch.Tensor, ...]:
        return conv_silu_prefill_cpu(qkv, weight, pool, bounds, slots, keep, layer.key_dim)

    with torch.no_grad():
        start = pool.clone()
        fast = torch.cat(compiled(), dim=1)
        pool.copy_(start)
        ref = torch.cat(torch_form(), dim=1)
        row = dict(case=f"prefill conv + SiLU 1 x {T}", compiled_s=cpu_seconds(compiled, repeats),
                   torch_s=cpu_seconds(torch_form, repeats), rel_diff=float((fast - ref).norm() / ref.norm()))
    row["speedup"] = row["torch_s"] / row["compiled_s"]
    return row


def print_table(result: dict[str, Any]) -> None:
    print(describe(result["machine"]))
    print(f"{'case':<38} {'compiled ms':>12} {'torch ms':>11} {'speedup':>8} {'rel diff':>9}")
    for r in result["rows"]:
        def ms(key: str, r: dict[str, Any] = r) -> str:
            return f"{r[key] * 1e3:.2f}" if key in r else "-"

        speed = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
        diff = f"{r['rel_diff']:.1e}" if "rel_diff" in r else "-"
        torch_ms = ms("chunked_s") if "chunked_s" in r else ms("torch_s")  # the chunked path, or the conv's torch form
        print(f"{r['case']:<38} {ms('compiled_s'):>12} {torch_ms:>11} {speed:>8} {diff:>9}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="*", default=[],
                    help="also time the compiled prefill on these numbers of threads (wall time)")
    ap.add_argument("--out", default="benchmarks/results/kda_cpu.json")
    args = ap.parse_args()
    result = run(args.lengths, args.repeats)
    if args.threads:
        result["rows"] += thread_rows(args.lengths, args.threads, args.repeats)
    print_table(result)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
