"""The RL loop on one GPU: a job's steps with the `small` preset, the learner and the rollout engine sharing the
device (`resources.learner_gpus` 0.5, `rollout_gpus` 0.4). Per case (prompts x generations x tokens a
trajectory): seconds per step split into rollout / scoring / learn / push / the rest, rollout and learner tokens/s,
the learner's MFU inside the loop (against a bf16 matmul rate measured in the same run), the GPU's busy share of
the wall time (NVML utilisation sampled every 50 ms while the steps run) and the device's peak memory in use. Each
case runs with the learner compiled (`algorithm.compile_layers: auto`) and eager. Random weights and one turn of
`max_total_tokens` (a random model rarely samples an end token), so trajectories have the case's length.

    python benchmarks/rl_loop_gpu.py                                  # 4x16 and 64x16, 2K and 16K tokens
    python benchmarks/rl_loop_gpu.py --cases 4x16x2048 --compile auto --steps 3

Writes benchmarks/results/rl_loop_gpu.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rl_step import _ray, _vllm_env  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "rl_loop_gpu.json"
DEFAULT_CASES = ("4x16x2048", "64x16x2048", "4x16x16384", "64x16x16384")
PHASES = ("time/rollout", "time/reward", "time/learn", "time/sync", "time/checkpoint")


class GpuSampler:
    """NVML utilisation (the share of the last sample period a kernel ran) and memory in use, every `period_s`."""

    def __init__(self, period_s: float = 0.05) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nvml, self.handle, self.period_s = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0), period_s
        self.busy: list[float] = []
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.busy.append(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu / 100)
            self.peak_bytes = max(self.peak_bytes, self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def job_spec(prompts: int, generations: int, tokens: int, steps: int, compile_layers: str) -> dict[str, Any]:
    return {
        "model": {"preset": "small"}, "total_steps": steps, "checkpoint_every": 1000, "eval_every": 0,
        "environment": {"name": "calculator"}, "tasks": {"num_train": 4096, "num_eval": 0},
        "algorithm": {"compile_layers": compile_layers, "micro_batch_tokens": 4 * 8192, "learning_rate": 1e-5},
        "rollout": {"num_workers": 1, "prompts_per_step": prompts, "num_generations": generations, "max_turns": 1,
                    "max_tokens_per_turn": tokens, "max_total_tokens": tokens + 256, "temperature": 1.0},
        "resources": {"learner_gpus": 0.5, "rollout_gpus": 0.4},
    }


def run_case(case: str, steps: int, compile_layers: str, peak_tflops: float) -> dict[str, Any]:
    from benchmarks.model import step_flops
    from model.config import TaperConfig
    from rl_service.hooks import InMemoryHooks
    from rl_service.spec import JobSpec
    from rl_service.training.runner import JobRunner

    prompts, generations, tokens = (int(x) for x in case.split("x"))
    spec = JobSpec.model_validate(job_spec(prompts, generations, tokens, steps, compile_layers))
    hooks = InMemoryHooks()
    work = Path(tempfile.mkdtemp(prefix="rl-loop-gpu-"))
    with GpuSampler() as gpu:
        t0 = time.perf_counter()
        result = JobRunner(f"bench-{case}-{compile_layers}", spec, hooks, work, device="cuda").run()
        wall = time.perf_counter() - t0
    rows = [m for _, m in hooks.metrics if "time/step" in m]
    timed = rows[1:] or rows  # the first step compiles and warms the engine
    row: dict[str, Any] = {"case": case, "compile_layers": compile_layers, "result": result, "steps": len(rows),
                           "wall_s": wall}
    row["step_s"] = statistics.mean(m["time/step"] for m in timed)
    for key in PHASES:
        row[key.split("/")[1] + "_s"] = statistics.mean(m.get(key, 0.0) for m in timed)
    row["other_s"] = row["step_s"] - sum(row[k.split("/")[1] + "_s"] for k in PHASES)
    row["rollout_tokens_per_s"] = statistics.mean(m.get("rollout/tokens_per_s", 0.0) for m in timed)
    row["learner_tokens_per_s"] = statistics.mean(m.get("tokens_per_s", 0.0) for m in timed)
    flops_per_token = step_flops(TaperConfig.preset("small"), 1, tokens) / tokens
    row["learner_mfu"] = row["learner_tokens_per_s"] * flops_per_token / (peak_tflops * 1e12)
    row["push_s"] = statistics.mean(m.get("weight_sync_s", 0.0) for m in timed)
    row["gpu_busy"] = statistics.mean(gpu.busy) if gpu.busy else 0.0
    row["peak_memory_gib"] = gpu.peak_bytes / 2**30
    row["logprob_mismatch"] = statistics.mean(m.get("logprob_mismatch/mean_abs", 0.0) for m in timed)
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ("case", "compile_layers", "step_s", "rollout_s", "reward_s", "learn_s", "sync_s", "other_s",
            "rollout_tokens_per_s", "learner_tokens_per_s", "learner_mfu", "gpu_busy", "peak_memory_gib")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), help="PROMPTSxGENERATIONSxTOKENS")
    ap.add_argument("--compile", nargs="+", default=["auto", "none"], choices=["auto", "stack", "parts", "none"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    _vllm_env()
    _ray(None)
    import torch

    from benchmarks.machine import machine_info
    from benchmarks.model import matmul_tflops

    peak = matmul_tflops("cuda", torch.bfloat16)
    rows = []
    for case in args.cases:
        for compile_layers in args.compile:
            rows.append(run_case(case, args.steps, compile_layers, peak))
            print(json.dumps(rows[-1]), flush=True)
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": {"gpu": torch.cuda.get_device_name(0), "host": machine_info(),
                                                "bf16_matmul_tflops": peak, "torch": torch.__version__},
                                    "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
