"""What the plugin can serve on a GPU, checked when the engine builds the model: a config outside it fails the
engine start with one line naming the field, instead of a kernel error in the middle of a rollout."""

from __future__ import annotations

import torch

from model.config import TaperConfig

# The Triton KDA kernels hold a head's K x V state tile in registers and multiply 16-row blocks on the matrix units.
KDA_HEAD_DIMS = range(16, 257, 16)
# vLLM's FlashAttention backends (the MLA layers are served as multi-head attention over up-projected keys/values).
ATTENTION_HEAD_DIMS = range(8, 257, 8)
MIN_COMPUTE_CAPABILITY = (8, 0)  # bf16 matrix instructions, which the KDA kernels use


def gpu_serving_problem(config: TaperConfig, capability: tuple[int, int]) -> str | None:
    """Why `config` cannot be served on a GPU of this compute capability, naming the field; None if it can."""
    for field in ("kda_head_dim", "kda_v_head_dim"):
        value = getattr(config, field)
        if value not in KDA_HEAD_DIMS:
            return (f"{field}={value}: the GPU KDA kernels take head sizes that are multiples of 16 from "
                    f"{KDA_HEAD_DIMS.start} to {KDA_HEAD_DIMS.stop - 1}")
    for field in ("qk_head_dim", "v_head_dim"):
        value = getattr(config, field)
        if value not in ATTENTION_HEAD_DIMS:
            return (f"{field}={value}: the GPU attention backends take head sizes that are multiples of 8 up to "
                    f"{ATTENTION_HEAD_DIMS.stop - 1}")
    if capability < MIN_COMPUTE_CAPABILITY:
        need = ".".join(map(str, MIN_COMPUTE_CAPABILITY))
        return (f"device: compute capability {capability[0]}.{capability[1]} has no bf16 matrix instructions, "
                f"which the KDA kernels need (>= {need})")
    return None


def check_gpu_servable(config: TaperConfig, dtype: torch.dtype) -> None:
    """Raise ValueError (one line, naming the field) if this process's GPU cannot serve `config` in `dtype`."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype={dtype}: the GPU KDA kernels take bfloat16, float16 or float32")
    problem = gpu_serving_problem(config, torch.cuda.get_device_capability())
    if problem is not None:
        raise ValueError(problem)
