"""The clipped policy-gradient loss on token-level advantages (TRL GRPOTrainer's formulas, with token
advantages and normalisation folded into per-token weights so accumulation is exact)."""

from __future__ import annotations

import math

import torch

from rl_service.training.learner.config import LearnerConfig


def importance_sampling_ratio(old_logps: torch.Tensor, engine_logps: torch.Tensor, mask: torch.Tensor,
                              config: LearnerConfig) -> torch.Tensor:
    """The rollout/learner mismatch correction `π_learner / π_engine` per token (`[B, C]`), as TRL's
    `vllm_importance_sampling_mode`: per token or per sequence (the product over its tokens), clipped to
    `[clip_min, clip_max]` (truncate) or zeroed outside it (mask). 1 where the mask is 0 (token modes)."""
    diff = torch.nan_to_num((old_logps - engine_logps) * mask, nan=0.0)
    mode = config.vllm_importance_sampling_mode
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    low, high = config.vllm_importance_sampling_clip_min, config.vllm_importance_sampling_clip_max
    if mode.endswith("truncate"):
        ratio = ratio.clamp(min=low, max=high)
    else:
        outside = (ratio < (-math.inf if low is None else low)) | (ratio > (math.inf if high is None else high))
        ratio = ratio.masked_fill(outside, 0.0)
    return ratio.expand_as(mask)


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    token_weights: torch.Tensor,
    config: LearnerConfig,
    is_ratio: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Returns `(Σ token_weights · per_token_loss, sums)`; all inputs are `[B, C]`.

    `sums` holds detached sums over the action tokens (divide by `sums["tokens"]` for means) and the
    weighted loss parts.
    """
    log_ratio = logps - old_logps
    if config.importance_sampling_level == "sequence":
        log_iw = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        log_iw = log_ratio
    coef_1 = torch.exp(log_iw)
    coef_2 = torch.clamp(coef_1, 1 - config.epsilon_low, 1 + config.epsilon_up)
    pg = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if is_ratio is not None:
        pg = pg * is_ratio
    loss_pg = (pg * token_weights).sum()
    loss = loss_pg
    kl = None
    if config.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps")
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        loss_kl = (config.beta * kl * token_weights).sum()
        loss = loss + loss_kl

    with torch.no_grad():
        coef = coef_1.expand_as(mask)
        low = ((coef < 1 - config.epsilon_low) & (advantages < 0)).float() * mask
        high = ((coef > 1 + config.epsilon_up) & (advantages > 0)).float() * mask
        sums = {
            "tokens": mask.sum(),
            "loss_policy": loss_pg.detach(),
            "loss_kl": (loss - loss_pg).detach(),
            "clip_low": low.sum(),
            "clip_high": high.sum(),
            "clip_region": ((low + high) > 0).float().sum(),
            "kl": (kl.detach() * mask).sum() if kl is not None else torch.zeros(()),
        }
    return loss, sums
