"""`taper demo`: the whole service on one machine, for real.

Starts the embedded defaults (a private Redis, the API server with a local Ray), warm-starts the tiny model
by supervised fine-tuning on gold calculator traces, submits an RL job over the REST API with a linear
process-reward decay, follows it, patches the schedule once mid-run, and writes a report. The demo acts as
the operator too: its warm start is a base model it offers to tenants (`TAPER_BASE_MODELS`), which the job
names as `base:demo-warmstart`, as a tenant would.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from api.cli.launcher import ApiServerProcess
from rl_service.control.local_services import RedisServer, ensure_embedded_redis, stop_embedded
from rl_service.control.settings import TaperSettings


@dataclass
class DemoConfig:
    """What the demo runs, sized for a 2-core CPU."""

    out_dir: Path = Path("taper_data/demo")
    # Warm start, phase 1: gold traces (every question answered through the calculator) until the model can
    # copy the expression into a call and the tool's result into the answer: the loss falls steeply once it
    # can (after ~100-200 steps, depending on the seed), so this phase runs until the loss (mean of the last
    # 10 steps) is under `sft_target_loss`, `sft_steps` at most.
    sft_steps: int = 400
    sft_target_loss: float = 0.05
    sft_examples: int = 2000
    # Phase 2: a short fine-tune on a mix where only `tool_use_fraction` of the traces use the tool and the
    # rest answer from memory (which a model this small cannot do). The warm start then calls the calculator
    # on about that fraction of questions; RL has to learn that calling it pays.
    mixed_sft_steps: int = 40
    tool_use_fraction: float = 0.25
    rl_steps: int = 20
    prompts_per_step: int = 4
    num_generations: int = 8
    eval_tasks: int = 50
    patch_at_step: int | None = None  # default: half-way
    seed: int = 0
    # "cuda": the learner and the rollout engine share this machine's first GPU; "auto": "cuda" where there is one
    device: str = "auto"


# One GPU shared (Ray's GPU shares): the learner's half and the engine's 0.4 of the device's memory.
SHARED_GPU_RESOURCES = {"learner_gpus": 0.5, "rollout_gpus": 0.4}


def resolve_device(device: str) -> str:
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


# The LR schedule and rollout/learner mismatch correction the demo's and the benchmarks' results were measured
# with (Taper's defaults before the algorithm block took TRL's): constant LR, per-token IS ratio truncated at 2.
MEASURED_ALGORITHM: dict[str, Any] = {"lr_scheduler_type": "constant", "vllm_importance_sampling_mode": "token_truncate",
                                      "vllm_importance_sampling_clip_max": 2.0}


def warm_start_spec(cfg: DemoConfig) -> dict[str, Any]:
    """The job's warm start: gold traces until the loss target, then the mix that rarely uses the tool."""
    mixed = ({"steps": cfg.mixed_sft_steps, "tool_use_fraction": cfg.tool_use_fraction, "learning_rate": 1e-3}
             if cfg.mixed_sft_steps else None)
    return {"num_examples": cfg.sft_examples, "max_steps": cfg.sft_steps, "until_loss": cfg.sft_target_loss,
            "learning_rate": 3e-3, "batch_size": 16, "mixed_phase": mixed}


