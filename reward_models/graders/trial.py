"""A grader tried on one sample before any job uses it (OpenAI's `graders/run`): the reward the job would train
on, each sub-grader's score, how long it took, and what went wrong, by OpenAI's error kinds."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from reward_models.graders.base import GradeContext, GraderSpec
from reward_models.graders.multi import MultiGrader
from reward_models.graders.python_grader import PythonGrader
from reward_models.graders.template import GraderError, sample_of_text

# OpenAI's `metadata.errors` flags; Taper raises some of them
ERROR_FLAGS = ("formula_parse_error", "invalid_variable_error", "model_grader_parse_error",
               "model_grader_refusal_error", "model_grader_server_error", "other_error", "python_grader_runtime_error",
               "python_grader_server_error", "sample_parse_error", "truncated_observation_error",
               "unresponsive_reward_error")


@dataclass
class Trial:
    reward: float  # in [0, 1], as the job trains on it (0 when the grader failed)
    raw: float | None  # the grader's own value before clipping (None: it failed)
    sub_rewards: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # the flag of ERROR_FLAGS that applies
    details: str | None = None
    seconds: float = 0.0


def _error_kind(grader: GraderSpec, message: str) -> str:
    if isinstance(grader, PythonGrader) or "python grader" in message:
        return "python_grader_runtime_error"
    if "calculate_output" in message:
        return "formula_parse_error"
    return "other_error"


def run_grader(grader: GraderSpec, item: dict[str, Any], model_sample: str, ctx: GradeContext,
               output_tools: list[dict[str, Any]] | None = None) -> Trial:
    """Grade `model_sample` (the final answer's text) for `item` (a task file's line)."""
    sample = sample_of_text(model_sample, output_tools)
    start = time.perf_counter()
    sub: dict[str, float] = {}
    try:
        if isinstance(grader, MultiGrader):  # each sub-grader once, its score kept
            for name, g in grader.graders.items():
                sub[name] = g.grade(item, sample, ctx)
            raw = grader.combine(sub)
        else:
            raw = grader.grade(item, sample, ctx)
    except GraderError as exc:
        return Trial(0.0, None, sub, _error_kind(grader, str(exc)), str(exc)[:2000], time.perf_counter() - start)
    return Trial(min(1.0, max(0.0, raw)), raw, sub, None, None, time.perf_counter() - start)
