"""Block-AttnRes mix followed by the sub-layer's RMSNorm as one CPU pass (C: `attn_res_cpu.c`, built by
`kernels.native`), for serving steps of any size: the candidates are read where they lie, in bf16 or fp32, and
each token's output is written once, in their dtype. The torch form makes ~25 ops of a decode step's few tokens, and at a prefill's
thousands it passes over fp32 copies of every candidate several times. The math is
`model.layers.attn_res.BlockAttnRes` then `RMSNorm` (the reference the tests compare against), in fp32:

    s_i = <V_i, key> / sqrt(mean(V_i^2) + eps),  w = softmax(s),  m = sum_i w_i V_i,
    out = m / sqrt(mean(m^2) + norm_eps) * norm_weight,           with key = gamma * w_query.

(The torch form rounds m to the candidates' dtype before the norm; this pass keeps it in fp32.) Rows run in
blocks on torch's intra-op threads (`kernels.cpu_threads`), with the same result on any number."""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels.cpu_threads import run_row_blocks, threads_for
from kernels.native import load as load_native
from kernels.native import read_source


@functools.cache
def _attn_res_rmsnorm_c() -> ctypes._CFuncPtr:
    fn = load_native("attn_res_rmsnorm", read_source(__file__, "attn_res_cpu.c")).attn_res_rmsnorm
    ptr, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32
    fn.argtypes = [ptr, i64, i64, i32, ptr, f32, ptr, f32, ptr, i64, i64]
    fn.restype = None
    return fn


def attn_res_rmsnorm(candidates: list[torch.Tensor], key: torch.Tensor, eps: float, norm_weight: torch.Tensor,
                     norm_eps: float, threads: int | None = None) -> torch.Tensor:
    """norm(mix(candidates)) of N CPU candidates [T, d] -> [T, d] in the first candidate's dtype (bf16 stays
    bf16, fp32 stays fp32, others compute and return in fp32). key = gamma * w_query and norm_weight: fp32 [d].
    On `threads` threads (default: torch's intra-op count, fewer for small work)."""
    if not candidates:
        raise ValueError("attn_res_rmsnorm needs at least one candidate")
    T, d = candidates[0].shape
    dtype = candidates[0].dtype if candidates[0].dtype in (torch.bfloat16, torch.float32) else torch.float32
    rows = []  # (a decode step calls this twice per layer: no needless tensor ops)
    for i, c in enumerate(candidates):
        if c.shape != (T, d) or not c.is_cpu:
            raise ValueError(f"candidate {i} must be a CPU tensor of shape {(T, d)}, got {c.device} {tuple(c.shape)}")
        rows.append(c if c.dtype == dtype and c.is_contiguous() else c.detach().to(dtype).contiguous())
    for name, x in (("key", key), ("norm_weight", norm_weight)):
        if x.shape != (d,) or x.dtype != torch.float32 or not x.is_cpu or not x.is_contiguous():
            raise ValueError(f"{name} must be a contiguous fp32 CPU tensor of shape {(d,)}, got {x.dtype} "
                             f"{tuple(x.shape)}")
    out = torch.empty(T, d, dtype=dtype)
    pointers = (ctypes.c_void_p * len(rows))(*[c.data_ptr() for c in rows])
    args = (pointers, len(rows), d, int(dtype == torch.bfloat16), key.data_ptr(), eps, norm_weight.data_ptr(),
            norm_eps, out.data_ptr())
    fn = _attn_res_rmsnorm_c()
    threads = threads or threads_for(T * d * len(rows))
    if threads == 1:  # a decode step's call: no blocks to hand out
        fn(*args, 0, T)
    else:
        run_row_blocks(lambda lo, hi: fn(*args, lo, hi), T, threads)
    return out
