"""The job state machine (pure logic)."""

from __future__ import annotations

import itertools

import pytest

from rl_service.job_states import (
    TERMINAL_STATES,
    TRANSITIONS,
    InvalidTransition,
    JobState,
    can_transition,
    check_transition,
    sources_of,
)

ALLOWED = {
    ("queued", "starting"), ("queued", "cancelled"), ("queued", "failed"),
    ("starting", "running"), ("starting", "paused"), ("starting", "queued"), ("starting", "failed"),
    ("starting", "cancelled"),
    ("running", "paused"), ("running", "starting"), ("running", "succeeded"), ("running", "failed"),
    ("running", "cancelled"),
    ("paused", "queued"), ("paused", "cancelled"), ("paused", "failed"),
}


def test_exactly_the_documented_transitions_are_allowed() -> None:
    for a, b in itertools.product(JobState, JobState):
        assert can_transition(a, b) == ((a.value, b.value) in ALLOWED), (a, b)


def test_terminal_states_are_final_and_every_state_reaches_one() -> None:
    assert all(not TRANSITIONS[s] for s in TERMINAL_STATES)
    for start in JobState:
        seen, todo = {start}, [start]
        while todo:
            for nxt in TRANSITIONS[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        assert seen & TERMINAL_STATES, start


def test_check_transition_raises_with_both_states() -> None:
    check_transition("running", "paused")
    with pytest.raises(InvalidTransition, match="a succeeded job cannot become running"):
        check_transition("succeeded", "running")
    with pytest.raises(ValueError):
        check_transition("running", "exploded")


def test_sources_of_inverts_the_table() -> None:
    assert sources_of("running") == {JobState.STARTING}
    assert sources_of("queued") == {JobState.STARTING, JobState.PAUSED}
    assert sources_of("cancelled") == {JobState.QUEUED, JobState.STARTING, JobState.RUNNING, JobState.PAUSED}
    assert JobState.RUNNING.has_driver and not JobState.PAUSED.has_driver
