"""Tenants inside the operator's limits, over the REST API on a real Redis: bounded job specs, priorities and
quotas, checkpoint references instead of host paths, admin scope, key revocation and expiry, job deletion.
Every refusal is a 4xx naming the field and leaves Redis as it was."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from api_helpers import Api, redis_contents

from rl_service.control.quota import JobLimits

SPEC = {"name": "t", "total_steps": 3, "rollout": {"num_generations": 2, "prompts_per_step": 2}}


def submit(api: Api, body=None, key=None):
    return api.client.post("/v1/jobs", json=body if body is not None else SPEC, headers=api.h(key))


def refused(api: Api, method: str, url: str, field: str, status: int = 422, key: str | None = None, **kw) -> dict:
    """Send a request that must be refused with ``status``, naming ``field``, writing nothing to Redis."""
    before = redis_contents(api.store.url)
    r = api.client.request(method, url, headers=api.h(key), **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["field"] or "").startswith(field), err
    assert err["message"]
    assert redis_contents(api.store.url) == before
    return err


def admin_key(api: Api) -> str:
    return api.store.create_api_key("ops", name="admin", admin=True)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": {"overrides": {"hidden_size": 1_000_000}}}, "model.overrides.hidden_size"),  # the spec's bound
        ({"model": {"overrides": {"hidden_size": 8192}}}, "model.overrides.hidden_size"),  # the operator's
        ({"model": {"overrides": {"num_hidden_layers": 65}}}, "model.overrides.num_hidden_layers"),
        ({"model": {"overrides": {"vocab_size": 10}}}, "model.overrides.vocab_size"),  # not a tenant's to change
        ({"model": {"overrides": {"n_routed_experts": 257}}}, "model.overrides.n_routed_experts"),
        ({"model": {"overrides": {"moe_intermediate_size": 16385}}}, "model.overrides.moe_intermediate_size"),
        ({"model": {"overrides": {"num_experts_per_tok": 65}}}, "model.overrides.num_experts_per_tok"),
        ({"resources": {"learner_cpus": 1e9}}, "resources.learner_cpus"),
        ({"resources": {"learner_cpus": 33}}, "resources.learner_cpus"),
        ({"resources": {"rollout_gpus": 9}}, "resources.rollout_gpus"),
        ({"resources": {"num_learners": 17}}, "resources.num_learners"),
        ({"rollout": {"num_workers": 33}}, "rollout.num_workers"),
        ({"resources": {"rollout_custom": {"tpu": 65}}}, "resources.rollout_custom.tpu"),
        ({"resources": {"learner_custom": {"tpu": 1e9}}}, "resources.learner_custom.tpu"),
        ({"rollout": {"prompts_per_step": 1024, "num_generations": 64, "max_total_tokens": 4096}}, "rollout"),
        ({"priority": 1}, "priority"),  # above the default quota's max_priority 0
        ({"priority": 1000}, "priority"),
        ({"model": {"checkpoint": "/root"}}, "model.checkpoint"),
        ({"model": {"checkpoint": "file:///etc"}}, "model.checkpoint"),
        ({"model": {"checkpoint": "job-0123456789abcdef/../../etc"}}, "model.checkpoint"),
        ({"model": {"checkpoint": "job-0123456789abcdef"}}, "model.checkpoint"),  # no such job
        ({"model": {"checkpoint": "base:nothing"}}, "model.checkpoint"),  # not offered by the operator
        ({"model": {"checkpoint_dir": "/root"}}, "model.checkpoint_dir"),  # the service's own field
    ],
)
def test_jobs_beyond_the_bounds_are_refused_naming_the_field(api: Api, body: dict, field: str) -> None:
    refused(api, "POST", "/v1/jobs", field, json={**SPEC, **body})


def test_jobs_inside_the_bounds_are_accepted(api: Api) -> None:
    body = {**SPEC, "model": {"overrides": {"hidden_size": 256, "num_hidden_layers": 6}},
            "resources": {"learner_cpus": 32, "rollout_custom": {"tpu": 64}}, "priority": -3,
            "rollout": {"num_workers": 32, "prompts_per_step": 8, "num_generations": 8, "max_total_tokens": 4096}}
    r = submit(api, body)
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["model"]["overrides"]["hidden_size"] == 256 and r.json()["priority"] == -3


def test_operator_limits_come_from_the_service(api: Api) -> None:
    api.service.jobs.limits = JobLimits(model_presets=["tiny"])
    err = refused(api, "POST", "/v1/jobs", "model.preset", json={**SPEC, "model": {"preset": "large"}})
    assert "tiny" in err["message"]
    api.service.jobs.limits = JobLimits(learner_cpus=2)
    err = refused(api, "POST", "/v1/jobs", "resources.learner_cpus", json={**SPEC, "resources": {"learner_cpus": 3}})
    assert "operator" in err["message"]


def test_quotas_are_admin_only_and_bound_priority_resources_and_queued_jobs(api: Api) -> None:
    admin = admin_key(api)
    url = "/v1/tenants/alpha/quota"
    assert api.client.get(url).status_code == 401
    refused(api, "GET", url, "Authorization", status=403)
    refused(api, "PUT", url, "Authorization", status=403, json={"max_priority": 100})
    refused(api, "DELETE", url, "Authorization", status=403)
    got = api.client.get(url, headers=api.h(admin)).json()
    assert got["default"] is True and got["quota"]["max_priority"] == 0
    for bad, field in [({"max_priority": 1000}, "max_priority"), ({"max_queued_jobs": -1}, "max_queued_jobs"),
                       ({"resources": {"learner_cpus": "many"}}, "resources.learner_cpus"), ({"bogus": 1}, "bogus")]:
        refused(api, "PUT", url, field, key=admin, json=bad)
    refused(api, "PUT", "/v1/tenants/Not%20A%20Tenant/quota", "tenant", key=admin, json={})
    quota = {"max_priority": 5, "max_queued_jobs": 2, "resources": {"learner_cpus": 2, "rollout_tokens_per_step": 4096}}
    r = api.client.put(url, json=quota, headers=api.h(admin))
    assert r.status_code == 200 and r.json()["default"] is False and r.json()["quota"]["max_priority"] == 5

    assert submit(api, {**SPEC, "priority": 5}).status_code == 201
    refused(api, "POST", "/v1/jobs", "priority", json={**SPEC, "priority": 6})
    err = refused(api, "POST", "/v1/jobs", "resources.learner_cpus", json={**SPEC, "resources": {"learner_cpus": 3}})
    assert "tenant's quota" in err["message"]
    refused(api, "POST", "/v1/jobs", "rollout", json={**SPEC, "rollout": {"prompts_per_step": 8}})
    assert submit(api, {**SPEC, "priority": 5, "resources": {"learner_cpus": 2}}).status_code == 201
    err = refused(api, "POST", "/v1/jobs", "max_queued_jobs", status=429, json=SPEC)
    assert "2 queued jobs" in err["message"]
    assert submit(api, key=api.key_b).status_code == 201  # the quota is alpha's alone
    assert submit(api, {**SPEC, "priority": 1}, key=api.key_b).status_code == 422

    assert api.client.delete(url, headers=api.h(admin)).status_code == 204
    assert api.client.get(url, headers=api.h(admin)).json()["default"] is True
    refused(api, "POST", "/v1/jobs", "priority", json={**SPEC, "priority": 5})


def test_revoked_and_expired_keys_get_401(api: Api) -> None:
    api.service.tenants.auth_cache_s = 0.0
    key = api.store.create_api_key("alpha", name="short")
    assert api.client.get("/v1/jobs", headers=api.h(key)).status_code == 200
    key_id = next(k["id"] for k in api.store.list_api_keys("alpha") if k["name"] == "short")
    assert api.store.revoke_api_key_id(key_id)
    r = api.client.get("/v1/jobs", headers=api.h(key))
    assert r.status_code == 401 and r.json()["error"]["field"] == "Authorization"
    expired = api.store.create_api_key("alpha", expires_at=time.time() - 1)
    r = api.client.get("/v1/jobs", headers=api.h(expired))
    assert r.status_code == 401 and "expired" in r.json()["error"]["message"]
    soon = api.store.create_api_key("alpha", expires_at=time.time() + 1.0)
    api.service.tenants.auth_cache_s = 60.0  # a cached key still stops at its expiry
    assert api.client.get("/v1/jobs", headers=api.h(soon)).status_code == 200
    time.sleep(1.1)
    assert api.client.get("/v1/jobs", headers=api.h(soon)).status_code == 401


def _fake_checkpoint(api: Api, job_id: str, step: int) -> Path:
    """What a job's runner leaves: a step directory in its work dir, listed in the store."""
    work_dir = Path(api.store.get_job(job_id).work_dir)
    path = work_dir / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    api.store.add_checkpoint(job_id, step, path.resolve().as_uri())
    return path.resolve()


