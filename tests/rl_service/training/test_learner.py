"""The learner: loss formulas against a slow per-sequence reference, exact accumulation, one step learns."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rl_service.training.learner import (
    Learner,
    LearnerConfig,
    LossNorm,
    PolicySample,
    pack_micro_batches,
    policy_loss,
)
from tests.rl_service.training.learner_helpers import make_samples, make_tiny_llama


def reference_loss(logps, old, adv, masks, cfg: LearnerConfig, is_ratios=None, ref=None) -> float:
    """TRL GRPOTrainer's per-sequence formulas written out with Python loops over sequences."""
    per_seq, tok_sum, tok_count = [], 0.0, 0
    for i in range(len(logps)):
        m = masks[i]
        n = sum(m)
        lr = [a - b for a, b in zip(logps[i], old[i], strict=True)]
        if cfg.importance_sampling_level == "sequence":
            seq = sum(x * y for x, y in zip(lr, m, strict=True)) / max(n, 1)
            ratios = [math.exp(seq)] * len(lr)
        else:
            ratios = [math.exp(x) for x in lr]
        terms = []
        for t, r in enumerate(ratios):
            c = min(max(r, 1 - cfg.epsilon_low), 1 + cfg.epsilon_up)
            loss_t = -min(r * adv[i][t], c * adv[i][t])
            if is_ratios is not None:
                loss_t *= is_ratios[i][t]
            if cfg.beta:
                d = ref[i][t] - logps[i][t]
                loss_t += cfg.beta * (math.exp(d) - d - 1)
            terms.append(loss_t * m[t])
        per_seq.append(sum(terms) / max(n, 1))
        tok_sum += sum(terms)
        tok_count += n
    g = len(logps)
    if cfg.loss_type == "grpo":
        return sum(per_seq) / g
    if cfg.loss_type == "dr_grpo":
        return tok_sum / (g * cfg.max_completion_length)
    return tok_sum / tok_count  # dapo, and bnpo on one micro-batch


LOSS_VARIANTS = [("grpo", "token"), ("dr_grpo", "token"), ("dapo", "token"), ("bnpo", "token"), ("grpo", "sequence")]


@pytest.mark.parametrize(("loss_type", "level"), LOSS_VARIANTS)
def test_policy_loss_matches_reference(loss_type: str, level: str) -> None:
    torch.manual_seed(1)
    cfg = LearnerConfig(loss_type=loss_type, importance_sampling_level=level, epsilon=0.2, epsilon_high=0.28,
                        beta=0.05, max_completion_length=12)
    samples = make_samples(5, seed=3)
    norm = LossNorm.of(samples)
    c = max(len(s.completion_ids) for s in samples)
    b = len(samples)
    mask = torch.zeros(b, c)
    adv = torch.zeros(b, c)
    w = torch.zeros(b, c)
    for i, s in enumerate(samples):
        n = len(s.completion_ids)
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        adv[i, :n] = torch.tensor(s.advantages)
        w[i, :n] = torch.tensor(norm.token_weights(s, cfg, norm.num_action_tokens))
    logps = -torch.rand(b, c, dtype=torch.float64).float() * 3
    old = logps + 0.4 * torch.randn(b, c)  # large enough that some ratios clip
    ref = logps + 0.3 * torch.randn(b, c)
    isr = (0.5 + torch.rand(b, c)).clamp(max=1.3)
    loss, sums = policy_loss(logps, old, adv, mask, w, cfg, is_ratio=isr, ref_logps=ref)
    lens = [len(s.completion_ids) for s in samples]
    want = reference_loss([logps[i, : lens[i]].tolist() for i in range(b)], [old[i, : lens[i]].tolist() for i in range(b)],
                          [s.advantages for s in samples], [s.loss_mask for s in samples], cfg,
                          [isr[i, : lens[i]].tolist() for i in range(b)], [ref[i, : lens[i]].tolist() for i in range(b)])
    assert float(loss) == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert float(sums["clip_region"]) > 0  # the test exercises clipping
    assert float(sums["tokens"]) == sum(s.num_action_tokens for s in samples)


def _grads_after_accumulate(model, samples, cfg):
    learner = Learner(model, cfg)
    learner.accumulate(learner.micro_batches(samples, LossNorm.of(samples)))
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("loss_type", "level"), [v for v in LOSS_VARIANTS if v[0] != "bnpo"])
def test_micro_batch_accumulation_is_exact(loss_type: str, level: str) -> None:
    """bnpo is left out: its normaliser is each micro-batch's own token count (TRL's "local batch")."""
    samples = make_samples(6, seed=5)
    base = make_tiny_llama()
    one = _grads_after_accumulate(copy.deepcopy(base), samples, LearnerConfig(
        loss_type=loss_type, importance_sampling_level=level, micro_batch_tokens=10_000))
    cfg_many = LearnerConfig(loss_type=loss_type, importance_sampling_level=level, micro_batch_tokens=20)
    assert len(pack_micro_batches(samples, 20)) >= 3
    many = _grads_after_accumulate(copy.deepcopy(base), samples, cfg_many)
    for name, g in one.items():
        torch.testing.assert_close(many[name], g, rtol=1e-4, atol=1e-7, msg=name)


def test_packing_respects_budget_and_covers_all() -> None:
    samples = make_samples(20, seed=7)
    groups = pack_micro_batches(samples, 40)
    assert sorted(i for g in groups for i in g) == list(range(20))
    for g in groups:
        longest = max(samples[i].num_tokens for i in g)
        assert len(g) == 1 or longest * len(g) <= 40


