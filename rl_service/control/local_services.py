"""The embedded defaults: a private redis-server and a local Ray, for running on one machine.

Both listen on 127.0.0.1 only and both require a secret kept in the data dir, each file created 0600: the
Redis password (`redis-password`, handed to redis-server on its stdin, never on a command line) and the Ray
head's token (`ray-auth-token`, Ray's token authentication: every Ray process reads it through
RAY_AUTH_TOKEN_PATH).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import redis

from rl_service.ports import free_port
from rl_service.ray_cluster import ensure_ray

log = logging.getLogger(__name__)

# ---- secrets: files only their owner can read, never written first and restricted after ----
REDIS_PASSWORD_FILE = "redis-password"
RAY_TOKEN_FILE = "ray-auth-token"


class EmbeddedServiceError(RuntimeError):
    """The data dir's embedded services cannot be used as they are; the message says what to do."""


def write_secret(path: Path, value: str) -> None:
    """Write `value` to `path` with mode 0600 from the first byte: a new file created exclusively, then renamed
    over `path` (a reader sees the old file or the whole new one)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(value)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_secret(path: Path) -> str:
    """A secret file's content; refused if other users may read or write it."""
    path = Path(path)
    mode = path.stat().st_mode
    if mode & 0o077:
        raise EmbeddedServiceError(f"{path} is open to other users (mode {mode & 0o777:o}): it holds a secret; "
                                   f"run `chmod 600 {path}`")
    return path.read_text().strip()


def ensure_secret(path: Path) -> str:
    """The secret in `path`, generated (256 random bits) if the file does not exist."""
    path = Path(path)
    if not path.exists():
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:  # another process created it just now
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
                f.flush()
                os.fsync(f.fileno())
    return read_secret(path)


