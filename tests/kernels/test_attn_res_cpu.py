"""The CPU pass of Block AttnRes + RMSNorm (`kernels.attn_res_cpu`) against the HF modules in fp64."""

from __future__ import annotations

import pytest
import torch

from kernels.attn_res_cpu import attn_res_rmsnorm
from model.layers.attn_res import BlockAttnRes
from model.layers.norm import RMSNorm


def reference(candidates: list[torch.Tensor], gamma: torch.Tensor, query: torch.Tensor, eps: float,
              norm_weight: torch.Tensor, norm_eps: float) -> torch.Tensor:
    d = candidates[0].shape[1]
    mix, norm = BlockAttnRes(d, eps).double(), RMSNorm(d, norm_eps).double()
    with torch.no_grad():
        mix.query.copy_(query)
        mix.norm.weight.copy_(gamma)
        norm.weight.copy_(norm_weight)
        return norm(mix([c.double() for c in candidates]))


# d = 37: a row that ends in a partial vector on every vector width; d = 256 as served
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("n,tokens,d", [(1, 1, 37), (3, 50, 37), (6, 33, 256), (2, 300, 256)])
def test_matches_the_modules_on_any_thread_count(cpu_threads: int, dtype: torch.dtype, tol: float, n: int,
                                                 tokens: int, d: int) -> None:
    torch.manual_seed(n * 1000 + tokens + d)
    # candidates of different scales and a query that makes the softmax far from uniform
    candidates = [(torch.randn(tokens, d) * (i + 1) + 0.3 * i).to(dtype) for i in range(n)]
    gamma, query = torch.rand(d) + 0.5, torch.randn(d)
    norm_weight = torch.rand(d) + 0.5
    out = attn_res_rmsnorm(candidates, gamma * query, 1e-6, norm_weight, 1e-5)
    ref = reference(candidates, gamma, query, 1e-6, norm_weight, 1e-5)
    assert out.dtype == dtype and out.shape == (tokens, d)
    assert ((out.double() - ref).norm() / ref.norm()).item() < tol
    torch.set_num_threads(1)
    assert torch.equal(attn_res_rmsnorm(candidates, gamma * query, 1e-6, norm_weight, 1e-5), out)


def test_reads_strided_and_mixed_dtype_candidates() -> None:
    torch.manual_seed(1)
    base = torch.randn(20, 64)
    candidates = [base[:, :32], torch.randn(20, 32, dtype=torch.float64), torch.randn(20, 32)]
    gamma, query, norm_weight = torch.rand(32) + 0.5, torch.randn(32), torch.rand(32) + 0.5
    out = attn_res_rmsnorm(candidates, gamma * query, 1e-6, norm_weight, 1e-6)
    ref = reference(candidates, gamma, query, 1e-6, norm_weight, 1e-6)
    assert out.dtype == torch.float32
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-6


@pytest.mark.parametrize("bad,message", [
    (lambda c, k, w: ([], k, w), "at least one candidate"),
    (lambda c, k, w: ([c[0], c[1][:-1]], k, w), "candidate 1"),
    (lambda c, k, w: (c, k[:-1], w), "key"),
    (lambda c, k, w: (c, k, w.double()), "norm_weight"),
])
def test_rejects_what_does_not_fit(bad, message: str) -> None:
    candidates, key, weight = [torch.randn(4, 16), torch.randn(4, 16)], torch.randn(16), torch.randn(16)
    with pytest.raises(ValueError, match=message):
        c, k, w = bad(candidates, key, weight)
        attn_res_rmsnorm(c, k, 1e-6, w, 1e-6)
