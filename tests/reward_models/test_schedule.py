from __future__ import annotations

import functools
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from reward_models.schedule import RewardSchedule, ScheduleHistory, SchedulePatch


def test_default_is_linear_one_to_zero() -> None:
    s = RewardSchedule()
    assert (s.kind, s.weight(0), s.weight(50), s.weight(100), s.weight(1000)) == (
        "linear",
        1.0,
        0.5,
        0.0,
        0.0,
    )


@pytest.mark.parametrize("t", [0, 3, 10, 17, 25, 40, 60, 200])
def test_kinds_match_closed_forms(t: int) -> None:
    a, b, warmup, horizon = 0.8, 0.1, 10, 30
    p = min(max((t - warmup) / horizon, 0.0), 1.0)
    cases = [
        (RewardSchedule(kind="constant", w_start=a, w_end=b), a),
        (RewardSchedule(kind="linear", w_start=a, w_end=b, warmup=warmup, horizon=horizon), a + (b - a) * p),
        (
            RewardSchedule(kind="cosine", w_start=a, w_end=b, warmup=warmup, horizon=horizon),
            b + (a - b) * (1 + math.cos(math.pi * p)) / 2,
        ),
        (
            RewardSchedule(kind="exponential", w_start=a, w_end=b, warmup=warmup, half_life=7),
            b + (a - b) * 2 ** (-max(t - warmup, 0) / 7),
        ),
        (
            RewardSchedule(kind="step", w_start=a, w_end=b, milestones=[10, 25, 40]),
            a + (b - a) * sum(t >= m for m in (10, 25, 40)) / 3,
        ),
    ]
    for sched, expected in cases:
        assert sched.weight(t) == pytest.approx(expected, rel=1e-12, abs=1e-15), sched.kind


def test_piecewise_interpolates_and_is_flat_outside() -> None:
    s = RewardSchedule(kind="piecewise", points=[(10, 0.2), (20, 1.0), (40, 0.0)])
    assert s.weight(0) == 0.2 and s.weight(10) == 0.2
    assert s.weight(15) == pytest.approx(0.6)
    assert s.weight(20) == pytest.approx(1.0)
    assert s.weight(30) == pytest.approx(0.5)
    assert s.weight(40) == 0.0 and s.weight(500) == 0.0


def test_other_kinds_fields_at_their_default_are_accepted_and_lists_are_sorted() -> None:
    s = RewardSchedule.model_validate({"kind": "linear", "half_life": None, "milestones": [], "points": []})
    assert (s.half_life, s.milestones, s.points) == (None, None, None)
    assert RewardSchedule(kind="step", milestones=[40, 10, 25]).milestones == [10, 25, 40]
    s = RewardSchedule(kind="piecewise", points=[(20, 1.0), (10, 0.2)])
    assert s.points == [(10, 0.2), (20, 1.0)] and s.weight(15) == pytest.approx(0.6)


def test_piecewise_step_listed_twice_is_a_jump() -> None:
    s = RewardSchedule(kind="piecewise", points=[(0, 1.0), (10, 1.0), (10, 0.2), (20, 0.0)])
    assert s.weight(9) == 1.0 and s.weight(10) == 0.2 and s.weight(15) == pytest.approx(0.1)
    assert s.weight(100) == 0.0


