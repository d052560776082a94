"""Schedule curves for the dashboard: the weight/density in force at every step (with its versions) and,
for a proposed patch, the curve the job would follow if the patch were applied now."""

from __future__ import annotations

from typing import Any

from reward_models.plot import effective_curve
from reward_models.schedule import ScheduleHistory

MAX_POINTS = 1000


def sample_steps(last_step: int, max_points: int = MAX_POINTS) -> list[int]:
    """0..last_step inclusive, thinned to at most ``max_points`` evenly spaced steps (always keeping both ends)."""
    if last_step < 0:
        raise ValueError(f"last_step must be >= 0 (got {last_step})")
    if last_step + 1 <= max_points:
        return list(range(last_step + 1))
    stride = last_step / (max_points - 1)
    return sorted({round(i * stride) for i in range(max_points)})


def _curve(history: ScheduleHistory, steps: list[int]) -> dict[str, list[float]]:
    weights, densities, _ = effective_curve(history, steps)
    return {"weight": weights, "density": densities}


def schedule_preview(history: ScheduleHistory, at_step: int, last_step: int,
                     patch: dict[str, Any] | None = None) -> dict[str, Any]:
    """Curves of ``history`` over steps 0..last_step, and of the history with ``patch`` applied at ``at_step``
    (exactly what PATCH /v1/jobs/{id}/reward-schedule would store). Raises pydantic.ValidationError or
    ValueError for a bad patch; ``history`` itself is not modified."""
    steps = sample_steps(last_step)
    out: dict[str, Any] = {
        "steps": steps,
        "current": _curve(history, steps),
        "versions": [{"version": v.version, "effective_from": v.effective_from, "applied_at": v.applied_at}
                     for v in history.versions],
        "proposed": None,
    }
    if patch:
        trial = ScheduleHistory.model_validate(history.model_dump())
        new = trial.apply_patch(patch, at_step=at_step)
        out["proposed"] = {
            **_curve(trial, steps),
            "version": new.version,
            "effective_from": new.effective_from,
            "schedule": new.schedule.model_dump(mode="json"),
        }
    return out

