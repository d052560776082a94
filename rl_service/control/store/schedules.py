"""A job's reward-schedule history (at most ``schedule_max_versions`` versions): read it, and patch it atomically
with the job's ``schedule_version`` and a ``schedule_patched`` event."""

from __future__ import annotations

import time
from typing import Any

import redis

from reward_models.schedule import RewardSchedule, ScheduleHistory, ScheduleVersion
from rl_service.control.store.base import StoreBase, dumps
from rl_service.control.store.jobs import JobNotFound
from rl_service.job_states import InvalidTransition, JobState


class ScheduleFull(ValueError):
    """The job's schedule has its maximum number of versions."""


class SchedulesPart(StoreBase):
    """The reward schedule of a job."""

    def schedule_history(self, job_id: str) -> ScheduleHistory:
        raw = self.r.get(self.k_schedule(job_id))
        if raw is None:
            raise JobNotFound(job_id)
        return ScheduleHistory.from_json(raw)

    def current_schedule(self, job_id: str) -> tuple[int, RewardSchedule]:
        cur = self.schedule_history(job_id).current
        return cur.version, cur.schedule

    def patch_schedule(self, job_id: str, patch: dict[str, Any]) -> ScheduleVersion:
        """Apply ``patch`` as a new schedule version effective from the job's next step, atomically with
        the job's ``schedule_version`` and a ``schedule_patched`` event (optimistic WATCH/MULTI).

        Raises pydantic.ValidationError / ValueError for a bad patch, InvalidTransition for a finished job,
        ScheduleFull when the history has ``schedule_max_versions`` versions."""
        job_key, sched_key = self.k_job(job_id), self.k_schedule(job_id)
        with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(job_key, sched_key)
                    state, step = pipe.hmget(job_key, ["state", "step"])
                    raw = pipe.get(sched_key)
                    if state is None or raw is None:
                        raise JobNotFound(job_id)
                    if JobState(state).is_terminal:
                        raise InvalidTransition(state, state)
                    history = ScheduleHistory.from_json(raw)
                    if len(history.versions) >= self.schedule_max_versions:
                        raise ScheduleFull(f"the schedule has {len(history.versions)} versions, the most a job "
                                           "may have")
                    # The runner is working on step `step`; the patch applies from the step after it.
                    new = history.apply_patch(patch, at_step=int(step or 0))
                    now = time.time()
                    pipe.multi()
                    pipe.set(sched_key, history.to_json())
                    pipe.hset(job_key, mapping={"schedule_version": str(new.version), "updated_at": repr(now)})
                    pipe.xadd(
                        self.k_events(job_id),
                        {
                            "kind": "schedule_patched",
                            "data": dumps(
                                {
                                    "version": new.version,
                                    "effective_from": new.effective_from,
                                    "patch": new.patch,
                                    "schedule": new.schedule.model_dump(),
                                }
                            ),
                            "ts": repr(now),
                        },
                        maxlen=self.events_maxlen,
                        approximate=True,
                    )
                    pipe.execute()
                    return new
                except redis.WatchError:
                    continue
