"""The served layers that work token by token: Block AttnRes with the RMSNorm that follows it, the SiTU-GLU MLP
and the Stable LatentMoE, each a subclass of the HF module with the same parameters and math in fewer ops
(concatenated projections, compiled CPU passes). Importable without vLLM, so that the CPU benchmarks time the
served forms where vLLM is not installed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attn_res_cpu import attn_res_rmsnorm
from kernels.moe_cpu import combine_rmsnorm_cpu, glu_combine_cpu, rmsnorm_glu_cpu, route_cpu, route_dense_cpu
from model.layers.attn_res import BlockAttnRes
from model.layers.moe import Router, StableLatentMoE
from model.layers.norm import RMSNorm
from model.layers.situ_glu import SiTUGLUMLP, situ_glu
from model.vllm_plugin.fused import (
    DerivedArrays,
    DerivedLinear,
    derived_arrays,
    derived_linear,
    fused,
    linear,
)


class VllmBlockAttnRes(BlockAttnRes):
    """`BlockAttnRes` with the same parameters and math in fewer passes: the score
    <V_i / rms(V_i), gamma * w> is computed as <V_i, gamma * w> / rms(V_i) (one matmul, one norm). Decode
    steps (few tokens, where the count of ops costs more than the bytes) stack the candidates once;
    prefills read each candidate in place (a norm, a matvec, one multiply-add into the fp32 mix) instead
    of materialising stacked fp32 copies: 2-4x faster at 4K tokens on CPU. On CPU the served layers call
    `mix_and_norm`, one compiled pass for both."""

    STACKED_MAX_TOKENS = 128

    def forward(self, candidates: list[torch.Tensor]) -> torch.Tensor:
        key = self.norm.weight.float() * self.query.float()
        if candidates[0].shape[0] < self.STACKED_MAX_TOKENS:
            stacked = torch.stack(candidates).float()  # [N, T, d]
            inv_rms = torch.rsqrt(stacked.pow(2).mean(-1) + self.eps)  # [N, T]
            weights = torch.softmax(torch.matmul(stacked, key) * inv_rms, dim=0)
            mixed = torch.bmm(stacked.permute(1, 2, 0), weights.t().unsqueeze(-1)).squeeze(-1)  # [T, d]
            return mixed.to(candidates[0].dtype)
        d = key.shape[0]

        def score(candidate: torch.Tensor) -> torch.Tensor:  # fp32 scores of one candidate's tokens
            c = candidate.float()
            return torch.mv(c, key) * torch.rsqrt(torch.linalg.vector_norm(c, dim=-1).square() / d + self.eps)

        weights = torch.softmax(torch.stack([score(c) for c in candidates]), dim=0)  # [N, T]
        mixed = candidates[0] * weights[0, :, None]  # fp32
        for candidate, weight in zip(candidates[1:], weights[1:], strict=True):
            mixed.addcmul_(candidate, weight[:, None])
        return mixed.to(candidates[0].dtype)

    def mix_and_norm(self, candidates: list[torch.Tensor], norm: RMSNorm) -> torch.Tensor:
        """norm(self(candidates)): the mix and the sub-layer's RMSNorm that always follows it. On CPU one
        compiled pass (`kernels.attn_res_cpu`) that reads the candidates in place: a decode step's few tokens
        in one call instead of ~25 small ops, a prefill's thousands without fp32 copies of every candidate."""
        if candidates[0].device.type != "cpu":
            return norm(self(candidates))
        key, norm_weight = derived_arrays(
            self, "key_and_norm", lambda: (self.norm.weight, self.query, norm.weight),
            lambda gamma, query, weight: (gamma.float() * query.float(), weight),
        ).tensors()
        return attn_res_rmsnorm(candidates, key, self.eps, norm_weight, norm.eps)


