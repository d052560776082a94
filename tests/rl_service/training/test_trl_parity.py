"""Our learner's formulas against TRL's own code on the same random tensors.

The policy loss runs TRL 1.16's real `GRPOTrainer._compute_loss` (trl/trainer/grpo_trainer.py) on a minimal
stand-in for the trainer: only the attributes that method reads, and a `_get_per_token_logps_and_entropies`
that returns our log-probabilities, so the clipping, KL, importance weighting and every `loss_type`'s
aggregation are TRL's lines, not a copy. Advantages and the rollout/learner importance ratio live inside
TRL's `_generate_and_score_completions`, which needs a whole trainer; their expressions are reproduced from
that function (with TRL's own `nanstd`) and compared with ours.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from trl import GRPOTrainer
from trl.trainer.utils import nanstd

from reward_models.credit import group_advantages
from rl_service.training.learner import LearnerConfig, LossNorm, PolicySample, collate, policy_loss
from rl_service.training.learner.loss import importance_sampling_ratio

VARIANTS = [(loss, level) for loss in ("grpo", "dapo", "dr_grpo", "bnpo") for level in ("token", "sequence")]


def _samples(n: int, seed: int) -> list[PolicySample]:
    """Multi-turn-like samples: different lengths, inserted (mask 0) spans inside, one fully masked sample."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        c = rng.randint(3, 14)
        mask = [1] * c
        if c > 6:
            start = rng.randint(1, c - 4)
            mask[start:start + 3] = [0, 0, 0]  # a tool response inside the completion
        if i == n - 1:
            mask = [0] * c  # a sample whose every token was inserted
        adv = [rng.gauss(0.0, 1.0) for _ in range(c)]
        out.append(PolicySample([rng.randint(3, 60) for _ in range(rng.randint(1, 5))],
                                [rng.randint(3, 60) for _ in range(c)], mask, adv, [0.0] * c))
    return out


def _trl_loss(cfg: LearnerConfig, logps: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    entropies = torch.rand_like(logps)
    stand_in = SimpleNamespace(
        # what GRPOTrainer.__init__ would have set from a GRPOConfig with the same values
        loss_type=cfg.loss_type, importance_sampling_level=cfg.importance_sampling_level, beta=cfg.beta,
        epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_up, max_completion_length=cfg.max_completion_length,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=True,
        vllm_importance_sampling_correction=True, aux_loss_enabled=False, _entropy_bonus_enabled=False,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        current_gradient_accumulation_steps=1, model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(num_processes=1, sync_gradients=True, gather=lambda x: x,
                                    gather_for_metrics=lambda x: x, reduce=lambda x, reduction: x),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logps, entropies, None),
    )
    return GRPOTrainer._compute_loss(stand_in, None, inputs)


@pytest.mark.parametrize(("loss_type", "level"), VARIANTS)
def test_policy_loss_and_its_gradient_equal_trls(loss_type: str, level: str) -> None:
    torch.manual_seed(3)
    cfg = LearnerConfig(loss_type=loss_type, importance_sampling_level=level, epsilon=0.2, epsilon_high=0.28,
                        beta=0.04, max_completion_length=16)
    samples = _samples(6, seed=4)
    mb = collate(samples, range(len(samples)), LossNorm.of(samples), cfg)  # one micro-batch: TRL's local batch
    b, c = mb.mask.shape
    padding = torch.zeros(b, c)
    for r, s in enumerate(samples):
        padding[r, : len(s.completion_ids)] = 1.0
    base = -3 * torch.rand(b, c, dtype=torch.float64).float()
    old = base + 0.3 * torch.randn(b, c) + 0.3 * torch.randn(b, 1)  # far enough from the policy to clip
    ref = base + 0.2 * torch.randn(b, c)
    is_ratio = 0.5 + torch.rand(b, c)

    ours_lp = base.clone().requires_grad_(True)
    ours, sums = policy_loss(ours_lp, old, mb.advantages, mb.mask, mb.token_weights, cfg, is_ratio=is_ratio,
                             ref_logps=ref)
    ours.backward()
    trl_lp = base.clone().requires_grad_(True)
    inputs = {"prompt_ids": torch.ones(b, 1, dtype=torch.long), "prompt_mask": torch.ones(b, 1, dtype=torch.long),
              "completion_ids": mb.completion_ids, "completion_mask": padding, "tool_mask": mb.mask,
              "advantages": mb.advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "importance_sampling_ratio": is_ratio, "num_items_in_batch": mb.mask.sum()}
    theirs = _trl_loss(cfg, trl_lp, inputs)
    theirs.backward()

    assert float(sums["clip_region"]) > 0
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(ours_lp.grad, trl_lp.grad, rtol=1e-5, atol=1e-8)


def _trl_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    """GRPOTrainer._generate_and_score_completions (trl/trainer/grpo_trainer.py, multi_objective_aggregation
    "sum_then_normalize", one reward function), line for line."""
    mean_grouped = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    if scale_rewards in ("group", "none"):
        std = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    else:
        std = nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean_grouped
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return advantages


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_outcome_advantages_equal_trls(scale_rewards: str) -> None:
    g, n = 5, 6
    rng = np.random.default_rng(7)
    rewards = rng.random(g * n)
    rewards[:n] = 1.0  # one group with zero variance
    ours, groups, zero_var = group_advantages(rewards.tolist(), [f"task-{i // n}" for i in range(g * n)],
                                              scale_rewards, eps=1e-4)
    theirs = _trl_advantages(torch.tensor(rewards, dtype=torch.float64), n, scale_rewards)
    # TRL's nanstd computes its Bessel factor count / (count - 1) in float32: agreement to fp32 precision
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-7, atol=1e-12)
    assert (groups, zero_var) == (g, 1)


def _trl_is_ratio(old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, mode: str, low: float | None,
                  high: float | None) -> torch.Tensor:
    """GRPOTrainer._generate_and_score_completions (trl/trainer/grpo_trainer.py), the vLLM importance-sampling
    branch, line for line."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=low, max=high)
    low_v = low if low is not None else -math.inf
    high_v = high if high is not None else math.inf
    return ratio.masked_fill((ratio < low_v) | (ratio > high_v), value=0.0)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_sampling_ratio_equals_trls(mode: str) -> None:
    torch.manual_seed(11)
    b, c = 6, 9
    mask = (torch.rand(b, c) > 0.25).float()
    old = -3 * torch.rand(b, c)
    sampling = old + 0.4 * torch.randn(b, c)
    sampling[0, 0] = float("nan")  # a logprob the engine did not return
    cfg = LearnerConfig(vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=0.8,
                        vllm_importance_sampling_clip_max=1.6)
    ours = importance_sampling_ratio(old, sampling, mask, cfg)
    theirs = _trl_is_ratio(old, sampling, mask, mode, 0.8, 1.6).expand(b, c)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0.0)
    assert bool((ours == (0.0 if mode.endswith("mask") else 0.8)).any() or (ours == 1.6).any())
