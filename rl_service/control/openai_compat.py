"""OpenAI fine-tuning compatibility: `/v1/fine_tuning/jobs` requests become job specs and jobs become OpenAI's
`fine_tuning.job` objects, so the official `openai` client drives Taper jobs. Every rule stays in
TaperService; this module only translates (and pages the way OpenAI does: newest first, `after` an id,
`has_more`).

A create request carries OpenAI's fields (`model`, `training_file`, `validation_file`, `seed`, `suffix`,
`metadata`, `method: {type: "reinforcement", reinforcement: {grader, hyperparameters}}`) and, through the
client's `extra_body`, Taper's own job blocks (`environment`, `tasks`, `rollout`, `algorithm`,
`reward_schedule`, `resources`, `tracking`, `total_steps`, ...), each validated exactly as in a native job spec.
OpenAI's `integrations` (W&B) become the job's `tracking.wandb`."""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from reward_models.graders import Grader
from reward_models.monitor import HackingMonitorConfig
from reward_models.schedule import RewardSchedule
from rl_service.control.service import (
    InvalidInput,
    NotFound,
    Principal,
    ServiceError,
    TaperService,
    invalid_from,
)
from rl_service.control.store import JobRecord
from rl_service.job_states import CONTROL_PAUSE, JobState
from rl_service.spec import (
    CHECKPOINT_REF,
    FILE_ID,
    AlgorithmSpec,
    EnvironmentSpec,
    InfraFailureConfig,
    JobSpec,
    Metadata,
    ResourcesSpec,
    RolloutSpec,
    TasksSpec,
    TrackingSpec,
    WandbTracking,
    WarmStartSpec,
    WatchdogSpec,
)

PRESETS = ("tiny", "small", "large")
MODEL = rf"^({'|'.join(PRESETS)}|{CHECKPOINT_REF.strip('^$')})$"
# OpenAI's names for the uploaded task files -> the job spec's fields of the same meaning
FILE_FIELDS = {"training_file": "train_file", "validation_file": "eval_file"}
EVENT_ID = r"^\d{1,19}(-\d{1,19})?$"
CHECKPOINT_ID = r"^job-[0-9a-f]{16}:[0-9]{1,10}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


Auto = Literal["auto"]


class ReinforcementHyperparameters(_Strict):
    """OpenAI's reinforcement hyperparameters, each mapped onto a job spec field ("auto": the spec's default)."""

    batch_size: Auto | Annotated[int, Field(ge=1, le=4096)] | None = Field(
        None, description="rollout.prompts_per_step")
    learning_rate_multiplier: Auto | Annotated[float, Field(gt=0.0, le=1e6)] | None = Field(
        None, description="algorithm.learning_rate = multiplier x the default learning rate (TRL's 1e-6)")
    n_epochs: Auto | Annotated[int, Field(ge=1, le=1000)] | None = Field(
        None, description="total_steps = ceil(n_epochs x tasks.num_train / batch_size)")
    eval_interval: Auto | Annotated[int, Field(ge=1, le=1_000_000)] | None = Field(
        None, description="eval_every")
    eval_samples: Auto | Annotated[int, Field(ge=1, le=100_000)] | None = Field(
        None, description="tasks.num_eval")
    compute_multiplier: Auto | Annotated[float, Field(gt=0.0, le=32.0)] | None = Field(
        None, description="Samples per task: rollout.num_generations = round(multiplier x its default), at least 2.")
    reasoning_effort: Literal["default"] | None = Field(
        None, description="Only 'default' (the policy is not a reasoning model).")


class Reinforcement(_Strict):
    grader: Grader | None = Field(
        None, description="OpenAI's RFT grader, run as the job's outcome grader (environment.grader): string_check "
        "(eq, ne, like, ilike), text_similarity (fuzzy_match, rouge_1), python (grade(sample, item) in Taper's "
        "sandbox; no image_tag), multi (named graders and calculate_output); also Taper's numeric, regex, "
        "json_match and http graders. Templates read {{item.FIELD}} and {{sample.output_text}}. score_model and "
        "label_model are not offered. None: the environment's own verifier.")
    hyperparameters: ReinforcementHyperparameters = Field(default_factory=ReinforcementHyperparameters)


