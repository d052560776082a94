"""The token mixers as vLLM layers. Each subclasses the HF layer (so parameters, names and math are the HF
model's) and adds what serving needs: KDA keeps its states in vLLM's hybrid (mamba-style) state cache and
reads the gated-delta-net backend's per-request metadata; MLA is vLLM `Attention` over the cached latent
on CPU and over the up-projected keys/values elsewhere (NoPE). The layers that work token by token are in
`per_token`."""

from __future__ import annotations

import dataclasses
import inspect

import torch
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.attention import unified_kv_cache_update
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    is_conv_state_dim_first,
)
from vllm.platforms import current_platform
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from kernels.mla_decode_cpu import latent_decode_attention
from kernels.prefill_attention_cpu import amx_available, chunk_attention, prefill_attention
from model.config import TaperConfig
from model.layers.kda import KimiDeltaAttention
from model.layers.mla import GatedMLA
from model.vllm_plugin.fused import derived_arrays, fused, linear
from model.vllm_plugin.kda_metadata import KDAAttentionBackend
from model.vllm_plugin.kda_ops import (
    KDABatch,
    conv_state_shape,
    kda_forward_with_state,
    recurrent_state_shape,
)


def oriented_conv_state_shape(channels_first: tuple[int, int]) -> tuple[int, int]:
    """vLLM stores a conv-state slot as (C, W-1) or (W-1, C), as its platform layout says."""
    return channels_first if is_conv_state_dim_first() else (channels_first[1], channels_first[0])


def kda_state_shapes(config: TaperConfig) -> tuple[tuple[int, int], tuple[int, int, int]]:
    C = 2 * config.kda_num_heads * config.kda_head_dim + config.kda_num_v_heads * config.kda_v_head_dim
    conv = oriented_conv_state_shape((C, config.kda_conv_size - 1))
    return conv, (config.kda_num_v_heads, config.kda_head_dim, config.kda_v_head_dim)


def kda_state_dtypes(vllm_config: VllmConfig) -> tuple[torch.dtype, torch.dtype]:
    """(conv state, recurrent state): fp32 recurrent state unless configured otherwise; the conv state in
    the model dtype, but fp32 on CPU unless configured, where the compiled decode step reads and advances
    it in place (C x (W-1) values a slot: small beside the recurrent state)."""
    cache = vllm_config.cache_config
    calculator = MambaStateDtypeCalculator.kda_state_dtype
    if len(inspect.signature(calculator).parameters) >= 3:  # vLLM 0.32: the recurrent state's dtype configurable
        conv, recurrent = calculator(vllm_config.model_config.dtype, cache.mamba_cache_dtype,
                                     cache.mamba_ssm_cache_dtype)
    else:  # vLLM 0.26: always fp32
        conv, recurrent = calculator(vllm_config.model_config.dtype, cache.mamba_cache_dtype)
    if current_platform.is_cpu() and vllm_config.cache_config.mamba_cache_dtype == "auto":
        conv = torch.float32
    return conv, recurrent


