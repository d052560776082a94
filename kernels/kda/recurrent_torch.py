"""Pure-torch recurrent KDA for decode on CPU: a loop over the (few) tokens of each sequence, batched over
sequences and heads. Padded zero tokens leave a state unchanged, so sequences of unequal length share
the loop."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.kda.common import sequence_bounds


def recurrent_kda_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float, states: torch.Tensor, cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Preprocessed inputs in one float dtype (q,k expanded to HV heads); `states` [N,HV,K,V] in that
    dtype. Returns o [B,T,HV,V] and the new states [N,HV,K,V]."""
    torch.set_flush_denormal(True)  # see chunk_kda_torch
    B, T, HV, K = q.shape
    bounds = sequence_bounds(T, B, cu_seqlens)
    Lmax = max(e - s for _, s, e in bounds)

    def to_rows(x: torch.Tensor) -> torch.Tensor:  # [B,T,HV,D] -> [N, Lmax, HV, D]
        return torch.stack([F.pad(x[b, s:e], (0, 0, 0, 0, 0, Lmax - (e - s))) for b, s, e in bounds], 0)

    qr, kr, vr, gr = to_rows(q), to_rows(k), to_rows(v), to_rows(g)
    br = to_rows(beta[..., None])[..., 0]
    S = states
    outs = []
    for t in range(Lmax):
        S = S * gr[:, t].exp()[..., None]
        kt = kr[:, t]
        err = vr[:, t] - torch.einsum("nhkv,nhk->nhv", S, kt)
        S = S + br[:, t][..., None, None] * kt[..., None] * err[..., None, :]
        outs.append(torch.einsum("nhkv,nhk->nhv", S, qr[:, t] * scale))
    o_rows = torch.stack(outs, 1)  # [N, Lmax, HV, V]
    if cu_seqlens is None:
        o = o_rows[:, :T]
    else:
        o = torch.cat([o_rows[n, : e - s] for n, (_, s, e) in enumerate(bounds)], 0)[None]
    return o, S


def recurrent_kda_step_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float, states: torch.Tensor,
) -> torch.Tensor:
    """One token for each of N sequences (decode), preprocessed as for `recurrent_kda_torch`: q, k, g
    [N, HV, K], v [N, HV, V], beta [N, HV]. `states` [N, HV, K, V] is updated in place (the caller owns
    it). Returns o [N, HV, V].

    With S' = Diag(e^g) S and e = v - S'^T k:  S = S' + beta k e^T  and
    o = S^T (scale q) = S'^T (scale q) + (scale q . beta k) e,
    so k^T S' and q^T S' come from one batched matmul and the state is read twice and written twice
    (decay, rank-1 update) instead of once per einsum/broadcast of the per-token loop."""
    torch.set_flush_denormal(True)  # see chunk_kda_torch
    N, HV, K = q.shape
    V = v.shape[-1]
    rows = N * HV
    states.mul_(g.exp().unsqueeze(-1))
    S = states.view(rows, K, V)
    qs = q.reshape(rows, K) * scale
    bk = (beta.unsqueeze(-1) * k).reshape(rows, K)
    kq = torch.bmm(torch.stack([k.reshape(rows, K), qs], 1), S)  # [rows, 2, V]: k^T S', scale q^T S'
    err = v.reshape(rows, V) - kq[:, 0]
    S.addcmul_(bk.unsqueeze(-1), err.unsqueeze(1))
    o = torch.addcmul(kq[:, 1], (qs * bk).sum(-1, keepdim=True), err)
    return o.view(N, HV, V)
