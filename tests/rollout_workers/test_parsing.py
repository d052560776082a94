from __future__ import annotations

import pytest

from rollout_workers.chat import tool_call_text
from rollout_workers.parsing import parse_tool_calls

TOOLS = {
    "add": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    }
}


def test_valid_calls_in_order() -> None:
    text = "thinking " + tool_call_text("add", {"a": 1, "b": 2}) + " and " + tool_call_text("add", {"a": 3, "b": 4})
    calls = parse_tool_calls(text, TOOLS)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 1, "b": 2}, None), ("add", {"a": 3, "b": 4}, None)]
    assert calls[0].raw == '{"name": "add", "arguments": {"a": 1, "b": 2}}'


def test_arguments_given_as_a_json_string_are_accepted() -> None:
    calls = parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>', TOOLS)
    assert calls[0].error is None and calls[0].arguments == {"a": 1, "b": 2}


@pytest.mark.parametrize(
    ("text", "kind", "words"),
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', "format", "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "format", "JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', "format", "no string 'name'"),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "format", "must be a JSON object"),
        ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}', "format", "never closed"),
        ('stray</tool_call>', "format", "without a matching"),
        ('<tool_call>{"name": "mul", "arguments": {"a": 1}}</tool_call>', "unknown_tool", "unknown tool 'mul'"),
        ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', "bad_arguments", "'b' is a required property"),
        ('<tool_call>{"name": "add", "arguments": {"a": "1", "b": 2}}</tool_call>', "bad_arguments", "at a"),
    ],
)
def test_problems_become_recorded_errors(text: str, kind: str, words: str) -> None:
    calls = parse_tool_calls(text, TOOLS)
    assert len(calls) == 1
    assert calls[0].error_kind == kind
    assert words in (calls[0].error or "")


def test_too_many_calls_in_one_turn() -> None:
    text = tool_call_text("add", {"a": 1, "b": 2}) * 3
    calls = parse_tool_calls(text, TOOLS, max_calls=2)
    assert [c.error_kind for c in calls] == [None, None, "format"]
