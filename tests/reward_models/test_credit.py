from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reward_models.credit import CreditConfig, compute_advantages


def grpo_reference(outcomes: list[float], groups: list[str], scale: str = "group") -> list[float]:
    """Outcome-only GRPO, written the way TRL's trainer does it (torch, Bessel-corrected std, eps 1e-4)."""
    r = torch.tensor(outcomes, dtype=torch.float64)
    out = torch.zeros_like(r)
    batch_std = r.std() if r.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
    for g in dict.fromkeys(groups):
        idx = torch.tensor([i for i, x in enumerate(groups) if x == g])
        rg = r[idx]
        std = rg.std() if rg.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
        a = rg - rg.mean()
        if scale == "group":
            a = a / (std + 1e-4)
        elif scale == "batch":
            a = a / (batch_std + 1e-4)
        out[idx] = a
    return out.tolist()


def random_batch(b: Any, rng: random.Random, n_groups: int = 3, size: int = 4, zero_groups: int = 0) -> list:
    trajs = []
    for g in range(n_groups):
        for _ in range(size):
            steps = []
            for k in range(rng.randint(1, 4)):
                proc = (
                    {"format": rng.choice([0.0, 1.0]), "tool_ok": rng.random()} if rng.random() < 0.8 else {}
                )
                steps.append(
                    b.step(n_action=rng.randint(1, 5), n_obs=rng.randint(0, 3), process=proc, start_id=k)
                )
            outcome = 0.0 if g < zero_groups else float(rng.random() < 0.5)
            trajs.append(b.traj(f"g{g}", outcome, steps))
    return trajs


def step_slices(traj: Any) -> list[tuple[slice, slice]]:
    """Per step, (action token slice, observation token slice) in completion coordinates."""
    out, pos = [], 0
    for s in traj.steps:
        a = slice(pos, pos + len(s.action_ids))
        o = slice(a.stop, a.stop + len(s.observation_ids))
        out.append((a, o))
        pos = o.stop
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_w_zero_is_exactly_outcome_only_grpo(b: Any, scale: str) -> None:
    trajs = random_batch(b, random.Random(0), n_groups=4, size=5)
    cfg = CreditConfig(scale_rewards=scale)
    got = compute_advantages(trajs, 0.0, cfg)
    stripped = [t.model_copy(deep=True) for t in trajs]
    for t in stripped:
        for s in t.steps:
            s.process_rewards = {}
    outcome_only = compute_advantages(stripped, 0.7, cfg)  # no process rewards at all: w is irrelevant
    assert got.advantages == outcome_only.advantages  # bitwise
    ref = grpo_reference([t.outcome_reward for t in trajs], [t.group_id for t in trajs], scale)
    for t, adv, r in zip(trajs, got.advantages, ref, strict=True):
        mask = t.loss_mask()
        assert len(adv) == len(t.completion_ids())
        for a, m in zip(adv, mask, strict=True):
            assert a == (pytest.approx(r, rel=1e-12, abs=1e-12) if m else 0.0)


def test_process_part_scales_with_w_even_where_every_outcome_is_zero(b: Any) -> None:
    trajs = random_batch(b, random.Random(1), n_groups=3, size=4, zero_groups=3)
    assert all(t.outcome_reward == 0.0 for t in trajs)
    base = compute_advantages(trajs, 0.0)
    assert all(a == 0.0 for adv in base.advantages for a in adv)
    a1 = compute_advantages(trajs, 0.1)
    a2 = compute_advantages(trajs, 0.4)
    assert a1.stats["zero_variance_groups"] == 3
    flat1 = np.concatenate([np.array(x) for x in a1.advantages])
    flat2 = np.concatenate([np.array(x) for x in a2.advantages])
    assert np.abs(flat1).max() > 0
    np.testing.assert_allclose(flat2, 4.0 * flat1, rtol=1e-12, atol=1e-15)


def test_summed_baseline_lets_the_group_std_cancel_w(b: Any) -> None:
    """The documented failure of the naive variant: in all-zero-outcome groups w has no effect on size."""
    trajs = random_batch(b, random.Random(2), n_groups=3, size=4, zero_groups=3)
    small = compute_advantages(trajs, 0.1, CreditConfig(mode="summed"))
    big = compute_advantages(trajs, 1.0, CreditConfig(mode="summed"))
    s = np.abs(np.array(small.outcome_advantages))
    g = np.abs(np.array(big.outcome_advantages))
    assert s.max() > 0.5 and np.allclose(s, g, rtol=0.01)
    # and the sequence-level advantage lands on every action token, final answer turn included
    for t, adv, a in zip(small.trajectories, small.advantages, small.outcome_advantages, strict=True):
        assert all(x == a for x, m in zip(adv, t.loss_mask(), strict=True) if m)


