"""The Redis store of the control plane: jobs, the queue, events, metrics, schedules, environments, API keys.

Key layout (the one place it is written down; ``P`` is the key prefix, ``taper`` by default):

    P:job:{id}                   HASH    the job record (fields: see JobRecord)
    P:job:{id}:events            STREAM  job events: kind, data (JSON), ts
    P:job:{id}:metrics           STREAM  per-step metrics: step, data (JSON), ts
    P:job:{id}:schedule          STRING  the job's ScheduleHistory (JSON)
    P:job:{id}:checkpoints       ZSET    score = step, member = {"step", "uri", "ts"} (JSON)
    P:job:{id}:heartbeat         STRING  the driver's last sign of progress, Redis time "sec.usec" (expires)
    P:jobs                       ZSET    every job id, score = creation time (ms)
    P:state:{state}              ZSET    job ids in that state, score = creation time (ms)
    P:tenant:{t}:jobs            ZSET    the tenant's job ids, score = creation time (ms)
    P:tenant:{t}:state:{state}   ZSET    the tenant's job ids in that state
    P:queue                      ZSET    queued job ids, score = -priority * 1e12 + arrival number (lowest first)
    P:seq                        STRING  arrival counter (FIFO order within one priority)
    P:idem:{t}:{key}             STRING  "{job id} {sha256 of the canonical spec}" for Idempotency-Key (24 h TTL)
    P:tenant:{t}:envs            HASH    environment name -> registration (JSON)
    P:tenant:{t}:quota           STRING  the tenant's TenantQuota (JSON); absent: the operator's default
    P:apikey:{sha256}            HASH    tenant, name, admin, created_at, expires_at (the key itself is never
                                         stored; its id is the digest's first 16 hex digits)
    P:tenant:{t}:apikeys         SET     sha256 digests of the tenant's keys
    P:rate:{t}:{minute}          STRING  jobs the tenant created in that minute (expires)
    P:scheduler:lock             STRING  the token of the process that runs the scheduler loop
    P:placed                     SET     job ids that may hold Ray resources (placement group, driver actor)

Writes that belong together (a job with its indexes, queue entry, schedule and first event; a state
change with its index moves and event) run in one Lua script or MULTI/EXEC, so a reader never sees half
of them. State changes are compare-and-set against the sources that rl_service.job_states allows.
All keys of one deployment live in one Redis (no cluster slot constraints are honoured).
Events and metrics streams are trimmed to the newest ``events_maxlen`` / ``metrics_maxlen`` entries
(XADD MAXLEN ~), and a job's schedule history holds at most ``schedule_max_versions`` versions.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.retry
from pydantic import BaseModel, Field
from redis.backoff import ExponentialBackoff
from redis.client import Pipeline
from redis.retry import Retry

from reward_models.schedule import RewardSchedule, ScheduleHistory, ScheduleVersion
from rl_service.control.quota import TenantQuota
from rl_service.job_states import (
    CONTROL_RUN,
    InvalidTransition,
    JobState,
    sources_of,
)
from rl_service.spec import JobSpec

EVENTS_MAXLEN = 10_000
METRICS_MAXLEN = 100_000
SCHEDULE_MAX_VERSIONS = 1_000
IDEMPOTENCY_TTL_S = 24 * 3600
KEY_ID_LEN = 16


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


class ScheduleFull(ValueError):
    """The job's schedule has its maximum number of versions."""


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


def hash_api_key(key: str) -> str:
    # API keys are 256-bit random tokens, so one SHA-256 is enough (no password stretching needed).
    return hashlib.sha256(key.encode()).hexdigest()


def spec_digest(spec: JobSpec) -> str:
    return hashlib.sha256(spec.model_dump_json().encode()).hexdigest()


# Creates a job with its indexes, queue entry, schedule and first event; honours the Idempotency-Key.
_SUBMIT = """
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
if ARGV[8] ~= '' and redis.call('ZCARD', p .. ':tenant:' .. tenant .. ':state:queued') >= tonumber(ARGV[8]) then
  return {'queue_full', ''}
end
local seq = redis.call('INCR', p .. ':seq')
redis.call('HSET', job, unpack(ARGV, 17))
redis.call('ZADD', p .. ':jobs', created_ms, id)
redis.call('ZADD', p .. ':state:queued', created_ms, id)
redis.call('ZADD', p .. ':tenant:' .. tenant .. ':jobs', created_ms, id)
redis.call('ZADD', p .. ':tenant:' .. tenant .. ':state:queued', created_ms, id)
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
"""

