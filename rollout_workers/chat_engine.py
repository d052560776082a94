"""`ChatEngineHost`: one vLLM engine that answers chat requests for the API's `/v1/chat/completions`.

It renders a conversation with the checkpoint's chat template (rollout_workers/chat.py), samples it with vLLM's
sampling parameters (n choices, temperature, top-p, stop strings, seeds, top logprobs, penalties) and streams each
choice's new text, ids and logprobs as the engine produces them. One engine thread steps vLLM's `LLMEngine` for as
long as any request is live, and a request joins the running batch at the next step (continuous batching, as in
rollout_workers/engine.py): concurrent requests share the engine. `ChatEngine` is the same class as a threaded
Ray actor; the API's translation to OpenAI's objects and the engines' lifetimes live above this layer.
"""

from __future__ import annotations

import os
import queue
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import ray
from pydantic import BaseModel, ConfigDict, Field

from rollout_workers.chat import ChatFormat
from rollout_workers.engine import EngineConfig
from rollout_workers.vllm_engine import build_llm


class ChatCall(BaseModel):
    """One chat request as the engine takes it (already checked against the operator's bounds)."""

    model_config = ConfigDict(extra="forbid")

    messages: list[dict[str, Any]] = Field(min_length=1, description="Chat-template messages.")
    tools: list[dict[str, Any]] | None = Field(None, description="Function definitions (name, description, parameters).")
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1, description="None: up to max_tokens_cap or the end of the context.")
    max_tokens_cap: int = Field(ge=1, description="The operator's bound on one choice's sampled tokens.")
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    logprobs: int | None = Field(None, ge=0, description="None: no logprobs; k: the sampled token's and the top k.")
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None


class ChatInputError(ValueError):
    """A request the engine cannot run (its conversation does not render or does not fit); `param` names it."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def preset_model_dir(preset: str, seed: int = 0) -> str:
    """A preset's fresh weights (what a job starting from the preset begins with, seed 0) in a new directory."""
    import torch

    from model.config import TaperConfig
    from model.modeling import TaperForCausalLM
    from model.tokenizer import load_tokenizer

    torch.manual_seed(seed)
    out = tempfile.mkdtemp(prefix=f"taper-chat-{preset}-")
    TaperForCausalLM(TaperConfig.preset(preset)).save_pretrained(out, safe_serialization=True)
    load_tokenizer().save_pretrained(out)
    return out


