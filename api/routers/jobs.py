"""/v1/jobs: submit, list, inspect and control jobs; their events, metrics, trajectories, checkpoints and
reward schedule. Thin: every rule lives in rl_service.control.service."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Header, Query, Request, Response
from sse_starlette.sse import EventSourceResponse

from api.openapi import SchemaCheckedRoute
from api.routers.dependencies import JobId, Svc, Who
from api.schemas import (
    CheckpointOut,
    EventOut,
    EventPage,
    JobOut,
    JobPage,
    MetricsPage,
    MetricsRow,
    ScheduleOut,
    TrajectoryPage,
    error_responses,
)
from reward_models.schedule import SchedulePatch
from rl_service.control.service import TaperService
from rl_service.job_states import JobState
from rl_service.spec import JobSpec

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], route_class=SchemaCheckedRoute)

# A stream id `ms-seq`, or `ms` alone for `ms-0` (as Redis reads it)
STREAM_ID = r"^\d{1,19}(-\d{1,19})?$"
Cursor = Annotated[str | None, Query(pattern=STREAM_ID, description="Return items after this stream id.")]
Offset = Annotated[int, Query(ge=0, le=1_000_000)]


_LOCATION = {"Location": {"description": "The job's URL", "schema": {"type": "string"}, "required": True}}


@router.post("", status_code=201, response_model=JobOut, summary="Submit a job",
             responses={201: {"headers": _LOCATION},
                        200: {"model": JobOut, "headers": _LOCATION,
                              "description": "Replay of an earlier submission (Idempotency-Key)"},
                        **error_responses(400, 409, 413, 422, 429)})
def submit_job(
    spec: JobSpec,
    svc: Svc,
    who: Who,
    response: Response,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=255, pattern=r"^[!-~]([ -~]*[!-~])?$",
                                                  description="Printable ASCII: a repeat answers the first job")] = None,
) -> JobOut:
    job, created = svc.jobs.submit(who, spec, idempotency_key)
    if not created:
        response.status_code = 200
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return JobOut.of(job)


@router.get("", response_model=JobPage, summary="List the tenant's jobs, newest first",
            responses=error_responses(422))
def list_jobs(
    svc: Svc,
    who: Who,
    state: JobState | None = None,
    offset: Offset = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> JobPage:
    jobs, total = svc.jobs.list_jobs(who, state, offset, limit)
    return JobPage(items=[JobOut.of(j) for j in jobs], total=total, offset=offset, limit=limit)


@router.get("/{job_id}", response_model=JobOut, responses=error_responses(404, 422))
async def get_job(job_id: JobId, svc: Svc, who: Who) -> JobOut:
    return JobOut.of(await svc.jobs.aget(who, job_id))


@router.delete("/{job_id}", status_code=204, response_class=Response,
               summary="Delete a finished job with its records and files",
               responses=error_responses(404, 409, 422))
def delete_job(
    job_id: JobId, svc: Svc, who: Who,
    keep_checkpoints: Annotated[bool, Query(description="Keep the checkpoint files (records go either way).")] = False,
) -> Response:
    svc.jobs.delete(who, job_id, keep_checkpoints=keep_checkpoints)
    return Response(status_code=204)


_CONTROL = error_responses(404, 409, 422)


@router.post("/{job_id}/cancel", response_model=JobOut, summary="Cancel a job", responses=_CONTROL)
def cancel_job(job_id: JobId, svc: Svc, who: Who) -> JobOut:
    """A queued or paused job is cancelled at once; a starting or running one is asked to stop."""
    return JobOut.of(svc.jobs.cancel(who, job_id))


@router.post("/{job_id}/pause", response_model=JobOut, summary="Pause a job", responses=_CONTROL)
def pause_job(job_id: JobId, svc: Svc, who: Who) -> JobOut:
    """A starting or running job is asked to pause after its current step (it keeps its checkpoint)."""
    return JobOut.of(svc.jobs.pause(who, job_id))


@router.post("/{job_id}/resume", response_model=JobOut, summary="Resume a job", responses=_CONTROL)
def resume_job(job_id: JobId, svc: Svc, who: Who) -> JobOut:
    """A paused job is queued again and resumes from its last checkpoint; a pending pause is withdrawn."""
    return JobOut.of(svc.jobs.resume(who, job_id))


@router.get(
    "/{job_id}/events",
    response_model=EventPage,
    summary="Job events: a paged JSON list, or a live SSE stream with `Accept: text/event-stream`",
    responses={200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}},
               **error_responses(404, 422)},
)
async def job_events(
    request: Request,
    job_id: JobId,
    svc: Svc,
    who: Who,
    after: Cursor = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    last_event_id: Annotated[str | None, Header(pattern=STREAM_ID)] = None,
) -> Any:
    items = await asyncio.to_thread(svc.jobs.events, who, job_id, after or last_event_id, limit)
    if "text/event-stream" not in request.headers.get("accept", ""):
        return EventPage(items=[EventOut(**e) for e in items],
                         next=items[-1]["id"] if len(items) == limit else None)
    return EventSourceResponse(_event_stream(request, svc, job_id, after or last_event_id), ping=15)


async def _event_stream(request: Request, svc: TaperService, job_id: str, after: str | None) -> AsyncIterator[dict]:
    """Replays events after ``after``, then follows the stream until the job has finished."""
    cursor = after
    while not await request.is_disconnected():
        batch = await asyncio.to_thread(svc.jobs.followed_events, job_id, cursor, 500)
        for e in batch:
            cursor = e["id"]
            yield {"id": e["id"], "event": e["kind"], "data": json.dumps({"ts": e["ts"], **e["data"]})}
        if not batch:
            if await asyncio.to_thread(svc.jobs.finished, job_id):
                # the terminal state and its event are written together: one last read sends it
                for e in await asyncio.to_thread(svc.jobs.followed_events, job_id, cursor, 10_000):
                    yield {"id": e["id"], "event": e["kind"], "data": json.dumps({"ts": e["ts"], **e["data"]})}
                return
            await asyncio.sleep(0.25)


@router.get("/{job_id}/metrics", response_model=MetricsPage, summary="Per-step training metrics",
            responses=error_responses(404, 422))
def job_metrics(
    job_id: JobId, svc: Svc, who: Who, after: Cursor = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
) -> MetricsPage:
    rows = svc.jobs.metrics(who, job_id, after, limit)
    return MetricsPage(items=[MetricsRow(**r) for r in rows], next=rows[-1]["id"] if len(rows) == limit else None)


@router.get("/{job_id}/trajectories", response_model=TrajectoryPage, summary="Recorded trajectories (paged)",
            responses=error_responses(404, 422))
def job_trajectories(
    job_id: JobId,
    svc: Svc,
    who: Who,
    status: Literal["ok", "truncated", "env_error", "tool_timeout"] | None = None,
    min_reward: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    max_reward: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    step: Annotated[int | None, Query(ge=0, le=10_000_000)] = None,
    offset: Offset = 0,
    limit: Annotated[int, Query(ge=1, le=200)] = 20,
) -> TrajectoryPage:
    items = svc.jobs.trajectories(who, job_id, status=status, min_reward=min_reward, max_reward=max_reward,
                             step=step, offset=offset, limit=limit)
    return TrajectoryPage(items=items, offset=offset, limit=limit)


@router.get("/{job_id}/checkpoints", response_model=list[CheckpointOut], responses=error_responses(404, 422))
def job_checkpoints(job_id: JobId, svc: Svc, who: Who) -> list[CheckpointOut]:
    return [CheckpointOut.of(job_id, c) for c in svc.jobs.checkpoints(who, job_id)]


def _schedule_out(history) -> ScheduleOut:
    cur = history.current
    return ScheduleOut(version=cur.version, effective_from=cur.effective_from, schedule=cur.schedule,
                       history=history.versions)


@router.get("/{job_id}/reward-schedule", response_model=ScheduleOut, tags=["schedule"],
            responses=error_responses(404, 422))
def get_reward_schedule(job_id: JobId, svc: Svc, who: Who) -> ScheduleOut:
    return _schedule_out(svc.jobs.schedule(who, job_id))


@router.patch(
    "/{job_id}/reward-schedule",
    response_model=ScheduleOut,
    tags=["schedule"],
    summary="Change the process-reward schedule from the job's next step (a new version)",
    responses=error_responses(400, 404, 409, 413, 422),
)
def patch_reward_schedule(
    job_id: JobId,
    svc: Svc,
    who: Who,
    patch: Annotated[SchedulePatch, Body(examples=[{"w_end": 0.0, "horizon": 50}])],
) -> ScheduleOut:
    """A patch that is valid on its own but does not fit the job's schedule (e.g. `half_life` while the kind is
    linear) is a 409, as is any patch of a finished job."""
    svc.jobs.patch_schedule(who, job_id, patch.changes())
    return _schedule_out(svc.jobs.schedule(who, job_id))
