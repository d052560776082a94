"""The MLflow tracker with the real mlflow package (the `tracking` extra, a local file store as the operator's
MLFLOW_TRACKING_URI): a job's metrics, slashes in their names included, land in a run named after the job.
Runs where the extra is installed (the dev extra pins it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl_service.hooks import InMemoryHooks
from rl_service.spec import JobSpec
from rl_service.training.tracking import TrackedHooks

mlflow = pytest.importorskip("mlflow")


def test_metrics_reach_an_mlflow_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a file store stands in for the operator's server
    spec = JobSpec(tracking={"mlflow": {"experiment": "taper-test"}})
    hooks = TrackedHooks(InMemoryHooks(), "job-0123456789abcdef", spec, tmp_path / "work")
    for step in (1, 2, 3):
        hooks.emit_metrics(step, {"loss": 1.0 / step, "schedule/weight": 1.0 - step / 4, "note": "text"})
    hooks.close()

    assert hooks.inner.events_of("warning") == []
    client = mlflow.tracking.MlflowClient()
    experiment = client.get_experiment_by_name("taper-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "job-0123456789abcdef" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "schedule/weight")
    assert [(m.step, m.value) for m in history] == [(1, 0.75), (2, 0.5), (3, 0.25)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == pytest.approx([1, 0.5, 1 / 3])
    assert sorted((tmp_path / "work" / "tensorboard").glob("events.out.tfevents.*"))  # TensorBoard as always
