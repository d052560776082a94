"""KDA token mixing over per-request state slots, as a serving engine runs it: the functions the vLLM KDA
layer calls, importable without vLLM (the GPU machine tests them directly against the HF layer).

A step's tokens are the requests' new tokens back to back, decodes (one token each) first. Each request
owns one slot of two pools: the conv state `[slots, C, W-1]` (the last W-1 pre-conv inputs of the
concatenated q|k|v channels, oldest first, as `KimiDeltaAttention.short_conv` keeps it) and the recurrent
state `[slots, HV, K, V]` (fp32). Prefill runs `chunk_kda` over the variable-length prompts, continuing
from a request's slot where it already has state (e.g. the second chunk of a chunked prefill), after the
conv (on CPU with an fp32 conv pool, one compiled pass); decode runs `fused_recurrent_kda` on the slots in
place (on CPU with fp32 pools, the conv and the recurrence as one compiled call). The math itself (projections, conv, gate, output) is the HF layer's, with its
parameters; the projections that read x run as one concatenated matmul and the decode conv as a
multiply-sum (a decode step is dominated by the count of small ops).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kernels.kda import chunk_kda, fused_recurrent_kda
from kernels.kda.recurrent_cpu import (
    conv_recurrent_kda_decode_cpu,
    conv_silu_prefill_cpu,
    gated_rms_norm_cpu,
    slots_contiguous,
)
from kernels.short_conv import short_conv_silu_decode
from model.layers.kda import KimiDeltaAttention
from model.vllm_plugin.fused import FusedLinear, derived_arrays, derived_linear, fused, linear


@dataclass(frozen=True)
class KDABatch:
    """Where each request's tokens and state slot are in one forward step (decodes first).

    query_start_loc: [n+1] token offsets of the n requests; state_indices: [n] state slot per request;
    has_initial_state: [n] bool, True where a prefill continues from its slot (None: every request
    continues); num_decodes: the first num_decodes requests are one-token decodes (they always continue);
    num_tokens: the step's token count (query_start_loc[-1]) where the caller knows it, so that no step reads
    it from the device (a CUDA graph cannot).
    """

    num_decodes: int
    query_start_loc: torch.Tensor
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor | None
    num_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.num_tokens is None:
            object.__setattr__(self, "num_tokens", int(self.query_start_loc[-1]))

    @property
    def num_requests(self) -> int:
        return int(self.state_indices.numel())

    # computed once per batch: every KDA layer of a step reads them (each read a tensor op or a copy)
    @functools.cached_property
    def slots(self) -> torch.Tensor:
        """state_indices as contiguous int64, as the compiled CPU loops take them."""
        return self.state_indices.to(torch.int64).contiguous()

    def validate(self) -> None:
        n = self.num_requests
        if self.query_start_loc.dim() != 1 or self.query_start_loc.numel() != n + 1:
            raise ValueError(f"query_start_loc must be [n+1]={n + 1} offsets, got {tuple(self.query_start_loc.shape)}")
        if self.has_initial_state is not None and self.has_initial_state.numel() != n:
            raise ValueError(f"has_initial_state must have n={n} entries, got {self.has_initial_state.numel()}")
        if not 0 <= self.num_decodes <= n:
            raise ValueError(f"num_decodes must lie in [0, {n}], got {self.num_decodes}")
        if self.num_decodes and int(self.query_start_loc[self.num_decodes]) != self.num_decodes:
            raise ValueError("the first num_decodes requests must have exactly one token each")


def conv_state_shape(layer: KimiDeltaAttention) -> tuple[int, int]:
    """(C, W-1): one slot of the conv-state pool in this module's layout."""
    return (layer.conv_channels, layer.conv_size - 1)


def recurrent_state_shape(layer: KimiDeltaAttention) -> tuple[int, int, int]:
    return (layer.num_v_heads, layer.head_dim, layer.v_head_dim)


def _kernel_kwargs(layer: KimiDeltaAttention) -> dict:
    """The layer's kernel arguments, as `KimiDeltaAttention.core` passes them."""
    return dict(scale=layer.head_dim**-0.5, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                **layer.gate_kwargs())


