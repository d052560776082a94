"""The main job, shortened: `taper demo` end to end through the REST API with real Redis, Ray and vLLM."""

from __future__ import annotations

import json

import pytest

from api.cli.demo import SHARED_GPU_RESOURCES, DemoConfig, demo_job_spec, run_demo
from reward_models.schedule import RewardSchedule


@pytest.mark.slow
def test_short_demo_end_to_end(tmp_path) -> None:
    cfg = DemoConfig(out_dir=tmp_path / "demo", sft_steps=4, mixed_sft_steps=2, sft_examples=32, rl_steps=5,
                     prompts_per_step=2, num_generations=2, eval_tasks=4, patch_at_step=2)
    result = run_demo(cfg)

    # artifacts
    report = result["report_dir"]
    for name in ("index.html", "rewards.png", "schedule.png", "success.png", "time_split.png", "summary.json"):
        assert (report / name).stat().st_size > 0, name
    assert "Trajectories" in (report / "index.html").read_text()
    assert json.loads((report / "summary.json").read_text())["RL steps"] == 5

    # every step counted once, in order
    train = [m for m in result["metrics"] if "success_rate" in m]
    assert [m["step"] for m in train] == [0, 1, 2, 3, 4]
    assert all(m["trajectories/num"] == 4 for m in train)
    evals = [m for m in result["metrics"] if "eval/success_rate" in m]
    assert len(evals) >= 2 and all(0.0 <= m["eval/success_rate"] <= 1.0 for m in evals)

    # the schedule weight follows the original schedule, then the patch from the step it took effect
    patch = result["patch"]
    assert patch is not None and patch["after_step"] >= 2
    original = RewardSchedule(kind="linear", w_start=0.5, w_end=0.0, horizon=5)
    patched = RewardSchedule(**patch["schedule"])
    versions = [int(m["schedule/version"]) for m in train]
    assert versions[0] == 1 and versions[-1] == 2 and versions == sorted(versions)
    for m in train:
        expected = (original if m["schedule/version"] == 1 else patched).weight(m["step"])
        assert m["schedule/weight"] == pytest.approx(expected)
    applied = [e["data"] for e in result["events"] if e["kind"] == "schedule_applied" and e["data"]["version"] == 2]
    first_v2 = next(m["step"] for m in train if m["schedule/version"] == 2)
    assert [e["step"] for e in applied] == [first_v2]  # one step numbering in events and metrics


def test_demo_on_a_gpu_shares_it_and_a_bad_device_is_a_message() -> None:
    from typer.testing import CliRunner

    from api.cli.cli import app
    from rl_service.spec import JobSpec

    on_gpu = JobSpec.model_validate(demo_job_spec(DemoConfig(device="cuda")))
    assert on_gpu.resources.learner_gpus + on_gpu.resources.rollout_gpus <= 1
    assert on_gpu.resources.model_dump(include=set(SHARED_GPU_RESOURCES)) == SHARED_GPU_RESOURCES
    assert JobSpec.model_validate(demo_job_spec(DemoConfig(device="cpu"))).resources.learner_gpus == 0
    result = CliRunner().invoke(app, ["demo", "--device", "tpu"])
    assert result.exit_code == 2 and "device must be auto, cpu or cuda, got 'tpu'" in result.output
