"""Weights derived for serving: concatenated projections (several `nn.Linear`s that read the same input run
as one matmul: a decode step is made of many tiny ops, each costing more in dispatch than in arithmetic),
matmuls prepared for the engine's GEMM kernels (`set_prepared_matmuls`: on CPU, vLLM's packed-weight kernels) and
fp32 arrays for the compiled CPU loops.

The parameters stay the HF model's (names, loading, weight sync untouched); each derived weight is a cache
that is rebuilt whenever any source weight was replaced or modified in place (tracked by its storage
pointer and version counter; `drop_fused` after a load), so a weight push cannot leave it stale. A served model
checks all of its caches' sources at once at the start of each forward step (`StepCheck`): checking each cache
when used held 7.6% of a decode step's samples, the pass 2% (the benchmark model, py-spy on one Xeon core;
the git history of benchmarks/NOTES.md). Importable without vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

PrepareMatmul = Callable[[torch.Tensor], "Callable[[torch.Tensor], torch.Tensor] | None"]
"""Turns a weight W [out, in] into a function x [T, in] -> x W^T [T, out] in x's dtype (e.g. with W packed for
the CPU's GEMM kernels; the result may be the leading columns of a wider product), or None where it has no
faster form for W."""


class _Derived:
    """A cache built from parameters (`sources()`), rebuilt when one was replaced or modified in place; trusted
    without a check while the `StepCheck` it belongs to vouches for every source."""

    def __init__(self, sources: Callable[[], tuple[torch.Tensor, ...]]) -> None:
        self.sources = sources
        self._stamp: tuple | None = None
        self._check: StepCheck | None = None

    def _rebuild(self, sources: tuple[torch.Tensor, ...]) -> None:
        raise NotImplementedError

    def refresh(self) -> bool:
        """Rebuild if a source changed; False for inference-mode sources (no version counter to watch)."""
        if self._stamp is not None and self._check is not None and self._check.trusted:
            return True
        sources = self.sources()
        stamp = _stamp(sources)
        if stamp is None:
            return False
        if stamp != self._stamp:
            with torch.no_grad():
                self._rebuild(tuple(t.detach() for t in sources))
            self._stamp = stamp
        return True


class DerivedLinear(_Derived):
    """y = x W^T for a weight W [out, in] built from parameters (W = build(*sources()): one linear's weight, a
    concatenation, stacked expert weights as one matrix), rebuilt whenever a source changed, through the matmul
    `prepare` makes from W where there is one. Not an nn.Module: it owns no parameters and is never saved."""

    def __init__(self, sources: Callable[[], tuple[torch.Tensor, ...]], build: Callable[..., torch.Tensor],
                 prepare: PrepareMatmul | None = None) -> None:
        super().__init__(sources)
        self.build, self.prepare = build, prepare
        self._weight: torch.Tensor | None = None
        self._matmul: Callable[[torch.Tensor], torch.Tensor] | None = None

    def _rebuild(self, sources: tuple[torch.Tensor, ...]) -> None:
        weight, old = self.build(*sources), self._weight
        if (self.prepare is None and old is not None and old.is_cuda and old.shape == weight.shape
                and old.dtype == weight.dtype and old.data_ptr() != weight.data_ptr()):
            # in place: a CUDA graph captured over this weight reads the new values. A weight first built in a
            # step (vLLM runs them in inference mode) is an inference tensor, written to only in that mode.
            with torch.inference_mode(old.is_inference()):
                old.copy_(weight)
            return
        self._weight = weight
        self._matmul = None if self.prepare is None else self.prepare(weight)

    def weight(self) -> torch.Tensor | None:
        """W, rebuilt if a source changed; None for inference-mode sources."""
        return self._weight if self.refresh() else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.refresh():
            with torch.no_grad():
                weight = self.build(*self.sources())
        else:
            weight = self._weight
            if self._matmul is not None and x.dtype == weight.dtype and x.dim() == 2:
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


class DerivedArrays(_Derived):
    """fp32 numpy arrays computed from parameters (e.g. a product of two), for compiled CPU loops: rebuilt
    whenever a source parameter was replaced or modified in place, so the loops never see stale weights."""

    def __init__(self, sources: Callable[[], tuple[torch.Tensor, ...]],
                 build: Callable[..., tuple[torch.Tensor, ...]]) -> None:
        super().__init__(sources)
        self.build = build
        self._arrays: tuple[np.ndarray, ...] = ()
        self._tensors: tuple[torch.Tensor, ...] = ()

    def _computed(self, sources: tuple[torch.Tensor, ...]) -> tuple[np.ndarray, ...]:
        with torch.no_grad():
            return tuple(t.detach().to(torch.float32).contiguous().numpy() for t in self.build(*sources))

    def _rebuild(self, sources: tuple[torch.Tensor, ...]) -> None:
        self._arrays = self._computed(sources)
        self._tensors = ()

    def __call__(self) -> tuple[np.ndarray, ...]:
        if not self.refresh():  # inference-mode sources: computed every time
            return self._computed(self.sources())
        return self._arrays

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The arrays as CPU tensors over the same memory, for loops that take tensors (made once per rebuild)."""
        if not self.refresh():
            return tuple(torch.from_numpy(a) for a in self._computed(self.sources()))
        if not self._tensors:
            self._tensors = tuple(torch.from_numpy(a) for a in self._arrays)
        return self._tensors


