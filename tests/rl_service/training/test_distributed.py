"""Data-parallel learner on real Ray actors with gloo: 2 ranks == 1 rank on the same global batch."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from rl_service.training.distributed import combine_metrics, shard_samples
from rl_service.training.learner import Learner, LossNorm
from tests.rl_service.training.learner_helpers import make_samples


def test_sharding_balances_tokens_and_keeps_every_sample() -> None:
    samples = make_samples(9, seed=2)
    shards = shard_samples(samples, 2)
    assert sorted(id(s) for sh in shards for s in sh) == sorted(id(s) for s in samples)
    loads = [sum(s.num_tokens for s in sh) for sh in shards]
    assert abs(loads[0] - loads[1]) <= max(s.num_tokens for s in samples)
    m = combine_metrics([{"loss": 1.0, "entropy": 2.0, "action_tokens": 1.0},
                         {"loss": 2.0, "entropy": 5.0, "action_tokens": 3.0}])
    assert m == {"loss": 3.0, "entropy": 4.25, "action_tokens": 4.0}


@pytest.fixture(scope="module")
def dp_runs(ray_local, tiny_llama_dir, tmp_path_factory) -> dict[str, Any]:
    """One data-parallel run serves both tests below (a pair of FSDP2 ranks costs two Ray worker processes that
    import torch and the model: started twice here, not three times). 2 ranks over gloo train steps 1-3 (linear
    LR decay) with a checkpoint after step 2; before its first step the pair's loss and gradients are compared
    with one learner's on the same global batch, and step 1 is repeated by a single-learner runner of the same
    spec. A new runner with new ranks then resumes from the checkpoint and trains step 3 again. Fixed
    trajectories stand in for rollouts, so the learner is all that runs."""
    import ray

    from rl_service.hooks import InMemoryHooks
    from rl_service.training.checkpoint import latest_checkpoint
    from rl_service.training.runner import JobRunner
    from tests.rl_service.training.learner_helpers import fake_trajectory
    from tests.rl_service.training.test_job import make_spec

    tmp = tmp_path_factory.mktemp("dp")
    over = {"total_steps": 3, "algorithm": {"lr_scheduler_type": "linear", "learning_rate": 0.02}}
    spec = make_spec(tiny_llama_dir, **over, resources={"num_learners": 2, "learner_cpus": 0.5})
    out: dict[str, Any] = {}

    def first_batch(runner: JobRunner) -> list:  # odd count: the ranks get different numbers of samples
        task_a, task_b = runner.train_tasks[:2]
        return [fake_trajectory(task_a, "a", 0, seed=1), fake_trajectory(task_a, "a", 0, seed=2),
                fake_trajectory(task_b, "b", 0, seed=3), fake_trajectory(task_b, "b", 0, seed=4),
                fake_trajectory(task_b, "b", 0, seed=5)]

    def batch(runner: JobRunner, t: int) -> list:
        if t == 0:
            return first_batch(runner)
        tasks = runner.train_tasks[2 * t: 2 * t + 2]
        return [fake_trajectory(task, f"g{t}-{i}", t, seed=100 * t + 10 * i + j)
                for i, task in enumerate(tasks) for j in range(3)]

    first = JobRunner("dpr", spec, InMemoryHooks(), tmp / "dp")
    assert first.setup() == 0
    try:
        out["pings"] = ray.get([a.ping.remote() for a in first.dp.ranks])
        samples = make_samples(7, seed=4)  # odd count again
        single = Learner(copy.deepcopy(first.model), first.learner.config)
        out["single_loss"] = single.accumulate(single.micro_batches(samples, LossNorm.of(samples)))["loss"]
        out["single_grads"] = {k: p.grad.clone() for k, p in single.model.named_parameters()}
        out["dp_grads"] = first.dp.gradients(samples)
        steps = [first._train_step(0, batch(first, 0), {})]
        out["step1"] = (steps[0], {k: v.clone() for k, v in first.model.state_dict().items()})
        steps.append(first._train_step(1, batch(first, 1), {}))
        first._checkpoint(2)
        steps.append(first._train_step(2, batch(first, 2), {}))
        out["lr"] = [m["learning_rate"] for m in steps]
        out["want"] = {k: v.clone() for k, v in first.model.state_dict().items()}
    finally:
        first.dp.shutdown()
    out["saved"] = latest_checkpoint(tmp / "dp" / "checkpoints")

    one = JobRunner("dp1", make_spec(tiny_llama_dir, **over, resources={"num_learners": 1}), InMemoryHooks(),
                    tmp / "one")
    one.setup()
    assert one.dp is None
    out["one_step1"] = (one._train_step(0, batch(one, 0), {}), {k: v.clone() for k, v in one.model.state_dict().items()})

    out["resume_hooks"] = hooks = InMemoryHooks()
    second = JobRunner("dpr", spec, hooks, tmp / "dp")
    out["resume_start"] = second.setup()
    try:
        out["resume_lr"] = second._train_step(2, batch(second, 2), {})["learning_rate"]
        out["resumed"] = {k: v.clone() for k, v in second.model.state_dict().items()}
    finally:
        second.dp.shutdown()
    return out


def test_two_ranks_match_one_rank(dp_runs) -> None:
    """2 FSDP2 ranks over gloo (Ray actors) give the same loss and gradients as one rank on the same global
    batch, and the job runner's data-parallel step trains the same weights as its single learner."""
    assert all("fsdp" in ping for ping in dp_runs["pings"])
    got = dict(dp_runs["dp_grads"])
    assert float(got.pop("__loss__")) == pytest.approx(dp_runs["single_loss"], rel=1e-5, abs=1e-7)
    for k, g in dp_runs["single_grads"].items():
        torch.testing.assert_close(got[k], g, rtol=1e-4, atol=1e-7, msg=k)
    (m1, w1), (m2, w2) = dp_runs["one_step1"], dp_runs["step1"]
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-5, abs=1e-7)
    assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-4)
    assert m2["entropy"] == pytest.approx(m1["entropy"], rel=1e-5)
    # Adam's first step moves each weight by ~lr·sign(g): where |g| is at rounding level the sign may
    # differ, so a few elements may be off by up to 2·lr
    lr = m1["learning_rate"]
    assert lr == m2["learning_rate"] > 0
    diffs = torch.cat([(w2[k] - w1[k]).abs().flatten() for k in w1])
    assert float(diffs.max()) <= 2 * lr + 1e-6
    assert float((diffs > 1e-5).float().mean()) < 0.01


