"""The learner: per-token logprobs, the clipped PG loss over packed micro-batches, AdamW + LR schedule."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from trl.trainer.utils import disable_dropout_in_model, entropy_from_logits, selective_log_softmax

from rl_service.training.learner.batch import LossNorm, MicroBatch, PolicySample, collate, pack_micro_batches
from rl_service.training.learner.config import LearnerConfig
from rl_service.training.learner.loss import importance_sampling_ratio, policy_loss


def completion_logits(model: nn.Module, mb: MicroBatch) -> torch.Tensor:
    """Logits `[B, C, V]` (fp32) that predict each completion token: position `P + j - 1` predicts token j.

    Right padding plus causal attention leaves the real positions untouched; the mask still goes in so that
    padding stays out of the MoE balancing statistics.
    """
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
    b, c = mb.completion_ids.shape
    pos = (mb.prompt_lens.unsqueeze(1) - 1 + torch.arange(c, device=logits.device)).clamp(max=logits.shape[1] - 1)
    rows = torch.arange(b, device=logits.device).unsqueeze(1)
    return logits[rows, pos].float()


def token_logprobs_and_entropy(logits: torch.Tensor, index: torch.Tensor, temperature: float = 1.0,
                               with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token logprobs of `index` under `logits / temperature`, and (no grad) the entropy: TRL's own
    `selective_log_softmax` and `entropy_from_logits` (fused Triton kernels on CUDA, chunked torch elsewhere)."""
    logps = selective_log_softmax(logits, index, temperature)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits / temperature if temperature != 1.0 else logits)
    return logps, entropy


