"""`taper checkpoints download JOB STEP`: fetch a checkpoint's model folder through the API (a streamed tar)
and unpack it, ready for `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`."""

from __future__ import annotations

import json
import tarfile
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console


def register(app: typer.Typer, api: Callable[[], AbstractContextManager[httpx.Client]],
             check: Callable[[httpx.Response], Any], console: Console) -> None:
    """Add `taper checkpoints` to the CLI; ``api`` opens a client, ``check`` turns an error answer into a
    one-line message and exit code."""
    checkpoints_app = typer.Typer(help="A job's checkpoints.", no_args_is_help=True)
    app.add_typer(checkpoints_app, name="checkpoints")

    @checkpoints_app.command("list")
    def list_checkpoints(job_id: str, as_json: Annotated[bool, typer.Option(
            "--json", help="Print the API's answer as JSON.")] = False) -> None:
        """The job's checkpoints (step, time)."""
        with api() as c:
            found = check(c.get(f"/v1/jobs/{job_id}/checkpoints"))
        if as_json:
            print(json.dumps(found))
            return
        for ckpt in found:
            console.print(f"step {ckpt['step']:>8}  {ckpt['ts']:.0f}")

    @checkpoints_app.command()
    def download(
        job_id: str,
        step: int,
        output: Annotated[Path, typer.Option("--output", "-o", help="Directory to unpack into.")] = Path("."),
    ) -> None:
        """Download checkpoint STEP of JOB_ID into OUTPUT/JOB_ID-step-STEP/."""
        folder = output / f"{job_id}-step-{step}"
        if folder.exists():
            console.print(f"[red]error[/red] {folder} exists; remove it or choose another --output")
            raise typer.Exit(1)
        output.mkdir(parents=True, exist_ok=True)
        with api() as c, tempfile.TemporaryFile(dir=output) as tmp:
            with c.stream("GET", f"/v1/jobs/{job_id}/checkpoints/{step}/download",
                          timeout=httpx.Timeout(30, read=300)) as r:
                if r.status_code >= 400:
                    r.read()
                    check(r)
                for chunk in r.iter_bytes(1 << 20):
                    tmp.write(chunk)
            tmp.seek(0)
            with tarfile.open(fileobj=tmp, mode="r:") as tar:
                tar.extractall(output, filter="data")  # no links, no paths outside `output`
        console.print(f"checkpoint {step} of {job_id} -> {folder}")
