"""The curriculum benchmark: the same RL budget four ways, on `calculator` and `long_horizon`.

Variants (docs/design.md section 6):
  outcome_only     w(t) = 0: plain outcome GRPO
  dense            process rewards at full weight throughout (decoupled credit assignment)
  dense_to_sparse  w(t) decays linearly 1 -> 0 over the run (decoupled credit assignment)
  summed           the naive baseline: w(t) 1 -> 0 summed into the reward before group normalisation

Each environment gets one warm start (the tiny model, SFT as in `taper demo`: on calculator gold traces
until it copies reliably, then a mix where only a quarter of the traces use the tool; on long_horizon a short
SFT on gold traces, so the chains are only partly learned); every variant and seed then trains from it with
the real job runner (rollouts in vLLM, rewards, learner) offline, the seed setting the tasks and the
sampling. Reports the held-out success rate before and after and the first step whose training success
(moving average) reaches the threshold; prints a table, writes JSON and a plot.

    python -m benchmarks.curriculum --seeds 3 --steps 10   (from the repository root)

The tool_chain protocol (`python -m benchmarks.curriculum --protocol tool_chain`), fixed before its runs:
  task          tool_chain, k in {2, 3} dependent one-operation calculator calls; 100 held-out tasks per seed
  warm start    one, shared by every variant, seed and k: the tiny model, SFT on 2000 gold k = 1 traces only
                (at most 400 steps, stopping at loss 0.05), cached on disk; chaining must be learnt by RL
  variants      outcome_only (w = 0), dense (w = 1), dense_to_sparse (linear 1 -> 0), dense_to_sparse_cosine
                (cosine 1 -> 0), all with decoupled credit; summed (linear 1 -> 0 summed into the reward before
                group normalisation) as the naive baseline; the horizon of every decay is the run's length
  budget        40 RL steps x 4 tasks x 8 samples per run (DAPO, lr 5e-4, T = 0.8, k + 2 turns, 320 tokens)
  seeds         0-4 (a seed sets the training and held-out tasks and the sampling), paired across variants
  primary       greedy success on the 100 held-out tasks after the last step (the warm start's own held-out
                success is measured once per seed and k, in that seed's outcome_only run)
  secondary     area under the training-success curve (its mean over steps), first step whose 5-step moving
                average of training success reaches 50%, hacking-monitor warnings (with the raw process reward)
  report        mean and standard deviation per variant and k; dense_to_sparse - outcome_only per seed with a
                paired bootstrap 95% interval (10,000 resamples of the seeds); a plot of the training-success
                curves (mean and min-max band over seeds) and the final held-out success per variant and k
  order         k = 2 before k = 3, seed by seed, every variant of a seed before the next seed; one run at a time;
                each run writes its JSON when it ends and a finished run is never rerun
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from api.cli.demo import MEASURED_ALGORITHM

VARIANTS: dict[str, dict[str, Any]] = {
    "outcome_only": {"reward_schedule": {"kind": "constant", "w_start": 0.0, "w_end": 0.0},
                     "algorithm": {"credit_assignment": "decoupled"}},
    "dense": {"reward_schedule": {"kind": "constant", "w_start": 1.0, "w_end": 1.0},
              "algorithm": {"credit_assignment": "decoupled"}},
    "dense_to_sparse": {"reward_schedule": {"kind": "linear", "w_start": 1.0, "w_end": 0.0},
                        "algorithm": {"credit_assignment": "decoupled"}},
    "summed": {"reward_schedule": {"kind": "linear", "w_start": 1.0, "w_end": 0.0},
               "algorithm": {"credit_assignment": "summed"}},
}

ENV_ROLLOUT = {
    "calculator": {"max_turns": 3, "max_tokens_per_turn": 48, "max_total_tokens": 256},
    "long_horizon": {"max_turns": 4, "max_tokens_per_turn": 40, "max_total_tokens": 512},
}
# a chain of two boxes out of ten: at four the tiny model's warm start never completed one (docs/benchmarks/curriculum.md)
ENV_TASKS: dict[str, dict[str, Any]] = {"calculator": {}, "long_horizon": {"chain_length": 2, "num_boxes": 10}}
# (gold SFT steps at most, target loss, mixed SFT steps, tool-use fraction of the mix) per environment
WARM_START = {"calculator": (400, 0.05, 40, 0.25), "long_horizon": (400, 0.1, 0, 1.0)}


def job_spec(env: str, variant: str, seed: int, steps: int, checkpoint: Path) -> dict[str, Any]:
    v = VARIANTS[variant]
    schedule = dict(v["reward_schedule"], horizon=steps)
    return {
        "name": f"curriculum-{env}-{variant}-{seed}",
        "model": {"preset": "tiny", "checkpoint_dir": str(checkpoint)},  # the runner directly: no control plane
        "environment": {"name": env},
        "tasks": {"seed": seed, "num_train": 5000, "num_eval": 50, "options": ENV_TASKS[env]},
        "algorithm": {"loss_type": "dapo", "learning_rate": 5e-4, **MEASURED_ALGORITHM, **v["algorithm"]},
        "rollout": {"prompts_per_step": 4, "num_generations": 8, "temperature": 0.6, **ENV_ROLLOUT[env]},
        "reward_schedule": schedule,
        "total_steps": steps,
        "checkpoint_every": steps,
        "seed": seed,
    }


def run_one(env: str, variant: str, seed: int, steps: int, work: Path, checkpoint: Path) -> dict[str, Any]:
    from rl_service.hooks import InMemoryHooks
    from rl_service.spec import JobSpec
    from rl_service.training.runner import JobRunner

    spec = JobSpec.model_validate(job_spec(env, variant, seed, steps, checkpoint))
    hooks = InMemoryHooks(spec.reward_schedule)
    started = time.monotonic()
    state = JobRunner(f"{env}-{variant}-{seed}", spec, hooks, work / f"{env}-{variant}-{seed}").run()
    metrics = [m for _, m in hooks.metrics]
    evals = [m for m in metrics if "eval/success_rate" in m]
    train = [m for m in metrics if "success_rate" in m]
    return {
        "env": env, "variant": variant, "seed": seed, "state": state,
        "eval_before": evals[0]["eval/success_rate"] if evals else None,
        "eval_after": evals[-1]["eval/success_rate"] if evals else None,
        "train_success": [m["success_rate"] for m in train],
        "wall_s": time.monotonic() - started,
    }


def steps_to(curve: list[float], threshold: float, window: int = 5) -> int | None:
    """First step whose moving average over `window` steps reaches the threshold."""
    for i in range(len(curve)):
        chunk = curve[max(0, i - window + 1): i + 1]
        if sum(chunk) / len(chunk) >= threshold:
            return i
    return None


# ---------------------------------------------------------------- the tool_chain protocol (see the docstring)

PROTOCOL_VARIANTS: dict[str, dict[str, Any]] = {
    "outcome_only": VARIANTS["outcome_only"],
    "dense": VARIANTS["dense"],
    "dense_to_sparse": VARIANTS["dense_to_sparse"],
    "dense_to_sparse_cosine": {"reward_schedule": {"kind": "cosine", "w_start": 1.0, "w_end": 0.0},
                               "algorithm": {"credit_assignment": "decoupled"}},
    "summed": VARIANTS["summed"],
}
PROTOCOL: dict[str, Any] = {
    "env": "tool_chain", "ks": [2, 3], "seeds": [0, 1, 2, 3, 4], "steps": 40, "prompts_per_step": 4,
    "num_generations": 8, "temperature": 0.8, "learning_rate": 5e-4, "loss_type": "dapo", "num_eval": 100,
    "max_total_tokens": 320, "max_tokens_per_turn": 40, "threshold": 0.5, "bootstrap_resamples": 10_000,
    "warm_start": {"k": 1, "examples": 2000, "max_steps": 400, "target_loss": 0.05, "seed": 0},
}


def protocol_spec(k: int, variant: str, seed: int, checkpoint: Path, steps: int) -> dict[str, Any]:
    v = PROTOCOL_VARIANTS[variant]
    return {
        "name": f"tool_chain-k{k}-{variant}-{seed}",
        "model": {"preset": "tiny", "checkpoint_dir": str(checkpoint)},
        "environment": {"name": PROTOCOL["env"]},
        "tasks": {"seed": seed, "num_train": 5000, "num_eval": PROTOCOL["num_eval"], "options": {"k": k}},
        "algorithm": {"loss_type": PROTOCOL["loss_type"], "learning_rate": PROTOCOL["learning_rate"],
                      **MEASURED_ALGORITHM, **v["algorithm"]},
        "rollout": {"prompts_per_step": PROTOCOL["prompts_per_step"], "num_generations": PROTOCOL["num_generations"],
                    "temperature": PROTOCOL["temperature"], "max_turns": k + 2,
                    "max_tokens_per_turn": PROTOCOL["max_tokens_per_turn"],
                    "max_total_tokens": PROTOCOL["max_total_tokens"]},
        "reward_schedule": dict(v["reward_schedule"], horizon=steps),
        "total_steps": steps,
        "checkpoint_every": steps,
        "keep_last_checkpoints": 1,
        "seed": seed,
    }


class SharedPool:
    """One rollout pool (one vLLM engine) for every run of an invocation: a run borrows it, its starting
    weights are pushed in at the start of each run, and the run's `shutdown` leaves it up. The engines are built
    from `engine_dir`, a folder that outlives the runs (a run's own folder is deleted when it ends, and a
    replacement for a worker lost later is built from the same folder before it gets the pushed weights).
    Sampling is seeded per request from the job seed, step, task, sample and turn, not from the engine."""

    def __init__(self, engine_dir: Path) -> None:
        self.engine_dir = engine_dir
        self.pool: Any = None
        self.start_s = 0.0

    def factory(self, spec: Any, weights_dir: Path) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        from rl_service.training.learner.weight_push import shippable_state_dict
        from rl_service.training.runner import default_pool_factory

        t0 = time.perf_counter()
        if self.pool is None:
            self.pool = default_pool_factory(spec, self.engine_dir)
        warm = AutoModelForCausalLM.from_pretrained(str(weights_dir), dtype=torch.float32)
        self.pool.push_weights(shippable_state_dict(warm), 0)
        self.start_s = time.perf_counter() - t0
        return _Borrowed(self.pool)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None


class _Borrowed:
    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def shutdown(self) -> None:
        """The pool outlives the run."""


def protocol_warm_start(work: Path) -> Path:
    """The shared warm start (k = 1 gold traces only), trained once and reused from disk."""
    from rl_service.training.warm_start import warm_started_model

    w = PROTOCOL["warm_start"]
    ckpt = work / f"warm-tool_chain-k{w['k']}"
    if not (ckpt / "config.json").exists():
        tmp = ckpt.with_name(ckpt.name + ".tmp")
        t0 = time.monotonic()
        losses = warm_started_model(PROTOCOL["env"], tmp, steps=w["max_steps"], target_loss=w["target_loss"],
                               examples=w["examples"], seed=w["seed"], task_options={"k": w["k"]})
        (tmp / "warm_start.json").write_text(json.dumps({"losses": losses, "seconds": time.monotonic() - t0, **w}))
        tmp.rename(ckpt)  # a half-written warm start is never mistaken for a finished one
    return ckpt


def run_protocol_one(k: int, variant: str, seed: int, steps: int, work: Path, checkpoint: Path, shared: SharedPool,
                     evaluate_before: bool) -> dict[str, Any]:
    import shutil

    from reward_models.monitor import WARNING_KIND
    from rl_service.hooks import InMemoryHooks
    from rl_service.spec import JobSpec
    from rl_service.training.runner import JobRunner

    class Runner(JobRunner):
        def _evaluate(self, step: int) -> None:
            if step > 0 or evaluate_before:  # the warm start is measured once per seed, not once per variant
                super()._evaluate(step)

    spec = JobSpec.model_validate(protocol_spec(k, variant, seed, checkpoint, steps))
    hooks = InMemoryHooks(spec.reward_schedule)
    run_dir = work / spec.name
    shutil.rmtree(run_dir, ignore_errors=True)  # an unfinished run starts over: its JSON was never written
    started = time.perf_counter()
    runner = Runner(spec.name, spec, hooks, run_dir, pool_factory=shared.factory)
    state = runner.run()
    wall = time.perf_counter() - started
    metrics = [m for _, m in hooks.metrics]
    evals = [(step, m) for step, m in hooks.metrics if "eval/success_rate" in m]
    train = [m for m in metrics if "success_rate" in m]
    phases = ("rollout", "reward", "learn", "sync", "checkpoint", "eval")
    time_s = {p: sum(m.get(f"time/{p}", 0.0) for m in train) for p in phases}
    time_s["other_in_steps"] = sum(m.get("time/step", 0.0) for m in train) - sum(time_s.values())
    time_s["eval_before"] = next((m["eval/time_s"] for s, m in evals if s == 0), 0.0)
    time_s["engine_start"] = shared.start_s
    time_s["setup"] = wall - sum(time_s.values())  # tasks, model and learner, the initial weights on disk
    curve = [m["success_rate"] for m in train]
    chains = [chain_attempt_rate(f, k) for f in sorted((run_dir / "trajectories").glob("*.jsonl"))]
    shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "env": PROTOCOL["env"], "k": k, "variant": variant, "seed": seed, "steps": steps, "state": state,
        "eval_before": next((m["eval/success_rate"] for s, m in evals if s == 0), None),
        "eval_after": next((m["eval/success_rate"] for s, m in evals if s == steps), None),
        "train_success": curve,
        "train_success_auc": sum(curve) / len(curve) if curve else None,
        "steps_to_threshold": steps_to(curve, PROTOCOL["threshold"]),
        "process_raw_mean": [m.get("reward/process_raw_mean", 0.0) for m in train],
        "process_weighted_mean": [m.get("reward/process_weighted_mean", 0.0) for m in train],
        "schedule_weight": [m.get("schedule/weight", 0.0) for m in train],
        "chain_attempt_rate": chains,
        "hacking_warnings": [{k_: v for k_, v in e.items() if k_ in ("step", "message")}
                             for e in hooks.events_of(WARNING_KIND)],
        "time_s": time_s, "wall_s": wall,
        "protocol": PROTOCOL, "spec": protocol_spec(k, variant, seed, Path("<warm start>"), steps),
    }


def chain_attempt_rate(step_file: Path, k: int) -> float:
    """Fraction of a step's sampled trajectories with at least k tool-call attempts, malformed ones included (a
    stray `</tool_call>` in an answer counts): an upper bound on how often the policy tried the whole chain."""
    rows = [json.loads(line) for line in step_file.read_text().splitlines() if line.strip()]
    calls = [sum(len(s["tool_calls"]) for s in r["steps"]) for r in rows]
    return sum(c >= k for c in calls) / len(calls) if calls else 0.0


def run_path(out: Path, k: int, variant: str, seed: int) -> Path:
    return out / f"k{k}-{variant}-seed{seed}.json"


def bootstrap_interval(diffs: list[float], resamples: int, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the mean of paired differences, resampling the pairs."""
    import numpy as np

    rng = np.random.default_rng(seed)
    a = np.asarray(diffs, dtype=np.float64)
    means = a[rng.integers(0, len(a), size=(resamples, len(a)))].mean(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def protocol_summary(results: list[dict[str, Any]]) -> str:
    """The markdown table of the finished runs and the paired comparison, as it goes into docs/benchmarks/curriculum.md."""
    lines = ["| k | variant | runs | held-out after (mean ± sd) | per seed | training-success AUC | steps to 50% "
             "| hacking warnings | samples with >= k call attempts, last 10 steps |", "|---|---|---|---|---|---|---|---|---|"]
    for k in PROTOCOL["ks"]:
        for variant in PROTOCOL_VARIANTS:
            rs = sorted((r for r in results if r["k"] == k and r["variant"] == variant), key=lambda r: r["seed"])
            if not rs:
                continue
            finals = [r["eval_after"] for r in rs]
            aucs = [r["train_success_auc"] for r in rs]
            reached = [r["steps_to_threshold"] for r in rs if r["steps_to_threshold"] is not None]
            sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
            tried = [statistics.mean(r["chain_attempt_rate"][-10:]) for r in rs if r.get("chain_attempt_rate")]
            tried_s = f"{statistics.mean(tried):.1%} ({len(tried)} runs)" if tried else "-"
            to = f"{statistics.mean(reached):.0f} ({len(reached)}/{len(rs)})" if reached else f"never (0/{len(rs)})"
            lines.append(f"| {k} | {variant} | {len(rs)} | {statistics.mean(finals):.1%} ± {sd:.1%} | "
                         f"{' / '.join(f'{f:.0%}' for f in finals)} | {statistics.mean(aucs):.1%} | {to} | "
                         f"{sum(len(r['hacking_warnings']) for r in rs)} | {tried_s} |")
    for k in PROTOCOL["ks"]:
        by = {(r["variant"], r["seed"]): r for r in results if r["k"] == k}
        seeds = [s for s in PROTOCOL["seeds"] if ("dense_to_sparse", s) in by and ("outcome_only", s) in by]
        if not seeds:
            continue
        diffs = [by["dense_to_sparse", s]["eval_after"] - by["outcome_only", s]["eval_after"] for s in seeds]
        line = (f"\nk = {k}: dense_to_sparse - outcome_only, held-out success after, paired over seeds {seeds}: "
                f"mean {statistics.mean(diffs):+.1%}")
        if len(seeds) > 1:
            lo, hi = bootstrap_interval(diffs, PROTOCOL["bootstrap_resamples"])
            line += f", 95% bootstrap interval [{lo:+.1%}, {hi:+.1%}]"
        lines.append(line)
    return "\n".join(lines)


def run_protocol(name: str, out: Path, work: Path, ks: list[int], seeds: list[int], steps: int) -> None:
    if name != "tool_chain":
        raise SystemExit(f"--protocol: unknown protocol {name!r}; known: tool_chain")
    from rl_service.ray_cluster import ensure_ray

    ensure_ray()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = protocol_warm_start(work)
    shared = SharedPool(checkpoint)
    try:
        for k in ks:
            for seed in seeds:
                for variant in PROTOCOL_VARIANTS:
                    path = run_path(out, k, variant, seed)
                    if path.exists():
                        continue
                    r = run_protocol_one(k, variant, seed, steps, work, checkpoint, shared,
                                         evaluate_before=variant == "outcome_only")
                    tmp = path.with_suffix(".tmp")
                    tmp.write_text(json.dumps(r, indent=1))
                    tmp.rename(path)
                    print(f"k={k} {variant:22s} seed {seed}: held-out {r['eval_before']} -> {r['eval_after']}, "
                          f"AUC {r['train_success_auc']:.3f} ({r['wall_s']:.0f} s: "
                          + ", ".join(f"{p} {v:.0f}" for p, v in r["time_s"].items()) + ")", flush=True)
    finally:
        shared.close()
    report_protocol(out)


def report_protocol(out: Path) -> None:
    results = [json.loads(p.read_text()) for p in sorted(out.glob("k*-seed*.json"))]
    total = len(PROTOCOL["ks"]) * len(PROTOCOL["seeds"]) * len(PROTOCOL_VARIANTS)
    print(f"\n{len(results)} of {total} protocol runs finished\n")
    if results:
        print(protocol_summary(results))
        _plot_protocol(results, out / "tool_chain.png")


def _plot_protocol(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({r["k"] for r in results})
    fig, axes = plt.subplots(1, len(ks) + 1, figsize=(5.5 * (len(ks) + 1), 3.8), squeeze=False)
    for ax, k in zip(axes[0], ks, strict=False):
        for variant in PROTOCOL_VARIANTS:
            curves = [r["train_success"] for r in results if r["k"] == k and r["variant"] == variant]
            if not curves:
                continue
            n = min(len(c) for c in curves)
            cols = [[c[i] for c in curves] for i in range(n)]
            line, = ax.plot(range(1, n + 1), [statistics.mean(c) for c in cols], label=f"{variant} ({len(curves)})")
            ax.fill_between(range(1, n + 1), [min(c) for c in cols], [max(c) for c in cols], alpha=0.15,
                            color=line.get_color())
        ax.set_title(f"tool_chain k = {k}: training success (mean, min-max over seeds)")
        ax.set_xlabel("step")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    ax = axes[0][-1]
    width = 0.8 / len(ks)
    for j, k in enumerate(ks):
        for i, variant in enumerate(PROTOCOL_VARIANTS):
            finals = [r["eval_after"] for r in results if r["k"] == k and r["variant"] == variant]
            if finals:
                ax.bar(i + j * width, statistics.mean(finals), width, color=f"C{j}", label=f"k = {k}" if i == 0 else None)
                ax.scatter([i + j * width] * len(finals), finals, color="k", s=6, zorder=3)
    ax.set_xticks([i + width * (len(ks) - 1) / 2 for i in range(len(PROTOCOL_VARIANTS))])
    ax.set_xticklabels(list(PROTOCOL_VARIANTS), rotation=20, fontsize=7)
    ax.set_title("greedy held-out success after the run")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envs", nargs="+", default=list(ENV_ROLLOUT))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--work", type=Path, default=Path("taper_data/curriculum"))
    ap.add_argument("--protocol", choices=["tool_chain"], help="run the pre-registered protocol (see above)")
    ap.add_argument("--ks", nargs="+", type=int, help="protocol: only these k (default: all)")
    ap.add_argument("--report", action="store_true", help="protocol: only print the table and plot of finished runs")
    args = ap.parse_args()
    if args.protocol:
        out = args.out / "curriculum_tool_chain"
        if args.report:
            report_protocol(out)
        else:
            run_protocol(args.protocol, out, args.work, args.ks or PROTOCOL["ks"], PROTOCOL["seeds"], PROTOCOL["steps"])
        return

    from rl_service.ray_cluster import ensure_ray
    from rl_service.training.warm_start import warm_started_model

    ensure_ray()
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "curriculum.json"
    # Runs of other environments from earlier invocations stay in the JSON, the table and the plot.
    results = [r for r in (json.loads(json_path.read_text()) if json_path.exists() else []) if r["env"] not in args.envs]
    for env in args.envs:
        gold_steps, target_loss, mixed_steps, fraction = WARM_START[env]
        ckpt = args.work / f"warm-{env}"
        if not (ckpt / "config.json").exists():  # a warm start from an earlier invocation is reused
            warm_started_model(env, ckpt, steps=gold_steps, target_loss=target_loss, mixed_steps=mixed_steps,
                               tool_use_fraction=fraction, task_options=ENV_TASKS[env], examples=2000, seed=0)
        for seed in range(args.seeds):
            for variant in args.variants:
                r = run_one(env, variant, seed, args.steps, args.work, ckpt)
                r["steps_to_threshold"] = steps_to(r["train_success"], args.threshold)
                print(f"{env:13s} {variant:16s} seed {seed}: held-out {r['eval_before']} -> {r['eval_after']} "
                      f"({r['wall_s']:.0f} s)", flush=True)
                results.append(r)
                json_path.write_text(json.dumps(results, indent=1))

    print(f"\n{'env':13s} {'variant':16s} {'held-out success before -> after':>34s} "
          f"{'steps to ' + str(args.threshold):>14s}")
    for env in sorted({r["env"] for r in results}):
        for variant in args.variants:
            rs = [r for r in results if r["env"] == env and r["variant"] == variant]
            if not rs:
                continue
            before = [r["eval_before"] for r in rs if r["eval_before"] is not None]
            finals = [r["eval_after"] for r in rs if r["eval_after"] is not None]
            reached = [r["steps_to_threshold"] for r in rs if r["steps_to_threshold"] is not None]
            change = (f"{statistics.mean(before):.1%} -> {statistics.mean(finals):.1%} ± {statistics.pstdev(finals):.1%}"
                      if finals and before else "-")
            to = f"{statistics.mean(reached):.0f} ({len(reached)}/{len(rs)})" if reached else f"never (0/{len(rs)})"
            print(f"{env:13s} {variant:16s} {change:>34s} {to:>14s}")
    _plot(results, args.out / "curriculum.png")


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    envs = sorted({r["env"] for r in results})
    fig, axes = plt.subplots(1, len(envs), figsize=(6 * len(envs), 3.6), squeeze=False)
    for ax, env in zip(axes[0], envs, strict=True):
        for variant in VARIANTS:
            curves = [r["train_success"] for r in results if r["env"] == env and r["variant"] == variant]
            if not curves:
                continue
            n = min(len(c) for c in curves)
            mean = [statistics.mean(c[i] for c in curves) for i in range(n)]
            ax.plot(range(n), mean, label=variant)
        ax.set_title(env)
        ax.set_xlabel("step")
        ax.set_ylabel("training success rate")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
