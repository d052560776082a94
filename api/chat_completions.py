"""OpenAI's chat completions over Taper's chat engines: a request becomes the engine's call
(rollout_workers.chat_engine.ChatCall), the engine's events become a `chat.completion` or the
`chat.completion.chunk`s of a stream (server-sent events ending with `data: [DONE]`), as OpenAI sends them.

Tool calls are what the model writes in the chat template's format, `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` (parsed by rollout_workers.parsing): with `tools` in the request, a choice whose spans all parse is
answered as `tool_calls` (finish_reason `tool_calls`), its other text as the content. While streaming, text that
may begin a tool call is held back until it is clear whether it does."""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from api.chat_schemas import ChatCompletionRequest, Message
from rl_service.control.chat_engines import ChatRequestError, ChatStream
from rl_service.control.quota import ChatSettings
from rollout_workers.parsing import CLOSE, OPEN, parse_tool_calls

_SPAN = re.compile(re.escape(OPEN) + r".*?" + re.escape(CLOSE), re.DOTALL)


def _text(content: Any) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


def template_message(m: Message) -> dict[str, Any]:
    """A message as the chat template takes it (a developer message is a system message)."""
    if m.role in ("system", "developer"):
        return {"role": "system", "content": _text(m.content)}
    if m.role == "assistant":
        out: dict[str, Any] = {"role": "assistant", "content": _text(m.content)}
        if m.tool_calls:
            out["tool_calls"] = [{"type": "function", "function": {"name": c.function.name,
                                                                   "arguments": c.function.arguments}}
                                 for c in m.tool_calls]
        return out
    return {"role": m.role, "content": _text(m.content)}


