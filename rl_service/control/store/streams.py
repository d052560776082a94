"""A job's streams: events and metrics (trimmed to the newest ``events_maxlen`` / ``metrics_maxlen`` entries),
and its checkpoint list. Each write runs only while the job exists, so a late driver recreates nothing."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from redis.client import Pipeline

from rl_service.control.store.base import StoreBase, dumps
from rl_service.control.store.jobs import JobNotFound
from rl_service.spec import checkpoint_ref


class StreamsPart(StoreBase):
    """Events, metrics and checkpoints of a job."""

    def _write_for_job(self, job_id: str, write: Callable[[Pipeline], None]) -> list[Any]:
        """Run `write`'s commands in one MULTI/EXEC only while the job record exists (WATCHed), so a write
        for a deleted job (a late driver) raises JobNotFound instead of recreating part of it."""

        def tx(pipe: Pipeline) -> None:
            if not pipe.exists(self.k_job(job_id)):
                raise JobNotFound(job_id)
            pipe.multi()
            write(pipe)

        return self.r.transaction(tx, self.k_job(job_id))

    def add_event(self, job_id: str, kind: str, data: dict[str, Any]) -> str:
        def write(pipe: Pipeline) -> None:
            pipe.xadd(self.k_events(job_id), {"kind": kind, "data": dumps(data), "ts": repr(time.time())},
                      maxlen=self.events_maxlen, approximate=True)

        return self._write_for_job(job_id, write)[0]

    @staticmethod
    def _exclusive(after: str | None) -> str:
        return f"({after}" if after else "-"

    def events(self, job_id: str, after: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """Events after the stream id ``after`` (exclusive), oldest first."""
        rows = self.r.xrange(self.k_events(job_id), min=self._exclusive(after), max="+", count=limit)
        return [self._event(eid, f) for eid, f in rows]

    def events_newest_first(self, job_id: str, before: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """Events before the stream id ``before`` (exclusive), newest first."""
        rows = self.r.xrevrange(self.k_events(job_id), max=self._exclusive(before) if before else "+", min="-",
                                count=limit)
        return [self._event(eid, f) for eid, f in rows]

    @staticmethod
    def _event(eid: str, f: dict[str, str]) -> dict[str, Any]:
        return {"id": eid, "kind": f["kind"], "ts": float(f["ts"]), "data": json.loads(f["data"])}

    def add_metrics(self, job_id: str, step: int, metrics: dict[str, Any], steps_done: int | None = None) -> None:
        """A metrics row for `step`; with `steps_done` (a training row) also the job's progress and last row."""
        payload = dumps(metrics)

        def write(pipe: Pipeline) -> None:
            pipe.xadd(self.k_metrics(job_id), {"step": str(step), "data": payload, "ts": repr(time.time())},
                      maxlen=self.metrics_maxlen, approximate=True)
            if steps_done is not None:
                pipe.hset(self.k_job(job_id), mapping={"step": str(steps_done), "last_metrics": payload})

        self._write_for_job(job_id, write)

    def metrics(self, job_id: str, after: str | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        rows = self.r.xrange(self.k_metrics(job_id), min=self._exclusive(after), max="+", count=limit)
        return [
            {"id": eid, "step": int(f["step"]), "ts": float(f["ts"]), "metrics": json.loads(f["data"])}
            for eid, f in rows
        ]

    def add_checkpoint(self, job_id: str, step: int, uri: str) -> None:
        now = time.time()
        member = dumps({"step": step, "uri": uri, "ts": now})

        def write(pipe: Pipeline) -> None:
            pipe.zremrangebyscore(self.k_checkpoints(job_id), step, step)
            pipe.zadd(self.k_checkpoints(job_id), {member: step})
            # what tenants read names the checkpoint as model.checkpoint takes it, never where it lies
            ref = checkpoint_ref(job_id, step)
            pipe.hset(self.k_job(job_id), mapping={"last_checkpoint": ref, "updated_at": repr(now)})
            pipe.xadd(self.k_events(job_id), {"kind": "checkpoint", "data": dumps({"step": step, "checkpoint": ref}),
                                              "ts": repr(now)}, maxlen=self.events_maxlen, approximate=True)

        self._write_for_job(job_id, write)

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        return [json.loads(m) for m in self.r.zrange(self.k_checkpoints(job_id), 0, -1)]
