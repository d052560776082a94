"""Per-token KDA recurrence: the slow, obviously-correct reference for tests (never a fast path)."""

from __future__ import annotations

import torch

from kernels.kda.common import check_inputs, preprocess, sequence_bounds


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    lower_bound: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """S' = Diag(exp(g_t)) S; S = S' + beta_t k_t (v_t - S'^T k_t)^T; o_t = S^T (scale q_t).

    Same arguments as `chunk_kda`; computes in `compute_dtype`, returns o in q's dtype and the final
    states [N, HV, K, V] in fp32 (fp64 when computing in fp64). Differentiable.
    """
    shp = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, use_gate_in_kernel, lower_bound, A_log, dt_bias)
    scale = shp.K**-0.5 if scale is None else scale
    qe, ke, ve, ge, be = preprocess(
        q, k, v, g, beta, dtype=compute_dtype, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias,
    )
    outs, finals = [], []
    for n, (b, start, end) in enumerate(sequence_bounds(shp.T, shp.B, cu_seqlens)):
        if initial_state is not None:
            S = initial_state[n].to(compute_dtype)
        else:
            S = qe.new_zeros(shp.HV, shp.K, shp.V)
        for t in range(start, end):
            S = S * ge[b, t].exp()[..., None]
            kt = ke[b, t]
            err = ve[b, t] - torch.einsum("hkv,hk->hv", S, kt)
            S = S + be[b, t][:, None, None] * kt[..., None] * err[:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", S, qe[b, t] * scale))
        finals.append(S)
    o = torch.stack(outs, 0).reshape(shp.B, shp.T, shp.HV, shp.V).to(q.dtype)
    state_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    final = torch.stack(finals, 0).to(state_dtype) if output_final_state else None
    return o, final
