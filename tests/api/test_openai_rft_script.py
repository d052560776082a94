"""docs/migrate-from-openai-rft.md's claim: an RFT script written for OpenAI's API (examples/openai_rft/rft.py)
runs against Taper unchanged but for OPENAI_BASE_URL and OPENAI_API_KEY (the official client reads both), the
operator aliasing the OpenAI model it names. The job's driver is played through the store, as in the other
OpenAI-compatibility tests: what is tested is the API surface the script drives, not training."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from api_helpers import ThreadedServer

from api.app import create_app
from rl_service.control.service import TaperService
from rl_service.control.settings import TaperSettings
from rl_service.control.store import Store

ROOT = Path(__file__).resolve().parents[2]
ALIASES = {"o4-mini-2025-04-16": "small"}


def _play_driver(store: Store, stop: threading.Event) -> None:
    """Start the script's job, report 4 steps, an eval and a checkpoint, and succeed it."""
    while not stop.is_set() and not store.list_jobs(None)[0]:
        time.sleep(0.05)
    if stop.is_set():
        return
    job = store.list_jobs(None)[0][0]
    store.transition(job.id, "starting")
    store.transition(job.id, "running")
    for t in range(job.spec.total_steps):
        store.add_metrics(job.id, t, {"loss": 0.1, "reward/outcome_mean": 0.5, "success_rate": 0.5,
                                      "action_tokens": 64.0, "time/step": 1.0}, steps_done=t + 1)
    store.add_metrics(job.id, job.spec.total_steps, {"eval/success_rate": 0.75})
    step_dir = Path(job.work_dir) / "checkpoints" / f"step_{job.spec.total_steps:08d}"
    step_dir.mkdir(parents=True)
    store.add_checkpoint(job.id, job.spec.total_steps, step_dir.resolve().as_uri())
    store.transition(job.id, "succeeded")


def test_an_rft_script_runs_unchanged_but_for_base_url_and_key(redis_url: str, tmp_path: Path) -> None:
    store = Store(redis_url)
    settings = TaperSettings(data_dir=tmp_path, model_aliases=ALIASES)
    service = TaperService(store, tmp_path, model_aliases=settings.model_aliases)
    stop = threading.Event()
    with ThreadedServer(create_app(service, settings)) as server:
        driver = threading.Thread(target=_play_driver, args=(store, stop), daemon=True)
        driver.start()
        env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
        env.update(OPENAI_BASE_URL=f"{server.url}/v1", OPENAI_API_KEY=store.create_api_key("rft"))
        try:
            result = subprocess.run([sys.executable, str(ROOT / "examples" / "openai_rft" / "rft.py")], env=env,
                                    cwd=tmp_path, capture_output=True, text=True, timeout=180)
        finally:
            stop.set()
            driver.join(timeout=10)
    assert result.returncode == 0, result.stdout + result.stderr
    [job] = store.list_jobs(None)[0]
    assert f"succeeded: fine_tuned_model={job.id}, trained_tokens={64 * 4}" in result.stdout
    assert "grader ok: reward 1.0" in result.stdout and "valid_success_rate" in result.stdout
    spec = job.spec
    assert (spec.model.preset, spec.name, spec.seed, spec.metadata) == ("small", "sums", 7, {"experiment": "rft-sums"})
    assert spec.environment.grader["type"] == "python"
    assert (spec.tasks.train_tasks, spec.tasks.eval_tasks, spec.total_steps) == (16, 4, 4)  # 1 epoch of 16 at 4
    assert (spec.rollout.num_generations, spec.eval_every) == (4, 2)
