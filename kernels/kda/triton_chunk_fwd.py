"""Triton kernels of the chunked KDA forward pass.

All kernels see a flattened token axis (B folded into T, sequences delimited by `cu_seqlens`) and a
list of chunks `chunk_indices` [NC, 2] = (sequence, chunk within it). Per chunk of BT tokens and value
head (Gam = in-chunk cumulative log-decay, see chunk_torch.py for the math):
  1. gate + cumsum     -> gcum [T, HV, K] fp32
  2. intra scores      -> Aqk [T, HV, BT] (incl. diagonal, times scale), Akk [T, HV, BT] (strict),
                          qg = scale Q e^Gam, kg = K e^(Gam_last - Gam)
  3. solve, then w/u   -> Ai = (I + diag(beta) Akk)^-1, w = Ai beta K e^Gam, u = Ai beta V
  4. state recurrence  -> h (state at each chunk start), vn = u - w h, final state, and the output
                          o = scale (Q e^Gam) h + Aqk vn
Intra-chunk scores are built from BC x BC blocks. Row block i uses one reference r_i (Gam just before the
block): left factor x_t e^(Gam_t - r_i) <= |x_t|, right factor k_s e^(r_i - Gam_s), which is <= |k_s| for
earlier blocks and at most e^(BC*|lower_bound|) (e^80 for BC=16, lb=-5) on the diagonal block; with the
bound (SAFE) every block is one tl.dot. Without it the diagonal blocks take pairwise exponentials.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.kda.gate import gate_fn


@triton.jit
def _chunk_coords(cu_seqlens, chunk_indices, i_c):
    i_n = tl.load(chunk_indices + i_c * 2).to(tl.int64)
    i_t = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    return i_n, i_t, bos, eos - bos


@triton.jit
def _chunk_head_coords(cu_seqlens, chunk_indices, H: tl.constexpr, HV: tl.constexpr):
    """Of a (chunk, value head) program: chunk i_c, value head i_hv, its q/k head i_h, the chunk's index
    i_t in its sequence, the sequence's first token bos and length T."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    _, i_t, bos, T = _chunk_coords(cu_seqlens, chunk_indices, i_c)
    return i_c, i_hv, i_h, i_t, bos, T


