"""The environment interface every tool environment implements (built-in, python-registered or http).

One `Environment` instance serves one episode: `reset(task)` gives the opening chat messages, the
agent loop calls `call(tool, args)` for each tool call the policy writes, and after the rollout the
reward code asks `outcome(trajectory)` (and optionally `process(trajectory, step_index)`).

Errors: a tool that rejects a call (bad input the *model* caused) raises `ToolError`; the message is
shown to the model as the tool's answer. Any other exception is an environment crash and ends the
episode with status `env_error`.
"""

from __future__ import annotations

import functools
import json
import re
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import jsonschema
from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from rollout_workers.trajectory import Trajectory


class ToolError(Exception):
    """The tool refused the call (the model's fault); the message becomes the tool's answer."""


_TOOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]{0,63}$")


def tool(name: str, description: str, parameters: dict[str, dict[str, Any]],
         required: list[str] | None = None) -> dict[str, Any]:
    """One tool description, {"name", "description", "parameters"}, the function part of an OpenAI-style tool.

    `parameters` maps each argument to its JSON Schema; every argument is required unless `required` lists
    fewer, and no other argument is allowed.
    """
    schema: dict[str, Any] = {"type": "object", "properties": parameters}
    required = list(parameters) if required is None else required
    if required:
        schema["required"] = required
    schema["additionalProperties"] = False
    return {"name": name, "description": description, "parameters": schema}


