"""`wait_for`: poll a condition in tests that wait on other processes (a scheduler, an API server, a Ray job)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(pred: Callable[[], Any], timeout: float = 90.0, what: str = "condition", *, every_s: float = 0.1,
             gone: Callable[[], str | None] | None = None, detail: Callable[[], str] | None = None) -> Any:
    """`pred()`'s first truthy value, polled every `every_s` seconds. AssertionError naming `what` after `timeout`
    seconds, or as soon as `gone()` gives a reason to stop waiting (the process that should act has exited);
    `detail()` (a log's tail) is added to the message."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        if gone is not None and (reason := gone()):
            raise AssertionError(f"{reason} while waiting for {what}" + (f":\n{detail()}" if detail else ""))
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}" + (f":\n{detail()}" if detail else ""))
