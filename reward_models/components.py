"""Process-reward components: named per-step scores in [0, 1].

A component looks at one trajectory and returns, per step, a dict of component name -> value; a
component that does not apply to a step (e.g. argument checks on a turn without tool calls) leaves
its name out, so the node does not enter that component's baseline.

Built-in components (registered by kind):
- ``format``       fraction of the step's tool calls whose span parsed;
- ``tool_valid``   fraction naming a tool the environment has, with arguments valid against its schema;
- ``tool_ok``      fraction that ran and returned a result without error;
- ``consistency``  fraction of the step's claims that agree with values the step could know (task and
                   earlier tool results), for environments exposing ``checkable_values`` (see below);
- ``env``          whatever the environment's ``process(trajectory, step_index)`` returns;
- ``model_scorer`` a scorer model (causal LM + scalar head) loaded lazily from a checkpoint
                   (reward_models.model_scorer).

Consistency hooks an environment may define (duck-typed):
- ``checkable_values(trajectory, step_index) -> Iterable | None``: values (numbers, strings, nested
  lists/dicts) that step `step_index` may legitimately use, i.e. from the task and from tool results of
  steps before it; None = this step is not checkable.
- ``step_claims(trajectory, step_index) -> Iterable | None`` (optional): what the step claims; default:
  the numbers in its tool-call arguments.
"""

from __future__ import annotations

import json
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jsonschema

from rollout_workers.trajectory import Step, Trajectory

StepScores = list[dict[str, float]]  # one dict per step

_COMPONENTS: dict[str, type[ProcessComponent]] = {}


def register_component(kind: str) -> Callable[[type[ProcessComponent]], type[ProcessComponent]]:
    """Class decorator: make a component buildable from a spec ``{"kind": kind, **options}``."""

    def deco(cls: type[ProcessComponent]) -> type[ProcessComponent]:
        if kind in _COMPONENTS and _COMPONENTS[kind] is not cls:
            raise ValueError(f"process component kind '{kind}' is already registered")
        _COMPONENTS[kind] = cls
        cls.kind = kind
        return cls

    return deco


def registered_components() -> list[str]:
    if "model_scorer" not in _COMPONENTS:
        import reward_models.model_scorer  # noqa: F401  (registers itself; heavy imports stay lazy)
    return sorted(_COMPONENTS)


def build_component(spec: str | dict[str, Any] | ProcessComponent) -> ProcessComponent:
    """A component from its kind name, a spec dict ``{"kind": ..., **options}``, or an instance."""
    if isinstance(spec, ProcessComponent):
        return spec
    if isinstance(spec, str):
        spec = {"kind": spec}
    if not isinstance(spec, dict) or "kind" not in spec:
        raise ValueError(f"process component spec must be a kind name or a dict with 'kind' (got {spec!r})")
    options = dict(spec)
    kind = options.pop("kind")
    if kind not in registered_components():
        raise ValueError(f"unknown process component kind '{kind}'; known: {registered_components()}")
    try:
        return _COMPONENTS[kind](**options)
    except TypeError as e:
        raise ValueError(f"bad options for process component '{kind}': {e}") from e


class ProcessComponent(ABC):
    kind: str = ""

    @abstractmethod
    def score(self, trajectory: Trajectory, env: Any) -> StepScores:
        """Per step, component name -> value in [0, 1]; names absent where the component does not apply."""


class StepComponent(ProcessComponent):
    """A component with one named value per step, computed step by step."""

    name: str = ""

    def score(self, trajectory: Trajectory, env: Any) -> StepScores:
        out: StepScores = []
        for i, step in enumerate(trajectory.steps):
            value = self.score_step(trajectory, i, step, env)
            out.append({} if value is None else {self.name: value})
        return out

    @abstractmethod
    def score_step(self, trajectory: Trajectory, index: int, step: Step, env: Any) -> float | None: ...


# ---------------------------------------------------------------- tool-call components


def tool_schemas(env: Any) -> dict[str, dict[str, Any]]:
    """Tool name -> JSON Schema of its arguments, from ``env.tools()`` (plain or OpenAI-style entries)."""
    out: dict[str, dict[str, Any]] = {}
    for entry in env.tools():
        spec = entry.get("function", entry) if isinstance(entry, dict) else {}
        name = spec.get("name")
        if not isinstance(name, str):
            raise ValueError(
                f"environment {getattr(env, 'name', env)!r}: tool entry without a name: {entry!r}"
            )
        out[name] = spec.get("parameters") or {"type": "object"}
    return out


@register_component("format")
class FormatComponent(StepComponent):
    name = "format"

    def score_step(self, trajectory: Trajectory, index: int, step: Step, env: Any) -> float | None:
        calls = step.tool_calls
        if not calls:
            return None
        return sum(c.name is not None and c.error_kind != "format" for c in calls) / len(calls)


