"""JobHooks over Redis: how a job driver (rl_service.training.runner.JobRunner inside a Ray actor) reports to the
control plane and hears from it, and beats its heartbeat. Satisfies the rl_service.hooks.JobHooks protocol."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from reward_models.schedule import RewardSchedule
from rl_service.control.store import InvalidTransition, JobNotFound, Store
from rl_service.hooks import Control
from rl_service.job_states import CONTROL_CANCEL, CONTROL_PAUSE, CONTROL_RUN, JobState

log = logging.getLogger(__name__)


class RedisHooks:
    """A job driver's hooks; `heartbeat` writes at most every `heartbeat_every_s` seconds (at once when the
    phase's deadline changes)."""

    def __init__(self, store: Store, job_id: str, heartbeat_every_s: float = 10.0) -> None:
        self.store = store
        self.job_id = job_id
        self.every_s = heartbeat_every_s
        self._last = -float("inf")
        self._deadline_s: float | None = None

    @classmethod
    def connect(cls, redis_url: str, job_id: str, prefix: str = "taper") -> RedisHooks:
        return cls(Store(redis_url, prefix=prefix), job_id)

    def heartbeat(self, deadline_s: float | None = None) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s and deadline_s == self._deadline_s:
            return
        try:
            self.store.write_heartbeat(self.job_id, deadline_s)
            self._last, self._deadline_s = now, deadline_s
        except Exception:  # Redis briefly away: the job goes on; the next call retries
            log.warning("job %s: heartbeat not written", self.job_id, exc_info=True)

    # A write for a job deleted under the driver is dropped: `control()` then tells the runner to stop.
    def emit_event(self, kind: str, data: dict[str, Any]) -> None:
        with contextlib.suppress(JobNotFound):
            self.store.add_event(self.job_id, kind, data)

    def warn(self, kind: str, message: str, data: dict[str, Any]) -> None:
        event = {**data, "message": message}
        try:
            self.store.update_job(self.job_id, allowed=[JobState.STARTING, JobState.RUNNING],
                                  fields={"warning": message}, event=kind, event_data=event)
        except InvalidTransition:  # the job is stopping: the event still tells
            self.emit_event(kind, event)
        except JobNotFound:
            pass

    def emit_metrics(self, step: int, metrics: dict[str, float]) -> None:
        with contextlib.suppress(JobNotFound):
            training = not all(k.startswith("eval/") for k in metrics)
            self.store.add_metrics(self.job_id, step, metrics, steps_done=step + 1 if training else None)

    def current_schedule(self) -> tuple[int, RewardSchedule]:
        return self.store.current_schedule(self.job_id)

    def control(self) -> Control:
        value = self.store.job_field(self.job_id, "control")
        if value in (CONTROL_PAUSE, CONTROL_CANCEL):
            return value  # type: ignore[return-value]
        if value is None:  # the job record is gone: nothing left to work for
            return CONTROL_CANCEL
        return CONTROL_RUN

    def add_checkpoint(self, step: int, uri: str) -> None:
        with contextlib.suppress(JobNotFound):
            self.store.add_checkpoint(self.job_id, step, uri)
