"""Response and error models of the OpenAI-compatible routes (/v1/fine_tuning), shaped as OpenAI's objects.
The request model and the translation live in rl_service.control.openai_compat."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

Status = Literal["validating_files", "queued", "running", "pausing", "paused", "succeeded", "failed", "cancelled"]
Auto = Literal["auto"]


class OpenAIErrorBody(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, permission_error, rate_limit_error")
    param: str | None = Field(description="The offending field (dotted path) or parameter.")
    code: str | None


class OpenAIError(BaseModel):
    error: OpenAIErrorBody


_ERRORS = {400: "The request does not match the schema; `error.param` names the field",
           401: "Missing or invalid API key", 404: "The job (or the `after` cursor) does not exist for this tenant",
           422: "A valid request the service cannot honour; `error.param` names the field",
           409: "The request conflicts with the job's current state",
           413: "The request body (or the file) is over the size limit",
           429: "Rate limited or over the tenant's quota",
           503: "The model's engine could not start or failed; retry later"}


def openai_error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": OpenAIError, "description": _ERRORS[s]} for s in statuses}


class JobError(BaseModel):
    code: str
    message: str
    param: str | None


class Hyperparameters(BaseModel):
    batch_size: Auto | int | None
    learning_rate_multiplier: Auto | float | None
    n_epochs: Auto | int | None


class ReinforcementHyperparameters(Hyperparameters):
    eval_interval: Auto | int | None
    eval_samples: Auto | int | None
    compute_multiplier: Auto | float | None
    reasoning_effort: Literal["default", "low", "medium", "high"] | None


class Reinforcement(BaseModel):
    grader: dict[str, Any] | None
    hyperparameters: ReinforcementHyperparameters


class Supervised(BaseModel):
    hyperparameters: Hyperparameters


class Method(BaseModel):
    type: Literal["reinforcement", "supervised"]
    reinforcement: Reinforcement | None = None
    supervised: Supervised | None = None


class FineTuningJob(BaseModel):
    object: Literal["fine_tuning.job"]
    id: str
    model: str
    created_at: int
    finished_at: int | None
    fine_tuned_model: str | None = Field(description="Once succeeded: a `model` that starts from its newest checkpoint.")
    organization_id: str = Field(description="The tenant.")
    result_files: list[str]
    status: Status
    trained_tokens: int | None
    training_file: str | None = Field(description="Null when the environment generates the tasks.")
    validation_file: str | None
    seed: int
    hyperparameters: Hyperparameters
    error: JobError | None
    estimated_finish: int | None
    integrations: list[dict[str, Any]]
    metadata: dict[str, str] | None
    method: Method
    user_provided_suffix: str | None


class FineTuningJobEvent(BaseModel):
    object: Literal["fine_tuning.job.event"]
    id: str
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    data: dict[str, Any] = Field(description="`kind`: the native event's kind, with its data.")
    type: Literal["message", "metrics"]


class CheckpointMetrics(BaseModel):
    step: int
    train_loss: float | None = Field(None, description="The loss of the step that ended at this checkpoint.")
    train_mean_reward: float | None = Field(None, description="Taper: that step's mean outcome reward.")
    train_success_rate: float | None = Field(None, description="Taper: that step's rollouts' success rate.")
    valid_success_rate: float | None = Field(None, description="Taper: held-out success rate, when evaluated here.")


class FineTuningJobCheckpoint(BaseModel):
    object: Literal["fine_tuning.job.checkpoint"]
    id: str
    created_at: int
    fine_tuned_model_checkpoint: str = Field(description="`JOB_ID:STEP`: a `model` that starts from this checkpoint.")
    fine_tuning_job_id: str
    step_number: int
    metrics: CheckpointMetrics


class _Page(BaseModel):
    object: Literal["list"]
    has_more: bool
    first_id: str | None
    last_id: str | None


class FineTuningJobPage(_Page):
    data: list[FineTuningJob]


class FineTuningJobEventPage(_Page):
    data: list[FineTuningJobEvent]


class FineTuningJobCheckpointPage(_Page):
    data: list[FineTuningJobCheckpoint]
