"""The operator's limits on environments through the REST API over a real Redis: SSRF targets, python classes
the operator did not make available (their module code never runs), options beyond their bounds and host
paths. Every refusal is a 4xx naming the field and leaves Redis unchanged."""

from __future__ import annotations

import sys
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from api_helpers import Api, redis_dump
from fastapi.testclient import TestClient

from api.app import create_app
from rl_service.control.service import TaperService
from rl_service.control.settings import SettingsError, TaperSettings, load_settings
from rl_service.control.store import Store
from rollout_workers.environments.policy import BUILTIN_DATA_DIR, EnvironmentPolicy

SPEC = {"name": "t", "total_steps": 3, "rollout": {"num_generations": 2, "prompts_per_step": 2}}
TOOLS = [{"name": "echo", "description": "echo", "parameters": {"type": "object"}}]


@pytest.fixture
def operator_api(redis_url: str, tmp_path: Path) -> Iterator[Api]:
    """An API whose operator allow-lists a local tool server and keeps tenant files under tmp_path/files."""
    store = Store(redis_url)
    (tmp_path / "files").mkdir()
    policy = EnvironmentPolicy(http_allow=("127.0.0.1",), data_roots=(BUILTIN_DATA_DIR, tmp_path / "files"))
    service = TaperService(store, tmp_path, env_policy=policy)
    app = create_app(service, TaperSettings(data_dir=tmp_path))
    with TestClient(app) as client:
        yield Api(client, store, service, store.create_api_key("alpha"), store.create_api_key("beta"))


def refused(api: Api, path: str, body: dict, field: str, words: str = "") -> None:
    before = redis_dump(api.store.url)
    r = api.client.post(path, json=body, headers=api.h())
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["field"] == field, error
    assert words in error["message"], error
    assert redis_dump(api.store.url) == before


@pytest.mark.parametrize(
    ("base_url", "words"),
    [
        ("http://127.0.0.1:8265", "loopback"),  # the Ray dashboard
        ("http://169.254.169.254/latest/meta-data", "link-local"),
        ("http://10.0.0.1", "private"),
        ("http://[::1]:6379", "loopback"),
        ("http://[::ffff:127.0.0.1]", "IPv4-mapped"),
        ("http://2130706433", "numeric-encoded"),
        ("http://0.0.0.0:6379", "unspecified"),
        ("http://localhost:8000", "loopback"),
        ("http://tools.example/api?", "query"),
        ("http://tools.example/a/../admin", "dot segments"),
        ("http://admin:pw@tools.example/", "user info"),
    ],
)
def test_http_registration_to_an_internal_or_malformed_target_is_a_422(api: Api, base_url: str, words: str) -> None:
    refused(api, "/v1/environments", {"kind": "http", "name": "h", "base_url": base_url, "tools": TOOLS},
            "base_url", words)


def test_the_operator_allow_list_admits_a_local_tool_server(operator_api: Api) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)  # answers every request with 501
    threading.Thread(target=server.serve_forever, daemon=True).start()
    body = {"kind": "http", "name": "local", "base_url": f"http://127.0.0.1:{server.server_address[1]}",
            "tools": TOOLS}
    try:
        r = operator_api.client.post("/v1/environments", json=body, headers=operator_api.h())
    finally:
        server.shutdown()
        server.server_close()
    assert r.status_code == 201, r.text
    # a server that does not answer is named at registration, not when the job fails
    refused(operator_api, "/v1/environments", {**body, "name": "gone"}, "base_url", "does not answer")
    # still only what it lists
    refused(operator_api, "/v1/environments", {**body, "name": "meta", "base_url": "http://169.254.169.254"},
            "base_url", "link-local")


