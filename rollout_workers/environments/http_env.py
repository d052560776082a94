"""An environment whose tools live on a remote HTTP server (registration kind `http`).

Protocol (JSON over POST, paths relative to the registered base URL):
  /call     {"session", "tool", "arguments"}            -> {"result": str} or {"error": str} (shown to the model)
  /reset    {"task"}                                     -> {"messages": [...], "session": str | null}   (optional)
  /outcome  {"session", "task", "final_answer", "trajectory"} -> {"reward": float}                  (optional)
  /tasks    {"n", "seed", "options"}                     -> {"tasks": [...]}                          (optional)
  /process  {"session", "task", "trajectory"}            -> {"steps": [{component: float}, ...]}       (optional)
  /demonstration {"task"}                                -> {"messages": [...]}                        (optional)
An optional endpoint answering 404 falls back to: the task's "question" (or "prompt") as the user
message; reward 1.0 when the stated answer equals the task's "answer"; no task generator; no process
components of the environment's own; no demonstrations. /process answers one object per trajectory step,
each value in [0, 1] (clipped), at most MAX_PROCESS_COMPONENTS names of at most 64 characters.

Each request has the registration's timeout; connection errors, 429 and 5xx are retried with exponential
backoff and jitter (a server's Retry-After honoured, capped); at most `concurrency` requests per registration
are in flight in a process.

Targets are tenant-chosen, so every connection goes through net_guard: the host is resolved and checked
against the operator's allow-list on each new request and the connection goes to the checked address;
redirects are not followed; endpoint URLs only ever extend the base URL's path; answers are capped in
size, and an error status comes back as the status code alone (the target's body is never echoed into
a trajectory).
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import httpx
from pydantic import ConfigDict, model_validator

from rollout_workers.environments.base import (
    Environment,
    EnvironmentOptions,
    ToolError,
    extract_answer,
    final_answer_text,
    task_messages,
)
from rollout_workers.net_guard import AllowList, PinnedTransport, TargetRefused, endpoint_url
from rollout_workers.retry import Retryable, call_with_retries, retry_after

if TYPE_CHECKING:
    from rollout_workers.environments.registry import EnvironmentRegistration
    from rollout_workers.trajectory import Trajectory

MAX_RESPONSE_BYTES = 8 * 1024 * 1024
MAX_TOOL_ERROR_CHARS = 2000
MAX_OPTIONS = 32
MAX_OPTIONS_BYTES = 16 * 1024
MAX_PROCESS_COMPONENTS = 16


class HttpOptions(EnvironmentOptions):
    """Options of an http environment are the tool server's own: forwarded as they are to its /tasks
    endpoint, never read by the cluster; bounded in number and size."""

    model_config = ConfigDict(extra="allow", frozen=True)

    @model_validator(mode="after")
    def _bounded(self) -> HttpOptions:
        extra = self.model_extra or {}
        if len(extra) > MAX_OPTIONS:
            raise ValueError(f"at most {MAX_OPTIONS} options")
        if len(json.dumps(extra, default=str)) > MAX_OPTIONS_BYTES:
            raise ValueError(f"at most {MAX_OPTIONS_BYTES} bytes of options (as JSON)")
        return self


class EndpointMissing(Exception):
    pass


@dataclass
class _Target:
    """What a process keeps per registration and allow-list: a pooled client and the concurrency limit."""

    client: httpx.Client
    slots: threading.BoundedSemaphore


_TARGETS: dict[tuple[str, AllowList], _Target] = {}
_TARGETS_LOCK = threading.Lock()


def _target(reg: EnvironmentRegistration, allow: AllowList) -> _Target:
    key = (reg.model_dump_json(), allow)
    with _TARGETS_LOCK:
        if key not in _TARGETS:
            transport = PinnedTransport(allow, limits=httpx.Limits(max_connections=reg.concurrency))
            client = httpx.Client(transport=transport, follow_redirects=False, trust_env=False)
            _TARGETS[key] = _Target(client, threading.BoundedSemaphore(reg.concurrency))
        return _TARGETS[key]


def _read_bounded(response: httpx.Response, where: str) -> bytes:
    chunks, size = [], 0
    for chunk in response.iter_bytes():
        size += len(chunk)
        if size > MAX_RESPONSE_BYTES:
            raise RuntimeError(f"{where}: answer larger than {MAX_RESPONSE_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def post_json(reg: EnvironmentRegistration, endpoint: str, body: dict[str, Any], allow: AllowList) -> dict[str, Any]:
    """POST to `base_url/endpoint` with timeout, retries (rollout_workers.retry: backoff with jitter, the
    server's Retry-After) and the registration's concurrency limit. Raises EndpointMissing on 404,
    RuntimeError naming the status code alone for other errors."""
    url = endpoint_url(str(reg.base_url), endpoint)
    where = f"{reg.base_url} /{endpoint}"
    target = _target(reg, allow)

    def attempt() -> dict[str, Any]:
        with target.slots:
            try:
                with target.client.stream("POST", url, json=body, timeout=reg.timeout_s) as response:
                    status = response.status_code
                    content = _read_bounded(response, where) if 200 <= status < 300 else b""
                    wait = retry_after(response.headers.get("retry-after"))
            except TargetRefused as e:
                raise RuntimeError(f"{where}: target refused: {e}") from None
            except httpx.TimeoutException as e:
                raise TimeoutError(f"{where}: no answer within {reg.timeout_s}s") from e
            except httpx.TransportError as e:
                raise Retryable(str(e) or type(e).__name__) from e
        if status == 404:
            raise EndpointMissing(where)
        if status == 429 or status >= 500:
            raise Retryable(f"{where}: HTTP {status}", retry_after_s=wait)
        if 300 <= status < 400:
            raise RuntimeError(f"{where}: HTTP {status} (redirects are not followed)")
        if not 200 <= status < 300:
            raise RuntimeError(f"{where}: HTTP {status}")
        try:
            data = json.loads(content)
        except ValueError:
            raise RuntimeError(f"{where}: the answer is not JSON") from None
        if not isinstance(data, dict):
            raise RuntimeError(f"{where}: expected a JSON object, got {type(data).__name__}")
        return data

    try:
        return call_with_retries(attempt, reg.retries, reg.backoff_s)
    except Retryable as e:
        raise RuntimeError(f"{where}: failed after {reg.retries + 1} attempts: {e}") from None


def probe(reg: EnvironmentRegistration, allow: AllowList) -> None:
    """Raise RuntimeError with the cause when the tool server at `base_url` does not answer HTTP at all
    (any status counts as an answer: the protocol's endpoints are POST-only and some are optional)."""
    url = str(reg.base_url)
    with httpx.Client(transport=PinnedTransport(allow), follow_redirects=False, trust_env=False) as client:
        try:
            client.get(url, timeout=min(reg.timeout_s, 10.0))
        except TargetRefused as e:
            raise RuntimeError(f"target refused: {e}") from None
        except httpx.TimeoutException:
            raise RuntimeError(f"{url} does not answer within {min(reg.timeout_s, 10.0)}s") from None
        except httpx.TransportError as e:
            raise RuntimeError(f"{url} does not answer: {e or type(e).__name__}") from None


class HttpEnvironment(Environment):
    """Subclassed per registration by the registry (`config` set on the subclass)."""

    config: ClassVar[EnvironmentRegistration]
    allow: ClassVar[AllowList] = AllowList()  # the operator's allow-list, set with `config`
    cooperative = True  # its requests run in threads (asyncio.to_thread)
    Options = HttpOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.Options.model_validate(options)
        self.session: str | None = None

    def _post(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        return post_json(self.config, endpoint, body, self.allow)

    def tools(self) -> list[dict[str, Any]]:
        return list(self.config.tools or [])

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.task = task
        try:
            data = await asyncio.to_thread(self._post, "reset", {"task": task})
        except EndpointMissing:
            return task_messages(task)
        self.session = data.get("session")
        messages = data.get("messages")
        if not isinstance(messages, list):
            raise RuntimeError("/reset: response has no 'messages' list")
        return messages

    def episode_metadata(self) -> dict[str, Any]:
        return {"session": self.session} if self.session is not None else {}

    async def call(self, tool: str, args: dict[str, Any]) -> str:
        body = {"session": self.session, "tool": tool, "arguments": args}
        data = await asyncio.to_thread(self._post, "call", body)
        if data.get("error") is not None:
            raise ToolError(str(data["error"])[:MAX_TOOL_ERROR_CHARS])
        if "result" not in data:
            raise RuntimeError("/call: response has neither 'result' nor 'error'")
        return str(data["result"])

    def outcome(self, trajectory: Trajectory) -> float:
        final = extract_answer(final_answer_text(trajectory))
        body = {
            "session": trajectory.metadata.get("session"),
            "task": trajectory.task,
            "final_answer": final,
            "trajectory": trajectory.model_dump(mode="json", exclude={"prompt_ids"}),
        }
        try:
            data = self._post("outcome", body)
        except EndpointMissing:
            expected = trajectory.task.get("answer")
            return float(final is not None and expected is not None and final.strip() == str(expected).strip())
        return min(1.0, max(0.0, float(data["reward"])))

    def process_steps(self, trajectory: Trajectory) -> list[dict[str, float]]:
        """All steps' components in one request to /process (none when the server has no /process)."""
        body = {
            "session": trajectory.metadata.get("session"),
            "task": trajectory.task,
            "trajectory": trajectory.model_dump(mode="json", exclude={"prompt_ids"}),
        }
        try:
            data = self._post("process", body)
        except EndpointMissing:
            return [{} for _ in trajectory.steps]
        return _process_answer(data, len(trajectory.steps))

    def process(self, trajectory: Trajectory, step_index: int) -> dict[str, float]:
        return self.process_steps(trajectory)[step_index]

    def demonstration(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        try:
            data = self._post("demonstration", {"task": task})
        except EndpointMissing:
            return super().demonstration(task)
        messages = data.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise RuntimeError("/demonstration: expected {'messages': [chat messages]}")
        return messages

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **options: Any) -> list[dict[str, Any]]:
        try:
            data = post_json(cls.config, "tasks", {"n": n, "seed": seed, "options": options}, cls.allow)
        except EndpointMissing:
            return super().generate_tasks(n, seed, **options)
        tasks = data.get("tasks")
        if not isinstance(tasks, list) or not all(isinstance(t, dict) and "id" in t for t in tasks):
            raise RuntimeError("/tasks: expected {'tasks': [objects with an 'id']}")
        return tasks


def _process_answer(data: dict[str, Any], num_steps: int) -> list[dict[str, float]]:
    """Check a /process answer: one object of named values per step; values clipped to [0, 1]."""
    steps = data.get("steps")
    if not isinstance(steps, list) or len(steps) != num_steps:
        raise RuntimeError(f"/process: expected {{'steps': [...]}} with one object per step ({num_steps})")
    out = []
    for i, components in enumerate(steps):
        if not isinstance(components, dict) or len(components) > MAX_PROCESS_COMPONENTS:
            raise RuntimeError(f"/process: steps[{i}] must be an object of at most {MAX_PROCESS_COMPONENTS} values")
        checked = {}
        for name, value in components.items():
            if len(name) > 64 or isinstance(value, bool) or not isinstance(value, int | float):
                raise RuntimeError(f"/process: steps[{i}].{name[:64]} must be a number under a name of <= 64 characters")
            checked[name] = min(1.0, max(0.0, float(value)))
        out.append(checked)
    return out
