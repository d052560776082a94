"""KDA over long sequences on the CPU without autograd, in chunks whose products are real matmuls: the prefill
path for the bounded gate. The per-token recurrence (`recurrent_cpu.py`) reads and writes the whole state for
every token and is bound by those stores; here the state is touched once per chunk of C tokens and everything
else is batched matmuls over all chunks, which the CPU's BLAS runs near its peak.

Notation as in `chunk_torch.py`, with Gam the in-chunk cumulative log-decay [C, K]. What differs is how the
chunk's decays are factored, so that C can be 32 or 64 (fewer, larger steps of the state loop) with nothing
leaving the float range: the chunk is split into 16-token blocks, and block i's rows use their own reference
r_i = Gam_{16 i}:
    exp(Gam_t - Gam_s) = exp(Gam_t - r_i) * exp(r_i - Gam_s)      for t in block i, s <= t.
The first factor is in (e^{-16 |lb|}, 1]; the second is at most e^{15 |lb|} (s in block i) and at most 1
(s in an earlier block), with lb >= -5 the gate's lower bound (|lb| * 16 <= 80, `_MAX_FACTORED_RANGE`).
The unit-lower solve (I + diag(beta) A) X = diag(beta) [V | K e^Gam] runs block by block: each 16 x 16
diagonal block inverted by the nilpotent series, the earlier blocks' contribution as one matmul.
"""

from __future__ import annotations

import torch

from kernels.cpu_math import f32_or_bf16_bits
from kernels.kda.chunk_torch import _MAX_FACTORED_RANGE, _unit_lower_inverse
from kernels.kda.common import sequence_rows

BLOCK = 16
_STRICT = torch.ones(BLOCK, BLOCK).tril(-1)
_INCLUSIVE = torch.ones(BLOCK, BLOCK).tril()

def factorable(lower_bound: float | None, chunk_size: int) -> bool:
    """Whether this path takes a gate with this lower bound (None: unbounded) and chunk size."""
    return (lower_bound is not None and -lower_bound * BLOCK <= _MAX_FACTORED_RANGE and chunk_size >= BLOCK
            and chunk_size % BLOCK == 0)


def chunk_kda_infer_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta: torch.Tensor, *, scale: float,
    l2norm: bool, lower_bound: float, dt_bias: torch.Tensor | None, beta_sigmoid: bool, states: torch.Tensor,
    cu_seqlens: torch.Tensor | None, chunk_size: int = 64, matmul_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """q, k [B, T, HV, K] (expanded to the value heads; l2-normalised here with `l2norm`), v [B, T, HV, V], the
    raw gate input f [B, T, HV, K] of the bounded gate g = lower_bound sigmoid(f + dt_bias) (with
    `factorable(lower_bound, chunk_size)`), beta [B, T, HV] (logits with `beta_sigmoid`): fp32, f also bf16.
    states [N, HV, K, V] fp32 holds each sequence's initial state and receives its final one. The products
    that feed the output (the scores P, q S, P Vn) run in `matmul_dtype` with fp32 accumulation; the solve
    and the state recurrence in fp32. Returns o [B, T, HV, V] fp32."""
    B, T, HV, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    first, last = sequence_rows(T, B, cu_seqlens)
    N = len(first)
    NT = max(1, -(-int((last - first).max()) // C))
    R = N * HV
    qo, kob, qg, kt = (q.new_empty(NT, R, C, K) for _ in range(4))
    kin = q.new_empty(NT, R, C // BLOCK, C, K)
    rhs = q.new_empty(NT, R, C, V + K)
    decay = q.new_empty(NT, R, K, 1)
    from kernels.kda.chunk_cpu_numba import chunk_operands  # numba loads on first use

    bias = torch.zeros(HV * K) if dt_bias is None else dt_bias.detach().reshape(-1).float().contiguous()
    chunk_operands(*(x.reshape(B * T, HV, -1).contiguous().numpy() for x in (q, k, v)),
                   *f32_or_bf16_bits(f.reshape(B * T * HV, K)), bias.numpy(), lower_bound,
                   beta.reshape(B * T, HV).float().contiguous().numpy(), beta_sigmoid, scale, l2norm,
                   first.numpy(), last.numpy(), qo.numpy(), kob.numpy(), kin.numpy(), qg.numpy(), rhs.numpy(),
                   kt.numpy(), decay.numpy())
    lowp = (lambda x: x.to(matmul_dtype)) if matmul_dtype != torch.float32 else (lambda x: x)
    a_blocks, p_blocks = [], []
    for i in range(C // BLOCK):
        rows_i = slice(i * BLOCK, (i + 1) * BLOCK)
        k_in = kin[:, :, i, : (i + 1) * BLOCK].flatten(0, 1).transpose(-1, -2)  # [NT R, K, 16 (i+1)]
        a = kob[:, :, rows_i].flatten(0, 1) @ k_in  # beta_t A[t, s] for s < 16 (i + 1)
        a[..., i * BLOCK:] *= _STRICT
        p = (lowp(qo[:, :, rows_i].flatten(0, 1)) @ lowp(k_in)).float()
        p[..., i * BLOCK:] *= _INCLUSIVE
        a_blocks.append(a)
        p_blocks.append(p)
    X = _solve(a_blocks, rhs.flatten(0, 1))  # [NT R, C, V + K]
    U = X[..., :V].reshape(NT, R, C, V).contiguous()
    W = X[..., V:].reshape(NT, R, C, K).contiguous()

    starts = q.new_empty(NT + 1, R, K, V)  # starts[c]: the state before chunk c; starts[NT]: the final one
    starts[0] = states.reshape(R, K, V)
    new_values = q.new_empty(NT, R, C, V)
    for c in range(NT):
        torch.baddbmm(U[c], W[c], starts[c], alpha=-1, out=new_values[c])  # the delta rule's U - W S
        torch.mul(starts[c], decay[c], out=starts[c + 1])
        starts[c + 1].baddbmm_(kt[c].transpose(-1, -2), new_values[c])
    states.copy_(starts[NT].view(states.shape))

    out = (lowp(qg.flatten(0, 1)) @ lowp(starts[:NT].flatten(0, 1))).float()  # [NT R, C, V]
    vn = lowp(new_values.flatten(0, 1))
    for i, p in enumerate(p_blocks):
        out[:, i * BLOCK:(i + 1) * BLOCK] += (lowp(p) @ vn[:, : (i + 1) * BLOCK]).float()
    o = out.view(NT, N, HV, C, V).permute(1, 0, 3, 2, 4).reshape(N, NT * C, HV, V)
    if cu_seqlens is None:
        return o[:, :T]
    valid = torch.arange(NT * C) < (last - first)[:, None]
    return o[valid][None]


def _solve(a_blocks: list[torch.Tensor], rhs: torch.Tensor) -> torch.Tensor:
    """X with (I + A) X = rhs for A strictly lower [..., C, C] given as its 16-row blocks a_blocks[i]
    [..., 16, 16 (i+1)]: forward substitution by blocks, each diagonal block inverted by the series."""
    X = torch.empty_like(rhs)
    for i, a in enumerate(a_blocks):
        rows = slice(i * BLOCK, (i + 1) * BLOCK)
        r = rhs[:, rows]
        if i:
            r = torch.baddbmm(r, a[..., : i * BLOCK], X[:, : i * BLOCK], alpha=-1)
        X[:, rows] = _unit_lower_inverse(a[..., i * BLOCK:]) @ r
    return X