@register_component("tool_valid")
class ToolValidComponent(StepComponent):
    """Checked here against the environment's schemas, not taken from the rollout's error labels."""

    name = "tool_valid"

    def __init__(self) -> None:
        self._validators: dict[str, Any] = {}

    def _validator(self, schema: dict[str, Any]) -> Any:
        key = json.dumps(schema, sort_keys=True, default=str)
        if key not in self._validators:
            cls = jsonschema.validators.validator_for(schema)
            cls.check_schema(schema)
            self._validators[key] = cls(schema)
        return self._validators[key]

    def score_step(self, trajectory: Trajectory, index: int, step: Step, env: Any) -> float | None:
        calls = step.tool_calls
        if not calls:
            return None
        schemas = tool_schemas(env)
        good = 0
        for c in calls:
            if c.name is None or c.name not in schemas or not isinstance(c.arguments, dict):
                continue
            if self._validator(schemas[c.name]).is_valid(c.arguments):
                good += 1
        return good / len(calls)


@register_component("tool_ok")
class ToolOkComponent(StepComponent):
    name = "tool_ok"

    def score_step(self, trajectory: Trajectory, index: int, step: Step, env: Any) -> float | None:
        calls = step.tool_calls
        if not calls:
            return None
        return sum(c.error is None and c.error_kind is None and c.result is not None for c in calls) / len(
            calls
        )


# ---------------------------------------------------------------- consistency

# A leading minus counts only where it cannot be a binary operator ("12-7" is 12 and 7; "x = -7" is -7).
_NUMBER = re.compile(r"(?:(?<![\w)\]])-)?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def numbers_in(value: Any) -> Iterator[float]:
    """Every number in a (nested) value: numeric leaves and numeric literals inside strings."""
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int | float):
        if math.isfinite(value):
            yield float(value)
    elif isinstance(value, str):
        for m in _NUMBER.finditer(value):
            f = float(m.group())
            if math.isfinite(f):
                yield f
    elif isinstance(value, dict):
        for v in value.values():
            yield from numbers_in(v)
    elif isinstance(value, Iterable):
        for v in value:
            yield from numbers_in(v)


def _strings_in(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings_in(v)
    elif isinstance(value, Iterable) and not isinstance(value, bytes):
        for v in value:
            yield from _strings_in(v)


def default_claims(trajectory: Trajectory, step_index: int) -> list[Any]:
    """The numbers in the step's parsed tool-call arguments."""
    step = trajectory.steps[step_index]
    return [x for c in step.tool_calls if c.arguments is not None for x in numbers_in(c.arguments)]


def claims_agree(
    claims: Iterable[Any], known: Any, rel_tol: float = 1e-6, abs_tol: float = 1e-9
) -> float | None:
    """Fraction of claims found among the known values (numbers within tolerance, strings as substrings)."""
    known_numbers = list(numbers_in(known))
    known_text = list(_strings_in(known))
    total = agree = 0
    for claim in claims:
        if isinstance(claim, str) and not any(True for _ in numbers_in(claim)):
            total += 1
            agree += any(claim in t for t in known_text)
            continue
        for x in numbers_in(claim):
            total += 1
            agree += any(math.isclose(x, k, rel_tol=rel_tol, abs_tol=abs_tol) for k in known_numbers)
    return None if total == 0 else agree / total


@register_component("consistency")
class ConsistencyComponent(StepComponent):
    name = "consistency"

    def __init__(self, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> None:
        self.rel_tol = rel_tol
        self.abs_tol = abs_tol

    def score_step(self, trajectory: Trajectory, index: int, step: Step, env: Any) -> float | None:
        hook = getattr(env, "checkable_values", None)
        if hook is None:
            return None
        known = hook(trajectory, index)
        if known is None:
            return None
        claims_hook = getattr(env, "step_claims", None)
        claims = claims_hook(trajectory, index) if claims_hook is not None else None
        if claims is None:
            claims = default_claims(trajectory, index)
        return claims_agree(claims, known, self.rel_tol, self.abs_tol)


# ---------------------------------------------------------------- environment-defined


@register_component("env")
class EnvComponent(ProcessComponent):
    """The environment's own components, from ``env.process_steps(trajectory)`` (or, for an object that is
    not an Environment, its ``process(trajectory, step_index)``)."""

    def score(self, trajectory: Trajectory, env: Any) -> StepScores:
        steps = getattr(env, "process_steps", None)
        if steps is not None:
            return steps(trajectory)
        hook = getattr(env, "process", None)
        if hook is None:
            return [{} for _ in trajectory.steps]
        return [dict(hook(trajectory, i) or {}) for i in range(len(trajectory.steps))]


DEFAULT_COMPONENTS: tuple[str, ...] = ("format", "tool_valid", "tool_ok", "consistency", "env")
