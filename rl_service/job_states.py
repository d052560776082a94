"""THE job state machine: every job state change in the service is checked here and nowhere else.

    queued -> starting -> running <-> paused -> succeeded | failed | cancelled

Details beyond the diagram (docs/design.md section 8):

- ``running -> starting``: the job's driver died and the scheduler restarts it from the last checkpoint.
- ``paused -> queued``: a paused job holds no Ray resources (its driver checkpointed and exited), so
  resuming puts it back in the queue; the scheduler then places it again (``queued -> starting``).
- ``starting -> paused``: a pause that arrives while the driver is still starting.
- ``queued``/``paused`` jobs have no driver, so cancelling them is immediate; a ``starting``/``running`` job is
  asked to stop (a control flag the driver polls every step) and becomes ``cancelled`` when it has.
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES

    @property
    def has_driver(self) -> bool:
        """States in which a driver actor is (or should be) alive and holding the job's resources."""
        return self in (JobState.STARTING, JobState.RUNNING)


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.STARTING, JobState.CANCELLED, JobState.FAILED}),
    JobState.STARTING: frozenset(
        {JobState.RUNNING, JobState.PAUSED, JobState.QUEUED, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.RUNNING: frozenset(
        {JobState.PAUSED, JobState.STARTING, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.PAUSED: frozenset({JobState.QUEUED, JobState.CANCELLED, JobState.FAILED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


class InvalidTransition(ValueError):
    def __init__(self, current: JobState | str, target: JobState | str) -> None:
        self.current = JobState(current)
        self.target = JobState(target)
        super().__init__(f"a {self.current.value} job cannot become {self.target.value}")


def can_transition(current: JobState | str, target: JobState | str) -> bool:
    return JobState(target) in TRANSITIONS[JobState(current)]


def check_transition(current: JobState | str, target: JobState | str) -> None:
    """Raise InvalidTransition unless ``current -> target`` is allowed."""
    if not can_transition(current, target):
        raise InvalidTransition(current, target)


def sources_of(target: JobState | str) -> frozenset[JobState]:
    """All states from which ``target`` may be entered (used for atomic compare-and-set in the store)."""
    t = JobState(target)
    return frozenset(s for s, targets in TRANSITIONS.items() if t in targets)


# What a user request asks of a job, by the state it is in. The store applies these atomically.
# cancel: queued/paused -> cancelled now; starting/running -> control flag, the driver finishes it.
# pause: starting/running -> control flag (the driver checkpoints and exits -> paused).
# resume: paused -> queued; a running job with a pending pause request just has the request withdrawn.
CONTROL_RUN = "run"
CONTROL_PAUSE = "pause"
CONTROL_CANCEL = "cancel"