class FineTuningMethod(_Strict):
    type: Literal["reinforcement"] = Field(description="Taper trains with reinforcement only.")
    reinforcement: Reinforcement = Field(default_factory=Reinforcement)


class Integration(_Strict):
    """OpenAI's W&B integration: the job's metrics go to this W&B project (tracking.wandb)."""

    type: Literal["wandb"]
    wandb: WandbTracking


class FineTuningJobCreate(_Strict):
    """POST /v1/fine_tuning/jobs. OpenAI's fields, then Taper's own (sent with the client's `extra_body`)."""

    model: str = Field(pattern=MODEL, description="A preset (tiny, small, large), a checkpoint "
                       "(`JOB_ID`, `JOB_ID:STEP`: e.g. a job's fine_tuned_model) or `base:NAME`.")
    training_file: str | None = Field(
        None, pattern=FILE_ID,
        description="A file id of purpose fine-tune (JSONL tasks); omit (null) to use the environment's generator.")
    validation_file: str | None = Field(None, pattern=FILE_ID, description="Held-out tasks, a file id.")
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    suffix: str | None = Field(None, min_length=1, max_length=64, description="Becomes the job's name.")
    metadata: Metadata | None = None
    method: FineTuningMethod | None = None
    integrations: list[Integration] | None = Field(None, max_length=1)
    # Taper's own blocks (extra_body)
    environment: EnvironmentSpec | None = None
    tasks: TasksSpec | None = None
    rollout: RolloutSpec | None = None
    algorithm: AlgorithmSpec | None = None
    reward_schedule: RewardSchedule | None = None
    resources: ResourcesSpec | None = None
    tracking: TrackingSpec | None = None
    warm_start: WarmStartSpec | None = None
    hacking_monitor: HackingMonitorConfig | None = None
    infra_failures: InfraFailureConfig | None = None
    watchdog: WatchdogSpec | None = None
    total_steps: int | None = Field(None, ge=1, le=1_000_000)
    eval_every: int | None = Field(None, ge=0)
    checkpoint_every: int | None = Field(None, ge=1)
    keep_last_checkpoints: int | None = Field(None, ge=1, le=1000)
    priority: int | None = Field(None, ge=-100, le=100)


def _bad(param: str, message: str) -> InvalidInput:
    return InvalidInput(f"{param}: {message}", field=param)


def _set(blocks: dict[str, Any], path: str, value: Any, param: str) -> None:
    """Put ``value`` at the dotted ``path`` of the spec being built, unless extra_body already set it there."""
    *parents, leaf = path.split(".")
    node = blocks
    for name in parents:
        node = node.setdefault(name, {})
    if leaf in node:
        raise _bad(param, f"sets {path}, which the request also sets; give one of them")
    node[leaf] = value


def _model_spec(model: str) -> dict[str, Any]:
    return {"preset": model} if model in PRESETS else {"checkpoint": model}


def _apply_hyperparameters(blocks: dict[str, Any], hp: ReinforcementHyperparameters) -> None:
    param = "method.reinforcement.hyperparameters"
    if isinstance(hp.batch_size, int):
        _set(blocks, "rollout.prompts_per_step", hp.batch_size, f"{param}.batch_size")
    if isinstance(hp.learning_rate_multiplier, float | int):
        base = AlgorithmSpec.model_fields["learning_rate"].default
        _set(blocks, "algorithm.learning_rate", base * hp.learning_rate_multiplier,
             f"{param}.learning_rate_multiplier")
    if isinstance(hp.compute_multiplier, float | int):
        default = RolloutSpec.model_fields["num_generations"].default
        _set(blocks, "rollout.num_generations", max(2, round(default * hp.compute_multiplier)),
             f"{param}.compute_multiplier")
    if isinstance(hp.eval_interval, int):
        _set(blocks, "eval_every", hp.eval_interval, f"{param}.eval_interval")
    if isinstance(hp.eval_samples, int):
        _set(blocks, "tasks.num_eval", hp.eval_samples, f"{param}.eval_samples")
    if isinstance(hp.n_epochs, int):
        tasks = TasksSpec.model_validate(blocks.get("tasks", {}))
        batch = RolloutSpec.model_validate(blocks.get("rollout", {})).prompts_per_step
        _set(blocks, "total_steps", math.ceil(hp.n_epochs * tasks.num_train / batch), f"{param}.n_epochs")


