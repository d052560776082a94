"""Whether a job's learner and rollout engines fit their GPU, checked before anything runs on it: a job that
cannot fit fails at its start naming the numbers, not with an out-of-memory error after its warm start."""

from __future__ import annotations

from dataclasses import dataclass

# fp32 weights, their gradients and AdamW's two moments
LEARNER_STATE_BYTES_PER_PARAM = 16
# activations, the allocator's slack and the CUDA context: a floor and a share of the device beside the state
LEARNER_WORKSPACE_BYTES = 2 << 30


@dataclass(frozen=True)
class GpuMemoryPlan:
    """What the learner needs and what the engines sharing its device take, in bytes."""

    learner_bytes: int
    engines_bytes: int
    free_bytes: int
    total_bytes: int

    @property
    def fits(self) -> bool:
        return self.learner_bytes + self.engines_bytes <= self.free_bytes

    def describe(self) -> str:
        gib = 1 << 30
        return (f"resources: the learner needs {self.learner_bytes / gib:.1f} GiB and the rollout engines on its "
                f"device take {self.engines_bytes / gib:.1f} GiB (rollout_gpus x its memory), but "
                f"{self.free_bytes / gib:.1f} of the device's {self.total_bytes / gib:.1f} GiB are free")


def plan(num_params: int, engines_share: float, free_bytes: int, total_bytes: int) -> GpuMemoryPlan:
    """`engines_share`: the memory share of the device the rollout engines placed on it hold (vLLM's
    gpu_memory_utilization each; 0 where the engines have GPUs of their own)."""
    return GpuMemoryPlan(learner_bytes=num_params * LEARNER_STATE_BYTES_PER_PARAM + LEARNER_WORKSPACE_BYTES,
                         engines_bytes=int(engines_share * total_bytes), free_bytes=free_bytes,
                         total_bytes=total_bytes)
