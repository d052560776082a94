"""Short causal depthwise conv + SiLU (the KDA layer's q/k/v conv, docs/design.md section 2) for CUDA: one Triton kernel
each way, registered as torch.library custom ops so torch.compile keeps each a single opaque op.

x [B, T, C] (channels q|k|v concatenated), weight [C, 1, W] with W <= 4 taps, zero history before t = 0:
  a[t, c] = sum_j weight[c, j] * x[t - (W-1) + j, c]   (fp32)
  y = SiLU(a), written in x's dtype straight into the three outputs (q, k, v: contiguous [B, T, width] each)
The backward recomputes a (nothing but x and the weight is saved) and writes dx and per-block partial sums of the
weight gradient, transposed ([C, 4, blocks]), so the op's autograd formula finishes them as one inner reduction that
torch.compile fuses with the cast to the weight's dtype (instead of a finishing reduction per tap).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

MAX_TAPS = 4  # the kernels hold taps in four fixed register tiles; wider convs take the torch path
# (tokens per tile, channels per tile, warps) of the forward and the backward; the backward's programs also loop
# over BWD_TOKENS tokens, summing the weight gradient in registers
# H200, bf16 [4, 8192, 2304] from a [.., 2560] projection (benchmarks/model.py --conv-sweep): forward 0.125 ms at
# (16, 128, 4) (0.141 at (32, 64, 4)); backward 0.366 ms at (16, 64, 1) over 128 tokens (0.43-0.73 ms at 2-4 warps)
FWD_LAUNCH = (16, 128, 4)
BWD_LAUNCH = (16, 64, 1)
BWD_TOKENS = 128


@triton.jit
def _taps(w, cols, m_c, W: tl.constexpr):
    """The weight as four [BC] fp32 tap vectors, right-aligned: tap j multiplies x[t - 3 + j] (missing taps 0)."""
    t0 = tl.load(w + cols * W + (0 - (4 - W)), mask=m_c & (4 - W <= 0), other=0.0).to(tl.float32)
    t1 = tl.load(w + cols * W + (1 - (4 - W)), mask=m_c & (4 - W <= 1), other=0.0).to(tl.float32)
    t2 = tl.load(w + cols * W + (2 - (4 - W)), mask=m_c & (4 - W <= 2), other=0.0).to(tl.float32)
    t3 = tl.load(w + cols * W + (3 - (4 - W)), mask=m_c & (4 - W <= 3), other=0.0).to(tl.float32)
    return t0, t1, t2, t3


@triton.jit
def _rows(x, b, t, cols, m_c, T, sb, st):
    """x[b, t, cols] as fp32 [BT, BC] (batch and token strides sb, st), zero outside 0 <= t < T."""
    m = ((t >= 0) & (t < T))[:, None] & m_c[None, :]
    off = b.to(tl.int64) * sb + t.to(tl.int64)[:, None] * st + cols[None, :]
    return tl.load(x + off, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _pre_activation(x, b, t, cols, m_c, T, sb, st, w0, w1, w2, w3):
    """a[t] = sum_j w_j x[t - 3 + j] (fp32, taps summed in order, as the torch path does)."""
    a = _rows(x, b, t - 3, cols, m_c, T, sb, st) * w0[None, :]
    a += _rows(x, b, t - 2, cols, m_c, T, sb, st) * w1[None, :]
    a += _rows(x, b, t - 1, cols, m_c, T, sb, st) * w2[None, :]
    a += _rows(x, b, t, cols, m_c, T, sb, st) * w3[None, :]
    return a


@triton.jit
def _segment(y0, y1, y2, c0, S1, S2, C):
    """The output a block of channels starting at c0 lies in (one of widths S1, S2 - S1, C - S2): its pointer,
    first channel and width."""
    first = tl.where(c0 < S1, 0, tl.where(c0 < S2, S1, S2))
    width = tl.where(c0 < S1, S1, tl.where(c0 < S2, S2 - S1, C - S2))
    return tl.where(c0 < S1, y0, tl.where(c0 < S2, y1, y2)), first, width


@triton.jit
def short_conv_fwd_kernel(
    x, w, y0, y1, y2, T, C, S1, S2, sb, st,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    """Each program's BC channels lie in one output (the host picks BC to divide every width)."""
    b = tl.program_id(2)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c0 = tl.program_id(1) * BC
    cols = c0 + tl.arange(0, BC)
    m_c = cols < C
    w0, w1, w2, w3 = _taps(w, cols, m_c, W)
    a = _pre_activation(x, b, t, cols, m_c, T, sb, st, w0, w1, w2, w3)
    y = a * tl.sigmoid(a)
    out, first, width = _segment(y0, y1, y2, c0, S1, S2, C)
    off = (b * T + t).to(tl.int64)[:, None] * width + (cols - first)[None, :]
    tl.store(out + off, y.to(y0.dtype.element_ty), mask=(t < T)[:, None] & m_c[None, :])


