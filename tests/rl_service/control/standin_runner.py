"""A stand-in for rl_service.training.runner.JobRunner with the same contract (resume from the newest checkpoint in
work_dir, poll control each step, read the schedule each step, report metrics/checkpoints), used to test the
scheduler's mechanics without a model. The real job over HTTP (tests/ui/test_real_job.py) uses the real JobRunner."""

from __future__ import annotations

import json
import time
from pathlib import Path


class StandInRunner:
    step_seconds = 0.1

    def __init__(self, job_id, spec, hooks, work_dir: Path) -> None:
        self.job_id, self.spec, self.hooks, self.work_dir = job_id, spec, hooks, Path(work_dir)
        self.pause_cause: str | None = None

    def _resume_step(self) -> int:
        ckpts = sorted((self.work_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
        return int(ckpts[-1].name.split("-")[1]) if ckpts else 0

    def run(self) -> str:
        start = self._resume_step()
        self.hooks.emit_event("runner_started", {"from_step": start})
        for step in range(start, self.spec.total_steps):
            self.hooks.heartbeat(2.0 if self.spec.name == "hang" else None)  # the phase's own deadline
            if self.spec.name == "hang" and step == 2 and self.hooks.store.get_job(self.job_id).attempts == 1:
                while True:  # the first driver gets stuck for good (alive, no progress, no heartbeat)
                    time.sleep(1)
            died_once = self.work_dir / "rank-died-once"
            if self.spec.name == "rank-dies" and step == 2 and not died_once.exists():
                died_once.touch()  # a learner rank dies once, at step 2 (the driver itself lives on)
                import ray.exceptions

                raise ray.exceptions.ActorDiedError()
            if self.spec.name == "env-down" and step == 2 and self.hooks.store.get_job(self.job_id).attempts == 1:
                self.hooks.warn("infrastructure_failures", "the environment is down", {"step": step})
                self.pause_cause = "paused: the environment is down"  # as JobRunner's infra guard does
                return "paused"
            control = self.hooks.control()
            if control in ("pause", "cancel"):
                return "paused" if control == "pause" else "cancelled"
            version, schedule = self.hooks.current_schedule()
            time.sleep(self.spec.seed / 1000 if self.spec.seed else self.step_seconds)
            if self.spec.name == "explode":
                raise RuntimeError("boom")
            self.hooks.emit_metrics(step, {"step": step, "schedule_version": version,
                                               "process_weight": schedule.weight(step), "resumed_from": start})
            ckpt = self.work_dir / "checkpoints" / f"step-{step + 1}"
            ckpt.mkdir(parents=True, exist_ok=True)
            (ckpt / "state.json").write_text(json.dumps({"step": step + 1}))
            self.hooks.add_checkpoint(step + 1, ckpt.as_uri())
        if self.spec.name == "lose-outcome" and self.hooks.store.get_job(self.job_id).attempts == 1:
            # the first driver cannot record how the job ended (as if Redis were unreachable just then)
            def unreachable(*args, **kwargs):
                raise ConnectionError("redis unreachable")

            self.hooks.store.transition = unreachable
        return "succeeded"
