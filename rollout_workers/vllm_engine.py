"""`VLLMEngine`: the continuous-batching engine (rollout_workers/engine.py) on vLLM's `LLMEngine`, with
multi-turn sessions, weight pushes into the running engine and exact CPU sampling across pushes."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollout_workers.engine import ContinuousBatchingEngine, EngineConfig, FinishedTurn, TurnRequest
from rollout_workers.sampling import SamplingConfig

if TYPE_CHECKING:
    import torch

def _on_cpu() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return True


class VLLMEngine(ContinuousBatchingEngine):
    """vLLM's `LLMEngine` behind the continuous-batching scheduler (`self.llm` is the `vllm.LLM`)."""

    def __init__(self, config: EngineConfig, weight_version: int = 0) -> None:
        from transformers import AutoTokenizer

        super().__init__(weight_version)
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_dir or config.model_dir)
        self.llm = build_llm(config)
        self._engine = self.llm.llm_engine
        self._supported_tasks = self._engine.get_supported_tasks()
        self._turn_of: dict[str, str] = {}  # live vLLM request id -> the turn's request id
        self._sessions: dict[str, _Session] = {}  # episode key -> its session
        self._session_of: dict[str, _Session] = {}  # the session's vLLM request id -> the session
        self._closing: set[str] = set()  # sessions closed while their turn ran
        self._session_ids = itertools.count()

    def _add(self, request_id: str, request: TurnRequest, sampling: SamplingConfig, stop_token_ids: list[int]) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1,
            max_tokens=request.max_tokens,
            min_tokens=request.min_tokens,
            seed=request.seed,
            logprobs=0,  # the sampled token's logprob only
            stop_token_ids=stop_token_ids,
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
            skip_clone=True,  # built for this request alone: vLLM's defensive deep copy is not needed
        )
        session = self._session_for(request)
        if session is None:
            self._engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(request.prompt_ids)), params)
            self._turn_of[request_id] = request_id
            return
        # a continuation starts with the previous turn's last sampled id: vLLM never computed its KV
        chunk = list(request.prompt_ids[len(session.context) - 1 :]) if session.context else list(request.prompt_ids)
        core_request = self._engine.input_processor.process_inputs(
            session.vllm_id, TokensPrompt(prompt_token_ids=chunk), params,
            supported_tasks=self._supported_tasks, resumable=True,
        )
        core_request.external_req_id = session.vllm_id
        self._engine.output_processor.add_request(core_request, None, None, 0)
        # its own id list: in one process the output processor and the scheduler would otherwise share
        # (and both extend) the prompt list
        own = copy.copy(core_request)
        own.prompt_token_ids = list(chunk)
        self._engine.engine_core.add_request(own)
        session.context = list(request.prompt_ids)
        self._turn_of[session.vllm_id] = request_id

    def _session_for(self, request: TurnRequest) -> _Session | None:
        """The session this turn continues or opens; None for a plain request."""
        if not self.config.keep_turn_state or request.session is None:
            return None
        session = self._sessions.get(request.session)
        if session is not None:
            continues = (session.vllm_id not in self._turn_of and len(request.prompt_ids) > len(session.context)
                         and request.prompt_ids[: len(session.context)] == session.context)
            if continues:
                return session
            self._end_session(request.session)
        # open sessions hold a request slot each: leave room for plain requests and continuations
        if len(self._sessions) >= self.config.max_num_seqs // 2:
            return None
        session = self._sessions[request.session] = _Session(vllm_id=f"session-{next(self._session_ids)}")
        self._session_of[session.vllm_id] = session
        return session

    def _end_session(self, key: str) -> None:
        session = self._sessions.pop(key, None)
        if session is None:
            return
        if session.vllm_id in self._turn_of:
            self._closing.add(session.vllm_id)  # its turn is running: abort once it has finished
        else:
            del self._session_of[session.vllm_id]
            self._engine.abort_request([session.vllm_id])

    def _step(self) -> list[FinishedTurn]:
        finished = []
        for out in self._engine.step():
            c = out.outputs[0]
            if c.finish_reason is None:
                continue
            turn_id = self._turn_of.pop(out.request_id)
            ids = list(c.token_ids)
            logprobs = [float(lp[t].logprob) for t, lp in zip(ids, c.logprobs or [], strict=True)]
            session = self._session_of.get(out.request_id)
            if session is not None:  # a session's outputs run on over its turns: this turn's are the new ones
                ids, logprobs, session.emitted = ids[session.emitted :], logprobs[session.emitted :], len(ids)
                session.context += ids
            if out.request_id in self._closing:
                self._closing.discard(out.request_id)
                del self._session_of[out.request_id]
                self._engine.abort_request([out.request_id])
            reason = "length" if c.finish_reason == "length" else "stop"
            finished.append(FinishedTurn(turn_id, ids, logprobs, reason))
        return finished

    def _num_unfinished(self) -> int:
        return len(self._turn_of)  # sessions between turns are not live: vLLM counts them, we do not step for them

    def _apply_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        for key in list(self._sessions):  # their KV was computed by the old weights
            self._end_session(key)
        load_weights_into_llm(self.llm, state_dict)


