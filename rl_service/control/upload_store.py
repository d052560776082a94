"""Uploads in parts (OpenAI's `/v1/uploads`): a file too large for one request, or sent over a flaky link,
arrives as parts that `complete` joins, in the order its `part_ids` give, into one task file, checked line by
line as any upload (rl_service.control.task_file_store). Parts live under the tenant's directory, in
`.uploads/UPLOAD_ID/`, until the upload completes, is cancelled or expires (an hour after it was created)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from rl_service.control.task_file_store import PURPOSES, TaskFileStore
from rl_service.task_files import TaskFileError

UPLOAD_ID = r"^upload_[0-9a-f]{24}$"
PART_ID = r"^part_[0-9a-f]{24}$"
EXPIRES_S = 3600
MAX_PARTS = 10_000
_CHUNK = 1024 * 1024


class UploadError(ValueError):
    """A refused upload request: `field` names what is wrong, `status` the HTTP status."""

    def __init__(self, message: str, field: str, status: int = 422) -> None:
        super().__init__(message)
        self.field, self.status = field, status


class _JoinedParts:
    """The parts, in order, read as one stream (what TaskFileStore.create reads)."""

    def __init__(self, paths: list[Path]) -> None:
        self._paths: Iterator[Path] = iter(paths)
        self._current: BinaryIO | None = None

    def read(self, n: int = -1) -> bytes:
        while True:
            if self._current is None:
                path = next(self._paths, None)
                if path is None:
                    return b""
                self._current = path.open("rb")
            chunk = self._current.read(n)
            if chunk:
                return chunk
            self._current.close()
            self._current = None


class UploadStore:
    def __init__(self, files: TaskFileStore) -> None:
        self.files = files

    def _dir(self, tenant: str, upload_id: str) -> Path:
        return self.files.root / tenant / ".uploads" / upload_id

    def _write_meta(self, tenant: str, meta: dict[str, Any]) -> None:
        directory = self._dir(tenant, meta["id"])
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".meta-")
        with os.fdopen(fd, "w") as f:
            json.dump(meta, f)
        os.replace(tmp, directory / "meta.json")

    def _expire(self, tenant: str) -> None:
        root = self.files.root / tenant / ".uploads"
        now = time.time()
        for directory in root.glob("upload_*") if root.is_dir() else []:
            with contextlib.suppress(OSError, ValueError):
                meta = json.loads((directory / "meta.json").read_text())
                if meta["expires_at"] < now and meta["status"] == "pending":
                    shutil.rmtree(directory, ignore_errors=True)

    def create(self, tenant: str, filename: str, purpose: str, size: int) -> dict[str, Any]:
        if purpose not in PURPOSES:
            raise UploadError(f"purpose: must be one of {', '.join(PURPOSES)}, got {purpose!r}", "purpose")
        if not filename.lower().endswith(".jsonl"):
            raise UploadError(f"filename: a JSONL file is expected (name ending .jsonl), got {filename!r}", "filename")
        if not 0 < size <= self.files.limits.max_bytes:
            raise UploadError(f"bytes: from 1 to {self.files.limits.max_bytes}, got {size}", "bytes", 413 if size else 422)
        self._expire(tenant)
        now = int(time.time())
        meta = {"id": "upload_" + secrets.token_hex(12), "object": "upload", "bytes": size, "created_at": now,
                "expires_at": now + EXPIRES_S, "filename": Path(filename).name[:255], "purpose": purpose,
                "status": "pending", "file": None, "parts": {}}
        self._dir(tenant, meta["id"]).mkdir(parents=True)
        self._write_meta(tenant, meta)
        return meta

    def get(self, tenant: str, upload_id: str) -> dict[str, Any]:
        if re.fullmatch(UPLOAD_ID, upload_id):
            with contextlib.suppress(OSError, ValueError):
                meta = json.loads((self._dir(tenant, upload_id) / "meta.json").read_text())
                if meta["status"] == "pending" and meta["expires_at"] < time.time():
                    meta["status"] = "expired"
                return meta
        raise UploadError(f"upload {upload_id!r} not found", "upload_id", 404)

    def _pending(self, tenant: str, upload_id: str) -> dict[str, Any]:
        meta = self.get(tenant, upload_id)
        if meta["status"] != "pending":
            raise UploadError(f"upload {upload_id!r} is {meta['status']}", "upload_id", 409)
        return meta

    def add_part(self, tenant: str, upload_id: str, stream: BinaryIO) -> dict[str, Any]:
        meta = self._pending(tenant, upload_id)
        if len(meta["parts"]) >= MAX_PARTS:
            raise UploadError(f"data: an upload has at most {MAX_PARTS} parts", "data", 409)
        room = meta["bytes"] - sum(meta["parts"].values())
        part_id = "part_" + secrets.token_hex(12)
        path = self._dir(tenant, upload_id) / part_id
        size = 0
        with path.open("wb") as out:
            while chunk := stream.read(_CHUNK):
                size += len(chunk)
                if size > room:
                    out.close()
                    path.unlink(missing_ok=True)
                    raise UploadError(f"data: the parts would exceed the upload's {meta['bytes']} bytes", "data", 413)
                out.write(chunk)
        if size == 0:
            path.unlink(missing_ok=True)
            raise UploadError("data: an empty part", "data")
        meta = self._pending(tenant, upload_id)  # re-read: parts may arrive at once
        meta["parts"][part_id] = size
        self._write_meta(tenant, meta)
        return {"id": part_id, "object": "upload.part", "created_at": int(time.time()), "upload_id": upload_id}

    def complete(self, tenant: str, upload_id: str, part_ids: list[str], md5: str | None) -> dict[str, Any]:
        """Join the parts in `part_ids` order into a task file (every part named once); nothing is kept when
        the file is refused."""
        meta = self._pending(tenant, upload_id)
        parts: dict[str, int] = meta["parts"]
        seen: dict[str, int] = {}
        for i, part_id in enumerate(part_ids):
            if part_id not in parts:
                raise UploadError(f"part_ids[{i}]: no part {part_id!r} of this upload", f"part_ids[{i}]")
            if part_id in seen:
                raise UploadError(f"part_ids[{i}]: repeats part_ids[{seen[part_id]}]", f"part_ids[{i}]")
            seen[part_id] = i
        if len(seen) != len(parts):
            raise UploadError(f"part_ids: names {len(seen)} of the {len(parts)} parts uploaded; name every part, "
                              "in the order they join", "part_ids")
        total = sum(parts.values())
        if total != meta["bytes"]:
            raise UploadError(f"bytes: the parts hold {total} bytes, the upload declared {meta['bytes']}", "bytes")
        paths = [self._dir(tenant, upload_id) / p for p in part_ids]
        if md5 is not None:
            digest = hashlib.md5(usedforsecurity=False)
            for path in paths:
                with path.open("rb") as f:
                    while chunk := f.read(_CHUNK):
                        digest.update(chunk)
            if digest.hexdigest() != md5.lower():
                raise UploadError(f"md5: the parts' digest is {digest.hexdigest()}, not {md5}", "md5")
        try:
            file = self.files.create(tenant, meta["filename"], meta["purpose"], _JoinedParts(paths))
        except TaskFileError as exc:
            raise UploadError(str(exc), "part_ids", exc.status) from None
        meta.update(status="completed", file=file)
        self._write_meta(tenant, meta)
        for path in paths:
            path.unlink(missing_ok=True)
        return meta

    def cancel(self, tenant: str, upload_id: str) -> dict[str, Any]:
        meta = self._pending(tenant, upload_id)
        for part_id in meta["parts"]:
            (self._dir(tenant, upload_id) / part_id).unlink(missing_ok=True)
        meta.update(status="cancelled")
        self._write_meta(tenant, meta)
        return meta
