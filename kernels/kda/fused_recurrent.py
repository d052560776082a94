"""`fused_recurrent_kda`: token-by-token KDA for decode, with vLLM-style state slots."""

from __future__ import annotations

import torch

from kernels.kda.common import check_inputs, default_scale, preprocess, work_dtype
from kernels.kda.recurrent_torch import recurrent_kda_step_torch, recurrent_kda_torch


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
    with torch.no_grad():
        dtype = work_dtype(q.dtype)
        qe, ke, ve, ge, be = preprocess(
            q, k, v, g, beta, dtype=dtype, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias,
        )
        if cu_seqlens is None and shp.T == 1:
            return _decode_one_token(qe, ke, ve, ge, be, scale, q.dtype, initial_state, output_final_state,
                                     ssm_state_indices, inplace_final_state)
        states = q.new_zeros(shp.N, shp.HV, shp.K, shp.V, dtype=dtype)
        valid = None
        if ssm_state_indices is not None:
            valid = ssm_state_indices >= 0
            slots = ssm_state_indices[valid].long()
            states[valid] = initial_state[slots].to(dtype)
        elif initial_state is not None:
            states = initial_state.to(dtype)
        o, new_states = recurrent_kda_torch(qe, ke, ve, ge, be, scale, states, cu_seqlens)
        if valid is not None:
            # padded rows: zero output, untouched slot
            if cu_seqlens is None:
                o[~valid] = 0
            else:
                cs = cu_seqlens.tolist()
                for n in torch.nonzero(~valid).flatten().tolist():
                    o[0, cs[n]: cs[n + 1]] = 0
            new_states[~valid] = 0
        o = o.to(q.dtype)
        if initial_state is not None and inplace_final_state:
            if valid is not None:
                initial_state[slots] = new_states[valid].to(initial_state.dtype)
            else:
                initial_state.copy_(new_states.to(initial_state.dtype))
            return o, initial_state
        if output_final_state or ssm_state_indices is not None:
            return o, new_states.to(dtype)
        return o, None


def _decode_one_token(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    out_dtype: torch.dtype, initial_state: torch.Tensor | None, output_final_state: bool,
    ssm_state_indices: torch.Tensor | None, inplace_final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU path for T = 1 (plain decode), same contract as `fused_recurrent_kda`; inputs preprocessed
    [N, 1, ...]. Slots are gathered and scattered with index_select / index_copy_ (no boolean masks)."""
    q, k, v, g, beta = q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0]
    N, HV, K = q.shape
    dtype = q.dtype
    if ssm_state_indices is not None:
        slots = ssm_state_indices.long()
        padded = bool((slots < 0).any())
        # index_select copies: the step updates its own rows, the pool is written back below
        states = initial_state.index_select(0, slots.clamp_min(0)).to(dtype)
        if padded:
            states[slots < 0] = 0
    elif initial_state is not None:
        states = initial_state.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)
    else:
        states = q.new_zeros(N, HV, K, v.shape[-1])
    o = recurrent_kda_step_torch(q, k, v, g, beta, scale, states)
    if ssm_state_indices is not None and padded:
        o[slots < 0] = 0  # padded rows: zero output, untouched slot
        states[slots < 0] = 0
    o = o.unsqueeze(1).to(out_dtype)
    if initial_state is not None and inplace_final_state:
        if ssm_state_indices is None:
            initial_state.copy_(states)
        elif padded:
            keep = torch.nonzero(slots >= 0).flatten()
            initial_state.index_copy_(0, slots[keep], states[keep].to(initial_state.dtype))
        else:
            initial_state.index_copy_(0, slots, states.to(initial_state.dtype))
        return o, initial_state
    if output_final_state or ssm_state_indices is not None:
        return o, states
    return o, None