class VllmKimiDeltaAttention(KimiDeltaAttention, MambaBase):
    """KDA with per-request conv + recurrent states in vLLM's state cache (GDN_ATTN metadata)."""

    def __init__(self, config: TaperConfig, layer_idx: int, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__(config, layer_idx)
        if vllm_config.speculative_config is not None:
            raise ValueError("speculative_config: speculative decoding is not supported by the Taper KDA layer")
        if vllm_config.parallel_config.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size: the Taper vLLM model runs with tensor_parallel_size=1")
        self.prefix = prefix
        self._state_dtypes = kda_state_dtypes(vllm_config)
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate layer name {prefix}")
        context[prefix] = self  # how vLLM finds its mamba-style layers and binds their cache

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.GDN_ATTN

    def get_attn_backend(self) -> type[KDAAttentionBackend]:
        return KDAAttentionBackend

    def get_state_shape(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        return oriented_conv_state_shape(conv_state_shape(self)), recurrent_state_shape(self)

    def get_state_dtype(self) -> tuple[torch.dtype, torch.dtype]:
        return self._state_dtypes

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """x [T, d] -> [T, d] for the step's tokens."""
        metadata = get_forward_context().attn_metadata
        meta = None if metadata is None else metadata.get(self.prefix)
        if meta is None:  # profiling / dummy run: no state slots
            return torch.zeros_like(x)
        assert isinstance(meta, GDNAttentionMetadata)
        batch = meta.__dict__.get("_taper_kda_batch")
        if batch is None:  # once per step: the KDA layers share their metadata
            n = meta.num_decodes + meta.num_prefills
            batch = meta.__dict__["_taper_kda_batch"] = KDABatch(
                num_decodes=meta.num_decodes,
                num_tokens=meta.num_actual_tokens,  # padded in a full CUDA graph's decode step, as x is
                query_start_loc=meta.non_spec_query_start_loc[: n + 1],
                state_indices=meta.non_spec_state_indices_tensor[:n],
                has_initial_state=None if meta.has_initial_state is None else meta.has_initial_state[:n],
            )
        conv_state, recurrent_state = self.kv_cache
        if not is_conv_state_dim_first():
            conv_state = conv_state.transpose(-1, -2)  # a (C, W-1) view of each slot
        return kda_forward_with_state(self, x, conv_state, recurrent_state, batch)


def absorbed_queries(q: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q [T, H, Dqk], W_uk [H, Dqk, r] -> q' [T, H, r] with q'_h = W_uk,h^T q_h (so q'_h . c = q_h . W_uk,h c)."""
    return torch.bmm(q.transpose(0, 1), w_uk).transpose(0, 1)


def expanded_values(mixed: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Mixed latents [T, H, r], W_uv [H, Dv, r] -> per-head values [T, H, Dv] (W_uv,h applied to head h)."""
    return torch.bmm(mixed.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def cached_latents(kv_cache: torch.Tensor, pages: torch.Tensor, length: int, isa: str) -> torch.Tensor:
    """The first `length` latents of a request from a latent-cache layer's pages: kv_cache
    [blocks, 1, block, 2r] as vLLM's CPU backend holds it (per page: keys, packed for its kernel, then
    values; keys and values are the same latents, so the values are read), pages [n] its page ids in
    order, `isa` the backend's kernel kind for the layer. Values are stored row by row, except for the
    AMX kernel (bf16 caches on CPUs with AMX), which packs them for its tile loads: 16-column strips, each
    holding the rows in pairs with the two rows' elements interleaved. Returns [length, r]."""
    blocks, _, block, _ = kv_cache.shape
    values = kv_cache.view(blocks, 2 * block, -1)[:, block:].index_select(0, pages.long())  # [n, block, r]
    r = values.shape[-1]
    if isa == "amx":
        values = values.reshape(-1, r // 16, block // 2, 16, 2).permute(0, 2, 4, 1, 3)
    return values.reshape(-1, r)[:length]


# Up to this many latents in a step's longest sequence, MLA decodes use `latent_decode_attention` even where vLLM's
# AMX kernel serves the layer: per MLA layer of a decode step (8 sequences, bf16, one Xeon core, in an engine),
# ours against vLLM's took 0.82 against 1.10 ms at 512 latents, 2.46 against 1.29 at 2,048 and 3.77 against 2.12
# at 4,096; where the two lines cross (~800) is interpolated.
OUR_KERNEL_MAX_LATENTS = 768


def vllm_kernel_decodes_latents(isa: str, longest: int) -> bool:
    """Whether MLA decode steps over the latent cache use vLLM's CPU attention kernel rather than
    `latent_decode_attention`, by the kernel kind vLLM chose for the layer and the step's longest sequence
    (`longest` latents). On AMX CPUs (bf16 caches) vLLM's AMX kernel is the faster but for short sequences
    (`OUR_KERNEL_MAX_LATENTS`): 8.0 against 11.8 ms for 8 sequences of 16K latents on a Xeon. Elsewhere ours,
    which reads each latent once where vLLM's kernel reads a key copy and a value copy: 13.3 against 20.9 ms on
    that Xeon in fp32, 12.9 against 25.0 ms in bf16 on an AVX2 CPU (the git history of benchmarks/NOTES.md)."""
    return isa == "amx" and longest > OUR_KERNEL_MAX_LATENTS


def tiles_attend_prefills(isa: str, dtype: torch.dtype) -> bool:
    """Whether MLA prefill attention runs in `prefill_attention` (AMX tiles) rather than torch's CPU flash
    kernel (`chunk_attention`): where vLLM chose its AMX kernel for the layer (a bf16 cache on an AMX CPU), the
    layer computes in bf16 (`dtype`; fp32 compute can be asked for) and our kernel's build has AMX. A 4K chunk
    at 16K tokens, 8 heads of 32, one Xeon core: 168-181 against 448-483 ms (the git history of benchmarks/NOTES.md)."""
    return isa == "amx" and dtype == torch.bfloat16 and amx_available()


def latent_cache_supported(config: TaperConfig, vllm_config: VllmConfig) -> bool:
    """Whether MLA layers cache the latent (vLLM's CPU attention backend, a latent width it supports)."""
    if not current_platform.is_cpu() or vllm_config.cache_config.cache_dtype != "auto":
        return False
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return config.kv_lora_rank in CPUAttentionBackend.get_supported_head_sizes()


class VllmGatedMLA(GatedMLA):
    """Gated MLA in vLLM, in one of two cache layouts (same math either way).

    Latent (vLLM's CPU backend): the cache holds the normalised latent c = RMSNorm(W_kva x) as one shared
    key/value head of width r = kv_lora_rank, half the bytes of up-projected keys/values at the benchmark
    sizes. Decode tokens attend with absorbed queries, q'_h = W_uk,h^T q_h, so that
    q_h . k_h,t = q'_h . c_t, and up-project the mixed latent, o_h = W_uv,h sum_t p_h,t c_t: multi-query
    attention in vLLM's kernel, which reads each cached latent once for all heads (1.4-1.6x faster than
    per-head keys at 16K, batch 8, on an AVX2 CPU). Prefill tokens, where that form costs H r / (Dqk + Dv) times the
    FLOPs, read their request's latents back from the cache, up-project them and run standard attention.

    Up-projected (elsewhere): ordinary multi-head vLLM `Attention` over the up-projected keys/values."""

    def __init__(self, config: TaperConfig, layer_idx: int, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__(config, layer_idx)
        self.cache_dtype = vllm_config.model_config.dtype  # the model dtype: vLLM's attention runs in it
        self.latent_cache = latent_cache_supported(config, vllm_config)
        r = config.kv_lora_rank
        self.attn = Attention(
            num_heads=self.num_heads,
            head_size=r if self.latent_cache else self.qk_head_dim,
            scale=self.scale,
            num_kv_heads=1 if self.latent_cache else self.num_heads,
            cache_config=vllm_config.cache_config,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.attn",
            head_size_v=r if self.latent_cache else self.v_head_dim,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """x [T, d] -> [T, d]: `project_q`, `project_kv` and `output` with the three projections of x
        (queries, the latent's down-projection, the output gate) as one matmul."""
        q, c, gate = fused(self, "input", lambda: (
            self.q_proj if self.q_lora_rank is None else self.q_a_proj, self.kv_a_proj, self.g_proj))(x)
        if self.q_lora_rank is not None:
            q = linear(self.q_b_proj, self.q_a_norm(q))
        if self.latent_cache:
            attn = self._latent_attention(q, self.kv_a_norm(c)).to(x.dtype)
        else:
            kv = linear(self.kv_b_proj, self.kv_a_norm(c))
            kv = kv.unflatten(-1, (self.num_heads, self.qk_head_dim + self.v_head_dim))
            k, v = (t.flatten(-2) for t in kv.split([self.qk_head_dim, self.v_head_dim], dim=-1))
            attn = self.attn(*(t.to(self.cache_dtype) for t in (q, k, v))).to(x.dtype)
        return linear(self.o_proj, attn * torch.sigmoid(gate))

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_uk [H, Dqk, r] and W_uv [H, Dv, r], views of kv_b_proj's weight."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_head_dim + self.v_head_dim, -1)
        return w[:, : self.qk_head_dim], w[:, self.qk_head_dim:]

    def _latent_attention(self, q: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """q [T, H*Dqk], c [T, r] (normalised latents) -> attention output [T, H*Dv] in q's dtype."""
        T, H = q.shape[0], self.num_heads
        meta = get_forward_context().attn_metadata
        meta = None if meta is None else meta.get(self.attn.layer_name)
        cache_c = c.to(self.cache_dtype)
        if meta is None:  # a dummy run (no cache yet): vLLM's kernel
            w_uk, w_uv = self._up_weights()
            q_abs = absorbed_queries(q.view(T, H, self.qk_head_dim), w_uk).to(self.cache_dtype)
            mixed = self.attn(q_abs, cache_c, cache_c).view(T, H, -1)  # [T, H*r]: one shared head of width r
            return expanded_values(mixed.to(q.dtype), w_uv).reshape(T, -1)
        unified_kv_cache_update(cache_c.unsqueeze(1), cache_c.unsqueeze(1), self.attn.layer_name)
        if meta.max_query_len > 1:  # a step with prefill tokens
            return self._latent_attention_mixed(q, c, meta)
        return self._latent_decode(q, meta, T).reshape(T, -1)

    def _latent_decode(self, q: torch.Tensor, meta, n: int) -> torch.Tensor:
        """The first n requests, one token each (q [>= n, H*Dqk]), over their cached latents: absorbed
        queries in vLLM's kernel or `latent_decode_attention` (`vllm_kernel_decodes_latents`), then the values'
        up-projection. Returns [n, H, Dv]."""
        w_uk, w_uv = self._up_weights_fp32()
        q_abs = absorbed_queries(q[:n].view(n, self.num_heads, self.qk_head_dim).float(), w_uk)
        if vllm_kernel_decodes_latents(self.attn.isa, meta.max_seq_len):
            mixed = self._vllm_latent_decode(q_abs.to(self.cache_dtype), meta, n)
        else:
            mixed = latent_decode_attention(q_abs.to(q.dtype), self.attn.kv_cache, meta.block_table,
                                            meta.seq_lens[:n], self.scale, packed=self.attn.isa == "amx")
        return expanded_values(mixed.float(), w_uv).to(q.dtype)

    def _up_weights_fp32(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`_up_weights` in fp32 for the decode's two batched matmuls, W_uv laid out as the values' matmul reads
        it ([H, r, Dv] contiguous), cached until kv_b_proj's weight changes. In bf16 torch's CPU bmm takes a
        slow path at decode sizes: 53 and 76 us against ~20 in fp32 (8 heads, 8 tokens, one Xeon core)."""
        H, Dqk = self.num_heads, self.qk_head_dim

        def build(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            w = weight.view(H, Dqk + self.v_head_dim, -1)
            return w[:, :Dqk], w[:, Dqk:].transpose(1, 2)

        w_uk, w_uv_t = derived_arrays(self, "up_weights_fp32", lambda: (self.kv_b_proj.weight,), build).tensors()
        return w_uk, w_uv_t.transpose(1, 2)

    def _vllm_latent_decode(self, q_abs: torch.Tensor, meta, n: int) -> torch.Tensor:
        """vLLM's CPU kernel for the first n requests (one token each), the latents as one shared head of
        width r: q_abs [n, H, r] in the cache dtype -> [n, H, r]."""
        from vllm import _custom_ops as ops

        impl = self.attn.impl
        if n < meta.seq_lens.shape[0]:  # a step with prefills too: metadata of the decodes alone
            seq_lens = meta.seq_lens[:n]
            meta = dataclasses.replace(
                meta, num_actual_tokens=n, max_query_len=1, query_start_loc=meta.query_start_loc[: n + 1],
                max_seq_len=int(seq_lens.max()), seq_lens=seq_lens, block_table=meta.block_table[:n],
                slot_mapping=meta.slot_mapping[:n],
            )
            meta.scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=n, num_heads=self.num_heads, num_kv_heads=1, head_dim=q_abs.shape[-1], seq_lens=seq_lens,
                dtype=self.cache_dtype, query_start_loc=meta.query_start_loc, causal=meta.causal,
                sliding_window_size=-1, isa=self.attn.isa, enable_kv_split=False, dynamic_causal=None,
                kv_cache_dtype=impl.kv_cache_dtype,
            )
        mixed = torch.empty(q_abs.shape, dtype=q_abs.dtype)  # contiguous: q_abs is a transposed view
        impl.forward(self.attn, q_abs, None, None, self.attn.kv_cache, meta, output=mixed)
        return mixed

    def _latent_attention_mixed(self, q: torch.Tensor, c: torch.Tensor, meta) -> torch.Tensor:
        """A step with prefill tokens, its latents cached: the leading one-token requests (decodes) attend as
        in `_latent_decode`, every other request runs standard attention over its up-projected cached
        latents (its own new ones included)."""
        T, H = q.shape[0], self.num_heads
        kv_cache = self.attn.kv_cache
        block = kv_cache.shape[2]
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        n = len(seq_lens)
        nd = 0
        while nd < n and starts[nd + 1] - starts[nd] == 1:
            nd += 1
        out = q.new_zeros(T, H, self.v_head_dim)
        attend = prefill_attention if tiles_attend_prefills(self.attn.isa, q.dtype) else chunk_attention
        if nd:
            out[:nd] = self._latent_decode(q, meta, nd)
        for i in range(nd, n):
            a, b, length = starts[i], starts[i + 1], seq_lens[i]
            if b - a == length:  # the whole sequence is new: its latents as computed (no cache rounding)
                latents = c[a:b]
            else:
                pages = meta.block_table[i, : (length + block - 1) // block]
                latents = cached_latents(kv_cache, pages, length, self.attn.isa).to(q.dtype)
            kv = linear(self.kv_b_proj, latents).view(length, H, self.qk_head_dim + self.v_head_dim)
            k, v = kv.transpose(0, 1).split([self.qk_head_dim, self.v_head_dim], dim=-1)
            qi = q[a:b].view(b - a, H, self.qk_head_dim).transpose(0, 1)
            out[a:b] = attend(qi, k, v, self.scale)
        return out.reshape(T, -1)
