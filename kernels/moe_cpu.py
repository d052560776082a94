"""The MoE's routing and its combine + latent RMSNorm as compiled CPU passes (numba). Steps of many tokens sort
the pairs by expert, and between the passes the experts run as grouped matmuls over the sorted rows (torch).
Decode steps (a few tokens, where the count of small ops costs more than the FLOPs) run every expert on every
token as two dense matmuls; their passes are the dense routing, the GLU scaled by the routing weights, and the
latent RMSNorm beside the shared expert's GLU. The torch forms
(`model.layers.moe`: the router's top-k and weights, `ExpertRouting`'s counting sort, the gathers, the weighted
sum over choices and the RMSNorm; the references the tests compare against) make ~25 passes over [T, n] and
[T, k, l] arrays with casts around them: on an AMX Xeon at 16K tokens in bf16, 17 ms against the expert
matmuls' 35 ms (issue 30).

    route:   chosen = top-k_e (score + bias),  w_j = score_{chosen_j} * scaling / sum_j score_{chosen_j};
             the pairs (t, j) = t * k + j sorted by expert, stably: `rows` (the token of each sorted pair),
             `slot` (the sorted position of each pair), `counts` per expert;
    combine: y_t = sum_j w_tj out[slot[t * k + j]],  latent_t = y_t / sqrt(mean(y_t^2) + eps) * norm_weight;
    dense:   W_te = w_tj where e = chosen_j, else 0;  h_te = W_te situ_glu(gate_te, up_te);
             [latent_t | situ_glu(shared gate_t, shared up_t)] with latent_t as above, y_t = sum_e down_e h_te.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import boolean, float32, int16, int64, njit, void

from kernels.cpu_math import (
    COMPILE,
    NO_BF16,
    NO_F32,
    empty_f32_or_bf16,
    f32_or_bf16_bits,
    load_row,
    store_row,
)
from kernels.cpu_threads import run_row_blocks, threads_for
from kernels.situ_glu_cpu import situ_glu_rows


@njit(inline="always", **COMPILE)
def _choose_top_k(scores, bias, chosen):  # pragma: no cover - compiled
    """chosen[:k] <- the k experts of highest score + bias, in order (exact ties to the lower index); returns
    the sum of their scores."""
    n, k = scores.shape[0], chosen.shape[0]
    total = np.float32(0.0)
    for j in range(k):
        best = -1
        top = np.float32(0.0)
        for e in range(n):
            taken = False
            for i in range(j):
                taken = taken or chosen[i] == e
            value = scores[e] + bias[e]
            if not taken and (best < 0 or value > top):
                best, top = e, value
        chosen[j] = best
        total += scores[best]
    return total


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
        total = _choose_top_k(scores[t], bias, chosen)
        for j in range(k):
            expert[t * k + j] = chosen[j]
            counts[chosen[j]] += 1
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


@njit(inline="always", **COMPILE)
def _rmsnorm(row, norm_weight, eps):  # pragma: no cover - compiled
    """row <- row / sqrt(mean(row^2) + eps) * norm_weight, in place."""
    ell = row.shape[0]
    sq = np.float32(0.0)
    for c in range(ell):
        sq += row[c] * row[c]
    r = np.float32(1.0) / np.sqrt(sq / ell + eps)
    for c in range(ell):
        row[c] = row[c] * r * norm_weight[c]


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
        _rmsnorm(acc, norm_weight, eps)
        store_row(acc, y, y_bf16, to_bf16, t, bits)


@njit(void(float32[:, :], int16[:, :], boolean, float32[:, ::1], float32[:, :], float32[::1], int64, float32,
           float32[:, ::1]), **COMPILE)
def route_dense_rows(x, x_bf16, from_bf16, router_weight, logits, bias, top_k, scaling,
                     combine):  # pragma: no cover - compiled
    """combine [T, n] <- each token's routing weights over all n experts, zero for the unchosen (`route_rows`'s
    choice and weights), from the router's logits: x [T, d] (fp32, or with from_bf16 its bf16 bits) times
    `router_weight` [n, d], or where router_weight has no rows, `logits` [T, n] as given."""
    T, n = combine.shape
    d = router_weight.shape[1]
    row = np.empty(d, np.float32)
    bits = np.empty(d, np.int32)
    scores = np.empty(n, np.float32)
    chosen = np.empty(top_k, np.int64)
    for t in range(T):
        if router_weight.shape[0] > 0:
            load_row(x, x_bf16, from_bf16, t, row, bits)
            for e in range(n):
                acc = np.float32(0.0)
                for c in range(d):
                    acc += row[c] * router_weight[e, c]
                scores[e] = acc
        else:
            for e in range(n):
                scores[e] = logits[t, e]
        for e in range(n):
            scores[e] = np.float32(1.0) / (np.float32(1.0) + np.exp(-scores[e]))
        total = _choose_top_k(scores, bias, chosen)
        combine[t] = 0.0
        for j in range(top_k):
            combine[t, chosen[j]] = scores[chosen[j]] * (scaling / total)


@njit(void(float32[:, :], int16[:, :], boolean, float32[:, ::1], float32, float32, float32[:, :], int16[:, :],
           boolean), **COMPILE)
def glu_combine_rows(gate_up, gate_up_bf16, from_bf16, combine, beta, beta_linear, out, out_bf16,
                     to_bf16):  # pragma: no cover - compiled
    """out [T, n * I] <- combine[t, e] situ_glu(gate, up) for every token t and expert e, where expert e's
    gate and up are columns e * 2I .. e * 2I + I - 1 and the next I of `gate_up` [T, n * 2I] (fp32, or with
    from_bf16 its bf16 bits); zeros where combine[t, e] is 0. fp32 `out`, or with to_bf16 bf16 bits `out_bf16`."""
    T, n = combine.shape
    inter = (gate_up_bf16.shape[1] if from_bf16 else gate_up.shape[1]) // (2 * n)
    h = np.empty((1, inter), np.float32)
    no_bits = np.empty((0, 0), np.int16)
    bits = np.empty(inter, np.int32)
    for t in range(T):
        for e in range(n):
            w = combine[t, e]
            g, u = e * 2 * inter, e * 2 * inter + inter
            if w == 0:
                h[0] = 0.0
            else:
                situ_glu_rows(gate_up[t:t + 1, g:u], gate_up[t:t + 1, u:u + inter], gate_up_bf16[t:t + 1, g:u],
                              gate_up_bf16[t:t + 1, u:u + inter], from_bf16, beta, beta_linear, h, no_bits,
                              False)
                for c in range(inter):
                    h[0, c] *= w
            o = e * inter
            store_row(h[0], out[:, o:o + inter], out_bf16[:, o:o + inter], to_bf16, t, bits)


@njit(void(float32[:, :], int16[:, :], boolean, float32[::1], float32, float32[:, :], float32[:, :], int16[:, :],
           int16[:, :], float32, float32, float32[:, :], int16[:, :], boolean), **COMPILE)
def rmsnorm_glu_rows(y, y_bf16, from_bf16, norm_weight, eps, gate, up, gate_bf16, up_bf16, beta, beta_linear, out,
                     out_bf16, to_bf16):  # pragma: no cover - compiled
    """out [T, l + I] <- [rmsnorm(y) | situ_glu(gate, up)] for y [T, l] and gate, up [T, I] (fp32, or with
    from_bf16 their bf16 bits); fp32 `out`, or with to_bf16 bf16 bits `out_bf16`."""
    ell = norm_weight.shape[0]
    T = y_bf16.shape[0] if from_bf16 else y.shape[0]
    row = np.empty(ell, np.float32)
    bits = np.empty(ell, np.int32)
    for t in range(T):
        load_row(y, y_bf16, from_bf16, t, row, bits)
        _rmsnorm(row, norm_weight, eps)
        store_row(row, out[:, :ell], out_bf16[:, :ell], to_bf16, t, bits)
    situ_glu_rows(gate, up, gate_bf16, up_bf16, from_bf16, beta, beta_linear, out[:, ell:], out_bf16[:, ell:],
                  to_bf16)


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


def route_dense_cpu(x: torch.Tensor, router_weight: np.ndarray | None, bias: torch.Tensor, top_k: int,
                    scaling: float) -> torch.Tensor:
    """Routing of T tokens as a dense [T, n] fp32 matrix of weights (zero for unchosen experts; the choice and
    weights of `route_cpu`). With `router_weight` (the router's fp32 weight [n, d]) x is the tokens [T, d]
    (fp32 or bf16) and the pass computes the logits; without it x is the logits [T, n]."""
    n = bias.shape[0] if router_weight is None else router_weight.shape[0]
    if not 0 < top_k <= n or bias.shape != (n,):
        raise ValueError(f"top_k {top_k} and bias {tuple(bias.shape)} do not fit {n} experts")
    width = n if router_weight is None else router_weight.shape[1]
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"x {tuple(x.shape)} does not fit a router of {n} experts over {width} inputs")
    combine = np.empty((x.shape[0], n), np.float32)
    if router_weight is None:
        rows, rows_bits, bf16, logits = NO_F32, NO_BF16, False, x.float().numpy()
        weight = np.empty((0, 1), np.float32)
    else:
        (rows, rows_bits, bf16), logits, weight = f32_or_bf16_bits(x), NO_F32, router_weight
    route_dense_rows(rows, rows_bits, bf16, weight, logits, bias.float().contiguous().numpy(), top_k,
                     np.float32(scaling), combine)
    return torch.from_numpy(combine)


def glu_combine_cpu(gate_up: torch.Tensor, combine: torch.Tensor, beta: float, beta_linear: float) -> torch.Tensor:
    """Every expert's SiTU-GLU scaled by its routing weight: gate_up [T, n * 2I] (each expert's gate then up
    columns; fp32 or bf16), combine [T, n] fp32 -> [T, n * I] in gate_up's dtype."""
    T, n = combine.shape
    if gate_up.dim() != 2 or gate_up.shape[0] != T or gate_up.shape[1] % (2 * n):
        raise ValueError(f"gate_up {tuple(gate_up.shape)} does not fit combine {tuple(combine.shape)}")
    values, bits, bf16 = f32_or_bf16_bits(gate_up)
    out, out_f32, out_bits = empty_f32_or_bf16(T, gate_up.shape[1] // 2, bf16)
    glu_combine_rows(values, bits, bf16, combine.numpy(), np.float32(beta), np.float32(beta_linear), out_f32,
                     out_bits, bf16)
    return out


def rmsnorm_glu_cpu(y: torch.Tensor, norm_weight: np.ndarray, eps: float, gate: torch.Tensor, up: torch.Tensor,
                    beta: float, beta_linear: float) -> torch.Tensor:
    """[rmsnorm(y) * norm_weight | situ_glu(gate, up)]: y [T, l], gate and up [T, I] of y's dtype (fp32 or bf16;
    any strides), `norm_weight` fp32 [l] -> [T, l + I] in y's dtype."""
    T, ell = y.shape
    if norm_weight.shape != (ell,) or gate.shape != up.shape or gate.shape[0] != T or not (
            y.dtype == gate.dtype == up.dtype):
        raise ValueError(f"y {y.dtype} {tuple(y.shape)}, norm_weight {norm_weight.shape}, gate {gate.dtype} "
                         f"{tuple(gate.shape)} and up {up.dtype} {tuple(up.shape)} do not fit")
    (y_f32, y_bits, bf16), (g_f32, g_bits, _), (u_f32, u_bits, _) = (f32_or_bf16_bits(t) for t in (y, gate, up))
    out, out_f32, out_bits = empty_f32_or_bf16(T, ell + gate.shape[1], bf16)
    rmsnorm_glu_rows(y_f32, y_bits, bf16, norm_weight, np.float32(eps), g_f32, u_f32, g_bits, u_bits,
                     np.float32(beta), np.float32(beta_linear), out_f32, out_bits, bf16)
    return out
