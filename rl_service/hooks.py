"""How a running job talks to the outside world: the `JobHooks` protocol, and `InMemoryHooks` for tests and the
standalone driver (`job_main`). The control plane's implementation over Redis is rl_service.control.redis_hooks."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Literal, Protocol

from reward_models.schedule import RewardSchedule

Control = Literal["run", "pause", "cancel"]


class JobHooks(Protocol):
    def emit_event(self, kind: str, data: dict[str, Any]) -> None:
        """A job event (state change, schedule applied, checkpoint, warning, ...)."""

    def warn(self, kind: str, message: str, data: dict[str, Any]) -> None:
        """A condition the user should act on: an event of `kind` (its data with `message`) that also becomes
        the job's current warning."""

    def emit_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """A metrics row. Training rows: `step` is the index of the step they describe (the first is 0).
        Held-out evaluations (only `eval/` keys): `step` is the number of steps trained before them (0 before
        training, total_steps after the last one)."""

    def current_schedule(self) -> tuple[int, RewardSchedule]:
        """The newest schedule version and its schedule; the runner applies it from its next step."""

    def control(self) -> Control:
        """What the control plane asks of the job now."""

    def add_checkpoint(self, step: int, uri: str) -> None:
        """A checkpoint was written (and older ones may have been pruned)."""

    # Optional: `heartbeat(deadline_s=None)`, the sign of progress the runner gives (between phases, per
    # rollout chunk and learner micro-batch), with the current phase's own deadline for the next one; the
    # scheduler kills a driver whose progress stops for longer. Hooks without it are not watched.


class InMemoryHooks:
    """JobHooks kept in memory (tests, `job_main`): records everything; `set_control` / `set_schedule`
    steer the job like the control plane would."""

    def __init__(self, schedule: RewardSchedule | None = None, on_metrics: Callable[[int, dict], None] | None = None):
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.metrics: list[tuple[int, dict[str, float]]] = []
        self.checkpoints: list[tuple[int, str]] = []
        self._control: Control = "run"
        self._schedule: tuple[int, RewardSchedule] = (1, schedule or RewardSchedule())
        self._lock = threading.Lock()
        self.on_metrics = on_metrics
        self.heartbeats = 0
        self.deadlines: set[float | None] = set()  # the phase deadlines the heartbeats carried
        self.warning: str | None = None

    def heartbeat(self, deadline_s: float | None = None) -> None:
        with self._lock:
            self.heartbeats += 1
            self.deadlines.add(deadline_s)

    def emit_event(self, kind: str, data: dict[str, Any]) -> None:
        with self._lock:
            self.events.append((kind, dict(data)))

    def warn(self, kind: str, message: str, data: dict[str, Any]) -> None:
        self.emit_event(kind, {**data, "message": message})
        with self._lock:
            self.warning = message

    def emit_metrics(self, step: int, metrics: dict[str, float]) -> None:
        with self._lock:
            self.metrics.append((step, dict(metrics)))
        if self.on_metrics is not None:
            self.on_metrics(step, metrics)

    def current_schedule(self) -> tuple[int, RewardSchedule]:
        with self._lock:
            return self._schedule

    def control(self) -> Control:
        with self._lock:
            return self._control

    def add_checkpoint(self, step: int, uri: str) -> None:
        with self._lock:
            self.checkpoints.append((step, uri))

    # ---- steering ----
    def set_control(self, control: Control) -> None:
        with self._lock:
            self._control = control

    def set_schedule(self, schedule: RewardSchedule) -> int:
        with self._lock:
            version = self._schedule[0] + 1
            self._schedule = (version, schedule)
            return version

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        return [d for k, d in self.events if k == kind]
