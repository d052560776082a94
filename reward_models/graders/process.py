"""Declared per-step process components, so an environment without code still gets a dense-to-sparse
curriculum. Each scores the steps whose turn made tool calls (other steps leave the component out):

- `tool_called`: 1.0 when the step calls the named tool, else 0.0;
- `tool_args_match`: for a step that calls `tool`, the share of the declared arguments whose value equals
  the rendered template (`{{item.city}}`; `ilike`: case-insensitive, the template's text contained in the
  argument), best over the step's calls of that tool; 0.0 when the step calls it with none matching, and
  left out on steps that do not call it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from reward_models.graders.template import MAX_TEMPLATE_CHARS, as_text, render, sample_of
from rollout_workers.environments.base import _TOOL_NAME
from rollout_workers.trajectory import ToolCall, Trajectory

ComponentName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]
ToolName = Annotated[str, StringConstraints(pattern=_TOOL_NAME.pattern)]
ArgName = Annotated[str, StringConstraints(min_length=1, max_length=128)]


class _Component(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: ComponentName = Field(description="The process reward's name in metrics and trajectories.")


class ToolCalled(_Component):
    kind: Literal["tool_called"] = "tool_called"
    tool: ToolName

    def score(self, trajectory: Trajectory, step_index: int) -> float | None:
        calls = trajectory.steps[step_index].tool_calls
        if not calls:
            return None
        return float(any(c.name == self.tool for c in calls))


class ToolArgsMatch(_Component):
    kind: Literal["tool_args_match"] = "tool_args_match"
    tool: ToolName
    arguments: dict[ArgName, Annotated[str, StringConstraints(max_length=MAX_TEMPLATE_CHARS)]] = Field(
        min_length=1, max_length=32, description="Argument name -> expected value (a template over the task).")
    operation: Literal["eq", "ilike"] = "eq"

    def score(self, trajectory: Trajectory, step_index: int) -> float | None:
        calls = [c for c in trajectory.steps[step_index].tool_calls if c.name == self.tool]
        if not calls:
            return None
        sample = sample_of(trajectory)
        expected = {k: render(v, trajectory.task, sample) for k, v in self.arguments.items()}
        return max(self._share(call, expected) for call in calls)

    def _share(self, call: ToolCall, expected: dict[str, str]) -> float:
        args = call.arguments or {}
        hits = 0
        for key, want in expected.items():
            got = as_text(args.get(key)) if key in args else None
            if got is None:
                continue
            hits += int(got == want if self.operation == "eq" else want.casefold() in got.casefold())
        return hits / len(expected)


ProcessSpec = Annotated[ToolCalled | ToolArgsMatch, Field(discriminator="kind")]


def score_declared(specs: list[Any], trajectory: Trajectory, step_index: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for spec in specs:
        value = spec.score(trajectory, step_index)
        if value is not None:
            out[spec.name] = value
    return out
