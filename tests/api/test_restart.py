"""Killing the API server mid-job loses nothing: drivers are detached Ray actors and all state is in Redis.

With no Redis or Ray configured, the server starts the embedded defaults of its data dir (a private Redis and a
local Ray head): they outlive the killed server, are found again by the next one (and by any process joining
the head through RAY_ADDRESS, as a job's entrypoint does), and are stopped by `taper down`. One restart covers
both (a second Ray head started only to test the embedded defaults would cost its start-up again)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from typer.testing import CliRunner

from api.cli.cli import app as cli
from api.cli.launcher import ApiServerProcess
from rl_service.control.local_services import (
    EMBEDDED_RECORD,
    EmbeddedSupervisor,
    embedded_ray_env,
    embedded_ray_head,
    embedded_redis,
    embedded_scheduler,
    ensure_embedded_ray_head,
    ensure_embedded_redis,
    pid_alive,
    stop_embedded,
)
from rl_service.control.settings import get_settings
from rl_service.control.store import Store
from tests.waiting import wait_for

STANDIN_DIR = Path(__file__).resolve().parent.parent / "rl_service" / "control"
# a separate process joins the head named by RAY_ADDRESS and runs a task there, as a job's entrypoint does
JOIN = """
import ray
from rl_service.ray_cluster import ensure_ray
ensure_ray()
print(ray.get(ray.remote(lambda: 6 * 7).remote()), ray.get_runtime_context().gcs_address.rsplit(":", 1)[1])
"""


# uvicorn shuts down on SIGTERM, then raises the signal again with its default handler (the exit status says so)
CLEAN_EXIT = (0, -signal.SIGTERM)


def api_process(env: dict[str, str], data_dir: Path) -> ApiServerProcess:
    # The stand-in runner (0.4 s per step) is imported by the driver from the server's working directory.
    env = {**env, "TAPER_DATA_DIR": str(data_dir), "TAPER_JOB_RUNNER": "standin_runner:StandInRunner"}
    return ApiServerProcess(data_dir / f"api-{time.monotonic_ns()}.log", env=env, cwd=STANDIN_DIR)


def restart_mid_job(services: dict[str, str], tmp_path: Path, keep_running: bool = False) -> ApiServerProcess | None:
    """A job runs through an API crash: with no API at all it keeps training, and the restarted API sees it
    finish, with every step, the schedule patch made before the crash, and the one driver it ever had. The
    restarted API is returned running with `keep_running`, else stopped by SIGTERM (cleanly: no traceback)."""
    first = api_process(services, tmp_path).start()
    redis_url = services.get("TAPER_REDIS_URL") or embedded_redis(tmp_path).client_url
    key = Store(redis_url).create_api_key("restart")
    h = {"Authorization": f"Bearer {key}"}
    try:
        job = httpx.post(f"{first.url}/v1/jobs", json={"name": "survivor", "total_steps": 12, "seed": 400},
                         headers=h).json()
        wait_for(lambda: httpx.get(f"{first.url}/v1/jobs/{job['id']}", headers=h).json()["step"] >= 2,
                 what="two steps")
        httpx.patch(f"{first.url}/v1/jobs/{job['id']}/reward-schedule", json={"w_start": 0.5}, headers=h)
    finally:
        first.kill()
    step_at_kill = Store(redis_url).get_job(job["id"]).step
    time.sleep(1.0)
    # with no API at all, the job keeps training
    assert wait_for(lambda: Store(redis_url).get_job(job["id"]).step > step_at_kill, 120, "progress without API")
    second = api_process(services, tmp_path).start()
    try:
        if "TAPER_REDIS_URL" not in services:  # the second server found the first one's Redis and Ray head
            assert embedded_redis(tmp_path).client_url == redis_url and embedded_ray_head(tmp_path) is not None
        final = wait_for(lambda: (j := httpx.get(f"{second.url}/v1/jobs/{job['id']}", headers=h).json())["state"]
                         in ("succeeded", "failed") and j, 120, "the job to finish")
        assert final["state"] == "succeeded", final
        assert final["attempts"] == 1  # the driver was never restarted: it simply kept running
        metrics = httpx.get(f"{second.url}/v1/jobs/{job['id']}/metrics", headers=h).json()["items"]
        assert [m["step"] for m in metrics] == list(range(12))
        assert max(m["metrics"]["schedule_version"] for m in metrics) == 2
        events = [e["kind"] for e in httpx.get(f"{second.url}/v1/jobs/{job['id']}/events", headers=h).json()["items"]]
        assert events.count("schedule_patched") == 1 and "driver_lost" not in events, events
        assert len(httpx.get(f"{second.url}/v1/jobs/{job['id']}/checkpoints", headers=h).json()) == 12
        # the scheduler frees the job's placement on its next tick after the job ends
        store = Store(redis_url)
        assert wait_for(lambda: not store.r.smembers(store.k_placed()), 120, "the placement to be released")
    except BaseException:
        second.stop()
        raise
    if keep_running:
        return second
    second.stop()
    assert second.proc is not None and second.proc.returncode in CLEAN_EXIT and "Traceback" not in second.logs()
    return None


def test_api_crash_and_restart_mid_job_loses_nothing(redis_url: str, ray_local, tmp_path: Path) -> None:
    """External services: the Redis and Ray of the test session."""
    restart_mid_job({"TAPER_REDIS_URL": redis_url, "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address},
                    tmp_path)


def test_embedded_services_outlive_an_api_crash_and_are_stopped_by_taper_down(tmp_path: Path,
                                                                               monkeypatch) -> None:
    """No Redis or Ray configured: the embedded defaults of the data dir, which must outlive the killed server."""
    server = head = api = None
    try:
        api = restart_mid_job({"RAY_ADDRESS": ""}, tmp_path, keep_running=True)
        assert api is not None
        server, head = embedded_redis(tmp_path), embedded_ray_head(tmp_path)
        assert server is not None and head is not None
        record = json.loads((tmp_path / EMBEDDED_RECORD).read_text())
        scheduler = embedded_scheduler(tmp_path)  # `taper serve` keeps one beside the API
        assert scheduler is not None
        assert record == {"redis": {"url": server.url, "pid": server.pid, "password_file": "redis-password"},
                          "ray": {"address": head.address, "pid": head.pid, "temp_dir": head.temp_dir,
                                  "auth_token_file": str(tmp_path / "ray-auth-token")},
                          "scheduler": {"pid": scheduler}}
        # started once: the next caller finds the same ones
        assert ensure_embedded_redis(tmp_path).pid == server.pid
        assert ensure_embedded_ray_head(tmp_path).pid == head.pid
        Store(server.client_url).create_api_key("kept")
        # what a process joining the head needs in its environment: the address, the token file, loopback mode
        out = subprocess.run([sys.executable, "-c", JOIN], capture_output=True, text=True, timeout=180,
                             env={**os.environ, **embedded_ray_env(head.auth_token_file), "RAY_ADDRESS": head.address})
        # the task ran on this head (its GCS port), not on a Ray the joining process started for itself
        port = head.address.rsplit(":", 1)[1]
        assert out.returncode == 0 and out.stdout.split() == ["42", port], out.stderr[-2000:]

        monkeypatch.setenv("TAPER_DATA_DIR", str(tmp_path))
        monkeypatch.delenv("TAPER_REDIS_URL", raising=False)
        monkeypatch.delenv("TAPER_API_URL", raising=False)
        monkeypatch.setenv("TAPER_API_KEY", Store(server.client_url).create_api_key("restart"))  # the job's tenant
        get_settings.cache_clear()
        # client commands find the running server from the address it recorded in the data dir
        assert json.loads((tmp_path / "api.json").read_text())["url"] == api.url
        result = CliRunner().invoke(cli, ["status"], catch_exceptions=False)
        assert result.exit_code == 0 and "survivor" in result.output, result.output
        unreachable = CliRunner().invoke(cli, ["--api-url", "http://127.0.0.1:9", "status"])
        assert unreachable.exit_code == 2 and "127.0.0.1:9" in unreachable.output
        # the API's supervisor starts a Redis that died again on its port and files, and a dead scheduler process
        os.kill(server.pid, signal.SIGKILL)
        os.kill(scheduler, signal.SIGKILL)
        again = wait_for(lambda: embedded_redis(tmp_path), 60, "Redis started again")
        assert again.url == server.url and again.pid != server.pid and Store(again.client_url).has_api_keys()
        new_scheduler = wait_for(lambda: embedded_scheduler(tmp_path), 60, "a scheduler started again")
        assert new_scheduler != scheduler
        server, scheduler = again, new_scheduler
        # `taper down` while the API runs stops the API first, with SIGTERM: it shuts down cleanly
        result = CliRunner().invoke(cli, ["down"], catch_exceptions=False)
        assert result.exit_code == 0
        assert f"API at {api.url}" in result.output, result.output
        assert api.proc is not None and api.proc.wait(10) in CLEAN_EXIT and "Traceback" not in api.logs(), api.logs()[-3000:]
        assert not (tmp_path / "api.json").exists()
        assert head.address in result.output and server.url in result.output, result.output
        assert f"scheduler (pid {scheduler})" in result.output and not pid_alive(scheduler)
        assert server.password not in result.output
        assert not pid_alive(head.pid) and not pid_alive(server.pid) and not Path(head.temp_dir).exists()
        assert embedded_ray_head(tmp_path) is None and embedded_redis(tmp_path) is None
        assert not (tmp_path / EMBEDDED_RECORD).exists()
        assert "nothing was running" in CliRunner().invoke(cli, ["down"]).output

        # a new Redis on the same data dir replays the append-only file: the data survived
        again = ensure_embedded_redis(tmp_path)
        assert again.pid != server.pid and Store(again.client_url).has_api_keys()
    finally:
        if api is not None:
            api.stop()
        stop_embedded(tmp_path)
        get_settings.cache_clear()
    assert not pid_alive(head.pid) and not pid_alive(server.pid)


def test_a_supervisor_restarts_a_dead_redis_but_nothing_once_the_services_were_stopped(tmp_path: Path) -> None:
    """`taper down` (or deleting the data dir) removes the services' record: a supervisor still running (in an
    orphaned scheduler process) must not start a Redis there again, round after round."""
    server = ensure_embedded_redis(tmp_path)
    supervisor = EmbeddedSupervisor(tmp_path)
    try:
        assert supervisor.check_once() and supervisor.restarts == []
        os.kill(server.pid, signal.SIGKILL)
        wait_for(lambda: not pid_alive(server.pid), 30, "Redis gone")
        assert supervisor.check_once() and supervisor.restarts == ["redis"]  # died: started again
        again = embedded_redis(tmp_path)
        assert again is not None and again.url == server.url
    finally:
        stop_embedded(tmp_path)
    assert not supervisor.check_once() and supervisor.gone.is_set()
    assert supervisor.check_once() is False and supervisor.restarts == ["redis"]
    assert embedded_redis(tmp_path) is None and not pid_alive(again.pid)
