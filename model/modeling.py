"""`TaperModel` / `TaperForCausalLM`: the KDA-hybrid Stable-LatentMoE causal LM (HF-compatible).

Layer i: Block-AttnRes mix -> RMSNorm -> token mixer (KDA, or gated MLA for i in full_attn_layers),
then Block-AttnRes mix -> RMSNorm -> channel mixer (dense SiTU-GLU for i < first_k_dense, else Stable
LatentMoE). A final AttnRes mix runs before the last norm. No positional encoding anywhere.
Parameter names are documented in model/PARAMETERS.md (the vLLM plugin uses the same names).

Decoding: the model creates a `TaperCache` (KDA conv + recurrent states, MLA keys/values) on the first
forward with use_cache and returns it; `generate()` threads it through (greedy, sampling, beams).
Training: call `update_balancing()` after each optimizer step; `gradient_checkpointing_enable()` works. On a
GPU, `model.model.compile_layers()` fuses the layers' elementwise work (`compile_layers("stack")`: the whole layer
stack as one graph, a faster step for a longer first compile); forward+backward then has no host sync (without an
attention_mask), so a learner with fixed batch shapes can also capture the whole step as a CUDA graph
(benchmarks/model.py, modes "graph" and "stack_graph").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    GenerationMixin,
    PreTrainedModel,
)
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from model.cache import TaperCache
from model.config import TaperConfig
from model.layers.attn_res import AttnResState, BlockAttnRes, _ScoreNorm
from model.layers.kda import KimiDeltaAttention
from model.layers.mla import GatedMLA
from model.layers.moe import LatentExperts, Router, StableLatentMoE
from model.layers.moe import update_balancing as update_moe_balancing
from model.layers.norm import GatedRMSNorm, RMSNorm
from model.layers.situ_glu import SiTUGLUMLP


@dataclass
class TaperModelOutput(BaseModelOutputWithPast):
    router_loads: tuple[torch.Tensor, ...] | None = None


@dataclass
class TaperCausalLMOutput(CausalLMOutputWithPast):
    router_loads: tuple[torch.Tensor, ...] | None = None


class TaperDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: TaperConfig, layer_idx: int) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = layer_idx
        self.is_mla = layer_idx in config.full_attn_layers
        self.mixer_res = BlockAttnRes(d, eps)
        self.mixer_norm = RMSNorm(d, eps)
        self.mixer = GatedMLA(config, layer_idx) if self.is_mla else KimiDeltaAttention(config, layer_idx)
        self.mlp_res = BlockAttnRes(d, eps)
        self.mlp_norm = RMSNorm(d, eps)
        self.is_moe = config.is_moe_layer(layer_idx)
        self.mlp = (
            StableLatentMoE(config) if self.is_moe
            else SiTUGLUMLP(d, config.intermediate_size, config.situ_beta, config.situ_beta_linear)
        )

    def forward(
        self,
        partial: torch.Tensor | None,
        *blocks: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: TaperCache | None = None,
    ) -> torch.Tensor:
        """Both sub-layers. `blocks` are the AttnRes block summaries, `partial` the running in-block sum (None
        right after a block boundary); returns the new in-block sum. Tensors are positional so reentrant
        gradient checkpointing sees them. attention_mask [B, P+T] covers cached and new tokens."""
        cache = past_key_values
        x = self.mixer_norm(self.mixer_res([*blocks] if partial is None else [*blocks, partial]))
        T = x.shape[1]
        token_mask = None if attention_mask is None else attention_mask[:, -T:]
        if self.is_mla:
            mixed = self.mixer(x, key_mask=attention_mask, cache=cache)
        else:
            conv_state, recurrent_state = (None, None) if cache is None else cache.kda_states(self.layer_idx)
            mixed, conv_state, recurrent_state = self.mixer(
                x, conv_state, recurrent_state, output_states=cache is not None, token_mask=token_mask
            )
            if cache is not None:
                cache.set_kda_states(self.layer_idx, conv_state, recurrent_state)
        partial = mixed if partial is None else partial + mixed
        h = self.mlp_norm(self.mlp_res([*blocks, partial]))
        return partial + (self.mlp(h, token_mask) if self.is_moe else self.mlp(h))


class TaperPreTrainedModel(PreTrainedModel):
    config_class = TaperConfig
    config: TaperConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["TaperDecoderLayer"]
    _is_stateful = True
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Conv1d):
            bound = module.weight.shape[-1] ** -0.5
            init.uniform_(module.weight, -bound, bound)
        elif isinstance(module, (RMSNorm, GatedRMSNorm, _ScoreNorm)):
            init.ones_(module.weight)
        elif isinstance(module, BlockAttnRes):
            init.zeros_(module.query)
        elif isinstance(module, KimiDeltaAttention):
            module.reset_gate_parameters()
        elif isinstance(module, Router):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.bias_correction)
        elif isinstance(module, LatentExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # generate() must not build a DynamicCache: the model creates its own TaperCache on first use.
        return False


class TaperModel(TaperPreTrainedModel):
    def __init__(self, config: TaperConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TaperDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.final_res = BlockAttnRes(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._compiled_stack: Callable[..., torch.Tensor] | None = None  # compile_layers(scope="stack")
        self._compiled_embed: Callable[[torch.Tensor], torch.Tensor] | None = None  # the same, for the lookup
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def moe_layers(self) -> list[StableLatentMoE]:
        return [layer.mlp for layer in self.layers if layer.is_moe]

    def compile_layers(self, scope: str = "parts", **compile_kwargs: Any) -> None:
        """torch.compile for the GPU training path (norms, SiTU-GLU and the MoE's routing arithmetic fuse; the KDA op,
        the fused AttnRes mix and the short conv stay opaque custom ops). Not for CPU (compile time there outweighs
        the gain).

        scope "parts": each layer's token mixer, channel mixer, AttnRes mix and RMSNorm; parts of one kind share
        graphs across layers (AttnRes: one per candidate count), so compile time does not grow with depth.
        scope "stack": every layer, the final mix and norm as one graph (one per input shape): the residual sums
        between the parts, and in the backward the gradient sums of tensors that many layers read (the AttnRes
        block summaries), fuse into the surrounding kernels instead of running as separate adds. Forwards with a
        cache (decoding) run the layers eagerly."""
        if scope not in ("parts", "stack"):
            raise ValueError(f"scope must be 'parts' or 'stack', got {scope!r}")
        dynamo = torch._dynamo.config
        name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
        setattr(dynamo, name, max(getattr(dynamo, name), 64))
        if scope == "stack":
            self._compiled_stack = torch.compile(self._layer_stack, **compile_kwargs)
            # the lookup compiled too: its backward is then a zero fill, an fp32 scatter-add and a cast, not the
            # sort-based eager embedding backward (14 kernels)
            self._compiled_embed = torch.compile(self._embed, **compile_kwargs)
            return
        for layer in self.layers:
            for part in (layer.mixer_res, layer.mixer_norm, layer.mixer, layer.mlp_res, layer.mlp_norm, layer.mlp):
                part.compile(**compile_kwargs)
        self.final_res.compile(**compile_kwargs)
        self.norm.compile(**compile_kwargs)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def _layer_stack(
        self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None, cache: TaperCache | None
    ) -> torch.Tensor:
        """All decoder layers, the final AttnRes mix and the last norm: embeddings -> final hidden states."""
        res = AttnResState.start(inputs_embeds)
        for layer in self.layers:
            res.partial = layer(res.partial, *res.blocks, attention_mask=attention_mask, past_key_values=cache)
            res.end_layer(self.config.attn_res_block_size)
        return self.norm(self.final_res(res.candidates()))

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_router_loads: bool = False,
        **kwargs,
    ) -> TaperModelOutput:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        for unsupported in ("output_hidden_states", "output_attentions"):
            if kwargs.get(unsupported):
                raise NotImplementedError(f"{unsupported}=True is not supported: AttnRes layers have no single "
                                          "per-layer hidden state and KDA no attention map")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if inputs_embeds is None:
            compiled_embed = self._compiled_embed if past_key_values is None and not use_cache else None
            inputs_embeds = (compiled_embed or self.embed_tokens)(input_ids)
        if past_key_values is not None and not isinstance(past_key_values, TaperCache):
            raise TypeError(f"past_key_values must be a TaperCache, got {type(past_key_values).__name__}")
        if use_cache and past_key_values is None:
            past_key_values = TaperCache(self.config)
        cache = past_key_values if use_cache else None
        T = inputs_embeds.shape[1]
        if attention_mask is not None:
            past = 0 if cache is None else cache.get_seq_length()
            if attention_mask.dim() != 2 or attention_mask.shape[1] != past + T:
                raise ValueError(
                    f"attention_mask must be [B, past + T] = [B, {past + T}] (2-D, 1 = real token), "
                    f"got {tuple(attention_mask.shape)}"
                )
            if bool(attention_mask.all()):
                attention_mask = None
        compiled = self._compiled_stack
        stack = compiled if compiled is not None and cache is None else self._layer_stack
        hidden = stack(inputs_embeds, attention_mask, cache)
        if cache is not None:
            cache.seen_tokens += T
        loads = tuple(moe.last_load for moe in self.moe_layers()) if output_router_loads else None
        return TaperModelOutput(last_hidden_state=hidden, past_key_values=cache, router_loads=loads)


class TaperForCausalLM(TaperPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: TaperConfig) -> None:
        # Before any tensor work, so the CPU thread pool inherits it: see kernels.kda.chunk_torch
        torch.set_flush_denormal(True)
        super().__init__(config)
        self.model = TaperModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        model = super().from_pretrained(*args, **kwargs)
        loaded = model[0] if isinstance(model, tuple) else model  # output_loading_info=True gives a tuple
        for module in loaded.modules():
            if isinstance(module, KimiDeltaAttention):
                module.freeze_unused_parameters()
        return model

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_loads: bool = False,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> TaperCausalLMOutput:
        """Logits [B, T, vocab] (the last `logits_to_keep` positions if > 0); with `labels` the mean
        next-token cross-entropy (-100 = ignored); `router_loads`: per MoE layer, the fraction of routed
        assignments per expert [n_experts] over real tokens, when `output_router_loads`."""
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, past_key_values=past_key_values,
            inputs_embeds=inputs_embeds, use_cache=use_cache, output_router_loads=output_router_loads, **kwargs,
        )
        hidden = outputs.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        return TaperCausalLMOutput(
            loss=loss, logits=logits, past_key_values=outputs.past_key_values, router_loads=outputs.router_loads
        )

    # ---- Stable LatentMoE balancing ---------------------------------------------------------------
    @torch.no_grad()
    def update_balancing(self) -> dict[str, float]:
        """Quantile-balancing update of every MoE layer from the router scores recorded by the training
        forwards since the last call (call once after each optimizer step; no-op in eval mode). Returns
        metrics: per-layer max/mean load of the last forward and their mean."""
        metrics: dict[str, float] = {}
        update_moe_balancing(self.model.moe_layers())
        metrics.update(self.balancing_metrics())
        return metrics

    @torch.no_grad()
    def balancing_metrics(self) -> dict[str, float]:
        """max/mean expert load per MoE layer (from the last forward) and their average."""
        metrics: dict[str, float] = {}
        layers = [layer for layer in self.model.layers if layer.is_moe and layer.mlp.last_load is not None]
        if not layers:
            return metrics
        loads = torch.stack([layer.mlp.last_load for layer in layers])
        ratios = (loads.max(-1).values / loads.mean(-1)).tolist()  # one device-to-host read for all layers
        for layer, ratio in zip(layers, ratios, strict=True):
            metrics[f"moe/layer{layer.layer_idx}/max_over_mean_load"] = ratio
        metrics["moe/max_over_mean_load"] = sum(ratios) / len(ratios)
        return metrics


AutoConfig.register(TaperConfig.model_type, TaperConfig, exist_ok=True)
AutoModel.register(TaperConfig, TaperModel, exist_ok=True)
AutoModelForCausalLM.register(TaperConfig, TaperForCausalLM, exist_ok=True)