class VllmSiTUGLUMLP(SiTUGLUMLP):
    """`SiTUGLUMLP` with gate and up projections as one matmul."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = fused(self, "gate_up", lambda: (self.gate_proj, self.up_proj))(x)
        return linear(self.down_proj, situ_glu(gate, up, self.beta, self.beta_linear))


# Small batches (decode) skip the HF dispatch's loop over experts. With at least n/2 routed (token, expert)
# pairs (n experts), every expert runs on every token as two dense matmuls and the combine weights (zero
# for unchosen experts) pick the sum: n/k times the useful FLOPs but each expert's weights read once, no
# gathers. With fewer pairs (up to GATHERED_EXPERTS_MAX_PAIRS) each pair's expert weights are gathered for
# one batched matmul. Above that, the HF dispatch: a grouped GEMM over the expert-sorted rows (on CPU in
# fp32 it beats dense from ~32 tokens: 0.85 vs 1.07 ms at 64 on the tiny preset, one core).
DENSE_EXPERTS_MAX_TOKENS = 32
GATHERED_EXPERTS_MAX_PAIRS = 64


def select_experts(router: Router, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`router.select` at inference in a third of its ops: torch.topk and a gather (the training form's
    argmax rounds and masked sums exist for torch.compile and autograd). Equal choices and weights, but for
    exact ties of biased scores, which topk may break either way."""
    chosen = torch.topk(scores + router.bias_correction, router.top_k, dim=-1, sorted=False).indices
    picked = scores.gather(-1, chosen)
    return chosen, picked * (router.routed_scaling_factor / picked.sum(-1, keepdim=True))


