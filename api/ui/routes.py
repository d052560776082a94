"""Routes of the dashboard: the pages (static HTML shells assembled by layout.py), their JavaScript/CSS,
plotly.js from the installed `plotly` package, and one read-only helper endpoint (the schedule preview). Every
piece of job data the pages show comes from the /v1 API, called by the browser with the user's key."""

from __future__ import annotations

import asyncio
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, RedirectResponse, Response
from pydantic import BaseModel, Field, ValidationError

from api.routers.dependencies import JobId, Svc, Who
from api.ui.layout import render_page
from api.ui.preview import schedule_preview
from api.ui.tokens import token_pieces
from rl_service.control.service import (
    Conflict,
    InvalidInput,
    NotFound,
    ServiceError,
    schedule_conflict,
    schedule_patch_changes,
)

STATIC = Path(__file__).resolve().parent / "static"
STATIC_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}

# Scripts only from this origin (no inline script, no eval); plotly injects <style> elements, hence
# 'unsafe-inline' for styles only. Job data (model output, tool results) is always inserted as text.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data: blob:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter(prefix="/ui", include_in_schema=False)



class VendorMissing(ServiceError):
    status, code = 503, "unavailable"


def _page(name: str) -> Response:
    return Response(render_page(name), media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)


@router.get("", response_class=RedirectResponse)
def ui_root() -> RedirectResponse:
    return RedirectResponse("/ui/jobs", status_code=307)


@router.get("/jobs")
def jobs_page() -> Response:
    return _page("jobs")


# The job page serves every /ui/jobs/{id}: its script reads the id from the location.
@router.get("/jobs/{job_id}")
def job_page(job_id: JobId) -> Response:
    return _page("job")


@router.get("/submit")
def submit_page() -> Response:
    return _page("submit")


@router.get("/environments")
def environments_page() -> Response:
    return _page("environments")


@router.get("/login")
def login_page() -> Response:
    return _page("login")


@router.get("/static/{name}")
def static_file(name: Annotated[str, PathParam(pattern=r"^[a-z0-9_-]+\.(js|css)$")]) -> Response:
    path = STATIC / name
    if not path.is_file():
        raise NotFound(f"no static file {name!r}", field="name")
    return FileResponse(path, media_type=STATIC_TYPES[path.suffix], headers={"Cache-Control": "no-cache"})


@lru_cache(maxsize=1)
def plotly_js_path() -> Path | None:
    """plotly.min.js as shipped inside the installed `plotly` package (None if plotly is not installed)."""
    try:
        import plotly
    except ImportError:
        return None
    path = Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"
    return path if path.is_file() else None


@router.get("/vendor/plotly.min.js")
def plotly_js() -> Response:
    path = plotly_js_path()
    if path is None:
        raise VendorMissing("the dashboard's charts need the `plotly` Python package (pip install plotly)",
                            field="plotly")
    # Versioned by the installed package: safe to cache for a day; the ETag covers upgrades.
    return FileResponse(path, media_type="text/javascript; charset=utf-8",
                        headers={"Cache-Control": "public, max-age=86400"})


@router.post("/api/jobs/{job_id}/schedule-preview")
async def preview_schedule(
    job_id: JobId,
    svc: Svc,
    who: Who,
    patch: Annotated[dict[str, Any], Body(description="RewardSchedule fields to change; {} for the current curve.")],
    last_step: Annotated[int | None, Query(ge=0, le=10_000_000)] = None,
) -> dict[str, Any]:
    """The job's schedule curve (every version in force) and, for a non-empty patch, the curve it would follow
    if the patch were PATCHed now. Nothing is stored; a bad patch gets the same 422 or 409 the PATCH would."""

    def compute() -> dict[str, Any]:
        job = svc.jobs.get(who, job_id)
        if patch and job.state.is_terminal:
            raise Conflict(f"job is already {job.state.value}; its schedule is final", field="state")
        history = svc.jobs.schedule(who, job_id)
        end = last_step if last_step is not None else max(job.total_steps, job.step + 1)
        try:
            out = schedule_preview(history, at_step=job.step, last_step=end,
                                   patch=schedule_patch_changes(patch) if patch else None)
        except ValidationError as exc:
            raise schedule_conflict(exc) from None
        except (ValueError, TypeError) as exc:
            raise InvalidInput(str(exc), field="body") from None
        out["job_step"] = job.step
        return out

    return await asyncio.to_thread(compute)


class TokenIds(BaseModel):
    ids: list[int] = Field(max_length=200_000, description="Token ids to show as text.")


@router.post("/api/jobs/{job_id}/tokens")
async def decode_tokens(job_id: JobId, svc: Svc, who: Who, body: TokenIds) -> dict[str, dict[str, str]]:
    """The text of each distinct token id, decoded with the job's tokenizer (for the trajectory viewer)."""

    def compute() -> dict[str, dict[str, str]]:
        job = svc.jobs.get(who, job_id)
        try:
            pieces = token_pieces(body.ids, job.spec.model.checkpoint_dir)
        except ValueError as exc:
            raise InvalidInput(str(exc), field="ids") from None
        return {"pieces": {str(k): v for k, v in pieces.items()}}

    return await asyncio.to_thread(compute)
