"""The job driver's heartbeat: signs of progress, each with the deadline of the phase the runner is in."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

from rl_service.hooks import JobHooks


class Progress:
    """Tell the control plane the job is making progress (its driver's heartbeat; hooks rate-limit it), with
    the current phase's deadline for the next sign. Called between phases, per rollout chunk finished, per
    learner micro-batch (the data-parallel ranks: while they answer within their own deadline); waiting alone
    is not progress, so a runner stuck in one call or waiting on rollouts that never finish stops the beat."""

    def __init__(self, hooks: JobHooks, pool_progress: Callable[[], int]) -> None:
        self._heartbeat = getattr(hooks, "heartbeat", None)
        self._pool_progress = pool_progress
        self.deadline_s: float | None = None

    def __call__(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat(self.deadline_s)

    def phase(self, deadline_s: float | None) -> None:
        """Enter a phase whose progress may take up to `deadline_s` (None: the operator's allowance only)."""
        self.deadline_s = deadline_s
        self()

    def wait(self, future: Any, every_s: float = 1.0) -> Any:
        """`future.result()`, beating whenever the rollout pool finishes a chunk meanwhile."""
        seen = self._pool_progress()
        while True:
            try:
                return future.result(timeout=every_s)
            except concurrent.futures.TimeoutError:
                now = self._pool_progress()
                if now != seen:
                    seen = now
                    self()
