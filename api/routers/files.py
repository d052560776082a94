"""/v1/files: upload, list, inspect and delete the tenant's task files (JSONL), as OpenAI-shaped file objects.

Purpose `tasks`, or `fine-tune` (what OpenAI's client sends; the same files serve its fine-tuning jobs)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, Path, UploadFile
from pydantic import BaseModel, Field

from api.routers.dependencies import Svc, Who
from api.schemas import error_responses
from rl_service.task_files import FILE_ID_PATTERN

router = APIRouter(prefix="/v1/files", tags=["files"])

FileId = Annotated[str, Path(pattern=FILE_ID_PATTERN, description="file- and 24 hex digits")]


class FileObject(BaseModel):
    id: str = Field(pattern=FILE_ID_PATTERN)
    object: Literal["file"] = "file"
    bytes: int
    created_at: int = Field(description="Unix seconds.")
    filename: str
    purpose: Literal["tasks", "fine-tune"]
    status: Literal["processed"] = "processed"
    tasks: int = Field(description="Tasks (lines) in the file.")


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


@router.post("", status_code=200, response_model=FileObject, summary="Upload a task file",
             responses=error_responses(400, 409, 413, 422))
def upload_file(
    svc: Svc,
    who: Who,
    file: Annotated[UploadFile, File(description="JSONL: one task per line ({question | messages, answer?, ...}).")],
    purpose: Annotated[Literal["tasks", "fine-tune"], Form()] = "tasks",
) -> FileObject:
    """Every line is checked before the file is kept; a bad line is a 422 naming its number."""
    return FileObject(**svc.files.create(who, file.filename or "", purpose, file.file))


@router.get("", response_model=FileList, summary="The tenant's task files, newest first")
def list_files(svc: Svc, who: Who) -> FileList:
    return FileList(data=[FileObject(**m) for m in svc.files.list_all(who)])


@router.get("/{file_id}", response_model=FileObject, responses=error_responses(404, 422))
def get_file(file_id: FileId, svc: Svc, who: Who) -> FileObject:
    return FileObject(**svc.files.get(who, file_id))


@router.delete("/{file_id}", response_model=FileDeleted, responses=error_responses(404, 409, 422))
def delete_file(file_id: FileId, svc: Svc, who: Who) -> FileDeleted:
    svc.files.delete(who, file_id)
    return FileDeleted(id=file_id)
