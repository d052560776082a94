"""The served projections' matmuls on CPU in vLLM's own GEMM kernels, prepared once per weight as vLLM's
`UnquantizedLinearMethod` prepares its models' linears (`dispatch_cpu_unquantized_gemm`): on CPUs with AMX,
sgl-kernel's packed-weight brgemm for weights up to 1 MiB (N a multiple of 16, K of 32), else a oneDNN matmul with
the weight reordered for it once. torch's `F.linear` in bf16 hands oneDNN the weight unprepared, and at a decode
step's 8 tokens that costs more than the arithmetic: a [256, 900] projection took 58 us as `F.linear` against
34 us with the weight reordered once (bf16, one Xeon core with AMX; benchmarks/NOTES.md).

bf16 weights only: in fp32 (CPUs without bf16 instructions) torch's own matmul has no reorder to save. The
prepared copies sit beside the parameters, which weight pushes write: on CPU the projections' weights take
twice their memory.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm


def prepare_cpu_matmul(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """x [T, in] -> x W^T for a bf16 CPU weight W [out, in] (`fused.PrepareMatmul`); None for other weights."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    return vllm_cpu_matmul(weight)


def vllm_cpu_matmul(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x W^T in the kernel vLLM's dispatch picks for a 2-d CPU weight W of any dtype it supports."""
    holder = SimpleNamespace(weight=weight)  # what vLLM's dispatch reads and sets (`cpu_linear`) on a layer
    dispatch_cpu_unquantized_gemm(holder, remove_weight=False)
    cpu_linear = holder.cpu_linear
    return lambda x: cpu_linear(x, weight, None)
