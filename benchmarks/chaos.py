"""Chaos run: a real job on the tiny model while its parts are killed, then the invariants.

`python -m benchmarks.chaos --seeds 5 --faults 6` starts the service as an operator would on one machine
(`taper serve`, which starts its embedded Redis, Ray head and a detached scheduler process), submits a real
data-parallel RL job (two learner ranks, one vLLM rollout worker, calculator, tiny model) and, at job steps
drawn from the seed, SIGKILLs one of: the API, the scheduler process, the job driver, a rollout worker, a
learner rank, Redis. Only the API is started again by the harness, as systemd or Kubernetes would; the rest
is the service's own business (its supervisor restarts Redis on its port and the scheduler process; the
scheduler restarts a lost driver from its last checkpoint; the driver replaces workers and ranks). Twice
during the run the reward schedule is patched.

Each fault counts as survived when the job trains a step past the one it was killed at (or finishes) within
`--recovery-timeout` seconds; the time that took is its recovery time. At the end it checks:
- the job succeeded;
- every step 0..S-1 has exactly one metrics row;
- every step's trajectories are stored once: `prompts_per_step` groups of `num_generations`, no id twice;
- the schedule's versions are 1..3, in order, each effective from a later step than the one before;
- no orphan process: after `taper down` nothing this run started is left.

It prints a table per fault and a summary, and writes `benchmarks/results/chaos_recovery.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from api.cli.launcher import ApiServerProcess
from benchmarks.machine import describe, machine_info
from rl_service.control.local_services import EMBEDDED_RECORD
from rl_service.control.scheduler.driver import JobDriver
from rl_service.training.distributed import RankLearner
from rollout_workers.worker import RolloutEngineHost

FAULT_KINDS = ("api", "scheduler", "driver", "rollout_worker", "learner_rank", "redis")
# Ray names an actor's process after its class
ACTOR_TITLES = {"driver": f"ray::{JobDriver.__name__}", "rollout_worker": f"ray::{RolloutEngineHost.__name__}",
                "learner_rank": f"ray::{RankLearner.__name__}"}
RESULTS = Path(__file__).resolve().parent / "results"


def job_spec(steps: int, seed: int) -> dict[str, Any]:
    return {
        "name": f"chaos-{seed}",
        "model": {"preset": "tiny"},
        "environment": {"name": "calculator"},
        "tasks": {"seed": seed, "num_train": 2000, "num_eval": 16},
        "rollout": {"num_workers": 1, "prompts_per_step": 4, "num_generations": 4, "max_turns": 2,
                    "max_tokens_per_turn": 24, "max_total_tokens": 192, "kv_cache_gib": 0.25},
        "resources": {"num_learners": 2, "learner_cpus": 0.25, "rollout_cpus": 0.25},
        "reward_schedule": {"kind": "linear", "w_start": 1.0, "w_end": 0.0, "horizon": steps},
        "total_steps": steps,
        "checkpoint_every": 1,
        "keep_last_checkpoints": 2,
        "seed": seed,
    }


@dataclass
class Fault:
    kind: str
    at_step: int
    injected_s: float = 0.0  # since the run started
    step_at_kill: int | None = None
    detail: str = ""
    recovery_s: float | None = None  # None: not recovered within the timeout

    @property
    def survived(self) -> bool:
        return self.recovery_s is not None


@dataclass
class RunResult:
    seed: int
    faults: list[Fault] = field(default_factory=list)
    invariants: dict[str, str] = field(default_factory=dict)  # name -> "ok" or what broke
    wall_s: float = 0.0
    state: str = ""


class Service:
    """`taper serve` on one data dir, restarted when killed as a supervisor would."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.env = {**os.environ, "TAPER_DATA_DIR": str(data_dir), "RAY_ADDRESS": "", "OMP_NUM_THREADS": "1"}
        self.env.pop("TAPER_REDIS_URL", None)
        self.api: ApiServerProcess | None = None

    def start_api(self) -> None:
        self.api = ApiServerProcess(self.data_dir / "logs" / f"api-{time.monotonic_ns()}.log", env=self.env).start()

    def client(self) -> httpx.Client:
        key = (self.data_dir / "api-key").read_text().strip()
        assert self.api is not None
        return httpx.Client(base_url=self.api.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)

    def get(self, path: str, **params: Any) -> Any:
        """GET with retries: the API (or Redis behind it) may be down for a while."""
        deadline = time.monotonic() + 600
        while True:
            try:
                with self.client() as c:
                    r = c.get(path, params=params)
                if r.status_code == 200:
                    return r.json()
                if r.status_code not in (502, 503, 504):
                    raise RuntimeError(f"GET {path}: HTTP {r.status_code}: {r.text[:300]}")
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"GET {path}: no answer for 600 s")
            time.sleep(1.0)

    def recorded_pid(self, service: str) -> int:
        return json.loads((self.data_dir / EMBEDDED_RECORD).read_text())[service]["pid"]

    def record_processes(self, seen: dict[int, float]) -> None:
        """Add this service's processes (the API, the scheduler, Redis, the Ray head and everything under
        them: drivers, workers, ranks) to `seen` as pid -> create time."""
        roots = [self.api.proc.pid if self.api and self.api.proc else None]
        try:
            record = json.loads((self.data_dir / EMBEDDED_RECORD).read_text())
            roots += [record.get(name, {}).get("pid") for name in ("redis", "ray", "scheduler")]
        except (OSError, ValueError):
            pass
        for pid in filter(None, roots):
            try:
                root = psutil.Process(pid)
                for p in [root, *root.children(recursive=True)]:
                    seen[p.pid] = p.create_time()
            except psutil.NoSuchProcess:
                continue

    def kill(self, kind: str, rng: random.Random) -> str:
        """SIGKILL one part (the API is started again, as its supervisor would). Returns what was killed."""
        if kind == "api":
            assert self.api is not None
            pid = self.api.proc.pid if self.api.proc else 0
            self.api.kill()
            self.start_api()
            return f"API pid {pid}"
        if kind in ("scheduler", "redis"):
            pid = self.recorded_pid(kind)
            os.kill(pid, signal.SIGKILL)
            _wait_gone(pid)
            return f"{kind} pid {pid}"
        victims = [p for p in psutil.process_iter(["pid", "cmdline"])
                   if (p.info["cmdline"] or [""])[0].startswith(ACTOR_TITLES[kind])]
        if not victims:
            raise RuntimeError(f"no {ACTOR_TITLES[kind]} process to kill")
        victim = rng.choice(victims)
        title = victim.info["cmdline"][0]
        victim.send_signal(signal.SIGKILL)
        return f"{title} pid {victim.pid}"

    def down(self) -> None:
        """`taper down`: the API, the scheduler, the Ray head and Redis."""
        subprocess.run([sys.executable, "-m", "api.cli", "down"], env=self.env, capture_output=True, timeout=300)


