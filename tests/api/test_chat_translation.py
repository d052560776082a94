"""The pure parts of /v1/chat/completions' translation (no engine): tool calls out of a choice's text, the text a
stream holds back while it may begin a call, and refusals that never reach an engine."""

from __future__ import annotations

import json

from api.chat_completions import _parses_tools, _StreamedChoice, split_tool_calls
from api.chat_schemas import ChatCompletionRequest
from rollout_workers.chat import tool_call_text

ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}


def _request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "hi"}], **kw)


def test_tool_calls_out_of_the_text() -> None:
    tools = _parses_tools(_request(tools=[{"type": "function", "function": ADD}]))
    two = "Let me add. " + tool_call_text("add", {"a": 1}) + "\n" + tool_call_text("add", {"a": 2})
    content, calls = split_tool_calls(two, tools)
    assert content == "Let me add." and [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1}, {"a": 2}]
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)
    assert len(split_tool_calls(two, tools, parallel=False)[1]) == 1
    # markup that does not parse stays text; so does any text without tools in the request
    for broken in ("<tool_call>{not json}</tool_call>", "<tool_call>" + '{"name": "add"', "a </tool_call> b"):
        assert split_tool_calls(broken, tools) == (broken, None)
    assert split_tool_calls(two, None) == (two, None)
    assert _parses_tools(_request(tools=[{"type": "function", "function": ADD}], tool_choice="none")) is None
    # a tool without parameters takes any object
    bare = _parses_tools(_request(tools=[{"type": "function", "function": {"name": "now"}}]))
    assert split_tool_calls(tool_call_text("now", {}), bare)[1][0]["function"]["name"] == "now"


def test_a_stream_holds_back_only_what_may_begin_a_call() -> None:
    choice = _StreamedChoice(tools={"add": ADD})
    pieces = ["Sum", " it <", "tool", "_call>{\"name\": ", "\"add\"}</tool_call>"]
    assert [choice.feed(p) for p in pieces] == ["Sum", " it ", "", "", ""]
    assert choice.in_call and choice.held.startswith("<tool_call>")
    plain = _StreamedChoice(tools={"add": ADD})
    assert [plain.feed(p) for p in ["a <", "b", " <t", "x"]] == ["a ", "<b", " ", "<tx"]
    assert _StreamedChoice(tools=None).feed("<tool_call>") == "<tool_call>"


def test_refusals_before_any_engine(api) -> None:
    url, h = "/v1/chat/completions", api.h()
    bad_schema = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                  "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}
    r = api.client.post(url, json=bad_schema, headers=h)
    assert r.status_code == 422 and r.json()["error"]["param"] == "tools.0.function.parameters"
    r = api.client.post(url, json={"model": "tiny", "messages": [{"role": "tool", "content": "5"}]}, headers=h)
    assert r.status_code == 422 and r.json()["error"]["param"] == "messages.0"
    assert "tool_call_id" in r.json()["error"]["message"]
    r = api.client.post(url, json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                   "stream_options": {"include_usage": True}}, headers=h)
    assert r.status_code == 422 and r.json()["error"]["param"] == "stream_options"
    r = api.client.post(url, json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, headers=h)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert api.client.app.state.chat_engines.started == 0
