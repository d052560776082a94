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
import re
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from reward_models.graders import Grader
from reward_models.monitor import HackingMonitorConfig
from reward_models.schedule import RewardSchedule
from rl_service.control.openai_results import (
    checkpoint_metrics,
    estimated_finish,
    job_of_result_file,
    result_file_id,
    results_csv,
    trained_tokens,
)
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
    WebhookSpec,
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


class Hyperparameters(_Strict):
    """OpenAI's hyperparameters common to every method (also the deprecated top-level `hyperparameters`)."""

    batch_size: Auto | Annotated[int, Field(ge=1, le=4096)] | None = Field(
        None, description="rollout.prompts_per_step")
    learning_rate_multiplier: Auto | Annotated[float, Field(gt=0.0, le=1e6)] | None = Field(
        None, description="algorithm.learning_rate = multiplier x the default learning rate (TRL's 1e-6)")
    n_epochs: Auto | Annotated[int, Field(ge=1, le=1000)] | None = Field(
        None, description="total_steps = ceil(n_epochs x tasks / batch_size), the tasks of training_file (else "
        "tasks.num_train)")


class ReinforcementHyperparameters(Hyperparameters):
    """OpenAI's reinforcement hyperparameters, each mapped onto a job spec field ("auto": the spec's default)."""
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


class Supervised(_Strict):
    hyperparameters: Hyperparameters = Field(
        default_factory=Hyperparameters, description="batch_size: warm_start.batch_size; learning_rate_multiplier: "
        "x the warm start's default rate; n_epochs (default 3): SFT steps = ceil(n_epochs x demonstrations / batch).")


class FineTuningMethod(_Strict):
    type: Literal["reinforcement", "supervised", "dpo"] = Field(
        description="reinforcement (Taper's RL), or supervised (SFT with TRL's SFTTrainer on the training file's "
        "demonstrations, OpenAI's chat format); dpo is not offered (a 422).")
    reinforcement: Reinforcement | None = None
    supervised: Supervised | None = None
    dpo: dict[str, Any] | None = Field(None, description="Not offered.")

    @model_validator(mode="after")
    def _one_block(self) -> FineTuningMethod:
        for name in ("reinforcement", "supervised", "dpo"):
            if name != self.type and getattr(self, name) is not None:
                raise ValueError(f"{name}: given with type {self.type!r}; give the block of the method's type")
        return self

    @property
    def rl(self) -> Reinforcement:
        return self.reinforcement or Reinforcement()


class Integration(_Strict):
    """OpenAI's W&B integration: the job's metrics go to this W&B project (tracking.wandb)."""

    type: Literal["wandb"]
    wandb: WandbTracking


class FineTuningJobCreate(_Strict):
    """POST /v1/fine_tuning/jobs. OpenAI's fields, then Taper's own (sent with the client's `extra_body`)."""

    model: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,96}$", description="A preset (tiny, small, large), a "
                       "checkpoint (`JOB_ID`, `JOB_ID:STEP`: e.g. a job's fine_tuned_model), `base:NAME`, or a name "
                       "the operator made an alias of one (e.g. the OpenAI model an RFT script names).")
    training_file: str | None = Field(
        None, pattern=FILE_ID,
        description="A file id of purpose fine-tune (JSONL tasks); omit (null) to use the environment's generator.")
    validation_file: str | None = Field(None, pattern=FILE_ID, description="Held-out tasks, a file id.")
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    suffix: str | None = Field(None, min_length=1, max_length=64, description="Becomes the job's name.")
    metadata: Metadata | None = None
    method: FineTuningMethod | None = None
    integrations: list[Integration] | None = Field(None, max_length=1)
    hyperparameters: Hyperparameters | None = Field(
        None, description="Deprecated by OpenAI in favour of method's hyperparameters, still accepted: merged "
        "into them (a field given in both places is refused).")
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
    webhooks: list[WebhookSpec] | None = Field(None, max_length=4)


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


