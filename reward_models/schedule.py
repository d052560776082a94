"""The dense-to-sparse process-reward schedule `w(t)`, its node density, and its version history.

`t` is the training step. Kinds (DESIGN.md section 6):

- ``constant``:     w(t) = w_start
- ``linear``:       w(t) = w_start + (w_end - w_start) * p(t)
- ``cosine``:       w(t) = w_end + (w_start - w_end) * (1 + cos(pi * p(t))) / 2
- ``exponential``:  w(t) = w_end + (w_start - w_end) * 0.5 ** (max(t - warmup, 0) / half_life)
- ``step``:         w drops in equal parts from w_start to w_end at each of the `milestones` (absolute steps;
                    a milestone m applies from step m on)
- ``piecewise``:    linear interpolation through `points` [(step, w), ...] (absolute steps), flat outside

with the progress ``p(t) = clamp((t - warmup) / horizon, 0, 1)``: `w` holds at `w_start` for the first
`warmup` steps and reaches `w_end` at step `warmup + horizon`.

`density(t)` is the fraction of process nodes (trajectory steps) whose process reward is kept; it moves
linearly (same `p(t)`) from `density_start` to `density_end` (constant when `density_end` is None). Which nodes
are kept is a deterministic hash of (seed, trajectory id, step index), so a lower density keeps a subset
of the nodes a higher one keeps.

A `ScheduleHistory` versions live changes: a patch applied at step t becomes version v+1, effective
from step t+1; earlier versions stay in the history.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

ScheduleKind = Literal["constant", "linear", "cosine", "exponential", "step", "piecewise"]

# Fields that only one kind reads: anything else set with another kind is an error, not silently ignored.
_KIND_ONLY_FIELDS: dict[str, str] = {"half_life": "exponential", "milestones": "step", "points": "piecewise"}


class RewardSchedule(BaseModel):
    """Process-reward weight `w(t)` and node density over training steps (discriminated by `kind`)."""

    model_config = ConfigDict(extra="forbid")

    kind: ScheduleKind = "linear"
    w_start: float = Field(1.0, ge=0.0, allow_inf_nan=False, description="Process weight at the start.")
    w_end: float = Field(0.0, ge=0.0, allow_inf_nan=False, description="Process weight at the end.")
    horizon: int = Field(
        100, ge=1, description="Steps over which w moves from w_start to w_end (after warmup)."
    )
    warmup: int = Field(0, ge=0, description="Steps w holds at w_start before moving.")
    # Kind-specific fields are validated even when left out (validate_default), so that a missing one is
    # reported under its own name.
    half_life: float | None = Field(
        None, validate_default=True, description="exponential only: steps for (w - w_end) to halve."
    )
    milestones: list[int] | None = Field(
        None, validate_default=True, description="step only: strictly increasing steps where w drops."
    )
    points: list[tuple[int, float]] | None = Field(
        None, validate_default=True, description="piecewise only: [(step, w), ...] with increasing steps."
    )
    density_start: float = Field(
        1.0, ge=0.0, le=1.0, allow_inf_nan=False, description="Fraction of process nodes kept at the start."
    )
    density_end: float | None = Field(
        None, ge=0.0, le=1.0, allow_inf_nan=False, description="Fraction kept at the end (None: constant)."
    )
    seed: int = Field(0, description="Seed of the deterministic node sampling.")

    @field_validator("half_life", "milestones", "points")
    @classmethod
    def _check_kind_field(cls, value: Any, info: ValidationInfo) -> Any:
        field = info.field_name
        assert field is not None
        owner = _KIND_ONLY_FIELDS[field]
        kind = info.data.get("kind")
        if kind is None:  # kind itself failed validation; that error is reported already
            return value
        if kind != owner:
            if value is not None:
                raise ValueError(f"{field} is only used by kind '{owner}' (kind is '{kind}')")
            return value
        if value is None:
            raise ValueError(f"{field} is required for kind '{owner}'")
        if field == "half_life":
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"half_life must be a positive number of steps (got {value})")
        elif field == "milestones":
            if not value:
                raise ValueError("milestones must list at least one step")
            if value[0] < 0:
                raise ValueError(f"milestones must be >= 0 (got {value[0]})")
            if any(b <= a for a, b in zip(value, value[1:], strict=False)):
                raise ValueError(f"milestones must be strictly increasing (got {value})")
        else:
            if not value:
                raise ValueError("points must list at least one (step, w) pair")
            steps = [s for s, _ in value]
            if steps[0] < 0:
                raise ValueError(f"points steps must be >= 0 (got {steps[0]})")
            if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
                raise ValueError(f"points steps must be strictly increasing (got {steps})")
            for s, w in value:
                if not (math.isfinite(w) and w >= 0):
                    raise ValueError(f"points weight at step {s} must be a finite number >= 0 (got {w})")
        return value

    # ---- values ----
    def progress(self, step: int) -> float:
        return min(max((step - self.warmup) / self.horizon, 0.0), 1.0)

    def weight(self, step: int) -> float:
        """The process-reward weight w(t) at training step `step`."""
        a, b = self.w_start, self.w_end
        if self.kind == "constant":
            return a
        if self.kind == "linear":
            return a + (b - a) * self.progress(step)
        if self.kind == "cosine":
            return b + (a - b) * 0.5 * (1.0 + math.cos(math.pi * self.progress(step)))
        if self.kind == "exponential":
            assert self.half_life is not None
            return b + (a - b) * 0.5 ** (max(step - self.warmup, 0) / self.half_life)
        if self.kind == "step":
            assert self.milestones is not None
            passed = sum(1 for m in self.milestones if step >= m)
            return a + (b - a) * passed / len(self.milestones)
        assert self.points is not None  # piecewise
        pts = self.points
        if step <= pts[0][0]:
            return pts[0][1]
        for (s0, w0), (s1, w1) in zip(pts, pts[1:], strict=False):
            if step <= s1:
                return w0 + (w1 - w0) * (step - s0) / (s1 - s0)
        return pts[-1][1]

    def density(self, step: int) -> float:
        """The fraction of process nodes kept at training step `step`."""
        if self.density_end is None:
            return self.density_start
        return self.density_start + (self.density_end - self.density_start) * self.progress(step)

    def keep_node(self, step: int, traj_id: str, step_index: int) -> bool:
        """Whether the process node (trajectory, step index) is kept at training step `step`."""
        d = self.density(step)
        if d >= 1.0:
            return True
        if d <= 0.0:
            return False
        return node_uniform(self.seed, traj_id, step_index) < d

    def is_monotone(self) -> bool:
        """True for the kinds that move monotonically from w_start to w_end."""
        return self.kind != "piecewise"

    def merged(self, patch: dict[str, Any]) -> RewardSchedule:
        """This schedule with `patch` applied (validated). Changing `kind` drops the old kind's own fields."""
        data = self.model_dump()
        new_kind = patch.get("kind", self.kind)
        if new_kind != self.kind:
            for field, owner in _KIND_ONLY_FIELDS.items():
                if owner == self.kind and field not in patch:
                    data[field] = None
        data.update(patch)
        return RewardSchedule.model_validate(data)


