"""`python` (as OpenAI's): the tenant's `grade(sample, item) -> float` run in the OS sandbox that runs
model-written code (rollout_workers.environments.sandbox: no network, no host files, memory and CPU limits
per call, wall-clock kill), never in the scorer's process. The limits asked for are capped by the operator's maxima."""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import json
import math
from typing import Any, Literal

from pydantic import Field, field_validator

from reward_models.graders.base import GradeContext, GraderSpec
from reward_models.graders.template import GraderError
from rollout_workers.environments.sandbox import SandboxLimits, SandboxResult, run_python_async

SCORE_MARKER = "__taper_grader_score__"
MAX_SOURCE_CHARS = 64 * 1024
_HARNESS = f"""

def __taper_main():
    import json, sys
    data = json.loads(sys.stdin.read())
    score = grade(data["sample"], data["item"])
    print("\\n{SCORE_MARKER}" + json.dumps(float(score)))

__taper_main()
"""


class PythonGrader(GraderSpec):
    type: Literal["python"] = "python"
    source: str = Field(max_length=MAX_SOURCE_CHARS, description="Python defining grade(sample, item) -> float.")
    cpu_seconds: int = Field(5, ge=1, le=3600)
    memory_mb: int = Field(256, ge=16, le=65536)
    wall_seconds: float = Field(10.0, gt=0.0, le=3600.0)

    @field_validator("source")
    @classmethod
    def _compiles(cls, source: str) -> str:
        """Compiled (never run) here, so a grader that cannot run is refused when declared, naming the line."""
        try:
            tree = ast.parse(source, "<grader>")
        except SyntaxError as e:
            raise ValueError(f"does not compile: line {e.lineno}: {e.msg}") from None
        except (ValueError, RecursionError, MemoryError) as e:
            raise ValueError(f"does not compile: {type(e).__name__}") from None
        grade = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == "grade"]
        if not grade or isinstance(grade[-1], ast.AsyncFunctionDef):
            raise ValueError("must define grade(sample, item) at the top level")
        args = grade[-1].args
        if len(args.posonlyargs) + len(args.args) < 2 and args.vararg is None:
            raise ValueError("grade(sample, item) takes two arguments")
        return source

    def limits(self, ctx: GradeContext) -> SandboxLimits:
        cap = ctx.python_max
        return SandboxLimits(
            cpu_seconds=min(self.cpu_seconds, cap.cpu_seconds),
            memory_bytes=min(self.memory_mb, cap.memory_mb) * 1024 * 1024,
            wall_seconds=min(self.wall_seconds, cap.wall_seconds),
            output_bytes=64 * 1024,
        )

    def grade(self, item: dict[str, Any], sample: dict[str, Any], ctx: GradeContext) -> float:
        stdin = json.dumps({"item": item, "sample": sample}, default=str)
        result = _run(self.source + _HARNESS, self.limits(ctx), stdin)
        return parse_score(result, self.name)


def _run(code: str, limits: SandboxLimits, stdin: str) -> SandboxResult:
    coro = run_python_async(code, limits, stdin)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # called from inside an event loop
        return pool.submit(asyncio.run, coro).result()


def parse_score(result: SandboxResult, name: str) -> float:
    if result.exceeded is not None:
        raise GraderError(f"python grader {name!r}: killed at the call's {result.exceeded} limit")
    if result.timed_out:
        raise GraderError(f"python grader {name!r}: killed at the wall-clock limit")
    lines = [line for line in result.stdout.splitlines() if line.startswith(SCORE_MARKER)]
    if result.exit_code != 0 or not lines:
        tail = result.stderr.strip().splitlines()[-1:] or [f"exit code {result.exit_code}"]
        raise GraderError(f"python grader {name!r}: grade() gave no score ({tail[0][:300]})")
    try:
        score = float(json.loads(lines[-1][len(SCORE_MARKER):]))
    except (ValueError, TypeError):
        raise GraderError(f"python grader {name!r}: grade() did not return a number") from None
    if not math.isfinite(score):
        raise GraderError(f"python grader {name!r}: grade() returned {score}")
    return score