def _merged_hyperparameters(request: FineTuningJobCreate, method: Hyperparameters, param: str) -> Any:
    """The method's hyperparameters with the deprecated top-level ones merged in."""
    top = request.hyperparameters
    if top is None:
        return method
    given = top.model_dump(exclude_none=True)
    for name in given:
        if getattr(method, name) is not None:
            raise _bad(f"hyperparameters.{name}", f"also given in {param}; give it in one place")
    return method.model_copy(update=given)


def _apply_hyperparameters(blocks: dict[str, Any], hp: ReinforcementHyperparameters, train_tasks: int | None) -> None:
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
        count = train_tasks if tasks.train_file is not None and train_tasks is not None else tasks.num_train
        _set(blocks, "total_steps", math.ceil(hp.n_epochs * count / batch), f"{param}.n_epochs")


SUPERVISED_EPOCHS = 3  # n_epochs "auto" of a supervised job
FileMeta = Callable[[str], dict[str, Any] | None]


def method_of(request: FineTuningJobCreate, file_meta: FileMeta) -> str:
    """The request's method; without one, as OpenAI: supervised when the training file holds only
    demonstrations (conversations ending with the assistant's turn), else Taper's reinforcement."""
    if request.method is not None:
        return request.method.type
    meta = file_meta(request.training_file) if request.training_file else None
    whole = meta is not None and 0 < meta.get("demonstrations", 0) == meta.get("tasks")
    return "supervised" if whole else "reinforcement"


def _common_blocks(request: FineTuningJobCreate) -> dict[str, Any]:
    blocks = request.model_dump(exclude_unset=True, exclude_none=True, exclude={
        "model", "training_file", "validation_file", "seed", "suffix", "metadata", "method", "integrations",
        "hyperparameters"})
    blocks["model"] = _model_spec(request.model)
    if request.seed is not None:
        blocks["seed"] = request.seed
    if request.suffix is not None:
        blocks["name"] = request.suffix
    if request.metadata is not None:
        blocks["metadata"] = request.metadata
    for integration in request.integrations or []:
        _set(blocks, "tracking.wandb", integration.wandb.model_dump(), "integrations")
    return blocks


def _reinforcement_blocks(request: FineTuningJobCreate, blocks: dict[str, Any], file_meta: FileMeta) -> None:
    for name, field in FILE_FIELDS.items():
        file_id = getattr(request, name)
        if file_id is not None:
            _set(blocks, f"tasks.{field}", file_id, name)
    rl = request.method.rl if request.method is not None else Reinforcement()
    if rl.grader is not None:
        _set(blocks, "environment.grader", rl.grader.model_dump(mode="json"), "method.reinforcement.grader")
    train_file = blocks.get("tasks", {}).get("train_file")
    meta = file_meta(train_file) if isinstance(train_file, str) else None
    hp = _merged_hyperparameters(request, rl.hyperparameters, "method.reinforcement.hyperparameters")
    try:  # n_epochs reads the tasks block, which may be invalid itself
        _apply_hyperparameters(blocks, hp, int(meta["tasks"]) if meta else None)
    except ValidationError as exc:
        raise invalid_from(exc, "tasks") from None


