"""Credit assignment: token-level advantages from outcome and process rewards (docs/design.md section 6).

``decoupled`` (the default) keeps the two signals apart until the end, so that `w` really sets the mix:

- outcome advantage ``A_o = r - mean_group(r)``, divided by ``std + eps`` of the group (``scale_rewards =
  "group"``), of the whole batch (``"batch"``) or not at all (``"none"``), exactly as TRL's GRPO (unbiased
  std, eps 1e-4); it goes on every model-written (mask-1) token of the trajectory;
- process advantage, per node (trajectory step) and component c: ``(p_c - b_c[k]) / s_c`` where ``b_c[k]``
  is the mean of component c over the batch's nodes at the same step index k, and ``s_c`` is a batch-wide
  scale (the RMS of c's centred values over the whole batch, ``process_scale = "batch"``) or a fixed one;
  never the group's std. A node's process advantage ``A_p`` is the weighted mean of its components'; with
  ``gamma`` set it becomes the discounted return-to-go over the following steps. It goes on the mask-1
  tokens of the step it judges only;
- token advantage ``A = A_o + w * A_p``; mask-0 (inserted) tokens get 0. With ``w = 0`` this is exactly
  outcome-only GRPO.

``summed`` is the naive baseline kept for the curriculum benchmark, never the default: the trajectory's
mean process reward times `w` is added to the outcome *before* group normalisation, and the one
sequence-level advantage goes on every mask-1 token.

Trajectories that are infrastructure failures (or whose outcome is missing) are dropped, and groups
whose outcomes have zero variance are counted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from rollout_workers.trajectory import Trajectory

KeepNode = Callable[[str, int], bool]  # (trajectory id, step index) -> keep this process node?


class CreditConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["decoupled", "summed"] = "decoupled"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    process_scale: Literal["batch", "fixed"] = "batch"
    fixed_scale: float = Field(
        1.0, gt=0.0, allow_inf_nan=False, description="Divisor when process_scale='fixed'."
    )
    gamma: float | None = Field(
        None, ge=0.0, le=1.0, description="Discount of process returns-to-go; None = step only."
    )
    component_weights: dict[str, float] | None = Field(
        None, description="Relative weight per process component (absent components: 0); None = all equal."
    )
    eps: float = Field(1e-4, gt=0.0, allow_inf_nan=False)
    success_threshold: float = Field(
        0.5, ge=0.0, le=1.0, description="Outcome at or above this counts as a success."
    )

    @classmethod
    def from_algorithm(cls, algorithm: Any, **overrides: Any) -> CreditConfig:
        """From a job spec's AlgorithmSpec (credit_assignment, scale_rewards, process_scale, gamma)."""
        data = {
            "mode": algorithm.credit_assignment,
            "scale_rewards": algorithm.scale_rewards,
            "process_scale": algorithm.process_scale,
            "gamma": algorithm.gamma,
        }
        data.update(overrides)
        return cls(**data)


@dataclass
class AdvantageBatch:
    """Advantages of the trajectories kept for training (input order, excluded ones left out)."""

    trajectories: list[Trajectory]
    advantages: list[list[float]]  # per trajectory, aligned with Trajectory.completion_ids()
    outcome_advantages: list[float]  # A_o per trajectory (summed mode: the combined sequence advantage)
    process_advantages: list[list[float]]  # per trajectory, per step: A_p before multiplying by w
    excluded_ids: list[str]
    stats: dict[str, float] = field(default_factory=dict)


def _std(x: np.ndarray) -> float:
    """Unbiased standard deviation (TRL's nanstd); 0 for fewer than two values."""
    return float(np.std(x, ddof=1)) if x.size > 1 else 0.0


