"""The operator's limits on environments (EnvironmentPolicy): which python classes tenants may register
(checked before anything is imported), options declared and bounded, file options inside the data roots."""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

import pytest

from rollout_workers.environments import (
    BUILTIN_ENVIRONMENTS,
    generate_tasks,
    make_env_factory,
    validate_registration,
)
from rollout_workers.environments.policy import BUILTIN_DATA_DIR, EnvironmentPolicy, PythonSandboxMaxima
from rollout_workers.environments.registry import check_job_environment
from rollout_workers.environments.retrieval import DEFAULT_CORPUS


def marker_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """A module on sys.path that, if ever imported, creates a marker file (module-level code ran)."""
    name = f"tenant_marker_{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "module-code-ran"
    (tmp_path / f"{name}.py").write_text(
        "from pathlib import Path\n"
        f"Path({str(marker)!r}).write_text('imported')\n"
        "from rollout_workers.environments.calculator import CalculatorEnv\n"
        "class Env(CalculatorEnv):\n"
        "    name = 'marker'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return name, marker


def test_a_module_the_operator_did_not_allow_is_never_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name, marker = marker_module(tmp_path, monkeypatch)
    reg = {"kind": "python", "name": "evil", "import_path": f"{name}:Env"}
    with pytest.raises(ValueError, match=r"^import_path: .* is not available to tenants"):
        validate_registration(reg)
    # a prefix only admits whole module names: 'tenant_marker' does not admit 'tenant_marker_1234'
    with pytest.raises(ValueError, match="not available"):
        validate_registration(reg, EnvironmentPolicy(environment_modules=("tenant_marker",)))
    assert not marker.exists() and name not in sys.modules
    # the same module once the operator lists it: imported (so the check above could have failed)
    assert validate_registration(reg, EnvironmentPolicy(environment_modules=(name,))).name == "evil"
    assert marker.read_text() == "imported"


def test_entry_points_make_the_builtin_classes_available() -> None:
    for cls in BUILTIN_ENVIRONMENTS.values():
        path = f"{cls.__module__}:{cls.__name__}"
        assert EnvironmentPolicy().module_allowed(path), path
    reg = validate_registration({"kind": "python", "name": "my-calc",
                                 "import_path": "rollout_workers.environments.calculator:CalculatorEnv"})
    assert reg.import_path.endswith("CalculatorEnv")
    # another class of the same (entry-point) module is not thereby available
    assert not EnvironmentPolicy().module_allowed("rollout_workers.environments.calculator:evaluate_expression")
    assert not EnvironmentPolicy().module_allowed("os:system")


# ---------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("env", "options", "field", "words"),
    [
        ("python", {"memory_mb": 1048576}, "environment.options.memory_mb", "less than or equal to 65536"),
        ("python", {"memory_mb": 2048}, "environment.options.memory_mb", "operator's maximum"),
        ("python", {"cpu_seconds": 31}, "environment.options.cpu_seconds", "operator's maximum"),
        ("python", {"wall_seconds": 61}, "environment.options.wall_seconds", "operator's maximum"),
        ("python", {"output_bytes": 10**12}, "environment.options.output_bytes", "less than or equal"),
        ("python", {"memory_mb": 0}, "environment.options.memory_mb", "greater than or equal"),
        ("python", {"network": True}, "environment.options.network", "Extra inputs"),
        ("calculator", {"ops": "/"}, "environment.options.ops", "subset"),
        ("calculator", {"max_operand": 10**9}, "environment.options.max_operand", "less than or equal"),
        ("calculator", {"min_operand": 50, "max_operand": 10}, "environment.options", "min_operand <= max_operand"),
        ("long_horizon", {"filler_words": 10**6}, "environment.options.filler_words", "less than or equal"),
        ("long_horizon", {"chain_length": 30, "num_boxes": 10}, "environment.options", "chain_length"),
        ("tool_chain", {"k": 5}, "environment.options.k", "less than or equal to 4"),
        ("tool_chain", {"k": 0}, "environment.options.k", "greater than or equal to 1"),
        ("tool_chain", {"max_operand": 10**6}, "environment.options.max_operand", "less than or equal"),
        ("retrieval", {"top_k": 0}, "environment.options.top_k", "greater than or equal"),
        ("retrieval", {"corpus_path": "/etc/passwd"}, "environment.options.corpus_path", "data roots"),
    ],
)
def test_options_beyond_their_bounds_are_refused_naming_the_field(env: str, options: dict, field: str,
                                                                  words: str) -> None:
    with pytest.raises(ValueError) as err:
        make_env_factory(env, options)
    message = str(err.value)
    assert message.startswith(f"{field}:") and words in message, message
    with pytest.raises(ValueError) as err:  # the same check at submission, for task options too
        check_job_environment(env, {}, options, EnvironmentPolicy())
    assert str(err.value).startswith(field.replace("environment.options", "tasks.options")), str(err.value)


