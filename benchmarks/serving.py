"""Serving benchmark in vLLM: our TaperForCausalLM vs a same-size Llama and a same-size Qwen3-Next.

All three are random-weight models of ~6.5M active parameters (the shipped tokenizer's vocabulary) served
by the same vLLM (in-process engine, eager, prefix caching off). For each context length a batch of
`--batch` distinct random prompts is submitted at once and `--new-tokens` tokens generated per request:
  prefill time   from submission until every sequence has its first token (wall and thread-CPU time);
  decode tok/s   tokens produced after that moment over the time since (not "total minus a prefill-only
                 run", which chunked prefill makes too noisy); the prefills are staggered (chunked, one
                 after another), so by then the first sequences may be done and fewer than `--batch` decode;
  full-batch     the steps in which all `--batch` sequences decode: tokens/s over their wall time and the
                 median thread-CPU ms per step (steadier than wall time on a shared box); only when
                 `--new-tokens` outlasts the stagger (at 16K, batch 8: about 30 steps, so 64 new tokens);
                 and the aten ops dispatched in one such step (counted in a step left out of the timing);
  cache memory   the bytes vLLM's cache needs for the batch at that context: attention layers
                 ceil(T / block) pages per sequence, KDA / gated-delta-net layers one state page per
                 sequence, page sizes as vLLM allocates them (hybrid page padding included).
Each model runs in its own process (fresh engine, no shared allocator state). Prints a table and writes
JSON to benchmarks/results/.

    nice python benchmarks/serving.py                          # CPU: contexts 512, 4K, 16K, batch 8
    python benchmarks/serving.py --quick                       # smoke run: short contexts, batch 2
    python benchmarks/serving.py --models taper llama --contexts 512 4096
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parents[1]
MODELS = ("taper", "llama", "qwen3_next")

# Same size by active parameters per token (~6.5M, embeddings included), same hidden width, depth and
# attention heads (8 x 32: vLLM's CPU attention needs head dim >= 32); both hybrids are 3:1.
HIDDEN, LAYERS, HEADS, HEAD_DIM = 256, 8, 8, 32


def build_checkpoint(name: str, out: Path, tokenizer_dir: Path, dtype: str) -> dict[str, int]:
    """Save a random-weight checkpoint of model `name` (with the tokenizer) and return its parameter counts."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = len(tok)
    torch.manual_seed(0)
    if name == "taper":
        from model.config import TaperConfig
        from model.modeling import TaperForCausalLM

        cfg = TaperConfig.preset(
            "tiny", vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=LAYERS, full_attn_layers=[3, 7],
            kda_num_heads=4, kda_head_dim=64, num_attention_heads=HEADS, qk_head_dim=HEAD_DIM,
            v_head_dim=HEAD_DIM, kv_lora_rank=128, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=128, moe_latent_size=128, shared_expert_intermediate_size=256,
            intermediate_size=768, torch_dtype=dtype,
        )
        model = TaperForCausalLM(cfg)
        counts = cfg.parameter_counts()
    elif name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            num_key_value_heads=HEADS, head_dim=HEAD_DIM, intermediate_size=640, max_position_embeddings=1 << 17,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, torch_dtype=dtype,
        )
        model = LlamaForCausalLM(cfg)
        n = sum(p.numel() for p in model.parameters())
        counts = {"total": n, "active": n}
    elif name == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        cfg = Qwen3NextConfig(
            vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            num_key_value_heads=HEADS, head_dim=HEAD_DIM, linear_num_key_heads=4, linear_num_value_heads=4,
            linear_key_head_dim=64, linear_value_head_dim=64, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=128, shared_expert_intermediate_size=256, full_attention_interval=4,
            decoder_sparse_step=1, max_position_embeddings=1 << 17, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id, torch_dtype=dtype,
        )
        model = Qwen3NextForCausalLM(cfg)
        total = sum(p.numel() for p in model.parameters())
        experts = sum(p.numel() for n_, p in model.named_parameters() if ".experts." in n_)
        counts = {"total": total, "active": int(total - experts + experts * 2 / 8)}
    else:
        raise ValueError(f"unknown model {name!r}; choose from {MODELS}")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return {"total": int(counts["total"]), "active": int(counts["active"])}


