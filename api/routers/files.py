"""/v1/files: upload, list, inspect, download and delete the tenant's task files (JSONL), as OpenAI's file
objects with OpenAI's errors (`error.param`); a finished fine-tuning job's result file (CSV) reads here too.

Purpose `tasks`, or `fine-tune` (what OpenAI's client sends; the same files serve its fine-tuning jobs)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, Path, Query, UploadFile
from fastapi.responses import FileResponse, Response
from pydantic import BaseModel, Field

from api.openai_schemas import openai_error_responses
from api.routers.dependencies import Svc, Who
from api.routers.openai_route import OpenAIRoute
from rl_service.control.openai_compat import FineTuningJobs
from rl_service.control.service import Conflict
from rl_service.task_files import FILE_ID_PATTERN

router = APIRouter(prefix="/v1/files", tags=["files"], route_class=OpenAIRoute)

FileId = Annotated[str, Path(pattern=FILE_ID_PATTERN, description="file- and 24 hex digits")]
Purpose = Literal["tasks", "fine-tune"]


class FileObject(BaseModel):
    id: str = Field(pattern=FILE_ID_PATTERN)
    object: Literal["file"] = "file"
    bytes: int
    created_at: int = Field(description="Unix seconds.")
    filename: str
    purpose: Literal["tasks", "fine-tune", "fine-tune-results"]
    status: Literal["processed"] = "processed"
    tasks: int = Field(description="Tasks (lines) in the file.")
    demonstrations: int = Field(0, description="Lines that are whole conversations (end with the assistant's "
                                               "turn): supervised examples and warm-start demonstrations.")


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


@router.post("", status_code=200, response_model=FileObject, summary="Upload a task file",
             responses=openai_error_responses(400, 401, 409, 413, 422))
def upload_file(
    svc: Svc,
    who: Who,
    file: Annotated[UploadFile, File(description="JSONL: one task per line ({question | messages, answer?, ...}).")],
    purpose: Annotated[Purpose, Form()] = "tasks",
) -> FileObject:
    """Every line is checked before the file is kept; a bad line is a 422 naming its number."""
    return FileObject(**svc.files.create(who, file.filename or "", purpose, file.file))


@router.get("", response_model=FileList, summary="The tenant's task files, newest first (OpenAI's paging)",
            responses=openai_error_responses(400, 401, 404, 422))
def list_files(
    svc: Svc,
    who: Who,
    purpose: Purpose | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
    after: Annotated[str | None, Query(pattern=FILE_ID_PATTERN, description="The last id of the previous page.")] = None,
) -> FileList:
    found, has_more = svc.files.list_page(who, purpose=purpose, order=order, after=after, limit=limit)
    data = [FileObject(**m) for m in found]
    return FileList(data=data, has_more=has_more, first_id=data[0].id if data else None,
                    last_id=data[-1].id if data else None)


@router.get("/{file_id}", response_model=FileObject, responses=openai_error_responses(400, 401, 404, 422))
def get_file(file_id: FileId, svc: Svc, who: Who) -> FileObject:
    result = FineTuningJobs(svc).result_file(who, file_id)
    if result is not None:
        return FileObject(**result[0])
    return FileObject(**svc.files.get(who, file_id))


@router.get("/{file_id}/content", response_class=Response, summary="The file's bytes",
            responses={200: {"content": {"application/octet-stream": {}}}, **openai_error_responses(400, 401, 404, 422)})
def file_content(file_id: FileId, svc: Svc, who: Who) -> Response:
    result = FineTuningJobs(svc).result_file(who, file_id)
    if result is not None:
        return Response(result[1], media_type="text/csv")
    meta = svc.files.get(who, file_id)
    return FileResponse(svc.files.content(who, file_id), media_type="application/octet-stream",
                        filename=meta["filename"])


@router.delete("/{file_id}", response_model=FileDeleted, responses=openai_error_responses(400, 401, 404, 409, 422))
def delete_file(file_id: FileId, svc: Svc, who: Who) -> FileDeleted:
    if FineTuningJobs(svc).result_file(who, file_id) is not None:
        raise Conflict(f"file {file_id!r} is a job's result file; it goes with the job", field="file_id")
    svc.files.delete(who, file_id)
    return FileDeleted(id=file_id)
