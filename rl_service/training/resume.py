"""Where a job's training starts: from the newest checkpoint (weights, the learner's or the ranks' optimizer
state, RNG, run state; the trajectories of later steps dropped), or afresh."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rl_service.hooks import JobHooks
from rl_service.spec import JobSpec
from rl_service.training.checkpoint import Checkpoint, load_weights, restore_rng_state
from rl_service.training.distributed import DistributedLearner
from rl_service.training.learner import Learner
from rl_service.training.run_state import RunState
from rollout_workers.storage import step_file


def resume_from(ckpt: Checkpoint | None, spec: JobSpec, model: Any, learner: Learner, dp: DistributedLearner | None,
                num_train_tasks: int, trajectory_dir: Path, hooks: JobHooks) -> tuple[int, RunState]:
    """(the first step to run, the run state): restored from `ckpt` into `model` and `learner` (or the
    data-parallel ranks `dp`), or fresh when there is no checkpoint. Emits `resumed` or `started`."""
    if ckpt is None:
        run_state = RunState.fresh(spec, num_train_tasks, hooks.current_schedule())
        hooks.emit_event("started", {"step": 0, "total_steps": spec.total_steps})
        return 0, run_state
    state = ckpt.state
    load_weights(model, ckpt.path)
    learner_state = ckpt.learner_state()
    if dp is None:
        learner.load_state_dict(learner_state)
    elif learner_state is not None and "optimizer_by_name" in learner_state:
        dp.load_state_dict(learner_state)
    else:  # written by a single learner: its optimizer state does not map onto the ranks
        hooks.emit_event("warning", {"message": "the checkpoint has no data-parallel optimizer "
                                     "state; AdamW restarts from zero moments", "step": ckpt.step})
    start = int(state["step"])
    run_state = RunState.from_checkpoint(spec, num_train_tasks, state)
    rng = ckpt.rng_state()
    if rng is not None:
        restore_rng_state(rng)
    drop_trajectories_after(trajectory_dir, start, spec.total_steps)
    hooks.emit_event("resumed", {"step": start, "checkpoint_step": ckpt.step})
    return start, run_state


def drop_trajectories_after(directory: Path, step: int, total_steps: int) -> None:
    """A crashed run may have written rollouts of steps after its last checkpoint; the resumed run
    regenerates them."""
    if not directory.is_dir():
        return
    for t in range(step, total_steps + 1):
        f = step_file(directory, t)
        if f.exists():
            f.unlink()
