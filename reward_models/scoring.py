"""Score finished trajectories: per-step process rewards and the outcome reward, in place.

An environment built from a registration with a declared grader (``env.grader_spec``) is scored by that
grader instead of its verifier, and its declared process components (``env.process_specs``) join the others.
Infrastructure failures (status ``env_error`` / ``tool_timeout``) get no rewards: their outcome stays
None ("missing", not zero) and credit assignment drops them. A verifier or process component that raises
marks the trajectory ``env_error`` (the environment failed, not the policy). Values outside [0, 1] are a contract violation of
the environment or component and raise ValueError naming it.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Sequence
from typing import Any

from reward_models.components import DEFAULT_COMPONENTS, ProcessComponent, build_component
from rollout_workers.trajectory import Trajectory, TrajectoryStatus

log = logging.getLogger(__name__)

ComponentSpec = str | dict[str, Any] | ProcessComponent


class ComponentFailed(RuntimeError):
    """A process component (or the environment hook it calls) raised while scoring one trajectory."""


def build_components(specs: Sequence[ComponentSpec] | None = None) -> list[ProcessComponent]:
    return [build_component(s) for s in (DEFAULT_COMPONENTS if specs is None else specs)]


def _check_unit(value: Any, what: str) -> float:
    try:
        f = float(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be a number in [0, 1] (got {value!r})") from e
    if not (math.isfinite(f) and 0.0 <= f <= 1.0):
        raise ValueError(f"{what} must be a number in [0, 1] (got {value!r})")
    return f


@functools.lru_cache(maxsize=64)
def _declared_grader(spec_json: str) -> Any:
    from reward_models.graders import parse_grader

    return parse_grader(json.loads(spec_json))


@functools.lru_cache(maxsize=64)
def _declared_process(specs_json: str) -> list[Any]:
    from reward_models.graders import parse_process

    return parse_process(json.loads(specs_json))


def _grade_context(env: Any) -> Any:
    from reward_models.graders import GradeContext

    policy = getattr(env, "policy", None)
    return GradeContext() if policy is None else GradeContext(allow=policy.allow_list, python_max=policy.python_max)


class _Declared:
    """The declared process components of an environment, as one component named `declared`."""

    kind = "declared"

    def __init__(self, specs: list[Any]) -> None:
        self.specs = specs

    def score(self, trajectory: Trajectory, env: Any) -> list[dict[str, float]]:
        from reward_models.graders import score_declared

        return [score_declared(self.specs, trajectory, i) for i in range(len(trajectory.steps))]


def score_process(trajectory: Trajectory, env: Any, components: Sequence[ProcessComponent]) -> None:
    """Fill ``Step.process_rewards`` of one trajectory."""
    env_name = getattr(env, "name", type(env).__name__)
    merged: list[dict[str, float]] = [{} for _ in trajectory.steps]
    owner: dict[str, str] = {}
    declared = getattr(env, "process_specs", ())
    all_components: list[Any] = list(components)
    if declared:
        all_components.append(_Declared(_declared_process(json.dumps(list(declared), sort_keys=True))))
    for comp in all_components:
        try:
            per_step = comp.score(trajectory, env)
        except Exception as e:
            raise ComponentFailed(f"process component '{comp.kind}' failed: {type(e).__name__}: {e}") from e
        if len(per_step) != len(trajectory.steps):
            raise ValueError(
                f"process component '{comp.kind}' returned {len(per_step)} step scores "
                f"for {len(trajectory.steps)} steps"
            )
        for i, scores in enumerate(per_step):
            for name, value in scores.items():
                if owner.setdefault(name, comp.kind) != comp.kind:
                    raise ValueError(
                        f"process reward name '{name}' is produced by both '{owner[name]}' and '{comp.kind}' "
                        f"(environment {env_name!r})"
                    )
                merged[i][name] = _check_unit(
                    value, f"process reward '{name}' (component '{comp.kind}', environment {env_name!r})"
                )
    for step, scores in zip(trajectory.steps, merged, strict=True):
        step.process_rewards = scores


def score_outcome(trajectory: Trajectory, env: Any) -> None:
    """Set ``outcome_reward`` from the environment's verifier (None for infrastructure failures)."""
    if trajectory.status.is_infra_failure:
        trajectory.outcome_reward = None
        return
    env_name = getattr(env, "name", type(env).__name__)
    grader = getattr(env, "grader_spec", None)
    try:
        if grader is not None:
            from reward_models.graders import grade_trajectory

            value = grade_trajectory(_declared_grader(json.dumps(grader, sort_keys=True)), trajectory, _grade_context(env))
        else:
            value = env.outcome(trajectory)
    except Exception as e:  # the verifier crashed: an environment failure, not the policy's
        log.warning("outcome verifier of %r failed on trajectory %s: %s", env_name, trajectory.id, e)
        trajectory.status = TrajectoryStatus.ENV_ERROR
        trajectory.error = f"outcome verifier failed: {type(e).__name__}: {e}"
        trajectory.outcome_reward = None
        return
    trajectory.outcome_reward = _check_unit(value, f"outcome reward of environment {env_name!r}")


def score_trajectories(
    trajectories: Sequence[Trajectory],
    env: Any,
    components: Sequence[ComponentSpec] | None = None,
) -> None:
    """Score each trajectory in place: process rewards on every step, then the outcome reward.

    `components`: kind names, spec dicts (``{"kind": "model_scorer", "path": ...}``) or instances;
    None = DEFAULT_COMPONENTS. Build them once with `build_components` and pass the instances to
    reuse loaded scorer models across calls.
    """
    built = build_components(components)
    for traj in trajectories:
        if traj.status.is_infra_failure:
            traj.outcome_reward = None
            for step in traj.steps:
                step.process_rewards = {}
            continue
        score_outcome(traj, env)
        if traj.status.is_infra_failure:
            continue
        try:
            score_process(traj, env, built)
        except ComponentFailed as e:  # like a crashed verifier: this trajectory cannot be scored
            log.warning("scoring trajectory %s of %r: %s", traj.id, getattr(env, "name", env), e)
            traj.status = TrajectoryStatus.ENV_ERROR
            traj.error = str(e)
            traj.outcome_reward = None
            for step in traj.steps:
                step.process_rewards = {}
