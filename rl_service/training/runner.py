"""One RL job's loop: sample tasks, roll out groups, score with the schedule in force, compute advantages,
train, push weights, checkpoint, evaluate, report.

`JobRunner(job_id, spec, hooks, work_dir).run()` returns "succeeded" | "cancelled" | "paused" (or raises:
the caller marks the job failed). It resumes from the newest checkpoint under `work_dir/checkpoints/`.

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

import contextlib
import functools
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from reward_models.schedule import RewardSchedule, ScheduleHistory
from rl_service.environment_settings import operator_environment_policy
from rl_service.hooks import Control, JobHooks
from rl_service.spec import JobSpec
from rl_service.training.checkpoint import (
    latest_checkpoint,
    load_weights,
    remove_stale_temporaries,
    restore_rng_state,
    save_checkpoint,
    save_weights,
)
from rl_service.training.infra_guard import InfraFailureGuard
from rl_service.training.learner import Learner, LearnerConfig, PolicySample
from rl_service.training.learner.weight_push import shippable_state_dict
from rl_service.training.tracking import TrackedHooks, tool_metrics
from rl_service.training.warm_start import WARM_START_SEED_OFFSET, run_warm_start
from rollout_workers.trajectory import Trajectory

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


PoolFactory = Callable[[JobSpec, Path], RolloutPoolLike]  # (spec, weights dir) -> pool


class InMemoryHooks:
    """JobHooks kept in memory (tests, `job_main`): records everything; `set_control` / `set_schedule`
    steer the job like the control plane would."""

    def __init__(self, schedule: RewardSchedule | None = None, on_metrics: Callable[[int, dict], None] | None = None):
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.metrics: list[tuple[int, dict[str, float]]] = []
        self.checkpoints: list[tuple[int, str]] = []
        self._control: Control = "run"
        self._schedule: tuple[int, RewardSchedule] = (1, schedule or RewardSchedule())
        self._lock = threading.Lock()
        self.on_metrics = on_metrics
        self.heartbeats = 0
        self.warning: str | None = None

    def heartbeat(self) -> None:
        with self._lock:
            self.heartbeats += 1

    def emit_event(self, kind: str, data: dict[str, Any]) -> None:
        with self._lock:
            self.events.append((kind, dict(data)))

    def warn(self, kind: str, message: str, data: dict[str, Any]) -> None:
        self.emit_event(kind, {**data, "message": message})
        with self._lock:
            self.warning = message

    def emit_metrics(self, step: int, metrics: dict[str, float]) -> None:
        with self._lock:
            self.metrics.append((step, dict(metrics)))
        if self.on_metrics is not None:
            self.on_metrics(step, metrics)

    def current_schedule(self) -> tuple[int, RewardSchedule]:
        with self._lock:
            return self._schedule

    def control(self) -> Control:
        with self._lock:
            return self._control

    def add_checkpoint(self, step: int, uri: str) -> None:
        with self._lock:
            self.checkpoints.append((step, uri))

    # ---- steering ----
    def set_control(self, control: Control) -> None:
        with self._lock:
            self._control = control

    def set_schedule(self, schedule: RewardSchedule) -> int:
        with self._lock:
            version = self._schedule[0] + 1
            self._schedule = (version, schedule)
            return version

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        return [d for k, d in self.events if k == kind]


class DataCursor:
    """Walks the training tasks epoch by epoch, each epoch a seeded permutation."""

    def __init__(self, num_tasks: int, seed: int, epoch: int = 0, position: int = 0) -> None:
        if num_tasks < 1:
            raise ValueError("tasks.num_train must be >= 1")
        self.num_tasks, self.seed, self.epoch, self.position = num_tasks, seed, epoch, position
        self._order = self._permutation(epoch)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.num_tasks))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def take(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            if self.position >= self.num_tasks:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            out.append(self._order[self.position])
            self.position += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    @classmethod
    def from_state(cls, num_tasks: int, seed: int, state: dict[str, int]) -> DataCursor:
        return cls(num_tasks, seed, int(state["epoch"]), int(state["position"]))


def staleness_of(traj: Trajectory, policy_version: int) -> int:
    versions = traj.weight_versions()
    return policy_version - min(versions) if versions else 0


def _token_stats(name: str, values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values, dtype=np.float64)
    return {f"{name}/mean": float(a.mean()), f"{name}/std": float(a.std()), f"{name}/min": float(a.min()),
            f"{name}/max": float(a.max())}


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
        self._heartbeat: Callable[[], None] | None = getattr(hooks, "heartbeat", None)

    def preload(self) -> None:
        """Import the code `run` needs before it starts (the job driver calls this before its first heartbeat:
        a cold import of transformers' model code alone can outlast a heartbeat timeout on a loaded machine)."""
        import model  # noqa: F401  (registers the architecture)
        import reward_models.credit  # noqa: F401
        import reward_models.monitor  # noqa: F401
        import reward_models.scoring  # noqa: F401
        import rollout_workers.storage  # noqa: F401
        from rollout_workers.environments.registry import environment_class

        environment_class(self._environment(), self.env_policy)  # a registered environment's own module

        if self.spec.model.checkpoint_dir:  # the checkpoint's own model class (a Llama, a Qwen, ...)
            from transformers import AutoConfig, AutoModelForCausalLM

            path = Path(self.spec.model.checkpoint_dir)
            with contextlib.suppress(Exception):  # a bad checkpoint is reported by the real load in `run`
                AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(str(path)))]
        if self.spec.resources.num_learners > 1:
            import rl_service.training.distributed  # noqa: F401

    # ------------------------------------------------------------------ progress
    def _progress(self) -> None:
        """Tell the control plane the job is making progress (its driver's heartbeat; hooks rate-limit it).
        Called between phases, per learner micro-batch, and while waiting on rollouts or the learner ranks,
        so only a runner stuck in one call (a hung tool scorer, a deadlock) stops the beat."""
        if self._heartbeat is not None:
            self._heartbeat()

    def _await(self, future: Any, every_s: float = 1.0) -> Any:
        """`future.result()`, beating while it waits."""
        import concurrent.futures

        while True:
            try:
                return future.result(timeout=every_s)
            except concurrent.futures.TimeoutError:
                self._progress()

    def _generate(self, tasks: list[dict[str, Any]], n: int, sampling: Any, train_step: int | None) -> list[list[Trajectory]]:
        assert self.pool is not None
        return self._await(self.pool.submit(tasks, n, sampling, train_step=train_step, job_id=self.job_id))

    # ------------------------------------------------------------------ setup
    @functools.cached_property
    def env_policy(self) -> Any:
        """The operator's limits for environments (HTTP allow-list, option maxima, data roots)."""
        return operator_environment_policy()

    def _environment(self) -> Any:
        """A built-in name or the registration the control plane resolved at submit time."""
        reg = self.spec.environment.registration
        if reg is None:
            return self.spec.environment.name
        from rollout_workers.environments.registry import EnvironmentRegistration

        return EnvironmentRegistration.model_validate(reg)

    def _warm_start(self) -> None:
        """Fine-tune the fresh model on the environment's demonstrations (spec.warm_start), reported as the
        job's `warm_start` phase: events while it runs, its summary in the first step's metrics."""
        from rollout_workers.environments.registry import generate_tasks, make_env_factory

        spec = self.spec
        assert spec.warm_start is not None
        ws = spec.warm_start
        tasks = generate_tasks(self.env, ws.num_examples, spec.tasks.seed + WARM_START_SEED_OFFSET,
                               spec.tasks.options, self.env_policy)
        env = make_env_factory(self.env, spec.environment.options, self.env_policy)()
        self.hooks.emit_event("warm_start_started", {"examples": len(tasks), "max_steps": ws.max_steps,
                                                     "mixed_phase": ws.mixed_phase is not None})

        def on_step(phase: str, step: int, loss: float) -> None:
            self._progress()
            if step % 25 == 0:
                self.hooks.emit_event("warm_start_progress", {"phase": phase, "sft_step": step, "loss": loss})

        self.model.train()
        result = run_warm_start(self.model, self.tokenizer, env, tasks, ws, spec.seed, on_step)
        self.warm_start_metrics = result.metrics()
        self.hooks.emit_event("warm_start_done", {"sft_steps": result.steps, "loss": result.final_loss,
                                                  "seconds": round(result.seconds, 1)})

    def _build_model(self) -> tuple[torch.nn.Module, Any]:
        import model as _taper  # noqa: F401  (registers the architecture)
        from model import TaperConfig, TaperForCausalLM
        from model.tokenizer import load_tokenizer

        ms = self.spec.model
        torch.manual_seed(self.spec.seed)
        if ms.checkpoint_dir:  # resolved by the control plane from `model.checkpoint`
            from transformers import AutoModelForCausalLM, AutoTokenizer

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

    def _sampling(self, greedy: bool = False) -> Any:
        from rollout_workers.sampling import SamplingConfig

        r = self.spec.rollout
        return SamplingConfig(
            temperature=0.0 if greedy else r.temperature, top_p=1.0 if greedy else r.top_p, max_turns=r.max_turns,
            max_tokens_per_turn=min(r.max_tokens_per_turn, r.max_total_tokens), max_total_tokens=r.max_total_tokens,
            tool_timeout_s=r.tool_timeout_s, seed=self.spec.seed,
        )

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

    def _run(self) -> str:
        start, engine_dir = self.setup()
        spec = self.spec
        if start >= spec.total_steps:
            return "succeeded"
        self._check_control(start)
        t0 = time.perf_counter()
        self._progress()
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="taper-pool-start") as starter:
            self.pool = self._await(starter.submit(self.pool_factory, spec, engine_dir))
        self.hooks.emit_event("rollout_pool_ready", {"seconds": time.perf_counter() - t0, "weights": str(engine_dir)})
        if start == 0 and self.eval_tasks:
            self._evaluate(0)
        return self._loop(start)

    def setup(self) -> tuple[int, Path]:
        """Tasks, model, learner, and the state of the newest checkpoint if there is one.
        Returns (first step to run, directory the rollout engines load)."""
        from reward_models.credit import CreditConfig
        from reward_models.monitor import HackingMonitor
        from rollout_workers.environments.registry import generate_tasks

        spec = self.spec
        self.env = self._environment()
        self.train_tasks = generate_tasks(self.env, spec.tasks.num_train, spec.tasks.seed, spec.tasks.options,
                                          self.env_policy)
        self.eval_tasks = (generate_tasks(self.env, spec.tasks.num_eval, spec.tasks.seed + EVAL_SEED_OFFSET,
                                          spec.tasks.options, self.env_policy) if spec.tasks.num_eval else [])
        self.credit = CreditConfig.from_algorithm(spec.algorithm)

        self._progress()
        self.model, self.tokenizer = self._build_model()
        self.model.to(self.device)
        self._progress()
        if not (self.initial_dir / "config.json").exists():  # a resumed job has its (warm-started) initial weights
            if spec.warm_start is not None:
                self._warm_start()
            save_weights(self.model, self.initial_dir, self.tokenizer)
        ref = None
        if spec.algorithm.beta > 0:
            from transformers import AutoModelForCausalLM

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
            self.dp = self._start_data_parallel(ckpt.path if ckpt else self.initial_dir)
        start = 0
        if ckpt is not None:
            state = ckpt.state
            load_weights(self.model, ckpt.path)
            learner_state = ckpt.learner_state()
            if self.dp is None:
                self.learner.load_state_dict(learner_state)
            elif learner_state is not None and "optimizer_by_name" in learner_state:
                self.dp.load_state_dict(learner_state)
            else:  # written by a single learner: its optimizer state does not map onto the ranks
                self.hooks.emit_event("warning", {"message": "the checkpoint has no data-parallel optimizer "
                                                  "state; AdamW restarts from zero moments", "step": ckpt.step})
            start = int(state["step"])
            self.cursor = DataCursor.from_state(len(self.train_tasks), spec.tasks.seed, state["cursor"])
            self.history = ScheduleHistory.from_json(state["schedule_history"])
            self.hooks_schedule_version = int(state["hooks_schedule_version"])
            self.version_map = {int(k): int(v) for k, v in state["version_map"].items()}
            self.monitor = HackingMonitor.from_state_dict(state["monitor"])
            self.infra_guard = InfraFailureGuard.from_state_dict(spec.infra_failures, state.get("infra_guard"))
            rng = ckpt.rng_state()
            if rng is not None:
                restore_rng_state(rng)
            self._drop_trajectories_after(start)
            engine_dir = ckpt.path
            self.hooks.emit_event("resumed", {"step": start, "checkpoint": str(ckpt.path)})
        else:
            self.cursor = DataCursor(len(self.train_tasks), spec.tasks.seed)
            version, schedule = self.hooks.current_schedule()
            self.history = ScheduleHistory.start(schedule)
            self.hooks_schedule_version = version
            self.version_map = {1: version}
            self.monitor = HackingMonitor(spec.hacking_monitor)
            self.infra_guard = InfraFailureGuard(spec.infra_failures)
            engine_dir = self.initial_dir
            self.hooks.emit_event("started", {"step": 0, "total_steps": spec.total_steps})
        return start, engine_dir

    def _start_data_parallel(self, model_dir: Path) -> Any:
        """The learner ranks, each in its own bundle of the job's placement group when the driver runs in one
        (under the scheduler), else wherever Ray has room."""
        import ray

        from rl_service.placement import learner_bundle_indices
        from rl_service.training.distributed import DistributedLearner

        res = self.spec.resources
        pg = ray.util.get_current_placement_group()
        return DistributedLearner(str(model_dir), self.learner.config, res.num_learners,
                                  use_gpu=res.learner_gpus > 0, num_cpus_per_rank=res.learner_cpus,
                                  ref_model_dir=str(self.initial_dir), pad_token_id=self.tokenizer.pad_token_id or 0,
                                  actor_options={"resources": res.learner_resources}, placement_group=pg,
                                  bundle_indices=learner_bundle_indices(self.spec) if pg is not None else None,
                                  progress=self._progress, rank_timeout_s=self.spec.learner_rank_deadline_s)

    def _loop(self, start: int) -> str:
        spec = self.spec
        assert self.pool is not None
        pending: Any = None  # async mode: the rollouts of the next step, already running
        pending_cursor: dict[str, int] | None = None
        async_depth = spec.rollout.async_mode and spec.rollout.max_staleness >= 1
        for t in range(start, spec.total_steps):
            # tasks already drawn for a pending rollout are drawn again after a resume
            self._check_control(t, pending_cursor if pending is not None else None)
            step_start = time.perf_counter()
            times: dict[str, float] = {}
            self._pick_up_schedule(t)

            # ---- rollouts
            tr = time.perf_counter()
            if async_depth:
                if pending is None:
                    pending = self.pool.submit(self._take_tasks(), spec.rollout.num_generations, self._sampling(),
                                               train_step=t, job_id=self.job_id)
                groups = self._await(pending)
                times["time/idle"] = time.perf_counter() - tr
                pending = None
                if t + 1 < spec.total_steps:
                    pending_cursor = self.cursor.state()
                    pending = self.pool.submit(self._take_tasks(), spec.rollout.num_generations, self._sampling(),
                                               train_step=t + 1, job_id=self.job_id)
                times["time/rollout"] = times["time/idle"]
            else:
                groups = self._generate(self._take_tasks(), spec.rollout.num_generations, self._sampling(), t)
                times["time/rollout"] = time.perf_counter() - tr
                times["time/idle"] = 0.0
            trajs = [tj for g in groups for tj in g]
            self._progress()

            metrics = self._train_step(t, trajs, times)
            health = self.infra_guard.observe(t, groups, trained="learner_skipped" not in metrics)
            metrics.update(health.metrics())
            metrics["steps/untrained"] = float(self.infra_guard.untrained_steps)
            if health.warning:
                self.hooks.warn("infrastructure_failures", health.warning,
                                {"step": t, "infra_failure_rate": health.infra_failure_rate})
            self._progress()
            # ---- weights to the engines
            ts = time.perf_counter()
            state = shippable_state_dict(self.model, torch.bfloat16 if spec.resources.rollout_gpus > 0 else None)
            push_s = self.pool.push_weights(state, t + 1)
            times["time/sync"] = time.perf_counter() - ts
            metrics["weight_sync_s"] = push_s
            self._progress()

            done = t + 1
            tc = time.perf_counter()
            if health.pause_cause:
                self.infra_guard.end_streak()  # the resumed job starts a fresh failure streak
            if done % spec.checkpoint_every == 0 or done == spec.total_steps or health.pause_cause:
                self._checkpoint(done, cursor=self.cursor.state() if pending is None else pending_cursor)
            times["time/checkpoint"] = time.perf_counter() - tc
            te = time.perf_counter()
            if self.eval_tasks and ((spec.eval_every and done % spec.eval_every == 0) or done == spec.total_steps):
                self._evaluate(done)
            times["time/eval"] = time.perf_counter() - te
            times["time/step"] = time.perf_counter() - step_start
            metrics.update(times)
            metrics["learner_idle_fraction"] = times["time/idle"] / max(times["time/step"], 1e-9)
            self.hooks.emit_metrics(done, metrics)
            self._progress()
            if health.pause_cause:
                self._pause_itself(done, health.pause_cause)
        self.hooks.emit_event("completed", {"step": spec.total_steps,
                                            "untrained_steps": self.infra_guard.untrained_steps})
        return "succeeded"

    # ------------------------------------------------------------------ pieces
    def _take_tasks(self) -> list[dict[str, Any]]:
        return [self.train_tasks[i] for i in self.cursor.take(self.spec.rollout.prompts_per_step)]

    def _pick_up_schedule(self, t: int) -> None:
        """A control-plane schedule version newer than the one in force applies from this step on."""
        version, schedule = self.hooks.current_schedule()
        if version == self.hooks_schedule_version:
            return
        if t == 0:
            self.history = ScheduleHistory.start(schedule)
            self.version_map = {1: version}
        else:
            new = self.history.replace(schedule, at_step=t - 1)
            self.version_map[new.version] = version
        self.hooks_schedule_version = version
        self.hooks.emit_event("schedule_applied", {"version": version, "step": t, "schedule": schedule.model_dump()})

    def _train_step(self, t: int, trajs: list[Trajectory], times: dict[str, float]) -> dict[str, float]:
        from reward_models.credit import compute_advantages
        from reward_models.scoring import score_trajectories
        from rollout_workers.environments.registry import make_env_factory
        from rollout_workers.storage import TrajectoryWriter, step_file

        spec = self.spec
        metrics: dict[str, float] = {"step": float(t + 1), **self.warm_start_metrics}
        self.warm_start_metrics = {}  # reported once, with the first step trained after it
        # ---- rewards with the schedule in force at this step
        tw = time.perf_counter()
        score_trajectories(trajs, make_env_factory(self.env, spec.environment.options, self.env_policy)())
        self._progress()
        hist_version, schedule = self.history.at(t)
        w = schedule.weight(t)
        # staleness: never train on a trajectory older than the bound
        stale = [tj for tj in trajs if staleness_of(tj, t) > spec.rollout.max_staleness]
        fresh = [tj for tj in trajs if staleness_of(tj, t) <= spec.rollout.max_staleness]
        batch = compute_advantages(fresh, w, self.credit, keep_node=functools.partial(self.history.keep_node, t))
        times["time/reward"] = time.perf_counter() - tw
        with TrajectoryWriter(step_file(self.trajectory_dir, t)) as writer:
            writer.write(trajs)
        staleness = [staleness_of(tj, t) for tj in trajs]
        metrics.update({
            "schedule/version": float(self.version_map.get(hist_version, hist_version)),
            "schedule/weight": w,
            "schedule/density": schedule.density(t),
            "staleness/mean": float(np.mean(staleness)) if staleness else 0.0,
            "staleness/max": float(max(staleness, default=0)),
            "staleness/dropped": float(len(stale)),
            "trajectories/num": float(len(trajs)),
            "trajectories/excluded": float(len(batch.excluded_ids)),
            "trajectories/truncated": float(sum(tj.status == "truncated" for tj in trajs)),
            "trajectories/mean_completion_tokens": float(np.mean([len(tj.completion_ids()) for tj in trajs]))
            if trajs else 0.0,
        })
        sampled = sum(len(s.action_ids) for tj in trajs for s in tj.steps)
        metrics["rollout/sampled_tokens"] = float(sampled)
        if times.get("time/rollout", 0.0) > 0 and not self.spec.rollout.async_mode:
            metrics["rollout/tokens_per_s"] = sampled / times["time/rollout"]
        metrics.update(tool_metrics(trajs))
        for key, value in batch.stats.items():
            metrics[f"reward/{key}"] = value
        metrics["success_rate"] = batch.stats.get("success_rate", 0.0)
        event = self.monitor.update(t, batch.stats.get("process_weighted_mean", 0.0), metrics["success_rate"])
        if event is not None:
            self.hooks.warn(event["kind"], event["message"], event)

        # ---- learn (infrastructure failures were dropped by compute_advantages)
        samples = [PolicySample.from_trajectory(tj, adv) for tj, adv in zip(batch.trajectories, batch.advantages,
                                                                             strict=True)]
        samples = [s for s in samples if s.num_action_tokens > 0]
        action_adv = [a for s in samples for a, m in zip(s.advantages, s.loss_mask, strict=True) if m]
        metrics.update(_token_stats("advantages", action_adv))
        tl = time.perf_counter()
        if samples and self.dp is not None:
            metrics.update(self.dp.step(samples))
            self.model.load_state_dict(self.dp.full_state_dict())
        elif samples:
            metrics.update(self.learner.step(samples))
        else:
            metrics["learner_skipped"] = 1.0
        times["time/learn"] = time.perf_counter() - tl
        return metrics

    def _drop_trajectories_after(self, step: int) -> None:
        """A crashed run may have written rollouts of steps after its last checkpoint; the resumed run
        regenerates them."""
        from rollout_workers.storage import step_file

        if not self.trajectory_dir.is_dir():
            return
        for t in range(step, self.spec.total_steps + 1):
            f = step_file(self.trajectory_dir, t)
            if f.exists():
                f.unlink()

    def _checkpoint(self, step: int, cursor: dict[str, int] | None = None) -> None:
        state = {
            "cursor": cursor if cursor is not None else self.cursor.state(),
            "schedule_history": self.history.to_json(),
            "hooks_schedule_version": self.hooks_schedule_version,
            "version_map": {str(k): v for k, v in self.version_map.items()},
            "monitor": self.monitor.state_dict(),
            "infra_guard": self.infra_guard.state_dict(),
            "job_id": self.job_id,
        }
        learner_state = self.dp.state_dict() if getattr(self, "dp", None) is not None else self.learner.state_dict()
        ck = save_checkpoint(self.checkpoint_dir, step, self.model, state, learner_state=learner_state,
                             tokenizer=self.tokenizer, keep_last=self.spec.keep_last_checkpoints)
        self.hooks.add_checkpoint(step, ck.path.resolve().as_uri())
        self.hooks.emit_event("checkpoint", {"step": step, "path": str(ck.path)})

    def _evaluate(self, step: int) -> None:
        """Greedy rollouts on the held-out tasks; outcome success rate."""
        from reward_models.scoring import score_outcome
        from rollout_workers.environments.registry import make_env_factory

        t0 = time.perf_counter()
        groups = self._generate(self.eval_tasks, 1, self._sampling(greedy=True), None)
        env = make_env_factory(self.env, self.spec.environment.options, self.env_policy)()
        outcomes = []
        for g in groups:
            for tj in g:
                score_outcome(tj, env)
                if not tj.excluded:
                    outcomes.append(float(tj.outcome_reward))
        success = float(np.mean([o >= self.credit.success_threshold for o in outcomes])) if outcomes else 0.0
        result = {"eval/success_rate": success, "eval/outcome_mean": float(np.mean(outcomes)) if outcomes else 0.0,
                  "eval/num": float(len(outcomes)), "eval/time_s": time.perf_counter() - t0}
        self.hooks.emit_metrics(step, result)
        self.hooks.emit_event("eval", {"step": step, **result})


