"""Run one RL job without the API: `python -m rl_service.training.job_main --spec FILE.yaml --work-dir DIR`.

Starts (or joins, with --ray-address / RAY_ADDRESS) Ray, runs the job with in-memory hooks, prints each
step's main metrics and the events, writes all metrics to DIR/metrics.jsonl, and resumes from the newest
checkpoint in DIR when there is one. Exit code 0 when the job succeeded.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from rl_service.spec import JobSpec

SHOWN = ("loss", "success_rate", "reward/outcome_mean", "schedule/weight", "kl", "entropy",
         "logprob_mismatch/mean_abs", "staleness/max", "time/step", "eval/success_rate")


def load_spec(path: Path) -> JobSpec:
    text = path.read_text()
    data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    return JobSpec.model_validate(data or {})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rl_service.training.job_main", description=__doc__.splitlines()[0])
    ap.add_argument("--spec", type=Path, required=True, help="job spec, YAML or JSON")
    ap.add_argument("--work-dir", type=Path, required=True)
    ap.add_argument("--job-id", default=None)
    ap.add_argument("--ray-address", default=None)
    ap.add_argument("--num-cpus", type=int, default=None, help="CPUs of a local Ray started here")
    args = ap.parse_args(argv)

    spec = load_spec(args.spec)
    from rl_service.ray_cluster import ensure_ray
    from rl_service.training.runner import InMemoryHooks, JobRunner

    ensure_ray(args.ray_address, num_cpus=args.num_cpus)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    metrics_file = (args.work_dir / "metrics.jsonl").open("a")

    def report(step: int, metrics: dict[str, float]) -> None:
        metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
        metrics_file.flush()
        shown = " ".join(f"{k}={metrics[k]:.4g}" for k in SHOWN if k in metrics)
        print(f"step {step:>5} {shown}", flush=True)

    hooks = InMemoryHooks(schedule=spec.reward_schedule, on_metrics=report)
    try:
        result = JobRunner(args.job_id or spec.name, spec, hooks, args.work_dir).run()
    finally:
        metrics_file.close()
        for kind, data in hooks.events:
            if kind not in ("checkpoint",):
                print(f"event {kind}: {json.dumps(data, default=str)[:300]}")
    print(f"result: {result}")
    return 0 if result == "succeeded" else 1


if __name__ == "__main__":
    sys.exit(main())
