"""Jobs in Redis: the record with its indexes and queue entry, created, moved between states and deleted in one
Lua script each (so a reader never sees half a change). State changes are compare-and-set against the sources
that rl_service.job_states allows; the scripts take the state names from there."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Iterable
from string import Template
from typing import Any, ClassVar

from pydantic import BaseModel, Field

from reward_models.schedule import ScheduleHistory
from rl_service.control.store.base import StoreBase, dumps
from rl_service.job_states import CONTROL_RUN, InvalidTransition, JobState, sources_of
from rl_service.spec import JobSpec

IDEMPOTENCY_TTL_S = 24 * 3600


class JobNotFound(KeyError):
    def __init__(self, job_id: str) -> None:
        super().__init__(job_id)
        self.job_id = job_id

    def __str__(self) -> str:
        return f"job {self.job_id!r} not found"


class RateLimitExceeded(Exception):
    """The tenant submitted its allowance of jobs for this minute."""


class IdempotencyConflict(ValueError):
    """The Idempotency-Key was used before with a different request body."""


class QueueFull(Exception):
    """The tenant has its quota of queued jobs."""


class JobActive(Exception):
    """The job is not finished (it cannot be deleted yet)."""

    def __init__(self, state: str) -> None:
        super().__init__(state)
        self.state = state


class JobRecord(BaseModel):
    id: str
    tenant: str
    name: str
    state: JobState
    control: str = CONTROL_RUN
    priority: int = 0
    spec: JobSpec
    created_at: float
    updated_at: float
    started_at: float | None = None
    finished_at: float | None = None
    step: int = 0
    total_steps: int
    attempts: int = 0
    error: str | None = None
    warning: str | None = Field(None, description="The latest warning of the running job (cleared on resume).")
    work_dir: str
    schedule_version: int = 1
    last_checkpoint: str | None = None
    last_metrics: dict[str, Any] | None = None


def spec_digest(spec: JobSpec) -> str:
    return hashlib.sha256(spec.model_dump_json().encode()).hexdigest()


def _record(raw: dict[str, str]) -> JobRecord:
    def opt_float(name: str) -> float | None:
        v = raw.get(name)
        return float(v) if v else None

    return JobRecord(
        id=raw["id"],
        tenant=raw["tenant"],
        name=raw["name"],
        state=JobState(raw["state"]),
        control=raw.get("control", CONTROL_RUN),
        priority=int(raw.get("priority", 0)),
        spec=JobSpec.model_validate_json(raw["spec"]),
        created_at=float(raw["created_at"]),
        updated_at=float(raw["updated_at"]),
        started_at=opt_float("started_at"),
        finished_at=opt_float("finished_at"),
        step=int(raw.get("step", 0)),
        total_steps=int(raw["total_steps"]),
        attempts=int(raw.get("attempts", 0)),
        error=raw.get("error") or None,
        warning=raw.get("warning") or None,
        work_dir=raw["work_dir"],
        schedule_version=int(raw.get("schedule_version", 1)),
        last_checkpoint=raw.get("last_checkpoint") or None,
        last_metrics=json.loads(raw["last_metrics"]) if raw.get("last_metrics") else None,
    )


def _lua(script: str) -> str:
    """`script` with $queued, $running, ... and $target_is_terminal filled in from JobState."""
    terminal = " or ".join(f"target == '{s.value}'" for s in JobState if s.is_terminal)
    return Template(script).substitute({s.value: s.value for s in JobState}, target_is_terminal=terminal)


# Creates a job with its indexes, queue entry, schedule and first event; honours the Idempotency-Key.
_SUBMIT = _lua("""
local p, id, tenant = ARGV[1], ARGV[2], ARGV[3]
local idem_key, idem_digest = ARGV[4], ARGV[5]
local created_ms, priority = tonumber(ARGV[6]), tonumber(ARGV[7])
if idem_key ~= '' then
  local prev = redis.call('GET', idem_key)
  if prev then return {'existing', prev} end
end
local job = p .. ':job:' .. id
if redis.call('EXISTS', job) == 1 then return {'duplicate', id} end
local rate_key, rate_limit = ARGV[14], tonumber(ARGV[15])
if rate_key ~= '' and tonumber(redis.call('GET', rate_key) or '0') >= rate_limit then
  return {'rate_limited', ''}
end
if ARGV[8] ~= '' and redis.call('ZCARD', p .. ':tenant:' .. tenant .. ':state:$queued') >= tonumber(ARGV[8]) then
  return {'queue_full', ''}
