"""/healthz and /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.auth import bearer, principal
from api.schemas import Health, error_responses
from rl_service.control.service.tenants import require_admin

router = APIRouter(tags=["system"])


@router.get("/healthz", response_model=Health, responses={503: {"model": Health}})
def healthz(request: Request) -> Response:
    health = request.app.state.service.health()
    return JSONResponse(health, status_code=200 if health["ok"] else 503)


@router.get("/metrics", response_class=Response, summary="Prometheus metrics (an admin key, unless the operator "
            "made them public)", responses=error_responses(401, 403))
async def prometheus_metrics(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> Response:
    if not request.app.state.metrics_public:  # the series name tenants and their jobs
        require_admin(await principal(request, creds))
    return Response(generate_latest(request.app.state.prometheus), media_type=CONTENT_TYPE_LATEST)
