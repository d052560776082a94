"""Turn the text of one policy turn into tool calls; every problem becomes a recorded error, never an
exception."""

from __future__ import annotations

import json
from typing import Any

from rollout_workers.environments.base import check_arguments
from rollout_workers.trajectory import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def has_tool_call_markup(text: str) -> bool:
    return OPEN in text or CLOSE in text


def parse_tool_calls(text: str, tools: dict[str, dict[str, Any]], max_calls: int = 4) -> list[ToolCall]:
    """All `<tool_call>` spans of `text`, in order. A call that cannot run carries `error`/`error_kind`
    ("format", "unknown_tool", "bad_arguments"); a valid one has name and arguments and no error."""
    calls: list[ToolCall] = []
    pos = 0
    while True:
        start = text.find(OPEN, pos)
        stray = text.find(CLOSE, pos)
        if stray != -1 and (start == -1 or stray < start):
            calls.append(_error(text[pos:stray].strip()[-200:], f"{CLOSE} without a matching {OPEN}", "format"))
            pos = stray + len(CLOSE)
            continue
        if start == -1:
            break
        end = text.find(CLOSE, start + len(OPEN))
        if end == -1:
            calls.append(_error(text[start + len(OPEN):], f"{OPEN} is never closed by {CLOSE}", "format"))
            break
        calls.append(_parse_one(text[start + len(OPEN):end], tools))
        pos = end + len(CLOSE)
    for extra in calls[max_calls:]:
        extra.name = extra.arguments = None
        extra.error, extra.error_kind = f"too many tool calls in one turn (max {max_calls})", "format"
    return calls


def _parse_one(raw: str, tools: dict[str, dict[str, Any]]) -> ToolCall:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return _error(raw, f"tool call is not valid JSON: {e.msg} at position {e.pos}", "format")
    if not isinstance(obj, dict):
        return _error(raw, "tool call must be a JSON object with 'name' and 'arguments'", "format")
    name, arguments = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str):
        return _error(raw, "tool call has no string 'name'", "format")
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return _error(raw, "'arguments' is a string that is not valid JSON", "format", name=name)
    if not isinstance(arguments, dict):
        return _error(raw, "'arguments' must be a JSON object", "format", name=name)
    if name not in tools:
        return _error(raw, f"unknown tool {name!r}; available: {', '.join(sorted(tools))}", "unknown_tool",
                      name=name, arguments=arguments)
    problem = check_arguments(tools[name], arguments)
    if problem:
        return _error(raw, problem, "bad_arguments", name=name, arguments=arguments)
    return ToolCall(raw=raw, name=name, arguments=arguments)


def _error(raw: str, error: str, kind: str, name: str | None = None, arguments: dict[str, Any] | None = None) -> ToolCall:
    return ToolCall(raw=raw, name=name, arguments=arguments, error=error, error_kind=kind)
