"""Which queued jobs start now: queue order (priority, then arrival), strict priority for jobs that do not fit
yet, tenants' running-jobs quotas, and jobs that can never fit the cluster."""

from __future__ import annotations

from collections.abc import Callable

import ray

from rl_service.control.quota import TenantQuota
from rl_service.control.store import JobNotFound, JobRecord, Store
from rl_service.job_states import JobState
from rl_service.placement import job_bundles


def _total(bundles: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _fits(need: dict[str, float], have: dict[str, float]) -> bool:
    return all(have.get(k, 0.0) + 1e-9 >= v for k, v in need.items() if v > 0)


class Admission:
    """Moves queued jobs to starting; `start` (Recovery.reconcile_one) then places each at once."""

    def __init__(self, store: Store, start: Callable[[JobRecord], None],
                 default_quota: TenantQuota | None = None) -> None:
        """`default_quota`: the running-jobs quota of tenants an admin gave none (None: no limit)."""
        self.store = store
        self.start = start
        self.default_quota = default_quota
        self._warned_unschedulable: set[str] = set()
        self._warned_quota: set[str] = set()

    def _running_room(self, tenant: str) -> int:
        quota = self.store.get_quota(tenant) or self.default_quota
        if quota is None:
            return 1 << 30
        return quota.max_running_jobs - self.store.count_active(tenant)

    def place(self) -> None:
        """Move queued jobs to starting while the cluster has room, in queue order."""
        queued = self.store.queued_ids()
        if not queued:
            return
        available = dict(ray.available_resources())
        total = dict(ray.cluster_resources())
        room: dict[str, int] = {}  # per tenant: how many more jobs it may start now
        for job_id in queued:
            try:
                job = self.store.get_job(job_id)
            except JobNotFound:
                continue
            if job.tenant not in room:
                room[job.tenant] = self._running_room(job.tenant)
            if room[job.tenant] <= 0:
                if job_id not in self._warned_quota:
                    self._warned_quota.add(job_id)
                    self.store.add_event(job_id, "quota_wait", {"reason": "the tenant has its max_running_jobs"})
                continue  # other tenants' jobs may go ahead: the quota, not the cluster, holds this one
            need = _total(job_bundles(job.spec))
            if not _fits(need, total):
                if job_id not in self._warned_unschedulable:
                    self._warned_unschedulable.add(job_id)
                    self.store.add_event(job_id, "unschedulable",
                                         {"needs": need, "cluster": {k: total.get(k, 0.0) for k in need}})
                continue
            if not _fits(need, available):
                break  # strict priority: wait for room rather than let later jobs overtake
            try:
                self.store.transition(job_id, JobState.STARTING, expect=[JobState.QUEUED], reason="placed")
            except Exception:
                continue  # cancelled or taken meanwhile
            room[job.tenant] -= 1
            for k, v in need.items():
                available[k] = available.get(k, 0.0) - v
            self.start(self.store.get_job(job_id))
