"""Request parameters shared by the /v1 routers and the dashboard's helper routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path

from api.auth import get_service, principal
from rl_service.control.service import Principal, TaperService

Svc = Annotated[TaperService, Depends(get_service)]
Who = Annotated[Principal, Depends(principal)]

# A job id or environment name in a URL path: characters that need no escaping, bounded length.
PathName = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
JobId = PathName
EnvName = PathName
