"""The `taper` CLI against a live API (uvicorn on loopback, real Redis)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from api_helpers import ThreadedServer
from typer.testing import CliRunner

from api.app import create_app
from api.cli.cli import app as cli
from rl_service.control.service import TaperService
from rl_service.control.settings import TaperSettings, get_settings
from rl_service.control.store import Store


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
    live.add_metrics(job_id, 1, {"loss": 0.5}, steps_done=2)
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


def test_keys_list_revoke_and_expiry(live: Store) -> None:
    out = run("keys", "create", "--tenant", "newco", "--name", "ci", "--expires-in", "30d")
    key = out.strip().splitlines()[-1]
    assert "valid until" in out and live.lookup_api_key(key)["expires_at"] > time.time() + 29 * 86400
    admin = run("keys", "create", "--tenant", "ops", "--admin").strip().splitlines()[-1]
    assert live.lookup_api_key(admin)["admin"] is True
    listing = run("keys", "list")
    assert "newco" in listing and "ops" in listing and key not in listing and admin not in listing
    key_id = live.lookup_api_key(key)["id"]
    assert key_id in run("keys", "list", "--tenant", "newco") and key_id not in run("keys", "list", "--tenant", "ops")
    assert f"revoked {key_id}" in run("keys", "revoke", key_id)
    assert live.lookup_api_key(key) is None
    result = CliRunner().invoke(cli, ["keys", "revoke", key_id])
    assert result.exit_code == 1 and "no API key with id" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(cli, ["keys", "create", "--tenant", "newco", "--expires-in", "3x"])
    assert result.exit_code == 2 and "--expires-in" in result.output


def test_quota_needs_an_admin_key_and_round_trips(live: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    result = CliRunner().invoke(cli, ["quota", "show", "cli"])
    assert result.exit_code == 1 and "403" in result.output and "admin" in result.output
    monkeypatch.setenv("TAPER_API_KEY", live.create_api_key("ops", admin=True))
    get_settings.cache_clear()
    assert "default" in run("quota", "show", "cli")
    out = run("quota", "set", "cli", "max_running_jobs=1", "max_priority=3", "resources.learner_cpus=2")
    assert "max_running_jobs: 1" in out and "learner_cpus=2" in out
    quota = live.get_quota("cli")
    assert (quota.max_running_jobs, quota.max_priority, quota.resources.learner_cpus) == (1, 3, 2)
    result = CliRunner().invoke(cli, ["quota", "set", "cli", "max_priority=1000"])
    assert result.exit_code == 1 and "max_priority" in result.output and live.get_quota("cli").max_priority == 3
    assert "default" in run("quota", "reset", "cli") and live.get_quota("cli") is None


def test_delete_a_finished_job(live: Store, tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"name": "to-delete", "total_steps": 2}))
    job_id = run("submit", str(spec)).split()[0]
    result = CliRunner().invoke(cli, ["delete", job_id])
    assert result.exit_code == 1 and "409" in result.output and "[state]" in result.output
    run("cancel", job_id)
    assert f"deleted {job_id}" in run("delete", job_id)
    assert not live.job_exists(job_id)


def test_key_commands_without_redis_are_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TAPER_REDIS_URL", "redis://127.0.0.1:1/0")
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(cli, ["keys", "list"])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 2 and "cannot use the Redis" in result.output and result.exception is not None
    assert isinstance(result.exception, SystemExit)


def test_files_upload_and_list(live: Store, tmp_path: Path) -> None:
    tasks = Path(__file__).resolve().parents[2] / "examples" / "mcp" / "weather_tasks.jsonl"
    out = run("files", "upload", str(tasks))
    file_id = out.split()[0]
    assert file_id.startswith("file-") and "6 tasks" in out
    assert file_id in run("files", "list")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n{"answer": 1}\n')
    result = CliRunner().invoke(cli, ["files", "upload", str(bad)])
    assert result.exit_code == 1 and "line 2" in result.output


def test_graders_validate_and_run_score_samples_before_a_job(live: Store, tmp_path: Path) -> None:
    grader = tmp_path / "grader.yaml"
    grader.write_text(yaml.safe_dump({"environment": {"name": "calculator", "grader": {
        "type": "multi", "name": "both", "calculate_output": "0.5 * exact + 0.5 * py", "graders": {
            "exact": {"type": "string_check", "name": "exact", "input": "{{sample.answer}}",
                      "reference": "{{item.answer}}", "operation": "eq"},
            "py": {"type": "python", "name": "py", "source": "def grade(sample, item):\n    return 1.0\n"}}}}}))
    assert "ok: multi grader 'both'" in run("graders", "validate", str(grader))
    out = run("graders", "run", str(grader), "--sample", "The answer is 4.", "--sample", "The answer is 5.",
              "--item", '{"answer": "4"}', "--json")
    rewards = [json.loads(line)["reward"] for line in out.splitlines()]
    assert rewards == [1.0, 0.5]
    samples = tmp_path / "samples.jsonl"
    samples.write_text(json.dumps({"model_sample": "The answer is 4.", "item": {"answer": "4"}}) + "\n")
    assert "1" in run("graders", "run", str(grader), "--samples", str(samples))

    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"type": "python", "name": "py", "source": "def grade(sample, item)\n"}))
    result = CliRunner().invoke(cli, ["graders", "validate", str(broken)])
    assert result.exit_code == 1 and "grader.python.source" in result.output and "line 1" in result.output
    crash = tmp_path / "crash.json"
    crash.write_text(json.dumps({"type": "python", "name": "py", "source": "def grade(sample, item):\n    1 / 0\n"}))
    result = CliRunner().invoke(cli, ["graders", "run", str(crash), "--sample", "x"])
    assert result.exit_code == 1 and "python_grader_runtime_error" in result.output
    result = CliRunner().invoke(cli, ["graders", "run", str(grader)])
    assert result.exit_code == 2 and "--sample" in result.output


def test_json_output_and_exit_codes_that_say_how_a_watched_job_ended(live: Store, tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"name": "json-job", "total_steps": 4}))
    job = json.loads(run("submit", str(spec), "--json"))
    assert job["state"] == "queued" and job["name"] == "json-job"
    assert json.loads(run("status", job["id"], "--json"))["id"] == job["id"]
    assert [j["id"] for j in json.loads(run("status", "--json"))["items"]] == [job["id"]]
    assert json.loads(run("schedule", "show", job["id"], "--json"))["version"] == 1
    events = [json.loads(line) for line in run("logs", job["id"], "--json").splitlines()]
    assert events[0]["kind"] == "submitted"
    assert isinstance(json.loads(run("files", "list", "--json")), list)
    assert any(e["name"] == "calculator" for e in json.loads(run("env", "list", "--json")))

    ended = {}
    for final in ("succeeded", "failed", "cancelled", "paused"):
        jid = json.loads(run("submit", str(spec), "--json"))["id"]
        live.transition(jid, "starting")
        live.transition(jid, "running")
        live.transition(jid, final)
        result = CliRunner().invoke(cli, ["status", jid, "--watch", "--json"])
        assert json.loads(result.output)["state"] == final
        ended[final] = result.exit_code
    assert ended == {"succeeded": 0, "failed": 1, "cancelled": 3, "paused": 4}
