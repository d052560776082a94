"""Triton kernels of the chunked KDA backward pass (math: chunk_torch.py's per-chunk form).

Per chunk, with S = state at the chunk start, dS' = gradient of the state at its end, M = Ai:
  1. state gradients (reverse over chunks): dVn = Aqk^T dO + (K e^(gam-Gam)) dS';
     dS = e^gam dS' + scale (Q e^Gam)^T dO - W^T dVn
  2. inter: dAqk = tril(dO Vn^T); dBv = M^T dVn -> dv = beta dBv; dW = -dVn S^T; dBk = M^T dW;
     dAkk = beta * strict(-(dBv U^T + dBk W^T)); direct parts of dq, dk, dGam, dgam, dbeta
  3. intra: gradients through the gated score matrices Aqk and Akk (BC x BC blocks, same reference
     points as the forward), one program per row block;
  4. gate: dg = reverse in-chunk cumsum of dGam (+ dgam), then the gate's derivative.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.kda.gate import gate_grad_fn
from kernels.kda.triton_chunk_fwd import (
    _block_reference,
    _chunk_head_coords,
    _gate_at_chunk_end,
    _gate_program,
    _start_state,
    _state_program,
)


@triton.jit
def bwd_state_kernel(
    qg, kg, gcum, w, Aqk, do, dht, dh, dh0, dvn, cu_seqlens, chunk_offsets,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_n, i_hv, bos, T, c0, NT, o_k, o_v, m_kv, s_off = _state_program(cu_seqlens, chunk_offsets, HV, K, V, BT, BK, BV)
    o_t = tl.arange(0, BT)
    b_dh = _start_state(dht, i_n, i_hv, s_off, m_kv, HV, K, V, BK, BV, HAS_DHT)
    for it_rev in range(0, NT):
        it = NT - 1 - it_rev
        tl.store(dh + ((c0 + it) * HV + i_hv) * K * V + s_off, b_dh.to(dh.dtype.element_ty), mask=m_kv)
        rows = it * BT + o_t
        ok = rows < T
        m_tk = ok[:, None] & (o_k < K)[None, :]
        m_tv = ok[:, None] & (o_v < V)[None, :]
        b_do = tl.load(do + (bos + rows)[:, None] * (HV * V) + i_hv * V + o_v[None, :], mask=m_tv, other=0.0)
        b_A = tl.load(Aqk + (bos + rows)[:, None] * (HV * BT) + i_hv * BT + o_t[None, :], mask=ok[:, None], other=0.0)
        g_last = _gate_at_chunk_end(gcum, bos, it * BT, T, i_hv, o_k, HV, K, BT)
        tk_off = (bos + rows)[:, None] * (HV * K) + i_hv * K + o_k[None, :]
        b_kg = tl.load(kg + tk_off, mask=m_tk, other=0.0)
        b_qg = tl.load(qg + tk_off, mask=m_tk, other=0.0)
        b_w = tl.load(w + tk_off, mask=m_tk, other=0.0)
        dt = b_kg.dtype
        b_dvn = tl.dot(tl.trans(b_A.to(dt)), b_do.to(dt), input_precision=DOT_PREC) + tl.dot(b_kg, b_dh.to(dt), input_precision=DOT_PREC)
        tl.store(dvn + (bos + rows)[:, None] * (HV * V) + i_hv * V + o_v[None, :], b_dvn.to(dvn.dtype.element_ty), mask=m_tv)
        b_dh = b_dh * tl.exp(g_last)[:, None] + tl.dot(tl.trans(b_qg), b_do.to(dt), input_precision=DOT_PREC) - tl.dot(tl.trans(b_w.to(dt)), b_dvn.to(dt), input_precision=DOT_PREC)
    if STORE_DH0:
        tl.store(dh0 + (i_n * HV + i_hv) * K * V + s_off, b_dh, mask=m_kv)


@triton.jit
def bwd_inter_kernel(
    q, k, v, beta, gcum, Akk, Ai, w, u, vn, h, dh, do, dvn,
    dv, dAqk, dAkk, dq_p, dk_p, dg_p, dgam, dbeta, cu_seqlens, chunk_indices, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One program per (chunk, value head). A first pass over V gives the [BT, BT] parts (dAqk, dv and
    the value side of dAkk); then one pass over V per K slice of width BK gives that slice's dq, dk, dg
    and dgam, and adds its share of dAkk's key side. Slices keep the live accumulators to three
    [BT, BK] tiles instead of three [BT, K] ones (register pressure), at the price of reading do, vn
    and dvn once more per slice."""
    i_c, i_hv, i_h, i_t, bos, T = _chunk_head_coords(cu_seqlens, chunk_indices, H, HV)
    rows = i_t * BT + tl.arange(0, BT)
    ok = rows < T
    o_t = tl.arange(0, BT)
    m_tt = ok[:, None] & (o_t < BT)[None, :]
    a_off = (bos + rows)[:, None] * (HV * BT) + i_hv * BT + o_t[None, :]
    dt = k.dtype.element_ty
    b_Mt = tl.trans(tl.load(Ai + a_off, mask=m_tt, other=0.0)).to(dt)
    b_beta = tl.load(beta + (bos + rows) * HV + i_hv, mask=ok, other=0.0).to(tl.float32)
    d_P = tl.zeros([BT, BT], dtype=tl.float32)
    d_Lv = tl.zeros([BT, BT], dtype=tl.float32)  # becomes -dL: the value side, then each slice's key side
    d_beta = tl.zeros([BT], dtype=tl.float32)
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_tv = ok[:, None] & (o_v < V)[None, :]
        tv_off = (bos + rows)[:, None] * (HV * V) + i_hv * V + o_v[None, :]
        b_do = tl.load(do + tv_off, mask=m_tv, other=0.0).to(dt)
        b_vn = tl.load(vn + tv_off, mask=m_tv, other=0.0).to(dt)
        b_dvn = tl.load(dvn + tv_off, mask=m_tv, other=0.0).to(dt)
        b_u = tl.load(u + tv_off, mask=m_tv, other=0.0).to(dt)
        b_v = tl.load(v + tv_off, mask=m_tv, other=0.0).to(tl.float32)
        d_P += tl.dot(b_do, tl.trans(b_vn), input_precision=DOT_PREC)
        b_dBv = tl.dot(b_Mt, b_dvn, input_precision=DOT_PREC)
        tl.store(dv + tv_off, (b_dBv * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_tv)
        d_beta += tl.sum(b_dBv * b_v, 1)
        d_Lv += tl.dot(b_dBv.to(dt), tl.trans(b_u), input_precision=DOT_PREC)
    tl.store(dAqk + a_off, tl.where(o_t[:, None] >= o_t[None, :], d_P, 0.0), mask=m_tt)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_tk = ok[:, None] & (o_k < K)[None, :]
        d_QE = tl.zeros([BT, BK], dtype=tl.float32)
        d_Kd = tl.zeros([BT, BK], dtype=tl.float32)
        d_W = tl.zeros([BT, BK], dtype=tl.float32)
        d_gam_h = tl.zeros([BK], dtype=tl.float32)
        for v0 in range(0, V, BV):
            o_v = v0 + tl.arange(0, BV)
            m_tv = ok[:, None] & (o_v < V)[None, :]
            m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
            tv_off = (bos + rows)[:, None] * (HV * V) + i_hv * V + o_v[None, :]
            s_off = (i_c * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
            b_do = tl.load(do + tv_off, mask=m_tv, other=0.0).to(dt)
            b_vn = tl.load(vn + tv_off, mask=m_tv, other=0.0).to(dt)
            b_dvn = tl.load(dvn + tv_off, mask=m_tv, other=0.0).to(dt)
            b_h = tl.load(h + s_off, mask=m_kv, other=0.0)
            b_dh = tl.load(dh + s_off, mask=m_kv, other=0.0)
            d_QE += tl.dot(b_do, tl.trans(b_h.to(dt)), input_precision=DOT_PREC)
            d_Kd += tl.dot(b_vn, tl.trans(b_dh.to(dt)), input_precision=DOT_PREC)
            d_W -= tl.dot(b_dvn, tl.trans(b_h.to(dt)), input_precision=DOT_PREC)
            d_gam_h += tl.sum(b_dh.to(tl.float32) * b_h.to(tl.float32), 1)
        tk_off = (bos + rows)[:, None] * (HV * K) + i_hv * K + o_k[None, :]
        qk_off = (bos + rows)[:, None] * (H * K) + i_h * K + o_k[None, :]
        b_w = tl.load(w + tk_off, mask=m_tk, other=0.0).to(dt)
        d_Bk = tl.dot(b_Mt, d_W.to(dt), input_precision=DOT_PREC)
        d_Lv += tl.dot(d_Bk.to(dt), tl.trans(b_w), input_precision=DOT_PREC)
        g_last = _gate_at_chunk_end(gcum, bos, i_t * BT, T, i_hv, o_k, HV, K, BT)
        b_g = tl.load(gcum + tk_off, mask=m_tk, other=0.0)
        b_q = tl.load(q + qk_off, mask=m_tk, other=0.0).to(tl.float32)
        b_k = tl.load(k + qk_off, mask=m_tk, other=0.0).to(tl.float32)
        e_g = tl.where(m_tk, tl.exp(b_g), 0.0)
        e_lg = tl.where(m_tk, tl.exp(g_last[None, :] - b_g), 0.0)
        d_beta += tl.sum(d_Bk * b_k * e_g, 1)
        d_QE = d_QE * scale * e_g
        d_Kd = d_Kd * e_lg
        d_Bk = d_Bk * b_beta[:, None] * e_g
        tl.store(dq_p + tk_off, d_QE, mask=m_tk)
        tl.store(dk_p + tk_off, d_Kd + d_Bk, mask=m_tk)
        tl.store(dg_p + tk_off, (d_QE * b_q) - (d_Kd * b_k) + (d_Bk * b_k), mask=m_tk)
        d_gam = tl.sum(d_Kd * b_k, 0) + d_gam_h * tl.exp(g_last)
        tl.store(dgam + (i_c * HV + i_hv) * K + o_k, d_gam, mask=o_k < K)
    d_L = tl.where(o_t[:, None] > o_t[None, :], -d_Lv, 0.0)
    b_Akk = tl.load(Akk + a_off, mask=m_tt, other=0.0)
    d_beta += tl.sum(d_L * b_Akk, 1)
    tl.store(dAkk + a_off, d_L * b_beta[:, None], mask=m_tt)
    tl.store(dbeta + (bos + rows) * HV + i_hv, d_beta, mask=ok)


@triton.jit
def _pairwise_grads(dX, a, b, g_i, R: tl.constexpr):
    """Diagonal block without factorised exponentials (unbounded gates): for X[t,s] = sum_c a_t b_s
    e^(g_t - g_s), t >= s, returns (dL/da [BC,BK], dL/db [BC,BK]). R marks the axis layout."""
    d = g_i[:, None, :] - g_i[None, :, :]
    e = tl.exp(tl.where(R[:, :, None], d, float("-inf")))
    da = tl.sum(dX[:, :, None] * b[None, :, :] * e, 1)
    db = tl.sum(dX[:, :, None] * a[:, None, :] * e, 0)
    return da, db


@triton.jit
def _mm(a, b, FP32: tl.constexpr, DOT_PREC: tl.constexpr):
    """Dot of the score-gradient blocks. FP32: fp32 operands at DOT_PREC (the config's
    `bwd_score_precision`): dg = a*da - b*db cancels, and bf16 operands here left dg ~3x less accurate
    than dq/dk (bf16-rounding emulation on CPU; 1.2e-2 vs fp64 on an H200)."""
    if FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=DOT_PREC)
    else:
        return tl.dot(a, b, input_precision=DOT_PREC)


@triton.jit
def bwd_intra_kernel(
    q, k, gcum, dAqk, dAkk, dq_p, dk_p, dg_p, dq, dk, dG, cu_seqlens, chunk_indices, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, SAFE: tl.constexpr, FP32_DOTS: tl.constexpr, DOT_PREC: tl.constexpr,
    DIAG_PREC: tl.constexpr,
):
    """Row block i of one chunk and value head, on one BK-column slice of K (program_id(2) = slice * NB +
    i; every column of K is independent here): dq, dk (per value head), and in dG each token's gate-
    gradient terms before the in-chunk reverse cumsum, which bwd_gate_kernel applies. The block's
    off-diagonal work is two [BC, BT] x [BT, BK] dots over the whole chunk (zero factors outside the
    blocks that take part). One program per row block and K slice: one per chunk needed 255 registers
    per thread (12% occupancy on an H200)."""
    i_c, i_hv, i_h, i_t, bos, T = _chunk_head_coords(cu_seqlens, chunk_indices, H, HV)
    NB: tl.constexpr = BT // BC
    i = tl.program_id(2) % NB
    o_i = tl.arange(0, BC)
    o_k = (tl.program_id(2) // NB) * BK + tl.arange(0, BK)
    m_k = o_k < K
    dt = k.dtype.element_ty
    if FP32_DOTS:
        dt = tl.float32
    o_t = tl.arange(0, BT)
    rows = i_t * BT + o_t
    qk_all = (bos + rows)[:, None] * (H * K) + i_h * K + o_k[None, :]
    tk_all = (bos + rows)[:, None] * (HV * K) + i_hv * K + o_k[None, :]
    rows_i = i_t * BT + i * BC + o_i
    ok_i = rows_i < T
    if i_t * BT + i * BC < T:
        m_i = ok_i[:, None] & m_k[None, :]
        tk_i = (bos + rows_i)[:, None] * (HV * K) + i_hv * K + o_k[None, :]
        qk_i = (bos + rows_i)[:, None] * (H * K) + i_h * K + o_k[None, :]
        b_g_i = tl.load(gcum + tk_i, mask=m_i, other=0.0)
        b_q_i = tl.load(q + qk_i, mask=m_i, other=0.0).to(tl.float32) * scale
        b_k_i = tl.load(k + qk_i, mask=m_i, other=0.0).to(tl.float32)
        # rows of block i against columns s <= its end: reference Gam just before block i
        ref = _block_reference(gcum, bos, i_t * BT, i, i_hv, o_k, m_k, HV, K, BC)
        da_P = tl.zeros([BC, BK], dtype=tl.float32)
        da_A = tl.zeros([BC, BK], dtype=tl.float32)
        db_P = tl.zeros([BC, BK], dtype=tl.float32)
        db_A = tl.zeros([BC, BK], dtype=tl.float32)
        a_row = (bos + rows_i)[:, None] * (HV * BT) + i_hv * BT + o_i[None, :]
        m_a_i = ok_i[:, None] & (o_i < BC)[None, :]
        if i > 0:  # the earlier blocks, all at once
            m_left = ((o_t < i * BC)[:, None] & m_k[None, :]) & (rows < T)[:, None]
            c_g = tl.load(gcum + tk_all, mask=m_left, other=0.0)
            c_k = tl.load(k + qk_all, mask=m_left, other=0.0).to(tl.float32)
            k_right = tl.where(m_left, c_k * tl.exp(tl.where(m_left, ref[None, :] - c_g, 0.0)), 0.0).to(dt)
            strip = (bos + rows_i)[:, None] * (HV * BT) + i_hv * BT + o_t[None, :]
            m_strip = ok_i[:, None] & (o_t < i * BC)[None, :]
            da_P += _mm(tl.load(dAqk + strip, mask=m_strip, other=0.0).to(dt), k_right, FP32_DOTS, DOT_PREC)
            da_A += _mm(tl.load(dAkk + strip, mask=m_strip, other=0.0).to(dt), k_right, FP32_DOTS, DOT_PREC)
        e_left = tl.where(m_i, tl.exp(b_g_i - ref[None, :]), 0.0)
        da_P *= e_left
        da_A *= e_left
        # columns of block i against rows t >= its start: reference at block i's last valid row
        last_i = tl.minimum(i_t * BT + i * BC + BC, T) - 1
        ref2 = tl.load(gcum + (bos + last_i) * (HV * K) + i_hv * K + o_k, mask=m_k, other=0.0)
        if i < NB - 1:  # the later blocks, all at once
            below = (o_t >= i * BC + BC) & (rows < T)
            m_below = below[:, None] & m_k[None, :]
            c_g = tl.load(gcum + tk_all, mask=m_below, other=0.0)
            e_m = tl.where(m_below, tl.exp(tl.where(m_below, c_g - ref2[None, :], 0.0)), 0.0)
            c_q = tl.load(q + qk_all, mask=m_below, other=0.0).to(tl.float32) * scale
            c_k = tl.load(k + qk_all, mask=m_below, other=0.0).to(tl.float32)
            col = (bos + rows)[:, None] * (HV * BT) + i_hv * BT + i * BC + o_i[None, :]
            m_col = below[:, None] & (o_i < BC)[None, :]
            dP_col = tl.load(dAqk + col, mask=m_col, other=0.0).to(dt)
            dA_col = tl.load(dAkk + col, mask=m_col, other=0.0).to(dt)
            db_P += _mm(tl.trans(dP_col), (c_q * e_m).to(dt), FP32_DOTS, DOT_PREC)
            db_A += _mm(tl.trans(dA_col), (c_k * e_m).to(dt), FP32_DOTS, DOT_PREC)
        e_right2 = tl.where(m_i, tl.exp(ref2[None, :] - b_g_i), 0.0)
        db_P *= e_right2
        db_A *= e_right2
        # the diagonal block
        dP_ii = tl.load(dAqk + a_row + i * BC, mask=m_a_i, other=0.0)
        dA_ii = tl.load(dAkk + a_row + i * BC, mask=m_a_i, other=0.0)
        if SAFE:
            k_r = (b_k_i * tl.where(m_i, tl.exp(ref[None, :] - b_g_i), 0.0)).to(dt)
            da_P += _mm(dP_ii.to(dt), k_r, FP32_DOTS, DIAG_PREC) * e_left
            da_A += _mm(dA_ii.to(dt), k_r, FP32_DOTS, DIAG_PREC) * e_left
            e_l2 = tl.where(m_i, tl.exp(b_g_i - ref2[None, :]), 0.0)
            db_P += _mm(tl.trans(dP_ii.to(dt)), (b_q_i * e_l2).to(dt), FP32_DOTS, DIAG_PREC) * e_right2
            db_A += _mm(tl.trans(dA_ii.to(dt)), (b_k_i * e_l2).to(dt), FP32_DOTS, DIAG_PREC) * e_right2
        else:
            R = (o_i[:, None] >= o_i[None, :]) & ok_i[:, None] & ok_i[None, :]
            t_da, t_db = _pairwise_grads(dP_ii, b_q_i, b_k_i, b_g_i, R)
            da_P += t_da
            db_P += t_db
            t_da, t_db = _pairwise_grads(dA_ii, b_k_i, b_k_i, b_g_i, R)
            da_A += t_da
            db_A += t_db
        tl.store(dq + tk_i, tl.load(dq_p + tk_i, mask=m_i, other=0.0) + da_P * scale, mask=m_i)
        tl.store(dk + tk_i, tl.load(dk_p + tk_i, mask=m_i, other=0.0) + db_P + da_A + db_A, mask=m_i)
        d_G = tl.load(dg_p + tk_i, mask=m_i, other=0.0) + b_q_i * da_P - b_k_i * db_P + b_k_i * (da_A - db_A)
        tl.store(dG + tk_i, d_G, mask=m_i)


@triton.jit
def bwd_gate_kernel(
    dG, dgam, f, dt_bias, cu_seqlens, chunk_indices, lower_bound,
    HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    USE_GATE: tl.constexpr, BOUNDED: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """In place in dG, for one chunk and value head: dg = the reverse in-chunk cumsum of the per-token
    terms plus the chunk-end term dgam; for the bounded in-kernel gate, times its derivative (= df).
    Unbounded gates leave dg to the host (its derivative also feeds A_log). One BK-column slice of K per
    program (program_id(2))."""
    i_c, i_hv, o_k, m, off, x = _gate_program(f, dt_bias, cu_seqlens, chunk_indices, HV, K, BT, BK, HAS_BIAS)
    b_dg = tl.cumsum(tl.load(dG + off, mask=m, other=0.0), 0, reverse=True)
    b_dg += tl.load(dgam + (i_c * HV + i_hv) * K + o_k, mask=o_k < K, other=0.0)[None, :]
    if USE_GATE and BOUNDED:
        b_dg = b_dg * gate_grad_fn(x, 0.0, lower_bound, BOUNDED)
    tl.store(dG + off, b_dg, mask=m)
