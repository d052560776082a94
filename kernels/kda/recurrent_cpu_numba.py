"""The numba loops of `recurrent_cpu.py`: the passes around the recurrence (gate, conv, decode inputs, output
norm); the recurrence itself is C (`recurrent_cpu.c`). Their signatures are declared: importing this module
compiles them once (about 2 s) or loads them from numba's on-disk cache, and an argument of another type
is an error rather than a second compile."""

from __future__ import annotations

import numpy as np
from numba import boolean, float32, int16, int32, int64, njit, void

from kernels.cpu_math import COMPILE, exp_parts, load_row, store_row

_VEC = float32[::1]
_ROWS = float32[:, :, ::1]
_INDEX = int64[::1]


@njit(void(_VEC, int32[::1]), **COMPILE)
def silu_inplace(x, exponent):  # pragma: no cover - compiled
    """x <- x sigmoid(x) = x / (1 + exp(-x)); exponent: int32 scratch of x's length."""
    scale = exponent.view(np.float32)
    for i in range(x.shape[0]):
        p, exponent[i] = exp_parts(-x[i])
        x[i] = x[i] / (np.float32(1.0) + p * scale[i])


@njit(void(float32[:, :], int16[:, :], boolean, _VEC, boolean, float32, _VEC, int64, float32[:, ::1]), **COMPILE)
def gate_decay_rows(f, f_bf16, from_bf16, dt_bias, bounded, lower_bound, a_log, K,
                    decay):  # pragma: no cover - compiled
    """The forget gate's decay exp(g) for rows of raw gate inputs: f [R, HV*K] fp32, or with from_bf16 its
    bf16 bits f_bf16 (any strides); dt_bias [HV*K]; decay [R, HV*K]. Bounded: g = lower_bound * sigmoid(f +
    dt_bias); else g = -exp(a_log[h]) * softplus(f + dt_bias) with a_log [HV] (softplus as torch computes it:
    linear above 20). The two formulas of `kernels/kda/gate.py`, which this loop cannot call."""
    R, n = f_bf16.shape if from_bf16 else f.shape
    x = np.empty(n, np.float32)
    bits = np.empty((2, n), np.int32)
    scale = bits.view(np.float32)
    for r in range(R):
        load_row(f, f_bf16, from_bf16, r, x, bits[0])
        for c in range(n):
            x[c] += dt_bias[c]
        if bounded:  # two loops, not a branch in one: the bounded one vectorises
            for c in range(n):
                p, bits[0, c] = exp_parts(-x[c])
                g = lower_bound / (np.float32(1.0) + p * scale[0, c])
                p, bits[1, c] = exp_parts(g)
                decay[r, c] = p * scale[1, c]
        else:
            for c in range(n):
                y = x[c]
                decay[r, c] = np.exp(-np.exp(a_log[c // K]) * (y if y > np.float32(20.0) else np.log1p(np.exp(y))))


@njit(inline="always", **COMPILE)
def _position_input(x, x_bf16, from_bf16, conv_pool, s, kept, a, p, out, bits):  # pragma: no cover - compiled
    """out <- the input at position p of a sequence whose positions count its slot's W-1 history rows first
    (conv_pool[s], zeros where not `kept`) and then its tokens, rows a, a+1, ... of x; bits: int32 scratch."""
    W1 = conv_pool.shape[1]
    if p >= W1:
        load_row(x, x_bf16, from_bf16, a + p - W1, out, bits)
    else:
        for c in range(out.shape[0]):
            out[c] = conv_pool[s, p, c] if kept else np.float32(0.0)


@njit(void(float32[:, :], int16[:, :], boolean, float32[:, ::1], float32[:, :, :], _INDEX, _INDEX, _INDEX,
           boolean[::1], int64, int64, float32[:, ::1], float32[:, ::1], float32[:, ::1]), **COMPILE)
def conv_silu_rows(x, x_bf16, from_bf16, conv_w, conv_pool, starts, ends, slots, keep, t_lo, t_hi, yq, yk,
                   yv):  # pragma: no cover - compiled
    """The causal depthwise conv + SiLU over back-to-back sequences, for the tokens t_lo .. t_hi-1: the
    pre-conv inputs (q|k|v channels) are x [T, C], or with from_bf16 x_bf16 [T, C], bf16 values as their
    bits (any strides: e.g. a column slice of a projection); conv_w [W, C] (tap W-1 the newest);
    conv_pool [P, W-1, C] the W-1 inputs before each sequence (oldest first; used where keep, zeros
    elsewhere; only read here, `conv_pool_advance` moves it on); sequence r is rows starts[r]..ends[r]-1 with
    its slot slots[r]. Writes y = SiLU(conv) split by channel into yq [T, Cq], yk [T, Cq], yv [T, C - 2 Cq].
    Token ranges that do not overlap can run at once."""
    C = conv_w.shape[1]
    W1 = conv_pool.shape[1]
    W = W1 + 1
    Cq = yq.shape[1]
    window = np.empty((W, C), np.float32)  # a ring: sequence position p (history first) in row p % W
    bits = np.empty(C, np.int32)
    acc = np.empty(C, np.float32)
    exponent = np.empty(C, np.int32)
    for r in range(starts.shape[0]):
        a, b, s = starts[r], ends[r], slots[r]
        lo, hi = max(a, t_lo), min(b, t_hi)
        if lo >= hi:
            continue
        for p in range(lo - a, lo - a + W1):  # the W-1 positions before token lo: history or tokens
            _position_input(x, x_bf16, from_bf16, conv_pool, s, keep[r], a, p, window[p % W], bits)
        for t in range(lo, hi):
            p = t - a + W1
            row = p % W
            load_row(x, x_bf16, from_bf16, t, window[row], bits)
            for c in range(C):
                acc[c] = conv_w[W1, c] * window[row, c]
            for tap in range(W1):
                src = (p - W1 + tap) % W
                for c in range(C):
                    acc[c] += conv_w[tap, c] * window[src, c]
            silu_inplace(acc, exponent)
            for c in range(Cq):
                yq[t, c] = acc[c]
                yk[t, c] = acc[Cq + c]
            for c in range(C - 2 * Cq):
                yv[t, c] = acc[2 * Cq + c]


@njit(void(float32[:, :], int16[:, :], boolean, float32[:, :, :], _INDEX, _INDEX, _INDEX, boolean[::1]), **COMPILE)
def conv_pool_advance(x, x_bf16, from_bf16, conv_pool, starts, ends, slots, keep):  # pragma: no cover - compiled
    """After `conv_silu_rows` over every token: each sequence's slot receives its last W-1 inputs (tokens, or
    the history before them where the sequence is shorter; zeros for history not kept). Arguments as there."""
    C = conv_pool.shape[2]
    W1 = conv_pool.shape[1]
    row = np.empty(C, np.float32)
    bits = np.empty(C, np.int32)
    for r in range(starts.shape[0]):
        a, b, s = starts[r], ends[r], slots[r]
        for tap in range(W1):  # position b - a + tap >= tap: a history row is read before it is overwritten
            _position_input(x, x_bf16, from_bf16, conv_pool, s, keep[r], a, b - a + tap, row, bits)
            for c in range(C):
                conv_pool[s, tap, c] = row[c]


@njit(void(float32[:, :], int16[:, :], float32[:, :], int16[:, :], float32[:, :], int16[:, :], boolean, float32[:, ::1],
           _VEC, int64, int64, boolean, float32, _VEC, _VEC, int64, _INDEX, int64, _ROWS, _ROWS, _ROWS, _ROWS,
           float32[:, ::1]), **COMPILE)
def conv_decode_inputs(qkv, qkv_bf16, f, f_bf16, beta_logits, beta_bf16, from_bf16, conv_w, conv_pool, slot_stride,
                       tap_stride, bounded, lower_bound, a_log, dt_bias, H, slots, num_slots, q, k, v, decay,
                       beta):  # pragma: no cover - compiled
    """The recurrence's inputs for one token of each of n sequences, from the pre-conv channels: qkv [n, C]
    (q|k|v channels), f [n, HV*K] the raw gate input and beta_logits [n, HV], each fp32 or, with from_bf16, as
    bf16 bits in the `_bf16` arguments (any strides); conv_w [W, C] (tap 0 the oldest), conv_pool [P, W-1, C]
    (the last W-1 inputs, oldest first, advanced in place), the gate's parameters (bounded:
    lower_bound * sigmoid(f + dt_bias), else -exp(a_log) * softplus(f + dt_bias)). Writes q, k [n, HV, K]
    (q/k heads expanded to the value heads, not normalised), v [n, HV, V], decay [n, HV, K] and
    sigmoid(beta) [n, HV]; rows of skipped sequences (slot < 0) are left as they are. Raises, before writing
    anything, where a slot is not below `num_slots` (the pools' slots, which the C recurrence trusts)."""
    n, HV, K = q.shape
    W1, C = conv_w.shape[0] - 1, conv_w.shape[1]
    for r in range(n):
        if slots[r] >= num_slots:
            raise ValueError("a slot lies outside the state pools")
    V = (C - 2 * H * K) // HV
    G = HV // H
    x = np.empty(C, np.float32)
    y = np.empty(C, np.float32)
    b = np.empty(HV, np.float32)
    bits = np.empty(C, np.int32)
    exponent = np.empty(C, np.int32)
    for r in range(n):
        s = slots[r]
        if s < 0:
            continue
        load_row(qkv, qkv_bf16, from_bf16, r, x, bits)
        # the causal conv's newest window, SiLU, and the window moved on by one. Rows are taken as slices: an
        # index computed at run time may be negative (numba then wraps it), and that check stops LLVM from
        # vectorising a loop (6x slower, measured)
        newest = conv_w[W1]
        for c in range(C):
            y[c] = newest[c] * x[c]
        for tap in range(W1):
            at = s * slot_stride + tap * tap_stride
            window, weight = conv_pool[at:at + C], conv_w[tap]
            for c in range(C):
                y[c] += weight[c] * window[c]
        for tap in range(W1):
            at = s * slot_stride + tap * tap_stride
            older = conv_pool[at:at + C]
            newer = conv_pool[at + tap_stride:at + tap_stride + C] if tap < W1 - 1 else x
            for c in range(C):
                older[c] = newer[c]
        silu_inplace(y, exponent)
        load_row(beta_logits, beta_bf16, from_bf16, r, b, bits)
        for h in range(HV):
            hq = h // G  # q/k head h serves value heads h*G .. h*G+G-1
            q[r, h] = y[hq * K:(hq + 1) * K]
            k[r, h] = y[(H + hq) * K:(H + hq + 1) * K]
            v[r, h] = y[2 * H * K + h * V:2 * H * K + (h + 1) * V]
            beta[r, h] = np.float32(1.0) / (np.float32(1.0) + np.exp(-b[h]))
    gate_decay_rows(f, f_bf16, from_bf16, dt_bias, bounded, lower_bound, a_log, K, decay.reshape((n, HV * K)))


@njit(void(float32[:, :, ::1], float32[:, :], int16[:, :], boolean, _VEC, float32, float32[:, ::1], int16[:, ::1],
           boolean), **COMPILE)
def gated_rms_norm_rows(o, gate, gate_bf16, gate_from_bf16, weight, eps, out, out_bf16,
                        to_bf16):  # pragma: no cover - compiled
    """KDA's output norm, out = o / rms(o) * weight * sigmoid(gate) per head: o [R, HV, V]; the gate [R, HV*V]
    as fp32 `gate` or, with gate_from_bf16, bf16 bits `gate_bf16` (any strides); out [R, HV*V] as fp32 `out`
    or, with to_bf16, bf16 bits `out_bf16` (rounded to nearest even)."""
    R, HV, V = o.shape
    n = HV * V
    g = np.empty(n, np.float32)
    bits = np.empty(n, np.int32)
    as_float = bits.view(np.float32)
    for r in range(R):
        load_row(gate, gate_bf16, gate_from_bf16, r, g, bits)
        for c in range(n):  # sigmoid(g)
            p, bits[c] = exp_parts(-g[c])
            g[c] = np.float32(1.0) / (np.float32(1.0) + p * as_float[c])
        for h in range(HV):
            ss = np.float32(0.0)
            for j in range(V):
                ss += o[r, h, j] * o[r, h, j]
            inv = np.float32(1.0) / np.sqrt(ss / np.float32(V) + eps)
            for j in range(V):
                g[h * V + j] *= o[r, h, j] * inv * weight[j]
        store_row(g, out, out_bf16, to_bf16, r, bits)