def group_advantages(
    rewards: Sequence[float], group_ids: Sequence[str], scale_rewards: str, eps: float
) -> tuple[np.ndarray, int, int]:
    """GRPO advantages of sequence rewards; also (number of groups, number with zero variance)."""
    r = np.asarray(rewards, dtype=np.float64)
    adv = np.zeros_like(r)
    index: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        index.setdefault(g, []).append(i)
    batch_std = _std(r)
    zero_var = 0
    for members in index.values():
        rg = r[members]
        std = _std(rg)
        zero_var += bool(np.all(rg == rg[0]))
        centred = rg - rg.mean()
        if scale_rewards == "group":
            centred = centred / (std + eps)
        elif scale_rewards == "batch":
            centred = centred / (batch_std + eps)
        elif scale_rewards != "none":
            raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none' (got {scale_rewards!r})")
        adv[members] = centred
    return adv, len(index), zero_var


def _component_weight(config: CreditConfig, name: str) -> float:
    if config.component_weights is None:
        return 1.0
    return float(config.component_weights.get(name, 0.0))


def _kept_nodes(
    trajs: Sequence[Trajectory], keep_node: KeepNode | None
) -> tuple[list[list[dict[str, float]]], int, int]:
    """Per trajectory and step, the process rewards of kept nodes ({} for dropped ones)."""
    out: list[list[dict[str, float]]] = []
    total = kept = 0
    for t in trajs:
        rows: list[dict[str, float]] = []
        for k, step in enumerate(t.steps):
            if not step.process_rewards:
                rows.append({})
                continue
            total += 1
            if keep_node is None or keep_node(t.id, k):
                kept += 1
                rows.append(dict(step.process_rewards))
            else:
                rows.append({})
        out.append(rows)
    return out, total, kept


def _node_mean(rewards: dict[str, float], config: CreditConfig) -> float | None:
    pairs = [(_component_weight(config, c), v) for c, v in rewards.items()]
    wsum = sum(w for w, _ in pairs if w > 0)
    if wsum == 0:
        return None
    return sum(w * v for w, v in pairs if w > 0) / wsum


def process_step_advantages(
    nodes: list[list[dict[str, float]]], config: CreditConfig
) -> tuple[list[list[float]], dict[str, float]]:
    """Per trajectory and step, A_p (centred per component and step index, batch-wide scale, optional RTG)."""
    # baseline b_c[k]
    sums: dict[tuple[str, int], list[float]] = {}
    for rows in nodes:
        for k, rewards in enumerate(rows):
            for c, v in rewards.items():
                if _component_weight(config, c) > 0:
                    sums.setdefault((c, k), []).append(v)
    baseline = {key: float(np.mean(vals)) for key, vals in sums.items()}
    centred_sq: dict[str, list[float]] = {}
    for (c, k), vals in sums.items():
        centred_sq.setdefault(c, []).extend((v - baseline[(c, k)]) ** 2 for v in vals)
    if config.process_scale == "batch":
        scale = {c: math.sqrt(float(np.mean(sq))) + config.eps for c, sq in centred_sq.items()}
    else:
        scale = {c: config.fixed_scale for c in centred_sq}

    out: list[list[float]] = []
    for rows in nodes:
        per_step: list[float] = []
        for k, rewards in enumerate(rows):
            num = den = 0.0
            for c, v in rewards.items():
                lam = _component_weight(config, c)
                if lam > 0:
                    num += lam * (v - baseline[(c, k)]) / scale[c]
                    den += lam
            per_step.append(num / den if den > 0 else 0.0)
        if config.gamma is not None:
            running = 0.0
            for k in range(len(per_step) - 1, -1, -1):
                running = per_step[k] + config.gamma * running
                per_step[k] = running
        out.append(per_step)
    stats = {f"process/{c}/scale": s for c, s in scale.items()}
    return out, stats


def _token_advantages(
    traj: Trajectory, outcome_adv: float, step_adv: Sequence[float], w: float
) -> list[float]:
    out: list[float] = []
    for step, a_p in zip(traj.steps, step_adv, strict=True):
        out += [outcome_adv + w * a_p] * len(step.action_ids)
        out += [0.0] * len(step.observation_ids)
    return out


