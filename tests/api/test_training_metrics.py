"""Training metrics in Prometheus: a running job's latest step as gauges labelled by tenant, environment and
job (so an operator aggregates by tenant), its driver restarts, and the queue depth per tenant. The driver's
part (state changes, per-step metrics) is played through the store, as a driver writes them."""

from __future__ import annotations

from api_helpers import Api
from prometheus_client.parser import text_string_to_metric_families

SPEC = {"total_steps": 4, "environment": {"name": "calculator"}}


def scrape(api: Api) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(api.client.get("/metrics").text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_running_jobs_and_queues_by_tenant(api: Api) -> None:
    ids = [api.client.post("/v1/jobs", json=SPEC, headers=api.h(key)).json()["id"]
           for key in (api.key_a, api.key_a, api.key_a, api.key_b)]
    running = ids[0]
    api.store.transition(running, "starting")
    api.store.transition(running, "running")
    api.store.update_job(running, allowed=["running"], fields={"attempts": 3})
    api.store.add_metrics(running, 1, {"rollout/tokens_per_s": 1234.5, "time/step": 2.5, "success_rate": 0.75,
                                       "tools/latency_mean_s": 0.012, "schedule/weight": 0.5, "loss": 0.1},
                          steps_done=2)  # step 1 trained: two steps done
    metrics = scrape(api)
    labels = (("environment", "calculator"), ("job", running), ("tenant", "alpha"))
    assert metrics["taper_job_tokens_per_second"] == {labels: 1234.5}
    assert metrics["taper_job_step_seconds"] == {labels: 2.5}
    assert metrics["taper_job_success_rate"] == {labels: 0.75}
    assert metrics["taper_job_tool_latency_seconds"] == {labels: 0.012}
    assert metrics["taper_job_process_weight"] == {labels: 0.5}
    assert metrics["taper_job_step"] == {labels: 2.0}
    assert metrics["taper_job_driver_restarts"] == {labels: 2.0}
    assert metrics["taper_queue_depth"] == {(("tenant", "alpha"),): 2.0, (("tenant", "beta"),): 1.0}
