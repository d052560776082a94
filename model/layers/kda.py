"""Kimi Delta Attention layer (docs/design.md section 2), on top of `kernels.kda`.

Per head (K = V head dims), state S in R^{K x V}:
  q, k, v = SiLU(causal depthwise conv(W x)); q, k L2-normalised (in the kernel); beta = sigmoid(W_b x)
  g = lb * sigmoid(f + dt_bias), f = W_fb W_fa x                 (bounded gate, default)
  g = -exp(A_log) * softplus(f + dt_bias)                          (unbounded form, for comparison)
  S_t = Diag(e^{g_t}) S_{t-1} + beta_t k_t (v_t - (Diag(e^{g_t}) S_{t-1})^T k_t)^T ;  o_t = S_t^T q_t / sqrt(K)
  out = W_o( RMSNorm(o) * sigmoid(W_gb W_ga x) )

The pieces are methods usable with explicit states, so the vLLM plugin can reuse them:
`project` (pre-conv q/k/v), `short_conv` (conv + SiLU with a conv state), `gate_input`, `beta_logits`,
`core` (chunked or recurrent KDA with a recurrent state), `output` (gated norm + o_proj).
State layouts: conv state [B, 2*H*K + HV*V, conv_size - 1] (q, k, v channels concatenated, the last
inputs in time order, model dtype); recurrent state [B, HV, K, V] fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels.kda import chunk_kda, fused_recurrent_kda
from model.config import TaperConfig
from model.layers.norm import GatedRMSNorm

# Gate input for padded tokens: sigmoid/softplus of it is exactly 0 in fp32 and bf16, so g = 0
# (no decay) and, with the same value as beta logit, beta = 0 (no write): the state passes through.
_MASKED_LOGIT = -1.0e4


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over time, as W shifted multiply-adds in time-major layout (fp32 sums; one fused
    kernel each way under torch.compile, no transposes). x [B, T, C]; weight [C, 1, W]; state [B, C, W-1]
    holds the previous W-1 inputs (None = zeros). Returns (y [B, T, C] fp32, new state [B, C, W-1])."""
    B, T, C = x.shape
    W = weight.shape[-1]
    if state is None:
        full = F.pad(x, (0, 0, W - 1, 0))
    elif state.shape != (B, C, W - 1):
        raise ValueError(f"conv state must be [B={B}, C={C}, W-1={W - 1}], got {tuple(state.shape)}")
    else:
        full = torch.cat([state.to(x.dtype).transpose(1, 2), x], dim=1)
    taps = weight.reshape(C, W).float()
    y = full[:, :T].float() * taps[:, 0]
    for w in range(1, W):
        y = y + full[:, w:w + T].float() * taps[:, w]
    return y, full[:, T:].transpose(1, 2)


def _zero_history_state(x: torch.Tensor, width: int) -> torch.Tensor:
    """The conv state after x [B, T, C] from a zero history: its last width-1 inputs [B, C, width-1] (a view when
    T >= width-1, so a training forward that drops it launches nothing for it)."""
    T = x.shape[1]
    if T >= width - 1:
        return x[:, T - (width - 1):].transpose(1, 2)
    return F.pad(x, (0, 0, width - 1 - T, 0)).transpose(1, 2)


