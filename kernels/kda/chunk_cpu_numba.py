"""The compiled pass of `chunk_cpu.py` (numba): every chunk's matmul operands from the token rows in one pass
(l2norm, the in-chunk decay sums and their exp factors, beta), written in the chunk-major layout the batched
matmuls read. In torch these are ~20 passes over [T, HV, K] plus gathers and copies; measured 3x the
matmuls' time on both an AVX2 and an AMX CPU."""

from __future__ import annotations

import numpy as np
from numba import boolean, float32, int16, int64, njit, void

from kernels.cpu_math import COMPILE, exp_parts, load_row
from kernels.kda.chunk_cpu import BLOCK
from kernels.kda.common import L2NORM_EPS

_ROWS = float32[:, :, ::1]
_CHUNKS = float32[:, :, :, ::1]
_INDEX = int64[::1]
_VEC = float32[::1]


@njit(inline="always", **COMPILE)
def _exp_into(x, out, bits):  # pragma: no cover - compiled
    """out <- exp(x) elementwise (x floored at -87: below, fp32 has no normal value); bits: int32 scratch."""
    scale = bits.view(np.float32)
    for i in range(x.shape[0]):
        p, bits[i] = exp_parts(x[i])
        out[i] = p * scale[i]


@njit(void(_ROWS, _ROWS, _ROWS, float32[:, :], int16[:, :], boolean, _VEC, float32, float32[:, ::1], boolean,
           float32, boolean, _INDEX, _INDEX, _CHUNKS, _CHUNKS, float32[:, :, :, :, ::1], _CHUNKS, _CHUNKS, _CHUNKS,
           _CHUNKS), **COMPILE)
