"""/healthz and /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.schemas import Health

router = APIRouter(tags=["system"])


@router.get("/healthz", response_model=Health, responses={503: {"model": Health}})
def healthz(request: Request) -> Response:
    health = request.app.state.service.health()
    return JSONResponse(health, status_code=200 if health["ok"] else 503)


@router.get("/metrics", response_class=Response, summary="Prometheus metrics")
def prometheus_metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.prometheus), media_type=CONTENT_TYPE_LATEST)
