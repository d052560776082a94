"""The embedded defaults: a private redis-server and a local Ray, for running on one machine."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class RedisServer:
    url: str
    pid: int
    process: subprocess.Popen | None = None  # None for a server this process found running, not started

    def alive(self) -> bool:
        return pid_alive(self.pid)

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    self.process.kill()
            return
        stop_process_group(self.pid, timeout)


def start_private_redis(data_dir: Path, binary: str = "redis-server", persist: bool = True,
                        detach: bool = False) -> RedisServer:
    """Start redis-server on a free 127.0.0.1 port with its files under ``data_dir``.

    With ``persist`` the server keeps an append-only file, so a restarted service finds its jobs again. With
    ``detach`` it runs in its own session and outlives this process (stop it with ``RedisServer.stop``).
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
    log_path = data_dir / "redis.log"
    with open(log_path, "w") as log:  # a file, not a pipe: a detached server must not depend on this process
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=detach)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 15
    while not _redis_answers(url):
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited: {log_path.read_text(errors='replace')[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("redis-server did not answer within 15 s")
        time.sleep(0.05)
    return RedisServer(url=url, pid=proc.pid, process=None if detach else proc)


@dataclasses.dataclass
class RayHead:
    """A local Ray head run as `ray start --head --block` in its own session: it outlives the process that
    started it (an API restart keeps the job drivers running), and stopping the block process stops it all."""

    address: str
    pid: int
    temp_dir: str  # its own, not Ray's shared default: `ray start` leaves its address there for `ray.init()`

    def alive(self) -> bool:
        if not pid_alive(self.pid):
            return False
        host, port = self.address.rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return True
        except OSError:
            return False

    def stop(self, timeout: float = 30.0) -> None:
        stop_process_group(self.pid, timeout)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


RAY_READY = "will now block forever"
# the head binds 127.0.0.1 only; Ray's token auth (on by default for `ray start`) would have to be handed
# to every client, unlike the local cluster `ray.init()` starts
_HEAD_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def start_ray_head(log_dir: Path, num_cpus: int | None = None, attempts: int = 3,
                   timeout: float = 120.0) -> RayHead:
    """Start a detached local Ray head on a free port. On a loaded machine a raylet can abort at startup
    (it waits a fixed time for its agents), so a failed start is retried."""
    ray_bin = Path(sys.executable).with_name("ray")
    log_dir = Path(log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "ray-head.log"
    for _ in range(attempts):
        port = free_port()
        # short: Ray's unix socket paths live under it and must stay under ~107 characters
        temp_dir = tempfile.mkdtemp(prefix="taper-ray-")
        cmd = [str(ray_bin), "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
               f"--temp-dir={temp_dir}",
               "--include-dashboard=false", "--disable-usage-stats", f"--object-store-memory={512 * 1024 * 1024}",
               # the agent's one fixed default port: another local Ray on this machine may hold it
               f"--dashboard-agent-listen-port={free_port()}"]
        if num_cpus is not None:
            cmd.append(f"--num-cpus={num_cpus}")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env={**os.environ, **_HEAD_ENV, "PYTHONUNBUFFERED": "1"})
        head = RayHead(address=f"127.0.0.1:{port}", pid=proc.pid, temp_dir=temp_dir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            if RAY_READY in log_path.read_text(errors="replace"):
                return head
            time.sleep(0.2)
        head.stop()
    raise RuntimeError(f"the local Ray head did not start in {attempts} attempts: "
                       f"{log_path.read_text(errors='replace')[-2000:]}")


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting for its parent counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def stop_process_group(pid: int, timeout: float) -> None:
    """SIGTERM the process that leads its own session; SIGKILL its group once it exits or after `timeout`."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)  # what the leader left behind, or the leader itself
    except (ProcessLookupError, PermissionError):
        pass


def ensure_ray(address: str | None = None, num_cpus: int | None = None, namespace: str = "taper") -> None:
    """Connect to the Ray cluster at ``address`` (default: ``RAY_ADDRESS``) or start a local one (idempotent)."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace=namespace, log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus, namespace=namespace, include_dashboard=False, log_to_driver=False,
                 object_store_memory=512 * 1024 * 1024)


# ---- the embedded services of a data dir: started once, shared by every `taper serve` on it ----
EMBEDDED_RECORD = "embedded.json"


def _read_record(data_dir: Path) -> dict[str, dict]:
    try:
        return json.loads((Path(data_dir) / EMBEDDED_RECORD).read_text())
    except (OSError, ValueError):
        return {}


def _write_record(data_dir: Path, record: dict[str, dict]) -> None:
    path = Path(data_dir) / EMBEDDED_RECORD
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)


def _redis_answers(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_timeout=2)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def embedded_redis(data_dir: Path) -> RedisServer | None:
    """The data dir's detached Redis if it is running."""
    rec = _read_record(data_dir).get("redis")
    if rec is None:
        return None
    server = RedisServer(url=rec["url"], pid=rec["pid"])
    return server if server.alive() and _redis_answers(server.url) else None


def embedded_ray_head(data_dir: Path) -> RayHead | None:
    """The data dir's detached Ray head if it is running."""
    rec = _read_record(data_dir).get("ray")
    if rec is None:
        return None
    head = RayHead(**rec)
    return head if head.alive() else None


def ensure_embedded_redis(data_dir: Path, binary: str = "redis-server") -> RedisServer:
    """The data dir's Redis: the running one, or a new detached one (its append-only file keeps the jobs)."""
    server = embedded_redis(data_dir)
    if server is None:
        server = start_private_redis(Path(data_dir) / "redis", binary=binary, persist=True, detach=True)
        _write_record(data_dir, {**_read_record(data_dir), "redis": {"url": server.url, "pid": server.pid}})
    return server


def ensure_embedded_ray_head(data_dir: Path, num_cpus: int | None = None) -> RayHead:
    """The data dir's Ray head: the running one, or a new detached one."""
    head = embedded_ray_head(data_dir)
    if head is None:
        head = start_ray_head(Path(data_dir) / "logs", num_cpus=num_cpus)
        _write_record(data_dir, {**_read_record(data_dir), "ray": dataclasses.asdict(head)})
    return head


def ensure_service_ray(address: str | None, data_dir: Path, num_cpus: int | None = None) -> None:
    """Ray for the control plane: nothing to do if this process has joined one already; else the cluster at
    ``address``, or the data dir's embedded head (started if none runs)."""
    import ray

    if not ray.is_initialized():
        ensure_ray(address or ensure_embedded_ray_head(data_dir, num_cpus=num_cpus).address)


def stop_embedded(data_dir: Path) -> list[str]:
    """Stop the data dir's detached Ray head and Redis (the jobs stay in Redis's files); names what it stopped."""
    stopped = []
    head, server = embedded_ray_head(data_dir), embedded_redis(data_dir)
    if head is not None:  # first: job drivers write to Redis until they stop
        head.stop()
        stopped.append(f"Ray head at {head.address}")
    if server is not None:
        server.stop()
        stopped.append(f"Redis at {server.url}")
    (Path(data_dir) / EMBEDDED_RECORD).unlink(missing_ok=True)
    return stopped
