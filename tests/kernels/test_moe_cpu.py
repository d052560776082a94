"""The MoE's compiled CPU passes (`kernels.moe_cpu`) against the torch forms of `model.layers.moe`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.moe_cpu import combine_rmsnorm_cpu, glu_combine_cpu, rmsnorm_glu_cpu, route_cpu, route_dense_cpu
from model.layers.moe import ExpertRouting, Router
from model.layers.norm import RMSNorm
from model.layers.situ_glu import situ_glu


@pytest.mark.parametrize("tokens,n,k", [(1, 8, 2), (300, 8, 2), (77, 12, 3), (40, 5, 5)])
def test_routing_matches_the_routers_choice_weights_and_sort(tokens: int, n: int, k: int) -> None:
    torch.manual_seed(tokens + n + k)
    router = Router(16, n_experts=n, top_k=k, routed_scaling_factor=2.5)
    router.bias_correction.normal_(0, 0.3)  # the bias steers the choice, not the weights
    scores = torch.rand(tokens, n)
    weights, rows, slot, counts = route_cpu(scores, router.bias_correction, k, router.routed_scaling_factor)

    chosen, ref_weights = router.select(scores)
    # the pair order within a token is the pass's own: compare each token's (expert, weight) pairs as sets
    order = chosen.argsort(-1)
    ref = torch.stack([chosen.gather(-1, order).float(), ref_weights.gather(-1, order)])
    ours_experts = torch.empty(tokens * k, dtype=torch.int64)
    running = torch.cumsum(counts, 0) - counts
    for e in range(n):  # the sorted pairs of expert e are slots running[e] .. running[e] + counts[e] - 1
        ours_experts[running[e]:running[e] + counts[e]] = e
    pair_expert = ours_experts[slot].view(tokens, k)
    mine = pair_expert.argsort(-1)
    got = torch.stack([pair_expert.gather(-1, mine).float(), weights.gather(-1, mine)])
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)

    routing = ExpertRouting.of(pair_expert, n)  # the torch counting sort of the same choices
    assert torch.equal(counts, routing.counts.long())
    assert torch.equal(slot, routing.slot) and torch.equal(rows, routing.order // k)


def test_exact_ties_go_to_the_lower_expert() -> None:
    scores = torch.tensor([[0.5, 0.7, 0.7, 0.7], [0.9, 0.1, 0.9, 0.2]])
    weights, rows, slot, counts = route_cpu(scores, torch.zeros(4), 2, 1.0)
    assert counts.tolist() == [1, 1, 2, 0]  # token 0: experts 1, 2; token 1: experts 0, 2
    torch.testing.assert_close(weights, torch.full((2, 2), 0.5))


def test_routing_rejects_a_top_k_beyond_the_experts() -> None:
    with pytest.raises(ValueError, match="top_k 5"):
        route_cpu(torch.rand(3, 4), torch.zeros(4), 5, 1.0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("tokens,k,ell", [(1, 2, 8), (50, 2, 128), (33, 3, 40)])
def test_combine_and_norm_match_the_torch_form(cpu_threads: int, dtype: torch.dtype, tol: float, tokens: int, k: int,
                                               ell: int) -> None:
    torch.manual_seed(tokens * k + ell)
    out = (torch.randn(tokens * k, ell) * 3).to(dtype)  # the experts' outputs in sorted order
    slot = torch.randperm(tokens * k)
    weights = torch.rand(tokens, k) + 0.1
    norm = RMSNorm(ell, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        ref = norm((out.double()[slot].view(tokens, k, ell) * weights.double()[..., None]).sum(1))
    y = combine_rmsnorm_cpu(out, slot, weights, norm.weight.float(), 1e-6, dtype)
    assert y.dtype == dtype and y.shape == (tokens, ell)
    assert ((y.double() - ref).norm() / ref.norm()).item() < tol
    torch.set_num_threads(1)
    assert torch.equal(combine_rmsnorm_cpu(out, slot, weights, norm.weight.float(), 1e-6, dtype), y)


def test_combine_rejects_outputs_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        combine_rmsnorm_cpu(torch.randn(5, 8), torch.arange(6), torch.rand(3, 2), torch.ones(8), 1e-6,
                            torch.float32)


def _dense(chosen: torch.Tensor, weights: torch.Tensor, n: int) -> torch.Tensor:
    return torch.zeros(chosen.shape[0], n, dtype=weights.dtype).scatter_(1, chosen, weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,n,k", [(1, 8, 2), (8, 8, 2), (13, 12, 3)])
def test_dense_routing_matches_the_router(dtype: torch.dtype, tokens: int, n: int, k: int) -> None:
    torch.manual_seed(tokens * n + k)
    router = Router(48, n_experts=n, top_k=k, routed_scaling_factor=2.5)
    router.bias_correction.normal_(0, 0.3)
    x = torch.randn(tokens, 48).to(dtype)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        logits = x.float() @ router.weight.t()
        ref = _dense(*router.select(torch.sigmoid(logits)), n)
        from_x = route_dense_cpu(x, router.weight.float().numpy(), router.bias_correction, k, 2.5)
    from_logits = route_dense_cpu(logits, None, router.bias_correction, k, 2.5)
    torch.testing.assert_close(from_logits, ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(from_x, ref, rtol=1e-5, atol=1e-6)  # the logits summed in another order
    assert ((from_x > 0).sum(1) == k).all()


def test_dense_routing_reads_logits_in_place_and_rejects_misfits() -> None:
    fused = torch.randn(4, 3 + 8)  # e.g. the router's logits as the leading columns of a fused projection
    strided = route_dense_cpu(fused[:, 3:], None, torch.zeros(8), 2, 1.0)
    torch.testing.assert_close(strided, route_dense_cpu(fused[:, 3:].contiguous(), None, torch.zeros(8), 2, 1.0))
    with pytest.raises(ValueError, match="top_k 9"):
        route_dense_cpu(fused[:, 3:], None, torch.zeros(8), 9, 1.0)
    with pytest.raises(ValueError, match="does not fit a router"):
        route_dense_cpu(torch.randn(4, 5), np.ones((8, 6), np.float32), torch.zeros(8), 2, 1.0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
def test_glu_combine_matches_the_torch_form(dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(3)
    T, n, inter = 6, 8, 24
    gate_up = (torch.randn(T, n * 2 * inter) * 3).to(dtype)
    combine = _dense(torch.rand(T, n).topk(2).indices, torch.rand(T, 2) + 0.1, n)
    a, u = gate_up.double().view(T, n, 2 * inter).split(inter, dim=-1)
    ref = (situ_glu(a, u, 4.0, 6.0) * combine.double()[..., None]).reshape(T, n * inter)
    out = glu_combine_cpu(gate_up, combine, 4.0, 6.0)
    assert out.dtype == dtype and out.shape == (T, n * inter)
    assert ((out.double() - ref).norm() / ref.norm()).item() < tol
    assert (out.view(T, n, inter).abs().sum(-1) > 0).eq(combine > 0).all()  # unchosen experts give zeros


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
def test_rmsnorm_beside_the_glu_matches_the_torch_forms(dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(4)
    T, ell, inter = 5, 40, 24
    y = (torch.randn(T, ell) * 3).to(dtype)
    gate_up = (torch.randn(T, 2 * inter + 7) * 3).to(dtype)  # strided halves, as a fused projection gives them
    gate, up = gate_up[:, 7:7 + inter], gate_up[:, 7 + inter:]
    norm = RMSNorm(ell, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        ref = torch.cat([norm(y.double()), situ_glu(gate.double(), up.double(), 4.0, 6.0)], dim=-1)
    out = rmsnorm_glu_cpu(y, norm.weight.detach().float().numpy(), 1e-6, gate, up, 4.0, 6.0)
    assert out.dtype == dtype and out.shape == (T, ell + inter)
    for part in (slice(0, ell), slice(ell, None)):
        assert ((out[:, part].double() - ref[:, part]).norm() / ref[:, part].norm()).item() < tol
    with pytest.raises(ValueError, match="do not fit"):
        rmsnorm_glu_cpu(y, norm.weight.detach().float().numpy(), 1e-6, gate.double(), up.double(), 4.0, 6.0)
