"""API latency and throughput under load, from a second process on loopback.

    python benchmarks/api.py                       # embedded: private Redis + `taper serve` subprocess
    python benchmarks/api.py --url URL --key KEY   # an already running API

Phases (open loop: requests are started on a fixed schedule, whether or not earlier ones returned, and
latency counts from the scheduled start, so a stalled server cannot hide its queueing):

1. status reads (GET /v1/jobs/{id}) at --rate for --seconds, with a job training in the background
   (--job-spec; default a tiny-model calculator job; measured once it has finished --wait-step steps);
2. submissions (POST /v1/jobs) at --submit-rate for --submit-seconds (the jobs are cancelled afterwards);
3. closed loop: --concurrency clients reading status as fast as they can, for the peak rate.

Prints a table and writes JSON (--out). Target on a 2-core machine: status reads p99 < 50 ms at 200 req/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import yaml

if TYPE_CHECKING:
    from api.cli.launcher import ApiServerProcess

ROOT = Path(__file__).resolve().parent.parent
# The job that trains in the background during the measurement (tiny model, vLLM on CPU, many steps).
BACKGROUND_JOB = {
    "name": "bench-background",
    "model": {"preset": "tiny"},
    "environment": {"name": "calculator"},
    "tasks": {"seed": 0, "num_train": 1000, "num_eval": 0},
    "rollout": {"num_workers": 1, "prompts_per_step": 4, "num_generations": 4, "max_turns": 2,
                "max_tokens_per_turn": 32, "max_total_tokens": 256, "kv_cache_gib": 0.25},
    "resources": {"learner_cpus": 1, "rollout_cpus": 1},
    "total_steps": 100_000,
    "checkpoint_every": 50,
}


class LeanClient:
    """A minimal HTTP/1.1 keep-alive client over asyncio streams (a pool of connections).

    httpx spends about as much CPU per request as the server does; on a 2-core machine that would measure the
    load generator more than the API, so the load is generated with this instead."""

    def __init__(self, url: str, headers: dict[str, str], connections: int = 32) -> None:
        from urllib.parse import urlparse

        u = urlparse(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.headers = "".join(f"{k}: {v}\r\n" for k, v in {"Host": f"{self.host}:{self.port}", **headers}.items())
        self.size = connections
        self.pool: asyncio.Queue | None = None

    async def _connection(self):
        if self.pool is None:
            self.pool = asyncio.Queue()
            for _ in range(self.size):
                self.pool.put_nowait(None)
        conn = await self.pool.get()
        if conn is None:
            conn = await asyncio.open_connection(self.host, self.port)
        return conn

    async def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        reader, writer = await self._connection()
        try:
            extra = f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n" if body is not None else ""
            writer.write(f"{method} {path} HTTP/1.1\r\n{self.headers}{extra}\r\n".encode() + (body or b""))
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = 0
            for line in head.split(b"\r\n")[1:]:
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            payload = await reader.readexactly(length) if length else b""
        except BaseException:
            writer.close()
            assert self.pool is not None
            self.pool.put_nowait(None)
            raise
        assert self.pool is not None
        self.pool.put_nowait((reader, writer))
        return status, payload

    async def close(self) -> None:
        while self.pool is not None and not self.pool.empty():
            conn = self.pool.get_nowait()
            if conn is not None:
                conn[1].close()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    idx = min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))
    return s[idx]


def summarize(name: str, latencies_s: list[float], errors: int, elapsed_s: float, target_rate: float | None) -> dict:
    ms = [x * 1000 for x in latencies_s]
    return {
        "phase": name,
        "requests": len(ms) + errors,
        "errors": errors,
        "target_rps": target_rate,
        "achieved_rps": round((len(ms) + errors) / elapsed_s, 1) if elapsed_s > 0 else 0.0,
        "p50_ms": round(percentile(ms, 50), 2),
        "p90_ms": round(percentile(ms, 90), 2),
        "p99_ms": round(percentile(ms, 99), 2),
        "max_ms": round(max(ms), 2) if ms else float("nan"),
        "mean_ms": round(statistics.fmean(ms), 2) if ms else float("nan"),
    }


async def open_loop(client: LeanClient, make_request, rate: float, seconds: float, ok=(200, 201)):
    """Start request i at t0 + i/rate; latency = completion - scheduled start."""
    n = int(rate * seconds)
    latencies: list[float] = []
    errors = 0
    loop = asyncio.get_running_loop()
    t0 = loop.time() + 0.05

    async def one(i: int) -> None:
        nonlocal errors
        scheduled = t0 + i / rate
        delay = scheduled - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            status, _ = await make_request(client, i)
            if status in ok:
                latencies.append(loop.time() - scheduled)
            else:
                errors += 1
        except (OSError, asyncio.IncompleteReadError, ValueError):
            errors += 1

    await asyncio.gather(*(one(i) for i in range(n)))
    return latencies, errors, loop.time() - t0


async def closed_loop(client: LeanClient, make_request, concurrency: int, seconds: float):
    latencies: list[float] = []
    errors = 0
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    start = loop.time()

    async def worker(w: int) -> None:
        nonlocal errors
        i = 0
        while loop.time() < end:
            t = loop.time()
            try:
                status, _ = await make_request(client, w * 1_000_000 + i)
                if status == 200:
                    latencies.append(loop.time() - t)
                else:
                    errors += 1
            except (OSError, asyncio.IncompleteReadError, ValueError):
                errors += 1
            i += 1

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return latencies, errors, loop.time() - start


class EmbeddedServer:
    """A private Redis and `taper serve` (local Ray, scheduler) in a subprocess."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.api: ApiServerProcess | None = None
        self.redis = None
        self.url = ""

    def __enter__(self) -> EmbeddedServer:
        from api.cli.launcher import ApiServerProcess
        from rl_service.control.local_services import start_private_redis

        self.redis = start_private_redis(self.data_dir / "redis", persist=False)
        ray_address = self._start_ray()
        env = {"TAPER_REDIS_URL": self.redis.url, "TAPER_DATA_DIR": str(self.data_dir),
               "TAPER_SUBMIT_RATE_PER_MINUTE": "100000", "PYTHONPATH": str(ROOT), "RAY_ADDRESS": ray_address}
        self.api = ApiServerProcess(self.data_dir / "api.log", env=env, cwd=ROOT).start()
        self.url = self.api.url
        return self

    @staticmethod
    def _start_ray(attempts: int = 3) -> str:
        """A local Ray the server joins (its head runs in processes of its own; this process only connects).
        Started here rather than by the server so a slow start on a busy machine can be retried."""
        import ray

        for attempt in range(attempts):
            try:
                ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                         namespace="taper-bench")
                return ray.get_runtime_context().gcs_address
            except Exception as exc:  # Ray's own "node timed out during startup"
                ray.shutdown()
                if attempt == attempts - 1:
                    raise
                print(f"Ray did not start ({exc}); retrying")
        raise AssertionError("unreachable")

    def key(self) -> str:
        from rl_service.control.store import Store

        return Store(self.redis.url).create_api_key("bench", name="bench")

    def __exit__(self, *exc: object) -> None:
        if self.api is not None:
            self.api.stop()
        if self.redis is not None:
            self.redis.stop()
        import ray

        ray.shutdown()


