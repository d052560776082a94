"""SiTU-GLU as one compiled CPU pass (numba), for steps without autograd: the formula of
`model.layers.situ_glu.situ_glu` (the reference the tests compare against), in fp32,

    h = [beta tanh(a / beta) sigmoid(a)] [beta_L tanh(u / beta_L)],

reading bf16 inputs as their bits where they lie and writing bf16 rounded to nearest even. torch's form makes
~10 passes over [N, I] with casts around them; in bf16 on a CPU those passes cost more than the expert
matmuls (measured on an AMX Xeon, issue 30)."""

from __future__ import annotations

import numpy as np
import torch
from numba import boolean, float32, int16, njit, void

from kernels.cpu_math import COMPILE, empty_f32_or_bf16, exp_parts, f32_or_bf16_bits, load_row, store_row
from kernels.cpu_threads import run_row_blocks, threads_for

# below it tanh is its odd Taylor series to x^9 (error < 1e-9 relative); above it 1 - 2 / (1 + e^2x) loses
# nothing to cancellation
_TANH_SERIES_BELOW = np.float32(0.25)


@njit(inline="always", **COMPILE)
def _tanh(x, e):  # pragma: no cover - compiled
    """tanh(x) given e = exp(-2 |x|)."""
    s = x * x
    series = x * (np.float32(1.0) + s * (np.float32(-1.0 / 3.0) + s * (np.float32(2.0 / 15.0) + s * (
        np.float32(-17.0 / 315.0) + s * np.float32(62.0 / 2835.0)))))
    exact = (np.float32(1.0) - e) / (np.float32(1.0) + e)
    return series if abs(x) < _TANH_SERIES_BELOW else (exact if x > 0 else -exact)


@njit(void(float32[:, :], float32[:, :], int16[:, :], int16[:, :], boolean, float32, float32, float32[:, :],
           int16[:, :], boolean), **COMPILE)
def situ_glu_rows(gate, up, gate_bf16, up_bf16, from_bf16, beta, beta_linear, out, out_bf16,
                  to_bf16):  # pragma: no cover - compiled
    """out = situ_glu(gate, up) for rows [N, I] of any strides: fp32 `gate`, `up`, or with from_bf16 their bf16
    bits `gate_bf16`, `up_bf16`; fp32 `out`, or with to_bf16 bf16 bits `out_bf16`."""
    N, n = (gate_bf16.shape if from_bf16 else gate.shape)
    a = np.empty(n, np.float32)
    u = np.empty(n, np.float32)
    bits = np.empty((4, n), np.int32)
    as_float = bits.view(np.float32)
    for r in range(N):
        load_row(gate, gate_bf16, from_bf16, r, a, bits[0])
        load_row(up, up_bf16, from_bf16, r, u, bits[1])
        for c in range(n):
            ga = a[c] / beta
            gu = u[c] / beta_linear
            p, bits[0, c] = exp_parts(np.float32(-2.0) * abs(ga))
            q, bits[1, c] = exp_parts(-a[c])
            w, bits[2, c] = exp_parts(np.float32(-2.0) * abs(gu))
            sig = np.float32(1.0) / (np.float32(1.0) + q * as_float[1, c])
            h = (beta * _tanh(ga, p * as_float[0, c]) * sig) * (beta_linear * _tanh(gu, w * as_float[2, c]))
            a[c] = h
        store_row(a, out, out_bf16, to_bf16, r, bits[3])


def situ_glu_cpu(gate: torch.Tensor, up: torch.Tensor, beta: float, beta_linear: float) -> torch.Tensor:
    """`situ_glu` without autograd on CPU tensors [..., I] of one dtype (fp32 or bf16; any strides in the last
    two dims, e.g. the halves of a fused gate|up projection). Returns gate's dtype, contiguous."""
    if gate.dtype != up.dtype or gate.dtype not in (torch.float32, torch.bfloat16) or gate.shape != up.shape:
        raise ValueError(f"gate and up must be fp32 or bf16 of one shape, got {gate.dtype} {tuple(gate.shape)} "
                         f"and {up.dtype} {tuple(up.shape)}")
    shape = gate.shape
    if gate.dim() != 2:  # (no reshape where none is needed: a decode step calls this once per MLP and MoE layer)
        gate, up = gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1])
    gate_f32, gate_bits, bf16 = f32_or_bf16_bits(gate)
    up_f32, up_bits, _ = f32_or_bf16_bits(up)
    out, out_f32, out_bits = empty_f32_or_bf16(*gate.shape, bf16)
    run_row_blocks(lambda lo, hi: situ_glu_rows(gate_f32[lo:hi], up_f32[lo:hi], gate_bits[lo:hi], up_bits[lo:hi], bf16,
                                                np.float32(beta), np.float32(beta_linear), out_f32[lo:hi],
                                                out_bits[lo:hi], bf16),
                   len(out), threads_for(out.numel()))
    return out if len(shape) == 2 else out.view(shape)
