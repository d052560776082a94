"""Operator limits and tenant quotas: what one job may ask for, and how many jobs a tenant may have.

The job spec's own bounds (rl_service.spec) are hard limits of the code. Inside them the operator sets
`JobLimits` (settings, ``TAPER_LIMITS__*``) for every job, and an admin may give a tenant a `TenantQuota`
(REST ``/v1/tenants/{tenant}/quota``, ``taper quota set``): running and queued jobs, the highest priority,
and resource caps per job that narrow the operator's. Tenants without a quota get the operator's default
(``TAPER_DEFAULT_QUOTA__*``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rl_service.spec import JobSpec


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ResourceCaps(_Strict):
    """Per-job maxima; None leaves that resource to the level above (the operator's limits, the spec's bounds)."""

    learner_cpus: float | None = Field(None, gt=0, description="resources.learner_cpus (per learner rank)")
    learner_gpus: float | None = Field(None, ge=0, description="resources.learner_gpus (per learner rank)")
    num_learners: int | None = Field(None, ge=1, description="resources.num_learners")
    rollout_cpus: float | None = Field(None, gt=0, description="resources.rollout_cpus (per rollout worker)")
    rollout_gpus: float | None = Field(None, ge=0, description="resources.rollout_gpus (per rollout worker)")
    num_workers: int | None = Field(None, ge=1, description="rollout.num_workers")
    custom_amount: float | None = Field(None, gt=0, description="any one custom Ray resource of one bundle")
    rollout_tokens_per_step: int | None = Field(
        None, ge=16, description="rollout.prompts_per_step x rollout.num_generations x rollout.max_total_tokens")


class JobLimits(ResourceCaps):
    """The operator's maxima for every job (the defaults suit one machine with a few GPUs)."""

    learner_cpus: float | None = Field(32.0, gt=0)
    learner_gpus: float | None = Field(8, ge=0)
    num_learners: int | None = Field(16, ge=1)
    rollout_cpus: float | None = Field(32.0, gt=0)
    rollout_gpus: float | None = Field(8.0, ge=0)
    num_workers: int | None = Field(32, ge=1)
    custom_amount: float | None = Field(64.0, gt=0)
    rollout_tokens_per_step: int | None = Field(4_194_304, ge=16)
    model_presets: list[Literal["tiny", "small", "large"]] = Field(
        ["tiny", "small", "large"], description="model.preset values tenants may choose")
    model_hidden_size: int = Field(4096, ge=16, description="model.overrides.hidden_size")
    model_num_hidden_layers: int = Field(64, ge=1, description="model.overrides.num_hidden_layers")
    model_intermediate_size: int = Field(
        16384, ge=1, description="model.overrides.intermediate_size and moe_intermediate_size")
    model_n_routed_experts: int = Field(256, ge=1, description="model.overrides.n_routed_experts")


class TenantQuota(_Strict):
    max_running_jobs: int = Field(4, ge=0, le=100_000, description="Jobs starting or running at once; more wait queued.")
    max_queued_jobs: int = Field(100, ge=0, le=1_000_000, description="Queued jobs; a submission beyond is refused.")
    max_priority: int = Field(0, ge=-100, le=100, description="The highest `priority` the tenant's jobs may ask for.")
    max_chat_engines: int = Field(
        2, ge=0, le=1000, description="Chat engines (/v1/chat/completions) kept running at once: one per model in use.")
    resources: ResourceCaps = Field(default_factory=ResourceCaps, description="Per-job caps inside the operator's.")


