"""Weights derived for serving: concatenated projections (several `nn.Linear`s that read the same input run
as one matmul: a decode step is made of many tiny ops, each costing more in dispatch than in arithmetic),
matmuls prepared for the engine's GEMM kernels (`set_prepared_matmuls`: on CPU, vLLM's packed-weight kernels) and
fp32 arrays for the compiled CPU loops.

The parameters stay the HF model's (names, loading, weight sync untouched); each derived weight is a cache
that is rebuilt whenever any source weight was replaced or modified in place (tracked by its storage
pointer and version counter; `drop_fused` after a load), so a weight push cannot leave it stale. Importable without vLLM.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

PrepareMatmul = Callable[[torch.Tensor], "Callable[[torch.Tensor], torch.Tensor] | None"]
"""Turns a weight W [out, in] into a function x [T, in] -> x W^T [T, out] in x's dtype (e.g. with W packed for
the CPU's GEMM kernels), or None where it has no faster form for W."""


class FusedLinear:
    """y = x @ cat(W_1, ..., W_n)^T split back into outputs: one per linear, or per group of adjacent
    linears when `groups` gives the group sizes (e.g. (3, 1) returns (x W_1|x W_2|x W_3, x W_4)).
    Not an nn.Module: it owns no parameters and is never saved."""

    def __init__(self, *linears: nn.Module, groups: tuple[int, ...] | None = None,
                 prepare: PrepareMatmul | None = None) -> None:
        if any(getattr(lin, "bias", None) is not None for lin in linears):
            raise ValueError("FusedLinear fuses bias-free projections only")
        groups = groups or (1,) * len(linears)
        if sum(groups) != len(linears):
            raise ValueError(f"groups {groups} must add up to the {len(linears)} linears")
        self.linears = linears  # modules with a `weight` [out, in]: nn.Linear, the MoE router
        self.sizes, start = [], 0
        for count in groups:
            self.sizes.append(sum(lin.weight.shape[0] for lin in linears[start:start + count]))
            start += count
        self.prepare = prepare
        self._stamp: tuple | None = None
        self._weight: torch.Tensor | None = None
        self._matmul: Callable[[torch.Tensor], torch.Tensor] | None = None

    def weight(self) -> torch.Tensor | None:
        """The concatenated weight, rebuilt if a source changed; None for inference-mode weights (they
        carry no version counter to watch)."""
        # _parameters directly: nn.Module.__getattr__ costs more than the rest of this check
        weights = [lin._parameters["weight"] for lin in self.linears]
        stamp = _stamp(weights)
        if stamp is None:
            return None
        if stamp != self._stamp:
            with torch.no_grad():
                self._weight = torch.cat([w.detach() for w in weights]) if len(weights) > 1 else weights[0].detach()
                self._matmul = None if self.prepare is None else self.prepare(self._weight)
            self._stamp = stamp
        return self._weight

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weight = self.weight()
        if weight is None:
            y = torch.cat([F.linear(x, lin.weight.to(x.dtype)) for lin in self.linears], dim=-1)
        elif self._matmul is not None and x.dtype == weight.dtype and x.dim() == 2:
            y = self._matmul(x.contiguous())
        else:
            y = F.linear(x, weight if weight.dtype == x.dtype else weight.to(x.dtype))
        return y.split(self.sizes, dim=-1) if len(self.sizes) > 1 else (y,)


def _stamp(tensors: list[torch.Tensor]) -> tuple | None:
    """Where each tensor's data is and how often it was modified in place; None for inference-mode tensors
    (they carry no version counter)."""
    try:
        return tuple((t.data_ptr(), t._version) for t in tensors)
    except RuntimeError:
        return None


class DerivedArrays:
    """fp32 numpy arrays computed from parameters (e.g. a product of two), for compiled CPU loops: rebuilt
    whenever a source parameter was replaced or modified in place, so the loops never see stale weights."""

    def __init__(self, sources: Callable[[], tuple[torch.Tensor, ...]],
                 build: Callable[..., tuple[torch.Tensor, ...]]) -> None:
        self.sources, self.build = sources, build
        self._stamp: tuple | None = None
        self._arrays: tuple[np.ndarray, ...] = ()

    def __call__(self) -> tuple[np.ndarray, ...]:
        sources = self.sources()
        stamp = _stamp(list(sources))
        if stamp is None or stamp != self._stamp:
            with torch.no_grad():
                self._arrays = tuple(t.detach().to(torch.float32).contiguous().numpy()
                                     for t in self.build(*sources))
            self._stamp = stamp
        return self._arrays


def _cached(module: nn.Module, name: str, make: Callable[[], object]) -> object:
    cache = module.__dict__.setdefault("_serving_fused", {})
    found = cache.get(name)
    if found is None:
        found = cache[name] = make()
    return found


def derived_arrays(
    module: nn.Module, name: str, sources: Callable[[], tuple[torch.Tensor, ...]],
    build: Callable[..., tuple[torch.Tensor, ...]],
) -> DerivedArrays:
    """The DerivedArrays `name` of `module`, created on first use and kept on the module."""
    return _cached(module, name, lambda: DerivedArrays(sources, build))


def fused(
    module: nn.Module, name: str, linears: Callable[[], tuple[nn.Module, ...]],
    groups: tuple[int, ...] | None = None,
) -> FusedLinear:
    """The FusedLinear `name` of `module`, over the modules `linears()` returns, created on first use and
    kept on the module; its matmul prepared as `set_prepared_matmuls` said for `module`."""
    return _cached(module, name, lambda: FusedLinear(*linears(), groups=groups,
                                                     prepare=module.__dict__.get("_serving_prepare")))


def linear(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """lin(x) for a bias-free linear, through its prepared matmul where there is one."""
    return fused(lin, "self", lambda: (lin,))(x)[0]


def set_prepared_matmuls(model: nn.Module, prepare: PrepareMatmul | None) -> None:
    """Run the projections of every module under `model` (`fused`, `linear`) through matmuls `prepare` makes
    from their weights (None: F.linear), rebuilt with the weights."""
    for module in model.modules():
        module.__dict__["_serving_prepare"] = prepare
    drop_fused(model)


def drop_fused(model: nn.Module) -> None:
    """Forget every cached concatenation under `model` (after loading weights by any route)."""
    for module in model.modules():
        module.__dict__.pop("_serving_fused", None)
