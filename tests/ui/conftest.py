"""Fixtures of the browser tests: the real API served by uvicorn from a thread, and headless Chromium
(Debian's package) driven by Playwright. Screenshots go to test-artifacts/ui/."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from ui_helpers import CHROMIUM, CHROMIUM_ARGS, ThreadedServer, UiServer  # noqa: E402

from api.app import create_app  # noqa: E402
from rl_service.control.service import TaperService  # noqa: E402
from rl_service.control.settings import TaperSettings  # noqa: E402
from rl_service.control.store import Store  # noqa: E402


@pytest.fixture
def ui_server(redis_url: str, tmp_path: Path) -> Iterator[UiServer]:
    """The API (with the dashboard) over a real Redis; no scheduler: tests drive job state through the store."""
    store = Store(redis_url)
    service = TaperService(store, tmp_path)
    app = create_app(service, TaperSettings(data_dir=tmp_path))
    with ThreadedServer(app) as server:
        yield UiServer(server.url, store.create_api_key("ui"), store, service)
    store.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(20_000)
    pg = context.new_page()
    pg.console_errors = []  # type: ignore[attr-defined]
    # 422s are the validation answers the tests provoke on purpose; anything else logged as an error is a bug
    pg.on("console", lambda m: m.type == "error" and "status of 422" not in m.text  # type: ignore[attr-defined]
          and pg.console_errors.append(m.text))
    pg.on("pageerror", lambda e: pg.console_errors.append(str(e)))  # type: ignore[attr-defined]
    # every URL the page asks for (documents, scripts, API calls, the event stream): no key may appear in one
    pg.request_urls = []  # type: ignore[attr-defined]
    pg.on("request", lambda r: pg.request_urls.append(r.url))  # type: ignore[attr-defined]
    yield pg
    context.close()
