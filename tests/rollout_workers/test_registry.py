from __future__ import annotations

from pathlib import Path

import pytest

from rollout_workers.environments import (
    BUILTIN_ENVIRONMENTS,
    EnvironmentRegistration,
    make_env_factory,
    validate_registration,
    validate_tool_schemas,
)
from rollout_workers.environments.calculator import CalculatorEnv
from rollout_workers.environments.policy import EnvironmentPolicy

HERE = Path(__file__).parent
# the operator makes these test modules available to tenants (TAPER_ENVIRONMENT_MODULES)
TEST_MODULES = EnvironmentPolicy(environment_modules=("helper_envs", "no_such_pkg", "json", "rollout_workers"))


@pytest.fixture
def helper_module(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.syspath_prepend(str(HERE))
    return "helper_envs"


def test_valid_python_registration_builds_environments(helper_module: str) -> None:
    reg = validate_registration({"kind": "python", "name": "toy", "import_path": f"{helper_module}:ToyEnv"}, TEST_MODULES)
    env = make_env_factory(reg)()
    assert {"add", "wait", "hang"} <= {t["name"] for t in env.tools()}
    # JSON round trip: what the control plane stores is enough to rebuild it
    again = EnvironmentRegistration.model_validate_json(reg.model_dump_json())
    assert again == reg


@pytest.mark.parametrize(
    ("registration", "field", "words"),
    [
        ({"kind": "python", "name": "x", "import_path": "no_such_pkg.mod:Env"}, "import_path", "cannot import"),
        ({"kind": "python", "name": "x", "import_path": "os.path; import os"}, "import_path", "must look like"),
        ({"kind": "python", "name": "x", "import_path": "json:NoSuchClass"}, "import_path", "no attribute"),
        ({"kind": "python", "name": "x", "import_path": "json:JSONDecoder"}, "import_path", "not a subclass"),
        (
            {"kind": "python", "name": "x", "import_path": "rollout_workers.environments.base:Environment"},
            "import_path",
            "abstract",
        ),
        ({"kind": "python", "name": "x", "import_path": "helper_envs:BadSchemaEnv"}, "parameters", "invalid JSON Schema"),
        ({"kind": "python", "name": "x", "import_path": "helper_envs:NotAnEnv"}, "import_path", "not a subclass"),
        ({"kind": "python", "name": "x"}, "import_path", "required"),
        ({"kind": "python", "name": "Bad Name!", "import_path": "helper_envs:ToyEnv"}, "name", "must match"),
        ({"kind": "python", "name": "calculator", "import_path": "helper_envs:ToyEnv"}, "name", "built-in"),
        ({"kind": "python", "name": "x", "import_path": "helper_envs:ToyEnv", "code": "print(1)"}, "code", "Extra"),
        ({"kind": "http", "name": "x", "tools": [{"name": "a", "parameters": {"type": "object"}}]}, "base_url", "required"),
        (
            {"kind": "http", "name": "x", "base_url": "ftp://h", "tools": [{"name": "a", "parameters": {"type": "object"}}]},
            "base_url",
            "http(s)",
        ),
        ({"kind": "http", "name": "x", "base_url": "http://h:1"}, "tools", "required"),
        ({"kind": "http", "name": "x", "base_url": "http://h:1", "tools": []}, "tools", "non-empty"),
        (
            {"kind": "http", "name": "x", "base_url": "http://h:1", "tools": [{"name": "a", "parameters": {"type": "array"}}]},
            "tools[0].parameters.type",
            "object",
        ),
        (
            {"kind": "http", "name": "x", "base_url": "http://h:1", "tools": [{"name": "a b", "parameters": {"type": "object"}}]},
            "tools[0].name",
            "must match",
        ),
        (
            {
                "kind": "http",
                "name": "x",
                "base_url": "http://h:1",
                "tools": [{"name": "a", "parameters": {"type": "object"}}] * 2,
            },
            "tools[1].name",
            "duplicate",
        ),
        (
            {"kind": "http", "name": "x", "base_url": "http://h:1", "timeout_s": 0, "tools": [{"name": "a", "parameters": {"type": "object"}}]},
            "timeout_s",
            "greater than 0",
        ),
    ],
)
def test_bad_registrations_are_rejected_naming_the_field(
    helper_module: str, registration: dict, field: str, words: str
) -> None:
    with pytest.raises(ValueError) as err:
        validate_registration(registration, TEST_MODULES)
    message = str(err.value)
    assert field in message, message
    assert words in message, message


def test_builtins_have_valid_schemas_and_seeded_generators() -> None:
    assert set(BUILTIN_ENVIRONMENTS) == {"calculator", "python", "retrieval", "long_horizon", "tool_chain"}
    for name, cls in BUILTIN_ENVIRONMENTS.items():
        validate_tool_schemas(cls().tools())
        a, b = cls.generate_tasks(5, seed=3), cls.generate_tasks(5, seed=3)
        assert a == b, name
        assert a != cls.generate_tasks(5, seed=4), name
        assert len({t["id"] for t in a}) == 5, name


def test_unknown_builtin_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="environment: unknown built-in 'nope'"):
        make_env_factory("nope")


def test_factory_options_reach_the_environment() -> None:
    env = make_env_factory("long_horizon", {"filler_words": 3})()
    assert env.filler_words == 3
    assert isinstance(make_env_factory("calculator")(), CalculatorEnv)
