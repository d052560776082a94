"""The REST API over a real Redis (no Ray: jobs stay queued; the real job in tests/ui/test_real_job.py runs one
over HTTP)."""

from __future__ import annotations

import json

import pytest
from api_helpers import Api, redis_dump

from api.app import OPENAI_PATHS

SPEC = {"name": "t", "total_steps": 3, "rollout": {"num_generations": 2, "prompts_per_step": 2}}


def submit(api: Api, body=None, key=None, **headers):
    return api.client.post("/v1/jobs", json=body if body is not None else SPEC, headers={**api.h(key), **headers})


def test_auth_is_required(api: Api) -> None:
    assert api.client.get("/v1/jobs").status_code == 401
    r = api.client.get("/v1/jobs", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["field"] == "Authorization"
    assert api.client.get("/v1/jobs", headers=api.h()).status_code == 200


def test_submit_get_list_and_filter(api: Api) -> None:
    r = submit(api)
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["state"] == "queued" and job["spec"]["rollout"]["num_generations"] == 2
    assert r.headers["Location"] == f"/v1/jobs/{job['id']}"
    assert api.client.get(f"/v1/jobs/{job['id']}", headers=api.h()).json()["id"] == job["id"]
    second = submit(api).json()
    page = api.client.get("/v1/jobs?limit=1", headers=api.h()).json()
    assert page["total"] == 2 and [j["id"] for j in page["items"]] == [second["id"]]
    page2 = api.client.get("/v1/jobs?limit=1&offset=1", headers=api.h()).json()
    assert [j["id"] for j in page2["items"]] == [job["id"]]
    api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.h())
    cancelled = api.client.get("/v1/jobs?state=cancelled", headers=api.h()).json()
    assert [j["id"] for j in cancelled["items"]] == [job["id"]]
    assert api.client.get("/v1/jobs?state=bogus", headers=api.h()).status_code == 422


