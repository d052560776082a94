"""The learner's configuration: the job spec's algorithm block (one declaration of every hyper-parameter, TRL's
GRPOConfig names) plus what the rest of the job spec fixes for the learner."""

from __future__ import annotations

from pydantic import Field

from rl_service.spec import AlgorithmSpec, JobSpec


class LearnerConfig(AlgorithmSpec):
    """`AlgorithmSpec`'s fields, with the values `from_spec` resolves from the rest of the job spec.

    Loss normalisation per `loss_type` (token losses `l_it`, action mask `m_it`, `G` sequences in the
    global batch, summed over all micro-batches and data-parallel ranks):
      - `grpo`:    mean over sequences of the per-sequence token mean, `Σ_i (Σ_t m l) / |o_i| / G`.
      - `dr_grpo`: `Σ m l / (G · max_completion_length)` (no length bias).
      - `dapo`:    `Σ m l / Σ m` (token mean over the whole global batch).
      - `bnpo`:    each micro-batch's token mean, averaged over the micro-batches of all ranks.
    `importance_sampling_level="sequence"` makes the ratio the sequence-level `exp(mean_t log r_it)` (GSPO).
    """

    max_completion_length: int = Field(512, ge=1, le=1_048_576, description="dr_grpo's normaliser.")
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="Logits are divided by it, as the sampler did.")
    max_steps: int = Field(100, ge=1, description="Optimizer steps the LR schedule spans (steps x num_iterations).")
    bf16: bool = Field(True, description="bf16 autocast on CUDA (never on CPU: exactness tests run fp32).")
    seed: int = 0

    @classmethod
    def from_spec(cls, spec: JobSpec) -> LearnerConfig:
        a = spec.algorithm
        data = a.model_dump(exclude={"max_completion_length", "num_generations", "temperature", "top_p"})
        return cls(
            **data,
            max_completion_length=a.max_completion_length or spec.rollout.max_total_tokens,
            temperature=spec.rollout.temperature if spec.rollout.temperature > 0 else 1.0,
            max_steps=spec.total_steps * a.num_iterations,
            seed=spec.seed,
        )