def cache_bytes(kv_cache_config: Any, batch: int, context: int) -> int:
    """Bytes of vLLM's cache pages the batch needs at `context` tokens per sequence."""
    from vllm.v1.kv_cache_interface import MambaSpec

    total = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        layers = len(group.layer_names)
        if isinstance(spec, MambaSpec):
            pages = 1
        else:
            pages = math.ceil(context / spec.block_size)
        total += batch * layers * pages * spec.page_size_bytes
    return total


class ModuleClock:
    """Thread-CPU seconds spent in each decoder layer's parts (the layers' direct children, keyed by class
    name), through forward hooks; `snapshot()` returns the totals so far."""

    def __init__(self, model: Any) -> None:
        self.totals: dict[str, float] = {}
        layers = model.model.layers
        for layer in layers:
            for child in layer.children():
                child.register_forward_pre_hook(self._enter)
                child.register_forward_hook(self._leave)
        self._started: dict[int, float] = {}

    def _enter(self, module: Any, _args: Any) -> None:
        self._started[id(module)] = time.thread_time()

    def _leave(self, module: Any, _args: Any, _out: Any) -> None:
        name = type(module).__name__
        self.totals[name] = self.totals.get(name, 0.0) + time.thread_time() - self._started.pop(id(module))

    def snapshot(self) -> dict[str, float]:
        return dict(self.totals)


