"""Task files: JSONL, one task per line (the format, shared by the control plane and the job runner;
rl_service.control.task_file_store keeps them per tenant).

A line is a JSON object with a `question` (the user message) or `messages` (the opening chat), an optional
`answer` and `id`, a `metadata` object, and any other fields the graders read as `{{item.FIELD}}` (as in
OpenAI's reinforcement fine-tuning files). A job reads its files with `load_tasks`.

A line whose `messages` end with the assistant's turn is a demonstration (OpenAI's supervised format: assistant
`tool_calls`, `tool` answers, optional `tools`): a supervised job or a warm start learns from the whole
conversation (`load_demonstrations`), and as an RL task it opens with the messages before the first assistant
turn (`load_tasks`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rl_service.json_limits import DEFAULT_MAX_DEPTH, nesting_exceeds

FILE_ID_PATTERN = r"^file-[0-9a-f]{24}$"


class TaskFileLimits(BaseModel):
    """The operator's limits on task files."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="Largest task file.")
    max_lines: int = Field(100_000, ge=1, description="Most tasks in one file.")
    max_line_bytes: int = Field(1024 * 1024, ge=256, description="Longest line (one task).")
    max_json_depth: int = Field(DEFAULT_MAX_DEPTH, ge=8, le=1000,
                                description="Deepest nesting of arrays and objects in a line.")
    max_files: int = Field(100, ge=1, description="Most files a tenant keeps.")


TOOL_NAME = r"^[A-Za-z_][A-Za-z0-9_\-]{0,63}$"


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=TOOL_NAME)
    arguments: str | dict[str, Any] = Field(description="A JSON object, or its text (OpenAI's files).")


