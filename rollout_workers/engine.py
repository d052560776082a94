"""The inference engine behind the agent loop: token ids in, sampled ids + logprobs out.

Continuous batching, the way vLLM serving works: one engine thread steps the engine for as long as it
has live sequences, and each episode `submit`s its next turn the moment its previous tool call returns;
the new request joins the running batch at the next step. Nobody waits for the slowest sequence of a
batch, and the engine does not idle between turns.

`ContinuousBatchingEngine` is that scheduler over four hooks (add a request, step, has unfinished,
apply weights); `rollout_workers.vllm_engine.VLLMEngine` implements the hooks on vLLM's `LLMEngine` (our
model through the model/vllm_plugin registration, or any HF model vLLM supports). Weights are pushed into the running
engine in place (`load_weights`), never by restarting it: a push waits until the turns submitted before
it have finished (turns submitted after it wait for it), so it lands between engine steps and every turn
is sampled by exactly one weight version.

Multi-turn sessions (`EngineConfig.keep_turn_state`): a turn that carries its episode's key and extends
that episode's previous turn continues the same vLLM request (a streaming-input session), so the engine
keeps the episode's KV cache and recurrent state between turns and prefills only the ids inserted since.
Without it every turn is a new request that prefills its context again from the last whole cached block
(a hybrid model's state is cached only at aligned blocks). A weight push ends every session: their KV
came from the old weights.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from rollout_workers.sampling import SamplingConfig

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")


class EngineFailed(RuntimeError):
    """The engine's step loop broke: this engine serves nothing more (its worker must be replaced)."""


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
    keep_turn_state: bool = Field(
        True,
        description="Keep an episode's KV cache (and recurrent state) in the engine between its turns, as a "
        "vLLM streaming-input session: a later turn prefills only the ids inserted since, not its whole "
        "context (prefix caching reuses whole blocks only; a hybrid model's state only at aligned blocks).",
    )


@dataclass
class TurnRequest:
    prompt_ids: list[int]
    max_tokens: int
    seed: int | None = None
    # the episode's key: an engine that keeps turn state continues the episode's previous turn when
    # prompt_ids extends that turn's context, and prefills only the new ids
    session: str | None = None
    # neither the end-of-sequence token nor a stop id ends the turn before this many tokens (vLLM's
    # min_tokens); a replay of recorded turns sets it to max_tokens to sample each turn's recorded length
    min_tokens: int = 0


@dataclass
class TurnOutput:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (end-of-turn token) | "length"
    weight_version: int


@dataclass
class FinishedTurn:
    """What a step hook reports for a request that finished in that step."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass
class EngineCounters:
    """Cumulative engine-thread counters (read any time; deltas give rates)."""

    steps: int = 0
    step_seconds: float = 0.0  # wall time inside engine steps
    sequence_steps: int = 0  # sum over steps of the sequences live in that step
    finished_turns: int = 0
    sampled_tokens: int = 0

    def copy(self) -> EngineCounters:
        return EngineCounters(**vars(self))


class Engine(Protocol):
    tokenizer: PreTrainedTokenizerBase
    weight_version: int

    def submit(
        self, request: TurnRequest, sampling: SamplingConfig, stop_token_ids: list[int]
    ) -> concurrent.futures.Future[TurnOutput]:
        """Queue one policy turn; it joins the running batch at the next engine step."""

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace the policy weights in place, between turns; later turns record `version`."""

    def counters(self) -> EngineCounters:
        """A copy of the engine's cumulative step counters."""

    def end_session(self, session: str) -> None:
        """The episode `session` is over: free whatever the engine kept for its turns."""


