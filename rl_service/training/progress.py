"""The job driver's heartbeat while a runner works: a beat between phases, and beats while it waits."""

from __future__ import annotations

import concurrent.futures
from typing import Any

from rl_service.hooks import JobHooks


class Progress:
    """Tell the control plane the job is making progress (its driver's heartbeat; hooks rate-limit it).
    Called between phases, per learner micro-batch, and while waiting on rollouts or the learner ranks,
    so only a runner stuck in one call (a hung tool scorer, a deadlock) stops the beat."""

    def __init__(self, hooks: JobHooks) -> None:
        self._heartbeat = getattr(hooks, "heartbeat", None)

    def __call__(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat()

    def wait(self, future: Any, every_s: float = 1.0) -> Any:
        """`future.result()`, beating while it waits."""
        while True:
            try:
                return future.result(timeout=every_s)
            except concurrent.futures.TimeoutError:
                self()
