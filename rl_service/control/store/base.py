"""The Store's connection to Redis (a sync client for the control plane, an async one for the API's hottest
reads), the caps on streams and histories, and the JSON encoding every part writes with."""

from __future__ import annotations

import json
import math
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.retry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from rl_service.control.store.keys import KeyLayout

EVENTS_MAXLEN = 10_000
METRICS_MAXLEN = 100_000
SCHEDULE_MAX_VERSIONS = 1_000


def clean_json(value: Any) -> Any:
    """JSON-safe copy: NaN/inf become None (JSON has no such numbers), tuples become lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean_json(v) for v in value]
    return value


def dumps(value: Any) -> str:
    return json.dumps(clean_json(value), separators=(",", ":"), allow_nan=False)


class StoreBase(KeyLayout):
    """The clients and caps; a part that declares ``LUA = {"_name": script}`` gets each script registered as
    ``self._name``."""

    def __init__(self, url: str, prefix: str = "taper", *, events_maxlen: int = EVENTS_MAXLEN,
                 metrics_maxlen: int = METRICS_MAXLEN, schedule_max_versions: int = SCHEDULE_MAX_VERSIONS) -> None:
        self.url = url
        self.prefix = prefix
        self.events_maxlen = events_maxlen
        self.metrics_maxlen = metrics_maxlen
        self.schedule_max_versions = schedule_max_versions
        # Transient connection errors (a Redis restart, a dropped socket) are retried with backoff, so a
        # job driver rides out a short Redis outage instead of failing its job.
        retry = Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=8)
        self.r = redis.Redis.from_url(url, decode_responses=True, health_check_interval=30, retry=retry,
                                      retry_on_error=[redis.ConnectionError, redis.TimeoutError])
        for cls in type(self).__mro__:  # each part's Lua scripts, as attributes of the same names
            for name, script in vars(cls).get("LUA", {}).items():
                setattr(self, name, self.r.register_script(script))
        self._async: redis.asyncio.Redis | None = None  # for the API's hottest reads (no thread hop)

    @property
    def caps(self) -> dict[str, int]:
        """The stream and history caps, for another Store of the same deployment (a job driver's)."""
        return {"events_maxlen": self.events_maxlen, "metrics_maxlen": self.metrics_maxlen,
                "schedule_max_versions": self.schedule_max_versions}

    @property
    def ar(self) -> redis.asyncio.Redis:
        if self._async is None:
            # The API's reads retry briefly (about 1 s in all), then the API answers 503 with Retry-After.
            retry = redis.asyncio.retry.Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=4)
            self._async = redis.asyncio.Redis.from_url(self.url, decode_responses=True, retry=retry,
                                                       retry_on_error=[redis.ConnectionError, redis.TimeoutError])
        return self._async

    def ping(self) -> bool:
        return bool(self.r.ping())

    def close(self) -> None:
        self.r.close()
        self._async = None  # its connections belong to the event loop that made them
