"""/v1/files: JSONL task files per tenant, each line checked, nothing half-stored; jobs name them by id."""

from __future__ import annotations

import json
from pathlib import Path

from api_helpers import Api

from rl_service.task_files import load_tasks

TASKS = [
    {"question": "How warm is Oslo?", "answer": "4", "city": "Oslo"},
    {"id": "p", "messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Paris?"}],
     "answer": "12", "metadata": {"source": "table"}},
]


def jsonl(rows: list) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def upload(api: Api, content: bytes, name: str = "tasks.jsonl", purpose: str = "tasks", key: str | None = None):
    return api.client.post("/v1/files", files={"file": (name, content, "application/jsonl")},
                           data={"purpose": purpose}, headers=api.h(key))


def stored_files(api: Api) -> list[Path]:
    root = api.service.data_dir / "task_files"
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_upload_list_get_delete_per_tenant(api: Api) -> None:
    r = upload(api, jsonl(TASKS), purpose="fine-tune")
    assert r.status_code == 200, r.text
    f = r.json()
    assert f["id"].startswith("file-") and len(f["id"]) == 29
    assert (f["object"], f["bytes"], f["filename"], f["purpose"], f["tasks"]) == (
        "file", len(jsonl(TASKS)), "tasks.jsonl", "fine-tune", 2)
    assert isinstance(f["created_at"], int)
    assert api.client.get("/v1/files", headers=api.h()).json()["data"] == [f]
    assert api.client.get(f"/v1/files/{f['id']}", headers=api.h()).json() == f
    # another tenant sees nothing of it
    assert api.client.get("/v1/files", headers=api.h(api.key_b)).json()["data"] == []
    assert api.client.get(f"/v1/files/{f['id']}", headers=api.h(api.key_b)).status_code == 404
    assert api.client.delete(f"/v1/files/{f['id']}", headers=api.h(api.key_b)).status_code == 404
    tasks = load_tasks(api.service.files.task_files.path("alpha", f["id"]))
    assert [t["id"] for t in tasks] == ["line-1", "p"]
    assert tasks[0]["city"] == "Oslo" and tasks[1]["metadata"] == {"source": "table"}
    assert tasks[1]["messages"][0] == {"role": "system", "content": "Be brief."}  # OpenAI's developer role
    r = api.client.delete(f"/v1/files/{f['id']}", headers=api.h())
    assert r.json() == {"id": f["id"], "object": "file", "deleted": True}
    assert api.client.get(f"/v1/files/{f['id']}", headers=api.h()).status_code == 404
    assert stored_files(api) == []