def op_counter() -> Any:
    """A torch dispatch mode whose `count` is the aten ops dispatched while it is active: a step's op count
    is what its CPU time mostly pays for at decode sizes, and unlike the time it does not depend on the
    machine. (Built here: this module imports torch only in the worker.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCounter(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))

    return OpCounter()


def run_worker(args: argparse.Namespace) -> None:
    """One model in this process: a fresh engine, every context, one JSON line per context on stdout."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # on CPU it would override kv_cache_memory_bytes
    import torch

    # One torch thread by default (the tables' setting: multi-threaded small ops spin-wait on a shared box); the
    # in-process CPU worker blocks the call that would set it, so set it before the engine starts. More threads:
    # the matmuls and attention use them, and so do our compiled passes (kernels/cpu_threads.py).
    torch.set_num_threads(args.threads)
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    max_context = max(args.contexts)
    llm = LLM(
        model=args.model_dir, dtype=args.dtype, enforce_eager=True, enable_prefix_caching=False,
        max_model_len=max_context + args.new_tokens + 8, max_num_seqs=args.batch,
        kv_cache_memory_bytes=args.kv_cache_gib << 30, seed=0,
    )
    engine = llm.llm_engine
    kv_cache_config = engine.engine_core.engine_core.scheduler.kv_cache_config
    served = engine.model_executor.driver_worker.worker.model_runner.model
    compute_dtype = str(getattr(served, "compute_dtype", served.lm_head.weight.dtype)).removeprefix("torch.")
    vocab = llm.get_tokenizer().vocab_size
    warmup = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(3, 67))}] * 2, warmup, use_tqdm=False)
    clock = ModuleClock(served) if args.profile_modules else None
    # CUMULATIVE: the engine reports every step's progress (LLM.generate switches its params to FINAL_ONLY)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.CUMULATIVE)
    gen = torch.Generator().manual_seed(0)
    for context in args.contexts:
        prompts = [torch.randint(3, vocab, (context,), generator=gen).tolist() for _ in range(args.batch)]
        start, cpu_start = time.perf_counter(), time.thread_time()
        modules_start = clock.snapshot() if clock else {}
        modules_prefill: dict[str, float] = {}
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{context}-{i}", {"prompt_token_ids": prompt}, params)
        produced: dict[str, int] = {}
        first_all = tokens_at_first = prefill_cpu = None
        now = start
        full_cpu: list[float] = []  # thread-CPU seconds of each step in which all `batch` sequences decode
        full_wall: list[float] = []
        step_ops = None  # aten ops of one full-batch decode step (that step's time is not recorded)
        while engine.has_unfinished_requests():
            before, cpu0, wall0 = sum(produced.values()), time.thread_time(), now
            counter = op_counter() if step_ops is None and len(full_cpu) >= 4 else None
            with counter or contextlib.nullcontext():
                for out in engine.step():
                    produced[out.request_id] = len(out.outputs[0].token_ids)
            now = time.perf_counter()
            if first_all is not None and sum(produced.values()) - before == args.batch:
                if counter:
                    step_ops = counter.count
                else:
                    full_cpu.append(time.thread_time() - cpu0)
                    full_wall.append(now - wall0)
            if first_all is None and len(produced) == args.batch and min(produced.values()) >= 1:
                first_all, tokens_at_first = now, sum(produced.values())
                prefill_cpu = time.thread_time() - cpu_start
                if clock:
                    modules_prefill = {k: v - modules_start.get(k, 0.0) for k, v in clock.snapshot().items()}
        decode_tokens = sum(produced.values()) - tokens_at_first
        row = {
            "context": context,
            "prefill_s": first_all - start,
            "prefill_cpu_s": prefill_cpu,  # this thread's CPU time over the same span: steadier on a shared box
            "decode_tok_s": decode_tokens / (now - first_all) if now > first_all else float("nan"),
            "decode_tokens": decode_tokens,
            # steady decode of the whole batch (none while `--new-tokens` is within the prefills' stagger)
            "full_batch_steps": len(full_cpu),
            "full_batch_tok_s": args.batch * len(full_wall) / sum(full_wall) if full_wall else float("nan"),
            "full_batch_step_cpu_ms": 1e3 * statistics.median(full_cpu) if full_cpu else float("nan"),
            "full_batch_step_aten_ops": step_ops,
            "cache_bytes": cache_bytes(kv_cache_config, args.batch, context),
            "load_avg": os.getloadavg()[0],
            "compute_dtype": compute_dtype,
        }
        if clock:  # thread-CPU seconds per layer part over the prefill span
            row["prefill_cpu_s_by_module"] = {k: round(v, 3) for k, v in sorted(modules_prefill.items())}
        print("RESULT " + json.dumps(row), flush=True)


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.machine import describe, machine_info
    from model.tokenizer import TOKENIZER_DIR

    machine = machine_info()
    print(f"machine: {describe(machine)}", flush=True)
    results: dict[str, Any] = {
        "machine": machine,
        "settings": {"batch": args.batch, "new_tokens": args.new_tokens, "dtype": args.dtype,
                     "contexts": args.contexts, "threads": args.threads,
                     "engine": f"vLLM in-process, eager, prefix caching off, {args.threads} torch thread(s)"},
        "models": {},
    }
    with tempfile.TemporaryDirectory(prefix="taper-serving-") as tmp:
        for name in args.models:
            model_dir = Path(tmp) / name
            counts = build_checkpoint(name, model_dir, Path(TOKENIZER_DIR), args.dtype)
            cmd = [sys.executable, __file__, "--worker", "--model-dir", str(model_dir), "--dtype", args.dtype,
                   "--batch", str(args.batch), "--new-tokens", str(args.new_tokens),
                   "--kv-cache-gib", str(args.kv_cache_gib), "--threads", str(args.threads),
                   "--contexts", *map(str, args.contexts)]
            cmd += ["--profile-modules"] if args.profile_modules else []
            print(f"[{name}] {counts['active'] / 1e6:.2f}M active / {counts['total'] / 1e6:.2f}M total params",
                  flush=True)
            env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "VLLM_CONFIGURE_LOGGING": "0"}
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            rows = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or len(rows) != len(args.contexts):
                print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n", file=sys.stderr)
                raise RuntimeError(f"benchmark worker for {name} failed (exit {proc.returncode})")
            results["models"][name] = {"params": counts, "runs": rows}
            for row in rows:
                print(f"  T={row['context']:>6}: prefill {row['prefill_s']:.2f}s ({row['prefill_cpu_s']:.2f}s CPU), decode {row['decode_tok_s']:.1f} tok/s, "
                      f"full batch {row['full_batch_tok_s']:.1f} tok/s / {row['full_batch_step_cpu_ms']:.1f} ms CPU "
                      f"per step over {row['full_batch_steps']} steps ({row['full_batch_step_aten_ops']} aten ops), cache {row['cache_bytes'] / 2**20:.1f} MiB, "
                      f"load {row['load_avg']:.1f}, computing in {row['compute_dtype']}", flush=True)
    return results


