"""Experiment tracking of a running job: every metric the runner emits (per-step training metrics, the
schedule's version and process weight among them, evaluations) also goes to TensorBoard event files in the
job's work dir (`tensorboard/`, always) and to MLflow or Weights & Biases when the job's `tracking` block asks
and the package is installed. A tracker that cannot start or write costs the job a warning event, never the
job itself."""

from __future__ import annotations

import importlib.util
import logging
import math
from pathlib import Path
from typing import Any, Protocol

from rl_service.hooks import JobHooks
from rl_service.spec import JobSpec

log = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


class TensorBoardTracker:
    def __init__(self, log_dir: Path, first_step: int) -> None:
        from tensorboardX import SummaryWriter

        # a resumed job drops what a crashed run logged past its checkpoint
        self.writer = SummaryWriter(str(log_dir), purge_step=first_step, flush_secs=30)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MLflowTracker:
    def __init__(self, job_id: str, experiment: str, run_name: str | None) -> None:
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(experiment)
        self.run = mlflow.start_run(run_name=run_name or job_id, tags={"taper.job_id": job_id})

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.mlflow.log_metrics(metrics, step=step, run_id=self.run.info.run_id)

    def close(self) -> None:
        self.mlflow.end_run()


class WandbTracker:
    def __init__(self, job_id: str, spec: Any, config: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(project=spec.project, entity=spec.entity, name=spec.name or job_id, id=job_id,
                              resume="allow", tags=spec.tags, config=config)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


class TrackedHooks:
    """JobHooks that also send each step's metrics to the job's trackers (opened at the first metrics, so a
    resumed job's TensorBoard purges from where it resumed). Everything else goes to the wrapped hooks."""

    def __init__(self, inner: JobHooks, job_id: str, spec: JobSpec, work_dir: Path) -> None:
        self.inner = inner
        self.job_id = job_id
        self.spec = spec
        self.work_dir = Path(work_dir)
        self.trackers: list[Tracker] | None = None

    def __getattr__(self, name: str) -> Any:  # only for what this class lacks (heartbeat, test helpers, ...)
        if name == "inner":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _open(self, first_step: int) -> list[Tracker]:
        trackers: list[Tracker] = []
        wanted: list[tuple[str, str, Any]] = [("tensorboard", "tensorboardX",
                                               lambda: TensorBoardTracker(self.work_dir / TENSORBOARD_DIR, first_step))]
        tracking = self.spec.tracking
        if tracking.mlflow is not None:
            wanted.append(("mlflow", "mlflow",
                           lambda: MLflowTracker(self.job_id, tracking.mlflow.experiment, tracking.mlflow.run_name)))
        if tracking.wandb is not None:
            wanted.append(("wandb", "wandb",
                           lambda: WandbTracker(self.job_id, tracking.wandb, self.spec.model_dump(mode="json"))))
        for name, package, make in wanted:
            if not installed(package):
                self.inner.emit_event("warning", {"message": f"tracking.{name}: the {package} package is not "
                                                             "installed on the cluster; metrics are not sent there"})
                continue
            try:
                trackers.append(make())
            except Exception as exc:  # a tracker's server being down must not fail the job
                log.exception("job %s: %s tracking did not start", self.job_id, name)
                self.inner.emit_event("warning", {"message": f"tracking.{name}: could not start: {exc}"})
        return trackers

    def emit_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.inner.emit_metrics(step, metrics)
        if self.trackers is None:
            self.trackers = self._open(step)
        scalars = _scalars(metrics)
        for tracker in list(self.trackers):
            try:
                tracker.log(step, scalars)
            except Exception as exc:
                log.exception("job %s: a tracker failed; it is dropped", self.job_id)
                self.trackers.remove(tracker)
                self.inner.emit_event("warning", {"message": f"tracking: {type(tracker).__name__} failed and "
                                                             f"was stopped: {exc}"})

    def close(self) -> None:
        for tracker in self.trackers or []:
            try:
                tracker.close()
            except Exception:
                log.exception("job %s: closing a tracker failed", self.job_id)
        self.trackers = None
