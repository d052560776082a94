"""The RL job specification: what a user submits (POST /v1/jobs, `taper submit FILE.yaml`).

Field names follow TRL's GRPOConfig where the meaning is the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, WithJsonSchema, model_validator

from reward_models.monitor import HackingMonitorConfig
from reward_models.schedule import RewardSchedule


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


BASE_MODEL_NAME = r"[A-Za-z0-9_.-]{1,64}"
# `JOB_ID` (its newest checkpoint), `JOB_ID:STEP`, or `base:NAME` (a base model the operator registered).
CHECKPOINT_REF = rf"^(job-[0-9a-f]{{16}}(:[0-9]{{1,9}})?|base:{BASE_MODEL_NAME})$"


def checkpoint_ref(job_id: str, step: int) -> str:
    """How a tenant names a job's checkpoint (`model.checkpoint`, events, the job object): `JOB_ID:STEP`."""
    return f"{job_id}:{step}"


# At most 16 string pairs, keys up to 64 characters, values up to 512 (OpenAI's `metadata` limits).
Metadata = Annotated[
    dict[Annotated[str, StringConstraints(min_length=1, max_length=64)], Annotated[str, StringConstraints(max_length=512)]],
    Field(max_length=16),
]


class ModelOverrides(_Strict):
    """The TaperConfig fields a tenant may change: architecture sizes (the operator caps some further)."""

    hidden_size: int | None = Field(None, ge=16, le=16384)
    num_hidden_layers: int | None = Field(None, ge=1, le=256)
    intermediate_size: int | None = Field(None, ge=1, le=65536, description="Dense MLP width.")
    kda_num_heads: int | None = Field(None, ge=1, le=256)
    num_attention_heads: int | None = Field(None, ge=1, le=256, description="MLA heads.")
    n_routed_experts: int | None = Field(None, ge=1, le=1024)
    num_experts_per_tok: int | None = Field(None, ge=1, le=64)
    moe_intermediate_size: int | None = Field(None, ge=1, le=65536)


class ModelSpec(_Strict):
    preset: Literal["tiny", "small", "large"] = "tiny"
    checkpoint: str | None = Field(
        None, pattern=CHECKPOINT_REF,
        description="Start from a checkpoint of one of your jobs (`JOB_ID` for its newest, `JOB_ID:STEP`) or from a "
                    "base model the operator registered (`base:NAME`), instead of the preset's fresh weights.")
    checkpoint_dir: str | None = Field(
        None, description="Set by the service: the directory `checkpoint` resolved to at submit time.")
    overrides: ModelOverrides = Field(default_factory=ModelOverrides, description="Preset field overrides.")


class EnvironmentSpec(_Strict):
    name: str = Field("calculator", min_length=1, max_length=64, description="A built-in or registered environment.")
    options: dict[str, Any] = Field(default_factory=dict, description="Passed to the environment's constructor / task generator.")
    grader: dict[str, Any] | None = Field(
        None, description="A declared outcome grader for this job (string_check, text_similarity, numeric, regex, "
                          "json_match, python, http, multi), instead of the registration's or the verifier.")
    process_rewards: list[dict[str, Any]] | None = Field(
        None, max_length=16, description="Declared per-step process components for this job (tool_called, "
                                         "tool_args_match), instead of the registration's.")
    # Set by the control plane, never by a submission: the request schema says null.
    registration: Annotated[dict[str, Any] | None, WithJsonSchema({"type": "null"}, mode="validation")] = Field(
        None,
        description="The EnvironmentRegistration of a registered (non built-in) environment, resolved by the "
        "control plane at submit time so the job runs without reading the registry.",
    )


FILE_ID = r"^file-[0-9a-f]{24}$"
_SET_BY_SERVICE = WithJsonSchema({"type": "null"}, mode="validation")