def print_table(results: dict[str, Any]) -> None:
    """One line per model and context; the ratios are against the Llama (/L) and Qwen3-Next (/Q) at the
    same context: prefill wall and CPU time (lower is better), decode and full-batch decode rates, and the
    full-batch step's CPU time against Qwen3-Next's as a rate (its ms over ours: higher is better)."""
    models = results["models"]
    base, qwen = models.get("llama"), models.get("qwen3_next")
    head = (f"{'model':<11} {'context':>7} {'prefill s':>10} {'prefill CPU s':>14} {'decode tok/s':>13} {'full tok/s':>11} "
            f"{'step CPU ms':>12} {'cache MiB':>10}")
    if base:
        head += f" {'prefill/L':>10} {'pCPU/L':>7} {'decode/L':>9} {'full/L':>7} {'step/L':>7} {'cache/L':>8}"
    if qwen:
        head += f" {'prefill/Q':>10} {'pCPU/Q':>7} {'decode/Q':>9} {'full/Q':>7} {'step/Q':>7}"
    print(head)
    for name, data in models.items():
        for i, row in enumerate(data["runs"]):
            line = (f"{name:<11} {row['context']:>7} {row['prefill_s']:>10.2f} {row.get('prefill_cpu_s', math.nan):>14.2f} "
                    f"{row['decode_tok_s']:>13.1f} {row.get('full_batch_tok_s', math.nan):>11.1f} "
                    f"{row.get('full_batch_step_cpu_ms', math.nan):>12.1f} {row['cache_bytes'] / 2**20:>10.1f}")
            for ref, extra in ((base, True), (qwen, False)):
                if not ref:
                    continue
                ref = ref["runs"][i]
                line += (f" {row['prefill_s'] / ref['prefill_s']:>9.2f}x {_ratio(row, ref, 'prefill_cpu_s'):>6.2f}x"
                         f" {row['decode_tok_s'] / ref['decode_tok_s']:>8.2f}x {_ratio(row, ref, 'full_batch_tok_s'):>6.2f}x"
                         f" {_ratio(ref, row, 'full_batch_step_cpu_ms'):>6.2f}x")
                if extra:
                    line += f" {row['cache_bytes'] / ref['cache_bytes']:>7.2f}x"
            print(line)
    for name, data in models.items():
        for row in data["runs"]:
            if "prefill_cpu_s_by_module" in row:
                parts = ", ".join(f"{k} {v:.2f}" for k, v in row["prefill_cpu_s_by_module"].items())
                print(f"{name} {row['context']}: prefill CPU s by layer part: {parts}")


def _ratio(row: dict[str, Any], ref: dict[str, Any], key: str) -> float:
    a, b = row.get(key, math.nan), ref.get(key, math.nan)
    return a / b if b and not math.isnan(b) else math.nan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--contexts", nargs="+", type=int, default=[512, 4096, 16384])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the engine (thread-CPU columns then cover the engine thread only)")
    parser.add_argument("--quick", action="store_true", help="smoke run: contexts 128 512, batch 2, 8 tokens")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/serving_cpu.json)")
    parser.add_argument("--profile-modules", action="store_true",
                        help="also record the prefill's thread-CPU time per layer part (forward hooks)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return
    if args.quick:
        args.contexts, args.batch, args.new_tokens = [128, 512], 2, 8
    results = run_all(args)
    print()
    print_table(results)
    out = args.out or RESULTS_DIR / ("serving_cpu_quick.json" if args.quick else "serving_cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    main()