@dataclasses.dataclass
class RedisServer:
    url: str  # without the password: safe to print and record
    pid: int
    process: subprocess.Popen | None = None  # None for a server this process found running, not started
    password: str | None = dataclasses.field(default=None, repr=False)

    @property
    def client_url(self) -> str:
        """The URL clients connect with: `url` with the password (keep it in memory, never log it)."""
        if self.password is None:
            return self.url
        return self.url.replace("redis://", f"redis://:{quote(self.password, safe='')}@", 1)

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
                        detach: bool = False, password: str | None = None, port: int | None = None) -> RedisServer:
    """Start redis-server on a free 127.0.0.1 port with its files under ``data_dir``.

    With ``persist`` the server keeps an append-only file, so a restarted service finds its jobs again. With
    ``detach`` it runs in its own session and outlives this process (stop it with ``RedisServer.stop``). With
    ``password`` clients must authenticate (`requirepass`, passed on the server's stdin: never in its
    command line).
    """
    exe = shutil.which(binary)
    if exe is None:
        raise RuntimeError(
            f"'{binary}' not found: install Debian's redis-server (apt-get install redis-server) "
            "or set TAPER_REDIS_URL to an existing Redis"
        )
    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir), "--save", ""]
    args += ["--appendonly", "yes" if persist else "no", "--protected-mode", "yes"]
    if password is not None:
        if not password.isalnum():
            raise ValueError("the Redis password must be letters and digits (it is written into a config line)")
        args.insert(1, "-")  # read more configuration from stdin
    log_path = data_dir / "redis.log"
    with open(log_path, "w") as log:  # a file, not a pipe: a detached server must not depend on this process
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=detach,
                                stdin=subprocess.PIPE if password is not None else subprocess.DEVNULL)
    if proc.stdin is not None:
        with proc.stdin:
            proc.stdin.write(f'requirepass "{password}"\n'.encode())
    server = RedisServer(url=f"redis://127.0.0.1:{port}/0", pid=proc.pid, process=None if detach else proc,
                         password=password)
    deadline = time.monotonic() + 15
    while not _redis_answers(server.client_url):
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited: {log_path.read_text(errors='replace')[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("redis-server did not answer within 15 s")
        time.sleep(0.05)
    return server


@dataclasses.dataclass
class RayHead:
    """A local Ray head run as `ray start --head --block` in its own session: it outlives the process that
    started it (an API restart keeps the job drivers running), and stopping the block process stops it all."""

    address: str
    pid: int
    temp_dir: str  # its own, not Ray's shared default: `ray start` leaves its address there for `ray.init()`
    auth_token_file: str | None = None  # None: a head started by an older Taper, without token auth

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


def embedded_ray_env(token_file: Path | str) -> dict[str, str]:
    """The environment of every process of the embedded head, and of any process joining it (set before Ray is
    imported): token auth with the token in `token_file` (Ray reads the file; only its path is in the
    environment), and Ray's single-machine mode (its default on macOS and Windows), where the node's address
    is 127.0.0.1: GCS, raylet, object manager, agents, workers and the client server bind loopback only (on
    Linux they would bind every interface or the machine's address, whatever --node-ip-address says), and a
    joining process connects to 127.0.0.1 instead of rewriting it to the machine's address."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def start_ray_head(log_dir: Path, num_cpus: int | None = None, attempts: int = 3,
                   timeout: float = 120.0, auth_token_file: Path | None = None) -> RayHead:
    """Start a detached local Ray head on a free 127.0.0.1 port, with token auth (the token in
    ``auth_token_file``, default ``log_dir/ray-auth-token``, generated if missing). On a loaded machine a
    raylet can abort at startup (it waits a fixed time for its agents), so a failed start is retried."""
    log_dir = Path(log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    token_file = Path(auth_token_file or log_dir / RAY_TOKEN_FILE).resolve()
    ensure_secret(token_file)
    log_path = log_dir / "ray-head.log"
    for _ in range(attempts):
        port = free_port()
        # short: Ray's unix socket paths live under it and must stay under ~107 characters
        temp_dir = tempfile.mkdtemp(prefix="taper-ray-")
        # this interpreter's Ray (not whatever `ray` script is first on PATH): the workers run this interpreter
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
               "--node-ip-address=127.0.0.1", f"--temp-dir={temp_dir}",
               "--include-dashboard=false", "--dashboard-host=127.0.0.1", "--disable-usage-stats",
               f"--object-store-memory={512 * 1024 * 1024}",
               # fixed default ports: another local Ray on this machine may hold them
               f"--dashboard-agent-listen-port={free_port()}", f"--ray-client-server-port={free_port()}"]
        if num_cpus is not None:
            cmd.append(f"--num-cpus={num_cpus}")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env={**os.environ, **embedded_ray_env(token_file),
                                                                 "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"})
        head = RayHead(address=f"127.0.0.1:{port}", pid=proc.pid, temp_dir=temp_dir,
                       auth_token_file=str(token_file))
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


def _terminate(pid: int, timeout: float) -> bool:
    """SIGTERM `pid` and wait up to `timeout` seconds for it to exit; False if there was no such process."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return True


def stop_process(pid: int, timeout: float) -> None:
    """SIGTERM `pid`; SIGKILL it if it still runs after `timeout` seconds."""
    if _terminate(pid, timeout) and pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def stop_process_group(pid: int, timeout: float) -> None:
    """SIGTERM the process that leads its own session; SIGKILL its group once it exits or after `timeout`."""
    if _terminate(pid, timeout):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # what the leader left behind, or the leader itself


def join_embedded_head(head: RayHead) -> None:
    """Join an embedded head from this process: `embedded_ray_env` applied here, though Ray is imported."""
    import ray
    from ray._private import ray_constants
    from ray._raylet import AuthenticationTokenLoader, Config

    if ray.is_initialized():
        return
    assert head.auth_token_file is not None
    read_secret(Path(head.auth_token_file))  # refuse a token file others can read before Ray uses it
    os.environ.update(embedded_ray_env(head.auth_token_file))  # inherited by what this process starts
    ray_constants.ENABLE_RAY_CLUSTER = False  # read from the environment at Ray's import
    Config.initialize("")  # the auth mode, likewise
    AuthenticationTokenLoader.instance().reset_cache()
    ensure_ray(head.address)


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


def _outdated(what: str, pid: int, data_dir: Path, missing: str) -> EmbeddedServiceError:
    return EmbeddedServiceError(
        f"the {what} running for {data_dir} (pid {pid}) was started by an older Taper without {missing}, so it "
        "is not used: stop it with `taper down` (running jobs stop and resume from their last checkpoints; no "
        "data is lost), then run `taper serve` again")


def embedded_redis(data_dir: Path) -> RedisServer | None:
    """The data dir's detached Redis if it is running (`password` None: one started without a password)."""
    rec = _read_record(data_dir).get("redis")
    if rec is None:
        return None
    password = read_secret(Path(data_dir) / rec["password_file"]) if rec.get("password_file") else None
    server = RedisServer(url=rec["url"], pid=rec["pid"], password=password)
    return server if server.alive() and _redis_answers(server.client_url) else None


def embedded_ray_head(data_dir: Path) -> RayHead | None:
    """The data dir's detached Ray head if it is running (`auth_token_file` None: one without token auth)."""
    rec = _read_record(data_dir).get("ray")
    if rec is None:
        return None
    head = RayHead(**rec)
    return head if head.alive() else None


def start_embedded_redis(data_dir: Path, binary: str = "redis-server", detach: bool = True) -> RedisServer:
    """A new Redis on the data dir's files (its append-only file keeps the jobs), with the data dir's password,
    on the port the data dir's last Redis had (drivers and schedulers hold its URL), else on a free one."""
    password = ensure_secret(Path(data_dir) / REDIS_PASSWORD_FILE)
    recorded = _read_record(data_dir).get("redis", {}).get("url")
    port = int(recorded.rsplit(":", 1)[1].split("/")[0]) if recorded else None
    return start_private_redis(Path(data_dir) / "redis", binary=binary, persist=True, detach=detach,
                               password=password, port=port)


def running_embedded_redis(data_dir: Path) -> RedisServer | None:
    """The data dir's running Redis (None if none runs); EmbeddedServiceError if it has no password."""
    server = embedded_redis(data_dir)
    if server is not None and server.password is None:
        raise _outdated("Redis", server.pid, Path(data_dir), "a password")
    return server


@contextlib.contextmanager
def _services_lock(data_dir: Path) -> Iterator[None]:
    """One process at a time starts or stops a data dir's services (the API's and the scheduler's supervisors
    may both find Redis gone)."""
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(data_dir) / ".services.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def ensure_embedded_redis(data_dir: Path, binary: str = "redis-server") -> RedisServer:
    """The data dir's Redis: the running one, or a new detached one."""
    with _services_lock(data_dir):
        return _ensure_embedded_redis(data_dir, binary)


def _ensure_embedded_redis(data_dir: Path, binary: str) -> RedisServer:
    server = running_embedded_redis(data_dir)
    if server is None:
        server = start_embedded_redis(data_dir, binary=binary)
        _write_record(data_dir, {**_read_record(data_dir), "redis": {"url": server.url, "pid": server.pid,
                                                                     "password_file": REDIS_PASSWORD_FILE}})
    return server


def running_embedded_ray_head(data_dir: Path) -> RayHead | None:
    """The data dir's running Ray head (None if none runs); EmbeddedServiceError if it has no token auth."""
    head = embedded_ray_head(data_dir)
    if head is not None and head.auth_token_file is None:
        raise _outdated("Ray head", head.pid, Path(data_dir), "token authentication")
    return head


def ensure_embedded_ray_head(data_dir: Path, num_cpus: int | None = None) -> RayHead:
    """The data dir's Ray head: the running one, or a new detached one."""
    with _services_lock(data_dir):
        return _ensure_embedded_ray_head(data_dir, num_cpus)


def _ensure_embedded_ray_head(data_dir: Path, num_cpus: int | None) -> RayHead:
    head = running_embedded_ray_head(data_dir)
    if head is None:
        head = start_ray_head(Path(data_dir) / "logs", num_cpus=num_cpus,
                              auth_token_file=Path(data_dir) / RAY_TOKEN_FILE)
        _write_record(data_dir, {**_read_record(data_dir), "ray": dataclasses.asdict(head)})
    return head


def ensure_service_ray(address: str | None, data_dir: Path, num_cpus: int | None = None) -> None:
    """Ray for the control plane: nothing to do if this process has joined one already; else the cluster at
    ``address``, or the data dir's embedded head (started if none runs)."""
    import ray

    if ray.is_initialized():
        return
    if address:
        ensure_ray(address)
    else:
        join_embedded_head(ensure_embedded_ray_head(data_dir, num_cpus=num_cpus))


def embedded_scheduler(data_dir: Path) -> int | None:
    """The pid of the data dir's detached scheduler process, if it runs."""
    pid = _read_record(data_dir).get("scheduler", {}).get("pid")
    return pid if pid and pid_alive(pid) else None


def ensure_embedded_scheduler(data_dir: Path, env: dict[str, str] | None = None) -> int:
    """The data dir's detached scheduler process (`taper scheduler`, in its own session so that it outlives the
    API): the running one, or a new one. Its output goes to `logs/scheduler.log`."""
    with _services_lock(data_dir):
        pid = embedded_scheduler(data_dir)
        if pid is None:
            (Path(data_dir) / "logs").mkdir(parents=True, exist_ok=True)
            with open(Path(data_dir) / "logs" / "scheduler.log", "a") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "rl_service.control.scheduler_process"], stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    env={**os.environ, **(env or {}), "TAPER_DATA_DIR": str(Path(data_dir).resolve())})
            pid = proc.pid
            _write_record(data_dir, {**_read_record(data_dir), "scheduler": {"pid": pid}})
        return pid


