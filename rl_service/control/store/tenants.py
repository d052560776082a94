"""What belongs to a tenant beside its jobs: its quota, its environment registrations and its API keys (only a
key's SHA-256 is stored)."""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from typing import Any

from rl_service.control.quota import TenantQuota
from rl_service.control.store.base import StoreBase, dumps

KEY_ID_LEN = 16


def hash_api_key(key: str) -> str:
    # API keys are 256-bit random tokens, so one SHA-256 is enough (no password stretching needed).
    return hashlib.sha256(key.encode()).hexdigest()


class TenantsPart(StoreBase):
    """Quotas, environments, API keys and webhook signing secrets."""

    def webhook_secret(self, tenant: str, rotate: bool = False) -> str:
        """The tenant's webhook signing secret (`whsec_` and base64 of 32 random bytes), made on first use."""
        import base64
        import secrets

        fresh = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
        if rotate:
            self.r.set(self.k_webhook_secret(tenant), fresh)
            return fresh
        self.r.set(self.k_webhook_secret(tenant), fresh, nx=True)
        return str(self.r.get(self.k_webhook_secret(tenant)))

    def get_quota(self, tenant: str) -> TenantQuota | None:
        """The quota an admin set for ``tenant``; None when it has none (the operator's default applies)."""
        raw = self.r.get(self.k_quota(tenant))
        return TenantQuota.model_validate_json(raw) if raw else None

    def set_quota(self, tenant: str, quota: TenantQuota) -> None:
        self.r.set(self.k_quota(tenant), quota.model_dump_json())

    def delete_quota(self, tenant: str) -> bool:
        return bool(self.r.delete(self.k_quota(tenant)))

    def put_environment(self, tenant: str, name: str, registration: dict[str, Any]) -> bool:
        """Store a registration; returns False (and writes nothing) if the name is taken."""
        return bool(self.r.hsetnx(self.k_envs(tenant), name, dumps(registration)))

    def get_environment(self, tenant: str, name: str) -> dict[str, Any] | None:
        raw = self.r.hget(self.k_envs(tenant), name)
        return json.loads(raw) if raw else None

    def list_environments(self, tenant: str) -> dict[str, dict[str, Any]]:
        return {k: json.loads(v) for k, v in sorted(self.r.hgetall(self.k_envs(tenant)).items())}

    def delete_environment(self, tenant: str, name: str) -> bool:
        return bool(self.r.hdel(self.k_envs(tenant), name))

    def create_api_key(self, tenant: str, name: str = "", admin: bool = False,
                       expires_at: float | None = None) -> str:
        """A new bearer key for ``tenant`` (valid until the Unix time ``expires_at``, if given); only its SHA-256
        is stored, so this is the one chance to see it."""
        key = "tpr_" + secrets.token_urlsafe(32)
        digest = hash_api_key(key)
        record = {"tenant": tenant, "name": name, "admin": "1" if admin else "0", "created_at": repr(time.time())}
        if expires_at is not None:
            record["expires_at"] = repr(expires_at)
        with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(self.k_apikey(digest), mapping=record)
            pipe.sadd(self.k_tenant_keys(tenant), digest)
            pipe.execute()
        return key

    @staticmethod
    def _key_info(digest: str, raw: dict[str, str]) -> dict[str, Any]:
        return {"id": digest[:KEY_ID_LEN], "tenant": raw["tenant"], "name": raw.get("name", ""),
                "admin": raw.get("admin") == "1", "created_at": float(raw.get("created_at") or 0),
                "expires_at": float(raw["expires_at"]) if raw.get("expires_at") else None}

    def lookup_api_key(self, key: str) -> dict[str, Any] | None:
        """The key's record (id, tenant, name, admin, created_at, expires_at), None for an unknown key. Whether it
        has expired is the caller's to judge (the service answers 401)."""
        digest = hash_api_key(key)
        raw = self.r.hgetall(self.k_apikey(digest))
        return self._key_info(digest, raw) if raw else None

    async def alookup_api_key(self, key: str) -> dict[str, Any] | None:
        digest = hash_api_key(key)
        raw = await self.ar.hgetall(self.k_apikey(digest))
        return self._key_info(digest, raw) if raw else None

    def list_api_keys(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """The records of every key (of ``tenant``), oldest first."""
        if tenant is not None:
            digests = sorted(self.r.smembers(self.k_tenant_keys(tenant)))
        else:
            head = f"{self.prefix}:apikey:"
            digests = sorted(k.removeprefix(head) for k in self.r.scan_iter(match=head + "*", count=1000))
        with self.r.pipeline(transaction=False) as pipe:
            for digest in digests:
                pipe.hgetall(self.k_apikey(digest))
            raws = pipe.execute()
        keys = [self._key_info(d, raw) for d, raw in zip(digests, raws, strict=True) if raw]
        return sorted(keys, key=lambda k: k["created_at"])

    def revoke_api_key(self, key: str) -> bool:
        return self._revoke_digest(hash_api_key(key))

    def revoke_api_key_id(self, key_id: str) -> dict[str, Any] | None:
        """Revoke the key whose id (see list_api_keys) is ``key_id``; returns its record, None if there is none."""
        if len(key_id) != KEY_ID_LEN or not all(c in "0123456789abcdef" for c in key_id):
            return None
        matches = list(self.r.scan_iter(match=self.k_apikey(key_id) + "*", count=1000))
        if len(matches) != 1:
            return None
        digest = matches[0].rsplit(":", 1)[1]
        raw = self.r.hgetall(matches[0])
        if not raw or not self._revoke_digest(digest):
            return None
        return self._key_info(digest, raw)

    def _revoke_digest(self, digest: str) -> bool:
        tenant = self.r.hget(self.k_apikey(digest), "tenant")
        if tenant is None:
            return False
        with self.r.pipeline(transaction=True) as pipe:
            pipe.delete(self.k_apikey(digest))
            pipe.srem(self.k_tenant_keys(tenant), digest)
            pipe.execute()
        return True

    def has_api_keys(self) -> bool:
        return next(self.r.scan_iter(match=f"{self.prefix}:apikey:*", count=1000), None) is not None
