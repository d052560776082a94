"""Killing the API server mid-job loses nothing: drivers are detached Ray actors and all state is in Redis."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from api.launcher import ApiServerProcess
from rl_service.store import Store

STANDIN_DIR = Path(__file__).resolve().parent.parent / "rl_service"


def wait_for(pred, timeout: float = 90.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def ray_address(ray_local) -> str:
    return ray_local.get_runtime_context().gcs_address


def api_process(redis_url: str, ray_address: str, data_dir: Path, runner: str) -> ApiServerProcess:
    env = {"TAPER_REDIS_URL": redis_url, "RAY_ADDRESS": ray_address, "TAPER_DATA_DIR": str(data_dir),
           "TAPER_JOB_RUNNER": runner}
    return ApiServerProcess(data_dir / f"api-{time.monotonic_ns()}.log", env=env, cwd=STANDIN_DIR)


def test_api_crash_and_restart_mid_job_loses_nothing(redis_url: str, ray_address: str, tmp_path: Path) -> None:
    key = Store(redis_url).create_api_key("restart")
    h = {"Authorization": f"Bearer {key}"}
    # The stand-in runner (0.4 s per step) is imported by the driver from the server's working directory.
    runner = "standin_runner:StandInRunner"
    first = api_process(redis_url, ray_address, tmp_path, runner).start()
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
    assert wait_for(lambda: Store(redis_url).get_job(job["id"]).step > step_at_kill, 30, "progress without API")
    second = api_process(redis_url, ray_address, tmp_path, runner).start()
    try:
        final = wait_for(lambda: (j := httpx.get(f"{second.url}/v1/jobs/{job['id']}", headers=h).json())["state"]
                         in ("succeeded", "failed") and j, 120, "the job to finish")
        assert final["state"] == "succeeded", final
        assert final["attempts"] == 1  # the driver was never restarted: it simply kept running
        metrics = httpx.get(f"{second.url}/v1/jobs/{job['id']}/metrics", headers=h).json()["items"]
        assert [m["step"] for m in metrics] == list(range(1, 13))
        assert max(m["metrics"]["schedule_version"] for m in metrics) == 2
        events = [e["kind"] for e in httpx.get(f"{second.url}/v1/jobs/{job['id']}/events", headers=h).json()["items"]]
        assert events.count("schedule_patched") == 1 and "driver_lost" not in events, events
        assert len(httpx.get(f"{second.url}/v1/jobs/{job['id']}/checkpoints", headers=h).json()) == 12
        # the scheduler frees the job's placement on its next tick after the job ends
        store = Store(redis_url)
        assert wait_for(lambda: not store.r.smembers(store.k_placed()), 30, "the placement to be released")
    finally:
        second.stop()
