"""/v1/fine_tuning/alpha/graders: OpenAI's grader trial routes (run a grader on one sample; validate one).
Thin: rl_service.control.openai_graders translates, reward_models.graders grades."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from api.openai_schemas import openai_error_responses
from api.routers.dependencies import Svc, Who
from api.routers.openai_route import OpenAIRoute
from rl_service.control import openai_graders
from rl_service.control.openai_graders import GraderRun, GraderValidate

router = APIRouter(prefix="/v1/fine_tuning/alpha/graders", tags=["fine-tuning (OpenAI-compatible)"],
                   route_class=OpenAIRoute)
_ERRORS = openai_error_responses(400, 401, 413, 422)


@router.post("/run", summary="Score one sample with a grader", responses=_ERRORS)
def run_grader(request: GraderRun, svc: Svc, who: Who) -> dict[str, Any]:
    """The reward a job would train on for `model_sample` (a final answer) and `item` (its task), each
    sub-grader's score and what failed (`metadata.errors`); a grader that does not validate is a 400 naming
    the field."""
    return openai_graders.run(svc, request)


@router.post("/validate", summary="Check a grader", responses=_ERRORS)
def validate_grader(request: GraderValidate, svc: Svc, who: Who) -> dict[str, Any]:
    return openai_graders.validate(request)