def _supervised_blocks(request: FineTuningJobCreate, blocks: dict[str, Any], file_meta: FileMeta) -> None:
    """SFT on the training file's demonstrations: the job's warm start is all it runs."""
    if request.training_file is None:
        raise _bad("training_file", "a supervised job learns from a file of demonstrations (chat lines ending with "
                                    "the assistant's turn); upload one and name it")
    if request.validation_file is not None:
        raise _bad("validation_file", "a supervised job here is not evaluated on a validation file; omit it")
    param = "method.supervised.hyperparameters"
    method = request.method.supervised if request.method is not None and request.method.supervised else Supervised()
    hp = _merged_hyperparameters(request, method.hyperparameters, param)
    blocks["method"] = "supervised"
    _set(blocks, "warm_start.demonstrations", request.training_file, "training_file")
    ws = blocks["warm_start"]
    ws.setdefault("until_loss", None)  # the epochs asked for, not an early stop
    if isinstance(hp.batch_size, int):
        _set(blocks, "warm_start.batch_size", hp.batch_size, f"{param}.batch_size")
    if isinstance(hp.learning_rate_multiplier, float | int):
        base = WarmStartSpec.model_fields["learning_rate"].default
        _set(blocks, "warm_start.learning_rate", base * hp.learning_rate_multiplier,
             f"{param}.learning_rate_multiplier")
    meta = file_meta(request.training_file)
    if meta is not None and "max_steps" not in ws:
        epochs = hp.n_epochs if isinstance(hp.n_epochs, int) else SUPERVISED_EPOCHS
        batch = ws.get("batch_size", WarmStartSpec.model_fields["batch_size"].default)
        ws["max_steps"] = max(1, math.ceil(epochs * int(meta.get("demonstrations", 0)) / batch))
    elif isinstance(hp.n_epochs, int):
        raise _bad(f"{param}.n_epochs", "sets warm_start.max_steps, which the request also sets; give one of them")


def resolve_model(model: str, aliases: dict[str, str]) -> str:
    """A request's `model`, its alias resolved; a 422 naming `model` for a name that is none of Taper's."""
    model = aliases.get(model, model)
    if not re.fullmatch(MODEL, model):
        offered = ", ".join([*PRESETS, *sorted(aliases)])
        raise _bad("model", f"no model {model!r}: give a preset, a checkpoint (JOB_ID or JOB_ID:STEP), base:NAME or "
                            f"an alias the operator set (offered: {offered}; GET /v1/models lists them)")
    return model


def job_spec_of(request: FineTuningJobCreate, file_meta: FileMeta = lambda _: None,
                aliases: dict[str, str] | None = None) -> JobSpec:
    """The job spec of a create request (a 422 naming the OpenAI field that cannot be honoured).
    ``file_meta`` answers an uploaded file's object (None: unknown), for `n_epochs` and the default method;
    ``aliases`` maps the operator's other model names to Taper's."""
    request = request.model_copy(update={"model": resolve_model(request.model, aliases or {})})
    method = method_of(request, file_meta)
    if method == "dpo":
        raise _bad("method.type", "dpo is not offered: Taper trains with reinforcement or supervised")
    blocks = _common_blocks(request)
    if method == "supervised":
        _supervised_blocks(request, blocks, file_meta)
    else:
        _reinforcement_blocks(request, blocks, file_meta)
    try:
        return JobSpec.model_validate(blocks)
    except ValidationError as exc:
        raise invalid_from(exc) from None


_METADATA_PARAM = re.compile(r"^metadata\[(.{1,64})\]$")


def metadata_filter(query: Sequence[tuple[str, str]]) -> dict[str, str]:
    """`metadata[KEY]=VALUE` query parameters as a dict (bounded as `metadata` itself: 16 pairs, 64/512 chars)."""
    pairs: dict[str, str] = {}
    for name, value in query:
        m = _METADATA_PARAM.match(name)
        if name.startswith("metadata") and m is None:
            raise _bad(name[:80], "a metadata filter is metadata[KEY]=VALUE, KEY of 1 to 64 characters")
        if m is None:
            continue
        if len(value) > 512:
            raise _bad(name, "a metadata value has at most 512 characters")
        pairs[m.group(1)] = value
    if len(pairs) > 16:
        raise _bad("metadata", "at most 16 metadata filters (metadata holds at most 16 pairs)")
    return pairs


def openai_status(job: JobRecord) -> str:
    """OpenAI's status of a job: `pausing` while a pause is pending; `starting` counts as running."""
    if job.state.has_driver and job.control == CONTROL_PAUSE:
        return "pausing"
    if job.state == JobState.STARTING:
        return "running"
    return job.state.value


def _int_time(ts: float | None) -> int | None:
    return None if ts is None else int(ts)