def job_spec_of(request: FineTuningJobCreate) -> JobSpec:
    """The job spec of a create request (a 422 naming the OpenAI field that cannot be honoured)."""
    blocks = request.model_dump(exclude_unset=True, exclude_none=True, exclude={
        "model", "training_file", "validation_file", "seed", "suffix", "metadata", "method", "integrations"})
    blocks["model"] = _model_spec(request.model)
    for name, field in FILE_FIELDS.items():
        file_id = getattr(request, name)
        if file_id is None:
            continue
        if field not in TasksSpec.model_fields:
            raise _bad(name, "this server takes no uploaded task files; omit it to use the environment's tasks")
        _set(blocks, f"tasks.{field}", file_id, name)
    if request.seed is not None:
        blocks["seed"] = request.seed
    if request.suffix is not None:
        blocks["name"] = request.suffix
    if request.metadata is not None:
        blocks["metadata"] = request.metadata
    if request.method is not None and request.method.reinforcement.grader is not None:
        _set(blocks, "environment.grader", request.method.reinforcement.grader.model_dump(mode="json"),
             "method.reinforcement.grader")
    if request.method is not None:
        try:  # n_epochs reads the tasks block, which may be invalid itself
            _apply_hyperparameters(blocks, request.method.reinforcement.hyperparameters)
        except ValidationError as exc:
            raise invalid_from(exc, "tasks") from None
    for integration in request.integrations or []:
        _set(blocks, "tracking.wandb", integration.wandb.model_dump(), "integrations")
    try:
        return JobSpec.model_validate(blocks)
    except ValidationError as exc:
        raise invalid_from(exc) from None


def openai_status(job: JobRecord) -> str:
    """OpenAI's status of a job: `pausing` while a pause is pending; `starting` counts as running."""
    if job.state.has_driver and job.control == CONTROL_PAUSE:
        return "pausing"
    if job.state == JobState.STARTING:
        return "running"
    return job.state.value


def _int_time(ts: float | None) -> int | None:
    return None if ts is None else int(ts)


def _hyperparameters(spec: JobSpec) -> dict[str, Any]:
    base = AlgorithmSpec.model_fields["learning_rate"].default
    epochs = spec.total_steps * spec.rollout.prompts_per_step / spec.tasks.num_train
    return {
        "batch_size": spec.rollout.prompts_per_step,
        "learning_rate_multiplier": spec.algorithm.learning_rate / base,
        "n_epochs": int(epochs) if epochs == int(epochs) else None,
        "eval_interval": spec.eval_every or "auto",
        "eval_samples": spec.tasks.num_eval,
        "compute_multiplier": spec.rollout.num_generations / RolloutSpec.model_fields["num_generations"].default,
        "reasoning_effort": "default",
    }


def job_object(job: JobRecord) -> dict[str, Any]:
    """A `fine_tuning.job` object. `fine_tuned_model` is the succeeded job's id: as a `model` it names the job's
    newest checkpoint, so it starts the next job from there."""
    spec = job.spec
    hyperparameters = _hyperparameters(spec)
    status = openai_status(job)
    return {
        "object": "fine_tuning.job",
        "id": job.id,
        "model": spec.model.checkpoint or spec.model.preset,
        "created_at": int(job.created_at),
        "finished_at": _int_time(job.finished_at),
        "fine_tuned_model": job.id if job.state == JobState.SUCCEEDED else None,
        "organization_id": job.tenant,
        "result_files": [],
        "status": status,
        "trained_tokens": None,
        "training_file": getattr(spec.tasks, FILE_FIELDS["training_file"], None),
        "validation_file": getattr(spec.tasks, FILE_FIELDS["validation_file"], None),
        "seed": spec.seed,
        "hyperparameters": {k: hyperparameters[k] for k in ("batch_size", "learning_rate_multiplier", "n_epochs")},
        "error": ({"code": "job_failed", "message": job.error or "the job failed", "param": None}
                  if job.state == JobState.FAILED else None),
        "estimated_finish": None,
        "integrations": ([{"type": "wandb", "wandb": spec.tracking.wandb.model_dump()}]
                         if spec.tracking.wandb is not None else []),
        "metadata": spec.metadata or None,
        "method": {"type": "reinforcement",
                   "reinforcement": {"grader": spec.environment.grader, "hyperparameters": hyperparameters}},
        "user_provided_suffix": spec.name,
    }


