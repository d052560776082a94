"""Start and stop the example MCP server (examples/mcp/weather_server.py) as a real process on 127.0.0.1."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from rl_service.ports import free_port

SERVER = Path(__file__).resolve().parents[2] / "examples" / "mcp" / "weather_server.py"
SHOP_SERVER = Path(__file__).with_name("mcp_shop_server.py")  # 150 tools, listed in pages


# The example server, killed (os._exit, as by a crash) when a tool call looks up the Nth temperature: the
# call that does it never gets an answer.
_DYING = """
import os, runpy, sys
sys.argv = ["weather_server", "--port", sys.argv[2]]
server = runpy.run_path({path!r}, run_name="weather")
limit, seen = int({limit}), []

class Dying(dict):
    def __contains__(self, key):
        seen.append(key)
        if len(seen) >= limit:
            os._exit(1)
        return dict.__contains__(self, key)

server["get_temperature"].__globals__["TEMPERATURES_C"] = Dying(server["TEMPERATURES_C"])
server["main"]()
"""


def start_weather_server(port: int | None = None, timeout_s: float = 60.0,
                         die_at_lookup: int | None = None, script: Path = SERVER) -> tuple[subprocess.Popen, str]:
    port = port or free_port()
    if die_at_lookup is None:
        argv = [sys.executable, str(script), "--port", str(port)]
    else:
        argv = [sys.executable, "-c", _DYING.format(path=str(SERVER), limit=die_at_lookup), "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
