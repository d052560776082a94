"""The `taper` command line: runs the service and wraps its REST API.

Client commands talk to the API at `--api-url` or TAPER_API_URL, else at the address `taper serve` recorded in
DATA_DIR/api.json, with the key TAPER_API_KEY (or the key `taper serve` wrote to DATA_DIR/api-key).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

from api.cli import checkpoints, demo, graders, keys
from rl_service.control.settings import TaperSettings, get_settings
from rl_service.spec import read_spec_file

app = typer.Typer(help="Taper: agentic RL post-training service.", no_args_is_help=True)
API_RECORD = "api.json"  # where `taper serve` records its address (and pid) in the data dir
schedule_app = typer.Typer(help="Show or change a job's process-reward schedule.", no_args_is_help=True)
env_app = typer.Typer(help="Register and list tool environments.", no_args_is_help=True)
quota_app = typer.Typer(help="Tenant quotas (needs an admin API key).", no_args_is_help=True)
app.add_typer(schedule_app, name="schedule")
app.add_typer(env_app, name="env")
files_app = typer.Typer(help="Upload and list task files (JSONL).", no_args_is_help=True)
app.add_typer(files_app, name="files")
app.add_typer(quota_app, name="quota")

console = Console()
# Exit codes: 0 done (a watched job succeeded), 1 the API refused the request or a watched job failed,
# 2 bad usage or an API that cannot be reached, 3 a watched job was cancelled, 4 it paused (itself or by hand)
EXIT_FAILED, EXIT_UNREACHABLE, EXIT_CANCELLED, EXIT_PAUSED = 1, 2, 3, 4
WATCH_EXIT = {"succeeded": 0, "failed": EXIT_FAILED, "cancelled": EXIT_CANCELLED, "paused": EXIT_PAUSED}
Json = Annotated[bool, typer.Option("--json", help="Print the API's answer as JSON (events: one per line).")]


def _print_json(data: Any) -> None:
    print(json.dumps(data))  # plain stdout: no wrapping, no markup
_api_url_option: str | None = None


@app.callback()
def _options(
    api_url: Annotated[str | None, typer.Option(
        help="The API's address for client commands (default: TAPER_API_URL, else the address `taper serve` "
             "recorded in the data dir, else http://127.0.0.1:8000).")] = None,
) -> None:
    global _api_url_option
    _api_url_option = api_url


def _settings() -> TaperSettings:
    return get_settings()


def _recorded_api(data_dir: Path) -> dict[str, Any] | None:
    """The running `taper serve` of a data dir (its url and pid), if one recorded itself and is alive."""
    from rl_service.control.local_services import pid_alive

    try:
        record = json.loads((data_dir / API_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and pid_alive(int(record.get("pid", 0))) else None


def _api_url() -> str:
    s = _settings()
    if _api_url_option:
        return _api_url_option
    if "api_url" in s.model_fields_set:
        return s.api_url
    recorded = _recorded_api(Path(s.data_dir))
    return str(recorded["url"]) if recorded else s.api_url


def _client() -> httpx.Client:
    s = _settings()
    key = s.api_key
    key_file = Path(s.data_dir) / "api-key"
    if key is None and key_file.exists():
        key = key_file.read_text().strip()
    if not key:
        raise typer.BadParameter("no API key: set TAPER_API_KEY (create one with `taper keys create --tenant NAME`)")
    return httpx.Client(base_url=_api_url(), headers={"Authorization": f"Bearer {key}"}, timeout=30)


@contextmanager
def _api() -> Iterator[httpx.Client]:
    """A client for the API; a server that cannot be reached is a one-line error, not a traceback."""
    client = _client()
    try:
        yield client
    except httpx.TransportError as exc:
        console.print(f"[red]error[/red] cannot reach the Taper API at {client.base_url}: {exc}")
        raise typer.Exit(EXIT_UNREACHABLE) from None
    finally:
        client.close()


def _check(r: httpx.Response) -> Any:
    if r.status_code >= 400:
        try:
            err = r.json()["error"]
            field = err.get("field") or err.get("param")  # OpenAI's routes name it `param`
            where = f" [{field}]" if field else ""
            msg = f"{r.status_code} {err['code']}{where}: {err['message']}"
        except Exception:
            msg = f"{r.status_code}: {r.text[:500]}"
        console.print(f"[red]error[/red] {escape(msg)}")  # "[field]" is text, not markup
        raise typer.Exit(1)
    return r.json() if r.content else None


def _load(path: Path) -> Any:
    try:
        return read_spec_file(path)
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc}") from None


# ---- server ----
@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address (default TAPER_API_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default TAPER_API_PORT).")] = None,
) -> None:
    """Run the API with the scheduler. Without TAPER_REDIS_URL / RAY_ADDRESS: a private Redis and a local Ray."""
    import uvicorn

    from api.app import create_app
    from rl_service.control.local_services import (
        EmbeddedServiceError,
        running_embedded_ray_head,
        running_embedded_redis,
    )

    s = _settings()
    try:  # embedded services left running by an older Taper (no password, no token) are refused before start
        if not s.redis_url:
            running_embedded_redis(Path(s.data_dir))
        if not s.ray_address:
            running_embedded_ray_head(Path(s.data_dir))
    except EmbeddedServiceError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    key_file = Path(s.data_dir) / "api-key"
    fresh = not key_file.exists()
    app_ = create_app(settings=s)
    host, port = host or s.api_host, port or s.api_port
    console.print(f"Taper API on http://{host}:{port} (docs at /docs)")
    if fresh:
        console.print(f"A first API key (tenant 'default') will be written to {key_file} if the store has none.")
    record = Path(s.data_dir) / API_RECORD
    client_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    Path(s.data_dir).mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"url": f"http://{client_host}:{port}", "pid": os.getpid()}))
    try:
        uvicorn.run(app_, host=host, port=port, log_level="info", access_log=False)
    finally:
        if (_recorded_api(Path(s.data_dir)) or {}).get("pid") == os.getpid():
            record.unlink(missing_ok=True)
    if not (s.redis_url and s.ray_address):
        console.print("The API stopped; jobs keep running in the local Ray head. "
                      "[bold]taper down[/bold] stops it and the private Redis.")


@app.command()
def scheduler() -> None:
    """Run the job scheduler without the API: it places queued jobs, restarts lost drivers and frees resources
    while no API runs. Any number may run beside `serve`'s: a Redis lease lets one place at a time."""
    from rl_service.control.scheduler_process import run_scheduler

    run_scheduler(_settings(), on_ready=lambda: console.print(
        "Taper scheduler running (Ctrl-C or SIGTERM stops it; running jobs keep going)."))
    console.print("scheduler stopped")


