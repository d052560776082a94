"""Helpers shared by the API tests."""

from __future__ import annotations

from dataclasses import dataclass

import redis
from fastapi.testclient import TestClient

from rl_service.service import TaperService
from rl_service.store import Store


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
