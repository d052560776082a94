"""Data-parallel learner: one `RankLearner` per process (a Ray actor, or a plain process in scripts), joined
by torch.distributed (gloo on CPU, NCCL on GPU), the model sharded with FSDP2 (`fully_shard`) or replicated
with DDP.

Exactness: every token's loss weight comes from the *global* batch (`LossNorm`), each rank scales its loss
by the world size, and the wrappers average gradients over ranks, so the ranks together compute the
gradient of exactly the one-process loss. Ranks run the same number of micro-batches (empty ones pad),
because FSDP2 gathers parameters in every forward.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from rl_service.ports import free_port
from rl_service.training.learner import Learner, LearnerConfig, LossNorm, PolicySample, pack_micro_batches
from rl_service.training.learner.weight_push import (
    BALANCING_BUFFER_SUFFIXES,  # averaged over ranks after each update
)

Strategy = Literal["auto", "fsdp", "ddp"]

_SUM_KEYS = ("loss", "loss/policy", "loss/kl", "action_tokens", "tokens_per_s")
_MAX_KEYS = ("logprob_mismatch/max_abs", "is_ratio/max", "learn_time_s", "num_micro_batches")
_MIN_KEYS = ("is_ratio/min",)
_SAME_KEYS = ("grad_norm", "learning_rate")


def shard_samples(samples: Sequence[PolicySample], world_size: int) -> list[list[PolicySample]]:
    """Longest first onto the rank with the fewest tokens so far (deterministic)."""
    shards: list[list[PolicySample]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(samples)), key=lambda i: (-samples[i].num_tokens, i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        shards[r].append(samples[i])
        load[r] += samples[i].num_tokens
    return shards


def combine_metrics(per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """Merge per-rank learner metrics: sums, extrema, and token-weighted means for the rest."""
    tokens = [m.get("action_tokens", 0.0) for m in per_rank]
    total = sum(tokens) or 1.0
    out: dict[str, float] = {}
    for key in per_rank[0]:
        vals = [m.get(key, 0.0) for m in per_rank]
        if key in _SUM_KEYS:
            out[key] = sum(vals)
        elif key in _MAX_KEYS:
            out[key] = max(vals)
        elif key in _MIN_KEYS:
            out[key] = min(vals)
        elif key in _SAME_KEYS:
            out[key] = vals[0]
        else:
            out[key] = sum(v * t for v, t in zip(vals, tokens, strict=True)) / total
    return out


def _decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder layers, sharded one by one: HF's `_no_split_modules` classes, else the children of a
    ModuleList named `layers`. (Never finer: MoE layers may read their experts' weights directly.)"""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in classes]
    if blocks:
        return blocks
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and name.endswith("layers"):
            return list(m)
    return []


