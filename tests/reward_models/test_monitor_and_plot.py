from __future__ import annotations

import json
from pathlib import Path

import pytest

from reward_models.monitor import WARNING_KIND, HackingMonitor
from reward_models.plot import effective_curve, plot_schedule
from reward_models.schedule import RewardSchedule, ScheduleHistory


def feed(mon: HackingMonitor, process: list[float], success: list[float]) -> list[dict]:
    return [e for t, (p, s) in enumerate(zip(process, success, strict=True)) if (e := mon.update(t, p, s))]


def test_warns_once_when_process_rises_while_success_falls_below_start() -> None:
    n = 40
    process = [0.2] * 5 + [0.2 + 0.02 * i for i in range(n)]
    success = [0.5] * 5 + [max(0.5 - 0.02 * i, 0.0) for i in range(n)]
    events = feed(HackingMonitor(window=10, baseline_steps=5, min_rise=0.05, min_drop=0.05), process, success)
    assert len(events) == 1
    e = events[0]
    assert e["kind"] == WARNING_KIND and e["success_start"] == pytest.approx(0.5)
    assert e["success_window_mean"] < 0.45 and e["process_weighted_rise"] >= 0.05
    # first step where the 10-point window mean of success is below 0.45 and the window is full
    first = next(t for t in range(14, 45) if sum(success[t - 9 : t + 1]) / 10 < 0.45 - 1e-12)
    assert e["step"] == first and e["window_start_step"] == first - 9
    json.dumps(e)  # an event payload


@pytest.mark.parametrize(
    "process, success",
    [
        ([0.2 + 0.02 * i for i in range(40)], [0.5 + 0.01 * i for i in range(40)]),  # both rise: learning
        ([0.5] * 40, [0.5 - 0.01 * i for i in range(40)]),  # success falls, process flat
        (
            [0.8 - 0.02 * i for i in range(40)],
            [0.5 - 0.01 * i for i in range(40)],
        ),  # process falls (w decays)
    ],
)
def test_no_warning_without_both_conditions(process: list[float], success: list[float]) -> None:
    assert feed(HackingMonitor(window=10, baseline_steps=5), process, success) == []


def test_rearms_after_the_condition_clears_and_state_round_trips() -> None:
    mon = HackingMonitor(window=4, baseline_steps=2)
    up, bad = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.2] * 6
    assert len(feed(mon, [0.0, 0.0] + up, [0.8, 0.8] + bad)) == 1
    restored = HackingMonitor.from_state_dict(json.loads(json.dumps(mon.state_dict())))
    for m in (mon, restored):
        assert [m.update(10 + i, 0.5, 0.9) for i in range(4)] == [None] * 4  # clears
        events = [m.update(20 + i, 0.5 + 0.1 * i, 0.1) for i in range(4)]
        assert sum(e is not None for e in events) == 1


def test_window_must_be_even() -> None:
    with pytest.raises(ValueError, match="window"):
        HackingMonitor(window=5)


def test_effective_curve_follows_versions_and_png_is_written(tmp_path: Path) -> None:
    h = ScheduleHistory.start(RewardSchedule(kind="cosine", horizon=50, density_end=0.3))
    h.apply_patch({"kind": "constant", "w_start": 0.25}, at_step=20)
    w, d, v = effective_curve(h, range(0, 40))
    assert w[:21] == [RewardSchedule(kind="cosine", horizon=50).weight(t) for t in range(21)]
    assert w[21:] == [0.25] * 19 and v[20] == 1 and v[21] == 2
    assert d[0] == 1.0 and d[21] == pytest.approx(1.0 - 0.7 * 21 / 50)
    out = plot_schedule(h, tmp_path / "plots" / "schedule.png", current_step=30)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    single = plot_schedule(RewardSchedule(kind="step", milestones=[5, 10]), tmp_path / "s.png")
    assert single.read_bytes()[:4] == b"\x89PNG"


def test_non_finite_points_are_rejected_with_the_field_named() -> None:
    mon = HackingMonitor(window=4, baseline_steps=1)
    with pytest.raises(ValueError, match="success must be a finite number"):
        mon.update(0, 0.1, float("nan"))
    with pytest.raises(ValueError, match="weighted_process must be a finite number"):
        mon.update(0, float("inf"), 0.5)


def test_history_plot_draws_the_later_versions(tmp_path: Path) -> None:
    from matplotlib.image import imread

    first = RewardSchedule(kind="linear", horizon=40)
    h = ScheduleHistory.start(first)
    h.apply_patch({"kind": "constant", "w_start": 0.8}, at_step=10)
    steps = range(0, 40)
    only_first = imread(plot_schedule(first, tmp_path / "v1.png", steps=steps))
    with_history = imread(plot_schedule(h, tmp_path / "h.png", steps=steps))
    assert only_first.shape == with_history.shape and (only_first != with_history).any()