@triton.jit
def _state_program(cu_seqlens, chunk_offsets, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Of a (V tile, sequence x value head) program of the sequential state kernels: sequence i_n, value
    head i_hv, bos, T, the sequence's first chunk c0 and chunk count NT, and the [BK, BV] state tile's
    k/v offsets, mask and offset within one [K, V] state."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    NT = tl.cdiv(T, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    s_off = o_k[:, None] * V + o_v[None, :]
    return i_n, i_hv, bos, T, c0, NT, o_k, o_v, m_kv, s_off


@triton.jit
def _start_state(state, i_n, i_hv, s_off, m_kv, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, HAS_STATE: tl.constexpr):
    """Tile of sequence i_n's given [N, HV, K, V] state in fp32, zeros without one."""
    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_STATE:
        b_s += tl.load(state + (i_n * HV + i_hv) * K * V + s_off, mask=m_kv, other=0.0).to(tl.float32)
    return b_s


@triton.jit
def _gate_at_chunk_end(gcum, bos, chunk_start, T, i_hv, o_k, HV: tl.constexpr, K: tl.constexpr,
                       BT: tl.constexpr):
    """Gam at the last token of the chunk starting at chunk_start (its last valid token for a short one)."""
    last = tl.minimum(chunk_start + BT, T) - 1
    return tl.load(gcum + (bos + last) * (HV * K) + i_hv * K + o_k, mask=o_k < K, other=0.0)


@triton.jit
def _block_reference(gcum, bos, chunk_start, i, i_hv, o_k, m_k, HV: tl.constexpr, K: tl.constexpr,
                     BC: tl.constexpr):
    """Gam just before row block i (a program's runtime index) of the chunk starting at chunk_start, zeros
    for the first block: the reference point of that block's factorised scores."""
    return tl.load(gcum + (bos + chunk_start + i * BC - 1) * (HV * K) + i_hv * K + o_k, mask=m_k & (o_k * 0 + i > 0),
                   other=0.0)


@triton.jit
def _rows(x, off, m, L2NORM: tl.constexpr):
    """Rows of q or k in fp32; with L2NORM normalised here and rounded to the input dtype, as l2norm_fwd
    stores them (a forward without autograd skips that kernel; only bounded gates, whose kernels load whole
    rows of K)."""
    b_x = tl.load(x + off, mask=m, other=0.0).to(tl.float32)
    if L2NORM:
        b_x = (b_x * tl.rsqrt(tl.sum(b_x * b_x, 1) + 1e-6)[:, None]).to(x.dtype.element_ty).to(tl.float32)
    return b_x


@triton.jit
def _right_factor(k, gcum, bos, rows, T, ref, i_h, i_hv, o_k, m_k, H: tl.constexpr, HV: tl.constexpr,
                  K: tl.constexpr, L2NORM: tl.constexpr):
    """k_s e^(ref - Gam_s) in fp32 for the rows of an earlier sub-block (zero outside the sequence)."""
    m = (rows < T)[:, None] & m_k[None, :]
    b_g = tl.load(gcum + (bos + rows)[:, None] * (HV * K) + i_hv * K + o_k[None, :], mask=m, other=0.0)
    b_k = _rows(k, (bos + rows)[:, None] * (H * K) + i_h * K + o_k[None, :], m, L2NORM)
    return b_k * tl.where(m, tl.exp(ref[None, :] - b_g), 0.0)


@triton.jit
def _gate_program(f, dt_bias, cu_seqlens, chunk_indices, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                  BK: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Of a (chunk, value head, K slice) program of the gate kernels: chunk i_c, value head i_hv, the
    [BT, BK] tile's K offsets, mask and offsets into [T, HV, K], and the gate's input f (+ dt_bias) in fp32."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    _, i_t, bos, T = _chunk_coords(cu_seqlens, chunk_indices, i_c)
    rows = i_t * BT + tl.arange(0, BT)
    o_k = tl.program_id(2) * BK + tl.arange(0, BK)
    m = (rows < T)[:, None] & (o_k < K)[None, :]
    off = (bos + rows)[:, None] * (HV * K) + i_hv * K + o_k[None, :]
    x = tl.load(f + off, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(dt_bias + i_hv * K + o_k, mask=o_k < K, other=0.0).to(tl.float32)[None, :]
    return i_c, i_hv, o_k, m, off, x


@triton.jit
def gate_cumsum_kernel(
    f, dt_bias, a_log, gcum, cu_seqlens, chunk_indices, lower_bound,
    HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    USE_GATE: tl.constexpr, BOUNDED: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """gcum of one chunk and value head on one BK-column slice of K (program_id(2)): the gate applied to f,
    then the in-chunk cumulative sum. Without USE_GATE, f is already the log-decay."""
    _, i_hv, o_k, m, off, x = _gate_program(f, dt_bias, cu_seqlens, chunk_indices, HV, K, BT, BK, HAS_BIAS)
    if USE_GATE:
        a = 0.0
        if not BOUNDED:
            a = tl.load(a_log + i_hv).to(tl.float32)
        x = tl.where(m, gate_fn(x, a, lower_bound, BOUNDED), 0.0)
    tl.store(gcum + off, tl.cumsum(x, 0), mask=m)


@triton.jit
def _diag_block_pairwise(x, k, g, rows, row_ok, xk_head, xk_stride, g_head, g_stride, K: tl.constexpr,
                         BC: tl.constexpr, BKS: tl.constexpr, x_scale):
    """sum_c x_t k_s exp(g_t - g_s) for t >= s inside one diagonal block, without factorising the
    exponential (for unbounded gates). rows [BC] are global token ids; x and k share one layout."""
    acc = tl.zeros([BC, BC], dtype=tl.float32)
    o_i = tl.arange(0, BC)
    causal = (o_i[:, None] >= o_i[None, :]) & row_ok[:, None] & row_ok[None, :]
    for k0 in range(0, K, BKS):
        o_k = k0 + tl.arange(0, BKS)
        m = row_ok[:, None] & (o_k < K)[None, :]
        xk_off = rows[:, None] * xk_stride + xk_head + o_k[None, :]
        b_x = tl.load(x + xk_off, mask=m, other=0.0).to(tl.float32) * x_scale
        b_k = tl.load(k + xk_off, mask=m, other=0.0).to(tl.float32)
        b_g = tl.load(g + rows[:, None] * g_stride + g_head + o_k[None, :], mask=m, other=0.0)
        d = b_g[:, None, :] - b_g[None, :, :]
        e = tl.exp(tl.where(causal[:, :, None], d, float("-inf")))
        acc += tl.sum(b_x[:, None, :] * b_k[None, :, :] * e, 2)
    return acc


@triton.jit
def intra_scores_kernel(
    q, k, gcum, Aqk, Akk, qg, kg, kge, cu_seqlens, chunk_indices, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, BKS: tl.constexpr, SAFE: tl.constexpr, DOT_PREC: tl.constexpr, L2NORM: tl.constexpr = False,
    STORE_KGE: tl.constexpr = False, ROW_BLOCK_FIRST: tl.constexpr = False, UPPER_KK: tl.constexpr = True,
):
    """Row block i = program_id(2) of one chunk and value head: its rows of Aqk (incl. diagonal, times
    scale) and Akk (strictly lower), and of the gated qg = scale q e^Gam and kg = k e^(Gam_last - Gam)
    that the state and output kernels consume (so their loops carry no exponentials). q and k have H
    heads; value head i_hv reads head i_hv // (HV // H). One program per row block, not per chunk: a
    whole chunk's blocks in one program needed ~240 registers per thread (12% occupancy on an H200).
    With STORE_KGE also kge = k e^Gam (the solve + w/u kernel of triton_chunk_infer.py reads it). With
    ROW_BLOCK_FIRST the grid is (row block, chunk, head), so a chunk's row blocks, which re-read the earlier
    blocks' k and gcum, run side by side. Without UPPER_KK, Akk's blocks above the diagonal are not written
    (a reader that takes only its diagonal and lower blocks)."""
    if ROW_BLOCK_FIRST:
        i, i_hv = tl.program_id(0), tl.program_id(2)
        i_h = i_hv // (HV // H)
        _, i_t, bos, T = _chunk_coords(cu_seqlens, chunk_indices, tl.program_id(1))
    else:
        _, i_hv, i_h, i_t, bos, T = _chunk_head_coords(cu_seqlens, chunk_indices, H, HV)
        i = tl.program_id(2)
    o_i = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    NB: tl.constexpr = BT // BC
    rows_i = i_t * BT + i * BC + o_i
    ok_i = rows_i < T
    m_i = ok_i[:, None] & m_k[None, :]
    qk_off_i = (bos + rows_i)[:, None] * (H * K) + i_h * K + o_k[None, :]
    g_off_i = (bos + rows_i)[:, None] * (HV * K) + i_hv * K + o_k[None, :]
    b_g_i = tl.load(gcum + g_off_i, mask=m_i, other=0.0)
    ref = _block_reference(gcum, bos, i_t * BT, i, i_hv, o_k, m_k, HV, K, BC)
    e_left = tl.where(m_i, tl.exp(b_g_i - ref[None, :]), 0.0)
    b_q = _rows(q, qk_off_i, m_i, L2NORM)
    b_k = _rows(k, qk_off_i, m_i, L2NORM)
    g_last = _gate_at_chunk_end(gcum, bos, i_t * BT, T, i_hv, o_k, HV, K, BT)
    e_g = tl.where(m_i, tl.exp(b_g_i), 0.0)
    tl.store(qg + g_off_i, (b_q * e_g * scale).to(qg.dtype.element_ty), mask=m_i)
    if STORE_KGE:
        tl.store(kge + g_off_i, (b_k * e_g).to(kge.dtype.element_ty), mask=m_i)
    tl.store(kg + g_off_i, (b_k * tl.where(m_i, tl.exp(g_last[None, :] - b_g_i), 0.0)).to(kg.dtype.element_ty),
             mask=m_i)
    q_left = (b_q * e_left * scale).to(k.dtype.element_ty)
    k_left = (b_k * e_left).to(k.dtype.element_ty)
    a_off = (bos + rows_i)[:, None] * (HV * BT) + i_hv * BT + o_i[None, :]
    m_a = ok_i[:, None] & (o_i < BC)[None, :]
    for j in tl.static_range(NB):
        if j < i:
            k_right = _right_factor(k, gcum, bos, i_t * BT + j * BC + o_i, T, ref, i_h, i_hv, o_k, m_k,
                                    H, HV, K, L2NORM).to(k.dtype.element_ty)
            s_qk = tl.dot(q_left, tl.trans(k_right), input_precision=DOT_PREC)
            s_kk = tl.dot(k_left, tl.trans(k_right), input_precision=DOT_PREC)
            tl.store(Aqk + a_off + j * BC, s_qk.to(Aqk.dtype.element_ty), mask=m_a)
            tl.store(Akk + a_off + j * BC, s_kk, mask=m_a)
        elif j == i:
            if SAFE:
                k_right = (b_k * tl.where(m_i, tl.exp(ref[None, :] - b_g_i), 0.0)).to(k.dtype.element_ty)
                s_qk = tl.dot(q_left, tl.trans(k_right), input_precision=DOT_PREC)
                s_kk = tl.dot(k_left, tl.trans(k_right), input_precision=DOT_PREC)
                s_qk = tl.where(o_i[:, None] >= o_i[None, :], s_qk, 0.0)
            else:
                s_qk = _diag_block_pairwise(q, k, gcum, bos + rows_i, ok_i, i_h * K, H * K, i_hv * K, HV * K,
                                            K, BC, BKS, scale)
                s_kk = _diag_block_pairwise(k, k, gcum, bos + rows_i, ok_i, i_h * K, H * K, i_hv * K, HV * K,
                                            K, BC, BKS, 1.0)
            s_kk = tl.where(o_i[:, None] > o_i[None, :], s_kk, 0.0)
            tl.store(Aqk + a_off + j * BC, s_qk.to(Aqk.dtype.element_ty), mask=m_a)
            tl.store(Akk + a_off + j * BC, s_kk, mask=m_a)
        else:
            tl.store(Aqk + a_off + j * BC, tl.zeros([BC, BC], dtype=tl.float32).to(Aqk.dtype.element_ty), mask=m_a)
            if UPPER_KK:
                tl.store(Akk + a_off + j * BC, tl.zeros([BC, BC], dtype=tl.float32), mask=m_a)


@triton.jit
def diag_inverses(beta, Akk, bos, i_t, T, i_hv, HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """(I + L_ii)^-1 - I of a chunk's diagonal blocks as one [NB, BC, BC] stack, L = diag(beta) Akk
    (strictly lower in each block): an interleaved forward substitution, step r of every block together,
    row r of L read from memory. Also returns the stack's offsets into [T, HV, BT] and their mask."""
    NB: tl.constexpr = BT // BC
    o_b = tl.arange(0, NB)
    o_i = tl.arange(0, BC)
    rows = i_t * BT + o_b[:, None, None] * BC + o_i[None, :, None]  # [NB, BC, 1]
    cols = o_b[:, None, None] * BC + o_i[None, None, :]  # [NB, 1, BC]
    ok = (rows < T) & (cols >= 0)
    b_beta = tl.load(beta + (bos + rows) * HV + i_hv, mask=rows < T, other=0.0).to(tl.float32)
    off = (bos + rows) * (HV * BT) + i_hv * BT + cols
    Y = -tl.load(Akk + off, mask=ok, other=0.0) * b_beta  # rows of (I + L)^-1 - I, built row by row
    for r in tl.static_range(2, BC):
        row_r = i_t * BT + o_b[:, None] * BC + r  # [NB, 1]
        ok_r = (row_r < T) & (o_i[None, :] >= 0)
        beta_r = tl.load(beta + (bos + row_r) * HV + i_hv, mask=row_r < T, other=0.0).to(tl.float32)
        a = -tl.load(Akk + (bos + row_r) * (HV * BT) + i_hv * BT + o_b[:, None] * BC + o_i[None, :], mask=ok_r,
                     other=0.0) * beta_r  # [NB, BC]
        a = a + tl.sum(a[:, :, None] * Y, 1)
        Y = tl.where((o_i == r)[None, :, None], a[:, None, :], Y)
    return Y, off, ok


@triton.jit
def solve_kernel(
    beta, Akk, Ai, cu_seqlens, chunk_indices,
    H: tl.constexpr, HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    """Ai = (I + L)^-1, L = diag(beta) Akk strictly lower, of one chunk and value head: the diagonal
    blocks' inverses as one interleaved forward substitution (step r of every block together; row r of
    L read from memory), then the off-diagonal blocks M_ij = -M_ii sum_m L_im M_mj row block by row
    block, through Ai in memory (a barrier per row block)."""
    _, i_hv, i_h, i_t, bos, T = _chunk_head_coords(cu_seqlens, chunk_indices, H, HV)
    NB: tl.constexpr = BT // BC
    o_i = tl.arange(0, BC)
    Y, off, ok = diag_inverses(beta, Akk, bos, i_t, T, i_hv, HV, BT, BC)
    eye = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)
    tl.store(Ai + off, Y + eye[None, :, :], mask=ok)
    tl.debug_barrier()
    for i in tl.static_range(NB):
        rows_i = i_t * BT + i * BC + o_i
        ok_i = rows_i < T
        m_a = ok_i[:, None] & (o_i < BC)[None, :]
        a_off = (bos + rows_i)[:, None] * (HV * BT) + i_hv * BT + o_i[None, :]
        beta_i = tl.load(beta + (bos + rows_i) * HV + i_hv, mask=ok_i, other=0.0).to(tl.float32)
        M_ii = tl.load(Ai + a_off + i * BC, mask=m_a, other=0.0)
        for j in tl.static_range(NB):
            if j < i:
                acc = tl.zeros([BC, BC], dtype=tl.float32)
                for mm in tl.static_range(NB):
                    if mm >= j and mm < i:
                        L_im = tl.load(Akk + a_off + mm * BC, mask=m_a, other=0.0) * beta_i[:, None]
                        rows_m = i_t * BT + mm * BC + o_i
                        m_m = (rows_m < T)[:, None] & (o_i < BC)[None, :]
                        M_mj = tl.load(Ai + (bos + rows_m)[:, None] * (HV * BT) + i_hv * BT + j * BC + o_i[None, :],
                                       mask=m_m, other=0.0)
                        acc += tl.dot(L_im, M_mj, input_precision="ieee")
                tl.store(Ai + a_off + j * BC, -tl.dot(M_ii, acc, input_precision="ieee"), mask=m_a)
            elif j > i:
                tl.store(Ai + a_off + j * BC, tl.zeros([BC, BC], dtype=tl.float32), mask=m_a)
        tl.debug_barrier()


@triton.jit
def wu_kernel(
    k, v, beta, gcum, Ai, w, u, cu_seqlens, chunk_indices,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr, L2NORM: tl.constexpr = False,
):
    """w = Ai (beta K e^Gam) (program_id(2) == 0) or one BV-column tile of u = Ai (beta V) (the others),
    whole-chunk dots on the lower-triangular Ai."""
    _, i_hv, i_h, i_t, bos, T = _chunk_head_coords(cu_seqlens, chunk_indices, H, HV)
    s = tl.program_id(2)
    o_t = tl.arange(0, BT)
    rows = i_t * BT + o_t
    ok = rows < T
    dt = k.dtype.element_ty
    b_M = tl.load(Ai + (bos + rows)[:, None] * (HV * BT) + i_hv * BT + o_t[None, :], mask=ok[:, None],
                  other=0.0).to(dt)
    b_b = tl.load(beta + (bos + rows) * HV + i_hv, mask=ok, other=0.0).to(tl.float32)
    if s == 0:
        o_k = tl.arange(0, BK)
        m_tk = ok[:, None] & (o_k < K)[None, :]
        b_k = _rows(k, (bos + rows)[:, None] * (H * K) + i_h * K + o_k[None, :], m_tk, L2NORM)
        tk_off = (bos + rows)[:, None] * (HV * K) + i_hv * K + o_k[None, :]
        b_g = tl.load(gcum + tk_off, mask=m_tk, other=0.0)
        kb = (b_k * tl.where(m_tk, tl.exp(b_g), 0.0) * b_b[:, None]).to(dt)
        tl.store(w + tk_off, tl.dot(b_M, kb, input_precision=DOT_PREC).to(w.dtype.element_ty), mask=m_tk)
    else:
        o_v = (s - 1) * BV + tl.arange(0, BV)
        m_tv = ok[:, None] & (o_v < V)[None, :]
        tv_off = (bos + rows)[:, None] * (HV * V) + i_hv * V + o_v[None, :]
        vb = (tl.load(v + tv_off, mask=m_tv, other=0.0).to(tl.float32) * b_b[:, None]).to(dt)
        tl.store(u + tv_off, tl.dot(b_M, vb, input_precision=DOT_PREC).to(u.dtype.element_ty), mask=m_tv)


@triton.jit
def fwd_state_kernel(
    kg, gcum, w, u, vn, h, h0, ht, qg, Aqk, o, cu_seqlens, chunk_offsets,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr, DOT_PREC: tl.constexpr,
    STORE_SAVED: tl.constexpr = True,
):
    """Sequential over a sequence's chunks; one program per (V tile, sequence, value head). Each chunk's
    output o = (Q e^Gam) h + Aqk vn comes from the state while it is in registers (an output kernel of its
    own re-read h and vn: H200, 32K, forward 3.83 -> 3.61 ms without it). Without STORE_SAVED (a forward
    without autograd) the per-chunk states h and the new values vn, which only the backward reads, are not
    written."""
    i_n, i_hv, bos, T, c0, NT, o_k, o_v, m_kv, s_off = _state_program(cu_seqlens, chunk_offsets, HV, K, V, BT, BK, BV)
    o_t = tl.arange(0, BT)
    b_h = _start_state(h0, i_n, i_hv, s_off, m_kv, HV, K, V, BK, BV, HAS_H0)
    for it in range(0, NT):
        if STORE_SAVED:
            tl.store(h + ((c0 + it) * HV + i_hv) * K * V + s_off, b_h.to(h.dtype.element_ty), mask=m_kv)
        rows = it * BT + o_t
        ok = rows < T
        m_tk = ok[:, None] & (o_k < K)[None, :]
        m_tv = ok[:, None] & (o_v < V)[None, :]
        b_w = tl.load(w + (bos + rows)[:, None] * (HV * K) + i_hv * K + o_k[None, :], mask=m_tk, other=0.0)
        b_u = tl.load(u + (bos + rows)[:, None] * (HV * V) + i_hv * V + o_v[None, :], mask=m_tv, other=0.0)
        b_vn = b_u.to(tl.float32) - tl.dot(b_w.to(kg.dtype.element_ty), b_h.to(kg.dtype.element_ty), input_precision=DOT_PREC)
        if STORE_SAVED:
            tl.store(vn + (bos + rows)[:, None] * (HV * V) + i_hv * V + o_v[None, :], b_vn.to(vn.dtype.element_ty),
                     mask=m_tv)
        dt = qg.dtype.element_ty  # h and vn rounded as stored, as the backward sees them
        b_qg = tl.load(qg + (bos + rows)[:, None] * (HV * K) + i_hv * K + o_k[None, :], mask=m_tk, other=0.0)
        b_A = tl.load(Aqk + (bos + rows)[:, None] * (HV * BT) + i_hv * BT + o_t[None, :], mask=ok[:, None], other=0.0)
        b_o = tl.dot(b_qg, b_h.to(h.dtype.element_ty).to(dt), input_precision=DOT_PREC)
        b_o += tl.dot(b_A.to(dt), b_vn.to(vn.dtype.element_ty).to(dt), input_precision=DOT_PREC)
        tl.store(o + (bos + rows)[:, None] * (HV * V) + i_hv * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)
        g_last = _gate_at_chunk_end(gcum, bos, it * BT, T, i_hv, o_k, HV, K, BT)
        b_kg = tl.load(kg + (bos + rows)[:, None] * (HV * K) + i_hv * K + o_k[None, :], mask=m_tk, other=0.0)
        b_h = b_h * tl.exp(g_last)[:, None] + tl.dot(tl.trans(b_kg), b_vn.to(b_kg.dtype), input_precision=DOT_PREC)
    if STORE_FINAL:
        tl.store(ht + (i_n * HV + i_hv) * K * V + s_off, b_h, mask=m_kv)
