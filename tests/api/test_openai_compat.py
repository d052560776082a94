"""The official `openai` client drives Taper jobs through /v1/fine_tuning/jobs on a live server: create (with
Taper's own blocks in extra_body), list with paging, retrieve, events, pause, resume, cancel, checkpoints, and
4xx answers surfacing as the client's typed exceptions. The job's driver is played through the store (the
calls a driver makes: state transitions, checkpoints), as the native API's control tests do."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from api_helpers import ThreadedServer

from api.app import create_app
from rl_service.control.service import TaperService
from rl_service.control.settings import TaperSettings
from rl_service.control.store import Store

RL = {"type": "reinforcement", "reinforcement": {"hyperparameters": {"batch_size": 2, "n_epochs": 1}}}


@pytest.fixture
def live(redis_url: str, tmp_path: Path) -> Iterator[tuple[openai.OpenAI, openai.OpenAI, Store]]:
    store = Store(redis_url)
    service = TaperService(store, tmp_path, submit_rate_per_minute=1000)
    app = create_app(service, TaperSettings(max_request_bytes=64_000, data_dir=tmp_path))
    with ThreadedServer(app) as server:
        base = f"{server.url}/v1"
        yield (openai.OpenAI(api_key=store.create_api_key("alpha"), base_url=base, max_retries=0),
               openai.OpenAI(api_key=store.create_api_key("beta"), base_url=base, max_retries=0), store)


def create(client: openai.OpenAI, **extra):
    return client.fine_tuning.jobs.create(
        model="tiny", training_file=None, seed=7, suffix="calc", metadata={"team": "rl"}, method=RL,
        integrations=[{"type": "wandb", "wandb": {"project": "taper-rl", "tags": ["calc"]}}],
        extra_body={"environment": {"name": "calculator"}, "tasks": {"num_train": 8, "num_eval": 2},
                    "reward_schedule": {"kind": "linear", "w_start": 1.0, "w_end": 0.0, "horizon": 4}, **extra})


def test_create_retrieve_and_list_with_paging(live) -> None:
    client, other, store = live
    job = create(client)
    assert (job.object, job.status, job.model, job.seed, job.metadata) == ("fine_tuning.job", "queued", "tiny", 7,
                                                                          {"team": "rl"})
    assert isinstance(job.created_at, int) and job.fine_tuned_model is None and job.error is None
    assert job.method.type == "reinforcement" and job.method.reinforcement.hyperparameters.batch_size == 2
    assert job.training_file is None  # the environment generates the tasks
    spec = store.get_job(job.id).spec  # the OpenAI fields and extra_body landed in the native spec
    assert (spec.name, spec.seed, spec.rollout.prompts_per_step, spec.total_steps, spec.tasks.num_train) == \
        ("calc", 7, 2, 4, 8)  # n_epochs 1 over 8 tasks at 2 per step
    assert (spec.reward_schedule.kind, spec.reward_schedule.horizon) == ("linear", 4)
    assert (spec.tracking.wandb.project, spec.tracking.wandb.tags) == ("taper-rl", ["calc"])
    assert job.integrations[0].wandb.project == "taper-rl"
    assert client.fine_tuning.jobs.retrieve(job.id).id == job.id

    ids = [job.id] + [create(client).id for _ in range(4)]
    first = client.fine_tuning.jobs.list(limit=2)
    assert [j.id for j in first.data] == ids[::-1][:2] and first.has_more
    walked = [j.id for j in client.fine_tuning.jobs.list(limit=2)]  # auto-paging follows `after`
    assert walked == ids[::-1]
    last = client.fine_tuning.jobs.list(limit=2, after=ids[1])
    assert [j.id for j in last.data] == [ids[0]] and not last.has_more
    assert [j.id for j in other.fine_tuning.jobs.list()] == []  # tenants see only their own jobs
    with pytest.raises(openai.NotFoundError):
        other.fine_tuning.jobs.retrieve(job.id)


def test_control_events_and_checkpoints(live) -> None:
    client, _, store = live
    job = create(client)
    with pytest.raises(openai.ConflictError) as exc:  # a queued job has no driver to pause
        client.fine_tuning.jobs.pause(job.id)
    assert exc.value.body["param"] == "state"
    store.transition(job.id, "starting")
    store.transition(job.id, "running")
    assert client.fine_tuning.jobs.pause(job.id).status == "pausing"
    store.transition(job.id, "paused", reason="paused by the driver")
    assert client.fine_tuning.jobs.retrieve(job.id).status == "paused"
    assert client.fine_tuning.jobs.resume(job.id).status == "queued"

    for step in (2, 4, 6):
        step_dir = Path(store.get_job(job.id).work_dir) / "checkpoints" / f"step_{step:08d}"
        step_dir.mkdir(parents=True)
        store.add_checkpoint(job.id, step, step_dir.resolve().as_uri())
    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id, limit=2)
    assert [c.step_number for c in checkpoints.data] == [6, 4] and checkpoints.has_more
    assert checkpoints.data[0].fine_tuned_model_checkpoint == f"{job.id}:6"
    assert [c.step_number for c in client.fine_tuning.jobs.checkpoints.list(job.id, limit=2)] == [6, 4, 2]

    assert client.fine_tuning.jobs.cancel(job.id).status == "cancelled"
    events = list(client.fine_tuning.jobs.list_events(job.id, limit=2))  # newest first, paged by `after`
    assert len(events) >= 6 and all(e.object == "fine_tuning.job.event" for e in events)
    assert events[0].message.endswith("-> cancelled: cancelled by user")
    assert [e.data["to"] for e in events if e.data["kind"] == "state"] == \
        ["cancelled", "queued", "paused", "running", "starting"]
    assert len({e.id for e in events}) == len(events)
    with pytest.raises(openai.ConflictError):
        client.fine_tuning.jobs.cancel(job.id)


GRADER = {"type": "string_check", "name": "x", "input": "{{sample.output_text}}", "reference": "4", "operation": "eq"}
SCORE_MODEL = {"type": "score_model", "name": "judge", "model": "gpt-4o", "input": []}


def _reinforcement(grader: dict | None = None, **hyperparameters) -> dict:
    return {"type": "reinforcement", "reinforcement": {"grader": grader, "hyperparameters": hyperparameters}}


# Requests off the schema are OpenAI's 400; schema-valid ones the service refuses keep its 422. Both name the field.
@pytest.mark.parametrize(("change", "param", "error"), [
    ({"model": "gpt-4o-mini"}, "model", openai.UnprocessableEntityError),  # no alias of it
    ({"method": {"type": "dpo"}}, "method.type", openai.UnprocessableEntityError),
    ({"method": {"type": "supervised"}}, "training_file", openai.UnprocessableEntityError),
    ({"method": {"type": "supervised", "reinforcement": {}}}, "method", openai.UnprocessableEntityError),
    ({"method": _reinforcement(SCORE_MODEL)}, "method.reinforcement.grader", openai.BadRequestError),
    ({"method": _reinforcement({**GRADER, "type": "text_similarity", "evaluation_metric": "bleu"})},
     "method.reinforcement.grader.text_similarity.evaluation_metric", openai.BadRequestError),
    ({"method": _reinforcement({**GRADER, "operation": "regex"})},
     "method.reinforcement.grader.string_check.operation", openai.BadRequestError),
    ({"method": _reinforcement({"type": "python", "name": "py", "source": "def grade(s, i): return 1",
                                "image_tag": "2025-05-08"})},
     "method.reinforcement.grader.python.image_tag", openai.BadRequestError),
    ({"method": _reinforcement(GRADER), "extra_body": {"environment": {"name": "calculator", "grader": GRADER}}},
     "method.reinforcement.grader", openai.UnprocessableEntityError),
    ({"method": _reinforcement(reasoning_effort="high")}, "method.reinforcement.hyperparameters.reasoning_effort",
     openai.BadRequestError),
    ({"method": _reinforcement(compute_multiplier=100)}, "method.reinforcement.hyperparameters.compute_multiplier",
     openai.BadRequestError),
    ({"method": {"type": "reinforcement", "reinforcement": {"hyperparameters": {"batch_size": 0}}}},
     "method.reinforcement.hyperparameters.batch_size", openai.BadRequestError),
    ({"extra_body": {"rollout": {"num_generations": 0}}}, "rollout.num_generations", openai.BadRequestError),
    ({"extra_body": {"no_such_field": 1}}, "no_such_field", openai.BadRequestError),
    ({"extra_body": {"algorithm": {"per_device_train_batch_size": 4}}}, "algorithm.per_device_train_batch_size",
     openai.BadRequestError),  # a GRPOConfig name the algorithm block does not take
    ({"extra_body": {"algorithm": {"beta": 100.0}}}, "algorithm.beta", openai.BadRequestError),
    ({"extra_body": {"environment": {"name": "nope"}}}, "environment.name", openai.UnprocessableEntityError),
    ({"extra_body": {"total_steps": 5}, "method": RL}, "method.reinforcement.hyperparameters.n_epochs",
     openai.UnprocessableEntityError),
    ({"model": "job-0123456789abcdef"}, "model.checkpoint", openai.UnprocessableEntityError),
])
def test_bad_requests_are_typed_client_errors_naming_the_field(live, change: dict, param: str, error: type) -> None:
    client, _, store = live
    kwargs = {"model": "tiny", "training_file": None, **change}
    with pytest.raises(error) as exc:
        client.fine_tuning.jobs.create(**kwargs)
    body = exc.value.body
    assert body["param"] == param and body["type"] == "invalid_request_error", body
    assert body["message"] and body["code"]
    assert store.list_jobs(None)[1] == 0  # nothing half-written


def test_paging_cursors_of_other_jobs_are_not_found(live) -> None:
    client, other, _ = live
    job = create(client)
    with pytest.raises(openai.NotFoundError) as exc:
        other.fine_tuning.jobs.list(after=job.id)
    assert exc.value.body["param"] == "after"
    with pytest.raises(openai.BadRequestError) as exc:
        client.fine_tuning.jobs.list_events(job.id, after="not-an-id")
    assert exc.value.body["param"] == "after"


def test_a_bad_key_is_an_authentication_error(live) -> None:
    client, _, _ = live
    bad = client.with_options(api_key="tpr_not-a-key")
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.fine_tuning.jobs.list()
    assert exc.value.body["type"] == "authentication_error" and exc.value.body["param"] == "Authorization"


def test_finished_jobs_and_fine_tuned_model_as_the_next_model(live) -> None:
    client, _, store = live
    job = create(client)
    for state in ("starting", "running", "succeeded"):
        store.transition(job.id, state)
    step_dir = Path(store.get_job(job.id).work_dir) / "checkpoints" / "step_00000004"
    step_dir.mkdir(parents=True)
    store.add_checkpoint(job.id, 4, step_dir.resolve().as_uri())
    done = client.fine_tuning.jobs.retrieve(job.id)
    assert (done.status, done.fine_tuned_model, done.error) == ("succeeded", job.id, None)
    assert isinstance(done.finished_at, int) and done.finished_at >= done.created_at
    following = client.fine_tuning.jobs.create(model=done.fine_tuned_model, training_file=None)
    assert following.model == job.id
    assert store.get_job(following.id).spec.model.checkpoint_dir == str(step_dir.resolve())

    failing = create(client)
    store.transition(failing.id, "starting")
    store.transition(failing.id, "failed", fields={"error": "learner rank 0 died"})
    failed = client.fine_tuning.jobs.retrieve(failing.id)
    assert failed.status == "failed" and failed.fine_tuned_model is None
    assert (failed.error.code, failed.error.message) == ("job_failed", "learner rank 0 died")


def test_training_and_validation_files_uploaded_with_the_client(live) -> None:
    client, other, store = live
    lines = [{"question": f"What is {a} + {a}?", "answer": str(2 * a)} for a in range(1, 5)]
    content = "\n".join(json.dumps(line) for line in lines).encode() + b"\n"
    train = client.files.create(file=("train.jsonl", content), purpose="fine-tune")
    valid = client.files.create(file=("valid.jsonl", content[: content.index(b"\n") + 1]), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(model="tiny", training_file=train.id, validation_file=valid.id,
                                         extra_body={"environment": {"name": "calculator"}})
    assert (job.training_file, job.validation_file) == (train.id, valid.id)
    tasks = store.get_job(job.id).spec.tasks
    assert (tasks.train_file, tasks.eval_file) == (train.id, valid.id)
    with pytest.raises(openai.APIStatusError) as exc:  # another tenant's file is not theirs to train on
        other.fine_tuning.jobs.create(model="tiny", training_file=train.id)
    assert exc.value.status_code in (404, 422) and "train_file" in (exc.value.body.get("param") or "")


def test_openai_graders_become_the_jobs_outcome_grader(live) -> None:
    """string_check, text_similarity and multi as OpenAI writes them: stored as the job's environment.grader (what
    the runner scores outcomes with), echoed in the job object, and grading as OpenAI's graders do."""
    from reward_models.graders import GradeContext, parse_grader

    client, _, store = live
    similar = {"type": "text_similarity", "name": "close", "input": "{{sample.output_text}}",
               "reference": "{{item.answer}}", "evaluation_metric": "fuzzy_match"}
    multi = {"type": "multi", "name": "both", "calculate_output": "0.5 * exact + 0.5 * close",
             "graders": {"exact": {**GRADER, "name": "exact", "reference": "{{item.answer}}", "operation": "ilike"},
                         "close": similar}}
    job = client.fine_tuning.jobs.create(model="tiny", training_file=None,
                                         method=_reinforcement(multi, compute_multiplier=0.5),
                                         extra_body={"environment": {"name": "calculator"}})
    spec = store.get_job(job.id).spec
    assert spec.environment.grader["type"] == "multi" and spec.rollout.num_generations == 4
    echoed = job.to_dict()["method"]["reinforcement"]["grader"]
    assert echoed["graders"]["close"]["evaluation_metric"] == "fuzzy_match"
    assert job.method.reinforcement.hyperparameters.compute_multiplier == 0.5
    grader = parse_grader(spec.environment.grader)
    item = {"question": "What is 2 + 2?", "answer": "FOUR"}
    assert grader.grade(item, {"output_text": "four"}, GradeContext()) == pytest.approx(0.5 + 0.5 * 0.0)
    assert grader.grade(item, {"output_text": "It is FOUR"}, GradeContext()) == pytest.approx(
        0.5 + 0.5 * (2 * 4 / (10 + 4)))  # ilike holds; difflib's ratio of the two strings

    for operation, output, want in (("eq", "4", 1.0), ("eq", "4 ", 0.0), ("ne", "5", 1.0), ("like", "is 4!", 1.0),
                                    ("ilike", "x", 0.0)):
        check = client.fine_tuning.jobs.create(model="tiny", training_file=None,
                                               method=_reinforcement({**GRADER, "operation": operation}))
        stored = parse_grader(store.get_job(check.id).spec.environment.grader)
        assert stored.grade({}, {"output_text": output}, GradeContext()) == want, operation


