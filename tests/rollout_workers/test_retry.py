"""Retries of requests to tenant servers (rollout_workers.retry, with tenacity): a real HTTP server that
answers 429 with Retry-After is waited for as it asks; Retry-After values are read and capped."""

from __future__ import annotations

import email.utils
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rollout_workers.environments.http_env import post_json
from rollout_workers.environments.policy import EnvironmentPolicy
from rollout_workers.environments.registry import EnvironmentRegistration
from rollout_workers.retry import MAX_RETRY_AFTER_S, Retryable, call_with_retries, retry_after

LOCAL = EnvironmentPolicy(http_allow=("127.0.0.1",))


@pytest.fixture
def busy_server() -> Iterator[tuple[str, list[float]]]:
    """Answers 429 with `Retry-After: 1` twice, then {"result": "ok"}; records when each request came."""
    seen: list[float] = []

    class Busy(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            self.rfile.read(int(self.headers.get("content-length", 0)))
            seen.append(time.monotonic())
            body = json.dumps({"result": "ok"}).encode() if len(seen) > 2 else b""
            self.send_response(200 if body else 429)
            if not body:
                self.send_header("retry-after", "1")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}/", seen
    httpd.shutdown()


def test_a_429_with_retry_after_is_waited_for_as_the_server_asks(busy_server: tuple[str, list[float]]) -> None:
    url, seen = busy_server
    reg = EnvironmentRegistration(kind="http", name="busy", base_url=url, retries=3, backoff_s=0.01,
                                  tools=[{"name": "t", "description": "", "parameters": {"type": "object"}}])
    assert post_json(reg, "call", {"tool": "t"}, LOCAL.allow_list) == {"result": "ok"}
    gaps = [b - a for a, b in zip(seen, seen[1:], strict=False)]
    assert len(seen) == 3 and all(gap >= 0.95 for gap in gaps), gaps  # not the 0.01 s backoff


def test_retry_after_values_and_the_attempt_budget() -> None:
    assert retry_after("3") == 3.0 and retry_after(None) is None and retry_after("soon") is None
    assert retry_after("100000") == MAX_RETRY_AFTER_S
    later = email.utils.formatdate(time.time() + 5, usegmt=True)
    assert 3.0 <= retry_after(later) <= 5.0
    calls = []

    def flaky() -> str:
        calls.append(1)
        raise Retryable("HTTP 503")

    with pytest.raises(Retryable, match="HTTP 503"):
        call_with_retries(flaky, retries=2, backoff_s=0.001)
    assert len(calls) == 3

    def refused() -> str:
        calls.append(1)
        raise RuntimeError("target refused")

    calls.clear()
    with pytest.raises(RuntimeError):  # not a Retryable: no second attempt
        call_with_retries(refused, retries=5, backoff_s=0.001)
    assert len(calls) == 1