end
local seq = redis.call('INCR', p .. ':seq')
redis.call('HSET', job, unpack(ARGV, 17))
redis.call('ZADD', p .. ':jobs', created_ms, id)
redis.call('ZADD', p .. ':state:$queued', created_ms, id)
redis.call('ZADD', p .. ':tenant:' .. tenant .. ':jobs', created_ms, id)
redis.call('ZADD', p .. ':tenant:' .. tenant .. ':state:$queued', created_ms, id)
redis.call('ZADD', p .. ':queue', -priority * 1e12 + seq, id)
redis.call('SET', job .. ':schedule', ARGV[9])
redis.call('XADD', job .. ':events', 'MAXLEN', '~', ARGV[12], '*', 'kind', 'submitted', 'data', ARGV[10], 'ts', ARGV[11])
if idem_key ~= '' then
  redis.call('SET', idem_key, id .. ' ' .. idem_digest, 'EX', ARGV[13])
end
if rate_key ~= '' then
  if redis.call('INCR', rate_key) == 1 then redis.call('EXPIRE', rate_key, ARGV[16]) end
end
return {'created', id}
""")

# Compare-and-set update of one job: checks the state is one of ARGV[3] (comma list), optionally moves it to
# ARGV[4] (indexes, queue, timestamps), sets the field/value pairs ARGV[10..] and appends the event ARGV[7]/ARGV[8].
_UPDATE = _lua("""
local p, id = ARGV[1], ARGV[2]
local job = p .. ':job:' .. id
local cur = redis.call('HGET', job, 'state')
if not cur then return {'missing', ''} end
local allowed = false
for s in string.gmatch(ARGV[3], '[^,]+') do if s == cur then allowed = true end end
if not allowed then return {'invalid', cur} end
local target, now = ARGV[4], ARGV[5]
local fields = {}
for i = 10, #ARGV do fields[#fields + 1] = ARGV[i] end
fields[#fields + 1] = 'updated_at'; fields[#fields + 1] = now
if target ~= '' then
  local tenant = redis.call('HGET', job, 'tenant')
  local created = redis.call('HGET', job, 'created_ms')
  redis.call('ZREM', p .. ':state:' .. cur, id)
  redis.call('ZREM', p .. ':tenant:' .. tenant .. ':state:' .. cur, id)
  redis.call('ZADD', p .. ':state:' .. target, created, id)
  redis.call('ZADD', p .. ':tenant:' .. tenant .. ':state:' .. target, created, id)
  if cur == '$queued' then redis.call('ZREM', p .. ':queue', id) end
  if target == '$queued' then
    local seq = redis.call('INCR', p .. ':seq')
    local prio = tonumber(redis.call('HGET', job, 'priority'))
    redis.call('ZADD', p .. ':queue', -prio * 1e12 + seq, id)
  end
  fields[#fields + 1] = 'state'; fields[#fields + 1] = target
  if target == '$running' and not redis.call('HGET', job, 'started_at') then
    fields[#fields + 1] = 'started_at'; fields[#fields + 1] = now
  end
  if $target_is_terminal then
    fields[#fields + 1] = 'finished_at'; fields[#fields + 1] = now
  end
end
redis.call('HSET', job, unpack(fields))
if ARGV[7] ~= '' then
  local data = ARGV[8]
  if target ~= '' then
    -- ARGV[8] is a JSON object written by Store; splice the transition in without re-encoding it
    local head = '{"from":"' .. cur .. '","to":"' .. target .. '"'
    if data == '{}' then data = head .. '}' else data = head .. ',' .. string.sub(data, 2) end
  end
  redis.call('XADD', job .. ':events', 'MAXLEN', '~', ARGV[9], '*', 'kind', ARGV[7], 'data', data, 'ts', now)
end
return {'ok', cur}
""")

# Deletes a finished job: its record, indexes, streams, schedule, checkpoint list and Idempotency-Key.
# It stays in P:placed (if there) so the scheduler's cleanup still frees whatever Ray holds for it.
_DELETE = _lua("""
local p, id, tenant = ARGV[1], ARGV[2], ARGV[3]
local job = p .. ':job:' .. id
local state = redis.call('HGET', job, 'state')
if not state or redis.call('HGET', job, 'tenant') ~= tenant then return {'missing', ''} end
local terminal = false
for s in string.gmatch(ARGV[4], '[^,]+') do if s == state then terminal = true end end
if not terminal then return {'active', state} end
local idem = redis.call('HGET', job, 'idempotency_key')
if idem then
  local idem_key = p .. ':idem:' .. tenant .. ':' .. idem
  local prev = redis.call('GET', idem_key)
  if prev and string.sub(prev, 1, #id + 1) == id .. ' ' then redis.call('DEL', idem_key) end
end
redis.call('DEL', job, job .. ':events', job .. ':metrics', job .. ':schedule', job .. ':checkpoints',
           job .. ':heartbeat', job .. ':permissions')
redis.call('ZREM', p .. ':jobs', id)
redis.call('ZREM', p .. ':state:' .. state, id)
redis.call('ZREM', p .. ':tenant:' .. tenant .. ':jobs', id)
redis.call('ZREM', p .. ':tenant:' .. tenant .. ':state:' .. state, id)
redis.call('ZREM', p .. ':queue', id)
return {'deleted', state}
""")


class JobsPart(StoreBase):
    """Jobs: submit, read, list, count, change state, delete."""

    LUA: ClassVar[dict[str, str]] = {"_submit": _SUBMIT, "_update": _UPDATE, "_delete": _DELETE}

    def submit_job(
        self,
        tenant: str,
        spec: JobSpec,
        work_root: str,
        idempotency_key: str | None = None,
        rate_per_minute: int | None = None,
        max_queued: int | None = None,
        request_digest: str | None = None,
    ) -> tuple[JobRecord, bool]:
        """Create a queued job; returns (job, created). A repeated Idempotency-Key returns the first job
        (and does not count against ``rate_per_minute``, the tenant's submissions per minute: RateLimitExceeded,
        nor against ``max_queued``, the tenant's queued jobs: QueueFull) if its request is the same:
        ``request_digest``, by default the digest of ``spec``."""
        job_id = "job-" + uuid.uuid4().hex[:16]
        now = time.time()
        digest = request_digest or spec_digest(spec)
        history = ScheduleHistory.start(spec.reward_schedule)
        fields = {
            "id": job_id,
            "tenant": tenant,
            "name": spec.name,
            "state": JobState.QUEUED.value,
            "control": CONTROL_RUN,
            "priority": str(spec.priority),
            "spec": spec.model_dump_json(),
            "created_at": repr(now),
            "created_ms": str(int(now * 1000)),
            "updated_at": repr(now),
            "step": "0",
            "total_steps": str(spec.total_steps),
            "attempts": "0",
            "work_dir": f"{work_root.rstrip('/')}/{job_id}",
            "schedule_version": "1",
        }
        if idempotency_key:
            fields["idempotency_key"] = idempotency_key
        res = self._submit(
            keys=[],
            args=[
                self.prefix,
                job_id,
                tenant,
                self.k_idem(tenant, idempotency_key) if idempotency_key else "",
                digest,
                int(now * 1000),
                spec.priority,
                "" if max_queued is None else max_queued,
                history.to_json(),
                dumps({"name": spec.name, "priority": spec.priority}),
                repr(now),
                self.events_maxlen,
                IDEMPOTENCY_TTL_S,
                self.k_rate(tenant, int(now // 60)) if rate_per_minute else "",
                rate_per_minute or 0,
                120,
                *[x for kv in fields.items() for x in kv],
            ],
        )
        status, value = res[0], res[1]
        if status == "rate_limited":
            raise RateLimitExceeded(f"more than {rate_per_minute} submissions per minute")
        if status == "queue_full":
            raise QueueFull(f"the tenant has {max_queued} queued jobs, its max_queued_jobs quota")
        if status == "existing":
            prev_id, prev_digest = value.split(" ", 1)
            if prev_digest != digest:
                raise IdempotencyConflict(
                    "Idempotency-Key was already used with a different job spec"
                )
            return self.get_job(prev_id), False
        # "duplicate": the job exists already, which (ids being random) means this very call created it and
        # the reply was lost to a connection error before the client's retry ran the script again.
        return self.get_job(job_id), True

    def get_job(self, job_id: str, tenant: str | None = None) -> JobRecord:
        """The job; JobNotFound if it does not exist or (with ``tenant``) belongs to another tenant."""
        raw = self.r.hgetall(self.k_job(job_id))
        if not raw or (tenant is not None and raw.get("tenant") != tenant):
            raise JobNotFound(job_id)
        return _record(raw)

    async def aget_job(self, job_id: str, tenant: str | None = None) -> JobRecord:
        raw = await self.ar.hgetall(self.k_job(job_id))
        if not raw or (tenant is not None and raw.get("tenant") != tenant):
            raise JobNotFound(job_id)
        return _record(raw)

    def job_exists(self, job_id: str, tenant: str | None = None) -> bool:
        owner = self.r.hget(self.k_job(job_id), "tenant")
        return owner is not None and (tenant is None or owner == tenant)

    def job_field(self, job_id: str, field: str) -> str | None:
        return self.r.hget(self.k_job(job_id), field)

    def list_jobs(
        self,
        tenant: str | None,
        state: JobState | str | None = None,
        offset: int = 0,
        limit: int = 50,
    ) -> tuple[list[JobRecord], int]:
        """Jobs, newest first, optionally of one state; returns (page, total)."""
        key = self.k_state(state, tenant) if state else self.k_jobs(tenant)
        with self.r.pipeline(transaction=False) as pipe:
            pipe.zcard(key)
            pipe.zrevrange(key, offset, offset + limit - 1)
            total, ids = pipe.execute()
        if not ids:
            return [], int(total)
        with self.r.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hgetall(self.k_job(job_id))
            raws = pipe.execute()
        return [_record(r) for r in raws if r], int(total)

    def list_jobs_after(self, tenant: str, after: str | None, limit: int) -> tuple[list[JobRecord], bool] | None:
        """Up to ``limit`` of the tenant's jobs, newest first, older than the job ``after`` (None: from the
        newest); and whether more follow. None when ``after`` is not one of the tenant's jobs."""
        start = 0
        if after is not None:
            rank = self.r.zrevrank(self.k_jobs(tenant), after)
            if rank is None:
                return None
            start = rank + 1
        jobs, total = self.list_jobs(tenant, None, start, limit)
        return jobs, start + limit < total

    def job_ids_in(self, state: JobState | str) -> list[str]:
        return list(self.r.zrange(self.k_state(state), 0, -1))

    def count_by_state(self) -> dict[str, int]:
        with self.r.pipeline(transaction=False) as pipe:
            for s in JobState:
                pipe.zcard(self.k_state(s))
            counts = pipe.execute()
        return {s.value: int(c) for s, c in zip(JobState, counts, strict=True)}

    def queued_ids(self, limit: int = 100) -> list[str]:
        """Queued job ids in scheduling order (highest priority first, then arrival)."""
        return list(self.r.zrange(self.k_queue(), 0, limit - 1))

    def count_active(self, tenant: str) -> int:
        """The tenant's jobs that hold (or are being given) resources: starting or running."""
        with self.r.pipeline(transaction=False) as pipe:
            pipe.zcard(self.k_state(JobState.STARTING, tenant))
            pipe.zcard(self.k_state(JobState.RUNNING, tenant))
            return sum(int(n) for n in pipe.execute())

    def update_job(
        self,
        job_id: str,
        *,
        allowed: Iterable[JobState | str],
        target: JobState | str | None = None,
        fields: dict[str, Any] | None = None,
        event: str | None = None,
        event_data: dict[str, Any] | None = None,
    ) -> JobState:
        """Atomically: check the job's state is in ``allowed``, move it to ``target`` (if given), set
        ``fields`` and append ``event``. Returns the state before. Raises JobNotFound / InvalidTransition."""
        allowed_s = ",".join(sorted(JobState(s).value for s in allowed))
        str_fields = {k: ("" if v is None else v if isinstance(v, str) else dumps(v)) for k, v in (fields or {}).items()}
        res = self._update(
            keys=[],
            args=[
                self.prefix,
                job_id,
                allowed_s,
                JobState(target).value if target else "",
                repr(time.time()),
                "",
                event or "",
                dumps(event_data or {}),
                self.events_maxlen,
                *[x for kv in str_fields.items() for x in kv],
            ],
        )
        status, cur = res[0], res[1]
        if status == "missing":
            raise JobNotFound(job_id)
        if status == "invalid":
            raise InvalidTransition(cur, target or cur)
        return JobState(cur)

    def transition(
        self,
        job_id: str,
        target: JobState | str,
        *,
        expect: Iterable[JobState | str] | None = None,
        fields: dict[str, Any] | None = None,
        reason: str | None = None,
        data: dict[str, Any] | None = None,
    ) -> JobState:
        """Move a job to ``target`` if the state machine allows it from its current state (and, with
        ``expect``, only from those states). Emits a ``state`` event. Returns the previous state."""
        allowed = sources_of(target)
        if expect is not None:
            allowed = allowed & {JobState(s) for s in expect}
        payload = dict(data or {})
        if reason:
            payload["reason"] = reason
        return self.update_job(
            job_id, allowed=allowed, target=target, fields=fields, event="state", event_data=payload
        )

    def delete_job(self, job_id: str, tenant: str) -> JobRecord:
        """Delete a finished job of ``tenant`` from Redis in one step (record, indexes, events, metrics, schedule,
        checkpoint list); returns the record as it was. JobNotFound, or JobActive if it is not finished. Its
        files are the caller's to remove."""
        job = self.get_job(job_id, tenant=tenant)
        terminal = ",".join(s.value for s in JobState if s.is_terminal)
        status, state = self._delete(keys=[], args=[self.prefix, job_id, tenant, terminal])
        if status == "missing":
            raise JobNotFound(job_id)
        if status == "active":
            raise JobActive(state)
        return job
