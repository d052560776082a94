"""Start and stop the example MCP server (examples/mcp/weather_server.py) as a real process on 127.0.0.1."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "examples" / "mcp" / "weather_server.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_weather_server(port: int | None = None, timeout_s: float = 60.0) -> tuple[subprocess.Popen, str]:
    port = port or free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the MCP server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"http://127.0.0.1:{port}/mcp"
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the MCP server did not start listening")


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=30)
