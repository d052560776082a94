"""Trajectory storage: append-only JSONL per job (one file per training step is the convention), read
back into the same `Trajectory` objects, and a text rendering for people.

JSONL because readers (the API's paged listing, a person with `jq`/`grep`) want one self-contained
record per line, and appends are atomic enough: a crash can only leave a partial LAST line, which
the reader skips.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from rollout_workers.trajectory import Trajectory, TrajectoryStatus


def step_file(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}.jsonl"


class TrajectoryWriter:
    """Appends trajectories to one JSONL file (created with its parent directories)."""

    def __init__(self, path: str | Path, fsync: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._fsync = fsync
        self._lock = threading.Lock()

    def write(self, trajectories: Trajectory | Iterable[Trajectory]) -> int:
        items = [trajectories] if isinstance(trajectories, Trajectory) else list(trajectories)
        lines = "".join(t.model_dump_json() + "\n" for t in items)
        with self._lock:
            self._file.write(lines)
            self._file.flush()
            if self._fsync:
                os.fsync(self._file.fileno())
        return len(items)

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()

    def __enter__(self) -> TrajectoryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_trajectories(path: str | Path) -> Iterator[Trajectory]:
    """Every trajectory in a file, or in all *.jsonl files of a directory (sorted by name)."""
    path = Path(path)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    for f in files:
        with open(f, encoding="utf-8") as fh:
            for line in fh:
                if not line.endswith("\n"):  # a partial last line from an interrupted append
                    break
                line = line.strip()
                if line:
                    yield Trajectory.model_validate(json.loads(line))


def read_trajectories(
    path: str | Path,
    status: str | TrajectoryStatus | None = None,
    min_reward: float | None = None,
    max_reward: float | None = None,
    step: int | None = None,
    offset: int = 0,
    limit: int = 50,
) -> list[Trajectory]:
    """Filtered page of trajectories. Reward filters drop unscored trajectories; `step` matches
    `train_step`."""
    if offset < 0:
        raise ValueError("offset: must be >= 0")
    if limit < 0:
        raise ValueError("limit: must be >= 0")
    wanted = TrajectoryStatus(status) if status is not None else None
    path = Path(path)
    source: Path = path
    if step is not None and path.is_dir() and step_file(path, step).exists():
        source = step_file(path, step)  # fast path for the one-file-per-step layout
    out: list[Trajectory] = []
    skipped = 0
    for t in iter_trajectories(source) if source.exists() else ():
        if wanted is not None and t.status != wanted:
            continue
        if step is not None and t.train_step != step:
            continue
        if min_reward is not None and (t.outcome_reward is None or t.outcome_reward < min_reward):
            continue
        if max_reward is not None and (t.outcome_reward is None or t.outcome_reward > max_reward):
            continue
        if skipped < offset:
            skipped += 1
            continue
        if len(out) >= limit:
            break
        out.append(t)
    return out


def render_text(traj: Trajectory) -> str:
    """The conversation as text, with what the policy wrote and what tools answered marked."""
    lines = [
        f"# trajectory {traj.id}  env={traj.env}  task={traj.task_id}  group={traj.group_id}",
        f"# status={traj.status.value}  outcome_reward={traj.outcome_reward}  train_step={traj.train_step}"
        + (f"  error={traj.error}" if traj.error else ""),
        "",
        "=== prompt ===",
        traj.prompt_text,
    ]
    for i, s in enumerate(traj.steps):
        rewards = "  ".join(f"{k}={v:.2f}" for k, v in sorted(s.process_rewards.items()))
        lines.append(
            f"=== step {i}  policy v{s.weight_version}  {len(s.action_ids)} sampled tokens"
            f"  finish={s.finish_reason}{'  FINAL' if s.is_final else ''}{'  ' + rewards if rewards else ''} ==="
        )
        lines.append(f"[[policy]]{s.action_text}[[/policy]]")
        for c in s.tool_calls:
            what = f"{c.name}({json.dumps(c.arguments)})" if c.name else repr(c.raw[:80])
            if c.error:
                lines.append(f"[[tool error: {c.error_kind}]] {what}: {c.error}")
            else:
                lines.append(f"[[tool {c.latency_s * 1000:.1f} ms]] {what} -> {c.result}")
        if s.observation_ids:
            lines.append(f"[[inserted {len(s.observation_ids)} tokens]]{s.observation_text}[[/inserted]]")
    return "\n".join(lines)
