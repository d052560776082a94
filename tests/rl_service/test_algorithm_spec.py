"""The job spec's algorithm block is the one algorithm config: TRL GRPOConfig's names and defaults, bounded,
unknown names refused, and the learner configured from it without a second declaration."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError
from trl import GRPOConfig

from rl_service.spec import ROLLOUT_FIELDS_OF_GRPO_CONFIG, AlgorithmSpec, JobSpec
from rl_service.training.learner import LearnerConfig

# AlgorithmSpec fields whose default is not TRL's, and why
NOT_TRLS_DEFAULT = {
    "max_completion_length": "null: the job's rollout.max_total_tokens",
    **{name: "null: stored in rollout (whose defaults are TRL's)" for name in ROLLOUT_FIELDS_OF_GRPO_CONFIG},
}


def _trl_defaults() -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(GRPOConfig):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def test_shared_fields_have_trls_defaults() -> None:
    trl = _trl_defaults()
    shared = [name for name in AlgorithmSpec.model_fields if name in trl]
    assert len(shared) >= 20, shared
    ours = AlgorithmSpec()
    for name in shared:
        if name in NOT_TRLS_DEFAULT:
            continue
        want = trl[name]
        want = getattr(want, "value", want)  # TrainingArguments' enums (lr_scheduler_type)
        assert getattr(ours, name) == want, name
    rollout = JobSpec().rollout
    assert (rollout.num_generations, rollout.temperature, rollout.top_p) == (
        trl["num_generations"], trl["temperature"], trl["top_p"])


def test_a_grpo_config_mapping_is_accepted_and_sampling_fields_land_in_rollout() -> None:
    trl = {"loss_type": "dr_grpo", "learning_rate": 3e-6, "beta": 0.04, "epsilon": 0.2, "epsilon_high": 0.28,
           "num_iterations": 2, "scale_rewards": "batch", "max_completion_length": 256, "num_generations": 4,
           "temperature": 0.7, "top_p": 0.9, "importance_sampling_level": "sequence", "max_grad_norm": 0.5,
           "vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": 0.5}
    spec = JobSpec.model_validate({"algorithm": trl, "total_steps": 10})
    assert (spec.rollout.num_generations, spec.rollout.temperature, spec.rollout.top_p) == (4, 0.7, 0.9)
    assert spec.algorithm.num_generations is None  # one home: rollout
    assert JobSpec.model_validate(spec.model_dump()) == spec  # a stored spec reloads unchanged
    cfg = LearnerConfig.from_spec(spec)
    for name in AlgorithmSpec.model_fields:
        if name not in ROLLOUT_FIELDS_OF_GRPO_CONFIG:
            assert getattr(cfg, name) == getattr(spec.algorithm, name), name
    assert (cfg.temperature, cfg.max_completion_length, cfg.max_steps) == (0.7, 256, 20)


@pytest.mark.parametrize(("algorithm", "rollout", "field"), [
    ({"per_device_train_batch_size": 4}, {}, "algorithm.per_device_train_batch_size"),
    ({"loss_type": "ppo"}, {}, "algorithm.loss_type"),
    ({"learning_rate": 2.0}, {}, "algorithm.learning_rate"),
    ({"beta": 1e9}, {}, "algorithm.beta"),
    ({"num_iterations": 1000}, {}, "algorithm.num_iterations"),
    ({"warmup_steps": 10**9}, {}, "algorithm.warmup_steps"),
    ({"vllm_importance_sampling_clip_min": 3.0, "vllm_importance_sampling_clip_max": 2.0}, {}, "algorithm"),
    ({"num_generations": 4}, {"num_generations": 8}, "algorithm.num_generations"),
    ({}, {"engine": "hf"}, "rollout.engine"),  # vLLM is the only rollout engine
])
def test_unknown_or_out_of_bounds_fields_are_named(algorithm: dict, rollout: dict, field: str) -> None:
    with pytest.raises(ValidationError) as exc:
        JobSpec.model_validate({"algorithm": algorithm, "rollout": rollout})
    err = exc.value.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    assert where.startswith(field) or field.split(".")[-1] in err["msg"], (where, err["msg"])


def test_older_names_of_stored_jobs_still_load() -> None:
    a = AlgorithmSpec.model_validate({"loss_type": "gspo", "vllm_importance_sampling_cap": 1.5})
    assert (a.loss_type, a.importance_sampling_level) == ("grpo", "sequence")
    assert (a.vllm_importance_sampling_mode, a.vllm_importance_sampling_clip_max) == ("token_truncate", 1.5)
