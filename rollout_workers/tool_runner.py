"""Run environment calls off the agent loop's event loop, with a timeout that always returns.

Coroutines (the `async def` Environment methods) run on a per-episode tools event loop in its own
thread (a "lane"); plain functions run in a shared thread pool. The agent loop's own event loop runs no
environment code by default: an environment that blocks inside `async def` stalls only its own episode,
whose call times out, and the blocked loop is abandoned. An environment that declares itself
cooperative (its coroutines only await, never block) has its coroutines run on the caller's loop: beside
a busy engine thread each hop between threads waits for the GIL, and the two hops of a call cost a few
milliseconds, more than a tool that answers at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


class _LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._main, name="taper-tools-loop", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        # stopped: cancel what is left (e.g. a hung call that timed out) and close cleanly
        leftover = asyncio.all_tasks(self.loop)
        for task in leftover:
            task.cancel()
        if leftover:
            self.loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))
        self.loop.close()

    def stop(self) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)

    def cancel_leftovers(self) -> None:
        """Cancel whatever the last episode's environment left running here (on the loop's own thread)."""

        def cancel_all() -> None:
            for task in asyncio.all_tasks(self.loop):
                task.cancel()

        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(cancel_all)


class ToolRunner:
    """Shared by the episodes of a worker: a thread pool for plain calls, and `lane()` for each
    episode's own tools event loop (an environment instance belongs to one episode, so a blocked
    environment can only stall its own episode). A lane's loop thread goes back to an idle list when
    its episode ends without a timed-out call, and the next lane reuses it: starting a thread and an
    event loop per episode cost the agent loop measurable CPU at high concurrency."""

    def __init__(self, max_threads: int = 64, max_idle_loops: int = 512) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_threads, thread_name_prefix="taper-tools")
        self.retired_loops = 0
        self.max_idle_loops = max_idle_loops
        self._idle_loops: list[_LoopThread] = []
        self._idle_lock = threading.Lock()

    def lane(self) -> ToolLane:
        return ToolLane(self)

    def _take_loop(self) -> _LoopThread:
        with self._idle_lock:
            if self._idle_loops:
                return self._idle_loops.pop()
        return _LoopThread()

    def _give_back_loop(self, lt: _LoopThread) -> None:
        lt.cancel_leftovers()
        with self._idle_lock:
            if len(self._idle_loops) < self.max_idle_loops:
                self._idle_loops.append(lt)
                return
        lt.stop()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._idle_lock:
            idle, self._idle_loops = self._idle_loops, []
        for lt in idle:
            lt.stop()


class ToolLane:
    def __init__(self, runner: ToolRunner) -> None:
        self._runner = runner
        self.cooperative = False  # run coroutines on the caller's event loop (see the module docstring)
        self._loop_thread: _LoopThread | None = None
        self._timed_out = False  # a loop that saw a timeout is never reused

    async def run(self, fn: Callable[[], Awaitable[T] | T], timeout_s: float) -> T:
        return (await self.run_timed(fn, timeout_s))[0]

    async def run_timed(self, fn: Callable[[], Awaitable[T] | T], timeout_s: float) -> tuple[T, float]:
        """`fn()` is a coroutine (run on this lane's loop, or on the caller's when the lane is
        cooperative) or a plain call (run in the pool). Returns its value and how long it ran where it ran
        (queueing on the agent loop excluded); TimeoutError after `timeout_s`."""
        lt, cfut = None, None
        is_coroutine = inspect.iscoroutinefunction(fn) or _returns_coroutine(fn)
        if is_coroutine and self.cooperative:
            work: Awaitable[tuple[T, float]] = _await_timed(fn)
        else:
            if is_coroutine:
                if self._loop_thread is None:
                    self._loop_thread = self._runner._take_loop()
                lt = self._loop_thread
                cfut = asyncio.run_coroutine_threadsafe(_await_timed(fn), lt.loop)
            else:
                cfut = self._runner._pool.submit(_call_timed, fn)
            work = asyncio.wrap_future(cfut)
        try:
            return await asyncio.wait_for(work, timeout_s)
        except TimeoutError:
            if cfut is not None:  # a call on the caller's loop was cancelled by wait_for itself
                self._timed_out = True
                cfut.cancel()
            if lt is not None and not await _responsive(lt.loop):
                self._loop_thread = None  # blocked: abandon it (a daemon thread), start afresh if needed
                self._runner.retired_loops += 1
                lt.stop()
            raise TimeoutError(f"no answer within {timeout_s:g}s") from None

    def close(self) -> None:
        if self._loop_thread is not None:
            if self._timed_out:
                self._loop_thread.stop()
            else:
                self._runner._give_back_loop(self._loop_thread)
            self._loop_thread = None


async def _await_timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    value = await fn()
    return value, time.perf_counter() - t0


def _call_timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - t0


def _returns_coroutine(fn: Callable[[], Any]) -> bool:
    # lambdas wrapping an async method: `lambda: env.call(...)`
    target = getattr(fn, "__wrapped_call__", None)
    return target is not None and inspect.iscoroutinefunction(target)


async def _responsive(loop: asyncio.AbstractEventLoop, within_s: float = 0.05) -> bool:
    if loop.is_closed():
        return False
    ping = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop))
    try:
        await asyncio.wait_for(ping, within_s)
        return True
    except TimeoutError:
        return False


def bound(method: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    """`method(*args)` as a zero-argument callable the runner knows to be async or sync."""

    def call() -> Any:
        return method(*args)

    call.__wrapped_call__ = method  # type: ignore[attr-defined]
    return call
