"""The trajectory record: the one data type every other package reads.

A trajectory is token-exact. `prompt_ids` are the rendered prompt; then each `Step` appends the
ids the policy sampled (`action_ids`, loss mask 1, with their logprobs) followed by the ids the
environment inserted (`observation_ids`, loss mask 0: the tool result wrapped in the chat template).
Text is never re-tokenised to rebuild the ids.
"""

from __future__ import annotations

import uuid
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field


class TrajectoryStatus(StrEnum):
    OK = "ok"
    TRUNCATED = "truncated"  # hit max turns or max tokens before a final answer
    ENV_ERROR = "env_error"  # the environment itself crashed (infrastructure failure)
    TOOL_TIMEOUT = "tool_timeout"  # a tool did not answer in time (infrastructure failure)

    @property
    def is_infra_failure(self) -> bool:
        return self in (TrajectoryStatus.ENV_ERROR, TrajectoryStatus.TOOL_TIMEOUT)


class ToolCall(BaseModel):
    """One `<tool_call>` span the policy wrote, and what came of it."""

    raw: str  # the text between the tags, as written
    name: str | None = None  # None when the span did not parse
    arguments: dict[str, Any] | None = None
    result: str | None = None
    error: str | None = None  # parse error, unknown tool, bad arguments, tool exception, timeout
    # "format" | "unknown_tool" | "bad_arguments" | "tool_error" (the model's) | "timeout" | "env_error" (the tool
    # server's or environment's failure: the episode ends env_error)
    error_kind: str | None = None
    latency_s: float = 0.0


class Step(BaseModel):
    """One policy turn (sampled tokens) and the environment's answer to it (inserted tokens)."""

    action_ids: list[int]
    action_logprobs: list[float]
    action_text: str
    weight_version: int  # policy weight version that sampled this turn
    tool_calls: list[ToolCall] = Field(default_factory=list)
    observation_ids: list[int] = Field(default_factory=list)
    observation_text: str = ""
    is_final: bool = False  # the turn ended the episode with an answer (no tool call)
    finish_reason: str | None = None  # engine's finish reason for the turn ("stop", "length")
    # Filled after the rollout by reward_models: component name -> value in [0, 1].
    process_rewards: dict[str, float] = Field(default_factory=dict)


class Trajectory(BaseModel):
    id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    job_id: str | None = None
    env: str
    task_id: str
    task: dict[str, Any]
    group_id: str  # trajectories sampled for the same prompt share a group
    prompt_ids: list[int]
    prompt_text: str
    steps: list[Step] = Field(default_factory=list)
    status: TrajectoryStatus = TrajectoryStatus.OK
    error: str | None = None
    outcome_reward: float | None = None  # None = missing (infrastructure failure or not scored yet)
    train_step: int | None = None  # the job step whose batch this trajectory was collected for
    metadata: dict[str, Any] = Field(default_factory=dict)

    # ---- token views (the learner and tests use these; never rebuild ids from text) ----
    def completion_ids(self) -> list[int]:
        out: list[int] = []
        for s in self.steps:
            out += s.action_ids
            out += s.observation_ids
        return out

    def loss_mask(self) -> list[int]:
        out: list[int] = []
        for s in self.steps:
            out += [1] * len(s.action_ids)
            out += [0] * len(s.observation_ids)
        return out

    def completion_logprobs(self) -> list[float]:
        """Engine logprobs aligned with `completion_ids` (0.0 on inserted tokens)."""
        out: list[float] = []
        for s in self.steps:
            out += s.action_logprobs
            out += [0.0] * len(s.observation_ids)
        return out

    def step_index(self) -> list[int]:
        """For each completion token, the index of the step it belongs to."""
        out: list[int] = []
        for i, s in enumerate(self.steps):
            out += [i] * (len(s.action_ids) + len(s.observation_ids))
        return out

    def weight_versions(self) -> list[int]:
        return [s.weight_version for s in self.steps]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + sum(len(s.action_ids) + len(s.observation_ids) for s in self.steps)

    @property
    def excluded(self) -> bool:
        """Infrastructure failures never reach advantages or the loss."""
        return self.status.is_infra_failure or self.outcome_reward is None
