"""The embedded defaults: a private redis-server and a local Ray, for running on one machine."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    url: str
    process: subprocess.Popen

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()


def start_private_redis(data_dir: Path, binary: str = "redis-server", persist: bool = True) -> RedisServer:
    """Start redis-server on a free 127.0.0.1 port with its files under ``data_dir``.

    With ``persist`` the server keeps an append-only file, so a restarted service finds its jobs again.
    """
    exe = shutil.which(binary)
    if exe is None:
        raise RuntimeError(
            f"'{binary}' not found: install Debian's redis-server (apt-get install redis-server) "
            "or set TAPER_REDIS_URL to an existing Redis"
        )
    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir), "--save", ""]
    args += ["--appendonly", "yes" if persist else "no", "--protected-mode", "yes"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 15
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {proc.stderr.read().decode(errors='replace')}") from None
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("redis-server did not answer within 15 s") from None
            time.sleep(0.05)
    return RedisServer(url=url, process=proc)


def ensure_ray(address: str | None = None, num_cpus: int | None = None, namespace: str = "taper") -> None:
    """Connect to the Ray cluster at ``address`` or start a local one (idempotent)."""
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, namespace=namespace, log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus, namespace=namespace, include_dashboard=False, log_to_driver=False,
                 object_store_memory=512 * 1024 * 1024)
