"""The tool runner's event-loop threads: reused across episodes, never after a timeout, and an
episode's leftover tasks do not survive into the next one."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rollout_workers.tool_runner import ToolRunner, bound


class Env:
    def __init__(self) -> None:
        self.leftover: asyncio.Task[None] | None = None

    async def where(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    async def spawn(self) -> None:
        self.leftover = asyncio.get_running_loop().create_task(asyncio.sleep(3600))

    async def hang(self) -> None:
        await asyncio.sleep(3600)


def test_loop_threads_are_reused_but_not_after_a_timeout() -> None:
    runner = ToolRunner()

    async def episode(env: Env, *calls: str, timeout_s: float = 1.0) -> list[Any]:
        lane = runner.lane()
        try:
            out = []
            for name in calls:
                try:
                    out.append(await lane.run(bound(getattr(env, name)), timeout_s))
                except TimeoutError:
                    out.append(None)
            return out
        finally:
            lane.close()

    try:
        first_env = Env()
        (first, _) = asyncio.run(episode(first_env, "where", "spawn"))
        (second,) = asyncio.run(episode(Env(), "where"))
        assert second is first  # the same loop (and thread) served the next episode
        assert first_env.leftover is not None
        asyncio.run(asyncio.sleep(0.05))
        assert first_env.leftover.cancelled()  # the first episode's background task did not live on

        (third, timed_out) = asyncio.run(episode(Env(), "where", "hang", timeout_s=0.2))
        assert third is first and timed_out is None
        (fourth,) = asyncio.run(episode(Env(), "where"))
        assert fourth is not third  # a loop that saw a timeout is not handed out again
    finally:
        runner.close()


@pytest.mark.parametrize("max_idle", [0])
def test_idle_list_is_bounded(max_idle: int) -> None:
    runner = ToolRunner(max_idle_loops=max_idle)

    async def where() -> asyncio.AbstractEventLoop:
        lane = runner.lane()
        try:
            return await lane.run(bound(Env().where), 1.0)
        finally:
            lane.close()

    try:
        a, b = asyncio.run(where()), asyncio.run(where())
        assert a is not b and runner._idle_loops == []
    finally:
        runner.close()


def test_a_cooperative_lane_runs_coroutines_on_the_callers_loop_and_still_times_out() -> None:
    runner = ToolRunner()
    env = Env()

    async def main() -> None:
        here = asyncio.get_running_loop()
        isolated, cooperative = runner.lane(), runner.lane()
        cooperative.cooperative = True
        try:
            assert await isolated.run(bound(env.where), 1.0) is not here
            assert await cooperative.run(bound(env.where), 1.0) is here
            with pytest.raises(TimeoutError, match="no answer within 0.2s"):
                await cooperative.run(bound(env.hang), 0.2)
            assert await cooperative.run(bound(env.where), 1.0) is here  # the loop goes on
        finally:
            isolated.close()
            cooperative.close()

    try:
        asyncio.run(main())
    finally:
        runner.close()
