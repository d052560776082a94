"""An environment whose tools live on an MCP server, over streamable HTTP (registration kind `mcp`).

At registration `list_mcp_tools` connects, lists the server's tools and the registry stores their schemas.
Each episode opens its own MCP session in `reset` and closes it in `close`; tool calls go through
`tools/call` with the registration's timeout, retries (connection failures only) and concurrency limit.
A result's text content becomes the tool message; a result with `isError` is shown to the model as a tool
error (`ToolError`), not an infrastructure failure; a server that cannot be reached is one (the episode
ends `env_error` or `tool_timeout` and is excluded from advantages). Tasks come from a task file or the
job; a stdio MCP server is never run on the cluster.

Targets are tenant-chosen: every connection goes through `AsyncPinnedTransport` (net_guard's rule: resolve,
check against the operator's allow-list, connect to the checked address); redirects are not followed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import httpx2
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.types import PaginatedRequestParams

from rollout_workers.environments.base import (
    Environment,
    ToolError,
    extract_answer,
    final_answer_text,
    task_messages,
)
from rollout_workers.environments.http_env import MAX_TOOL_ERROR_CHARS, HttpOptions
from rollout_workers.net_guard import AllowList, request_targets
from rollout_workers.retry import Retryable, acall_with_retries

if TYPE_CHECKING:
    from rollout_workers.environments.registry import EnvironmentRegistration
    from rollout_workers.trajectory import Trajectory

MAX_TOOLS = 128  # tools one environment exposes (after a registration's `tools` filter)
MAX_LISTED_TOOLS = 4096  # tools a server may list at registration (all pages)
MAX_LISTED_PAGES = 256
MAX_RESULT_CHARS = 64 * 1024
T = TypeVar("T")


class AsyncPinnedTransport(httpx2.AsyncHTTPTransport):
    """net_guard.PinnedTransport for the MCP SDK's async client: each request's host is resolved (in a
    thread) and checked, and the connection goes to a checked address; proxies are never used."""

    def __init__(self, allow: AllowList, **kwargs: Any) -> None:
        super().__init__(trust_env=False, **kwargs)
        self.allow = allow

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        url = request.url
        host, addresses, named = await asyncio.to_thread(request_targets, url, self.allow)  # DNS blocks
        last_error: httpx2.ConnectError | None = None
        for ip in addresses:
            request.url = url.copy_with(host=str(ip))
            if named and url.scheme == "https":
                request.extensions = {**request.extensions, "sni_hostname": host}
            try:
                return await super().handle_async_request(request)
            except httpx2.ConnectError as exc:
                last_error = exc
            finally:
                request.url = url
        assert last_error is not None
        raise last_error


class McpSession:
    """One MCP session, owned by a task of its own (the SDK's task groups must be left by the task that
    entered them, and an episode's calls each run in their own task)."""

    def __init__(self, url: str, allow: AllowList, timeout_s: float) -> None:
        self.url, self.allow, self.timeout_s = url, allow, timeout_s
        self.session: ClientSession | None = None
        self.failure: BaseException | None = None
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._owner: asyncio.Task[None] | None = None

    async def open(self) -> ClientSession:
        self._owner = asyncio.get_running_loop().create_task(self._own())
        try:
            await asyncio.wait_for(self._ready.wait(), self.timeout_s)
        except TimeoutError:
            self._owner.cancel()  # a server that accepts the connection but never initializes
            raise RuntimeError(f"MCP server {self.url}: no session within {self.timeout_s}s") from None
        if self.session is None:
            raise RuntimeError(f"MCP server {self.url}: {_describe(self.failure)}")
        return self.session

    async def _own(self) -> None:
        try:
            timeout = httpx2.Timeout(self.timeout_s, read=max(self.timeout_s, 30.0))
            async with (
                httpx2.AsyncClient(transport=AsyncPinnedTransport(self.allow), timeout=timeout,
                                   follow_redirects=False, trust_env=False) as http,
                streamable_http_client(self.url, http_client=http) as (read, write),
                ClientSession(read, write, read_timeout_seconds=self.timeout_s) as session,
            ):
                await session.initialize()
                self.session = session
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:  # noqa: BLE001 - recorded; the episode's calls report it
            self.failure = exc
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self.session = None if self.failure is not None else self.session
            self._ready.set()

    async def close(self) -> None:
        self._stop.set()
        if self._owner is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self._owner, self.timeout_s)


# What the SDK says when the answer is HTTP but not JSON-RPC: a plain web service, not an MCP endpoint
_NOT_JSON_RPC = ("Failed to parse JSON response", "validation error", "Unexpected content type")
NOT_AN_MCP_ENDPOINT = ("not an MCP endpoint: it answers HTTP, but not MCP's JSON-RPC; base_url must be the server's "
                       "streamable HTTP endpoint (often .../mcp). A plain HTTP tool server registers as kind 'http'")


