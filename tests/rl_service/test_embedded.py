"""The embedded defaults of a data dir: a private Redis and a local Ray head that outlive the process that
started them, are found again by the next one, and are stopped by `taper down`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from api.cli import app as cli
from rl_service.embedded import (
    EMBEDDED_RECORD,
    embedded_ray_head,
    embedded_redis,
    ensure_embedded_ray_head,
    ensure_embedded_redis,
    pid_alive,
    stop_embedded,
)
from rl_service.settings import get_settings
from rl_service.store import Store

# a separate process joins the head named by RAY_ADDRESS and runs a task there, as a job's entrypoint does
JOIN = """
import ray
from rl_service.embedded import ensure_ray
ensure_ray()
print(ray.get(ray.remote(lambda: 6 * 7).remote()), ray.cluster_resources()["CPU"])
"""


def test_embedded_services_are_shared_and_stopped_by_taper_down(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    server = ensure_embedded_redis(tmp_path)
    head = ensure_embedded_ray_head(tmp_path, num_cpus=1)
    try:
        record = json.loads((tmp_path / EMBEDDED_RECORD).read_text())
        assert record == {"redis": {"url": server.url, "pid": server.pid},
                          "ray": {"address": head.address, "pid": head.pid, "temp_dir": head.temp_dir}}
        # started once: the next caller finds the same ones
        assert ensure_embedded_redis(tmp_path).pid == server.pid
        assert ensure_embedded_ray_head(tmp_path).pid == head.pid
        Store(server.url).create_api_key("kept")
        out = subprocess.run([sys.executable, "-c", JOIN], capture_output=True, text=True, timeout=180,
                             env={**os.environ, "RAY_ADDRESS": head.address})
        assert out.returncode == 0 and out.stdout.split() == ["42", "1.0"], out.stderr[-2000:]

        monkeypatch.setenv("TAPER_DATA_DIR", str(tmp_path))
        monkeypatch.delenv("TAPER_REDIS_URL", raising=False)
        get_settings.cache_clear()
        result = CliRunner().invoke(cli, ["down"], catch_exceptions=False)
        assert result.exit_code == 0
        assert head.address in result.output and server.url in result.output, result.output
        assert not pid_alive(head.pid) and not pid_alive(server.pid) and not Path(head.temp_dir).exists()
        assert embedded_ray_head(tmp_path) is None and embedded_redis(tmp_path) is None
        assert not (tmp_path / EMBEDDED_RECORD).exists()
        assert "nothing was running" in CliRunner().invoke(cli, ["down"]).output

        # a new Redis on the same data dir replays the append-only file: the data survived
        again = ensure_embedded_redis(tmp_path)
        assert again.pid != server.pid and Store(again.url).has_api_keys()
    finally:
        stop_embedded(tmp_path)
        get_settings.cache_clear()
    assert not pid_alive(head.pid) and not pid_alive(server.pid)