def test_idempotency_key(api: Api) -> None:
    a = submit(api, **{"Idempotency-Key": "abc"})
    b = submit(api, **{"Idempotency-Key": "abc"})
    assert (a.status_code, b.status_code) == (201, 200) and a.json()["id"] == b.json()["id"]
    before = redis_dump(api.store.url)
    c = submit(api, {**SPEC, "seed": 7}, **{"Idempotency-Key": "abc"})
    assert c.status_code == 409 and c.json()["error"]["field"] == "Idempotency-Key"
    assert redis_dump(api.store.url) == before


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**SPEC, "bogus": 1}, "bogus"),
        ({**SPEC, "rollout": {"num_generations": "many"}}, "rollout.num_generations"),
        ({**SPEC, "rollout": {"num_generations": 0}}, "rollout.num_generations"),
        ({**SPEC, "total_steps": 1.5}, "total_steps"),
        ({**SPEC, "reward_schedule": {"kind": "exponential"}}, "reward_schedule"),
        ({**SPEC, "resources": {"custom": {"CPU": 1}}}, "resources"),
        ({**SPEC, "reward_schedule": {"kind": "linear", "w_start": -1}}, "reward_schedule.w_start"),
        ({**SPEC, "environment": {"name": "nope"}}, "environment.name"),
        ([1, 2], ""),
    ],
)
def test_bad_bodies_get_422_naming_the_field_and_write_nothing(api: Api, body, field: str) -> None:
    before = redis_dump(api.store.url)
    r = submit(api, body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["field"].startswith(field) and err["message"]
    # pydantic's "Value error, " prefix never reaches a user
    assert "error, " not in err["message"] and all("error, " not in d["message"] for d in err.get("details", []))
    assert redis_dump(api.store.url) == before


def test_malformed_json_huge_payload_and_wrong_content(api: Api) -> None:
    before = redis_dump(api.store.url)
    r = api.client.post("/v1/jobs", content=b"{not json", headers={**api.h(), "Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "body"
    huge = {**SPEC, "tasks": {"options": {"blob": "x" * 100_000}}}
    r = submit(api, huge)
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"

    def chunks():
        yield b'{"name": "'
        for _ in range(20):
            yield b"x" * 10_000
        yield b'"}'

    r = api.client.post("/v1/jobs", content=chunks(), headers={**api.h(), "Content-Type": "application/json"})
    assert r.status_code == 413
    r = api.client.post("/v1/jobs", content=json.dumps({**SPEC, "name": "\ud800"}),
                        headers={**api.h(), "Content-Type": "application/json"})
    assert r.status_code in (201, 422)  # a lone surrogate must never be a 5xx
    if r.status_code == 422:
        assert redis_dump(api.store.url) == before


@pytest.mark.parametrize("method, path", [
    ("POST", "/v1/jobs"), ("PATCH", "/v1/jobs/job-0/reward-schedule"), ("POST", "/v1/environments"),
    ("POST", "/v1/fine_tuning/jobs"), ("POST", "/v1/keys"), ("PUT", "/v1/tenants/alpha/quota"),
])
def test_deep_json_is_refused_before_any_parse(api: Api, method: str, path: str) -> None:
    """A JSON bomb (20k levels, under the body size limit: a RecursionError in Python's parser) is a 422 naming the problem on
    every route, with or without a content type, and nothing is written; deep but allowed bodies reach the
    route's own validation."""
    before = redis_dump(api.store.url)
    for bomb in (b"[" * 20_000 + b"]" * 20_000, b'{"a":' * 10_000 + b"1" + b"}" * 10_000):
        for content_type in ({"Content-Type": "application/json"}, {}):
            r = api.client.request(method, path, content=bomb, headers={**api.h(), **content_type})
            assert r.status_code == 422, (r.status_code, r.text[:300])
            assert r.json()["error"]["field"] == "body" and "nested deeper than 64" in r.json()["error"]["message"]
    r = api.client.request(method, path, content=b"[" * 64 + b"]" * 64, headers={**api.h(), "Content-Type": "application/json"})
    assert 400 <= r.status_code < 500 and "nested deeper" not in r.text
    # brackets inside strings nest nothing; a huge integer is a client error too
    r = api.client.request(method, path, content=json.dumps({"name": "[" * 5000}).encode(), headers=api.h())
    assert r.status_code < 500 and "nested deeper" not in r.text
    r = api.client.request(method, path, content=b'{"seed": ' + b"9" * 50_000 + b"}", headers=api.h())
    assert 400 <= r.status_code < 500, r.text[:300]
    assert redis_dump(api.store.url) == before


def test_tenant_isolation(api: Api) -> None:
    job = submit(api).json()
    other = api.h(api.key_b)
    for method, path in [
        ("get", f"/v1/jobs/{job['id']}"),
        ("post", f"/v1/jobs/{job['id']}/cancel"),
        ("post", f"/v1/jobs/{job['id']}/pause"),
        ("get", f"/v1/jobs/{job['id']}/events"),
        ("get", f"/v1/jobs/{job['id']}/metrics"),
        ("get", f"/v1/jobs/{job['id']}/checkpoints"),
        ("get", f"/v1/jobs/{job['id']}/trajectories"),
        ("get", f"/v1/jobs/{job['id']}/reward-schedule"),
    ]:
        r = api.client.request(method, path, headers=other)
        assert r.status_code == 404, (path, r.text)
    r = api.client.patch(f"/v1/jobs/{job['id']}/reward-schedule", json={"w_end": 0.1}, headers=other)
    assert r.status_code == 404
    assert api.client.get("/v1/jobs", headers=other).json()["total"] == 0
    assert api.client.get(f"/v1/jobs/{job['id']}", headers=api.h()).json()["state"] == "queued"


def test_reward_schedule_get_patch_and_bad_patches(api: Api) -> None:
    job = submit(api).json()
    url = f"/v1/jobs/{job['id']}/reward-schedule"
    got = api.client.get(url, headers=api.h()).json()
    assert got["version"] == 1 and got["schedule"]["kind"] == "linear"
    r = api.client.patch(url, json={"kind": "exponential", "half_life": 5, "w_end": 0.0}, headers=api.h())
    assert r.status_code == 200, r.text
    assert r.json()["version"] == 2 and r.json()["effective_from"] == 1 and len(r.json()["history"]) == 2
    events = api.client.get(f"/v1/jobs/{job['id']}/events", headers=api.h()).json()["items"]
    assert events[-1]["kind"] == "schedule_patched" and events[-1]["data"]["version"] == 2
    before = redis_dump(api.store.url)
    # invalid on its own: 422; valid, but not for this (exponential) schedule: 409; the field is named either way
    for bad, field, status in [
        ({"half_life": -1}, "half_life", 422), ({"kind": "wavy"}, "kind", 422), ({"nope": 1}, "nope", 422),
        ({"w_end": "x"}, "w_end", 422), ({"w_end": None}, "w_end", 422), ({}, "body", 422),
        ({"kind": "linear", "half_life": 3}, "half_life", 422), ({"half_life": 3, "milestones": [2]}, "milestones", 422),
        ({"milestones": [4, 4]}, "milestones", 422),
        ({"kind": "step"}, "milestones", 409), ({"milestones": [3]}, "milestones", 409),
        ({"half_life": None}, "half_life", 409),
    ]:
        r = api.client.patch(url, json=bad, headers=api.h())
        assert r.status_code == status, (bad, r.text)
        assert (r.json()["error"]["field"] or "").startswith(field), (bad, r.json())
    r = api.client.patch(url, content=b"[1]", headers={**api.h(), "Content-Type": "application/json"})
    assert r.status_code == 422
    assert redis_dump(api.store.url) == before


def test_control_actions_follow_the_state_machine(api: Api) -> None:
    job = submit(api).json()
    base = f"/v1/jobs/{job['id']}"
    r = api.client.post(f"{base}/pause", headers=api.h())
    assert r.status_code == 409 and r.json()["error"]["field"] == "state"
    assert api.client.post(f"{base}/resume", headers=api.h()).json()["state"] == "queued"
    assert api.client.post(f"{base}/cancel", headers=api.h()).json()["state"] == "cancelled"
    assert api.client.post(f"{base}/cancel", headers=api.h()).status_code == 409
    assert api.client.patch(f"{base}/reward-schedule", json={"w_end": 0.1}, headers=api.h()).status_code == 409
    assert api.client.post(f"{base}/explode", headers=api.h()).status_code == 404
    # a running job only gets a request; the driver acts on it
    job2 = submit(api).json()
    api.store.transition(job2["id"], "starting")
    api.store.transition(job2["id"], "running")
    r = api.client.post(f"/v1/jobs/{job2['id']}/pause", headers=api.h()).json()
    assert (r["state"], r["control"]) == ("running", "pause")
    r = api.client.post(f"/v1/jobs/{job2['id']}/resume", headers=api.h()).json()
    assert (r["state"], r["control"]) == ("running", "run")
    r = api.client.post(f"/v1/jobs/{job2['id']}/cancel", headers=api.h()).json()
    assert (r["state"], r["control"]) == ("running", "cancel")


def test_submission_rate_limit(api: Api) -> None:
    codes = [submit(api).status_code for _ in range(6)]
    assert codes == [201] * 5 + [429]
    r = submit(api)
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 0
    assert submit(api, key=api.key_b).status_code == 201


def test_events_paged_and_sse(api: Api) -> None:
    job = submit(api).json()
    for i in range(4):
        api.store.add_event(job["id"], "note", {"i": i})
    page = api.client.get(f"/v1/jobs/{job['id']}/events?limit=2", headers=api.h()).json()
    assert [e["kind"] for e in page["items"]] == ["submitted", "note"] and page["next"]
    rest = api.client.get(f"/v1/jobs/{job['id']}/events?after={page['next']}", headers=api.h()).json()
    assert [e["data"]["i"] for e in rest["items"]] == [1, 2, 3]
    assert api.client.get(f"/v1/jobs/{job['id']}/events?after=zzz", headers=api.h()).status_code == 422
    api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.h())
    with api.client.stream("GET", f"/v1/jobs/{job['id']}/events",
                           headers={**api.h(), "Accept": "text/event-stream"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        kinds = [line.split(":", 1)[1].strip() for line in r.iter_lines() if line.startswith("event:")]
    assert kinds[0] == "submitted" and kinds[-1] == "state"


def test_metrics_checkpoints_and_trajectories_empty(api: Api) -> None:
    job = submit(api).json()
    api.store.add_metrics(job["id"], 1, {"loss": 0.5})
    m = api.client.get(f"/v1/jobs/{job['id']}/metrics", headers=api.h()).json()
    assert m["items"][0]["metrics"] == {"loss": 0.5}
    assert api.client.get(f"/v1/jobs/{job['id']}/checkpoints", headers=api.h()).json() == []
    t = api.client.get(f"/v1/jobs/{job['id']}/trajectories?status=ok&min_reward=0.5", headers=api.h()).json()
    assert t["items"] == []
    assert api.client.get(f"/v1/jobs/{job['id']}/trajectories?status=weird", headers=api.h()).status_code == 422


def test_environments(api: Api) -> None:
    envs = api.client.get("/v1/environments", headers=api.h()).json()
    assert {"calculator"} <= {e["name"] for e in envs if e["builtin"]}
    reg = {"kind": "python", "name": "my-calc",
           "import_path": "rollout_workers.environments.calculator:CalculatorEnv"}
    r = api.client.post("/v1/environments", json=reg, headers=api.h())
    assert r.status_code == 201, r.text
    assert api.client.post("/v1/environments", json=reg, headers=api.h()).status_code == 409
    assert api.client.get("/v1/environments/my-calc", headers=api.h()).json()["builtin"] is False
    assert api.client.get("/v1/environments/my-calc", headers=api.h(api.key_b)).status_code == 404
    before = redis_dump(api.store.url)
    for bad, field in [({**reg, "import_path": "os:system"}, "import_path"),
                       ({**reg, "name": "calculator"}, "name"),
                       ({**reg, "code": "print(1)"}, "code"),
                       ({"kind": "http", "name": "h", "base_url": "ftp://x", "tools": []}, "base_url")]:
        r = api.client.post("/v1/environments", json=bad, headers=api.h())
        assert r.status_code in (409, 422), r.text
        assert r.json()["error"]["field"] == field, r.json()
    assert redis_dump(api.store.url) == before
    # a job can use the tenant's registration, and another tenant cannot
    r = submit(api, {**SPEC, "environment": {"name": "my-calc"}})
    assert r.status_code == 201 and r.json()["spec"]["environment"]["registration"]["import_path"].endswith("CalculatorEnv")
    # a job may not smuggle in a registration of its own
    r = submit(api, {**SPEC, "environment": {"name": "calculator", "registration": {"kind": "python"}}})
    assert r.status_code == 422 and r.json()["error"]["field"] == "environment.registration"
    assert submit(api, {**SPEC, "environment": {"name": "my-calc"}}, key=api.key_b).status_code == 422
    assert api.client.delete("/v1/environments/my-calc", headers=api.h()).status_code == 204
    assert api.client.delete("/v1/environments/my-calc", headers=api.h()).status_code == 404


def test_health_prometheus_and_openapi(api: Api) -> None:
    assert api.client.get("/healthz").json() == {"ok": True, "redis": True}
    submit(api)
    api.client.get("/v1/jobs", headers=api.h())
    admin = {"Authorization": f"Bearer {api.store.create_api_key('ops', admin=True)}"}
    text = api.client.get("/metrics", headers=admin).text
    assert 'taper_jobs{state="queued"} 1.0' in text
    assert 'taper_http_requests_total{method="GET",route="/v1/jobs",status="200"}' in text
    schema = api.client.get("/openapi.json").json()
    assert "/v1/jobs/{job_id}/reward-schedule" in schema["paths"]
    assert api.client.get("/docs").status_code == 200
    r = api.client.get("/v1/nowhere")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_sse_follows_a_live_job_until_it_finishes(api: Api) -> None:
    import threading

    job = submit(api).json()
    api.store.transition(job["id"], "starting")

    def drive() -> None:
        import time

        time.sleep(0.5)
        api.store.transition(job["id"], "running")
        for i in range(3):
            api.store.add_event(job["id"], "tick", {"i": i})
            time.sleep(0.1)
        api.store.transition(job["id"], "succeeded")

    worker = threading.Thread(target=drive)
    worker.start()
    with api.client.stream("GET", f"/v1/jobs/{job['id']}/events",
                           headers={**api.h(), "Accept": "text/event-stream"}) as r:
        lines = list(r.iter_lines())
    worker.join()
    kinds = [line.split(":", 1)[1].strip() for line in lines if line.startswith("event:")]
    assert kinds == ["submitted", "state", "state", "tick", "tick", "tick", "state"]
    last = json.loads([line for line in lines if line.startswith("data:")][-1][5:])
    assert last["to"] == "succeeded"
    ids = [line.split(":", 1)[1].strip() for line in lines if line.startswith("id:")]
    # resuming from the second-to-last id (as a reconnecting client sends Last-Event-ID) replays only the last
    with api.client.stream("GET", f"/v1/jobs/{job['id']}/events",
                           headers={**api.h(), "Accept": "text/event-stream", "Last-Event-ID": ids[-2]}) as r:
        again = [line for line in r.iter_lines() if line.startswith("event:")]
    assert again == ["event: state"]


def test_status_reads_are_fresh_after_our_writes_and_at_most_briefly_stale_after_the_driver(api: Api) -> None:
    import time

    job = submit(api).json()
    url = f"/v1/jobs/{job['id']}"
    assert api.client.get(url, headers=api.h()).json()["step"] == 0
    api.store.add_metrics(job["id"], 2, {"loss": 1.0}, steps_done=3)  # as a driver would, behind the service's back
    time.sleep(api.service.jobs.status_cache_s + 0.05)
    assert api.client.get(url, headers=api.h()).json()["step"] == 3
    api.client.post(f"{url}/cancel", headers=api.h())
    assert api.client.get(url, headers=api.h()).json()["state"] == "cancelled"  # no wait needed
    assert api.client.get(url, headers=api.h(api.key_b)).status_code == 404  # the cache is tenant-checked


def test_undeclared_methods_get_405_with_every_method_of_the_path_in_allow(api: Api) -> None:
    job = submit(api).json()
    for method, path, allow in [
        ("OPTIONS", "/v1/environments", "GET, POST"),
        ("PUT", "/v1/environments/calculator", "DELETE, GET"),
        ("POST", f"/v1/jobs/{job['id']}/metrics", "GET"),
        ("GET", f"/v1/jobs/{job['id']}/cancel", "POST"),
        ("DELETE", f"/v1/jobs/{job['id']}/reward-schedule", "GET, PATCH"),
    ]:
        r = api.client.request(method, path, headers=api.h())
        assert r.status_code == 405, (method, path, r.text)
        assert r.headers["Allow"] == allow and r.json()["error"]["code"] == "method_not_allowed", (method, path)
    # an action that does not exist is an unknown path, not a bad parameter
    assert api.client.post(f"/v1/jobs/{job['id']}/explode", headers=api.h()).status_code == 404


@pytest.mark.parametrize("field, value", [("priority", True), ("total_steps", "3"), ("seed", False)])
def test_values_pydantic_would_coerce_are_rejected_as_the_schema_says(api: Api, field: str, value) -> None:
    before = redis_dump(api.store.url)
    r = submit(api, {**SPEC, field: value})
    assert r.status_code == 422 and r.json()["error"]["field"] == field, r.text
    assert redis_dump(api.store.url) == before
    integral = {"priority": 0.0, "total_steps": 3.0, "seed": 1.0}[field]  # a float that is an integer
    assert submit(api, {**SPEC, field: integral}).status_code == 201


def test_openapi_documents_errors_with_the_shared_error_body(api: Api) -> None:
    schema = api.client.get("/openapi.json").json()
    error_ref = "#/components/schemas/ErrorResponse"
    for path, item in schema["paths"].items():
        openai = path.startswith(OPENAI_PATHS)  # OpenAI's error body; invalid requests are its 400
        for method, operation in item.items():
            responses = operation["responses"]
            for status, response in responses.items():
                if status.startswith("4"):
                    ref = "#/components/schemas/OpenAIError" if openai else error_ref
                    assert response["content"]["application/json"]["schema"]["$ref"] == ref, (path, method)
            if path.startswith("/v1/"):
                assert "401" in responses, (method, path)
            if operation.get("parameters") or "requestBody" in operation:
                assert ("400" if openai else "422") in responses, (method, path)
            if "requestBody" in operation:
                assert {"400", "413"} <= set(responses), (method, path)
            if "{" in path:
                assert "404" in responses, (method, path)
            for parameter in operation.get("parameters", []):
                assert "anyOf" not in parameter["schema"], (method, path, parameter)  # never `null`
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    links = schema["paths"]["/v1/jobs"]["post"]["responses"]["201"]["links"]
    assert {link["parameters"]["job_id"] for link in links.values()} == {"$response.body#/id"} and len(links) >= 9
    patch_body = schema["paths"]["/v1/jobs/{job_id}/reward-schedule"]["patch"]["requestBody"]["content"]
    assert patch_body["application/json"]["schema"]["$ref"].endswith("/SchedulePatch")
    assert schema["components"]["schemas"]["SchedulePatch"]["minProperties"] == 1


def test_a_stdio_mcp_config_is_refused_naming_command_and_saying_what_to_do(api: Api) -> None:
    r = api.client.post("/v1/environments", json={"kind": "mcp", "name": "local", "command": "python",
                                                   "args": ["server.py"]}, headers=api.h())
    assert r.status_code == 422 and r.json()["error"]["field"] == "command", r.text
    message = r.json()["error"]["message"]
    assert message.startswith("command: a stdio MCP server") and "streamable HTTP" in message
    assert "Extra inputs" not in message
