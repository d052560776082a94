"""Training metrics in Prometheus: a running job's latest step as gauges labelled by tenant, environment and
job (so an operator aggregates by tenant), its driver restarts, and the queue depth per tenant. The driver's
part (state changes, per-step metrics) is played through the store, as a driver writes them."""

from __future__ import annotations

from pathlib import Path

from api_helpers import Api
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from rl_service.control.settings import TaperSettings

SPEC = {"total_steps": 4, "environment": {"name": "calculator"}}


def scrape(api: Api) -> dict[str, dict[tuple, float]]:
    admin = api.store.create_api_key("ops", admin=True)
    r = api.client.get("/metrics", headers=api.h(admin))
    assert r.status_code == 200, r.text
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(r.text):
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


def test_metrics_need_an_admin_key_unless_the_operator_made_them_public(api: Api, tmp_path: Path) -> None:
    """The series name tenants and their jobs: no key is 401, a tenant's key 403, an admin key 200."""
    api.client.post("/v1/jobs", json=SPEC, headers=api.h())
    r = api.client.get("/metrics")
    assert r.status_code == 401 and r.json()["error"]["field"] == "Authorization" and "alpha" not in r.text
    r = api.client.get("/metrics", headers=api.h())
    assert r.status_code == 403 and "admin" in r.json()["error"]["message"] and "alpha" not in r.text
    assert 'taper_queue_depth{tenant="alpha"} 1.0' in scrape_text(api, api.store.create_api_key("ops", admin=True))
    public = create_app(api.service, TaperSettings(data_dir=tmp_path, metrics_public=True))
    with TestClient(public) as client:
        assert client.get("/metrics").status_code == 200


def test_an_option_drops_the_tenant_and_job_labels(api: Api, tmp_path: Path) -> None:
    ids = [api.client.post("/v1/jobs", json=SPEC, headers=api.h(key)).json()["id"]
           for key in (api.key_a, api.key_b, api.key_b)]
    for job_id, rate in zip(ids[:2], (0.5, 1.0), strict=True):
        api.store.transition(job_id, "starting")
        api.store.transition(job_id, "running")
        api.store.add_metrics(job_id, 0, {"success_rate": rate}, steps_done=1)
    app = create_app(api.service, TaperSettings(data_dir=tmp_path, metrics_job_labels=False, metrics_public=True))
    with TestClient(app) as client:
        text = client.get("/metrics").text
    assert "alpha" not in text and "beta" not in text and not any(job_id in text for job_id in ids)
    assert 'taper_job_success_rate{environment="calculator"} 0.75' in text  # the mean of the two
    assert "taper_queue_depth 1.0" in text


def scrape_text(api: Api, key: str) -> str:
    r = api.client.get("/metrics", headers=api.h(key))
    assert r.status_code == 200, r.text
    return r.text