class TasksSpec(_Strict):
    seed: int = 0
    num_train: int = Field(2000, ge=1, le=1_000_000, description="Generated training tasks (not used with train_file).")
    num_eval: int = Field(100, ge=0, le=100_000,
                          description="Generated held-out tasks (not used with eval_file; none with train_file alone).")
    options: dict[str, Any] = Field(default_factory=dict, description="Task generator options (e.g. difficulty).")
    train_file: str | None = Field(None, pattern=FILE_ID,
                                   description="An uploaded task file (POST /v1/files) to train on instead of generated tasks.")
    eval_file: str | None = Field(None, pattern=FILE_ID, description="An uploaded task file of held-out tasks.")
    # Set by the control plane, never by a submission: where the named files are stored.
    train_path: Annotated[str | None, _SET_BY_SERVICE] = Field(None, description="Set by the service from train_file.")
    eval_path: Annotated[str | None, _SET_BY_SERVICE] = Field(None, description="Set by the service from eval_file.")
    train_tasks: Annotated[int | None, _SET_BY_SERVICE] = Field(None, description="Set by the service: train_file's tasks.")
    eval_tasks: Annotated[int | None, _SET_BY_SERVICE] = Field(None, description="Set by the service: eval_file's tasks.")


class RolloutSpec(_Strict):
    num_workers: int = Field(1, ge=1, le=256)
    prompts_per_step: int = Field(8, ge=1, le=4096, description="Distinct tasks per training step.")
    num_generations: int = Field(8, ge=1, le=256, description="Group size: samples per task (TRL's num_generations).")
    max_turns: int = Field(4, ge=1, le=256)
    max_tokens_per_turn: int = Field(64, ge=1, le=65536, description="Capped by what is left of max_total_tokens.")
    max_total_tokens: int = Field(512, ge=16, le=1_048_576)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    tool_timeout_s: float = Field(5.0, gt=0.0, le=3600.0)
    engine: Literal["vllm"] = Field("vllm", description="The rollout engine: vLLM (the only one).")
    kv_cache_gib: float = Field(1.0, gt=0.0, le=1024.0)
    async_mode: bool = Field(False, description="Generate step t+1 while the learner trains step t.")
    max_staleness: int = Field(1, ge=0, le=16, description="Max policy-version lag of a trajectory used in training.")


LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo"]
# Fields of TRL's GRPOConfig that the job spec keeps in `rollout` (sampling is the rollout workers' business):
# given in `algorithm` they move there, so a GRPOConfig mapping can be pasted whole.
ROLLOUT_FIELDS_OF_GRPO_CONFIG = ("num_generations", "temperature", "top_p")


