"""The engines behind `/v1/chat/completions`: one Ray actor (rollout_workers.chat_engine.ChatEngine) per tenant and
checkpoint in use, started on the first request for it, shared by that tenant's concurrent requests (the engine
batches them continuously), stopped once no request has used it for `ChatSettings.idle_timeout_s`. A tenant keeps
at most its quota's `max_chat_engines` running: a request for another model stops the tenant's least recently
used idle engine to make room, or is refused (429) while all of them are answering.

`model` is what a job may start from (rl_service.spec.CHECKPOINT_REF: `JOB_ID`, `JOB_ID:STEP`, `base:NAME`, or a
preset's fresh weights), resolved by the service's own rules: the tenant's checkpoints and those another tenant
gave it permission to use; anything else is the 404 of a model that does not exist."""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_service.control.quota import ChatSettings
from rl_service.control.service import (
    InvalidInput,
    NotFound,
    Principal,
    QuotaExceeded,
    ServiceError,
    TaperService,
)
from rl_service.spec import CHECKPOINT_REF

log = logging.getLogger(__name__)


class ChatRequestError(ServiceError):
    """A request OpenAI answers with 400 (`param` names the field; `code` e.g. context_length_exceeded)."""

    status = 400

    def __init__(self, message: str, field: str | None, code: str | None = None) -> None:
        super().__init__(message, field)
        self.code = code or "invalid_request"


class EngineUnavailable(ServiceError):
    status, code = 503, "engine_unavailable"


@dataclass
class _Engine:
    tenant: str
    model: str  # as the tenant named it when the engine started
    actor: Any
    ready: Any  # the ObjectRef of its first ping: resolves once vLLM has loaded the model
    last_used: float
    in_flight: int = 0
    failed: bool = False


@dataclass
class ChatStream:
    """An accepted request: its prompt's length and its event batches (rollout_workers.chat_engine's events)."""

    prompt_tokens: int
    events: AsyncIterator[list[dict[str, Any]]]
    engine_key: tuple[str, str] = field(default=("", ""))


