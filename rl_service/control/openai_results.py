"""What a fine-tuning job reports from its metrics rows, as OpenAI's objects carry it: the result file (a CSV
of the training steps, under an id derived from the job's), trained tokens, the estimated finish of a running
job and each checkpoint's metrics."""

from __future__ import annotations

import csv
import io
from typing import Any

from rl_service.control.store import JobRecord
from rl_service.job_states import JobState

RESULT_FILE_SUFFIX = "00000000"  # a job's result file: `file-` + the job's 16 hex digits + this


def result_file_id(job_id: str) -> str:
    return "file-" + job_id.removeprefix("job-") + RESULT_FILE_SUFFIX


def job_of_result_file(file_id: str) -> str | None:
    if not (file_id.startswith("file-") and file_id.endswith(RESULT_FILE_SUFFIX) and len(file_id) == 29):
        return None
    return "job-" + file_id[5:21]


def _training_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if not all(k.startswith("eval/") for k in r["metrics"])]


RESULT_COLUMNS = ("step", "train_loss", "train_mean_reward", "train_success_rate", "valid_success_rate",
                  "trained_tokens")


def results_csv(rows: list[dict[str, Any]]) -> bytes:
    """A job's result file (OpenAI's: one CSV row per training step): the loss, the mean outcome reward and the
    success rate of the step's rollouts, the held-out success rate where it was evaluated, tokens trained."""
    evals = {r["step"]: r["metrics"]["eval/success_rate"] for r in rows if "eval/success_rate" in r["metrics"]}
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(RESULT_COLUMNS)
    for r in _training_rows(rows):
        m, done = r["metrics"], r["step"] + 1
        writer.writerow([done, m.get("loss", ""), m.get("reward/outcome_mean", ""), m.get("success_rate", ""),
                         evals.get(done, ""), int(m.get("action_tokens", 0))])
    return out.getvalue().encode()


def trained_tokens(rows: list[dict[str, Any]]) -> int:
    """Tokens the loss trained on, over the job's steps."""
    return int(sum(r["metrics"].get("action_tokens", 0.0) for r in _training_rows(rows)))


def estimated_finish(job: JobRecord) -> int | None:
    """When a running job will be done at its latest step's pace (None: not running, or no step yet)."""
    pace = (job.last_metrics or {}).get("time/step")
    if job.state != JobState.RUNNING or not job.step or not isinstance(pace, int | float):
        return None
    return int(job.updated_at + max(0, job.total_steps - job.step) * float(pace))


def checkpoint_metrics(step: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's checkpoint metrics from the job's rows: the loss of the step that ended at the checkpoint, and
    (Taper's) its rollouts' mean reward and success rate, the held-out success rate when evaluated there."""
    out: dict[str, Any] = {"step": step}
    for r in rows:
        m = r["metrics"]
        if r["step"] == step - 1 and "loss" in m:
            out.update(train_loss=m["loss"], train_mean_reward=m.get("reward/outcome_mean"),
                       train_success_rate=m.get("success_rate"))
        if r["step"] == step and "eval/success_rate" in m:
            out["valid_success_rate"] = m["eval/success_rate"]
    return out
