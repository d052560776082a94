"""Random KDA inputs for the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KDAInputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    kwargs: dict = field(default_factory=dict)

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k, self.v, self.g, self.beta


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def make_inputs(
    B: int, T: int, H: int, HV: int, K: int, V: int, *, gate: str = "bounded", lower_bound: float = -5.0,
    f_shift: float = 0.0, initial_state: bool = False, l2norm: bool = True, beta_logits: bool = False,
    cu_seqlens: list[int] | None = None, dtype: torch.dtype = torch.float32, seed: int = 0,
    device: str = "cpu",
) -> KDAInputs:
    """gate: 'bounded' / 'unbounded' (raw f, in-kernel gate) or 'precomputed' (g given, log-decay)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, HV, V)
    if not l2norm:  # keep the delta rule contractive: |beta k k^T| < 2
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    kwargs: dict = {"use_qk_l2norm_in_kernel": l2norm}
    if gate == "precomputed":
        g = (-torch.rand(B, T, HV, K, generator=gen) * 2.0).to(device=device, dtype=dtype)
    else:
        g = rnd(B, T, HV, K) + f_shift
        kwargs["use_gate_in_kernel"] = True
        kwargs["dt_bias"] = rnd(HV * K, scale=0.5)
        if gate == "bounded":
            kwargs["lower_bound"] = lower_bound
        else:
            kwargs["A_log"] = rnd(HV, scale=0.5)
    if beta_logits:
        beta = rnd(B, T, HV)
        kwargs["use_beta_sigmoid_in_kernel"] = True
    else:
        beta = torch.rand(B, T, HV, generator=gen).to(device=device, dtype=dtype)
    if initial_state:
        kwargs["initial_state"] = (torch.randn(N, HV, K, V, generator=gen) * 0.5).to(device, torch.float32)
    if cu_seqlens is not None:
        kwargs["cu_seqlens"] = torch.tensor(cu_seqlens, dtype=torch.long, device=device)
    return KDAInputs(q, k, v, g, beta, kwargs)
