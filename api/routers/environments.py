"""/v1/environments: register, list, inspect and delete the tenant's tool environments."""

from __future__ import annotations

from fastapi import APIRouter, Response

from api.openapi import SchemaCheckedRoute
from api.routers.dependencies import EnvName, Svc, Who
from api.schemas import EnvironmentOut, error_responses
from rollout_workers.environments.registry import EnvironmentRegistration

router = APIRouter(prefix="/v1/environments", tags=["environments"], route_class=SchemaCheckedRoute)


@router.post("", status_code=201, response_model=EnvironmentOut, summary="Register an environment",
             responses=error_responses(400, 409, 413, 422))
def register_environment(svc: Svc, who: Who, body: EnvironmentRegistration) -> EnvironmentOut:
    """kind `python`: an import path `pkg.module:Class` already installed on the cluster (never code);
    kind `http`: a remote tool server (base URL, tools with JSON Schemas, timeouts, retries)."""
    reg = svc.environments.register(who, body)
    return EnvironmentOut(name=reg["name"], builtin=False, registration=reg)


@router.get("", response_model=list[EnvironmentOut], summary="Built-in and registered environments")
def list_environments(svc: Svc, who: Who) -> list[EnvironmentOut]:
    return [EnvironmentOut(**e) for e in svc.environments.list_all(who)]


@router.get("/{name}", response_model=EnvironmentOut, responses=error_responses(404, 422))
def get_environment(name: EnvName, svc: Svc, who: Who) -> EnvironmentOut:
    return EnvironmentOut(**svc.environments.get(who, name))


@router.delete("/{name}", status_code=204, response_class=Response, responses=error_responses(404, 409, 422))
def delete_environment(name: EnvName, svc: Svc, who: Who) -> Response:
    svc.environments.delete(who, name)
    return Response(status_code=204)
