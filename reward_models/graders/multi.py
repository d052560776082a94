"""`multi` (as OpenAI's): named graders combined by `calculate_output`, an arithmetic formula over their
names, e.g. "0.7 * correct + 0.3 * format". Graders inside a multi grader may not be multi graders."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, model_validator

from reward_models.graders.base import GRADER_NAME, GradeContext, GraderSpec
from reward_models.graders.formula import FormulaError, evaluate, parse_formula
from reward_models.graders.http_grader import HttpGrader
from reward_models.graders.json_match import JsonMatchGrader
from reward_models.graders.numeric import NumericGrader
from reward_models.graders.python_grader import PythonGrader
from reward_models.graders.regex_grader import RegexGrader
from reward_models.graders.string_check import StringCheckGrader
from reward_models.graders.template import GraderError
from reward_models.graders.text_similarity import TextSimilarityGrader

SimpleGrader = Annotated[
    StringCheckGrader | TextSimilarityGrader | NumericGrader | RegexGrader | JsonMatchGrader | PythonGrader
    | HttpGrader,
    Field(discriminator="type"),
]
GraderName = Annotated[str, StringConstraints(pattern=GRADER_NAME)]


class MultiGrader(GraderSpec):
    type: Literal["multi"] = "multi"
    # pydantic documents the key pattern as patternProperties, which alone lets any other key through
    graders: dict[GraderName, SimpleGrader] = Field(min_length=1, max_length=16,
                                                   json_schema_extra={"additionalProperties": False})
    calculate_output: str = Field(max_length=1024, description="Formula over the graders' names.")

    @model_validator(mode="after")
    def _formula(self) -> MultiGrader:
        try:
            parse_formula(self.calculate_output, set(self.graders))
        except FormulaError as e:
            raise ValueError(f"calculate_output: {e}") from None
        return self

    def grade(self, item: dict[str, Any], sample: dict[str, Any], ctx: GradeContext) -> float:
        return self.combine({name: g.grade(item, sample, ctx) for name, g in self.graders.items()})

    def combine(self, values: dict[str, float]) -> float:
        """`calculate_output` over the graders' scores."""
        try:
            return evaluate(parse_formula(self.calculate_output, set(self.graders)), values)
        except FormulaError as e:
            raise GraderError(f"multi grader {self.name!r}: calculate_output {e}") from None
