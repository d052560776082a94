"""The embedded services' credentials and listeners (docs/design.md section 10): the private Redis requires a generated
password, the local Ray head requires its token, both listen on 127.0.0.1 only, and their secrets live in files
created 0600 that never show up on a command line, in a log or in the data dir's record."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import redis
from typer.testing import CliRunner

from api.cli.cli import app as cli
from rl_service.control.local_services import (
    EMBEDDED_RECORD,
    RAY_TOKEN_FILE,
    REDIS_PASSWORD_FILE,
    EmbeddedServiceError,
    embedded_ray_env,
    ensure_embedded_ray_head,
    ensure_embedded_redis,
    ensure_secret,
    read_secret,
    start_private_redis,
    stop_embedded,
    write_secret,
)
from rl_service.control.settings import get_settings
from rl_service.control.store import Store


def listening_addresses(pids: list[int]) -> dict[str, list[tuple[str, int]]]:
    """The TCP/UDP addresses each process ("name[pid]") listens on (bound UDP sockets count as listening)."""
    out: dict[str, list[tuple[str, int]]] = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            out[f"{proc.name()}[{pid}]"] = [(c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="inet")
                                            if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and not c.raddr)]
        except psutil.NoSuchProcess:
            continue
    return out


def non_loopback(listening: dict[str, list[tuple[str, int]]]) -> list[tuple[str, str, int]]:
    bad = []
    for pid, addrs in listening.items():
        for ip, port in addrs:
            addr = ipaddress.ip_address(ip.split("%")[0])
            if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
                addr = addr.ipv4_mapped
            if not addr.is_loopback:  # 0.0.0.0 and :: are not loopback either
                bad.append((pid, ip, port))
    return bad


def process_tree(pid: int) -> list[int]:
    root = psutil.Process(pid)
    return [root.pid] + [p.pid for p in root.children(recursive=True)]


def command_lines(pids: list[int]) -> str:
    lines = []
    for pid in pids:
        try:
            lines.append("\0".join(psutil.Process(pid).cmdline()))
        except psutil.NoSuchProcess:
            pass
    return "\n".join(lines)


def test_secret_files_are_0600_from_the_start_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        write_secret(tmp_path / "api-key", "tpr_first\n")
        write_secret(tmp_path / "api-key", "tpr_second\n")  # replaced whole, still 0600
        generated = ensure_secret(tmp_path / "token")
    finally:
        os.umask(old)
    for name in ("api-key", "token"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o600, name
    assert (tmp_path / "api-key").read_text() == "tpr_second\n"
    assert len(generated) == 64 and ensure_secret(tmp_path / "token") == generated  # generated once
    assert sorted(p.name for p in tmp_path.iterdir()) == ["api-key", "token"]  # no temporary file left
    (tmp_path / "token").chmod(0o644)
    with pytest.raises(EmbeddedServiceError, match=r"token is open to other users \(mode 644\).*chmod 600"):
        read_secret(tmp_path / "token")


def test_embedded_redis_requires_its_password_which_stays_off_command_lines_logs_and_records(tmp_path: Path) -> None:
    server = ensure_embedded_redis(tmp_path)
    try:
        password = read_secret(tmp_path / REDIS_PASSWORD_FILE)
        assert (tmp_path / REDIS_PASSWORD_FILE).stat().st_mode & 0o777 == 0o600 and len(password) == 64
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url, password="not-the-password").ping()
        store = Store(server.client_url)
        assert store.ping() and store.create_api_key("t1")
        assert ensure_embedded_redis(tmp_path).pid == server.pid  # found again, with its password
        assert password not in server.url and password not in repr(server) and password not in repr(store.r)
        assert password not in command_lines([server.pid])
        assert password not in (tmp_path / EMBEDDED_RECORD).read_text()
        assert password not in (tmp_path / "redis" / "redis.log").read_text()
        listening = listening_addresses([server.pid])
        assert any(listening.values()) and not non_loopback(listening), listening
    finally:
        stop_embedded(tmp_path)


def test_a_passwordless_redis_left_by_an_older_taper_is_refused_until_taper_down(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """An embedded Redis started before passwords existed (found by the data dir's record) is not used: `taper
    serve` and `taper keys` say to run `taper down`, which stops it; the next start has a password and the
    same data (its append-only file)."""
    old = start_private_redis(tmp_path / "redis", persist=True, detach=True)
    (tmp_path / EMBEDDED_RECORD).write_text(json.dumps({"redis": {"url": old.url, "pid": old.pid}}))
    Store(old.url).create_api_key("kept")
    monkeypatch.setenv("TAPER_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("TAPER_REDIS_URL", raising=False)
    get_settings.cache_clear()
    try:
        with pytest.raises(EmbeddedServiceError, match=r"older Taper without a password.*`taper down`"):
            ensure_embedded_redis(tmp_path)
        for args in (["serve"], ["keys", "create", "--tenant", "t"]):
            result = CliRunner().invoke(cli, args)
            assert result.exit_code != 0 and "taper down" in result.output, (args, result.output)
            assert "Traceback" not in result.output
        result = CliRunner().invoke(cli, ["down"], catch_exceptions=False)
        assert result.exit_code == 0 and old.url in result.output and not old.alive()
        new = ensure_embedded_redis(tmp_path)
        assert new.password and Store(new.client_url).has_api_keys()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(new.url).ping()
    finally:
        stop_embedded(tmp_path)
        old.stop()
        get_settings.cache_clear()


# joins the head as the control plane does, starts an actor (a worker process of the head), reports its pid and
# the driver's own listening addresses, and stays connected until its stdin closes
JOIN = """
import json, os, psutil, ray, sys
from rl_service.control.local_services import ensure_service_ray
ensure_service_ray(None, sys.argv[1])
@ray.remote
class Pid:
    def get(self):
        return os.getpid()
actor = Pid.remote()
worker_pid = ray.get(actor.get.remote())
conns = psutil.Process().net_connections(kind="inet")
print(json.dumps({"worker": worker_pid, "driver": [[c.laddr.ip, c.laddr.port] for c in conns
                                                    if c.status == psutil.CONN_LISTEN]}), flush=True)
sys.stdin.read()
"""
# the same join with Ray's own settings, the token missing
JOIN_WITHOUT_TOKEN = """
import ray, sys
ray.init(address=sys.argv[1], log_to_driver=False)
"""


def test_embedded_ray_head_listens_on_loopback_only_and_requires_its_token(tmp_path: Path) -> None:
    head = ensure_embedded_ray_head(tmp_path, num_cpus=1)
    try:
        token_file = tmp_path / RAY_TOKEN_FILE
        assert head.auth_token_file == str(token_file) and token_file.stat().st_mode & 0o777 == 0o600
        token = read_secret(token_file)
        driver = subprocess.Popen([sys.executable, "-c", JOIN, str(tmp_path)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = driver.stdout.readline()
            assert line, driver.stderr.read()[-3000:] if driver.wait(timeout=30) is not None else ""
            joined = json.loads(line)
            pids = process_tree(head.pid)
            assert joined["worker"] in pids  # the actor runs on the head's raylet
            listening = listening_addresses(pids)
        finally:
            driver.stdin.close()
            assert driver.wait(timeout=120) == 0, driver.stderr.read()[-3000:]
        listening["driver"] = [tuple(a) for a in joined["driver"]]  # the joining driver's own servers
        assert sum(len(a) for a in listening.values()) >= 5, listening  # GCS, raylet, agents, worker, driver
        assert not non_loopback(listening), non_loopback(listening)
        assert token not in command_lines(pids)
        assert token not in (tmp_path / EMBEDDED_RECORD).read_text()

        env = {**os.environ, **embedded_ray_env(token_file)}
        env.pop("RAY_AUTH_TOKEN_PATH")
        refused = subprocess.run([sys.executable, "-c", JOIN_WITHOUT_TOKEN, head.address], capture_output=True,
                                 text=True, timeout=240, env=env)
        assert refused.returncode != 0 and "InvalidAuthToken" in refused.stderr, refused.stderr[-3000:]
    finally:
        stop_embedded(tmp_path)
