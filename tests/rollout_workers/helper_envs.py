"""Small environments for loop tests: tools that answer, hang, block, crash or reject."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rollout_workers.environments.base import Environment, ToolError, tool


class ToyEnv(Environment):
    name = "toy"

    def tools(self) -> list[dict[str, Any]]:
        return [
            tool("add", "a + b", {"a": {"type": "integer"}, "b": {"type": "integer"}}),
            tool("wait", "answers after ms milliseconds (async)", {"ms": {"type": "integer"}}),
            tool("hang", "never answers (async)", {}),
            tool("block", "blocks its thread for 10 s", {}),
            tool("crash", "raises", {}),
            tool("reject", "ToolError", {}),
        ]

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        if task.get("crash_on_reset"):
            raise RuntimeError("reset exploded")
        return await super().reset(task)

    async def call(self, tool: str, args: dict[str, Any]) -> str:
        if tool == "add":
            return str(args["a"] + args["b"])
        if tool == "wait":
            await asyncio.sleep(args["ms"] / 1000)
            return "waited"
        if tool == "hang":
            await asyncio.sleep(3600)
        if tool == "block":
            time.sleep(10)  # a badly written environment: blocks inside async def
            return "unblocked"
        if tool == "crash":
            raise RuntimeError("environment bug")
        if tool == "reject":
            raise ToolError("not today")
        raise ToolError(f"unknown tool {tool}")

    def outcome(self, trajectory: Any) -> float:
        return 1.0


class ProbeEnv(Environment):
    """One argument-free tool, `probe`, for the tool-calling test model (which always calls it). What it
    does is the task's choice: answer "42" at once, after `wait_s` seconds, or never."""

    name = "probe"
    cooperative = True

    def tools(self) -> list[dict[str, Any]]:
        return [tool("probe", "answers 42, or never", {})]

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.mode, self.wait_s = task.get("probe", "answer"), float(task.get("wait_s", 0.0))
        return await super().reset(task)

    async def call(self, tool: str, args: dict[str, Any]) -> str:
        await asyncio.sleep(3600 if self.mode == "hang" else self.wait_s)
        return "42"

    def outcome(self, trajectory: Any) -> float:
        return 1.0


class CooperativeToyEnv(ToyEnv):
    """ToyEnv declaring its coroutines cooperative: they run on the agent loop's own event loop."""

    cooperative = True
    loops: list[asyncio.AbstractEventLoop] = []  # noqa: RUF012 - the loops its tool calls ran on, for tests

    async def call(self, tool: str, args: dict[str, Any]) -> str:
        self.loops.append(asyncio.get_running_loop())
        return await super().call(tool, args)


class BadSchemaEnv(ToyEnv):
    def tools(self) -> list[dict[str, Any]]:
        return [{"name": "x", "description": "", "parameters": {"type": "object", "properties": {"a": {"type": 5}}}}]


class NotAnEnv:
    pass
