"""A tenant's jobs: submit (checked against limits, quotas and the tenant's environments and files), read
(with a micro-cached status), steer (cancel, pause, resume against the state machine), delete, and adjust
the reward schedule."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from reward_models.schedule import ScheduleHistory, SchedulePatch, ScheduleVersion
from rl_service.control.quota import JobLimits, LimitExceeded, check_job
from rl_service.control.service.environments import Environments
from rl_service.control.service.errors import (
    Conflict,
    InvalidInput,
    QuotaExceeded,
    RateLimited,
    invalid_from,
    job_not_found,
)
from rl_service.control.service.files import JobFiles
from rl_service.control.service.host_paths import hide_host_paths
from rl_service.control.service.tenants import Principal, Tenants
from rl_service.control.store import (
    IdempotencyConflict,
    JobActive,
    JobNotFound,
    JobRecord,
    QueueFull,
    RateLimitExceeded,
    ScheduleFull,
    Store,
    spec_digest,
)
from rl_service.job_states import CONTROL_CANCEL, CONTROL_PAUSE, CONTROL_RUN, InvalidTransition, JobState
from rl_service.spec import JobSpec

# How often cancel/pause/resume re-read a job that changed state under them before giving up with a 409.
CONTROL_ATTEMPTS = 5


def schedule_patch_changes(patch: Any) -> dict[str, Any]:
    """The fields a reward-schedule patch sets, if it is valid on its own (else a 422 naming the field)."""
    if not isinstance(patch, dict) or not patch:
        raise InvalidInput("the patch must be a non-empty JSON object of schedule fields", field="body")
    try:
        return SchedulePatch.model_validate(patch).changes()
    except ValidationError as exc:
        raise invalid_from(exc) from None


def schedule_conflict(exc: ValidationError) -> Conflict:
    """A valid patch that the job's current schedule cannot take (e.g. `half_life` while the kind is linear)."""
    invalid = invalid_from(exc)
    return Conflict(f"the patch does not fit the job's current schedule: {invalid.message}", field=invalid.field)


