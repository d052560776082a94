"""Fewer-op forms of the HF model's small fp32 functions for serving (a decode step is made of many tiny
ops, each costing more in dispatch than in arithmetic). Same parameters and math as the HF modules; in
any dtype but fp32 they defer to the HF modules themselves. Importable without vLLM."""

from __future__ import annotations

import torch

from model.layers.norm import GatedRMSNorm, RMSNorm
from model.layers.situ_glu import situ_glu


def _fp32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 for t in tensors)


def rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """= norm(x)."""
    if not _fp32(x, norm.weight):
        return norm(x)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight


def gated_rms_norm(norm: GatedRMSNorm, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """= norm(x, gate)."""
    if not _fp32(x, gate, norm.weight):
        return norm(x, gate)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight * torch.sigmoid(gate)


def situ_glu_fast(gate: torch.Tensor, up: torch.Tensor, beta: float, beta_linear: float) -> torch.Tensor:
    """= situ_glu(gate, up, beta, beta_linear), the two caps' scales folded into one multiply."""
    if not _fp32(gate, up):
        return situ_glu(gate, up, beta, beta_linear)
    h = torch.tanh(gate * (1.0 / beta)) * torch.sigmoid(gate)
    return h.mul_(torch.tanh(up * (1.0 / beta_linear))).mul_(beta * beta_linear)
