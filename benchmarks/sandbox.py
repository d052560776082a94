"""Per-call cost of the python environment's sandbox: one small program run three ways.

  plain   `python -I -c CODE` as a subprocess with pipes, on the interpreter the sandbox uses: the floor
  bwrap   `run_python_async` in its default mode (bubblewrap, rlimits, pid-namespace kill)
  unsafe  `run_python_async` with TAPER_SANDBOX_MODE=unsafe-rlimits-only (a launcher stage, then exec)

The variants alternate call by call, so load from other processes on the machine falls on all three
alike. Prints a table (milliseconds) and writes JSON with the machine.

    python benchmarks/sandbox.py --calls 40   (from the repository root)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from rollout_workers.environments import sandbox

ROOT = Path(__file__).resolve().parents[1]
CODE = "print(sum(i * i for i in range(1000)))"
EXPECTED = f"{sum(i * i for i in range(1000))}\n"


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


async def plain(python: str) -> float:
    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(python, "-I", "-c", CODE, stdin=subprocess.DEVNULL,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={})
    out, _ = await proc.communicate()
    assert out.decode() == EXPECTED
    return time.perf_counter() - start


async def sandboxed(config: sandbox.SandboxConfig) -> float:
    start = time.perf_counter()
    result = await sandbox.run_python_async(CODE, config=config)
    assert result.stdout == EXPECTED, result
    return time.perf_counter() - start


def stats(seconds: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in seconds)
    return {"median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms),
            "p90_ms": ms[int(0.9 * (len(ms) - 1))], "min_ms": ms[0]}


async def run(calls: int, warmup: int) -> dict[str, Any]:
    bwrap = sandbox.check_sandbox(sandbox.SandboxConfig())
    unsafe = sandbox.SandboxConfig(mode="unsafe-rlimits-only")
    python = sandbox._checked(bwrap, os.geteuid() == 0).python
    variants = {"plain": lambda: plain(python), "bwrap": lambda: sandboxed(bwrap), "unsafe": lambda: sandboxed(unsafe)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(warmup + calls):
        for name, call in variants.items():
            t = await call()
            if i >= warmup:
                times[name].append(t)
    results = {name: stats(t) for name, t in times.items()}
    return {"code": CODE, "calls": calls, "sandbox_python": python, "worker_is_root": os.geteuid() == 0,
            "results": results,
            "bwrap_added_median_ms": results["bwrap"]["median_ms"] - results["plain"]["median_ms"],
            "unsafe_added_median_ms": results["unsafe"]["median_ms"] - results["plain"]["median_ms"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sandbox_cpu.json"))
    args = p.parse_args()

    load_before = os.getloadavg()[0]
    report = asyncio.run(run(args.calls, args.warmup))
    bwrap_version = subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip()
    report["machine"] = {"cpu_model": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
                         "bwrap": bwrap_version, "load_average_1m_before": load_before,
                         "load_average_1m_after": os.getloadavg()[0]}
    m = report["machine"]
    print(f"{m['cpu_model']}, {m['cores']} cores, {m['bwrap']}; load average {load_before:.1f} -> "
          f"{m['load_average_1m_after']:.1f}; sandbox interpreter {report['sandbox_python']}")
    print(f"{'variant':8} {'median ms':>10} {'mean ms':>9} {'p90 ms':>8} {'min ms':>8}")
    for name, r in report["results"].items():
        print(f"{name:8} {r['median_ms']:10.1f} {r['mean_ms']:9.1f} {r['p90_ms']:8.1f} {r['min_ms']:8.1f}")
    print(f"added per call (median): bwrap {report['bwrap_added_median_ms']:.1f} ms, "
          f"unsafe {report['unsafe_added_median_ms']:.1f} ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
