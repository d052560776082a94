"""Starting a control plane: the store, the service, a first API key, the scheduler loop and the supervisor
of the embedded Redis and scheduler process."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_service.control.service import TaperService
from rl_service.control.store import Store


@dataclass
class ServiceRuntime:
    """What a running control plane holds: the service and its scheduler loop."""

    service: TaperService
    scheduler: Any = None
    supervisor: Any = None  # local_services.EmbeddedSupervisor on the embedded setup

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        if self.scheduler is not None:
            self.scheduler.stop()
        self.service.store.close()


def start_runtime(settings: Any, *, run_scheduler: bool = True, runner: str | type | None = None,
                  detached_scheduler: bool = False) -> ServiceRuntime:
    """Connect to Redis and join Ray, or use the data dir's embedded ones (a private Redis and a local Ray
    head, each started once in its own session so that jobs keep running through an API restart; `taper down`
    stops them), then run the scheduler loop (docs/design.md section 8). On the embedded setup a supervisor thread
    restarts a Redis that died, and with ``detached_scheduler`` (`taper serve`) keeps a scheduler process
    running beside this one, so that jobs are placed and recovered while no API runs. Writes a first API key
    for tenant ``default`` to ``data_dir/api-key`` when the store has none, so a fresh single-machine install
    can be used at once."""
    from rl_service.control.local_services import (
        EmbeddedSupervisor,
        ensure_embedded_redis,
        ensure_service_ray,
        write_secret,
    )
    from rl_service.control.scheduler import Scheduler

    data_dir = Path(settings.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    url = settings.redis_url or ensure_embedded_redis(data_dir, binary=settings.redis_server_bin).client_url
    store = Store(url, events_maxlen=settings.events_maxlen, metrics_maxlen=settings.metrics_maxlen,
                  schedule_max_versions=settings.schedule_max_versions)
    service = TaperService(store, data_dir, submit_rate_per_minute=settings.submit_rate_per_minute,
                           env_policy=settings.environment_policy(), limits=settings.limits,
                           default_quota=settings.default_quota, base_models=settings.base_models,
                           task_file_limits=settings.task_files, model_aliases=settings.model_aliases)
    service.environments.builtin()  # import the environment registry now, not in the first submission
    if not store.has_api_keys():
        key_file = data_dir / "api-key"
        key = store.create_api_key("default", name="bootstrap", admin=True)
        write_secret(key_file, key + "\n")
    scheduler = supervisor = None
    if run_scheduler:
        ensure_service_ray(settings.ray_address, data_dir, num_cpus=settings.local_cpus)
        scheduler = Scheduler(store, runner=runner or settings.job_runner, default_quota=settings.default_quota)
        scheduler.start()
    if not settings.redis_url:
        embedded_ray = run_scheduler and not settings.ray_address
        supervisor = EmbeddedSupervisor(data_dir, settings.redis_server_bin,
                                        scheduler=detached_scheduler and embedded_ray).start()
    return ServiceRuntime(service=service, scheduler=scheduler, supervisor=supervisor)
