"""The Redis key layout of the control plane (the one place it is written down; ``P`` is the key prefix, ``taper`` by default):

    P:job:{id}                   HASH    the job record (fields: see JobRecord)
    P:job:{id}:events            STREAM  job events: kind, data (JSON), ts
    P:job:{id}:metrics           STREAM  per-step metrics: step, data (JSON), ts
    P:job:{id}:schedule          STRING  the job's ScheduleHistory (JSON)
    P:job:{id}:checkpoints       ZSET    score = step, member = {"step", "uri", "ts"} (JSON)
    P:job:{id}:heartbeat         STRING  the driver's last sign of progress, Redis time "sec.usec" and the phase's
                                         deadline for the next "sec.usec DEADLINE" (expires)
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

from rl_service.job_states import JobState


class KeyLayout:
    """The name of every key, under ``prefix``."""

    prefix: str

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

    def k_permissions(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}:permissions"

    def k_heartbeat(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}:heartbeat"

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

    def k_webhook_secret(self, tenant: str) -> str:
        return f"{self.prefix}:tenant:{tenant}:webhook_secret"

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