class Jobs:
    """Every job operation a tenant may ask for; another tenant's job answers as a missing one."""

    def __init__(self, store: Store, tenants: Tenants, environments: Environments, files: JobFiles, *,
                 submit_rate_per_minute: int = 60, limits: JobLimits | None = None,
                 status_cache_s: float = 0.25) -> None:
        """``limits``: the operator's maxima per job."""
        self.store = store
        self.tenants = tenants
        self.environments = environments
        self.files = files
        self.submit_rate_per_minute = submit_rate_per_minute
        self.limits = limits or JobLimits()
        self.status_cache_s = status_cache_s
        self._status_cache: dict[str, tuple[float, JobRecord]] = {}

    def _job(self, p: Principal, job_id: str) -> JobRecord:
        try:
            return self.store.get_job(job_id, tenant=p.tenant)
        except JobNotFound:
            raise job_not_found(job_id) from None

    # ---- submit ----
    def submit(self, p: Principal, spec: JobSpec, idempotency_key: str | None = None) -> tuple[JobRecord, bool]:
        if idempotency_key is not None and not (1 <= len(idempotency_key) <= 255 and idempotency_key.isprintable()):
            raise InvalidInput("Idempotency-Key must be 1-255 printable characters", field="Idempotency-Key")
        if spec.environment.registration is not None:
            raise InvalidInput("set by the service from the tenant's registered environments; name one instead",
                               field="environment.registration")
        if spec.model.checkpoint_dir is not None:
            raise InvalidInput("set by the service from model.checkpoint; name a checkpoint there instead",
                               field="model.checkpoint_dir")
        # a retry is the same request even when what the service resolves below changed in between
        request_digest = spec_digest(spec)
        quota = self.tenants.quota_of(p.tenant)
        try:
            check_job(spec, self.limits, quota)
        except LimitExceeded as exc:
            raise InvalidInput(str(exc), field=exc.field) from None
        self._check_webhooks(spec)
        registration = self.environments.resolve(p, spec.environment.name)
        self.environments.check_job(spec, registration)
        spec = self.files.resolve_task_files(p, spec, registration)
        if registration is not None:
            # the job carries its registration, so its driver never reads the (tenant's, mutable) registry
            spec = spec.model_copy(update={
                "environment": spec.environment.model_copy(update={"registration": registration})})
        if spec.model.checkpoint is not None:
            checkpoint_dir = self.files.resolve_checkpoint(p, spec.model.checkpoint)
            spec = spec.model_copy(update={"model": spec.model.model_copy(update={"checkpoint_dir": checkpoint_dir})})
        try:
            return self.store.submit_job(p.tenant, spec, str(self.files.jobs_dir), idempotency_key,
                                         rate_per_minute=self.submit_rate_per_minute,
                                         max_queued=quota.max_queued_jobs, request_digest=request_digest)
        except IdempotencyConflict as exc:
            raise Conflict(str(exc), field="Idempotency-Key") from None
        except RateLimitExceeded as exc:
            raise RateLimited(str(exc), retry_after_s=60 - int(time.time()) % 60) from None
        except QueueFull as exc:
            raise QuotaExceeded(f"{exc}; wait for some to start or finish", field="max_queued_jobs") from None

    def _check_webhooks(self, spec: JobSpec) -> None:
        """Each webhook's host is one the operator's network rules allow (as a tool server's)."""
        from rollout_workers.environments.registry import check_target

        for i, hook in enumerate(spec.webhooks):
            try:
                check_target(hook.url, self.environments.policy.allow_list)
            except ValueError as exc:
                raise InvalidInput(f"webhooks[{i}].url: {str(exc).removeprefix('base_url: ')}",
                                   field=f"webhooks[{i}].url") from None

    # ---- read ----
    def list_jobs(self, p: Principal, state: JobState | None, offset: int, limit: int) -> tuple[list[JobRecord], int]:
        return self.store.list_jobs(p.tenant, state, offset, limit)

    def list_after(self, p: Principal, after: str | None, limit: int) -> tuple[list[JobRecord], bool] | None:
        """The tenant's jobs newest first, after the job ``after`` (OpenAI's paging), and whether more follow;
        None when ``after`` is not one of the tenant's jobs."""
        return self.store.list_jobs_after(p.tenant, after, limit)

    def get(self, p: Principal, job_id: str) -> JobRecord:
        return self._job(p, job_id)

    async def aget(self, p: Principal, job_id: str) -> JobRecord:
        """The job for a status read. Status is polled (dashboards, CLIs, many clients per job), so records are
        micro-cached for ``status_cache_s``: a driver's progress shows up that much later, while changes made
        through this service are seen at once (they drop the entry)."""
        now = time.monotonic()
        hit = self._status_cache.get(job_id)
        if hit is not None and hit[0] > now:
            job = hit[1]
        else:
            try:
                job = await self.store.aget_job(job_id)
            except JobNotFound:
                raise job_not_found(job_id) from None
            if len(self._status_cache) > 10_000:
                self._status_cache.clear()
            self._status_cache[job_id] = (now + self.status_cache_s, job)
        if job.tenant != p.tenant:
            raise job_not_found(job_id)
        return job

    def _changed(self, job_id: str) -> None:
        self._status_cache.pop(job_id, None)

    def events(self, p: Principal, job_id: str, after: str | None, limit: int) -> list[dict[str, Any]]:
        job = self._job(p, job_id)
        return hide_host_paths(self.store.events(job_id, after=after, limit=limit), [job.work_dir, self.files.data_dir])

    def events_newest_first(self, p: Principal, job_id: str, before: str | None, limit: int) -> list[dict[str, Any]]:
        job = self._job(p, job_id)
        return hide_host_paths(self.store.events_newest_first(job_id, before=before, limit=limit),
                               [job.work_dir, self.files.data_dir])

    def followed_events(self, job_id: str, after: str | None, limit: int) -> list[dict[str, Any]]:
        """The next events of a job whose stream the caller was already allowed to follow (see `events`); an empty
        list once the job is gone."""
        return hide_host_paths(self.store.events(job_id, after=after, limit=limit), [self.files.data_dir])

    def finished(self, job_id: str) -> bool:
        """The job has reached a final state, or no longer exists."""
        state = self.store.job_field(job_id, "state")
        return state is None or JobState(state).is_terminal

    def count_by_state(self) -> dict[str, int]:
        """How many jobs are in each state (every tenant's)."""
        return self.store.count_by_state()

    def all_in_state(self, state: JobState, limit: int) -> list[JobRecord]:
        """Up to ``limit`` jobs of every tenant in ``state`` (the operator's metrics)."""
        return self.store.list_jobs(None, state, 0, limit)[0]

    def metrics(self, p: Principal, job_id: str, after: str | None, limit: int) -> list[dict[str, Any]]:
        self._job(p, job_id)
        return self.store.metrics(job_id, after=after, limit=limit)

    def checkpoints(self, p: Principal, job_id: str) -> list[dict[str, Any]]:
        """The job's checkpoints that exist (the runner deletes all but the newest `keep_last_checkpoints`)."""
        self._job(p, job_id)
        return self.files.existing_checkpoints(job_id)

    def trajectories(self, p: Principal, job_id: str, **filters: Any) -> list[dict[str, Any]]:
        """The job's trajectories, paged and filtered (JobFiles.trajectories)."""
        return self.files.trajectories(self._job(p, job_id), **filters)

    # ---- steer ----
    def _control(self, p: Principal, job_id: str, act: Callable[[JobRecord], JobRecord | None]) -> JobRecord:
        """Run ``act`` on a fresh read of the job, again on a new read when the store's conditional write
        found the job in another state (InvalidTransition). ``act`` answers a record to return as it is, or
        None after it wrote: the job is then read back. Drops the job's cached status either way."""
        try:
            for _ in range(CONTROL_ATTEMPTS):
                job = self._job(p, job_id)
                try:
                    answer = act(job)
                    return answer if answer is not None else self._job(p, job_id)
                except InvalidTransition:
                    continue
            raise Conflict("job kept changing state; try again", field="state")
        finally:
            self._changed(job_id)

    def cancel(self, p: Principal, job_id: str) -> JobRecord:
        def act(job: JobRecord) -> None:
            if job.state in (JobState.QUEUED, JobState.PAUSED):  # no driver to send its notices: sent here
                self.store.transition(job_id, JobState.CANCELLED, expect=[job.state], reason="cancelled by user")
                if job.spec.webhooks:
                    from rl_service.control.webhooks import notify

                    notify(self.store, job_id, self.environments.policy.allow_list, background=True)
            elif job.state.has_driver:
                self.store.update_job(job_id, allowed=[JobState.STARTING, JobState.RUNNING],
                                      fields={"control": CONTROL_CANCEL}, event="cancel_requested")
            else:
                raise Conflict(f"job is already {job.state.value}", field="state")

        return self._control(p, job_id, act)

    def pause(self, p: Principal, job_id: str) -> JobRecord:
        def act(job: JobRecord) -> JobRecord | None:
            if job.state == JobState.PAUSED:
                return job
            if not job.state.has_driver:
                raise Conflict(f"only a starting or running job can be paused (job is {job.state.value})", field="state")
            if job.control == CONTROL_CANCEL:
                raise Conflict("job is being cancelled", field="state")
            self.store.update_job(job_id, allowed=[JobState.STARTING, JobState.RUNNING],
                                  fields={"control": CONTROL_PAUSE}, event="pause_requested")
            return None

        return self._control(p, job_id, act)

    def resume(self, p: Principal, job_id: str) -> JobRecord:
        def act(job: JobRecord) -> None:
            if job.state == JobState.PAUSED:  # a pause's cause (a job that paused itself) is past
                self.store.transition(job_id, JobState.QUEUED, expect=[JobState.PAUSED],
                                      fields={"control": CONTROL_RUN, "error": None, "warning": None},
                                      reason="resumed by user")
            elif job.state.has_driver and job.control == CONTROL_PAUSE:
                self.store.update_job(job_id, allowed=[JobState.STARTING, JobState.RUNNING],
                                      fields={"control": CONTROL_RUN}, event="pause_withdrawn")
            elif job.state.has_driver or job.state == JobState.QUEUED:
                if job.control == CONTROL_CANCEL:
                    raise Conflict("job is being cancelled", field="state")
            else:
                raise Conflict(f"job is already {job.state.value}", field="state")

        return self._control(p, job_id, act)

    def delete(self, p: Principal, job_id: str, keep_checkpoints: bool = False) -> None:
        """Delete a finished job: its records in Redis, then its files (all of its work dir, or all but
        ``checkpoints/`` with ``keep_checkpoints``). 409 while it is not finished."""
        try:
            job = self.store.delete_job(job_id, p.tenant)
        except JobNotFound:
            raise job_not_found(job_id) from None
        except JobActive as exc:
            raise Conflict(f"job is {exc.state}; cancel it and wait for it to end first", field="state") from None
        finally:
            self._changed(job_id)
        self.files.delete_work_dir(job, keep_checkpoints)

    # ---- reward schedule ----
    def schedule(self, p: Principal, job_id: str) -> ScheduleHistory:
        self._job(p, job_id)
        return self.store.schedule_history(job_id)

    def patch_schedule(self, p: Principal, job_id: str, patch: dict[str, Any]) -> ScheduleVersion:
        """422 for a patch that is invalid on its own; 409 for a valid one the job's schedule cannot take (e.g.
        `half_life` while the kind is linear: the same patch fits an exponential schedule)."""
        self._job(p, job_id)
        self._changed(job_id)
        changes = schedule_patch_changes(patch)
        try:
            return self.store.patch_schedule(job_id, changes)
        except JobNotFound:
            raise job_not_found(job_id) from None
        except InvalidTransition as exc:
            raise Conflict(f"job is already {exc.current.value}; its schedule is final", field="state") from None
        except ScheduleFull as exc:
            raise Conflict(str(exc), field="schedule_version") from None
        except ValidationError as exc:
            raise schedule_conflict(exc) from None
        except ValueError as exc:  # the job's step is behind its current version (a patch cannot change the past)
            raise Conflict(str(exc), field="state") from None
