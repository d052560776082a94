"""Who else may start from a job's checkpoints: per job, a hash of permission id -> {checkpoint, tenant,
created_at} (deleted with the job)."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from rl_service.control.store.base import StoreBase, dumps

MAX_PERMISSIONS_PER_JOB = 256


class PermissionsFull(ValueError):
    """The job has its maximum number of checkpoint permissions."""


class PermissionsPart(StoreBase):
    def grant(self, job_id: str, checkpoint: str, tenant: str) -> dict[str, Any]:
        """The permission of ``tenant`` on ``checkpoint`` (a `JOB_ID` or `JOB_ID:STEP` of ``job_id``): the
        existing one, or a new one."""
        for perm in self.permissions(job_id):
            if (perm["checkpoint"], perm["project_id"]) == (checkpoint, tenant):
                return perm
        if self.r.hlen(self.k_permissions(job_id)) >= MAX_PERMISSIONS_PER_JOB:
            raise PermissionsFull(f"a job keeps at most {MAX_PERMISSIONS_PER_JOB} checkpoint permissions")
        perm = {"id": "cp_" + secrets.token_hex(12), "checkpoint": checkpoint, "project_id": tenant,
                "created_at": int(time.time())}
        self.r.hset(self.k_permissions(job_id), perm["id"], dumps(perm))
        return perm

    def permissions(self, job_id: str) -> list[dict[str, Any]]:
        """Oldest first."""
        found = [json.loads(v) for v in self.r.hvals(self.k_permissions(job_id))]
        return sorted(found, key=lambda p: (p["created_at"], p["id"]))

    def revoke(self, job_id: str, permission_id: str) -> bool:
        return bool(self.r.hdel(self.k_permissions(job_id), permission_id))

    def permitted(self, job_id: str, checkpoint: str, tenant: str) -> bool:
        return any((p["checkpoint"], p["project_id"]) == (checkpoint, tenant) for p in self.permissions(job_id))
