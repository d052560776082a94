"""/v1/tenants/{tenant}/quota: what a tenant may run (admin keys only)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response

from api.routers.params import Svc, Who
from api.schemas import QuotaOut
from rl_service.quota import TenantQuota

router = APIRouter(prefix="/v1/tenants", tags=["tenants"],
                   responses={403: {"description": "Not an admin key"}})

Tenant = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9_-]*$")]


@router.get("/{tenant}/quota", response_model=QuotaOut, summary="A tenant's quota (the default when it has none)")
def get_quota(tenant: Tenant, svc: Svc, who: Who) -> QuotaOut:
    quota, own = svc.get_quota(who, tenant)
    return QuotaOut(tenant=tenant, quota=quota, default=not own)


@router.put("/{tenant}/quota", response_model=QuotaOut, summary="Set a tenant's quota (every field; omitted ones "
            "take their defaults)")
def set_quota(tenant: Tenant, svc: Svc, who: Who, body: TenantQuota) -> QuotaOut:
    return QuotaOut(tenant=tenant, quota=svc.set_quota(who, tenant, body), default=False)


@router.delete("/{tenant}/quota", status_code=204, response_class=Response,
               summary="Drop a tenant's quota: the operator's default applies again")
def reset_quota(tenant: Tenant, svc: Svc, who: Who) -> Response:
    svc.reset_quota(who, tenant)
    return Response(status_code=204)
