"""`json_match`: the share of the declared fields (dotted paths) on which the input's JSON equals the
reference's. Input that is not a JSON object scores 0; a field missing on both sides does not match."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints

from reward_models.graders.base import GradeContext, GraderSpec
from reward_models.graders.template import MISSING, GraderError, lookup, resolve

FieldPath = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+){0,15}$")]

def _as_object(value: Any) -> dict[str, Any] | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


class JsonMatchGrader(GraderSpec):
    type: Literal["json_match"] = "json_match"
    input: str = Field("{{sample.output_json}}", max_length=4096)
    reference: str = Field("{{item.answer}}", max_length=4096)
    fields: list[FieldPath] = Field(min_length=1, max_length=64, description="Dotted paths compared for equality.")

    def grade(self, item: dict[str, Any], sample: dict[str, Any], ctx: GradeContext) -> float:
        want = _as_object(resolve(self.reference, item, sample))
        if want is None:
            raise GraderError(f"json_match grader {self.name!r}: the reference is not a JSON object")
        got = _as_object(resolve(self.input, item, sample))
        if got is None:
            return 0.0
        hits = 0
        for path in self.fields:
            a, b = lookup({"x": got}, "x", path), lookup({"x": want}, "x", path)
            hits += int(a is not MISSING and b is not MISSING and a == b)
        return hits / len(self.fields)