@app.command()
def down() -> None:
    """Stop the local Ray head and private Redis that `serve` started for DATA_DIR (running jobs stop too;
    they resume from their last checkpoints at the next `serve`)."""
    from rl_service.control.local_services import stop_embedded, stop_process

    data_dir = Path(_settings().data_dir)
    stopped = []
    api = _recorded_api(data_dir)
    if api is not None:  # first: an API whose Redis and Ray vanish under it takes minutes to give up
        stop_process(int(api["pid"]), timeout=60)
        (data_dir / API_RECORD).unlink(missing_ok=True)
        stopped.append(f"API at {api['url']}")
    stopped += stop_embedded(data_dir)
    console.print("\n".join(f"stopped the {what}" for what in stopped) or "nothing was running")


# ---- jobs ----
@app.command()
def submit(
    file: Annotated[Path, typer.Argument(help="Job spec (YAML or JSON), see rl_service/spec.py.")],
    idempotency_key: Annotated[str | None, typer.Option(help="Submitting again with the same key is a no-op.")] = None,
    as_json: Json = False,
) -> None:
    """Submit a job; prints its id."""
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
    with _api() as c:
        job = _check(c.post("/v1/jobs", json=_load(file), headers=headers))
    if as_json:
        return _print_json(job)
    console.print(f"[green]{job['id']}[/green] {job['state']}")


def _job_table(jobs: list[dict[str, Any]]) -> Table:
    table = Table(Column("id", no_wrap=True), "name", "state", "progress", "step", "updated")
    for j in jobs:
        bar_len = 10
        filled = int(round(j["progress"] * bar_len))
        bar = "[green]" + "█" * filled + "[/green]" + "░" * (bar_len - filled)
        table.add_row(j["id"], j["name"], j["state"], f"{bar} {j['progress'] * 100:5.1f}%",
                      f"{j['step']}/{j['total_steps']}", time.strftime("%H:%M:%S", time.localtime(j["updated_at"])))
    return table


