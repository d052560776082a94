"""Stable LatentMoE with quantile balancing (docs/design.md section 2).

Router on the full hidden x: s = sigmoid(W_r x) (fp32); the top-k of s + b are chosen (b: balancing bias,
a buffer without gradient); combine weights are s renormalised over the chosen set times
`routed_scaling_factor`. Experts (SiTU-GLU MLPs) run in a latent width l: z = W_down x,
y = sum_chosen w_e Expert_e(z) (fp32 sum), out = W_up RMSNorm(y) + SharedExpert(x).

Quantile balancing (no auxiliary loss): training forwards record the router scores; after the optimizer
step `update_balancing()` sets, per expert j, b~_j = -Q_j with Q_j the (1 - k/n) quantile of s_{.j} over
the recorded tokens, centres b~, and moves b <- mu b + (1 - mu) b~. Eval or no-grad forwards record nothing, so the
bias is frozen at inference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from model.config import TaperConfig
from model.layers.norm import RMSNorm
from model.layers.situ_glu import SiTUGLUMLP, situ_glu


def quantile_balancing_target(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Centred target bias b~ [n] from router scores [N, n]: -(1 - k/n) quantile per expert, minus its mean."""
    if scores.dim() != 2 or scores.shape[0] == 0:
        raise ValueError(f"scores must be [N > 0, n_experts], got {tuple(scores.shape)}")
    return balancing_targets(scores[None], None, top_k)[0][0]