class KimiDeltaAttention(nn.Module):
    # On CUDA without a conv state: the conv + SiLU as one Triton kernel each way (kernels/short_conv.py), the same
    # math as `causal_conv1d`; False: the torch path everywhere (the benchmarks compare the two)
    use_fused_conv = True

    def __init__(self, config: TaperConfig, layer_idx: int | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        d = config.hidden_size
        self.num_heads, self.num_v_heads = config.kda_num_heads, config.kda_num_v_heads
        self.head_dim, self.v_head_dim = config.kda_head_dim, config.kda_v_head_dim
        self.conv_size = config.kda_conv_size
        self.bounded_gate = config.kda_gate == "bounded"
        self.lower_bound = config.gate_lower_bound
        H, HV, K, V = self.num_heads, self.num_v_heads, self.head_dim, self.v_head_dim
        self.key_dim, self.value_dim = H * K, HV * V
        self.q_proj = nn.Linear(d, H * K, bias=False)
        self.k_proj = nn.Linear(d, H * K, bias=False)
        self.v_proj = nn.Linear(d, HV * V, bias=False)
        self.q_conv1d = self._conv(H * K)
        self.k_conv1d = self._conv(H * K)
        self.v_conv1d = self._conv(HV * V)
        self.f_a_proj = nn.Linear(d, K, bias=False)
        self.f_b_proj = nn.Linear(K, HV * K, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(HV * K))
        # Always present (one name for both gate forms), but frozen when the bounded gate ignores it.
        self.A_log = nn.Parameter(torch.zeros(HV))
        self.freeze_unused_parameters()
        self.b_proj = nn.Linear(d, HV, bias=False)
        self.g_a_proj = nn.Linear(d, V, bias=False)
        self.g_b_proj = nn.Linear(V, HV * V, bias=False)
        self.o_norm = GatedRMSNorm(V, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(HV * V, d, bias=False)

    def freeze_unused_parameters(self) -> None:
        """The bounded gate ignores A_log: no gradient, no optimizer state for it. Checkpoint loading creates
        fresh (trainable) parameters, so the model calls this again after loading."""
        self.A_log.requires_grad_(not self.bounded_gate)

    def _conv(self, channels: int) -> nn.Conv1d:
        return nn.Conv1d(channels, channels, self.conv_size, groups=channels, bias=False)

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def conv_weight(self) -> torch.Tensor:
        """The three depthwise conv weights concatenated: [2*H*K + HV*V, 1, W]."""
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], dim=0)

    @torch.no_grad()
    def reset_gate_parameters(self) -> None:
        """Decay rates e^{-dt} with dt log-uniform in [1e-3, 0.1] at f = 0 (as in Mamba/fla)."""
        HV, K = self.num_v_heads, self.head_dim
        dt = torch.exp(torch.empty(HV * K).uniform_(math.log(1e-3), math.log(0.1)))
        if self.bounded_gate:  # lb * sigmoid(dt_bias) = -dt
            p = dt / -self.lower_bound
            self.dt_bias.copy_(torch.log(p) - torch.log1p(-p))
        else:  # softplus(dt_bias) = dt
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.A_log.copy_(torch.log(torch.empty(HV).uniform_(1.0, 16.0)))

    # ---- pure pieces -------------------------------------------------------------------------------
    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-conv q, k, v channels concatenated: [..., 2*H*K + HV*V]."""
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def short_conv(
        self, qkv: torch.Tensor, conv_state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Causal conv + SiLU on [B, T, C] pre-conv channels. Returns (q [B,T,H,K], k, v [B,T,HV,V], state)."""
        B, T = qkv.shape[:2]
        split = [self.key_dim, self.key_dim, self.value_dim]
        if self.use_fused_conv and qkv.is_cuda and conv_state is None and self.conv_size <= 4:
            from kernels.short_conv import short_conv_silu

            q, k, v = short_conv_silu(qkv, self.conv_weight(), split)
            new_state = _zero_history_state(qkv, self.conv_size)
        else:
            y, new_state = causal_conv1d(qkv, self.conv_weight(), conv_state)
            y = F.silu(y).to(qkv.dtype)
            # contiguous here, where a compiled graph writes them straight from the conv (the kernels need them so)
            q, k, v = (t.contiguous() for t in y.split(split, dim=-1))
        return (q.view(B, T, self.num_heads, self.head_dim), k.view(B, T, self.num_heads, self.head_dim),
                v.view(B, T, self.num_v_heads, self.v_head_dim), new_state)

    def input_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Everything the layer reads from x in one GEMM: (pre-conv q|k|v, gate input f [..., HV, K], beta
        logits [..., HV], W_ga x [..., V]); the same values as `project`, `gate_input`, `beta_logits`."""
        # beta's few rows stay a GEMM of their own: an output width that is a multiple of 64 (2560 at `small`)
        # keeps cuBLAS on its Hopper kernels for the weight gradient (2566 fell back to an sm80 kernel, 4x slower)
        weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight, self.f_a_proj.weight,
                            self.g_a_proj.weight])
        qkv, f_low, g_low = F.linear(x, weight).split([self.conv_channels, self.head_dim, self.v_head_dim], dim=-1)
        f = self.f_b_proj(f_low).unflatten(-1, (self.num_v_heads, self.head_dim))
        return qkv, f, self.b_proj(x), g_low

    def gate_input(self, x: torch.Tensor) -> torch.Tensor:
        """Raw forget-gate input f = W_fb W_fa x: [..., HV, K] (the kernel adds dt_bias and applies the gate)."""
        f = self.f_b_proj(self.f_a_proj(x))
        return f.unflatten(-1, (self.num_v_heads, self.head_dim))

    def beta_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[..., HV]; beta = sigmoid of it (in the kernel)."""
        return self.b_proj(x)

    def gate_kwargs(self) -> dict:
        """The gate arguments of kernels.kda.chunk_kda / fused_recurrent_kda for this layer."""
        if self.bounded_gate:
            return dict(use_gate_in_kernel=True, lower_bound=self.lower_bound, A_log=None, dt_bias=self.dt_bias)
        return dict(use_gate_in_kernel=True, lower_bound=None, A_log=self.A_log, dt_bias=self.dt_bias)

    def core(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        f: torch.Tensor,
        beta_logits: torch.Tensor,
        recurrent_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        recurrent: bool = False,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The delta-rule recurrence: chunked (training/prefill) or token-by-token (`recurrent`, no autograd).
        Returns (o [B, T, HV, V], final state [N, HV, K, V] fp32 or None)."""
        kernel = fused_recurrent_kda if recurrent else chunk_kda
        extra = dict(inplace_final_state=False) if recurrent else {}
        return kernel(
            q, k, v, f, beta_logits, scale=self.head_dim**-0.5, initial_state=recurrent_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            cu_seqlens=cu_seqlens, **self.gate_kwargs(), **extra,
        )

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """W_o(RMSNorm(o) * sigmoid(W_gb W_ga x)); o [B, T, HV, V], x [B, T, d]."""
        return self.gated_output(o, self.g_a_proj(x))

    def gated_output(self, o: torch.Tensor, g_low: torch.Tensor) -> torch.Tensor:
        """`output` from W_ga x [..., V] already computed."""
        gate = self.g_b_proj(g_low).unflatten(-1, (self.num_v_heads, self.v_head_dim))
        return self.o_proj(self.o_norm(o, gate).flatten(-2))

    # ---- whole layer -------------------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        conv_state: torch.Tensor | None = None,
        recurrent_state: torch.Tensor | None = None,
        output_states: bool = False,
        token_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """x [B, T, d]; token_mask [B, T] (1 = real token, 0 = padding: it neither writes nor decays the state).
        Returns (y [B, T, d], conv state, recurrent state); the states only when `output_states`."""
        qkv, f, beta, g_low = self.input_projections(x)
        if token_mask is not None:
            keep = token_mask.to(torch.bool)
            qkv = qkv * keep.unsqueeze(-1).to(qkv.dtype)
            f = f.masked_fill(~keep[..., None, None], _MASKED_LOGIT)
            beta = beta.masked_fill(~keep[..., None], _MASKED_LOGIT)
        q, k, v, new_conv_state = self.short_conv(qkv, conv_state)
        recurrent = x.shape[1] == 1 and recurrent_state is not None and not torch.is_grad_enabled()
        o, new_state = self.core(q, k, v, f, beta, recurrent_state, output_final_state=output_states,
                                 recurrent=recurrent)
        y = self.gated_output(o, g_low)
        if not output_states:
            return y, None, None
        return y, new_conv_state, new_state
