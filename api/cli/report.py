"""A job's report: PNG plots of its metrics and an HTML page that shows them with a few trajectories."""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from rollout_workers.trajectory import Trajectory  # noqa: E402


def _series(metrics: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for m in metrics:
        if key in m and m[key] is not None:
            xs.append(int(m["step"]))
            ys.append(float(m[key]))
    return xs, ys


def _keys(metrics: Sequence[dict[str, Any]], prefix: str, suffix: str = "") -> list[str]:
    found = {k for m in metrics for k in m if k.startswith(prefix) and k.endswith(suffix)}
    return sorted(found)


def _plot(path: Path, title: str, lines: list[tuple[str, list[int], list[float]]], ylabel: str,
          vlines: Sequence[tuple[int, str]] = ()) -> Path | None:
    lines = [ln for ln in lines if ln[1]]
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for label, xs, ys in lines:
        ax.plot(xs, ys, label=label, marker="." if len(xs) < 40 else None)
    for x, label in vlines:
        ax.axvline(x, color="grey", linestyle="--", linewidth=1)
        ax.annotate(label, (x, ax.get_ylim()[1]), fontsize=8, rotation=90, va="top", ha="right")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render_plots(metrics: Sequence[dict[str, Any]], out_dir: Path,
                 schedule_changes: Sequence[tuple[int, str]] = ()) -> dict[str, Path]:
    """Plot reward components (raw and weighted), the schedule weight with its versions, success rate
    and the time split per step. Returns name -> PNG path for the plots that had data."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots: dict[str, Path | None] = {}
    raw = [(k.removeprefix("reward/process/").removesuffix("/raw"), *_series(metrics, k))
           for k in _keys(metrics, "reward/process/", "/raw")]
    weighted = [(k.removeprefix("reward/process/").removesuffix("/weighted") + " (weighted)", *_series(metrics, k))
                for k in _keys(metrics, "reward/process/", "/weighted")]
    outcome = [("outcome", *_series(metrics, "reward/outcome_mean"))]
    plots["rewards"] = _plot(out_dir / "rewards.png", "Reward components: raw and weighted",
                             outcome + raw + weighted, "mean reward", schedule_changes)
    plots["schedule"] = _plot(out_dir / "schedule.png", "Process-reward weight w(t) and schedule versions",
                              [("w(t)", *_series(metrics, "schedule/weight"))], "weight", schedule_changes)
    plots["success"] = _plot(out_dir / "success.png", "Success rate",
                             [("train", *_series(metrics, "success_rate")),
                              ("held-out (greedy)", *_series(metrics, "eval/success_rate"))], "success rate")
    plots["time"] = _plot(out_dir / "time_split.png", "Time per step",
                          [(k.removeprefix("time/"), *_series(metrics, k)) for k in _keys(metrics, "time/")],
                          "seconds")
    return {k: v for k, v in plots.items() if v is not None}


def _trajectory_html(traj: Trajectory) -> str:
    parts = [f"<div class='traj'><div class='meta'>task {html.escape(traj.task_id)} · status {traj.status} · "
             f"outcome {traj.outcome_reward}</div><pre>"]
    parts.append(f"<span class='prompt'>{html.escape(traj.prompt_text[-400:])}</span>")
    for step in traj.steps:
        rewards = ", ".join(f"{k}={v:.2f}" for k, v in step.process_rewards.items())
        parts.append(f"<span class='action' title='process: {html.escape(rewards)}'>{html.escape(step.action_text)}</span>")
        if step.observation_text:
            parts.append(f"<span class='obs'>{html.escape(step.observation_text)}</span>")
    parts.append("</pre></div>")
    return "".join(parts)


def render_html(out_dir: Path, title: str, summary: dict[str, Any], plots: dict[str, Path],
                trajectories: Sequence[Trajectory]) -> Path:
    rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in summary.items())
    imgs = "".join(f"<figure><img src='{p.name}' alt='{name}'></figure>" for name, p in plots.items())
    trajs = "".join(_trajectory_html(t) for t in trajectories)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}} table{{border-collapse:collapse}}
th,td{{border:1px solid #ccc;padding:4px 8px;text-align:left}} figure{{display:inline-block;margin:4px}}
img{{max-width:520px}} pre{{white-space:pre-wrap;background:#f7f7f7;padding:8px}}
.action{{background:#dff0d8}} .obs{{background:#fcf8e3}} .prompt{{color:#777}} .meta{{font-weight:bold}}</style>
</head><body><h1>{html.escape(title)}</h1><table>{rows}</table><h2>Curves</h2>{imgs}
<h2>Trajectories</h2><p>Green: tokens the policy sampled (hover for per-step process rewards).
Yellow: tokens the environment inserted.</p>{trajs}</body></html>"""
    path = out_dir / "index.html"
    path.write_text(page)
    return path