@app.command()
def status(
    job_id: Annotated[str | None, typer.Argument(help="A job id; all jobs when omitted.")] = None,
    state: Annotated[str | None, typer.Option(help="Only jobs in this state.")] = None,
    watch: Annotated[bool, typer.Option(help="Follow the job's progress until it finishes or pauses; the exit "
                                             "code says how it ended (0 succeeded, 1 failed, 3 cancelled, "
                                             "4 paused).")] = False,
    as_json: Json = False,
) -> None:
    """Jobs with progress bars, or one job's details."""
    with _api() as c:
        if job_id is None:
            params = {"limit": 100, **({"state": state} if state else {})}
            page = _check(c.get("/v1/jobs", params=params))
            if as_json:
                return _print_json(page)
            console.print(_job_table(page["items"]))
            console.print(f"{page['total']} job(s)")
            return
        job = _check(c.get(f"/v1/jobs/{job_id}"))
        if not watch:
            return _print_json(job) if as_json else _print_job(job)
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=console, disable=as_json) as progress:
            task = progress.add_task(f"{job_id} {job['state']}", total=job["total_steps"], completed=job["step"])
            while job["state"] not in WATCH_EXIT:
                time.sleep(1.0)
                job = _check(c.get(f"/v1/jobs/{job_id}"))
                progress.update(task, completed=job["step"], description=f"{job_id} {job['state']}")
    _print_json(job) if as_json else _print_job(job)
    if WATCH_EXIT[job["state"]]:
        raise typer.Exit(WATCH_EXIT[job["state"]])


def _print_job(job: dict[str, Any]) -> None:
    console.print(_job_table([job]))
    if job.get("error"):
        console.print(f"[red]error:[/red] {job['error']}")
    if job.get("last_metrics"):
        shown = {k: v for k, v in list(job["last_metrics"].items())[:12]}
        console.print("last metrics: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                   for k, v in shown.items()))
    console.print(f"schedule version {job['schedule_version']}, checkpoint {job.get('last_checkpoint') or '-'}")


def _print_event(e: dict[str, Any]) -> None:
    ts = time.strftime("%H:%M:%S", time.localtime(e["ts"]))
    data = {k: v for k, v in e["data"].items() if k != "ts"}
    console.print(f"{ts} [bold]{e['kind']}[/bold] {json.dumps(data)[:300]}")


@app.command()
def logs(
    job_id: str,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Stream new events until the job finishes.")] = False,
    as_json: Json = False,
) -> None:
    """A job's events."""
    show = _print_json if as_json else _print_event
    with _api() as c:
        if not follow:
            after = None
            while True:
                page = _check(c.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000, **({"after": after} if after else {})}))
                for e in page["items"]:
                    show(e)
                if not page["next"]:
                    return
                after = page["next"]
        with c.stream("GET", f"/v1/jobs/{job_id}/events", headers={"Accept": "text/event-stream"},
                      timeout=httpx.Timeout(30, read=None)) as r:
            if r.status_code >= 400:
                r.read()
                _check(r)
            kind, eid = "message", ""
            for line in r.iter_lines():
                if line.startswith("event:"):
                    kind = line[6:].strip()
                elif line.startswith("id:"):
                    eid = line[3:].strip()
                elif line.startswith("data:"):
                    data = json.loads(line[5:].strip())
                    show({"id": eid, "kind": kind, "ts": data.get("ts", time.time()), "data": data})


@app.command()
def cancel(job_id: str, as_json: Json = False) -> None:
    """Cancel a job."""
    with _api() as c:
        job = _check(c.post(f"/v1/jobs/{job_id}/cancel"))
    _print_json(job) if as_json else console.print(job["state"])


@app.command()
def pause(job_id: str, as_json: Json = False) -> None:
    """Pause a job (it checkpoints and frees its resources)."""
    with _api() as c:
        job = _check(c.post(f"/v1/jobs/{job_id}/pause"))
    _print_json(job) if as_json else console.print(f"{job['state']} (requested: {job['control']})")


@app.command()
def resume(job_id: str, as_json: Json = False) -> None:
    """Resume a paused job from its last checkpoint."""
    with _api() as c:
        job = _check(c.post(f"/v1/jobs/{job_id}/resume"))
    _print_json(job) if as_json else console.print(job["state"])


