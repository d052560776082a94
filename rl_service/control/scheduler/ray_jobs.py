"""A job's Ray side: its named detached driver actor and placement group, found, created and released."""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl_service.control.scheduler.driver import JobDriver
from rl_service.control.store import JobRecord, Store
from rl_service.job_states import JobState
from rl_service.placement import driver_cpus, job_bundles


def driver_name(job_id: str) -> str:
    return f"taper-driver-{job_id}"


def pg_name(job_id: str) -> str:
    return f"taper-pg-{job_id}"


class RayJobs:
    """Drivers and placement groups by job id, and when this process created them."""

    def __init__(self, store: Store, runner: str | type, namespace: str | None, heartbeat_every_s: float) -> None:
        self.store = store
        self.runner = runner
        self.namespace = namespace
        self.heartbeat_every_s = heartbeat_every_s
        self.driver_started: dict[str, float] = {}  # monotonic time this process created the job's driver
        self.pg_pending_since: dict[str, float] = {}  # since when the job's placement group waits for resources

    def _ns(self) -> str:
        return self.namespace or ray.get_runtime_context().namespace

    def driver(self, job_id: str) -> Any | None:
        try:
            return ray.get_actor(driver_name(job_id), namespace=self._ns())
        except ValueError:
            return None

    def pg(self, job_id: str) -> PlacementGroup | None:
        try:
            return get_placement_group(pg_name(job_id))
        except ValueError:
            return None

    def create_pg(self, job: JobRecord) -> PlacementGroup:
        """The job's placement group (marked placed first, so a crash right after leaves nothing unknown)."""
        self.store.mark_placed(job.id)
        pg = placement_group(job_bundles(job.spec), strategy="PACK", name=pg_name(job.id), lifetime="detached")
        self.pg_pending_since[job.id] = time.monotonic()
        return pg

    def kill_driver(self, job_id: str, driver: Any) -> None:
        ray.kill(driver, no_restart=True)
        self.driver_started.pop(job_id, None)

    def release(self, job_id: str) -> None:
        """Kill the job's driver and remove its placement group (the actors in it go with it)."""
        actor = self.driver(job_id)
        if actor is not None:
            ray.kill(actor, no_restart=True)
        pg = self.pg(job_id)
        if pg is not None:
            remove_placement_group(pg)
        self.driver_started.pop(job_id, None)
        self.pg_pending_since.pop(job_id, None)

    def start_driver(self, job: JobRecord, pg: PlacementGroup) -> None:
        res = job.spec.resources
        self.store.update_job(job.id, allowed=[JobState.STARTING], fields={"attempts": str(job.attempts + 1)},
                              event="driver_started", event_data={"attempt": job.attempts + 1})
        actor_cls = ray.remote(JobDriver)
        single = res.num_learners == 1  # then the driver is the learner: it takes bundle 0 whole
        try:
            driver = actor_cls.options(
                name=driver_name(job.id),
                namespace=self._ns(),
                lifetime="detached",
                max_restarts=0,
                max_concurrency=4,
                num_cpus=res.learner_cpus if single else driver_cpus(job.spec),
                num_gpus=res.learner_gpus if single else 0,
                resources=res.learner_resources if single else {},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
                ),
            ).remote(job.id, self.store.url, self.store.prefix, self.runner, self.heartbeat_every_s, self.store.caps)
        except ValueError:  # the name is still held by a driver that is going away; retry next tick
            return
        self.driver_started[job.id] = time.monotonic()
        driver.run.remote()  # fire and forget: the driver reports through Redis
