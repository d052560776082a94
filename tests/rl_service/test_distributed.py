"""Data-parallel learner on real Ray actors with gloo: 2 ranks == 1 rank on the same global batch."""

from __future__ import annotations

import copy

import pytest
import torch

from rl_service.distributed import combine_metrics, shard_samples
from rl_service.learner import Learner, LossNorm
from tests.rl_service.learner_helpers import make_samples


def test_sharding_balances_tokens_and_keeps_every_sample() -> None:
    samples = make_samples(9, seed=2)
    shards = shard_samples(samples, 2)
    assert sorted(id(s) for sh in shards for s in sh) == sorted(id(s) for s in samples)
    loads = [sum(s.num_tokens for s in sh) for sh in shards]
    assert abs(loads[0] - loads[1]) <= max(s.num_tokens for s in samples)
    m = combine_metrics([{"loss": 1.0, "entropy": 2.0, "action_tokens": 1.0},
                         {"loss": 2.0, "entropy": 5.0, "action_tokens": 3.0}])
    assert m == {"loss": 3.0, "entropy": 4.25, "action_tokens": 4.0}


def test_two_ranks_match_one_rank(ray_local, tiny_llama_dir, tmp_path) -> None:
    """2 FSDP2 ranks over gloo (Ray actors) give the same loss and gradients as one rank on the same global
    batch, and the job runner's data-parallel step trains the same weights as its single learner."""
    import ray

    from rl_service.job import InMemoryHooks, JobRunner
    from tests.rl_service.learner_helpers import fake_trajectory
    from tests.rl_service.test_job import make_spec

    samples = make_samples(7, seed=4)  # odd count: the ranks get different numbers of samples
    results = {}
    for n in (1, 2):
        r = JobRunner(f"dp{n}", make_spec(tiny_llama_dir, resources={"num_learners": n}), InMemoryHooks(),
                      tmp_path / str(n))
        r.setup()
        task_a, task_b = r.train_tasks[:2]
        trajs = [fake_trajectory(task_a, "a", 0, seed=1), fake_trajectory(task_a, "a", 0, seed=2),
                 fake_trajectory(task_b, "b", 0, seed=3), fake_trajectory(task_b, "b", 0, seed=4),
                 fake_trajectory(task_b, "b", 0, seed=5)]
        try:
            if n == 2:
                assert all("fsdp" in ray.get(a.ping.remote()) for a in r.dp.ranks)
                single = Learner(copy.deepcopy(r.model), r.learner.config)
                loss = single.accumulate(single.micro_batches(samples, LossNorm.of(samples)))["loss"]
                got = r.dp.gradients(samples)
                assert float(got.pop("__loss__")) == pytest.approx(loss, rel=1e-5, abs=1e-7)
                for k, p in single.model.named_parameters():
                    torch.testing.assert_close(got[k], p.grad, rtol=1e-4, atol=1e-7, msg=k)
            results[n] = (r._train_step(0, trajs, {}), {k: v.clone() for k, v in r.model.state_dict().items()})
        finally:
            if r.dp is not None:
                r.dp.shutdown()
    (m1, w1), (m2, w2) = results[1], results[2]
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-5, abs=1e-7)
    assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-4)
    assert m2["entropy"] == pytest.approx(m1["entropy"], rel=1e-5)
    # Adam's first step moves each weight by ~lr·sign(g): where |g| is at rounding level the sign may
    # differ, so a few elements may be off by up to 2·lr
    lr = 0.05
    diffs = torch.cat([(w2[k] - w1[k]).abs().flatten() for k in w1])
    assert float(diffs.max()) <= 2 * lr + 1e-6
    assert float((diffs > 1e-5).float().mean()) < 0.01
