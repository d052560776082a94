"""Argument checks and the differentiable input preprocessing shared by the pure-torch KDA paths."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kda.gate import check_gate_args, kda_gate

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (fla's convention)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the torch paths compute in and return states in: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_scale(scale: float | None, K: int) -> float:
    """The attention scale: K**-0.5 unless given."""
    return K**-0.5 if scale is None else float(scale)


@dataclass(frozen=True)
class Shapes:
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int  # number of sequences


def check_cu_seqlens_values(cs: list[int], T: int) -> None:
    if cs[0] != 0 or cs[-1] != T or any(b < a for a, b in zip(cs, cs[1:], strict=False)):
        raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {cs}")


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    use_gate_in_kernel: bool,
    lower_bound: float | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    state_rows: int | None = None,
) -> Shapes:
    """Validate shapes; errors name the offending argument. `state_rows` overrides the expected
    initial_state rows (a decode state pool)."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must match q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, HV, V] with B={B}, T={T}, got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise ValueError(f"v's head count HV={HV} must be a multiple of q/k's H={H}")
    if g.shape != (B, T, HV, K):
        raise ValueError(f"g must be [B, T, HV, K]={(B, T, HV, K)}, got {tuple(g.shape)}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"beta must be [B, T, HV]={(B, T, HV)}, got {tuple(beta.shape)}")
    if use_gate_in_kernel:
        check_gate_args(g, lower_bound, A_log, dt_bias)
    elif A_log is not None or dt_bias is not None:
        raise ValueError("A_log/dt_bias are only used with use_gate_in_kernel=True")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size B must be 1, got q of shape {tuple(q.shape)}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be a 1-D tensor [N+1] of cumulative lengths")
        if cu_seqlens.device.type == "cpu":  # on a GPU the values are checked where they are read anyway
            check_cu_seqlens_values(cu_seqlens.tolist(), T)
        N = cu_seqlens.numel() - 1
    else:
        N = B
    if initial_state is not None:
        rows = N if state_rows is None else state_rows
        if initial_state.dim() != 4 or initial_state.shape[1:] != (HV, K, V) or (
            state_rows is None and initial_state.shape[0] != rows
        ):
            raise ValueError(
                f"initial_state must be [N={rows}, HV={HV}, K={K}, V={V}], got {tuple(initial_state.shape)}"
            )
    return Shapes(B=B, T=T, H=H, HV=HV, K=K, V=V, N=N)


def preprocess(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    dtype: torch.dtype,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    lower_bound: float | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast to `dtype`, apply the optional l2norm / gate / beta sigmoid, and expand q, k to HV heads
    (q/k head h serves value heads h*G .. h*G+G-1 with G = HV/H). Differentiable."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    G = v.shape[2] // q.shape[2]
    if G > 1:
        q, k = q.repeat_interleave(G, dim=2), k.repeat_interleave(G, dim=2)
    if use_gate_in_kernel:
        g = kda_gate(g.to(dtype), lower_bound, A_log, dt_bias).to(dtype)
    else:
        g = g.to(dtype)
    beta = beta.to(dtype)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta)
    return q, k, v, g, beta


def sequence_bounds(T: int, B: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch row, start, end) for each of the N sequences."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cs = cu_seqlens.tolist()
    return [(0, cs[n], cs[n + 1]) for n in range(len(cs) - 1)]


def sequence_rows(T: int, B: int, cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's first and past-the-end row in the flattened [B * T] tokens (CPU int64)."""
    bounds = sequence_bounds(T, B, cu_seqlens)
    return (torch.tensor([b * T + s for b, s, _ in bounds], dtype=torch.int64),
            torch.tensor([b * T + e for b, _, e in bounds], dtype=torch.int64))


def fp32_states(initial_state: torch.Tensor | None, N: int, HV: int, K: int, V: int) -> torch.Tensor:
    """A contiguous fp32 copy of the initial states [N, HV, K, V], or zeros: states a kernel may update."""
    if initial_state is None:
        return torch.zeros(N, HV, K, V)
    return initial_state.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
