"""Decode steps (or prefills) of the serving benchmark's models, interleaved in one process: a paired comparison.

`serving.py` runs each model in its own process, one after another; on a shared machine the host's load
changes between them and moves a model's step time by up to ~2x from one run to the next (docs/benchmarks/serving.md,
issue 30). Here every model's engine lives in one process and the measurement takes rounds: one decode step of
each model per round, so a busy moment slows all of them alike. The comparison is the per-round ratio of each
model's step time to the first model's (its median and range over the rounds).

Per context, `--phase decode` (the default): `--batch` prompts of that length per model, prefilled until every
request decodes, then `--rounds` rounds of one full-batch decode step per model (thread-CPU ms). `--phase
prefill`: `--rounds` rounds of one prefill of `--batch` new prompts per model, thread-CPU seconds from adding the
prompts until every request has its first token (each asks for one token, so none decodes meanwhile; vLLM's
default chunking, as in `serving.py`). Prints a table and writes JSON.

    python benchmarks/serving_interleaved.py                            # decode at 512 and 16K, batch 8
    python benchmarks/serving_interleaved.py --contexts 512 --rounds 100
    python benchmarks/serving_interleaved.py --phase prefill --contexts 4096 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving import MODELS, RESULTS_DIR, build_checkpoint  # noqa: E402


def decoding_engine(model_dir: Path, dtype: str, batch: int, context: int, rounds: int) -> Any:
    """An engine serving `model_dir` with `batch` requests of `context` prompt tokens, stepped until every
    request decodes; enough tokens left for `rounds` more steps."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype=dtype, enforce_eager=True, enable_prefix_caching=False,
              max_model_len=context + rounds + 64, max_num_seqs=batch, max_num_batched_tokens=max(2048, context),
              kv_cache_memory_bytes=(3 << 30) if context > 4096 else (1 << 28), seed=0)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=rounds + 32, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), {"prompt_token_ids": [3 + (i * 7 + j) % 1500 for j in range(context)]}, params)
    generated: dict[str, int] = {}
    while len(generated) < batch or min(generated.values()) < 3:
        for out in engine.step():
            generated[out.request_id] = len(out.outputs[0].token_ids)
    return llm


def prefilling_engine(model_dir: Path, dtype: str, batch: int, context: int) -> Any:
    """An engine for prefills of `batch` prompts of `context` tokens (settings as `serving.py`'s), warmed up."""
    from vllm import LLM

    llm = LLM(model=str(model_dir), dtype=dtype, enforce_eager=True, enable_prefix_caching=False,
              max_model_len=context + 8, max_num_seqs=batch,
              kv_cache_memory_bytes=(3 << 30) if context > 4096 else (1 << 28), seed=0)
    warmup = min(context, 2048)  # compiled passes and caches ready before the first measured round
    prefill_cpu_s(llm, [[3 + (i + j) % 1500 for j in range(warmup)] for i in range(batch)], "warmup")
    return llm


def prefill_cpu_s(llm: Any, prompts: list[list[int]], tag: str) -> float:
    """Thread-CPU seconds until every prompt has its first (and only) token."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.thread_time()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.thread_time() - start


def result_keys(phase: str) -> tuple[str, str]:
    """A result row's keys for the phase's times and their ratios to the first model's."""
    return ("prefill_cpu_s", "prefill_ratio_to_first") if phase == "prefill" else ("step_ms", "step_ratio_to_first")


def measure(models: list[str], context: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from model.tokenizer import TOKENIZER_DIR

    engines = {}
    for name in models:
        model_dir = tmp / f"{name}-{context}"
        build_checkpoint(name, model_dir, Path(TOKENIZER_DIR), args.dtype)
        engines[name] = (prefilling_engine(model_dir, args.dtype, args.batch, context) if args.phase == "prefill"
                         else decoding_engine(model_dir, args.dtype, args.batch, context, args.rounds))
    times: dict[str, list[float]] = {name: [] for name in models}
    for r in range(args.rounds):
        if args.phase == "prefill":
            prompts = [[3 + (r * 131 + i * 7 + j) % 1500 for j in range(context)] for i in range(args.batch)]
        for name, llm in engines.items():
            if args.phase == "prefill":
                times[name].append(prefill_cpu_s(llm, prompts, f"round{r}"))
            else:
                start = time.thread_time()
                llm.llm_engine.step()
                times[name].append((time.thread_time() - start) * 1e3)
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    first = models[0]
    time_key, ratio_key = result_keys(args.phase)
    row: dict[str, Any] = {"context": context, "phase": args.phase, time_key: {}, ratio_key: {}}
    for name, values in times.items():
        row[time_key][name] = {"median": statistics.median(values), "min": min(values),
                               "p90": sorted(values)[int(0.9 * len(values))]}
        ratios = [t / f for t, f in zip(values, times[first], strict=True)]
        row[ratio_key][name] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS,
                        help="the first is the reference of the ratios")
    parser.add_argument("--phase", default="decode", choices=["decode", "prefill"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[512, 16384])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "serving_interleaved.json")
    args = parser.parse_args()
    if args.batch < 1 or args.rounds < 1 or min(args.contexts) < 1:
        parser.error("--batch, --rounds and --contexts must be positive")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # on CPU it would override kv_cache_memory_bytes
    import torch

    torch.set_num_threads(1)
    from benchmarks.machine import describe, machine_info

    machine = machine_info()
    print(f"machine: {describe(machine)}", flush=True)
    results: dict[str, Any] = {"machine": machine, "settings": {
        "phase": args.phase, "batch": args.batch, "rounds": args.rounds, "dtype": args.dtype, "threads": 1,
        "engine": "vLLM in-process, eager, prefix caching off; all models' engines in one process"}, "runs": []}
    with tempfile.TemporaryDirectory(prefix="taper-interleaved-") as tmp:
        for context in args.contexts:
            results["runs"].append(measure(args.models, context, args, Path(tmp)))
    what = ("thread-CPU s per prefill of the batch" if args.phase == "prefill"
            else "thread-CPU ms per full-batch decode step")
    time_key, ratio_key = result_keys(args.phase)
    print(f"\n{what} (batch {args.batch}, {args.rounds} rounds); ratio: the model's time over {args.models[0]}'s in "
          f"the same round")
    print(f"{'context':>8} {'model':<12} {'median':>8} {'min':>8} {'p90':>8} {'ratio median':>13} {'ratio range':>14}")
    for row in results["runs"]:
        for name in args.models:
            step, ratio = row[time_key][name], row[ratio_key][name]
            print(f"{row['context']:>8} {name:<12} {step['median']:8.2f} {step['min']:8.2f} {step['p90']:8.2f} "
                  f"{ratio['median']:12.2f}x {ratio['min']:6.2f}-{ratio['max']:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
