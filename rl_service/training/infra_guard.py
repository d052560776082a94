"""A job that cannot learn says so: watch each step's share of infrastructure-failure trajectories
(environment errors, tool timeouts), warn when it stays high, and ask the job to pause itself when
it stays high for long.

A step is *failing* when that share exceeds `warn_fraction`. A failing step on which every group
failed warns at once; otherwise `warn_after_steps` failing steps in a row do. `pause_after_steps`
failing steps in a row pause the job (it resumes from its checkpoint once the environment is back).
A healthy step ends the streak.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rl_service.spec import InfraFailureConfig
from rollout_workers.trajectory import Trajectory


@dataclass(frozen=True)
class StepHealth:
    infra_failure_rate: float
    failed_groups: int
    warning: str | None = None  # set on the step that first crosses the warning threshold of a streak
    pause_cause: str | None = None  # set when the job must pause itself

    def metrics(self) -> dict[str, float]:
        return {"trajectories/infra_failure_rate": self.infra_failure_rate,
                "groups/infra_failed": float(self.failed_groups)}


class InfraFailureGuard:
    def __init__(self, config: InfraFailureConfig, streak: int = 0, warned: bool = False,
                 untrained_steps: int = 0) -> None:
        self.config = config
        self.streak = streak  # failing steps in a row, up to the last one observed
        self.warned = warned  # a warning was already raised for this streak
        self.untrained_steps = untrained_steps  # steps on which the learner had nothing to train on
        self.endpoint: str | None = None  # the environment's tool server, named in warnings (set by the runner)

    def observe(self, step: int, groups: Sequence[Sequence[Trajectory]], trained: bool) -> StepHealth:
        """Judge training step `step` (0-based) from its rollout groups; `trained` says whether the learner
        had any sample."""
        trajs = [tj for g in groups for tj in g]
        failed = sum(tj.status.is_infra_failure for tj in trajs)
        rate = failed / len(trajs) if trajs else 0.0
        failed_groups = sum(1 for g in groups if g and all(tj.status.is_infra_failure for tj in g))
        if not trained:
            self.untrained_steps += 1
        if rate <= self.config.warn_fraction:
            self.end_streak()
            return StepHealth(rate, failed_groups)

        self.streak += 1
        every_group = bool(groups) and failed_groups == len(groups)
        example = next((tj.error for tj in trajs if tj.status.is_infra_failure and tj.error), None)
        where = f"the tool server at {self.endpoint}" if self.endpoint else "the environment's tool server"
        summary = (f"{failed} of {len(trajs)} trajectories of step {step} were infrastructure failures "
                   f"({failed_groups} of {len(groups)} groups failed whole; {self.streak} failing step(s) in a "
                   f"row): check {where} or the rollout workers"
                   + (f"; the first error: {example[:300]}" if example else ""))
        warning = None
        if not self.warned and (every_group or self.streak >= self.config.warn_after_steps):
            self.warned = True
            warning = summary
        pause = None
        if self.config.pause_after_steps and self.streak >= self.config.pause_after_steps:
            pause = f"paused after {self.streak} steps in a row with mostly infrastructure failures: {summary}"
        return StepHealth(rate, failed_groups, warning, pause)

    def end_streak(self) -> None:
        self.streak, self.warned = 0, False

    def state_dict(self) -> dict[str, int | bool]:
        return {"streak": self.streak, "warned": self.warned, "untrained_steps": self.untrained_steps}

    @classmethod
    def from_state_dict(cls, config: InfraFailureConfig, state: dict[str, int | bool] | None) -> InfraFailureGuard:
        state = state or {}
        return cls(config, int(state.get("streak", 0)), bool(state.get("warned", False)),
                   int(state.get("untrained_steps", 0)))
