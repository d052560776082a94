"""Coordination of the scheduler: which process runs its loop (a lock with a TTL), which jobs may hold Ray
resources (the placed set), and the drivers' heartbeats (by Redis's clock, so the hosts' clocks never matter)."""

from __future__ import annotations

from typing import ClassVar, NamedTuple

from rl_service.control.store.base import StoreBase

_RENEW_LOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


class Heartbeat(NamedTuple):
    age_s: float
    deadline_s: float | None  # the phase's own deadline for the next progress (None: none was given)


class CoordinationPart(StoreBase):
    """The scheduler's lock, the placed set and the drivers' heartbeats."""

    LUA: ClassVar[dict[str, str]] = {"_renew": _RENEW_LOCK}

    def write_heartbeat(self, job_id: str, deadline_s: float | None = None, ttl_s: int = 24 * 3600) -> None:
        """The driver made progress now; `deadline_s`: how long its current phase may take to make more."""
        sec, usec = self.r.time()
        value = f"{sec}.{usec:06d}" if deadline_s is None else f"{sec}.{usec:06d} {deadline_s:.3f}"
        self.r.set(self.k_heartbeat(job_id), value, ex=ttl_s)

    def heartbeat(self, job_id: str) -> Heartbeat | None:
        """The job driver's last sign of progress (its age by Redis's clock); None when it never gave one."""
        raw = self.r.get(self.k_heartbeat(job_id))
        if raw is None:
            return None
        sec, usec = self.r.time()
        at, _, deadline = raw.partition(" ")
        return Heartbeat(sec + usec / 1e6 - float(at), float(deadline) if deadline else None)

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