class AlgorithmSpec(_Strict):
    """The learning algorithm: TRL 1.16's `GRPOConfig` field names and defaults wherever the concept is the same
    (the learner's one configuration; `rl_service.training.learner.LearnerConfig` adds only what the rest of the
    job spec fixes). Taper's own fields (credit assignment, micro-batching) are marked as such."""

    loss_type: LossType = Field(
        "dapo", description="How token losses aggregate (TRL's names). grpo: mean over sequences of each "
        "sequence's token mean; dapo: token mean over the global batch; dr_grpo: token sum / (sequences x "
        "max_completion_length); bnpo: token mean of each micro-batch, averaged over micro-batches.")
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="token: one ratio per token; sequence: exp(mean log-ratio) per sequence (GSPO).")
    learning_rate: float = Field(1e-6, gt=0.0, le=1.0, description="AdamW's initial learning rate.")
    lr_scheduler_type: Literal["constant", "linear", "cosine", "constant_with_warmup"] = Field(
        "linear", description="The learning-rate schedule over total_steps x num_iterations optimizer steps.")
    warmup_steps: int = Field(0, ge=0, le=1_000_000)
    weight_decay: float = Field(0.0, ge=0.0, le=10.0)
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0)
    adam_epsilon: float = Field(1e-8, gt=0.0, le=1.0)
    max_grad_norm: float = Field(1.0, gt=0.0, le=1e6)
    epsilon: float = Field(0.2, gt=0.0, le=10.0, description="Lower clip: ratio >= 1 - epsilon.")
    epsilon_high: float | None = Field(
        None, gt=0.0, le=10.0, description="Upper clip: ratio <= 1 + epsilon_high (null: epsilon; DAPO uses 0.28).")
    beta: float = Field(0.0, ge=0.0, le=10.0, description="KL coefficient to the frozen reference policy (k3).")
    num_iterations: int = Field(1, ge=1, le=16, description="Optimizer passes over each batch (TRL's mu).")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Divide the centred outcome by the group's std, the batch's, or nothing.")
    max_completion_length: int | None = Field(
        None, ge=1, le=1_048_576, description="dr_grpo's normaliser (null: rollout.max_total_tokens).")
    vllm_importance_sampling_correction: bool = Field(
        True, description="Weight each token by the learner/rollout probability ratio (vllm_importance_sampling_mode).")
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = (
        Field("sequence_mask", description="truncate: clip the ratio to [clip_min, clip_max]; mask: zero the "
                                           "tokens (or sequences) outside it; per token or per sequence."))
    # The ratio clip brackets 1 (the on-policy ratio), so the bounds alone keep clip_min < clip_max.
    vllm_importance_sampling_clip_min: float | None = Field(None, ge=0.0, lt=1.0)
    vllm_importance_sampling_clip_max: float | None = Field(3.0, gt=1.0, le=1e6)
    num_generations: int | None = Field(
        None, ge=1, le=256, description="Accepted as in GRPOConfig; stored as rollout.num_generations.")
    temperature: float | None = Field(
        None, ge=0.0, le=10.0, description="Accepted as in GRPOConfig; stored as rollout.temperature.")
    top_p: float | None = Field(
        None, gt=0.0, le=1.0, description="Accepted as in GRPOConfig; stored as rollout.top_p.")
    # Taper's own
    micro_batch_tokens: int = Field(
        8192, ge=1, le=16_777_216, description="Taper: padded-token budget of one micro-batch (gradient "
                                                "accumulation; the loss is exact whatever its size).")
    credit_assignment: Literal["decoupled", "summed"] = Field(
        "decoupled",
        description="Taper: decoupled: A = A_outcome + w(t)*A_process (docs/design.md §6). summed: the naive baseline.",
    )
    process_scale: Literal["batch", "fixed"] = Field("batch", description="Taper: how process advantages scale.")
    gamma: float | None = Field(
        None, ge=0.0, le=1.0, description="Taper: discount for process returns-to-go; null = the step only.")
    compile_layers: Literal["auto", "stack", "parts", "none"] = Field(
        "auto", description="Taper: torch.compile of the learner's layers. auto: the layer stack as one graph "
        "(shapes dynamic, so a new micro-batch shape does not recompile) where one learner trains on a CUDA "
        "device, eager on CPU and for data-parallel ranks; stack / parts: always; none: eager.")

    @model_validator(mode="before")
    @classmethod
    def _older_names(cls, data: Any) -> Any:
        """Names of earlier Taper releases, kept for stored jobs: loss_type "gspo" is grpo with sequence-level
        importance sampling; vllm_importance_sampling_cap is TRL's deprecated name of ..._clip_max (truncating
        per token)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("loss_type") == "gspo":
            data["loss_type"] = "grpo"
            data.setdefault("importance_sampling_level", "sequence")
        if "vllm_importance_sampling_cap" in data:
            data.setdefault("vllm_importance_sampling_clip_max", data.pop("vllm_importance_sampling_cap"))
            data.setdefault("vllm_importance_sampling_mode", "token_truncate")
        return data

    @model_validator(mode="after")
    def _check_clip_range(self) -> AlgorithmSpec:
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and high is not None and low >= high:
            raise ValueError(f"vllm_importance_sampling_clip_min ({low}) must be less than "
                             f"vllm_importance_sampling_clip_max ({high})")
        if self.vllm_importance_sampling_mode.endswith("truncate") and low is None and high is None:
            raise ValueError("vllm_importance_sampling_clip_max: a *_truncate mode needs clip_min or clip_max")
        return self

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def epsilon_up(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


class MixedPhaseSpec(_Strict):
    """An optional second warm-start phase on a mix of demonstrations and answers without tools."""

    steps: int = Field(40, ge=1, le=100_000, description="Optimizer steps of this phase.")
    tool_use_fraction: float = Field(
        0.25, ge=0.0, le=1.0,
        description="Share of the conversations that keep their tool calls; the rest state the task's `answer` "
                    "directly. A warm start that rarely calls tools leaves RL something to learn (the demo uses it).")
    learning_rate: float = Field(1e-3, gt=0.0, le=1.0)


class WarmStartSpec(_Strict):
    """Supervised fine-tuning on demonstrations before RL: a fresh model never writes a well-formed tool call,
    so RL alone learns nothing from it. Runs once per job, before step 0; a resumed job does not repeat it."""

    demonstrations: Literal["environment"] | Annotated[str, StringConstraints(pattern=FILE_ID)] = Field(
        "environment", description="`environment`: the environment's `demonstration(task)` (an HTTP server's "
        "/demonstration) on training tasks drawn with another seed than the job's. A file id: the uploaded "
        "file's demonstrations (lines in OpenAI's supervised chat format, ending with the assistant's turn; tool "
        "calls as `tool_calls`), for any environment kind.")
    num_examples: int = Field(500, ge=1, le=100_000, description="Tasks turned into demonstrations (environment "
                                                                  "demonstrations only: a file's are all used).")
    max_steps: int = Field(300, ge=1, le=100_000, description="Most optimizer steps.")
    until_loss: float | None = Field(
        0.05, gt=0.0, description="Stop early once the mean loss of the last 10 steps is under this (null: never).")
    learning_rate: float = Field(3e-3, gt=0.0, le=1.0)
    batch_size: int = Field(16, ge=1, le=1024)
    mixed_phase: MixedPhaseSpec | None = None
    demonstrations_path: Annotated[str | None, _SET_BY_SERVICE] = Field(
        None, description="Set by the service from a demonstrations file id.")
    demonstrations_count: Annotated[int | None, _SET_BY_SERVICE] = Field(
        None, description="Set by the service: the demonstrations in that file.")


class InfraFailureConfig(_Strict):
    """When rollouts fail for infrastructure reasons (environment errors, tool timeouts) the job warns, then
    pauses itself with the cause as its error, instead of training on nothing (rl_service.training.infra_guard)."""

    warn_fraction: float = Field(
        0.5, ge=0.0, lt=1.0,
        description="A step whose share of infrastructure-failure trajectories exceeds this is failing.")
    warn_after_steps: int = Field(
        3, ge=1, le=10_000,
        description="Failing steps in a row before a warning event (a step on which every group failed warns at once).")
    pause_after_steps: int = Field(
        5, ge=0, le=10_000,
        description="Failing steps in a row after which the job pauses itself, resumable once the environment "
                    "is back (0: never pause).")


class WatchdogSpec(_Strict):
    """Deadlines past which a live but silent part of a job counts as hung, and how often training restarts from
    its last checkpoint when a learner rank dies or hangs. Unset deadlines are derived from the job's sizes."""

    rollout_chunk_s: float | None = Field(
        None, gt=0.0, le=86_400.0,
        description="A rollout worker that returns no result for this long is replaced and its groups rerun. "
                    "Default: 300 s + max_turns x (tool_timeout_s + 0.5 s x max_tokens_per_turn).")
    learner_rank_s: float | None = Field(
        None, gt=0.0, le=86_400.0,
        description="A data-parallel learner call that no rank answers for this long restarts training from the "
                    "last checkpoint. Default: 600 s + 0.05 s per token a rank trains in one step.")
    max_training_restarts: int = Field(
        2, ge=0, le=10, description="Restarts from the last checkpoint after a learner rank died or hung; one "
                                    "more failure fails the job.")