def test_outcome_on_every_action_token_process_on_its_own_step_nothing_on_inserted(b: Any) -> None:
    rng = random.Random(3)
    trajs = random_batch(b, rng, n_groups=3, size=4)
    w = 0.5
    batch = compute_advantages(trajs, w)
    for t, adv, a_o, a_p in zip(
        batch.trajectories, batch.advantages, batch.outcome_advantages, batch.process_advantages, strict=True
    ):
        for k, (act, obs) in enumerate(step_slices(t)):
            assert adv[act] == [a_o + w * a_p[k]] * (act.stop - act.start)
            assert adv[obs] == [0.0] * (obs.stop - obs.start)
            if not t.steps[k].process_rewards:
                assert a_p[k] == 0.0  # no process node: no process credit on this step
    # the process part of step k's tokens is exactly that step's A_p: perturbing one step's process
    # rewards changes advantages only on that step's tokens (and the baselines of that step index)
    t0 = trajs[0]
    k = next(i for i, s in enumerate(t0.steps) if s.process_rewards)
    before = compute_advantages(trajs, w).advantages[0]
    t0.steps[k].process_rewards = {c: 1.0 - v for c, v in t0.steps[k].process_rewards.items()}
    after = compute_advantages(trajs, w).advantages[0]
    for j, (act, _) in enumerate(step_slices(t0)):
        if j != k and not t0.steps[j].process_rewards:
            assert after[act] == before[act]


def test_process_baseline_is_per_component_per_step_index_with_batch_scale(b: Any) -> None:
    # two trajectories in different groups, two steps each, one component
    t1 = b.traj("g1", 1.0, [b.step(process={"format": 1.0}), b.step(process={"format": 0.0})])
    t2 = b.traj("g2", 0.0, [b.step(process={"format": 0.0}), b.step(process={"format": 0.0})])
    cfg = CreditConfig(process_scale="fixed", fixed_scale=2.0)
    batch = compute_advantages([t1, t2], 1.0, cfg)
    # step 0 baseline 0.5, step 1 baseline 0.0; fixed scale 2
    assert batch.process_advantages == [[0.25, 0.0], [-0.25, 0.0]]
    # batch scale: RMS of centred values over the whole batch = sqrt((0.25+0.25+0+0)/4)
    batch = compute_advantages([t1, t2], 1.0, CreditConfig())
    s = math.sqrt(0.5 / 4) + 1e-4
    np.testing.assert_allclose(batch.process_advantages, [[0.5 / s, 0.0], [-0.5 / s, 0.0]], rtol=1e-12)
    assert batch.stats["process/format/raw"] == 0.25 and batch.stats["process/format/weighted"] == 0.25


def test_returns_to_go(b: Any) -> None:
    trajs = random_batch(b, random.Random(4), n_groups=2, size=3)
    step_only = compute_advantages(trajs, 1.0, CreditConfig(gamma=None)).process_advantages
    rtg = compute_advantages(trajs, 1.0, CreditConfig(gamma=0.9)).process_advantages
    for s, r in zip(step_only, rtg, strict=True):
        expected = [sum(0.9 ** (j - k) * s[j] for j in range(k, len(s))) for k in range(len(s))]
        assert r == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_infra_failures_dropped_and_zero_variance_groups_counted(b: Any) -> None:
    ok = [b.traj("g1", 1.0), b.traj("g1", 0.0), b.traj("g2", 1.0), b.traj("g2", 1.0), b.traj("g3", 0.0)]
    bad = [
        b.traj("g1", None, status=b.Status.ENV_ERROR),
        b.traj("g1", None, status=b.Status.TOOL_TIMEOUT),
        b.traj("g3", None),  # missing outcome
    ]
    batch = compute_advantages(ok + bad, 0.5)
    assert batch.trajectories == ok
    assert set(batch.excluded_ids) == {t.id for t in bad}
    assert batch.stats["num_excluded"] == 3 and batch.stats["num_groups"] == 3
    assert batch.stats["zero_variance_groups"] == 2  # g2 (all 1) and g3 (one sample)
    assert batch.outcome_advantages[0] > 0 > batch.outcome_advantages[1]
    assert batch.outcome_advantages[2:] == [0.0, 0.0, 0.0]