class ChatSettings(_Strict):
    """The operator's settings for chat engines (``TAPER_CHAT__IDLE_TIMEOUT_S=300``, ...)."""

    idle_timeout_s: float = Field(600.0, gt=0.0, description="An engine no request has used for this long is stopped.")
    max_completion_tokens: int = Field(
        4096, ge=1, le=1_000_000, description="Most tokens one choice may sample; a request asking for more is refused.")
    max_n: int = Field(8, ge=1, le=128, description="Most choices (`n`) one request may ask for.")
    max_model_len: int = Field(4096, ge=16, le=1_048_576, description="Context length of each engine (prompt + completion).")
    kv_cache_gib: float = Field(1.0, gt=0.0, description="KV cache of each engine on CPU (GPU: gpu_memory_utilization).")
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    max_num_seqs: int = Field(64, ge=1, le=4096, description="Sequences one engine runs in a batch.")
    max_concurrent_requests: int = Field(256, ge=1, le=100_000, description="Requests one engine takes at once.")
    engine_cpus: float = Field(1.0, ge=0.0, description="Ray CPUs each engine reserves.")
    engine_gpus: float = Field(0.0, ge=0.0, description="Ray GPUs each engine reserves.")
    start_timeout_s: float = Field(900.0, gt=0.0, description="How long a request waits for its engine to start.")


class LimitExceeded(ValueError):
    """A job asks for more than the operator or its tenant's quota allows; ``field`` names what."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _cap(operator: float | None, tenant: float | None) -> tuple[float | None, str]:
    """The tighter of two caps and whose it is."""
    if tenant is not None and (operator is None or tenant < operator):
        return tenant, "the tenant's quota"
    return operator, "the operator's limit"


def rollout_tokens_per_step(spec: JobSpec) -> int:
    r = spec.rollout
    return r.prompts_per_step * r.num_generations * r.max_total_tokens


def check_job(spec: JobSpec, limits: JobLimits, quota: TenantQuota) -> None:
    """Raise LimitExceeded for the first request of ``spec`` beyond ``limits`` or ``quota``."""
    if spec.priority > quota.max_priority:
        raise LimitExceeded("priority", f"{spec.priority} is above this tenant's max_priority {quota.max_priority}")
    res, caps = spec.resources, quota.resources
    asked = {
        "resources.learner_cpus": (res.learner_cpus, "learner_cpus"),
        "resources.learner_gpus": (res.learner_gpus, "learner_gpus"),
        "resources.num_learners": (res.num_learners, "num_learners"),
        "resources.rollout_cpus": (res.rollout_cpus, "rollout_cpus"),
        "resources.rollout_gpus": (res.rollout_gpus, "rollout_gpus"),
        "rollout.num_workers": (spec.rollout.num_workers, "num_workers"),
    }
    for field, (value, cap_name) in asked.items():
        cap, whose = _cap(getattr(limits, cap_name), getattr(caps, cap_name))
        if cap is not None and value > cap:
            raise LimitExceeded(field, f"{value} is above {whose} ({cap})")
    cap, whose = _cap(limits.custom_amount, caps.custom_amount)
    for group in ("rollout_custom", "learner_custom", "custom"):
        for name, amount in getattr(res, group).items():
            if cap is not None and amount > cap:
                raise LimitExceeded(f"resources.{group}.{name}", f"{amount} is above {whose} ({cap})")
    cap, whose = _cap(limits.rollout_tokens_per_step, caps.rollout_tokens_per_step)
    tokens = rollout_tokens_per_step(spec)
    if cap is not None and tokens > cap:
        r = spec.rollout
        raise LimitExceeded("rollout", f"prompts_per_step x num_generations x max_total_tokens = {r.prompts_per_step} "
                                       f"x {r.num_generations} x {r.max_total_tokens} = {tokens} tokens per step is "
                                       f"above {whose} ({cap})")
    if spec.model.preset not in limits.model_presets:
        raise LimitExceeded("model.preset", f"{spec.model.preset!r} is not offered here (choose one of "
                                            f"{', '.join(limits.model_presets)})")
    overrides = spec.model.overrides
    for name, cap_value in (("hidden_size", limits.model_hidden_size),
                            ("num_hidden_layers", limits.model_num_hidden_layers),
                            ("intermediate_size", limits.model_intermediate_size),
                            ("moe_intermediate_size", limits.model_intermediate_size),
                            ("n_routed_experts", limits.model_n_routed_experts)):
        value = getattr(overrides, name)
        if value is not None and value > cap_value:
            raise LimitExceeded(f"model.overrides.{name}", f"{value} is above the operator's limit ({cap_value})")

