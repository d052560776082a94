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


def test_data_parallel_resume_restores_optimizer_and_schedule_exactly(ray_local, tiny_llama_dir, tmp_path) -> None:
    """2 FSDP2 ranks over gloo: steps 1-3 in one run == steps 1-2, a checkpoint, and step 3 in a new runner with
    new ranks, bit for bit. Needs the ranks' AdamW moments and LR schedule in the checkpoint (zero moments or
    the linear decay started afresh would give other weights). Fixed trajectories stand in for rollouts, so the
    learner is all that runs."""
    from rl_service.checkpoint import latest_checkpoint
    from rl_service.job import InMemoryHooks, JobRunner
    from tests.rl_service.learner_helpers import fake_trajectory
    from tests.rl_service.test_job import make_spec

    spec = make_spec(tiny_llama_dir, total_steps=3, algorithm={"lr_scheduler_type": "linear", "learning_rate": 0.02},
                     resources={"num_learners": 2, "learner_cpus": 0.5})

    def batch(runner: JobRunner, t: int) -> list:
        tasks = runner.train_tasks[2 * t: 2 * t + 2]
        return [fake_trajectory(task, f"g{t}-{i}", t, seed=100 * t + 10 * i + j)
                for i, task in enumerate(tasks) for j in range(3)]

    first = JobRunner("dpr", spec, InMemoryHooks(), tmp_path)
    assert first.setup()[0] == 0
    try:
        lr = [first._train_step(t, batch(first, t), {})["learning_rate"] for t in range(2)]
        first._checkpoint(2)
        lr.append(first._train_step(2, batch(first, 2), {})["learning_rate"])
        want = {k: v.clone() for k, v in first.model.state_dict().items()}
    finally:
        first.dp.shutdown()
    saved = latest_checkpoint(tmp_path / "checkpoints")
    state = saved.learner_state()
    assert saved.step == 2 and state["world_size"] == 2 and state["optimizer_steps"] == 2
    assert {"exp_avg", "exp_avg_sq"} <= set(next(iter(state["optimizer_by_name"]["state"].values())))

    hooks = InMemoryHooks()
    second = JobRunner("dpr", spec, hooks, tmp_path)
    assert second.setup()[0] == 2 and not hooks.events_of("warning")
    try:
        got_lr = second._train_step(2, batch(second, 2), {})["learning_rate"]
    finally:
        second.dp.shutdown()
    assert got_lr == lr[2] < lr[0]
    moved = [k for k in want if not torch.equal(want[k], _weights_at(saved.path)[k])]
    assert moved  # step 3 changed the weights
    for k, v in second.model.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=0, msg=k)


def _weights_at(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))