def test_operator_maxima_set_the_sandbox_limits() -> None:
    roomy = EnvironmentPolicy(python_max=PythonSandboxMaxima(memory_mb=4096, cpu_seconds=120))
    env = make_env_factory("python", {"memory_mb": 2048, "cpu_seconds": 100}, roomy)()
    assert env.limits.memory_bytes == 2048 * 1024 * 1024 and env.limits.cpu_seconds == 100
    assert make_env_factory("python")().limits.memory_bytes == 256 * 1024 * 1024  # the declared default
    with pytest.raises(ValueError, match="environment.options.memory_mb"):
        make_env_factory("python", {"memory_mb": 8192}, roomy)
    # an operator maximum below a default lowers the default; the tenant cannot go above it
    tight = EnvironmentPolicy(python_max=PythonSandboxMaxima(memory_mb=128, wall_seconds=2.0))
    env = make_env_factory("python", {}, tight)()
    assert env.limits.memory_bytes == 128 * 1024 * 1024 and env.limits.wall_seconds == 2.0
    assert env.limits.cpu_seconds == 5  # a default already within its maximum stays
    with pytest.raises(ValueError, match="environment.options.wall_seconds"):
        make_env_factory("python", {"wall_seconds": 10}, tight)


def test_registered_options_are_checked_too() -> None:
    reg = {"kind": "python", "name": "big-py", "import_path": "rollout_workers.environments.python_env:PythonEnv",
           "options": {"memory_mb": 1048576}}
    with pytest.raises(ValueError, match=r"^options\.memory_mb: "):
        validate_registration(reg)
    http = {"kind": "http", "name": "h", "base_url": "https://93.184.216.34/", "options": {f"k{i}": i for i in range(40)},
            "tools": [{"name": "a", "parameters": {"type": "object"}}]}
    with pytest.raises(ValueError, match=r"^options: .*at most 32 options"):
        validate_registration(http)
    assert validate_registration({**http, "options": {"difficulty": 3}}).options == {"difficulty": 3}


# ---------------------------------------------------------------- file options


def corpus(path: Path) -> Path:
    path.write_text(json.dumps([{"id": "d1", "title": "Avaloria", "text": "The capital of Avaloria is Brin.",
                                 "facts": {"capital": "Brin"}}]))
    return path


def test_corpus_paths_resolve_inside_the_data_roots_only(tmp_path: Path) -> None:
    root, outside = tmp_path / "files", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    corpus(root / "mine.json")
    secret = corpus(outside / "secret.json")
    os.symlink(secret, root / "link.json")  # a symlink inside the root that points out of it
    (root / "sub").mkdir()
    policy = EnvironmentPolicy(data_roots=(BUILTIN_DATA_DIR, root))
    for bad in ["/etc/passwd", str(secret), "../outside/secret.json", "sub/../../outside/secret.json",
                "link.json", str(root / "link.json"), "missing.json", "sub", ""]:
        with pytest.raises(ValueError) as err:
            make_env_factory("retrieval", {"corpus_path": bad}, policy)
        assert str(err.value).startswith("environment.options.corpus_path:"), (bad, str(err.value))
    for good in ["mine.json", str(root / "mine.json"), "sub/../mine.json", str(DEFAULT_CORPUS)]:
        env = make_env_factory("retrieval", {"corpus_path": good}, policy)()
        assert env.corpus.docs, good
    tasks = generate_tasks("retrieval", 2, seed=0, options={"corpus_path": "mine.json"}, policy=policy)
    assert {t["answer"] for t in tasks} == {"Brin"}
    # under the default policy only the package's own data is a data root
    with pytest.raises(ValueError, match="corpus_path"):
        make_env_factory("retrieval", {"corpus_path": str(root / "mine.json")})