class RankLearner:
    """One data-parallel rank. `device` is this process's device ("cpu", "cuda:0", ...)."""

    def __init__(self, rank: int, world_size: int, init_method: str, model_dir: str, config: LearnerConfig,
                 strategy: Strategy = "auto", device: str = "cpu", ref_model_dir: str | None = None,
                 pad_token_id: int = 0, shard_layers: bool = False) -> None:
        from transformers import AutoModelForCausalLM

        import model as _taper  # noqa: F401  (registers the taper architecture with AutoModel)

        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
        inner = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device)
        for t in list(inner.parameters()) + list(inner.buffers()):  # identical start on every rank
            dist.broadcast(t.data, src=0)
        self.inner = inner
        self.strategy = self._pick(strategy)
        if self.strategy == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(self.device.type, (world_size,))
            # Per-layer units need each layer's output tensors to hook the backward gather on; the Taper
            # layers hand their output on through a mutable Block-AttnRes state, so by default the whole
            # model is one unit (parameters, gradients and optimizer state still sharded between steps).
            for block in _decoder_blocks(inner) if shard_layers else []:
                fully_shard(block, mesh=mesh)
            fully_shard(inner, mesh=mesh)
            wrapped: nn.Module = inner
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [self.device.index] if self.device.type == "cuda" else None
            wrapped = DDP(inner, device_ids=ids, find_unused_parameters=True)
        ref = None
        if config.beta > 0:
            ref = AutoModelForCausalLM.from_pretrained(ref_model_dir or model_dir, dtype=torch.float32).to(self.device)
        self.learner = Learner(wrapped, config, ref_model=ref, pad_token_id=pad_token_id, device=self.device,
                               balancing_model=_SyncedBalancing(inner))
        self.learner.loss_scale = float(world_size)

    @staticmethod
    def _pick(strategy: Strategy) -> str:
        if strategy != "auto":
            return strategy
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError:
            return "ddp"
        return "fsdp"

    def ping(self) -> str:
        return f"rank {self.rank}/{self.world_size} {self.strategy} on {self.device}"

    def step(self, samples: list[PolicySample], norm: LossNorm, min_micro_batches: int) -> dict[str, float]:
        return self.learner.step(samples, norm, min_micro_batches)

    def gradients(self, samples: list[PolicySample], norm: LossNorm, min_micro_batches: int) -> dict[str, torch.Tensor]:
        """Accumulate one pass and return the full (unsharded) gradients on CPU; zeroes them after."""
        self.learner.optimizer.zero_grad(set_to_none=True)
        mbs = self.learner.micro_batches(samples, norm, min_micro_batches)
        metrics = self.learner.accumulate(mbs)
        out = {"__loss__": torch.tensor(metrics["loss"])}
        for name, p in self.inner.named_parameters():
            g = p.grad
            if g is None:
                continue
            out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().cpu().clone()
        self.learner.optimizer.zero_grad(set_to_none=True)
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state on CPU (a collective: call on every rank; only rank 0's is complete)."""
        if self.strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(self.inner, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k: v.detach().cpu() for k, v in self.inner.state_dict().items()}

    def save_pretrained(self, path: str, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        self.inner.save_pretrained(path, state_dict=state_dict, safe_serialization=True)

    def learner_state(self) -> dict[str, Any]:
        """Optimizer + LR scheduler state with the optimizer's whole (unsharded) tensors keyed by parameter
        name (a collective: call on every rank; rank 0's is complete, the others' optimizer part is empty)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        optim = get_optimizer_state_dict(self.inner, self.learner.optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {"optimizer_by_name": optim, "scheduler": self.learner.scheduler.state_dict(),
                "optimizer_steps": self.learner.optimizer_steps, "world_size": self.world_size}

    def load_learner_state(self, state: dict[str, Any]) -> None:
        """Restore what `learner_state` returned (every rank gets the whole state and keeps its shard)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.inner, self.learner.optimizer, optim_state_dict=state["optimizer_by_name"],
                                 options=StateDictOptions(full_state_dict=True))
        self.learner.scheduler.load_state_dict(state["scheduler"])
        self.learner.optimizer_steps = int(state["optimizer_steps"])

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _node_address() -> tuple[str, int, str]:
    """This node's IP, a free port on it and its Ray node id (rank 0 hosts the rendezvous: ask on its node)."""
    import ray

    return ray.util.get_node_ip_address(), free_port(), ray.get_runtime_context().get_node_id()


class _SyncedBalancing:
    """`update_balancing()` on the local model, then average the balancing biases over ranks so the
    replicas route identically (each rank's quantiles come from its own tokens)."""

    def __init__(self, inner: nn.Module) -> None:
        self.inner = inner

    def update_balancing(self) -> None:
        update = getattr(self.inner, "update_balancing", None)
        if not callable(update):
            return
        update()
        world = dist.get_world_size()
        for name, buf in self.inner.named_buffers():
            if name.endswith(BALANCING_BUFFER_SUFFIXES):
                dist.all_reduce(buf.data, op=dist.ReduceOp.SUM)
                buf.data /= world


class LearnerRankStalled(TimeoutError):
    """A learner rank is alive but makes no progress (a hung collective, a stopped process)."""


class DistributedLearner:
    """Data-parallel learner over `num_ranks` Ray actors (same `step` contract as `Learner`).

    `placement_group` + `bundle_indices` pin rank r to bundle `bundle_indices[r]` (the scheduler reserves
    one bundle per rank); without them the ranks go wherever Ray finds room. `progress` is called about every
    `progress_every_s` while the ranks work, so a job's heartbeat keeps going through a long step.
    """

    def __init__(self, model_dir: str, config: LearnerConfig, num_ranks: int, use_gpu: bool = False,
                 strategy: Strategy = "auto", num_cpus_per_rank: float = 1.0, ref_model_dir: str | None = None,
                 pad_token_id: int = 0, actor_options: dict[str, Any] | None = None,
                 placement_group: Any = None, bundle_indices: Sequence[int] | None = None,
                 progress: Callable[[], None] | None = None, progress_every_s: float = 1.0,
                 rank_timeout_s: float | None = None) -> None:
        import ray
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        if placement_group is not None and (bundle_indices is None or len(bundle_indices) != num_ranks):
            raise ValueError(f"bundle_indices: need one bundle per rank ({num_ranks}), got {bundle_indices}")
        self.num_ranks = num_ranks
        self.progress = progress
        self.progress_every_s = progress_every_s
        self.rank_timeout_s = rank_timeout_s
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        opts: dict[str, Any] = {"num_cpus": num_cpus_per_rank, "num_gpus": 1 if use_gpu else 0,
                                "runtime_env": {"env_vars": env}}
        opts.update(actor_options or {})

        rank0_node: str | None = None

        def placed(rank: int) -> dict[str, Any]:
            if placement_group is not None:
                return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group, placement_group_bundle_index=int(bundle_indices[rank]))}
            if rank == 0 and rank0_node is not None:
                return {"scheduling_strategy": NodeAffinitySchedulingStrategy(rank0_node, soft=False)}
            return {}

        # Rank 0 binds the rendezvous port, so the address must be on rank 0's node: in a placement group
        # ask in its bundle; else ask on a node with room for a rank and pin rank 0 there.
        probe = {"num_cpus": 0} if placement_group is not None else {
            k: opts[k] for k in ("num_cpus", "num_gpus", "resources") if k in opts}
        addr, port, rank0_node = self._wait(ray.remote(_node_address).options(**probe, **placed(0)).remote(),
                                            start_up=True)
        init_method = f"tcp://{addr}:{port}"
        actor = ray.remote(RankLearner)
        self.ranks = [
            actor.options(**opts, **placed(r)).remote(
                r, num_ranks, init_method, model_dir, config, strategy, "cuda:0" if use_gpu else "cpu",
                ref_model_dir, pad_token_id)
            for r in range(num_ranks)
        ]
        self.config = config
        self._wait([a.ping.remote() for a in self.ranks], start_up=True)

    def _wait(self, refs: Any, start_up: bool = False) -> Any:
        """`ray.get`, calling `progress` while it waits. A rank that failed (died, raised) ends the wait at once,
        since the others may be blocked on it in a collective; calls after start-up that return nothing within
        `rank_timeout_s` raise LearnerRankStalled."""
        import ray

        many = isinstance(refs, list)
        pending = list(refs) if many else [refs]
        deadline = None if start_up or self.rank_timeout_s is None else time.monotonic() + self.rank_timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=self.progress_every_s)
            try:
                ray.get(ready)
            except ray.exceptions.RayTaskError as exc:  # often a peer's collective failing because a rank died
                self._raise_if_a_rank_died(exc)
                raise
            if self.progress is not None:
                self.progress()
            if pending and deadline is not None and time.monotonic() > deadline:
                raise LearnerRankStalled(f"{len(pending)} learner rank call(s) returned nothing within "
                                         f"{self.rank_timeout_s} s")
        return ray.get(refs)

    def _raise_if_a_rank_died(self, error: BaseException) -> None:
        """Name a dead rank as the cause of `error` (a RayActorError), so the job restarts rather than fails."""
        import ray

        for actor in getattr(self, "ranks", []):
            try:
                ray.get(actor.ping.remote(), timeout=10)
            except ray.exceptions.RayActorError as died:
                raise died from error
            except ray.exceptions.GetTimeoutError:  # alive, still busy
                continue

    def _plan(self, samples: Sequence[PolicySample]) -> tuple[list[list[PolicySample]], LossNorm, int]:
        shards = shard_samples(samples, self.num_ranks)
        n_mb = max(len(pack_micro_batches(s, self.config.micro_batch_tokens)) for s in shards)
        n_mb = max(n_mb, 1)
        norm = LossNorm.of(samples)
        norm.num_micro_batches = n_mb * len(shards)  # every rank runs n_mb passes (bnpo's mean over all)
        return shards, norm, n_mb

    def step(self, samples: Sequence[PolicySample]) -> dict[str, float]:

        shards, norm, n_mb = self._plan(samples)
        per_rank = self._wait([a.step.remote(s, norm, n_mb) for a, s in zip(self.ranks, shards, strict=True)])
        return combine_metrics(per_rank)

    def gradients(self, samples: Sequence[PolicySample]) -> dict[str, torch.Tensor]:

        shards, norm, n_mb = self._plan(samples)
        grads = self._wait([a.gradients.remote(s, norm, n_mb) for a, s in zip(self.ranks, shards, strict=True)])
        out = grads[0]
        out["__loss__"] = sum(g["__loss__"] for g in grads)
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self._wait([a.full_state_dict.remote() for a in self.ranks])[0]

    def state_dict(self) -> dict[str, Any]:
        """The optimizer and LR schedule of the data-parallel run (see `RankLearner.learner_state`)."""
        return self._wait([a.learner_state.remote() for a in self.ranks])[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "optimizer_by_name" not in state:
            raise ValueError("learner state: no 'optimizer_by_name' (not written by a data-parallel learner)")
        self._wait([a.load_learner_state.remote(state) for a in self.ranks])

    def shutdown(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.get([a.shutdown.remote() for a in self.ranks], timeout=30)
        for a in self.ranks:
            ray.kill(a)
