"""Serving on one GPU: our KDA hybrid (`small`) against a Llama and a Qwen3-Next-style Gated DeltaNet hybrid of
the same active size, each in its own vLLM engine in turn, in one process, random weights, bf16, CUDA graphs on.

Per model and (context, batch): `batch` prompts of `context` random tokens, 64 new tokens each. The engine is
stepped by hand; a step is a decode step when no request is waiting and every running one is past its prompt.
Reported: decode tokens/s over the decode steps and their median step time, the concurrency reached (the most
requests running at once: where a model's cache cannot hold the batch, vLLM runs fewer), the prefill tokens/s
(prompt tokens over the time until every request has its first token: a pure prefill rate where the
batch fits at once), the mean time to first token,
and the cache bytes one sequence of the context needs (KV pages and recurrent-state pages, from the engine's
cache layout). For ours also the weight push of the whole model from GPU tensors into the running engine.

    python benchmarks/serving_gpu.py                                  # the default grid, all three models
    python benchmarks/serving_gpu.py --models taper llama --cases 4096x64 32768x256
    python benchmarks/serving_gpu.py --report benchmarks/results/serving_gpu_*.json   # one table of several

Writes benchmarks/results/serving_gpu_<models>.json with the GPU, vLLM and torch versions.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving import cache_bytes  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MODELS = ("taper", "llama", "qwen3_next")
NEW_TOKENS = 64
DEFAULT_CASES = ("4096x64", "4096x256", "32768x64", "32768x256", "131072x16")
VOCAB = 1536
# The `small` preset's width, depth and attention heads for all three; the Llama's MLP and Qwen3-Next's experts
# sized so that the active parameters per token are within ~15% of ours (the JSON records each count).
HIDDEN, LAYERS, HEADS, HEAD_DIM = 768, 12, 12, 64


def build_checkpoint(name: str, out: Path) -> dict[str, int]:
    """A random-weight bf16 checkpoint of model `name` in `out`; returns its parameter counts."""
    import torch

    torch.manual_seed(0)
    if name == "taper":
        from model.config import TaperConfig
        from model.modeling import TaperForCausalLM

        cfg = TaperConfig.preset("small", vocab_size=VOCAB, max_position_embeddings=1 << 18)
        model = TaperForCausalLM(cfg)
        counts = cfg.parameter_counts()
    elif name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                          num_key_value_heads=HEADS, head_dim=HEAD_DIM, intermediate_size=1536,
                          max_position_embeddings=1 << 18)
        model = LlamaForCausalLM(cfg)
        n = sum(p.numel() for p in model.parameters())
        counts = {"total": n, "active": n}
    elif name == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        cfg = Qwen3NextConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            num_key_value_heads=HEADS, head_dim=HEAD_DIM, linear_num_key_heads=6, linear_num_value_heads=6,
            linear_key_head_dim=128, linear_value_head_dim=128, num_experts=16, num_experts_per_tok=2,
            moe_intermediate_size=256, shared_expert_intermediate_size=512, full_attention_interval=4,
            decoder_sparse_step=1, max_position_embeddings=1 << 18,
        )
        model = Qwen3NextForCausalLM(cfg)
        total = sum(p.numel() for p in model.parameters())
        experts = sum(p.numel() for n_, p in model.named_parameters() if ".experts." in n_)
        counts = {"total": total, "active": int(total - experts + experts * 2 / 16)}
    else:
        raise ValueError(f"unknown model {name!r}; choose from {MODELS}")
    model.to(torch.bfloat16).save_pretrained(out)
    return {"total": int(counts["total"]), "active": int(counts["active"])}


def _scheduler(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler  # in-process engine core


def run_case(llm: Any, context: int, batch: int, seed: int) -> dict[str, Any]:
    """`batch` prompts of `context` tokens, NEW_TOKENS each, stepped by hand (see the module docstring)."""
    import torch
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine, sched = llm.llm_engine, _scheduler(llm)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    added: dict[str, float] = {}
    for i in range(batch):
        rid = f"{seed}-{i}"
        engine.add_request(rid, {"prompt_token_ids": torch.randint(3, VOCAB, (context,), generator=gen).tolist()},
                           params)
        added[rid] = time.perf_counter()
    first: dict[str, float] = {}
    decode_steps: list[tuple[float, int]] = []
    concurrency = 0
    while engine.has_unfinished_requests():
        decoding = len(sched.waiting) == 0 and all(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running)
        concurrency = max(concurrency, len(sched.running))
        start = time.perf_counter()
        outs = engine.step()
        torch.cuda.synchronize()
        now = time.perf_counter()
        for o in outs:
            if o.request_id not in first and o.outputs[0].token_ids:
                first[o.request_id] = now
        if decoding:
            decode_steps.append((now - start, sum(len(o.outputs[0].token_ids) for o in outs)))
    prefill_s = max(first.values()) - min(added.values())
    decode_s = sum(s for s, _ in decode_steps)
    decode_tokens = sum(n for _, n in decode_steps)
    return {
        "context": context, "batch": batch, "new_tokens": NEW_TOKENS, "concurrency": concurrency,
        "decode_tok_s": decode_tokens / decode_s if decode_s else None,
        "decode_step_ms_median": 1e3 * statistics.median(s for s, _ in decode_steps) if decode_steps else None,
        "decode_steps": len(decode_steps),
        "prefill_tok_s": batch * context / prefill_s,
        "ttft_s_mean": statistics.fmean(first[r] - added[r] for r in first) if first else None,
        "cache_bytes_per_sequence": cache_bytes(sched.kv_cache_config, 1, context + NEW_TOKENS),
        "cache_blocks": sched.kv_cache_config.num_blocks,
    }


def time_weight_push(llm: Any, model_dir: Path, repeats: int = 5) -> dict[str, float]:
    """Seconds to push the whole model from GPU tensors into the running engine (median of `repeats`)."""
    import torch

    from model.modeling import TaperForCausalLM
    from model.vllm_plugin import push_weights

    model = TaperForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    state = {name: t.detach() for name, t in model.state_dict().items()}
    times = [push_weights(llm, state) for _ in range(repeats)]
    return {"push_s_median": statistics.median(times), "push_s_max": max(times),
            "push_bytes": sum(t.numel() * t.element_size() for t in state.values())}


def run_model(name: str, cases: list[tuple[int, int]], gpu_memory_utilization: float, eager: bool) -> dict[str, Any]:
    import torch
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    with tempfile.TemporaryDirectory(prefix=f"serving-gpu-{name}-") as tmp:
        model_dir = Path(tmp)
        counts = build_checkpoint(name, model_dir)
        longest = max(c for c, _ in cases) + NEW_TOKENS + 16
        start = time.perf_counter()
        llm = LLM(model=str(model_dir), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=longest,
                  max_num_seqs=max(b for _, b in cases), max_num_batched_tokens=16384, enable_prefix_caching=False,
                  gpu_memory_utilization=gpu_memory_utilization, enforce_eager=eager, seed=0)
        up_s = time.perf_counter() - start
        row: dict[str, Any] = {"model": name, "params": counts, "cuda_graphs": not eager, "engine_up_s": up_s,
                               "cases": []}
        run_case(llm, 512, 8, seed=99)  # warm-up: kernels compiled and tuned outside the measurements
        for seed, (context, batch) in enumerate(cases):
            result = run_case(llm, context, batch, seed)
            print(json.dumps({"model": name, **result}), flush=True)
            row["cases"].append(result)
        if name == "taper":
            row["weight_push"] = time_weight_push(llm, model_dir)
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
        torch.cuda.empty_cache()
    return row


def versions() -> dict[str, Any]:
    import torch
    import vllm

    from benchmarks.machine import machine_info

    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1), "vllm": vllm.__version__,
            "torch": torch.__version__, "cuda": torch.version.cuda, "host": machine_info()}


def print_table(results: list[dict[str, Any]]) -> None:
    """One line per model and case, with ours over the Llama (/L) and over Qwen3-Next (/Q) where both ran."""
    rows = {(r["model"], c["context"], c["batch"]): c for r in results for c in r["cases"]}
    print(f"{'model':<11} {'context':>7} {'batch':>5} {'conc':>4} {'decode tok/s':>12} {'step ms':>8} "
          f"{'prefill tok/s':>13} {'TTFT s':>7} {'cache MiB/seq':>13} {'dec /L':>6} {'dec /Q':>6}")

    def ratio(a: Any, b: Any) -> str:
        return f"{a / b:6.2f}" if a and b else "     -"

    graphs = {r["model"]: r.get("cuda_graphs", True) for r in results}
    for (model, context, batch), c in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        ours = model == "taper"
        print(f"{model + ('' if graphs[model] else '*'):<11} {context:>7} {batch:>5} {c['concurrency']:>4} {fmt(c['decode_tok_s'], '12.0f')} "
              f"{fmt(c['decode_step_ms_median'], '8.2f')} {fmt(c['prefill_tok_s'], '13.0f')} "
              f"{fmt(c['ttft_s_mean'], '7.2f')} {c['cache_bytes_per_sequence'] / 2**20:13.1f} "
              f"{ratio(c['decode_tok_s'], rows.get(('llama', context, batch), {}).get('decode_tok_s')) if ours else '':>6} "
              f"{ratio(c['decode_tok_s'], rows.get(('qwen3_next', context, batch), {}).get('decode_tok_s')) if ours else '':>6}")
    if not all(graphs.values()):
        print("* served without CUDA graphs")
    for r in results:
        if "weight_push" in r:
            w = r["weight_push"]
            print(f"weight push ({r['model']}, {w['push_bytes'] / 2**20:.0f} MiB from GPU tensors): "
                  f"median {w['push_s_median'] * 1e3:.1f} ms, max {w['push_s_max'] * 1e3:.1f} ms")


def parse_case(text: str) -> tuple[int, int]:
    try:
        context, batch = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a case is CONTEXTxBATCH, e.g. 32768x256; got {text!r}") from None
    return context, batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--cases", nargs="+", type=parse_case, default=[parse_case(c) for c in DEFAULT_CASES])
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--eager", nargs="*", default=[], choices=MODELS, help="models served without CUDA graphs")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: benchmarks/results/...)")
    parser.add_argument("--report", nargs="+", type=Path, help="print the table of these JSON files and exit")
    args = parser.parse_args()
    if args.report:
        print_table([r for p in args.report for r in json.loads(p.read_text())["results"]])
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("serving_gpu.py needs a CUDA GPU")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: the scheduler is read each step
    import model.vllm_plugin as plugin

    plugin.register()
    results = [run_model(name, args.cases, args.gpu_memory_utilization, name in args.eager) for name in args.models]
    out = args.out or RESULTS_DIR / f"serving_gpu_{'_'.join(args.models)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": versions(), "new_tokens": NEW_TOKENS, "results": results}, indent=1))
    print_table(results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
