"""The dense-to-sparse process-reward schedule `w(t)`, its node density, and its version history.

`t` is the training step. Kinds (docs/design.md section 6):

- ``constant``:     w(t) = w_start
- ``linear``:       w(t) = w_start + (w_end - w_start) * p(t)
- ``cosine``:       w(t) = w_end + (w_start - w_end) * (1 + cos(pi * p(t))) / 2
- ``exponential``:  w(t) = w_end + (w_start - w_end) * 0.5 ** (max(t - warmup, 0) / half_life)
- ``step``:         w drops in equal parts from w_start to w_end at each of the `milestones` (distinct absolute
                    steps, kept sorted; a milestone m applies from step m on)
- ``piecewise``:    linear interpolation through `points` [(step, w), ...] (absolute steps, kept sorted by step),
                    flat outside; a step listed twice is a jump: its later point applies from that step on

with the progress ``p(t) = clamp((t - warmup) / horizon, 0, 1)``: `w` holds at `w_start` for the first
`warmup` steps and reaches `w_end` at step `warmup + horizon`.

`density(t)` is the fraction of process nodes (trajectory steps) whose process reward is kept; it moves
linearly (same `p(t)`) from `density_start` to `density_end` (constant when `density_end` is None). Which nodes
are kept is a deterministic hash of (seed, trajectory id, step index), so a lower density keeps a subset
of the nodes a higher one keeps.

Each kind reads its own field (`half_life`, `milestones` or `points`); the other kinds' fields must be left
out, or at their default (null, or an empty list). The JSON Schema says so: a union of one object per kind,
told apart by `kind` (see `_kind_union`), so that a schema-valid schedule is a valid one.

A `ScheduleHistory` versions live changes: a patch applied at step t becomes version v+1, effective
from step t+1; earlier versions stay in the history. A `SchedulePatch` is a patch that is valid on its own;
whether it fits a job's schedule (e.g. `half_life` needs kind `exponential`) depends on that schedule.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

ScheduleKind = Literal["constant", "linear", "cosine", "exponential", "step", "piecewise"]
DEFAULT_KIND = "linear"

# Fields that only one kind reads: anything else set with another kind is an error, not silently ignored.
_KIND_ONLY_FIELDS: dict[str, str] = {"half_life": "exponential", "milestones": "step", "points": "piecewise"}
MAX_LIST = 1000  # milestones or points


def _unused(value: Any) -> bool:
    """A kind-only field left at its default (null or an empty list): accepted with any kind."""
    return value is None or value == []


def _distinct_sorted(steps: list[int]) -> list[int]:
    if len(set(steps)) != len(steps):
        raise ValueError(f"milestones must be distinct steps (got {steps})")
    return sorted(steps)


Step = Annotated[int, Field(ge=0)]
HalfLife = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
Milestones = Annotated[list[Step], Field(max_length=MAX_LIST, json_schema_extra={"uniqueItems": True}),
                       AfterValidator(_distinct_sorted)]
# sorted by step; sort is stable, so a step listed twice keeps its points' order (a jump)
Points = Annotated[list[tuple[Step, Annotated[float, Field(ge=0.0, allow_inf_nan=False)]]],
                   Field(max_length=MAX_LIST), AfterValidator(lambda pts: sorted(pts, key=lambda p: p[0]))]


class RewardSchedule(BaseModel):
    """Process-reward weight `w(t)` and node density over training steps (discriminated by `kind`)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=lambda schema: _kind_union(schema, partial=False))

    kind: ScheduleKind = DEFAULT_KIND
    w_start: float = Field(1.0, ge=0.0, allow_inf_nan=False, description="Process weight at the start.")
    w_end: float = Field(0.0, ge=0.0, allow_inf_nan=False, description="Process weight at the end.")
    horizon: int = Field(
        100, ge=1, description="Steps over which w moves from w_start to w_end (after warmup)."
    )
    warmup: int = Field(0, ge=0, description="Steps w holds at w_start before moving.")
    # Kind-specific fields are validated even when left out (validate_default), so that a missing one is
    # reported under its own name.
    half_life: HalfLife | None = Field(
        None, validate_default=True, description="exponential only: steps for (w - w_end) to halve."
    )
    milestones: Milestones | None = Field(
        None, validate_default=True, description="step only: the distinct steps where w drops."
    )
    points: Points | None = Field(
        None, validate_default=True,
        description="piecewise only: [(step, w), ...]; a step listed twice jumps to its later w there.",
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
            if not _unused(value):
                raise ValueError(f"{field} is only used by kind '{owner}' (kind is '{kind}')")
            return None
        if _unused(value):
            raise ValueError(f"{field} is required for kind '{owner}' (and must not be empty)")
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
        last = bisect.bisect_right(pts, step, key=lambda p: p[0]) - 1  # the last point at or before `step`
        if last < 0:
            return pts[0][1]
        if last == len(pts) - 1:
            return pts[-1][1]
        (s0, w0), (s1, w1) = pts[last], pts[last + 1]  # s0 <= step < s1
        return w0 + (w1 - w0) * (step - s0) / (s1 - s0)

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


class _PatchRules(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=lambda schema: _kind_union(schema, partial=True))

    @field_validator(*_KIND_ONLY_FIELDS, check_fields=False)
    @classmethod
    def _fits_one_kind(cls, value: Any, info: ValidationInfo) -> Any:
        field = info.field_name
        assert field is not None
        owner = _KIND_ONLY_FIELDS[field]
        kind = info.data.get("kind")
        if kind is not None:  # the patch sets the kind: its own fields must be usable, the others unused
            if owner == kind and _unused(value):
                raise ValueError(f"{field} is required for kind '{owner}' (and must not be empty)")
            if owner != kind and not _unused(value):
                raise ValueError(f"{field} is only used by kind '{owner}' (kind is '{kind}')")
        elif not _unused(value):
            for other, other_owner in _KIND_ONLY_FIELDS.items():
                if other_owner != owner and not _unused(info.data.get(other)):
                    raise ValueError(f"{field} (kind '{owner}') cannot be set together with {other} "
                                     f"(kind '{other_owner}')")
        return value

    @model_validator(mode="after")
    def _not_empty(self) -> _PatchRules:
        if not self.model_fields_set:
            raise ValueError("a patch must change at least one field")
        return self

    def changes(self) -> dict[str, Any]:
        """The fields the patch sets, as JSON-ready data."""
        return self.model_dump(mode="json", exclude_unset=True)


def _optional(annotation: Any, metadata: list[Any]) -> Any:
    return Annotated[(annotation, *metadata)] if metadata else annotation


# The fields of RewardSchedule, each optional (left out: unchanged) and none defaulted: valid on its own,
# a patch can still not fit a given schedule (`half_life` for a linear one; `kind: step` without milestones).
SchedulePatch = create_model(
    "SchedulePatch",
    __base__=_PatchRules,
    __doc__="RewardSchedule fields to change (at least one), merged into the current schedule; changing `kind` "
    "drops the old kind's own fields.",
    **{name: (_optional(info.annotation, info.metadata), Field(None, description=info.description))
       for name, info in RewardSchedule.model_fields.items()},
)


def _kind_union(schema: dict[str, Any], *, partial: bool) -> None:
    """Turn the flat object schema of a schedule (or, ``partial``, of a patch) into a union of one object per
    kind: the kind's own field required (patch: optional but usable), the other kinds' fields null or empty."""
    properties = schema.pop("properties")
    for key in ("type", "required", "additionalProperties"):
        schema.pop(key, None)
    variants = []
    for kind in get_args(ScheduleKind):
        props: dict[str, Any] = {}
        for name, prop in properties.items():
            prop = {k: v for k, v in prop.items() if not (partial and k == "default")}
            owner = _KIND_ONLY_FIELDS.get(name)
            if name == "kind":
                default = {"default": kind} if kind == DEFAULT_KIND and not partial else {}
                props[name] = {"type": "string", "const": kind, **default}
            elif owner is None:
                props[name] = prop
            else:
                value_schema = next(b for b in prop["anyOf"] if b.get("type") != "null")
                if owner == kind:
                    own = {**value_schema, "description": prop.get("description", "")}
                    props[name] = {**own, "minItems": 1} if own.get("type") == "array" else own
                else:
                    empty = [{"type": "null"}, {"type": "array", "maxItems": 0}]
                    props[name] = {**({"anyOf": empty} if value_schema.get("type") == "array" else empty[0]),
                                   "description": f"Not used by kind '{kind}': left out, null or empty."}
        required = [] if partial else [f for f, o in _KIND_ONLY_FIELDS.items() if o == kind]
        if not partial and kind != DEFAULT_KIND:
            required.insert(0, "kind")
        variant = {"title": f"{kind.capitalize()}{schema.get('title', '')}", "type": "object",
                   "properties": props, "additionalProperties": False}
        if required:
            variant["required"] = required
        variants.append(variant)
    if partial:  # a patch may leave `kind` out, so several variants can match it
        schema.update(anyOf=variants, minProperties=1)
    else:  # `kind` (or its default) picks exactly one
        schema["oneOf"] = variants


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
