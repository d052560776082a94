"""The learner: clipped PG loss on token-level advantages, IS correction, micro-batch accumulation, AdamW.

Public API: `LearnerConfig` (the job spec's `AlgorithmSpec`, TRL GRPOConfig names, plus what `from_spec(JobSpec)`
resolves from the rest of the spec), `Learner(model, config,
ref_model=None, pad_token_id=0)` with `step(samples) -> metrics` and `logprobs(samples)`, `PolicySample`
(one trajectory + token advantages; `from_trajectory(traj, advantages)`), `LossNorm`, `policy_loss`.
"""

from rl_service.training.learner.batch import LossNorm, MicroBatch, PolicySample, collate, pack_micro_batches
from rl_service.training.learner.config import LearnerConfig
from rl_service.training.learner.learner import Learner, completion_logits, token_logprobs_and_entropy
from rl_service.training.learner.loss import importance_sampling_ratio, policy_loss

__all__ = [
    "Learner", "LearnerConfig", "LossNorm", "MicroBatch", "PolicySample", "collate",
    "completion_logits", "pack_micro_batches", "policy_loss", "token_logprobs_and_entropy", "importance_sampling_ratio",
]
