"""A real job's whole life over HTTP: the real JobRunner (tiny model, vLLM on CPU) in a detached driver actor on
a real local Ray, the scheduler and the API in this process, a real Redis.

One job covers: submit -> running -> reward-schedule PATCH seen by the job in its metrics -> succeeded, with
trajectories (filtered) and checkpoints listed. (Killing a driver and resuming it from its checkpoint is
tested with a stand-in runner in tests/rl_service/test_scheduler.py: a second vLLM start here would double
this test's minutes.)"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from api_helpers import ThreadedServer

from api.app import create_app
from rl_service.embedded import EMBEDDED_RECORD
from rl_service.settings import TaperSettings
from rl_service.store import Store

TINY_JOB = {
    "name": "lifecycle",
    "model": {"preset": "tiny"},
    "environment": {"name": "calculator"},
    "tasks": {"seed": 0, "num_train": 16, "num_eval": 0},
    "rollout": {"num_workers": 1, "prompts_per_step": 2, "num_generations": 2, "max_turns": 1,
                "max_tokens_per_turn": 8, "max_total_tokens": 96, "kv_cache_gib": 0.25},
    "reward_schedule": {"kind": "linear", "w_start": 1.0, "w_end": 0.0, "horizon": 10},
    "resources": {"learner_cpus": 1, "rollout_cpus": 1},
    "total_steps": 2,
    "checkpoint_every": 1,
}


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_real_job_lifecycle_over_http(redis_url: str, ray_local, tmp_path: Path) -> None:
    settings = TaperSettings(redis_url=redis_url, data_dir=tmp_path)
    key = Store(redis_url).create_api_key("life")
    with ThreadedServer(create_app(settings=settings)) as server:
        c = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        r = c.post("/v1/jobs", json=TINY_JOB)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]

        def job() -> dict:
            return c.get(f"/v1/jobs/{job_id}").json()

        def why() -> str:
            errors = [e for e in c.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}).json()["items"]
                      if e["kind"] == "error"]
            return f"{job()['error']}\n{errors[-1]['data'].get('traceback') if errors else ''}"

        wait_for(lambda: job()["state"] in ("running", "failed"), 120, "running")
        assert job()["state"] == "running", why()
        r = c.patch(f"/v1/jobs/{job_id}/reward-schedule", json={"w_start": 0.5, "kind": "constant"})
        assert r.status_code == 200 and r.json()["version"] == 2

        t_running = time.monotonic()
        final = wait_for(lambda: (j := job())["state"] in ("succeeded", "failed", "cancelled") and j, 420, "the end")
        assert final["state"] == "succeeded", why()
        assert final["attempts"] == 1 and final["step"] == 2
        print(f"running -> succeeded in {time.monotonic() - t_running:.1f} s")

        metrics = c.get(f"/v1/jobs/{job_id}/metrics").json()["items"]
        train = [m for m in metrics if "schedule/version" in m["metrics"]]
        assert [m["step"] for m in train] == [1, 2]
        assert train[-1]["metrics"]["schedule/version"] == 2.0  # the PATCH reached the job
        assert train[-1]["metrics"]["schedule/weight"] == 0.5

        events = c.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}).json()["items"]
        kinds = [e["kind"] for e in events]
        for kind in ("submitted", "schedule_patched", "started", "checkpoint", "completed"):
            assert kind in kinds, (kind, kinds)
        states = [e["data"]["to"] for e in events if e["kind"] == "state"]
        assert states == ["starting", "running", "succeeded"]

        ckpts = c.get(f"/v1/jobs/{job_id}/checkpoints").json()
        assert [ck["step"] for ck in ckpts][-1] == 2 and all(ck["uri"].startswith("file://") for ck in ckpts)
        trajs = c.get(f"/v1/jobs/{job_id}/trajectories", params={"limit": 50}).json()["items"]
        assert len(trajs) == 2 * 2 * 2  # steps x prompts x generations
        last = c.get(f"/v1/jobs/{job_id}/trajectories", params={"step": 1}).json()["items"]
        assert len(last) == 4 and all(t["train_step"] == 1 for t in last)
        page = c.get(f"/v1/jobs/{job_id}/trajectories", params={"limit": 3, "offset": 6}).json()["items"]
        assert [t["id"] for t in page] == [t["id"] for t in trajs[6:]]
        assert all(t["job_id"] == job_id for t in trajs)
        assert c.get("/metrics").text.count('taper_jobs{state="succeeded"} 1.0') == 1
    # the finished job's placement group is gone, so later tests get the whole local Ray
    assert not Store(redis_url).r.smembers(Store(redis_url).k_placed())
    # the server used this process's Ray: no embedded head was started (it would outlive the test)
    assert not (tmp_path / EMBEDDED_RECORD).exists()