_WARNING_KINDS = frozenset({"warning", "driver_lost", "driver_hung", "unschedulable", "quota_wait"})


def event_object(event: dict[str, Any]) -> dict[str, Any]:
    """A `fine_tuning.job.event`: our event's kind and data stay under `data`, a sentence becomes `message`."""
    kind, data = event["kind"], event["data"]
    if kind == "state":
        message = f"job {data.get('from')} -> {data.get('to')}" + (f": {data['reason']}" if data.get("reason") else "")
        failed = data.get("to") == JobState.FAILED
    else:
        detail = data.get("message") or json.dumps(data, default=str)[:500]
        message = f"{kind}: {detail}"
        failed = kind == "error"
    level = "error" if failed else "warn" if kind in _WARNING_KINDS or "message" in data else "info"
    return {"object": "fine_tuning.job.event", "id": event["id"], "created_at": int(event["ts"]), "level": level,
            "message": message, "data": {"kind": kind, **data}, "type": "metrics" if kind == "eval" else "message"}


def checkpoint_object(job_id: str, checkpoint: dict[str, Any]) -> dict[str, Any]:
    ref = f"{job_id}:{checkpoint['step']}"
    return {"object": "fine_tuning.job.checkpoint", "id": ref, "created_at": int(checkpoint["ts"]),
            "fine_tuned_model_checkpoint": ref, "fine_tuning_job_id": job_id, "step_number": checkpoint["step"],
            "metrics": {"step": checkpoint["step"]}}


def page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


class FineTuningJobs:
    """The fine-tuning job operations over a TaperService (which checks tenancy, quotas and states)."""

    def __init__(self, service: TaperService) -> None:
        self.service = service

    def create(self, p: Principal, request: FineTuningJobCreate) -> dict[str, Any]:
        job, _ = self.service.jobs.submit(p, job_spec_of(request))
        return job_object(job)

    def list(self, p: Principal, after: str | None, limit: int) -> dict[str, Any]:
        found = self.service.jobs.list_after(p, after, limit)
        if found is None:
            raise NotFound(f"after: no job {after!r} to list after", field="after")
        jobs, has_more = found
        return page([job_object(j) for j in jobs], has_more)

    def retrieve(self, p: Principal, job_id: str) -> dict[str, Any]:
        return job_object(self.service.jobs.get(p, job_id))

    def cancel(self, p: Principal, job_id: str) -> dict[str, Any]:
        return job_object(self.service.jobs.cancel(p, job_id))

    def pause(self, p: Principal, job_id: str) -> dict[str, Any]:
        return job_object(self.service.jobs.pause(p, job_id))

    def resume(self, p: Principal, job_id: str) -> dict[str, Any]:
        return job_object(self.service.jobs.resume(p, job_id))

    def events(self, p: Principal, job_id: str, after: str | None, limit: int) -> dict[str, Any]:
        """Newest first; ``after`` is the id of the last event of the previous page."""
        rows = self.service.jobs.events_newest_first(p, job_id, before=after, limit=limit + 1)
        return page([event_object(e) for e in rows[:limit]], len(rows) > limit)

    def checkpoints(self, p: Principal, job_id: str, after: str | None, limit: int) -> dict[str, Any]:
        """Newest first; ``after`` is the id of the last checkpoint of the previous page (`JOB_ID:STEP`)."""
        found = sorted(self.service.jobs.checkpoints(p, job_id), key=lambda c: c["step"], reverse=True)
        if after is not None:
            job, _, step = after.partition(":")
            if job != job_id:
                raise NotFound(f"after: {after!r} is not a checkpoint of job {job_id!r}", field="after")
            found = [c for c in found if c["step"] < int(step)]
        return page([checkpoint_object(job_id, c) for c in found[:limit]], len(found) > limit)


# OpenAI's error `type` by HTTP status
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error"}


def openai_error(status: int, message: str, code: str | None, param: str | None) -> tuple[int, dict[str, Any]]:
    """(status, body) of an error in OpenAI's shape."""
    return status, {"error": {"message": message, "type": ERROR_TYPES.get(status, "api_error"),
                              "param": param, "code": code}}


def openai_error_of(exc: ServiceError) -> tuple[int, dict[str, Any]]:
    return openai_error(exc.status, exc.message, exc.code, exc.field)
