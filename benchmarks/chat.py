"""Chat completions under load: `--clients` concurrent `openai` clients streaming from `/v1/chat/completions` on the
tiny preset, against the same requests on the engine alone (rollout_workers.chat_engine.ChatEngineHost in this
process, no API, no Ray).

    python -m benchmarks.chat                    # embedded `taper serve` (private Redis, local Ray), 32 clients
    python -m benchmarks.chat --clients 8 --requests 2 --tokens 32

Each client sends `--requests` requests one after another (temperature 1, a distinct seed each, `--tokens`
tokens: the end-of-turn token is biased away so every request samples them all). Latency is per request, from
sending it to its last chunk; tokens/s is every sampled token over the wall time of the whole phase. The first
request, which starts the engine, is sent and answered before the clock starts. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [{"role": "user", "content": "What is 12 plus 30? Answer with the number."}]


def _summary(latencies: list[float], tokens: int, wall: float) -> dict[str, float]:
    q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else latencies * 99
    return {"requests": len(latencies), "p50_s": statistics.median(latencies), "p99_s": q[98],
            "tokens": tokens, "tokens_per_s": tokens / wall, "wall_s": wall}


async def _api_phase(url: str, key: str, args: argparse.Namespace, eos: int) -> dict[str, float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=3600)
    ask = dict(model="tiny", messages=PROMPT, temperature=1.0, max_completion_tokens=args.tokens,
               logit_bias={str(eos): -100}, stream=True, stream_options={"include_usage": True})

    async def one(seed: int) -> tuple[float, int]:
        t0, tokens = time.perf_counter(), 0
        async for chunk in await client.chat.completions.create(seed=seed, **ask):
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return time.perf_counter() - t0, tokens

    await one(0)  # starts the engine
    async def run_client(c: int) -> list[tuple[float, int]]:
        return [await one(1 + c * args.requests + r) for r in range(args.requests)]

    t0 = time.perf_counter()
    results = [x for xs in await asyncio.gather(*(run_client(c) for c in range(args.clients))) for x in xs]
    wall = time.perf_counter() - t0
    return _summary([lat for lat, _ in results], sum(t for _, t in results), wall)


def _engine_phase(args: argparse.Namespace, eos: int) -> dict[str, float]:
    from rollout_workers.chat_engine import ChatEngineHost
    from rollout_workers.engine import EngineConfig

    host = ChatEngineHost(EngineConfig(model_dir="", max_model_len=args.max_model_len, kv_cache_gib=0.5,
                                       max_num_seqs=64, logprobs_mode="raw_logprobs", keep_turn_state=False),
                          preset="tiny")
    call = {"messages": PROMPT, "temperature": 1.0, "max_tokens": args.tokens, "max_tokens_cap": args.tokens,
            "logit_bias": {eos: -100.0}}
    lock = threading.Lock()
    results: list[tuple[float, int]] = []

    def one(seed: int) -> tuple[float, int]:
        t0, tokens = time.perf_counter(), 0
        for batch in host.stream(f"bench-{seed}", {**call, "seed": seed}):
            tokens += sum(len(e.get("token_ids", [])) for e in batch)
        return time.perf_counter() - t0, tokens

    one(0)

    def run_client(c: int) -> None:
        mine = [one(1 + c * args.requests + r) for r in range(args.requests)]
        with lock:
            results.extend(mine)

    threads = [threading.Thread(target=run_client, args=(c,)) for c in range(args.clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return _summary([lat for lat, _ in results], sum(t for _, t in results), wall)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=4, help="requests per client")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "chat.json")
    args = parser.parse_args()

    from api.cli.launcher import ApiServerProcess
    from model.tokenizer import load_tokenizer
    from rl_service.control.local_services import stop_embedded

    eos = load_tokenizer().eos_token_id
    data_dir = Path(tempfile.mkdtemp(prefix="taper-bench-chat-"))
    env = {"TAPER_DATA_DIR": str(data_dir), "RAY_ADDRESS": "", "TAPER_CHAT__MAX_MODEL_LEN": str(args.max_model_len),
           "TAPER_CHAT__KV_CACHE_GIB": "0.5", "TAPER_CHAT__MAX_NUM_SEQS": "64",
           "TAPER_DEFAULT_QUOTA__MAX_CHAT_ENGINES": "1"}
    server = ApiServerProcess(data_dir / "api.log", env=env)
    server.env.pop("TAPER_REDIS_URL", None)
    try:
        server.start()
        key = (data_dir / "api-key").read_text().strip()
        api = asyncio.run(_api_phase(server.url, key, args, eos))
    finally:
        server.stop()
        stop_embedded(data_dir)
    engine = _engine_phase(args, eos)
    report = {"machine": platform.processor() or platform.machine(), "clients": args.clients,
              "requests_per_client": args.requests, "tokens_per_request": args.tokens, "api": api, "engine": engine,
              "api_over_engine_tokens_per_s": api["tokens_per_s"] / engine["tokens_per_s"]}
    print(f"{'path':<8} {'requests':>8} {'p50 s':>8} {'p99 s':>8} {'tokens/s':>9}")
    for name, r in (("api", api), ("engine", engine)):
        print(f"{name:<8} {r['requests']:>8} {r['p50_s']:>8.2f} {r['p99_s']:>8.2f} {r['tokens_per_s']:>9.1f}")
    print(f"API tokens/s over the engine alone's: {report['api_over_engine_tokens_per_s']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
