"""The scheduler on a real local Ray (2 CPUs) and a real Redis, with a stand-in runner."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import ray

from rl_service.control.quota import TenantQuota
from rl_service.control.scheduler import Scheduler, driver_name
from rl_service.control.service import Principal, TaperService
from rl_service.control.store import Store
from rl_service.job_states import JobState
from rl_service.placement import job_bundles, learner_bundle_indices, rollout_bundle_indices
from rl_service.spec import JobSpec
from tests.waiting import wait_for


@pytest.fixture
def store(redis_url: str) -> Store:
    return Store(redis_url, prefix="ts")


@contextlib.contextmanager
def running_scheduler(store: Store, runner: str | type) -> Iterator[Scheduler]:
    """A scheduler with fast ticks and checks; on exit it stops and releases what it still holds."""
    sched = Scheduler(store, runner=runner, tick_s=0.1, driver_grace_s=1.0, liveness_every_s=0.5,
                      heartbeat_every_s=0.1, heartbeat_timeout_s=3.0)
    sched.start()
    try:
        yield sched
    finally:
        sched.stop()
        for job_id in store.r.smembers(store.k_placed()):
            sched.ray_jobs.release(job_id)


@pytest.fixture
def scheduler(store: Store, standin_runner_cls, tmp_path) -> Iterator[Scheduler]:
    with running_scheduler(store, standin_runner_cls) as sched:
        yield sched


def _state(store: Store, job_id: str) -> JobState:
    return store.get_job(job_id).state


def _spec(**kw) -> JobSpec:
    kw.setdefault("total_steps", 3)
    return JobSpec(**kw)


def test_bundles_follow_the_spec() -> None:
    spec = JobSpec.model_validate({"resources": {"learner_cpus": 2, "rollout_cpus": 0.5, "rollout_gpus": 1,
                                                 "custom": {"rollout": 1}}, "rollout": {"num_workers": 2}})
    assert job_bundles(spec) == [{"CPU": 2.0}, {"CPU": 0.5, "GPU": 1.0, "rollout": 1}, {"CPU": 0.5, "GPU": 1.0, "rollout": 1}]
    assert learner_bundle_indices(spec) == [0] and rollout_bundle_indices(spec) == [1, 2]
    # several ranks: the driver gets a CPU-only bundle of its own in front of one bundle per rank
    dp = JobSpec.model_validate({"resources": {"num_learners": 2, "learner_cpus": 4, "learner_gpus": 1,
                                               "learner_custom": {"learner": 1}}})
    assert job_bundles(dp) == [{"CPU": 1.0}, {"CPU": 4.0, "GPU": 1.0, "learner": 1}, {"CPU": 4.0, "GPU": 1.0, "learner": 1},
                               {"CPU": 1.0}]
    assert learner_bundle_indices(dp) == [1, 2] and rollout_bundle_indices(dp) == [3]


def test_heartbeat_settings_are_checked(monkeypatch) -> None:
    from rl_service.control.settings import SettingsError, load_settings

    monkeypatch.setenv("TAPER_DRIVER_HEARTBEAT_EVERY_S", "30")
    monkeypatch.setenv("TAPER_DRIVER_HEARTBEAT_TIMEOUT_S", "20")
    with pytest.raises(SettingsError, match="TAPER_DRIVER_HEARTBEAT_TIMEOUT_S must exceed"):
        load_settings()
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        Scheduler(Store("redis://127.0.0.1:1/0"), heartbeat_every_s=5, heartbeat_timeout_s=5)


def test_job_runs_to_success_and_frees_its_resources(store: Store, scheduler: Scheduler, tmp_path) -> None:
    job = store.submit_job("t", _spec(), str(tmp_path))[0]
    wait_for(lambda: _state(store, job.id) == JobState.SUCCEEDED, what="success")
    got = store.get_job(job.id)
    assert got.step == 3 and got.attempts == 1
    assert [c["step"] for c in store.checkpoints(job.id)] == [1, 2, 3]
    states = [e["data"]["to"] for e in store.events(job.id) if e["kind"] == "state"]
    assert states == ["starting", "running", "succeeded"]
    wait_for(lambda: not store.r.smembers(store.k_placed()), what="cleanup")
    wait_for(lambda: ray.available_resources().get("CPU", 0) == 2.0, what="CPUs back")


def test_queue_priority_resources_unschedulable_and_failure(store: Store, scheduler: Scheduler, tmp_path) -> None:
    huge = store.submit_job("t", _spec(priority=9, resources={"learner_cpus": 64}), str(tmp_path))[0]
    first = store.submit_job("t", _spec(total_steps=4), str(tmp_path))[0]  # 2 CPUs: the whole cluster
    wait_for(lambda: _state(store, first.id) == JobState.RUNNING, what="first running past the huge job")
    low = store.submit_job("t", _spec(priority=-5, total_steps=1), str(tmp_path))[0]
    high = store.submit_job("t", _spec(name="explode", priority=5, total_steps=1), str(tmp_path))[0]
    time.sleep(0.3)
    assert _state(store, low.id) == JobState.QUEUED and _state(store, high.id) == JobState.QUEUED
    wait_for(lambda: _state(store, low.id) == JobState.SUCCEEDED, what="low done")
    assert store.get_job(high.id).started_at < store.get_job(low.id).started_at
    assert store.get_job(first.id).finished_at <= store.get_job(high.id).started_at
    failed = store.get_job(high.id)
    assert failed.state == JobState.FAILED and "boom" in failed.error
    assert _state(store, huge.id) == JobState.QUEUED
    assert any(e["kind"] == "unschedulable" for e in store.events(huge.id))


def test_a_tenant_at_its_running_quota_waits_queued_while_other_tenants_run(
        store: Store, scheduler: Scheduler, tmp_path) -> None:
    store.set_quota("t", TenantQuota(max_running_jobs=1))
    half = {"learner_cpus": 0.5, "rollout_cpus": 0.5}  # 1 CPU a job: the cluster has room for two
    first = store.submit_job("t", _spec(total_steps=10_000, resources=half), str(tmp_path))[0]
    wait_for(lambda: _state(store, first.id) == JobState.RUNNING, what="the first job running")
    second = store.submit_job("t", _spec(total_steps=1, resources=half), str(tmp_path))[0]
    other = store.submit_job("u", _spec(total_steps=10_000, resources=half), str(tmp_path))[0]
    wait_for(lambda: _state(store, other.id) == JobState.RUNNING, what="another tenant's job running")
    assert _state(store, second.id) == JobState.QUEUED and _state(store, first.id) == JobState.RUNNING
    assert [e["kind"] for e in store.events(second.id)].count("quota_wait") == 1
    store.update_job(first.id, allowed=[JobState.RUNNING], fields={"control": "cancel"})
    wait_for(lambda: _state(store, second.id) == JobState.SUCCEEDED, what="the second job after the first")
    assert store.get_job(second.id).started_at >= store.get_job(first.id).finished_at
    assert store.get_job(second.id).attempts == 1 and _state(store, first.id) == JobState.CANCELLED
    store.update_job(other.id, allowed=[JobState.RUNNING], fields={"control": "cancel"})
    wait_for(lambda: _state(store, other.id) == JobState.CANCELLED, what="the other tenant's job cancelled")


def test_killed_driver_resumes_from_its_last_checkpoint(store: Store, scheduler: Scheduler, tmp_path) -> None:
    job = store.submit_job("t", _spec(total_steps=6, seed=300), str(tmp_path))[0]  # 0.3 s per step
    wait_for(lambda: store.get_job(job.id).step >= 2, what="two steps")
    ray.kill(ray.get_actor(driver_name(job.id), namespace=ray.get_runtime_context().namespace), no_restart=True)
    wait_for(lambda: _state(store, job.id) == JobState.SUCCEEDED, what="success after restart")
    got = store.get_job(job.id)
    assert got.attempts == 2
    kinds = [e["kind"] for e in store.events(job.id)]
    assert "driver_lost" in kinds
    resumed = [m["metrics"]["resumed_from"] for m in store.metrics(job.id)]
    assert resumed[0] == 0 and resumed[-1] >= 2  # the second driver did not start over
    assert [m["step"] for m in store.metrics(job.id)][-1] == 5


def test_pause_frees_resources_resume_continues_and_cancel_stops(store: Store, scheduler: Scheduler, tmp_path) -> None:
    job = store.submit_job("t", _spec(total_steps=40, seed=150), str(tmp_path))[0]
    wait_for(lambda: store.get_job(job.id).step >= 1, what="a step")
    store.update_job(job.id, allowed=[JobState.RUNNING], fields={"control": "pause"})
    wait_for(lambda: _state(store, job.id) == JobState.PAUSED, what="paused")
    wait_for(lambda: ray.available_resources().get("CPU", 0) == 2.0, what="CPUs back while paused")
    paused_at = store.get_job(job.id).step
    store.transition(job.id, JobState.QUEUED, fields={"control": "run"})
    wait_for(lambda: store.get_job(job.id).step >= paused_at + 2, what="progress after resume")
    resumed = [m["metrics"]["resumed_from"] for m in store.metrics(job.id)]
    assert resumed[-1] == paused_at > 0
    assert [m["step"] for m in store.metrics(job.id)] == list(range(store.get_job(job.id).step))
    # a cancel request is carried out by the running driver
    store.update_job(job.id, allowed=[JobState.RUNNING], fields={"control": "cancel"})
    wait_for(lambda: _state(store, job.id) == JobState.CANCELLED, what="cancelled")
    assert store.get_job(job.id).step < 40
    wait_for(lambda: not store.r.smembers(store.k_placed()), what="cleanup")


def test_a_job_that_pauses_itself_keeps_its_cause_until_resumed(store: Store, scheduler: Scheduler,
                                                                 tmp_path) -> None:
    service = TaperService(store, tmp_path)
    job = store.submit_job("t", _spec(name="env-down", total_steps=4), str(tmp_path))[0]
    wait_for(lambda: _state(store, job.id) == JobState.PAUSED, what="the job to pause itself")
    got = store.get_job(job.id)
    assert got.error == "paused: the environment is down" and got.warning == "the environment is down"
    assert got.step == 2 and got.control == "run"
    warned = [e["data"] for e in store.events(job.id) if e["kind"] == "infrastructure_failures"]
    assert warned == [{"step": 2, "message": "the environment is down"}]

    resumed = service.jobs.resume(Principal(tenant="t"), job.id)
    assert resumed.error is None and resumed.warning is None
    wait_for(lambda: _state(store, job.id) == JobState.SUCCEEDED, what="success after the resume")
    assert store.get_job(job.id).error is None and store.get_job(job.id).step == 4


def test_a_dead_learner_rank_restarts_training_from_the_last_checkpoint(store: Store, scheduler: Scheduler,
                                                                        tmp_path) -> None:
    job = store.submit_job("t", _spec(name="rank-dies", total_steps=4), str(tmp_path / "a"))[0]
    wait_for(lambda: _state(store, job.id) == JobState.SUCCEEDED, what="success after the restart")
    got = store.get_job(job.id)
    assert got.attempts == 1 and got.step == 4  # the same driver, not a new one
    restarted = [e["data"] for e in store.events(job.id) if e["kind"] == "training_restarted"]
    assert len(restarted) == 1 and restarted[0]["restart"] == 1 and "ActorDiedError" in restarted[0]["cause"]
    assert [m["metrics"]["resumed_from"] for m in store.metrics(job.id)] == [0, 0, 2, 2]

    # with no restarts allowed the same death fails the job, naming the cause
    spec = _spec(name="rank-dies", total_steps=4, watchdog={"max_training_restarts": 0})
    job = store.submit_job("t", spec, str(tmp_path / "b"))[0]
    wait_for(lambda: _state(store, job.id) == JobState.FAILED, what="the job to fail")
    assert "ActorDiedError" in store.get_job(job.id).error


def test_a_runner_that_cannot_be_imported_fails_its_job_with_the_reason(store: Store, ray_local, tmp_path) -> None:
    with running_scheduler(store, "no_such_package.runner:Runner"):
        job = store.submit_job("t", _spec(name="no-runner"), str(tmp_path))[0]
        wait_for(lambda: _state(store, job.id) == JobState.FAILED, what="the job to fail")
        wait_for(lambda: not store.r.smembers(store.k_placed()), what="cleanup")
    got = store.get_job(job.id)
    assert got.attempts == 1 and "No module named 'no_such_package'" in got.error
    assert [e["kind"] for e in store.events(job.id)].count("error") == 1


def test_a_driver_that_could_not_record_the_outcome_is_restarted(store: Store, scheduler: Scheduler, tmp_path) -> None:
    job = store.submit_job("t", _spec(name="lose-outcome", total_steps=2), str(tmp_path))[0]
    wait_for(lambda: _state(store, job.id) == JobState.SUCCEEDED, what="success by a second driver")
    got = store.get_job(job.id)
    assert got.attempts == 2 and got.step == 2
    assert "driver_lost" in [e["kind"] for e in store.events(job.id)]


def test_a_hung_driver_is_killed_and_its_job_resumed(store: Store, scheduler: Scheduler, tmp_path) -> None:
    """The first driver stops making progress at step 2 (stuck in one call, still alive and answering pings):
    its heartbeat goes stale, and past the operator's allowance (3 s here) plus the deadline its phase gave (2 s)
    the scheduler kills it and a second driver resumes from the last checkpoint."""
    job = store.submit_job("t", _spec(name="hang", total_steps=4), str(tmp_path))[0]
    wait_for(lambda: store.get_job(job.id).step == 2, what="two steps")
    wait_for(lambda: (beat := store.heartbeat(job.id)) is not None and beat.age_s > 1.0 and beat.deadline_s == 2.0,
             what="the heartbeat going stale")
    assert _state(store, job.id) == JobState.RUNNING  # alive: the ordinary liveness check sees nothing wrong
    wait_for(lambda: _state(store, job.id) == JobState.SUCCEEDED, what="success after the hang")
    events = store.events(job.id, limit=1000)
    hung = [e["data"] for e in events if e["kind"] == "driver_hung"]
    assert len(hung) == 1 and hung[0]["attempt"] == 1 and hung[0]["step"] == 2
    assert hung[0]["phase_deadline_s"] == 2.0 and hung[0]["allowed_s"] == 5.0 and hung[0]["silent_s"] > 5.0
    got = store.get_job(job.id)
    assert got.attempts == 2 and got.step == 4
    resumed = [m["metrics"]["resumed_from"] for m in store.metrics(job.id)]
    assert resumed == [0, 0, 2, 2]