@app.command()
def delete(
    job_id: str,
    keep_checkpoints: Annotated[bool, typer.Option(help="Keep the checkpoint files.")] = False,
) -> None:
    """Delete a finished job with its records, metrics, trajectories and checkpoints."""
    with _api() as c:
        _check(c.delete(f"/v1/jobs/{job_id}", params={"keep_checkpoints": keep_checkpoints}))
    console.print(f"deleted {job_id}")


# ---- schedule ----
@schedule_app.command("show")
def schedule_show(job_id: str, as_json: Json = False) -> None:
    """The current schedule and its versions."""
    with _api() as c:
        s = _check(c.get(f"/v1/jobs/{job_id}/reward-schedule"))
    if as_json:
        return _print_json(s)
    console.print(f"version {s['version']} (from step {s['effective_from']}): {json.dumps(s['schedule'])}")
    for v in s["history"][:-1]:
        console.print(f"  v{v['version']} from step {v['effective_from']}: {json.dumps(v['patch'] or v['schedule'])}")


def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


@schedule_app.command("set")
def schedule_set(
    job_id: str,
    fields: Annotated[list[str] | None, typer.Argument(help="FIELD=VALUE pairs, e.g. w_end=0 horizon=50.")] = None,
    file: Annotated[Path | None, typer.Option(help="A YAML/JSON object of schedule fields.")] = None,
    as_json: Json = False,
) -> None:
    """Change the schedule from the job's next step (a new version)."""
    patch: dict[str, Any] = dict(_load(file)) if file else {}
    for item in fields or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected FIELD=VALUE, got {item!r}")
        patch[key] = _parse_value(value)
    if not patch:
        raise typer.BadParameter("give FIELD=VALUE pairs or --file")
    with _api() as c:
        s = _check(c.patch(f"/v1/jobs/{job_id}/reward-schedule", json=patch))
    if as_json:
        return _print_json(s)
    console.print(f"version {s['version']} from step {s['effective_from']}: {json.dumps(s['schedule'])}")


# ---- environments ----
@env_app.command("register")
def env_register(file: Annotated[Path, typer.Argument(help="An EnvironmentRegistration (YAML or JSON).")],
                 as_json: Json = False) -> None:
    """Register a tool environment (python import path, http tool server or mcp server)."""
    with _api() as c:
        env = _check(c.post("/v1/environments", json=_load(file)))
    if as_json:
        return _print_json(env)
    console.print(f"registered [green]{env['name']}[/green] ({env['registration']['kind']})")


@env_app.command("list")
def env_list(as_json: Json = False) -> None:
    """Built-in and registered environments."""
    with _api() as c:
        envs = _check(c.get("/v1/environments"))
    if as_json:
        return _print_json(envs)
    table = Table("name", "kind", "detail")
    for e in envs:
        reg = e["registration"] or {}
        detail = reg.get("import_path") or reg.get("base_url") or ""
        table.add_row(e["name"], "built-in" if e["builtin"] else reg.get("kind", ""), detail)
    console.print(table)


@env_app.command("check")
def env_check(
    target: Annotated[str, typer.Argument(
        help="'package.module:Class', or the package or entry-point name of an installed environment.")],
    tasks: Annotated[int, typer.Option(min=1, max=1000, help="Tasks to generate and replay.")] = 8,
    seed: Annotated[int, typer.Option(help="Task generator seed.")] = 0,
    option: Annotated[list[str] | None, typer.Option(help="Environment option FIELD=VALUE (repeatable).")] = None,
) -> None:
    """Run an environment locally before registering it: generate tasks, replay each task's demonstration
    through its tools, score it with its outcome and process rewards; exit 1 on any problem."""
    from rollout_workers.environments.check import check_environment
    from rollout_workers.environments.registry import find_environment_class

    options = {}
    for pair in option or []:
        field, sep, raw = pair.partition("=")
        if not sep:
            raise typer.BadParameter(f"--option {pair!r}: expected FIELD=VALUE")
        options[field] = _parse_value(raw)
    try:
        report = check_environment(find_environment_class(target), n=tasks, seed=seed, options=options)
    except (ValueError, NotImplementedError) as exc:
        console.print(f"[red]error[/red] {escape(str(exc))}")
        raise typer.Exit(1) from None
    table = Table("task", "tool calls", "outcome", "process components per step", "problems",
                  title=f"environment {report.environment}: {tasks} tasks, seed {seed}")
    for t in report.tasks:
        steps = "; ".join(", ".join(f"{k}={v:.2f}" for k, v in c.items()) or "-" for c in t.process)
        outcome = "" if t.outcome is None else f"{t.outcome:.2f}"
        table.add_row(t.task_id, str(t.tool_calls), outcome, steps, escape("; ".join(t.problems)) or "[green]ok")
    console.print(table)
    for problem in report.problems:
        console.print(f"[red]problem[/red] {escape(problem)}")
    if not report.ok:
        raise typer.Exit(1)
    console.print(f"[green]ok[/green]: {len(report.tasks)} demonstrations earn the full outcome reward")