class VllmStableLatentMoE(StableLatentMoE):
    """Stable LatentMoE at inference: frozen balancing bias, no load statistics, fast small-batch experts, and
    on CPU at prefill sizes the routing and the combine + latent norm as compiled passes."""

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        shared = self.shared_expert
        # One matmul for everything that reads x; the router joins only in fp32, where it computes anyway.
        with_router = x.dtype == torch.float32
        name = "input_with_router" if with_router else "input"
        outs = fused(self, name, lambda: self._input_linears(with_router))(x)
        logits, outs = (outs[0], outs[1:]) if with_router else (None, outs)
        pairs = x.shape[0] * self.top_k
        dense = x.shape[0] <= DENSE_EXPERTS_MAX_TOKENS and 2 * pairs >= self.n_experts
        if dense and shared is not None and x.device.type == "cpu":
            return self._dense_step_cpu(x, logits, outs)
        if with_router:
            scores = torch.sigmoid(logits)
        elif x.device.type == "cpu":  # = self.router.scores(x), the fp32 copy of its weight kept
            scores = torch.sigmoid(F.linear(x.float(), self._router_weight_fp32().tensors()[0]))
        else:  # on a GPU one low-precision GEMM with fp32 logits
            scores = self.router.scores(x)
        z = outs[0]
        if pairs > GATHERED_EXPERTS_MAX_PAIRS and x.device.type == "cpu":
            latent = self._sorted_experts_cpu(z, scores)
        else:
            expert_ids, weights = select_experts(self.router, scores)
            if dense:
                y = self._dense_experts(z, expert_ids, weights)
            elif pairs <= GATHERED_EXPERTS_MAX_PAIRS:
                y = self._gathered_experts(z, expert_ids, weights)
            else:
                y = self.experts(z, expert_ids, weights)
            latent = self.latent_norm(y).to(x.dtype)
        if shared is None:
            return linear(self.latent_up, latent)
        return self._up_and_shared_down(torch.cat([latent, situ_glu(outs[1], outs[2], shared.beta, shared.beta_linear)],
                                                  dim=-1))

    def _up_and_shared_down(self, latent_and_h: torch.Tensor) -> torch.Tensor:
        """latent_up(latent) + shared.down_proj(h) as one matmul: [latent | h] @ [W_up | W_down]^T."""
        return self._up_and_shared_down_linear()(latent_and_h)

    def _up_and_shared_down_linear(self) -> DerivedLinear:
        up, down = self.latent_up, self.shared_expert.down_proj
        return derived_linear(self, "up_and_shared_down", lambda: (up.weight, down.weight),
                              lambda w_up, w_down: torch.cat([w_up, w_down], dim=1))

    def build_caches(self) -> None:
        """Build every derived weight a step may use now. On a GPU the decode steps of some sizes are first run
        while vLLM captures their CUDA graphs, where a weight built on first use would hold nothing until the
        graph's first replay (a capture records kernels without running them)."""
        with_router = self.router.weight.dtype == torch.float32
        fused(self, "input_with_router" if with_router else "input", lambda: self._input_linears(with_router)).weight()
        for derived in self._all_experts():
            derived.weight()
        if self.shared_expert is not None:
            self._up_and_shared_down_linear().weight()

    def _dense_step_cpu(self, x: torch.Tensor, logits: torch.Tensor | None, outs: tuple[torch.Tensor, ...]
                        ) -> torch.Tensor:
        """A decode step's MoE on CPU (few tokens, a shared expert): `_dense_experts` with the routing, the
        GLU scaled by the routing weights, and the latent norm beside the shared GLU as compiled passes
        (`kernels.moe_cpu`) between the four matmuls, in place of ~50 small ops. `logits`: the router's, where
        the fused input projection computed them (fp32); else the routing pass computes them from x."""
        router, experts, shared = self.router, self.experts, self.shared_expert
        weight = self._router_weight_fp32()()[0] if logits is None else None
        combine = route_dense_cpu(x if logits is None else logits, weight, router.bias_correction, router.top_k,
                                  router.routed_scaling_factor)
        gate_up_rows, down_columns = self._all_experts()
        y = down_columns(glu_combine_cpu(gate_up_rows(outs[0]), combine, experts.beta, experts.beta_linear))
        (norm_weight,) = derived_arrays(self, "latent_norm", lambda: (self.latent_norm.weight,), lambda w: (w,))()
        return self._up_and_shared_down(rmsnorm_glu_cpu(y, norm_weight, self.latent_norm.eps, outs[1], outs[2],
                                                        shared.beta, shared.beta_linear))

    def _input_linears(self, with_router: bool) -> tuple[torch.nn.Module, ...]:
        shared = self.shared_expert
        heads = (self.latent_down,) + ((shared.gate_proj, shared.up_proj) if shared is not None else ())
        return ((self.router,) if with_router else ()) + heads

    def _dense_experts(self, z: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_k w_k Expert_{e_k}(z) for each token: z [N, l], expert_ids/weights [N, k] -> [N, l] in z's dtype.
        Two matmuls over all n experts' weights as single matrices: the combine weights (zero for unchosen
        experts) scale each expert's activations, so the down projections' sum over experts is one matmul."""
        experts = self.experts
        n, inter = experts.n_experts, experts.intermediate_size
        N = z.shape[0]
        gate_up_rows, down_columns = self._all_experts()
        gate_up = gate_up_rows(z).view(N, n, 2 * inter)
        h = situ_glu(*gate_up.split(inter, dim=-1), experts.beta, experts.beta_linear)  # [N, n, I]
        combine = weights.new_zeros(N, n).scatter_(1, expert_ids, weights)  # [N, n] fp32
        return down_columns((h * combine.unsqueeze(-1)).to(z.dtype).view(N, n * inter))

    def _router_weight_fp32(self) -> DerivedArrays:
        """The router's weight in fp32 (kept: the routing computes in fp32 whatever the model's dtype)."""
        router = self.router
        return derived_arrays(router, "fp32", lambda: (router.weight,), lambda w: (w,))

    def _all_experts(self) -> tuple[DerivedLinear, DerivedLinear]:
        """Every expert at once: the gate|up projections as the rows of one weight [n * 2I, l], the down
        projections as the columns of one [l, n * I] (column e * I + i is expert e's down_proj[:, i])."""
        experts = self.experts
        return (derived_linear(experts, "gate_up_rows", lambda: (experts.gate_up_proj,), lambda w: w.flatten(0, 1)),
                derived_linear(experts, "down_columns", lambda: (experts.down_proj,),
                               lambda w: w.permute(1, 0, 2).reshape(w.shape[1], -1)))

    def _sorted_experts_cpu(self, z: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """latent_norm(experts(z)) in z's dtype, with the routing and the combine + norm as compiled passes
        (`kernels.moe_cpu`) around the grouped expert matmuls."""
        router = self.router
        weights, rows, slot, counts = route_cpu(scores, router.bias_correction, router.top_k,
                                                router.routed_scaling_factor)
        out = self.experts.sorted_experts(z.index_select(0, rows), counts)
        return combine_rmsnorm_cpu(out, slot, weights, self.latent_norm.weight, self.latent_norm.eps, z.dtype)

    def _gathered_experts(self, z: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Same as `_dense_experts`, computing only the chosen pairs from gathered expert weights."""
        experts = self.experts
        gate_up = experts.gate_up_proj[expert_ids]  # [N, k, 2I, l]
        a, u = torch.einsum("nl,nkil->nki", z, gate_up).split(experts.intermediate_size, dim=-1)
        h = situ_glu(a, u, experts.beta, experts.beta_linear)
        out = torch.einsum("nki,nkli->nkl", h, experts.down_proj[expert_ids])
        return (out.float() * weights[..., None]).sum(1)
