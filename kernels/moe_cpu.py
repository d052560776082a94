"""The MoE's routing and its combine + latent RMSNorm as compiled CPU passes (numba), for serving steps of many
tokens. Between them the experts run as grouped matmuls over the expert-sorted rows (torch). The torch forms
(`model.layers.moe`: the router's top-k and weights, `ExpertRouting`'s counting sort, the gathers, the weighted
sum over choices and the RMSNorm; the references the tests compare against) make ~25 passes over [T, n] and
[T, k, l] arrays with casts around them: on an AMX Xeon at 16K tokens in bf16, 17 ms against the expert
matmuls' 35 ms (NOTES, issue 30).

    route:   chosen = top-k_e (score + bias),  w_j = score_{chosen_j} * scaling / sum_j score_{chosen_j};
             the pairs (t, j) = t * k + j sorted by expert, stably: `rows` (the token of each sorted pair),
             `slot` (the sorted position of each pair), `counts` per expert;
    combine: y_t = sum_j w_tj out[slot[t * k + j]],  latent_t = y_t / sqrt(mean(y_t^2) + eps) * norm_weight.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import boolean, float32, int16, int64, njit, void

from kernels.cpu_math import COMPILE, empty_f32_or_bf16, f32_or_bf16_bits, load_row, store_row
from kernels.cpu_threads import run_row_blocks, threads_for


@njit(void(float32[:, ::1], float32[::1], float32, float32[:, ::1], int64[::1], int64[::1], int64[::1]), **COMPILE)
def route_rows(scores, bias, scaling, weights, rows, slot, counts):  # pragma: no cover - compiled
    """scores [T, n] (>= 0) -> weights [T, k], rows and slot [T * k], counts [n]. Exact ties go to the lower
    expert index."""
    T, n = scores.shape
    k = weights.shape[1]
    chosen = np.empty(k, np.int64)
    expert = np.empty(T * k, np.int64)
    counts[:] = 0
    for t in range(T):
        total = np.float32(0.0)
        for j in range(k):
            best = -1
            top = np.float32(0.0)
            for e in range(n):
                taken = False
                for i in range(j):
                    taken = taken or chosen[i] == e
                value = scores[t, e] + bias[e]
                if not taken and (best < 0 or value > top):
                    best, top = e, value
            chosen[j] = best
            expert[t * k + j] = best
            counts[best] += 1
            total += scores[t, best]
        for j in range(k):
            weights[t, j] = scores[t, chosen[j]] * (scaling / total)
    start = np.empty(n, np.int64)
    s = 0
    for e in range(n):
        start[e] = s
        s += counts[e]
    for p in range(T * k):
        e = expert[p]
        slot[p] = start[e]
        rows[start[e]] = p // k
        start[e] += 1


@njit(void(float32[:, :], int16[:, :], boolean, int64[::1], float32[:, ::1], float32[::1], float32, float32[:, :],
           int16[:, :], boolean), **COMPILE)
def combine_rmsnorm_rows(out, out_bf16, from_bf16, slot, weights, norm_weight, eps, y, y_bf16,
                         to_bf16):  # pragma: no cover - compiled
    """y [t] = rmsnorm(sum_j weights[t, j] out[slot[t * k + j]]) for the rows t of `weights` [T, k] (slot: their
    T * k pairs); `out` [P, l] fp32, or with from_bf16 its bf16 bits `out_bf16`; y [T, l] fp32, or with to_bf16
    bf16 bits `y_bf16`."""
    T, k = weights.shape
    ell = norm_weight.shape[0]
    acc = np.empty(ell, np.float32)
    row = np.empty(ell, np.float32)
    bits = np.empty(ell, np.int32)
    for t in range(T):
        acc[:] = 0.0
        for j in range(k):
            load_row(out, out_bf16, from_bf16, slot[t * k + j], row, bits)
            w = weights[t, j]
            for c in range(ell):
                acc[c] += w * row[c]
        sq = np.float32(0.0)
        for c in range(ell):
            sq += acc[c] * acc[c]
        r = np.float32(1.0) / np.sqrt(sq / ell + eps)
        for c in range(ell):
            acc[c] = acc[c] * r * norm_weight[c]
        store_row(acc, y, y_bf16, to_bf16, t, bits)


def route_cpu(scores: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routing of T tokens from their router scores [T, n] (fp32 CPU) and balancing bias [n]: (weights [T, k]
    fp32, rows [T * k], slot [T * k], counts [n]; int64), as in the module docstring."""
    T, n = scores.shape
    if not 0 < top_k <= n or bias.shape != (n,):
        raise ValueError(f"top_k {top_k} and bias {tuple(bias.shape)} do not fit {n} experts")
    weights = torch.empty(T, top_k)
    rows, slot = torch.empty(T * top_k, dtype=torch.int64), torch.empty(T * top_k, dtype=torch.int64)
    counts = torch.empty(n, dtype=torch.int64)
    route_rows(scores.detach().float().contiguous().numpy(), bias.detach().float().contiguous().numpy(),
               np.float32(scaling), weights.numpy(), rows.numpy(), slot.numpy(), counts.numpy())
    return weights, rows, slot, counts


def combine_rmsnorm_cpu(out: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float, dtype: torch.dtype) -> torch.Tensor:
    """The experts' sorted outputs `out` [T * k, l] (fp32 or bf16) combined per token with `weights` [T, k] and
    RMS-normalised (fp32 `norm_weight` [l]): [T, l] in `dtype` (fp32 or bf16)."""
    T, k = weights.shape
    ell = out.shape[1]
    if out.shape[0] != T * k or slot.shape != (T * k,) or norm_weight.shape != (ell,):
        raise ValueError(f"out {tuple(out.shape)}, slot {tuple(slot.shape)} and norm_weight "
                         f"{tuple(norm_weight.shape)} do not fit weights {tuple(weights.shape)}")
    out_f32, out_bits, from_bf16 = f32_or_bf16_bits(out)
    to_bf16 = dtype == torch.bfloat16
    if not to_bf16 and dtype != torch.float32:
        raise ValueError(f"dtype must be fp32 or bf16, got {dtype}")
    y, y_f32, y_bits = empty_f32_or_bf16(T, ell, to_bf16)
    slot_np = slot.to(torch.int64).contiguous().numpy()
    w = weights.detach().float().contiguous().numpy()
    nw = norm_weight.detach().float().contiguous().numpy()

    def block(lo: int, hi: int) -> None:
        combine_rmsnorm_rows(out_f32, out_bits, from_bf16, slot_np[lo * k:hi * k], w[lo:hi], nw, np.float32(eps),
                             y_f32[lo:hi], y_bits[lo:hi], to_bf16)

    run_row_blocks(block, T, threads_for(T * k * ell))
    return y
