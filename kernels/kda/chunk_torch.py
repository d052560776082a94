"""Vectorised pure-torch chunked KDA (the CPU path). Differentiable through torch autograd.

Per chunk of C tokens with state S at its start and in-chunk cumulative log-decay Gam [C, K]:
  A[t,s]   = sum_c k_t k_s exp(Gam_t - Gam_s)          (s < t)
  P[t,s]   = sum_c q_t k_s exp(Gam_t - Gam_s) * scale  (s <= t)
  L        = I + diag(beta) A;   U = L^-1 diag(beta) V;   W = L^-1 diag(beta) (K * exp(Gam))
  Vn       = U - W S                                    (the delta-rule "new values")
  O        = scale (Q * exp(Gam)) S + P Vn
  S_next   = exp(Gam_last) S + (K * exp(Gam_last - Gam))^T Vn
Where a chunk's total decay spans at most `_MAX_FACTORED_RANGE` (always with the lower-bounded gate at
C = 16: 16 * 5 = 80), exp(Gam_t - Gam_s) = exp(Gam_t - Gam_0) * exp(Gam_0 - Gam_s) and A, P are plain
matmuls whose factors stay inside the float range. Otherwise (the unbounded gate) the decays are formed
from pairwise differences Gam_t - Gam_s (t >= s), so nothing overflows whatever the gate, at the price of
[C, C, K] temporaries. The state-independent part runs for many chunks at once; only the state recurrence
loops over chunks (T / C steps of small matmuls), batched over sequences and heads.
"""

from __future__ import annotations

import torch

from kernels.kda.common import sequence_rows

# exp(80) ~ 5.5e34: factor products stay far inside fp32/bf16 range (max ~ exp(88.7)).
_MAX_FACTORED_RANGE = 80.0


def _unit_lower_inverse(n: torch.Tensor) -> torch.Tensor:
    """(I + n)^-1 for strictly lower-triangular n [..., C, C]: n is nilpotent (n^C = 0), so
    (I + n)^-1 = (I - n)(I + n^2)(I + n^4)...: log2(C) batched matmuls, much faster on CPU than a batched
    triangular solve (one LAPACK call per matrix) and with a plain-matmul backward."""
    eye = torch.eye(n.shape[-1], dtype=n.dtype, device=n.device)
    inv = eye - n
    power = n
    for _ in range(max(n.shape[-1] - 1, 1).bit_length() - 1):
        power = power @ power
        inv = inv + inv @ power
    return inv


