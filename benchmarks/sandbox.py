"""Per-call cost of the python environment's sandbox: one small program run three ways.

  plain   `python -I -c CODE` as a subprocess with pipes, on the interpreter the sandbox uses: the floor
  bwrap   `run_python_async` in its default mode (bubblewrap, rlimits, pid-namespace kill)
  unsafe  `run_python_async` with TAPER_SANDBOX_MODE=unsafe-rlimits-only (a launcher stage, then exec)

The variants alternate call by call, so load from other processes on the machine falls on all three
alike. Wall time is what a tool call waits; on a busy machine it is mostly queueing for a CPU, so where
the benchmark may make a cgroup (root, with a cgroup-v1 `cpuacct` hierarchy or cgroup v2) it also
reports the CPU time each call used, all its processes and ours together. Prints a table (milliseconds)
and writes JSON with the machine.

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


# Not benchmarks.machine: it imports torch, and a parent holding torch makes every spawn dearer (measured on
# the idle box: 29.8 ms added per call instead of 8-9), which would be measured here as the sandbox's cost.
def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


class CpuMeter:
    """CPU time of this process and everything it starts, from a cgroup of our own (None if we cannot)."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.home: Path | None = None
        for root, usage in ((Path("/sys/fs/cgroup/cpuacct"), "cpuacct.usage"), (Path("/sys/fs/cgroup"), "cpu.stat")):
            if not (root / usage).exists() or os.geteuid() != 0:
                continue
            try:
                path = root / f"taper-bench-sandbox-{os.getpid()}"
                path.mkdir()
                (path / "cgroup.procs").write_text(str(os.getpid()))
            except OSError:
                continue
            self.path, self.home, self.usage = path, root, usage
            break

    def seconds(self) -> float | None:
        if self.path is None:
            return None
        text = (self.path / self.usage).read_text()
        if self.usage == "cpuacct.usage":
            return int(text) / 1e9
        return int(dict(line.split() for line in text.splitlines())["usage_usec"]) / 1e6

    def close(self) -> None:
        if self.path is not None and self.home is not None:
            (self.home / "cgroup.procs").write_text(str(os.getpid()))
            for _ in range(50):  # processes that left are counted out asynchronously
                try:
                    self.path.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


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


def stats(seconds: list[float], cpu_seconds: list[float]) -> dict[str, float | None]:
    ms = sorted(s * 1000 for s in seconds)
    return {"median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms),
            "p90_ms": ms[int(0.9 * (len(ms) - 1))], "min_ms": ms[0],
            "cpu_median_ms": statistics.median(cpu_seconds) * 1000 if cpu_seconds else None}


async def run(calls: int, warmup: int, meter: CpuMeter) -> dict[str, Any]:
    bwrap = sandbox.check_sandbox(sandbox.SandboxConfig())
    unsafe = sandbox.SandboxConfig(mode="unsafe-rlimits-only")
    python = sandbox._checked(bwrap, os.geteuid() == 0).python
    variants = {"plain": lambda: plain(python), "bwrap": lambda: sandboxed(bwrap), "unsafe": lambda: sandboxed(unsafe)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(warmup + calls):
        for name, call in variants.items():
            cpu_before = meter.seconds()
            t = await call()
            cpu_after = meter.seconds()
            if i >= warmup:
                times[name].append(t)
                if cpu_before is not None and cpu_after is not None:
                    cpu[name].append(cpu_after - cpu_before)
    results = {name: stats(times[name], cpu[name]) for name in variants}
    report: dict[str, Any] = {
        "code": CODE, "calls": calls, "sandbox_python": python, "worker_is_root": os.geteuid() == 0,
        "results": results,
        "bwrap_added_median_ms": results["bwrap"]["median_ms"] - results["plain"]["median_ms"],
        "unsafe_added_median_ms": results["unsafe"]["median_ms"] - results["plain"]["median_ms"],
    }
    if results["plain"]["cpu_median_ms"] is not None:
        report["bwrap_added_cpu_median_ms"] = results["bwrap"]["cpu_median_ms"] - results["plain"]["cpu_median_ms"]
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sandbox_overhead.json"))
    args = p.parse_args()

    load_before = os.getloadavg()[0]
    meter = CpuMeter()
    try:
        report = asyncio.run(run(args.calls, args.warmup, meter))
    finally:
        meter.close()
    bwrap_version = subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip()
    report["machine"] = {"cpu_model": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
                         "bwrap": bwrap_version, "load_average_1m_before": load_before,
                         "load_average_1m_after": os.getloadavg()[0]}
    m = report["machine"]
    print(f"{m['cpu_model']}, {m['cores']} cores, {m['bwrap']}; load average {load_before:.1f} -> "
          f"{m['load_average_1m_after']:.1f}; sandbox interpreter {report['sandbox_python']}")
    print(f"{'variant':8} {'median ms':>10} {'mean ms':>9} {'p90 ms':>8} {'min ms':>8} {'CPU ms (median)':>16}")
    for name, r in report["results"].items():
        cpu = "n/a" if r["cpu_median_ms"] is None else f"{r['cpu_median_ms']:.1f}"
        print(f"{name:8} {r['median_ms']:10.1f} {r['mean_ms']:9.1f} {r['p90_ms']:8.1f} {r['min_ms']:8.1f} {cpu:>16}")
    print(f"added per call (median wall): bwrap {report['bwrap_added_median_ms']:.1f} ms, "
          f"unsafe {report['unsafe_added_median_ms']:.1f} ms")
    if "bwrap_added_cpu_median_ms" in report:
        print(f"added per call (median CPU): bwrap {report['bwrap_added_cpu_median_ms']:.1f} ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