class ChatEngineHost:
    """A vLLM engine for chat requests; `stream` runs one request (its n choices) and yields event batches."""

    def __init__(self, config: EngineConfig, preset: str | None = None) -> None:
        # In-process vLLM engine core: one process per engine, as the rollout workers run theirs.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from transformers import AutoTokenizer

        if preset is not None:
            config = config.model_copy(update={"model_dir": preset_model_dir(preset), "tokenizer_dir": None})
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_dir or config.model_dir)
        self.chat = ChatFormat(self.tokenizer)
        self.llm = build_llm(config)
        self._engine = self.llm.llm_engine
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        # vLLM request id -> (its call's event queue, the choice's index, the top logprobs asked for)
        self._live: dict[str, tuple[queue.SimpleQueue[dict[str, Any]], int, int]] = {}
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="taper-chat-engine", daemon=True)
        self._thread.start()

    def ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "max_model_len": self.config.max_model_len, "failed": self._failure is not None}

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """The ids the engine samples after: the conversation rendered with the generation prompt."""
        try:
            return self.chat.render_prompt(messages, tools)[1]
        except Exception as e:  # the template's own refusals (jinja's TemplateError, a missing key)
            raise ChatInputError(f"messages: the chat template cannot render them: {e}", "messages") from None

    def _sampling(self, call: ChatCall, prompt_len: int) -> list[Any]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        limit = self.config.max_model_len
        room = limit - prompt_len
        max_tokens = call.max_tokens or min(call.max_tokens_cap, room)
        if room < 1 or prompt_len + max_tokens > limit:
            raise ChatInputError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion.", "messages", "context_length_exceeded")
        return [SamplingParams(
            n=1, temperature=call.temperature, top_p=call.top_p, max_tokens=max_tokens,
            seed=None if call.seed is None else call.seed + i, stop=list(call.stop) or None,
            stop_token_ids=self.chat.stop_token_ids, logprobs=call.logprobs,
            presence_penalty=call.presence_penalty, frequency_penalty=call.frequency_penalty,
            logit_bias=call.logit_bias, detokenize=True, skip_special_tokens=True,
            output_kind=RequestOutputKind.DELTA,
        ) for i in range(call.n)]

    def stream(self, call_id: str, call: dict[str, Any]) -> Iterator[list[dict[str, Any]]]:
        """Run one request. The first batch is `[{"type": "prompt", "prompt_tokens": N}]` or `[{"type": "error",
        "message", "param", "code"}]`; then batches of `{"type": "delta", "index", "text", "token_ids", "logprobs",
        "finish_reason"}` (finish_reason None until the choice's last delta: "stop", "length" or "abort")."""
        request = ChatCall.model_validate(call)
        try:
            ids = self.prompt_ids(request.messages, request.tools)
            params = self._sampling(request, len(ids))
        except ChatInputError as e:
            yield [{"type": "error", "message": str(e), "param": e.param, "code": e.code}]
            return
        if self._failure is not None:
            raise RuntimeError(f"the chat engine failed earlier: {self._failure!r}")
        out: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._inbox.put(("add", call_id, ids, params, out))
        yield [{"type": "prompt", "prompt_tokens": len(ids)}]
        pending = len(params)
        try:
            while pending:
                batch = [out.get()]
                while True:
                    try:
                        batch.append(out.get_nowait())
                    except queue.Empty:
                        break
                for event in batch:
                    if event["type"] == "failed":
                        raise RuntimeError(event["message"])
                    pending -= event["finish_reason"] is not None
                yield batch
        finally:
            if pending:  # the consumer went away (or the engine failed): free the request's sequences
                self.abort(call_id)

    def abort(self, call_id: str) -> None:
        """Stop a request's choices (each ends with finish_reason "abort"); nothing if it has finished."""
        self._inbox.put(("abort", call_id))

    # ---------------------------------------------------------------- engine thread
    def _main(self) -> None:
        while True:
            if not self._live:
                self._apply(self._inbox.get())  # idle: sleep until there is work
            while True:
                try:
                    self._apply(self._inbox.get_nowait())
                except queue.Empty:
                    break
            if not self._live:
                continue
            try:
                outputs = self._engine.step()
            except BaseException as e:  # the engine is broken: fail every request, accept nothing more
                self._failure = e
                for q, _, _ in self._live.values():
                    q.put({"type": "failed", "message": f"an engine step failed: {e!r}"})
                self._live.clear()
                return
            for out in outputs:
                q, index, top_k = self._live[out.request_id]
                c = out.outputs[0]
                if c.finish_reason is None and not c.token_ids:
                    continue
                finish = None if c.finish_reason is None else ("length" if c.finish_reason == "length" else "stop")
                if finish is not None:
                    del self._live[out.request_id]
                q.put({"type": "delta", "index": index, "text": c.text, "token_ids": list(c.token_ids),
                       "logprobs": self._logprobs(c, top_k) if c.logprobs is not None else None, "finish_reason": finish})

    def _apply(self, command: tuple[Any, ...]) -> None:
        from vllm.inputs import TokensPrompt

        if command[0] == "add":
            _, call_id, ids, params, q = command
            for i, p in enumerate(params):
                request_id = f"{call_id}-{i}"
                try:
                    self._engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(ids)), p)
                except Exception as e:  # a request vLLM refuses fails alone
                    q.put({"type": "failed", "message": f"the engine refused the request: {e}"})
                    continue
                self._live[request_id] = (q, i, p.logprobs or 0)
        elif command[0] == "abort":
            prefix = f"{command[1]}-"
            doomed = [rid for rid in self._live if rid.startswith(prefix)]
            if doomed:
                self._engine.abort_request(doomed)
            for rid in doomed:
                q, index, _ = self._live.pop(rid)
                q.put({"type": "delta", "index": index, "text": "", "token_ids": [], "logprobs": None,
                       "finish_reason": "abort"})

    def _logprobs(self, c: Any, top_k: int) -> list[dict[str, Any]]:
        """Per sampled token: its text, logprob and the top alternatives (text, logprob) by rank; none for the
        end-of-turn token, which is not part of the message."""
        stops = set(self.chat.stop_token_ids)
        out = []
        for token_id, candidates in zip(c.token_ids, c.logprobs, strict=True):
            if token_id in stops and c.finish_reason is not None:
                continue
            ranked = sorted(candidates.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
            top = [(self._text(k, v), float(v.logprob)) for k, v in ranked if v.rank is not None and v.rank >= 1]
            chosen = candidates[token_id]
            out.append({"token": self._text(token_id, chosen), "logprob": float(chosen.logprob),
                        "top": top[:top_k]})
        return out

    def _text(self, token_id: int, logprob: Any) -> str:
        text = logprob.decoded_token
        return text if text is not None else self.tokenizer.decode([token_id])


ChatEngine = ray.remote(ChatEngineHost)