def node_uniform(seed: int, traj_id: str, step_index: int) -> float:
    """A deterministic uniform number in [0, 1) for one process node."""
    digest = hashlib.blake2b(f"{seed}:{traj_id}:{step_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


class ScheduleVersion(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=1)
    effective_from: int = Field(ge=0, description="First training step this version applies to.")
    applied_at: int | None = Field(
        None, description="Training step at which the patch arrived (None: initial)."
    )
    schedule: RewardSchedule
    patch: dict[str, Any] = Field(default_factory=dict)


class ScheduleHistory(BaseModel):
    """All versions of one job's schedule; version 1 is the submitted schedule, effective from step 0."""

    model_config = ConfigDict(extra="forbid")

    versions: list[ScheduleVersion]

    @model_validator(mode="after")
    def _check_order(self) -> ScheduleHistory:
        if not self.versions:
            raise ValueError("versions must hold at least the initial schedule")
        for i, v in enumerate(self.versions):
            if v.version != i + 1:
                raise ValueError(f"versions[{i}].version must be {i + 1} (got {v.version})")
            if i and v.effective_from < self.versions[i - 1].effective_from:
                raise ValueError(f"versions[{i}].effective_from must not go back in time")
        return self

    @classmethod
    def start(cls, schedule: RewardSchedule) -> ScheduleHistory:
        return cls(versions=[ScheduleVersion(version=1, effective_from=0, schedule=schedule)])

    @property
    def current(self) -> ScheduleVersion:
        return self.versions[-1]

    def apply_patch(self, patch: dict[str, Any], at_step: int) -> ScheduleVersion:
        """Apply `patch` (fields of RewardSchedule) arriving at step `at_step`: a new version from `at_step + 1`."""
        if at_step < 0:
            raise ValueError(f"at_step must be >= 0 (got {at_step})")
        if at_step + 1 < self.current.effective_from:
            raise ValueError(
                f"at_step {at_step} is before the current version's start ({self.current.effective_from}); "
                "a patch cannot change the past"
            )
        schedule = self.current.schedule.merged(patch)
        new = ScheduleVersion(
            version=self.current.version + 1,
            effective_from=at_step + 1,
            applied_at=at_step,
            schedule=schedule,
            patch=dict(patch),
        )
        self.versions.append(new)
        return new

    def replace(self, schedule: RewardSchedule, at_step: int) -> ScheduleVersion:
        """Replace the whole schedule at step `at_step` (effective from `at_step + 1`)."""
        return self.apply_patch(schedule.model_dump(), at_step)

    def at(self, step: int) -> tuple[int, RewardSchedule]:
        """(version, schedule) in force at training step `step`."""
        chosen = self.versions[0]
        for v in self.versions:
            if v.effective_from <= step:
                chosen = v
        return chosen.version, chosen.schedule

    def weight(self, step: int) -> float:
        return self.at(step)[1].weight(step)

    def density(self, step: int) -> float:
        return self.at(step)[1].density(step)

    def keep_node(self, step: int, traj_id: str, step_index: int) -> bool:
        return self.at(step)[1].keep_node(step, traj_id, step_index)

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str | bytes) -> ScheduleHistory:
        return cls.model_validate_json(text)