def test_density_drops_nodes_from_baseline_and_credit(b: Any) -> None:
    trajs = random_batch(b, random.Random(5), n_groups=3, size=4)
    dropped = {(trajs[0].id, 0), (trajs[1].id, 1)}
    batch = compute_advantages(trajs, 1.0, keep_node=lambda tid, k: (tid, k) not in dropped)
    assert batch.process_advantages[0][0] == 0.0
    if len(trajs[1].steps) > 1:
        assert batch.process_advantages[1][1] == 0.0
    with_all = compute_advantages(trajs, 1.0)
    assert batch.stats["nodes_kept"] < with_all.stats["nodes_kept"] == with_all.stats["nodes_total"]


def test_component_weights_select_components(b: Any) -> None:
    t1 = b.traj("g1", 0.0, [b.step(process={"format": 1.0, "tool_ok": 0.0})])
    t2 = b.traj("g1", 0.0, [b.step(process={"format": 0.0, "tool_ok": 0.0})])
    only_ok = compute_advantages([t1, t2], 1.0, CreditConfig(component_weights={"tool_ok": 1.0}))
    assert only_ok.process_advantages == [[0.0], [0.0]]
    only_fmt = compute_advantages([t1, t2], 1.0, CreditConfig(component_weights={"format": 1.0}))
    assert only_fmt.process_advantages[0][0] > 0 > only_fmt.process_advantages[1][0]


def test_bad_input_is_rejected_with_the_field_named(b: Any) -> None:
    with pytest.raises(ValueError, match="process_weight"):
        compute_advantages([b.traj("g", 1.0)], float("nan"))
    with pytest.raises(ValueError, match="gamma"):
        CreditConfig(gamma=1.5)
    with pytest.raises(ValueError, match="scale_rewards"):
        CreditConfig(scale_rewards="std")


def test_from_algorithm_spec() -> None:
    from rl_service.spec import AlgorithmSpec

    cfg = CreditConfig.from_algorithm(
        AlgorithmSpec(credit_assignment="summed", scale_rewards="none", gamma=0.5)
    )
    assert (cfg.mode, cfg.scale_rewards, cfg.gamma, cfg.process_scale) == ("summed", "none", 0.5, "batch")


rewards = st.floats(0.0, 1.0, allow_nan=False, allow_subnormal=False)


@settings(max_examples=80, deadline=None)
@given(
    groups=st.lists(st.lists(rewards, min_size=1, max_size=6), min_size=1, max_size=5),
    process=st.lists(st.lists(rewards, min_size=0, max_size=3), min_size=30, max_size=30),
    w=st.floats(0.0, 10.0, allow_subnormal=False),
    scale=st.sampled_from(["group", "batch", "none"]),
    gamma=st.none() | st.floats(0.0, 1.0, allow_subnormal=False),
)
def test_property_finite_and_group_normalised(
    b: Any, groups: list[list[float]], process: list[list[float]], w: float, scale: str, gamma: float | None
) -> None:
    trajs, i = [], 0
    for g, outcomes in enumerate(groups):
        for r in outcomes:
            ps = process[i % len(process)]
            i += 1
            steps = [b.step(n_action=2, n_obs=1, process={"c": p}) for p in ps] or [b.step()]
            trajs.append(b.traj(f"g{g}", r, steps))
    batch = compute_advantages(trajs, w, CreditConfig(scale_rewards=scale, gamma=gamma))
    assert all(math.isfinite(a) for adv in batch.advantages for a in adv)
    assert all(math.isfinite(a) for pa in batch.process_advantages for a in pa)
    a_o = np.array(batch.outcome_advantages)
    start = 0
    for outcomes in groups:
        part = a_o[start : start + len(outcomes)]
        start += len(outcomes)
        assert abs(part.sum()) < 1e-9 * max(1.0, np.abs(part).max()) + 1e-12  # centred within its group
        if scale == "group" and len(part) > 1:
            assert np.std(part, ddof=1) <= 1.0 + 1e-9
    # process advantages are centred per step index over the batch
    by_index: dict[int, list[float]] = {}
    for pa in batch.process_advantages:
        for k, a in enumerate(pa):
            if gamma is None:
                by_index.setdefault(k, []).append(a)
    for vals in by_index.values():
        assert abs(sum(vals)) < 1e-6 * max(1.0, max(abs(v) for v in vals))