def demo_job_spec(cfg: DemoConfig) -> dict[str, Any]:
    return {
        "name": "demo-calculator",
        "model": {"preset": "tiny"},
        "warm_start": warm_start_spec(cfg),
        "environment": {"name": "calculator"},
        "tasks": {"seed": cfg.seed, "num_train": 5000, "num_eval": cfg.eval_tasks},
        "algorithm": {"loss_type": "dapo", "learning_rate": 5e-4, "beta": 0.0, "scale_rewards": "group",
                      **MEASURED_ALGORITHM},
        "rollout": {
            "num_workers": 1,
            "prompts_per_step": cfg.prompts_per_step,
            "num_generations": cfg.num_generations,
            "max_turns": 3,
            "max_tokens_per_turn": 48,
            "max_total_tokens": 256,
            "temperature": 0.6,
        },
        "reward_schedule": {"kind": "linear", "w_start": 0.5, "w_end": 0.0, "horizon": cfg.rl_steps},
        "total_steps": cfg.rl_steps,
        "checkpoint_every": max(cfg.rl_steps // 3, 1),
        "eval_every": max(cfg.rl_steps // 4, 5),
        "seed": cfg.seed,
        **({"resources": SHARED_GPU_RESOURCES} if resolve_device(cfg.device) == "cuda" else {}),
    }


class EmbeddedService:
    """The embedded defaults of a data dir (a private Redis and a local Ray head) and the API server as a
    subprocess (with the operator settings in `env`); all of them are stopped on exit."""

    def __init__(self, data_dir: Path, console: Console, env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir.resolve()
        self.console = console
        self.env = dict(env or {})
        self.redis: RedisServer | None = None
        self.api: ApiServerProcess | None = None
        self.url = ""

    def __enter__(self) -> EmbeddedService:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.redis = ensure_embedded_redis(self.data_dir)
            # the server finds this Redis (and its password) in the data dir, and starts or finds its Ray head
            self.api = ApiServerProcess(self.data_dir / "api.log", env={**self.env, "TAPER_DATA_DIR": str(self.data_dir)})
            self.api.env.pop("TAPER_REDIS_URL", None)
            self.api.start()
        except BaseException:
            stop_embedded(self.data_dir)
            raise
        self.url = self.api.url
        return self

    def __exit__(self, *exc: object) -> None:
        if self.api is not None:
            self.api.stop()
        stop_embedded(self.data_dir)

    def create_key(self) -> str:
        from rl_service.control.store import Store

        assert self.redis is not None
        return Store(self.redis.client_url).create_api_key("demo", name="demo")


def fetch_metrics(client: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    rows = client.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 100000}).raise_for_status().json()["items"]
    return [{**r["metrics"], "step": r["step"]} for r in rows]


def follow_job(client: httpx.Client, job_id: str, cfg: DemoConfig,
               console: Console) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Show a progress bar until the job ends; patch the schedule once half-way.
    Returns the metrics and the patch that was sent (with the step it was sent after)."""
    patch_at = cfg.patch_at_step if cfg.patch_at_step is not None else cfg.rl_steps // 2
    patched: dict[str, Any] | None = None
    metrics: list[dict[str, Any]] = []
    columns = [TextColumn("[bold]RL"), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("rl", total=cfg.rl_steps, info="starting")
        warm_started = False
        while True:
            job = client.get(f"/v1/jobs/{job_id}").raise_for_status().json()
            metrics = fetch_metrics(client, job_id)
            train = [m for m in metrics if "success_rate" in m]
            if not warm_started:
                warm_started = _show_warm_start(client, job_id, progress, bar)
            if train:
                last = train[-1]
                done = int(last["step"]) + 1  # rows count steps from 0
                progress.update(bar, completed=done, info=(
                    f"success {last.get('success_rate', 0):.0%}  w={last.get('schedule/weight', 0):.2f} "
                    f"(v{int(last.get('schedule/version', 1))})  {last.get('rollout/tokens_per_s', 0):.0f} tok/s"))
                if patched is None and done >= patch_at:
                    body = {"kind": "linear", "w_start": float(last.get("schedule/weight", 0.25)), "w_end": 0.0,
                            "horizon": max(cfg.rl_steps // 4, 1)}
                    client.patch(f"/v1/jobs/{job_id}/reward-schedule", json=body).raise_for_status()
                    progress.console.print(f"patched the reward schedule after {done} steps: "
                                           f"faster decay to 0 over {body['horizon']} steps")
                    patched = {"after_step": done, "schedule": body}
            if job["state"] in ("succeeded", "failed", "cancelled"):
                if job["state"] != "succeeded":
                    raise RuntimeError(f"job {job_id} ended {job['state']}: {job.get('error')}")
                return metrics, patched
            time.sleep(0.5)


def _show_warm_start(client: httpx.Client, job_id: str, progress: Progress, bar: Any) -> bool:
    """The job's warm-start phase on the progress bar; prints its result once it is done (then True)."""
    events = client.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}).raise_for_status().json()["items"]
    done = [e["data"] for e in events if e["kind"] == "warm_start_done"]
    if done:
        progress.console.print(f"warm-start done: SFT loss {done[0]['loss']:.3f} after {done[0]['sft_steps']} steps "
                               f"({done[0]['seconds']:.0f} s)")
        return True
    steps = [e["data"] for e in events if e["kind"] == "warm_start_progress"]
    if steps:
        progress.update(bar, info=f"warm start: SFT step {steps[-1]['sft_step']}, loss {steps[-1]['loss']:.3f}")
    return False