def _intra_factored(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gam: torch.Tensor, beta: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_intra` as matmuls, valid when each chunk's decay range is at most _MAX_FACTORED_RANGE."""
    C = q.shape[-2]
    idx = torch.arange(C, device=q.device)
    ref = gam[..., :1, :].detach()  # the product does not depend on it: no gradient, no cancellation
    k_in = k * torch.exp(ref - gam)  # exp(Gam_0 - Gam_s) in [1, exp(range)]
    k_out = k * torch.exp(gam - ref)  # exp(Gam_t - Gam_0) in (0, 1]
    A = (k_out @ k_in.transpose(-1, -2)) * (idx[:, None] > idx[None, :])
    P = ((q * torch.exp(gam - ref)) @ k_in.transpose(-1, -2)) * ((idx[:, None] >= idx[None, :]) * scale)
    rhs = beta[..., :, None] * torch.cat([v, k * torch.exp(gam)], dim=-1)
    sol = _unit_lower_inverse(beta[..., :, None] * A) @ rhs
    return P, sol[..., : v.shape[-1]], sol[..., v.shape[-1]:]


def _intra(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gam: torch.Tensor, beta: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """State-independent part for a batch of chunks: q,k,gam [..., C, K], v [..., C, V], beta [..., C].
    Returns P [..., C, C], U [..., C, V], W [..., C, K]."""
    C = q.shape[-2]
    idx = torch.arange(C, device=q.device)
    incl = idx[:, None] >= idx[None, :]
    diff = gam[..., :, None, :] - gam[..., None, :, :]  # [..., t, s, K]
    decay_k = torch.exp(diff.masked_fill(~incl[:, :, None], float("-inf"))) * k[..., None, :, :]
    A = (decay_k * k[..., :, None, :]).sum(-1) * (idx[:, None] > idx[None, :])
    P = (decay_k * q[..., :, None, :]).sum(-1) * scale
    rhs = beta[..., :, None] * torch.cat([v, k * torch.exp(gam)], dim=-1)
    sol = _unit_lower_inverse(beta[..., :, None] * A) @ rhs
    return P, sol[..., : v.shape[-1]], sol[..., v.shape[-1]:]


def chunk_kda_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float, initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Preprocessed inputs (q,k already expanded to HV heads, g log-decay, beta probabilities), all in one
    float dtype. Returns o [B,T,HV,V] and final states [N,HV,K,V] in that dtype."""
    # Decays of up to exp(-80) times small keys and gradients fall below fp32's normal range; x86 CPUs
    # handle such denormals in microcode, which made training steps several times slower (measured 6x on
    # the tiny model's SFT). Flushing them to zero (this thread's FTZ/DAZ flags) changes nothing visible.
    torch.set_flush_denormal(True)
    B, T, HV, K = q.shape
    V = v.shape[-1]
    # Bounded gates make 16-token chunks factorable into matmuls, which beats larger pairwise chunks.
    # fp64 is the checking precision: it keeps the pairwise form, whose rounding is the smallest.
    factor = q.dtype != torch.float64 and float(-g.detach().min()) * 16 <= _MAX_FACTORED_RANGE
    C = 16 if factor else chunk_size
    first, last = (x.to(q.device) for x in sequence_rows(T, B, cu_seqlens))
    lengths = last - first
    N = len(first)
    max_len = int(lengths.max())
    Tp = max(C, -(-max_len // C) * C)

    # Row n of the padded layout reads tokens start_n .. start_n + Tp - 1 of the flattened batch, and a zero
    # row (index B*T) past its end: zero k, v, g, beta tokens leave the state unchanged, so padding is exact.
    # One gather per tensor (not one pad per sequence): steps that continue many short turns stay cheap.
    offsets = torch.arange(Tp, device=q.device)
    valid = offsets < lengths[:, None]  # [N, Tp]
    gather = torch.where(valid, first[:, None] + offsets, B * T)

    def to_rows(x: torch.Tensor) -> torch.Tensor:  # [B, T, HV, D] -> [N*HV, Tp, D]
        flat = torch.cat([x.reshape(B * T, HV, x.shape[-1]), x.new_zeros(1, HV, x.shape[-1])])
        return flat[gather].permute(0, 2, 1, 3).reshape(N * HV, Tp, x.shape[-1])

    qr, kr, vr, gr = to_rows(q), to_rows(k), to_rows(v), to_rows(g)
    br = to_rows(beta[..., None])[..., 0]
    if initial_state is not None:
        S = initial_state.to(q.dtype).reshape(N * HV, K, V)
    else:
        S = q.new_zeros(N * HV, K, V)
    NT = Tp // C
    qc, kc, vc = (x.reshape(N * HV, NT, C, -1) for x in (qr, kr, vr))
    gam = gr.reshape(N * HV, NT, C, K).cumsum(2)
    bc = br.reshape(N * HV, NT, C)
    if factor and float((gam[:, :, 0] - gam[:, :, -1]).detach().max()) <= _MAX_FACTORED_RANGE:
        P, U, W = _intra_factored(qc, kc, vc, gam, bc, scale)
    else:
        # many chunks at once, in groups that bound the [.., C, C, K] temporaries
        group = max(1, (1 << 23) // (N * HV * C * C * K))
        parts = [_intra(qc[:, a:a + group], kc[:, a:a + group], vc[:, a:a + group], gam[:, a:a + group],
                        bc[:, a:a + group], scale) for a in range(0, NT, group)]
        P, U, W = (torch.cat(x, 1) for x in zip(*parts, strict=True))
    q_gam = qc * torch.exp(gam) * scale
    g_last = gam[:, :, -1, :]  # [R, NT, K]
    k_tail_t = (kc * torch.exp(g_last[:, :, None, :] - gam)).transpose(-1, -2)  # [R, NT, K, C]
    decay = torch.exp(g_last)[..., None]  # [R, NT, K, 1]
    starts, new_values = [], []
    # unbind once: indexing chunk c out of each tensor would make autograd scatter every chunk's gradient
    # into a zero tensor of the full size (quadratic in the number of chunks)
    for u, w, d, kt in zip(U.unbind(1), W.unbind(1), decay.unbind(1), k_tail_t.unbind(1), strict=True):
        starts.append(S)
        Vn = torch.baddbmm(u, w, S, alpha=-1)  # the delta rule's new values U - W S
        new_values.append(Vn)
        S = torch.baddbmm(d * S, kt, Vn)
    # O = Q_gam S + P Vn, for all chunks at once
    outs = q_gam @ torch.stack(starts, 1) + P @ torch.stack(new_values, 1)  # [R, NT, C, V]
    o_rows = outs.reshape(N, HV, Tp, V).permute(0, 2, 1, 3)  # [N, Tp, HV, V]
    o = o_rows[:, :T] if cu_seqlens is None else o_rows[valid][None]
    return o, S.reshape(N, HV, K, V)
