"""`string_check` (as OpenAI's): compare two rendered templates; 1.0 when the comparison holds, else 0.0.

eq: equal; ne: not equal; like: `reference` occurs in `input`; ilike: the same, ignoring case."""

from __future__ import annotations

from typing import Any, Literal

from reward_models.graders.base import GradeContext, GraderSpec, template_field
from reward_models.graders.template import render


class StringCheckGrader(GraderSpec):
    type: Literal["string_check"] = "string_check"
    input: str = template_field()
    reference: str = template_field()
    operation: Literal["eq", "ne", "like", "ilike"] = "eq"

    def grade(self, item: dict[str, Any], sample: dict[str, Any], ctx: GradeContext) -> float:
        got, want = render(self.input, item, sample), render(self.reference, item, sample)
        if self.operation == "eq":
            return float(got == want)
        if self.operation == "ne":
            return float(got != want)
        if self.operation == "like":
            return float(want in got)
        return float(want.casefold() in got.casefold())
