"""Gated multi-head latent attention (NoPE, docs/design.md section 2).

q = W_q x (or W_qb RMSNorm(W_qa x) with q_lora_rank); c = RMSNorm(W_kva x); [k; v] = W_kvb c per head;
causal softmax attention with scale 1/sqrt(Dqk); out = W_o(attn * sigmoid(W_g x)).
Here (the HF model) keys/values are cached up-projected ([B, Hq, T, D]), so the layer is ordinary
multi-head attention from the cache's point of view. The vLLM plugin on CPU caches the latent c instead
(one shared head) and decodes with the key up-projection absorbed into the queries (model/vllm_plugin/layers.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache

from model.config import TaperConfig
from model.layers.norm import RMSNorm


def attention_mask_for(
    query_len: int, past_len: int, key_mask: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """Boolean [B or 1, 1, T, past+T] mask: causal, keys allowed by key_mask [B, past+T]; each query always
    sees its own key so padded rows stay finite. None when plain causal with no past (use is_causal)."""
    if key_mask is None and past_len == 0:
        return None
    total = past_len + query_len
    q_pos = torch.arange(past_len, total, device=device)[:, None]
    k_pos = torch.arange(total, device=device)[None, :]
    mask = (k_pos <= q_pos)[None, None]
    if key_mask is not None:
        mask = mask & key_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
        mask = mask | (k_pos == q_pos)[None, None]
    return mask


class GatedMLA(nn.Module):
    def __init__(self, config: TaperConfig, layer_idx: int | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        d = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.qk_head_dim, self.v_head_dim = config.qk_head_dim, config.v_head_dim
        self.q_lora_rank = config.q_lora_rank
        Hq, Dqk, Dv = self.num_heads, self.qk_head_dim, self.v_head_dim
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(d, Hq * Dqk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, self.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(self.q_lora_rank, eps=config.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, Hq * Dqk, bias=False)
        self.kv_a_proj = nn.Linear(d, config.kv_lora_rank, bias=False)
        self.kv_a_norm = RMSNorm(config.kv_lora_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, Hq * (Dqk + Dv), bias=False)
        self.g_proj = nn.Linear(d, Hq * Dv, bias=False)
        self.o_proj = nn.Linear(Hq * Dv, d, bias=False)
        self.scale = Dqk**-0.5

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """[..., Hq, Dqk]"""
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        return q.unflatten(-1, (self.num_heads, self.qk_head_dim))

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Up-projected keys [..., Hq, Dqk] and values [..., Hq, Dv] from the latent c = RMSNorm(W_kva x)."""
        kv = self.kv_b_proj(self.kv_a_norm(self.kv_a_proj(x)))
        kv = kv.unflatten(-1, (self.num_heads, self.qk_head_dim + self.v_head_dim))
        return kv.split([self.qk_head_dim, self.v_head_dim], dim=-1)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q [B, Hq, T, Dqk], k/v [B, Hq, S, D] (S = past + T); mask as from `attention_mask_for`.
        Returns [B, T, Hq, Dv]."""
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale)
        return out.transpose(1, 2)

    def output(self, attn: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """W_o(attn * sigmoid(W_g x)); attn [B, T, Hq, Dv]."""
        return self.o_proj(attn.flatten(-2) * torch.sigmoid(self.g_proj(x)))

    def forward(
        self,
        x: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        """x [B, T, d]; key_mask [B, P+T] over cached and new tokens (1 = real token); `cache` is a
        transformers `Cache` (its `update(k, v, layer_idx)` appends and returns all keys/values).
        Returns y [B, T, d]."""
        q = self.project_q(x).transpose(1, 2)
        k, v = (t.transpose(1, 2) for t in self.project_kv(x))
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        past_len = k.shape[2] - x.shape[1]
        mask = attention_mask_for(x.shape[1], past_len, key_mask, x.device)
        return self.output(self.attend(q, k, v, mask), x)