_registrations = 0  # parameters and buffers assigned to modules so far, anywhere


def _count_registration(*_: object) -> None:
    global _registrations
    _registrations += 1


# A parameter or buffer assigned to a module (a new object, where a check would watch the old one's stamp).
torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)
torch.nn.modules.module.register_module_buffer_registration_hook(_count_registration)


class StepCheck:
    """The derived caches of one model, checked together at the start of each forward step (`step`): while a
    step runs, the caches skip their own checks, which cost more one by one than all of them in one pass. A
    forward changes no weights, so the check at its start holds until it ends. A step after a change (a weight
    pushed or modified in place, a parameter assigned anew, a cache added) checks and rebuilds every cache."""

    def __init__(self) -> None:
        self.trusted = False
        self._members: list[_Derived] = []
        self._tensors: list[torch.Tensor] = []
        self._stamp: tuple | None = None
        self._registered = -1

    def add(self, member: _Derived) -> None:
        member._check = self
        self._members.append(member)
        self._stamp = None

    def clear(self) -> None:
        for member in self._members:
            member._check = None
        self._members, self._tensors, self._stamp = [], [], None

    def _verify(self) -> bool:
        if self._stamp is not None and self._registered == _registrations and _stamp(self._tensors) == self._stamp:
            return True
        self._registered = _registrations
        if not all([member.refresh() for member in self._members]):
            self._stamp = None
            return False
        self._tensors = [t for member in self._members for t in member.sources()]
        self._stamp = _stamp(self._tensors)
        return self._stamp is not None

    def refresh(self) -> None:
        """Rebuild every stale cache now (after a weight load): on a GPU in place, so that CUDA graphs, which
        replay without running this check, read the new weights."""
        self.trusted = False
        self._stamp = None
        self._verify()

    @contextmanager
    def step(self) -> Iterator[None]:
        """One forward step with every cache checked at its start (rebuilt where stale)."""
        self.trusted = self._verify()
        try:
            yield
        finally:
            self.trusted = False


def _cached(module: nn.Module, name: str, make: Callable[[], object]) -> object:
    cache = module.__dict__.get("_serving_fused")
    found = None if cache is None else cache.get(name)
    if found is None:
        found = module.__dict__.setdefault("_serving_fused", {})[name] = make()
        check = module.__dict__.get("_serving_step_check")
        if check is not None:
            check.add(_derived_of(found))
    return found


def _derived_of(found: object) -> _Derived:
    return found.linear if isinstance(found, FusedLinear) else found


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
    check = model.__dict__.get("_serving_step_check")
    if check is not None:
        check.clear()


def step_check(model: nn.Module) -> StepCheck:
    """The `StepCheck` of the caches under `model`, made on first use with the caches already there; the caches
    made later join it."""
    check = model.__dict__.get("_serving_step_check")
    if check is None:
        check = StepCheck()
        for module in model.modules():
            module.__dict__["_serving_step_check"] = check
            for found in module.__dict__.get("_serving_fused", {}).values():
                check.add(_derived_of(found))
    return check
