"""RMSNorm and the gated RMSNorm of the KDA output; both compute in fp32."""

from __future__ import annotations

import torch
from torch import nn


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x, self.eps) * self.weight.float()).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm(o) * sigmoid(gate) over the last dim (one head's channels). The CPU serving path runs the same
    formula as one compiled pass (`kernels.kda.recurrent_cpu.gated_rms_norm_cpu`)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        out = rms_normalize(x, self.eps) * self.weight.float() * torch.sigmoid(gate.float())
        return out.to(gate.dtype)
