"""A job whose progress the test writes itself through the store's public methods (as a job driver would),
so the dashboard can be checked against known metrics, events and trajectories."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from reward_models.schedule import RewardSchedule, ScheduleHistory
from rl_service.control.service import Principal, TaperService
from rl_service.control.store import JobRecord
from rl_service.job_states import JobState
from rl_service.spec import JobSpec, RolloutSpec
from rollout_workers.storage import TrajectoryWriter, step_file
from rollout_workers.trajectory import Step, ToolCall, Trajectory, TrajectoryStatus


def start_job(service: TaperService, tenant: str, name: str = "ui-demo", total_steps: int = 20) -> JobRecord:
    spec = JobSpec(name=name, total_steps=total_steps, rollout=RolloutSpec(prompts_per_step=2, num_generations=2),
                   reward_schedule=RewardSchedule(kind="linear", w_start=1.0, w_end=0.0, horizon=10))
    job, _ = service.jobs.submit(Principal(tenant), spec)
    service.store.transition(job.id, JobState.STARTING, reason="placed")
    service.store.transition(job.id, JobState.RUNNING, reason="driver up")
    return service.store.get_job(job.id)


def step_metrics(t: int, history: ScheduleHistory) -> dict[str, float]:
    """Metrics of training step ``t`` (counted from 0, as the job runner reports them), with its key names;
    the values grow with the number of steps done, ``t + 1``."""
    step = t + 1
    version, schedule = history.at(t)
    w = schedule.weight(t)
    raw = 0.5 + 0.4 * math.sin(step / 3)
    return {
        "step": float(t),
        "reward/outcome_mean": 0.1 * step,
        "reward/process/tool_use/raw": raw,
        "reward/process/tool_use/weighted": w * raw,
        "reward/process_weight": w,
        "reward/success_rate": min(1.0, 0.05 * step),
        "success_rate": min(1.0, 0.05 * step),
        "schedule/version": float(version),
        "schedule/weight": w,
        "schedule/density": schedule.density(t),
        "loss": 1.0 / step,
        "loss/policy": 0.9 / step,
        "kl": 0.01 * step,
        "entropy": 2.0 - 0.05 * step,
        "time/rollout": 1.5,
        "time/learn": 0.5,
        "time/step": 2.1,
        "tokens_per_s": 1000.0 + step,
    }


def report_steps(service: TaperService, job_id: str, steps: range) -> None:
    for s in steps:
        # `steps` counts steps done: the row of the s-th step is step s - 1
        service.store.add_metrics(job_id, s - 1, step_metrics(s - 1, service.store.schedule_history(job_id)),
                                  steps_done=s)


def _step(text: str, ids: list[int], logprobs: list[float], obs_ids: list[int], obs_text: str,
          calls: list[ToolCall], final: bool, rewards: dict[str, float]) -> Step:
    return Step(action_ids=ids, action_logprobs=logprobs, action_text=text, weight_version=3, tool_calls=calls,
                observation_ids=obs_ids, observation_text=obs_text, is_final=final,
                finish_reason="stop", process_rewards=rewards)


def trajectory(job_id: str, train_step: int, reward: float | None, status: TrajectoryStatus = TrajectoryStatus.OK,
               task_id: str = "t-1") -> Trajectory:
    call = ToolCall(raw='{"name": "calculator", "arguments": {"expression": "17*23"}}', name="calculator",
                    arguments={"expression": "17*23"}, result="391", latency_s=0.004)
    steps = [
        _step('<tool_call>{"name": "calculator", "arguments": {"expression": "17*23"}}</tool_call>',
              [11, 12, 13, 14], [-0.1, -0.7, -2.3, -0.02], [90, 91, 92], "<tool_response>391</tool_response>",
              [call], False, {"tool_use": 0.9, "format": 1.0}),
        _step("The answer is 391. <script>alert(1)</script>", [21, 22, 23], [-0.05, -0.4, -1.2], [], "", [], True,
              {"tool_use": 0.0, "format": 1.0}),
    ]
    return Trajectory(job_id=job_id, env="calculator", task_id=task_id, task={"question": "What is 17*23?"},
                      group_id=f"g-{task_id}", prompt_ids=[1, 2, 3, 4, 5], prompt_text="<|user|>What is 17*23?",
                      steps=steps, status=status, outcome_reward=reward, train_step=train_step)


def write_trajectories(job: JobRecord, items: list[Trajectory]) -> Path:
    path = step_file(Path(job.work_dir) / "trajectories", items[0].train_step or 0)
    with TrajectoryWriter(path) as w:
        w.write(items)
    return path


def chart_data(page: Any, div_id: str) -> list[dict[str, Any]]:
    """The traces plotly holds for a chart div (name, meta, x, y)."""
    return page.evaluate(
        """id => (document.getElementById(id).data || []).map(t => ({name: t.name, meta: t.meta,
                  x: Array.from(t.x || []), y: Array.from(t.y || [])}))""", div_id)
