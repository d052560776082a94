"""`TaperCache`: incremental-decoding state for a KDA/MLA hybrid, as a transformers `Cache`.

KDA layers keep a conv state [B, 2*H*K + HV*V, conv_size - 1] (model dtype) and a recurrent state
[B, HV, K, V] (fp32): constant size in the context length. MLA layers keep up-projected keys/values
[B, Hq, T, D] that grow with it. Being a `Cache` gives `generate()` beam reordering, batch selection and
`get_seq_length()` (the number of tokens consumed, tracked here so KDA-only stacks work too).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionCacheLayerMixin

from model.config import FULL_ATTENTION, TaperConfig


class KDAStateLayer(LinearAttentionCacheLayerMixin):
    """One KDA layer's conv and recurrent state (state slot 0), replaced wholesale on each update."""

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0) -> None:
        if conv_states is not None:
            self.dtype, self.device = conv_states.dtype, conv_states.device
            self.conv_kernel_size[state_idx] = conv_states.shape[-1]
            self.is_conv_states_initialized[state_idx] = True
        if recurrent_states is not None:
            self.is_recurrent_states_initialized[state_idx] = True

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        self.lazy_initialization(conv_states=conv_states, state_idx=state_idx)
        self.conv_states[state_idx] = conv_states
        self.has_previous_state[state_idx] = True
        return conv_states

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        self.lazy_initialization(recurrent_states=recurrent_states, state_idx=state_idx)
        self.recurrent_states[state_idx] = recurrent_states
        return recurrent_states


class TaperCache(Cache):
    def __init__(self, config: TaperConfig) -> None:
        layers = [DynamicLayer() if t == FULL_ATTENTION else KDAStateLayer() for t in config.layer_types]
        super().__init__(layers=layers)
        self.seen_tokens = 0

    def kda_states(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(conv state, recurrent state) of a KDA layer, or (None, None) before its first update."""
        layer = self._kda_layer(layer_idx)
        if not layer.has_previous_state[0]:
            return None, None
        return layer.conv_states[0], layer.recurrent_states[0]

    def set_kda_states(self, layer_idx: int, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        layer = self._kda_layer(layer_idx)
        layer.update_conv_state(conv_state)
        layer.update_recurrent_state(recurrent_state)

    def _kda_layer(self, layer_idx: int) -> KDAStateLayer:
        layer = self.layers[layer_idx]
        if not isinstance(layer, KDAStateLayer):
            raise ValueError(f"layer {layer_idx} is an MLA layer; it has no KDA state")
        return layer

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    @property
    def is_compileable(self) -> bool:
        return False

    def reset(self) -> None:
        super().reset()
        self.seen_tokens = 0

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("a recurrent KDA state cannot be rolled back; re-run the prefix instead")

    def state_bytes(self) -> int:
        """Bytes held by all layers' states (for the decode-memory benchmark)."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, KDAStateLayer):
                tensors = [layer.conv_states[0], layer.recurrent_states[0]]
            else:
                tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
            total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
        return total
