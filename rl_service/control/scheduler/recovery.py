"""Keeping placed jobs whole: starting jobs get their placement group and driver; a lost, finished-but-silent
or hung driver is replaced (its job resumes from the last checkpoint) until the attempt limit; paused and
finished jobs give their resources back."""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

from rl_service.control.scheduler.ray_jobs import RayJobs
from rl_service.control.store import JobNotFound, JobRecord, Store
from rl_service.job_states import CONTROL_CANCEL, CONTROL_PAUSE, JobState

log = logging.getLogger(__name__)


class Recovery:
    """The reconcile passes over starting and running jobs, and the cleanup of jobs that need nothing."""

    def __init__(self, store: Store, ray_jobs: RayJobs, *, max_attempts: int, pg_timeout_s: float,
                 driver_grace_s: float, liveness_every_s: float, heartbeat_timeout_s: float) -> None:
        self.store = store
        self.ray_jobs = ray_jobs
        self.max_attempts = max_attempts
        self.pg_timeout_s = pg_timeout_s
        self.driver_grace_s = driver_grace_s
        self.liveness_every_s = liveness_every_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._last_liveness: dict[str, float] = {}

    def cleanup(self) -> None:
        """Free the resources of jobs that no longer need them (paused or finished)."""
        for job_id in self.store.placed_job_ids():
            state = self.store.job_field(job_id, "state")
            if state is None or not JobState(state).has_driver:
                self.ray_jobs.release(job_id)
                self.store.unmark_placed(job_id)

    def reconcile(self) -> None:
        for state in (JobState.RUNNING, JobState.STARTING):
            for job_id in self.store.job_ids_in(state):
                try:
                    self.reconcile_one(self.store.get_job(job_id))
                except JobNotFound:
                    continue
                except Exception:
                    log.exception("reconciling job %s failed", job_id)

    def reconcile_one(self, job: JobRecord) -> None:
        ray_jobs = self.ray_jobs
        driver = ray_jobs.driver(job.id)
        if driver is not None and not self._driver_stuck(job, driver) and not self._driver_hung(job, driver):
            return
        started = ray_jobs.driver_started.get(job.id)
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
        pg = ray_jobs.pg(job.id)
        if pg is None:
            pg = ray_jobs.create_pg(job)
        if not pg.wait(timeout_seconds=0):
            since = ray_jobs.pg_pending_since.setdefault(job.id, time.monotonic())
            if time.monotonic() - since > self.pg_timeout_s:
                ray_jobs.release(job.id)
                self.store.transition(job.id, JobState.QUEUED, expect=[JobState.STARTING],
                                      reason="resources did not become available; back in the queue")
            return
        ray_jobs.pg_pending_since.pop(job.id, None)
        ray_jobs.start_driver(job, pg)

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
            self.ray_jobs.kill_driver(job.id, driver)
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
        self.ray_jobs.kill_driver(job.id, driver)
        self.store.clear_heartbeat(job.id)
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