@triton.jit
def _d_pre_activation(x, dy, b, t, cols, m_c, T, first, width, sb, st, w0, w1, w2, w3):
    """dL/da at tokens t (zero for t >= T): dy * SiLU'(a), a recomputed from x; dy the gradient of the output that
    holds these channels (from channel `first`, `width` wide)."""
    a = _pre_activation(x, b, t, cols, m_c, T, sb, st, w0, w1, w2, w3)
    m = ((t >= 0) & (t < T))[:, None] & m_c[None, :]
    g = tl.load(dy + (b * T + t).to(tl.int64)[:, None] * width + (cols - first)[None, :], mask=m, other=0.0)
    s = tl.sigmoid(a)
    return g.to(tl.float32) * s * (1.0 + a * (1.0 - s))


@triton.jit
def short_conv_bwd_kernel(
    x, w, dy0, dy1, dy2, dx, dw_part, scratch, T, C, S1, S2, sb, st, n_parts,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, TOKENS: tl.constexpr,
):
    """dx[t] = sum_j w_j da[t + 3 - j]; dw_part[c, j, part] = sum over the part's tokens t of da[t] x[t - 3 + j].

    da is computed once per token: each step computes it for BT tokens and finishes dx for the BT tokens three
    earlier, reading da through the program's own scratch rows ([3 + BT, BC] fp32: the previous step's last three
    rows, then this step's), which stay in L1/L2. So a program covering tokens [start, end) writes dx for
    [start - 3, end - 3), and the last program of a sequence one step more (da = 0 past T)."""
    b = tl.program_id(2)
    chunk = tl.program_id(0)
    part = b * tl.num_programs(0) + chunk
    c0 = tl.program_id(1) * BC
    cols = c0 + tl.arange(0, BC)
    m_c = cols < C
    w0, w1, w2, w3 = _taps(w, cols, m_c, W)
    dy, first, width = _segment(dy0, dy1, dy2, c0, S1, S2, C)
    o_t = tl.arange(0, BT)
    pad = scratch + (part * tl.num_programs(1) + tl.program_id(1)).to(tl.int64) * ((BT + 3) * BC)
    carry = pad + (o_t - (BT - 3))[:, None] * BC + tl.arange(0, BC)[None, :]  # this tile's last 3 rows -> rows 0..2
    m_carry = (o_t >= BT - 3)[:, None] & m_c[None, :]
    start = chunk * TOKENS
    end = tl.minimum(start + TOKENS, T)
    stop = tl.where(end >= T, end + BT, end)
    da = _d_pre_activation(x, dy, b, start - BT + o_t, cols, m_c, T, first, width, sb, st, w0, w1, w2, w3)
    tl.store(carry, da, mask=m_carry)
    g0 = tl.zeros([BC], dtype=tl.float32)
    g1 = tl.zeros([BC], dtype=tl.float32)
    g2 = tl.zeros([BC], dtype=tl.float32)
    g3 = tl.zeros([BC], dtype=tl.float32)
    for t0 in range(start, stop, BT):
        t = t0 + o_t
        da = _d_pre_activation(x, dy, b, t, cols, m_c, T, first, width, sb, st, w0, w1, w2, w3)
        m_own = (t < end)[:, None] & m_c[None, :]  # the extra step past T adds nothing
        g0 += tl.sum(tl.where(m_own, da * _rows(x, b, t - 3, cols, m_c, T, sb, st), 0.0), 0)
        g1 += tl.sum(tl.where(m_own, da * _rows(x, b, t - 2, cols, m_c, T, sb, st), 0.0), 0)
        g2 += tl.sum(tl.where(m_own, da * _rows(x, b, t - 1, cols, m_c, T, sb, st), 0.0), 0)
        g3 += tl.sum(tl.where(m_own, da * _rows(x, b, t, cols, m_c, T, sb, st), 0.0), 0)
        tl.store(pad + (3 + o_t)[:, None] * BC + tl.arange(0, BC)[None, :], da)
        tl.debug_barrier()  # every thread's rows written before any thread reads them shifted
        window = pad + o_t[:, None] * BC + tl.arange(0, BC)[None, :]
        acc = tl.load(window) * w3[None, :]  # da[t - 3] meets x[t - 3] through tap 3
        acc += tl.load(window + BC) * w2[None, :]
        acc += tl.load(window + 2 * BC) * w1[None, :]
        acc += tl.load(window + 3 * BC) * w0[None, :]
        r = t - 3
        m_r = ((r >= 0) & (r < T))[:, None] & m_c[None, :]
        tl.store(dx + (b * T + r).to(tl.int64)[:, None] * C + cols[None, :], acc.to(dx.dtype.element_ty), mask=m_r)
        tl.debug_barrier()  # every thread's reads done before the rows are overwritten
        tl.store(carry, da, mask=m_carry)
    # transposed, [C, 4, parts]: the sum over parts is then an inner reduction, one fused kernel under compile
    base = dw_part + cols.to(tl.int64) * (4 * n_parts) + part
    tl.store(base, g0, mask=m_c)
    tl.store(base + n_parts, g1, mask=m_c)
    tl.store(base + 2 * n_parts, g2, mask=m_c)
    tl.store(base + 3 * n_parts, g3, mask=m_c)


