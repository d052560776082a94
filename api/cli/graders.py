"""`taper graders validate FILE` and `taper graders run FILE`: try a declared grader (the `grader` of a job or a
registration: string_check, text_similarity, numeric, regex, json_match, python, http, multi) on sample answers
through the API's /v1/fine_tuning/alpha/graders routes, before a job spends GPU time on it."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rl_service.spec import read_spec_file

ROUTE = "/v1/fine_tuning/alpha/graders"


def load_grader(path: Path) -> dict[str, Any]:
    """The grader in a YAML or JSON file: the grader itself, or any mapping holding one under `grader` (a
    registration), `environment.grader` (a job spec) or `method.reinforcement.grader` (an OpenAI create)."""
    try:
        data = read_spec_file(path)
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc}") from None
    except ValueError as exc:  # YAML and JSON errors both
        raise typer.BadParameter(f"{path} does not parse: {exc}") from None
    for keys in (("grader",), ("environment", "grader"), ("method", "reinforcement", "grader")):
        node: Any = data
        for key in keys:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            return node
    if isinstance(data, dict) and "type" in data:
        return data
    raise typer.BadParameter(f"{path}: no grader in it (a mapping with a `type`, or one under `grader`)")


def load_samples(path: Path) -> list[dict[str, Any]]:
    """Samples in a JSONL file: {"model_sample": TEXT, "item": {...}} per line (`item` optional)."""
    samples = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            sample = json.loads(line)
        except ValueError as exc:
            raise typer.BadParameter(f"{path} line {number}: not JSON ({exc})") from None
        if not isinstance(sample, dict) or not isinstance(sample.get("model_sample"), str):
            raise typer.BadParameter(f"{path} line {number}: expected {{\"model_sample\": TEXT, \"item\": {{...}}}}")
        samples.append({"model_sample": sample["model_sample"], "item": sample.get("item") or {}})
    if not samples:
        raise typer.BadParameter(f"{path}: no samples")
    return samples


def _failure(result: dict[str, Any]) -> str:
    errors = result["metadata"]["errors"]
    kinds = [k for k, v in errors.items() if v is True]
    details = errors.get("python_grader_runtime_error_details") or errors.get("other_error_details") or ""
    return ", ".join(kinds) + (f": {details}" if details else "")


def register(app: typer.Typer, api: Callable[[], AbstractContextManager[httpx.Client]],
             check: Callable[[httpx.Response], Any], console: Console) -> None:
    graders_app = typer.Typer(help="Try a grader on sample answers before a job uses it.", no_args_is_help=True)
    app.add_typer(graders_app, name="graders")

    @graders_app.command("validate")
    def validate(file: Annotated[Path, typer.Argument(help="A grader (YAML or JSON), or a job spec or "
                                                          "registration that declares one.")],
                 as_json: Annotated[bool, typer.Option("--json", help="Print the API's answer as JSON.")] = False,
                 ) -> None:
        """Check a grader as a job would (a python grader must compile); exit 1 naming the field if not."""
        grader = load_grader(file)
        with api() as c:
            checked = check(c.post(f"{ROUTE}/validate", json={"grader": grader}))["grader"]
        if as_json:
            print(json.dumps(checked))
            return
        console.print(f"[green]ok[/green]: {escape(checked['type'])} grader {escape(checked.get('name', ''))!r}")

    @graders_app.command("run")
    def run(
        file: Annotated[Path, typer.Argument(help="A grader (YAML or JSON), or a spec that declares one.")],
        sample: Annotated[list[str] | None, typer.Option(help="A final answer to score (repeatable).")] = None,
        item: Annotated[str | None, typer.Option(help="The task as JSON, e.g. '{\"answer\": \"4\"}'.")] = None,
        samples: Annotated[Path | None, typer.Option(help="JSONL of {model_sample, item} to score.")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="One JSON answer per line.")] = False,
    ) -> None:
        """Score sample answers with a grader: the reward a job would train on, each sub-grader's score and
        what failed; exit 1 when the grader failed on any sample."""
        grader = load_grader(file)
        try:
            task = json.loads(item) if item is not None else {}
        except ValueError as exc:
            raise typer.BadParameter(f"--item: not JSON ({exc})") from None
        if not isinstance(task, dict):
            raise typer.BadParameter("--item: a JSON object")
        todo = [{"model_sample": s, "item": task} for s in sample or []]
        todo += load_samples(samples) if samples is not None else []
        if not todo:
            raise typer.BadParameter("give --sample TEXT or --samples FILE.jsonl")
        table = Table("#", "sample", "reward", "sub-rewards", "problem", title=f"grader {grader.get('name', '')}")
        failed = 0
        with api() as c:
            for i, s in enumerate(todo, start=1):
                result = check(c.post(f"{ROUTE}/run", json={"grader": grader, **s}, timeout=httpx.Timeout(600)))
                problem = _failure(result)
                failed += bool(problem)
                if as_json:
                    print(json.dumps(result))
                    continue
                subs = ", ".join(f"{k}={v:.3g}" for k, v in result["sub_rewards"].items())
                table.add_row(str(i), escape(s["model_sample"][:60]), f"{result['reward']:.3g}", subs,
                              escape(problem) or "[green]-")
        if not as_json:
            console.print(table)
        if failed:
            console.print(f"[red]error[/red] the grader failed on {failed} of {len(todo)} samples")
            raise typer.Exit(1)
