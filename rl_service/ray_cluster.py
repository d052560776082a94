"""Join the Ray cluster a process is told to use, or start a local one: the service and a standalone job
driver both do it."""

from __future__ import annotations

import os


def ensure_ray(address: str | None = None, num_cpus: int | None = None, namespace: str = "taper") -> None:
    """Connect to the Ray cluster at ``address`` (default: ``RAY_ADDRESS``) or start a local one (idempotent)."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace=namespace, log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus, namespace=namespace, include_dashboard=False, log_to_driver=False,
                 object_store_memory=512 * 1024 * 1024)
