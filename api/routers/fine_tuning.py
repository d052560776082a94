"""/v1/fine_tuning/jobs: OpenAI's fine-tuning API over Taper jobs, so the official `openai` client drives them
(same keys: the API key is the client's `api_key`). Errors on these routes come in OpenAI's shape. Thin: the
translation lives in rl_service.control.openai_compat, every rule in rl_service.control.service."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request

from api.openai_schemas import (
    FineTuningJob,
    FineTuningJobCheckpointPage,
    FineTuningJobEventPage,
    FineTuningJobPage,
    openai_error_responses,
)
from api.routers.dependencies import JobId, Svc, Who
from api.routers.openai_route import OpenAIRoute
from rl_service.control.openai_compat import (
    CHECKPOINT_ID,
    EVENT_ID,
    FineTuningJobCreate,
    FineTuningJobs,
    metadata_filter,
)

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning (OpenAI-compatible)"], route_class=OpenAIRoute)

JobAfter = Annotated[str | None, Query(pattern=r"^job-[0-9a-f]{16}$", description="The last id of the previous page.")]
EventAfter = Annotated[str | None, Query(pattern=EVENT_ID, description="The last id of the previous page.")]
CheckpointAfter = Annotated[str | None, Query(pattern=CHECKPOINT_ID, description="The last id of the previous page.")]
Limit = Annotated[int, Query(ge=1, le=100)]
_CONTROL = openai_error_responses(400, 401, 404, 409, 422)


def _jobs(svc: Svc) -> FineTuningJobs:
    return FineTuningJobs(svc)


@router.post("", response_model=FineTuningJob, summary="Create a fine-tuning job (reinforcement)",
             responses=openai_error_responses(400, 401, 409, 413, 422, 429))
def create_job(
    request: FineTuningJobCreate,
    svc: Svc,
    who: Who,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=255, pattern=r"^[!-~]([ -~]*[!-~])?$",
                                                  description="A repeat of the same request answers the first job; "
                                                              "the same key with another request is a 409")] = None,
) -> dict[str, Any]:
    """OpenAI's fields; Taper's job blocks (environment, tasks, rollout, algorithm, reward_schedule, resources,
    total_steps, ...) as extra top-level fields (the client's `extra_body`)."""
    return _jobs(svc).create(who, request, idempotency_key)


@router.get("", response_model=FineTuningJobPage, summary="List fine-tuning jobs, newest first",
            responses=openai_error_responses(400, 401, 404, 422))
def list_jobs(request: Request, svc: Svc, who: Who, after: JobAfter = None, limit: Limit = 20) -> dict[str, Any]:
    """`metadata[KEY]=VALUE` (any number, as OpenAI's client sends `metadata={...}`) lists only the jobs whose
    metadata holds every such pair."""
    return _jobs(svc).list(who, after, limit, metadata_filter(request.query_params.multi_items()))


@router.get("/{fine_tuning_job_id}", response_model=FineTuningJob, summary="Retrieve a fine-tuning job",
            responses=openai_error_responses(400, 401, 404, 422))
def retrieve_job(fine_tuning_job_id: JobId, svc: Svc, who: Who) -> dict[str, Any]:
    return _jobs(svc).retrieve(who, fine_tuning_job_id)


@router.post("/{fine_tuning_job_id}/cancel", response_model=FineTuningJob, summary="Cancel a fine-tuning job",
             responses=_CONTROL)
def cancel_job(fine_tuning_job_id: JobId, svc: Svc, who: Who) -> dict[str, Any]:
    return _jobs(svc).cancel(who, fine_tuning_job_id)


@router.post("/{fine_tuning_job_id}/pause", response_model=FineTuningJob, summary="Pause a fine-tuning job",
             responses=_CONTROL)
def pause_job(fine_tuning_job_id: JobId, svc: Svc, who: Who) -> dict[str, Any]:
    return _jobs(svc).pause(who, fine_tuning_job_id)


@router.post("/{fine_tuning_job_id}/resume", response_model=FineTuningJob, summary="Resume a paused fine-tuning job",
             responses=_CONTROL)
def resume_job(fine_tuning_job_id: JobId, svc: Svc, who: Who) -> dict[str, Any]:
    return _jobs(svc).resume(who, fine_tuning_job_id)


@router.get("/{fine_tuning_job_id}/events", response_model=FineTuningJobEventPage,
            summary="A fine-tuning job's events, newest first", responses=openai_error_responses(400, 401, 404, 422))
def list_events(fine_tuning_job_id: JobId, svc: Svc, who: Who, after: EventAfter = None, limit: Limit = 20) -> dict[str, Any]:
    return _jobs(svc).events(who, fine_tuning_job_id, after, limit)


@router.get("/{fine_tuning_job_id}/checkpoints", response_model=FineTuningJobCheckpointPage,
            summary="A fine-tuning job's checkpoints, newest first", responses=openai_error_responses(400, 401, 404, 422))
def list_checkpoints(fine_tuning_job_id: JobId, svc: Svc, who: Who, after: CheckpointAfter = None,
                     limit: Limit = 10) -> dict[str, Any]:
    return _jobs(svc).checkpoints(who, fine_tuning_job_id, after, limit)
