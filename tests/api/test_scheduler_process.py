"""`taper scheduler` runs jobs with no API at all, and two of them never both place: two real scheduler
processes on one real Redis and the data dir's embedded Ray head (the first starts it, the second finds it;
a cluster of its own, so nothing other tests left on the session's Ray can hold its resources), jobs
submitted straight to the store, the stand-in runner (0.2 s a step): every job finishes, placed once, with
the one driver it was given, and both processes stop cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from rl_service.control.local_services import stop_embedded
from rl_service.control.store import Store
from rl_service.job_states import JobState
from rl_service.spec import JobSpec
from tests.api.test_restart import STANDIN_DIR, wait_for


def scheduler_process(env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-c", "from api.cli.cli import app; app()", "scheduler"], env=env,
                                cwd=STANDIN_DIR, stdout=out, stderr=subprocess.STDOUT)


def test_two_scheduler_processes_place_each_job_once_without_an_api(redis_url, tmp_path) -> None:
    store = Store(redis_url)
    env = {**os.environ, "TAPER_REDIS_URL": redis_url, "TAPER_LOCAL_CPUS": "2",
           "TAPER_DATA_DIR": str(tmp_path), "TAPER_JOB_RUNNER": "standin_runner:StandInRunner",
           "PYTHONPATH": os.pathsep.join([str(STANDIN_DIR), os.environ.get("PYTHONPATH", "")])}
    env.pop("RAY_ADDRESS", None)
    first = scheduler_process(env, tmp_path / "first.log")
    second = None
    try:
        wait_for(lambda: store.r.get(store.k_lock()), what=f"a leader: {(tmp_path / 'first.log').read_text()}")
        second = scheduler_process(env, tmp_path / "second.log")
        spec = JobSpec(total_steps=8, seed=200, resources={"learner_cpus": 0.5, "rollout_cpus": 0.5})
        jobs = [store.submit_job("t", spec, str(tmp_path / "jobs"))[0].id for _ in range(4)]
        wait_for(lambda: all(store.get_job(j).state == JobState.SUCCEEDED for j in jobs), 300,
                 f"every job to finish: {[store.get_job(j).state for j in jobs]}")
        for j in jobs:
            got = store.get_job(j)
            events = store.events(j, limit=1000)
            placed = [e for e in events if e["kind"] == "state" and e["data"].get("to") == "starting"]
            assert len(placed) == 1 and got.attempts == 1 and got.step == 8, (placed, got.attempts, got.step)
            assert "driver_lost" not in [e["kind"] for e in events]
        for proc in (first, second):
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
        stop_embedded(tmp_path)
