"""JobHooks over Redis: how a job driver (rl_service.training.runner.JobRunner inside a Ray actor) reports to the
control plane and hears from it. Satisfies the rl_service.hooks.JobHooks protocol."""

from __future__ import annotations

import contextlib
from typing import Any

from reward_models.schedule import RewardSchedule
from rl_service.control.store import InvalidTransition, JobNotFound, Store
from rl_service.hooks import Control
from rl_service.job_states import CONTROL_CANCEL, CONTROL_PAUSE, CONTROL_RUN, JobState


class RedisHooks:
    def __init__(self, store: Store, job_id: str) -> None:
        self.store = store
        self.job_id = job_id

    @classmethod
    def connect(cls, redis_url: str, job_id: str, prefix: str = "taper") -> RedisHooks:
        return cls(Store(redis_url, prefix=prefix), job_id)

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
            self.store.add_metrics(self.job_id, step, metrics)

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