def test_a_python_class_the_operator_did_not_allow_is_refused_before_import(
    api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"tenant_marker_{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "module-code-ran"
    (tmp_path / f"{name}.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    refused(api, "/v1/environments", {"kind": "python", "name": "evil", "import_path": f"{name}:Env"},
            "import_path", "not available to tenants")
    refused(api, "/v1/environments", {"kind": "python", "name": "evil", "import_path": "os:system"}, "import_path")
    refused(api, "/v1/environments", {"kind": "python", "name": "evil", "import_path": "subprocess:Popen"},
            "import_path")
    assert not marker.exists() and name not in sys.modules
    # a class of the taper.environments entry points is available
    ok = {"kind": "python", "name": "my-py", "import_path": "rollout_workers.environments.python_env:PythonEnv"}
    assert api.client.post("/v1/environments", json=ok, headers=api.h()).status_code == 201


def test_registration_options_beyond_their_bounds_are_a_422(api: Api) -> None:
    py = {"kind": "python", "name": "py", "import_path": "rollout_workers.environments.python_env:PythonEnv"}
    refused(api, "/v1/environments", {**py, "options": {"memory_mb": 1048576}}, "options.memory_mb")
    refused(api, "/v1/environments", {**py, "options": {"wall_seconds": 3000}}, "options.wall_seconds",
            "operator's maximum")
    refused(api, "/v1/environments", {**py, "options": {"unbounded": 1}}, "options.unbounded", "Extra inputs")


@pytest.mark.parametrize(
    ("environment", "tasks", "field", "words"),
    [
        ({"name": "python", "options": {"memory_mb": 1048576}}, {}, "environment.options.memory_mb", "65536"),
        ({"name": "python", "options": {"memory_mb": 2048}}, {}, "environment.options.memory_mb", "operator's maximum"),
        ({"name": "python", "options": {"cpu_seconds": 3600}}, {}, "environment.options.cpu_seconds", "maximum"),
        ({"name": "calculator", "options": {"blob": "x"}}, {}, "environment.options.blob", "Extra inputs"),
        ({"name": "long_horizon"}, {"options": {"filler_words": 10**7}}, "tasks.options.filler_words", "4096"),
        ({"name": "retrieval", "options": {"corpus_path": "/etc/passwd"}}, {}, "environment.options.corpus_path",
         "data roots"),
        ({"name": "retrieval"}, {"options": {"corpus_path": "../../../../etc/passwd"}}, "tasks.options.corpus_path",
         "data roots"),
    ],
)
def test_job_options_beyond_their_bounds_are_a_422(api: Api, environment: dict, tasks: dict, field: str,
                                                   words: str) -> None:
    refused(api, "/v1/jobs", {**SPEC, "environment": environment, "tasks": tasks}, field, words)


def test_job_options_of_a_registered_environment_are_checked(operator_api: Api) -> None:
    reg = {"kind": "python", "name": "my-py", "import_path": "rollout_workers.environments.python_env:PythonEnv"}
    assert operator_api.client.post("/v1/environments", json=reg, headers=operator_api.h()).status_code == 201
    refused(operator_api, "/v1/jobs", {**SPEC, "environment": {"name": "my-py", "options": {"memory_mb": 4096}}},
            "environment.options.memory_mb")
    r = operator_api.client.post("/v1/jobs", json={**SPEC, "environment": {"name": "my-py", "options": {"memory_mb": 512}}},
                                 headers=operator_api.h())
    assert r.status_code == 201, r.text


def test_a_corpus_in_the_operator_data_roots_is_accepted(operator_api: Api, tmp_path: Path) -> None:
    (tmp_path / "files" / "corpus.json").write_text(
        '[{"id": "d", "title": "T", "text": "The capital of T is X.", "facts": {"capital": "X"}}]')
    outside = tmp_path / "outside.json"
    outside.write_text("[]")
    (tmp_path / "files" / "escape.json").symlink_to(outside)
    for path in ("corpus.json", str(tmp_path / "files" / "corpus.json")):
        body = {**SPEC, "environment": {"name": "retrieval", "options": {"corpus_path": path}}}
        r = operator_api.client.post("/v1/jobs", json=body, headers=operator_api.h())
        assert r.status_code == 201, r.text
    for path in ("escape.json", str(outside)):
        refused(operator_api, "/v1/jobs", {**SPEC, "environment": {"name": "retrieval", "options": {"corpus_path": path}}},
                "environment.options.corpus_path", "data roots")


def test_the_settings_carry_the_policy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TAPER_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("TAPER_HTTP_ALLOW", "127.0.0.1, 10.0.0.0/8,tools.internal")
    monkeypatch.setenv("TAPER_ENVIRONMENT_MODULES", '["my_company.envs"]')
    monkeypatch.setenv("TAPER_PYTHON_MAX_MEMORY_MB", "2048")
    policy = load_settings().environment_policy()
    assert policy.http_allow == ("127.0.0.1", "10.0.0.0/8", "tools.internal")
    assert policy.environment_modules == ("my_company.envs",)
    assert policy.data_roots == (BUILTIN_DATA_DIR, (tmp_path / "files").resolve())
    assert policy.python_max.memory_mb == 2048
    monkeypatch.delenv("TAPER_HTTP_ALLOW")
    monkeypatch.delenv("TAPER_ENVIRONMENT_MODULES")
    default = load_settings().environment_policy()
    assert default.http_allow == () and default.environment_modules == ()
    monkeypatch.delenv("TAPER_PYTHON_MAX_MEMORY_MB")
    assert load_settings().environment_policy().python_max == EnvironmentPolicy().python_max  # the built-in maxima
    monkeypatch.setenv("TAPER_HTTP_ALLOW", "not a network!")
    with pytest.raises(SettingsError, match="TAPER_HTTP_ALLOW"):
        load_settings()
    monkeypatch.setenv("TAPER_HTTP_ALLOW", "")
    monkeypatch.setenv("TAPER_ENVIRONMENT_MODULES", "os; import x")
    with pytest.raises(SettingsError, match="TAPER_ENVIRONMENT_MODULES"):
        load_settings()
    monkeypatch.delenv("TAPER_ENVIRONMENT_MODULES")
    monkeypatch.setenv("TAPER_PYTHON_MAX_MEMORY_MB", "8")
    with pytest.raises(SettingsError, match="TAPER_PYTHON_MAX_MEMORY_MB: .*greater than or equal to 16"):
        load_settings()


def test_a_python_class_the_workers_cannot_import_is_refused(
    ray_local, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Importable by the API process (on its sys.path) but not by the Ray workers: 422 saying so, nothing
    stored. The same class from an installed package registers."""
    name = f"api_only_env_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "from rollout_workers.environments.calculator import CalculatorEnv\n\n\nclass Env(CalculatorEnv):\n"
        "    name = 'api_only'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    store = Store(redis_url)
    service = TaperService(store, tmp_path, env_policy=EnvironmentPolicy(environment_modules=(name,)))
    with TestClient(create_app(service, TaperSettings(data_dir=tmp_path))) as client:
        api = Api(client, store, service, store.create_api_key("alpha"), store.create_api_key("beta"))
        refused(api, "/v1/environments", {"kind": "python", "name": "api-only", "import_path": f"{name}:Env"},
                "import_path", "the cluster's workers cannot import")
        ok = {"kind": "python", "name": "calc", "import_path": "rollout_workers.environments.calculator:CalculatorEnv"}
        assert api.client.post("/v1/environments", json=ok, headers=api.h()).status_code == 201