class Learner:
    """Trains `model` on `PolicySample`s. One `step` = `num_iterations` optimizer steps over the batch.

    `loss_scale` multiplies every micro-batch loss before backward: data-parallel wrappers average
    gradients over ranks, and each rank's loss already carries global-batch normalisation, so the
    distributed learner sets it to the world size to turn that average into the exact sum.
    """

    def __init__(self, model: nn.Module, config: LearnerConfig, ref_model: nn.Module | None = None,
                 pad_token_id: int = 0, device: torch.device | str | None = None,
                 balancing_model: nn.Module | None = None, compile_layers: str | None = None) -> None:
        self.config = config
        self.model = model
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.compiled_layers = self._compile_layers(compile_layers or config.compile_layers)
        self.ref_model = ref_model
        if config.beta > 0 and ref_model is None:
            raise ValueError("LearnerConfig.beta > 0 needs a reference model")
        if ref_model is not None:
            ref_model.eval()
            ref_model.requires_grad_(False)
        self.pad_token_id = pad_token_id
        self.balancing_model = balancing_model if balancing_model is not None else model
        self.loss_scale = 1.0
        self.progress: Callable[[], None] | None = None  # called after each micro-batch (a job's heartbeat)
        disable_dropout_in_model(model)  # dropout would make logprobs differ from the sampler's and between passes
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_epsilon, weight_decay=config.weight_decay,
        )
        from transformers import get_scheduler

        self.scheduler = get_scheduler(
            config.lr_scheduler_type, self.optimizer, num_warmup_steps=config.warmup_steps,
            num_training_steps=max(config.max_steps, 1),
        )
        self.optimizer_steps = 0

    # ---- helpers ----
    def _compile_layers(self, scope: str) -> str | None:
        """`compile_layers(scope)` of a Taper model ("stack": the layer stack as one compiled graph, "parts": each
        layer part); "none" keeps it eager. "auto" picks "stack" on a single CUDA device and leaves CPU (compile
        time outweighs the gain there) and data-parallel wrappers eager. Shapes are compiled dynamic: a
        micro-batch's rows and length change from one to the next (docs/benchmarks/model.md)."""
        if scope == "auto":
            distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
            scope = "stack" if self.device.type == "cuda" and not distributed else "none"
        inner = getattr(self.model, "model", None)
        if scope == "none" or not hasattr(inner, "compile_layers"):
            return None
        inner.compile_layers(scope, dynamic=True)
        return scope

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.config.bf16 and self.device.type == "cuda":
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _grad_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2
            self.model.set_requires_gradient_sync(enabled)
            return contextlib.nullcontext()
        if not enabled and hasattr(self.model, "no_sync"):  # DDP
            return self.model.no_sync()
        return contextlib.nullcontext()

    def micro_batches(self, samples: Sequence[PolicySample], norm: LossNorm,
                      min_micro_batches: int = 0) -> list[MicroBatch]:
        groups = pack_micro_batches(samples, self.config.micro_batch_tokens)
        if norm.num_micro_batches is None:
            norm = dataclasses.replace(norm, num_micro_batches=max(len(groups), min_micro_batches, 1))
        mbs = [collate(samples, g, norm, self.config, self.pad_token_id).to(self.device) for g in groups]
        while len(mbs) < min_micro_batches:  # data-parallel ranks must run the same number of passes
            mbs.append(_empty_like(mbs[0] if mbs else None, self.device))
        return mbs

    @torch.no_grad()
    def logprobs(self, samples: Sequence[PolicySample], model: nn.Module | None = None) -> list[list[float]]:
        """The model's logprobs of each sample's completion tokens (no grad)."""
        model = model if model is not None else self.model
        was_training = model.training
        model.eval()  # eval forwards record no MoE balancing statistics
        norm = LossNorm.of(samples)
        out: list[list[float]] = [[] for _ in samples]
        try:
            for mb in self.micro_batches(samples, norm):
                with self._autocast():
                    logits = completion_logits(model, mb)
                lp, _ = token_logprobs_and_entropy(logits, mb.completion_ids, self.config.temperature, False)
                for r, i in enumerate(mb.sample_index):
                    out[i] = lp[r, : len(samples[i].completion_ids)].tolist()
        finally:
            model.train(was_training)
        return out

    # ---- training ----
    def accumulate(self, mbs: list[MicroBatch], old: dict[int, torch.Tensor] | None = None,
                   is_ratios: dict[int, torch.Tensor] | None = None,
                   ref: dict[int, torch.Tensor] | None = None) -> dict[str, float]:
        """Forward + backward over all micro-batches (gradients accumulate; no optimizer step).

        `old`, `is_ratios`, `ref` are keyed by micro-batch position; missing entries are filled in from this
        pass (the first pass of a step defines the "old" policy), so the caller can reuse them next pass.
        """
        cfg = self.config
        old = {} if old is None else old
        is_ratios = {} if is_ratios is None else is_ratios
        ref = {} if ref is None else ref
        totals: dict[str, float] = {}
        ent_sum = 0.0
        mism_abs = 0.0
        mism_max = 0.0
        mism_k3 = 0.0
        is_sum, is_min, is_max = 0.0, math.inf, -math.inf
        self.model.train()
        for k, mb in enumerate(mbs):
            with self._grad_sync(k == len(mbs) - 1), self._autocast():
                logits = completion_logits(self.model, mb)
                logps, entropy = token_logprobs_and_entropy(logits, mb.completion_ids, cfg.temperature)
                if k not in old:
                    old[k] = logps.detach()
                    if cfg.vllm_importance_sampling_correction:
                        is_ratios[k] = importance_sampling_ratio(old[k], mb.engine_logprobs, mb.mask, cfg)
                    if cfg.beta > 0:
                        with torch.no_grad():
                            ref_logits = completion_logits(self.ref_model, mb)
                            ref[k], _ = token_logprobs_and_entropy(ref_logits, mb.completion_ids,
                                                                   cfg.temperature, False)
                loss, sums = policy_loss(logps, old[k], mb.advantages, mb.mask, mb.token_weights, cfg,
                                         is_ratio=is_ratios.get(k), ref_logps=ref.get(k))
                (loss * self.loss_scale).backward()
            if self.progress is not None:
                self.progress()
            for name, v in sums.items():
                totals[name] = totals.get(name, 0.0) + float(v)
            m = mb.mask > 0
            if m.any():
                ent_sum += float(entropy[m].sum())
                d = (old[k] - mb.engine_logprobs)[m]
                mism_abs += float(d.abs().sum())
                mism_max = max(mism_max, float(d.abs().max()))
                mism_k3 += float((torch.exp(-d) + d - 1).sum())  # KL(engine || learner), k3 estimator
                if k in is_ratios:
                    r = is_ratios[k][m]
                    is_sum += float(r.sum())
                    is_min, is_max = min(is_min, float(r.min())), max(is_max, float(r.max()))
        n = max(totals.get("tokens", 0.0), 1.0)
        metrics = {
            "loss": totals.get("loss_policy", 0.0) + totals.get("loss_kl", 0.0),
            "loss/policy": totals.get("loss_policy", 0.0),
            "loss/kl": totals.get("loss_kl", 0.0),
            "kl": totals.get("kl", 0.0) / n,
            "entropy": ent_sum / n,
            "clip_ratio/low_mean": totals.get("clip_low", 0.0) / n,
            "clip_ratio/high_mean": totals.get("clip_high", 0.0) / n,
            "clip_ratio/region_mean": totals.get("clip_region", 0.0) / n,
            "logprob_mismatch/mean_abs": mism_abs / n,
            "logprob_mismatch/max_abs": mism_max,
            "logprob_mismatch/kl": mism_k3 / n,
            "action_tokens": totals.get("tokens", 0.0),
        }
        if is_ratios:
            metrics.update({"is_ratio/mean": is_sum / n, "is_ratio/min": is_min if is_sum else 1.0,
                            "is_ratio/max": is_max if is_sum else 1.0})
        return metrics

    def optimizer_step(self) -> float:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):  # DTensor under FSDP2
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        update = getattr(self.balancing_model, "update_balancing", None)
        if callable(update):
            update()
        return float(grad_norm)

    def step(self, samples: Sequence[PolicySample], norm: LossNorm | None = None,
             min_micro_batches: int = 0) -> dict[str, float]:
        """Train on one batch; `norm` is the global batch's counts (defaults to this batch's)."""
        if not samples and min_micro_batches == 0:
            raise ValueError("Learner.step needs at least one sample")
        t0 = time.perf_counter()
        norm = norm if norm is not None else LossNorm.of(samples)
        mbs = self.micro_batches(samples, norm, min_micro_batches)
        old: dict[int, torch.Tensor] = {}
        is_ratios: dict[int, torch.Tensor] = {}
        ref: dict[int, torch.Tensor] = {}
        lr = self.scheduler.get_last_lr()[0]
        metrics: dict[str, float] = {}
        grad_norms = []
        for it in range(self.config.num_iterations):
            m = self.accumulate(mbs, old, is_ratios, ref)
            grad_norms.append(self.optimizer_step())
            if it == 0:
                metrics = m  # metrics of the first pass: the on-policy view of the batch
        elapsed = time.perf_counter() - t0
        metrics.update({
            "grad_norm": grad_norms[0],
            "learning_rate": lr,
            "num_micro_batches": float(len(mbs)),
            "learn_time_s": elapsed,
            "tokens_per_s": sum(s.num_tokens for s in samples) * self.config.num_iterations / max(elapsed, 1e-9),
        })
        return metrics

    # ---- state ----
    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.optimizer_steps = int(state["optimizer_steps"])


def _empty_like(mb: MicroBatch | None, device: torch.device) -> MicroBatch:
    """A one-token micro-batch with zero mask and weights: contributes nothing but runs the collectives."""
    z = torch.zeros((1, 1), device=device)
    ids = torch.zeros((1, 2), dtype=torch.long, device=device)
    return MicroBatch(ids, torch.ones_like(ids), torch.ones(1, dtype=torch.long, device=device),
                      torch.zeros((1, 1), dtype=torch.long, device=device), z, z.clone(), z.clone(), z.clone(), [])
