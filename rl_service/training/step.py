"""One training step as plain functions, in the order the runner calls them:
rollout (the runner's pool) -> `score` -> `assign_credit` -> `learn` -> `push_weights`; `evaluate` for the
held-out tasks. Each takes what it needs as arguments and returns its metrics; the runner keeps the state
(the model, the learner, the schedule history, the monitor) and decides when each runs."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from reward_models.credit import AdvantageBatch, CreditConfig, compute_advantages
from reward_models.schedule import ScheduleHistory
from reward_models.scoring import score_outcome, score_trajectories
from rl_service.training.learner import Learner, PolicySample
from rl_service.training.learner.weight_push import shippable_state_dict
from rollout_workers.storage import TrajectoryWriter, step_file
from rollout_workers.trajectory import Trajectory


class WeightSink(Protocol):
    def push_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> float: ...


def staleness_of(traj: Trajectory, policy_version: int) -> int:
    versions = traj.weight_versions()
    return policy_version - min(versions) if versions else 0


def token_stats(name: str, values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values, dtype=np.float64)
    return {f"{name}/mean": float(a.mean()), f"{name}/std": float(a.std()), f"{name}/min": float(a.min()),
            f"{name}/max": float(a.max())}


def rollout_metrics(trajs: Sequence[Trajectory], rollout_s: float, async_mode: bool) -> dict[str, float]:
    """Tokens sampled, their rate when the rollout was not overlapped with training, and the tool calls."""
    sampled = sum(len(s.action_ids) for tj in trajs for s in tj.steps)
    metrics = {"rollout/sampled_tokens": float(sampled)}
    if rollout_s > 0 and not async_mode:
        metrics["rollout/tokens_per_s"] = sampled / rollout_s
    metrics.update(tool_metrics(trajs))
    return metrics


def tool_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Tool calls of a step's trajectories: how many, their mean latency and error rate."""
    calls = [c for tj in trajs for step in tj.steps for c in step.tool_calls]
    if not calls:
        return {"tools/calls": 0.0}
    return {"tools/calls": float(len(calls)),
            "tools/latency_mean_s": sum(c.latency_s for c in calls) / len(calls),
            "tools/latency_max_s": max(c.latency_s for c in calls),
            "tools/error_rate": sum(c.error is not None for c in calls) / len(calls)}


def score(trajs: Sequence[Trajectory], env: Any) -> None:
    """Process and outcome rewards from the environment, written into each trajectory."""
    score_trajectories(list(trajs), env)


def assign_credit(t: int, trajs: Sequence[Trajectory], history: ScheduleHistory, credit: CreditConfig,
                  max_staleness: int, version_map: dict[int, int]) -> tuple[AdvantageBatch, dict[str, float]]:
    """Token advantages of step `t` with the schedule in force at `t`, never from a trajectory older than
    `max_staleness` versions; returns the batch and the step's reward, schedule and staleness metrics.
    `version_map` maps the history's versions to the control plane's."""
    hist_version, schedule = history.at(t)
    w = schedule.weight(t)
    stale = [tj for tj in trajs if staleness_of(tj, t) > max_staleness]
    fresh = [tj for tj in trajs if staleness_of(tj, t) <= max_staleness]
    batch = compute_advantages(fresh, w, credit, keep_node=functools.partial(history.keep_node, t))
    staleness = [staleness_of(tj, t) for tj in trajs]
    metrics = {
        "schedule/version": float(version_map.get(hist_version, hist_version)),
        "schedule/weight": w,
        "schedule/density": schedule.density(t),
        "staleness/mean": float(np.mean(staleness)) if staleness else 0.0,
        "staleness/max": float(max(staleness, default=0)),
        "staleness/dropped": float(len(stale)),
        "trajectories/num": float(len(trajs)),
        "trajectories/excluded": float(len(batch.excluded_ids)),
        "trajectories/truncated": float(sum(tj.status == "truncated" for tj in trajs)),
        "trajectories/mean_completion_tokens": float(np.mean([len(tj.completion_ids()) for tj in trajs]))
        if trajs else 0.0,
    }
    for key, value in batch.stats.items():
        metrics[f"reward/{key}"] = value
    metrics["success_rate"] = batch.stats.get("success_rate", 0.0)
    return batch, metrics