def held_out_tasks(tasks: TasksSpec) -> int | None:
    """How many held-out tasks the job evaluates on (None: it has none)."""
    if tasks.eval_file is not None:
        return tasks.eval_tasks
    if tasks.train_file is not None:
        return None  # an uploaded training file alone: no generated held-out set (runner.job_tasks)
    return tasks.num_eval or None


def _hyperparameters(spec: JobSpec) -> dict[str, Any]:
    base = AlgorithmSpec.model_fields["learning_rate"].default
    train_tasks = spec.tasks.train_tasks if spec.tasks.train_file is not None else spec.tasks.num_train
    epochs = spec.total_steps * spec.rollout.prompts_per_step / train_tasks if train_tasks else 0.0
    return {
        "batch_size": spec.rollout.prompts_per_step,
        "learning_rate_multiplier": spec.algorithm.learning_rate / base,
        "n_epochs": int(epochs) if epochs and epochs == int(epochs) else None,
        "eval_interval": spec.eval_every or "auto",
        "eval_samples": held_out_tasks(spec.tasks),
        "compute_multiplier": spec.rollout.num_generations / RolloutSpec.model_fields["num_generations"].default,
        "reasoning_effort": "default",
    }


def job_object(job: JobRecord, tokens: int | None = None) -> dict[str, Any]:
    """A `fine_tuning.job` object. `fine_tuned_model` is the succeeded job's id: as a `model` it names the job's
    newest checkpoint, so it starts the next job from there. ``tokens``: the finished job's trained tokens
    (its result file is listed then)."""
    spec = job.spec
    hyperparameters = _hyperparameters(spec)
    status = openai_status(job)
    out = {
        "object": "fine_tuning.job",
        "id": job.id,
        "model": spec.model.checkpoint or spec.model.preset,
        "created_at": int(job.created_at),
        "finished_at": _int_time(job.finished_at),
        "fine_tuned_model": job.id if job.state == JobState.SUCCEEDED else None,
        "organization_id": job.tenant,
        "result_files": [result_file_id(job.id)] if job.state.is_terminal and tokens is not None else [],
        "status": status,
        "trained_tokens": tokens if job.state.is_terminal else None,
        "training_file": getattr(spec.tasks, FILE_FIELDS["training_file"], None),
        "validation_file": getattr(spec.tasks, FILE_FIELDS["validation_file"], None),
        "seed": spec.seed,
        "hyperparameters": {k: hyperparameters[k] for k in ("batch_size", "learning_rate_multiplier", "n_epochs")},
        "error": ({"code": "job_failed", "message": job.error or "the job failed", "param": None}
                  if job.state == JobState.FAILED else None),
        "estimated_finish": estimated_finish(job),
        "integrations": ([{"type": "wandb", "wandb": spec.tracking.wandb.model_dump()}]
                         if spec.tracking.wandb is not None else []),
        "metadata": spec.metadata or None,
        "method": {"type": "reinforcement",
                   "reinforcement": {"grader": spec.environment.grader, "hyperparameters": hyperparameters}},
        "user_provided_suffix": spec.name,
    }
    if spec.method == "supervised":
        _as_supervised(out, spec)
    return out


def _as_supervised(out: dict[str, Any], spec: JobSpec) -> None:
    """A supervised job's training file and hyperparameters (its warm start's)."""
    ws = spec.warm_start
    assert ws is not None
    base = WarmStartSpec.model_fields["learning_rate"].default
    epochs = ws.max_steps * ws.batch_size / ws.demonstrations_count if ws.demonstrations_count else 0.0
    hyperparameters = {"batch_size": ws.batch_size, "learning_rate_multiplier": ws.learning_rate / base,
                       "n_epochs": round(epochs) if epochs else None}
    out.update(training_file=ws.demonstrations, validation_file=None, hyperparameters=hyperparameters,
               method={"type": "supervised", "supervised": {"hyperparameters": hyperparameters}})


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


