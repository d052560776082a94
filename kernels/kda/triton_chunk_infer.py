"""Triton kernel of the chunked KDA forward without autograd, for bounded gates (prefill, and any forward
whose inputs need no gradient): solve_wu_kernel replaces the solve and w/u kernels of triton_chunk_fwd.py.
One program per (chunk, value head): the diagonal blocks of (I + diag(beta) Akk)^-1 by forward substitution,
the off-diagonal blocks merged in registers, then w = Ai diag(beta) kge and u = Ai diag(beta) v, with
kge = k e^Gam written by the scores kernel; Ai never leaves registers (the separate kernels write it in
fp32 and the w/u kernel read it three times). Chunks of 2 or 4 sub-blocks (BT / BC), the blocks unrolled by
hand: Triton has no arrays of tiles.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.kda.triton_chunk_fwd import _chunk_head_coords, diag_inverses


@triton.jit
def _block(Y, i, NB: tl.constexpr):
    """Tile i of a [NB, BC, BC] stack."""
    return tl.sum(tl.where((tl.arange(0, NB) == i)[:, None, None], Y, 0.0), 0)


@triton.jit
def _l_block(Akk, beta_i, bos, rows_i, T, i_hv, j, HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """L_ij = diag(beta_i) Akk_ij of an off-diagonal block (fp32)."""
    o_i = tl.arange(0, BC)
    m = (rows_i < T)[:, None] & (o_i < BC)[None, :]
    b = tl.load(Akk + (bos + rows_i)[:, None] * (HV * BT) + i_hv * BT + j * BC + o_i[None, :], mask=m, other=0.0)
    return b * beta_i[:, None]


@triton.jit
def _apply_rows(x, y, P00, P10, P11, P20, P21, P22, P30, P31, P32, P33, bos, i_hv, r0, T, o_c, m_c, HV: tl.constexpr, C: tl.constexpr,
                BC: tl.constexpr, NB: tl.constexpr, DOT_PREC: tl.constexpr):
    """y rows = P x rows on one column slice o_c of C columns: row block i is sum_{j <= i} P_ij x_j (the
    tiles P2*, P3* are read only for chunks of 4 blocks)."""
    r1 = r0 + BC
    r2 = r0 + 2 * BC
    r3 = r0 + 3 * BC
    dt = P00.dtype
    x0 = tl.load(x + (bos + r0)[:, None] * (HV * C) + i_hv * C + o_c[None, :], mask=(r0 < T)[:, None] & m_c[None, :],
                 other=0.0).to(dt)
    x1 = tl.load(x + (bos + r1)[:, None] * (HV * C) + i_hv * C + o_c[None, :], mask=(r1 < T)[:, None] & m_c[None, :],
                 other=0.0).to(dt)
    y0 = tl.dot(P00, x0, input_precision=DOT_PREC)
    y1 = tl.dot(P11, x1, tl.dot(P10, x0, input_precision=DOT_PREC), input_precision=DOT_PREC)
    tl.store(y + (bos + r0)[:, None] * (HV * C) + i_hv * C + o_c[None, :], y0.to(y.dtype.element_ty),
             mask=(r0 < T)[:, None] & m_c[None, :])
    tl.store(y + (bos + r1)[:, None] * (HV * C) + i_hv * C + o_c[None, :], y1.to(y.dtype.element_ty),
             mask=(r1 < T)[:, None] & m_c[None, :])
    if NB == 4:
        x2 = tl.load(x + (bos + r2)[:, None] * (HV * C) + i_hv * C + o_c[None, :],
                     mask=(r2 < T)[:, None] & m_c[None, :], other=0.0).to(dt)
        x3 = tl.load(x + (bos + r3)[:, None] * (HV * C) + i_hv * C + o_c[None, :],
                     mask=(r3 < T)[:, None] & m_c[None, :], other=0.0).to(dt)
        y2 = tl.dot(P20, x0, input_precision=DOT_PREC)
        y2 = tl.dot(P21, x1, y2, input_precision=DOT_PREC)
        y2 = tl.dot(P22, x2, y2, input_precision=DOT_PREC)
        y3 = tl.dot(P30, x0, input_precision=DOT_PREC)
        y3 = tl.dot(P31, x1, y3, input_precision=DOT_PREC)
        y3 = tl.dot(P32, x2, y3, input_precision=DOT_PREC)
        y3 = tl.dot(P33, x3, y3, input_precision=DOT_PREC)
        tl.store(y + (bos + r2)[:, None] * (HV * C) + i_hv * C + o_c[None, :], y2.to(y.dtype.element_ty),
                 mask=(r2 < T)[:, None] & m_c[None, :])
        tl.store(y + (bos + r3)[:, None] * (HV * C) + i_hv * C + o_c[None, :], y3.to(y.dtype.element_ty),
                 mask=(r3 < T)[:, None] & m_c[None, :])


@triton.jit
def solve_wu_kernel(
    beta, Akk, kge, v, w, u, cu_seqlens, chunk_indices,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """w = Ai diag(beta) kge and u = Ai diag(beta) v of one chunk and value head, Ai = (I + L)^-1 with
    L = diag(beta) Akk: diagonal blocks M_ii by forward substitution, then M_ij = -M_ii sum_{j<=m<i} L_im M_mj
    as fp32 register tiles, then the products on K and V slices in the input dtype (DOT_PREC: tf32 for bf16
    inputs, whose products round Ai to bf16 anyway; ieee for fp32 inputs)."""
    _, i_hv, i_h, i_t, bos, T = _chunk_head_coords(cu_seqlens, chunk_indices, H, HV)
    NB: tl.constexpr = BT // BC
    o_i = tl.arange(0, BC)
    r0 = i_t * BT + o_i
    r1 = r0 + BC
    r2 = r0 + 2 * BC
    r3 = r0 + 3 * BC
    Y, _, _ = diag_inverses(beta, Akk, bos, i_t, T, i_hv, HV, BT, BC)
    eye = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)
    b0 = tl.load(beta + (bos + r0) * HV + i_hv, mask=r0 < T, other=0.0).to(tl.float32)
    b1 = tl.load(beta + (bos + r1) * HV + i_hv, mask=r1 < T, other=0.0).to(tl.float32)
    M00 = _block(Y, 0, NB) + eye
    M11 = _block(Y, 1, NB) + eye
    M10 = -tl.dot(M11, tl.dot(_l_block(Akk, b1, bos, r1, T, i_hv, 0, HV, BT, BC), M00, input_precision=DOT_PREC),
                  input_precision=DOT_PREC)
    dt = kge.dtype.element_ty
    P00 = (M00 * b0[None, :]).to(dt)
    P10 = (M10 * b0[None, :]).to(dt)
    P11 = (M11 * b1[None, :]).to(dt)
    P20, P21, P22, P30, P31, P32, P33 = P00, P00, P00, P00, P00, P00, P00
    if NB == 4:
        b2 = tl.load(beta + (bos + r2) * HV + i_hv, mask=r2 < T, other=0.0).to(tl.float32)
        b3 = tl.load(beta + (bos + r3) * HV + i_hv, mask=r3 < T, other=0.0).to(tl.float32)
        M22 = _block(Y, 2, NB) + eye
        M33 = _block(Y, 3, NB) + eye
        L20 = _l_block(Akk, b2, bos, r2, T, i_hv, 0, HV, BT, BC)
        L21 = _l_block(Akk, b2, bos, r2, T, i_hv, 1, HV, BT, BC)
        M21 = -tl.dot(M22, tl.dot(L21, M11, input_precision=DOT_PREC), input_precision=DOT_PREC)
        M20 = -tl.dot(M22, tl.dot(L21, M10, tl.dot(L20, M00, input_precision=DOT_PREC), input_precision=DOT_PREC),
                      input_precision=DOT_PREC)
        L30 = _l_block(Akk, b3, bos, r3, T, i_hv, 0, HV, BT, BC)
        L31 = _l_block(Akk, b3, bos, r3, T, i_hv, 1, HV, BT, BC)
        L32 = _l_block(Akk, b3, bos, r3, T, i_hv, 2, HV, BT, BC)
        M32 = -tl.dot(M33, tl.dot(L32, M22, input_precision=DOT_PREC), input_precision=DOT_PREC)
        acc = tl.dot(L32, M21, tl.dot(L31, M11, input_precision=DOT_PREC), input_precision=DOT_PREC)
        M31 = -tl.dot(M33, acc, input_precision=DOT_PREC)
        acc = tl.dot(L30, M00, input_precision=DOT_PREC)
        acc = tl.dot(L31, M10, acc, input_precision=DOT_PREC)
        acc = tl.dot(L32, M20, acc, input_precision=DOT_PREC)
        M30 = -tl.dot(M33, acc, input_precision=DOT_PREC)
        P20 = (M20 * b0[None, :]).to(dt)
        P21 = (M21 * b1[None, :]).to(dt)
        P22 = (M22 * b2[None, :]).to(dt)
        P30 = (M30 * b0[None, :]).to(dt)
        P31 = (M31 * b1[None, :]).to(dt)
        P32 = (M32 * b2[None, :]).to(dt)
        P33 = (M33 * b3[None, :]).to(dt)
    for s in range(0, K, BK):
        o_k = s + tl.arange(0, BK)
        _apply_rows(kge, w, P00, P10, P11, P20, P21, P22, P30, P31, P32, P33, bos, i_hv, r0, T, o_k, o_k < K, HV, K, BC, NB, DOT_PREC)
    for s in range(0, V, BV):
        o_v = s + tl.arange(0, BV)
        _apply_rows(v, u, P00, P10, P11, P20, P21, P22, P30, P31, P32, P33, bos, i_hv, r0, T, o_v, o_v < V, HV, V, BC, NB, DOT_PREC)
