"""One Triton kernel for everything of the chunked KDA forward that is local to a chunk (bounded gates only).

Per (chunk, value head) it does what the separate l2norm, gate + cumsum, intra-scores, solve and w/u kernels
of triton_chunk_fwd.py do, in one program, so the 64 x 64 score blocks and the inverse never leave the chip:

  1. q, k l2-normalised (rounded to the input dtype, as the separate kernel stores them), gate and in-chunk
     cumsum Gam, qg = scale q e^Gam and kg = k e^(Gam_last - Gam), all on the whole [BT, K] chunk;
  2. row block i of Aqk (incl. diagonal, times scale) and Akk (strict) as one [BC, BT] dot each: the left
     factor x_t e^(Gam_t - r_i) of the block's rows (r_i = Gam just before the block, so <= |x_t|), the
     right factor k_s e^(r_i - Gam_s) of the whole chunk (<= |k_s| before the block, <= e^(BC |lower_bound|)
     inside it, masked after it);
  3. Ai = (I + diag(beta) Akk)^-1 as in solve_kernel, then w = Ai (beta K e^Gam), u = Ai (beta V).

Row blocks of Gam, Akk and Ai are exchanged between the program's threads through a workspace in global
memory (a barrier between the steps; the lines stay in L1/L2). With STORE_SAVED the workspace is the saved
tensors the backward reads (gcum, Akk, Ai [T, HV, *]) and the normalised q, k and their rstd are written too;
without it (no autograd) each program owns one chunk-sized workspace and loops over chunks (a persistent grid),
so the workspace is rewritten in L2 instead of streamed to memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.kda.gate import gate_fn
from kernels.kda.triton_chunk_fwd import _chunk_coords


@triton.jit
def _normalised(x_ptr, off, m, L2NORM: tl.constexpr, eps):
    """Rows of q or k in fp32, l2-normalised and rounded to the input dtype; and their rstd."""
    b_x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
    r = tl.sum(b_x * 0.0, 1) + 1.0
    if L2NORM:
        r = tl.rsqrt(tl.sum(b_x * b_x, 1) + eps)
        b_x = (b_x * r[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    return b_x, r


@triton.jit
def fwd_intra_fused_kernel(
    q, k, v, f, beta, dt_bias, a_log, qn, kn, q_rstd, k_rstd, gcum, Akk, Ai, glast, Aqk, qg, kg, w, u,
    cu_seqlens, chunk_indices, n_tiles, scale, lower_bound, eps,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_GATE: tl.constexpr, HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr,
    STORE_SAVED: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    NB: tl.constexpr = BT // BC
    G: tl.constexpr = HV // H
    WH: tl.constexpr = HV if STORE_SAVED else 1  # workspace heads per row: the saved [T, HV, *] or one
    dt = k.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_i = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    a = 0.0
    for tile in range(pid, n_tiles, tl.num_programs(0)):
        i_c, i_hv = tile // HV, tile % HV
        i_h = i_hv // G
        _, i_t, bos, T = _chunk_coords(cu_seqlens, chunk_indices, i_c)
        rows = i_t * BT + o_t
        ok = rows < T
        m_tk = ok[:, None] & m_k[None, :]
        if STORE_SAVED:
            w_row, w_head = bos + i_t * BT, i_hv  # workspace row of the chunk's first token, and head
        else:
            w_row, w_head = pid * BT, 0
        ws_k = (w_row + o_t)[:, None] * (WH * K) + w_head * K + o_k[None, :]  # [BT, BK] in gcum
        ws_t = (w_row + o_t)[:, None] * (WH * BT) + w_head * BT + o_t[None, :]  # [BT, BT] in Akk / Ai
        # ---- 1. gate + cumsum, normalised q/k, qg and kg on the whole chunk
        tk_off = (bos + rows)[:, None] * (HV * K) + i_hv * K + o_k[None, :]
        x = tl.load(f + tk_off, mask=m_tk, other=0.0).to(tl.float32)
        if USE_GATE:
            if HAS_BIAS:
                x += tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)[None, :]
            x = gate_fn(x, a, lower_bound, True)
        x = tl.where(m_tk, x, 0.0)
        b_g = tl.cumsum(x, 0)
        g_last = tl.sum(tl.where((o_t == tl.minimum(T - i_t * BT, BT) - 1)[:, None], b_g, 0.0), 0)
        tl.store(gcum + ws_k, b_g, mask=m_tk)
        tl.store(glast + (i_c * HV + i_hv) * K + o_k, g_last, mask=m_k)
        qk_off = (bos + rows)[:, None] * (H * K) + i_h * K + o_k[None, :]
        b_q, r_q = _normalised(q, qk_off, m_tk, L2NORM, eps)
        b_k, r_k = _normalised(k, qk_off, m_tk, L2NORM, eps)
        if STORE_SAVED and L2NORM:
            if i_hv % G == 0:  # one writer per q/k head
                tl.store(qn + qk_off, b_q.to(qn.dtype.element_ty), mask=m_tk)
                tl.store(kn + qk_off, b_k.to(kn.dtype.element_ty), mask=m_tk)
                tl.store(q_rstd + (bos + rows) * H + i_h, r_q, mask=ok)
                tl.store(k_rstd + (bos + rows) * H + i_h, r_k, mask=ok)
        tl.store(qg + tk_off, (b_q * tl.where(m_tk, tl.exp(b_g), 0.0) * scale).to(qg.dtype.element_ty), mask=m_tk)
        tl.store(kg + tk_off, (b_k * tl.where(m_tk, tl.exp(g_last[None, :] - b_g), 0.0)).to(kg.dtype.element_ty),
                 mask=m_tk)
        b_kn = b_k.to(dt)  # what stays live through the scores: k in the input dtype and Gam
        tl.debug_barrier()
        # ---- 2. scores, row block by row block
        for i in tl.static_range(NB):
            rows_i = i_t * BT + i * BC + o_i
            ok_i = rows_i < T
            m_i = ok_i[:, None] & m_k[None, :]
            b_gi = tl.load(gcum + (w_row + i * BC + o_i)[:, None] * (WH * K) + w_head * K + o_k[None, :], mask=m_i,
                           other=0.0)
            ref = tl.zeros([BK], dtype=tl.float32)
            if i > 0:
                ref += tl.load(gcum + (w_row + i * BC - 1) * (WH * K) + w_head * K + o_k, mask=m_k, other=0.0)
            off_i = (bos + rows_i)[:, None] * (H * K) + i_h * K + o_k[None, :]
            b_qi, _ = _normalised(q, off_i, m_i, L2NORM, eps)
            b_ki, _ = _normalised(k, off_i, m_i, L2NORM, eps)
            e_left = tl.where(m_i, tl.exp(b_gi - ref[None, :]), 0.0)
            q_left = (b_qi * e_left * scale).to(dt)
            k_left = (b_ki * e_left).to(dt)
            m_right = ((o_t < (i + 1) * BC)[:, None]) & m_tk
            k_right = (b_kn.to(tl.float32) * tl.where(m_right, tl.exp(ref[None, :] - b_g), 0.0)).to(dt)  # [BT, BK]
            s_qk = tl.dot(q_left, tl.trans(k_right), input_precision=DOT_PREC)  # [BC, BT]
            s_kk = tl.dot(k_left, tl.trans(k_right), input_precision=DOT_PREC)
            r_loc = i * BC + o_i
            s_qk = tl.where(o_t[None, :] <= r_loc[:, None], s_qk, 0.0)
            s_kk = tl.where(o_t[None, :] < r_loc[:, None], s_kk, 0.0)
            m_a = ok_i[:, None] & (o_t < BT)[None, :]
            tl.store(Aqk + (bos + rows_i)[:, None] * (HV * BT) + i_hv * BT + o_t[None, :], s_qk.to(Aqk.dtype.element_ty),
                     mask=m_a)
            tl.store(Akk + (w_row + r_loc)[:, None] * (WH * BT) + w_head * BT + o_t[None, :], s_kk, mask=m_a)
        tl.debug_barrier()
        # ---- 3. Ai = (I + diag(beta) Akk)^-1: diagonal blocks by interleaved forward substitution (step r of
        # every block together), then the off-diagonal blocks row block by row block (as solve_kernel)
        o_b = tl.arange(0, NB)
        loc = o_b[:, None, None] * BC + o_i[None, :, None]  # [NB, BC, 1] row within the chunk
        cols = o_b[:, None, None] * BC + o_i[None, None, :]  # [NB, 1, BC]
        ok3 = (i_t * BT + loc < T) & (cols >= 0)
        b_beta3 = tl.load(beta + (bos + i_t * BT + loc) * HV + i_hv, mask=i_t * BT + loc < T, other=0.0).to(tl.float32)
        off3 = (w_row + loc) * (WH * BT) + w_head * BT + cols
        Y = -tl.load(Akk + off3, mask=ok3, other=0.0) * b_beta3
        for r in tl.static_range(2, BC):
            loc_r = o_b[:, None] * BC + r  # [NB, 1]
            ok_r = (i_t * BT + loc_r < T) & (o_i[None, :] >= 0)
            beta_r = tl.load(beta + (bos + i_t * BT + loc_r) * HV + i_hv, mask=i_t * BT + loc_r < T,
                             other=0.0).to(tl.float32)
            a_r = -tl.load(Akk + (w_row + loc_r) * (WH * BT) + w_head * BT + o_b[:, None] * BC + o_i[None, :], mask=ok_r,
                           other=0.0) * beta_r  # [NB, BC]
            a_r = a_r + tl.sum(a_r[:, :, None] * Y, 1)
            Y = tl.where((o_i == r)[None, :, None], a_r[:, None, :], Y)
        eye = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)
        tl.store(Ai + off3, Y + eye[None, :, :], mask=ok3)
        tl.debug_barrier()
        for i in tl.static_range(NB):
            rows_i = i_t * BT + i * BC + o_i
            ok_i = rows_i < T
            m_a = ok_i[:, None] & (o_i < BC)[None, :]
            a_off = (w_row + i * BC + o_i)[:, None] * (WH * BT) + w_head * BT + o_i[None, :]
            beta_i = tl.load(beta + (bos + rows_i) * HV + i_hv, mask=ok_i, other=0.0).to(tl.float32)
            M_ii = tl.load(Ai + a_off + i * BC, mask=m_a, other=0.0)
            for j in tl.static_range(NB):
                if j < i:
                    acc = tl.zeros([BC, BC], dtype=tl.float32)
                    for mm in tl.static_range(NB):
                        if mm >= j and mm < i:
                            L_im = tl.load(Akk + a_off + mm * BC, mask=m_a, other=0.0) * beta_i[:, None]
                            m_m = (i_t * BT + mm * BC + o_i < T)[:, None] & (o_i < BC)[None, :]
                            M_mj = tl.load(Ai + (w_row + mm * BC + o_i)[:, None] * (WH * BT) + w_head * BT + j * BC
                                           + o_i[None, :], mask=m_m, other=0.0)
                            acc += tl.dot(L_im, M_mj, input_precision="ieee")
                    tl.store(Ai + a_off + j * BC, -tl.dot(M_ii, acc, input_precision="ieee"), mask=m_a)
                elif j > i:
                    tl.store(Ai + a_off + j * BC, tl.zeros([BC, BC], dtype=tl.float32), mask=m_a)
            tl.debug_barrier()
        # ---- 4. w = Ai (beta K e^Gam), u = Ai (beta V), whole-chunk dots on the lower-triangular Ai
        b_M = tl.load(Ai + ws_t, mask=ok[:, None], other=0.0).to(dt)
        b_b = tl.load(beta + (bos + rows) * HV + i_hv, mask=ok, other=0.0).to(tl.float32)
        b_g = tl.load(gcum + ws_k, mask=m_tk, other=0.0)  # reloaded (L1/L2): fewer registers live through 3.
        b_k, _ = _normalised(k, qk_off, m_tk, L2NORM, eps)
        kb = (b_k * tl.where(m_tk, tl.exp(b_g), 0.0) * b_b[:, None]).to(dt)
        tl.store(w + tk_off, tl.dot(b_M, kb, input_precision=DOT_PREC).to(w.dtype.element_ty), mask=m_tk)
        for v0 in tl.static_range(0, V, BV):
            o_v = v0 + tl.arange(0, BV)
            m_tv = ok[:, None] & (o_v < V)[None, :]
            tv_off = (bos + rows)[:, None] * (HV * V) + i_hv * V + o_v[None, :]
            vb = (tl.load(v + tv_off, mask=m_tv, other=0.0).to(tl.float32) * b_b[:, None]).to(dt)
            tl.store(u + tv_off, tl.dot(b_M, vb, input_precision=DOT_PREC).to(u.dtype.element_ty), mask=m_tv)
        tl.debug_barrier()  # the next chunk rewrites the workspace
