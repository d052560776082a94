"""/v1/webhooks/secret: the tenant's webhook signing secret (what its receivers verify jobs' notices with),
and its rotation. Thin: the store keeps it, rl_service.control.webhooks signs with it."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from api.routers.dependencies import Svc, Who

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])


class WebhookSecret(BaseModel):
    secret: str = Field(description="`whsec_` and base64: the HMAC-SHA256 key of the `webhook-signature` header "
                                    "(Standard Webhooks).")


@router.get("/secret", response_model=WebhookSecret, summary="The tenant's webhook signing secret")
def get_secret(svc: Svc, who: Who) -> WebhookSecret:
    return WebhookSecret(secret=svc.tenants.webhook_secret(who))


@router.post("/secret/rotate", response_model=WebhookSecret, summary="A new signing secret (the old one stops)")
def rotate_secret(svc: Svc, who: Who) -> WebhookSecret:
    return WebhookSecret(secret=svc.tenants.webhook_secret(who, rotate=True))
