"""The Redis store against a real redis-server."""

from __future__ import annotations

import pytest
import redis

from rl_service.control.quota import TenantQuota
from rl_service.control.store import (
    IdempotencyConflict,
    JobActive,
    JobNotFound,
    QueueFull,
    RateLimitExceeded,
    ScheduleFull,
    Store,
    hash_api_key,
)
from rl_service.job_states import InvalidTransition, JobState
from rl_service.spec import JobSpec


@pytest.fixture
def store(redis_url: str) -> Store:
    return Store(redis_url, prefix="t")


def _spec(**kw) -> JobSpec:
    return JobSpec(total_steps=3, **kw)


def test_submit_creates_job_indexes_queue_schedule_and_event(store: Store) -> None:
    job, created = store.submit_job("acme", _spec(name="a"), "/data/jobs")
    assert created and job.state == JobState.QUEUED and job.tenant == "acme" and job.name == "a"
    assert job.work_dir == f"/data/jobs/{job.id}"
    assert store.queued_ids() == [job.id]
    assert store.list_jobs("acme")[1] == 1 and store.list_jobs("other")[1] == 0
    assert [j.id for j in store.list_jobs("acme", state="queued")[0]] == [job.id]
    assert store.current_schedule(job.id)[0] == 1
    events = store.events(job.id)
    assert [e["kind"] for e in events] == ["submitted"]


def test_idempotency_key_returns_the_first_job_and_rejects_another_body(store: Store) -> None:
    a, created_a = store.submit_job("acme", _spec(), "/d", idempotency_key="k1")
    b, created_b = store.submit_job("acme", _spec(), "/d", idempotency_key="k1")
    assert created_a and not created_b and a.id == b.id
    assert store.list_jobs("acme")[1] == 1
    with pytest.raises(IdempotencyConflict):
        store.submit_job("acme", _spec(seed=5), "/d", idempotency_key="k1")
    # keys are per tenant
    c, created_c = store.submit_job("other", _spec(), "/d", idempotency_key="k1")
    assert created_c and c.id != a.id


def test_queue_orders_by_priority_then_arrival(store: Store) -> None:
    low = store.submit_job("t", _spec(priority=-1), "/d")[0]
    mid1 = store.submit_job("t", _spec(), "/d")[0]
    high = store.submit_job("t", _spec(priority=5), "/d")[0]
    mid2 = store.submit_job("t", _spec(), "/d")[0]
    assert store.queued_ids() == [high.id, mid1.id, mid2.id, low.id]


def test_transitions_are_checked_and_move_indexes_atomically(store: Store) -> None:
    job = store.submit_job("t", _spec(), "/d")[0]
    with pytest.raises(InvalidTransition):
        store.transition(job.id, JobState.RUNNING)  # queued -> running skips starting
    assert store.get_job(job.id).state == JobState.QUEUED
    assert store.transition(job.id, JobState.STARTING) == JobState.QUEUED
    assert store.queued_ids() == []
    store.transition(job.id, JobState.RUNNING)
    got = store.get_job(job.id)
    assert got.state == JobState.RUNNING and got.started_at is not None
    assert store.job_ids_in("running") == [job.id] and store.job_ids_in("queued") == []
    store.transition(job.id, JobState.PAUSED)
    store.transition(job.id, JobState.QUEUED)  # resume re-queues
    assert store.queued_ids() == [job.id]
    store.transition(job.id, JobState.CANCELLED, reason="user")
    got = store.get_job(job.id)
    assert got.state == JobState.CANCELLED and got.finished_at is not None
    assert store.queued_ids() == []
    with pytest.raises(InvalidTransition):
        store.transition(job.id, JobState.QUEUED)
    kinds = [(e["kind"], e["data"].get("to")) for e in store.events(job.id)]
    assert kinds[-1] == ("state", "cancelled") and len(kinds) == 6
    assert store.count_by_state()["cancelled"] == 1
    with pytest.raises(JobNotFound):
        store.transition("job-nope", JobState.STARTING)


def test_expect_restricts_the_sources(store: Store) -> None:
    job = store.submit_job("t", _spec(), "/d")[0]
    with pytest.raises(InvalidTransition):
        store.transition(job.id, JobState.CANCELLED, expect=[JobState.PAUSED])
    store.transition(job.id, JobState.CANCELLED, expect=[JobState.QUEUED])


