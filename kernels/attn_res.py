"""Fused Block-AttnRes mix (docs/design.md section 2) for CUDA: scores, softmax over depth and the weighted sum in one
Triton kernel, and one for the backward, registered as torch.library custom ops.

Per token, over N candidates V_i [d]: s_i = r_i <V_i, key> with r_i = rsqrt(mean(V_i^2) + eps), key = gamma * w
(formed in fp32 inside the kernels from the two parameters, so no separate kernel builds it);
weights softmax(s) (fp32); out = sum_i w_i V_i, in the candidates' dtype. Each candidate is read once from memory
per pass (the second sweep over a token block re-reads it from L2), the candidates are never stacked, and
nothing but the inputs is saved for the backward (it recomputes the scores). The backward writes each
candidate's gradient and per-block partial sums of the key's gradient; the op's autograd formula sums them and
applies the product rule for gamma and w, which torch.compile fuses into one reduction kernel per mix.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_CANDIDATES = 8  # pointer arguments of the kernels; more candidates take the torch path
# (tokens per program, warps) of the forward and the backward kernel. H200, 4 bf16 candidates of [32768, 768]
# (benchmarks/model.py --attn-res-sweep): forward 0.093 ms at (8, 8) against 0.116 at (32, 4); backward 0.266 ms at
# (16, 2) against 0.319 at (32, 4)
FWD_LAUNCH = (8, 8)
BWD_LAUNCH = (16, 2)


@triton.jit
def _pick(i: tl.constexpr, p0, p1, p2, p3, p4, p5, p6, p7):
    p = p0
    if i == 1:
        p = p1
    if i == 2:
        p = p2
    if i == 3:
        p = p3
    if i == 4:
        p = p4
    if i == 5:
        p = p5
    if i == 6:
        p = p6
    if i == 7:
        p = p7
    return p


@triton.jit
def _column(tile, cols, i: tl.constexpr):
    """Column i of a [BT, NP] tile as a [BT] vector."""
    return tl.sum(tl.where(cols[None, :] == i, tile, 0.0), 1)


@triton.jit
def _key(gamma, query, offs, mask):
    """A chunk of key = gamma * w in fp32 (the product of two bf16 values is exact in fp32)."""
    return tl.load(gamma + offs, mask=mask, other=0.0).to(tl.float32) * \
        tl.load(query + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _scores(v0, v1, v2, v3, v4, v5, v6, v7, gamma, query, g, rows, m_rows, eps, D,
            N: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, NP: tl.constexpr,
            WITH_GRAD: tl.constexpr):
    """[BT, NP] tiles: scores s_i, r_i and (WITH_GRAD) <g, V_i>; padding columns hold -inf / 0."""
    cols = tl.arange(0, NP)
    o_d = tl.arange(0, BD)
    S = tl.zeros([BT, NP], dtype=tl.float32)
    R = tl.zeros([BT, NP], dtype=tl.float32)
    DW = tl.zeros([BT, NP], dtype=tl.float32)
    for i in tl.static_range(N):
        v = _pick(i, v0, v1, v2, v3, v4, v5, v6, v7)
        dot = tl.zeros([BT], dtype=tl.float32)
        ss = tl.zeros([BT], dtype=tl.float32)
        dw = tl.zeros([BT], dtype=tl.float32)
        for d0 in range(0, D, BD):
            m_d = d0 + o_d < D
            m = m_rows[:, None] & m_d[None, :]
            off = rows[:, None] * D + d0 + o_d[None, :]
            x = tl.load(v + off, mask=m, other=0.0).to(tl.float32)
            kk = _key(gamma, query, d0 + o_d, m_d)
            dot += tl.sum(x * kk[None, :], 1)
            ss += tl.sum(x * x, 1)
            if WITH_GRAD:
                dw += tl.sum(x * tl.load(g + off, mask=m, other=0.0).to(tl.float32), 1)
        r = tl.rsqrt(ss / D + eps)
        S = tl.where(cols[None, :] == i, (dot * r)[:, None], S)
        R = tl.where(cols[None, :] == i, r[:, None], R)
        DW = tl.where(cols[None, :] == i, dw[:, None], DW)
    S = tl.where(cols[None, :] < N, S, float("-inf"))
    return S, R, DW


@triton.jit
def attn_res_fwd_kernel(
    v0, v1, v2, v3, v4, v5, v6, v7, gamma, query, out, M, D, eps,
    N: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, NP: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    m_rows = rows < M
    rows = rows.to(tl.int64)
    S, R, _ = _scores(v0, v1, v2, v3, v4, v5, v6, v7, gamma, query, gamma, rows, m_rows, eps, D, N, BT, BD, NP, False)
    P = tl.exp(S - tl.max(S, 1)[:, None])
    W = P / tl.sum(P, 1)[:, None]
    cols = tl.arange(0, NP)
    o_d = tl.arange(0, BD)
    for d0 in range(0, D, BD):
        m_d = d0 + o_d < D
        m = m_rows[:, None] & m_d[None, :]
        off = rows[:, None] * D + d0 + o_d[None, :]
        acc = tl.zeros([BT, BD], dtype=tl.float32)
        for i in tl.static_range(N):
            v = _pick(i, v0, v1, v2, v3, v4, v5, v6, v7)
            acc += _column(W, cols, i)[:, None] * tl.load(v + off, mask=m, other=0.0).to(tl.float32)
        tl.store(out + off, acc.to(out.dtype.element_ty), mask=m)


@triton.jit
def attn_res_bwd_kernel(
    v0, v1, v2, v3, v4, v5, v6, v7, dv0, dv1, dv2, dv3, dv4, dv5, dv6, dv7, gamma, query, g, dkey_part, n_blocks, M, D,
    eps,
    N: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, NP: tl.constexpr, NCH: tl.constexpr,
):
    """dV_i = w_i g + ds_i (r_i key - s_i r_i^2 / D V_i), ds = softmax backward of dw_i = <g, V_i>;
    dkey_part[:, block] = sum over the block's tokens and i of ds_i r_i V_i."""
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    m_rows = rows < M
    rows = rows.to(tl.int64)
    S, R, DW = _scores(v0, v1, v2, v3, v4, v5, v6, v7, gamma, query, g, rows, m_rows, eps, D, N, BT, BD, NP, True)
    P = tl.exp(S - tl.max(S, 1)[:, None])
    W = P / tl.sum(P, 1)[:, None]
    DS = W * (DW - tl.sum(W * DW, 1)[:, None])
    cols = tl.arange(0, NP)
    o_d = tl.arange(0, BD)
    o_c = tl.arange(0, NCH)
    DK = tl.zeros([NCH, BD], dtype=tl.float32)  # the key gradient's chunks, summed over candidates and tokens
    for i in tl.static_range(N):
        v = _pick(i, v0, v1, v2, v3, v4, v5, v6, v7)
        dv = _pick(i, dv0, dv1, dv2, dv3, dv4, dv5, dv6, dv7)
        w, ds = _column(W, cols, i), _column(DS, cols, i)
        r, s = _column(R, cols, i), _column(S, cols, i)
        a = (s * r * r / D)[:, None]
        for d0 in range(0, D, BD):
            m_d = d0 + o_d < D
            m = m_rows[:, None] & m_d[None, :]
            off = rows[:, None] * D + d0 + o_d[None, :]
            x = tl.load(v + off, mask=m, other=0.0).to(tl.float32)
            gg = tl.load(g + off, mask=m, other=0.0).to(tl.float32)
            kk = _key(gamma, query, d0 + o_d, m_d)
            dx = w[:, None] * gg + ds[:, None] * (r[:, None] * kk[None, :]) - ds[:, None] * a * x
            tl.store(dv + off, dx.to(dv.dtype.element_ty), mask=m)
            DK = tl.where(o_c[:, None] == d0 // BD, DK + tl.sum((ds * r)[:, None] * x, 0)[None, :], DK)
    o_dk = o_c[:, None] * BD + o_d[None, :]
    # transposed, [D, blocks]: the sum over blocks is then an inner reduction, one fused kernel under compile
    tl.store(dkey_part + o_dk * n_blocks + pid, DK, mask=o_dk < D)


def _pointers(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return tensors + [tensors[0]] * (MAX_CANDIDATES - len(tensors))


def _shape(candidates: list[torch.Tensor]) -> tuple[int, int, int, int]:
    D = candidates[0].shape[-1]
    M = candidates[0].numel() // D
    BD = min(256, triton.next_power_of_2(D))
    return M, D, BD, max(2, triton.next_power_of_2(len(candidates)))


def _key_blocks(candidates: list[torch.Tensor], block_tokens: int) -> int:
    """Rows of the backward's partial sums of the key gradient (one per token block)."""
    D = candidates[0].shape[-1]
    return triton.cdiv(candidates[0].numel() // D, block_tokens)


@torch.library.custom_op("taper::attn_res_mix", mutates_args=())
def attn_res_mix_op(candidates: list[torch.Tensor], gamma: torch.Tensor, query: torch.Tensor, eps: float) -> torch.Tensor:
    """candidates: N tensors of one shape [..., d] and dtype; gamma, query [d] (key = gamma * query in fp32).
    Returns the mix in the candidates' dtype."""
    candidates = [c.contiguous() for c in candidates]
    M, D, BD, NP = _shape(candidates)
    out = torch.empty_like(candidates[0])
    BT, warps = FWD_LAUNCH
    attn_res_fwd_kernel[(triton.cdiv(M, BT),)](
        *_pointers(candidates), gamma.contiguous(), query.contiguous(), out, M, D, eps,
        N=len(candidates), BT=BT, BD=BD, NP=NP, num_warps=warps, num_stages=1,
    )
    return out


@attn_res_mix_op.register_fake
def _(candidates, gamma, query, eps):
    return torch.empty_like(candidates[0])


@torch.library.custom_op("taper::attn_res_mix_bwd", mutates_args=())
def attn_res_mix_bwd_op(
    grad: torch.Tensor, candidates: list[torch.Tensor], gamma: torch.Tensor, query: torch.Tensor, eps: float,
    block_tokens: int,
) -> list[torch.Tensor]:
    """Returns [per-block partial sums of d key [d, blocks] (fp32), d candidate_0, ...], blocks of `block_tokens`
    tokens. An argument, not read from BWD_LAUNCH here: a compiled graph keeps the count it was traced with, and a
    launch sweep that changes BWD_LAUNCH afterwards must not make the real kernel disagree with it."""
    candidates = [c.contiguous() for c in candidates]
    M, D, BD, NP = _shape(candidates)
    grads = [torch.empty_like(c) for c in candidates]
    BT, warps = block_tokens, BWD_LAUNCH[1]
    blocks = triton.cdiv(M, BT)
    dkey_part = torch.empty(D, blocks, dtype=torch.float32, device=grad.device)
    attn_res_bwd_kernel[(blocks,)](
        *_pointers(candidates), *_pointers(grads), gamma.contiguous(), query.contiguous(), grad.contiguous(),
        dkey_part, blocks, M, D, eps,
        N=len(candidates), BT=BT, BD=BD, NP=NP, NCH=triton.next_power_of_2(triton.cdiv(D, BD)),
        num_warps=warps, num_stages=1,
    )
    return [dkey_part, *grads]


@attn_res_mix_bwd_op.register_fake
def _(grad, candidates, gamma, query, eps, block_tokens):
    D = candidates[0].shape[-1]
    return [gamma.new_empty((D, _key_blocks(candidates, block_tokens)), dtype=torch.float32),
            *(torch.empty_like(c) for c in candidates)]


def _setup_context(ctx, inputs, output) -> None:
    candidates, gamma, query, eps = inputs
    ctx.save_for_backward(gamma, query, *candidates)
    ctx.eps = eps


def _backward(ctx, grad):
    gamma, query, *candidates = ctx.saved_tensors
    dkey_part, *grads = attn_res_mix_bwd_op(grad, candidates, gamma, query, ctx.eps, BWD_LAUNCH[0])
    # outside the op, so torch.compile fuses the sum over token blocks with the product rule and the casts
    dkey = dkey_part.sum(1)
    return grads, (dkey * query.float()).to(gamma.dtype), (dkey * gamma.float()).to(query.dtype), None


attn_res_mix_op.register_autograd(_backward, setup_context=_setup_context)


def attn_res_mix(candidates: list[torch.Tensor], gamma: torch.Tensor, query: torch.Tensor, eps: float) -> torch.Tensor:
    """The fused mix (any device Triton runs on: CUDA, or the CPU interpreter under TRITON_INTERPRET=1).
    At most MAX_CANDIDATES candidates of one shape and dtype; gamma, query [d] (the key is their product)."""
    if not 1 <= len(candidates) <= MAX_CANDIDATES:
        raise ValueError(f"attn_res_mix takes 1..{MAX_CANDIDATES} candidates, got {len(candidates)}")
    return attn_res_mix_op(candidates, gamma, query, eps)