def test_checkpoints_are_references_to_own_jobs_or_operator_base_models(api: Api, tmp_path: Path) -> None:
    api.service.jobs.submit_rate_per_minute = 100
    source = submit(api).json()["id"]
    step2 = _fake_checkpoint(api, source, 2)
    step4 = _fake_checkpoint(api, source, 4)
    for ref, expected in [(f"{source}:2", step2), (source, step4)]:
        r = submit(api, {**SPEC, "model": {"checkpoint": ref}})
        assert r.status_code == 201, r.text
        assert r.json()["spec"]["model"]["checkpoint"] == ref
        assert r.json()["spec"]["model"]["checkpoint_dir"] is None  # the host path stays in the control plane
        assert api.store.get_job(r.json()["id"]).spec.model.checkpoint_dir == str(expected)
    refused(api, "POST", "/v1/jobs", "model.checkpoint", json={**SPEC, "model": {"checkpoint": f"{source}:3"}})
    # another tenant's job is not there for beta
    err = refused(api, "POST", "/v1/jobs", "model.checkpoint", key=api.key_b,
                  json={**SPEC, "model": {"checkpoint": source}})
    assert "not found" in err["message"]
    # a checkpoint record that points outside the job's work dir is never used
    api.store.add_checkpoint(source, 6, Path("/etc").as_uri())
    refused(api, "POST", "/v1/jobs", "model.checkpoint", json={**SPEC, "model": {"checkpoint": f"{source}:6"}})
    r = submit(api, {**SPEC, "model": {"checkpoint": source}})
    assert api.store.get_job(r.json()["id"]).spec.model.checkpoint_dir == str(step4)
    # a retry with the same Idempotency-Key is the same request, though `source` has a newer checkpoint now
    body, again = {**SPEC, "model": {"checkpoint": source}}, {"Idempotency-Key": "ckpt"}
    first = api.client.post("/v1/jobs", json=body, headers={**api.h(), **again})
    _fake_checkpoint(api, source, 5)
    retry = api.client.post("/v1/jobs", json=body, headers={**api.h(), **again})
    assert (first.status_code, retry.status_code) == (201, 200) and first.json()["id"] == retry.json()["id"]
    # a base model the operator offers, by name
    base = tmp_path / "models" / "warm"
    api.service.files.base_models = {"warm": base}
    refused(api, "POST", "/v1/jobs", "model.checkpoint", json={**SPEC, "model": {"checkpoint": "base:warm"}})
    base.mkdir(parents=True)
    r = submit(api, {**SPEC, "model": {"checkpoint": "base:warm"}})
    assert r.status_code == 201 and api.store.get_job(r.json()["id"]).spec.model.checkpoint_dir == str(base.resolve())


