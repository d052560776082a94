"""Reward-hacking monitor: process reward rising while outcome success falls below where it started.

Feed it one point per training step (the batch's weighted process reward and success rate, e.g.
``stats["process_weighted_mean"]`` and ``stats["success_rate"]`` of compute_advantages). The starting
success level is the mean of the first `baseline_steps` points. Once `window` points follow the baseline,
it warns when, over the last `window` points, the weighted process reward rose (second half's mean minus
first half's mean >= `min_rise`) and the mean success is below the start by at least `min_drop`. It warns
once per episode and re-arms after the condition clears.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

WARNING_KIND = "reward_hacking_suspected"


class HackingMonitorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    window: int = Field(20, ge=2, multiple_of=2, description="Steps the condition is judged over (even: its halves "
                        "are compared).")
    baseline_steps: int = Field(5, ge=1, description="First steps whose mean success is the starting level.")
    min_rise: float = Field(0.0, ge=0.0, description="Weighted process rise (half-window means) that counts.")
    min_drop: float = Field(0.0, ge=0.0, description="How far below the start success must fall.")


class HackingMonitor:
    def __init__(self, config: HackingMonitorConfig | None = None, **kwargs: Any) -> None:
        self.config = config or HackingMonitorConfig(**kwargs)
        self._baseline: list[float] = []
        self._points: deque[tuple[int, float, float]] = deque(maxlen=self.config.window)
        self._firing = False

    @property
    def success_start(self) -> float | None:
        if len(self._baseline) < self.config.baseline_steps:
            return None
        return sum(self._baseline) / len(self._baseline)

    def update(self, step: int, weighted_process: float, success: float) -> dict[str, Any] | None:
        """Record one step; a warning event dict when the hacking condition starts to hold, else None."""
        for field, value in (("weighted_process", weighted_process), ("success", success)):
            if not math.isfinite(value):
                raise ValueError(f"{field} must be a finite number (got {value} at step {step})")
        if len(self._baseline) < self.config.baseline_steps:
            self._baseline.append(float(success))
            return None
        self._points.append((step, float(weighted_process), float(success)))
        if len(self._points) < self.config.window:
            return None
        half = self.config.window // 2
        procs = [p for _, p, _ in self._points]
        first, second = sum(procs[:half]) / half, sum(procs[half:]) / half
        success_now = sum(s for _, _, s in self._points) / len(self._points)
        start = self.success_start
        assert start is not None
        rise = second - first
        holds = rise > 0 and rise >= self.config.min_rise and success_now < start - self.config.min_drop
        if not holds:
            self._firing = False
            return None
        if self._firing:
            return None
        self._firing = True
        return {
            "kind": WARNING_KIND,
            "step": step,
            "window": self.config.window,
            "window_start_step": self._points[0][0],
            "process_weighted_first_half": first,
            "process_weighted_second_half": second,
            "process_weighted_rise": rise,
            "success_start": start,
            "success_window_mean": success_now,
            "message": (
                f"weighted process reward rose by {rise:.4f} over the last {self.config.window} steps while "
                f"success ({success_now:.3f}) fell below its starting level ({start:.3f}): "
                "the policy may be gaming the process reward"
            ),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.model_dump(),
            "baseline": list(self._baseline),
            "points": [list(p) for p in self._points],
            "firing": self._firing,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> HackingMonitor:
        mon = cls(HackingMonitorConfig(**state["config"]))
        mon._baseline = [float(x) for x in state["baseline"]]
        mon._points.extend((int(s), float(p), float(q)) for s, p, q in state["points"])
        mon._firing = bool(state["firing"])
        return mon
