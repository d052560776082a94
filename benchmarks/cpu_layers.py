"""Taper's serving layers on the CPU without vLLM, one torch thread, thread-CPU ms (best of a few calls), in
bf16 and fp32: the KDA token mixer as the engine runs it (`kda_forward_with_state`: a prefill of one T-token
prompt, a decode step of 8 sequences), the served MoE layer and the served Block AttnRes + RMSNorm over 5
candidates (`model.vllm_plugin.per_token`, which needs no vLLM), an MLA decode step's attention over 8
sequences' cached latents (`kernels.mla_decode_cpu`), an MLA prefill's attention for the last 4K-token chunk of
a prompt (`kernels.prefill_attention_cpu`: torch's flash kernel, and the AMX tile kernel in bf16 on CPUs with
AMX) and the matmul shapes behind them, at the
serving benchmark's sizes (`benchmarks/serving.py`). For machines where vLLM is not installed, e.g. to see
where a bf16/AMX CPU spends a layer's time. With `--threads N` (N > 1), N torch threads and wall ms instead.
`--parts` times the KDA prefill's compiled parts inside the layer (conv + SiLU, gate, recurrence, output norm;
wall ms, each wrapped by a timer) on 1, 2, 4, ... up to `--threads` threads. Prints a table and writes JSON.

    python benchmarks/cpu_layers.py [--lengths 4096 16384] [--threads 1] [--profile] [--parts]
                                    [--out benchmarks/results/cpu_layers.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kda_cpu import cpu_seconds, wall_seconds  # noqa: E402
from benchmarks.machine import describe, machine_info  # noqa: E402
from kernels.mla_decode_cpu import latent_decode_attention  # noqa: E402
from kernels.prefill_attention_cpu import amx_available, chunk_attention, prefill_attention  # noqa: E402
from model.config import TaperConfig  # noqa: E402
from model.layers.kda import KimiDeltaAttention  # noqa: E402
from model.layers.norm import RMSNorm  # noqa: E402
from model.vllm_plugin.kda_ops import (  # noqa: E402
    KDABatch,
    conv_state_shape,
    kda_forward_with_state,
    recurrent_state_shape,
)
from model.vllm_plugin.per_token import VllmBlockAttnRes, VllmStableLatentMoE  # noqa: E402

DECODE_SEQUENCES = 8
PREFILL_CHUNK = 4096  # the engine's long prompts are prefilled in chunks: the last one attends over the most


def serving_config() -> TaperConfig:
    """The Taper model of `benchmarks/serving.py` (vocabulary aside)."""
    return TaperConfig.preset(
        "tiny", hidden_size=256, num_hidden_layers=8, full_attn_layers=[3, 7], kda_num_heads=4, kda_head_dim=64,
        num_attention_heads=8, qk_head_dim=32, v_head_dim=32, kv_lora_rank=128, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=128, moe_latent_size=128, shared_expert_intermediate_size=256,
        intermediate_size=768,
    )


def prefill_batch(T: int) -> KDABatch:
    return KDABatch(num_decodes=0, query_start_loc=torch.tensor([0, T], dtype=torch.int32),
                    state_indices=torch.tensor([1], dtype=torch.int32), has_initial_state=torch.tensor([False]))


def mla_decode(cfg: TaperConfig, T: int, dtype: torch.dtype, block: int = 128) -> Callable[[], Any]:
    """One decode step's attention of an MLA layer over a latent cache (`latent_decode_attention`), each of
    DECODE_SEQUENCES sequences T tokens long on its own pages."""
    n, r, pages = DECODE_SEQUENCES, cfg.kv_lora_rank, -(-T // block)
    cache = torch.randn(n * pages, 1, block, 2 * r, dtype=dtype)
    table = torch.randperm(n * pages, dtype=torch.int32).view(n, pages)
    q = torch.randn(n, cfg.num_attention_heads, r)
    return partial(latent_decode_attention, q, cache, table, torch.full((n,), T, dtype=torch.int32),
                   cfg.qk_head_dim**-0.5, False)


def run(lengths: list[int], profile: bool, threads: int = 1) -> dict[str, Any]:
    torch.set_num_threads(threads)
    seconds = cpu_seconds if threads == 1 else wall_seconds
    torch.manual_seed(0)
    cfg = serving_config()
    rows: list[dict[str, Any]] = []
    profiles: dict[str, str] = {}
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")

        def row(case: str, fn: Callable[[], Any], repeats: int, name: str = name) -> None:
            rows.append(dict(case=case, dtype=name, ms=1e3 * seconds(fn, repeats)))

        for M, K, N in [(8, 256, 900), (8, 128, 2048), (4096, 256, 900), (4096, 128, 2048)]:
            x, w = torch.randn(M, K, dtype=dtype), torch.randn(N, K, dtype=dtype)
            row(f"linear {M} x {K} -> {N}", partial(torch.nn.functional.linear, x, w), 20 if M < 64 else 3)
        kda = KimiDeltaAttention(cfg, 0).eval().to(dtype)
        moe = VllmStableLatentMoE(cfg).eval()
        attn_res = VllmBlockAttnRes(cfg.hidden_size, cfg.rms_norm_eps)
        norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        with torch.no_grad():  # the expert weights are allocated, not initialised, outside a PreTrainedModel
            for p in [*moe.parameters(), *attn_res.parameters(), *norm.parameters()]:
                p.normal_(0, 0.05)
        moe, attn_res, norm = moe.to(dtype), attn_res.to(dtype), norm.to(dtype)
        with torch.no_grad():
            for T in lengths:
                x = torch.randn(T, cfg.hidden_size, dtype=dtype)
                conv = torch.randn(4, *conv_state_shape(kda))
                rec = torch.randn(4, *recurrent_state_shape(kda))
                row(f"KDA layer prefill 1 x {T}", partial(kda_forward_with_state, kda, x, conv, rec, prefill_batch(T)), 2)
                row(f"MoE layer 1 x {T}", partial(moe, x), 2)
                candidates = [torch.randn(T, cfg.hidden_size, dtype=dtype) for _ in range(5)]
                row(f"AttnRes + norm 1 x {T}", partial(attn_res.mix_and_norm, candidates, norm), 3)
                row(f"MLA decode attention {DECODE_SEQUENCES} x {T} latents", mla_decode(cfg, T, dtype), 5)
                chunk = min(T, PREFILL_CHUNK)
                q, k, v = (torch.randn(cfg.num_attention_heads, n, cfg.qk_head_dim, dtype=dtype) for n in (chunk, T, T))
                scale = cfg.qk_head_dim**-0.5
                row(f"MLA prefill attention {chunk} of {T}, torch flash", partial(chunk_attention, q, k, v, scale), 2)
                if dtype == torch.bfloat16 and amx_available():
                    row(f"MLA prefill attention {chunk} of {T}, AMX tiles", partial(prefill_attention, q, k, v, scale), 2)
                if profile and T == lengths[0]:
                    from torch.profiler import ProfilerActivity
                    from torch.profiler import profile as torch_profile

                    for title, fn in ((f"KDA layer prefill 1 x {T} {name}", partial(
                            kda_forward_with_state, kda, x, conv, rec, prefill_batch(T))),
                                      (f"MoE layer 1 x {T} {name}", partial(moe, x))):
                        with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                            fn()
                        profiles[title] = prof.key_averages(group_by_input_shape=True).table(
                            sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=32,
                            max_shapes_column_width=56)
            n = DECODE_SEQUENCES
            conv = torch.randn(2 * n, *reversed(conv_state_shape(kda))).transpose(-1, -2)  # the engine's layout
            rec = torch.randn(2 * n, *recurrent_state_shape(kda))
            batch = KDABatch(num_decodes=n, query_start_loc=torch.arange(n + 1, dtype=torch.int32),
                             state_indices=torch.arange(n, dtype=torch.int32) * 2, has_initial_state=None)
            x = torch.randn(n, cfg.hidden_size, dtype=dtype)
            row(f"KDA layer decode {n} sequences", partial(kda_forward_with_state, kda, x, conv, rec, batch), 50)
            row(f"MoE layer decode {n} tokens", partial(moe, x), 50)
    return dict(machine=machine_info(), threads=threads, timer="thread CPU" if threads == 1 else "wall", rows=rows,
                profiles=profiles)


def kda_parts(T: int, max_threads: int, repeats: int = 3) -> list[dict[str, Any]]:
    """The KDA layer's prefill of one T-token prompt on 1, 2, 4, ... max_threads threads, bf16 and fp32: wall ms
    of the whole layer and of each compiled part (the fastest of `repeats` calls); the rest is torch's ops."""
    import time

    import kernels.kda.recurrent_cpu as recurrent_cpu
    from model.vllm_plugin import kda_ops

    spent: dict[str, float] = {}

    def timed(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - start
        return call

    patched = [(kda_ops, "conv_silu_prefill_cpu", "conv + SiLU"), (kda_ops, "gated_rms_norm_cpu", "output norm"),
               (recurrent_cpu, "_gate_decay", "gate"), (recurrent_cpu, "_kda_rows_unchecked", "recurrence")]
    originals = [getattr(module, name) for module, name, _ in patched]
    for (module, name, label), fn in zip(patched, originals, strict=True):
        setattr(module, name, timed(fn, label))
    rows = []
    try:
        for dtype in (torch.bfloat16, torch.float32):
            torch.manual_seed(0)
            cfg = serving_config()
            kda = KimiDeltaAttention(cfg, 0).eval().to(dtype)
            x = torch.randn(T, cfg.hidden_size, dtype=dtype)
            conv, rec = torch.randn(4, *conv_state_shape(kda)), torch.randn(4, *recurrent_state_shape(kda))
            threads = 1
            while threads <= max_threads:
                torch.set_num_threads(threads)
                best: dict[str, float] | None = None
                with torch.no_grad():
                    kda_forward_with_state(kda, x, conv, rec, prefill_batch(T))
                    for _ in range(repeats):
                        spent.clear()
                        start = time.perf_counter()
                        kda_forward_with_state(kda, x, conv, rec, prefill_batch(T))
                        total = time.perf_counter() - start
                        if best is None or total < best["layer"]:
                            best = dict(spent, layer=total)
                rows.append(dict(case=f"KDA layer prefill 1 x {T}", dtype=str(dtype).removeprefix("torch."),
                                 threads=threads, ms={k: 1e3 * v for k, v in best.items()}))
                threads *= 2
    finally:
        for (module, name, _), fn in zip(patched, originals, strict=True):
            setattr(module, name, fn)
        torch.set_num_threads(1)
    return rows


def print_table(result: dict[str, Any]) -> None:
    print(describe(result["machine"]), f"| {result['threads']} threads, {result['timer']} time")
    by_case: dict[str, dict[str, float]] = {}
    for r in result["rows"]:
        by_case.setdefault(r["case"], {})[r["dtype"]] = r["ms"]
    width = max(len(case) for case in by_case)
    print(f"{'case':<{width}} {'bf16 ms':>10} {'fp32 ms':>10}")
    for case, ms in by_case.items():
        print(f"{case:<{width}} {ms.get('bfloat16', float('nan')):>10.3f} {ms.get('float32', float('nan')):>10.3f}")
    for title, table in result["profiles"].items():
        print(f"\n{title}\n{table}")
    for r in result.get("parts", []):
        print(f"{r['case']} {r['dtype']:<8} {r['threads']:>2} threads (wall ms): "
              + "  ".join(f"{k} {v:.2f}" for k, v in r["ms"].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--profile", action="store_true", help="torch profiler tables of the KDA and MoE prefills at the first length, per dtype")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (> 1: wall time)")
    ap.add_argument("--parts", action="store_true",
                    help="the KDA prefill's compiled parts at the last length, on 1, 2, 4, ... --threads threads")
    ap.add_argument("--out", default="benchmarks/results/cpu_layers.json")
    args = ap.parse_args()
    result = run(args.lengths, args.profile, args.threads)
    if args.parts:
        result["parts"] = kda_parts(args.lengths[-1], args.threads)
    print_table(result)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