def test_finished_jobs_can_be_deleted_with_their_records_and_files(api: Api) -> None:
    keep = submit(api).json()["id"]
    job = submit(api).json()["id"]
    work_dir = Path(api.store.get_job(job).work_dir)
    ckpt = _fake_checkpoint(api, job, 1)
    (work_dir / "trajectories").mkdir()
    (work_dir / "trajectories" / "step_1.jsonl").write_text("{}\n")
    api.store.add_metrics(job, 1, {"loss": 1.0})
    refused(api, "DELETE", f"/v1/jobs/{job}", "state", status=409)
    api.store.transition(job, "starting")
    api.store.transition(job, "running")
    refused(api, "DELETE", f"/v1/jobs/{job}", "state", status=409)
    api.client.post(f"/v1/jobs/{job}/cancel", headers=api.h())
    api.store.transition(job, "cancelled")
    refused(api, "DELETE", f"/v1/jobs/{job}", "job_id", status=404, key=api.key_b)
    assert work_dir.exists()

    r = api.client.delete(f"/v1/jobs/{job}", headers=api.h())
    assert r.status_code == 204, r.text
    assert api.client.get(f"/v1/jobs/{job}", headers=api.h()).status_code == 404
    assert not work_dir.exists() and not ckpt.exists()
    assert not [k for k in redis_contents(api.store.url) if job in k]
    assert api.client.get("/v1/jobs", headers=api.h()).json()["total"] == 1
    assert api.client.delete(f"/v1/jobs/{job}", headers=api.h()).status_code == 404

    # keep_checkpoints: the records go, the checkpoint files stay
    api.client.post(f"/v1/jobs/{keep}/cancel", headers=api.h())
    keep_dir = Path(api.store.get_job(keep).work_dir)
    kept = _fake_checkpoint(api, keep, 3)
    (keep_dir / "log.txt").write_text("x")
    assert api.client.delete(f"/v1/jobs/{keep}?keep_checkpoints=true", headers=api.h()).status_code == 204
    assert kept.is_dir() and not (keep_dir / "log.txt").exists()
    assert api.store.list_jobs("alpha")[1] == 0


