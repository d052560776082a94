"""The Redis store of the control plane: jobs, the queue, events, metrics, schedules, environments, API keys.

One module per group of keys: `keys` (the key layout), `jobs` (records, indexes, the queue and their Lua
scripts), `streams` (events, metrics, checkpoints), `permissions` (who else may start from a checkpoint),
`schedules`, `tenants` (quotas, environments, API keys), `coordination` (the scheduler's lock, the placed set,
heartbeats); `base` holds the clients. `Store` is all of
them; nothing else touches the Redis client.

Writes that belong together (a job with its indexes, queue entry, schedule and first event; a state
change with its index moves and event) run in one Lua script or MULTI/EXEC, so a reader never sees half
of them. State changes are compare-and-set against the sources that rl_service.job_states allows.
All keys of one deployment live in one Redis (no cluster slot constraints are honoured).
Events and metrics streams are trimmed to the newest ``events_maxlen`` / ``metrics_maxlen`` entries
(XADD MAXLEN ~), and a job's schedule history holds at most ``schedule_max_versions`` versions.
"""

from __future__ import annotations

from rl_service.control.store.base import (
    EVENTS_MAXLEN,
    METRICS_MAXLEN,
    SCHEDULE_MAX_VERSIONS,
    clean_json,
    dumps,
)
from rl_service.control.store.coordination import CoordinationPart
from rl_service.control.store.jobs import (
    IDEMPOTENCY_TTL_S,
    IdempotencyConflict,
    JobActive,
    JobNotFound,
    JobRecord,
    JobsPart,
    QueueFull,
    RateLimitExceeded,
    spec_digest,
)
from rl_service.control.store.permissions import PermissionsFull, PermissionsPart
from rl_service.control.store.schedules import ScheduleFull, SchedulesPart
from rl_service.control.store.streams import StreamsPart
from rl_service.control.store.tenants import KEY_ID_LEN, TenantsPart, hash_api_key
from rl_service.job_states import InvalidTransition

__all__ = [
    "EVENTS_MAXLEN", "IDEMPOTENCY_TTL_S", "KEY_ID_LEN", "METRICS_MAXLEN", "SCHEDULE_MAX_VERSIONS", "IdempotencyConflict",
    "InvalidTransition", "JobActive", "JobNotFound", "JobRecord", "PermissionsFull", "QueueFull", "RateLimitExceeded", "ScheduleFull", "Store",
    "clean_json", "dumps", "hash_api_key", "spec_digest",
]


class Store(JobsPart, StreamsPart, SchedulesPart, TenantsPart, CoordinationPart, PermissionsPart):
    """All Redis reads and writes of the control plane (sync client; thread-safe via its pool)."""
