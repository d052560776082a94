"""The learner's weights, ready to push into the rollout engines.

Where a push of the `small` preset (110M parameters, 422 MiB fp32) went on CPU: Ray pickles a plain torch
tensor in band, so putting the state dict into the object store and unpickling it in the rollout worker copied
every byte twice through pickle (3-4 s each way on a loaded 2-core box), while the engine's own in-place load
took 0.13-0.8 s. Tensors from `shippable_state_dict` pickle as numpy arrays, which Ray keeps out of band:
one memcpy into the object store, and the worker reads them where they lie (a read-only view; the engine's load
copies from it). They unpickle as plain torch tensors, so the receiving side needs nothing from this module.
"""

from __future__ import annotations

import torch
from torch import nn

BALANCING_BUFFER_SUFFIXES = ("bias_correction",)  # MoE balancing biases stay fp32 whatever the push dtype


class ShippedTensor(torch.Tensor):
    """A tensor that pickles as a numpy array (zero-copy in Ray's object store) and unpickles as a plain
    `torch.Tensor` (bf16 travels as its int16 bits, since numpy has no bfloat16)."""

    def __reduce_ex__(self, protocol: int):  # type: ignore[override]
        plain = torch.Tensor.as_subclass(self, torch.Tensor).detach().cpu().contiguous()
        if plain.dtype == torch.bfloat16:
            return torch.Tensor.view, (plain.view(torch.int16).as_subclass(ShippedTensor), torch.bfloat16)
        return torch.from_numpy, (plain.numpy(),)


def shippable_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's state as detached `ShippedTensor`s on the model's device (pickled, they travel from the CPU;
    a pool whose engines share the model's GPU takes them from there). `dtype`: the engines' dtype, to send half
    the bytes to bf16 engines (floating tensors only, balancing biases excepted)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        t = value.detach()
        if hasattr(t, "full_tensor"):  # a DTensor shard: the push needs the whole tensor
            t = t.full_tensor()
        if dtype is not None and t.is_floating_point() and not name.endswith(BALANCING_BUFFER_SUFFIXES):
            t = t.to(dtype)
        out[name] = t.as_subclass(ShippedTensor)
    return out
