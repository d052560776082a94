"""Serve TaperForCausalLM in vLLM: registration (the `vllm.general_plugins` entry point), the vLLM model,
its KDA / MLA layers, and live weight sync into a running engine.

`kda_ops` (KDA over per-request state slots) and `per_token` (the served AttnRes, MLP and MoE) import without
vLLM; everything else needs vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping

from model.vllm_plugin.weight_sync import push_weights, weight_sync_engine_kwargs

__all__ = ["ARCHITECTURE", "MODEL_TYPE", "push_weights", "register", "weight_sync_engine_kwargs"]

ARCHITECTURE = "TaperForCausalLM"
MODEL_TYPE = "taper"


def register() -> None:
    """Register the architecture with vLLM's ModelRegistry and the config with transformers' AutoConfig.

    vLLM calls this in every process it starts (engine core, workers); it is idempotent.
    """
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from model.config import TaperConfig

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        # Lazy "module:class" form: the model module (and torch-heavy imports) load only when used.
        ModelRegistry.register_model(ARCHITECTURE, "model.vllm_plugin.model:TaperForCausalLM")
    try:
        AutoConfig.register(MODEL_TYPE, TaperConfig)
    except ValueError:  # already registered (by model/ itself or an earlier call)
        pass
    _let_kernel_scan_skip_attribute_proxies()


def _let_kernel_scan_skip_attribute_proxies() -> None:
    """vLLM's CPU worker start rebinds Triton kernels by scanning every loaded module's objects with
    `vars(obj).get("kernel")` (vllm.triton_utils.dispatcher). llvmlite's `ffi.lib`, loaded with numba (our
    CPU KDA kernel), answers any attribute with a function wrapper, `__dict__` included, and the scan
    raises on it. The module gets a `vars` that returns only real namespaces (an empty one otherwise)."""
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:
        return

    def namespace_of(obj: object) -> Mapping:
        namespace = getattr(obj, "__dict__", None)
        return namespace if isinstance(namespace, Mapping) else {}

    dispatcher.vars = namespace_of
