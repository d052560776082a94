"""Request and response models of the REST API (the job spec and schedule types come from their owners)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from reward_models.schedule import RewardSchedule, ScheduleVersion
from rl_service.control.quota import TenantQuota
from rl_service.control.service.host_paths import hide_host_paths
from rl_service.control.store import JobRecord
from rl_service.job_states import JobState
from rl_service.spec import JobSpec, checkpoint_ref


class ErrorDetail(BaseModel):
    field: str
    message: str


class ErrorBody(BaseModel):
    code: str = Field(description="Machine-readable kind: not_found, conflict, invalid, unauthorized, ...")
    message: str
    field: str | None = Field(None, description="The offending field (dotted path), header or parameter.")
    details: list[ErrorDetail] | None = Field(None, description="Every invalid field (validation errors only).")


class ErrorResponse(BaseModel):
    error: ErrorBody


_ERROR_STATUSES: dict[int, tuple[str, dict[str, dict[str, Any]]]] = {
    400: ("The request body could not be read (e.g. not UTF-8)", {}),
    401: ("Missing or invalid API key",
          {"WWW-Authenticate": {"description": "The auth scheme to use", "schema": {"type": "string"}}}),
    403: ("The API key may not do this (e.g. an admin-only operation)", {}),
    404: ("The job or environment does not exist (or belongs to another tenant)", {}),
    409: ("The request conflicts with the resource's current state", {}),
    413: ("The request body is over the configured size limit", {}),
    422: ("Invalid input; `error.field` names the offending field", {}),
    429: ("Rate limited", {"Retry-After": {"description": "Seconds to wait before retrying",
                                          "schema": {"type": "integer", "minimum": 0}}}),
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI `responses` of the error statuses a route can answer, all with the shared error body."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        description, headers = _ERROR_STATUSES[status]
        out[status] = {"model": ErrorResponse, "description": description}
        if headers:
            out[status]["headers"] = {name: {**header, "required": True} for name, header in headers.items()}
    return out


class JobOut(BaseModel):
    id: str
    name: str
    state: JobState
    control: str = Field(description="What the control plane asks of the job: run, pause or cancel.")
    priority: int
    created_at: float
    updated_at: float
    started_at: float | None
    finished_at: float | None
    step: int
    total_steps: int
    progress: float = Field(description="step / total_steps")
    attempts: int = Field(description="Driver starts so far (more than 1 after a resume or a restart).")
    error: str | None
    warning: str | None = Field(None, description="The latest warning (infrastructure failures, suspected reward "
                                                  "hacking); cleared when the job is resumed.")
    schedule_version: int
    last_checkpoint: str | None
    last_metrics: dict[str, Any] | None
    spec: JobSpec

    @classmethod
    def of(cls, job: JobRecord) -> JobOut:
        # host paths stay in the control plane: the tenant sees its checkpoint and file ids, not where they lie
        data = job.model_dump(exclude={"tenant": True, "work_dir": True, "spec": {
            "model": {"checkpoint_dir"}, "tasks": {"train_path", "eval_path"}}})
        for name in ("error", "warning", "last_checkpoint"):
            data[name] = hide_host_paths(data[name], [job.work_dir])
        return cls(**data, progress=min(job.step / max(job.total_steps, 1), 1.0))


class JobPage(BaseModel):
    items: list[JobOut]
    total: int
    offset: int
    limit: int


class EventOut(BaseModel):
    id: str = Field(description="Stream id; pass it as `after` (or Last-Event-ID) to continue.")
    kind: str
    ts: float
    data: dict[str, Any]


class EventPage(BaseModel):
    items: list[EventOut]
    next: str | None = Field(description="Cursor for the next page (None when this page was short).")


class MetricsRow(BaseModel):
    id: str
    step: int
    ts: float
    metrics: dict[str, Any]


class MetricsPage(BaseModel):
    items: list[MetricsRow]
    next: str | None


class CheckpointOut(BaseModel):
    step: int
    checkpoint: str = Field(description="The checkpoint as `model.checkpoint` takes it: JOB_ID:STEP.")
    download_url: str = Field(description="Its model folder as a tar (GET, with your key).")
    ts: float

    @classmethod
    def of(cls, job_id: str, stored: dict[str, Any]) -> CheckpointOut:
        step = stored["step"]
        return cls(step=step, checkpoint=checkpoint_ref(job_id, step),
                   download_url=f"/v1/jobs/{job_id}/checkpoints/{step}/download", ts=stored["ts"])


class TrajectoryPage(BaseModel):
    items: list[dict[str, Any]]
    offset: int
    limit: int


class ScheduleOut(BaseModel):
    version: int
    effective_from: int
    schedule: RewardSchedule
    history: list[ScheduleVersion]


class EnvironmentOut(BaseModel):
    name: str
    builtin: bool
    registration: dict[str, Any] | None


class KeyOut(BaseModel):
    id: str = Field(description="Names the key in listings and revocations (the key itself is never stored).")
    tenant: str
    name: str
    admin: bool
    created_at: float
    expires_at: float | None


class KeyCreated(KeyOut):
    key: str = Field(description="The bearer key: shown this once.")


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str = Field(min_length=1, max_length=64)
    name: str = Field("", max_length=128)
    admin: bool = False
    expires_in_s: float | None = Field(None, gt=0, le=10 * 365 * 86400, description="Lifetime; none: no expiry.")


class QuotaOut(BaseModel):
    tenant: str
    quota: TenantQuota
    default: bool = Field(description="True when the tenant has no quota of its own (the operator's default applies).")


class Health(BaseModel):
    ok: bool
    redis: bool
