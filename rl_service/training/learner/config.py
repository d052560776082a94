"""Learner hyper-parameters. Field names follow TRL's GRPOConfig wherever the meaning is the same."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from rl_service.spec import JobSpec

LossType = Literal["grpo", "dr_grpo", "dapo", "gspo"]
LOSS_TYPES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "gspo")


@dataclass
class LearnerConfig:
    """Everything the learner needs; built from `JobSpec.algorithm` by `from_spec`.

    Loss normalisation per `loss_type` (token losses `l_it`, action mask `m_it`, `G` sequences in the
    global batch, summed over all micro-batches and data-parallel ranks):
      - `grpo`:    mean over sequences of the per-sequence token mean, `Σ_i (Σ_t m l) / |o_i| / G`.
      - `dr_grpo`: `Σ m l / (G · max_completion_length)` (no length bias).
      - `dapo`:    `Σ m l / Σ m` (token mean over the whole global batch).
      - `gspo`:    like `grpo`, but the ratio is the sequence-level `exp(mean_t log r_it)` (GSPO).
    """

    loss_type: LossType = "dapo"
    learning_rate: float = 1e-3
    lr_scheduler_type: str = "constant"  # any `transformers.get_scheduler` name
    warmup_steps: int = 0
    max_steps: int = 100  # optimizer steps the LR schedule spans (job steps × num_iterations)
    epsilon: float = 0.2  # lower clip: ratio >= 1 - epsilon
    epsilon_high: float | None = None  # upper clip: ratio <= 1 + epsilon_high (None: same as epsilon)
    beta: float = 0.0  # KL (k3 estimator) coefficient to the frozen reference policy
    num_iterations: int = 1  # optimizer passes over each batch (PPO epochs, TRL's μ)
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    micro_batch_tokens: int = 8192  # padded-token budget of one micro-batch (gradient accumulation)
    max_completion_length: int = 512  # the dr_grpo normaliser
    temperature: float = 1.0  # logits are divided by it, as the sampler did
    vllm_importance_sampling_correction: bool = True  # truncated IS between engine and learner logprobs
    vllm_importance_sampling_cap: float = 2.0  # TRL's vllm_importance_sampling_clip_max
    bf16: bool = True  # bf16 autocast when the model is on CUDA (never on CPU: exactness tests run fp32)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        for name in ("learning_rate", "epsilon", "max_grad_norm", "temperature", "vllm_importance_sampling_cap"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.epsilon_high is not None and self.epsilon_high <= 0:
            raise ValueError(f"epsilon_high must be > 0, got {self.epsilon_high}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations must be >= 1, got {self.num_iterations}")
        if self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        if self.max_completion_length < 1:
            raise ValueError(f"max_completion_length must be >= 1, got {self.max_completion_length}")

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def epsilon_up(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @classmethod
    def from_spec(cls, spec: JobSpec) -> LearnerConfig:
        a = spec.algorithm
        return cls(
            loss_type=a.loss_type,
            learning_rate=a.learning_rate,
            lr_scheduler_type=a.lr_scheduler_type,
            warmup_steps=a.warmup_steps,
            max_steps=spec.total_steps * a.num_iterations,
            epsilon=a.epsilon,
            epsilon_high=a.epsilon_high,
            beta=a.beta,
            num_iterations=a.num_iterations,
            max_grad_norm=a.max_grad_norm,
            weight_decay=a.weight_decay,
            micro_batch_tokens=a.micro_batch_tokens,
            max_completion_length=spec.rollout.max_total_tokens,
            temperature=spec.rollout.temperature if spec.rollout.temperature > 0 else 1.0,
            vllm_importance_sampling_correction=True,
            vllm_importance_sampling_cap=a.vllm_importance_sampling_cap,
            seed=spec.seed,
        )
