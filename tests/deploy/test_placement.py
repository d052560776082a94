"""Placement by resources: what each role's Ray bundles and actors request (pure logic; the real
multi-node check is test_multinode.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rl_service.placement import job_bundles
from rl_service.spec import JobSpec, ResourcesSpec


def spec_with(resources: dict, num_workers: int = 2) -> JobSpec:
    return JobSpec.model_validate({"resources": resources, "rollout": {"num_workers": num_workers}})


def test_each_role_gets_its_own_custom_resources() -> None:
    spec = spec_with({"learner_cpus": 2, "learner_gpus": 1, "num_learners": 2, "learner_custom": {"learner": 1},
                      "rollout_cpus": 0.5, "rollout_gpus": 1, "rollout_custom": {"rollout": 1}}, num_workers=3)
    bundles = job_bundles(spec)
    assert bundles[0] == {"CPU": 1.0}  # the driver of a data-parallel job: CPU only
    assert bundles[1:3] == [{"CPU": 2.0, "GPU": 1.0, "learner": 1.0}] * 2
    assert bundles[3:] == [{"CPU": 0.5, "GPU": 1.0, "rollout": 1.0}] * 3


def test_custom_is_the_older_name_of_rollout_custom() -> None:
    res = ResourcesSpec(custom={"rollout": 1, "fast_disk": 1}, rollout_custom={"rollout": 2})
    assert res.rollout_resources == {"rollout": 2, "fast_disk": 1}
    assert res.learner_resources == {}
    assert job_bundles(spec_with({"custom": {"rollout": 1}}, num_workers=1)) == [{"CPU": 1.0}, {"CPU": 1.0, "rollout": 1}]


@pytest.mark.parametrize(("field", "value", "message"), [
    ("learner_custom", {"GPU": 1}, "resources.learner_custom: 'GPU' is not a custom resource"),
    ("rollout_custom", {"CPU": 2}, "resources.rollout_custom: 'CPU' is not a custom resource"),
    # amounts and names are bounded by the declared type (so the JSON Schema says it too)
    ("rollout_custom", {"rollout": 0}, "rollout_custom.rollout\n  Input should be greater than 0"),
    ("custom", {"": 1}, "custom..[key]\n  String should have at least 1 character"),
])
def test_bad_custom_resources_are_rejected_naming_the_field(field: str, value: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ResourcesSpec(**{field: value})


def test_one_gpu_shared_by_the_learner_and_the_engine() -> None:
    """Shares of one device: Ray's fractional GPUs place both bundles on it, and the engine holds its share of the
    device's memory (a whole GPU per worker keeps vLLM's default)."""
    from rl_service.training.runner import WHOLE_DEVICE_MEMORY_SHARE, engine_memory_share

    bundles = job_bundles(spec_with({"learner_gpus": 0.5, "rollout_gpus": 0.4}, num_workers=1))
    assert bundles == [{"CPU": 1.0, "GPU": 0.5}, {"CPU": 1.0, "GPU": 0.4}]
    assert engine_memory_share(0.4) == 0.4
    assert engine_memory_share(1) == engine_memory_share(2) == WHOLE_DEVICE_MEMORY_SHARE


@pytest.mark.parametrize(("resources", "message"), [
    ({"learner_gpus": 0.5, "num_learners": 2}, "resources.learner_gpus: a share of one device"),
    ({"learner_gpus": 1.5}, "resources.learner_gpus: a share of one device"),
    ({"rollout_gpus": 1.5}, "resources.rollout_gpus: above 1 it must be a whole number"),
])
def test_gpu_shares_that_cannot_be_placed_are_refused(resources: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ResourcesSpec(**resources)


def test_a_learner_and_engines_too_big_for_their_gpu_are_named_with_the_numbers() -> None:
    from rl_service.training.gpu_memory import LEARNER_STATE_BYTES_PER_PARAM, LEARNER_WORKSPACE_BYTES, plan

    gib = 1 << 30
    fits = plan(110_000_000, 0.4, free_bytes=120 * gib, total_bytes=140 * gib)
    assert fits.fits and fits.engines_bytes == int(0.4 * 140 * gib)
    assert fits.learner_bytes == 110_000_000 * LEARNER_STATE_BYTES_PER_PARAM + LEARNER_WORKSPACE_BYTES
    too_big = plan(7_000_000_000, 0.4, free_bytes=120 * gib, total_bytes=140 * gib)
    assert not too_big.fits
    assert too_big.describe() == ("resources: the learner needs 106.3 GiB and the rollout engines on its device take "
                                  "56.0 GiB (rollout_gpus x its memory), but 120.0 of the device's 140.0 GiB are free")
