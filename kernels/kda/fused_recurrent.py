"""`fused_recurrent_kda`: token-by-token KDA for decode, with vLLM-style state slots."""

from __future__ import annotations

import torch

from kernels.kda.common import check_inputs, default_scale, fp32_states
from kernels.kda.recurrent_cpu import recurrent_kda_cpu, slots_contiguous


def fused_recurrent_kda(
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
    lower_bound: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    inplace_final_state: bool = True,
    use_beta_sigmoid_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode many sequences at once (no autograd). Inputs as in `chunk_kda`; a sequence is a batch row,
    or a `cu_seqlens` segment when B == 1 (one token each for plain decode).

    State handling:
    - `ssm_state_indices` [N] given: `initial_state` is the whole state pool [num_slots, HV, K, V] (fp32);
      sequence n reads slot ssm_state_indices[n]; a negative index marks a padded row, which is skipped
      (its output is zero, no slot is touched). With `inplace_final_state` the slots are updated in place
      and the pool is returned as the final state; otherwise the pool is left alone and new final states
      [N, HV, K, V] are returned (zeros for padded rows).
    - no indices: `initial_state` is [N, HV, K, V] or None; with `inplace_final_state` and an
      initial_state the final states are written back into it (and it is returned); otherwise final
      states are returned only when `output_final_state`.
    Returns (o [B, T, HV, V] in q's dtype, final state or None).
    """
    state_rows = None
    if ssm_state_indices is not None:
        if initial_state is None:
            raise ValueError("ssm_state_indices needs initial_state: the state pool [num_slots, HV, K, V]")
        state_rows = initial_state.shape[0]
    shp = check_inputs(
        q, k, v, g, beta, initial_state, cu_seqlens, use_gate_in_kernel, lower_bound, A_log, dt_bias,
        state_rows=state_rows,
    )
    if ssm_state_indices is not None:
        if ssm_state_indices.dim() != 1 or ssm_state_indices.numel() != shp.N:
            raise ValueError(f"ssm_state_indices must be [N={shp.N}], got {tuple(ssm_state_indices.shape)}")
        if ssm_state_indices.device.type == "cpu" and int(ssm_state_indices.max()) >= initial_state.shape[0]:
            raise ValueError(f"ssm_state_indices has a slot >= the pool size {initial_state.shape[0]}")
    scale = default_scale(scale, shp.K)
    if q.is_cuda:
        from kernels.kda.triton_recurrent import fused_recurrent_kda_triton

        return fused_recurrent_kda_triton(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, lower_bound=lower_bound, A_log=A_log,
            dt_bias=dt_bias, cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices,
            inplace_final_state=inplace_final_state,
        )
    gate = dict(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, lower_bound=lower_bound, A_log=A_log,
                dt_bias=dt_bias)
    if ssm_state_indices is not None:
        slots = ssm_state_indices.to("cpu", torch.int64)
        if inplace_final_state and initial_state.dtype == torch.float32 and slots_contiguous(initial_state):
            o = recurrent_kda_cpu(q, k, v, g, beta, scale=scale, pool=initial_state, slots=slots,
                                  cu_seqlens=cu_seqlens, **gate)
            return o.to(q.dtype), initial_state
        # a pool of another dtype or layout, or new final states asked for: the used slots as a compact fp32 copy
        padded = bool((slots < 0).any())
        used = slots[slots >= 0] if padded else slots
        compact = initial_state.index_select(0, used).to(torch.float32, memory_format=torch.contiguous_format)
        if padded:
            local = torch.full_like(slots, -1)
            local[slots >= 0] = torch.arange(used.numel())
        else:
            local = torch.arange(used.numel())
        o = recurrent_kda_cpu(q, k, v, g, beta, scale=scale, pool=compact, slots=local, cu_seqlens=cu_seqlens,
                              **gate).to(q.dtype)
        if inplace_final_state:
            initial_state.index_copy_(0, used, compact.to(initial_state.dtype))
            return o, initial_state
        final = compact.new_zeros(shp.N, shp.HV, shp.K, shp.V)  # zeros for padded rows
        final[slots >= 0] = compact
        return o, final
    pool = fp32_states(initial_state, shp.N, shp.HV, shp.K, shp.V)
    o = recurrent_kda_cpu(q, k, v, g, beta, scale=scale, pool=pool, slots=torch.arange(shp.N),
                          cu_seqlens=cu_seqlens, **gate).to(q.dtype)
    if initial_state is not None and inplace_final_state:
        initial_state.copy_(pool)
        return o, initial_state
    return o, (pool if output_final_state else None)
