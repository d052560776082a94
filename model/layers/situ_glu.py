"""SiTU-GLU: h = [beta*tanh(a/beta)*sigmoid(a)] * [beta_L*tanh(u/beta_L)], in fp32, bounded by beta*beta_L."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.situ_glu_cpu import situ_glu_cpu


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, beta_linear: float) -> torch.Tensor:
    """The soft-capped GLU activation (~SwiGLU for small inputs). Returns the input dtype. On CPU without
    autograd (serving, evaluation) the same formula runs as one compiled pass (`kernels/situ_glu_cpu.py`)."""
    if _compiled_cpu_pass_applies(gate, up):
        return situ_glu_cpu(gate, up, beta, beta_linear)
    a, u = gate.float(), up.float()
    h = (beta * torch.tanh(a / beta) * torch.sigmoid(a)) * (beta_linear * torch.tanh(u / beta_linear))
    return h.to(gate.dtype)


def _compiled_cpu_pass_applies(gate: torch.Tensor, up: torch.Tensor) -> bool:
    needs_grad = torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
    return (gate.device.type == "cpu" and not needs_grad and not torch.compiler.is_compiling()
            and gate.dtype == up.dtype and gate.dtype in (torch.float32, torch.bfloat16))


class SiTUGLUMLP(nn.Module):
    """Dense MLP (first_k_dense layers) and the MoE shared expert: down(situ_glu(gate(x), up(x)))."""

    def __init__(self, hidden_size: int, intermediate_size: int, beta: float, beta_linear: float) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.beta, self.beta_linear = beta, beta_linear

    def gate_up_weight(self) -> torch.Tensor:
        """gate and up projections stacked [2*I, d]: one GEMM reads x for both."""
        return torch.cat([self.gate_proj.weight, self.up_proj.weight])

    def from_gate_up(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP's output from x's projection by `gate_up_weight`."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(situ_glu(gate, up, self.beta, self.beta_linear))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.from_gate_up(F.linear(x, self.gate_up_weight()))
