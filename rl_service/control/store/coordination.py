"""Coordination of the scheduler: which process runs its loop (a lock with a TTL), which jobs may hold Ray
resources (the placed set), and the drivers' heartbeats (by Redis's clock, so the hosts' clocks never matter)."""

from __future__ import annotations

from typing import ClassVar

from rl_service.control.store.base import StoreBase

_RENEW_LOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


class CoordinationPart(StoreBase):
    """The scheduler's lock, the placed set and the drivers' heartbeats."""

    LUA: ClassVar[dict[str, str]] = {"_renew": _RENEW_LOCK}

    def write_heartbeat(self, job_id: str, ttl_s: int = 24 * 3600) -> None:
        sec, usec = self.r.time()
        self.r.set(self.k_heartbeat(job_id), f"{sec}.{usec:06d}", ex=ttl_s)

    def heartbeat_age(self, job_id: str) -> float | None:
        """Seconds since the job's driver last beat (by Redis's clock); None when it never did."""
        raw = self.r.get(self.k_heartbeat(job_id))
        if raw is None:
            return None
        sec, usec = self.r.time()
        return sec + usec / 1e6 - float(raw)

    def acquire_lock(self, token: str, ttl_ms: int) -> bool:
        if self.r.set(self.k_lock(), token, nx=True, px=ttl_ms):
            return True
        return bool(self._renew(keys=[self.k_lock()], args=[token, ttl_ms]))

    def release_lock(self, token: str) -> None:
        if self.r.get(self.k_lock()) == token:
            self.r.delete(self.k_lock())

    def clear_heartbeat(self, job_id: str) -> None:
        self.r.delete(self.k_heartbeat(job_id))

    def placed_job_ids(self) -> set[str]:
        """Jobs that may hold Ray resources (a placement group, a driver actor)."""
        return set(self.r.smembers(self.k_placed()))

    def mark_placed(self, job_id: str) -> None:
        self.r.sadd(self.k_placed(), job_id)

    def unmark_placed(self, job_id: str) -> None:
        self.r.srem(self.k_placed(), job_id)