def test_exponential_halves_every_half_life() -> None:
    s = RewardSchedule(kind="exponential", w_start=1.0, w_end=0.0, half_life=5)
    assert [s.weight(t) for t in (0, 5, 10, 15)] == pytest.approx([1.0, 0.5, 0.25, 0.125])


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["constant", "linear", "cosine", "exponential", "step"]),
    w_start=st.floats(0, 5, allow_subnormal=False),
    w_end=st.floats(0, 5, allow_subnormal=False),
    warmup=st.integers(0, 20),
    horizon=st.integers(1, 50),
)
def test_monotone_kinds_are_monotone(
    kind: str, w_start: float, w_end: float, warmup: int, horizon: int
) -> None:
    extra = {"exponential": {"half_life": 4.0}, "step": {"milestones": [3, 9, 27]}}.get(kind, {})
    warm = {} if kind == "step" else {"warmup": warmup, "horizon": horizon}
    s = RewardSchedule(kind=kind, w_start=w_start, w_end=w_end, **warm, **extra)
    ws = [s.weight(t) for t in range(0, 90)]
    sign = 1 if w_end >= w_start else -1
    assert all(sign * (y - x) >= -1e-12 for x, y in zip(ws, ws[1:], strict=False))
    lo, hi = min(w_start, w_end), max(w_start, w_end)
    assert all(lo - 1e-12 <= w <= hi + 1e-12 for w in ws)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"kind": "exponential", "half_life": -3}, "half_life"),
        ({"kind": "exponential"}, "half_life"),
        ({"kind": "exponential", "half_life": math.inf}, "half_life"),
        ({"kind": "step", "milestones": [5, 5]}, "milestones"),
        ({"kind": "step", "milestones": [3, -1]}, "milestones"),
        ({"kind": "step", "milestones": []}, "milestones"),
        ({"kind": "step"}, "milestones"),
        ({"kind": "piecewise", "points": [(5, -0.1)]}, "points"),
        ({"kind": "piecewise", "points": [(-5, 0.1)]}, "points"),
        ({"kind": "linear", "half_life": 3}, "half_life"),
        ({"kind": "linear", "milestones": [3]}, "milestones"),
        ({"w_start": -1}, "w_start"),
        ({"horizon": 0}, "horizon"),
        ({"density_start": 1.5}, "density_start"),
        ({"density_end": -0.1}, "density_end"),
        ({"kind": "bogus"}, "kind"),
        ({"w_strat": 1}, "w_strat"),
    ],
)
def test_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValidationError) as err:
        RewardSchedule(**kwargs)
    # the error is located at the field (what the API reports as the offending field) and says why
    locs = [e["loc"] for e in err.value.errors()]
    assert (field,) in locs or any(loc[:1] == (field,) for loc in locs), locs
    assert field in str(err.value)


def test_density_interpolates_and_sampling_is_deterministic_with_the_right_rate() -> None:
    s = RewardSchedule(density_start=1.0, density_end=0.2, horizon=100, seed=7)
    assert (
        s.density(0) == 1.0 and s.density(50) == pytest.approx(0.6) and s.density(100) == pytest.approx(0.2)
    )
    ids = [f"traj-{i}" for i in range(4000)]
    kept = [s.keep_node(50, i, k) for i in ids for k in range(3)]
    assert kept == [s.keep_node(50, i, k) for i in ids for k in range(3)]  # deterministic
    n = len(kept)
    rate = sum(kept) / n
    assert abs(rate - 0.6) < 4 * math.sqrt(0.6 * 0.4 / n)
    # nested: a node kept at the lower density is kept at the higher one
    assert all(s.keep_node(0, i, 0) for i in ids)
    assert all(s.keep_node(50, i, 1) for i in ids if s.keep_node(100, i, 1))
    # another seed samples other nodes
    other = RewardSchedule(density_start=0.5, seed=8)
    same = RewardSchedule(density_start=0.5, seed=7)
    assert [other.keep_node(0, i, 0) for i in ids] != [same.keep_node(0, i, 0) for i in ids]


def test_patch_mid_run_changes_weights_only_from_the_next_step() -> None:
    h = ScheduleHistory.start(RewardSchedule(kind="linear", w_start=1.0, w_end=0.0, horizon=100))
    before = [h.weight(t) for t in range(0, 30)]
    v = h.apply_patch({"kind": "constant", "w_start": 0.3}, at_step=10)
    assert (v.version, v.effective_from, v.applied_at) == (2, 11, 10)
    after = [h.weight(t) for t in range(0, 30)]
    assert after[:11] == before[:11]
    assert after[11:] == [0.3] * 19
    assert h.at(10)[0] == 1 and h.at(11) == (2, h.versions[1].schedule)
    # a third version; the history keeps all
    h.apply_patch({"kind": "exponential", "half_life": 5}, at_step=20)
    assert [v.version for v in h.versions] == [1, 2, 3]
    assert h.at(21)[1].kind == "exponential" and h.at(21)[1].w_start == 0.3
    # round trip through JSON (what the Redis store persists)
    h2 = ScheduleHistory.from_json(h.to_json())
    assert h2 == h and json.loads(h.to_json())["versions"][2]["patch"] == {
        "kind": "exponential",
        "half_life": 5,
    }


