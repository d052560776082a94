"""The rollout worker: one engine, many concurrent agent loops, weight pushes, stats.

`RolloutEngineHost` holds one engine and the environment its agent loops run (usable in-process);
`RolloutWorker` is the same class as a Ray actor (its processes are titled `ray::RolloutEngineHost`). The actor
is threaded (max_concurrency > 1) so `stats()` and `load_weights()` answer while a batch runs; the
engine puts a weight push between two engine steps, after the live turns end (continuous batching:
rollout calls that overlap share the engine's running batch).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import ray

from rollout_workers.agent import AgentLoop, EpisodeSpec, run_groups
from rollout_workers.device_weights import DeviceWeights, device_uuid
from rollout_workers.engine import Engine, EngineConfig
from rollout_workers.environments.base import Environment
from rollout_workers.environments.policy import EnvironmentPolicy
from rollout_workers.environments.registry import EnvironmentRegistration, make_env_factory
from rollout_workers.sampling import SamplingConfig
from rollout_workers.stats import RolloutStats
from rollout_workers.tool_runner import ToolRunner
from rollout_workers.trajectory import Trajectory
from rollout_workers.vllm_engine import VLLMEngine

if TYPE_CHECKING:
    import torch

EngineFactory = Callable[[], Engine]
EnvSource = EnvironmentRegistration | str | Callable[[], Environment]


def build_engine(engine: EngineConfig | EngineFactory) -> Engine:
    if isinstance(engine, EngineConfig):
        return VLLMEngine(engine)
    return engine()


class RolloutEngineHost:
    """One inference engine, the environment factory its agent loops use, their stats and tool runner."""

    def __init__(
        self,
        engine: EngineConfig | EngineFactory,
        env: EnvSource,
        env_options: dict[str, Any] | None = None,
        weights: Mapping[str, torch.Tensor] | None = None,
        weight_version: int = 0,
        *,
        env_policy: EnvironmentPolicy | None = None,
    ) -> None:
        """`env`: a built-in name, a registration, or (in-process code only) a zero-argument factory.
        `weights` (with their `weight_version`) are loaded before the actor takes any call: a replacement
        worker samples its first token from the latest pushed weights. `env_policy`: the operator's limits
        (HTTP allow-list, option maxima, data roots) the environment runs under; default: the safe defaults."""
        # In-process vLLM engine core: one process per worker is enough on CPU and keeps startup short.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if isinstance(env, str | EnvironmentRegistration):
            self.env_name = env if isinstance(env, str) else env.name
            self.env_factory = make_env_factory(env, env_options, env_policy)
        else:
            self.env_name = str(getattr(env, "name", "") or type(env).__name__)
            self.env_factory = env
        self.engine = build_engine(engine)
        if weights is not None:
            self.load_weights(weights, weight_version)
        self.max_model_len = engine.max_model_len if isinstance(engine, EngineConfig) else None
        self.stats_ = RolloutStats()
        self.tool_runner = ToolRunner()

    def ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "weight_version": self.engine.weight_version}

    def generate(
        self,
        groups: list[list[EpisodeSpec]],
        sampling: SamplingConfig,
        train_step: int | None = None,
        job_id: str | None = None,
    ) -> list[list[Trajectory]]:
        """Run every episode of every group concurrently; groups come back in order."""
        if self.max_model_len is not None and sampling.max_total_tokens > self.max_model_len:
            raise ValueError(
                f"max_total_tokens: {sampling.max_total_tokens} exceeds the engine's max_model_len {self.max_model_len}"
            )
        loop = AgentLoop(
            self.engine,
            self.env_factory,
            sampling,
            env_name=self.env_name,
            job_id=job_id,
            train_step=train_step,
            stats=self.stats_,
            tool_runner=self.tool_runner,
        )
        return run_groups(loop, groups)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor] | DeviceWeights, version: int) -> float:
        """`state_dict` may be `DeviceWeights` (the sender's buffer on this engine's GPU): copied from there."""
        t0 = time.monotonic()
        if isinstance(state_dict, DeviceWeights):
            import torch

            self.engine.load_weights(state_dict.open(), version)
            torch.cuda.synchronize()  # the copies are done before the sender may reuse its buffer
        else:
            self.engine.load_weights(state_dict, version)
        return time.monotonic() - t0

    def device_uuid(self) -> str | None:
        """The GPU this worker's engine runs on (None on CPU)."""
        return device_uuid()

    def weight_version(self) -> int:
        return self.engine.weight_version

    def stats(self) -> dict[str, float]:
        out = self.stats_.snapshot()
        out["weight_version"] = float(self.engine.weight_version)
        out["tool_loops_retired"] = float(self.tool_runner.retired_loops)
        return out


RolloutWorker = ray.remote(RolloutEngineHost)
