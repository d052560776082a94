"""Uploaded task files, per tenant under the data dir's `task_files/` (outside the data roots that
environments' file options may read; the format: rl_service.task_files).

Every line is checked before anything is kept: the upload is written to a temporary file in the tenant's
directory, validated, fsynced and renamed into place, and only then does its description (the `.json`
beside it, which is what listing reads) appear. Ids are `file-` and 24 hex digits; file objects have
OpenAI's shape.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any, BinaryIO

from rl_service.task_files import FILE_ID_PATTERN, TaskFileError, TaskFileLimits, is_demonstration, read_tasks

PURPOSES = ("tasks", "fine-tune")
_CHUNK = 1024 * 1024


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class TaskFileStore:
    """Files under `root/TENANT/`: `ID.jsonl` (the tasks) and `ID.json` (the file object)."""

    def __init__(self, root: Path, limits: TaskFileLimits | None = None) -> None:
        self.root = Path(root)
        self.limits = limits or TaskFileLimits()

    def _dir(self, tenant: str) -> Path:
        return self.root / tenant

    def create(self, tenant: str, filename: str, purpose: str, stream: BinaryIO) -> dict[str, Any]:
        """Store an upload after checking every line; raises TaskFileError (nothing is left behind)."""
        if purpose not in PURPOSES:
            raise TaskFileError(f"purpose: must be one of {', '.join(PURPOSES)}, got {purpose!r}")
        if not filename.lower().endswith(".jsonl"):
            raise TaskFileError(f"file: a JSONL file is expected (name ending .jsonl), got {filename!r}")
        directory = self._dir(tenant)
        directory.mkdir(parents=True, exist_ok=True)
        if len(self.list(tenant)) >= self.limits.max_files:
            raise TaskFileError(f"file: you keep {self.limits.max_files} files, the most allowed; delete some",
                                status=409)
        fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=".upload-")
        tmp = Path(tmp_name)
        try:
            size = 0
            with os.fdopen(fd, "wb") as out:
                while chunk := stream.read(_CHUNK):
                    size += len(chunk)
                    if size > self.limits.max_bytes:
                        raise TaskFileError(f"file: larger than {self.limits.max_bytes} bytes", status=413)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            tasks = read_tasks(tmp, self.limits)
            file_id = "file-" + secrets.token_hex(12)
            os.replace(tmp, directory / f"{file_id}.jsonl")
            meta = {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()),
                    "filename": Path(filename).name[:255], "purpose": purpose, "status": "processed",
                    "tasks": len(tasks), "demonstrations": sum(map(is_demonstration, tasks))}
            _write_atomically(directory / f"{file_id}.json", json.dumps(meta).encode())
            _fsync_dir(directory)
            return meta
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def list(self, tenant: str) -> list[dict[str, Any]]:
        """The tenant's files, newest first."""
        directory = self._dir(tenant)
        if not directory.is_dir():
            return []
        out = []
        for meta in directory.glob("file-*.json"):
            with contextlib.suppress(OSError, ValueError):
                out.append(json.loads(meta.read_text()))
        return sorted(out, key=lambda m: (m["created_at"], m["id"]), reverse=True)

    def get(self, tenant: str, file_id: str) -> dict[str, Any] | None:
        if not _is_file_id(file_id):
            return None
        try:
            return json.loads((self._dir(tenant) / f"{file_id}.json").read_text())
        except (OSError, ValueError):
            return None

    def path(self, tenant: str, file_id: str) -> Path | None:
        """The stored tasks of one of the tenant's files (None: no such file of this tenant)."""
        if self.get(tenant, file_id) is None:
            return None
        return (self._dir(tenant) / f"{file_id}.jsonl").resolve()

    def delete(self, tenant: str, file_id: str) -> bool:
        if self.get(tenant, file_id) is None:
            return False
        directory = self._dir(tenant)
        (directory / f"{file_id}.json").unlink(missing_ok=True)  # unlisted first, then its data
        (directory / f"{file_id}.jsonl").unlink(missing_ok=True)
        return True


def _is_file_id(value: str) -> bool:
    return re.fullmatch(FILE_ID_PATTERN, value) is not None
