"""The control-plane service: everything the REST API (and the CLI through it) can do, with the rules.

The API routers only translate HTTP to calls on a `TaperService`'s parts; tenancy, validation beyond the
request schemas, state-machine checks and the store's atomic writes all happen here or below:
`tenants` (who calls: keys, quotas), `environments` (built-ins and registrations), `files` (task files,
checkpoints, work dirs), `jobs` (submit, read, steer, delete, the reward schedule), `errors` (each with its
HTTP status), `runtime` (starting a control plane).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rl_service.control.quota import JobLimits, TenantQuota
from rl_service.control.service.environments import Environments
from rl_service.control.service.errors import (
    Conflict,
    Forbidden,
    InvalidInput,
    NotFound,
    QuotaExceeded,
    RateLimited,
    ServiceError,
    TooLarge,
    Unauthorized,
    error_field,
    invalid_from,
    plain_message,
)
from rl_service.control.service.files import JobFiles
from rl_service.control.service.jobs import Jobs, schedule_conflict, schedule_patch_changes
from rl_service.control.service.tenants import Principal, Tenants, validate_tenant
from rl_service.control.store import Store


class TaperService:
    """The service's parts over one store: `tenants`, `environments`, `files` and `jobs`."""

    def __init__(self, store: Store, data_dir: Path, submit_rate_per_minute: int = 60,
                 auth_cache_s: float = 5.0, status_cache_s: float = 0.25, env_policy: Any = None, *,
                 limits: JobLimits | None = None, default_quota: TenantQuota | None = None,
                 base_models: dict[str, Path] | None = None, task_file_limits: Any = None,
                 model_aliases: dict[str, str] | None = None) -> None:
        """`env_policy`: the operator's EnvironmentPolicy (TaperSettings.environment_policy()); default: the
        safe defaults. ``limits`` (the operator's maxima per job), ``default_quota`` (of tenants an admin gave
        none), ``base_models`` (name -> model directory tenants may start from) and ``model_aliases`` (other
        names of models, for the OpenAI-compatible routes) come from the settings."""
        self.store = store
        self.data_dir = Path(data_dir)
        self.model_aliases = dict(model_aliases or {})
        self.tenants = Tenants(store, auth_cache_s, default_quota)
        self.environments = Environments(store, env_policy)
        self.files = JobFiles(store, self.data_dir, task_file_limits, base_models)
        self.jobs = Jobs(store, self.tenants, self.environments, self.files,
                         submit_rate_per_minute=submit_rate_per_minute, limits=limits, status_cache_s=status_cache_s)

    def health(self) -> dict[str, Any]:
        try:
            ok = self.store.ping()
        except Exception:
            ok = False
        return {"ok": ok, "redis": ok}


__all__ = [
    "Conflict",
    "Forbidden",
    "InvalidInput",
    "NotFound",
    "Principal",
    "QuotaExceeded",
    "RateLimited",
    "ServiceError",
    "TaperService",
    "TooLarge",
    "Unauthorized",
    "error_field",
    "invalid_from",
    "plain_message",
    "schedule_conflict",
    "schedule_patch_changes",
    "validate_tenant",
]