# ---- task files ----
@files_app.command("upload")
def files_upload(
    file: Annotated[Path, typer.Argument(help="A JSONL file: one task per line ({question | messages, answer?, ...}).")],
    purpose: Annotated[str, typer.Option(help="tasks or fine-tune.")] = "tasks",
    as_json: Json = False,
) -> None:
    """Upload a task file; prints its id (name it in a job's tasks.train_file / tasks.eval_file, or, for a file of
    demonstrations, warm_start.demonstrations)."""
    if not file.is_file():
        raise typer.BadParameter(f"{file} is not a file")
    with _api() as c, file.open("rb") as f:
        meta = _check(c.post("/v1/files", files={"file": (file.name, f, "application/jsonl")},
                             data={"purpose": purpose}, timeout=httpx.Timeout(30, write=None)))
    if as_json:
        return _print_json(meta)
    demos = f", {meta['demonstrations']} of them demonstrations" if meta.get("demonstrations") else ""
    console.print(f"{meta['id']}  ({meta['tasks']} tasks{demos}, {meta['bytes']} bytes)")


@files_app.command("list")
def files_list(as_json: Json = False) -> None:
    """Your task files, newest first."""
    with _api() as c:
        files = _check(c.get("/v1/files"))["data"]
    if as_json:
        return _print_json(files)
    table = Table("filename", "purpose", "tasks", "bytes")
    table.add_column("id", no_wrap=True, min_width=29)
    for f in files:
        table.add_row(f["filename"], f["purpose"], str(f["tasks"]), str(f["bytes"]), f["id"])
    console.print(table)


# ---- quotas ----
def _print_quota(q: dict[str, Any]) -> None:
    quota = q["quota"]
    source = "the operator's default" if q["default"] else "its own"
    console.print(f"tenant [bold]{q['tenant']}[/bold] ({source} quota)")
    for field in ("max_running_jobs", "max_queued_jobs", "max_priority", "max_chat_engines"):
        console.print(f"  {field}: {quota[field]}")
    caps = {k: v for k, v in quota["resources"].items() if v is not None}
    console.print("  resources: " + (", ".join(f"{k}={v}" for k, v in caps.items()) or "the operator's limits"))


@quota_app.command("show")
def quota_show(tenant: str, as_json: Json = False) -> None:
    """A tenant's quota."""
    with _api() as c:
        quota = _check(c.get(f"/v1/tenants/{tenant}/quota"))
    _print_json(quota) if as_json else _print_quota(quota)


@quota_app.command("set")
def quota_set(
    tenant: str,
    fields: Annotated[list[str], typer.Argument(
        help="FIELD=VALUE pairs: max_running_jobs, max_queued_jobs, max_priority, max_chat_engines, resources.learner_cpus, ... "
             "(resources.X=null drops a cap).")],
) -> None:
    """Change some fields of a tenant's quota (the others keep their current values)."""
    with _api() as c:
        quota = _check(c.get(f"/v1/tenants/{tenant}/quota"))["quota"]
        for item in fields:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise typer.BadParameter(f"expected FIELD=VALUE, got {item!r}")
            group, dot, name = key.partition(".")
            target = quota
            if dot:
                if group != "resources":
                    raise typer.BadParameter(f"unknown field {key!r}")
                target, key = quota["resources"], name
            target[key] = _parse_value(value)
        _print_quota(_check(c.put(f"/v1/tenants/{tenant}/quota", json=quota)))


@quota_app.command("reset")
def quota_reset(tenant: str) -> None:
    """Drop a tenant's own quota: the operator's default applies again."""
    with _api() as c:
        _check(c.delete(f"/v1/tenants/{tenant}/quota"))
    console.print(f"tenant {tenant} has the operator's default quota")


demo.register(app)
keys.register(app, console)
checkpoints.register(app, _api, _check, console)
graders.register(app, _api, _check, console)


if __name__ == "__main__":
    app()