Name = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:/ -]+$")]


class MLflowTracking(_Strict):
    """Log the job's metrics to MLflow, at the tracking server the operator configured (MLFLOW_TRACKING_URI on
    the cluster; a tenant never chooses where the cluster connects)."""

    experiment: Name = "taper"
    run_name: Name | None = Field(None, description="Default: the job id.")


class WandbTracking(_Strict):
    """Log the job's metrics to Weights & Biases with the operator's credentials (WANDB_API_KEY on the cluster)."""

    project: Name
    entity: Name | None = None
    name: Name | None = Field(None, description="The run's name; default: the job id.")
    tags: list[Annotated[str, StringConstraints(min_length=1, max_length=64)]] = Field(default_factory=list,
                                                                                         max_length=16)


class TrackingSpec(_Strict):
    """Where the job's metrics go besides the service: TensorBoard event files in the job's work dir always;
    MLflow and W&B when asked and installed on the cluster (the `tracking` extra), else a warning event."""

    mlflow: MLflowTracking | None = None
    wandb: WandbTracking | None = None


RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
# What _check_custom enforces, declared for the JSON Schema too; bounded in number and size.
CustomResources = Annotated[
    dict[
        Annotated[str, StringConstraints(min_length=1, max_length=64),
                  Field(json_schema_extra={"not": {"enum": list(RAY_BUILTIN_RESOURCES)}})],
        Annotated[float, Field(gt=0.0, le=1e6)],
    ],
    Field(max_length=16),
]


