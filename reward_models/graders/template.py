"""What a grader reads: the task (`item`) and the model's answer (`sample`), and `{{...}}` templates over them.

Names mirror OpenAI's RFT graders: `{{item.FIELD}}` is a field of the task (a line of the task file, or a
generated task), `{{sample.output_text}}` the final assistant message. Taper adds `{{sample.answer}}` (what
follows "The answer is" in the final message) and `{{sample.output_tools}}` (the episode's tool calls).
A path that names nothing renders as the empty string; objects and lists render as JSON.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from rollout_workers.environments.base import extract_answer, final_answer_text

if TYPE_CHECKING:
    from rollout_workers.trajectory import Trajectory

MAX_TEMPLATE_CHARS = 4096
MAX_RENDERED_CHARS = 256 * 1024
TEMPLATE = re.compile(r"\{\{\s*(item|sample)((?:\.[A-Za-z0-9_\-]+)*)\s*\}\}")
MISSING = object()


class GraderError(RuntimeError):
    """The grader could not score this sample (its own failure, not the policy's)."""


def sample_of(trajectory: Trajectory) -> dict[str, Any]:
    """The `sample` namespace of one finished trajectory."""
    tools = [{"name": c.name, "arguments": c.arguments, "result": c.result, "error": c.error}
             for s in trajectory.steps for c in s.tool_calls]
    return sample_of_text(final_answer_text(trajectory) or "", tools)


def sample_of_text(text: str, output_tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The `sample` namespace of a final answer's text (and the episode's tool calls)."""
    text = text.replace("<|im_end|>", "").strip()
    try:
        output_json = json.loads(text) if text else None
    except ValueError:
        output_json = None
    return {"output_text": text, "output_json": output_json, "answer": extract_answer(text) or "",
            "output_tools": list(output_tools or [])}


def lookup(namespaces: dict[str, Any], root: str, path: str) -> Any:
    value: Any = namespaces.get(root, MISSING)
    for part in [p for p in path.split(".") if p]:
        if isinstance(value, dict):
            value = value.get(part, MISSING)
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return MISSING
        if value is MISSING:
            return MISSING
    return value


def as_text(value: Any) -> str:
    if value is MISSING or value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, bool | int | float):
        return json.dumps(value)
    return json.dumps(value, sort_keys=True)


def render(template: str, item: dict[str, Any], sample: dict[str, Any]) -> str:
    """Replace every `{{item.x}}` / `{{sample.y}}` in `template`."""
    namespaces = {"item": item, "sample": sample}
    out = TEMPLATE.sub(lambda m: as_text(lookup(namespaces, m.group(1), m.group(2))), template)
    return out[:MAX_RENDERED_CHARS]


def resolve(template: str, item: dict[str, Any], sample: dict[str, Any]) -> Any:
    """A template that is exactly one `{{...}}` yields the value itself (a number, an object); else the text."""
    m = TEMPLATE.fullmatch(template.strip())
    if m:
        value = lookup({"item": item, "sample": sample}, m.group(1), m.group(2))
        return None if value is MISSING else value
    return render(template, item, sample)
