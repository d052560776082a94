"""The served projections' matmuls on CPU in vLLM's own GEMM kernels, prepared once per weight as vLLM's
`UnquantizedLinearMethod` prepares its models' linears (`dispatch_cpu_unquantized_gemm`): on CPUs with AMX,
sgl-kernel's packed-weight brgemm for weights up to 1 MiB (N a multiple of 16, K of 32), else a oneDNN matmul with
the weight reordered for it once. torch's `F.linear` in bf16 hands oneDNN the weight unprepared, and at a decode
step's 8 tokens that costs more than the arithmetic: a [256, 900] projection took 58 us as `F.linear` against
34 us with the weight reordered once (bf16, one Xeon core with AMX; the git history of benchmarks/NOTES.md).

A weight whose N is not a multiple of 16 but would otherwise qualify for sgl-kernel's brgemm is padded with zero
rows to one, and its outputs are the leading columns of the padded product (a column slice, not contiguous): at
the benchmark sizes the KDA layer's fused input projection ([900, 256]) went to oneDNN at 83 us a call, where
the brgemm runs the other decode projections at ~45 (one Xeon core, bf16, profiled in an engine).

bf16 weights only: in fp32 (CPUs without bf16 instructions) torch's own matmul has no reorder to save. The
prepared copies sit beside the parameters, which weight pushes write: on CPU the projections' weights take
twice their memory.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch
from vllm.model_executor.layers.utils import check_cpu_sgl_kernel, dispatch_cpu_unquantized_gemm
from vllm.platforms import current_platform

SGL_ROWS = 16  # sgl-kernel's brgemm takes N in tiles of 16


def prepare_cpu_matmul(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """x [T, in] -> x W^T for a bf16 CPU weight W [out, in] (`fused.PrepareMatmul`); None for other weights."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    return vllm_cpu_matmul(weight, sgl_padding(*weight.shape, weight.dtype))


def sgl_padding(n: int, k: int, dtype: torch.dtype) -> int:
    """Zero rows to append to a weight [n, k] so that vLLM's dispatch gives it sgl-kernel's brgemm: where the
    padded weight qualifies (on this CPU) and n alone does not."""
    pad = -n % SGL_ROWS
    return pad if pad and n >= SGL_ROWS and check_cpu_sgl_kernel(n + pad, k, dtype) else 0


def vllm_cpu_matmul(weight: torch.Tensor, pad_rows: int = 0) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x W^T in the kernel vLLM's dispatch picks for a 2-d CPU weight W of any dtype it supports; with
    `pad_rows`, for W with that many zero rows appended, returning the leading columns (a column slice)."""
    n = weight.shape[0]
    if pad_rows:
        weight = torch.cat([weight, weight.new_zeros(pad_rows, weight.shape[1])])
    sgl = check_cpu_sgl_kernel(*weight.shape, weight.dtype) and not current_platform.is_zen_cpu()
    matmul = _sgl_matmul(weight) if sgl else _dispatched_matmul(weight)
    if pad_rows:
        return lambda x: matmul(x)[:, :n]
    return matmul


def _dispatched_matmul(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    holder = SimpleNamespace(weight=weight)  # what vLLM's dispatch reads and sets (`cpu_linear`) on a layer
    dispatch_cpu_unquantized_gemm(holder, remove_weight=False)
    cpu_linear = holder.cpu_linear
    return lambda x: cpu_linear(x, weight, None)


def _sgl_matmul(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """vLLM's dispatch's sgl-kernel branch (the weight packed once, then `weight_packed_linear`), calling the
    kernel directly. vLLM's wrapper, which also reshapes both operands and finds the op's overload by name on
    every call, held 5.4% of a decode step's samples on one Xeon core with AMX (the benchmark model, py-spy;
    the git history of benchmarks/NOTES.md), its allocation (kept here) among them. x: [T, in], contiguous, in W's dtype."""
    packed = torch.ops._C.convert_weight_packed(weight)
    kernel = torch.ops._C.weight_packed_linear.default
    n = weight.shape[0]

    def matmul(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((x.shape[0], n), dtype=x.dtype)
        kernel(out, x, packed, None, True)
        return out

    return matmul
