"""An environment whose tools live on a remote HTTP server (registration kind `http`).

Protocol (JSON over POST, paths relative to the registered base URL):
  /call     {"session", "tool", "arguments"}            -> {"result": str} or {"error": str} (shown to the model)
  /reset    {"task"}                                     -> {"messages": [...], "session": str | null}   (optional)
  /outcome  {"session", "task", "final_answer", "trajectory"} -> {"reward": float}                  (optional)
  /tasks    {"n", "seed", "options"}                     -> {"tasks": [...]}                          (optional)
An optional endpoint answering 404 falls back to: the task's "question" (or "prompt") as the user
message; reward 1.0 when the stated answer equals the task's "answer"; no task generator.

Each request has the registration's timeout; connection errors, 429 and 5xx are retried with
exponential backoff; at most `concurrency` requests per registration are in flight in a process.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING, Any, ClassVar

import httpx

from rollout_workers.environments.base import Environment, ToolError, extract_answer, final_answer_text

if TYPE_CHECKING:
    from rollout_workers.environments.registry import EnvironmentRegistration
    from rollout_workers.trajectory import Trajectory

_SEMAPHORES: dict[tuple[str, str], threading.BoundedSemaphore] = {}
_CLIENTS: dict[tuple[str, str], httpx.Client] = {}
_SEMAPHORES_LOCK = threading.Lock()


class EndpointMissing(Exception):
    pass


def _semaphore(reg: EnvironmentRegistration) -> threading.BoundedSemaphore:
    key = (reg.name, str(reg.base_url))
    with _SEMAPHORES_LOCK:
        if key not in _SEMAPHORES:
            _SEMAPHORES[key] = threading.BoundedSemaphore(reg.concurrency)
        return _SEMAPHORES[key]


def _client(reg: EnvironmentRegistration) -> httpx.Client:
    """One pooled client per registration and process (keeps connections alive; thread-safe)."""
    key = (reg.name, str(reg.base_url))
    with _SEMAPHORES_LOCK:
        if key not in _CLIENTS:
            _CLIENTS[key] = httpx.Client(limits=httpx.Limits(max_connections=reg.concurrency))
        return _CLIENTS[key]


def post_json(reg: EnvironmentRegistration, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST with timeout, retries with backoff and the registration's concurrency limit."""
    url = str(reg.base_url).rstrip("/") + path
    last_error: Exception | None = None
    for attempt in range(reg.retries + 1):
        if attempt:
            time.sleep(reg.backoff_s * 2 ** (attempt - 1))
        with _semaphore(reg):
            try:
                response = _client(reg).post(url, json=body, timeout=reg.timeout_s)
            except httpx.TimeoutException as e:
                raise TimeoutError(f"{url}: no answer within {reg.timeout_s}s") from e
            except httpx.TransportError as e:
                last_error = e
                continue
        if response.status_code == 404:
            raise EndpointMissing(url)
        if response.status_code == 429 or response.status_code >= 500:
            last_error = RuntimeError(f"{url}: HTTP {response.status_code}")
            continue
        if response.status_code >= 400:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.text[:200]}")
        data = response.json()
        if not isinstance(data, dict):
            raise RuntimeError(f"{url}: expected a JSON object, got {type(data).__name__}")
        return data
    raise RuntimeError(f"{url}: failed after {reg.retries + 1} attempts: {last_error}")


class HttpEnvironment(Environment):
    """Subclassed per registration by the registry (`config` set on the subclass)."""

    config: ClassVar[EnvironmentRegistration]
    cooperative = True  # its requests run in threads (asyncio.to_thread)

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.session: str | None = None

    def tools(self) -> list[dict[str, Any]]:
        return list(self.config.tools or [])

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.task = task
        try:
            data = await asyncio.to_thread(post_json, self.config, "/reset", {"task": task})
        except EndpointMissing:
            return [{"role": "user", "content": str(task.get("question", task.get("prompt", "")))}]
        self.session = data.get("session")
        messages = data.get("messages")
        if not isinstance(messages, list):
            raise RuntimeError("/reset: response has no 'messages' list")
        return messages

    def episode_metadata(self) -> dict[str, Any]:
        return {"session": self.session} if self.session is not None else {}

    async def call(self, tool: str, args: dict[str, Any]) -> str:
        body = {"session": self.session, "tool": tool, "arguments": args}
        data = await asyncio.to_thread(post_json, self.config, "/call", body)
        if data.get("error") is not None:
            raise ToolError(str(data["error"]))
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
            data = post_json(self.config, "/outcome", body)
        except EndpointMissing:
            expected = trajectory.task.get("answer")
            return float(final is not None and expected is not None and final.strip() == str(expected).strip())
        return min(1.0, max(0.0, float(data["reward"])))

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **options: Any) -> list[dict[str, Any]]:
        try:
            data = post_json(cls.config, "/tasks", {"n": n, "seed": seed, "options": options})
        except EndpointMissing:
            return super().generate_tasks(n, seed, **options)
        tasks = data.get("tasks")
        if not isinstance(tasks, list) or not all(isinstance(t, dict) and "id" in t for t in tasks):
            raise RuntimeError("/tasks: expected {'tasks': [objects with an 'id']}")
        return tasks
