"""Render a schedule (and its version history) to PNG."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from reward_models.schedule import RewardSchedule, ScheduleHistory


def effective_curve(
    schedule: RewardSchedule | ScheduleHistory, steps: Sequence[int]
) -> tuple[list[float], list[float], list[int]]:
    """(w(t), density(t), version in force) for each step, following the history's versions."""
    history = schedule if isinstance(schedule, ScheduleHistory) else ScheduleHistory.start(schedule)
    weights, densities, versions = [], [], []
    for t in steps:
        v, s = history.at(t)
        weights.append(s.weight(t))
        densities.append(s.density(t))
        versions.append(v)
    return weights, densities, versions


def default_steps(schedule: RewardSchedule | ScheduleHistory) -> range:
    history = schedule if isinstance(schedule, ScheduleHistory) else ScheduleHistory.start(schedule)
    end = 0
    for v in history.versions:
        s = v.schedule
        end = max(end, v.effective_from, s.warmup + s.horizon)
        if s.milestones:
            end = max(end, s.milestones[-1])
        if s.points:
            end = max(end, s.points[-1][0])
        if s.half_life:
            end = max(end, s.warmup + int(5 * s.half_life))
    return range(0, int(end * 1.1) + 2)


def plot_schedule(
    schedule: RewardSchedule | ScheduleHistory,
    path: str | Path,
    steps: range | None = None,
    current_step: int | None = None,
    title: str | None = None,
) -> Path:
    """Write a PNG of w(t) and density(t); with a history, each version's own curve dashed and the
    effective curve solid, version changes marked."""
    # A bare Figure on the Agg canvas: no pyplot global state, safe in a server thread.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = steps or default_steps(schedule)
    xs = list(steps)
    weights, densities, _ = effective_curve(schedule, steps)
    fig = Figure(figsize=(7, 5))
    FigureCanvasAgg(fig)
    ax_w, ax_d = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    if isinstance(schedule, ScheduleHistory) and len(schedule.versions) > 1:
        for v in schedule.versions:
            ax_w.plot(xs, [v.schedule.weight(t) for t in xs], "--", lw=0.8, alpha=0.6, label=f"v{v.version}")
            if v.version > 1:
                ax_w.axvline(v.effective_from, color="grey", lw=0.6, ls=":")
    ax_w.plot(xs, weights, color="black", lw=1.8, label="w(t) in force")
    if current_step is not None:
        ax_w.axvline(current_step, color="red", lw=1.0, label=f"step {current_step}")
    ax_w.set_ylabel("process weight w(t)")
    ax_w.legend(fontsize=7, loc="best")
    ax_w.set_title(title or "process-reward schedule")
    ax_d.plot(xs, densities, color="tab:green")
    ax_d.set_ylim(-0.05, 1.05)
    ax_d.set_ylabel("density(t)")
    ax_d.set_xlabel("training step")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out
