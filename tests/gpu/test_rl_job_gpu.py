"""A real RL job on one GPU through the service: `taper serve` (its embedded Redis and local Ray) takes the job
over REST; the job driver trains the `small` preset on the GPU while the rollout engine (vLLM, our plugin) shares
the device. The same code path as on CPU: warm start, rollouts, scoring, learning, weight pushes, checkpoints;
then a pause after a checkpoint and a resume from it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from api.cli.demo import SHARED_GPU_RESOURCES, EmbeddedService

STEPS = 5
SPEC = {
    "name": "gpu-calculator",
    "model": {"preset": "small"},
    "warm_start": {"num_examples": 400, "max_steps": 150, "until_loss": 0.1, "learning_rate": 1e-3, "batch_size": 16},
    "environment": {"name": "calculator"},
    "tasks": {"seed": 0, "num_train": 2000, "num_eval": 16},
    "algorithm": {"loss_type": "dapo", "learning_rate": 1e-4, "beta": 0.0},
    "rollout": {"num_workers": 1, "prompts_per_step": 8, "num_generations": 8, "max_turns": 3,
                "max_tokens_per_turn": 48, "max_total_tokens": 256, "temperature": 0.8},
    "reward_schedule": {"kind": "linear", "w_start": 0.5, "w_end": 0.0, "horizon": STEPS},
    "total_steps": STEPS,
    "checkpoint_every": 2,
    "eval_every": 0,
    "seed": 0,
    "resources": SHARED_GPU_RESOURCES,
}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    data_dir = tmp_path_factory.mktemp("taper-gpu-service")
    with EmbeddedService(data_dir, Console()) as service:
        key = service.create_key()
        yield httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _wait(client: httpx.Client, job_id: str, until, timeout_s: float = 900) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").raise_for_status().json()
        if until(job):
            return job
        if job["state"] in ("failed", "cancelled"):
            events = client.get(f"/v1/jobs/{job_id}/events", params={"limit": 50}).json()["items"]
            pytest.fail(f"job {job_id} {job['state']}: {job.get('error')}; events {[e['kind'] for e in events]}")
        time.sleep(1)
    pytest.fail(f"job {job_id} still {job['state']} after {timeout_s} s")


def _train_rows(client: httpx.Client, job_id: str) -> list[dict]:
    rows = client.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 1000}).raise_for_status().json()["items"]
    return [{**r["metrics"], "step": r["step"]} for r in rows if "loss" in r["metrics"]]


def test_a_job_trains_on_the_gpu_and_lands_as_on_cpu(client: httpx.Client) -> None:
    job_id = client.post("/v1/jobs", json=SPEC).raise_for_status().json()["id"]
    _wait(client, job_id, lambda j: j["state"] == "succeeded")
    rows = _train_rows(client, job_id)
    assert [r["step"] for r in rows] == list(range(STEPS))
    for r in rows:
        assert r["trajectories/num"] == 64
        assert r["time/learn"] > 0 and r["weight_sync_s"] > 0
        # engine (bf16, vLLM) and learner (fp32 weights under bf16 autocast) see nearly the same policy
        assert r["logprob_mismatch/mean_abs"] < 0.1, r["logprob_mismatch/mean_abs"]
    events = [e["kind"] for e in client.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}).json()["items"]]
    assert "warm_start_done" in events
    trajectories = client.get(f"/v1/jobs/{job_id}/trajectories", params={"limit": 4}).raise_for_status().json()
    assert len(trajectories["items"]) == 4
    steps = [c["step"] for c in client.get(f"/v1/jobs/{job_id}/checkpoints").raise_for_status().json()]
    assert {2, 4} <= set(steps)


def test_a_paused_job_resumes_from_its_checkpoint_on_the_gpu(client: httpx.Client, tmp_path: Path) -> None:
    job_id = client.post("/v1/jobs", json={**SPEC, "name": "gpu-resume"}).raise_for_status().json()["id"]
    _wait(client, job_id, lambda j: any(c["step"] >= 2 for c in client.get(f"/v1/jobs/{job_id}/checkpoints").json()))
    client.post(f"/v1/jobs/{job_id}/pause").raise_for_status()
    _wait(client, job_id, lambda j: j["state"] == "paused")
    client.post(f"/v1/jobs/{job_id}/resume").raise_for_status()
    _wait(client, job_id, lambda j: j["state"] == "succeeded")
    events = client.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}).json()["items"]
    resumed = [e["data"]["step"] for e in events if e["kind"] == "resumed"]
    assert resumed and resumed[0] >= 2
    # every step trained once, the resumed ones after the checkpoint's
    assert sorted({r["step"] for r in _train_rows(client, job_id)}) == list(range(STEPS))
