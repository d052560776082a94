"""Helpers shared by the API tests."""

from __future__ import annotations

from dataclasses import dataclass

import redis
from fastapi.testclient import TestClient

from rl_service.control.service import TaperService
from rl_service.control.store import Store


@dataclass
class Api:
    client: TestClient
    store: Store
    service: TaperService
    key_a: str
    key_b: str

    def h(self, key: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key or self.key_a}"}


def redis_dump(url: str) -> dict[bytes, bytes]:
    """Every key with its serialized value: equal dumps mean nothing was written."""
    r = redis.Redis.from_url(url)
    return {k: r.dump(k) for k in sorted(r.scan_iter(count=1000))}


def redis_contents(url: str) -> dict[str, object]:
    """Every key with its contents read by type: unlike DUMP bytes, equal whatever order a hash table is
    rehashed into by reads."""
    r = redis.Redis.from_url(url, decode_responses=True)
    read = {"string": r.get, "hash": r.hgetall, "set": r.smembers, "list": lambda k: r.lrange(k, 0, -1),
            "zset": lambda k: r.zrange(k, 0, -1, withscores=True), "stream": r.xrange}
    return {k: (r.type(k), read[r.type(k)](k)) for k in sorted(r.scan_iter(count=1000))}


class ThreadedServer:
    """Serves an ASGI app with uvicorn on a free loopback port from a background thread."""

    def __init__(self, app) -> None:
        import threading

        import uvicorn

        from rl_service.control.local_services import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadedServer:
        import time

        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
