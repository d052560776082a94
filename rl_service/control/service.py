"""The control-plane service: everything the REST API (and the CLI through it) can do, with the rules.

The API routers only translate HTTP to these calls; tenancy, validation beyond the request schemas,
state-machine checks and the store's atomic writes all happen here or below.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from pydantic import BaseModel, ValidationError

from reward_models.schedule import RewardSchedule, ScheduleHistory, SchedulePatch, ScheduleVersion
from rl_service.control.quota import JobLimits, LimitExceeded, TenantQuota, check_job
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
from rl_service.job_states import (
    CONTROL_CANCEL,
    CONTROL_PAUSE,
    CONTROL_RUN,
    InvalidTransition,
    JobState,
)
from rl_service.spec import JobSpec

log = logging.getLogger(__name__)


class ServiceError(Exception):
    status: int = 400
    code: str = "bad_request"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class NotFound(ServiceError):
    status, code = 404, "not_found"


class Conflict(ServiceError):
    status, code = 409, "conflict"


class TooLarge(ServiceError):
    status, code = 413, "too_large"


class InvalidInput(ServiceError):
    status, code = 422, "invalid"


class Unauthorized(ServiceError):
    status, code = 401, "unauthorized"


class Forbidden(ServiceError):
    status, code = 403, "forbidden"


def job_not_found(job_id: str) -> NotFound:
    # the same answer for another tenant's job as for a missing one: ids do not leak across tenants
    return NotFound(f"job {job_id!r} not found", field="job_id")


class RateLimited(ServiceError):
    status, code = 429, "rate_limited"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QuotaExceeded(ServiceError):
    status, code = 429, "quota_exceeded"


def _model_field_names(model: type[BaseModel], out: set[str] | None = None) -> set[str]:
    out = set() if out is None else out
    for name, info in model.model_fields.items():
        out.add(name)
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel) and ann is not model:
            _model_field_names(ann, out)
    return out


# How often cancel/pause/resume re-read a job that changed state under them before giving up with a 409.
CONTROL_ATTEMPTS = 5

_KNOWN_FIELDS = _model_field_names(JobSpec) | _model_field_names(RewardSchedule)


def error_field(loc: tuple[Any, ...] | list[Any], message: str) -> str:
    """The dotted field of a pydantic error. A model-level check ("half_life is required ...") has no
    location of its own, so the field its message starts with is appended."""
    parts = [str(p) for p in loc if p != "__root__"]
    text = message.removeprefix("Value error, ")
    head = text.split(" ", 1)[0].split(":", 1)[0].strip("'\"`")
    if head in _KNOWN_FIELDS and (not parts or parts[-1] != head):
        parts.append(head)
    return ".".join(parts)


def invalid_from(exc: ValidationError | ValueError, prefix: str = "") -> InvalidInput:
    """An InvalidInput naming the first offending field of a pydantic error (or the message of a ValueError)."""
    if isinstance(exc, ValidationError) and exc.errors():
        err = exc.errors()[0]
        msg = str(err.get("msg", exc))
        field = ".".join(p for p in (prefix, error_field(err.get("loc", ()), msg)) if p) or None
        return InvalidInput(f"{field or 'body'}: {msg}", field=field)
    return InvalidInput(str(exc), field=prefix or None)


def named_invalid(exc: ValueError) -> InvalidInput:
    """An InvalidInput for a ValueError whose message starts with the dotted field ("options.memory_mb: ...")."""
    message = str(exc)
    head = message.split(":", 1)[0]
    field = head if head.replace(".", "").replace("_", "").isalnum() else None
    return InvalidInput(message, field=field)


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


@dataclass(frozen=True)
class Principal:
    tenant: str
    admin: bool = False
    key_name: str = ""


class TaperService:
    def __init__(self, store: Store, data_dir: Path, submit_rate_per_minute: int = 60,
                 auth_cache_s: float = 5.0, status_cache_s: float = 0.25, env_policy: Any = None, *,
                 limits: JobLimits | None = None, default_quota: TenantQuota | None = None,
                 base_models: dict[str, Path] | None = None, task_file_limits: Any = None) -> None:
        """`env_policy`: the operator's EnvironmentPolicy (TaperSettings.environment_policy()); default: the
        safe defaults (no internal HTTP targets, no extra python modules, only the built-in data).
        ``limits`` (the operator's maxima per job), ``default_quota`` (of tenants an admin gave none) and
        ``base_models`` (name -> model directory tenants may start from) come from the settings."""
        self.store = store
        self._env_policy = env_policy
        self.data_dir = Path(data_dir)
        self.jobs_dir = (self.data_dir / "jobs").resolve()
        from rl_service.control.task_file_store import TaskFileStore

        # not under data_dir/files: that is the default data root environments' file options may read
        self.task_files = TaskFileStore(self.data_dir / "task_files", task_file_limits)
        self.submit_rate_per_minute = submit_rate_per_minute
        self.limits = limits or JobLimits()
        self.default_quota = default_quota or TenantQuota()
        self.base_models = {name: Path(path) for name, path in (base_models or {}).items()}
        self.auth_cache_s = auth_cache_s
        self._auth_cache: dict[str, tuple[float, Principal]] = {}
        self._auth_lock = threading.Lock()
        self.status_cache_s = status_cache_s
        self._status_cache: dict[str, tuple[float, JobRecord]] = {}

    # ---- auth ----
    def _cached_principal(self, key: str | None) -> Principal | None:
        if not key:
            raise Unauthorized("missing bearer API key (Authorization: Bearer <key>)", field="Authorization")
        with self._auth_lock:
            hit = self._auth_cache.get(key)
        return hit[1] if hit and hit[0] > time.monotonic() else None

    def _remember(self, key: str, info: dict[str, Any] | None) -> Principal:
        if info is None:
            raise Unauthorized("invalid API key", field="Authorization")
        left_s = float("inf") if info["expires_at"] is None else info["expires_at"] - time.time()
        if left_s <= 0:
            raise Unauthorized("API key expired", field="Authorization")
        principal = Principal(tenant=info["tenant"], admin=info["admin"], key_name=info["name"])
        with self._auth_lock:
            if len(self._auth_cache) > 10_000:
                self._auth_cache.clear()
            self._auth_cache[key] = (time.monotonic() + min(self.auth_cache_s, left_s), principal)
        return principal

    def authenticate(self, key: str | None) -> Principal:
        """The principal of a bearer key (cached briefly: a revoked key stops working within auth_cache_s)."""
        return self._cached_principal(key) or self._remember(key, self.store.lookup_api_key(key))

    async def aauthenticate(self, key: str | None) -> Principal:
        return self._cached_principal(key) or self._remember(key, await self.store.alookup_api_key(key))

    def create_api_key(self, tenant: str, name: str = "", admin: bool = False,
                       expires_at: float | None = None) -> str:
        validate_tenant(tenant)
        return self.store.create_api_key(tenant, name=name, admin=admin, expires_at=expires_at)

    # ---- API keys (admin) ----
    def admin_create_key(self, p: Principal, tenant: str, name: str = "", admin: bool = False,
                         expires_in_s: float | None = None) -> tuple[str, dict[str, Any]]:
        """A new key (shown once) and its record."""
        self.require_admin(p)
        expires_at = None if expires_in_s is None else time.time() + expires_in_s
        key = self.create_api_key(tenant, name=name, admin=admin, expires_at=expires_at)
        info = self.store.lookup_api_key(key)
        assert info is not None
        return key, info

    def admin_list_keys(self, p: Principal, tenant: str | None = None) -> list[dict[str, Any]]:
        self.require_admin(p)
        return self.store.list_api_keys(tenant)

    def admin_revoke_key(self, p: Principal, key_id: str) -> dict[str, Any]:
        self.require_admin(p)
        info = self.store.revoke_api_key_id(key_id)
        if info is None:
            raise NotFound(f"API key {key_id!r} not found", field="key_id")
        with self._auth_lock:  # keys are cached by their secret, which is not stored: drop them all
            self._auth_cache.clear()
        return info

    @staticmethod
    def require_admin(p: Principal) -> None:
        if not p.admin:
            raise Forbidden("this needs an admin API key", field="Authorization")

    # ---- tenant quotas (admin) ----
    def quota_of(self, tenant: str) -> TenantQuota:
        """The quota in force for ``tenant``: the one an admin set, else the operator's default."""
        return self.store.get_quota(tenant) or self.default_quota

    def get_quota(self, p: Principal, tenant: str) -> tuple[TenantQuota, bool]:
        """(the tenant's quota, whether an admin set it rather than it being the default)."""
        self.require_admin(p)
        validate_tenant(tenant)
        own = self.store.get_quota(tenant)
        return own or self.default_quota, own is not None

    def set_quota(self, p: Principal, tenant: str, body: Any) -> TenantQuota:
        self.require_admin(p)
        validate_tenant(tenant)
        try:
            quota = body if isinstance(body, TenantQuota) else TenantQuota.model_validate(body)
        except ValidationError as exc:
            raise invalid_from(exc) from None
        self.store.set_quota(tenant, quota)
        return quota

    def reset_quota(self, p: Principal, tenant: str) -> None:
        """Drop the tenant's own quota: the operator's default applies again."""
        self.require_admin(p)
        validate_tenant(tenant)
        self.store.delete_quota(tenant)

    # ---- jobs ----
    def _job(self, p: Principal, job_id: str) -> JobRecord:
        try:
            return self.store.get_job(job_id, tenant=p.tenant)
        except JobNotFound:
            raise job_not_found(job_id) from None

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
        quota = self.quota_of(p.tenant)
        try:
            check_job(spec, self.limits, quota)
        except LimitExceeded as exc:
            raise InvalidInput(str(exc), field=exc.field) from None
        registration = self._resolve_environment(p, spec.environment.name)
        self._check_job_environment(spec, registration)
        try:
            check_declared_rewards(spec.environment.grader, spec.environment.process_rewards or [], "environment.")
        except ValueError as exc:
            raise named_invalid(exc) from None
        spec = self._resolve_task_files(p, spec, registration)
        if registration is not None:
            # the job carries its registration, so its driver never reads the (tenant's, mutable) registry
            spec = spec.model_copy(update={
                "environment": spec.environment.model_copy(update={"registration": registration})})
        if spec.model.checkpoint is not None:
            checkpoint_dir = self._resolve_checkpoint(p, spec.model.checkpoint)
            spec = spec.model_copy(update={"model": spec.model.model_copy(update={"checkpoint_dir": checkpoint_dir})})
        try:
            return self.store.submit_job(p.tenant, spec, str(self.jobs_dir), idempotency_key,
                                         rate_per_minute=self.submit_rate_per_minute,
                                         max_queued=quota.max_queued_jobs, request_digest=request_digest)
        except IdempotencyConflict as exc:
            raise Conflict(str(exc), field="Idempotency-Key") from None
        except RateLimitExceeded as exc:
            raise RateLimited(str(exc), retry_after_s=60 - int(time.time()) % 60) from None
        except QueueFull as exc:
            raise QuotaExceeded(f"{exc}; wait for some to start or finish", field="max_queued_jobs") from None

    def _resolve_task_files(self, p: Principal, spec: JobSpec, registration: dict[str, Any] | None) -> JobSpec:
        """The stored paths of the job's task files (422 naming the field for a file the tenant does not have);
        an environment without a task generator needs a train_file."""
        tasks = spec.tasks
        for name in ("train_path", "eval_path"):
            if getattr(tasks, name) is not None:
                raise InvalidInput("set by the service from the file id; name the file instead", field=f"tasks.{name}")
        update: dict[str, str] = {}
        for name in ("train_file", "eval_file"):
            file_id = getattr(tasks, name)
            if file_id is None:
                continue
            path = self.task_files.path(p.tenant, file_id)
            if path is None:
                raise InvalidInput(f"no task file {file_id!r} (upload one with POST /v1/files)", field=f"tasks.{name}")
            update[name.replace("_file", "_path")] = str(path)
        if tasks.train_file is None and registration is not None and registration.get("kind") == "mcp":
            raise InvalidInput("an mcp environment has no task generator: upload a task file and name it here",
                               field="tasks.train_file")
        return spec.model_copy(update={"tasks": tasks.model_copy(update=update)}) if update else spec

    def _resolve_checkpoint(self, p: Principal, ref: str) -> str:
        """The directory of a checkpoint reference (rl_service.spec.CHECKPOINT_REF): a base model the operator
        registered, or a checkpoint the store lists for one of the tenant's own jobs that lies in that job's
        work dir. Never a path the tenant wrote."""
        field = "model.checkpoint"
        if ref.startswith("base:"):
            name = ref.removeprefix("base:")
            path = self.base_models.get(name)
            if path is None:
                offered = ", ".join(sorted(self.base_models)) or "none"
                raise InvalidInput(f"{field}: no base model {name!r} (the operator offers: {offered})", field=field)
            if not path.is_dir():
                raise InvalidInput(f"{field}: base model {name!r} is not available now", field=field)
            return str(path.resolve())
        job_id, _, step = ref.partition(":")
        try:
            source = self.store.get_job(job_id, tenant=p.tenant)
        except JobNotFound:
            raise InvalidInput(f"{field}: job {job_id!r} not found", field=field) from None
        work_dir = Path(source.work_dir).resolve()
        found = [c for c in self.store.checkpoints(job_id) if not step or c["step"] == int(step)]
        for c in sorted(found, key=lambda c: c["step"], reverse=True):
            uri = urlparse(c["uri"])
            if uri.scheme not in ("", "file"):
                continue
            path = Path(unquote(uri.path)).resolve()
            if path.is_relative_to(work_dir) and path.is_dir():
                return str(path)
        which = f"a checkpoint of step {step}" if step else "a checkpoint"
        raise InvalidInput(f"{field}: job {job_id!r} has no {which} (see its /checkpoints)", field=field)

    def list_jobs(self, p: Principal, state: JobState | None, offset: int, limit: int) -> tuple[list[JobRecord], int]:
        return self.store.list_jobs(p.tenant, state, offset, limit)

    def get_job(self, p: Principal, job_id: str) -> JobRecord:
        return self._job(p, job_id)

    async def aget_job(self, p: Principal, job_id: str) -> JobRecord:
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
            if job.state in (JobState.QUEUED, JobState.PAUSED):
                self.store.transition(job_id, JobState.CANCELLED, expect=[job.state], reason="cancelled by user")
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

    def delete_job(self, p: Principal, job_id: str, keep_checkpoints: bool = False) -> None:
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
        work_dir = Path(job.work_dir).resolve()
        if not work_dir.is_relative_to(self.jobs_dir) or work_dir == self.jobs_dir:
            log.warning("job %s: work dir %s is outside %s; its files are left alone", job_id, work_dir, self.jobs_dir)
            return
        if not work_dir.is_dir():
            return
        doomed = [c for c in work_dir.iterdir() if c.name != "checkpoints"] if keep_checkpoints else [work_dir]
        for path in doomed:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def events(self, p: Principal, job_id: str, after: str | None, limit: int) -> list[dict[str, Any]]:
        self._job(p, job_id)
        return self.store.events(job_id, after=after, limit=limit)

    def followed_events(self, job_id: str, after: str | None, limit: int) -> list[dict[str, Any]]:
        """The next events of a job whose stream the caller was already allowed to follow (see `events`); an empty
        list once the job is gone."""
        return self.store.events(job_id, after=after, limit=limit)

    def job_finished(self, job_id: str) -> bool:
        """The job has reached a final state, or no longer exists."""
        state = self.store.job_field(job_id, "state")
        return state is None or JobState(state).is_terminal

    def jobs_by_state(self) -> dict[str, int]:
        """How many jobs are in each state (every tenant's)."""
        return self.store.count_by_state()

    def metrics(self, p: Principal, job_id: str, after: str | None, limit: int) -> list[dict[str, Any]]:
        self._job(p, job_id)
        return self.store.metrics(job_id, after=after, limit=limit)

    def checkpoints(self, p: Principal, job_id: str) -> list[dict[str, Any]]:
        """The job's checkpoints that exist (the runner deletes all but the newest `keep_last_checkpoints`)."""
        self._job(p, job_id)
        return [c for c in self.store.checkpoints(job_id) if _checkpoint_exists(c["uri"])]

    def trajectories(self, p: Principal, job_id: str, *, status: str | None = None, min_reward: float | None = None,
                     max_reward: float | None = None, step: int | None = None, offset: int = 0,
                     limit: int = 50) -> list[dict[str, Any]]:
        job = self._job(p, job_id)
        traj_dir = Path(job.work_dir) / "trajectories"
        if not traj_dir.exists():
            return []
        from rollout_workers.storage import read_trajectories

        trajs = read_trajectories(traj_dir, status=status, min_reward=min_reward, max_reward=max_reward,
                                  step=step, offset=offset, limit=limit)
        # the tokens after the prompt, and which of them the loss trains on (1: the model wrote it)
        return [{**t.model_dump(mode="json"), "completion_ids": t.completion_ids(), "loss_mask": t.loss_mask()}
                for t in trajs]

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

    # ---- task files ----
    def create_file(self, p: Principal, filename: str, purpose: str, stream: Any) -> dict[str, Any]:
        from rl_service.task_files import TaskFileError

        try:
            return self.task_files.create(p.tenant, filename, purpose, stream)
        except TaskFileError as exc:
            field = str(exc).split(":", 1)[0]
            error = {413: TooLarge, 409: Conflict}.get(exc.status, InvalidInput)
            raise error(str(exc), field=field if field in ("file", "purpose") else "file") from None

    def list_files(self, p: Principal) -> list[dict[str, Any]]:
        return self.task_files.list(p.tenant)

    def get_file(self, p: Principal, file_id: str) -> dict[str, Any]:
        meta = self.task_files.get(p.tenant, file_id)
        if meta is None:
            raise NotFound(f"file {file_id!r} not found", field="file_id")
        return meta

    def delete_file(self, p: Principal, file_id: str) -> None:
        """Refused (409) while a job that has not finished names the file."""
        for state in JobState:
            if state.is_terminal:
                continue
            offset = 0
            while True:
                jobs, total = self.store.list_jobs(p.tenant, state, offset, 200)
                for job in jobs:
                    if file_id in (job.spec.tasks.train_file, job.spec.tasks.eval_file):
                        raise Conflict(f"file {file_id!r} is used by job {job.id} ({state.value}); delete it once the "
                                       "job has finished", field="file_id")
                offset += len(jobs)
                if not jobs or offset >= total:
                    break
        if not self.task_files.delete(p.tenant, file_id):
            raise NotFound(f"file {file_id!r} not found", field="file_id")

    # ---- environments ----
    def _registry(self):  # imported lazily: the registry pulls in environment code the API rarely needs
        from rollout_workers.environments import registry

        return registry

    @property
    def env_policy(self) -> Any:
        if self._env_policy is None:
            from rollout_workers.environments.policy import EnvironmentPolicy

            self._env_policy = EnvironmentPolicy()
        return self._env_policy

    def _check_job_environment(self, spec: JobSpec, registration: dict[str, Any] | None) -> None:
        """The job's environment options are declared and within the operator's limits (422 naming the field)."""
        registry = self._registry()
        env = spec.environment.name if registration is None else registry.EnvironmentRegistration.model_validate(registration)
        try:
            registry.check_job_environment(env, spec.environment.options, spec.tasks.options, self.env_policy)
        except ValueError as exc:
            raise named_invalid(exc) from None

    def builtin_environments(self) -> list[str]:
        return sorted(self._registry().BUILTIN_ENVIRONMENTS)

    def _resolve_environment(self, p: Principal, name: str) -> dict[str, Any] | None:
        """The tenant's registration snapshot for ``name`` (None for a built-in); 422 if unknown."""
        registered = self.store.get_environment(p.tenant, name)
        if registered is not None:
            return registered
        if name in self.builtin_environments():
            return None
        raise InvalidInput(f"unknown environment {name!r} (register it first or use a built-in)",
                           field="environment.name")

    def register_environment(self, p: Principal, body: Any) -> dict[str, Any]:
        """Validate (rollout_workers' registry: imports the class / checks the URL and tool schemas) and store."""
        registry = self._registry()
        if not isinstance(body, registry.EnvironmentRegistration):
            try:
                body = registry.EnvironmentRegistration.model_validate(body)
            except ValidationError as exc:
                raise invalid_from(exc) from None
        if body.name in self.builtin_environments():
            raise Conflict(f"{body.name!r} is a built-in environment", field="name")
        try:
            reg = registry.validate_registration(body, self.env_policy)
            registry.check_reachable(reg, self.env_policy)
            check_declared_rewards(reg.grader, reg.process_rewards)
        except ValueError as exc:
            raise named_invalid(exc) from None
        if reg.kind == "python":
            self._check_workers_import(reg.import_path or "")
        data = reg.model_dump(mode="json")
        if not self.store.put_environment(p.tenant, reg.name, data):
            raise Conflict(f"environment {reg.name!r} is already registered; delete it first", field="name")
        return data

    def _check_workers_import(self, import_path: str, timeout_s: float = 60.0) -> None:
        """The cluster's workers, not only this process, can import a python environment (a task on the Ray
        cluster this process has joined; nothing to ask when it has joined none)."""
        import ray

        if not ray.is_initialized():
            return
        importable = ray.remote(num_cpus=0, max_retries=0)(self._registry().importable_here)
        try:
            error = ray.get(importable.remote(import_path), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            error = f"the cluster did not answer within {timeout_s:.0f} s"
        if error:
            raise InvalidInput(
                f"the cluster's workers cannot import {import_path}: {error}. Install the package where the "
                "workers run (every Ray node); a local Ray head started before the package or PYTHONPATH was "
                "set needs `taper down` and `taper serve`", field="import_path")

    def list_environments(self, p: Principal) -> list[dict[str, Any]]:
        out = [{"name": n, "builtin": True, "registration": None} for n in self.builtin_environments()]
        for name, reg in self.store.list_environments(p.tenant).items():
            out.append({"name": name, "builtin": False, "registration": reg})
        return out

    def get_environment(self, p: Principal, name: str) -> dict[str, Any]:
        reg = self.store.get_environment(p.tenant, name)
        if reg is not None:
            return {"name": name, "builtin": False, "registration": reg}
        if name in self.builtin_environments():
            return {"name": name, "builtin": True, "registration": None}
        raise NotFound(f"environment {name!r} not found", field="name")

    def delete_environment(self, p: Principal, name: str) -> None:
        if not self.store.delete_environment(p.tenant, name):
            if name in self.builtin_environments():
                raise Conflict(f"{name!r} is a built-in environment", field="name")
            raise NotFound(f"environment {name!r} not found", field="name")

    # ---- health ----
    def health(self) -> dict[str, Any]:
        try:
            ok = self.store.ping()
        except Exception:
            ok = False
        return {"ok": ok, "redis": ok}


def check_declared_rewards(grader: dict[str, Any] | None, process_rewards: list[dict[str, Any]],
                           prefix: str = "") -> None:
    """A declared grader and process components are well-formed (ValueError naming the field)."""
    from reward_models.graders import parse_grader, parse_process

    if grader is not None:
        parse_grader(grader, f"{prefix}grader")
    parse_process(process_rewards, f"{prefix}process_rewards")


def validate_tenant(tenant: str) -> None:
    import re

    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,63}", tenant):
        raise InvalidInput("tenant must be 1-64 chars of a-z, 0-9, '_' or '-', starting with a letter or digit",
                           field="tenant")


@dataclass
class ServiceRuntime:
    """What a running control plane holds: the service and its scheduler loop."""

    service: TaperService
    scheduler: Any = None
    supervisor: Any = None  # local_services.EmbeddedSupervisor on the embedded setup

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        if self.scheduler is not None:
            self.scheduler.stop()
        self.service.store.close()


def _checkpoint_exists(uri: str) -> bool:
    parts = urlparse(uri)
    return parts.scheme != "file" or Path(unquote(parts.path)).is_dir()


def start_runtime(settings: Any, *, run_scheduler: bool = True, runner: str | type | None = None,
                  detached_scheduler: bool = False) -> ServiceRuntime:
    """Connect to Redis and join Ray, or use the data dir's embedded ones (a private Redis and a local Ray
    head, each started once in its own session so that jobs keep running through an API restart; `taper down`
    stops them), then run the scheduler loop (DESIGN.md section 8). On the embedded setup a supervisor thread
    restarts a Redis that died, and with ``detached_scheduler`` (`taper serve`) keeps a scheduler process
    running beside this one, so that jobs are placed and recovered while no API runs. Writes a first API key
    for tenant ``default`` to ``data_dir/api-key`` when the store has none, so a fresh single-machine install
    can be used at once."""
    from rl_service.control.local_services import (
        EmbeddedSupervisor,
        ensure_embedded_redis,
        ensure_service_ray,
        write_secret,
    )
    from rl_service.control.scheduler import Scheduler

    data_dir = Path(settings.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    url = settings.redis_url or ensure_embedded_redis(data_dir, binary=settings.redis_server_bin).client_url
    store = Store(url, events_maxlen=settings.events_maxlen, metrics_maxlen=settings.metrics_maxlen,
                  schedule_max_versions=settings.schedule_max_versions)
    service = TaperService(store, data_dir, submit_rate_per_minute=settings.submit_rate_per_minute,
                           env_policy=settings.environment_policy(), limits=settings.limits,
                           default_quota=settings.default_quota, base_models=settings.base_models,
                           task_file_limits=settings.task_files)
    service.builtin_environments()  # import the environment registry now, not in the first submission
    if not store.has_api_keys():
        key_file = data_dir / "api-key"
        key = store.create_api_key("default", name="bootstrap", admin=True)
        write_secret(key_file, key + "\n")
    scheduler = supervisor = None
    if run_scheduler:
        ensure_service_ray(settings.ray_address, data_dir, num_cpus=settings.local_cpus)
        scheduler = Scheduler(store, runner=runner or settings.job_runner, default_quota=settings.default_quota)
        scheduler.start()
    if not settings.redis_url:
        embedded_ray = run_scheduler and not settings.ray_address
        supervisor = EmbeddedSupervisor(data_dir, settings.redis_server_bin,
                                        scheduler=detached_scheduler and embedded_ray).start()
    return ServiceRuntime(service=service, scheduler=scheduler, supervisor=supervisor)