def _describe(exc: BaseException | None) -> str:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if exc is None:
        return "the session ended"
    text = str(exc)
    if any(marker in text for marker in _NOT_JSON_RPC):
        return NOT_AN_MCP_ENDPOINT
    return f"{type(exc).__name__}: {text[:500]}"


def run_coroutine(factory: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine to completion from synchronous code (in a fresh thread when a loop is running)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())  # type: ignore[arg-type]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(factory())).result()  # type: ignore[arg-type]


def list_mcp_tools(url: str, allow: AllowList, timeout_s: float) -> list[dict[str, Any]]:
    """Every tool the server lists (all pages, following `nextCursor`; at most MAX_LISTED_TOOLS) as {name,
    description, parameters}; raises RuntimeError saying what went wrong."""

    async def list_tools() -> list[dict[str, Any]]:
        session = McpSession(url, allow, timeout_s)
        tools: list[Any] = []
        try:
            client = await session.open()
            cursor: str | None = None
            for _ in range(MAX_LISTED_PAGES):
                params = PaginatedRequestParams(cursor=cursor) if cursor is not None else None
                listed = await asyncio.wait_for(client.list_tools(params=params), timeout_s)
                tools += listed.tools
                cursor = listed.next_cursor
                if cursor is None or len(tools) > MAX_LISTED_TOOLS:
                    break
            else:
                raise RuntimeError(f"MCP server {url}: still paging after {MAX_LISTED_PAGES} pages of tools")
        except TimeoutError:
            raise RuntimeError(f"MCP server {url} did not answer within {timeout_s}s") from None
        finally:
            await session.close()
        if len(tools) > MAX_LISTED_TOOLS:
            raise RuntimeError(f"MCP server {url} lists more than {MAX_LISTED_TOOLS} tools")
        return [{"name": t.name, "description": t.description or "", "parameters": dict(t.input_schema)}
                for t in tools]

    return run_coroutine(list_tools)


def result_text(result: Any) -> str:
    """The text content of a tools/call result (other content kinds are named, not inlined)."""
    parts = []
    for block in result.content:
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else f"[{getattr(block, 'type', 'content')} content]")
    text = "\n".join(parts)
    return text if len(text) <= MAX_RESULT_CHARS else text[:MAX_RESULT_CHARS] + "\n[output truncated]"


_SLOTS: dict[tuple[int, str], asyncio.Semaphore] = {}


def _slots(reg: EnvironmentRegistration) -> asyncio.Semaphore:
    """The registration's concurrency limit on this event loop."""
    key = (id(asyncio.get_running_loop()), reg.model_dump_json())
    if key not in _SLOTS:
        _SLOTS[key] = asyncio.Semaphore(reg.concurrency)
    return _SLOTS[key]


class McpEnvironment(Environment):
    """Subclassed per registration by the registry (`config` and `allow` set on the subclass)."""

    config: ClassVar[EnvironmentRegistration]
    allow: ClassVar[AllowList] = AllowList()
    cooperative = True  # only awaits; the session's own task lives on the same loop
    Options = HttpOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.Options.model_validate(options)
        self.mcp: McpSession | None = None

    def tools(self) -> list[dict[str, Any]]:
        return list(self.config.tools or [])

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.task = task
        self.mcp = McpSession(str(self.config.base_url), self.allow, self.config.timeout_s)
        await self.mcp.open()
        return task_messages(task)

    async def call(self, tool: str, args: dict[str, Any]) -> str:
        reg = self.config

        async def attempt() -> Any:
            session = self.mcp.session if self.mcp is not None else None
            if session is None:
                raise RuntimeError(f"MCP session lost: {_describe(self.mcp.failure if self.mcp else None)}")
            try:
                async with _slots(reg):
                    return await asyncio.wait_for(session.call_tool(tool, args), reg.timeout_s)
            except TimeoutError:
                raise TimeoutError(f"MCP server {reg.base_url}: no answer to {tool} within {reg.timeout_s}s") from None
            except Exception as exc:  # connection failures are retried (rollout_workers.retry), then reported
                raise Retryable(_describe(exc)) from exc

        try:
            result = await acall_with_retries(attempt, reg.retries, reg.backoff_s)
        except Retryable as exc:
            raise RuntimeError(f"MCP server {reg.base_url}: {tool} failed after {reg.retries + 1} attempts: "
                               f"{exc}") from None
        if result.is_error:
            raise ToolError(result_text(result)[:MAX_TOOL_ERROR_CHARS] or f"{tool} failed")
        return result_text(result)

    def outcome(self, trajectory: Trajectory) -> float:
        """Without a declared grader: the stated answer equals the task's `answer`."""
        final = extract_answer(final_answer_text(trajectory))
        expected = trajectory.task.get("answer")
        return float(final is not None and expected is not None and final.strip() == str(expected).strip())

    async def close(self) -> None:
        if self.mcp is not None:
            await self.mcp.close()
            self.mcp = None

