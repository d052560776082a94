"""`regex`: 1.0 when the pattern matches the rendered input (search, or the whole input), else 0.0.

The pattern is the tenant's, so matching runs with a time limit (the `regex` package's timeout): a pattern
that backtracks past it is a grader failure, never a stalled scorer."""

from __future__ import annotations

from typing import Any, Literal

import regex
from pydantic import Field, field_validator

from reward_models.graders.base import GradeContext, GraderSpec, template_field
from reward_models.graders.template import GraderError, render

MATCH_TIMEOUT_S = 0.5


class RegexGrader(GraderSpec):
    type: Literal["regex"] = "regex"
    input: str = template_field()
    pattern: str = Field(max_length=1024, description="A regular expression (Python syntax).")
    mode: Literal["search", "fullmatch"] = "search"
    ignore_case: bool = False

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            regex.compile(v)
        except regex.error as e:
            raise ValueError(f"not a valid regular expression: {e}") from None
        return v

    def grade(self, item: dict[str, Any], sample: dict[str, Any], ctx: GradeContext) -> float:
        compiled = regex.compile(self.pattern, regex.IGNORECASE if self.ignore_case else 0)
        text = render(self.input, item, sample)
        match = compiled.search if self.mode == "search" else compiled.fullmatch
        try:
            return float(match(text, timeout=MATCH_TIMEOUT_S) is not None)
        except TimeoutError:
            raise GraderError(f"regex grader {self.name!r}: matching took longer than {MATCH_TIMEOUT_S}s") from None