def run_demo(cfg: DemoConfig, console: Console | None = None) -> dict[str, Any]:
    from api.cli.report import render_html, render_plots

    console = console or Console()
    started = time.monotonic()
    out = cfg.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    settings = TaperSettings(data_dir=out / "service")
    with EmbeddedService(settings.data_dir, console) as service:
        console.print(f"API on {service.url} (OpenAPI at {service.url}/docs), private Redis, local Ray")
        key = service.create_key()
        client = httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        job = client.post("/v1/jobs", json=demo_job_spec(cfg)).raise_for_status().json()
        job_id = job["id"]
        console.print(f"submitted RL job {job_id}")
        metrics, patch = follow_job(client, job_id, cfg, console)
        events = client.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}).raise_for_status().json()["items"]
        trajs_raw = client.get(f"/v1/jobs/{job_id}/trajectories", params={"limit": 6}).raise_for_status().json()["items"]
    from rollout_workers.trajectory import Trajectory

    evals = [m for m in metrics if "eval/success_rate" in m]
    before, after = evals[0], evals[-1]
    changes = [(int(e["data"].get("step", 0)), f"v{e['data'].get('version')}")
               for e in events if e["kind"] == "schedule_applied"]
    report_dir = out / "report"
    plots = render_plots(metrics, report_dir, schedule_changes=changes)
    summary = {
        "held-out success before RL": f"{before['eval/success_rate']:.1%}",
        "held-out success after RL": f"{after['eval/success_rate']:.1%}",
        "gain (points)": f"{100 * (after['eval/success_rate'] - before['eval/success_rate']):.1f}",
        "outcome reward before / after": f"{before.get('eval/outcome_mean', 0):.3f} / {after.get('eval/outcome_mean', 0):.3f}",
        "RL steps": cfg.rl_steps,
        "wall time (s)": f"{time.monotonic() - started:.0f}",
    }
    page = render_html(report_dir, f"Taper demo: job {job_id}", summary, plots,
                       [Trajectory.model_validate(t) for t in trajs_raw])
    (report_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    for k, v in summary.items():
        console.print(f"  {k}: [bold]{v}[/bold]")
    console.print(f"report: {page}")
    return {"job_id": job_id, "summary": summary, "metrics": metrics, "events": events, "report": page,
            "report_dir": report_dir, "patch": patch,
            "before": before["eval/success_rate"], "after": after["eval/success_rate"]}


def register(app: typer.Typer) -> None:
    """Add `taper demo` to the CLI."""

    @app.command()
    def demo(
        steps: int = typer.Option(DemoConfig.rl_steps, help="RL steps."),
        out: Path = typer.Option(DemoConfig.out_dir, help="Where the report and service data go."),
        seed: int = typer.Option(0, help="Seed for tasks, model init and sampling."),
        device: str = typer.Option("auto", help="cpu, cuda (the learner and the engine share the first GPU) or "
                                   "auto (cuda where there is a GPU)."),
    ) -> None:
        """Run the main job end to end on this machine and write a report."""
        console = Console()
        try:
            result = run_demo(DemoConfig(out_dir=out, rl_steps=steps, seed=seed, device=resolve_device(device)),
                              console)
        except ValueError as e:
            console.print(f"[red]demo failed:[/red] {e}")
            raise typer.Exit(2) from None
        except (RuntimeError, httpx.HTTPStatusError) as e:
            console.print(f"[red]demo failed:[/red] {e}")
            raise typer.Exit(1) from None
        gain = 100 * (result["after"] - result["before"])
        console.print(f"[bold green]held-out success {result['before']:.1%} -> {result['after']:.1%} "
                      f"({gain:+.1f} points)[/bold green]")