def _decode_conv(
    layer: KimiDeltaAttention, qkv: torch.Tensor, conv_state: torch.Tensor, idx: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`layer.short_conv` for one new token per request, the slots' conv states advanced in place:
    qkv [n, C] -> q, k [n, 1, H, K], v [n, 1, HV, V]. A multiply-sum over the W taps, time-major
    ([n, W, C]: the reduction and the concatenation run over whole rows of C channels); a depthwise
    conv1d call, or the same sum over a last dim of W, costs several times more on CPU at these sizes."""
    pool = conv_state.transpose(-1, -2)  # [slots, W-1, C]: vLLM's own layout on CPU
    window = torch.cat([pool.index_select(0, idx).to(qkv.dtype), qkv.unsqueeze(1)], dim=1)  # [n, W, C]
    pool.index_copy_(0, idx, window[:, 1:].to(pool.dtype))
    return _split_heads(layer, F.silu((window * layer.conv_weight().to(qkv.dtype).squeeze(1).t()).sum(1)))


def _split_heads(layer: KimiDeltaAttention, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv's output for one token per request [n, C] -> q, k [n, 1, H, K], v [n, 1, HV, V]."""
    n = y.shape[0]
    q, k, v = y.split([layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    return (q.view(n, 1, layer.num_heads, layer.head_dim), k.view(n, 1, layer.num_heads, layer.head_dim),
            v.view(n, 1, layer.num_v_heads, layer.v_head_dim))


def _decode(
    layer: KimiDeltaAttention, qkv: torch.Tensor, f: torch.Tensor, beta: torch.Tensor,
    conv_state: torch.Tensor, recurrent_state: torch.Tensor, slots: torch.Tensor,
) -> torch.Tensor:
    """One token for each of n requests: qkv [n, C], f [n, HV, K], beta [n, HV] (logits) -> o [n, HV, V]
    (fp32 on the CPU's compiled path, else qkv's dtype)."""
    if (qkv.device.type == "cpu" and conv_state.dtype == recurrent_state.dtype == torch.float32
            and conv_state.stride(-2) == 1 and slots_contiguous(recurrent_state)):
        dt_bias, a_log = derived_arrays(layer, "decode_gate", lambda: (layer.dt_bias, layer.A_log),
                                        lambda *params: params)()
        return conv_recurrent_kda_decode_cpu(
            qkv, _conv_weight_rows(layer), conv_state.transpose(-1, -2), f, beta, num_heads=layer.num_heads,
            scale=layer.head_dim**-0.5, lower_bound=layer.gate_kwargs()["lower_bound"], A_log=a_log,
            dt_bias=dt_bias, slots=slots, pool=recurrent_state,
        )  # fp32, as the output norm's compiled pass reads it
    if qkv.is_cuda:  # padded rows (slot < 0, in a CUDA graph's batch) leave every slot alone
        y = short_conv_silu_decode(qkv, layer.conv_weight(), conv_state, slots)
        q, k, v = _split_heads(layer, y)
    else:
        q, k, v = _decode_conv(layer, qkv, conv_state, slots.long())
    # Batch rows are the sequences (T = 1); the pool's slots are read and written in place.
    o, _ = fused_recurrent_kda(
        q, k, v, f[:, None], beta[:, None], initial_state=recurrent_state, ssm_state_indices=slots,
        inplace_final_state=True, **_kernel_kwargs(layer),
    )
    return o[:, 0]


def _conv_weight_rows(layer: KimiDeltaAttention) -> np.ndarray:
    """The q|k|v conv weights as one fp32 [W, C] array (tap W-1 the newest), cached until a weight changes."""
    return derived_arrays(layer, "conv_rows", lambda: (layer.q_conv1d.weight, layer.k_conv1d.weight,
                                                       layer.v_conv1d.weight),
                          lambda *_: (layer.conv_weight().squeeze(1).t(),))()[0]


def _prefill_conv(
    layer: KimiDeltaAttention, qkv: torch.Tensor, conv_init: torch.Tensor, query_start_loc: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`layer.short_conv` over back-to-back sequences in one depthwise conv pass: qkv [T, C], conv_init
    [n, C, W-1] -> q, k [T, H, K], v [T, HV, V] (fp32 on CPU, where the KDA kernel computes in fp32 anyway;
    qkv's dtype on GPUs) and the new conv states [n, C, W-1]. The rows are laid out as each sequence's W-1
    initial inputs followed by its tokens; the conv's outputs at windows that cross from one sequence into
    the next are dropped. One pass for the whole step instead of one per sequence, whose fixed cost
    dominated CPU steps that continue many short turns."""
    T, C = qkv.shape
    n, W1 = conv_init.shape[0], conv_init.shape[-1]
    device = qkv.device
    lengths = query_start_loc[1:] - query_start_loc[:-1]
    seq = torch.arange(n, device=device)
    # each sequence's rows in the extended layout start at its token offset plus W-1 per earlier sequence
    ext_start = query_start_loc[:-1].long() + seq * W1
    init_rows = (ext_start[:, None] + torch.arange(W1, device=device)).flatten()
    token_rows = torch.arange(T, device=device) + torch.repeat_interleave((seq + 1) * W1, lengths, output_size=T)
    ext = qkv.new_empty(T + n * W1, C)
    ext.index_copy_(0, init_rows, conv_init.transpose(1, 2).reshape(n * W1, C).to(qkv.dtype))
    ext.index_copy_(0, token_rows, qkv)
    # The depthwise conv as W shifted multiply-adds over time-major rows, accumulated in fp32: conv1d
    # wants channel-major input, and its two transposes cost several times the conv (measured 55 vs 10 ms
    # at 4K x 768 channels, fp32 on an AVX2 CPU). Row r of y is the window ending at row r + W-1.
    weight = layer.conv_weight().squeeze(1).t().float()  # [W, C]
    rows = ext.shape[0] - W1
    y = ext[:rows] * weight[0]
    for tap in range(1, W1 + 1):
        y.addcmul_(ext[tap:tap + rows], weight[tap])
    y = F.silu(y.index_select(0, token_rows - W1))
    if qkv.is_cuda:
        y = y.to(qkv.dtype)
    last_rows = (ext_start + lengths)[:, None] + torch.arange(W1, device=device)  # each sequence's last W-1
    new_conv = ext[last_rows].transpose(1, 2)
    q, k, v = y.split([layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    return (q.view(T, layer.num_heads, layer.head_dim), k.view(T, layer.num_heads, layer.head_dim),
            v.view(T, layer.num_v_heads, layer.v_head_dim), new_conv)


def _prefill(
    layer: KimiDeltaAttention, qkv: torch.Tensor, f: torch.Tensor, beta: torch.Tensor,
    conv_state: torch.Tensor, recurrent_state: torch.Tensor, query_start_loc: torch.Tensor,
    slots: torch.Tensor, has_initial_state: torch.Tensor | None,
) -> torch.Tensor:
    """Back-to-back prompts (chunks): qkv [T, C] ... -> o [T, HV, V]; slots updated with the final states."""
    idx = slots.long()
    keep = None if has_initial_state is None else has_initial_state.to(torch.bool)
    rec_init = recurrent_state.index_select(0, idx).float()
    if keep is not None:
        rec_init = rec_init * keep[:, None, None, None].to(rec_init.dtype)
    if qkv.device.type == "cpu" and conv_state.dtype == torch.float32:
        # one compiled pass, the pool advanced in place: the torch form's passes over [T, C] (the row
        # layout, four multiply-adds, SiLU, the gather of token rows, q/k/v copies) cost about as much as
        # the recurrence itself on a CPU with AMX (NOTES, session 16)
        T = qkv.shape[0]
        q, k, v = conv_silu_prefill_cpu(qkv, _conv_weight_rows(layer), conv_state.transpose(-1, -2),
                                        query_start_loc, slots, has_initial_state, layer.key_dim)
        q, k = q.view(T, layer.num_heads, layer.head_dim), k.view(T, layer.num_heads, layer.head_dim)
        v = v.view(T, layer.num_v_heads, layer.v_head_dim)
    else:
        conv_init = conv_state.index_select(0, idx)
        if keep is not None:
            conv_init = conv_init * keep[:, None, None].to(conv_init.dtype)
        q, k, v, new_conv = _prefill_conv(layer, qkv, conv_init, query_start_loc)
        conv_state.index_copy_(0, idx, new_conv.to(conv_state.dtype))
    o, final = chunk_kda(
        q[None], k[None], v[None], f[None], beta[None],
        initial_state=rec_init, output_final_state=True, cu_seqlens=query_start_loc, **_kernel_kwargs(layer),
    )
    recurrent_state.index_copy_(0, idx, final.to(recurrent_state.dtype))
    return o[0]


def kda_forward_with_state(
    layer: KimiDeltaAttention,
    x: torch.Tensor,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    batch: KDABatch,
) -> torch.Tensor:
    """The KDA token mixer for one engine step: x [T', d] (T' >= batch.num_tokens; rows past the batch's
    tokens are padding and get zeros). conv_state [slots, C, W-1] and recurrent_state [slots, HV, K, V]
    are pools updated in place at the batch's slots. Returns y [T', d]."""
    T = batch.num_tokens
    assert T is not None
    if T == 0:
        return x.new_zeros(x.shape)
    xs = x if T == x.shape[0] else x[:T]
    qkv, beta, low = _input_projection(layer)(xs)
    f, gate = _gate_projections(layer, low)  # f = layer.gate_input(xs); gate = W_gb W_ga xs, as layer.output uses it
    nd = batch.num_decodes
    if nd == batch.num_requests:  # decode-only step
        o = _decode(layer, qkv, f, beta, conv_state, recurrent_state, batch.slots)
    elif nd == 0:  # prefill-only step: the kernel's output as it is (a copy of it cost ~5% of a 16K prefill)
        o = _prefill(layer, qkv, f, beta, conv_state, recurrent_state, batch.query_start_loc,
                     batch.state_indices, batch.has_initial_state)
    else:
        # every row is written below; fp32 on CPU, where the output norm's compiled pass reads it
        o = qkv.new_empty(T, layer.num_v_heads, layer.v_head_dim, dtype=torch.float32 if qkv.device.type == "cpu"
                          else qkv.dtype)
        o[:nd] = _decode(layer, qkv[:nd], f[:nd], beta[:nd], conv_state, recurrent_state, batch.state_indices[:nd])
        t0 = nd  # decodes hold one token each
        qsl = batch.query_start_loc[nd:] - t0
        has_init = None if batch.has_initial_state is None else batch.has_initial_state[nd:]
        o[t0:] = _prefill(layer, qkv[t0:], f[t0:], beta[t0:], conv_state, recurrent_state, qsl,
                          batch.state_indices[nd:], has_init)
    # = layer.output(o, xs)
    if o.device.type == "cpu" and o.dtype == torch.float32:
        (norm_weight,) = derived_arrays(layer, "o_norm", lambda: (layer.o_norm.weight,), lambda *params: params)()
        normed = gated_rms_norm_cpu(o, gate, norm_weight, layer.o_norm.eps)
    else:
        normed = layer.o_norm(o, gate.unflatten(-1, (layer.num_v_heads, layer.v_head_dim))).flatten(-2)
    out = linear(layer.o_proj, normed)
    if T == x.shape[0]:
        return out
    y = x.new_zeros(x.shape)
    y[:T] = out
    return y


def _input_projection(layer: KimiDeltaAttention) -> FusedLinear:
    """Everything the layer computes from x in one matmul: (q|k|v pre-conv = `layer.project`,
    beta logits = `layer.beta_logits`, W_fa x | W_ga x)."""
    return fused(layer, "input", lambda: (layer.q_proj, layer.k_proj, layer.v_proj, layer.b_proj,
                                          layer.f_a_proj, layer.g_a_proj), groups=(3, 1, 2))


# Up to this many tokens on CPU, the gate's and the output gate's up-projections run as one matmul with their
# weights block-diagonal: half its products are zeros, which at a decode step's few rows cost less than a
# second matmul call.
GATE_PROJECTIONS_FUSED_MAX_TOKENS = 64


def _gate_projections(layer: KimiDeltaAttention, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The low-rank gates' up-projections from low = [W_fa x | W_ga x] [T, K + V]: f = W_fb W_fa x
    [T, HV, K] and the output gate W_gb W_ga x [T, HV*V]."""
    HV, K, V = layer.num_v_heads, layer.head_dim, layer.v_head_dim
    if low.device.type == "cpu" and low.shape[0] <= GATE_PROJECTIONS_FUSED_MAX_TOKENS:
        both = derived_linear(layer, "gate_projections", lambda: (layer.f_b_proj.weight, layer.g_b_proj.weight),
                              torch.block_diag)(low)
        f, gate = both.split([HV * K, HV * V], dim=-1)
    else:
        f_low, gate_low = low.split([layer.f_a_proj.out_features, layer.g_a_proj.out_features], dim=-1)
        f, gate = linear(layer.f_b_proj, f_low), linear(layer.g_b_proj, gate_low)
    return f.unflatten(-1, (HV, K)), gate
