"""Push a learner's state dict into a running vLLM engine, in place, without a restart.

In-process engines (VLLM_ENABLE_V1_MULTIPROCESSING=0) get the tensors by reference through
`collective_rpc` with a function run in the worker. Multiprocess engines get one picklable payload: the
state dict as safetensors bytes, loaded by a worker method. That method comes from
`TaperWorkerExtension` when the engine was built with `**weight_sync_engine_kwargs()`; otherwise the same
function is shipped by cloudpickle, which vLLM allows only with VLLM_ALLOW_INSECURE_SERIALIZATION=1.
Either way the worker calls the model's `load_weights` (HF parameter names, no renaming) and the prefix
cache is reset, so no cached KV / KDA state computed with the old weights is reused.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import torch

WORKER_EXTENSION = "model.vllm_plugin.weight_sync.TaperWorkerExtension"
WORKER_METHOD = "taper_load_weights"


def weight_sync_engine_kwargs() -> dict[str, str]:
    """Extra `vllm.LLM(...)` kwargs that let multiprocess engines take weight pushes without pickling code."""
    return {"worker_extension_cls": WORKER_EXTENSION}


def state_dict_to_bytes(state_dict: Mapping[str, torch.Tensor]) -> bytes:
    """Serialize a state dict (detached, on CPU, contiguous) as safetensors bytes."""
    from safetensors.torch import save

    tensors = {}
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] must be a torch.Tensor, got {type(tensor).__name__}")
        tensors[name] = tensor.detach().to("cpu").contiguous()
    return save(tensors)


def load_into_model(model: torch.nn.Module, weights: Mapping[str, torch.Tensor] | bytes) -> int:
    """Copy weights (a state dict, or safetensors bytes) into a served model; returns how many loaded."""
    if isinstance(weights, bytes | bytearray):
        from safetensors.torch import load

        weights = load(bytes(weights))
    with torch.no_grad():
        loaded = model.load_weights(iter(weights.items()))
    return len(loaded)


def _load_in_worker(worker: Any, weights: Mapping[str, torch.Tensor] | bytes) -> int:
    return load_into_model(worker.get_model(), weights)


class TaperWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`): a weight-load method callable by name."""

    def taper_load_weights(self, payload: bytes) -> int:
        return _load_in_worker(self, payload)


def _is_in_process(llm: Any) -> bool:
    from vllm.v1.engine.core_client import InprocClient

    return isinstance(llm.llm_engine.engine_core, InprocClient)


def push_weights(llm: Any, state_dict: Mapping[str, torch.Tensor]) -> float:
    """Update the engine's weights in place from `state_dict` (HF names); returns the seconds it took.

    Call it between generate() calls (no request in flight). Names the model does not have raise.
    """
    start = time.perf_counter()
    if _is_in_process(llm):
        counts = llm.collective_rpc(_load_in_worker, args=(dict(state_dict),))
    else:
        payload = state_dict_to_bytes(state_dict)
        extension = llm.llm_engine.vllm_config.parallel_config.worker_extension_cls
        if extension == WORKER_EXTENSION:
            counts = llm.collective_rpc(WORKER_METHOD, args=(payload,))
        elif os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") == "1":
            counts = llm.collective_rpc(_load_in_worker, args=(payload,))
        else:
            raise RuntimeError(
                "push_weights into a multiprocess engine needs the engine built with "
                "**weight_sync_engine_kwargs() (worker_extension_cls) or VLLM_ALLOW_INSECURE_SERIALIZATION=1"
            )
    if any(c != len(state_dict) for c in counts):
        raise RuntimeError(f"weight push loaded {counts} tensors per worker, expected {len(state_dict)}")
    llm.reset_prefix_cache()
    return time.perf_counter() - start
