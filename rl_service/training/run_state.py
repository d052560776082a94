"""What a job's checkpoint restores beside the weights and the optimizer: the data cursor, the reward-schedule
history (with the control plane's version number of each of its versions), the hacking monitor and the
infrastructure-failure guard."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from reward_models.monitor import HackingMonitor
from reward_models.schedule import RewardSchedule, ScheduleHistory
from rl_service.spec import JobSpec
from rl_service.training.infra_guard import InfraFailureGuard


class DataCursor:
    """Walks the training tasks epoch by epoch, each epoch a seeded permutation."""

    def __init__(self, num_tasks: int, seed: int, epoch: int = 0, position: int = 0) -> None:
        if num_tasks < 1:
            raise ValueError("tasks.num_train must be >= 1")
        self.num_tasks, self.seed, self.epoch, self.position = num_tasks, seed, epoch, position
        self._order = self._permutation(epoch)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.num_tasks))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def take(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            if self.position >= self.num_tasks:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            out.append(self._order[self.position])
            self.position += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    @classmethod
    def from_state(cls, num_tasks: int, seed: int, state: dict[str, int]) -> DataCursor:
        return cls(num_tasks, seed, int(state["epoch"]), int(state["position"]))


@dataclass
class RunState:
    cursor: DataCursor
    history: ScheduleHistory
    hooks_schedule_version: int  # the control plane's version of the schedule in force
    version_map: dict[int, int]  # the history's version -> the control plane's
    monitor: HackingMonitor
    infra_guard: InfraFailureGuard

    @classmethod
    def fresh(cls, spec: JobSpec, num_tasks: int, schedule: tuple[int, RewardSchedule]) -> RunState:
        """A job's first start, with the control plane's current (version, schedule)."""
        version, current = schedule
        return cls(DataCursor(num_tasks, spec.tasks.seed), ScheduleHistory.start(current), version, {1: version},
                   HackingMonitor(spec.hacking_monitor), InfraFailureGuard(spec.infra_failures))

    @classmethod
    def from_checkpoint(cls, spec: JobSpec, num_tasks: int, state: dict[str, Any]) -> RunState:
        return cls(
            DataCursor.from_state(num_tasks, spec.tasks.seed, state["cursor"]),
            ScheduleHistory.from_json(state["schedule_history"]),
            int(state["hooks_schedule_version"]),
            {int(k): int(v) for k, v in state["version_map"].items()},
            HackingMonitor.from_state_dict(state["monitor"]),
            InfraFailureGuard.from_state_dict(spec.infra_failures, state.get("infra_guard")),
        )

    def to_checkpoint(self, cursor: dict[str, int] | None = None) -> dict[str, Any]:
        """The checkpoint's state; `cursor` instead of the current one (the rollouts drawn ahead are redrawn)."""
        return {
            "cursor": cursor if cursor is not None else self.cursor.state(),
            "schedule_history": self.history.to_json(),
            "hooks_schedule_version": self.hooks_schedule_version,
            "version_map": {str(k): v for k, v in self.version_map.items()},
            "monitor": self.monitor.state_dict(),
            "infra_guard": self.infra_guard.state_dict(),
        }

    def apply_schedule(self, t: int, version: int, schedule: RewardSchedule) -> bool:
        """The control plane's schedule `version`, if newer than the one in force, applies from step `t` on;
        returns whether it was new."""
        if version == self.hooks_schedule_version:
            return False
        if t == 0:
            self.history = ScheduleHistory.start(schedule)
            self.version_map = {1: version}
        else:
            new = self.history.replace(schedule, at_step=t - 1)
            self.version_map[new.version] = version
        self.hooks_schedule_version = version
        return True