class ChatEngines:
    """The running chat engines, keyed by (tenant, the checkpoint directory or preset they serve)."""

    def __init__(self, service: TaperService, settings: ChatSettings | None = None, *, ray_address: str | None = None,
                 data_dir: Path | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.service = service
        self.settings = settings or ChatSettings()
        self._ray_address, self._data_dir = ray_address, data_dir
        self._clock = clock
        self._engines: dict[tuple[str, str], _Engine] = {}
        self._lock = threading.Lock()
        self._calls = itertools.count()
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self.started = 0  # engines started so far (tests and metrics)

    # ---- which weights a model names ----
    def resolve(self, p: Principal, model: str) -> str:
        """`preset:NAME`, or the directory of the checkpoint `model` names for this tenant; 404 otherwise."""
        missing = f"The model `{model}` does not exist or you do not have access to it"
        from rl_service.control.openai_compat import PRESETS

        if model in PRESETS:
            if model not in self.service.jobs.limits.model_presets:
                raise NotFound(f"{missing}: the operator offers the presets {self.service.jobs.limits.model_presets}",
                               field="model")
            return f"preset:{model}"
        if not re.fullmatch(CHECKPOINT_REF, model):
            raise NotFound(f"{missing} (a preset, `base:NAME`, `JOB_ID` or `JOB_ID:STEP`).", field="model")
        try:
            return self.service.files.resolve_checkpoint(p, model)
        except InvalidInput as exc:
            reason = exc.message.removeprefix("model.checkpoint: ")
            raise NotFound(f"{missing} ({reason}).", field="model") from None

    # ---- engines ----
    def acquire(self, p: Principal, model: str) -> tuple[tuple[str, str], _Engine]:
        """The running engine for `model` (started if needed, waited for until ready), counted as in use."""
        source = self.resolve(p, model)
        key = (p.tenant, source)
        with self._lock:
            engine = self._engines.get(key)
            if engine is None or engine.failed:
                self._make_room(p.tenant)
                engine = self._engines[key] = self._start(p.tenant, model, source)
            engine.in_flight += 1
            engine.last_used = self._clock()
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            ray.get(engine.ready, timeout=self.settings.start_timeout_s)
        except Exception as exc:
            self._drop(key, engine)
            self.release(engine)
            if isinstance(exc, GetTimeoutError):
                raise EngineUnavailable(f"model: the engine for {model!r} did not start within "
                                        f"{self.settings.start_timeout_s:.0f} s; retry later", field="model") from None
            log.warning("chat engine for %s failed to start: %r", model, exc)
            raise EngineUnavailable(f"model: the engine for {model!r} failed to start: {exc}", field="model") from None
        return key, engine

    def _make_room(self, tenant: str) -> None:
        """Under the lock: stop the tenant's least recently used idle engine if it holds its quota's worth."""
        cap = self.service.tenants.quota_of(tenant).max_chat_engines
        mine = [(k, e) for k, e in self._engines.items() if e.tenant == tenant]
        if len(mine) < cap:
            return
        idle = sorted((e.last_used, k) for k, e in mine if e.in_flight == 0)
        if len(mine) - len(idle) >= cap or cap == 0:
            raise QuotaExceeded(f"model: this tenant may run {cap} chat engine(s) at once (quota max_chat_engines) "
                                "and every one is answering requests; retry when one is idle, or use a model "
                                f"already running ({', '.join(sorted(e.model for _, e in mine)) or 'none'})",
                                field="model")
        for _, k in idle[: len(mine) - cap + 1]:
            self._kill(self._engines.pop(k))

    def _start(self, tenant: str, model: str, source: str) -> _Engine:
        import ray

        from rollout_workers.chat_engine import ChatEngine
        from rollout_workers.engine import EngineConfig

        if not ray.is_initialized():
            from rl_service.control.local_services import ensure_service_ray

            ensure_service_ray(self._ray_address, self._data_dir or self.service.data_dir)
        s = self.settings
        preset = source.removeprefix("preset:") if source.startswith("preset:") else None
        config = EngineConfig(model_dir=source if preset is None else "", max_model_len=s.max_model_len,
                              kv_cache_gib=s.kv_cache_gib, max_num_seqs=s.max_num_seqs,
                              gpu_memory_utilization=s.gpu_memory_utilization, logprobs_mode="raw_logprobs",
                              keep_turn_state=False)
        actor = ChatEngine.options(num_cpus=s.engine_cpus, num_gpus=s.engine_gpus,
                                   max_concurrency=s.max_concurrent_requests + 2).remote(config, preset)
        self.started += 1
        self._start_reaper()
        log.info("starting a chat engine for tenant %s, model %s", tenant, model)
        return _Engine(tenant, model, actor, actor.ping.remote(), self._clock())

    def release(self, engine: _Engine) -> None:
        with self._lock:
            engine.in_flight -= 1
            engine.last_used = self._clock()

    def _drop(self, key: tuple[str, str], engine: _Engine) -> None:
        """Forget a broken engine (the next request starts a fresh one) and stop what is left of it."""
        with self._lock:
            engine.failed = True
            if self._engines.get(key) is engine:
                del self._engines[key]
        self._kill(engine)

    @staticmethod
    def _kill(engine: _Engine) -> None:
        import ray

        try:
            ray.kill(engine.actor)
        except Exception:  # already gone
            pass

    def running(self, tenant: str | None = None) -> list[str]:
        """The models of the running engines (of one tenant)."""
        with self._lock:
            return sorted(e.model for e in self._engines.values() if tenant is None or e.tenant == tenant)

    def reap(self, now: float | None = None) -> list[str]:
        """Stop the engines idle for longer than idle_timeout_s; the models they served."""
        now = self._clock() if now is None else now
        with self._lock:
            idle = [k for k, e in self._engines.items()
                    if e.in_flight == 0 and now - e.last_used > self.settings.idle_timeout_s]
            stopped = [self._engines.pop(k) for k in idle]
        for engine in stopped:
            log.info("stopping the idle chat engine of tenant %s, model %s", engine.tenant, engine.model)
            self._kill(engine)
        return [e.model for e in stopped]

    def _start_reaper(self) -> None:
        if self._reaper is None:
            every = min(30.0, self.settings.idle_timeout_s / 4)
            self._reaper = threading.Thread(target=self._reap_loop, args=(every,), name="taper-chat-reaper",
                                            daemon=True)
            self._reaper.start()

    def _reap_loop(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                self.reap()
            except Exception:  # keep reaping
                log.exception("chat engine reaper")

    def close(self) -> None:
        """Stop every engine (the API is shutting down)."""
        self._stop.set()
        with self._lock:
            engines, self._engines = list(self._engines.values()), {}
        for engine in engines:
            self._kill(engine)

    # ---- requests ----
    async def open(self, p: Principal, model: str, call: dict[str, Any]) -> ChatStream:
        """Start one request (rollout_workers.chat_engine.ChatCall fields) on the model's engine. Refusals (unknown
        model, quota, a conversation that does not fit) raise before anything is sent to the client."""
        key, engine = await asyncio.to_thread(self.acquire, p, model)
        call_id = f"chat-{next(self._calls)}"
        try:
            gen = engine.actor.stream.options(num_returns="streaming").remote(call_id, call)
            first = await (await gen.__anext__())
        except Exception as exc:
            self.release(engine)
            self._drop(key, engine)
            raise EngineUnavailable(f"model: the engine for {model!r} is unavailable: {exc}", field="model") from None
        if first[0]["type"] == "error":
            self.release(engine)
            e = first[0]
            raise ChatRequestError(e["message"], e["param"], e["code"])
        return ChatStream(first[0]["prompt_tokens"], self._events(key, engine, call_id, gen), key)

    async def _events(self, key: tuple[str, str], engine: _Engine, call_id: str,
                      gen: Any) -> AsyncIterator[list[dict[str, Any]]]:
        finished = False
        try:
            async for ref in gen:
                try:
                    batch = await ref
                except Exception as exc:
                    self._drop(key, engine)
                    raise EngineUnavailable(f"the engine for {engine.model!r} failed: {exc}", field="model") from None
                yield batch
            finished = True
        finally:
            if not finished and not engine.failed:  # the client went away: free its sequences
                engine.actor.abort.remote(call_id)
            self.release(engine)
