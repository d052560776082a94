"""The multi-turn tool-calling agent loop: many episodes at once on one engine.

Each episode runs as its own coroutine: it submits its next turn (token-id prompt) to the engine the
moment its previous tool calls return, and the engine's continuous batching puts the turn into the
running batch at its next step; no episode waits for another one's turn or tools. The context of an
episode is only ever extended by ids: the sampled ids, then the ids of the text the loop inserted
(tool messages + next assistant header), tokenised on their own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rollout_workers.chat import ChatFormat
from rollout_workers.engine import Engine, TurnOutput, TurnRequest, request_seed
from rollout_workers.environments.base import Environment, ToolError
from rollout_workers.environments.sandbox import replace_surrogates
from rollout_workers.parsing import has_tool_call_markup, parse_tool_calls
from rollout_workers.sampling import SamplingConfig
from rollout_workers.stats import RolloutStats
from rollout_workers.tool_runner import ToolLane, ToolRunner, bound
from rollout_workers.trajectory import Step, ToolCall, Trajectory, TrajectoryStatus

MAX_TOOL_RESULT_CHARS = 4000
T = TypeVar("T")


@dataclass
class EpisodeSpec:
    task: dict[str, Any]
    group_id: str
    sample_index: int = 0


@dataclass
class _Episode:
    spec: EpisodeSpec
    traj: Trajectory
    env: Environment | None = None
    tools: dict[str, dict[str, Any]] = field(default_factory=dict)
    context: list[int] = field(default_factory=list)
    done: bool = False
    lane: ToolLane | None = None


class _ResultRelay:
    """Hands engine results to the agent loop's event loop: one wake-up for all the results that are
    ready, not one per turn (each wake-up is a cross-thread write that makes the engine thread give up
    the GIL and wait to get it back)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._ready: list[tuple[asyncio.Future[Any], concurrent.futures.Future[Any]]] = []
        self._scheduled = False

    def watch(self, done: concurrent.futures.Future[T]) -> asyncio.Future[T]:
        waiter: asyncio.Future[T] = self._loop.create_future()
        done.add_done_callback(lambda f: self._arrived(waiter, f))
        return waiter

    def _arrived(self, waiter: asyncio.Future[Any], done: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._ready.append((waiter, done))
            if self._scheduled:
                return
            self._scheduled = True
        self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            ready, self._ready, self._scheduled = self._ready, [], False
        for waiter, done in ready:
            if waiter.cancelled():
                continue
            if done.cancelled():
                waiter.cancel()
            elif (error := done.exception()) is not None:
                waiter.set_exception(error)
            else:
                waiter.set_result(done.result())


class AgentLoop:
    def __init__(
        self,
        engine: Engine,
        env_factory: Callable[[], Environment],
        sampling: SamplingConfig,
        *,
        env_name: str,
        job_id: str | None = None,
        train_step: int | None = None,
        stats: RolloutStats | None = None,
        tool_runner: ToolRunner | None = None,
    ) -> None:
        self.engine = engine
        self.chat = ChatFormat(engine.tokenizer)
        self.env_factory = env_factory
        self.sampling = sampling
        self.env_name = env_name
        self.job_id = job_id
        self.train_step = train_step
        self.stats = stats or RolloutStats()
        self._owns_runner = tool_runner is None
        self.tool_runner = tool_runner or ToolRunner()
        self._prompts: dict[str, tuple[str, list[int]]] = {}
        self._relays: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _ResultRelay] = weakref.WeakKeyDictionary()

    def close(self) -> None:
        if self._owns_runner:
            self.tool_runner.close()

    # ------------------------------------------------------------------ driver
    async def run(self, specs: list[EpisodeSpec]) -> list[Trajectory]:
        started = time.monotonic()
        engine_before = self.engine.counters()
        episodes = [self._new_episode(s) for s in specs]
        tasks = [asyncio.create_task(self._run_episode(e)) for e in episodes]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*(self._close(e) for e in episodes))
        for e in episodes:
            self.stats.record_trajectory(e.traj.status.value, len(e.traj.prompt_ids))
        self.stats.record_busy(time.monotonic() - started, engine_before, self.engine.counters())
        return [e.traj for e in episodes]

    async def _run_episode(self, ep: _Episode) -> None:
        await self._start(ep)
        while not ep.done:
            out = await self._turn(ep)  # engine errors propagate: they are not the episode's fault
            try:
                await self._handle_turn(ep, out)
            except Exception as e:  # a bug in handling must not take the other episodes down
                self._finish(ep, TrajectoryStatus.ENV_ERROR, "env_error", f"internal error handling the turn: {e!r}")

    async def _turn(self, ep: _Episode) -> TurnOutput:
        request = TurnRequest(
            prompt_ids=list(ep.context),
            max_tokens=min(self.sampling.max_tokens_per_turn, self.sampling.max_total_tokens - len(ep.context)),
            seed=request_seed(
                self.sampling.seed, ep.traj.task_id, ep.spec.sample_index, len(ep.traj.steps), self.train_step
            ),
            session=ep.traj.id,
        )
        loop = asyncio.get_running_loop()
        relay = self._relays.get(loop)
        if relay is None:
            relay = self._relays[loop] = _ResultRelay(loop)
        out = await relay.watch(self.engine.submit(request, self.sampling, self.chat.stop_token_ids))
        self.stats.record_generate(len(out.token_ids))
        return out

    # ------------------------------------------------------------------ one episode
    def _new_episode(self, spec: EpisodeSpec) -> _Episode:
        traj = Trajectory(
            job_id=self.job_id,
            env=self.env_name,
            task_id=str(spec.task.get("id", "")),
            task=spec.task,
            group_id=spec.group_id,
            prompt_ids=[],
            prompt_text="",
            train_step=self.train_step,
            metadata={"sample_index": spec.sample_index},
        )
        return _Episode(spec=spec, traj=traj)

    async def _start(self, ep: _Episode) -> None:
        traj = ep.traj
        ep.lane = self.tool_runner.lane()
        try:
            ep.env = self.env_factory()
            env = ep.env
            ep.lane.cooperative = bool(getattr(env, "cooperative", False))
            messages = await ep.lane.run(bound(env.reset, ep.spec.task), self.sampling.tool_timeout_s)
            tools = env.tools()
            ep.tools = {t["name"]: t for t in tools}
            traj.prompt_text, traj.prompt_ids = self._render_prompt(messages, tools)
            traj.metadata.update(env.episode_metadata())
        except TimeoutError as e:
            return self._finish(ep, TrajectoryStatus.ENV_ERROR, "env_error", f"reset timed out: {e}")
        except Exception as e:
            return self._finish(ep, TrajectoryStatus.ENV_ERROR, "env_error", f"reset failed: {e!r}")
        ep.context = list(traj.prompt_ids)
        if len(ep.context) >= self.sampling.max_total_tokens:
            self._finish(ep, TrajectoryStatus.TRUNCATED, "max_total_tokens", None)

    def _render_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> tuple[str, list[int]]:
        """The chat template, rendered and tokenised once per distinct prompt (the n samples of a group
        share theirs); the key keeps dict order, which the template's output may depend on."""
        try:
            key = json.dumps([messages, tools])
        except (TypeError, ValueError):
            return self.chat.render_prompt(messages, tools)
        if key not in self._prompts:
            self._prompts[key] = self.chat.render_prompt(messages, tools)
        text, ids = self._prompts[key]
        return text, list(ids)

    async def _handle_turn(self, ep: _Episode, out: TurnOutput) -> None:
        s = self.sampling
        step = Step(
            action_ids=list(out.token_ids),
            action_logprobs=list(out.logprobs),
            action_text=self.chat.decode(out.token_ids),
            weight_version=out.weight_version,
            finish_reason=out.finish_reason,
        )
        ep.traj.steps.append(step)
        ep.context += out.token_ids
        ended_with_eos = bool(out.token_ids) and out.token_ids[-1] == self.chat.eos_token_id

        if out.finish_reason == "length":
            if len(ep.context) >= s.max_total_tokens:
                return self._finish(ep, TrajectoryStatus.TRUNCATED, "max_total_tokens", None, inserted=0)
            step.tool_calls = [
                ToolCall(
                    raw="",
                    error=f"turn cut off after {len(out.token_ids)} tokens (max_tokens_per_turn) before it ended",
                    error_kind="format",
                )
            ]
        else:
            text = step.action_text
            if ended_with_eos and text.endswith(self.chat.eos_text):
                text = text[: -len(self.chat.eos_text)]
            if not has_tool_call_markup(text):
                step.is_final = True
                return self._finish(ep, TrajectoryStatus.OK, "final_answer", None, inserted=0)
            step.tool_calls = parse_tool_calls(text, ep.tools, s.max_tool_calls_per_turn)

        for call in step.tool_calls:
            if call.error is not None:
                self.stats.record_tool(None, call.error_kind)
                continue
            failure = await self._call_tool(ep, call)
            if failure is not None:
                return self._finish(ep, failure[0], failure[0].value, failure[1], inserted=0)

        if len(ep.traj.steps) >= s.max_turns:
            return self._finish(ep, TrajectoryStatus.TRUNCATED, "max_turns", None, inserted=0)
        messages = [
            {"role": "tool", "content": c.result if c.error is None else f"Error: {c.error}"} for c in step.tool_calls
        ]
        obs_text = self.chat.observation_text(messages, ended_with_eos)
        obs_ids = self.chat.encode(obs_text)
        if len(ep.context) + len(obs_ids) >= s.max_total_tokens:
            return self._finish(ep, TrajectoryStatus.TRUNCATED, "max_total_tokens", None, inserted=0)
        step.observation_ids, step.observation_text = obs_ids, obs_text
        ep.context += obs_ids
        self.stats.record_turn(len(obs_ids))

    async def _call_tool(self, ep: _Episode, call: ToolCall) -> tuple[TrajectoryStatus, str] | None:
        """Run one validated call; a (status, reason) when the episode must end."""
        env, lane, name, args = ep.env, ep.lane, call.name or "", dict(call.arguments or {})
        assert env is not None and lane is not None
        outcome: tuple[TrajectoryStatus, str] | None = None
        t0 = time.monotonic()
        try:
            result, call.latency_s = await lane.run_timed(bound(env.call, name, args), self.sampling.tool_timeout_s)
        except TimeoutError as e:
            call.error, call.error_kind = f"tool {name} timed out: {e}", "timeout"
            outcome = (TrajectoryStatus.TOOL_TIMEOUT, call.error)
            call.latency_s = time.monotonic() - t0
        except ToolError as e:  # its message may quote the arguments: text the tokenizer must encode
            call.error, call.error_kind = replace_surrogates(str(e)) or type(e).__name__, "tool_error"
            call.latency_s = time.monotonic() - t0
        except Exception as e:
            # the environment's failure, not the model's: the infrastructure kind, as the episode's status
            call.error, call.error_kind = replace_surrogates(f"environment crashed in {name}: {e!r}"), "env_error"
            outcome = (TrajectoryStatus.ENV_ERROR, call.error)
            call.latency_s = time.monotonic() - t0
        else:
            text = replace_surrogates(result if isinstance(result, str) else str(result))
            if len(text) > MAX_TOOL_RESULT_CHARS:
                text = text[:MAX_TOOL_RESULT_CHARS] + " [truncated]"
            call.result = text
        self.stats.record_tool(call.latency_s, call.error_kind)
        return outcome

    def _finish(
        self, ep: _Episode, status: TrajectoryStatus, reason: str, error: str | None, inserted: int | None = None
    ) -> None:
        ep.done = True
        ep.traj.status = status
        ep.traj.error = error
        ep.traj.metadata["stop_reason"] = reason
        if inserted is not None:
            self.stats.record_turn(inserted)

    async def _close(self, ep: _Episode) -> None:
        if ep.traj.steps:
            try:
                self.engine.end_session(ep.traj.id)
            except Exception:  # a closed or failed engine keeps nothing
                pass
        if ep.lane is None:
            return
        try:
            if ep.env is not None:
                await ep.lane.run(bound(ep.env.close), self.sampling.tool_timeout_s)
        except Exception:  # closing is best effort; the trajectory is already recorded
            pass
        finally:
            ep.lane.close()


def make_group_specs(tasks: list[dict[str, Any]], n: int) -> list[list[EpisodeSpec]]:
    """n episodes per task, sharing one fresh group id."""
    groups = []
    for task in tasks:
        gid = uuid.uuid4().hex
        groups.append([EpisodeSpec(task=task, group_id=gid, sample_index=i) for i in range(n)])
    return groups


def run_groups(loop: AgentLoop, groups: list[list[EpisodeSpec]]) -> list[list[Trajectory]]:
    """Run all groups' episodes concurrently; trajectories come back grouped, in input order."""
    flat = [spec for g in groups for spec in g]
    trajs = asyncio.run(loop.run(flat))
    out, i = [], 0
    for g in groups:
        out.append(trajs[i : i + len(g)])
        i += len(g)
    return out
