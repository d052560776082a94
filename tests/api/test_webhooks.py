"""Signed webhooks for a job's end and pauses: a real receiver on 127.0.0.1 gets a notice it can verify with
the tenant's secret (Standard Webhooks' headers), retried past a 503; a URL the network rules refuse is a 422
naming the field; a state the hook did not ask for sends nothing."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from rl_service.control.scheduler.driver import _send_webhooks
from rl_service.control.service import TaperService
from rl_service.control.settings import TaperSettings
from rl_service.control.store import Store
from rl_service.control.webhooks import verify
from rollout_workers.environments.policy import EnvironmentPolicy
from tests.waiting import wait_for


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[tuple[dict, bytes]]]]:
    """Answers the first POST with 503, then 204; keeps what came (headers, body)."""
    got: list[tuple[dict, bytes]] = []
    tries = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            tries.append(1)
            if len(tries) == 1:
                self.send_response(503)
            else:
                got.append(({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}/hook", got
    httpd.shutdown()


def test_a_jobs_end_is_a_signed_notice_its_receiver_can_verify(
        redis_url: str, tmp_path: Path, receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    url, got = receiver
    store = Store(redis_url)
    service = TaperService(store, tmp_path, env_policy=EnvironmentPolicy(http_allow=("127.0.0.1",)))
    headers = {"Authorization": f"Bearer {store.create_api_key('hooks')}"}
    with TestClient(create_app(service, TaperSettings(data_dir=tmp_path))) as client:
        secret = client.get("/v1/webhooks/secret", headers=headers).json()["secret"]
        assert secret.startswith("whsec_") and client.get("/v1/webhooks/secret", headers=headers).json()["secret"] == secret
        r = client.post("/v1/jobs", json={"webhooks": [{"url": "http://192.168.7.7/hook"}]}, headers=headers)
        assert r.status_code == 422 and r.json()["error"]["field"] == "webhooks[0].url", r.text

        job = client.post("/v1/jobs", json={"webhooks": [{"url": url}], "metadata": {"run": "a"}},
                          headers=headers).json()
        assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=headers).json()["state"] == "cancelled"
        wait_for(lambda: got, 30, "the cancel's notice")  # retried past the first 503
        sent_headers, body = got[0]
        assert verify(secret, sent_headers, body)
        assert not verify(secret, sent_headers, body.replace(b"cancelled", b"succeeded"))  # a forged body fails
        notice = json.loads(body)
        assert (notice["type"], notice["job_id"], notice["metadata"]) == ("job.cancelled", job["id"], {"run": "a"})
        wait_for(lambda: any(e["kind"] == "webhook_sent" for e in store.events(job["id"])), 10, "the event")

        rotated = client.post("/v1/webhooks/secret/rotate", headers=headers).json()["secret"]
        assert rotated != secret and not verify(rotated, sent_headers, body)

        # the driver's path: a job that failed notifies the hooks that asked for it, and only those
        monkeypatch.setenv("TAPER_HTTP_ALLOW", "127.0.0.1")
        spec = {"webhooks": [{"url": url, "events": ["failed"]}, {"url": url + "2", "events": ["succeeded"]}]}
        failing = client.post("/v1/jobs", json=spec, headers=headers).json()["id"]
    store.transition(failing, "starting")
    store.transition(failing, "running")
    store.transition(failing, "failed", fields={"error": "learner rank 0 died"})
    _send_webhooks(store, failing)
    assert len(got) == 2 and json.loads(got[1][1])["error"] == "learner rank 0 died"
    assert got[1][0]["webhook-id"] != got[0][0]["webhook-id"] and verify(rotated, *got[1])
    assert abs(int(got[1][0]["webhook-timestamp"]) - time.time()) < 60
