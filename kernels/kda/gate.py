"""The KDA forget gate, in log space. This file is its home: the torch form (CPU paths, tests) and the
Triton form that the CUDA kernels inline. The CPU recurrence's gate loop
(`recurrent_cpu_numba.gate_decay_rows`) writes the same two formulas in numba, which cannot call either; its
tests compare it with this one.

Bounded (docs/design.md section 2):   g = lower_bound * sigmoid(f + dt_bias),   so g in (lower_bound, 0).
Unbounded (for comparison):   g = -exp(A_log) * softplus(f + dt_bias).

flash-linear-attention's bounded form is `lower_bound * sigmoid(exp(A_log) * (f + dt_bias))`; with
`A_log = 0` (or None) it equals ours, which is how benchmarks compare the two. Here `A_log` belongs to the
unbounded form only, and passing it together with `lower_bound` is an error.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # Triton is optional on CPU-only installs; the CUDA kernels import `gate_fn` from here.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None


def check_gate_args(
    f: torch.Tensor, lower_bound: float | None, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None
) -> None:
    """Validate gate parameters against the raw gate input `f` of shape [..., HV, K]."""
    HV, K = f.shape[-2:]
    if lower_bound is not None:
        if not lower_bound < 0:
            raise ValueError(f"lower_bound must be negative (log-space decay floor), got {lower_bound}")
        if A_log is not None:
            raise ValueError("A_log belongs to the unbounded gate; pass either lower_bound or A_log, not both")
    elif A_log is None:
        raise ValueError("the unbounded gate needs A_log (shape [HV]); or set lower_bound for the bounded gate")
    if A_log is not None and A_log.numel() != HV:
        raise ValueError(f"A_log must have HV={HV} elements, got shape {tuple(A_log.shape)}")
    if dt_bias is not None and dt_bias.numel() != HV * K:
        raise ValueError(f"dt_bias must have HV*K={HV * K} elements, got shape {tuple(dt_bias.shape)}")


def kda_gate(
    f: torch.Tensor,
    lower_bound: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-space decay from the raw gate input f [..., HV, K]; fp32 (fp64 if f is fp64) result."""
    check_gate_args(f, lower_bound, A_log, dt_bias)
    HV, K = f.shape[-2:]
    dtype = torch.float64 if f.dtype == torch.float64 else torch.float32
    x = f.to(dtype)
    if dt_bias is not None:
        x = x + dt_bias.to(dtype).reshape(HV, K)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(x)
    return -torch.exp(A_log.to(dtype)).reshape(HV, 1) * F.softplus(x)


if triton is not None:

    @triton.jit
    def gate_fn(x, a_log, lower_bound, BOUNDED: tl.constexpr):
        """Triton form: x = f + dt_bias (fp32); a_log is the head's A_log (ignored when BOUNDED)."""
        if BOUNDED:
            return lower_bound * tl.sigmoid(x)
        else:
            sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
            return -tl.exp(a_log) * sp

    @triton.jit
    def gate_grad_fn(x, a_log, lower_bound, BOUNDED: tl.constexpr):
        """d gate / d x for the same x."""
        if BOUNDED:
            # sigmoid(x) * sigmoid(-x), not s * (1 - s): stays accurate where s rounds to 1
            return lower_bound * tl.sigmoid(x) * tl.sigmoid(-x)
        else:
            return -tl.exp(a_log) * tl.sigmoid(x)
