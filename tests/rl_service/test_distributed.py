"""Data-parallel learner on real Ray actors with gloo: 2 ranks == 1 rank on the same global batch."""

from __future__ import annotations

import copy

import pytest
import torch

from rl_service.distributed import DistributedLearner, combine_metrics, shard_samples
from rl_service.learner import Learner, LearnerConfig, LossNorm
from tests.rl_service.learner_helpers import make_samples, make_tiny_llama


def test_sharding_balances_tokens_and_keeps_every_sample() -> None:
    samples = make_samples(9, seed=2)
    shards = shard_samples(samples, 2)
    assert sorted(id(s) for sh in shards for s in sh) == sorted(id(s) for s in samples)
    loads = [sum(s.num_tokens for s in sh) for sh in shards]
    assert abs(loads[0] - loads[1]) <= max(s.num_tokens for s in samples)
    m = combine_metrics([{"loss": 1.0, "entropy": 2.0, "action_tokens": 1.0},
                         {"loss": 2.0, "entropy": 5.0, "action_tokens": 3.0}])
    assert m == {"loss": 3.0, "entropy": 4.25, "action_tokens": 4.0}


@pytest.mark.parametrize("strategy", ["fsdp"])
def test_two_ranks_match_one_rank(ray_local, tmp_path, strategy: str) -> None:
    base = make_tiny_llama()
    base.save_pretrained(tmp_path)
    samples = make_samples(7, seed=4)  # odd count: the ranks get different numbers of micro-batches
    # adam_epsilon well above the tiniest gradients: Adam's first step is ~lr·sign(g), which would turn
    # float-rounding differences of near-zero gradients into lr-sized parameter differences
    cfg = LearnerConfig(loss_type="grpo", learning_rate=1e-2, micro_batch_tokens=24, adam_epsilon=1e-4)

    single = Learner(copy.deepcopy(base), cfg)
    single.accumulate(single.micro_batches(samples, LossNorm.of(samples)))
    want = {n: p.grad.clone() for n, p in single.model.named_parameters()}
    single.optimizer.zero_grad()

    dp = DistributedLearner(str(tmp_path), cfg, num_ranks=2, strategy=strategy)
    try:
        got = dp.gradients(samples)
        ref_metrics = single.step(samples)
        dp_metrics = dp.step(samples)
        state = dp.full_state_dict()
    finally:
        dp.shutdown()
    assert float(got.pop("__loss__")) == pytest.approx(ref_metrics["loss"], rel=1e-5, abs=1e-7)
    assert dp_metrics["loss"] == pytest.approx(ref_metrics["loss"], rel=1e-5, abs=1e-7)
    assert dp_metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-4)
    assert dp_metrics["entropy"] == pytest.approx(ref_metrics["entropy"], rel=1e-5)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-7, msg=name)
    for name, p in single.model.state_dict().items():
        torch.testing.assert_close(state[name], p, rtol=1e-4, atol=1e-6, msg=name)
