"""One RL job's runner: set up (tasks, model, learner), resume from the newest checkpoint, run the step loop
(the pipeline in rl_service.training.step: roll out groups, score with the schedule in force, compute
advantages, train, push weights), obey pause/cancel, checkpoint, evaluate, report.

`JobRunner(job_id, spec, hooks, work_dir).run()` returns "succeeded" | "cancelled" | "paused" (or raises:
the caller marks the job failed). It resumes from the newest checkpoint under `work_dir/checkpoints/`
(rl_service.training.resume) and beats the driver's heartbeat as it goes (rl_service.training.progress).
The functions after the class build what a job runs on: its environment, tasks, policy, sampling, learner
ranks and rollout pool.

Work directory:
  initial/              the starting weights + tokenizer (rollout engines and the KL reference load them)
  checkpoints/step_N/   see rl_service.training.checkpoint (weights, optimizer, RNG, state.json)
  trajectories/         one JSONL file per training step (rollout_workers.storage)

Weight versions: version v = the policy after v training steps. Step t (0-based) trains on rollouts of
version t (sync) or version >= t - max_staleness (async: step t+1 is generated while step t trains); a
trajectory older than that never reaches the loss.

Exact resume (sync mode, CPU, fp32): everything random is either checkpointed (optimizer, LR schedule, RNG
states, data cursor, schedule history, monitor) or derived from (job seed, step, task, sample index, turn):
the engines seed every sampling request that way, so a resumed run regenerates the same rollouts.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import ray
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from model import TaperConfig, TaperForCausalLM
from model.tokenizer import load_tokenizer
from reward_models.credit import CreditConfig
from rl_service.environment_settings import operator_environment_policy
from rl_service.hooks import JobHooks
from rl_service.placement import learner_bundle_indices, rollout_bundle_indices
from rl_service.spec import JobSpec, checkpoint_ref
from rl_service.task_files import load_tasks
from rl_service.training import gpu_memory
from rl_service.training import step as pipeline
from rl_service.training.checkpoint import (
    latest_checkpoint,
    load_weights,
    remove_stale_temporaries,
    save_checkpoint,
    save_weights,
)
from rl_service.training.distributed import DistributedLearner
from rl_service.training.learner import Learner, LearnerConfig
from rl_service.training.progress import Progress
from rl_service.training.resume import resume_from
from rl_service.training.tracking import TrackedHooks
from rl_service.training.warm_start import (
    WARM_START_SEED_OFFSET,
    environment_demonstrations,
    file_demonstrations,
    mean_assistant_tokens,
    run_warm_start,
)
from rollout_workers.engine import EngineConfig
from rollout_workers.environments.registry import (
    EnvironmentRegistration,
    environment_class,
    generate_tasks,
    make_env_factory,
)
from rollout_workers.pool import RolloutPool
from rollout_workers.sampling import SamplingConfig
from rollout_workers.trajectory import Trajectory
from rollout_workers.vllm_engine import VLLMEngine

log = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 1_000_003  # held-out tasks come from a seed stream disjoint from the training tasks'


class RolloutPoolLike(Protocol):
    def generate(self, tasks: list[dict[str, Any]], n: int, sampling: Any, train_step: int | None = None,
                 job_id: str | None = None) -> list[list[Trajectory]]: ...

    def submit(self, tasks: list[dict[str, Any]], n: int, sampling: Any, train_step: int | None = None,
               job_id: str | None = None) -> Any: ...

    def push_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> float: ...

    def stats(self) -> dict[str, float]: ...

    def shutdown(self) -> None: ...

    @property
    def progress_count(self) -> int:
        """Grows whenever the pool finishes a chunk of rollouts or replaces a worker."""


PoolFactory = Callable[[JobSpec, Path], RolloutPoolLike]  # (spec, weights dir) -> pool


class NothingTrained(RuntimeError):
    """The job ran every step and none trained (every rollout failed): it fails instead of succeeding."""


class _Stop(Exception):
    def __init__(self, result: str) -> None:
        self.result = result


class JobRunner:
    def __init__(self, job_id: str, spec: JobSpec, hooks: JobHooks, work_dir: Path | str, *,
                 pool_factory: PoolFactory | None = None, device: str | None = None) -> None:
        self.job_id = job_id
        self.spec = spec
        self.work_dir = Path(work_dir)
        self.hooks = TrackedHooks(hooks, job_id, spec, self.work_dir)
        self.pool_factory = pool_factory or default_pool_factory
        if device is None:
            device = "cuda" if spec.resources.learner_gpus > 0 and torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.checkpoint_dir = self.work_dir / "checkpoints"
        self.trajectory_dir = self.work_dir / "trajectories"
        self.initial_dir = self.work_dir / "initial"
        self.warm_start_metrics: dict[str, float] = {}
        self.pool: RolloutPoolLike | None = None
        self.pause_cause: str | None = None  # why the job paused itself, when it did
        self._infra_example: str | None = None  # an infrastructure failure's error, for the job's own error
        self._progress = Progress(hooks, lambda: self.pool.progress_count if self.pool is not None else 0)
        self._await = self._progress.wait
        self._phase = self._progress.phase

    def preload(self) -> None:
        """Import the code `run` needs before it starts (the job driver calls this before its first heartbeat:
        a cold import of transformers' model code alone can outlast a heartbeat timeout on a loaded machine).
        This module's own imports came with the class; what is left is the code the job's spec names."""
        environment_class(environment_of(self.spec), self.env_policy)  # a registered environment's own module

        if self.spec.model.checkpoint_dir:  # the checkpoint's own model class (a Llama, a Qwen, ...)
            path = Path(self.spec.model.checkpoint_dir)
            with contextlib.suppress(Exception):  # a bad checkpoint is reported by the real load in `run`
                AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(str(path)))]

    # ------------------------------------------------------------------ rollouts
    def _generate(self, tasks: list[dict[str, Any]], n: int, sampling: Any, train_step: int | None) -> list[list[Trajectory]]:
        assert self.pool is not None
        return self._await(self.pool.submit(tasks, n, sampling, train_step=train_step, job_id=self.job_id))

    # ------------------------------------------------------------------ setup
    @functools.cached_property
    def env_policy(self) -> Any:
        """The operator's limits for environments (HTTP allow-list, option maxima, data roots)."""
        return operator_environment_policy()

    # ------------------------------------------------------------------ the loop
    def run(self) -> str:
        try:
            return self._run()
        except _Stop as stop:
            return stop.result
        finally:
            if getattr(self, "dp", None) is not None:
                self.dp.shutdown()
                self.dp = None
            self.hooks.close()
            if self.pool is not None:
                try:
                    self.pool.shutdown()
                finally:
                    self.pool = None

    def _pause_itself(self, step: int, cause: str) -> None:
        """Stop as a pause does (the loop checkpointed `step`), with `cause` as the job's error."""
        self.pause_cause = cause
        self.hooks.emit_event("paused", {"step": step, "cause": cause})
        raise _Stop("paused")

    def _check_control(self, step: int, cursor: dict[str, int] | None = None) -> None:
        control = self.hooks.control()
        if control in ("pause", "cancel"):
            result = "paused" if control == "pause" else "cancelled"
            if control == "pause":
                self._checkpoint(step, cursor)
            self.hooks.emit_event(result, {"step": step})
            raise _Stop(result)

    def _supervised(self) -> str:
        """A supervised job: the warm start alone, its result the job's one checkpoint (step total_steps)."""
        spec = self.spec
        done = latest_checkpoint(self.checkpoint_dir)
        if done is not None:  # a restarted driver after the job's work was done: recorded again, not redone
            self.hooks.add_checkpoint(done.step, done.path.resolve().as_uri())
            return "succeeded"
        self.env = environment_of(spec)
        self._progress()
        self.model, self.tokenizer = build_policy(spec)
        self.model.to(self.device)
        self._warm_start()  # a pause asked meanwhile is moot: the job is done
        ck = save_checkpoint(self.checkpoint_dir, spec.total_steps, self.model, {"job_id": self.job_id},
                             tokenizer=self.tokenizer, keep_last=1)
        self.hooks.add_checkpoint(spec.total_steps, ck.path.resolve().as_uri())
        self.hooks.emit_event("completed", {"step": spec.total_steps, **self.warm_start_metrics})
        return "succeeded"

    def _run(self) -> str:
        if self.spec.method == "supervised":
            return self._supervised()
        start = self.setup()
        spec = self.spec
        if start >= spec.total_steps:
            return "succeeded"
        self._check_control(start)
        t0 = time.perf_counter()
        self._phase(spec.rollout_chunk_deadline_s)  # engines start: bounded like a worker's chunk
        # The engines always start from the initial weights, which stay for the job's life: a worker replaced
        # later starts from them too (a checkpoint folder may be pruned by then) and loads the pushed weights.
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="taper-pool-start") as starter:
            self.pool = self._await(starter.submit(self.pool_factory, spec, self.initial_dir))
        if start > 0:  # resumed: the engines get the checkpoint's policy, as the version it is
            pipeline.push_weights(self.pool, self.model, start, bf16=spec.resources.rollout_gpus > 0)
        self.hooks.emit_event("rollout_pool_ready", {"seconds": time.perf_counter() - t0, "weight_version": start})
        if start == 0 and self.eval_tasks:
            self._evaluate(0)
        return self._loop(start)

    def _check_gpu_memory(self) -> None:
        """Before the model goes to a GPU: the learner's state and the engines that share its device must fit."""
        if self.device.type != "cuda":
            return
        res = self.spec.resources
        # engines with a share below one device share the learner's (one GPU); whole GPUs are their own
        shared = res.rollout_gpus < 1 and res.learner_gpus < 1
        engines = engine_memory_share(res.rollout_gpus) * self.spec.rollout.num_workers if shared else 0.0
        free, total = torch.cuda.mem_get_info(self.device)
        need = gpu_memory.plan(sum(p.numel() for p in self.model.parameters()), engines, free, total)
        self.hooks.emit_event("gpu_memory", {"phase": "start", "learner_gib": need.learner_bytes / 2**30,
                                             "engines_gib": need.engines_bytes / 2**30, "free_gib": free / 2**30})
        if not need.fits:
            raise ValueError(need.describe())

    def setup(self) -> int:
        """Tasks, model, learner, and the state of the newest checkpoint if there is one.
        Returns the first step to run."""
        spec = self.spec
        self.env = environment_of(spec)
        self.train_tasks, self.eval_tasks = job_tasks(spec, self.env, self.env_policy)
        self.credit = CreditConfig.from_algorithm(spec.algorithm)

        self._progress()
        self.model, self.tokenizer = build_policy(self.spec)
        self._check_gpu_memory()
        self.model.to(self.device)
        self._progress()
        if not (self.initial_dir / "config.json").exists():
            if spec.warm_start is not None:
                self._warm_start()
            save_weights(self.model, self.initial_dir, self.tokenizer)
        else:  # a restarted driver: the job starts from its (warm-started) initial weights, as the engines do
            load_weights(self.model, self.initial_dir)
        ref = None
        if spec.algorithm.beta > 0:
            ref = AutoModelForCausalLM.from_pretrained(str(self.initial_dir), dtype=torch.float32).to(self.device)
        self.learner = Learner(self.model, LearnerConfig.from_spec(spec), ref_model=ref,
                               pad_token_id=self.tokenizer.pad_token_id or 0, device=self.device)
        self.learner.progress = self._progress

        removed = remove_stale_temporaries(self.checkpoint_dir)
        if removed:
            log.info("job %s: removed %d unfinished checkpoint writes", self.job_id, len(removed))
        ckpt = latest_checkpoint(self.checkpoint_dir)
        self.dp = None
        if spec.resources.num_learners > 1:
            # Data-parallel ranks (Ray actors) train; the driver keeps a full copy for pushes and checkpoints.
            # Checkpoints hold the ranks' optimizer state gathered whole, keyed by parameter name.
            self.dp = start_data_parallel(spec, self.learner.config, ckpt.path if ckpt else self.initial_dir,
                                          self.initial_dir, self.tokenizer.pad_token_id or 0, self._progress)
        start, self.run_state = resume_from(ckpt, spec, self.model, self.learner, self.dp, len(self.train_tasks),
                                            self.trajectory_dir, self.hooks)
        registration = spec.environment.registration or {}
        self.run_state.infra_guard.endpoint = registration.get("base_url")  # http and mcp: named in warnings
        return start

    def _warm_start(self) -> None:
        """Fine-tune the fresh model on the environment's demonstrations (spec.warm_start), reported as the
        job's `warm_start` phase: events while it runs, its summary in the first step's metrics."""
        spec = self.spec
        assert spec.warm_start is not None
        ws = spec.warm_start
        env = self._new_env()
        if ws.demonstrations_path is not None:  # an uploaded file, resolved by the control plane at submit time
            demonstrations = file_demonstrations(ws.demonstrations_path, env.tools())
        else:
            tasks = generate_tasks(self.env, ws.num_examples, spec.tasks.seed + WARM_START_SEED_OFFSET,
                                   spec.tasks.options, self.env_policy)
            demonstrations = environment_demonstrations(env, tasks)
        self.hooks.emit_event("warm_start_started", {"examples": len(demonstrations), "max_steps": ws.max_steps,
                                                     "mixed_phase": ws.mixed_phase is not None})
        supervised = spec.method == "supervised"

        def on_step(phase: str, step: int, loss: float) -> None:
            self._progress()
            if supervised:  # the job's own steps: its progress and metrics; a cancel stops it here
                self.hooks.emit_metrics(step - 1, {"loss": loss, "action_tokens": tokens_per_step})
                if self.hooks.control() == "cancel":
                    self.hooks.emit_event("cancelled", {"step": step})
                    raise _Stop("cancelled")
            if step % 25 == 0:
                self.hooks.emit_event("warm_start_progress", {"phase": phase, "sft_step": step, "loss": loss})

        # tokens the loss trains on per step, estimated from the demonstrations' mean (for trained_tokens)
        tokens_per_step = ws.batch_size * mean_assistant_tokens(self.tokenizer, demonstrations)
        self.model.train()
        result = run_warm_start(self.model, self.tokenizer, demonstrations, env.tools(), ws, spec.seed, on_step)
        self.warm_start_metrics = result.metrics()
        self.hooks.emit_event("warm_start_done", {"sft_steps": result.steps, "loss": result.final_loss,
                                                  "seconds": round(result.seconds, 1)})

    def _loop(self, start: int) -> str:
        spec = self.spec
        assert self.pool is not None
        rollouts = pipeline.Rollouts(
            self.pool, self._take_tasks, self.run_state.cursor.state, n=spec.rollout.num_generations,
            sampling=sampling_config(spec), job_id=self.job_id, wait=self._await,
            ahead=spec.rollout.async_mode and spec.rollout.max_staleness >= 1, total_steps=spec.total_steps)
        for t in range(start, spec.total_steps):
            self._check_control(t, rollouts.saved_cursor())
            step_start = time.perf_counter()
            self._pick_up_schedule(t)
            self._phase(spec.rollout_chunk_deadline_s)
            groups, times = rollouts.collect(t)
            trajs = [tj for g in groups for tj in g]
            self._phase(None)  # scoring: the environment's code, within the operator's allowance

            metrics = self._train_step(t, trajs, times)
            health = self.run_state.infra_guard.observe(t, groups, trained="learner_skipped" not in metrics)
            self._infra_example = next((tj.error for tj in trajs if tj.status.is_infra_failure and tj.error),
                                       self._infra_example)
            metrics.update(health.metrics())
            metrics["steps/untrained"] = float(self.run_state.infra_guard.untrained_steps)
            if health.warning:
                self.hooks.warn("infrastructure_failures", health.warning,
                                {"step": t, "infra_failure_rate": health.infra_failure_rate})
            pushed = pipeline.push_weights(self.pool, self.model, t + 1, bf16=spec.resources.rollout_gpus > 0)
            times["time/sync"] = pushed.pop("time/sync")
            metrics.update(pushed)
            self._progress()

            done = t + 1
            tc = time.perf_counter()
            if health.pause_cause:
                self.run_state.infra_guard.end_streak()  # the resumed job starts a fresh failure streak
            if done % spec.checkpoint_every == 0 or done == spec.total_steps or health.pause_cause:
                self._checkpoint(done, cursor=rollouts.saved_cursor())
            times["time/checkpoint"] = time.perf_counter() - tc
            te = time.perf_counter()
            if self.eval_tasks and ((spec.eval_every and done % spec.eval_every == 0) or done == spec.total_steps):
                self._evaluate(done)
            times["time/eval"] = time.perf_counter() - te
            times["time/step"] = time.perf_counter() - step_start
            metrics.update(times)
            metrics["learner_idle_fraction"] = times["time/idle"] / max(times["time/step"], 1e-9)
            self.hooks.emit_metrics(t, metrics)
            self._progress()
            if health.pause_cause:
                self._pause_itself(done, health.pause_cause)
        untrained = self.run_state.infra_guard.untrained_steps
        if untrained >= spec.total_steps:  # it ran every step and learned nothing: not a success
            raise NothingTrained(f"no step of the job trained: the rollouts of all {spec.total_steps} steps failed "
                                 f"for infrastructure reasons (e.g. {self._infra_example or 'unknown'}); "
                                 "check the environment and the task file")
        self.hooks.emit_event("completed", {"step": spec.total_steps, "untrained_steps": untrained})
        return "succeeded"

    # ------------------------------------------------------------------ pieces
    def _take_tasks(self) -> list[dict[str, Any]]:
        return [self.train_tasks[i] for i in self.run_state.cursor.take(self.spec.rollout.prompts_per_step)]

    def _pick_up_schedule(self, t: int) -> None:
        """A control-plane schedule version newer than the one in force applies from this step on."""
        version, schedule = self.hooks.current_schedule()
        if self.run_state.apply_schedule(t, version, schedule):
            self.hooks.emit_event("schedule_applied", {"version": version, "step": t, "schedule": schedule.model_dump()})

    def _train_step(self, t: int, trajs: list[Trajectory], times: dict[str, float]) -> dict[str, float]:
        """Score, assign credit, record and learn from step `t`'s rollouts (the pipeline in `step`)."""
        spec = self.spec
        metrics: dict[str, float] = {"step": float(t), **self.warm_start_metrics}
        self.warm_start_metrics = {}  # reported once, with the first step trained after it
        tw = time.perf_counter()
        pipeline.score(trajs, self._new_env())
        self._progress()
        batch, credit_metrics = pipeline.assign_credit(t, trajs, self.run_state.history, self.credit,
                                                       spec.rollout.max_staleness, self.run_state.version_map)
        times["time/reward"] = time.perf_counter() - tw
        pipeline.save_trajectories(self.trajectory_dir, t, trajs)
        metrics.update(credit_metrics)
        metrics.update(pipeline.rollout_metrics(trajs, times.get("time/rollout", 0.0), spec.rollout.async_mode))
        event = self.run_state.monitor.update(t, batch.stats.get("process_weighted_mean", 0.0), metrics["success_rate"])
        if event is not None:
            self.hooks.warn(event["kind"], event["message"], event)

        # infrastructure failures were dropped by assign_credit
        samples, advantage_stats = pipeline.policy_samples(batch)
        metrics.update(advantage_stats)
        tl = time.perf_counter()
        self._phase(spec.learner_rank_deadline_s)
        metrics.update(pipeline.learn(samples, self.learner, self.model, self.dp))
        self._phase(None)
        times["time/learn"] = time.perf_counter() - tl
        return metrics

    def _new_env(self) -> Any:
        return scoring_env(self.spec, self.env, self.env_policy)

    def _checkpoint(self, step: int, cursor: dict[str, int] | None = None) -> None:
        state = {**self.run_state.to_checkpoint(cursor), "job_id": self.job_id}
        learner_state = self.dp.state_dict() if getattr(self, "dp", None) is not None else self.learner.state_dict()
        ck = save_checkpoint(self.checkpoint_dir, step, self.model, state, learner_state=learner_state,
                             tokenizer=self.tokenizer, keep_last=self.spec.keep_last_checkpoints)
        self.hooks.add_checkpoint(step, ck.path.resolve().as_uri())
        self.hooks.emit_event("checkpoint", {"step": step, "checkpoint": checkpoint_ref(self.job_id, step)})

    def _evaluate(self, at_step: int) -> None:
        """Greedy rollouts on the held-out tasks; outcome success rate."""
        t0 = time.perf_counter()
        self._phase(self.spec.rollout_chunk_deadline_s)
        groups = self._generate(self.eval_tasks, 1, sampling_config(self.spec, greedy=True), None)
        self._phase(None)
        result = pipeline.evaluate(groups, self._new_env(), self.credit.success_threshold)
        result["eval/time_s"] = time.perf_counter() - t0
        self.hooks.emit_metrics(at_step, result)
        self.hooks.emit_event("eval", {"step": at_step, **result})


def environment_of(spec: JobSpec) -> Any:
    """A built-in name or the registration the control plane resolved at submit time."""
    reg = spec.environment.registration
    return spec.environment.name if reg is None else EnvironmentRegistration.model_validate(reg)


def job_tasks(spec: JobSpec, env: Any, policy: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The training tasks and the held-out ones (from a seed stream disjoint from the training tasks')."""
    t = spec.tasks
    if t.train_path:  # uploaded task files, resolved by the control plane at submit time
        train = load_tasks(t.train_path)
    else:
        train = generate_tasks(env, t.num_train, t.seed, t.options, policy)
    if t.eval_path:
        held_out = load_tasks(t.eval_path)
    elif t.num_eval and not t.train_path:
        held_out = generate_tasks(env, t.num_eval, t.seed + EVAL_SEED_OFFSET, t.options, policy)
    else:
        held_out = []
    return train, held_out


def scoring_env(spec: JobSpec, env: Any, policy: Any) -> Any:
    """A fresh environment instance for scoring (with the job's options and the operator's limits), judged by
    the registration's declared grader and process components, or the job's own where it declares them."""
    declared = spec.environment
    instance = make_env_factory(env, declared.options, policy)()
    if declared.grader is not None:
        instance.grader_spec = declared.grader
    if declared.process_rewards is not None:
        instance.process_specs = tuple(declared.process_rewards)
    return instance


def build_policy(spec: JobSpec) -> tuple[torch.nn.Module, Any]:
    """The policy model (fp32) and its tokenizer: from the job's checkpoint directory, else a fresh preset."""
    ms = spec.model
    torch.manual_seed(spec.seed)
    if ms.checkpoint_dir:  # resolved by the control plane from `model.checkpoint`
        path = Path(ms.checkpoint_dir)
        if not path.is_dir():
            raise ValueError(f"model.checkpoint: {ms.checkpoint or ms.checkpoint_dir!r} is no longer a checkpoint "
                             "directory")
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(path)) if (path / "tokenizer.json").exists() else load_tokenizer()
    else:
        tokenizer = load_tokenizer()
        config = TaperConfig.preset(ms.preset, **ms.overrides.model_dump(exclude_none=True))
        model = TaperForCausalLM(config)
    return model.float(), tokenizer


def sampling_config(spec: JobSpec, greedy: bool = False) -> SamplingConfig:
    r = spec.rollout
    return SamplingConfig(
        temperature=0.0 if greedy else r.temperature, top_p=1.0 if greedy else r.top_p, max_turns=r.max_turns,
        max_tokens_per_turn=min(r.max_tokens_per_turn, r.max_total_tokens), max_total_tokens=r.max_total_tokens,
        tool_timeout_s=r.tool_timeout_s, seed=spec.seed,
    )


def start_data_parallel(spec: JobSpec, config: LearnerConfig, model_dir: Path, initial_dir: Path, pad_token_id: int,
                        progress: Callable[[], None]) -> DistributedLearner:
    """The learner ranks, each in its own bundle of the job's placement group when the driver runs in one
    (under the scheduler), else wherever Ray has room. They start from `model_dir`; `initial_dir` is the KL
    reference."""
    res = spec.resources
    pg = ray.util.get_current_placement_group()
    return DistributedLearner(str(model_dir), config, res.num_learners,
                              use_gpu=res.learner_gpus > 0, num_cpus_per_rank=res.learner_cpus,
                              ref_model_dir=str(initial_dir), pad_token_id=pad_token_id,
                              actor_options={"resources": res.learner_resources}, placement_group=pg,
                              bundle_indices=learner_bundle_indices(spec) if pg is not None else None,
                              progress=progress, rank_timeout_s=spec.learner_rank_deadline_s)


WHOLE_DEVICE_MEMORY_SHARE = 0.9  # an engine alone on its GPU: vLLM's default


def engine_memory_share(rollout_gpus: float) -> float:
    """vLLM's gpu_memory_utilization for a rollout engine given its Ray GPU share: a worker with a share below
    one device shares that device (with the learner, or other workers) and holds that share of its memory."""
    return rollout_gpus if 0 < rollout_gpus < 1 else WHOLE_DEVICE_MEMORY_SHARE


def seeded_vllm_engine(config: Any) -> Any:
    """EngineFactory for the rollout workers (runs inside the worker process)."""
    return VLLMEngine(config)


def default_pool_factory(spec: JobSpec, weights_dir: Path) -> RolloutPoolLike:
    """The real rollout pool: Ray actors, each with a vLLM engine loading `weights_dir`."""
    reg: Any = spec.environment.name
    if spec.environment.registration is not None:
        reg = EnvironmentRegistration.model_validate(spec.environment.registration)
    max_len = max(spec.rollout.max_total_tokens + 16, 64)
    # Seeded sampling needs whole-prompt prefills: vLLM rewinds a request's generator after a partial
    # (chunked) prefill, which CPU generators cannot do ("CPU Generator does not use offset").
    res = spec.resources
    engine = EngineConfig(model_dir=str(weights_dir), tokenizer_dir=str(weights_dir), max_model_len=max_len,
                          kv_cache_gib=spec.rollout.kv_cache_gib, seed=spec.seed,
                          gpu_memory_utilization=engine_memory_share(res.rollout_gpus),
                          engine_kwargs={"max_num_batched_tokens": max(16 * max_len, 8192)})
    # under the scheduler, each worker in its own bundle of the job's placement group (not a learner's)
    pg = ray.util.get_current_placement_group()
    return RolloutPool(functools.partial(seeded_vllm_engine, engine), reg, spec.rollout.num_workers, env_options=spec.environment.options,
                       env_policy=operator_environment_policy(),
                       num_cpus_per_worker=res.rollout_cpus, num_gpus_per_worker=res.rollout_gpus,
                       resources=res.rollout_resources or None, chunk_timeout_s=spec.rollout_chunk_deadline_s,
                       placement_group=pg,
                       bundle_indices=rollout_bundle_indices(spec) if pg is not None else None)
