"""The multi-node test's job driver: a tiny RL job (JobRunner + InMemoryHooks) on an existing Ray cluster.

Run as its own process (`python multinode_job.py --address ... --work-dir ... --progress ... --result ...`) so
its Ray client never mixes with one the pytest process may hold. After every step it appends a JSON line to
`--progress` with the step and the node of every rollout worker; at the end it writes `--result`. Once
connected it writes its node's id next to `--progress` (suffix `.connected`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import ray

from rl_service.spec import JobSpec
from rl_service.training.runner import InMemoryHooks, JobRunner, default_pool_factory

ENV_PASSTHROUGH = ("VLLM_", "TOKENIZERS_", "HF_", "TRANSFORMERS_", "RAY_USAGE", "OMP_NUM_THREADS", "TMPDIR")


class LoggingHooks(InMemoryHooks):
    """InMemoryHooks that also print each event, so a slow or stuck run shows where it is."""

    def emit_event(self, kind: str, data: dict[str, Any]) -> None:
        super().emit_event(kind, data)
        print(f"{time.strftime('%H:%M:%S')} event {kind}", flush=True)

    def emit_metrics(self, step: int, metrics: dict[str, float]) -> None:
        super().emit_metrics(step, metrics)
        print(f"{time.strftime('%H:%M:%S')} step {step} done", flush=True)


def tiny_spec(total_steps: int, num_workers: int) -> JobSpec:
    return JobSpec.model_validate({
        "name": "multinode",
        "model": {"preset": "tiny"},
        "environment": {"name": "calculator"},
        "tasks": {"num_train": 16, "num_eval": 0, "seed": 5},
        "rollout": {"num_workers": num_workers, "prompts_per_step": 2, "num_generations": 2, "max_turns": 1,
                    "max_tokens_per_turn": 4, "max_total_tokens": 256, "kv_cache_gib": 0.25},
        "resources": {"rollout_cpus": 1, "rollout_custom": {"rollout": 1}, "learner_custom": {"learner": 1}},
        "total_steps": total_steps,
        "checkpoint_every": 1,
        "seed": 7,
    })


def actor_node(actor: Any) -> str | None:
    """The node an actor is placed on, read from the GCS (no dashboard needed)."""
    info = ray._private.state.actors(actor_id=actor._actor_id.hex())
    return (info.get("Address") or {}).get("NodeID") or None


def place_like_the_scheduler(spec: JobSpec, timeout_s: float = 120) -> dict[str, Any]:
    """Reserve the job's bundles as the API's scheduler does (one placement group, PACK) and report the node
    of each role's bundles: learner bundles must land on `learner` nodes, rollout bundles on `rollout` ones."""
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    from rl_service.placement import job_bundles, learner_bundle_indices

    bundles = job_bundles(spec)
    pg = placement_group(bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
        nodes = placement_group_table(pg)["bundles_to_node_id"]
        learners = learner_bundle_indices(spec)
        first_rollout = len(bundles) - spec.rollout.num_workers
        return {"learner_nodes": [nodes[i] for i in learners],
                "rollout_nodes": [nodes[i] for i in range(first_rollout, len(bundles))]}
    finally:
        remove_placement_group(pg)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--work-dir", required=True)
    p.add_argument("--progress", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--total-steps", type=int, default=3)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--hold-after-step", type=int, default=0,
                   help="after this step, wait for the file `--progress` + '.resume' before going on")
    args = p.parse_args(argv)

    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PASSTHROUGH)}
    ray.init(address=args.address, namespace="taper-multinode", log_to_driver=False,
             runtime_env={"env_vars": env})
    progress = Path(args.progress)
    progress.with_suffix(".connected").write_text(ray.get_runtime_context().get_node_id())
    spec = tiny_spec(args.total_steps, args.num_workers)
    holder: dict[str, Any] = {}

    def pool_factory(job_spec: JobSpec, weights_dir: Path) -> Any:
        holder["pool"] = default_pool_factory(job_spec, weights_dir)
        return holder["pool"]

    def on_metrics(step: int, metrics: dict[str, float]) -> None:
        pool = holder.get("pool")
        nodes = [actor_node(w) for w in pool.workers] if pool is not None else []
        with progress.open("a") as f:
            f.write(json.dumps({"step": step, "worker_nodes": nodes,
                                "worker_restarts": getattr(pool, "restarts", None)}) + "\n")
        if step == args.hold_after_step:  # lets the test kill a node before the next step's rollouts start
            resume = progress.with_suffix(".resume")
            deadline = time.monotonic() + 600
            while not resume.exists() and time.monotonic() < deadline:
                time.sleep(0.2)

    hooks = LoggingHooks(on_metrics=on_metrics)
    runner = JobRunner("multinode", spec, hooks, args.work_dir, pool_factory=pool_factory, device="cpu")
    error = None
    try:
        outcome = runner.run()
    except Exception as exc:  # reported to the test, which fails with it
        outcome, error = "failed", repr(exc)
    Path(args.result).write_text(json.dumps({
        "outcome": outcome, "error": error, "events": [k for k, _ in hooks.events],
        "steps": [s for s, m in hooks.metrics if "trajectories/num" in m],
        "head_node": ray.get_runtime_context().get_node_id(),
        "placement": place_like_the_scheduler(spec) if error is None else None,
    }))
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
