"""The `taper` CLI against a live API (uvicorn on loopback, real Redis)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from api_helpers import ThreadedServer
from typer.testing import CliRunner

from api.app import create_app
from api.cli import app as cli
from rl_service.service import TaperService
from rl_service.settings import TaperSettings, get_settings
from rl_service.store import Store


@pytest.fixture
def live(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    store = Store(redis_url)
    service = TaperService(store, tmp_path)
    key = store.create_api_key("cli")
    with ThreadedServer(create_app(service, TaperSettings(data_dir=tmp_path))) as server:
        monkeypatch.setenv("TAPER_API_URL", server.url)
        monkeypatch.setenv("TAPER_API_KEY", key)
        monkeypatch.setenv("TAPER_REDIS_URL", redis_url)
        monkeypatch.setenv("TAPER_DATA_DIR", str(tmp_path))
        get_settings.cache_clear()
        yield store
    get_settings.cache_clear()


def run(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_cli_round_trip(live: Store, tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"name": "cli-job", "total_steps": 4}))
    out = run("submit", str(spec), "--idempotency-key", "once")
    job_id = out.split()[0]
    assert job_id.startswith("job-") and "queued" in out
    assert run("submit", str(spec), "--idempotency-key", "once").split()[0] == job_id
    assert job_id in run("status") and "cli-job" in run("status", job_id)
    out = run("schedule", "set", job_id, "w_end=0.25", "horizon=40")
    assert "version 2" in out and live.current_schedule(job_id)[1].w_end == 0.25
    assert "version 2" in run("schedule", "show", job_id)
    live.add_metrics(job_id, 2, {"loss": 0.5})
    assert "2/4" in run("status", job_id)
    assert "cancelled" in run("cancel", job_id)
    logs = run("logs", job_id)
    assert "submitted" in logs and "schedule_patched" in logs
    follow = run("logs", job_id, "--follow")  # the job is finished: the stream replays and ends
    assert "submitted" in follow and "cancelled" in follow


def test_cli_errors_name_the_field(live: Store, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rollout": {"num_generations": 0}}))
    result = CliRunner().invoke(cli, ["submit", str(bad)])
    assert result.exit_code == 1 and "rollout.num_generations" in result.output


def test_env_and_keys(live: Store, tmp_path: Path) -> None:
    reg = tmp_path / "env.yaml"
    reg.write_text(yaml.safe_dump({"kind": "python", "name": "calc-copy",
                                   "import_path": "rollout_workers.environments.calculator:CalculatorEnv"}))
    assert "calc-copy" in run("env", "register", str(reg))
    listing = run("env", "list")
    assert "calc-copy" in listing and "calculator" in listing
    out = run("keys", "create", "--tenant", "newco")
    key = out.strip().splitlines()[-1]
    assert live.lookup_api_key(key)["tenant"] == "newco"
    result = CliRunner().invoke(cli, ["keys", "create", "--tenant", "Bad Name"])
    assert result.exit_code != 0


def test_unreachable_api_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TAPER_API_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("TAPER_API_KEY", "tpr_x")
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(cli, ["status"])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 2 and "cannot reach the Taper API" in result.output
