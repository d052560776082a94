"""The chat template as the agent loop uses it: render the prompt once, then only ever tokenise the text
the loop inserts (tool messages and the next assistant header). Sampled ids are never re-tokenised."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_PLACEHOLDER = "\u2063TAPER_ASSISTANT_CONTENT\u2063"
# a conversation up to an assistant turn: the loop's inserted text is what rendering tool messages after it adds
_TOOL_TURN_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PLACEHOLDER}]


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """The span the chat template renders for a structured tool call (json.dumps default spacing)."""
    return '<tool_call>{"name": ' + json.dumps(name) + ', "arguments": ' + json.dumps(arguments) + "}</tool_call>"


def as_template_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": t} for t in tools]


class ChatFormat:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if tokenizer.chat_template is None:
            raise ValueError("tokenizer: has no chat template")
        self.tokenizer = tokenizer
        self.eos_token_id: int = tokenizer.eos_token_id
        self.eos_text: str = tokenizer.eos_token
        stops = {tokenizer.eos_token_id}
        if tokenizer.pad_token_id is not None and tokenizer.pad_token == "<|endoftext|>":
            stops.add(tokenizer.pad_token_id)
        self.stop_token_ids: list[int] = sorted(stops)
        before = self._before_tool_messages = self.render(_TOOL_TURN_BASE, None, add_generation_prompt=False)
        # what the template writes after an assistant message's content (e.g. "<|im_end|>\n")
        self._closing = before[before.index(_PLACEHOLDER) + len(_PLACEHOLDER):]

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=as_template_tools(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )

    def encode(self, text: str) -> list[int]:
        # A fast tokenizer's own backend gives the same ids without the wrapper's batch path, which
        # drops and retakes the GIL: under a busy engine thread each retake waited milliseconds.
        backend = getattr(self.tokenizer, "backend_tokenizer", None) if self.tokenizer.is_fast else None
        if backend is not None:
            return list(backend.encode(text, add_special_tokens=False).ids)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def render_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> tuple[str, list[int]]:
        text = self.render(messages, tools, add_generation_prompt=True)
        return text, self.encode(text)

    def observation_text(self, tool_messages: list[dict[str, Any]], ended_with_eos: bool) -> str:
        """The text inserted after a policy turn: the rest of the assistant closing (the policy already
        wrote the end-of-turn token when `ended_with_eos`), the tool messages, the next assistant header."""
        before = self._before_tool_messages
        after = self.render(_TOOL_TURN_BASE + tool_messages, None, add_generation_prompt=True)
        if not after.startswith(before):
            raise RuntimeError("chat template: rendering tool messages changed the text before them")
        closing = self._closing
        if ended_with_eos:
            if not closing.startswith(self.eos_text):
                raise RuntimeError(f"chat template: assistant turns do not end with {self.eos_text!r}")
            closing = closing[len(self.eos_text):]
        return closing + after[len(before):]