def validate_tool_schemas(tools: Any, field: str = "tools") -> list[dict[str, Any]]:
    """Check a list of tool descriptions {"name", "description", "parameters": JSON Schema}.

    Raises ValueError naming the offending field.
    """
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"{field}: must be a non-empty list of tool descriptions")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"{field}[{i}]"
        if not isinstance(tool, dict):
            raise ValueError(f"{where}: must be an object with name, description, parameters")
        unknown = set(tool) - {"name", "description", "parameters"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
        name = tool.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise ValueError(f"{where}.name: must match {_TOOL_NAME.pattern}, got {name!r}")
        if name in seen:
            raise ValueError(f"{where}.name: duplicate tool name {name!r}")
        seen.add(name)
        if not isinstance(tool.get("description", ""), str):
            raise ValueError(f"{where}.description: must be a string")
        params = tool.get("parameters")
        if not isinstance(params, dict):
            raise ValueError(f"{where}.parameters: must be a JSON Schema object")
        try:
            jsonschema.Draft202012Validator.check_schema(params)
        except jsonschema.SchemaError as e:
            raise ValueError(f"{where}.parameters: invalid JSON Schema: {e.message}") from None
        if params.get("type") != "object":
            raise ValueError(f"{where}.parameters.type: must be 'object' (tool arguments are a JSON object)")
    return tools


@functools.lru_cache(maxsize=1024)
def _validator(schema_json: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json.loads(schema_json))


def check_arguments(tool: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """None when `arguments` validate against the tool's schema, else a short error message."""
    validator = _validator(json.dumps(tool["parameters"], sort_keys=True))
    error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
    if error is None:
        return None
    path = ".".join(str(p) for p in error.absolute_path)
    return f"invalid arguments for {tool['name']}{' at ' + path if path else ''}: {error.message}"


class EnvironmentOptions(BaseModel):
    """The options a tenant may pass to an environment (constructor and task generator alike): declared
    fields with bounds; anything undeclared is refused. An environment without options keeps this one."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Environment(ABC):
    """A tool environment. Subclasses set `name` and implement the abstract methods (`tools` usually as a
    list of `tool(...)`); `reset` may be left as it is when a task's "question" opens the episode."""

    name: ClassVar[str] = ""
    Options: ClassVar[type[EnvironmentOptions]] = EnvironmentOptions
    # True when every `async def` method only awaits and never blocks its thread (blocking work goes
    # through `asyncio.to_thread` or an async client): the agent loop then runs them on its own event
    # loop, which saves two thread hops per call. Leave False for code that may block: it then runs on
    # its episode's own tools loop, where a blocked call times out without stalling other episodes.
    cooperative: ClassVar[bool] = False

    # A registration's declared rewards, set by the registry's factory (data: reward_models.graders reads them):
    # scoring uses the grader instead of `outcome` and adds the process components; `policy` is the operator's.
    grader_spec: dict[str, Any] | None = None
    process_specs: tuple[dict[str, Any], ...] = ()
    policy: Any = None

    def __init__(self, **options: Any) -> None:
        self.options = options

    @abstractmethod
    def tools(self) -> list[dict[str, Any]]:
        """Tool descriptions: {"name", "description", "parameters": JSON Schema of the arguments}."""

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """Start an episode; return the opening chat messages (the loop adds the tools' system prompt).
        By default: keep the task as `self.task` and open with its `messages` (a task file's chat form) or its
        question as the user's message."""
        self.task = task
        return task_messages(task)

    @abstractmethod
    async def call(self, tool: str, args: dict[str, Any]) -> str:
        """Run one tool call; raise ToolError for a call the model got wrong."""

    @abstractmethod
    def outcome(self, trajectory: Trajectory) -> float:
        """The verifier: final-answer reward in [0, 1]."""

    def process(self, trajectory: Trajectory, step_index: int) -> dict[str, float]:
        """Optional environment-specific process components for one step, each in [0, 1]."""
        return {}

    def process_steps(self, trajectory: Trajectory) -> list[dict[str, float]]:
        """Every step's components (what the reward code calls); override it to judge a whole trajectory
        at once, e.g. in one request."""
        return [dict(self.process(trajectory, i) or {}) for i in range(len(trajectory.steps))]

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **options: Any) -> list[dict[str, Any]]:
        """Seeded task generator; every task has a unique "id"."""
        raise NotImplementedError(f"environment {cls.name!r} has no task generator; supply tasks")

    def demonstration(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """A gold conversation for the task (with tool calls), e.g. for SFT warm-start."""
        raise NotImplementedError(f"environment {self.name!r} has no demonstrations")

    def episode_metadata(self) -> dict[str, Any]:
        """Copied into Trajectory.metadata after reset (e.g. a remote session id)."""
        return {}

    async def close(self) -> None:  # noqa: B027 - optional hook, deliberately not abstract
        """Release per-episode resources."""


# ---------------------------------------------------------------- helpers shared by the built-ins

_ANSWER = re.compile(r"answer\s*(?:is|:)\s*(.+?)\s*\.?\s*$", re.IGNORECASE | re.DOTALL)


def final_answer_text(trajectory: Trajectory) -> str | None:
    """The text of the final assistant turn, if the episode ended with one."""
    if not trajectory.steps or not trajectory.steps[-1].is_final:
        return None
    return trajectory.steps[-1].action_text


def extract_answer(text: str | None) -> str | None:
    """"... The answer is 444." -> "444"; None when the text states no answer."""
    if not text:
        return None
    text = text.replace("<|im_end|>", "").strip()
    m = _ANSWER.search(text)
    return m.group(1).strip() if m else None


def parse_int(text: str | None) -> int | None:
    if text is None:
        return None
    m = re.fullmatch(r"\s*(-?\d[\d,]*)\s*", text)
    return int(m.group(1).replace(",", "")) if m else None


def task_messages(task: dict[str, Any]) -> list[dict[str, Any]]:
    """The opening messages of a task: its `messages` (a task file's chat form), or its `question` (or
    `prompt`) as the user's message."""
    if isinstance(task.get("messages"), list):
        return [dict(m) for m in task["messages"]]
    return [{"role": "user", "content": str(task.get("question", task.get("prompt", "")))}]


def tool_call_message(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """An assistant message with one structured tool call (the chat template renders the span)."""
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }
