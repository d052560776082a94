"""Helpers of the learner/job tests: a tiny random causal LM and synthetic policy samples."""

from __future__ import annotations

import random

import torch


def make_tiny_llama(vocab: int = 48, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      attn_implementation="eager")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float()


def make_samples(n: int, vocab: int = 48, seed: int = 0, max_prompt: int = 6, max_completion: int = 10):
    """Random samples with random advantages; the last 2 completion tokens of odd samples are inserted."""
    from rl_service.training.learner import PolicySample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = rng.randint(1, max_prompt)
        c = rng.randint(2, max_completion)
        mask = [1] * c
        if i % 2 and c > 3:
            mask[-2:] = [0, 0]
        out.append(PolicySample(
            prompt_ids=[rng.randrange(vocab) for _ in range(p)],
            completion_ids=[rng.randrange(vocab) for _ in range(c)],
            loss_mask=mask,
            advantages=[rng.gauss(0, 1) for _ in range(c)],
            engine_logprobs=[-3.0 + rng.gauss(0, 0.1) for _ in range(c)],
        ))
    return out


# ---- job tests ---------------------------------------------------------------------------------------
from rollout_workers.environments.calculator import CalculatorEnv, CalculatorOptions  # noqa: E402


class GradedCalculator(CalculatorEnv):
    """The calculator with a dense, deterministic outcome so a random tiny model gets non-zero advantages:
    the fraction of sampled tokens with an even id. Only the job's scoring uses it (the rollout workers run
    the built-in calculator, which samples the same episodes)."""

    def outcome(self, trajectory) -> float:
        ids = [t for s in trajectory.steps for t in s.action_ids]
        return sum(1 for t in ids if t % 2 == 0) / len(ids) if ids else 0.0


class HangOnceCalculator(GradedCalculator):
    """GradedCalculator whose verifier gets stuck for good on a trajectory of training step `hang_step`, the
    first time only (the `hang_flag` file records it): a job driver that hangs in the middle of a step, alive
    but making no progress. Without `hang_flag` it never hangs."""

    class Options(CalculatorOptions):
        hang_flag: str | None = None
        hang_step: int = 1

    def outcome(self, trajectory) -> float:
        import time
        from pathlib import Path

        flag = self.options.get("hang_flag")
        if flag and trajectory.train_step == int(self.options.get("hang_step", 1)) and not Path(flag).exists():
            Path(flag).touch()
            while True:
                time.sleep(1)
        return super().outcome(trajectory)


class ReusedPool:
    """A real RolloutPool shared by several JobRunner runs of one test module (engine start-up dominates a
    short job). `factory` loads the job's initial weights into the running engines, as a fresh pool would."""

    def __init__(self, pool) -> None:
        self.pool = pool

    def factory(self, spec, weights_dir):
        from pathlib import Path

        from safetensors.torch import load_file

        state = {}
        for f in sorted(Path(weights_dir).glob("*.safetensors")):
            state.update(load_file(str(f)))
        self.pool.push_weights(state, 0)
        return self

    def generate(self, *a, **k):
        return self.pool.generate(*a, **k)

    def submit(self, *a, **k):
        return self.pool.submit(*a, **k)

    def push_weights(self, state_dict, version):
        return self.pool.push_weights(state_dict, version)

    def stats(self):
        return self.pool.stats()

    @property
    def progress_count(self):
        return self.pool.progress_count

    def shutdown(self) -> None:  # the module fixture shuts the real pool down
        pass


class RolloutsBeforePushPool(ReusedPool):
    """The shared pool, except that a weight push first waits for the rollouts submitted before it, so in
    async mode the next step's rollouts are all sampled by the old policy (as whenever the learner is
    slower than generation) however the machine's load shifts the timing."""

    def __init__(self, shared: ReusedPool) -> None:
        super().__init__(shared.pool)
        self.submitted: list = []

    def submit(self, *a, **k):
        future = self.pool.submit(*a, **k)
        self.submitted.append(future)
        return future

    def push_weights(self, state_dict, version):
        for future in self.submitted:
            future.result()
        return self.pool.push_weights(state_dict, version)


class EnvironmentDownPool(ReusedPool):
    """The shared pool, except that training rollouts of the steps in `down_steps` come back as environment
    errors (as when the environment's tool server is gone: the agent loop's `env_error`)."""

    def __init__(self, shared: ReusedPool, down_steps: set[int]) -> None:
        super().__init__(shared.pool)
        self.down_steps = down_steps

    def submit(self, tasks, n, sampling, train_step=None, job_id=None):
        import concurrent.futures

        from rollout_workers.trajectory import TrajectoryStatus

        future = self.pool.submit(tasks, n, sampling, train_step=train_step, job_id=job_id)
        if train_step not in self.down_steps:
            return future
        broken: concurrent.futures.Future = concurrent.futures.Future()

        def fail_all(done: concurrent.futures.Future) -> None:
            if done.exception() is not None:
                broken.set_exception(done.exception())
                return
            for group in done.result():
                for tj in group:
                    tj.status, tj.error = TrajectoryStatus.ENV_ERROR, "reset failed: the tool server is gone"
            broken.set_result(done.result())

        future.add_done_callback(fail_all)
        return broken


def fake_trajectory(task, group, version, status="ok", seed=0):
    import random

    from rollout_workers.trajectory import Step, Trajectory

    rng = random.Random(seed)
    ids = [rng.randrange(2, 200) for _ in range(6)]
    return Trajectory(env="calculator", task_id=task["id"], task=task, group_id=group, prompt_ids=[5, 6, 7, 8],
                      prompt_text="q", status=status,
                      steps=[Step(action_ids=ids, action_logprobs=[-4.0] * 6, action_text="x", weight_version=version,
                                  finish_reason="stop", is_final=True)])
