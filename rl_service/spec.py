"""The RL job specification: what a user submits (POST /v1/jobs, `taper submit FILE.yaml`).

Field names follow TRL's GRPOConfig where the meaning is the same.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator

from reward_models.monitor import HackingMonitorConfig
from reward_models.schedule import RewardSchedule


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(_Strict):
    preset: Literal["tiny", "small", "large"] = "tiny"
    checkpoint: str | None = Field(None, description="Checkpoint directory or URI to start from (overrides preset weights).")
    overrides: dict[str, Any] = Field(default_factory=dict, description="TaperConfig field overrides.")


class EnvironmentSpec(_Strict):
    name: str = Field("calculator", min_length=1, max_length=64, description="A built-in or registered environment.")
    options: dict[str, Any] = Field(default_factory=dict, description="Passed to the environment's constructor / task generator.")
    # Set by the control plane, never by a submission: the request schema says null.
    registration: Annotated[dict[str, Any] | None, WithJsonSchema({"type": "null"}, mode="validation")] = Field(
        None,
        description="The EnvironmentRegistration of a registered (non built-in) environment, resolved by the "
        "control plane at submit time so the job runs without reading the registry.",
    )


class TasksSpec(_Strict):
    seed: int = 0
    num_train: int = Field(2000, ge=1, le=1_000_000)
    num_eval: int = Field(100, ge=0, le=100_000)
    options: dict[str, Any] = Field(default_factory=dict, description="Task generator options (e.g. difficulty).")


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
    engine: Literal["vllm", "hf"] = "vllm"
    kv_cache_gib: float = Field(1.0, gt=0.0, le=1024.0)
    async_mode: bool = Field(False, description="Generate step t+1 while the learner trains step t.")
    max_staleness: int = Field(1, ge=0, le=16, description="Max policy-version lag of a trajectory used in training.")


class AlgorithmSpec(_Strict):
    loss_type: Literal["grpo", "dr_grpo", "dapo", "gspo"] = "dapo"
    learning_rate: float = Field(1e-3, gt=0.0, le=1.0)
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    epsilon: float = Field(0.2, gt=0.0, le=10.0)
    epsilon_high: float | None = Field(None, gt=0.0, le=10.0)
    beta: float = Field(0.0, ge=0.0, description="KL coefficient to the frozen reference policy.")
    scale_rewards: Literal["group", "batch", "none"] = "group"
    num_iterations: int = Field(1, ge=1, le=16, description="Optimizer passes over each batch.")
    max_grad_norm: float = Field(1.0, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    micro_batch_tokens: int = Field(8192, ge=64, description="Token budget of one micro-batch (gradient accumulation).")
    vllm_importance_sampling_cap: float = Field(2.0, gt=0.0, description="Truncated IS correction cap.")
    credit_assignment: Literal["decoupled", "summed"] = Field(
        "decoupled",
        description="decoupled: A = A_outcome + w(t)*A_process (DESIGN §6). summed: the naive baseline.",
    )
    process_scale: Literal["batch", "fixed"] = "batch"
    gamma: float | None = Field(None, ge=0.0, le=1.0, description="Discount for process returns-to-go; None = step only.")


RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
# What _check_custom enforces, declared for the JSON Schema too.
CustomResources = dict[
    Annotated[str, Field(min_length=1, json_schema_extra={"not": {"enum": list(RAY_BUILTIN_RESOURCES)}})],
    Annotated[float, Field(gt=0.0)],
]


class ResourcesSpec(_Strict):
    rollout_cpus: float = Field(1.0, gt=0.0, description="CPUs per rollout worker.")
    rollout_gpus: float = Field(0.0, ge=0.0)
    learner_cpus: float = Field(1.0, gt=0.0)
    learner_gpus: int = Field(0, ge=0, le=1024)
    num_learners: int = Field(1, ge=1, le=1024, description="Data-parallel learner ranks.")
    rollout_custom: CustomResources = Field(
        default_factory=dict, description="Custom Ray resources each rollout worker needs, e.g. {'rollout': 1}.")
    learner_custom: CustomResources = Field(
        default_factory=dict, description="Custom Ray resources each learner rank needs, e.g. {'learner': 1}.")
    custom: CustomResources = Field(
        default_factory=dict, description="Older name of rollout_custom (merged into it; rollout_custom wins).")

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


class JobSpec(_Strict):
    name: str = Field("rl-job", min_length=1, max_length=128)
    model: ModelSpec = Field(default_factory=ModelSpec)
    environment: EnvironmentSpec = Field(default_factory=EnvironmentSpec)
    tasks: TasksSpec = Field(default_factory=TasksSpec)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    reward_schedule: RewardSchedule = Field(default_factory=RewardSchedule)
    hacking_monitor: HackingMonitorConfig = Field(
        default_factory=HackingMonitorConfig,
        description="When to warn that the weighted process reward rises while success falls below its start.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    total_steps: int = Field(100, ge=1, le=1_000_000)
    eval_every: int = Field(0, ge=0, description="Evaluate on held-out tasks every N steps (0 = start and end only).")
    checkpoint_every: int = Field(10, ge=1)
    keep_last_checkpoints: int = Field(3, ge=1, le=1000)
    seed: int = 0
    priority: int = Field(0, ge=-100, le=100)