# Compare-and-set update of one job: checks the state is one of ARGV[3] (comma list), optionally moves it to
# ARGV[4] (indexes, queue, timestamps), sets the field/value pairs ARGV[10..] and appends the event ARGV[7]/ARGV[8].
_UPDATE = """
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
  if cur == 'queued' then redis.call('ZREM', p .. ':queue', id) end
  if target == 'queued' then
    local seq = redis.call('INCR', p .. ':seq')
    local prio = tonumber(redis.call('HGET', job, 'priority'))
    redis.call('ZADD', p .. ':queue', -prio * 1e12 + seq, id)
  end
  fields[#fields + 1] = 'state'; fields[#fields + 1] = target
  if target == 'running' and not redis.call('HGET', job, 'started_at') then
    fields[#fields + 1] = 'started_at'; fields[#fields + 1] = now
  end
  if target == 'succeeded' or target == 'failed' or target == 'cancelled' then
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
"""

# Deletes a finished job: its record, indexes, streams, schedule, checkpoint list and Idempotency-Key.
# It stays in P:placed (if there) so the scheduler's cleanup still frees whatever Ray holds for it.
_DELETE = """
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
           job .. ':heartbeat')
redis.call('ZREM', p .. ':jobs', id)
redis.call('ZREM', p .. ':state:' .. state, id)
redis.call('ZREM', p .. ':tenant:' .. tenant .. ':jobs', id)
redis.call('ZREM', p .. ':tenant:' .. tenant .. ':state:' .. state, id)
redis.call('ZREM', p .. ':queue', id)
return {'deleted', state}
"""

_RENEW_LOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


