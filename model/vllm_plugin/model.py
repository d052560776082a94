"""`TaperForCausalLM` for vLLM: the HF model's modules and parameter names, with vLLM token mixers.

Tokens arrive flattened ([num_tokens, d], all requests of a step back to back). Every piece except the
token mixers works per token and is an HF module (Block AttnRes, RMSNorm, SiTU-GLU MLP, Stable LatentMoE
with its frozen balancing bias) or a subclass with the same parameters and math in fewer ops (`per_token`:
concatenated projections, compiled CPU passes, no fp32 casts of fp32 tensors), so a
`save_pretrained` directory loads with no conversion and a learner's state dict pushes in by name.

On CPU the layers hold and compute in the dtype `cpu_dtype` decides: bf16 where the CPU has bf16
instructions (fp32 accumulation in the matmuls; norms, gates, routing, AttnRes weights and the KDA state
in fp32), fp32 elsewhere (there torch's bf16 matmuls are several times slower than fp32); the caches and
every tensor handed to vLLM stay in the model dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.platforms import current_platform
from vllm.sequence import IntermediateTensors

from model.config import TaperConfig
from model.layers.attn_res import AttnResState
from model.layers.norm import RMSNorm
from model.vllm_plugin.cpu_dtype import cpu_compute_dtype
from model.vllm_plugin.cpu_gemm import prepare_cpu_matmul
from model.vllm_plugin.fused import linear, set_prepared_matmuls, step_check
from model.vllm_plugin.gpu_support import check_gpu_servable
from model.vllm_plugin.layers import (
    VllmGatedMLA,
    VllmKimiDeltaAttention,
    kda_state_dtypes,
    kda_state_shapes,
)
from model.vllm_plugin.per_token import VllmBlockAttnRes, VllmSiTUGLUMLP, VllmStableLatentMoE

logger = init_logger("vllm.taper")  # under "vllm": printed by the engine's own log handler


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class TaperDecoderLayer(nn.Module):
    def __init__(self, config: TaperConfig, layer_idx: int, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.mixer_res = VllmBlockAttnRes(d, eps)
        self.mixer_norm = RMSNorm(d, eps)
        mixer_cls = VllmGatedMLA if layer_idx in config.full_attn_layers else VllmKimiDeltaAttention
        self.mixer = mixer_cls(config, layer_idx, vllm_config, prefix=f"{prefix}.mixer")
        self.mlp_res = VllmBlockAttnRes(d, eps)
        self.mlp_norm = RMSNorm(d, eps)
        self.mlp = (
            VllmStableLatentMoE(config) if config.is_moe_layer(layer_idx)
            else VllmSiTUGLUMLP(d, config.intermediate_size, config.situ_beta, config.situ_beta_linear)
        )

    def forward(self, res: AttnResState) -> None:
        res.add(self.mixer(self.mixer_res.mix_and_norm(res.candidates(), self.mixer_norm)))
        res.add(self.mlp(self.mlp_res.mix_and_norm(res.candidates(), self.mlp_norm)))


class TaperModel(nn.Module):
    def __init__(self, config: TaperConfig, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            TaperDecoderLayer(config, i, vllm_config, prefix=f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.final_res = VllmBlockAttnRes(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        res = AttnResState.start(inputs_embeds)
        for layer in self.layers:
            layer(res)
            res.end_layer(self.config.attn_res_block_size)
        return self.final_res.mix_and_norm(res.candidates(), self.norm)


class TaperForCausalLM(nn.Module, HasInnerState, IsHybrid):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        torch.set_flush_denormal(True)  # see kernels.kda.chunk_torch
        super().__init__()
        config = vllm_config.model_config.hf_config
        if not isinstance(config, TaperConfig):
            raise TypeError(f"hf_config must be a TaperConfig, got {type(config).__name__}")
        if current_platform.is_cpu() and vllm_config.compilation_config.cudagraph_mode != CUDAGraphMode.NONE:
            raise ValueError("enforce_eager: on CPU the Taper vLLM model is served with enforce_eager=True")
        if current_platform.is_cuda_alike():
            check_gpu_servable(config, vllm_config.model_config.dtype)
        self.config = config
        self.model_dtype = vllm_config.model_config.dtype
        if current_platform.is_cpu():
            decided = cpu_compute_dtype(self.model_dtype)
            logger.info("Taper on CPU computes in %s", decided.describe())
            self.compute_dtype = decided.dtype
        else:
            self.compute_dtype = self.model_dtype
        with _default_dtype(self.compute_dtype):
            self.model = TaperModel(config, vllm_config, prefix=f"{prefix}.model" if prefix else "model")
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if current_platform.is_cpu():
            set_prepared_matmuls(self, prepare_cpu_matmul)
        step_check(self)  # the derived weights made from here on are checked once per step
        self.eval()  # MoE records balancing statistics only in training mode: frozen bias at inference

    # ---- vLLM model interface ----------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids).to(self.model_dtype)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.model.embed_tokens(input_ids)
        with step_check(self).step():
            return self.model(inputs_embeds.to(self.compute_dtype)).to(self.model_dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # contiguous for vLLM's samplers: a padded prepared matmul returns a column slice (cpu_gemm)
        return linear(self.lm_head, hidden_states.to(self.compute_dtype)).contiguous()

    @classmethod
    def get_mamba_state_shape_from_config(
        cls, vllm_config: VllmConfig
    ) -> tuple[tuple[int, int], tuple[int, int, int]]:
        return kda_state_shapes(vllm_config.model_config.hf_config)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, torch.dtype]:
        return kda_state_dtypes(vllm_config)

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple:
        # (conv, recurrent) copy rules for prefix caching's state alignment, as for Kimi Linear's KDA.
        return MambaStateCopyFuncCalculator.kda_state_copy_func()

    # ---- weights -----------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors (parameters and the MoE balancing-bias buffers) in place.
        Unknown names and shape mismatches raise, naming the tensor."""
        targets = dict(self.named_parameters())
        targets.update(self.named_buffers())
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name == "lm_head.weight" and self.config.tie_word_embeddings:
                    name = "model.embed_tokens.weight"
                target = targets.get(name)
                if target is None:
                    raise KeyError(f"checkpoint tensor {name!r} has no counterpart in the vLLM TaperForCausalLM")
                if target.shape != tensor.shape:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                    )
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
                loaded.add(name)
        step_check(self).refresh()  # the derived weights now (in place on a GPU: captured graphs read them)
        for module in self.modules():
            if isinstance(module, VllmStableLatentMoE):
                module.build_caches()
        return loaded