def seeded_vllm_engine(config: Any) -> Any:
    """EngineFactory for the rollout workers (runs inside the worker process)."""
    from rollout_workers.engine import VLLMEngine

    return VLLMEngine(config)


def default_pool_factory(spec: JobSpec, weights_dir: Path) -> RolloutPoolLike:
    """The real rollout pool: Ray actors, each with a vLLM engine loading `weights_dir`."""
    import ray

    from rl_service.placement import rollout_bundle_indices
    from rollout_workers.engine import EngineConfig
    from rollout_workers.pool import RolloutPool

    if spec.rollout.engine != "vllm":
        raise ValueError(f"rollout.engine: {spec.rollout.engine!r} is not available; use 'vllm'")
    reg: Any = spec.environment.name
    if spec.environment.registration is not None:
        from rollout_workers.environments.registry import EnvironmentRegistration

        reg = EnvironmentRegistration.model_validate(spec.environment.registration)
    max_len = max(spec.rollout.max_total_tokens + 16, 64)
    # Seeded sampling needs whole-prompt prefills: vLLM rewinds a request's generator after a partial
    # (chunked) prefill, which CPU generators cannot do ("CPU Generator does not use offset").
    engine = EngineConfig(model_dir=str(weights_dir), tokenizer_dir=str(weights_dir), max_model_len=max_len,
                          kv_cache_gib=spec.rollout.kv_cache_gib, seed=spec.seed,
                          engine_kwargs={"max_num_batched_tokens": max(16 * max_len, 8192)})
    res = spec.resources
    # under the scheduler, each worker in its own bundle of the job's placement group (not a learner's)
    pg = ray.util.get_current_placement_group()
    return RolloutPool(functools.partial(seeded_vllm_engine, engine), reg, spec.rollout.num_workers, env_options=spec.environment.options,
                       env_policy=operator_environment_policy(),
                       num_cpus_per_worker=res.rollout_cpus, num_gpus_per_worker=res.rollout_gpus,
                       resources=res.rollout_resources or None, chunk_timeout_s=spec.rollout_chunk_deadline_s,
                       placement_group=pg,
                       bundle_indices=rollout_bundle_indices(spec) if pg is not None else None)