class Store:
    """All Redis reads and writes of the control plane (sync client; thread-safe via its pool)."""

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
        self._submit = self.r.register_script(_SUBMIT)
        self._update = self.r.register_script(_UPDATE)
        self._renew = self.r.register_script(_RENEW_LOCK)
        self._delete = self.r.register_script(_DELETE)
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

    # ---- keys (see the module docstring) ----
    def k_job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def k_events(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}:events"

    def k_metrics(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}:metrics"

    def k_schedule(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}:schedule"

    def k_checkpoints(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}:checkpoints"

    def k_heartbeat(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}:heartbeat"

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

    def k_state(self, state: JobState | str, tenant: str | None = None) -> str:
        s = JobState(state).value
        return f"{self.prefix}:tenant:{tenant}:state:{s}" if tenant else f"{self.prefix}:state:{s}"

    def k_jobs(self, tenant: str | None = None) -> str:
        return f"{self.prefix}:tenant:{tenant}:jobs" if tenant else f"{self.prefix}:jobs"

    def k_queue(self) -> str:
        return f"{self.prefix}:queue"

    def k_idem(self, tenant: str, key: str) -> str:
        return f"{self.prefix}:idem:{tenant}:{key}"

    def k_envs(self, tenant: str) -> str:
        return f"{self.prefix}:tenant:{tenant}:envs"

    def k_quota(self, tenant: str) -> str:
        return f"{self.prefix}:tenant:{tenant}:quota"

    def k_apikey(self, digest: str) -> str:
        return f"{self.prefix}:apikey:{digest}"

    def k_tenant_keys(self, tenant: str) -> str:
        return f"{self.prefix}:tenant:{tenant}:apikeys"

    def k_rate(self, tenant: str, minute: int) -> str:
        return f"{self.prefix}:rate:{tenant}:{minute}"

    def k_lock(self) -> str:
        return f"{self.prefix}:scheduler:lock"

    def k_placed(self) -> str:
        return f"{self.prefix}:placed"

    def ping(self) -> bool:
        return bool(self.r.ping())

    # ---- jobs ----
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

    def _record(self, raw: dict[str, str]) -> JobRecord:
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

    def get_job(self, job_id: str, tenant: str | None = None) -> JobRecord:
        """The job; JobNotFound if it does not exist or (with ``tenant``) belongs to another tenant."""
        raw = self.r.hgetall(self.k_job(job_id))
        if not raw or (tenant is not None and raw.get("tenant") != tenant):
            raise JobNotFound(job_id)
        return self._record(raw)

    async def aget_job(self, job_id: str, tenant: str | None = None) -> JobRecord:
        raw = await self.ar.hgetall(self.k_job(job_id))
        if not raw or (tenant is not None and raw.get("tenant") != tenant):
            raise JobNotFound(job_id)
        return self._record(raw)

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
        return [self._record(r) for r in raws if r], int(total)

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

    # ---- events and metrics ----
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

    def add_metrics(self, job_id: str, step: int, metrics: dict[str, Any]) -> None:
        payload = dumps(metrics)

        def write(pipe: Pipeline) -> None:
            pipe.xadd(self.k_metrics(job_id), {"step": str(step), "data": payload, "ts": repr(time.time())},
                      maxlen=self.metrics_maxlen, approximate=True)
            pipe.hset(self.k_job(job_id), mapping={"step": str(step), "last_metrics": payload})

        self._write_for_job(job_id, write)

    def metrics(self, job_id: str, after: str | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        rows = self.r.xrange(self.k_metrics(job_id), min=self._exclusive(after), max="+", count=limit)
        return [
            {"id": eid, "step": int(f["step"]), "ts": float(f["ts"]), "metrics": json.loads(f["data"])}
            for eid, f in rows
        ]

    # ---- checkpoints ----
    def add_checkpoint(self, job_id: str, step: int, uri: str) -> None:
        now = time.time()
        member = dumps({"step": step, "uri": uri, "ts": now})

        def write(pipe: Pipeline) -> None:
            pipe.zremrangebyscore(self.k_checkpoints(job_id), step, step)
            pipe.zadd(self.k_checkpoints(job_id), {member: step})
            pipe.hset(self.k_job(job_id), mapping={"last_checkpoint": uri, "updated_at": repr(now)})
            pipe.xadd(self.k_events(job_id), {"kind": "checkpoint", "data": dumps({"step": step, "uri": uri}),
                                              "ts": repr(now)}, maxlen=self.events_maxlen, approximate=True)

        self._write_for_job(job_id, write)

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        return [json.loads(m) for m in self.r.zrange(self.k_checkpoints(job_id), 0, -1)]

    # ---- reward schedule ----
    def schedule_history(self, job_id: str) -> ScheduleHistory:
        raw = self.r.get(self.k_schedule(job_id))
        if raw is None:
            raise JobNotFound(job_id)
        return ScheduleHistory.from_json(raw)

    def current_schedule(self, job_id: str) -> tuple[int, RewardSchedule]:
        cur = self.schedule_history(job_id).current
        return cur.version, cur.schedule

    def patch_schedule(self, job_id: str, patch: dict[str, Any]) -> ScheduleVersion:
        """Apply ``patch`` as a new schedule version effective from the job's next step, atomically with
        the job's ``schedule_version`` and a ``schedule_patched`` event (optimistic WATCH/MULTI).

        Raises pydantic.ValidationError / ValueError for a bad patch, InvalidTransition for a finished job,
        ScheduleFull when the history has ``schedule_max_versions`` versions."""
        job_key, sched_key = self.k_job(job_id), self.k_schedule(job_id)
        with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(job_key, sched_key)
                    state, step = pipe.hmget(job_key, ["state", "step"])
                    raw = pipe.get(sched_key)
                    if state is None or raw is None:
                        raise JobNotFound(job_id)
                    if JobState(state).is_terminal:
                        raise InvalidTransition(state, state)
                    history = ScheduleHistory.from_json(raw)
                    if len(history.versions) >= self.schedule_max_versions:
                        raise ScheduleFull(f"the schedule has {len(history.versions)} versions, the most a job "
                                           "may have")
                    # The runner is working on step `step`; the patch applies from the step after it.
                    new = history.apply_patch(patch, at_step=int(step or 0))
                    now = time.time()
                    pipe.multi()
                    pipe.set(sched_key, history.to_json())
                    pipe.hset(job_key, mapping={"schedule_version": str(new.version), "updated_at": repr(now)})
                    pipe.xadd(
                        self.k_events(job_id),
                        {
                            "kind": "schedule_patched",
                            "data": dumps(
                                {
                                    "version": new.version,
                                    "effective_from": new.effective_from,
                                    "patch": new.patch,
                                    "schedule": new.schedule.model_dump(),
                                }
                            ),
                            "ts": repr(now),
                        },
                        maxlen=self.events_maxlen,
                        approximate=True,
                    )
                    pipe.execute()
                    return new
                except redis.WatchError:
                    continue

    # ---- tenant quotas ----
    def get_quota(self, tenant: str) -> TenantQuota | None:
        """The quota an admin set for ``tenant``; None when it has none (the operator's default applies)."""
        raw = self.r.get(self.k_quota(tenant))
        return TenantQuota.model_validate_json(raw) if raw else None

    def set_quota(self, tenant: str, quota: TenantQuota) -> None:
        self.r.set(self.k_quota(tenant), quota.model_dump_json())

    def delete_quota(self, tenant: str) -> bool:
        return bool(self.r.delete(self.k_quota(tenant)))

    def count_active(self, tenant: str) -> int:
        """The tenant's jobs that hold (or are being given) resources: starting or running."""
        with self.r.pipeline(transaction=False) as pipe:
            pipe.zcard(self.k_state(JobState.STARTING, tenant))
            pipe.zcard(self.k_state(JobState.RUNNING, tenant))
            return sum(int(n) for n in pipe.execute())

    # ---- environments (per tenant) ----
    def put_environment(self, tenant: str, name: str, registration: dict[str, Any]) -> bool:
        """Store a registration; returns False (and writes nothing) if the name is taken."""
        return bool(self.r.hsetnx(self.k_envs(tenant), name, dumps(registration)))

    def get_environment(self, tenant: str, name: str) -> dict[str, Any] | None:
        raw = self.r.hget(self.k_envs(tenant), name)
        return json.loads(raw) if raw else None

    def list_environments(self, tenant: str) -> dict[str, dict[str, Any]]:
        return {k: json.loads(v) for k, v in sorted(self.r.hgetall(self.k_envs(tenant)).items())}

    def delete_environment(self, tenant: str, name: str) -> bool:
        return bool(self.r.hdel(self.k_envs(tenant), name))

    # ---- API keys ----
    def create_api_key(self, tenant: str, name: str = "", admin: bool = False,
                       expires_at: float | None = None) -> str:
        """A new bearer key for ``tenant`` (valid until the Unix time ``expires_at``, if given); only its SHA-256
        is stored, so this is the one chance to see it."""
        key = "tpr_" + secrets.token_urlsafe(32)
        digest = hash_api_key(key)
        record = {"tenant": tenant, "name": name, "admin": "1" if admin else "0", "created_at": repr(time.time())}
        if expires_at is not None:
            record["expires_at"] = repr(expires_at)
        with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(self.k_apikey(digest), mapping=record)
            pipe.sadd(self.k_tenant_keys(tenant), digest)
            pipe.execute()
        return key

    @staticmethod
    def _key_info(digest: str, raw: dict[str, str]) -> dict[str, Any]:
        return {"id": digest[:KEY_ID_LEN], "tenant": raw["tenant"], "name": raw.get("name", ""),
                "admin": raw.get("admin") == "1", "created_at": float(raw.get("created_at") or 0),
                "expires_at": float(raw["expires_at"]) if raw.get("expires_at") else None}

    def lookup_api_key(self, key: str) -> dict[str, Any] | None:
        """The key's record (id, tenant, name, admin, created_at, expires_at), None for an unknown key. Whether it
        has expired is the caller's to judge (the service answers 401)."""
        digest = hash_api_key(key)
        raw = self.r.hgetall(self.k_apikey(digest))
        return self._key_info(digest, raw) if raw else None

    async def alookup_api_key(self, key: str) -> dict[str, Any] | None:
        digest = hash_api_key(key)
        raw = await self.ar.hgetall(self.k_apikey(digest))
        return self._key_info(digest, raw) if raw else None

    def list_api_keys(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """The records of every key (of ``tenant``), oldest first."""
        if tenant is not None:
            digests = sorted(self.r.smembers(self.k_tenant_keys(tenant)))
        else:
            head = f"{self.prefix}:apikey:"
            digests = sorted(k.removeprefix(head) for k in self.r.scan_iter(match=head + "*", count=1000))
        with self.r.pipeline(transaction=False) as pipe:
            for digest in digests:
                pipe.hgetall(self.k_apikey(digest))
            raws = pipe.execute()
        keys = [self._key_info(d, raw) for d, raw in zip(digests, raws, strict=True) if raw]
        return sorted(keys, key=lambda k: k["created_at"])

    def revoke_api_key(self, key: str) -> bool:
        return self._revoke_digest(hash_api_key(key))

    def revoke_api_key_id(self, key_id: str) -> dict[str, Any] | None:
        """Revoke the key whose id (see list_api_keys) is ``key_id``; returns its record, None if there is none."""
        if len(key_id) != KEY_ID_LEN or not all(c in "0123456789abcdef" for c in key_id):
            return None
        matches = list(self.r.scan_iter(match=self.k_apikey(key_id) + "*", count=1000))
        if len(matches) != 1:
            return None
        digest = matches[0].rsplit(":", 1)[1]
        raw = self.r.hgetall(matches[0])
        if not raw or not self._revoke_digest(digest):
            return None
        return self._key_info(digest, raw)

    def _revoke_digest(self, digest: str) -> bool:
        tenant = self.r.hget(self.k_apikey(digest), "tenant")
        if tenant is None:
            return False
        with self.r.pipeline(transaction=True) as pipe:
            pipe.delete(self.k_apikey(digest))
            pipe.srem(self.k_tenant_keys(tenant), digest)
            pipe.execute()
        return True

    def has_api_keys(self) -> bool:
        return next(self.r.scan_iter(match=f"{self.prefix}:apikey:*", count=1000), None) is not None

    # ---- scheduler leadership ----
    def acquire_lock(self, token: str, ttl_ms: int) -> bool:
        if self.r.set(self.k_lock(), token, nx=True, px=ttl_ms):
            return True
        return bool(self._renew(keys=[self.k_lock()], args=[token, ttl_ms]))

    def release_lock(self, token: str) -> None:
        if self.r.get(self.k_lock()) == token:
            self.r.delete(self.k_lock())

    def close(self) -> None:
        self.r.close()
        self._async = None  # its connections belong to the event loop that made them