def _check(x: torch.Tensor, weight: torch.Tensor, split: list[int]) -> tuple[int, int, int]:
    B, T, C = x.shape
    W = weight.shape[-1]
    if weight.shape != (C, 1, W) or not 1 <= W <= MAX_TAPS:
        raise ValueError(f"weight must be [C={C}, 1, W<={MAX_TAPS}], got {tuple(weight.shape)}")
    if len(split) != 3 or sum(split) != C:
        raise ValueError(f"split must be three widths summing to C={C}, got {split}")
    return B, T, C


def _channel_block(split: list[int], cap: int) -> int:
    """Channels per program: the largest power of two up to `cap` that divides every width, so each program's
    channels lie in one output."""
    common = math.gcd(*split)
    return min(cap, common & -common)


def _unit_channel_stride(x: torch.Tensor) -> torch.Tensor:
    """x as it is when its channels are adjacent (e.g. a column slice of a wider projection: no copy)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _parts(B: int, T: int, tokens: int) -> int:
    """Columns of the backward's partial sums of the weight gradient (one per program along time)."""
    return B * triton.cdiv(T, tokens)


@torch.library.custom_op("taper::short_conv_silu", mutates_args=())
def short_conv_silu_op(x: torch.Tensor, weight: torch.Tensor, split: list[int]) -> list[torch.Tensor]:
    """x [B, T, C], weight [C, 1, W]; returns SiLU(causal conv) split into three contiguous [B, T, split_i]."""
    B, T, C = _check(x, weight, split)
    x = _unit_channel_stride(x)
    outs = [x.new_empty(B, T, width) for width in split]
    BT, BC, warps = FWD_LAUNCH
    BC = _channel_block(split, BC)
    short_conv_fwd_kernel[(triton.cdiv(T, BT), triton.cdiv(C, BC), B)](
        x, weight.contiguous(), *outs, T, C, split[0], split[0] + split[1], x.stride(0), x.stride(1),
        W=weight.shape[-1], BT=BT, BC=BC, num_warps=warps,
    )
    return outs


@short_conv_silu_op.register_fake
def _(x, weight, split):
    B, T, _ = x.shape
    return [x.new_empty(B, T, width) for width in split]


