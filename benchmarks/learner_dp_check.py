"""Data-parallel learner check without Ray: N ranks (torch.multiprocessing, NCCL on GPUs or gloo on CPU)
must give the same loss, gradients and post-step weights as one rank on the same global batch.

    python benchmarks/learner_dp_check.py --world 2 --arch taper --preset small      # 2 GPUs, NCCL
    python benchmarks/learner_dp_check.py --world 2 --device cpu --arch llama        # CPU, gloo

Prints a table of max absolute / relative differences and timings, and writes JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this folder would come first on sys.path, and benchmarks/model.py would shadow `model`.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def build_model(arch: str, preset: str):
    torch.manual_seed(0)
    if arch == "taper":
        from model import TaperConfig, TaperForCausalLM

        return TaperForCausalLM(TaperConfig.preset(preset))
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=1536, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=4, head_dim=64))


def make_batch(n: int, vocab: int, seq: int, seed: int = 0):
    from rl_service.training.learner import PolicySample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, c = rng.randint(8, seq // 4), rng.randint(seq // 4, seq // 2)
        mask = [1] * c
        if i % 2:
            mask[c // 2: c // 2 + 8] = [0] * 8  # an inserted tool result
        out.append(PolicySample([rng.randrange(vocab) for _ in range(p)], [rng.randrange(vocab) for _ in range(c)],
                                mask, [rng.gauss(0, 1) for _ in range(c)], [-5.0 + rng.gauss(0, 0.1) for _ in range(c)]))
    return out


def diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a.float() - b.float()).abs().max().item()
    return d, d / max(b.float().abs().max().item(), 1e-12)


def rank_main(rank: int, world: int, init: str, model_dir: str, cfg, strategy: str, device: str, batch, out_dir: str):
    from rl_service.training.distributed import RankLearner, combine_metrics, shard_samples
    from rl_service.training.learner import LossNorm, pack_micro_batches

    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    r = RankLearner(rank, world, init, model_dir, cfg, strategy=strategy, device=dev)
    shards = shard_samples(batch, world)
    n_mb = max(len(pack_micro_batches(s, cfg.micro_batch_tokens)) for s in shards)
    norm = LossNorm.of(batch)
    grads = r.gradients(shards[rank], norm, n_mb)
    losses = [torch.zeros(1) for _ in range(world)]
    torch.distributed.all_gather_object(losses, float(grads["__loss__"]))
    if device == "cuda":
        torch.cuda.synchronize()
    torch.distributed.barrier()
    t0 = time.perf_counter()
    metrics = r.step(shards[rank], norm, n_mb)
    if device == "cuda":
        torch.cuda.synchronize()
    step_s = time.perf_counter() - t0
    state = r.full_state_dict()
    # the checkpoint path of the optimizer: gathered whole, loaded back on every rank, gathered again
    saved = r.learner_state()
    try:  # every rank gets the same state, so all fail alike and none waits in a collective
        r.load_learner_state(_broadcast_object(saved if rank == 0 else None))
        again = r.learner_state()
        optim_roundtrip: float | str = max(
            (diff(a, again["optimizer_by_name"]["state"][k][n])[0]
             for k, st in saved["optimizer_by_name"]["state"].items()
             for n, a in st.items() if isinstance(a, torch.Tensor) and a.dim() > 0), default=0.0) if rank == 0 else 0.0
    except RuntimeError as exc:  # reported, and the loss/gradient/weight comparison still comes out
        optim_roundtrip = f"error: {str(exc)[:300]}"
    all_metrics: list = [None] * world
    torch.distributed.all_gather_object(all_metrics, metrics)
    metrics = combine_metrics(all_metrics)
    if rank == 0:
        grads["__loss__"] = torch.tensor(sum(losses))
        torch.save({"grads": grads, "state": state, "metrics": metrics, "step_s": step_s,
                    "strategy": r.strategy, "optim_roundtrip_max_abs": optim_roundtrip}, Path(out_dir) / "dp.pt")
    r.shutdown()


def _broadcast_object(obj=None):
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--arch", choices=["taper", "llama"], default="taper")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--strategy", choices=["auto", "fsdp", "ddp"], default="auto")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--loss-type", default="grpo")
    ap.add_argument("--micro-batch-tokens", type=int, default=2048)
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()

    from rl_service.training.learner import Learner, LearnerConfig, LossNorm

    cfg = LearnerConfig(loss_type=args.loss_type, learning_rate=1e-4, micro_batch_tokens=args.micro_batch_tokens,
                        bf16=False, adam_epsilon=1e-6)
    model = build_model(args.arch, args.preset).float()
    vocab = model.config.vocab_size
    batch = make_batch(args.samples, vocab, args.seq)
    n_params = sum(p.numel() for p in model.parameters())
    tmp = Path(tempfile.mkdtemp(prefix="dp-check-"))
    model.save_pretrained(tmp / "model")

    dev = "cuda:0" if args.device == "cuda" else "cpu"
    single = Learner(model.to(dev), cfg, device=dev)
    single.accumulate(single.micro_batches(batch, LossNorm.of(batch)))
    ref_grads = {n: p.grad.detach().cpu().clone() for n, p in single.model.named_parameters() if p.grad is not None}
    single.optimizer.zero_grad(set_to_none=True)
    if args.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    ref_metrics = single.step(batch)
    if args.device == "cuda":
        torch.cuda.synchronize()
    single_s = time.perf_counter() - t0
    ref_state = {k: v.detach().cpu() for k, v in single.model.state_dict().items()}
    del single, model
    if args.device == "cuda":
        torch.cuda.empty_cache()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(rank_main, args=(args.world, f"tcp://127.0.0.1:{port}", str(tmp / "model"), cfg, args.strategy,
                              args.device, batch, str(tmp)), nprocs=args.world, join=True)
    dp = torch.load(tmp / "dp.pt", weights_only=True)

    grad_abs, grad_rel, worst = 0.0, 0.0, ""
    missing = [n for n in ref_grads if n not in dp["grads"]]
    for name, g in ref_grads.items():
        a, r = diff(dp["grads"].get(name, torch.zeros_like(g)), g)  # no grad on the ranks counts as zero
        if r > grad_rel:
            grad_abs, grad_rel, worst = a, r, name
    from rl_service.training.distributed import BALANCING_BUFFER_SUFFIXES

    w_abs, w_rel, b_abs = 0.0, 0.0, 0.0
    for name, p in ref_state.items():
        a, r = diff(dp["state"][name], p)
        if name.endswith(BALANCING_BUFFER_SUFFIXES):  # per-rank quantiles averaged: close, not equal
            b_abs = max(b_abs, a)
        else:
            w_abs, w_rel = max(w_abs, a), max(w_rel, r)
    result = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "world": args.world, "strategy": dp["strategy"], "arch": args.arch, "preset": args.preset,
        "params": n_params, "samples": args.samples, "tokens": sum(s.num_tokens for s in batch),
        "loss_1rank": ref_metrics["loss"], "loss_nrank": float(dp["grads"]["__loss__"]),
        "loss_nrank_step": dp["metrics"]["loss"],
        "grad_norm_1rank": ref_metrics["grad_norm"], "grad_norm_nrank": dp["metrics"]["grad_norm"],
        "params_without_grad_on_ranks": len(missing),
        "grad_max_abs_diff": grad_abs, "grad_max_rel_diff": grad_rel, "grad_worst_param": worst,
        "weights_after_step_max_abs_diff": w_abs, "weights_after_step_max_rel_diff": w_rel,
        "step_s_1rank": single_s, "step_s_nrank": dp["step_s"],
        "optimizer_state_roundtrip_max_abs_diff": dp["optim_roundtrip_max_abs"],
    }
    width = max(len(k) for k in result)
    for k, v in result.items():
        print(f"{k:<{width}}  {v:.6g}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
