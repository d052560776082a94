"""Redis killed (SIGKILL) under a running job and started again on the same data dir: the job finishes with
every step trained once, and while Redis is down the API answers 503 with Retry-After, not 500.

A real redis-server with an append-only file (as the embedded default keeps one), the real scheduler and job
drivers on a real local Ray, the stand-in runner (0.3 s a step), and the real API app in-process."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from api.app import create_app
from rl_service.control.service import TaperService
from rl_service.control.settings import TaperSettings
from rl_service.control.store import Store
from rl_service.job_states import JobState
from rl_service.spec import JobSpec
from tests.rl_service.control.test_scheduler import running_scheduler
from tests.waiting import wait_for


class RestartableRedis:
    def __init__(self, data_dir: Path, port: int) -> None:
        self.data_dir, self.port = data_dir, port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.data_dir), "--save", "", "--appendonly", "yes", "--appendfsync", "everysec"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self._answers, 15, "redis-server to answer")

    def _answers(self) -> bool:
        try:
            return bool(redis.Redis.from_url(self.url, socket_timeout=0.5).ping())
        except redis.ConnectionError:
            return False

    def kill(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()


@pytest.fixture
def restartable_redis(tmp_path: Path) -> Iterator[RestartableRedis]:
    from rl_service.ports import free_port

    server = RestartableRedis(tmp_path / "redis", free_port())
    server.data_dir.mkdir()
    server.start()
    yield server
    if server.process is not None and server.process.poll() is None:
        server.kill()


def test_a_job_survives_redis_killed_and_restarted(restartable_redis: RestartableRedis, standin_runner_cls,
                                                   tmp_path: Path) -> None:
    store = Store(restartable_redis.url, prefix="rr")
    service = TaperService(store, tmp_path)
    app = create_app(service, TaperSettings(data_dir=tmp_path))
    key = store.create_api_key("t")
    headers = {"Authorization": f"Bearer {key}"}
    with running_scheduler(store, standin_runner_cls), TestClient(app) as client:
        job = client.post("/v1/jobs", json=JobSpec(total_steps=12, seed=300).model_dump(), headers=headers).json()
        wait_for(lambda: store.get_job(job["id"]).step >= 3, what="three steps")

        restartable_redis.kill()
        down = client.get(f"/v1/jobs/{job['id']}", headers=headers)
        assert down.status_code == 503, down.text
        assert down.headers["Retry-After"] == "5" and down.json()["error"]["code"] == "unavailable"
        time.sleep(2.0)
        restartable_redis.start()

        wait_for(lambda: store.get_job(job["id"]).state == JobState.SUCCEEDED, 180, "the job to finish")
        assert client.get(f"/v1/jobs/{job['id']}", headers=headers).json()["state"] == "succeeded"
    steps = [m["step"] for m in store.metrics(job["id"])]
    assert steps == list(range(12))  # every step once: none trained twice, none missing