def test_schedule_density_drives_node_sampling_in_credit(b: Any) -> None:
    import functools

    from reward_models.schedule import RewardSchedule

    schedule = RewardSchedule(density_start=1.0, density_end=0.0, horizon=100, seed=3)
    trajs = random_batch(b, random.Random(6), n_groups=20, size=8)
    for t, expected in ((0, 1.0), (50, 0.5), (100, 0.0)):
        batch = compute_advantages(
            trajs, schedule.weight(t), keep_node=functools.partial(schedule.keep_node, t)
        )
        total, kept = batch.stats["nodes_total"], batch.stats["nodes_kept"]
        assert abs(kept / total - expected) <= 4 * math.sqrt(0.25 / total) + 1e-12
        if expected == 0.0:
            assert all(a == 0.0 for pa in batch.process_advantages for a in pa)


def test_decoupled_is_the_default_and_summed_only_by_its_name() -> None:
    from rl_service.spec import AlgorithmSpec

    assert CreditConfig().mode == "decoupled"
    assert CreditConfig.from_algorithm(AlgorithmSpec()).mode == "decoupled"
    with pytest.raises(ValueError, match="mode"):
        CreditConfig(mode="sum")


def test_a_step_process_reward_moves_only_the_tokens_of_its_own_step_index(b: Any) -> None:
    """With a fixed scale the only coupling between nodes is the baseline of their step index: changing one
    node's process reward changes the advantages of step-index k tokens only, never observations or
    other steps, and leaves every outcome advantage alone."""
    rng = random.Random(7)
    trajs = random_batch(b, rng, n_groups=3, size=4)
    cfg = CreditConfig(process_scale="fixed", fixed_scale=1.0)
    t0 = next(t for t in trajs if any(s.process_rewards for s in t.steps))
    k = next(i for i, s in enumerate(t0.steps) if s.process_rewards)
    before = compute_advantages(trajs, 0.7, cfg)
    t0.steps[k].process_rewards = {
        c: 1.0 - v if v != 0.5 else 0.0 for c, v in t0.steps[k].process_rewards.items()
    }
    after = compute_advantages(trajs, 0.7, cfg)
    assert after.outcome_advantages == before.outcome_advantages
    changed = False
    for t, adv_b, adv_a in zip(trajs, before.advantages, after.advantages, strict=True):
        for j, (act, obs) in enumerate(step_slices(t)):
            assert adv_a[obs] == adv_b[obs] == [0.0] * (obs.stop - obs.start)
            if j != k or not t.steps[j].process_rewards:
                assert adv_a[act] == adv_b[act], (t.id, j)
            elif t is t0:
                changed |= adv_a[act] != adv_b[act]
    assert changed


finite_rewards = st.floats(-1e4, 1e4, allow_nan=False, allow_subnormal=False)


@settings(max_examples=80, deadline=None)
@given(
    groups=st.lists(st.lists(finite_rewards, min_size=1, max_size=6), min_size=1, max_size=5),
    scale=st.sampled_from(["group", "batch", "none"]),
)
def test_property_w_zero_matches_the_grpo_reference_for_arbitrary_outcomes(
    b: Any, groups: list[list[float]], scale: str
) -> None:
    trajs = [
        b.traj(f"g{g}", r, [b.step(process={"c": 0.5 + 0.5 * math.sin(i)})])
        for g, outcomes in enumerate(groups)
        for i, r in enumerate(outcomes)
    ]
    batch = compute_advantages(trajs, 0.0, CreditConfig(scale_rewards=scale))
    ref = grpo_reference([t.outcome_reward for t in trajs], [t.group_id for t in trajs], scale)
    # float64 on both sides; the slack covers a mean of equal values that is off by an ulp, divided by eps
    np.testing.assert_allclose(batch.outcome_advantages, ref, rtol=1e-9, atol=1e-6)
    assert all(math.isfinite(a) for adv in batch.advantages for a in adv)
    for adv, t, a in zip(batch.advantages, trajs, batch.outcome_advantages, strict=True):
        assert adv == [a if m else 0.0 for m in t.loss_mask()]