def test_schedule_history_is_capped(api: Api) -> None:
    job = submit(api).json()["id"]
    api.store.schedule_max_versions = 2
    url = f"/v1/jobs/{job}/reward-schedule"
    assert api.client.patch(url, json={"w_end": 0.1}, headers=api.h()).status_code == 200
    err = refused(api, "PATCH", url, "schedule_version", status=409, json={"w_end": 0.0})
    assert "2 versions" in err["message"]


def test_admins_manage_keys_over_rest(api: Api) -> None:
    admin = admin_key(api)
    refused(api, "GET", "/v1/keys", "Authorization", status=403)
    refused(api, "POST", "/v1/keys", "Authorization", status=403, json={"tenant": "alpha", "admin": True})
    refused(api, "DELETE", "/v1/keys/0123456789abcdef", "Authorization", status=403)
    refused(api, "POST", "/v1/keys", "tenant", key=admin, json={"tenant": "Not A Tenant"})
    refused(api, "POST", "/v1/keys", "expires_in_s", key=admin, json={"tenant": "alpha", "expires_in_s": -5})
    refused(api, "DELETE", "/v1/keys/0123456789abcdef", "key_id", status=404, key=admin)

    r = api.client.post("/v1/keys", json={"tenant": "gamma", "name": "ci", "expires_in_s": 3600}, headers=api.h(admin))
    assert r.status_code == 201, r.text
    made = r.json()
    assert made["key"].startswith("tpr_") and made["tenant"] == "gamma" and not made["admin"]
    assert made["expires_at"] == pytest.approx(time.time() + 3600, abs=60)
    assert api.client.get("/v1/jobs", headers=api.h(made["key"])).status_code == 200  # now cached
    listed = api.client.get("/v1/keys", headers=api.h(admin)).json()
    assert {"alpha", "beta", "ops", "gamma"} <= {k["tenant"] for k in listed}
    assert all("key" not in k for k in listed)
    assert [k["id"] for k in api.client.get("/v1/keys?tenant=gamma", headers=api.h(admin)).json()] == [made["id"]]
    r = api.client.delete(f"/v1/keys/{made['id']}", headers=api.h(admin))
    assert r.status_code == 200 and r.json()["tenant"] == "gamma"
    # revoked over REST: refused at once, though the key was in this process's auth cache
    assert api.client.get("/v1/jobs", headers=api.h(made["key"])).status_code == 401
