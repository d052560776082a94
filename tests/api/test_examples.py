"""Every file in examples/ is valid: job specs as JobSpec, environment registrations as EnvironmentRegistration,
and each job names a built-in environment or one that an example registers."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rl_service.spec import JobSpec
from rollout_workers.environments.policy import EnvironmentPolicy
from rollout_workers.environments.registry import (
    BUILTIN_ENVIRONMENTS,
    EnvironmentRegistration,
    check_job_environment,
    validate_registration,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_examples() -> tuple[dict[str, dict], dict[str, dict]]:
    jobs, envs = {}, {}
    for path in sorted(EXAMPLES.glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        (envs if "kind" in data else jobs)[path.name] = data
    return jobs, envs


def test_examples_are_valid_and_their_environments_exist() -> None:
    jobs, envs = load_examples()
    assert len(jobs) >= 5 and envs
    registered = {EnvironmentRegistration.model_validate(d).name for d in envs.values()}
    for name, data in jobs.items():
        spec = JobSpec.model_validate(data)
        assert spec.environment.name in set(BUILTIN_ENVIRONMENTS) | registered, name
        if spec.environment.name in BUILTIN_ENVIRONMENTS:  # options within the default operator limits
            check_job_environment(spec.environment.name, spec.environment.options, spec.tasks.options,
                                  EnvironmentPolicy())


def test_the_example_tool_server_registration_needs_the_operator_allow_list() -> None:
    _, envs = load_examples()
    for data in envs.values():
        with pytest.raises(ValueError, match="^base_url: 127.0.0.1 is a loopback address"):
            validate_registration(data)
        assert validate_registration(data, EnvironmentPolicy(http_allow=("127.0.0.1",))).kind == "http"


def test_a_bad_example_field_is_named() -> None:
    jobs, _ = load_examples()
    with pytest.raises(ValueError, match="total_steps"):
        JobSpec.model_validate({**next(iter(jobs.values())), "total_steps": -1})
