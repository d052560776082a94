"""Block AttnRes: each sub-layer's input is a softmax-weighted mix over depth.

Candidates are the block summaries b_0 (the embedding), b_1, ... and the running in-block sum p of
sub-layer outputs (absent right after a block boundary). Scores s_i = <V_i / rms(V_i), gamma * w>
with a learned pseudo-query w per sub-layer; weights softmax(s) in fp32; the mix is of the raw
candidates. Every `block_size` layers p is pushed onto the stack and reset.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from model.layers.norm import rms_normalize


@dataclass
class AttnResState:
    """Depth-wise residual state carried through the layers of one forward pass."""

    blocks: list[torch.Tensor]
    partial: torch.Tensor | None = None
    layers_in_block: int = field(default=0)

    @classmethod
    def start(cls, embeddings: torch.Tensor) -> AttnResState:
        return cls(blocks=[embeddings])

    def candidates(self) -> list[torch.Tensor]:
        return self.blocks if self.partial is None else [*self.blocks, self.partial]

    def add(self, sublayer_output: torch.Tensor) -> None:
        self.partial = sublayer_output if self.partial is None else self.partial + sublayer_output

    def end_layer(self, block_size: int) -> None:
        self.layers_in_block += 1
        if self.layers_in_block == block_size:
            if self.partial is not None:
                self.blocks.append(self.partial)
            self.partial, self.layers_in_block = None, 0


class BlockAttnRes(nn.Module):
    """The depth mix in front of one sub-layer. Parameters: `query` (w) and `norm.weight` (gamma)."""

    # On CUDA: one fused Triton kernel each way (kernels/attn_res.py), the same math as `weights` and the mix
    # below; False: this torch path everywhere (the benchmarks compare the two)
    use_fused = True

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        # Zero query: a uniform average over the candidates at initialisation.
        self.query = nn.Parameter(torch.zeros(hidden_size))
        self.norm = _ScoreNorm(hidden_size)
        self.eps = eps

    def weights(self, candidates: list[torch.Tensor]) -> torch.Tensor:
        """Softmax weights [N, ...tokens] over the N candidates, fp32."""
        stacked = torch.stack(candidates)
        key = self.norm.weight.float() * self.query.float()
        scores = (rms_normalize(stacked, self.eps) * key).sum(-1)
        return torch.softmax(scores, dim=0)

    def forward(self, candidates: list[torch.Tensor]) -> torch.Tensor:
        # Also with a single candidate (weight 1), so the parameters always take part in autograd.
        if self.use_fused and candidates[0].is_cuda:
            from kernels.attn_res import MAX_CANDIDATES, attn_res_mix

            if len(candidates) <= MAX_CANDIDATES:
                return attn_res_mix(candidates, self.norm.weight, self.query, self.eps)
        weights = self.weights(candidates)
        mixed = (weights.unsqueeze(-1) * torch.stack(candidates).float()).sum(0)
        return mixed.to(candidates[0].dtype)


class _ScoreNorm(nn.Module):
    """Holds gamma (`norm.weight`) of the AttnRes score; the normalisation itself runs in BlockAttnRes."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
