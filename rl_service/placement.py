"""Where a job's parts run: the bundles of its Ray placement group, in order (the scheduler reserves them, the
runner places its learner ranks and rollout workers in them)."""

from __future__ import annotations

from rl_service.spec import JobSpec

MAX_DRIVER_CPUS = 1.0  # a data-parallel job's driver only holds a copy of the weights for pushes and checkpoints


def driver_cpus(spec: JobSpec) -> float:
    return min(MAX_DRIVER_CPUS, spec.resources.learner_cpus)


def job_bundles(spec: JobSpec) -> list[dict[str, float]]:
    """One learner rank: bundle 0 is the learner, and the driver (which is that learner) runs in it.
    Several ranks: bundle 0 is the driver's own (CPU only), bundles 1..num_learners the ranks.
    Then one bundle per rollout worker. Each role's custom resources (`learner_custom`, `rollout_custom`)
    go into its bundles, so a cluster can dedicate nodes to learners and rollouts."""
    res = spec.resources

    def bundle(cpus: float, gpus: float) -> dict[str, float]:
        b = {"CPU": float(cpus)}
        if gpus:
            b["GPU"] = float(gpus)
        return b

    learners = [{**bundle(res.learner_cpus, res.learner_gpus), **res.learner_resources} for _ in range(res.num_learners)]
    rollouts = [{**bundle(res.rollout_cpus, res.rollout_gpus), **res.rollout_resources}
                for _ in range(spec.rollout.num_workers)]
    driver = [bundle(driver_cpus(spec), 0)] if res.num_learners > 1 else []
    return driver + learners + rollouts


def learner_bundle_indices(spec: JobSpec) -> list[int]:
    """The bundle of each learner rank in `job_bundles(spec)`."""
    first = 1 if spec.resources.num_learners > 1 else 0
    return list(range(first, first + spec.resources.num_learners))


def rollout_bundle_indices(spec: JobSpec) -> list[int]:
    """The bundle of each rollout worker in `job_bundles(spec)`."""
    first = learner_bundle_indices(spec)[-1] + 1
    return list(range(first, first + spec.rollout.num_workers))
