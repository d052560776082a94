"""What every grader declares: a `type`, a `name`, and how it scores one (item, sample) pair in [0, 1]."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from reward_models.graders.template import MAX_TEMPLATE_CHARS
from rollout_workers.environments.policy import PythonSandboxMaxima
from rollout_workers.net_guard import AllowList

GRADER_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"


def template_field() -> Any:
    return Field(max_length=MAX_TEMPLATE_CHARS, description="Text with {{item.FIELD}} / {{sample.FIELD}} templates.")


@dataclass(frozen=True)
class GradeContext:
    """What the operator allows a grader to reach (http graders) and run (python graders)."""

    allow: AllowList = field(default_factory=AllowList)
    python_max: PythonSandboxMaxima = field(default_factory=PythonSandboxMaxima)


def _type_required(schema: dict[str, Any]) -> None:
    """Graders are told apart by `type`: the document says it is required, as validation does."""
    if "type" in schema.get("properties", {}) and "type" not in schema.setdefault("required", []):
        schema["required"].append("type")


class GraderSpec(BaseModel, ABC):
    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=_type_required)

    name: str = Field("grader", pattern=GRADER_NAME, description="Referenced by a multi grader's formula.")

    @abstractmethod
    def grade(self, item: dict[str, Any], sample: dict[str, Any], ctx: GradeContext) -> float:
        """The score of one sample; raise GraderError when it cannot be scored."""