def chunk_operands(q, k, v, f, f_bf16, from_bf16, dt_bias, lower_bound, beta, beta_sigmoid, scale, l2norm,
                   starts, ends, qo, kob, kin, qg, rhs, kt, d_last):  # pragma: no cover - compiled
    """Token rows q, k [rows, HV, K], v [rows, HV, V], the raw gate input f [rows HV, K] (fp32, or with from_bf16
    its bf16 bits f_bf16), dt_bias [HV K], beta [rows, HV] (logits with beta_sigmoid, else probabilities): the
    bounded gate g = lower_bound sigmoid(f + dt_bias) is the log-decay. Sequence n is rows
    starts[n] .. ends[n]-1, cut into chunks of C tokens (zero tokens past its end). For chunk c of sequence
    n, head h (r = n HV + h), token t of the chunk in 16-token block i = t // 16 with reference
    r_i = Gam[16 i], Gam the in-chunk cumulative log-decay:
        qo[c, r, t]      = scale q_t exp(Gam_t - r_i)          kob[c, r, t] = beta_t k_t exp(Gam_t - r_i)
        kin[c, r, i, s]  = k_s exp(r_i - Gam_s)  (s < 16 (i+1); zero rows above)
        qg[c, r, t]      = scale q_t exp(Gam_t)                rhs[c, r, t] = beta_t [v_t | k_t exp(Gam_t)]
        kt[c, r, t]      = k_t exp(Gam_last - Gam_t)             d_last[c, r, :, 0] = exp(Gam_last)
    q and k l2-normalised first with `l2norm`; lower_bound * 16 >= -80 keeps every factor in fp32's range."""
    NT, R, C, K = qo.shape
    HV = q.shape[1]
    V = v.shape[2]
    nb = C // BLOCK
    n_ck = C * K
    gam = np.empty(n_ck, np.float32)  # [C, K] tiles as flat arrays: loops over them vectorise
    kn = np.empty(n_ck, np.float32)
    qn = np.empty(n_ck, np.float32)
    within = np.empty(n_ck, np.float32)  # exp(Gam_t - r_i)
    inv_within = np.empty(n_ck, np.float32)
    e = np.empty(n_ck, np.float32)
    block_ref = np.empty((nb, K), np.float32)  # exp(r_i)
    block_tail = np.empty((nb, K), np.float32)  # exp(Gam_last - r_{i+1}) (last block: exp(Gam_last - r_i))
    block_step = np.empty((nb, K), np.float32)  # exp(r_{i+1} - r_i) (last block: 1)
    x = np.empty(n_ck, np.float32)
    b = np.empty(C, np.float32)
    cross = np.empty(K, np.float32)
    bits = np.empty(n_ck, np.int32)
    fbits = np.empty(K, np.int32)
    for n in range(starts.shape[0]):
        for h in range(HV):
            r = n * HV + h
            for c in range(NT):
                t0 = starts[n] + c * C
                m = max(0, min(C, ends[n] - t0))  # the chunk's real tokens; the rest are zeros
                for t in range(m):
                    rq = np.float32(1.0)
                    rk = np.float32(1.0)
                    if l2norm:
                        sq = np.float32(0.0)
                        sk = np.float32(0.0)
                        for i in range(K):
                            sq += q[t0 + t, h, i] * q[t0 + t, h, i]
                            sk += k[t0 + t, h, i] * k[t0 + t, h, i]
                        rq = np.float32(1.0) / np.sqrt(sq + np.float32(L2NORM_EPS))
                        rk = np.float32(1.0) / np.sqrt(sk + np.float32(L2NORM_EPS))
                    for i in range(K):
                        qn[t * K + i] = q[t0 + t, h, i] * rq
                        kn[t * K + i] = k[t0 + t, h, i] * rk
                    load_row(f, f_bf16, from_bf16, (t0 + t) * HV + h, x[t * K:(t + 1) * K], fbits)
                    for i in range(K):
                        x[t * K + i] = -(x[t * K + i] + dt_bias[h * K + i])
                    b[t] = beta[t0 + t, h]
                for j in range(m * K, n_ck):
                    qn[j] = 0.0
                    kn[j] = 0.0
                    x[j] = 0.0
                for t in range(m, C):
                    b[t] = 0.0
                if beta_sigmoid:
                    for t in range(m):
                        b[t] = -b[t]
                    _exp_into(b[:m], b[:m], bits)
                    for t in range(m):
                        b[t] = np.float32(1.0) / (np.float32(1.0) + b[t])
                _exp_into(x[:m * K], x[:m * K], bits)
                for j in range(m * K):
                    gam[j] = lower_bound / (np.float32(1.0) + x[j])
                for j in range(m * K, n_ck):
                    gam[j] = 0.0
                for j in range(K, n_ck):  # the in-chunk cumulative sum
                    gam[j] += gam[j - K]
                for t in range(C):
                    ref = (t - t % BLOCK) * K
                    for i in range(K):
                        x[t * K + i] = gam[t * K + i] - gam[ref + i]
                _exp_into(x, within, bits)
                for j in range(n_ck):
                    inv_within[j] = np.float32(1.0) / within[j]  # exp(r_i - Gam_t), in [1, e^{15 |lb|}]
                # per block i: exp(r_i) and the tail factor exp(Gam_last - r_{i+1}) exp(r_{i+1} - r_i), so that
                # exp(Gam_t) and exp(Gam_last - Gam_t) cost a multiply each, not an exp (floors at e^-87
                # only ever stand for factors <= 1 that multiply values <= 1)
                last = (C - 1) * K
                for bi in range(nb):
                    ri = bi * BLOCK * K
                    nxt = ri + BLOCK * K if bi + 1 < nb else last
                    for i in range(K):
                        x[ri + i] = gam[ri + i]
                        x[ri + K + i] = gam[last + i] - gam[nxt + i]
                        x[ri + 2 * K + i] = gam[nxt + i] - gam[ri + i]
                    _exp_into(x[ri:ri + 3 * K], e[ri:ri + 3 * K], bits)
                    if bi + 1 == nb:  # the last block: exp(Gam_last - Gam_t) = exp(Gam_last - r_i) exp(r_i - Gam_t)
                        for i in range(K):
                            e[ri + K + i] = e[ri + 2 * K + i]
                            e[ri + 2 * K + i] = np.float32(1.0)
                    for i in range(K):
                        block_ref[bi, i] = e[ri + i]
                        block_tail[bi, i] = e[ri + K + i]
                        block_step[bi, i] = e[ri + 2 * K + i]
                qo_, kob_, qg_, rhs_, kt_ = qo[c, r], kob[c, r], qg[c, r], rhs[c, r], kt[c, r]
                for t in range(C):
                    bi = t // BLOCK
                    for i in range(K):
                        w = within[t * K + i]
                        eg = block_ref[bi, i] * w  # exp(Gam_t)
                        qo_[t, i] = scale * qn[t * K + i] * w
                        kob_[t, i] = b[t] * kn[t * K + i] * w
                        qg_[t, i] = scale * qn[t * K + i] * eg
                        rhs_[t, V + i] = b[t] * kn[t * K + i] * eg
                        kt_[t, i] = kn[t * K + i] * (block_step[bi, i] * inv_within[t * K + i]) * block_tail[bi, i]
                for t in range(m):
                    for j in range(V):
                        rhs_[t, j] = b[t] * v[t0 + t, h, j]
                for t in range(m, C):
                    for j in range(V):
                        rhs_[t, j] = 0.0
                _exp_into(gam[last:], cross, bits)
                for i in range(K):
                    d_last[c, r, i, 0] = cross[i]
                for bi in range(nb):
                    ri = bi * BLOCK
                    kin_ = kin[c, r, bi]
                    for s in range(ri + BLOCK):
                        for i in range(K):
                            kin_[s, i] = kn[s * K + i] * inv_within[s * K + i]
                    for bj in range(bi):  # earlier blocks: k_s exp(r_j - Gam_s) exp(r_i - r_j), at most 1
                        for i in range(K):
                            x[i] = gam[ri * K + i] - gam[bj * BLOCK * K + i]
                        _exp_into(x[:K], cross, bits)
                        for s in range(bj * BLOCK, (bj + 1) * BLOCK):
                            for i in range(K):
                                kin_[s, i] *= cross[i]
                    for s in range(ri + BLOCK, C):
                        for i in range(K):
                            kin_[s, i] = 0.0
