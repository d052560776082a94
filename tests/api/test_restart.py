"""Killing the API server mid-job loses nothing: drivers are detached Ray actors and all state is in Redis."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from api.launcher import ApiServerProcess
from rl_service.embedded import embedded_ray_head, embedded_redis, stop_embedded
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


def api_process(env: dict[str, str], data_dir: Path) -> ApiServerProcess:
    # The stand-in runner (0.4 s per step) is imported by the driver from the server's working directory.
    env = {**env, "TAPER_DATA_DIR": str(data_dir), "TAPER_JOB_RUNNER": "standin_runner:StandInRunner"}
    return ApiServerProcess(data_dir / f"api-{time.monotonic_ns()}.log", env=env, cwd=STANDIN_DIR)


@pytest.fixture(params=["external", "embedded"])
def services(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str]]:
    """The server's environment: an external Redis and Ray, or none (the embedded defaults of its data dir,
    which must outlive the killed server, and are stopped here)."""
    if request.param == "external":
        ray_address = request.getfixturevalue("ray_local").get_runtime_context().gcs_address
        yield {"TAPER_REDIS_URL": request.getfixturevalue("redis_url"), "RAY_ADDRESS": ray_address}
        return
    yield {"RAY_ADDRESS": ""}
    stop_embedded(tmp_path)


def test_api_crash_and_restart_mid_job_loses_nothing(services: dict[str, str], tmp_path: Path) -> None:
    first = api_process(services, tmp_path).start()
    redis_url = services.get("TAPER_REDIS_URL") or embedded_redis(tmp_path).url
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
            assert embedded_redis(tmp_path).url == redis_url and embedded_ray_head(tmp_path) is not None
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
        assert wait_for(lambda: not store.r.smembers(store.k_placed()), 120, "the placement to be released")
    finally:
        second.stop()
