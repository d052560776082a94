"""Operator limits and tenant quotas (pure logic) and how the operator sets them (settings)."""

from __future__ import annotations

import pytest

from rl_service.control.quota import JobLimits, LimitExceeded, ResourceCaps, TenantQuota, check_job
from rl_service.control.settings import SettingsError, load_settings
from rl_service.spec import JobSpec


def test_the_tighter_of_operator_limit_and_tenant_cap_applies_and_is_named() -> None:
    spec = JobSpec.model_validate({"resources": {"learner_cpus": 4}})
    check_job(spec, JobLimits(learner_cpus=4), TenantQuota())
    with pytest.raises(LimitExceeded, match="operator's limit") as exc:
        check_job(spec, JobLimits(learner_cpus=3), TenantQuota(resources=ResourceCaps(learner_cpus=8)))
    assert exc.value.field == "resources.learner_cpus"
    with pytest.raises(LimitExceeded, match="tenant's quota"):
        check_job(spec, JobLimits(learner_cpus=8), TenantQuota(resources=ResourceCaps(learner_cpus=3)))
    check_job(spec, JobLimits(learner_cpus=None), TenantQuota())  # no cap at either level


def test_rollout_size_is_bounded_as_a_product() -> None:
    spec = JobSpec.model_validate({"rollout": {"prompts_per_step": 4, "num_generations": 4, "max_total_tokens": 64}})
    check_job(spec, JobLimits(rollout_tokens_per_step=1024), TenantQuota())
    with pytest.raises(LimitExceeded, match="4 x 4 x 64 = 1024") as exc:
        check_job(spec, JobLimits(rollout_tokens_per_step=1023), TenantQuota())
    assert exc.value.field == "rollout"


def test_priority_is_bounded_by_the_quota() -> None:
    check_job(JobSpec(priority=-5), JobLimits(), TenantQuota())
    with pytest.raises(LimitExceeded) as exc:
        check_job(JobSpec(priority=1), JobLimits(), TenantQuota())
    assert exc.value.field == "priority"
    check_job(JobSpec(priority=7), JobLimits(), TenantQuota(max_priority=7))


def test_limits_quotas_and_base_models_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TAPER_LIMITS__LEARNER_GPUS", "2")
    monkeypatch.setenv("TAPER_LIMITS__MODEL_PRESETS", '["tiny"]')
    monkeypatch.setenv("TAPER_DEFAULT_QUOTA__MAX_RUNNING_JOBS", "1")
    monkeypatch.setenv("TAPER_BASE_MODELS", '{"warm": "/models/warm"}')
    s = load_settings()
    assert (s.limits.learner_gpus, s.limits.model_presets, s.default_quota.max_running_jobs) == (2, ["tiny"], 1)
    assert str(s.base_models["warm"]) == "/models/warm"
    for bad in ("many", "-1"):
        monkeypatch.setenv("TAPER_LIMITS__LEARNER_GPUS", bad)
        with pytest.raises(SettingsError, match="TAPER_LIMITS__LEARNER_GPUS"):
            load_settings()
    monkeypatch.setenv("TAPER_LIMITS__LEARNER_GPUS", "2")
    monkeypatch.setenv("TAPER_BASE_MODELS", '{"../up": "/x"}')
    with pytest.raises(SettingsError, match="TAPER_BASE_MODELS"):
        load_settings()
