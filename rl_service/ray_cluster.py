"""Join the Ray cluster a process is told to use, or start a local one: the service and a standalone job
driver both do it."""

from __future__ import annotations

import os
import signal
import threading


def ensure_ray(address: str | None = None, num_cpus: int | None = None, namespace: str = "taper") -> None:
    """Connect to the Ray cluster at ``address`` (default: ``RAY_ADDRESS``) or start a local one (idempotent)."""
    import ray

    if ray.is_initialized():
        return
    # ray.init replaces a SIGTERM handler of the main thread with its own sys.exit: a process that has one
    # (the API server's graceful shutdown) keeps it
    on_main_thread = threading.current_thread() is threading.main_thread()
    own_handler = signal.getsignal(signal.SIGTERM) if on_main_thread else None
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace=namespace, log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus, namespace=namespace, include_dashboard=False, log_to_driver=False,
                 object_store_memory=512 * 1024 * 1024)
    if callable(own_handler):
        signal.signal(signal.SIGTERM, own_handler)