def save_trajectories(directory: Path, t: int, trajs: Sequence[Trajectory]) -> None:
    with TrajectoryWriter(step_file(directory, t)) as writer:
        writer.write(list(trajs))


def policy_samples(batch: AdvantageBatch) -> tuple[list[PolicySample], dict[str, float]]:
    """The learner's samples (those with model-written tokens) and the statistics of their token advantages."""
    samples = [PolicySample.from_trajectory(tj, adv) for tj, adv in zip(batch.trajectories, batch.advantages,
                                                                         strict=True)]
    samples = [s for s in samples if s.num_action_tokens > 0]
    action_adv = [a for s in samples for a, m in zip(s.advantages, s.loss_mask, strict=True) if m]
    return samples, token_stats("advantages", action_adv)


def learn(samples: list[PolicySample], learner: Learner, model: nn.Module, ranks: Any = None) -> dict[str, float]:
    """One optimizer step on `samples`: on the data-parallel `ranks` when there are some (the driver's `model`
    then takes their weights), else on `learner`. No samples: nothing trains (`learner_skipped`)."""
    if not samples:
        return {"learner_skipped": 1.0}
    if ranks is not None:
        metrics = ranks.step(samples)
        model.load_state_dict(ranks.full_state_dict())
        return metrics
    return learner.step(samples)


def push_weights(pool: WeightSink, model: nn.Module, version: int, bf16: bool) -> dict[str, float]:
    """Send the policy as weight `version` to the rollout engines (in bf16 for GPU engines)."""
    ts = time.perf_counter()
    state = shippable_state_dict(model, torch.bfloat16 if bf16 else None)
    push_s = pool.push_weights(state, version)
    return {"weight_sync_s": push_s, "time/sync": time.perf_counter() - ts}


def evaluate(groups: Sequence[Sequence[Trajectory]], env: Any, success_threshold: float) -> dict[str, float]:
    """Outcome success rate and mean of greedy rollouts on held-out tasks (infrastructure failures left out)."""
    outcomes = []
    for g in groups:
        for tj in g:
            score_outcome(tj, env)
            if not tj.excluded:
                outcomes.append(float(tj.outcome_reward))
    success = float(np.mean([o >= success_threshold for o in outcomes])) if outcomes else 0.0
    return {"eval/success_rate": success, "eval/outcome_mean": float(np.mean(outcomes)) if outcomes else 0.0,
            "eval/num": float(len(outcomes))}


class Rollouts:
    """The rollout stage: step t's groups from the pool. With `ahead` (async mode), step t+1's rollouts are
    submitted as soon as step t's are in, so they run while t trains; a resumed run draws their tasks again, so
    a checkpoint keeps the data cursor from before that draw (`saved_cursor`)."""

    def __init__(self, pool: Any, draw_tasks: Callable[[], list[dict[str, Any]]],
                 cursor_state: Callable[[], dict[str, int]], *, n: int, sampling: Any, job_id: str,
                 wait: Callable[[Any], Any], ahead: bool, total_steps: int) -> None:
        self.pool, self.draw_tasks, self.cursor_state = pool, draw_tasks, cursor_state
        self.n, self.sampling, self.job_id, self.wait = n, sampling, job_id, wait
        self.ahead, self.total_steps = ahead, total_steps
        self._pending: Any = None
        self._cursor_before_pending: dict[str, int] | None = None

    def _submit(self, t: int) -> Any:
        return self.pool.submit(self.draw_tasks(), self.n, self.sampling, train_step=t, job_id=self.job_id)

    def saved_cursor(self) -> dict[str, int] | None:
        """The cursor a checkpoint keeps instead of the current one; None: the current one."""
        return self._cursor_before_pending if self._pending is not None else None

    def collect(self, t: int) -> tuple[list[list[Trajectory]], dict[str, float]]:
        """Step t's groups, and the time spent waiting for them."""
        t0 = time.perf_counter()
        if not self.ahead:
            groups = self.wait(self._submit(t))
            return groups, {"time/rollout": time.perf_counter() - t0, "time/idle": 0.0}
        groups = self.wait(self._pending if self._pending is not None else self._submit(t))
        idle = time.perf_counter() - t0
        self._pending = None
        if t + 1 < self.total_steps:
            self._cursor_before_pending = self.cursor_state()
            self._pending = self._submit(t + 1)
        return groups, {"time/idle": idle, "time/rollout": idle}
