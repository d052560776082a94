"""`http`: POST {"item", "sample"} to a grader endpoint that answers {"reward": float}. The same target rules
as http environments (net_guard: resolve, check against the operator's allow-list, connect to the checked
address), with timeout, retries with backoff and a concurrency limit."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator

from reward_models.graders.base import GradeContext, GraderSpec
from reward_models.graders.template import GraderError
from rollout_workers.environments.http_env import EndpointMissing, post_json
from rollout_workers.net_guard import TargetRefused, check_base_url


class HttpGrader(GraderSpec):
    type: Literal["http"] = "http"
    base_url: str = Field(max_length=2048, description="The grader server's base URL (http or https).")
    endpoint: str = Field("grade", pattern=r"^[A-Za-z0-9_\-]{1,64}$", description="Path segment POSTed to.")
    timeout_s: float = Field(10.0, gt=0.0, le=600.0)
    retries: int = Field(2, ge=0, le=10)
    backoff_s: float = Field(0.2, ge=0.0, le=60.0)
    concurrency: int = Field(16, ge=1, le=1024)

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str) -> str:
        try:
            check_base_url(v)
        except TargetRefused as e:
            raise ValueError(str(e)) from None
        return v

    def grade(self, item: dict[str, Any], sample: dict[str, Any], ctx: GradeContext) -> float:
        try:
            data = post_json(self, self.endpoint, {"item": item, "sample": sample}, ctx.allow)  # type: ignore[arg-type]
        except EndpointMissing:
            raise GraderError(f"http grader {self.name!r}: {self.base_url} has no /{self.endpoint}") from None
        except (RuntimeError, TimeoutError) as e:
            raise GraderError(f"http grader {self.name!r}: {e}") from None
        try:
            score = float(data["reward"])
        except (KeyError, TypeError, ValueError):
            raise GraderError(f"http grader {self.name!r}: the answer has no numeric 'reward'") from None
        if not math.isfinite(score):
            raise GraderError(f"http grader {self.name!r}: reward {score}")
        return score
