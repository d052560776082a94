"""Graders: outcome rewards declared as data (after OpenAI's RFT graders), and declared process components.

A registration or job carries a grader as JSON (`{"type": "string_check", ...}`); `parse_grader` checks it
against the declared models (every field bounded), `grade_trajectory` scores one finished trajectory.
One module per grader kind; `template` holds the `{{item.x}}` / `{{sample.y}}` namespaces.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError

from reward_models.graders.base import GradeContext, GraderSpec
from reward_models.graders.multi import MultiGrader, SimpleGrader
from reward_models.graders.process import ProcessSpec, score_declared
from reward_models.graders.template import GraderError, sample_of
from rollout_workers.trajectory import Trajectory

Grader = Annotated[SimpleGrader | MultiGrader, Field(discriminator="type")]
MAX_PROCESS_COMPONENTS = 16
_GRADER = TypeAdapter(Grader)
_PROCESS = TypeAdapter(list[ProcessSpec])


def _message(exc: ValidationError, field: str) -> str:
    err = exc.errors()[0]
    where = ".".join([field, *(str(p) for p in err.get("loc", ()))])
    return f"{where}: {str(err.get('msg', exc)).removeprefix('Value error, ')}"


def parse_grader(data: Any, field: str = "grader") -> GraderSpec:
    """The checked grader; raises ValueError whose message starts with the offending field."""
    try:
        return _GRADER.validate_python(data)
    except ValidationError as exc:
        raise ValueError(_message(exc, field)) from None


def parse_process(data: Any, field: str = "process_rewards") -> list[Any]:
    if isinstance(data, list) and len(data) > MAX_PROCESS_COMPONENTS:
        raise ValueError(f"{field}: at most {MAX_PROCESS_COMPONENTS} components")
    try:
        specs = _PROCESS.validate_python(data)
    except ValidationError as exc:
        raise ValueError(_message(exc, field)) from None
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"{field}: component names must differ, got {names}")
    return specs


def grade_trajectory(grader: GraderSpec, trajectory: Trajectory, ctx: GradeContext | None = None) -> float:
    """The outcome reward in [0, 1] (a formula's value is clipped); raises GraderError when it cannot be scored."""
    score = grader.grade(trajectory.task, sample_of(trajectory), ctx or GradeContext())
    return min(1.0, max(0.0, score))


__all__ = [
    "GradeContext",
    "Grader",
    "GraderError",
    "GraderSpec",
    "ProcessSpec",
    "grade_trajectory",
    "parse_grader",
    "parse_process",
    "score_declared",
]