def test_data_parallel_resume_restores_optimizer_and_schedule_exactly(dp_runs) -> None:
    """2 FSDP2 ranks over gloo: steps 1-3 in one run == steps 1-2, a checkpoint, and step 3 in a new runner with
    new ranks, bit for bit. Needs the ranks' AdamW moments and LR schedule in the checkpoint (zero moments or
    the linear decay started afresh would give other weights)."""
    saved = dp_runs["saved"]
    state = saved.learner_state()
    assert saved.step == 2 and state["world_size"] == 2 and state["optimizer_steps"] == 2
    assert {"exp_avg", "exp_avg_sq"} <= set(next(iter(state["optimizer_by_name"]["state"].values())))

    assert dp_runs["resume_start"] == 2 and not dp_runs["resume_hooks"].events_of("warning")
    lr = dp_runs["lr"]
    assert dp_runs["resume_lr"] == lr[2] < lr[0]
    want = dp_runs["want"]
    moved = [k for k in want if not torch.equal(want[k], _weights_at(saved.path)[k])]
    assert moved  # step 3 changed the weights
    for k, v in dp_runs["resumed"].items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=0, msg=k)


def _weights_at(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_a_dead_rank_ends_the_wait_at_once_and_a_stopped_one_at_the_deadline(ray_local, tiny_llama_dir) -> None:
    """Two real ranks (gloo). Killing one mid-run raises at once, though its peer waits for it in a collective;
    a rank that is alive but stopped (SIGSTOP) raises LearnerRankStalled at the deadline instead of blocking
    for good while the job's heartbeat goes on."""
    import os
    import signal
    import time

    import ray

    from rl_service.training.distributed import DistributedLearner, LearnerRankStalled
    from rl_service.training.learner import LearnerConfig

    def learner() -> DistributedLearner:
        return DistributedLearner(str(tiny_llama_dir), LearnerConfig(learning_rate=1e-3), 2, num_cpus_per_rank=0.5,
                                  progress=lambda: beats.append(1), progress_every_s=0.2, rank_timeout_s=20.0)

    beats: list[int] = []
    samples = make_samples(6, seed=7)
    dead = learner()
    try:
        dead.step(samples)
        ray.kill(dead.ranks[1], no_restart=True)
        t0 = time.monotonic()
        with pytest.raises(ray.exceptions.RayActorError):
            dead.step(samples)
        assert time.monotonic() - t0 < 15.0
    finally:
        dead.shutdown()

    stopped = learner()
    pid = ray.get(stopped.ranks[1].__ray_call__.remote(lambda _: os.getpid()))
    try:
        os.kill(pid, signal.SIGSTOP)
        beats.clear()
        t0 = time.monotonic()
        with pytest.raises(LearnerRankStalled, match="within 20.0 s"):
            stopped.step(samples)
        assert time.monotonic() - t0 >= 20.0 and len(beats) > 10  # the heartbeat went on while it waited
    finally:
        os.kill(pid, signal.SIGKILL)
        stopped.shutdown()
