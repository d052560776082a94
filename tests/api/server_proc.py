"""`python -m api.cli serve` as a subprocess joined to the test's Ray and Redis (for restart tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from rl_service.embedded import free_port


class ApiProcess:
    def __init__(self, redis_url: str, ray_address: str, data_dir: Path, cwd: Path | None = None,
                 extra_env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = data_dir
        self.cwd = cwd
        self.env = dict(os.environ, TAPER_REDIS_URL=redis_url, RAY_ADDRESS=ray_address,
                        TAPER_DATA_DIR=str(data_dir), **(extra_env or {}))
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> ApiProcess:
        self.log = open(self.data_dir / f"api-{self.port}-{time.monotonic_ns()}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "api.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)],
            env=self.env, cwd=self.cwd, stdout=self.log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"API exited early:\n{Path(self.log.name).read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("API did not come up")

    def kill(self) -> None:
        """SIGKILL: no shutdown hooks run, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.log.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()

    def logs(self) -> str:
        return Path(self.log.name).read_text()