def test_schedule_patch_versions_and_events(store: Store) -> None:
    job = store.submit_job("t", _spec(), "/d")[0]
    store.add_metrics(job.id, 4, {"loss": 1.0, "nan": float("nan")}, steps_done=5)  # step 4 trained
    assert store.get_job(job.id).step == 5
    store.add_metrics(job.id, 5, {"eval/success_rate": 0.5})  # an evaluation row moves no progress
    assert store.get_job(job.id).step == 5
    new = store.patch_schedule(job.id, {"w_end": 0.25})
    assert new.version == 2 and new.effective_from == 6  # step 5 runs now: from the step after it
    version, sched = store.current_schedule(job.id)
    assert version == 2 and sched.w_end == 0.25
    assert store.get_job(job.id).schedule_version == 2
    assert store.events(job.id)[-1]["kind"] == "schedule_patched"
    before = store.r.get(store.k_schedule(job.id))
    with pytest.raises(ValueError):
        store.patch_schedule(job.id, {"w_end": -1.0})
    assert store.r.get(store.k_schedule(job.id)) == before
    assert store.metrics(job.id)[0]["metrics"] == {"loss": 1.0, "nan": None}


def test_events_page_with_an_exclusive_cursor(store: Store) -> None:
    job = store.submit_job("t", _spec(), "/d")[0]
    for i in range(5):
        store.add_event(job.id, "x", {"i": i})
    first = store.events(job.id, limit=3)
    rest = store.events(job.id, after=first[-1]["id"], limit=10)
    assert [e["data"].get("i") for e in first + rest] == [None, 0, 1, 2, 3, 4]


def test_checkpoints_replace_same_step(store: Store) -> None:
    job = store.submit_job("t", _spec(), "/d")[0]
    store.add_checkpoint(job.id, 1, "file:///a")
    store.add_checkpoint(job.id, 2, "file:///b")
    store.add_checkpoint(job.id, 2, "file:///c")
    assert [(c["step"], c["uri"]) for c in store.checkpoints(job.id)] == [(1, "file:///a"), (2, "file:///c")]
    assert store.get_job(job.id).last_checkpoint == f"{job.id}:2"  # the reference tenants read, not the path


def test_api_keys_are_hashed_at_rest(store: Store, redis_url: str) -> None:
    key = store.create_api_key("acme", name="ci")
    info = store.lookup_api_key(key)
    assert {k: info[k] for k in ("tenant", "name", "admin", "expires_at")} == {
        "tenant": "acme", "name": "ci", "admin": False, "expires_at": None}
    assert info["id"] == hash_api_key(key)[:16]
    assert store.lookup_api_key(key + "x") is None
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    for k in raw.scan_iter():
        assert key not in k
        if raw.type(k) == "hash":
            assert key not in str(raw.hgetall(k))
    assert raw.exists(f"t:apikey:{hash_api_key(key)}")
    assert store.revoke_api_key(key) and store.lookup_api_key(key) is None


def test_environments_rate_and_lock(store: Store) -> None:
    assert store.put_environment("a", "calc2", {"kind": "python"})
    assert not store.put_environment("a", "calc2", {"kind": "http"})
    assert store.get_environment("a", "calc2") == {"kind": "python"}
    assert store.get_environment("b", "calc2") is None
    assert store.delete_environment("a", "calc2") and store.list_environments("a") == {}
    assert store.acquire_lock("one", 5000) and not store.acquire_lock("two", 5000)
    assert store.acquire_lock("one", 5000)
    store.release_lock("one")
    assert store.acquire_lock("two", 5000)


def test_rate_limit_counts_created_jobs_only(store: Store) -> None:
    store.submit_job("a", _spec(), "/d", idempotency_key="x", rate_per_minute=2)
    store.submit_job("a", _spec(), "/d", idempotency_key="x", rate_per_minute=2)  # a replay is free
    store.submit_job("a", _spec(), "/d", rate_per_minute=2)
    before = store.list_jobs("a")[1]
    with pytest.raises(RateLimitExceeded):
        store.submit_job("a", _spec(), "/d", rate_per_minute=2)
    assert store.list_jobs("a")[1] == before == 2
    store.submit_job("b", _spec(), "/d", rate_per_minute=2)  # per tenant


def test_writes_for_a_deleted_job_are_refused_and_recreate_nothing(store: Store) -> None:
    job = store.submit_job("t", _spec(), "/d")[0]
    store.add_metrics(job.id, 1, {"loss": 1.0})
    store.r.delete(*[k for k in store.r.scan_iter(f"t:job:{job.id}*")])  # the job deleted under its driver
    for write in (lambda: store.add_metrics(job.id, 2, {"loss": 0.5}),
                  lambda: store.add_checkpoint(job.id, 2, "file:///b"),
                  lambda: store.add_event(job.id, "late", {"i": 1})):
        with pytest.raises(JobNotFound):
            write()
    assert list(store.r.scan_iter(f"t:job:{job.id}*")) == []