class ResourcesSpec(_Strict):
    rollout_cpus: float = Field(1.0, gt=0.0, le=1024.0, description="CPUs per rollout worker.")
    rollout_gpus: float = Field(
        0.0, ge=0.0, le=64.0, description="GPUs per rollout worker. Below 1, the worker's engine shares a device "
        "(with the learner, or other workers) and takes this share of the device's memory (vLLM's "
        "gpu_memory_utilization).")
    learner_cpus: float = Field(1.0, gt=0.0, le=1024.0)
    learner_gpus: float = Field(
        0, ge=0, le=64, description="GPUs per learner rank: a whole number, or (one learner rank) a share of one "
        "device below 1, so the learner and the rollout engines share it, e.g. 0.5 with rollout_gpus 0.4.")
    num_learners: int = Field(1, ge=1, le=1024, description="Data-parallel learner ranks.")
    rollout_custom: CustomResources = Field(
        default_factory=dict, description="Custom Ray resources each rollout worker needs, e.g. {'rollout': 1}.")
    learner_custom: CustomResources = Field(
        default_factory=dict, description="Custom Ray resources each learner rank needs, e.g. {'learner': 1}.")
    custom: CustomResources = Field(
        default_factory=dict, description="Older name of rollout_custom (merged into it; rollout_custom wins).")

    @model_validator(mode="after")
    def _check_gpus(self) -> ResourcesSpec:
        if self.learner_gpus != int(self.learner_gpus) and (self.learner_gpus > 1 or self.num_learners > 1):
            raise ValueError(f"resources.learner_gpus: a share of one device ({self.learner_gpus}) needs one "
                             f"learner rank and must be below 1; use whole GPUs otherwise")
        if self.rollout_gpus > 1 and self.rollout_gpus != int(self.rollout_gpus):
            raise ValueError(f"resources.rollout_gpus: above 1 it must be a whole number, got {self.rollout_gpus}")
        return self

    @model_validator(mode="after")
    def _check_custom(self) -> ResourcesSpec:
        for field in ("rollout_custom", "learner_custom", "custom"):
            for name, amount in getattr(self, field).items():
                if not name or name in RAY_BUILTIN_RESOURCES:
                    raise ValueError(f"resources.{field}: {name!r} is not a custom resource name "
                                     f"(use the cpus/gpus fields for {', '.join(RAY_BUILTIN_RESOURCES)})")
                if not amount > 0:
                    raise ValueError(f"resources.{field}[{name!r}]: must be > 0, got {amount}")
        return self

    @property
    def rollout_resources(self) -> dict[str, float]:
        """Custom resources one rollout worker requests (`custom` and `rollout_custom` merged)."""
        return {**self.custom, **self.rollout_custom}

    @property
    def learner_resources(self) -> dict[str, float]:
        """Custom resources one learner rank (and the job driver, which trains when num_learners is 1) requests."""
        return dict(self.learner_custom)


WEBHOOK_EVENTS = ("succeeded", "failed", "cancelled", "paused")


class WebhookSpec(_Strict):
    """Where to POST the job's notices: signed (Standard Webhooks' headers, HMAC-SHA256 with the tenant's
    secret, GET /v1/webhooks/secret), retried with backoff; the URL must be one the operator's network rules
    allow (as a tool server's)."""

    url: str = Field(min_length=8, max_length=2048, pattern=r"^https?://", description="http or https.")
    events: list[Literal["succeeded", "failed", "cancelled", "paused"]] = Field(
        default_factory=lambda: list(WEBHOOK_EVENTS), min_length=1, max_length=4,
        description="The states that send a notice.")