def build_llm(config: EngineConfig) -> Any:
    """The `vllm.LLM` an engine config describes (float32 on CPU, bfloat16 on GPU for dtype 'auto')."""
    from vllm import LLM  # heavy import, only where an engine is built

    from model.vllm_plugin import register

    register()  # vLLM finds it through the package's entry point, if installed; a checkout on PYTHONPATH has none
    tokenizer_dir = config.tokenizer_dir or config.model_dir
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
        rewind_cpu_generators_exactly()
    return LLM(**kwargs)


@dataclass
class _Session:
    """An episode's vLLM streaming-input request, kept between its turns."""

    vllm_id: str
    context: list[int] = field(default_factory=list)  # the ids of its last turn: prompt, then sampled
    emitted: int = 0  # output ids vLLM has reported for it so far (they accumulate over turns)


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


CPU_GENERATOR_REWINDS = 0  # discarded samples whose CPU generator was rewound (tests check it is exercised)


def rewind_cpu_generators_exactly() -> None:
    """Make vLLM's generator rewind for discarded samples exact on CPU. Idempotent.

    A request whose prefill is split over several steps (the token budget of a step, or the hybrid
    model's block-aligned state cache) is sampled at the end of every partial step and the sample is
    discarded; vLLM then rewinds the request's generator by its offset, which CPU generators cannot do
    ("CPU Generator does not use offset"). Here the generator state of each request to be discarded is
    saved when the step's inputs are prepared and restored after sampling, so a seeded request samples
    the same tokens however its prefill was split, i.e. whatever else is in the running batch.
    """
    import numpy as np
    from vllm.v1.worker import gpu_model_runner as gmr

    runner = gmr.GPUModelRunner
    if getattr(runner._bookkeeping_sync, "_taper_cpu_rewind_patch", False):
        return
    prepare_inputs, bookkeeping_sync = runner._prepare_inputs, runner._bookkeeping_sync

    def saving_prepare_inputs(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = prepare_inputs(self, *args, **kwargs)
        gens = self.input_batch.generators
        discarded = np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]
        self._taper_saved_generator_states = {
            int(i): gens[int(i)].get_state() for i in discarded if int(i) in gens and gens[int(i)].device.type == "cpu"
        }
        return out

    def restoring_bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        global CPU_GENERATOR_REWINDS
        saved = getattr(self, "_taper_saved_generator_states", {})
        CPU_GENERATOR_REWINDS += len(saved)
        self._taper_saved_generator_states = {}
        gens = self.input_batch.generators
        held = {i: gens.pop(i) for i in saved if i in gens}  # keep them from vLLM's offset rewind
        try:
            return bookkeeping_sync(self, *args, **kwargs)
        finally:
            for i, gen in held.items():
                gen.set_state(saved[i])
            gens.update(held)

    restoring_bookkeeping_sync._taper_cpu_rewind_patch = True  # type: ignore[attr-defined]
    runner._prepare_inputs = saving_prepare_inputs
    runner._bookkeeping_sync = restoring_bookkeeping_sync


def _serves_plugin_model(llm: Any) -> bool:
    modules = llm.apply_model(lambda model: type(model).__module__)
    return any(m.startswith("model.") for m in modules)
