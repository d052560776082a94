"""The job scheduler as a process of its own (`taper scheduler`, and the detached one `taper serve` starts on
the embedded setup): it places queued jobs, restarts lost drivers and frees resources while no API runs.
Any number may run: a Redis lease lets one place at a time."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

from rl_service.control.service.runtime import start_runtime
from rl_service.control.settings import TaperSettings, get_settings


def run_scheduler(settings: TaperSettings, on_ready: Callable[[], None] | None = None) -> None:
    """Run until SIGTERM or SIGINT, or until the embedded services it runs beside are stopped for good (their
    data dir's record removed); running jobs keep going after it stops."""
    runtime = start_runtime(settings, run_scheduler=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if on_ready is not None:
        on_ready()
    gone = runtime.supervisor.gone if runtime.supervisor is not None else threading.Event()
    while not stop.wait(1.0) and not gone.is_set():
        pass
    runtime.stop()


if __name__ == "__main__":
    run_scheduler(get_settings())
