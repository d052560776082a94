"""A pool of rollout workers (Ray actors) that spreads groups of rollouts over them.

Groups (n samples of one task) are cut into chunks; each idle worker takes the next chunk and runs
all its episodes concurrently. A worker that dies, or whose engine broke (`EngineFailed`), is replaced by a
fresh one (which first loads the latest pushed weights) and its in-flight chunk goes back to the queue,
so no group is lost.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from rollout_workers.agent import EpisodeSpec, make_group_specs
from rollout_workers.engine import EngineConfig, EngineFailed
from rollout_workers.environments.policy import EnvironmentPolicy
from rollout_workers.sampling import SamplingConfig
from rollout_workers.trajectory import Trajectory
from rollout_workers.worker import EngineFactory, EnvSource, RolloutWorker

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
# Ray re-raises a task's exception as an instance of its class too, so `except EngineFailed` sees it.
_WORKER_LOST = (RayActorError, ActorUnavailableError, EngineFailed)


_Chunk = tuple[int, list[list[EpisodeSpec]], int]  # (first group index, groups, attempts so far)


@dataclass
class _Batch:
    """One `generate` call in progress: chunks still queued, chunks on workers, groups done."""

    chunks: deque[_Chunk]
    results: list[list[Trajectory] | None]
    call_args: tuple[SamplingConfig, int | None, str | None]
    in_flight: dict[ray.ObjectRef, tuple[int, Any, _Chunk]] = field(default_factory=dict)
    sent_at: dict[ray.ObjectRef, float] = field(default_factory=dict)  # monotonic time each chunk went out


class RolloutPool:
    """`num_workers` rollout workers sharing out groups of rollouts; a dead worker is replaced and its groups
    rerun. A worker that is alive but has not returned a chunk within `chunk_timeout_s` (a hung engine or
    process) counts as dead too: it is killed, replaced, and its groups rerun. `placement_group` +
    `bundle_indices` pin worker i (and its replacements) to bundle `bundle_indices[i]` (the scheduler reserves
    one bundle per worker); without them the workers go wherever Ray finds room."""

    def __init__(
        self,
        engine: EngineConfig | EngineFactory,
        env: EnvSource,
        num_workers: int = 1,
        *,
        env_options: dict[str, Any] | None = None,
        env_policy: EnvironmentPolicy | None = None,
        num_cpus_per_worker: float = 1.0,
        num_gpus_per_worker: float = 0.0,
        resources: dict[str, float] | None = None,
        groups_per_call: int | None = None,
        max_retries: int = 3,
        chunk_timeout_s: float | None = None,
        placement_group: Any = None,
        bundle_indices: Sequence[int] | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError("num_workers: must be >= 1")
        if placement_group is not None and (bundle_indices is None or len(bundle_indices) != num_workers):
            raise ValueError(f"bundle_indices: need one bundle per worker ({num_workers}), got {bundle_indices}")
        if groups_per_call is not None and groups_per_call < 1:
            raise ValueError("groups_per_call: must be >= 1")
        if not ray.is_initialized():
            ray.init()
        self._spawn_args = (engine, env, env_options)
        self._env_policy = env_policy
        self._options = dict(
            num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker, resources=resources or {}, max_concurrency=4
        )
        self.groups_per_call = groups_per_call
        self.max_retries = max_retries
        if chunk_timeout_s is not None and chunk_timeout_s <= 0:
            raise ValueError("chunk_timeout_s: must be > 0")
        self.chunk_timeout_s = chunk_timeout_s
        self.restarts = 0
        self.stalls = 0  # workers replaced because a chunk outlived chunk_timeout_s
        self.chunks_done = 0
        self._placement = (placement_group, list(bundle_indices or []))
        self._weights: tuple[Any, int] | None = None  # the last push (object ref or DeviceWeights) and its version
        self._device_buffer: torch.Tensor | None = None  # what the last DeviceWeights push points into
        self._workers = [self._spawn(slot) for slot in range(num_workers)]
        ray.get([w.ping.remote() for w in self._workers])  # engines built: surface startup errors here
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="taper-rollout-pool")

    @property
    def workers(self) -> list[Any]:
        return list(self._workers)

    @property
    def progress_count(self) -> int:
        """Grows whenever a chunk of rollouts comes back or a worker is replaced: the pool is not stuck."""
        return self.chunks_done + self.restarts

    def _spawn(self, slot: int) -> Any:
        options = dict(self._options)
        pg, bundles = self._placement
        if pg is not None:  # worker `slot` (and its replacements) in its own bundle of the job's group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundles[slot])
        # The weights go to the constructor: the actor is threaded, so a separate load call could race its first batch.
        return RolloutWorker.options(**options).remote(*self._spawn_args, *(self._weights or ()),
                                                       env_policy=self._env_policy)

    def _replace(self, slot: int, dead: Any, why: str = "died or its engine failed") -> None:
        if self._workers[slot] is dead:
            log.warning("rollout worker %d %s; starting a replacement", slot, why)
            try:
                ray.kill(dead, no_restart=True)
            except Exception:  # already gone
                pass
            self._workers[slot] = self._spawn(slot)
            self.restarts += 1
            # ready before its first chunk, so a chunk's deadline never counts the engine's start-up; one that
            # dies too (placed on a node being lost) fails its first chunk, which is retried like any lost chunk
            with contextlib.suppress(*_WORKER_LOST):
                ray.get(self._workers[slot].ping.remote())

    # ------------------------------------------------------------------ rollouts
    def generate(
        self,
        tasks: list[dict[str, Any]],
        n: int,
        sampling: SamplingConfig,
        train_step: int | None = None,
        job_id: str | None = None,
    ) -> list[list[Trajectory]]:
        """One group of n trajectories per task, in task order."""
        return self._collect(self._dispatch(tasks, n, sampling, train_step, job_id))

    def submit(
        self,
        tasks: list[dict[str, Any]],
        n: int,
        sampling: SamplingConfig,
        train_step: int | None = None,
        job_id: str | None = None,
    ) -> concurrent.futures.Future[list[list[Trajectory]]]:
        """`generate` in the background (async mode); `.result()` waits for it.

        The first chunks reach the workers before this returns. A weight push the caller makes next can
        still reach an engine before their first tokens (the worker actor is threaded), so a trajectory
        may be fresher than its submission: each one records the weight versions that sampled it.
        """
        return self._executor.submit(self._collect, self._dispatch(tasks, n, sampling, train_step, job_id))

    def _dispatch(
        self,
        tasks: list[dict[str, Any]],
        n: int,
        sampling: SamplingConfig,
        train_step: int | None,
        job_id: str | None,
    ) -> _Batch:
        if n < 1:
            raise ValueError("n: must be >= 1")
        groups = make_group_specs(tasks, n)
        size = self.groups_per_call or max(1, math.ceil(len(groups) / len(self._workers)))
        batch = _Batch(
            chunks=deque((start, groups[start : start + size], 0) for start in range(0, len(groups), size)),
            results=[None] * len(groups),
            call_args=(sampling, train_step, job_id),
        )
        self._fill_idle_workers(batch)
        return batch

    def _fill_idle_workers(self, batch: _Batch) -> None:
        busy_slots = {slot for slot, _, _ in batch.in_flight.values()}
        for slot in range(len(self._workers)):
            if batch.chunks and slot not in busy_slots:
                chunk = batch.chunks.popleft()
                worker = self._workers[slot]
                ref = worker.generate.remote(chunk[1], *batch.call_args)
                batch.in_flight[ref] = (slot, worker, chunk)
                batch.sent_at[ref] = time.monotonic()

    def _collect(self, batch: _Batch) -> list[list[Trajectory]]:
        while batch.in_flight:
            done, _ = ray.wait(list(batch.in_flight), num_returns=1, timeout=self._wait_s(batch))
            for ref in done:
                slot, worker, chunk = batch.in_flight.pop(ref)
                del batch.sent_at[ref]
                try:
                    out = ray.get(ref)
                except _WORKER_LOST as e:
                    self._rerun(batch, chunk, e)
                    self._replace(slot, worker)
                    continue
                for i, group in enumerate(out):
                    batch.results[chunk[0] + i] = group
                self.chunks_done += 1
            for ref in self._stalled(batch):
                slot, worker, chunk = batch.in_flight.pop(ref)
                del batch.sent_at[ref]
                self._rerun(batch, chunk, TimeoutError(f"no result within {self.chunk_timeout_s} s"))
                self.stalls += 1
                self._replace(slot, worker, f"returned nothing within {self.chunk_timeout_s} s (hung)")
            self._fill_idle_workers(batch)
        assert all(r is not None for r in batch.results)
        return batch.results  # type: ignore[return-value]

    def _rerun(self, batch: _Batch, chunk: _Chunk, cause: BaseException) -> None:
        start, chunk_groups, attempts = chunk
        if attempts >= self.max_retries:
            raise RuntimeError(f"rollout chunk failed on {attempts + 1} workers: {cause}") from cause
        batch.chunks.appendleft((start, chunk_groups, attempts + 1))

    def _wait_s(self, batch: _Batch) -> float | None:
        """How long `ray.wait` may block: until the oldest in-flight chunk's deadline (None: no deadline)."""
        if self.chunk_timeout_s is None:
            return None
        oldest = min(batch.sent_at.values())
        return max(0.0, oldest + self.chunk_timeout_s - time.monotonic())

    def _stalled(self, batch: _Batch) -> list[ray.ObjectRef]:
        if self.chunk_timeout_s is None:
            return []
        now = time.monotonic()
        return [ref for ref, sent in batch.sent_at.items() if now - sent >= self.chunk_timeout_s]

    # ------------------------------------------------------------------ weights and stats
    def push_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> float:
        """Load new weights into every worker's running engine; returns seconds taken. CUDA tensors of the GPU
        every engine is on go by CUDA IPC (one device buffer, kept until the next push); others through the
        object store."""
        t0 = time.monotonic()
        ref: Any = self._device_weights(state_dict)
        if ref is None:
            self._device_buffer = None
            ref = ray.put(dict(state_dict))
        self._weights = (ref, version)
        pending = {w.load_weights.remote(ref, version): (slot, w) for slot, w in enumerate(self._workers)}
        for r, (slot, w) in pending.items():
            try:
                ray.get(r)
            except _WORKER_LOST:
                self._replace(slot, w)  # the replacement loads these weights on start
        return time.monotonic() - t0

    def _device_weights(self, state_dict: Mapping[str, torch.Tensor]) -> Any:
        """The state dict as `DeviceWeights` where it lies on the GPU of every worker's engine, else None."""
        first = next(iter(state_dict.values()), None)
        if first is None or not first.is_cuda:
            return None
        from rollout_workers.device_weights import DeviceWeights, device_uuid

        engines = set(ray.get([w.device_uuid.remote() for w in self._workers]))
        if engines != {device_uuid(first.device)}:
            return None
        self._device_buffer, weights = DeviceWeights.pack(state_dict)
        return weights

    def stats(self) -> dict[str, float]:
        per_worker = []
        for slot, w in enumerate(self._workers):
            try:
                per_worker.append(ray.get(w.stats.remote(), timeout=60))
            except _WORKER_LOST:
                self._replace(slot, w)
        out: dict[str, float] = {"workers": float(len(self._workers)), "worker_restarts": float(self.restarts),
                                 "worker_stalls": float(self.stalls)}
        if not per_worker:
            return out
        for key in per_worker[0]:
            values = [s.get(key, 0.0) for s in per_worker]
            if key.startswith("tool_latency"):
                out[key] = max(values)  # the slowest worker's percentile: an upper bound for the pool
            elif key == "weight_version":
                out[key] = min(values)
            elif key in ("engine_busy_fraction", "mean_running_sequences"):
                out[key] = sum(values) / len(values)
            else:
                out[key] = sum(values)  # counts, and rates of workers running side by side
        return out

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        for w in self._workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass
        self._workers = []