def request_seed(base: int | None, *parts: object) -> int | None:
    """A stable per-request seed from the config seed and an episode/turn key."""
    if base is None:
        return None
    digest = hashlib.blake2b(repr((base, *parts)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


@dataclass
class _Add:
    request: TurnRequest
    sampling: SamplingConfig
    stop_token_ids: list[int]
    future: concurrent.futures.Future[TurnOutput]


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: concurrent.futures.Future[Any]
    drain: bool  # wait until every earlier turn has finished (a barrier for later ones)


@dataclass
class _Stop:
    future: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)


_Command = _Add | _Call | _Stop


class ContinuousBatchingEngine(ABC):
    """The continuous-batching scheduler on one engine thread; subclasses supply the engine hooks.

    Commands (submitted turns, calls such as a weight push) are applied in submission order between
    engine steps. A draining call is a barrier: it runs once the engine has no live sequence, and the
    turns submitted after it are held until it has run.
    """

    tokenizer: PreTrainedTokenizerBase

    def __init__(self, weight_version: int = 0) -> None:
        self.weight_version = weight_version
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._backlog: deque[_Command] = deque()
        self._running: dict[str, tuple[concurrent.futures.Future[TurnOutput], int]] = {}
        self._ids = itertools.count()
        self._counters = EngineCounters()
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._closed = False

    # ---------------------------------------------------------------- hooks (engine thread only)
    @abstractmethod
    def _add(self, request_id: str, request: TurnRequest, sampling: SamplingConfig, stop_token_ids: list[int]) -> None:
        """Add one request to the engine (it runs from the next step on)."""

    @abstractmethod
    def _step(self) -> list[FinishedTurn]:
        """One engine step over every live sequence; the requests that finished in it."""

    @abstractmethod
    def _num_unfinished(self) -> int:
        """Live sequences (added and not finished)."""

    @abstractmethod
    def _apply_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Replace the weights in place (called with no live sequence)."""

    def _end_session(self, session: str) -> None:  # noqa: B027 - optional: most engines keep nothing
        """Free what the engine kept for the episode's turns."""

    # ---------------------------------------------------------------- public API (any thread)
    def submit(
        self, request: TurnRequest, sampling: SamplingConfig, stop_token_ids: list[int]
    ) -> concurrent.futures.Future[TurnOutput]:
        future: concurrent.futures.Future[TurnOutput] = concurrent.futures.Future()
        self._send(_Add(request, sampling, list(stop_token_ids), future))
        return future

    def generate(self, requests: list[TurnRequest], sampling: SamplingConfig, stop_token_ids: list[int]) -> list[TurnOutput]:
        """Submit every request and wait for all of them (a convenience over `submit`)."""
        futures = [self.submit(r, sampling, stop_token_ids) for r in requests]
        return [f.result() for f in futures]

    def call(self, fn: Callable[[], T], *, drain: bool = True) -> T:
        """Run `fn` on the engine thread between steps and return its result. With `drain`, it runs
        after every turn submitted before it has finished and before any turn submitted after it."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._send(_Call(fn, future, drain))
        return future.result()

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        def apply() -> None:
            self._apply_weights(state_dict)
            self.weight_version = version

        self.call(apply, drain=True)

    def counters(self) -> EngineCounters:
        return self._counters.copy()

    def end_session(self, session: str) -> None:
        """Free what the engine kept for the episode `session` (applied between steps; does not wait)."""
        if self._failure is None and not self._closed:
            self._send(_Call(lambda: self._end_session(session), concurrent.futures.Future(), drain=False))

    def close(self) -> None:
        """Stop the engine thread (turns still queued or running fail); idempotent."""
        with self._start_lock:
            self._closed = True
            thread = self._thread
        if thread is None or not thread.is_alive():
            return
        stop = _Stop()
        self._inbox.put(stop)
        stop.future.result()

    # ---------------------------------------------------------------- engine thread
    def _send(self, command: _Command) -> None:
        if self._failure is not None:
            raise EngineFailed(f"the engine failed earlier: {self._failure!r}") from self._failure
        with self._start_lock:
            if self._closed:
                raise RuntimeError("the engine was closed")
            if self._thread is None:
                # Not the thread that built the engine: on vLLM's CPU backend that thread has its OpenMP
                # threads pinned, which measured several times slower on a shared machine.
                self._thread = threading.Thread(target=self._main, name="taper-engine", daemon=True)
                self._thread.start()
        self._inbox.put(command)

    def _main(self) -> None:
        while True:
            if not self._backlog and self._num_unfinished() == 0:
                self._backlog.append(self._inbox.get())  # idle: sleep until there is work
            while True:
                try:
                    self._backlog.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            stop = self._admit()
            if stop is not None:
                self._fail_all(RuntimeError("the engine was closed"))
                stop.future.set_result(None)
                return
            if self._num_unfinished():
                try:
                    self._run_step()
                except BaseException as e:  # the engine is broken: fail everything, accept nothing more
                    self._failure = e
                    failed = EngineFailed(f"an engine step failed: {e!r}")
                    failed.__cause__ = e
                    self._fail_all(failed)
                    return

    def _admit(self) -> _Stop | None:
        """Apply queued commands in order, up to a draining call that must wait for live sequences."""
        while self._backlog:
            command = self._backlog[0]
            if isinstance(command, _Call) and command.drain and self._num_unfinished():
                return None
            self._backlog.popleft()
            if isinstance(command, _Stop):
                return command
            if not command.future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            if isinstance(command, _Add):
                request_id = f"taper-{next(self._ids)}"
                try:
                    self._add(request_id, command.request, command.sampling, command.stop_token_ids)
                except Exception as e:  # a bad request fails alone
                    command.future.set_exception(e)
                else:
                    self._running[request_id] = (command.future, self.weight_version)
            else:
                try:
                    command.future.set_result(command.fn())
                except Exception as e:
                    command.future.set_exception(e)
        return None

    def _run_step(self) -> None:
        live = self._num_unfinished()
        t0 = time.perf_counter()
        finished = self._step()
        c = self._counters
        c.step_seconds += time.perf_counter() - t0
        c.steps += 1
        c.sequence_steps += live
        for turn in finished:
            future, version = self._running.pop(turn.request_id)
            c.finished_turns += 1
            c.sampled_tokens += len(turn.token_ids)
            future.set_result(TurnOutput(turn.token_ids, turn.logprobs, turn.finish_reason, version))

    def _fail_all(self, error: BaseException) -> None:
        for future, _ in self._running.values():
            future.set_exception(error)
        self._running.clear()
        while True:
            try:
                self._backlog.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for command in self._backlog:
            if isinstance(command, _Stop):
                command.future.set_result(None)
            elif command.future.set_running_or_notify_cancel():
                command.future.set_exception(error)
        self._backlog.clear()
