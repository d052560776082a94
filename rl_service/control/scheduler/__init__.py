"""The scheduler: places queued jobs onto Ray resources and keeps their drivers alive.

Each job runs in a detached Ray placement group (its resources: one learner bundle per learner rank and
one rollout bundle per rollout worker; see `job_bundles`) with a detached driver actor that runs the JobRunner
and reports over Redis. Detached means neither outlives nor dies with the API process: an API restart leaves
running jobs alone, and the scheduler of the restarted process picks them up from Redis.

The loop is a reconciler: every tick it compares what Redis says each job should have with what Ray has,
and fixes the difference, so a crash at any point of placing a job is repaired on the next tick.

- queued jobs are placed in queue order (priority, then arrival) while the cluster has room for them; a job
  that does not fit now blocks lower ones (strict priority), except one that can never fit the cluster or
  whose tenant already has its quota of starting and running jobs (it waits queued, `quota_wait` event).
- starting jobs get their placement group and, once it is ready, a driver actor.
- running jobs whose driver is gone (killed, node lost, crashed) go back to starting and get a new driver,
  which resumes from the newest checkpoint in the job's work dir; after ``max_attempts`` they fail.
- a running job whose driver is alive but makes no progress (none for ``heartbeat_timeout_s`` plus its phase's
  own deadline: the runner is stuck in one call, or waits on rollouts that never come) is treated the same
  way: a ``driver_hung`` event, the driver is killed and replaced.
- jobs that no longer need resources (paused, finished) have their driver and placement group removed.

Only one process runs the loop at a time (a Redis lock with a TTL), so several API replicas are safe.

Heartbeat: the runner reports progress through its hooks (`RedisHooks.heartbeat`: between phases, per
rollout chunk finished, per learner micro-batch; waiting alone is not progress), with the deadline its current
phase derives from the job's sizes (rollouts: the chunk deadline; training: the learner-rank deadline). The
hooks write Redis's own clock and that deadline to ``P:job:{id}:heartbeat`` (STRING, expires after a day) at
most every ``heartbeat_every_s``; the scheduler compares it with Redis's clock, so the hosts' clocks never
matter. ``heartbeat_timeout_s`` is the operator's allowance for one call without progress (an engine start, a
checkpoint write) on top of the phase's deadline.

The parts: `driver` (JobDriver, the actor that runs one job), `ray_jobs` (a job's driver and placement group
on Ray), `recovery` (the reconcile and cleanup passes), `admission` (which queued jobs start now); this
module holds `Scheduler`, the loop that runs them while this process holds the scheduler lock.
"""

from __future__ import annotations

import logging
import threading
import uuid

from rl_service.control.quota import TenantQuota
from rl_service.control.scheduler.admission import Admission
from rl_service.control.scheduler.driver import DEFAULT_RUNNER, JobDriver
from rl_service.control.scheduler.ray_jobs import RayJobs, driver_name, pg_name
from rl_service.control.scheduler.recovery import Recovery
from rl_service.control.settings import get_settings
from rl_service.control.store import Store

log = logging.getLogger(__name__)


class Scheduler:
    """The reconcile loop, run by whichever process holds the scheduler lock."""

    def __init__(
        self,
        store: Store,
        *,
        runner: str | type = DEFAULT_RUNNER,
        namespace: str | None = None,
        tick_s: float = 0.5,
        max_attempts: int = 3,
        lock_ttl_ms: int = 5000,
        pg_timeout_s: float = 120.0,
        driver_grace_s: float = 5.0,
        liveness_every_s: float = 15.0,
        heartbeat_every_s: float | None = None,
        heartbeat_timeout_s: float | None = None,
        default_quota: TenantQuota | None = None,
    ) -> None:
        """`heartbeat_every_s` / `heartbeat_timeout_s` default to the settings' `driver_heartbeat_*`;
        `default_quota` (the running-jobs quota of tenants an admin gave none) to no limit."""
        self.store = store
        self.tick_s = tick_s
        self.lock_ttl_ms = lock_ttl_ms
        settings = get_settings() if heartbeat_every_s is None or heartbeat_timeout_s is None else None
        heartbeat_every_s = heartbeat_every_s or settings.driver_heartbeat_every_s  # type: ignore[union-attr]
        heartbeat_timeout_s = heartbeat_timeout_s or settings.driver_heartbeat_timeout_s  # type: ignore[union-attr]
        if heartbeat_timeout_s <= heartbeat_every_s:
            raise ValueError(f"heartbeat_timeout_s ({heartbeat_timeout_s}) must exceed heartbeat_every_s "
                             f"({heartbeat_every_s})")
        self.ray_jobs = RayJobs(store, runner, namespace, heartbeat_every_s)
        self.recovery = Recovery(store, self.ray_jobs, max_attempts=max_attempts, pg_timeout_s=pg_timeout_s,
                                 driver_grace_s=driver_grace_s, liveness_every_s=liveness_every_s,
                                 heartbeat_timeout_s=heartbeat_timeout_s)
        self.admission = Admission(store, self.recovery.reconcile_one, default_quota)
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="taper-scheduler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the loop (running jobs are left alone: their drivers are detached), after a last cleanup so
        jobs that just finished do not keep their resources until another scheduler runs."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        try:
            if self.store.acquire_lock(self.token, self.lock_ttl_ms):
                self.recovery.cleanup()
        except Exception:
            log.exception("final cleanup failed")
        self.store.release_lock(self.token)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:
                log.exception("scheduler tick failed")
            self._stop.wait(self.tick_s)

    def tick(self) -> bool:
        """One reconcile pass; returns False when another process holds the scheduler lock."""
        if not self.store.acquire_lock(self.token, self.lock_ttl_ms):
            return False
        self.recovery.cleanup()
        self.recovery.reconcile()
        self.admission.place()
        return True


__all__ = ["DEFAULT_RUNNER", "JobDriver", "Scheduler", "driver_name", "pg_name"]
