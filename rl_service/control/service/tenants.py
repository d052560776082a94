"""Who calls: bearer keys to principals (briefly cached), the admin's API keys and tenant quotas."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from rl_service.control.quota import TenantQuota
from rl_service.control.service.errors import Forbidden, InvalidInput, NotFound, Unauthorized, invalid_from
from rl_service.control.store import Store


@dataclass(frozen=True)
class Principal:
    tenant: str
    admin: bool = False
    key_name: str = ""


def validate_tenant(tenant: str) -> None:
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,63}", tenant):
        raise InvalidInput("tenant must be 1-64 chars of a-z, 0-9, '_' or '-', starting with a letter or digit",
                           field="tenant")


def require_admin(p: Principal) -> None:
    if not p.admin:
        raise Forbidden("this needs an admin API key", field="Authorization")


class Tenants:
    """Authentication, the API keys an admin manages, and the quota in force for each tenant."""

    def __init__(self, store: Store, auth_cache_s: float = 5.0, default_quota: TenantQuota | None = None) -> None:
        self.store = store
        self.auth_cache_s = auth_cache_s
        self.default_quota = default_quota or TenantQuota()
        self._auth_cache: dict[str, tuple[float, Principal]] = {}
        self._auth_lock = threading.Lock()

    # ---- auth ----
    def _cached_principal(self, key: str | None) -> Principal | None:
        if not key:
            raise Unauthorized("missing bearer API key (Authorization: Bearer <key>)", field="Authorization")
        with self._auth_lock:
            hit = self._auth_cache.get(key)
        return hit[1] if hit and hit[0] > time.monotonic() else None

    def _remember(self, key: str, info: dict[str, Any] | None) -> Principal:
        if info is None:
            raise Unauthorized("invalid API key", field="Authorization")
        left_s = float("inf") if info["expires_at"] is None else info["expires_at"] - time.time()
        if left_s <= 0:
            raise Unauthorized("API key expired", field="Authorization")
        principal = Principal(tenant=info["tenant"], admin=info["admin"], key_name=info["name"])
        with self._auth_lock:
            if len(self._auth_cache) > 10_000:
                self._auth_cache.clear()
            self._auth_cache[key] = (time.monotonic() + min(self.auth_cache_s, left_s), principal)
        return principal

    def authenticate(self, key: str | None) -> Principal:
        """The principal of a bearer key (cached briefly: a revoked key stops working within auth_cache_s)."""
        return self._cached_principal(key) or self._remember(key, self.store.lookup_api_key(key))

    async def aauthenticate(self, key: str | None) -> Principal:
        return self._cached_principal(key) or self._remember(key, await self.store.alookup_api_key(key))

    # ---- API keys (admin) ----
    def create_key(self, p: Principal, tenant: str, name: str = "", admin: bool = False,
                   expires_in_s: float | None = None) -> tuple[str, dict[str, Any]]:
        """A new key (shown once) and its record."""
        require_admin(p)
        validate_tenant(tenant)
        expires_at = None if expires_in_s is None else time.time() + expires_in_s
        key = self.store.create_api_key(tenant, name=name, admin=admin, expires_at=expires_at)
        info = self.store.lookup_api_key(key)
        assert info is not None
        return key, info

    def list_keys(self, p: Principal, tenant: str | None = None) -> list[dict[str, Any]]:
        require_admin(p)
        return self.store.list_api_keys(tenant)

    def revoke_key(self, p: Principal, key_id: str) -> dict[str, Any]:
        require_admin(p)
        info = self.store.revoke_api_key_id(key_id)
        if info is None:
            raise NotFound(f"API key {key_id!r} not found", field="key_id")
        with self._auth_lock:  # keys are cached by their secret, which is not stored: drop them all
            self._auth_cache.clear()
        return info

    # ---- quotas (admin) ----
    def quota_of(self, tenant: str) -> TenantQuota:
        """The quota in force for ``tenant``: the one an admin set, else the operator's default."""
        return self.store.get_quota(tenant) or self.default_quota

    def get_quota(self, p: Principal, tenant: str) -> tuple[TenantQuota, bool]:
        """(the tenant's quota, whether an admin set it rather than it being the default)."""
        require_admin(p)
        validate_tenant(tenant)
        own = self.store.get_quota(tenant)
        return own or self.default_quota, own is not None

    def set_quota(self, p: Principal, tenant: str, body: Any) -> TenantQuota:
        require_admin(p)
        validate_tenant(tenant)
        try:
            quota = body if isinstance(body, TenantQuota) else TenantQuota.model_validate(body)
        except ValidationError as exc:
            raise invalid_from(exc) from None
        self.store.set_quota(tenant, quota)
        return quota

    def reset_quota(self, p: Principal, tenant: str) -> None:
        """Drop the tenant's own quota: the operator's default applies again."""
        require_admin(p)
        validate_tenant(tenant)
        self.store.delete_quota(tenant)

    def webhook_secret(self, p: Principal, rotate: bool = False) -> str:
        """The caller's tenant's webhook signing secret (a new one with ``rotate``: the old one stops)."""
        return self.store.webhook_secret(p.tenant, rotate=rotate)
