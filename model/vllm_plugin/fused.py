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
the CPU's GEMM kernels; the result may be the leading columns of a wider product), or None where it has no
faster form for W."""


class DerivedLinear:
    """y = x W^T for a weight W [out, in] built from parameters (W = build(*sources()): one linear's weight, a
    concatenation, stacked expert weights as one matrix), rebuilt whenever a source changed, through the matmul
    `prepare` makes from W where there is one. Not an nn.Module: it owns no parameters and is never saved."""

    def __init__(self, sources: Callable[[], tuple[torch.Tensor, ...]], build: Callable[..., torch.Tensor],
                 prepare: PrepareMatmul | None = None) -> None:
        self.sources, self.build, self.prepare = sources, build, prepare
        self._stamp: tuple | None = None
        self._weight: torch.Tensor | None = None
        self._matmul: Callable[[torch.Tensor], torch.Tensor] | None = None

    def weight(self) -> torch.Tensor | None:
        """W, rebuilt if a source changed; None for inference-mode sources (they carry no version counter to
        watch)."""
        sources = self.sources()
        stamp = _stamp(sources)
        if stamp is None:
            return None
        if stamp != self._stamp:
            with torch.no_grad():
                self._weight = self.build(*(t.detach() for t in sources))
                self._matmul = None if self.prepare is None else self.prepare(self._weight)
            self._stamp = stamp
        return self._weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight()
        if weight is None:
            with torch.no_grad():
                weight = self.build(*self.sources())
        elif self._matmul is not None and x.dtype == weight.dtype and x.dim() == 2:
            return self._matmul(x.contiguous())
        return F.linear(x, weight if weight.dtype == x.dtype else weight.to(x.dtype))


class FusedLinear:
    """y = x @ cat(W_1, ..., W_n)^T split back into outputs: one per linear, or per group of adjacent
    linears when `groups` gives the group sizes (e.g. (3, 1) returns (x W_1|x W_2|x W_3, x W_4)). The linears
    are modules with a `weight` [out, in]: nn.Linear, the MoE router."""

    def __init__(self, *linears: nn.Module, groups: tuple[int, ...] | None = None,
                 prepare: PrepareMatmul | None = None) -> None:
        if any(getattr(lin, "bias", None) is not None for lin in linears):
            raise ValueError("FusedLinear fuses bias-free projections only")
        groups = groups or (1,) * len(linears)
        if sum(groups) != len(linears):
            raise ValueError(f"groups {groups} must add up to the {len(linears)} linears")
        self.sizes, start = [], 0
        for count in groups:
            self.sizes.append(sum(lin.weight.shape[0] for lin in linears[start:start + count]))
            start += count
        # _parameters directly: nn.Module.__getattr__ costs more than the rest of the stamp check
        self.linear = DerivedLinear(lambda: tuple(lin._parameters["weight"] for lin in linears),
                                    lambda *weights: torch.cat(weights) if len(weights) > 1 else weights[0], prepare)

    def weight(self) -> torch.Tensor | None:
        """The concatenated weight (see `DerivedLinear.weight`)."""
        return self.linear.weight()

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.linear(x)
        return y.split_with_sizes(self.sizes, dim=-1) if len(self.sizes) > 1 else (y,)


def _stamp(tensors: tuple[torch.Tensor, ...]) -> tuple | None:
    """Where each tensor's data is and how often it was modified in place; None for inference-mode tensors
    (they carry no version counter)."""
    try:
        return tuple([(t.data_ptr(), t._version) for t in tensors])  # (a list builds faster than a generator)
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
        self._tensors: tuple[tuple[np.ndarray, ...], tuple[torch.Tensor, ...]] = ((), ())

    def __call__(self) -> tuple[np.ndarray, ...]:
        sources = self.sources()
        stamp = _stamp(sources)
        if stamp is None or stamp != self._stamp:
            with torch.no_grad():
                self._arrays = tuple(t.detach().to(torch.float32).contiguous().numpy()
                                     for t in self.build(*sources))
            self._stamp = stamp
        return self._arrays

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The arrays as CPU tensors over the same memory, for loops that take tensors (made once per rebuild)."""
        arrays = self()
        if self._tensors[0] is not arrays:
            self._tensors = (arrays, tuple(torch.from_numpy(a) for a in arrays))
        return self._tensors[1]


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


def derived_linear(
    module: nn.Module, name: str, sources: Callable[[], tuple[torch.Tensor, ...]],
    build: Callable[..., torch.Tensor],
) -> DerivedLinear:
    """The DerivedLinear `name` of `module`, created on first use and kept on the module; its matmul prepared as
    `set_prepared_matmuls` said for `module`."""
    return _cached(module, name, lambda: DerivedLinear(sources, build, module.__dict__.get("_serving_prepare")))


def linear(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """lin(x) for a bias-free linear, through its prepared matmul where there is one."""
    found = lin.__dict__.get("_serving_fused")  # (the lookup of `derived_linear`, without its closures: hot)
    derived = None if found is None else found.get("self")
    if derived is None:
        if lin._parameters.get("bias") is not None:
            raise ValueError("linear serves bias-free projections only")
        derived = derived_linear(lin, "self", lambda: (lin._parameters["weight"],), lambda weight: weight)
    return derived(x)


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
