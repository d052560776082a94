"""Run `python -m api.cli serve` as a child process and wait until it answers `/healthz`.

Used by `taper demo`, the API benchmark and the restart tests: the server runs in its own process, as in
production, and a crash there cannot take the caller down.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from rl_service.control.local_services import free_port


class ApiServerProcess:
    """One API server child process on 127.0.0.1 and a free port, its output in `log_path`."""

    def __init__(self, log_path: Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.env = dict(os.environ, **(env or {}))
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180.0, attempts: int = 3) -> ApiServerProcess:
        """Start the server; raise RuntimeError (with the log's tail) if it exits or does not answer in time.
        The free port is chosen before the server binds it, after its start-up (which may start services
        that take free ports too): if another process took it meanwhile, the start is retried on a new one."""
        for attempt in range(attempts):
            if attempt:
                self.port = free_port()
                self.url = f"http://127.0.0.1:{self.port}"
            if self._start_once(timeout):
                return self
            if "address already in use" not in self.logs():
                break
        raise RuntimeError(f"the API server exited (log {self.log_path}):\n{self.logs()[-3000:]}")

    def _start_once(self, timeout: float) -> bool:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:  # the child keeps its own handle
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "api.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)],
                env=self.env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the API server did not answer within {timeout:.0f} s (log {self.log_path})")

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM (the server's shutdown hooks run), SIGKILL if it does not exit in `timeout` seconds."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)

    def kill(self) -> None:
        """SIGKILL: no shutdown hooks run, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def logs(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""
