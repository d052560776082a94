"""SiTU-GLU: h = [beta*tanh(a/beta)*sigmoid(a)] * [beta_L*tanh(u/beta_L)], in fp32, bounded by beta*beta_L."""

from __future__ import annotations

import torch
from torch import nn


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, beta_linear: float) -> torch.Tensor:
    """The soft-capped GLU activation (~SwiGLU for small inputs). Returns the input dtype."""
    a, u = gate.float(), up.float()
    h = (beta * torch.tanh(a / beta) * torch.sigmoid(a)) * (beta_linear * torch.tanh(u / beta_linear))
    return h.to(gate.dtype)


class SiTUGLUMLP(nn.Module):
    """Dense MLP (first_k_dense layers) and the MoE shared expert: down(situ_glu(gate(x), up(x)))."""

    def __init__(self, hidden_size: int, intermediate_size: int, beta: float, beta_linear: float) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.beta, self.beta_linear = beta, beta_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ_glu(self.gate_proj(x), self.up_proj(x), self.beta, self.beta_linear))
