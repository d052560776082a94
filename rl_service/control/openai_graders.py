"""OpenAI's `fine_tuning/alpha/graders/run` and `/validate` over Taper's graders (reward_models.graders): try
a declared grader on a sample in seconds, before a job spends GPU hours on it. Translation only: grading is
reward_models.graders.trial's, under the operator's limits (the http allow-list, the python sandbox's maxima)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from reward_models.graders import GradeContext, Grader, GraderSpec
from reward_models.graders.trial import ERROR_FLAGS, Trial, run_grader
from rl_service.control.service import TaperService

MAX_SAMPLE_CHARS = 100_000  # a final answer; under the request limit, so the field is what refuses it


class GraderValidate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grader: Grader = Field(description="As in a job's method.reinforcement.grader (or environment.grader).")


class GraderRun(GraderValidate):
    model_sample: str = Field(max_length=MAX_SAMPLE_CHARS, description="The final answer's text: `sample.output_text` "
                              "(`output_json` when it parses, Taper's `sample.answer` after 'The answer is').")
    item: dict[str, Any] = Field(default_factory=dict, description="The task (a task file's line): `item.*`.")
    output_tools: list[dict[str, Any]] | None = Field(
        None, max_length=256, description="Taper: the episode's tool calls ({name, arguments, result, error}): "
        "`sample.output_tools`.")


def grade_context(service: TaperService) -> GradeContext:
    policy = service.environments.policy
    return GradeContext(allow=policy.allow_list, python_max=policy.python_max)


def run_object(grader: GraderSpec, trial: Trial) -> dict[str, Any]:
    """OpenAI's run response: `reward` (what a job trains on: clipped to [0, 1], 0 when the grader failed),
    `metadata.errors` by OpenAI's flags with the failure's details, each sub-grader's score."""
    errors: dict[str, Any] = {flag: flag == trial.error for flag in ERROR_FLAGS}
    errors.update(python_grader_runtime_error_details=trial.details if trial.error == "python_grader_runtime_error"
                  else None, python_grader_server_error_type=None, model_grader_server_error_details=None,
                  other_error_details=trial.details if trial.error == "other_error" else None)
    scores: dict[str, Any] = dict(trial.sub_rewards)
    if trial.raw is not None:
        scores[grader.name] = trial.raw
    return {"reward": trial.reward, "sub_rewards": trial.sub_rewards, "model_grader_token_usage_per_model": {},
            "metadata": {"name": grader.name, "type": getattr(grader, "type", ""), "errors": errors,
                         "execution_time": trial.seconds, "scores": scores, "token_usage": None,
                         "sampled_model_name": None}}


def run(service: TaperService, request: GraderRun) -> dict[str, Any]:
    trial = run_grader(request.grader, request.item, request.model_sample, grade_context(service),
                       request.output_tools)
    return run_object(request.grader, trial)


def validate(request: GraderValidate) -> dict[str, Any]:
    """The grader as it will run (defaults filled in); a grader that does not validate never gets here."""
    return {"grader": request.grader.model_dump(mode="json")}
