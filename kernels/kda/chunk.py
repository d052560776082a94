"""`chunk_kda`: KDA over whole sequences for training and prefill. Triton on CUDA; on CPU the chunked torch
path where a gradient is needed and the compiled recurrence (`recurrent_cpu.py`) where none is."""

from __future__ import annotations

import torch

from kernels.kda.chunk_torch import chunk_kda_torch
from kernels.kda.common import check_inputs, default_scale, fp32_states, preprocess, work_dtype
from kernels.kda.recurrent_cpu import recurrent_kda_cpu


def chunk_kda(
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
    chunk_size: int = 64,
    use_beta_sigmoid_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention over whole sequences, with autograd.

    q, k: [B, T, H, K]; v: [B, T, HV, V] with HV a multiple of H (q/k head h serves value heads
    h*HV/H .. (h+1)*HV/H - 1); g: [B, T, HV, K] log-decay, or the raw gate input f when
    `use_gate_in_kernel` (then g = lower_bound*sigmoid(f + dt_bias) if `lower_bound` is set, else
    -exp(A_log)*softplus(f + dt_bias); see kernels/kda/gate.py). With a precomputed g, `lower_bound`
    promises g >= lower_bound (the CUDA kernel then takes the all-tl.dot path). beta: [B, T, HV]
    probabilities (raw logits with `use_beta_sigmoid_in_kernel`). scale defaults to K**-0.5.
    initial_state / final state: [N, HV, K, V] fp32; with `cu_seqlens` ([N+1] cumulative lengths) B
    must be 1. Returns (o [B, T, HV, V] in q's dtype, final_state or None).
    """
    shp = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, use_gate_in_kernel, lower_bound, A_log, dt_bias)
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size}")
    scale = default_scale(scale, shp.K)
    if q.is_cuda:
        from kernels.kda.triton_chunk import chunk_kda_triton

        return chunk_kda_triton(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, lower_bound=lower_bound, A_log=A_log,
            dt_bias=dt_bias, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
        )
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state, A_log, dt_bias))
    dtype = work_dtype(q.dtype)
    gate = dict(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, lower_bound=lower_bound, A_log=A_log,
                dt_bias=dt_bias)
    if not needs_grad and dtype == torch.float32:  # fp64 is the checking precision: the torch path
        states = fp32_states(initial_state, shp.N, shp.HV, shp.K, shp.V)
        o = recurrent_kda_cpu(q, k, v, g, beta, scale=scale, pool=states, slots=torch.arange(shp.N),
                              cu_seqlens=cu_seqlens, **gate)
        return o.to(q.dtype), (states if output_final_state else None)
    qe, ke, ve, ge, be = preprocess(q, k, v, g, beta, dtype=dtype, **gate)
    o, final = chunk_kda_torch(qe, ke, ve, ge, be, scale, initial_state, cu_seqlens, chunk_size)
    return o.to(q.dtype), (final.to(dtype) if output_final_state else None)