def test_patch_changing_kind_drops_the_old_kinds_fields_and_validates() -> None:
    h = ScheduleHistory.start(RewardSchedule(kind="exponential", half_life=4))
    h.apply_patch({"kind": "linear"}, at_step=0)
    assert h.current.schedule.half_life is None
    with pytest.raises(ValidationError, match="milestones"):
        h.apply_patch({"kind": "step", "milestones": [9, 9]}, at_step=1)
    assert len(h.versions) == 2  # a rejected patch leaves no version behind
    with pytest.raises(ValueError, match="at_step"):
        h.apply_patch({"w_start": 0.5}, at_step=-1)
    h.apply_patch({"w_start": 0.5}, at_step=10)
    with pytest.raises(ValueError, match="past"):
        h.apply_patch({"w_start": 0.4}, at_step=3)


def test_spec_default_still_builds() -> None:
    from rl_service.spec import JobSpec

    spec = JobSpec.model_validate({"reward_schedule": {"kind": "cosine", "w_start": 0.5, "horizon": 10}})
    assert spec.reward_schedule.weight(10) == 0.0 and JobSpec().reward_schedule.weight(0) == 1.0


# Values from which the schema-consistency tests below draw schedules and patches: valid and invalid ones,
# the unused defaults of the kind-only fields, and combinations across kinds.
_VALUES: dict[str, list] = {
    "kind": ["constant", "linear", "cosine", "exponential", "step", "piecewise", "bogus", None],
    "w_start": [0.5, -1.0, "x", None],
    "horizon": [10, 0],
    "half_life": [None, 3.0, 0.0, -1.0],
    "milestones": [None, [], [3], [5, 2], [4, 4], [-1]],
    "points": [None, [], [[5, 0.1]], [[5, 0.1], [3, 0.2]], [[2, 0.5], [2, 0.7]], [[1, -0.1]], [[1]]],
    "density_end": [None, 0.5, 2.0],
    "nope": [1],
}
_BASES = [RewardSchedule(kind=k) for k in ("constant", "linear", "cosine")] + [
    RewardSchedule(kind="exponential", half_life=4),
    RewardSchedule(kind="step", milestones=[5]),
    RewardSchedule(kind="piecewise", points=[(1, 0.5)]),
]


@st.composite
def _documents(draw) -> dict:
    fields = draw(st.lists(st.sampled_from(sorted(_VALUES)), unique=True, max_size=5))
    return {f: draw(st.sampled_from(_VALUES[f])) for f in fields}


@functools.cache
def _schema_validator(model):
    import jsonschema

    return jsonschema.Draft202012Validator(model.model_json_schema())


def _accepts(model, data: dict) -> bool:
    try:
        model.model_validate(data)
        return True
    except ValidationError:
        return False


@settings(max_examples=150, deadline=None)
@given(data=_documents())
def test_the_json_schema_of_a_schedule_accepts_exactly_the_valid_ones(data: dict) -> None:
    assert _schema_validator(RewardSchedule).is_valid(data) == _accepts(RewardSchedule, data), data


@settings(max_examples=150, deadline=None)
@given(data=_documents())
def test_a_patch_is_valid_exactly_when_its_schema_says_and_then_fits_some_schedule(data: dict) -> None:
    valid = _accepts(SchedulePatch, data)
    assert _schema_validator(SchedulePatch).is_valid(data) == valid, data
    fits = []
    for base in _BASES:
        try:
            base.merged(data)
            fits.append(True)
        except ValidationError:
            fits.append(False)
    # a valid patch fits a schedule of some kind (so refusing it is a conflict with the job's schedule, not
    # bad input); an invalid one fits none (except the empty patch, which changes nothing and is refused)
    assert any(fits) if valid else (not any(fits) or data == {}), (data, fits)