class JobSpec(_Strict):
    name: str = Field("rl-job", min_length=1, max_length=128)
    method: Literal["reinforcement", "supervised"] = Field(
        "reinforcement", description="supervised: only the warm start (SFT on `warm_start.demonstrations`, a file "
        "of demonstrations), checkpointed as the job's result; total_steps is its number of SFT steps.")
    model: ModelSpec = Field(default_factory=ModelSpec)
    environment: EnvironmentSpec = Field(default_factory=EnvironmentSpec)
    tasks: TasksSpec = Field(default_factory=TasksSpec)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    warm_start: WarmStartSpec | None = Field(None, description="Fine-tune on demonstrations before RL.")
    reward_schedule: RewardSchedule = Field(default_factory=RewardSchedule)
    hacking_monitor: HackingMonitorConfig = Field(
        default_factory=HackingMonitorConfig,
        description="When to warn that the weighted process reward rises while success falls below its start.")
    infra_failures: InfraFailureConfig = Field(default_factory=InfraFailureConfig)
    watchdog: WatchdogSpec = Field(default_factory=WatchdogSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    total_steps: int = Field(100, ge=1, le=1_000_000)
    eval_every: int = Field(0, ge=0, description="Evaluate on held-out tasks every N steps (0 = start and end only).")
    checkpoint_every: int = Field(10, ge=1)
    keep_last_checkpoints: int = Field(3, ge=1, le=1000)
    seed: int = 0
    priority: int = Field(0, ge=-100, le=100, description="Higher runs first; at most the tenant's max_priority.")
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    metadata: Metadata = Field(default_factory=dict, description="The tenant's own labels (as OpenAI's `metadata`).")
    webhooks: list[WebhookSpec] = Field(default_factory=list, max_length=4,
                                        description="Signed notices when the job ends or pauses.")

    @model_validator(mode="after")
    def _sampling_fields_live_in_rollout(self) -> JobSpec:
        """GRPOConfig's sampling fields given in `algorithm` move to `rollout` (their one home)."""
        for name in ROLLOUT_FIELDS_OF_GRPO_CONFIG:
            value = getattr(self.algorithm, name)
            if value is None:
                continue
            if name in self.rollout.model_fields_set and getattr(self.rollout, name) != value:
                raise ValueError(f"algorithm.{name}: differs from rollout.{name}; give it in one place")
            setattr(self.rollout, name, value)
            self.rollout.model_fields_set.add(name)
            setattr(self.algorithm, name, None)
        return self

    @model_validator(mode="after")
    def _supervised_is_the_warm_start(self) -> JobSpec:
        if self.method != "supervised":
            return self
        ws = self.warm_start
        if ws is None or ws.demonstrations == "environment" and "demonstrations" not in ws.model_fields_set:
            raise ValueError("warm_start.demonstrations: a supervised job learns from demonstrations: name a file "
                             "of them (or 'environment' for the environment's own)")
        if ws.mixed_phase is not None:
            raise ValueError("warm_start.mixed_phase: not for a supervised job")
        if "total_steps" in self.model_fields_set and self.total_steps != ws.max_steps:
            raise ValueError(f"total_steps: a supervised job runs warm_start.max_steps ({ws.max_steps}) SFT steps; "
                             "give one of them")
        self.total_steps = ws.max_steps
        return self

    @property
    def rollout_chunk_deadline_s(self) -> float:
        r = self.rollout
        derived = 300.0 + r.max_turns * (r.tool_timeout_s + 0.5 * r.max_tokens_per_turn)
        return self.watchdog.rollout_chunk_s or derived

    @property
    def learner_rank_deadline_s(self) -> float:
        r = self.rollout
        tokens_per_rank = (r.prompts_per_step * r.num_generations * r.max_total_tokens * self.algorithm.num_iterations
                           / self.resources.num_learners)
        return self.watchdog.learner_rank_s or 600.0 + 0.05 * tokens_per_rank


def read_spec_file(path: Path) -> Any:
    """The data of a YAML or JSON file (``.json``: JSON; anything else: YAML, a superset of JSON). OSError when
    it cannot be read, yaml.YAMLError or json.JSONDecodeError when it does not parse."""
    text = path.read_text()
    return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