class ToolCallLine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(None, max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


class TaskMessage(BaseModel):
    """`developer` (OpenAI's name for instructions in newer files) is kept as `system`. `tool_calls` (on the
    assistant's turns) and `tool` answers appear in demonstrations; `weight` 0 marks an assistant turn not to
    learn from (OpenAI's)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = Field(None, max_length=1_000_000)
    tool_calls: list[ToolCallLine] | None = Field(None, min_length=1, max_length=64)
    tool_call_id: str | None = Field(None, max_length=128)
    name: str | None = Field(None, max_length=64)
    weight: Literal[0, 1] | None = None

    @model_validator(mode="after")
    def _shape(self) -> TaskMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only on the assistant's messages")
        if self.content is None and self.tool_calls is None:
            raise ValueError("content: required (an assistant message may give tool_calls instead)")
        if self.weight is not None and self.role != "assistant":
            raise ValueError("weight: only on the assistant's messages")
        return self


class ToolSpecLine(BaseModel):
    """A tool a demonstration offers, as OpenAI writes it: {"type": "function", "function": {...}}."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: dict[str, Any]


class TaskLine(BaseModel):
    """One task. Fields beyond these are kept for graders (`{{item.FIELD}}`)."""

    model_config = ConfigDict(extra="allow")

    id: str | None = Field(None, min_length=1, max_length=128, description="Unique in the file; default line-N.")
    question: str | None = Field(None, min_length=1, max_length=1_000_000)
    messages: list[TaskMessage] | None = Field(None, min_length=1, max_length=256)
    answer: Any = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    tools: list[ToolSpecLine] | None = Field(None, min_length=1, max_length=128,
                                             description="A demonstration's tools (default: the environment's).")
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _prompt(self) -> TaskLine:
        if self.question is None and self.messages is None:
            raise ValueError("needs a 'question' or 'messages'")
        if self.messages is None:
            return self
        roles = [m.role for m in self.messages]
        if roles[-1] not in ("user", "assistant"):
            raise ValueError("messages: the last message must be the user's (a task) or the assistant's (a "
                             "demonstration)")
        if "assistant" in roles and "user" not in roles[: roles.index("assistant")]:
            raise ValueError("messages: a user message must come before the assistant's first turn")
        for i, m in enumerate(self.messages):
            if m.role == "tool" and (i == 0 or not (roles[i - 1] == "tool" or self.messages[i - 1].tool_calls)):
                raise ValueError(f"messages.{i}: a tool message answers the assistant's tool_calls just before it")
        return self


class TaskFileError(ValueError):
    """An upload that is refused; `status` is the HTTP status it maps to."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


def check_line(raw: bytes, number: int, limits: TaskFileLimits) -> dict[str, Any]:
    if len(raw) > limits.max_line_bytes:
        raise TaskFileError(f"line {number}: longer than {limits.max_line_bytes} bytes")
    if nesting_exceeds(raw, limits.max_json_depth):
        raise TaskFileError(f"line {number}: JSON nested deeper than {limits.max_json_depth} levels")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise TaskFileError(f"line {number}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise TaskFileError(f"line {number}: must be a JSON object, got {type(data).__name__}")
    try:
        task = TaskLine.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        msg = str(err.get("msg", exc)).removeprefix("Value error, ")
        raise TaskFileError(f"line {number}: {where + ': ' if where else ''}{msg}") from None
    out = task.model_dump(exclude_none=True)
    for i, message in enumerate(out.get("messages", [])):
        if message["role"] == "developer":
            message["role"] = "system"
        for j, call in enumerate(message.get("tool_calls", [])):
            arguments = call["function"]["arguments"]
            if isinstance(arguments, str):  # OpenAI's files hold the arguments as JSON text
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    arguments = None
                if not isinstance(arguments, dict):
                    raise TaskFileError(f"line {number}: messages.{i}.tool_calls.{j}.function.arguments: not a JSON "
                                        "object")
                call["function"]["arguments"] = arguments
    out.setdefault("id", f"line-{number}")
    return out


def is_demonstration(line: dict[str, Any]) -> bool:
    """The line is a whole conversation (it ends with the assistant's turn)."""
    messages = line.get("messages") or []
    return bool(messages) and messages[-1]["role"] == "assistant"


def task_of(line: dict[str, Any]) -> dict[str, Any]:
    """The RL task of a line: a demonstration opens with its messages before the assistant's first turn."""
    if not is_demonstration(line):
        return line
    messages = line["messages"]
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    task = {k: v for k, v in line.items() if k not in ("tools", "parallel_tool_calls")}
    task["messages"] = messages[:first]
    return task


def read_tasks(path: Path, limits: TaskFileLimits) -> list[dict[str, Any]]:
    """Every task of a JSONL file, checked; raises TaskFileError naming the first bad line."""
    tasks: list[dict[str, Any]] = []
    ids: dict[str, int] = {}
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            if len(tasks) >= limits.max_lines:
                raise TaskFileError(f"line {number}: more than {limits.max_lines} tasks in one file", status=413)
            task = check_line(raw, number, limits)
            if task["id"] in ids:
                raise TaskFileError(f"line {number}: id {task['id']!r} repeats line {ids[task['id']]}")
            ids[task["id"]] = number
            tasks.append(task)
    if not tasks:
        raise TaskFileError("file: no tasks (an empty file)")
    return tasks


_UNLIMITED = TaskFileLimits.model_construct(max_bytes=2**62, max_lines=2**62, max_line_bytes=2**62, max_files=2**62)


def load_tasks(path: str | Path) -> list[dict[str, Any]]:
    """The tasks of a stored file (checked when it was uploaded, under the limits of that time)."""
    return [task_of(line) for line in read_tasks(Path(path), _UNLIMITED)]


def load_demonstrations(path: str | Path) -> list[dict[str, Any]]:
    """The demonstrations of a stored file (its lines that end with the assistant's turn), whole."""
    found = [line for line in read_tasks(Path(path), _UNLIMITED) if is_demonstration(line)]
    if not found:
        raise ValueError("the file holds no demonstrations (lines whose messages end with the assistant's turn)")
    return found