def compute_advantages(
    trajectories: Sequence[Trajectory],
    process_weight: float,
    config: CreditConfig | None = None,
    keep_node: KeepNode | None = None,
) -> AdvantageBatch:
    """Token advantages for one training batch (see the module docstring).

    `process_weight` is the schedule's w(t) for this step; `keep_node(traj_id, step_index)` the schedule's
    density sampling for this step (e.g. ``functools.partial(schedule.keep_node, t)``); None keeps all nodes.
    Trajectories must already be scored (reward_models.scoring).
    """
    config = config or CreditConfig()
    if not math.isfinite(process_weight):
        raise ValueError(f"process_weight must be a finite number (got {process_weight})")
    included = [t for t in trajectories if not t.excluded]
    excluded_ids = [t.id for t in trajectories if t.excluded]
    for t in included:
        assert t.outcome_reward is not None
        if not math.isfinite(t.outcome_reward):
            raise ValueError(f"outcome_reward of trajectory {t.id} must be finite (got {t.outcome_reward})")

    outcomes = [float(t.outcome_reward) for t in included]  # type: ignore[arg-type]
    groups = [t.group_id for t in included]
    nodes, nodes_total, nodes_kept = _kept_nodes(included, keep_node)

    raw_by_component: dict[str, list[float]] = {}
    node_means: list[float] = []
    traj_process: list[float] = []
    for rows in nodes:
        means = []
        for rewards in rows:
            for c, v in rewards.items():
                raw_by_component.setdefault(c, []).append(v)
            m = _node_mean(rewards, config) if rewards else None
            if m is not None:
                means.append(m)
        node_means += means
        traj_process.append(float(np.mean(means)) if means else 0.0)

    w = float(process_weight)
    extra: dict[str, float] = {}
    a_o, num_groups, zero_var = group_advantages(outcomes, groups, config.scale_rewards, config.eps)
    if config.mode == "decoupled":
        step_adv, extra = process_step_advantages(nodes, config)
    else:
        summed = [r + w * p for r, p in zip(outcomes, traj_process, strict=True)]
        a_o, _, _ = group_advantages(summed, groups, config.scale_rewards, config.eps)
        step_adv = [[0.0] * len(t.steps) for t in included]

    advantages = [
        _token_advantages(t, float(a), sa, w) for t, a, sa in zip(included, a_o, step_adv, strict=True)
    ]

    stats: dict[str, float] = {
        "num_trajectories": float(len(trajectories)),
        "num_included": float(len(included)),
        "num_excluded": float(len(excluded_ids)),
        "num_groups": float(num_groups),
        "zero_variance_groups": float(zero_var),
        "zero_variance_fraction": zero_var / num_groups if num_groups else 0.0,
        "outcome_mean": float(np.mean(outcomes)) if outcomes else 0.0,
        "success_rate": float(np.mean([r >= config.success_threshold for r in outcomes]))
        if outcomes
        else 0.0,
        "process_weight": w,
        "nodes_total": float(nodes_total),
        "nodes_kept": float(nodes_kept),
        "process_raw_mean": float(np.mean(node_means)) if node_means else 0.0,
        "process_weighted_mean": w * float(np.mean(node_means)) if node_means else 0.0,
    }
    for c, vals in sorted(raw_by_component.items()):
        stats[f"process/{c}/raw"] = float(np.mean(vals))
        stats[f"process/{c}/weighted"] = w * float(np.mean(vals))
    stats.update(extra)
    tokens = [
        a
        for adv, t in zip(advantages, included, strict=True)
        for a, m in zip(adv, t.loss_mask(), strict=True)
        if m
    ]
    stats["advantage_abs_mean"] = float(np.mean(np.abs(tokens))) if tokens else 0.0
    stats["outcome_advantage_abs_mean"] = float(np.mean(np.abs(a_o))) if len(a_o) else 0.0
    flat_p = [a for sa in step_adv for a in sa]
    stats["process_advantage_abs_mean"] = float(np.mean(np.abs(flat_p))) if flat_p else 0.0

    return AdvantageBatch(
        trajectories=included,
        advantages=advantages,
        outcome_advantages=[float(a) for a in a_o],
        process_advantages=step_adv,
        excluded_ids=excluded_ids,
        stats=stats,
    )