@torch.library.custom_op("taper::short_conv_silu_bwd", mutates_args=())
def short_conv_silu_bwd_op(
    x: torch.Tensor, weight: torch.Tensor, grads: list[torch.Tensor], tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dx [B, T, C] in x's dtype, the weight gradient's partial sums [C, 4, parts] fp32 over `tokens` tokens
    each: tap j of a W-tap conv is column j + 4 - W). `tokens` is an argument, not read from the module, so a
    compiled graph's shapes never disagree with the kernel's."""
    split = [g.shape[-1] for g in grads]
    B, T, C = _check(x, weight, split)
    x = _unit_channel_stride(x)
    grads = [g.contiguous() for g in grads]
    dx = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    parts = _parts(B, T, tokens)
    dw_part = torch.empty(C, 4, parts, dtype=torch.float32, device=x.device)
    BT, BC, warps = BWD_LAUNCH
    assert BT >= 4, "the backward carries three rows of a token tile"
    BC = _channel_block(split, BC)
    scratch = torch.empty(parts * triton.cdiv(C, BC), BT + 3, BC, dtype=torch.float32, device=x.device)
    short_conv_bwd_kernel[(triton.cdiv(T, tokens), triton.cdiv(C, BC), B)](
        x, weight.contiguous(), *grads, dx, dw_part, scratch, T, C, split[0], split[0] + split[1], x.stride(0), x.stride(1),
        parts,
        W=weight.shape[-1], BT=BT, BC=BC, TOKENS=tokens, num_warps=warps,
    )
    return dx, dw_part


@short_conv_silu_bwd_op.register_fake
def _(x, weight, grads, tokens):
    B, T, C = x.shape
    return x.new_empty(B, T, C), x.new_empty((C, 4, _parts(B, T, tokens)), dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight)


def _backward(ctx, grads):
    x, weight = ctx.saved_tensors
    dx, dw_part = short_conv_silu_bwd_op(x, weight, grads, BWD_TOKENS)
    W = weight.shape[-1]
    # outside the op, so torch.compile fuses the sum over parts with the slice and the cast
    dw = dw_part.sum(-1)[:, 4 - W:].unsqueeze(1).to(weight.dtype)
    return dx, dw, None


short_conv_silu_op.register_autograd(_backward, setup_context=_setup_context)


def short_conv_silu(x: torch.Tensor, weight: torch.Tensor, split: list[int]) -> list[torch.Tensor]:
    """SiLU(causal depthwise conv(x)) with zero history, split into three contiguous outputs (any device Triton
    runs on: CUDA, or the CPU interpreter under TRITON_INTERPRET=1). x [B, T, C]; weight [C, 1, W], W <= 4."""
    return short_conv_silu_op(x, weight, list(split))


@triton.jit
def short_conv_decode_kernel(
    x, w, state, slots, y, C, sx, s_slot, s_c, s_w,
    W: tl.constexpr, BC: tl.constexpr,
):
    """One new token of row i_n: its window is the slot's W-1 inputs (oldest first) and x; the slot advances by one.
    A row whose slot is negative (a padded row of a CUDA graph's batch) gets zeros and touches no slot."""
    i_n = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    m_c = cols < C
    slot = tl.load(slots + i_n).to(tl.int64)
    if slot < 0:
        tl.store(y + i_n * C + cols, tl.zeros([BC], dtype=tl.float32).to(y.dtype.element_ty), mask=m_c)
    else:
        x_new = tl.load(x + i_n * sx + cols, mask=m_c, other=0.0)
        base = state + slot * s_slot + cols.to(tl.int64) * s_c
        a = x_new.to(tl.float32) * tl.load(w + cols * W + (W - 1), mask=m_c, other=0.0).to(tl.float32)
        for j in tl.static_range(W - 1):
            h = tl.load(base + j * s_w, mask=m_c, other=0.0)
            a += h.to(tl.float32) * tl.load(w + cols * W + j, mask=m_c, other=0.0).to(tl.float32)
            if j > 0:  # input j moves to j - 1 (read in the step before)
                tl.store(base + (j - 1) * s_w, h, mask=m_c)
        tl.store(base + (W - 2) * s_w, x_new.to(state.dtype.element_ty), mask=m_c)
        tl.store(y + i_n * C + cols, (a * tl.sigmoid(a)).to(y.dtype.element_ty), mask=m_c)


DECODE_BLOCK_C = 256


def short_conv_silu_decode(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
) -> torch.Tensor:
    """One decode step of the conv + SiLU over a pool of conv states, in place: x [n, C] (one new token per row),
    weight [C, 1, W] (2 <= W), state [slots, C, W-1] (any strides: a serving engine's slots lie in pages),
    slots [n] (negative: a padded row, zeros out and no slot touched). Returns y [n, C] in x's dtype."""
    n, C = x.shape
    W = weight.shape[-1]
    if W < 2 or tuple(state.shape[1:]) != (C, W - 1) or slots.shape != (n,) or x.stride(-1) != 1:
        raise ValueError(f"short_conv_silu_decode: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"state {tuple(state.shape)}, slots {tuple(slots.shape)}")
    y = torch.empty(n, C, dtype=x.dtype, device=x.device)
    if n:
        short_conv_decode_kernel[(n, triton.cdiv(C, DECODE_BLOCK_C))](
            x, weight.contiguous(), state, slots, y, C, x.stride(0), *state.stride(), W=W, BC=DECODE_BLOCK_C,
        )
    return y
