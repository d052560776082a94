"""Rollout throughput on CPU: trajectories/s and tokens/s of one worker and of a pool vs concurrency,
and how close the agent loop keeps the engine to its standalone generation speed.

    python benchmarks/rollouts.py [--model llama|taper] [--concurrency 8 32 96] [--pool-workers 2]
                                  [--tool-latency-ms 5] [--no-keep-turn-state]

A tiny Llama (random init; or, with --model taper, the service's tiny Taper model) is first fine-tuned
on calculator demonstrations, so that it really writes `<tool_call>` spans and the loop runs multi-turn
episodes with tool calls (a random model would only ever be cut off). Each concurrency level is one
closed batch of episodes, as one rollout call of a worker is. Three standalone baselines, all the same engine on the
same prompts, none of the loop's tools or parsing:
- "uniform": every sequence generates the episodes' mean token count. No batch of variable-length
  episodes can reach it: its tail, where the last long episodes run nearly alone, is not there.
- "matched": each sequence generates exactly as many tokens as its episode sampled, in one turn: the
  same sampled tokens with the same length tail, but none of the multi-turn work.
- "replay": the loop's own turns on the engine alone: each turn samples its recorded length and is
  submitted the moment the episode's previous turn finishes, with the tokens the loop inserted after that
  turn; through the engine's own API, so with its multi-turn sessions (on by default; --no-keep-turn-state)
  an episode's turns continue one session, as in the loop. The engine does the loop's multi-turn work
  with no tool call, parsing or event loop: loop / replay is the loop's own cost, replay / matched the
  cost of multi-turn requests in the engine.
Each level runs `--repeats` paired rounds (the loop, then the baselines right after it on the same
prompts) and reports medians: one closed batch of short episodes ends in about a second, and single runs
of the baselines moved up to 1.9x between back-to-back runs on a 2-core machine.
Target: with tools under 10 ms, loop tokens/s >= 80% of standalone: of replay, the engine alone doing the
loop's own turns (the loop, parsing and tool calls must not starve it). Matched and uniform put that
in context: they also leave out the multi-turn work itself, which any agent loop has to do.
Writes a table to stdout and JSON to benchmarks/results/rollouts_cpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# run as a script, this folder would shadow the `model` package with benchmarks/model.py
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for benchmarks.machine
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from benchmarks.machine import machine_info  # noqa: E402
from rollout_workers.agent import AgentLoop, make_group_specs  # noqa: E402
from rollout_workers.chat import as_template_tools  # noqa: E402
from rollout_workers.engine import TurnRequest  # noqa: E402
from rollout_workers.environments.calculator import CalculatorEnv  # noqa: E402
from rollout_workers.sampling import SamplingConfig  # noqa: E402
from rollout_workers.stats import RolloutStats  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "rollouts_cpu.json"
TARGET = 0.8  # loop tokens/s over replay's
# At 150 steps the tiny Llama still wrote 58-77% malformed calls, so few of its turns ran a tool; at 400, 0-17%.
SFT_STEPS = {"llama": 400, "taper": 150}


class SlowCalculatorEnv(CalculatorEnv):
    """The calculator with an artificial tool latency (asyncio sleep), to measure the loop's tolerance."""

    latency_s = 0.0

    async def call(self, tool: str, args: dict[str, Any]) -> str:
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        return await super().call(tool, args)


def make_env_factory(latency_s: float) -> Any:
    cls = type("BenchCalculatorEnv", (SlowCalculatorEnv,), {"latency_s": latency_s})
    return cls