def engine_call(req: ChatCompletionRequest, limits: ChatSettings) -> dict[str, Any]:
    """The engine's call for a request, refusing what the operator's bounds do not allow (400 naming the field)."""
    n = req.n or 1
    if n > limits.max_n:
        raise ChatRequestError(f"n: at most {limits.max_n} choices per request here", "n")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if max_tokens is not None and max_tokens > limits.max_completion_tokens:
        raise ChatRequestError(f"{param}: {max_tokens} is above this service's limit of {limits.max_completion_tokens} "
                               "tokens per choice", param)
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    if top_p == 0.0:  # only the most likely token is left: greedy
        temperature, top_p = 0.0, 1.0
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return {
        "messages": [template_message(m) for m in req.messages],
        "tools": [t.function.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
        "n": n, "temperature": temperature, "top_p": top_p, "max_tokens": max_tokens,
        "max_tokens_cap": limits.max_completion_tokens, "stop": stop, "seed": req.seed,
        "logprobs": (req.top_logprobs or 0) if req.logprobs else None,
        "presence_penalty": req.presence_penalty or 0.0, "frequency_penalty": req.frequency_penalty or 0.0,
        "logit_bias": {int(k): float(v) for k, v in req.logit_bias.items()} if req.logit_bias else None,
    }


def _parses_tools(req: ChatCompletionRequest) -> dict[str, dict[str, Any]] | None:
    """The request's tools by name when the answer may call them."""
    if not req.tools or req.tool_choice == "none":
        return None
    return {t.function.name: {"parameters": {"type": "object"}, **t.function.model_dump(exclude_none=True)}
            for t in req.tools}


def split_tool_calls(text: str, tools: dict[str, dict[str, Any]] | None, parallel: bool = True,
                     ) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(content, tool_calls) of a choice's text. Spans that do not all parse leave the whole text as the content."""
    if tools is None or OPEN not in text:
        return text, None
    calls = parse_tool_calls(text, tools, max_calls=64)
    if not calls or any(c.error_kind == "format" or c.name is None for c in calls):
        return text, None
    if not parallel:
        calls = calls[:1]
    content = _SPAN.sub("", text).strip() or None
    return content, [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
                      "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]


def _logprob_entries(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode()),
             "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in e["top"]]}
            for e in entries]


@dataclass
class _Choice:
    text: str = ""
    tokens: int = 0
    logprobs: list[dict[str, Any]] | None = None
    finish: str | None = None


def _finish(reason: str, calls: list[dict[str, Any]] | None) -> str:
    if calls:
        return "tool_calls"
    return "length" if reason == "length" else "stop"


def _usage(prompt_tokens: int, choices: list[Any]) -> dict[str, int]:
    completion = sum(c.tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


async def completion(req: ChatCompletionRequest, stream: ChatStream) -> dict[str, Any]:
    """The whole `chat.completion` of a request that does not stream."""
    choices = [_Choice(logprobs=[] if req.logprobs else None) for _ in range(req.n or 1)]
    try:
        async for batch in stream.events:
            for e in batch:
                c = choices[e["index"]]
                c.text += e["text"]
                c.tokens += len(e["token_ids"])
                if c.logprobs is not None and e["logprobs"]:
                    c.logprobs += e["logprobs"]
                c.finish = e["finish_reason"] or c.finish
    finally:
        await stream.events.aclose()
    tools = _parses_tools(req)
    out = []
    for i, c in enumerate(choices):
        content, calls = split_tool_calls(c.text, tools, req.parallel_tool_calls is not False)
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if calls:
            message["tool_calls"] = calls
        out.append({"index": i, "message": message, "finish_reason": _finish(c.finish or "stop", calls),
                    "logprobs": {"content": _logprob_entries(c.logprobs), "refusal": None}
                    if c.logprobs is not None else None})
    return {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
            "model": req.model, "choices": out, "usage": _usage(stream.prompt_tokens, choices),
            "system_fingerprint": None}


@dataclass
class _StreamedChoice:
    """One choice while it streams: the text held back because it may begin a tool call."""

    tools: dict[str, dict[str, Any]] | None
    held: str = ""
    in_call: bool = False
    tokens: int = 0
    finish: str | None = None

    def feed(self, text: str) -> str:
        """The part of `text` that can be sent now."""
        if self.tools is None:
            return text
        if self.in_call:
            self.held += text
            return ""
        self.held += text
        at = self.held.find(OPEN)
        if at != -1:
            self.in_call = True
        else:  # keep a tail that may be the start of OPEN
            at = len(self.held)
            for k in range(min(len(OPEN) - 1, len(self.held)), 0, -1):
                if self.held.endswith(OPEN[:k]):
                    at = len(self.held) - k
                    break
        ready, self.held = self.held[:at], self.held[at:]
        return ready


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def chunks(req: ChatCompletionRequest, stream: ChatStream) -> AsyncIterator[str]:
    """The server-sent events of a streamed request, as OpenAI sends them."""
    cid, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
    usage_too = bool(req.stream_options and req.stream_options.include_usage)
    tools = _parses_tools(req)
    parallel = req.parallel_tool_calls is not False
    choices = [_StreamedChoice(tools) for _ in range(req.n or 1)]

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None,
              logprobs: list[dict[str, Any]] | None = None) -> str:
        body: dict[str, Any] = {
            "id": cid, "object": "chat.completion.chunk", "created": created, "model": req.model,
            "system_fingerprint": None,
            "choices": [{"index": index, "delta": delta, "logprobs": None if logprobs is None else
                         {"content": _logprob_entries(logprobs), "refusal": None}, "finish_reason": finish}]}
        if usage_too:
            body["usage"] = None
        return _sse(body)

    try:
        for i in range(len(choices)):
            yield chunk(i, {"role": "assistant", "content": "", "refusal": None})
        async for batch in stream.events:
            for e in batch:
                i, c = e["index"], choices[e["index"]]
                c.tokens += len(e["token_ids"])
                ready = c.feed(e["text"])
                if ready or e["logprobs"]:
                    yield chunk(i, {"content": ready}, logprobs=e["logprobs"] if req.logprobs else None)
                if e["finish_reason"] is None:
                    continue
                content, calls = split_tool_calls(c.held, tools, parallel) if c.held else (None, None)
                if calls:
                    if content:
                        yield chunk(i, {"content": content})
                    for k, call in enumerate(calls):
                        yield chunk(i, {"tool_calls": [{"index": k, **call}]})
                elif c.held:
                    yield chunk(i, {"content": c.held})
                yield chunk(i, {}, _finish(e["finish_reason"], calls))
        if usage_too:
            yield _sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                        "system_fingerprint": None, "choices": [], "usage": _usage(stream.prompt_tokens, choices)})
    except Exception as exc:  # after the 200 has gone out: OpenAI's error object as the last event
        message = getattr(exc, "message", None) or "internal error"
        yield _sse({"error": {"message": message, "type": "api_error", "param": None, "code": "engine_unavailable"}})
    finally:
        await stream.events.aclose()
    yield "data: [DONE]\n\n"