def _upload(client: openai.OpenAI, lines: list[dict], name: str = "train.jsonl"):
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return client.files.create(file=(name, content), purpose="fine-tune")


def test_n_epochs_counts_the_uploaded_files_tasks_and_eval_samples_the_held_out_set(live) -> None:
    client, _, store = live
    train = _upload(client, [{"question": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(8)])
    valid = _upload(client, [{"question": "What is 2 + 2?", "answer": "4"}] * 1 + [{"question": "1+1?", "answer": "2"}])
    job = client.fine_tuning.jobs.create(model="tiny", training_file=train.id, method=RL)
    spec = store.get_job(job.id).spec
    assert spec.total_steps == 4  # 1 epoch of the file's 8 tasks at 2 per step, not of tasks.num_train
    assert (spec.tasks.train_tasks, job.hyperparameters.n_epochs) == (8, 1)
    assert job.method.reinforcement.hyperparameters.eval_samples is None  # no held-out set: none claimed
    with_valid = client.fine_tuning.jobs.create(model="tiny", training_file=train.id, validation_file=valid.id,
                                                method=_reinforcement(batch_size=4, n_epochs=3))
    assert store.get_job(with_valid.id).spec.total_steps == 6
    assert with_valid.method.reinforcement.hyperparameters.eval_samples == 2
    generated = client.fine_tuning.jobs.create(model="tiny", training_file=None)
    assert generated.method.reinforcement.hyperparameters.eval_samples == 100  # the generated held-out tasks


def test_the_deprecated_top_level_hyperparameters_are_accepted(live) -> None:
    client, _, store = live
    train = _upload(client, [{"question": f"q{i}?", "answer": "1"} for i in range(6)])
    job = client.fine_tuning.jobs.create(model="tiny", training_file=train.id,
                                         hyperparameters={"batch_size": 3, "n_epochs": 2, "learning_rate_multiplier": 2})
    spec = store.get_job(job.id).spec
    assert (spec.rollout.prompts_per_step, spec.total_steps, spec.algorithm.learning_rate) == (3, 4, 2e-6)
    assert job.hyperparameters.batch_size == 3
    with pytest.raises(openai.UnprocessableEntityError) as exc:  # given twice: which one is meant?
        client.fine_tuning.jobs.create(model="tiny", training_file=train.id, hyperparameters={"batch_size": 3},
                                       method=_reinforcement(batch_size=2))
    assert exc.value.body["param"] == "hyperparameters.batch_size"


def test_request_ids_reach_the_client(live) -> None:
    client, _, _ = live
    page = client.fine_tuning.jobs.with_raw_response.list()
    assert page.request_id and page.request_id.startswith("req_")
    echoed = client.fine_tuning.jobs.with_raw_response.list(extra_headers={"X-Request-Id": "my-trace-1"})
    assert echoed.request_id == "my-trace-1"
    with pytest.raises(openai.NotFoundError) as exc:
        client.fine_tuning.jobs.retrieve("job-0123456789abcdef")
    assert exc.value.request_id.startswith("req_")


def test_a_finished_job_reports_tokens_result_file_and_checkpoint_metrics(live) -> None:
    client, _, store = live
    job = create(client)
    store.transition(job.id, "starting")
    store.transition(job.id, "running")
    assert client.fine_tuning.jobs.retrieve(job.id).estimated_finish is None  # no step yet
    for t in range(4):
        store.add_metrics(job.id, t, {"loss": 0.5 - 0.1 * t, "reward/outcome_mean": 0.25 * t, "success_rate": 0.25 * t,
                                      "action_tokens": 100.0 + t, "time/step": 10.0}, steps_done=t + 1)
        if t == 1:
            running = client.fine_tuning.jobs.retrieve(job.id)
            assert running.trained_tokens is None and running.result_files == []
            assert running.estimated_finish == pytest.approx(store.get_job(job.id).updated_at + 2 * 10.0, abs=1)
    store.add_metrics(job.id, 4, {"eval/success_rate": 0.75, "eval/num": 2.0})
    step_dir = Path(store.get_job(job.id).work_dir) / "checkpoints" / "step_00000004"
    step_dir.mkdir(parents=True)
    store.add_checkpoint(job.id, 4, step_dir.resolve().as_uri())
    store.transition(job.id, "succeeded")

    done = client.fine_tuning.jobs.retrieve(job.id)
    assert done.trained_tokens == 100 + 101 + 102 + 103 and done.estimated_finish is None
    assert len(done.result_files) == 1
    result = client.files.retrieve(done.result_files[0])
    assert (result.purpose, result.filename) == ("fine-tune-results", f"{job.id}-results.csv")
    csv_text = client.files.content(done.result_files[0]).text
    lines = csv_text.splitlines()
    assert lines[0] == "step,train_loss,train_mean_reward,train_success_rate,valid_success_rate,trained_tokens"
    assert len(lines) == 5 and lines[4].split(",")[0] == "4" and lines[4].split(",")[4] == "0.75"
    [checkpoint] = client.fine_tuning.jobs.checkpoints.list(job.id).data
    metrics = checkpoint.metrics.to_dict()
    assert metrics["step"] == 4 and metrics["train_loss"] == pytest.approx(0.2)
    assert (metrics["train_success_rate"], metrics["valid_success_rate"]) == (0.75, 0.75)


def test_jobs_list_filters_by_metadata_and_pages_the_matches(live) -> None:
    client, other, _ = live
    rl = [create(client).id for _ in range(3)]  # metadata {"team": "rl"}
    sft = [client.fine_tuning.jobs.create(model="tiny", training_file=None, metadata={"team": "sft", "run": str(i)}).id
           for i in range(2)]
    assert [j.id for j in client.fine_tuning.jobs.list(metadata={"team": "rl"})] == rl[::-1]
    first = client.fine_tuning.jobs.list(metadata={"team": "rl"}, limit=2)
    assert [j.id for j in first.data] == rl[::-1][:2] and first.has_more
    assert [j.id for j in client.fine_tuning.jobs.list(metadata={"team": "sft", "run": "1"})] == [sft[1]]
    assert list(client.fine_tuning.jobs.list(metadata={"team": "nobody"})) == []
    assert list(other.fine_tuning.jobs.list(metadata={"team": "rl"})) == []
    assert len(list(client.fine_tuning.jobs.list())) == 5  # no filter: every job


def test_an_idempotency_key_makes_a_retried_create_answer_the_first_job(live) -> None:
    client, _, store = live
    key = {"Idempotency-Key": "retry-7f3a"}
    first = client.fine_tuning.jobs.create(model="tiny", training_file=None, suffix="once", extra_headers=key)
    again = client.fine_tuning.jobs.create(model="tiny", training_file=None, suffix="once", extra_headers=key)
    assert again.id == first.id and store.list_jobs(None)[1] == 1
    with pytest.raises(openai.ConflictError) as exc:  # the same key on another request
        client.fine_tuning.jobs.create(model="tiny", training_file=None, suffix="twice", extra_headers=key)
    assert exc.value.body["param"] == "Idempotency-Key"


def _succeed_with_checkpoint(store: Store, job_id: str, step: int = 4) -> Path:
    for state in ("starting", "running", "succeeded"):
        store.transition(job_id, state)
    step_dir = Path(store.get_job(job_id).work_dir) / "checkpoints" / f"step_{step:08d}"
    step_dir.mkdir(parents=True)
    store.add_checkpoint(job_id, step, step_dir.resolve().as_uri())
    return step_dir


def test_models_list_presets_and_the_tenants_fine_tuned_models(live) -> None:
    client, other, store = live
    job = create(client)
    assert [m.id for m in client.models.list()] == ["tiny", "small", "large"]  # not succeeded yet
    _succeed_with_checkpoint(store, job.id)
    models = {m.id: m for m in client.models.list()}
    assert set(models) == {"tiny", "small", "large", job.id}
    assert (models[job.id].object, models[job.id].owned_by) == ("model", "alpha")
    assert client.models.retrieve(job.id).id == job.id
    assert client.models.retrieve(f"{job.id}:4").id == f"{job.id}:4"
    assert client.models.retrieve("small").owned_by == "taper"
    for missing in (f"{job.id}:5", "gpt-4o"):
        with pytest.raises(openai.NotFoundError) as exc:
            client.models.retrieve(missing)
        assert exc.value.body["param"] == "model"
    assert [m.id for m in other.models.list()] == ["tiny", "small", "large"]
    with pytest.raises(openai.NotFoundError):
        other.models.retrieve(job.id)


def test_checkpoint_permissions_let_another_tenant_start_from_it(live) -> None:
    client, other, store = live
    job = create(client)
    step_dir = _succeed_with_checkpoint(store, job.id)
    ref = f"{job.id}:4"
    with pytest.raises(openai.UnprocessableEntityError):  # not theirs, not shared: as if it did not exist
        other.fine_tuning.jobs.create(model=ref, training_file=None)
    perms = client.fine_tuning.checkpoints.permissions
    granted = perms.create(ref, project_ids=["beta"])
    [perm] = granted.data
    assert (perm.object, perm.project_id) == ("checkpoint.permission", "beta")
    assert perms.create(ref, project_ids=["beta"]).data[0].id == perm.id  # granting again changes nothing
    assert [p.id for p in perms.list(ref)] == [perm.id]
    assert list(perms.list(ref, project_id="gamma")) == []
    started = other.fine_tuning.jobs.create(model=ref, training_file=None)
    assert store.get_job(started.id).spec.model.checkpoint_dir == str(step_dir.resolve())
    with pytest.raises(openai.UnprocessableEntityError):  # the permission is for that checkpoint only
        other.fine_tuning.jobs.create(model=job.id, training_file=None)
    with pytest.raises(openai.NotFoundError):  # only the owner manages them
        other.fine_tuning.checkpoints.permissions.create(ref, project_ids=["gamma"])
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        perms.create(ref, project_ids=["gamma", "Not A Tenant"])
    assert exc.value.body["param"] == "project_ids[1]"
    deleted = perms.delete(perm.id, fine_tuned_model_checkpoint=ref)
    assert (deleted.id, deleted.deleted) == (perm.id, True)
    with pytest.raises(openai.UnprocessableEntityError):
        other.fine_tuning.jobs.create(model=ref, training_file=None)
    with pytest.raises(openai.NotFoundError) as exc:
        perms.delete(perm.id, fine_tuned_model_checkpoint=ref)
    assert exc.value.body["param"] == "permission_id"


def _chat_line(a: int) -> dict:
    """A demonstration in OpenAI's supervised chat format, with a tool call."""
    return {"messages": [
        {"role": "system", "content": "Use the calculator."}, {"role": "user", "content": f"What is {a} + 1?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "calculator", "arguments": json.dumps({"expression": f"{a} + 1"})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": str(a + 1)},
        {"role": "assistant", "content": f"The answer is {a + 1}."}]}


def test_supervised_jobs_train_on_the_files_demonstrations(live) -> None:
    client, _, store = live
    demos = _upload(client, [_chat_line(a) for a in range(10)])
    assert demos.to_dict()["demonstrations"] == 10
    job = client.fine_tuning.jobs.create(model="tiny", training_file=demos.id, method={
        "type": "supervised", "supervised": {"hyperparameters": {"batch_size": 4, "n_epochs": 2}}})
    spec = store.get_job(job.id).spec
    assert spec.method == "supervised" and spec.warm_start.demonstrations == demos.id
    assert (spec.warm_start.max_steps, spec.total_steps, spec.warm_start.batch_size) == (5, 5, 4)  # ceil(2 x 10 / 4)
    assert spec.warm_start.until_loss is None and spec.warm_start.demonstrations_count == 10
    assert (job.method.type, job.training_file) == ("supervised", demos.id)
    assert job.method.supervised.hyperparameters.n_epochs == 2 and job.hyperparameters.batch_size == 4

    legacy = client.fine_tuning.jobs.create(model="tiny", training_file=demos.id, hyperparameters={"n_epochs": 1})
    assert legacy.method.type == "supervised"  # no method and a file of conversations: OpenAI's default
    assert store.get_job(legacy.id).spec.total_steps == 1  # ceil(10 / 16)
    tasks = _upload(client, [{"question": "What is 1 + 1?", "answer": "2"}])
    assert client.fine_tuning.jobs.create(model="tiny", training_file=tasks.id).method.type == "reinforcement"
    with pytest.raises(openai.UnprocessableEntityError) as exc:  # nothing to learn from
        client.fine_tuning.jobs.create(model="tiny", training_file=tasks.id, method={"type": "supervised"})
    assert exc.value.body["param"] == "warm_start.demonstrations"
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.fine_tuning.jobs.create(model="tiny", training_file=demos.id, validation_file=demos.id,
                                       method={"type": "supervised"})
    assert exc.value.body["param"] == "validation_file"


def test_rl_jobs_warm_start_from_an_uploaded_file_of_demonstrations(live) -> None:
    """One file serves both: its conversations warm-start the model, their opening turns are the RL tasks."""
    client, _, store = live
    lines = [{**_chat_line(a), "answer": str(a + 1)} for a in range(4)]
    f = _upload(client, lines)
    job = client.fine_tuning.jobs.create(model="tiny", training_file=f.id, method=RL,
                                         extra_body={"warm_start": {"demonstrations": f.id, "max_steps": 20}})
    spec = store.get_job(job.id).spec
    assert (spec.method, spec.warm_start.demonstrations_count, spec.tasks.train_tasks) == ("reinforcement", 4, 4)
    assert spec.warm_start.demonstrations_path == spec.tasks.train_path
    with pytest.raises(openai.ConflictError):  # a job waiting on it keeps the file
        client.files.delete(f.id)


def test_uploads_in_parts_join_in_the_order_part_ids_give(live, tmp_path: Path) -> None:
    client, other, store = live
    content = "".join(json.dumps({"question": f"What is {a} + {a}?", "answer": str(2 * a)}) + "\n"
                      for a in range(40)).encode()
    cut = [0, 333, 1000, len(content)]  # cuts inside lines: parts are bytes, not lines
    chunks = [content[a:b] for a, b in zip(cut, cut[1:], strict=False)]
    upload = client.uploads.create(bytes=len(content), filename="big.jsonl", mime_type="application/jsonl",
                                   purpose="fine-tune")
    assert (upload.object, upload.status, upload.bytes) == ("upload", "pending", len(content))
    ids = {i: client.uploads.parts.create(upload.id, data=chunks[i]).id for i in (2, 0, 1)}  # arrive out of order
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.uploads.complete(upload.id, part_ids=[ids[0], ids[1], ids[0]])
    assert exc.value.body["param"] == "part_ids[2]" and "repeats part_ids[0]" in exc.value.body["message"]
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.uploads.complete(upload.id, part_ids=[ids[0], ids[1]])
    assert exc.value.body["param"] == "part_ids"
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.uploads.complete(upload.id, part_ids=[ids[0], "part_" + "0" * 24, ids[2]])
    assert exc.value.body["param"] == "part_ids[1]"
    with pytest.raises(openai.UnprocessableEntityError) as exc:  # joined in the wrong order: line 1 is cut
        client.uploads.complete(upload.id, part_ids=[ids[1], ids[0], ids[2]])
    assert exc.value.body["param"] == "part_ids" and "line 1" in exc.value.body["message"]
    with pytest.raises(openai.NotFoundError):  # another tenant's upload
        other.uploads.parts.create(upload.id, data=b"x")
    import hashlib

    done = client.uploads.complete(upload.id, part_ids=[ids[0], ids[1], ids[2]],
                                   md5=hashlib.md5(content, usedforsecurity=False).hexdigest())
    assert done.status == "completed" and done.file.bytes == len(content)
    assert client.files.content(done.file.id).content == content
    assert done.file.to_dict()["tasks"] == 40
    with pytest.raises(openai.ConflictError) as exc:  # a completed upload takes no more parts
        client.uploads.parts.create(upload.id, data=b"x")
    assert exc.value.body["param"] == "upload_id"

    short = client.uploads.create(bytes=len(content), filename="b.jsonl", mime_type="application/jsonl",
                                  purpose="fine-tune")
    part = client.uploads.parts.create(short.id, data=chunks[0])
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.uploads.complete(short.id, part_ids=[part.id])
    assert exc.value.body["param"] == "bytes"
    with pytest.raises(openai.APIStatusError) as exc:  # more than declared
        client.uploads.parts.create(short.id, data=content)
    assert exc.value.status_code == 413 and exc.value.body["param"] == "data"
    assert client.uploads.cancel(short.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError) as exc:
        client.uploads.create(bytes=10, filename="b.jsonl", mime_type="application/jsonl", purpose="batch")
    assert exc.value.body["param"] == "purpose"

    path = tmp_path / "chunked.jsonl"  # the client's own helper: parts of part_size, completed in order
    path.write_bytes(content)
    chunked = client.uploads.upload_file_chunked(file=path, mime_type="application/jsonl", purpose="fine-tune",
                                                 part_size=500)
    assert chunked.status == "completed" and client.files.content(chunked.file.id).content == content


def test_graders_run_and_validate_before_any_job(live) -> None:
    """OpenAI's alpha graders routes: a grader scores one sample in seconds, with the reward a job would train
    on, each sub-grader's score and OpenAI's error flags; a grader that cannot run is refused naming the field."""
    client, _, store = live
    graders = client.fine_tuning.alpha.graders
    item = {"question": "What is 2 + 2?", "answer": "4"}
    exact = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
             "reference": "The answer is {{item.answer}}.", "operation": "eq"}
    result = graders.run(grader=exact, model_sample="The answer is 4.", item=item)
    assert result.reward == 1.0 and result.metadata.name == "exact" and result.metadata.type == "string_check"
    assert not any(v for k, v in result.metadata.errors.to_dict().items() if not k.endswith("details") and v)
    assert graders.run(grader=exact, model_sample="The answer is 5.", item=item).reward == 0.0

    multi = {"type": "multi", "name": "both", "calculate_output": "0.5 * exact + 0.5 * close",
             "graders": {"exact": exact, "close": {"type": "text_similarity", "name": "close",
                                                   "input": "{{sample.answer}}", "reference": "{{item.answer}}",
                                                   "evaluation_metric": "fuzzy_match"}}}
    both = graders.run(grader=multi, model_sample="The answer is 4.", item=item)
    assert both.sub_rewards == {"exact": 1.0, "close": 1.0} and both.reward == 1.0

    python = {"type": "python", "name": "py", "source": "def grade(sample, item):\n"
              "    return float(sample['output_text'].endswith(item['answer'] + '.'))\n"}
    assert graders.run(grader=python, model_sample="The answer is 4.", item=item).reward == 1.0
    crash = {**python, "source": "def grade(sample, item):\n    return 1 / 0\n"}
    failed = graders.run(grader=crash, model_sample="x", item=item)
    errors = failed.metadata.errors
    assert failed.reward == 0.0 and errors.python_grader_runtime_error and "ZeroDivisionError" in (
        errors.python_grader_runtime_error_details or "")

    # off the schema: OpenAI's 400; a grader that matches it but cannot run (does not compile): the 422
    for bad, param, status in [
            ({**python, "source": "def grade(sample, item)\n    return 1\n"}, "grader.python.source", 422),
            ({**python, "source": "x = 1\n"}, "grader.python.source", 422),
            ({**exact, "operation": "regex"}, "grader.string_check.operation", 400),
            ({"type": "score_model", "name": "judge", "model": "gpt-4o", "input": []}, "grader", 400)]:
        with pytest.raises(openai.APIStatusError) as exc:
            graders.validate(grader=bad)
        assert (exc.value.status_code, exc.value.body["param"]) == (status, param), exc.value.body
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        graders.run(grader={**python, "source": "def grade(sample, item)\n"}, model_sample="x")
    assert "line 1" in exc.value.body["message"]
    assert graders.validate(grader=exact).grader.to_dict()["reference"] == exact["reference"]
    assert store.list_jobs(None)[1] == 0  # trying graders starts nothing