def balancing_targets(scores: torch.Tensor, keep: torch.Tensor | None,
                      top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantile_balancing_target` for L layers at once, with padding dropped on the device: scores [L, N, n],
    keep [L, N] bool or None. Returns (targets [L, n], valid [L]: the layer had a real token). One sort for
    all layers and no host sync, so a CUDA graph can hold it."""
    L, N, n = scores.shape
    scores = scores.float()
    if keep is not None:  # padding sorts past every real score, and the quantile reads real ranks only
        scores = scores.masked_fill(~keep[..., None], float("inf"))
        count = keep.sum(-1)
    else:
        count = torch.full((L,), N, device=scores.device)
    # torch.quantile has an input-size limit; sort + linear interpolation has none.
    ordered = scores.transpose(1, 2).sort(dim=-1).values  # [L, n, N]
    position = (1.0 - top_k / n) * (count - 1).clamp_min(0).double()
    lo = position.floor()
    frac = (position - lo).float()[:, None]
    lo = lo.long()
    hi = torch.minimum(lo + 1, (count - 1).clamp_min(0))
    low = ordered.gather(-1, lo[:, None, None].expand(L, n, 1))[..., 0]
    high = ordered.gather(-1, hi[:, None, None].expand(L, n, 1))[..., 0]
    target = -(low + frac * (high - low))
    return target - target.mean(-1, keepdim=True), count > 0


def expert_counts(expert_ids: torch.Tensor, n_experts: int, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Assignments per expert [n_experts] (int64; fp32 when `weight` [N, ...] weighs each token's rows).
    A scatter-add, unlike `torch.bincount`, has a fixed output size, so on CUDA nothing waits for the host."""
    flat = expert_ids.reshape(-1)
    if weight is None:
        return flat.new_zeros(n_experts).scatter_add_(0, flat, torch.ones_like(flat))
    w = weight.to(torch.float32).reshape(-1, 1).expand(-1, expert_ids.shape[-1]).reshape(-1)
    return w.new_zeros(n_experts).scatter_add_(0, flat, w)


def top_k_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., k] of the k largest values along the last dim, largest first (ties: the lower index).
    k rounds of argmax over rows of n_experts: torch.compile fuses them with the scores into one kernel,
    where `torch.topk` is two kernels of its own on CUDA (a radix select and a sort)."""
    columns = torch.arange(values.shape[-1], device=values.device)
    chosen = []
    for _ in range(k):
        best = values.argmax(-1, keepdim=True)
        chosen.append(best)
        values = values.masked_fill(columns == best, float("-inf"))
    return torch.cat(chosen, -1)


class _RouterLogits(torch.autograd.Function):
    """x W^T of bf16/fp16 inputs as one low-precision GEMM with an fp32 result, on CUDA. The products of
    bf16 values are exact in fp32 and the GEMM accumulates in fp32, so the logits are those of the fp32
    product of the same values, without casting x [N, d] to fp32 (a copy of it) or running an fp32 GEMM.
    The backward rounds the logits' gradient to the input dtype, as any bf16 linear layer's is."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return torch.mm(x, weight.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.to(x.dtype)
        return grad @ weight, grad.t() @ x


class Router(nn.Module):
    """`weight` [n, d] and the balancing bias buffer `bias_correction` [n] (fp32, saved, no gradient)."""

    def __init__(self, hidden_size: int, n_experts: int, top_k: int, routed_scaling_factor: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, hidden_size))
        self.register_buffer("bias_correction", torch.zeros(n_experts, dtype=torch.float32), persistent=True)
        self.top_k, self.routed_scaling_factor = top_k, routed_scaling_factor

    def _apply(self, fn, recurse: bool = True):
        # Module.to(bf16) / .half() would round the balancing bias; it stays fp32 (moves device only).
        saved = self.bias_correction
        super()._apply(fn, recurse)
        moved = self.bias_correction
        if moved.dtype != torch.float32:
            self.bias_correction = saved.to(device=moved.device, dtype=torch.float32)
        return self

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """s = sigmoid(W_r x) in fp32: [N, n]."""
        low_precision = x.dtype in (torch.bfloat16, torch.float16) and self.weight.dtype == x.dtype
        if x.is_cuda and x.dim() == 2 and low_precision:
            return torch.sigmoid(_RouterLogits.apply(x, self.weight))
        return torch.sigmoid(x.float() @ self.weight.float().t())

    def select(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [N, k], combine weights [N, k] fp32)."""
        chosen = top_k_indices(scores.detach() + self.bias_correction.float(), self.top_k)
        # a masked sum rather than a gather: its backward is elementwise and fuses (a gather's is a scatter-add
        # into a zero-filled buffer: two kernels per layer)
        picked = (scores.unsqueeze(1) * (chosen.unsqueeze(-1) == torch.arange(scores.shape[-1], device=scores.device))
                  ).sum(-1)
        weights = picked / picked.sum(-1, keepdim=True) * self.routed_scaling_factor
        return chosen, weights


class ExpertRouting(NamedTuple):
    """Where each (token, choice) pair goes in the expert-sorted order. Pair i = token * k + choice;
    `order` [N*k] lists the pairs by expert (ties in pair order: `argsort(expert_ids.flatten(), stable=True)`),
    `slot` [N*k] is its inverse (the sorted position of pair i), `counts` [n] the pairs per expert."""

    order: torch.Tensor
    slot: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def of(cls, expert_ids: torch.Tensor, n_experts: int) -> ExpertRouting:
        """A counting sort: each pair's rank among the earlier pairs of its expert is a running sum over the
        one-hot choices. Elementwise work and short scans, no comparison sort, no data-dependent size."""
        flat = expert_ids.reshape(-1)
        one_hot = F.one_hot(flat, n_experts).to(torch.int32)  # [N*k, n]
        seen = _running_sum(one_hot)  # inclusive: pairs of each expert up to and with pair i
        counts = one_hot.sum(0)
        starts = counts.cumsum(0) - counts
        # the pair's own column of (start + rank): a masked row sum, which fuses (a gather would not)
        slot = ((starts + seen - 1) * one_hot).sum(1).long()
        # int32 values: inductor compiles a scatter of them itself (of int64 ones it falls back to aten, two kernels)
        order = torch.empty_like(slot, dtype=torch.int32).scatter_(
            0, slot, torch.arange(flat.numel(), device=flat.device, dtype=torch.int32)).long()
        return cls(order, slot, counts)


def _running_sum(x: torch.Tensor, block: int = 256) -> torch.Tensor:
    """Inclusive cumulative sum over dim 0 of x [M, n] (int32), in two levels: within blocks of `block` rows,
    then over the block totals. One scan over all M rows took ~90 us per MoE layer at 64K pairs on an H200,
    far more than its 4 MB of traffic (a few long sequential scans); blocks give M / block * n short ones."""
    M, n = x.shape
    pad = -M % block
    blocks = F.pad(x, (0, 0, 0, pad)).view(-1, block, n).cumsum(1, dtype=torch.int32)
    totals = blocks[:, -1]
    if torch.compiler.is_compiling():
        # the exclusive sum over the block totals as a masked sum, which inductor computes without materialising
        # the mask (a scan over them compiles to a split scan with a zero-filled workspace: two kernels per layer)
        earlier = torch.arange(totals.shape[0], device=x.device)
        before = (totals.unsqueeze(0) * (earlier.unsqueeze(1) > earlier.unsqueeze(0)).unsqueeze(-1)).sum(
            1, dtype=torch.int32)
    else:
        before = totals.cumsum(0, dtype=torch.int32) - totals
    return (blocks + before[:, None]).view(-1, n)[:M]


class _GatherRows(torch.autograd.Function):
    """out[i] = x[index[i] // group], where index is a permutation of range(len(x) * group) and `inverse` its
    inverse. The gradient is a gather as well (row t sums grad[inverse[t * group + j]] over j): no scatter,
    no atomics, no zero-filled buffer."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, group: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.group = group
        return x.index_select(0, index // group if group > 1 else index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        rows = grad.index_select(0, inverse)
        if ctx.group > 1:
            rows = rows.view(-1, ctx.group, grad.shape[-1]).sum(1, dtype=torch.float32).to(grad.dtype)
        return rows, None, None, None


class LatentExperts(nn.Module):
    """Fused expert weights: `gate_up_proj` [n, 2*I, l] (rows [:I] gate a, [I:] up u), `down_proj` [n, l, I]."""

    def __init__(self, n_experts: int, latent_size: int, intermediate_size: int, beta: float,
                 beta_linear: float) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * intermediate_size, latent_size))
        self.down_proj = nn.Parameter(torch.empty(n_experts, latent_size, intermediate_size))
        self.n_experts, self.intermediate_size = n_experts, intermediate_size
        self.beta, self.beta_linear = beta, beta_linear

    def expert(self, e: int, z: torch.Tensor) -> torch.Tensor:
        """Expert e on latent rows z [m, l] -> [m, l]."""
        a, u = (z @ self.gate_up_proj[e].t()).split(self.intermediate_size, dim=-1)
        return situ_glu(a, u, self.beta, self.beta_linear) @ self.down_proj[e].t()

    def forward(self, z: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                routing: ExpertRouting | None = None) -> torch.Tensor:
        """z [N, l]; expert_ids, weights [N, k]. Returns the fp32 weighted sum [N, l]. Each token's row is
        gathered once per choice into expert order and the outputs gathered back, so both directions are
        gathers that fuse with their neighbours (the weighting and the sum over choices included)."""
        N, k = expert_ids.shape
        if routing is None:
            routing = ExpertRouting.of(expert_ids, self.n_experts)
        rows = _GatherRows.apply(z, routing.order, routing.slot, k)
        out = self.sorted_experts(rows, routing.counts)
        per_choice = _GatherRows.apply(out, routing.slot, routing.order, 1).view(N, k, -1)
        return (per_choice.float() * weights[..., None]).sum(1)

    def sorted_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows [P, l] sorted by expert (counts [n] of each, in expert order) -> each row's expert output [P, l]."""
        return self._grouped(rows, counts) if self._uses_grouped_mm(rows) else self._looped(rows, counts)

    # Grouped GEMM over the expert-sorted rows: one op per projection, no host sync on CUDA. torch runs it in
    # bf16 on CUDA and in fp32 on CPU (there 2.7-3.3x faster than the loop over experts at 48-192 rows), and in
    # bf16 on CPU without autograd (no backward there; serving on an AMX CPU: 5x fp32 grouped at 8K rows).
    use_grouped_mm: bool = hasattr(torch, "_grouped_mm")

    def _uses_grouped_mm(self, z: torch.Tensor) -> bool:
        if z.is_cuda:
            supported: tuple[torch.dtype, ...] = (torch.bfloat16,)
        elif z.device.type == "cpu":
            supported = (torch.float32,) if torch.is_grad_enabled() else (torch.float32, torch.bfloat16)
        else:
            supported = ()
        return self.use_grouped_mm and z.dtype in supported

    def _grouped(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = counts.cumsum(0).to(torch.int32)
        gate_up = torch._grouped_mm(rows, self.gate_up_proj.transpose(-2, -1), offs=offs)
        a, u = gate_up.split(self.intermediate_size, dim=-1)
        h = situ_glu(a, u, self.beta, self.beta_linear)
        return torch._grouped_mm(h, self.down_proj.transpose(-2, -1), offs=offs)

    def _looped(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        outputs, start = [], 0
        # Every expert runs (empty ones on zero rows) so each slice of the fused weights joins autograd.
        for e, count in enumerate(counts.tolist()):
            outputs.append(self.expert(e, rows[start:start + count]))
            start += count
        return torch.cat(outputs)


class StableLatentMoE(nn.Module):
    def __init__(self, config: TaperConfig) -> None:
        super().__init__()
        d, ell = config.hidden_size, config.moe_latent_size
        self.n_experts, self.top_k = config.n_routed_experts, config.num_experts_per_tok
        self.momentum = config.balancing_momentum
        self.router = Router(d, self.n_experts, self.top_k, config.routed_scaling_factor)
        self.latent_down = nn.Linear(d, ell, bias=False)
        self.latent_norm = RMSNorm(ell, eps=config.rms_norm_eps)
        self.latent_up = nn.Linear(ell, d, bias=False)
        self.experts = LatentExperts(self.n_experts, ell, config.moe_intermediate_size, config.situ_beta,
                                     config.situ_beta_linear)
        self.shared_expert = (
            SiTUGLUMLP(d, config.n_shared_experts * config.shared_expert_intermediate_size, config.situ_beta,
                       config.situ_beta_linear)
            if config.n_shared_experts > 0 else None
        )
        # (scores [N, n] fp32, keep [N] bool or None) per training forward; padding is dropped when applied,
        # so the forward itself never selects by a mask (a data-dependent size would wait for the host).
        self._recorded_scores: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.last_load: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., d] -> [..., d]. token_mask [...] (1 = real token) keeps padding out of the balancing
        statistics and the load metric; training forwards record the scores for `update_balancing`."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        scores = self.router.scores(flat)
        expert_ids, weights = self.router.select(scores)
        routing = ExpertRouting.of(expert_ids, self.n_experts)
        keep = None if token_mask is None else token_mask.reshape(-1).to(torch.bool)
        # Only training forwards (train mode with autograd on) feed the balancing: inference engines and
        # no-grad evaluation passes never do, even if the module was left in train mode.
        self._observe(scores, expert_ids, routing, keep, record=self.training and torch.is_grad_enabled())
        # latent down-projection and the shared expert's gate/up: one GEMM over x
        ell = self.latent_down.out_features
        if self.shared_expert is None:
            z = self.latent_down(flat)
        else:
            both = F.linear(flat, torch.cat([self.latent_down.weight, self.shared_expert.gate_up_weight()]))
            z, shared_gate_up = both.split([ell, both.shape[-1] - ell], dim=-1)
        y = self.experts(z, expert_ids, weights, routing)
        out = self.latent_up(self.latent_norm(y).to(x.dtype))
        if self.shared_expert is not None:
            out = out + self.shared_expert.from_gate_up(shared_gate_up)
        return out.reshape(shape)

    @torch.no_grad()
    def _observe(self, scores: torch.Tensor, expert_ids: torch.Tensor, routing: ExpertRouting,
                 keep: torch.Tensor | None, record: bool) -> None:
        counts = (routing.counts if keep is None else expert_counts(expert_ids, self.n_experts, keep)).float()
        self.last_load = counts / counts.sum().clamp_min(1.0)
        if record:
            self._recorded_scores.append((scores.detach().float(), keep))

    @torch.no_grad()
    def update_balancing(self) -> torch.Tensor | None:
        """Apply quantile balancing from the scores recorded since the last call, then forget them.
        Returns the new bias, or None when nothing was recorded (e.g. eval mode) or only padding was (the
        one case that reads a value back to the host; `update_balancing` over all layers never does)."""
        applied = update_balancing([self])
        if not applied or (applied[0][1] is not None and not bool(applied[0][1])):
            return None
        return self.router.bias_correction.clone()

    def clear_recorded_scores(self) -> None:
        self._recorded_scores.clear()


@torch.no_grad()
def update_balancing(layers: Sequence[StableLatentMoE]) -> list[tuple[StableLatentMoE, torch.Tensor | None]]:
    """Quantile balancing of several MoE layers from the scores each recorded since the last call, then
    forget them. Returns (layer, valid) for each layer that had records: valid is None without padding masks,
    else a device bool, False when the layer saw only padding. Layers whose records have the same shapes share one
    sort and one multi-tensor bias update, with padding dropped on the device (a layer that saw only padding
    keeps its bias): a fixed number of kernels for the whole model and no host sync, so a training step
    captured as a CUDA graph can include it."""
    groups: dict[tuple, list[StableLatentMoE]] = {}
    for layer in layers:
        if layer._recorded_scores:
            shapes = tuple((s.shape, keep is not None) for s, keep in layer._recorded_scores)
            groups.setdefault((shapes, layer.top_k, layer.momentum), []).append(layer)
    applied: list[tuple[StableLatentMoE, torch.Tensor | None]] = []
    for (_, top_k, momentum), group in groups.items():
        records = [layer._recorded_scores for layer in group]
        forwards = range(len(records[0]))
        # [L, N, n]: per forward, one stack over the layers; then the forwards end to end
        scores = _cat1([torch.stack([r[i][0] for r in records]) for i in forwards])
        has_mask = any(keep is not None for r in records for _, keep in r)
        keep = None
        if has_mask:
            def mask(scores: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
                return torch.ones(scores.shape[0], dtype=torch.bool, device=scores.device) if keep is None else keep

            keep = _cat1([torch.stack([mask(*r[i]) for r in records]) for i in forwards])
        targets, valid = balancing_targets(scores, keep, top_k)
        biases = [layer.router.bias_correction for layer in group]
        current = torch.stack(biases)
        moved = momentum * current + (1.0 - momentum) * targets.to(current.device)
        new = torch.where(valid[:, None].to(current.device), moved, current) if has_mask else moved
        torch._foreach_copy_(biases, list(new.unbind(0)))
        for i, layer in enumerate(group):
            layer._recorded_scores.clear()
            applied.append((layer, valid[i] if has_mask else None))
    return applied


def _cat1(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