def test_one_step_lowers_the_loss_on_a_fixed_batch() -> None:
    model = make_tiny_llama()
    samples = make_samples(8, seed=11)
    cfg = LearnerConfig(loss_type="dapo", learning_rate=3e-3, vllm_importance_sampling_correction=False)
    learner = Learner(model, cfg)
    norm = LossNorm.of(samples)

    def surrogate(old_lp):
        new_lp = learner.logprobs(samples)
        total = 0.0
        for s, o, n_ in zip(samples, old_lp, new_lp, strict=True):
            for t in range(len(s.completion_ids)):
                r = math.exp(n_[t] - o[t])
                c = min(max(r, 0.8), 1.2)
                total += -min(r * s.advantages[t], c * s.advantages[t]) * norm.token_weights(s, cfg)[t]
        return total

    before_lp = learner.logprobs(samples)
    before = surrogate(before_lp)
    metrics = learner.step(samples)
    after = surrogate(before_lp)
    assert metrics["loss"] == pytest.approx(before, rel=1e-4, abs=1e-6)
    assert after < before - 1e-4
    # tokens with positive advantage became more likely on average, negative ones less likely
    after_lp = learner.logprobs(samples)
    up = [a - b for s, x, y in zip(samples, after_lp, before_lp, strict=True)
          for a, b, adv, m in zip(x, y, s.advantages, s.loss_mask, strict=True) if m and adv > 0.5]
    down = [a - b for s, x, y in zip(samples, after_lp, before_lp, strict=True)
            for a, b, adv, m in zip(x, y, s.advantages, s.loss_mask, strict=True) if m and adv < -0.5]
    assert sum(up) / len(up) > 0 > sum(down) / len(down)


def test_masked_tokens_and_masked_samples_never_reach_the_gradient() -> None:
    """Inserted tokens (mask 0) contribute nothing: changing their advantages leaves the gradient unchanged."""
    base = make_tiny_llama()
    samples = make_samples(4, seed=13)
    changed = []
    for s in samples:
        adv = [a if m else a + 100.0 for a, m in zip(s.advantages, s.loss_mask, strict=True)]
        eng = [e if m else e - 50.0 for e, m in zip(s.engine_logprobs, s.loss_mask, strict=True)]
        changed.append(PolicySample(s.prompt_ids, s.completion_ids, s.loss_mask, adv, eng))
    cfg = LearnerConfig(loss_type="grpo")
    g1 = _grads_after_accumulate(copy.deepcopy(base), samples, cfg)
    g2 = _grads_after_accumulate(copy.deepcopy(base), changed, cfg)
    for name, g in g1.items():
        torch.testing.assert_close(g2[name], g, rtol=1e-5, atol=1e-8, msg=name)


def test_importance_sampling_correction_uses_engine_logprobs_and_is_truncated() -> None:
    model = make_tiny_llama()
    samples = make_samples(3, seed=17)
    cfg = LearnerConfig(loss_type="dapo", vllm_importance_sampling_mode="token_truncate",
                        vllm_importance_sampling_clip_max=1.5)
    learner = Learner(copy.deepcopy(model), cfg)
    exact = learner.logprobs(samples)
    # engine logprobs equal to the learner's: mismatch 0 and the IS ratio is 1
    same = [PolicySample(s.prompt_ids, s.completion_ids, s.loss_mask, s.advantages, lp) for s, lp in zip(samples, exact, strict=True)]
    m = learner.accumulate(learner.micro_batches(same, LossNorm.of(same)))
    assert m["logprob_mismatch/mean_abs"] < 1e-6
    assert m["is_ratio/mean"] == pytest.approx(1.0, abs=1e-5)
    # engine much less likely than the learner: the ratio is capped
    low = [PolicySample(s.prompt_ids, s.completion_ids, s.loss_mask, s.advantages, [x - 5 for x in lp])
           for s, lp in zip(samples, exact, strict=True)]
    learner.optimizer.zero_grad()
    m = learner.accumulate(learner.micro_batches(low, LossNorm.of(low)))
    assert m["is_ratio/max"] == pytest.approx(1.5)
    assert m["logprob_mismatch/mean_abs"] == pytest.approx(5.0, rel=1e-4)


def test_num_iterations_and_lr_schedule_and_bad_config() -> None:
    model = make_tiny_llama()
    samples = make_samples(4, seed=19)
    cfg = LearnerConfig(num_iterations=2, lr_scheduler_type="linear", max_steps=4, learning_rate=1e-2)
    learner = Learner(model, cfg)
    m1 = learner.step(samples)
    m2 = learner.step(samples)
    assert learner.optimizer_steps == 4
    assert m1["learning_rate"] == pytest.approx(1e-2) and m2["learning_rate"] == pytest.approx(5e-3)
    with pytest.raises(ValueError, match="loss_type"):
        LearnerConfig(loss_type="ppo")
    with pytest.raises(ValueError, match="epsilon"):
        LearnerConfig(epsilon=0)
    with pytest.raises(ValueError, match="advantages"):
        PolicySample([1], [1, 2], [1, 1], [0.0], [0.0, 0.0])


def test_kl_to_reference_is_zero_at_start_and_grows() -> None:
    model = make_tiny_llama()
    ref = copy.deepcopy(model)
    samples = make_samples(4, seed=23)
    learner = Learner(model, LearnerConfig(beta=0.1, learning_rate=1e-2), ref_model=ref)
    m0 = learner.step(samples)
    m1 = learner.step(samples)
    assert abs(m0["kl"]) < 1e-6 and m1["kl"] > 1e-6
    with pytest.raises(ValueError, match="reference"):
        Learner(make_tiny_llama(), LearnerConfig(beta=0.1))


def test_balancing_hook_runs_after_each_optimizer_step() -> None:
    model = make_tiny_llama()
    calls = []
    model.update_balancing = lambda: calls.append(1)
    Learner(model, LearnerConfig(num_iterations=3)).step(make_samples(2))
    assert len(calls) == 3