def checkpoint_object(job_id: str, checkpoint: dict[str, Any], rows: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    ref = f"{job_id}:{checkpoint['step']}"
    return {"object": "fine_tuning.job.checkpoint", "id": ref, "created_at": int(checkpoint["ts"]),
            "fine_tuned_model_checkpoint": ref, "fine_tuning_job_id": job_id, "step_number": checkpoint["step"],
            "metrics": checkpoint_metrics(checkpoint["step"], rows or [])}


def page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


_TOKENS: dict[tuple[str, float | None], int] = {}  # (job, finished_at) -> trained tokens of a finished job


class FineTuningJobs:
    """The fine-tuning job operations over a TaperService (which checks tenancy, quotas and states)."""

    def __init__(self, service: TaperService) -> None:
        self.service = service

    def _rows(self, p: Principal, job_id: str) -> list[dict[str, Any]]:
        """Every metrics row the store keeps of the job."""
        rows: list[dict[str, Any]] = []
        while True:
            page = self.service.jobs.metrics(p, job_id, rows[-1]["id"] if rows else None, 5000)
            rows += page
            if len(page) < 5000:
                return rows

    def _object(self, p: Principal, job: JobRecord) -> dict[str, Any]:
        if not job.state.is_terminal:
            return job_object(job)
        key = (job.id, job.finished_at)
        if key not in _TOKENS:  # a finished job's rows no longer change
            if len(_TOKENS) > 10_000:
                _TOKENS.clear()
            _TOKENS[key] = trained_tokens(self._rows(p, job.id))
        return job_object(job, _TOKENS[key])

    def result_file(self, p: Principal, file_id: str) -> tuple[dict[str, Any], bytes] | None:
        """The file object and CSV of a finished job's result file (None: not one of the tenant's)."""
        job_id = job_of_result_file(file_id)
        if job_id is None:
            return None
        try:
            job = self.service.jobs.get(p, job_id)
        except NotFound:
            return None
        if not job.state.is_terminal:
            return None
        content = results_csv(self._rows(p, job_id))
        meta = {"id": file_id, "object": "file", "bytes": len(content), "created_at": int(job.finished_at or 0),
                "filename": f"{job_id}-results.csv", "purpose": "fine-tune-results", "status": "processed",
                "tasks": 0}
        return meta, content

    def create(self, p: Principal, request: FineTuningJobCreate, idempotency_key: str | None = None) -> dict[str, Any]:
        spec = job_spec_of(request, lambda file_id: self.service.files.describe(p, file_id), self.service.model_aliases)
        job, _ = self.service.jobs.submit(p, spec, idempotency_key)
        return job_object(job)

    def list(self, p: Principal, after: str | None, limit: int,
             metadata: dict[str, str] | None = None) -> dict[str, Any]:
        """Newest first after the job ``after``; with ``metadata``, only the jobs whose metadata holds it."""
        if not metadata:
            found = self.service.jobs.list_after(p, after, limit)
            if found is None:
                raise NotFound(f"after: no job {after!r} to list after", field="after")
            jobs, has_more = found
            return page([self._object(p, j) for j in jobs], has_more)
        matched: list[JobRecord] = []
        cursor, more = after, True
        while more and len(matched) <= limit:
            found = self.service.jobs.list_after(p, cursor, 200)
            if found is None:
                raise NotFound(f"after: no job {after!r} to list after", field="after")
            batch, more = found
            matched += [j for j in batch if metadata.items() <= (j.spec.metadata or {}).items()]
            cursor = batch[-1].id if batch else cursor
        return page([self._object(p, j) for j in matched[:limit]], len(matched) > limit)

    def retrieve(self, p: Principal, job_id: str) -> dict[str, Any]:
        return self._object(p, self.service.jobs.get(p, job_id))

    def cancel(self, p: Principal, job_id: str) -> dict[str, Any]:
        return self._object(p, self.service.jobs.cancel(p, job_id))

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
        rows = self._rows(p, job_id) if found else []
        return page([checkpoint_object(job_id, c, rows) for c in found[:limit]], len(found) > limit)


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
