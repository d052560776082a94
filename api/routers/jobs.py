"""/v1/jobs: submit, list, inspect and control jobs; their events, metrics, trajectories, checkpoints and
reward schedule. Thin: every rule lives in rl_service.service."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Header, Query, Request, Response
from sse_starlette.sse import EventSourceResponse

from api.routers.params import JobId, Svc, Who
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
)
from rl_service.job_states import JobState
from rl_service.service import TaperService
from rl_service.spec import JobSpec

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

Cursor = Annotated[str | None, Query(pattern=r"^\d{1,19}-\d{1,19}$", description="Return items after this id.")]
Offset = Annotated[int, Query(ge=0, le=1_000_000)]


@router.post("", status_code=201, response_model=JobOut, summary="Submit a job",
             responses={200: {"model": JobOut, "description": "Replay of an earlier submission (Idempotency-Key)"}})
def submit_job(
    spec: JobSpec,
    svc: Svc,
    who: Who,
    response: Response,
    idempotency_key: Annotated[str | None, Header(max_length=255)] = None,
) -> JobOut:
    job, created = svc.submit(who, spec, idempotency_key)
    if not created:
        response.status_code = 200
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return JobOut.of(job)


@router.get("", response_model=JobPage, summary="List the tenant's jobs, newest first")
def list_jobs(
    svc: Svc,
    who: Who,
    state: JobState | None = None,
    offset: Offset = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> JobPage:
    jobs, total = svc.list_jobs(who, state, offset, limit)
    return JobPage(items=[JobOut.of(j) for j in jobs], total=total, offset=offset, limit=limit)


@router.get("/{job_id}", response_model=JobOut)
async def get_job(job_id: JobId, svc: Svc, who: Who) -> JobOut:
    return JobOut.of(await svc.aget_job(who, job_id))


@router.delete("/{job_id}", status_code=204, response_class=Response,
               summary="Delete a finished job with its records and files",
               responses={409: {"description": "The job has not finished"}})
def delete_job(
    job_id: JobId, svc: Svc, who: Who,
    keep_checkpoints: Annotated[bool, Query(description="Keep the checkpoint files (records go either way).")] = False,
) -> Response:
    svc.delete_job(who, job_id, keep_checkpoints=keep_checkpoints)
    return Response(status_code=204)


@router.post("/{job_id}/{action}", response_model=JobOut, summary="Cancel, pause or resume a job")
def control_job(job_id: JobId, action: Literal["cancel", "pause", "resume"], svc: Svc, who: Who) -> JobOut:
    do = {"cancel": svc.cancel, "pause": svc.pause, "resume": svc.resume}[action]
    return JobOut.of(do(who, job_id))


@router.get(
    "/{job_id}/events",
    response_model=EventPage,
    summary="Job events: a paged JSON list, or a live SSE stream with `Accept: text/event-stream`",
)
async def job_events(
    request: Request,
    job_id: JobId,
    svc: Svc,
    who: Who,
    after: Cursor = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    last_event_id: Annotated[str | None, Header(pattern=r"^\d{1,19}-\d{1,19}$")] = None,
) -> Any:
    items = await asyncio.to_thread(svc.events, who, job_id, after or last_event_id, limit)
    if "text/event-stream" not in request.headers.get("accept", ""):
        return EventPage(items=[EventOut(**e) for e in items],
                         next=items[-1]["id"] if len(items) == limit else None)
    return EventSourceResponse(_event_stream(request, svc, job_id, after or last_event_id), ping=15)


async def _event_stream(request: Request, svc: TaperService, job_id: str, after: str | None) -> AsyncIterator[dict]:
    """Replays events after ``after``, then follows the stream until the job has finished."""
    cursor = after
    while not await request.is_disconnected():
        batch = await asyncio.to_thread(svc.store.events, job_id, cursor, 500)
        for e in batch:
            cursor = e["id"]
            yield {"id": e["id"], "event": e["kind"], "data": json.dumps({"ts": e["ts"], **e["data"]})}
        if not batch:
            state = await asyncio.to_thread(svc.store.job_field, job_id, "state")
            if state is None or JobState(state).is_terminal:
                # the terminal state and its event are written together: one last read sends it
                for e in await asyncio.to_thread(svc.store.events, job_id, cursor, 10_000):
                    yield {"id": e["id"], "event": e["kind"], "data": json.dumps({"ts": e["ts"], **e["data"]})}
                return
            await asyncio.sleep(0.25)


@router.get("/{job_id}/metrics", response_model=MetricsPage, summary="Per-step training metrics")
def job_metrics(
    job_id: JobId, svc: Svc, who: Who, after: Cursor = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
) -> MetricsPage:
    rows = svc.metrics(who, job_id, after, limit)
    return MetricsPage(items=[MetricsRow(**r) for r in rows], next=rows[-1]["id"] if len(rows) == limit else None)


@router.get("/{job_id}/trajectories", response_model=TrajectoryPage, summary="Recorded trajectories (paged)")
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
    items = svc.trajectories(who, job_id, status=status, min_reward=min_reward, max_reward=max_reward,
                             step=step, offset=offset, limit=limit)
    return TrajectoryPage(items=items, offset=offset, limit=limit)


@router.get("/{job_id}/checkpoints", response_model=list[CheckpointOut])
def job_checkpoints(job_id: JobId, svc: Svc, who: Who) -> list[CheckpointOut]:
    return [CheckpointOut(**c) for c in svc.checkpoints(who, job_id)]


def _schedule_out(history) -> ScheduleOut:
    cur = history.current
    return ScheduleOut(version=cur.version, effective_from=cur.effective_from, schedule=cur.schedule,
                       history=history.versions)


@router.get("/{job_id}/reward-schedule", response_model=ScheduleOut, tags=["schedule"])
def get_reward_schedule(job_id: JobId, svc: Svc, who: Who) -> ScheduleOut:
    return _schedule_out(svc.schedule(who, job_id))


@router.patch(
    "/{job_id}/reward-schedule",
    response_model=ScheduleOut,
    tags=["schedule"],
    summary="Change the process-reward schedule from the job's next step (a new version)",
)
def patch_reward_schedule(
    job_id: JobId,
    svc: Svc,
    who: Who,
    patch: Annotated[
        dict[str, Any],
        Body(
            description="RewardSchedule fields to change (merged into the current schedule; changing `kind` "
            "drops the old kind's own fields).",
            examples=[{"w_end": 0.0, "horizon": 50}],
        ),
    ],
) -> ScheduleOut:
    svc.patch_schedule(who, job_id, patch)
    return _schedule_out(svc.schedule(who, job_id))
