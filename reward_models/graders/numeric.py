"""`numeric`: 1.0 when the rendered input is a number within tolerance of the reference, else 0.0.

Passes when |input - reference| <= max(tolerance, relative_tolerance * |reference|). Thousands separators
and surrounding spaces are ignored; input that is not a number scores 0 (a reference that is not one is
the task's fault: GraderError)."""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import Field

from reward_models.graders.base import GradeContext, GraderSpec, template_field
from reward_models.graders.template import GraderError, render

_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


def parse_number(text: str) -> float | None:
    cleaned = text.strip().replace(",", "").rstrip(".")
    if not _NUMBER.fullmatch(cleaned):
        return None
    value = float(cleaned)
    return value if math.isfinite(value) else None


class NumericGrader(GraderSpec):
    type: Literal["numeric"] = "numeric"
    input: str = template_field()
    reference: str = template_field()
    tolerance: float = Field(0.0, ge=0.0, le=1e12, description="Absolute tolerance.")
    relative_tolerance: float = Field(0.0, ge=0.0, le=1.0, description="Tolerance relative to |reference|.")

    def grade(self, item: dict[str, Any], sample: dict[str, Any], ctx: GradeContext) -> float:
        reference = parse_number(render(self.reference, item, sample))
        if reference is None:
            raise GraderError(f"numeric grader {self.name!r}: the reference is not a number")
        got = parse_number(render(self.input, item, sample))
        if got is None:
            return 0.0
        return float(abs(got - reference) <= max(self.tolerance, self.relative_tolerance * abs(reference)))
