"""KDA's per-token recurrence as one compiled CPU loop (numba): the CPU path wherever no gradient is needed
(the engine's prefill and decode, evaluation). The CPU training path, which needs autograd, stays the
chunked torch one (`chunk_torch.py`).

Why a recurrence and not chunks on CPU: with K = V = 64 per head, a token costs a few multiply-adds per
state element, the state (16 KiB) stays in L1 and nothing is materialised, while the chunked torch path
spends most of its time in small batched matmuls and elementwise temporaries (measured 2.4x slower at 4K, 2.6x at 16K, AVX2 CPU).

Per token, with the decay d = exp(g), S' = Diag(d) S, e = v - S'^T k:
    S = S' + beta k e^T,    o = S^T (scale q) = S'^T (scale q) + (scale q . beta k) e.
Each token's rank-1 update is applied lazily, in the next token's one sweep over the state: that sweep
forms S_{t-1} = Diag(d_{t-1}) S_{t-2} + beta k e^T row by row and, from the same rows, S'_t^T k_t and
S'_t^T q_t. So the state is read and written once per token.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.kda.common import preprocess, sequence_rows


def recurrent_kda_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, scale: float,
    pool: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor | None, use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, lower_bound: float | None,
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
) -> torch.Tensor:
    """The op's inputs as `chunk_kda` takes them (checked); sequence n (a batch row, or a `cu_seqlens`
    segment) continues state pool[slots[n]] (pool: [P, HV, K, V] fp32, contiguous, updated in place; a
    negative slot skips the sequence: zero output, no state touched). Returns o [B, T, HV, V] fp32."""
    if pool.dtype != torch.float32 or not pool.is_contiguous():
        raise ValueError(f"the state pool must be contiguous fp32, got {pool.dtype}")
    B, T, _, _ = q.shape
    HV, V = pool.shape[1], pool.shape[3]
    with torch.no_grad():
        # the l2norm runs in the kernel: a few multiply-adds per token there, several tensor passes here
        qe, ke, ve, ge, be = preprocess(
            q, k, v, g, beta, dtype=torch.float32, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, lower_bound=lower_bound, A_log=A_log,
            dt_bias=dt_bias,
        )
        rows = B * T
        arrays = [x.reshape(rows, *x.shape[2:]).contiguous().numpy() for x in (qe, ke, ve, torch.exp(ge), be)]
        o = torch.zeros(B, T, HV, V)
        starts, ends = sequence_rows(T, B, cu_seqlens)
        index = [x.to("cpu", torch.int64).contiguous().numpy() for x in (starts, ends, slots)]
        from kernels.kda.recurrent_cpu_numba import kda_rows  # numba loads where the CPU path first runs

        kda_rows(*arrays, np.float32(scale), use_qk_l2norm_in_kernel, *index, pool.numpy(),
                  o.view(rows, HV, V).numpy())
    return o