def test_keys_are_listed_by_id_revoked_by_id_and_carry_their_expiry(store: Store) -> None:
    a = store.create_api_key("acme", name="ci")
    b = store.create_api_key("acme", name="tmp", expires_at=1234.5)
    c = store.create_api_key("other", name="ops", admin=True)
    listed = store.list_api_keys()
    assert [k["name"] for k in listed] == ["ci", "tmp", "ops"]
    assert [k["name"] for k in store.list_api_keys("acme")] == ["ci", "tmp"]
    assert listed[1]["expires_at"] == 1234.5 and listed[2]["admin"] is True
    assert all(key not in str(listed) for key in (a, b, c))
    tmp_id = listed[1]["id"]
    assert store.revoke_api_key_id("0" * 16) is None and store.revoke_api_key_id("nope") is None
    assert store.revoke_api_key_id(tmp_id)["name"] == "tmp"
    assert store.lookup_api_key(b) is None and store.revoke_api_key_id(tmp_id) is None
    assert [k["name"] for k in store.list_api_keys("acme")] == ["ci"]


def test_queued_quota_is_checked_in_the_submission(store: Store) -> None:
    store.submit_job("a", _spec(), "/d", max_queued=2)
    store.submit_job("a", _spec(), "/d", idempotency_key="k", max_queued=2)
    keys_before = sorted(store.r.keys("*"))
    with pytest.raises(QueueFull, match="max_queued_jobs"):
        store.submit_job("a", _spec(), "/d", max_queued=2)
    assert store.submit_job("a", _spec(), "/d", idempotency_key="k", max_queued=2)[1] is False  # a replay
    assert sorted(store.r.keys("*")) == keys_before
    store.submit_job("b", _spec(), "/d", max_queued=2)  # per tenant


def test_quota_round_trip_and_active_count(store: Store) -> None:
    assert store.get_quota("a") is None
    store.set_quota("a", TenantQuota(max_running_jobs=1, max_priority=3))
    assert store.get_quota("a") == TenantQuota(max_running_jobs=1, max_priority=3)
    job = store.submit_job("a", _spec(), "/d")[0]
    assert store.count_active("a") == 0
    store.transition(job.id, "starting")
    assert store.count_active("a") == 1 and store.count_active("b") == 0
    assert store.delete_quota("a") and store.get_quota("a") is None


def test_delete_job_removes_every_key_of_a_finished_job_only(store: Store) -> None:
    keep = store.submit_job("a", _spec(), "/d")[0]
    before = set(store.r.keys("*"))
    job = store.submit_job("a", _spec(), "/d", idempotency_key="once")[0]
    store.add_metrics(job.id, 1, {"loss": 1.0})
    store.add_checkpoint(job.id, 1, "file:///x")
    store.write_heartbeat(job.id)
    store.patch_schedule(job.id, {"w_end": 0.1})
    store.transition(job.id, "starting")
    with pytest.raises(JobActive):
        store.delete_job(job.id, "a")
    with pytest.raises(JobNotFound):
        store.delete_job(job.id, "b")  # another tenant's job
    store.transition(job.id, "cancelled")
    assert store.delete_job(job.id, "a").id == job.id
    after = set(store.r.keys("*"))
    assert not [k for k in after if job.id in k]
    # what is left: the other job's keys and the counters shared by all jobs
    assert after - before <= {"t:state:cancelled", "t:tenant:a:state:cancelled"} and before - after == set()
    assert store.list_jobs("a")[1] == 1 and store.get_job(keep.id).state == JobState.QUEUED
    with pytest.raises(JobNotFound):
        store.delete_job(job.id, "a")
    # the Idempotency-Key is free again
    assert store.submit_job("a", _spec(), "/d", idempotency_key="once")[1] is True


def test_streams_and_schedule_history_are_capped(redis_url: str) -> None:
    store = Store(redis_url, prefix="caps", events_maxlen=100, metrics_maxlen=100, schedule_max_versions=3)
    job = store.submit_job("a", _spec(), "/d")[0]
    for step in range(1000):
        store.add_metrics(job.id, step, {"loss": step})
        store.add_event(job.id, "tick", {"i": step})
    # XADD MAXLEN ~ trims whole macro nodes: the stream stays near the cap, never near what was written
    assert 100 <= store.r.xlen(store.k_metrics(job.id)) < 300
    assert 100 <= store.r.xlen(store.k_events(job.id)) < 300
    assert store.metrics(job.id, limit=10_000)[-1]["step"] == 999
    store.patch_schedule(job.id, {"w_end": 0.2})
    store.patch_schedule(job.id, {"w_end": 0.1})
    before = store.r.get(store.k_schedule(job.id))
    with pytest.raises(ScheduleFull, match="3 versions"):
        store.patch_schedule(job.id, {"w_end": 0.0})
    assert store.r.get(store.k_schedule(job.id)) == before
