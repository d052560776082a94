"""Training metrics on the API's /metrics (Prometheus), read from the job store at scrape time: each running
job's latest step (tokens/s, step time, tool latency, success rate, process weight), its driver restarts, and
the queue per tenant. Every job series carries `tenant`, `environment` and `job` labels, so an operator sums
or averages by tenant or environment (`sum by (tenant) (taper_job_tokens_per_second)`)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from rl_service.control.service import TaperService
from rl_service.job_states import JobState

log = logging.getLogger(__name__)

MAX_JOBS = 1000  # per state, per scrape
LABELS = ["tenant", "environment", "job"]
# metric name, help, key in the job's latest metrics
FROM_LAST_STEP = [
    ("taper_job_tokens_per_second", "Sampled tokens per second of rollout, latest step", "rollout/tokens_per_s"),
    ("taper_job_step_seconds", "Wall time of the latest training step", "time/step"),
    ("taper_job_tool_latency_seconds", "Mean tool-call latency, latest step", "tools/latency_mean_s"),
    ("taper_job_tool_error_rate", "Share of tool calls that failed, latest step", "tools/error_rate"),
    ("taper_job_success_rate", "Outcome success rate of the latest step's rollouts", "success_rate"),
    ("taper_job_process_weight", "Process-reward weight w(t) of the latest step", "schedule/weight"),
    ("taper_job_schedule_version", "Reward-schedule version of the latest step", "schedule/version"),
]


_STEP, _RESTARTS = "~step", "~restarts"  # keys of the two gauges read from the job record, not its metrics


class TrainingMetrics:
    """A Prometheus collector over the service's jobs (every tenant's). Without `job_labels` the series name
    no tenant and no job: each is the mean over an environment's running jobs, and the queue depth a total."""

    def __init__(self, service: TaperService, job_labels: bool = True) -> None:
        self.service = service
        self.job_labels = job_labels

    def collect(self) -> Iterator[Metric]:
        try:
            running = self.service.jobs.all_in_state(JobState.RUNNING, MAX_JOBS)
            queued = self.service.jobs.all_in_state(JobState.QUEUED, MAX_JOBS)
        except Exception:  # a scrape must not fail because Redis blinked
            log.debug("training metrics skipped: the store is unreachable", exc_info=True)
            return
        names = LABELS if self.job_labels else ["environment"]
        families = {key: GaugeMetricFamily(name, text, labels=names) for name, text, key in FROM_LAST_STEP}
        families[_STEP] = GaugeMetricFamily("taper_job_step", "Training steps done", labels=names)
        families[_RESTARTS] = GaugeMetricFamily(
            "taper_job_driver_restarts", "Driver starts after the first (resumes, restarts after a lost driver)",
            labels=names)
        # labels -> key -> the values of the jobs behind those labels (one job each, with job labels)
        rows: dict[tuple[str, ...], dict[str, list[float]]] = {}
        for job in running:
            labels = (job.tenant, job.spec.environment.name, job.id) if self.job_labels else (job.spec.environment.name,)
            row = rows.setdefault(labels, {})
            numbers = {_STEP: job.step, _RESTARTS: max(job.attempts - 1, 0), **(job.last_metrics or {})}
            for key in families:
                if isinstance(numbers.get(key), int | float):
                    row.setdefault(key, []).append(float(numbers[key]))
        for labels, row in rows.items():
            for key, vs in row.items():  # without job labels: the mean over the environment's running jobs
                families[key].add_metric(list(labels), sum(vs) / len(vs))
        yield from families.values()
        if not self.job_labels:
            yield GaugeMetricFamily("taper_queue_depth", "Jobs waiting to be placed", value=len(queued))
            return
        depth = GaugeMetricFamily("taper_queue_depth", "Jobs waiting to be placed", labels=["tenant"])
        for tenant, n in sorted(Counter(job.tenant for job in queued).items()):
            depth.add_metric([tenant], n)
        yield depth
