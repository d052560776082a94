"""The inference engine behind the agent loop: token ids in, sampled ids + logprobs out.

`Engine` is the interface the loop needs; `VLLMEngine` implements it on `vllm.LLM` (our model through
the model/vllm_plugin registration, or any HF model vLLM supports). Weights are pushed into the
running engine in place (`load_weights`), never by restarting it.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from rollout_workers.sampling import SamplingConfig

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model_dir: str
    tokenizer_dir: str | None = None
    max_model_len: int = Field(2048, ge=16)
    kv_cache_gib: float = Field(1.0, gt=0.0)
    dtype: str = Field("auto", description="'auto' = float32 on CPU, bfloat16 on GPU.")
    seed: int = 0
    enforce_eager: bool = True
    max_num_seqs: int = Field(256, ge=1)
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0, description="GPU only; ignored on CPU.")
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = Field(
        "processed_logprobs", description="processed = after temperature/top-p, i.e. the sampling policy."
    )
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for vllm.LLM.")


@dataclass
class TurnRequest:
    prompt_ids: list[int]
    max_tokens: int
    seed: int | None = None


@dataclass
class TurnOutput:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (end-of-turn token) | "length"
    weight_version: int


class Engine(Protocol):
    tokenizer: PreTrainedTokenizerBase
    weight_version: int

    def generate(self, requests: list[TurnRequest], sampling: SamplingConfig, stop_token_ids: list[int]) -> list[TurnOutput]:
        """One policy turn for each request, batched."""

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace the policy weights in place; later turns record `version`."""


def request_seed(base: int | None, *parts: object) -> int | None:
    """A stable per-request seed from the config seed and an episode/turn key."""
    if base is None:
        return None
    digest = hashlib.blake2b(repr((base, *parts)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def _on_cpu() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return True


class VLLMEngine:
    """`vllm.LLM` behind the Engine interface; generate/load_weights are serialised on one engine
    thread, so a weight push lands between turns and every turn has exactly one weight version."""

    def __init__(self, config: EngineConfig, weight_version: int = 0) -> None:
        from transformers import AutoTokenizer
        from vllm import LLM  # heavy imports, only where an engine is built

        self.config = config
        tokenizer_dir = config.tokenizer_dir or config.model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        dtype = config.dtype
        if dtype == "auto":
            dtype = "float32" if _on_cpu() else "bfloat16"
        kwargs: dict[str, Any] = dict(
            model=config.model_dir,
            tokenizer=tokenizer_dir,
            dtype=dtype,
            seed=config.seed,
            max_model_len=config.max_model_len,
            enforce_eager=config.enforce_eager,
            max_num_seqs=config.max_num_seqs,
            logprobs_mode=config.logprobs_mode,
        )
        if _on_cpu():
            kwargs["kv_cache_memory_bytes"] = int(config.kv_cache_gib * (1 << 30))
        else:
            kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        kwargs.update(config.engine_kwargs)
        if _on_cpu():
            skip_cpu_generator_rewind()
        self.llm = LLM(**kwargs)
        self.weight_version = weight_version
        # Every engine call runs on this one thread: it serialises generate and load_weights (a push
        # lands between turns), and on vLLM's CPU backend the thread that built the engine has its
        # OpenMP threads pinned, which measured several times slower on a shared machine.
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="taper-vllm")

    def generate(self, requests: list[TurnRequest], sampling: SamplingConfig, stop_token_ids: list[int]) -> list[TurnOutput]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not requests:
            return []
        params = [
            SamplingParams(
                n=1,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else -1,
                max_tokens=r.max_tokens,
                seed=r.seed,
                logprobs=0,  # the sampled token's logprob only
                stop_token_ids=stop_token_ids,
                detokenize=False,
                skip_special_tokens=False,
            )
            for r in requests
        ]
        prompts = [TokensPrompt(prompt_token_ids=r.prompt_ids) for r in requests]

        def run() -> tuple[int, list[Any]]:
            return self.weight_version, self.llm.generate(prompts, params, use_tqdm=False)

        version, outs = self._thread.submit(run).result()
        results = []
        for out in outs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            logprobs = [float(lp[t].logprob) for t, lp in zip(ids, c.logprobs or [], strict=True)]
            reason = "length" if c.finish_reason == "length" else "stop"
            results.append(TurnOutput(ids, logprobs, reason, version))
        return results

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        def run() -> None:
            load_weights_into_llm(self.llm, state_dict)
            self.weight_version = version

        self._thread.submit(run).result()


def load_weights_into_llm(llm: Any, state_dict: Mapping[str, torch.Tensor]) -> None:
    """The one place that knows how to update a running vLLM engine's weights in memory.

    Our model (model.vllm_plugin) goes through its `push_weights`; any other vLLM model through vLLM's
    in-place `reload_weights` (HF parameter names). The prefix cache is dropped afterwards: its KV
    blocks were computed with the old weights.
    """
    if _serves_plugin_model(llm):
        from model.vllm_plugin.weight_sync import push_weights

        push_weights(llm, state_dict)  # resets the prefix cache itself; once more below is harmless
    else:
        # vLLM's in-place reload: loads checkpoint-format (HF-named) tensors layer by layer and re-runs
        # each layer's post-load processing (on CPU the linear layers keep repacked copies, so a
        # plain model.load_weights would not reach the kernels).
        llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": list(state_dict.items()), "is_checkpoint_format": True}
        )
    llm.reset_prefix_cache()


def skip_cpu_generator_rewind() -> None:
    """vLLM rewinds a seeded request's generator after a partial prefill (the hybrid model's state cache
    prefills in block-aligned chunks), which CPU generators cannot do: "CPU Generator does not use
    offset". Without the rewind the discarded sample still consumes its draws, identically in every run,
    so seeded rollouts stay reproducible (which is all exact resume needs). Idempotent."""
    import numpy as np
    from vllm.v1.worker import gpu_model_runner as gmr

    original = gmr.GPUModelRunner._bookkeeping_sync
    if getattr(original, "_taper_cpu_rewind_patch", False):
        return

    def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
        gens = self.input_batch.generators
        idx = np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]
        held = {int(i): gens.pop(int(i)) for i in idx if int(i) in gens and gens[int(i)].device.type == "cpu"}
        try:
            return original(self, *args, **kwargs)
        finally:
            gens.update(held)

    patched._taper_cpu_rewind_patch = True  # type: ignore[attr-defined]
    gmr.GPUModelRunner._bookkeeping_sync = patched


def _serves_plugin_model(llm: Any) -> bool:
    modules = llm.apply_model(lambda model: type(model).__module__)
    return any(m.startswith("model.") for m in modules)
