"""Bearer API keys: each request acts for the tenant its key belongs to. Keys are stored hashed
(rl_service.control.store); `taper keys create --tenant NAME [--admin] [--expires-in 30d]` makes one, `taper keys
revoke ID` ends one. Admin keys may also use the admin routes (API keys, tenant quotas); the service checks that."""

from __future__ import annotations

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from rl_service.control.service import Principal, TaperService, Unauthorized

bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer tpr_...`")


async def get_service(request: Request) -> TaperService:
    return request.app.state.service


# async dependencies run on the event loop: a sync one would cost a thread hop on every request
async def principal(
    request: Request,
    creds: HTTPAuthorizationCredentials | None = Depends(bearer),
) -> Principal:
    if creds is None or creds.scheme.lower() != "bearer":
        raise Unauthorized("missing bearer API key (Authorization: Bearer <key>)", field="Authorization")
    return await request.app.state.service.tenants.aauthenticate(creds.credentials)
