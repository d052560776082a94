"""/v1/uploads: OpenAI's uploads in parts (create, add parts, complete in the order `part_ids` gives, cancel),
for task files too large for one request. The completed upload's `file` is an ordinary task file. Thin: the
rules live in rl_service.control.upload_store."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Path, UploadFile
from pydantic import BaseModel, ConfigDict, Field

from api.openai_schemas import openai_error_responses
from api.routers.dependencies import Svc, Who
from api.routers.files import FileObject
from api.routers.openai_route import OpenAIRoute
from rl_service.control.upload_store import MAX_PARTS, PART_ID, UPLOAD_ID

router = APIRouter(prefix="/v1/uploads", tags=["files"], route_class=OpenAIRoute)

UploadId = Annotated[str, Path(pattern=UPLOAD_ID, description="upload_ and 24 hex digits")]
_ERRORS = openai_error_responses(400, 401, 404, 409, 413, 422)


class UploadCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    filename: str = Field(min_length=1, max_length=255)
    purpose: Literal["tasks", "fine-tune"]
    bytes: int = Field(ge=1, le=2**40, description="The whole file's size; the parts must add up to it.")
    mime_type: str = Field(max_length=128, description="Recorded only (a JSONL file is expected).")


class UploadComplete(BaseModel):
    model_config = ConfigDict(extra="forbid")

    part_ids: list[Annotated[str, Field(pattern=PART_ID)]] = Field(
        min_length=1, max_length=MAX_PARTS, description="Every part, in the order they join.")
    md5: str | None = Field(None, pattern=r"^[0-9a-fA-F]{32}$", description="Checked against the joined parts.")


class Upload(BaseModel):
    id: str
    object: Literal["upload"] = "upload"
    bytes: int
    created_at: int
    expires_at: int
    filename: str
    purpose: str
    status: Literal["pending", "completed", "cancelled", "expired"]
    file: FileObject | None = None


class UploadPart(BaseModel):
    id: str
    object: Literal["upload.part"] = "upload.part"
    created_at: int
    upload_id: str


def _upload(meta: dict[str, Any]) -> Upload:
    return Upload(**{k: v for k, v in meta.items() if k != "parts"})


@router.post("", response_model=Upload, summary="Start an upload in parts", responses=_ERRORS)
def create_upload(body: UploadCreate, svc: Svc, who: Who) -> Upload:
    return _upload(svc.files.upload(who, "create", body.filename, body.purpose, body.bytes))


@router.post("/{upload_id}/parts", response_model=UploadPart, summary="Add a part", responses=_ERRORS)
def add_part(upload_id: UploadId, svc: Svc, who: Who,
             data: Annotated[UploadFile, File(description="The part's bytes.")]) -> UploadPart:
    return UploadPart(**svc.files.upload(who, "add_part", upload_id, data.file))


@router.post("/{upload_id}/complete", response_model=Upload, summary="Join the parts into a task file",
             responses=_ERRORS)
def complete_upload(upload_id: UploadId, body: UploadComplete, svc: Svc, who: Who) -> Upload:
    return _upload(svc.files.upload(who, "complete", upload_id, body.part_ids, body.md5))


@router.post("/{upload_id}/cancel", response_model=Upload, summary="Cancel an upload", responses=_ERRORS)
def cancel_upload(upload_id: UploadId, svc: Svc, who: Who) -> Upload:
    return _upload(svc.files.upload(who, "cancel", upload_id))
