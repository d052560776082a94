"""The job driver: the detached Ray actor that runs one job's runner, restarts training after a lost learner
rank or worker, and records the job's outcome in Redis."""

from __future__ import annotations

import importlib
import logging
import traceback
from pathlib import Path
from typing import Any

import ray

from rl_service.control.redis_hooks import RedisHooks
from rl_service.control.store import JobRecord, Store
from rl_service.job_states import CONTROL_CANCEL, CONTROL_PAUSE, JobState

log = logging.getLogger(__name__)

DEFAULT_RUNNER = "rl_service.training.runner:JobRunner"
# A learner rank or a worker actor that died, or a part that stopped answering (rl_service.training.distributed's
# LearnerRankStalled is a TimeoutError): the job driver restarts training from the last checkpoint.
RESTARTABLE_ERRORS = (ray.exceptions.RayActorError, TimeoutError)

FINAL_RESULTS = {"succeeded": JobState.SUCCEEDED, "failed": JobState.FAILED, "cancelled": JobState.CANCELLED,
                 "paused": JobState.PAUSED}


def _send_webhooks(store: Store, job_id: str) -> None:
    """The job's signed notices of the state it just reached (a receiver's trouble never fails the job)."""
    from rl_service.control.webhooks import notify
    from rl_service.environment_settings import operator_environment_policy

    try:
        notify(store, job_id, operator_environment_policy().allow_list)
    except Exception:
        log.exception("job %s: webhooks not sent", job_id)


def load_runner(runner: str | type) -> type:
    if not isinstance(runner, str):
        return runner
    module, _, attr = runner.partition(":")
    return getattr(importlib.import_module(module), attr)


class JobDriver:
    """Runs one job (a detached Ray actor; see RayJobs.start_driver). Threaded so ping() answers mid-run."""

    def __init__(self, job_id: str, redis_url: str, prefix: str, runner: str | type,
                 heartbeat_every_s: float = 10.0, store_caps: dict[str, int] | None = None) -> None:
        """Errors in RESTARTABLE_ERRORS (a learner rank or worker that died or hung) restart the runner, which
        resumes from its last checkpoint, up to the spec's `watchdog.max_training_restarts` times."""
        self.job_id = job_id
        self.store = Store(redis_url, prefix=prefix, **(store_caps or {}))
        self.runner = runner
        self.heartbeat_every_s = heartbeat_every_s
        self.running = False
        self.finished = False

    def ping(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "running": self.running, "finished": self.finished}

    def run(self) -> str:
        self.running = True
        try:
            return self._run()
        finally:
            self.running = False
            self.finished = True

    def _build_runner(self, job: Any, hooks: RedisHooks) -> Any:
        work_dir = Path(job.work_dir)
        work_dir.mkdir(parents=True, exist_ok=True)
        runner = load_runner(self.runner)(self.job_id, job.spec, hooks, work_dir)
        preload = getattr(runner, "preload", None)
        if preload is not None:
            preload()
        return runner

    def _run(self) -> str:
        store, job_id = self.store, self.job_id
        job = store.get_job(job_id)
        if job.control == CONTROL_CANCEL:
            store.transition(job_id, JobState.CANCELLED, expect=[JobState.STARTING], reason="cancel requested")
            return "cancelled"
        if job.control == CONTROL_PAUSE:
            store.transition(job_id, JobState.PAUSED, expect=[JobState.STARTING], reason="pause requested")
            return "paused"
        # The runner is built, and its code imported (`preload`), before the first heartbeat: cold imports
        # (transformers' model code, the environment's module) can outlast a heartbeat timeout on a loaded
        # machine. An error here fails the job below, like any runner error.
        hooks = RedisHooks(store, job_id, self.heartbeat_every_s)
        try:
            runner, build_error = self._build_runner(job, hooks), None
        except Exception as exc:
            runner, build_error = None, exc
        hooks.heartbeat()  # before RUNNING: the scheduler judges running jobs by their heartbeat
        store.transition(job_id, JobState.RUNNING, expect=[JobState.STARTING], data={"attempt": job.attempts})
        try:
            if build_error is not None:
                raise build_error
            result, runner = self._run_with_restarts(runner, job, hooks)
            target = FINAL_RESULTS.get(str(result))
            if target is None:
                raise RuntimeError(f"job runner returned an unknown result {result!r}")
        except Exception as exc:
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            log.exception("job %s failed", job_id)
            store.add_event(job_id, "error", {"error": detail, "traceback": traceback.format_exc()[-4000:]})
            store.transition(job_id, JobState.FAILED, expect=[JobState.RUNNING], fields={"error": detail},
                             reason="runner raised")
            _send_webhooks(store, job_id)
            return "failed"
        # Outside the try: failing to record the outcome is not the job failing. It propagates, and the
        # scheduler's liveness check restarts the driver, whose runner resumes from the final checkpoint.
        cause = getattr(runner, "pause_cause", None)  # a job that paused itself says why, as its error
        store.transition(job_id, target, expect=[JobState.RUNNING], reason=f"runner returned {result}",
                         fields={"error": cause} if cause else None)
        _send_webhooks(store, job_id)
        return target.value

    def _run_with_restarts(self, runner: Any, job: JobRecord, hooks: RedisHooks) -> tuple[str, Any]:
        """The runner's result, and the runner that produced it."""
        restarts = 0
        while True:
            try:
                return runner.run(), runner
            except RESTARTABLE_ERRORS as exc:
                if restarts >= job.spec.watchdog.max_training_restarts:
                    raise
                restarts += 1
                cause = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                log.warning("job %s: restarting training from its last checkpoint (%s)", self.job_id, cause)
                hooks.emit_event("training_restarted", {"restart": restarts, "cause": cause[-2000:]})
                runner = self._build_runner(job, hooks)
