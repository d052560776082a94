"""RL step benchmark: time per step and its split (rollout / reward / learn / sync / idle), the learner
alone, and weight-push time vs parameter count. Prints a table and writes JSON.

    python benchmarks/rl_step.py job --preset tiny --steps 4            # full steps, sync then async (CPU, vLLM)
    python benchmarks/rl_step.py learner --preset small --device cuda   # learner only (no vLLM needed)
    python benchmarks/rl_step.py push --presets tiny,small              # weight push into a running engine
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this folder would come first on sys.path, and benchmarks/model.py would shadow `model`.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

SPLIT = ("time/step", "time/rollout", "time/reward", "time/learn", "time/sync", "time/idle", "time/checkpoint")


def _vllm_env() -> None:
    for k, v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false",
                 "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))


def _ray(num_cpus: int | None) -> None:
    import ray

    if not ray.is_initialized():
        keys = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CACHE_ROOT", "TOKENIZERS_PARALLELISM")
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {k: os.environ[k] for k in keys}})


def bench_job(args) -> dict:
    _vllm_env()
    _ray(args.num_cpus)
    from rl_service.hooks import InMemoryHooks
    from rl_service.spec import JobSpec
    from rl_service.training.runner import JobRunner

    out = {}
    for mode in ("sync", "async"):
        spec = JobSpec.model_validate({
            "model": {"preset": args.preset}, "total_steps": args.steps, "checkpoint_every": 1000,
            "tasks": {"num_train": 64, "num_eval": 0},
            "rollout": {"prompts_per_step": args.prompts, "num_generations": args.generations, "max_turns": 2,
                        "max_tokens_per_turn": 24, "max_total_tokens": 512, "async_mode": mode == "async"},
            "reward_schedule": {"kind": "linear", "w_start": 1.0, "w_end": 0.0, "horizon": 100},
        })
        hooks = InMemoryHooks()
        t0 = time.perf_counter()
        JobRunner(f"bench-{mode}", spec, hooks, Path(tempfile.mkdtemp(prefix=f"rl-step-{mode}-"))).run()
        wall = time.perf_counter() - t0
        steps = [m for _, m in hooks.metrics if "time/step" in m][1:]  # the first step warms up
        row = {k: statistics.mean(m[k] for m in steps) for k in SPLIT}
        row["idle_fraction"] = row["time/idle"] / row["time/step"]
        row["learner_tokens_per_s"] = statistics.mean(m.get("tokens_per_s", 0.0) for m in steps)
        row["weight_sync_s"] = statistics.mean(m["weight_sync_s"] for m in steps)
        row["logprob_mismatch"] = statistics.mean(m.get("logprob_mismatch/mean_abs", 0.0) for m in steps)
        row["staleness_max"] = max(m.get("staleness/max", 0.0) for m in steps)
        row["pool_start_s"] = [d for k, d in hooks.events if k == "rollout_pool_ready"][0]["seconds"]
        row["wall_s"] = wall
        out[mode] = row
    return out


def _synthetic_samples(n: int, vocab: int, prompt: int, completion: int, seed: int = 0):
    from rl_service.training.learner import PolicySample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        c = rng.randint(completion // 2, completion)
        mask = [1] * c
        if i % 2:
            mask[c // 2: c // 2 + 16] = [0] * min(16, c - c // 2)
        out.append(PolicySample([rng.randrange(vocab) for _ in range(prompt)], [rng.randrange(vocab) for _ in range(c)],
                                mask, [rng.gauss(0, 1) for _ in range(c)], [-6.0] * c))
    return out


def bench_learner(args) -> dict:
    import torch

    from model import TaperConfig, TaperForCausalLM
    from rl_service.training.learner import Learner, LearnerConfig

    torch.manual_seed(0)
    model = TaperForCausalLM(TaperConfig.preset(args.preset)).float().to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    cfg = LearnerConfig(loss_type="dapo", micro_batch_tokens=args.micro_batch_tokens, learning_rate=1e-5)
    learner = Learner(model, cfg, device=args.device, compile_layers=args.compile)
    samples = _synthetic_samples(args.prompts * args.generations, model.config.vocab_size, args.prompt_len,
                                 args.completion_len)
    times, first_s = [], 0.0
    for i in range(args.steps + 1):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        m = learner.step(samples)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
        else:
            first_s = time.perf_counter() - t0  # includes compiling, when the learner compiles the layers
    tokens = sum(s.num_tokens for s in samples)
    t0 = time.perf_counter()
    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    to_cpu = time.perf_counter() - t0
    row = {"device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
           "params": n_params, "samples": len(samples), "tokens": tokens, "micro_batches": m["num_micro_batches"],
           "compile_layers": learner.compiled_layers, "first_step_s": first_s,
           "step_s": statistics.mean(times), "tokens_per_s": tokens / statistics.mean(times),
           "state_dict_to_cpu_s": to_cpu, "state_mib": sum(v.numel() * v.element_size() for v in state.values()) / 2**20}
    if args.device.startswith("cuda"):
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def bench_push(args) -> list[dict]:
    _vllm_env()
    _ray(args.num_cpus)
    import torch

    from model import TaperConfig, TaperForCausalLM
    from model.tokenizer import load_tokenizer
    from rl_service.training.learner.weight_push import shippable_state_dict
    from rl_service.training.runner import seeded_vllm_engine
    from rollout_workers.engine import EngineConfig
    from rollout_workers.pool import RolloutPool

    rows = []
    tok = load_tokenizer()
    for preset in args.presets.split(","):
        torch.manual_seed(0)
        model = TaperForCausalLM(TaperConfig.preset(preset)).float()
        d = Path(tempfile.mkdtemp(prefix=f"push-{preset}-"))
        model.save_pretrained(d)
        tok.save_pretrained(d)
        t0 = time.perf_counter()
        engine = EngineConfig(model_dir=str(d), max_model_len=512, kv_cache_gib=0.25)
        import functools

        pool = RolloutPool(functools.partial(seeded_vllm_engine, engine), "calculator", 1, num_cpus_per_worker=1)
        start_s = time.perf_counter() - t0
        # plain tensors (pickled in band, as before) vs the job runner's ShippedTensors (out of band)
        plain = {k: v.detach() for k, v in model.state_dict().items()}
        pushes = [pool.push_weights(plain, v) for v in range(1, 4)]
        shipped = [pool.push_weights(shippable_state_dict(model), v) for v in range(4, 7)]
        # where a shipped push goes: the learner-side copy, the object-store put, the worker's engine load
        import ray

        split = []
        for v in range(7, 10):
            t0 = time.perf_counter()
            state = shippable_state_dict(model)
            t1 = time.perf_counter()
            ref = ray.put(state)
            t2 = time.perf_counter()
            worker_s = ray.get(pool.workers[0].load_weights.remote(ref, v))
            t3 = time.perf_counter()
            split.append((t1 - t0, t2 - t1, worker_s, t3 - t2 - worker_s))
        pool.shutdown()
        rows.append({"preset": preset, "params": sum(p.numel() for p in model.parameters()),
                     "mib": sum(v.numel() * v.element_size() for v in plain.values()) / 2**20,
                     "engine_start_s": start_s, "plain_push_s_mean": statistics.mean(pushes),
                     "plain_push_s_max": max(pushes), "push_s_mean": statistics.mean(shipped),
                     "push_s_max": max(shipped),
                     **{f"split_{k}_s": statistics.mean(x[i] for x in split)
                        for i, k in enumerate(("state_dict", "object_store_put", "engine_load", "transport"))}})
    return rows


def _table(title: str, rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = [title, " | ".join(keys), " | ".join("---" for _ in keys)]
    for r in rows:
        lines.append(" | ".join(f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k]) for k in keys))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["job", "learner", "push"])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=320)
    ap.add_argument("--completion-len", type=int, default=128)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--num-cpus", type=int, default=None)
    ap.add_argument("--compile", default="none", help="learner: compile_layers scope (none, auto, stack, parts)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.what == "job":
        res = bench_job(args)
        print(_table(f"RL step ({args.preset}, {args.prompts}x{args.generations} rollouts/step, seconds)",
                     [{"mode": k, **v} for k, v in res.items()]))
    elif args.what == "learner":
        res = bench_learner(args)
        print(_table(f"learner step ({args.preset})", [{"preset": args.preset, **res}]))
    else:
        res = bench_push(args)
        print(_table("weight push into a running engine", res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
