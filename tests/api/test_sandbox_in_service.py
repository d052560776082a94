"""The sandbox inside the service as deployed: `taper serve` (embedded Redis and Ray head) runs a real job of the
`python` environment whose outcome grader is OpenAI's `python` grader, so model-written code runs in tool calls
and the tenant's grade() runs in the scorer, both in Ray workers (uvloop) and, when the suite runs as root as CI
does, under a root service. Every trajectory must be scored: a sandbox that cannot start there turns them all
into `env_error` (the job itself still succeeds, which is why the test looks at each trajectory)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest

from api.cli.launcher import ApiServerProcess
from rl_service.control.local_services import stop_embedded
from tests.waiting import wait_for

# a score no verifier gives: the trajectory's outcome can only have come from this grader
GRADE = "def grade(sample, item):\n    return 0.25 if len(sample['output_text']) % 2 else 0.75\n"
JOB = {
    "name": "sandbox-in-service",
    "model": {"preset": "tiny"},
    "environment": {"name": "python", "grader": {"type": "python", "name": "parity", "source": GRADE}},
    "tasks": {"seed": 0, "num_train": 8, "num_eval": 0},
    # a few steps on the environment's demonstrations: enough for run_python calls, not for right answers
    "warm_start": {"num_examples": 32, "max_steps": 60, "batch_size": 4, "until_loss": None},
    "rollout": {"num_workers": 1, "prompts_per_step": 2, "num_generations": 2, "max_turns": 2, "temperature": 0.5,
                "max_tokens_per_turn": 80, "max_total_tokens": 600, "kv_cache_gib": 0.25},
    "resources": {"learner_cpus": 1, "rollout_cpus": 1},
    "total_steps": 2,
}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    data_dir = tmp_path_factory.mktemp("sandbox-service")
    server = ApiServerProcess(data_dir / "api.log", env={"TAPER_DATA_DIR": str(data_dir), "RAY_ADDRESS": ""})
    server.env.pop("TAPER_REDIS_URL", None)
    try:
        server.start()
        key = (data_dir / "api-key").read_text().strip()
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
            yield client
    finally:
        server.stop()
        stop_embedded(data_dir)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_python_graded_python_environment_job_scores_every_trajectory(service: httpx.Client) -> None:
    print("the service runs as", "root" if os.geteuid() == 0 else f"uid {os.geteuid()}")
    r = service.post("/v1/jobs", json=JOB)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    job = wait_for(lambda: (j := service.get(f"/v1/jobs/{job_id}").json())["state"] in
                   ("succeeded", "failed", "cancelled", "paused") and j, 800, "the job to finish")
    assert job["state"] == "succeeded", job

    trajectories = service.get(f"/v1/jobs/{job_id}/trajectories", params={"limit": 100}).json()["items"]
    assert len(trajectories) == JOB["total_steps"] * 2 * 2
    for t in trajectories:
        assert t["status"] != "env_error" and t["error"] is None, t["error"]
        assert t["outcome_reward"] in (0.25, 0.75), t
    calls = [c for t in trajectories for s in t["steps"] for c in s["tool_calls"] if c["error"] is None]
    assert calls, "no trajectory ran code in the sandbox"
    assert all(c["result"] is not None and "environment crashed" not in c["result"] for c in calls)
