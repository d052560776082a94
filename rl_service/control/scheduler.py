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
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl_service.control.quota import TenantQuota
from rl_service.control.redis_hooks import RedisHooks
from rl_service.control.settings import get_settings
from rl_service.control.store import JobNotFound, JobRecord, Store
from rl_service.job_states import CONTROL_CANCEL, CONTROL_PAUSE, JobState
from rl_service.placement import driver_cpus, job_bundles

log = logging.getLogger(__name__)

DEFAULT_RUNNER = "rl_service.training.runner:JobRunner"
# A learner rank or a worker actor that died, or a part that stopped answering (rl_service.training.distributed's
# LearnerRankStalled is a TimeoutError): the job driver restarts training from the last checkpoint.
RESTARTABLE_ERRORS = (ray.exceptions.RayActorError, TimeoutError)

FINAL_RESULTS = {"succeeded": JobState.SUCCEEDED, "failed": JobState.FAILED, "cancelled": JobState.CANCELLED,
                 "paused": JobState.PAUSED}


def driver_name(job_id: str) -> str:
    return f"taper-driver-{job_id}"


def pg_name(job_id: str) -> str:
    return f"taper-pg-{job_id}"


def _total(bundles: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _fits(need: dict[str, float], have: dict[str, float]) -> bool:
    return all(have.get(k, 0.0) + 1e-9 >= v for k, v in need.items() if v > 0)


def load_runner(runner: str | type) -> type:
    if not isinstance(runner, str):
        return runner
    module, _, attr = runner.partition(":")
    return getattr(importlib.import_module(module), attr)


class JobDriver:
    """Runs one job (a detached Ray actor; see Scheduler._start_driver). Threaded so ping() answers mid-run."""

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
            return "failed"
        # Outside the try: failing to record the outcome is not the job failing. It propagates, and the
        # scheduler's liveness check restarts the driver, whose runner resumes from the final checkpoint.
        cause = getattr(runner, "pause_cause", None)  # a job that paused itself says why, as its error
        store.transition(job_id, target, expect=[JobState.RUNNING], reason=f"runner returned {result}",
                         fields={"error": cause} if cause else None)
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


class Scheduler:
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
        self.runner = runner
        self.namespace = namespace
        self.tick_s = tick_s
        self.max_attempts = max_attempts
        self.lock_ttl_ms = lock_ttl_ms
        self.pg_timeout_s = pg_timeout_s
        self.driver_grace_s = driver_grace_s
        self.liveness_every_s = liveness_every_s
        settings = get_settings() if heartbeat_every_s is None or heartbeat_timeout_s is None else None
        self.heartbeat_every_s = heartbeat_every_s or settings.driver_heartbeat_every_s  # type: ignore[union-attr]
        self.heartbeat_timeout_s = heartbeat_timeout_s or settings.driver_heartbeat_timeout_s  # type: ignore[union-attr]
        if self.heartbeat_timeout_s <= self.heartbeat_every_s:
            raise ValueError(f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed heartbeat_every_s "
                             f"({self.heartbeat_every_s})")
        self.default_quota = default_quota
        self._last_liveness: dict[str, float] = {}
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned_unschedulable: set[str] = set()
        self._warned_quota: set[str] = set()
        self._driver_started: dict[str, float] = {}
        self._pending_pg_since: dict[str, float] = {}

    # ---- loop ----
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
                self.cleanup()
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
        self.cleanup()
        self.reconcile()
        self.place()
        return True

    # ---- Ray helpers ----
    def _ns(self) -> str:
        return self.namespace or ray.get_runtime_context().namespace

    def _driver(self, job_id: str) -> Any | None:
        try:
            return ray.get_actor(driver_name(job_id), namespace=self._ns())
        except ValueError:
            return None

    def _pg(self, job_id: str) -> PlacementGroup | None:
        try:
            return get_placement_group(pg_name(job_id))
        except ValueError:
            return None

    def _release(self, job_id: str) -> None:
        actor = self._driver(job_id)
        if actor is not None:
            ray.kill(actor, no_restart=True)
        pg = self._pg(job_id)
        if pg is not None:
            remove_placement_group(pg)
        self._driver_started.pop(job_id, None)
        self._pending_pg_since.pop(job_id, None)

    # ---- the three passes ----
    def cleanup(self) -> None:
        """Free the resources of jobs that no longer need them (paused or finished)."""
        for job_id in self.store.placed_job_ids():
            state = self.store.job_field(job_id, "state")
            if state is None or not JobState(state).has_driver:
                self._release(job_id)
                self.store.unmark_placed(job_id)

    def reconcile(self) -> None:
        for state in (JobState.RUNNING, JobState.STARTING):
            for job_id in self.store.job_ids_in(state):
                try:
                    self._reconcile_one(self.store.get_job(job_id))
                except JobNotFound:
                    continue
                except Exception:
                    log.exception("reconciling job %s failed", job_id)

    def _reconcile_one(self, job: JobRecord) -> None:
        driver = self._driver(job.id)
        if driver is not None and not self._driver_stuck(job, driver) and not self._driver_hung(job, driver):
            return
        started = self._driver_started.get(job.id)
        if started is not None and time.monotonic() - started < self.driver_grace_s:
            return  # a driver we just created may not be visible yet
        if self.store.job_field(job.id, "state") != job.state.value:
            return  # the job moved on (e.g. its driver finished it) after `job` was read
        if job.state == JobState.RUNNING:
            self.store.add_event(job.id, "driver_lost", {"attempt": job.attempts, "step": job.step})
            if self._finish_without_driver(job):
                return
            self.store.transition(job.id, JobState.STARTING, expect=[JobState.RUNNING],
                                  reason="driver lost; resuming from the last checkpoint")
            job = self.store.get_job(job.id)
        if self._finish_without_driver(job):
            return
        pg = self._pg(job.id)
        if pg is None:
            self.store.mark_placed(job.id)
            pg = placement_group(job_bundles(job.spec), strategy="PACK", name=pg_name(job.id), lifetime="detached")
            self._pending_pg_since[job.id] = time.monotonic()
        if not pg.wait(timeout_seconds=0):
            since = self._pending_pg_since.setdefault(job.id, time.monotonic())
            if time.monotonic() - since > self.pg_timeout_s:
                self._release(job.id)
                self.store.transition(job.id, JobState.QUEUED, expect=[JobState.STARTING],
                                      reason="resources did not become available; back in the queue")
            return
        self._pending_pg_since.pop(job.id, None)
        self._start_driver(job, pg)

    def _driver_stuck(self, job: JobRecord, driver: Any) -> bool:
        """A live driver whose run() has ended while its job still looks active (it could not record the
        outcome, e.g. Redis was unreachable at that moment) is killed, so the job is resumed like a lost one.
        Checked every ``liveness_every_s`` per job."""
        now = time.monotonic()
        if now - self._last_liveness.get(job.id, 0.0) < self.liveness_every_s:
            return False
        self._last_liveness[job.id] = now
        try:
            status = ray.get(driver.ping.remote(), timeout=10)
        except Exception:
            return False  # busy or just starting: not evidence of a problem
        if status["finished"] and not status["running"]:
            if self.store.job_field(job.id, "state") != job.state.value:
                return False  # it recorded the outcome after `job` was read: cleanup releases it
            log.warning("driver of %s finished but the job is still %s; restarting it", job.id, job.state.value)
            ray.kill(driver, no_restart=True)
            self._driver_started.pop(job.id, None)
            return True
        return False

    def _driver_hung(self, job: JobRecord, driver: Any) -> bool:
        """A running job whose last progress is older than ``heartbeat_timeout_s`` plus its phase's deadline: its
        driver is alive but stuck. It is killed (with the actors it owns: learner ranks, rollout workers) and
        replaced like a lost one."""
        if job.state != JobState.RUNNING:
            return False
        beat = self.store.heartbeat(job.id)
        if beat is None:
            return False  # no heartbeat at all: a driver from before heartbeats, judged by liveness only
        allowed_s = self.heartbeat_timeout_s + (beat.deadline_s or 0.0)
        if beat.age_s <= allowed_s:
            return False
        log.warning("driver of %s made no progress for %.1f s; killing it", job.id, beat.age_s)
        self.store.add_event(job.id, "driver_hung", {"silent_s": round(beat.age_s, 3), "allowed_s": allowed_s,
                                                     "phase_deadline_s": beat.deadline_s,
                                                     "attempt": job.attempts, "step": job.step})
        ray.kill(driver, no_restart=True)
        self.store.clear_heartbeat(job.id)
        self._driver_started.pop(job.id, None)
        return True

    def _finish_without_driver(self, job: JobRecord) -> bool:
        """Honour a cancel/pause request or the attempt limit for a job whose driver is gone."""
        if job.control == CONTROL_CANCEL:
            self.store.transition(job.id, JobState.CANCELLED, expect=[job.state], reason="cancel requested")
        elif job.control == CONTROL_PAUSE:
            self.store.transition(job.id, JobState.PAUSED, expect=[job.state], reason="pause requested")
        elif job.attempts >= self.max_attempts:
            self.store.transition(job.id, JobState.FAILED, expect=[job.state],
                                  fields={"error": f"driver died {job.attempts} times"}, reason="too many attempts")
        else:
            return False
        return True

    def _start_driver(self, job: JobRecord, pg: PlacementGroup) -> None:
        res = job.spec.resources
        self.store.update_job(job.id, allowed=[JobState.STARTING], fields={"attempts": str(job.attempts + 1)},
                              event="driver_started", event_data={"attempt": job.attempts + 1})
        actor_cls = ray.remote(JobDriver)
        single = res.num_learners == 1  # then the driver is the learner: it takes bundle 0 whole
        try:
            driver = actor_cls.options(
                name=driver_name(job.id),
                namespace=self._ns(),
                lifetime="detached",
                max_restarts=0,
                max_concurrency=4,
                num_cpus=res.learner_cpus if single else driver_cpus(job.spec),
                num_gpus=res.learner_gpus if single else 0,
                resources=res.learner_resources if single else {},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
                ),
            ).remote(job.id, self.store.url, self.store.prefix, self.runner, self.heartbeat_every_s, self.store.caps)
        except ValueError:  # the name is still held by a driver that is going away; retry next tick
            return
        self._driver_started[job.id] = time.monotonic()
        driver.run.remote()  # fire and forget: the driver reports through Redis

    def _running_room(self, tenant: str) -> int:
        quota = self.store.get_quota(tenant) or self.default_quota
        if quota is None:
            return 1 << 30
        return quota.max_running_jobs - self.store.count_active(tenant)

    def place(self) -> None:
        """Move queued jobs to starting while the cluster has room, in queue order."""
        queued = self.store.queued_ids()
        if not queued:
            return
        available = dict(ray.available_resources())
        total = dict(ray.cluster_resources())
        room: dict[str, int] = {}  # per tenant: how many more jobs it may start now
        for job_id in queued:
            try:
                job = self.store.get_job(job_id)
            except JobNotFound:
                continue
            if job.tenant not in room:
                room[job.tenant] = self._running_room(job.tenant)
            if room[job.tenant] <= 0:
                if job_id not in self._warned_quota:
                    self._warned_quota.add(job_id)
                    self.store.add_event(job_id, "quota_wait", {"reason": "the tenant has its max_running_jobs"})
                continue  # other tenants' jobs may go ahead: the quota, not the cluster, holds this one
            need = _total(job_bundles(job.spec))
            if not _fits(need, total):
                if job_id not in self._warned_unschedulable:
                    self._warned_unschedulable.add(job_id)
                    self.store.add_event(job_id, "unschedulable",
                                         {"needs": need, "cluster": {k: total.get(k, 0.0) for k in need}})
                continue
            if not _fits(need, available):
                break  # strict priority: wait for room rather than let later jobs overtake
            try:
                self.store.transition(job_id, JobState.STARTING, expect=[JobState.QUEUED], reason="placed")
            except Exception:
                continue  # cancelled or taken meanwhile
            room[job.tenant] -= 1
            for k, v in need.items():
                available[k] = available.get(k, 0.0) - v
            self._reconcile_one(self.store.get_job(job_id))
