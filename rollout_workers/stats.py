"""Rollout throughput and failure counters (one per worker; `snapshot()` is what stats() reports)."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from rollout_workers.engine import EngineCounters


class RolloutStats:
    def __init__(self, latency_window: int = 4096) -> None:
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.sampled_tokens = 0
        self.inserted_tokens = 0
        self.prompt_tokens = 0
        self.turns = 0
        self.trajectories = 0
        self.engine_steps = 0
        self.engine_sequence_steps = 0  # sum over engine steps of the live sequences
        self.engine_seconds = 0.0  # time the engine spent stepping during run() calls
        self.busy_seconds = 0.0  # wall time inside run() calls
        self.statuses: Counter[str] = Counter()
        self.tool_errors: Counter[str] = Counter()
        self.tool_calls = 0  # every call the model wrote
        self.tool_calls_run = 0  # the calls that reached the environment (the latency window's samples)
        self._tool_latency: deque[float] = deque(maxlen=latency_window)

    def record_generate(self, sampled_tokens: int) -> None:
        with self._lock:
            self.sampled_tokens += sampled_tokens

    def record_turn(self, inserted_tokens: int) -> None:
        with self._lock:
            self.turns += 1
            self.inserted_tokens += inserted_tokens

    def record_tool(self, latency_s: float | None, error_kind: str | None) -> None:
        """One tool call; latency_s is None for a call rejected before it reached the environment (bad
        format, unknown tool, bad arguments): it counts as an error but not as a latency sample."""
        with self._lock:
            self.tool_calls += 1
            if latency_s is not None:
                self.tool_calls_run += 1
                self._tool_latency.append(latency_s)
            if error_kind:
                self.tool_errors[error_kind] += 1

    def record_trajectory(self, status: str, prompt_tokens: int) -> None:
        with self._lock:
            self.trajectories += 1
            self.prompt_tokens += prompt_tokens
            self.statuses[status] += 1

    def record_busy(self, seconds: float, engine_before: EngineCounters, engine_after: EngineCounters) -> None:
        """One run() call: its wall time and what the engine did meanwhile (runs that overlap on one
        engine each count the shared steps)."""
        with self._lock:
            self.busy_seconds += seconds
            self.engine_steps += engine_after.steps - engine_before.steps
            self.engine_sequence_steps += engine_after.sequence_steps - engine_before.sequence_steps
            self.engine_seconds += engine_after.step_seconds - engine_before.step_seconds

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            busy = max(self.busy_seconds, 1e-9)
            lat = np.array(self._tool_latency) * 1000.0 if self._tool_latency else np.zeros(1)
            out = {
                "trajectories": float(self.trajectories),
                "turns": float(self.turns),
                "sampled_tokens": float(self.sampled_tokens),
                "inserted_tokens": float(self.inserted_tokens),
                "prompt_tokens": float(self.prompt_tokens),
                "busy_seconds": self.busy_seconds,
                "tokens_per_s": self.sampled_tokens / busy,
                "turns_per_s": self.turns / busy,
                "trajectories_per_s": self.trajectories / busy,
                "engine_steps": float(self.engine_steps),
                "engine_tokens_per_s": self.sampled_tokens / max(self.engine_seconds, 1e-9),
                "engine_busy_fraction": min(1.0, self.engine_seconds / busy),
                "mean_running_sequences": self.engine_sequence_steps / max(self.engine_steps, 1),
                "tool_calls": float(self.tool_calls),
                "tool_calls_run": float(self.tool_calls_run),
                "tool_latency_p50_ms": float(np.percentile(lat, 50)),
                "tool_latency_p90_ms": float(np.percentile(lat, 90)),
                "tool_latency_p99_ms": float(np.percentile(lat, 99)),
            }
            for status in ("ok", "truncated", "env_error", "tool_timeout"):
                out[f"status_{status}"] = float(self.statuses.get(status, 0))
            out["failures"] = out["status_env_error"] + out["status_tool_timeout"]
            for kind in ("format", "unknown_tool", "bad_arguments", "tool_error", "timeout", "env_error"):
                out[f"tool_errors_{kind}"] = float(self.tool_errors.get(kind, 0))
            return out
