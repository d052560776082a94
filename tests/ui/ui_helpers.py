"""Helpers of the browser tests: uvicorn in a thread, the Chromium launch settings, login and screenshots."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_service.control.local_services import free_port
from rl_service.control.service import TaperService
from rl_service.control.store import Store

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "ui"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


class ThreadedServer:
    """uvicorn serving ``app`` on a free loopback port from a daemon thread (lifespan included)."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        import uvicorn

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


@dataclass
class UiServer:
    url: str
    key: str
    store: Store
    service: TaperService


def screenshot(page: Any, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 0 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"no screenshot at {path}"
    return path


def log_in(page: Any, url: str, key: str, next_path: str = "/ui/jobs") -> None:
    page.goto(f"{url}{next_path}")
    page.wait_for_url("**/ui/login**")
    page.fill("#api-key", key)
    page.click("#login-form button[type=submit]")
    page.wait_for_url(f"**{next_path}")


def wait_js(page: Any, expression: str, timeout: float = 20.0) -> Any:
    """Poll a JavaScript expression until it is truthy (page.wait_for_function evaluates its predicate with
    eval(), which the dashboard's Content-Security-Policy forbids, as it should)."""
    deadline = time.monotonic() + timeout
    while True:
        value = page.evaluate(expression)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for: {expression}")
        page.wait_for_timeout(100)
