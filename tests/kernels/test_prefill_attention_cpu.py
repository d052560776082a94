"""Causal prefill attention in tiles (`kernels.prefill_attention_cpu`) against fp64 softmax attention. On CPUs
without AMX the kernel's tile products run in its C emulation, so the blocking, masking and online softmax are
checked on any machine; on AMX CPUs the same tests check the AMX build."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kernels.prefill_attention_cpu import amx_available, prefill_attention

BF16_TOL = 5e-3  # relative error of the output: bf16 inputs, probabilities and output (torch's flash: ~2e-3)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """fp64 causal attention of the last Tq of Tk positions -> [Tq, H, Dv]."""
    tq, tk = q.shape[1], k.shape[1]
    scores = torch.einsum("hqd,hkd->hqk", q.double(), k.double()) * scale
    future = torch.arange(tk)[None, :] > (tk - tq + torch.arange(tq))[:, None]
    weights = scores.masked_fill(future, -math.inf).softmax(-1)
    return torch.einsum("hqk,hkd->qhd", weights, v.double())


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def random_qkv(H: int, tq: int, tk: int, d: int, dv: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    # scores of a few units: a softmax far from uniform
    return tuple((2 * torch.randn(H, n, e, generator=gen) + 0.3).bfloat16() for n, e in ((tq, d), (tk, d), (tk, dv)))


# one query; a whole prompt; a chunk after earlier tokens; channels and lengths off the tile sizes; more
# than one work item per head (> 1,024 queries) and more than one pass over the keys (> 2,048 keys)
@pytest.mark.parametrize("H,tq,tk,d,dv", [(2, 1, 1, 32, 32), (2, 1, 77, 32, 32), (3, 40, 40, 32, 32),
                                          (3, 40, 300, 32, 32), (1, 5, 9, 20, 24), (2, 70, 500, 64, 48),
                                          (1, 1100, 1150, 32, 16), (1, 60, 2300, 48, 32)])
def test_matches_causal_softmax_attention(H: int, tq: int, tk: int, d: int, dv: int) -> None:
    q, k, v = random_qkv(H, tq, tk, d, dv, seed=tq + tk + d)
    out = prefill_attention(q, k, v, d ** -0.5)
    assert out.dtype == torch.bfloat16 and out.shape == (tq, H, dv)
    assert rel_error(out, reference(q, k, v, d ** -0.5)) < BF16_TOL


def test_a_rising_max_rescales_the_running_output() -> None:
    """Scores that grow along the keys raise each query's running max over and over (by more than the
    kernel's lazy threshold): every raise must rescale the output and sum gathered so far."""
    H, tq, tk, d = 2, 48, 700, 32
    gen = torch.Generator().manual_seed(5)
    q = (torch.randn(H, tq, d, generator=gen) * 0.1 + 1.0).bfloat16()
    k = (torch.randn(H, tk, d, generator=gen) * 0.1 + torch.linspace(-8, 8, tk)[None, :, None]).bfloat16()
    v = torch.randn(H, tk, d, generator=gen).bfloat16()
    ref = reference(q, k, v, 0.5)
    assert rel_error(prefill_attention(q, k, v, 0.5), ref) < BF16_TOL


def test_strided_inputs_and_threads_give_the_same_output(cpu_threads: int) -> None:
    H, tq, tk, d = 4, 300, 2100, 32
    q, k, v = random_qkv(H, tq, tk, d, d, seed=1)
    # transposed views, as the served layer passes its heads out of [T, H, D] projections
    qs, ks, vs = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (q, k, v))
    one = prefill_attention(q, k, v, 0.2, threads=1)
    assert torch.equal(prefill_attention(qs, ks, vs, 0.2, threads=1), one)
    assert torch.equal(prefill_attention(q, k, v, 0.2, threads=max(cpu_threads, 3)), one)


def test_builds_amx_exactly_where_the_cpu_has_it() -> None:
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    assert amx_available() == ({"amx_tile", "amx_bf16"} <= flags)


@pytest.mark.parametrize("shapes,dtype,match", [
    (((2, 4, 32), (2, 3, 32), (2, 3, 32)), torch.bfloat16, "Tk >= Tq"),
    (((2, 4, 32), (2, 8, 16), (2, 8, 32)), torch.bfloat16, "k \\[2, Tk, 32\\]"),
    (((2, 4, 32), (3, 8, 32), (3, 8, 32)), torch.bfloat16, "k \\[2, Tk, 32\\]"),
    (((2, 4, 32), (2, 8, 32), (2, 7, 32)), torch.bfloat16, "v \\[2, Tk, Dv\\]"),
    (((4, 32), (8, 32), (8, 32)), torch.bfloat16, "\\[H, T, D\\]"),
    (((2, 4, 32), (2, 8, 32), (2, 8, 32)), torch.float32, "bf16"),
])
def test_bad_input_is_named(shapes, dtype, match) -> None:
    q, k, v = (torch.randn(s).to(dtype) for s in shapes)
    with pytest.raises(ValueError, match=match):
        prefill_attention(q, k, v, 0.1)
