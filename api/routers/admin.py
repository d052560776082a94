"""Admin routes (admin keys only): /v1/tenants/{tenant}/quota (what a tenant may run) and /v1/keys."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from api.openapi import SchemaCheckedRoute
from api.routers.dependencies import Svc, Who
from api.schemas import KeyCreate, KeyCreated, KeyOut, QuotaOut, error_responses
from rl_service.control.quota import TenantQuota

router = APIRouter(prefix="/v1", tags=["admin"], route_class=SchemaCheckedRoute, responses=error_responses(403, 422))

TENANT = r"^[a-z0-9][a-z0-9_-]*$"
Tenant = Annotated[str, Path(min_length=1, max_length=64, pattern=TENANT)]
KeyId = Annotated[str, Path(min_length=16, max_length=16, pattern=r"^[0-9a-f]+$")]


@router.get("/keys", response_model=list[KeyOut], summary="API keys (of one tenant), oldest first")
def list_keys(svc: Svc, who: Who,
              tenant: Annotated[str | None, Query(max_length=64, pattern=TENANT)] = None) -> list[KeyOut]:
    return [KeyOut(**k) for k in svc.tenants.list_keys(who, tenant)]


@router.post("/keys", status_code=201, response_model=KeyCreated, summary="Create an API key (shown once)",
             responses=error_responses(400, 413))
def create_key(svc: Svc, who: Who, body: KeyCreate) -> KeyCreated:
    key, info = svc.tenants.create_key(who, body.tenant, name=body.name, admin=body.admin,
                                     expires_in_s=body.expires_in_s)
    return KeyCreated(**info, key=key)


@router.delete("/keys/{key_id}", response_model=KeyOut, summary="Revoke an API key", responses=error_responses(404))
def revoke_key(key_id: KeyId, svc: Svc, who: Who) -> KeyOut:
    return KeyOut(**svc.tenants.revoke_key(who, key_id))


@router.get("/tenants/{tenant}/quota", response_model=QuotaOut, summary="A tenant's quota (the default when it has none)",
            responses=error_responses(404))
def get_quota(tenant: Tenant, svc: Svc, who: Who) -> QuotaOut:
    quota, own = svc.tenants.get_quota(who, tenant)
    return QuotaOut(tenant=tenant, quota=quota, default=not own)


@router.put("/tenants/{tenant}/quota", response_model=QuotaOut, summary="Set a tenant's quota (every field; omitted ones "
            "take their defaults)", responses=error_responses(400, 404, 413))
def set_quota(tenant: Tenant, svc: Svc, who: Who, body: TenantQuota) -> QuotaOut:
    return QuotaOut(tenant=tenant, quota=svc.tenants.set_quota(who, tenant, body), default=False)


@router.delete("/tenants/{tenant}/quota", status_code=204, response_class=Response,
               summary="Drop a tenant's quota: the operator's default applies again", responses=error_responses(404))
def reset_quota(tenant: Tenant, svc: Svc, who: Who) -> Response:
    svc.tenants.reset_quota(who, tenant)
    return Response(status_code=204)