def test_bad_lines_are_422_naming_the_line_and_nothing_is_stored(api: Api) -> None:
    good = jsonl(TASKS)
    cases = [
        (good + b"{not json\n", "line 3: not valid JSON"),
        (good + b"[1, 2]\n", "line 3: must be a JSON object"),
        (good + b'{"answer": "x"}\n', "line 3: needs a 'question' or 'messages'"),
        (good + b'{"question": ""}\n', "line 3: question"),
        (good + b'{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}\n',
         "line 3: messages: the last message must be the user's (a task) or the assistant's (a demonstration)"),
        (good + b'{"messages": [{"role": "system", "content": "a"}, {"role": "assistant", "content": "b"}]}\n',
         "line 3: messages: a user message must come before the assistant's first turn"),
        (good + b'{"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "4"}, '
                b'{"role": "assistant", "content": "b"}]}\n', "line 3: messages.1: a tool message answers"),
        (good + b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [{"type": '
                b'"function", "function": {"name": "f", "arguments": "{oops"}}]}, {"role": "assistant", '
                b'"content": "b"}]}\n', "line 3: messages.1.tool_calls.0.function.arguments: not a JSON object"),
        (good + b'{"messages": [{"role": "robot", "content": "a"}]}\n', "line 3: messages.0.role"),
        (good + b'{"id": "p", "question": "again"}\n', "line 3: id 'p' repeats line 2"),
        (b"\n\n", "no tasks"),
    ]
    for content, message in cases:
        r = upload(api, content)
        assert r.status_code == 422, (message, r.text)
        assert message in r.json()["error"]["message"], r.json()
        assert r.json()["error"]["param"] == "file" and r.json()["error"]["type"] == "invalid_request_error"
    r = upload(api, good, purpose="batch")
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"  # off the schema: OpenAI's 400
    r = upload(api, good, name="tasks.csv")
    assert r.status_code == 422 and ".jsonl" in r.json()["error"]["message"]
    assert stored_files(api) == []  # not even a temporary file is left


def test_operator_limits(api: Api) -> None:
    from rl_service.control.task_file_store import TaskFileStore
    from rl_service.task_files import TaskFileLimits

    api.service.files.task_files = TaskFileStore(api.service.data_dir / "task_files",
                                           TaskFileLimits(max_bytes=2048, max_lines=3, max_line_bytes=512, max_files=1))
    r = upload(api, jsonl([{"question": "q" * 100}] * 30))
    assert r.status_code == 413 and "larger than 2048 bytes" in r.json()["error"]["message"]
    r = upload(api, jsonl([{"question": "q"}] * 4))
    assert r.status_code == 413 and "line 4: more than 3 tasks" in r.json()["error"]["message"]
    r = upload(api, jsonl([{"question": "q"}, {"question": "q" * 600}]))
    assert r.status_code == 422 and "line 2: longer than 512 bytes" in r.json()["error"]["message"]
    assert upload(api, jsonl([{"question": "q"}])).status_code == 200
    r = upload(api, jsonl([{"question": "q"}]))
    assert r.status_code == 409 and "delete some" in r.json()["error"]["message"]
    assert len(stored_files(api)) == 2  # the one kept file and its description


def test_jobs_name_files_by_id(api: Api) -> None:
    f = upload(api, jsonl(TASKS)).json()
    spec = {"environment": {"name": "calculator"}, "tasks": {"train_file": f["id"], "eval_file": f["id"]}}
    r = api.client.post("/v1/jobs", json=spec, headers=api.h())
    assert r.status_code == 201, r.text
    tasks = r.json()["spec"]["tasks"]  # the tenant sees the ids; the runner reads the stored paths
    assert (tasks["train_file"], tasks["eval_file"], tasks["train_path"], tasks["eval_path"]) == (f["id"], f["id"], None, None)
    stored = api.store.get_job(r.json()["id"]).spec.tasks
    assert Path(stored.train_path) == api.service.files.task_files.path("alpha", f["id"])
    assert stored.eval_path == stored.train_path
    # another tenant's file, an unknown one, a path set by hand: 422 naming the field
    for body, field in [
        ({"tasks": {"train_file": f["id"]}}, "tasks.train_file"),
        ({"tasks": {"eval_file": "file-" + "0" * 24}}, "tasks.eval_file"),
    ]:
        r = api.client.post("/v1/jobs", json=body, headers=api.h(api.key_b))
        assert r.status_code == 422 and r.json()["error"]["field"] == field, r.text
    r = api.client.post("/v1/jobs", json={"tasks": {"train_file": "file-123"}}, headers=api.h())
    assert r.status_code == 422 and r.json()["error"]["field"] == "tasks.train_file"
    r = api.client.post("/v1/jobs", json={"tasks": {"train_path": "/etc/passwd"}}, headers=api.h())
    assert r.status_code == 422 and r.json()["error"]["field"] == "tasks.train_path"


def test_a_file_a_waiting_job_names_cannot_be_deleted(api: Api) -> None:
    f = upload(api, jsonl(TASKS)).json()
    job = api.client.post("/v1/jobs", json={"tasks": {"train_file": f["id"]}}, headers=api.h()).json()
    r = api.client.delete(f"/v1/files/{f['id']}", headers=api.h())
    assert r.status_code == 409 and job["id"] in r.json()["error"]["message"]
    api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.h())
    assert api.client.delete(f"/v1/files/{f['id']}", headers=api.h()).status_code == 200


def test_task_files_are_outside_the_data_roots_environments_read(api: Api) -> None:
    from rl_service.control.settings import TaperSettings

    f = upload(api, jsonl(TASKS)).json()
    path = api.service.files.task_files.path("alpha", f["id"])
    policy = TaperSettings(data_dir=api.service.data_dir).environment_policy()
    assert not any(path.is_relative_to(root.resolve()) for root in policy.data_roots)


def test_a_deeply_nested_line_is_refused_naming_the_line(api: Api) -> None:
    """A JSON bomb in a task file is the line's 422, measured before the line is parsed."""
    bomb = b'{"question": "q", "metadata": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"
    r = upload(api, b'{"question": "fine"}\n' + bomb + b"\n")
    assert r.status_code == 422, r.text[:300]
    assert "line 2" in r.text and "nested deeper than 64 levels" in r.text
    assert api.client.get("/v1/files", headers=api.h()).json()["data"] == []


def test_tenants_see_ids_never_host_paths(api: Api, tmp_path: Path) -> None:
    """Every object a tenant reads about a job (the job, its events, checkpoints, the OpenAI views, its files)
    names files and checkpoints by id: the service's data dir, the job's work dir and the installed code's
    paths never show, even in text the driver wrote (a traceback, a legacy event)."""
    import sys

    f = upload(api, b'{"question": "q", "answer": 1}\n').json()
    job = api.client.post("/v1/jobs", json={"tasks": {"train_file": f["id"]}}, headers=api.h()).json()
    record = api.store.get_job(job["id"])
    assert record.spec.tasks.train_path  # the runner reads the stored path
    work = Path(record.work_dir)
    ckpt = work / "checkpoints" / "step_000001"
    ckpt.mkdir(parents=True)
    api.store.transition(job["id"], "starting")
    api.store.transition(job["id"], "running")
    api.store.add_checkpoint(job["id"], 1, ckpt.resolve().as_uri())
    api.store.add_event(job["id"], "resumed", {"step": 1, "checkpoint": str(ckpt)})  # as older drivers wrote it
    crash = f'Traceback:\n  File "{sys.prefix}/lib/x.py", line 1\n  File "{work}/run.py", line 2\nOSError: {ckpt}'
    api.store.add_event(job["id"], "training_restarted", {"restart": 1, "cause": crash})
    api.store.update_job(job["id"], allowed=["running"], fields={"warning": f"cannot read {ckpt}"})

    seen = [api.client.get(path, headers=api.h()) for path in (
        f"/v1/jobs/{job['id']}", f"/v1/jobs/{job['id']}/events?limit=100", f"/v1/jobs/{job['id']}/checkpoints",
        "/v1/jobs", "/v1/files", f"/v1/files/{f['id']}", f"/v1/fine_tuning/jobs/{job['id']}",
        f"/v1/fine_tuning/jobs/{job['id']}/events", f"/v1/fine_tuning/jobs/{job['id']}/checkpoints")]
    assert all(r.status_code == 200 for r in seen), [(r.url, r.status_code) for r in seen]
    text = "\n".join(r.text for r in seen)
    for host_path in (str(tmp_path), str(api.service.data_dir), str(work), sys.prefix, "file://", "_path\": \"", "_path\":\""):
        assert host_path not in text, host_path
    assert api.client.get(f"/v1/jobs/{job['id']}/checkpoints", headers=api.h()).json()[0]["checkpoint"] == \
        f"{job['id']}:1"
    assert api.client.get(f"/v1/jobs/{job['id']}", headers=api.h()).json()["last_checkpoint"] == f"{job['id']}:1"


def test_listing_pages_by_purpose_order_and_after_and_content_reads_back(api: Api) -> None:
    """OpenAI's files list: `purpose`, `limit`, `order`, `after` with a real `has_more`; `/content` is the bytes."""
    ids = []
    for i in range(5):
        r = upload(api, jsonl([{"question": f"q{i}?"}]), name=f"t{i}.jsonl", purpose="fine-tune" if i % 2 else "tasks")
        ids.append(r.json()["id"])

    def page(**params):
        r = api.client.get("/v1/files", params=params, headers=api.h())
        assert r.status_code == 200, r.text
        return r.json()

    newest = [m["id"] for m in page()["data"]]
    assert sorted(newest) == sorted(ids) and page()["has_more"] is False
    first = page(limit=2)
    assert [m["id"] for m in first["data"]] == newest[:2] and first["has_more"] is True
    assert first["last_id"] == newest[1]
    rest = page(limit=2, after=first["last_id"])
    assert [m["id"] for m in rest["data"]] == newest[2:4] and rest["has_more"] is True
    assert [m["id"] for m in page(after=newest[3])["data"]] == newest[4:]
    assert [m["id"] for m in page(order="asc")["data"]] == newest[::-1]
    assert {m["purpose"] for m in page(purpose="fine-tune")["data"]} == {"fine-tune"}
    assert len(page(purpose="fine-tune")["data"]) == 2
    r = api.client.get("/v1/files", params={"after": "file-" + "0" * 24}, headers=api.h())
    assert r.status_code == 404 and r.json()["error"]["param"] == "after"
    r = api.client.get("/v1/files", params={"limit": 0}, headers=api.h())
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"

    content = jsonl(TASKS)
    f = upload(api, content).json()
    r = api.client.get(f"/v1/files/{f['id']}/content", headers=api.h())
    assert r.status_code == 200 and r.content == content
    r = api.client.get(f"/v1/files/{f['id']}/content", headers=api.h(api.key_b))
    assert r.status_code == 404 and r.json()["error"]["param"] == "file_id"


def test_every_answer_carries_a_request_id_echoing_the_clients(api: Api) -> None:
    r = api.client.get("/v1/files", headers=api.h())
    generated = r.headers["x-request-id"]
    assert generated.startswith("req_") and len(generated) > 10
    assert api.client.get("/v1/files", headers=api.h()).headers["x-request-id"] != generated
    r = api.client.get("/v1/files", headers={**api.h(), "X-Request-Id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42"
    r = api.client.get("/v1/jobs/nope", headers={**api.h(), "X-Request-Id": "bad id with spaces"})
    assert r.status_code == 404 and r.headers["x-request-id"].startswith("req_")  # not echoed as given
    r = api.client.get("/v1/files")  # no key: the 401 has one too
    assert r.status_code == 401 and r.headers["x-request-id"].startswith("req_")
    big = api.client.post("/v1/jobs", content=b"x" * 70_000, headers={**api.h(), "X-Request-Id": "big-1"})
    assert big.status_code == 413 and big.headers["x-request-id"] == "big-1"