def train_tool_caller(out_dir: Path, tokenizer_dir: str, steps: int, seed: int = 0) -> None:
    """A tiny Llama, SFT on calculator demonstrations until it writes the tool-call format."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=32, max_position_embeddings=2048, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, bos_token_id=None, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    env = CalculatorEnv()
    tools = as_template_tools(env.tools())
    tasks = CalculatorEnv.generate_tasks(2048, seed=seed)
    texts = [tok.apply_chat_template(env.demonstration(t), tools=tools, tokenize=False) for t in tasks]
    rows = [tok.encode(t, add_special_tokens=False) for t in texts]
    # loss only after the question: the tools preamble and the question are given, not taught
    starts = [
        len(tok.encode(tok.apply_chat_template(env.demonstration(t)[:1], tools=tools, tokenize=False,
                                               add_generation_prompt=True), add_special_tokens=False))
        for t in tasks
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = 16
    model.train()
    for step in range(steps):
        idx = torch.randint(0, len(rows), (batch,))
        seqs = [rows[i] for i in idx]
        firsts = [starts[i] for i in idx]
        width = max(map(len, seqs))
        ids = torch.full((batch, width), tok.pad_token_id)
        labels = torch.full((batch, width), -100)
        for b, s in enumerate(seqs):
            ids[b, : len(s)] = torch.tensor(s)
            labels[b, firsts[b] : len(s)] = torch.tensor(s[firsts[b] :])
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"  sft step {step:4d} loss {loss.item():.3f}", flush=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)


def run_loop(engine: Any, env_factory: Any, tasks: list[dict[str, Any]], sampling: SamplingConfig) -> dict[str, Any]:
    stats = RolloutStats()
    loop = AgentLoop(engine, env_factory, sampling, env_name="calculator", stats=stats)
    specs = [s for g in make_group_specs(tasks, 1) for s in g]
    t0 = time.monotonic()
    trajs = asyncio.run(loop.run(specs))
    wall = time.monotonic() - t0
    loop.close()
    snap = stats.snapshot()
    env = CalculatorEnv()
    return {
        "wall_s": wall,
        "trajectories_per_s": len(trajs) / wall,
        "tokens_per_s": snap["sampled_tokens"] / wall,
        "turns_per_s": snap["turns"] / wall,
        "sampled_tokens_per_episode": snap["sampled_tokens"] / len(trajs),
        "turns_per_episode": snap["turns"] / len(trajs),
        "tool_calls": snap["tool_calls"],
        "tool_errors": {kind: n for kind, n in stats.tool_errors.items()},
        "tool_latency_p50_ms": snap["tool_latency_p50_ms"],
        "tool_latency_p99_ms": snap["tool_latency_p99_ms"],
        "engine_busy_fraction": snap["engine_busy_fraction"],
        "engine_steps": snap["engine_steps"],
        "mean_running_sequences": snap["mean_running_sequences"],
        "success_rate": sum(env.outcome(t) for t in trajs) / len(trajs),
        "statuses": dict(stats.statuses),
        "prompt_ids": [t.prompt_ids for t in trajs],
        "episode_tokens": [sum(len(s.action_ids) for s in t.steps) for t in trajs],
        "turn_requests": [turn_requests(t) for t in trajs],
    }


def turn_requests(traj: Any) -> list[tuple[list[int], int]]:
    """The (prompt ids, sampled token count) of each turn the loop sent the engine for this episode."""
    context, turns = list(traj.prompt_ids), []
    for step in traj.steps:
        turns.append((list(context), len(step.action_ids)))
        context += step.action_ids + step.observation_ids
    return turns


def standalone(engine: Any, prompts: list[list[int]], tokens_per_seq: list[int]) -> float:
    """Tokens/s of one plain batched generate call: these prompts, these token counts per sequence.

    Run on the engine's own thread, where the agent loop's turns run: on vLLM's CPU backend the thread
    that built the engine has its OpenMP threads pinned, and on a shared machine that thread measured
    ~7x slower than an unpinned one, which would flatter the loop."""
    return engine.call(lambda: _standalone(engine, prompts, tokens_per_seq))


def _standalone(engine: Any, prompts: list[list[int]], tokens_per_seq: list[int]) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(max_tokens=max(1, n), ignore_eos=True, temperature=1.0, logprobs=0, detokenize=False)
              for n in tokens_per_seq]
    engine.llm.reset_prefix_cache()
    t0 = time.monotonic()
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.monotonic() - t0)


def replay(engine: Any, episodes: list[list[tuple[list[int], int]]], sampling: SamplingConfig) -> float:
    """Tokens/s of the engine alone on the loop's own turns: each episode's turns are submitted through the
    engine's own API the moment the previous one finishes (its completion callback runs on the engine
    thread, so the next turn joins the very next step), with no tool call, parsing or event loop in between.
    Each turn samples its recorded length (min_tokens = max_tokens); the next prompt is this replay's own
    context plus the tokens the loop inserted after that turn, so with the engine's multi-turn sessions an
    episode's turns continue one session, as in the loop. Loop / replay is what the loop itself costs."""
    key = f"replay-{next(_replay_rounds)}"
    finished = threading.Event()
    lock = threading.Lock()
    state = {"tokens": 0, "open": len(episodes)}

    def submit(episode: int, turn: int, prompt: list[int]) -> None:
        n = max(1, episodes[episode][turn][1])
        request = TurnRequest(prompt, max_tokens=n, min_tokens=n, session=f"{key}-{episode}")
        future = engine.submit(request, sampling, [])
        future.add_done_callback(lambda f: done(episode, turn, prompt, f))

    def done(episode: int, turn: int, prompt: list[int], future: Any) -> None:
        out = future.result()
        turns = episodes[episode]
        if turn + 1 < len(turns):
            recorded, n = turns[turn]
            inserted = turns[turn + 1][0][len(recorded) + n:]
            submit(episode, turn + 1, prompt + out.token_ids + inserted)
        else:
            engine.end_session(f"{key}-{episode}")
        with lock:
            state["tokens"] += len(out.token_ids)
            if turn + 1 == len(turns):
                state["open"] -= 1
                if state["open"] == 0:
                    finished.set()

    engine.call(engine.llm.reset_prefix_cache)
    t0 = time.monotonic()
    for e, turns in enumerate(episodes):
        submit(e, 0, turns[0][0])
    if not finished.wait(timeout=600):
        raise RuntimeError("the replay did not finish (a turn failed in the engine?)")
    return state["tokens"] / (time.monotonic() - t0)


