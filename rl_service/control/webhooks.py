"""Signed webhooks: when a job ends (succeeded, failed, cancelled) or pauses, a POST to each of its
`webhooks` that asked for that state, signed as Standard Webhooks (and OpenAI's webhooks) sign: headers
`webhook-id`, `webhook-timestamp` and `webhook-signature: v1,BASE64(HMAC-SHA256(secret, "ID.TIMESTAMP.BODY"))`
with the tenant's secret (`whsec_...`, GET /v1/webhooks/secret). Connections go through the operator's network
rules (net_guard, as a tool server's); a failed delivery (connection error, 429, 5xx) is retried with backoff,
a refused target or a 4xx is not. Delivery never changes the job."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
from typing import Any

import httpx

from rl_service.control.store import JobRecord, Store
from rollout_workers.net_guard import AllowList, PinnedTransport, TargetRefused
from rollout_workers.retry import Retryable, call_with_retries, retry_after

log = logging.getLogger(__name__)

RETRIES = 4
BACKOFF_S = 1.0
TIMEOUT_S = 10.0


def sign(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    key = base64.b64decode(secret.removeprefix("whsec_"))
    digest = hmac.new(key, f"{message_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def verify(secret: str, headers: dict[str, str], body: bytes, tolerance_s: float = 300.0) -> bool:
    """What a receiver checks (the standard's rule): a signature of the body with the secret, and a fresh
    timestamp."""
    timestamp = int(headers["webhook-timestamp"])
    if abs(time.time() - timestamp) > tolerance_s:
        return False
    expected = sign(secret, headers["webhook-id"], timestamp, body)
    return any(hmac.compare_digest(expected, s) for s in headers["webhook-signature"].split())


def notice(job: JobRecord) -> dict[str, Any]:
    return {"type": f"job.{job.state.value}", "job_id": job.id, "state": job.state.value, "name": job.name,
            "step": job.step, "total_steps": job.total_steps, "error": job.error, "metadata": job.spec.metadata,
            "created_at": int(time.time())}


def deliver(url: str, body: bytes, secret: str, allow: AllowList) -> int:
    """POST one signed notice (retried with backoff); the final status code, or raises RuntimeError."""
    message_id = "msg_" + secrets.token_hex(12)

    def attempt() -> int:
        timestamp = int(time.time())
        headers = {"content-type": "application/json", "webhook-id": message_id,
                   "webhook-timestamp": str(timestamp), "webhook-signature": sign(secret, message_id, timestamp, body)}
        with httpx.Client(transport=PinnedTransport(allow), follow_redirects=False, trust_env=False) as client:
            try:
                response = client.post(url, content=body, headers=headers, timeout=TIMEOUT_S)
            except TargetRefused as e:
                raise RuntimeError(f"webhook {url}: target refused: {e}") from None
            except httpx.TransportError as e:
                raise Retryable(f"webhook {url}: {e or type(e).__name__}") from e
        if response.status_code == 429 or response.status_code >= 500:
            raise Retryable(f"webhook {url}: HTTP {response.status_code}",
                            retry_after(response.headers.get("retry-after")))
        return response.status_code

    try:
        return call_with_retries(attempt, RETRIES, BACKOFF_S)
    except Retryable as e:
        raise RuntimeError(f"{e} (after {RETRIES + 1} attempts)") from None


def notify(store: Store, job_id: str, allow: AllowList, *, background: bool = False) -> None:
    """Send the job's notices for its current state (each failure logged and recorded as a warning event)."""
    job = store.get_job(job_id)
    hooks = [h for h in job.spec.webhooks if job.state.value in h.events]
    if not hooks:
        return
    body = json.dumps(notice(job)).encode()
    secret = store.webhook_secret(job.tenant)

    def send_all() -> None:
        for hook in hooks:
            try:
                status = deliver(hook.url, body, secret, allow)
            except Exception as exc:  # a receiver's trouble is never the job's
                log.warning("job %s: webhook %s failed: %s", job_id, hook.url, exc)
                store.add_event(job_id, "webhook_failed", {"url": hook.url, "message": str(exc)[:500]})
                continue
            store.add_event(job_id, "webhook_sent", {"url": hook.url, "state": job.state.value, "status": status})

    if background:
        threading.Thread(target=send_all, name=f"taper-webhooks-{job_id}", daemon=True).start()
    else:
        send_all()