class EmbeddedSupervisor:
    """Keeps a data dir's embedded services up while the process that runs it lives: a Redis that died is
    started again on its port and files (its append-only file replays what it acknowledged), and with
    `scheduler` the detached scheduler process is started again. Checks every `interval_s` seconds. Once the
    services' record is gone (`taper down` stopped them, or the data dir was deleted) it starts nothing there
    again, stops, and sets `gone`."""

    def __init__(self, data_dir: Path, redis_binary: str = "redis-server", scheduler: bool = False,
                 interval_s: float = 2.0) -> None:
        self.data_dir, self.redis_binary, self.scheduler, self.interval_s = data_dir, redis_binary, scheduler, interval_s
        self.restarts: list[str] = []
        self.gone = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="taper-embedded-supervisor", daemon=True)

    def start(self) -> EmbeddedSupervisor:
        if self.scheduler:
            ensure_embedded_scheduler(self.data_dir)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def check_once(self) -> bool:
        """One round; False (and `gone` set) when the data dir's services were stopped for good."""
        if "redis" not in _read_record(self.data_dir):
            self.gone.set()
            return False
        if embedded_redis(self.data_dir) is None:
            ensure_embedded_redis(self.data_dir, self.redis_binary)
            self.restarts.append("redis")
        if self.scheduler and embedded_scheduler(self.data_dir) is None:
            ensure_embedded_scheduler(self.data_dir)
            self.restarts.append("scheduler")
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if not self.check_once():
                    log.warning("embedded services of %s were stopped; no longer supervising them", self.data_dir)
                    return
            except Exception as exc:  # e.g. the port taken meanwhile: said in the log, tried again next round
                log.warning("embedded services of %s: %s", self.data_dir, exc)


def stop_embedded(data_dir: Path) -> list[str]:
    """Stop the data dir's detached scheduler, Ray head and Redis (the jobs stay in Redis's files); names what it
    stopped."""
    with _services_lock(data_dir):
        return _stop_embedded(data_dir)


def _stop_embedded(data_dir: Path) -> list[str]:
    stopped = []
    scheduler = embedded_scheduler(data_dir)
    if scheduler is not None:  # first: it would start drivers on the head
        stop_process(scheduler, timeout=30)
        stopped.append(f"scheduler (pid {scheduler})")
    head, server = embedded_ray_head(data_dir), embedded_redis(data_dir)
    if head is not None:  # first: job drivers write to Redis until they stop
        head.stop()
        stopped.append(f"Ray head at {head.address}")
    if server is not None:
        server.stop()
        stopped.append(f"Redis at {server.url}")
    (Path(data_dir) / EMBEDDED_RECORD).unlink(missing_ok=True)
    return stopped
