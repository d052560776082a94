"""The infrastructure-failure guard's rule on hand-made rollout groups (pure logic)."""

from __future__ import annotations

from rl_service.spec import InfraFailureConfig
from rl_service.training.infra_guard import InfraFailureGuard
from tests.rl_service.training.learner_helpers import fake_trajectory

TASK = {"id": "t0", "question": "1+1", "answer": "2"}


def groups(failed: int, total: int = 8, group_size: int = 2) -> list[list]:
    """`total` trajectories in groups of `group_size`, the first `failed` of them environment errors."""
    trajs = [fake_trajectory(TASK, f"g{i // group_size}", 0, status="env_error" if i < failed else "ok", seed=i)
             for i in range(total)]
    return [trajs[i:i + group_size] for i in range(0, total, group_size)]


def test_a_step_on_which_every_group_failed_warns_at_once() -> None:
    guard = InfraFailureGuard(InfraFailureConfig())
    health = guard.observe(0, groups(8), trained=False)
    assert health.infra_failure_rate == 1.0 and health.failed_groups == 4
    assert health.warning is not None and "8 of 8" in health.warning and health.pause_cause is None
    assert guard.observe(1, groups(8), trained=False).warning is None  # once per streak
    assert guard.untrained_steps == 2


def test_over_half_warns_on_the_third_step_in_a_row_and_a_healthy_step_ends_the_streak() -> None:
    guard = InfraFailureGuard(InfraFailureConfig())
    assert guard.observe(0, groups(4), trained=True).warning is None  # exactly half is not failing
    assert guard.streak == 0
    assert [guard.observe(t, groups(5), trained=True).warning is not None for t in (1, 2, 3)] == [False, False, True]
    assert guard.observe(4, groups(0), trained=True).warning is None and guard.streak == 0
    assert guard.observe(5, groups(5), trained=True).warning is None and guard.streak == 1
    assert guard.untrained_steps == 0


def test_the_fifth_failing_step_in_a_row_asks_for_a_pause_and_zero_never_does() -> None:
    guard = InfraFailureGuard(InfraFailureConfig())
    causes = [guard.observe(t, groups(6), trained=True).pause_cause for t in range(5)]
    assert causes[:4] == [None] * 4 and causes[4] is not None and "5 steps in a row" in causes[4]
    never = InfraFailureGuard(InfraFailureConfig(pause_after_steps=0))
    assert all(never.observe(t, groups(8), trained=False).pause_cause is None for t in range(20))


def test_state_round_trip_keeps_the_streak() -> None:
    config = InfraFailureConfig(warn_fraction=0.2, warn_after_steps=2, pause_after_steps=3)
    guard = InfraFailureGuard(config)
    guard.observe(0, groups(3), trained=True)
    guard.observe(1, groups(8), trained=False)
    copy = InfraFailureGuard.from_state_dict(config, guard.state_dict())
    assert copy.state_dict() == {"streak": 2, "warned": True, "untrained_steps": 1}
    assert copy.observe(2, groups(2), trained=True).pause_cause is not None
    assert InfraFailureGuard.from_state_dict(config, None).state_dict() == {"streak": 0, "warned": False,
                                                                            "untrained_steps": 0}


def test_the_warning_and_the_pause_name_the_endpoint_and_the_first_error() -> None:
    guard = InfraFailureGuard(InfraFailureConfig(pause_after_steps=1))
    guard.endpoint = "http://shop.example:8000/mcp"
    failing = groups(8)
    failing[0][0].error = "MCP server http://shop.example:8000/mcp: connection refused"
    health = guard.observe(0, failing, trained=False)
    assert "check the tool server at http://shop.example:8000/mcp" in health.warning
    assert "the first error: MCP server http://shop.example:8000/mcp: connection refused" in health.warning
    assert "http://shop.example:8000/mcp" in health.pause_cause