def _wait_gone(pid: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        if time.monotonic() > deadline:
            raise RuntimeError(f"pid {pid} did not exit")
        time.sleep(0.1)


def still_running(seen: dict[int, float]) -> list[str]:
    out = []
    for pid, created in seen.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{pid} {' '.join(p.cmdline())[:60]}")
        except psutil.NoSuchProcess:
            continue
    return out


def plan(seed: int, faults: int, steps: int) -> list[Fault]:
    """Fault kinds cycle through all six in a seeded order; steps drawn without repeats from [2, steps - 3]."""
    rng = random.Random(seed)
    kinds = [k for _ in range(-(-faults // len(FAULT_KINDS))) for k in rng.sample(FAULT_KINDS, len(FAULT_KINDS))]
    at = sorted(rng.sample(range(2, steps - 2), faults))
    return [Fault(kind, s) for kind, s in zip(kinds[:faults], at, strict=True)]


def run(seed: int, faults: int, steps: int, recovery_timeout: float, work: Path) -> RunResult:
    result = RunResult(seed)
    data_dir = work / f"seed{seed}"
    (data_dir / "logs").mkdir(parents=True)
    service = Service(data_dir)
    seen: dict[int, float] = {}
    rng = random.Random(seed + 1)
    start = time.monotonic()
    try:
        service.start_api()
        spec = job_spec(steps, seed)
        with service.client() as c:
            r = c.post("/v1/jobs", json=spec)
            r.raise_for_status()
            job_id = r.json()["id"]
        patches = {steps // 3: {"w_end": 0.2}, 2 * steps // 3: {"kind": "cosine"}}
        pending = plan(seed, faults, steps)
        for fault in pending:
            job = _wait_step(service, job_id, fault.at_step, patches, seen)
            if job["state"] in ("succeeded", "failed", "cancelled"):
                fault.detail = f"not injected: job {job['state']} first"
                continue
            fault.step_at_kill = int(job["step"])
            fault.injected_s = round(time.monotonic() - start, 1)
            kill_t = time.monotonic()
            fault.detail = service.kill(fault.kind, rng)
            print(f"  seed {seed}: {fault.kind} killed at step {fault.step_at_kill} ({fault.detail})", flush=True)
            try:
                _wait_step(service, job_id, fault.step_at_kill + 1, patches, seen, timeout=recovery_timeout)
                fault.recovery_s = round(time.monotonic() - kill_t, 1)
            except TimeoutError:
                pass
            result.faults.append(fault)
        job = _wait_step(service, job_id, steps + 1, patches, seen, timeout=1800)
        result.state = job["state"]
        result.wall_s = round(time.monotonic() - start, 1)
        result.invariants = check_invariants(service, job_id, spec)
    finally:
        service.record_processes(seen)
        service.down()
    time.sleep(2.0)
    orphans = still_running(seen)
    result.invariants["no orphan process"] = "ok" if not orphans else f"left running: {orphans[:5]}"
    return result


def _wait_step(service: Service, job_id: str, step: int, patches: dict[int, dict[str, Any]],
               seen: dict[int, float], timeout: float = 1800) -> dict[str, Any]:
    """Poll until the job has trained `step` steps or finished; apply due schedule patches on the way and
    note the service's processes."""
    deadline = time.monotonic() + timeout
    while True:
        service.record_processes(seen)
        job = service.get(f"/v1/jobs/{job_id}")
        for at in [a for a in patches if job["step"] >= a]:
            with service.client() as c:
                r = c.patch(f"/v1/jobs/{job_id}/reward-schedule", json=patches.pop(at))
            if r.status_code >= 400:
                raise RuntimeError(f"schedule patch failed: HTTP {r.status_code} {r.text[:300]}")
        if job["step"] >= step or job["state"] in ("succeeded", "failed", "cancelled"):
            return job
        if time.monotonic() > deadline:
            raise TimeoutError(f"job at step {job['step']} after {timeout:.0f} s (waiting for {step})")
        time.sleep(1.0)


def check_invariants(service: Service, job_id: str, spec: dict[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    steps, rollout = spec["total_steps"], spec["rollout"]
    job = service.get(f"/v1/jobs/{job_id}")
    out["job succeeded"] = "ok" if job["state"] == "succeeded" else f"state {job['state']}: {job.get('error')}"
    rows = service.get(f"/v1/jobs/{job_id}/metrics", limit=100000)["items"]
    counts = Counter(int(r["step"]) for r in rows if "time/step" in r["metrics"])  # evaluations have rows too
    first = min(counts, default=0)
    wrong = {s: n for s, n in counts.items() if n != 1}
    missing = sorted(set(range(first, first + steps)) - set(counts))
    out["each step trained once"] = "ok" if not wrong and not missing and len(counts) == steps else (
        f"repeated {wrong}, missing {missing}")
    problems = []
    for step in range(steps):
        items = service.get(f"/v1/jobs/{job_id}/trajectories", step=step, limit=200)["items"]
        groups = Counter(t["group_id"] for t in items)
        ids = Counter(t["id"] for t in items)
        if len(groups) != rollout["prompts_per_step"] or set(groups.values()) != {rollout["num_generations"]} or (
                max(ids.values(), default=1) > 1):
            problems.append(f"step {step}: {len(groups)} groups of sizes {sorted(set(groups.values()))}")
    out["trajectory groups stored once"] = "ok" if not problems else "; ".join(problems[:5])
    history = service.get(f"/v1/jobs/{job_id}/reward-schedule")["history"]
    versions = [v["version"] for v in history]
    starts = [v["effective_from"] for v in history]
    out["schedule versions intact"] = "ok" if versions == [1, 2, 3] and starts == sorted(set(starts)) else (
        f"versions {versions} from steps {starts}")
    return out


def print_tables(results: list[RunResult]) -> None:
    print(f"\n{'seed':>4} {'kind':<15} {'step':>4} {'at s':>7} {'recovery s':>10}  what")
    for r in results:
        for f in r.faults:
            rec = f"{f.recovery_s:.1f}" if f.survived else "NOT"
            print(f"{r.seed:>4} {f.kind:<15} {f.step_at_kill!s:>4} {f.injected_s:>7.1f} {rec:>10}  {f.detail}")
    print(f"\n{'seed':>4} {'state':<10} {'wall s':>7} {'survived':>9}  invariants")
    for r in results:
        broken = {k: v for k, v in r.invariants.items() if v != "ok"}
        survived = sum(f.survived for f in r.faults)
        print(f"{r.seed:>4} {r.state:<10} {r.wall_s:>7.1f} {survived:>4}/{len(r.faults):<4}  "
              f"{'all hold' if not broken else broken}")
    total = sum(len(r.faults) for r in results)
    ok = sum(f.survived for r in results for f in r.faults)
    print(f"\nfaults injected {total}, survived {ok}; runs with every invariant: "
          f"{sum(all(v == 'ok' for v in r.invariants.values()) for r in results)}/{len(results)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--faults", type=int, default=6, help="faults per run")
    parser.add_argument("--steps", type=int, default=24, help="the job's total_steps")
    parser.add_argument("--recovery-timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "chaos_recovery.json")
    args = parser.parse_args()
    if args.steps < args.faults + 5:
        parser.error("--steps must be at least --faults + 5 (faults fall on distinct steps in [2, steps - 3])")
    results = []
    with tempfile.TemporaryDirectory(prefix="taper-chaos-") as work:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            print(f"seed {seed}: {args.faults} faults over {args.steps} steps", flush=True)
            results.append(run(seed, args.faults, args.steps, args.recovery_timeout, Path(work)))
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items() if k != "out"},
                                            "runs": [asdict(r) for r in results]}, indent=1))
    print(f"machine: {describe(machine_info())}")
    print_tables(results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
