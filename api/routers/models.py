"""/v1/models (the models a job may start from, as OpenAI's model objects) and
/v1/fine_tuning/checkpoints/{checkpoint}/permissions (other tenants allowed to start from a checkpoint).
Thin: the translation lives in rl_service.control.openai_models."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query
from pydantic import BaseModel, ConfigDict, Field

from api.openai_schemas import openai_error_responses
from api.routers.dependencies import Svc, Who
from api.routers.openai_route import OpenAIRoute
from rl_service.control.openai_models import MAX_PROJECTS_PER_REQUEST, OpenAIModels

router = APIRouter(tags=["models (OpenAI-compatible)"], route_class=OpenAIRoute)

ModelId = Annotated[str, Path(min_length=1, max_length=96, pattern=r"^[A-Za-z0-9_.:-]+$",
                              description="A preset, `base:NAME`, a fine-tuned model (job id) or `JOB_ID:STEP`.")]
CheckpointRef = Annotated[str, Path(pattern=r"^job-[0-9a-f]{16}(:[0-9]{1,10})?$",
                                    description="`JOB_ID:STEP` (a checkpoint) or `JOB_ID` (a fine-tuned model).")]
PermissionId = Annotated[str, Path(pattern=r"^cp_[0-9a-f]{24}$")]
_ERRORS = openai_error_responses(400, 401, 404, 422)


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="Unix seconds (0 for the presets and base models).")
    owned_by: str = Field(description="taper (a preset), operator (a base model) or the tenant.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class Permission(BaseModel):
    id: str
    object: Literal["checkpoint.permission"] = "checkpoint.permission"
    created_at: int
    project_id: str = Field(description="The tenant allowed to start jobs from the checkpoint.")


class PermissionPage(BaseModel):
    object: Literal["list"] = "list"
    data: list[Permission]
    has_more: bool
    first_id: str | None
    last_id: str | None


class PermissionDeleted(BaseModel):
    id: str
    object: Literal["checkpoint.permission"] = "checkpoint.permission"
    deleted: bool


class PermissionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    project_ids: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(
        min_length=1, max_length=MAX_PROJECTS_PER_REQUEST, description="Tenants to allow.")


@router.get("/v1/models", response_model=ModelList, summary="Models a job may start from",
            responses=openai_error_responses(401))
def list_models(svc: Svc, who: Who) -> dict[str, Any]:
    return OpenAIModels(svc).list(who)


@router.get("/v1/models/{model}", response_model=Model, summary="One model", responses=_ERRORS)
def retrieve_model(model: ModelId, svc: Svc, who: Who) -> dict[str, Any]:
    return OpenAIModels(svc).retrieve(who, model)


_PERMISSIONS = "/v1/fine_tuning/checkpoints/{fine_tuned_model_checkpoint}/permissions"


@router.post(_PERMISSIONS, response_model=PermissionPage, summary="Let other tenants start from a checkpoint",
             responses=openai_error_responses(400, 401, 404, 413, 422, 429))
def grant_permissions(fine_tuned_model_checkpoint: CheckpointRef, body: PermissionCreate, svc: Svc,
                      who: Who) -> dict[str, Any]:
    return OpenAIModels(svc).grant(who, fine_tuned_model_checkpoint, body.project_ids)


@router.get(_PERMISSIONS, response_model=PermissionPage, summary="A checkpoint's permissions", responses=_ERRORS)
def list_permissions(
    fine_tuned_model_checkpoint: CheckpointRef,
    svc: Svc,
    who: Who,
    after: Annotated[str | None, Query(pattern=r"^cp_[0-9a-f]{24}$")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 10,
    order: Literal["ascending", "descending"] = "descending",
    project_id: Annotated[str | None, Query(min_length=1, max_length=64)] = None,
) -> dict[str, Any]:
    return OpenAIModels(svc).permissions(who, fine_tuned_model_checkpoint, after=after, limit=limit, order=order,
                                         project_id=project_id)


@router.delete(_PERMISSIONS + "/{permission_id}", response_model=PermissionDeleted,
               summary="Withdraw a checkpoint permission", responses=_ERRORS)
def revoke_permission(fine_tuned_model_checkpoint: CheckpointRef, permission_id: PermissionId, svc: Svc,
                      who: Who) -> dict[str, Any]:
    return OpenAIModels(svc).revoke(who, fine_tuned_model_checkpoint, permission_id)
