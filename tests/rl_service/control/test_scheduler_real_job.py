"""A real data-parallel job under the scheduler, on a real local Ray (2 CPUs) and a real Redis: the real
JobRunner (tiny Llama, vLLM on CPU) in a detached driver with its own bundle, 2 learner ranks (FSDP2 over gloo)
in one bundle each, one rollout worker in the last. In step 2 the driver hangs for good (the
environment's verifier blocks forever): its heartbeat goes stale, the scheduler kills it (and the ranks and
rollout worker it owns) and a second driver resumes from the step-1 checkpoint, optimizer state included."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rl_service.control.scheduler import Scheduler
from rl_service.control.store import Store
from rl_service.job_states import JobState
from rl_service.placement import job_bundles
from rl_service.training.checkpoint import list_checkpoints
from tests.rl_service.training.test_job import make_spec

HANG_ONCE = {"kind": "python", "name": "hang_once_calculator",
             "import_path": "tests.rl_service.training.learner_helpers:HangOnceCalculator"}


@pytest.mark.slow
def test_data_parallel_job_survives_a_hung_driver(redis_url, ray_local, tiny_llama_dir, tmp_path) -> None:
    store = Store(redis_url, prefix="treal")
    registration = {**HANG_ONCE, "options": {"hang_flag": str(tmp_path / "hung-once"), "hang_step": 1}}
    spec = make_spec(tiny_llama_dir, total_steps=2, checkpoint_every=1,
                     environment={"name": "hang_once_calculator", "registration": registration},
                     rollout={"kv_cache_gib": 0.25},
                     resources={"num_learners": 2, "learner_cpus": 0.5, "rollout_cpus": 0.5})
    assert job_bundles(spec) == [{"CPU": 0.5}] * 4  # driver, rank 0, rank 1, rollout worker: the whole cluster
    sched = Scheduler(store, tick_s=0.2, driver_grace_s=2.0, liveness_every_s=1.0, heartbeat_every_s=0.5,
                      heartbeat_timeout_s=20.0)
    sched.start()
    try:
        job = store.submit_job("t", spec, str(tmp_path / "work"))[0]
        deadline = time.monotonic() + 900
        while store.get_job(job.id).state not in (JobState.SUCCEEDED, JobState.FAILED):
            assert time.monotonic() < deadline, [(e["kind"], e["data"]) for e in store.events(job.id, limit=1000)]
            time.sleep(0.5)
    finally:
        sched.stop()
        for job_id in store.r.smembers(store.k_placed()):
            sched.ray_jobs.release(job_id)
    got = store.get_job(job.id)
    events = store.events(job.id, limit=1000)
    assert got.state == JobState.SUCCEEDED, [e for e in events if e["kind"] == "error"]
    assert got.attempts == 2 and got.step == 2
    hung = [e["data"] for e in events if e["kind"] == "driver_hung"]
    # silent_s is rounded to the millisecond: a kill just past the 20 s timeout can read 20.0
    assert len(hung) == 1 and hung[0]["step"] == 1 and hung[0]["silent_s"] >= 20.0
    assert hung[0]["phase_deadline_s"] is None  # stuck in scoring: the operator's allowance alone
    assert [e["data"]["step"] for e in events if e["kind"] == "resumed"] == [1]
    assert [m["step"] for m in store.metrics(job.id) if "loss" in m["metrics"]] == [0, 1]
    ckpts = list_checkpoints(Path(got.work_dir) / "checkpoints")
    assert [c.step for c in ckpts] == [1, 2]
    learner_state = ckpts[-1].learner_state()
    assert learner_state["world_size"] == 2 and learner_state["optimizer_steps"] == 2
