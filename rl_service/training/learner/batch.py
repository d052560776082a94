"""Learner inputs: one `PolicySample` per trajectory, packed into padded micro-batches by token count."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rl_service.training.learner.config import LearnerConfig


@dataclass
class PolicySample:
    """One trajectory as the learner sees it. Completion lists are aligned token by token."""

    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int]  # 1 on policy-sampled tokens, 0 on inserted (tool / environment) tokens
    advantages: list[float]
    engine_logprobs: list[float]  # the sampler's logprobs (ignored where loss_mask is 0)
    weight_version: int = 0  # the oldest policy version that sampled any of its turns

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        for name in ("loss_mask", "advantages", "engine_logprobs"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"PolicySample.{name} has length {len(getattr(self, name))}, completion_ids has {n}")
        if not self.prompt_ids:
            raise ValueError("PolicySample.prompt_ids must not be empty")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def num_action_tokens(self) -> int:
        return sum(self.loss_mask)

    @classmethod
    def from_trajectory(cls, traj, advantages: Sequence[float]) -> PolicySample:
        """`traj` is a `rollout_workers.trajectory.Trajectory`; `advantages` align with its completion ids."""
        versions = traj.weight_versions()
        return cls(
            prompt_ids=list(traj.prompt_ids),
            completion_ids=traj.completion_ids(),
            loss_mask=traj.loss_mask(),
            advantages=[float(a) for a in advantages],
            engine_logprobs=traj.completion_logprobs(),
            weight_version=min(versions) if versions else 0,
        )


@dataclass
class LossNorm:
    """Global-batch counts that fix each token's loss weight, so that accumulation over micro-batches and
    data-parallel ranks gives exactly the full-batch loss. `num_micro_batches` (bnpo only) counts the
    micro-batches of all ranks; unset, the learner counts its own."""

    num_sequences: int
    num_action_tokens: int
    num_micro_batches: int | None = None

    @classmethod
    def of(cls, samples: Sequence[PolicySample]) -> LossNorm:
        return cls(len(samples), sum(s.num_action_tokens for s in samples))

    def token_weights(self, sample: PolicySample, config: LearnerConfig, micro_batch_action_tokens: int = 0) -> list[float]:
        m = sample.loss_mask
        if config.loss_type == "grpo":
            n = sum(m)
            w = 1.0 / (self.num_sequences * n) if n else 0.0
        elif config.loss_type == "dr_grpo":
            w = 1.0 / (self.num_sequences * config.max_completion_length)
        elif config.loss_type == "bnpo":
            w = 1.0 / (max(micro_batch_action_tokens, 1) * (self.num_micro_batches or 1))
        else:  # dapo
            w = 1.0 / max(self.num_action_tokens, 1)
        return [w * x for x in m]


@dataclass
class MicroBatch:
    """Right-padded tensors; completion-aligned tensors have shape [B, C] (C = longest completion)."""

    input_ids: torch.Tensor  # [B, T] prompt + completion
    attention_mask: torch.Tensor  # [B, T]
    prompt_lens: torch.Tensor  # [B]
    completion_ids: torch.Tensor  # [B, C]
    mask: torch.Tensor  # [B, C] float, loss mask (0 on padding)
    advantages: torch.Tensor  # [B, C]
    engine_logprobs: torch.Tensor  # [B, C]
    token_weights: torch.Tensor  # [B, C] per-token loss weights from LossNorm
    sample_index: list[int]  # positions in the step's sample list (to keep per-sample state like old logprobs)

    @property
    def num_padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device: torch.device | str) -> MicroBatch:
        fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return MicroBatch(**fields)


def pack_micro_batches(samples: Sequence[PolicySample], micro_batch_tokens: int) -> list[list[int]]:
    """Group sample indices so each group's padded size (count × longest) stays within the token budget.

    Longest first, greedy; a sample longer than the budget goes alone. Deterministic for a given input.
    """
    order = sorted(range(len(samples)), key=lambda i: (-samples[i].num_tokens, i))
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        n = samples[i].num_tokens
        if current and max(longest, n) * (len(current) + 1) > micro_batch_tokens:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups


def collate(samples: Sequence[PolicySample], indices: Sequence[int], norm: LossNorm, config: LearnerConfig,
            pad_id: int = 0) -> MicroBatch:
    chosen = [samples[i] for i in indices]
    b = len(chosen)
    t = max(s.num_tokens for s in chosen)
    c = max(max(len(s.completion_ids) for s in chosen), 1)
    input_ids = torch.full((b, t), pad_id, dtype=torch.long)
    attention = torch.zeros((b, t), dtype=torch.long)
    comp = torch.full((b, c), pad_id, dtype=torch.long)
    mask = torch.zeros((b, c))
    adv = torch.zeros((b, c))
    eng = torch.zeros((b, c))
    weights = torch.zeros((b, c))
    prompt_lens = torch.zeros(b, dtype=torch.long)
    action_tokens = sum(s.num_action_tokens for s in chosen)
    for r, s in enumerate(chosen):
        ids = s.prompt_ids + s.completion_ids
        input_ids[r, : len(ids)] = torch.tensor(ids)
        attention[r, : len(ids)] = 1
        prompt_lens[r] = len(s.prompt_ids)
        n = len(s.completion_ids)
        if n:
            comp[r, :n] = torch.tensor(s.completion_ids)
            mask[r, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
            adv[r, :n] = torch.tensor(s.advantages, dtype=torch.float32)
            eng[r, :n] = torch.tensor(s.engine_logprobs, dtype=torch.float32)
            weights[r, :n] = torch.tensor(norm.token_weights(s, config, action_tokens), dtype=torch.float32)
    return MicroBatch(input_ids, attention, prompt_lens, comp, mask, adv, eng, weights, list(indices))