_replay_rounds = itertools.count()


def run_pool(model_dir: str, workers: int, concurrencies: list[int], sampling: SamplingConfig,
             latency_s: float, keep_turn_state: bool) -> list[dict[str, Any]]:
    """One pool of `workers` Ray actors; each concurrency level is one pool.generate call over that many
    tasks (spread over the workers)."""
    import ray

    from rollout_workers.engine import EngineConfig
    from rollout_workers.pool import RolloutPool

    ray.init(num_cpus=max(2, workers), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CONFIGURE_LOGGING": "0"}})
    rows = []
    try:
        pool = RolloutPool(EngineConfig(model_dir=model_dir, max_model_len=1024, kv_cache_gib=0.5,
                                        keep_turn_state=keep_turn_state),
                           make_env_factory(latency_s), num_workers=workers, num_cpus_per_worker=1)
        pool.generate(CalculatorEnv.generate_tasks(8, seed=99), n=1, sampling=sampling)  # warm-up
        for c in concurrencies:
            tasks = CalculatorEnv.generate_tasks(c, seed=1)
            before = pool.stats()
            t0 = time.monotonic()
            groups = pool.generate(tasks, n=1, sampling=sampling)
            wall = time.monotonic() - t0
            after = pool.stats()
            n = sum(len(g) for g in groups)
            rows.append({
                "workers": workers,
                "concurrency": c,
                "trajectories_per_s": n / wall,
                "tokens_per_s": (after["sampled_tokens"] - before["sampled_tokens"]) / wall,
                "wall_s": wall,
            })
            print(f"  pool of {workers}, concurrency {c}: {rows[-1]['tokens_per_s']:.0f} tok/s", flush=True)
        pool.shutdown()
    finally:
        ray.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 96])
    ap.add_argument("--tool-latency-ms", type=float, default=5.0)
    ap.add_argument("--block-size", type=int, default=None, help="KV block size (vLLM's CPU default: 128)")
    ap.add_argument("--repeats", type=int, default=11,
                    help="paired rounds per level (loop, then its baselines); medians are reported")
    ap.add_argument("--sft-steps", type=int, default=None,
                    help="SFT steps (default: llama 400, taper 150: where most of each model's tool calls parse)")
    ap.add_argument("--pool-workers", type=int, default=2, help="0 skips the pool measurement")
    ap.add_argument("--model", choices=["llama", "taper"], default="llama",
                    help="the model SFT'd on calculator demonstrations: a tiny Llama (plain attention), or the "
                         "service's own tiny Taper model (KDA-hybrid MoE, served through the vLLM plugin)")
    ap.add_argument("--model-dir", default=None, help="an existing model to use instead of SFT'ing one")
    ap.add_argument("--no-keep-turn-state", dest="keep_turn_state", action="store_false",
                    help="every turn a new request (no multi-turn sessions in the engine)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    from model.tokenizer import TOKENIZER_DIR
    from rollout_workers.engine import EngineConfig
    from rollout_workers.vllm_engine import VLLMEngine

    work = Path(tempfile.mkdtemp(prefix="taper-bench-rollouts-"))
    model_dir = args.model_dir
    if args.sft_steps is None:
        args.sft_steps = SFT_STEPS[args.model]
    if model_dir is None:
        model_dir = str(work / "tool-caller")
        t0 = time.monotonic()
        print(f"fine-tuning a tiny {args.model} model on calculator demonstrations ({args.sft_steps} steps)")
        if args.model == "taper":
            from rl_service.training.warm_start import warm_started_model

            warm_started_model("calculator", Path(model_dir), steps=args.sft_steps, examples=2048, seed=0)
        else:
            train_tool_caller(Path(model_dir), str(TOKENIZER_DIR), args.sft_steps)
        print(f"  done in {time.monotonic() - t0:.0f} s; reuse it with --model-dir {model_dir}")

    sampling = SamplingConfig(max_tokens_per_turn=48, max_turns=3, max_total_tokens=1024, temperature=1.0, tool_timeout_s=5.0)
    engine_kwargs = {"block_size": args.block_size} if args.block_size else {}
    engine = VLLMEngine(EngineConfig(model_dir=model_dir, max_model_len=1024, kv_cache_gib=0.5, max_num_seqs=256,
                                     engine_kwargs=engine_kwargs, keep_turn_state=args.keep_turn_state))
    env_factory = make_env_factory(args.tool_latency_ms / 1000.0)
    run_loop(engine, env_factory, CalculatorEnv.generate_tasks(8, seed=99), sampling)  # warm-up

    rows = []
    for c in args.concurrency:
        tasks = CalculatorEnv.generate_tasks(c, seed=1)
        rounds = []
        for _ in range(args.repeats):  # loop, then its three baselines right after it: one paired round
            engine.call(engine.llm.reset_prefix_cache)
            loop = run_loop(engine, env_factory, tasks, sampling)
            prompts, lengths = loop.pop("prompt_ids"), loop.pop("episode_tokens")
            rounds.append({
                "loop": loop,
                "uniform": standalone(engine, prompts, [max(1, round(loop["sampled_tokens_per_episode"]))] * len(prompts)),
                "matched": standalone(engine, prompts, lengths),
                "replay": replay(engine, loop.pop("turn_requests"), sampling),
            })
        loop = sorted((r["loop"] for r in rounds), key=lambda r: r["tokens_per_s"])[len(rounds) // 2]
        row = {"concurrency": c, **loop, "rounds": len(rounds)}
        for name in ("uniform", "matched", "replay"):  # each ratio is the median of the rounds' own ratios
            row[f"{name}_tokens_per_s"] = statistics.median(r[name] for r in rounds)
            row[f"loop_vs_{name}"] = statistics.median(r["loop"]["tokens_per_s"] / r[name] for r in rounds)
        row["replay_vs_matched"] = statistics.median(r["replay"] / r["matched"] for r in rounds)
        row["loop_vs_matched_per_round"] = [r["loop"]["tokens_per_s"] / r["matched"] for r in rounds]
        rows.append(row)
        print(f"  concurrency {c} (median of {len(rounds)} rounds): {row['tokens_per_s']:.0f} tok/s loop vs "
              f"{row['uniform_tokens_per_s']:.0f} uniform / {row['matched_tokens_per_s']:.0f} matched / "
              f"{row['replay_tokens_per_s']:.0f} replay; {row['turns_per_episode']:.2f} turns/ep, "
              f"{row['sampled_tokens_per_episode']:.1f} tok/ep, {row['engine_steps']:.0f} engine steps, "
              f"{row['mean_running_sequences']:.1f} live seqs/step, success {row['success_rate']:.2f}", flush=True)

    pool_rows = []
    if args.pool_workers:
        engine.close()
        del engine  # the pool's workers build their own engines
        pool_rows = run_pool(model_dir, args.pool_workers, args.concurrency, sampling, args.tool_latency_ms / 1000.0,
                             args.keep_turn_state)

    print()
    print(f"one worker, in-process vLLM (CPU), calculator env, tool latency {args.tool_latency_ms:g} ms")
    print(f"{'conc':>5} {'traj/s':>8} {'tok/s':>8} {'turns/s':>8} {'uniform':>8} {'ratio':>6} {'matched':>8} {'ratio':>6} "
          f"{'replay':>8} {'ratio':>6} {'tok/ep':>7} {'turns/ep':>8} {'tool p50':>9} {'tool p99':>9} {'tool err':>8} {'steps':>6} "
          f"{'live/step':>9} {'success':>7}")
    for r in rows:
        print(f"{r['concurrency']:>5} {r['trajectories_per_s']:>8.2f} {r['tokens_per_s']:>8.0f} {r['turns_per_s']:>8.1f} "
              f"{r['uniform_tokens_per_s']:>8.0f} {r['loop_vs_uniform']:>6.2f} {r['matched_tokens_per_s']:>8.0f} "
              f"{r['loop_vs_matched']:>6.2f} {r['replay_tokens_per_s']:>8.0f} {r['loop_vs_replay']:>6.2f} "
              f"{r['sampled_tokens_per_episode']:>7.1f} "
              f"{r['turns_per_episode']:>8.2f} {r['tool_latency_p50_ms']:>8.1f}ms {r['tool_latency_p99_ms']:>8.1f}ms "
              f"{sum(r['tool_errors'].values()) / max(r['tool_calls'], 1):>8.2f} "
              f"{r['engine_steps']:>6.0f} {r['mean_running_sequences']:>9.1f} {r['success_rate']:>7.2f}")
    verdict = ", ".join(f"{r['concurrency']}: {r['loop_vs_replay']:.2f} {'met' if r['loop_vs_replay'] >= TARGET else 'NOT met'}"
                        for r in rows)
    print(f"target, loop >= {TARGET} x replay: {verdict}")
    if pool_rows:
        print(f"\npool of {args.pool_workers} Ray workers (each one in-process vLLM engine, 1 CPU)")
        print(f"{'conc':>5} {'traj/s':>8} {'tok/s':>8}")
        for r in pool_rows:
            print(f"{r['concurrency']:>5} {r['trajectories_per_s']:>8.2f} {r['tokens_per_s']:>8.0f}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": {**machine_info(), "torch_threads": torch.get_num_threads(),
                    "load_average_1m_at_end": os.getloadavg()[0]},
        "model": ("tiny Llama (hidden 128, 2 layers)" if args.model == "llama" else "tiny Taper (the service's preset)")
                 + ", SFT on calculator demonstrations"
                 + ("" if args.model_dir is None else f" (reused with --model-dir, folder {Path(args.model_dir).name!r})"),
        "sft_steps": None if args.model_dir else args.sft_steps,
        "keep_turn_state": args.keep_turn_state,
        "tool_latency_ms": args.tool_latency_ms,
        "sampling": sampling.model_dump(),
        "single_worker": rows,
        "pool": pool_rows,
        "target": f"loop_vs_replay >= {TARGET} with tools under 10 ms (replay: the loop's own turn requests on the "
                  "engine alone; loop_vs_matched: the episodes' own lengths in one turn each; loop_vs_uniform: every "
                  "episode the mean length)",
        "target_met": {str(r["concurrency"]): r["loop_vs_replay"] >= TARGET for r in rows},
    }, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