async def run_benchmark(url: str, key: str, args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=30) as client:
        spec = yaml.safe_load(Path(args.job_spec).read_text()) if args.job_spec else BACKGROUND_JOB
        r = await client.post("/v1/jobs", json=spec)
        r.raise_for_status()
        job_id = r.json()["id"]
        job: dict[str, Any] = {"state": "queued", "step": 0}
        deadline = time.monotonic() + args.wait_running
        while time.monotonic() < deadline:  # until it is training: running, with a first step done
            job = (await client.get(f"/v1/jobs/{job_id}")).json()
            if (job["state"] == "running" and job["step"] >= args.wait_step) or job["state"] in (
                    "succeeded", "failed", "cancelled"):
                break
            await asyncio.sleep(1.0)
        state = job["state"]
        print(f"background job {job_id}: {state} at step {job['step']}")

        lean = LeanClient(url, headers, connections=args.connections)

        async def read_status(c: LeanClient, i: int) -> tuple[int, bytes]:
            return await c.request("GET", f"/v1/jobs/{job_id}")

        submitted: list[str] = []
        small = json.dumps({"name": "bench-submit", "total_steps": 1}).encode()

        async def submit(c: LeanClient, i: int) -> tuple[int, bytes]:
            status, body = await c.request("POST", "/v1/jobs", small)
            if status == 201:
                submitted.append(json.loads(body)["id"])
            return status, body

        for _ in range(20):  # warm-up: connections, caches
            await read_status(lean, 0)
        results = []
        lat, err, el = await open_loop(lean, read_status, args.rate, args.seconds)
        results.append(summarize("status reads (open loop)", lat, err, el, args.rate))
        lat, err, el = await open_loop(lean, submit, args.submit_rate, args.submit_seconds)
        results.append(summarize("submissions (open loop)", lat, err, el, args.submit_rate))
        lat, err, el = await closed_loop(lean, read_status, args.concurrency, args.closed_seconds)
        results.append(summarize(f"status reads (closed loop, {args.concurrency} clients)", lat, err, el, None))
        await lean.close()
        final_step = (await client.get(f"/v1/jobs/{job_id}")).json()["step"]
        final_state = (await client.get(f"/v1/jobs/{job_id}")).json()["state"]
        for jid in submitted + [job_id]:
            await client.post(f"/v1/jobs/{jid}/cancel")
    return {"job_state_during": state, "job_step_before": job["step"], "job_state_after": final_state,
            "job_step_after": final_step, "results": results}


def main() -> None:
    if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path[0] = str(ROOT)  # run as a script: this file would shadow the `api` package
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url")
    p.add_argument("--key")
    p.add_argument("--job-spec", default="", help="YAML job spec of the background job (default: a tiny one).")
    p.add_argument("--wait-running", type=float, default=400.0, help="Seconds to wait for the job to train.")
    p.add_argument("--wait-step", type=int, default=1, help="Measure once the background job reached this step.")
    p.add_argument("--rate", type=float, default=200.0)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--submit-rate", type=float, default=20.0)
    p.add_argument("--submit-seconds", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--connections", type=int, default=32, help="Keep-alive connections of the load generator.")
    p.add_argument("--closed-seconds", type=float, default=5.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "api_load.json"))
    args = p.parse_args()

    if args.url:
        if not args.key:
            p.error("--key is required with --url")
        report = asyncio.run(run_benchmark(args.url, args.key, args))
    else:
        with tempfile.TemporaryDirectory(prefix="taper-bench-") as tmp, EmbeddedServer(Path(tmp)) as server:
            report = asyncio.run(run_benchmark(server.url, server.key(), args))
    report["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                         "load_average_1m_after": os.getloadavg()[0]}
    print(f"load average (1 min) after the run: {report['machine']['load_average_1m_after']:.1f} "
          f"on {report['machine']['cpus']} CPUs")
    print(f"{'phase':48} {'req':>6} {'err':>4} {'rps':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for r in report["results"]:
        print(f"{r['phase']:48} {r['requests']:6d} {r['errors']:4d} {r['achieved_rps']:7.1f} "
              f"{r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['max_ms']:8.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
