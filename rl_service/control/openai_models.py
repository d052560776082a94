"""OpenAI's `/v1/models` and checkpoint permissions over Taper (translation only; the rules stay in
TaperService and the store).

Models: the presets (`tiny`, `small`, `large`), the operator's base models (`base:NAME`) and aliases, and the tenant's
fine-tuned models (its succeeded jobs, by job id; `JOB_ID:STEP` names one checkpoint). Each is a `model` to
start a job from. Checkpoint permissions let other tenants (OpenAI's projects: here, tenant names) start jobs
from one of the tenant's checkpoints (`JOB_ID:STEP`) or fine-tuned models (`JOB_ID`)."""

from __future__ import annotations

from typing import Any, Literal

from rl_service.control.openai_compat import PRESETS, page
from rl_service.control.service import (
    InvalidInput,
    NotFound,
    Principal,
    QuotaExceeded,
    TaperService,
    validate_tenant,
)
from rl_service.control.store import PermissionsFull
from rl_service.job_states import JobState

MAX_PROJECTS_PER_REQUEST = 32


def model_object(model_id: str, created: int, owned_by: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": owned_by}


def permission_object(perm: dict[str, Any]) -> dict[str, Any]:
    return {"id": perm["id"], "object": "checkpoint.permission", "created_at": perm["created_at"],
            "project_id": perm["project_id"]}


class OpenAIModels:
    def __init__(self, service: TaperService) -> None:
        self.service = service

    def _fine_tuned(self, p: Principal) -> list[dict[str, Any]]:
        out, offset = [], 0
        while True:
            jobs, total = self.service.jobs.list_jobs(p, JobState.SUCCEEDED, offset, 500)
            out += [model_object(j.id, int(j.finished_at or j.created_at), p.tenant) for j in jobs]
            offset += len(jobs)
            if not jobs or offset >= total:
                return out

    def list(self, p: Principal) -> dict[str, Any]:
        """Presets, the operator's base models, then the tenant's fine-tuned models newest first."""
        data = [model_object(name, 0, "taper") for name in PRESETS]
        data += [model_object(f"base:{name}", 0, "operator") for name in sorted(self.service.files.base_models)]
        data += [model_object(alias, 0, "operator") for alias in sorted(self.service.model_aliases)]
        data += self._fine_tuned(p)
        return {"object": "list", "data": data}

    def retrieve(self, p: Principal, model: str) -> dict[str, Any]:
        if model in PRESETS:
            return model_object(model, 0, "taper")
        if model in self.service.model_aliases or (model.startswith("base:") and model.removeprefix("base:")
                                                   in self.service.files.base_models):
            return model_object(model, 0, "operator")
        job_id, _, step = model.partition(":")
        if job_id.startswith("job-"):
            try:
                job = self.service.jobs.get(p, job_id)
            except NotFound:
                job = None
            if job is not None and not step and job.state == JobState.SUCCEEDED:
                return model_object(job.id, int(job.finished_at or job.created_at), p.tenant)
            if job is not None and step.isdigit() and self._has_checkpoint(p, job_id, int(step)):
                return model_object(model, int(job.created_at), p.tenant)
        raise NotFound(f"model {model!r} not found", field="model")

    def _has_checkpoint(self, p: Principal, job_id: str, step: int) -> bool:
        return any(c["step"] == step for c in self.service.jobs.checkpoints(p, job_id))

    # ---- checkpoint permissions ----
    def _own_checkpoint(self, p: Principal, ref: str) -> str:
        """The job id of ``ref`` (`JOB_ID` of a succeeded job, or `JOB_ID:STEP` of a checkpoint that exists), one
        of the tenant's; 404 otherwise."""
        job_id, _, step = ref.partition(":")
        try:
            job = self.service.jobs.get(p, job_id)
        except NotFound:
            raise NotFound(f"checkpoint {ref!r} not found", field="fine_tuned_model_checkpoint") from None
        if step and not (step.isdigit() and self._has_checkpoint(p, job_id, int(step))):
            raise NotFound(f"checkpoint {ref!r} not found", field="fine_tuned_model_checkpoint")
        if not step and job.state != JobState.SUCCEEDED:
            raise NotFound(f"{ref!r} is not a fine-tuned model (the job has not succeeded)",
                           field="fine_tuned_model_checkpoint")
        return job_id

    def grant(self, p: Principal, ref: str, project_ids: list[str]) -> dict[str, Any]:
        job_id = self._own_checkpoint(p, ref)
        if not 1 <= len(project_ids) <= MAX_PROJECTS_PER_REQUEST:
            raise InvalidInput(f"project_ids: 1 to {MAX_PROJECTS_PER_REQUEST} project ids", field="project_ids")
        for i, project in enumerate(project_ids):
            try:
                validate_tenant(project)
            except InvalidInput:
                raise InvalidInput(f"project_ids[{i}]: {project[:80]!r} is not a tenant name", field=f"project_ids[{i}]") \
                    from None
            if project == p.tenant:
                raise InvalidInput(f"project_ids[{i}]: the checkpoint is already yours", field=f"project_ids[{i}]")
        try:
            granted = [self.service.store.grant(job_id, ref, project) for project in project_ids]
        except PermissionsFull as exc:
            raise QuotaExceeded(str(exc), field="project_ids") from None
        return page([permission_object(g) for g in granted], False)

    def permissions(self, p: Principal, ref: str, *, after: str | None, limit: int,
                    order: Literal["ascending", "descending"], project_id: str | None) -> dict[str, Any]:
        job_id = self._own_checkpoint(p, ref)
        found = [perm for perm in self.service.store.permissions(job_id) if perm["checkpoint"] == ref
                 and (project_id is None or perm["project_id"] == project_id)]
        if order == "descending":
            found.reverse()
        if after is not None:
            ids = [perm["id"] for perm in found]
            if after not in ids:
                raise NotFound(f"after: no permission {after!r} in this list", field="after")
            found = found[ids.index(after) + 1:]
        return page([permission_object(perm) for perm in found[:limit]], len(found) > limit)

    def revoke(self, p: Principal, ref: str, permission_id: str) -> dict[str, Any]:
        job_id = self._own_checkpoint(p, ref)
        ours = any(perm["id"] == permission_id and perm["checkpoint"] == ref
                   for perm in self.service.store.permissions(job_id))
        if not ours or not self.service.store.revoke(job_id, permission_id):
            raise NotFound(f"permission {permission_id!r} not found", field="permission_id")
        return {"id": permission_id, "object": "checkpoint.permission", "deleted": True}
