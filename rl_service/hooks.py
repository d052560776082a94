"""How a running job talks to the outside world (the control plane implements this over Redis;
tests and the offline runner use an in-memory version)."""

from __future__ import annotations

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
