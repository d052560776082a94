"""The CPU KDA paths against the naive per-token recurrence: `chunk_kda` runs the chunked torch path where a
gradient is needed and the compiled recurrence where none is; both are checked."""

from __future__ import annotations

import pytest
import torch
from kda_inputs import make_inputs, rel_err

from kernels.kda import chunk_kda, fused_recurrent_kda, kda_gate, naive_recurrent_kda


@pytest.mark.parametrize(
    "B,T,H,HV,K,V,chunk,opts",
    [
        (2, 64, 2, 2, 16, 16, 16, dict(gate="bounded")),
        (1, 37, 1, 3, 8, 12, 16, dict(gate="unbounded", initial_state=True)),  # odd T, HV > H
        (2, 50, 2, 4, 16, 8, 32, dict(gate="precomputed", l2norm=False, initial_state=True)),
        (1, 100, 2, 2, 32, 16, 64, dict(gate="bounded", f_shift=8.0, beta_logits=True)),  # near the bound
        (3, 19, 1, 2, 16, 16, 16, dict(gate="bounded", lower_bound=-2.0, initial_state=True)),
        (1, 33, 1, 2, 8, 40, 16, dict(gate="bounded", initial_state=True)),  # V = 40: column blocks and a rest
    ],
)
@pytest.mark.parametrize("grad", [False, True], ids=["compiled", "chunked"])
def test_chunk_matches_naive(B, T, H, HV, K, V, chunk, opts, grad):
    x = make_inputs(B, T, H, HV, K, V, seed=T, **opts)
    x.q.requires_grad_(grad)
    o, s = chunk_kda(*x.args(), output_final_state=True, chunk_size=chunk, **x.kwargs)
    o_ref, s_ref = naive_recurrent_kda(*x.args(), output_final_state=True, **x.kwargs)
    assert o.dtype == x.q.dtype and o.shape == (B, T, HV, V)
    assert s.dtype == torch.float32 and s.shape == (B, HV, K, V)
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(s, s_ref) < 1e-5


def test_gates_near_bound_decay_fast():
    """With f far above zero the bounded gate sits at the bound: decays of e^-5 per token."""
    x = make_inputs(1, 80, 2, 2, 16, 16, gate="bounded", f_shift=30.0, seed=1)
    g = kda_gate(x.g, x.kwargs["lower_bound"], None, x.kwargs["dt_bias"])
    assert float(g.min()) >= -5.0 and float(g.max()) < -4.99
    o, s = chunk_kda(*x.args(), output_final_state=True, **x.kwargs)
    o_ref, s_ref = naive_recurrent_kda(*x.args(), output_final_state=True, **x.kwargs)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


@pytest.mark.parametrize("grad", [False, True], ids=["compiled", "chunked"])
def test_varlen_matches_naive_and_separate_sequences(grad):
    cu = [0, 5, 40, 41, 90]
    x = make_inputs(1, 90, 2, 4, 16, 8, gate="bounded", initial_state=True, cu_seqlens=cu, seed=3)
    x.q.requires_grad_(grad)
    o, s = chunk_kda(*x.args(), output_final_state=True, chunk_size=16, **x.kwargs)
    o_ref, s_ref = naive_recurrent_kda(*x.args(), output_final_state=True, **x.kwargs)
    assert s.shape == (4, 4, 16, 8)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5
    # sequence 1 alone gives the same output and state: no leakage across boundaries
    kw = {k: v for k, v in x.kwargs.items() if k not in ("cu_seqlens", "initial_state")}
    sl = slice(5, 40)
    o1, s1 = chunk_kda(x.q[:, sl], x.k[:, sl], x.v[:, sl], x.g[:, sl], x.beta[:, sl],
                       initial_state=x.kwargs["initial_state"][1:2], output_final_state=True, chunk_size=16, **kw)
    assert rel_err(o1, o[:, sl]) < 1e-6 and rel_err(s1, s[1:2]) < 1e-6


@pytest.mark.parametrize("gate,cu_seqlens", [("bounded", None), ("unbounded", None), ("precomputed", None),
                                             ("bounded", [0, 5, 21])])
def test_chunk_gradients_match_naive(gate, cu_seqlens):
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    x = make_inputs(1, 21, 1, 2, 8, 8, gate=gate, initial_state=True, beta_logits=gate == "bounded",
                    dtype=torch.float64, cu_seqlens=cu, seed=7)
    x.kwargs["initial_state"] = x.kwargs["initial_state"].double()
    leaves = [x.q, x.k, x.v, x.g, x.beta, x.kwargs["initial_state"]]
    leaves += [x.kwargs[n] for n in ("dt_bias", "A_log") if n in x.kwargs]
    for t in leaves:
        t.requires_grad_(True)
    gen = torch.Generator().manual_seed(0)
    do = torch.randn(1, 21, 2, 8, generator=gen, dtype=torch.float64)
    ds = torch.randn(x.kwargs["initial_state"].shape, generator=gen, dtype=torch.float64)

    def grads(fn):
        o, s = fn(*x.args(), output_final_state=True, **x.kwargs)
        return torch.autograd.grad((o * do).sum() + (s * ds).sum(), leaves)

    got = grads(lambda *a, **kw: chunk_kda(*a, chunk_size=16, **kw))
    ref = grads(naive_recurrent_kda)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert rel_err(a, b) < 1e-8, f"gradient {i} differs"


def test_bf16_bounded_chunk_stays_finite_where_unbounded_decays_vanish():
    """f large: the unbounded gate gives log-decays far below -5 (products over 16 tokens << e^-80);
    the bounded gate keeps g >= -5 and the bf16 chunked path stays finite and accurate."""
    x = make_inputs(1, 128, 2, 2, 32, 32, gate="bounded", f_shift=12.0, dtype=torch.bfloat16, seed=11)
    unbounded = kda_gate(x.g, None, torch.zeros(2), x.kwargs["dt_bias"])
    assert float(unbounded[..., :16, :, :].sum(1).max()) < -80.0  # e^-80 and beyond inside one 16-block
    o, s = chunk_kda(*x.args(), output_final_state=True, **x.kwargs)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    o_ref, s_ref = naive_recurrent_kda(*x.args(), output_final_state=True, **x.kwargs)
    assert rel_err(o, o_ref) < 1e-2 and rel_err(s, s_ref) < 1e-2


def _decode_inputs(N, HV, seed):
    return make_inputs(N, 1, 2, HV, 16, 8, gate="bounded", beta_logits=True, seed=seed)


def test_decode_with_state_slots_matches_naive():
    N, HV, slots = 5, 4, 9
    x = _decode_inputs(N, HV, 5)
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(slots, HV, 16, 8, generator=gen)
    pool_before = pool.clone()
    idx = torch.tensor([7, -1, 0, 3, -1])
    o, final = fused_recurrent_kda(*x.args(), initial_state=pool, ssm_state_indices=idx, **x.kwargs)
    assert final is pool
    valid = idx >= 0
    o_ref, s_ref = naive_recurrent_kda(
        *(t[valid] for t in x.args()), initial_state=pool_before[idx[valid]], output_final_state=True, **x.kwargs)
    assert rel_err(o[valid], o_ref) < 1e-5
    assert rel_err(pool[idx[valid]], s_ref) < 1e-5
    assert (o[~valid] == 0).all()
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[idx[valid]] = False
    assert torch.equal(pool[untouched], pool_before[untouched])


def test_decode_varlen_tokens_and_out_of_place():
    cu = [0, 1, 4, 6]  # 1, 3 and 2 tokens (prefix-free chunk of a spec-decode or short prefill)
    x = make_inputs(1, 6, 2, 2, 16, 8, gate="unbounded", cu_seqlens=cu, seed=9)
    pool = torch.randn(4, 2, 16, 8)
    pool_before = pool.clone()
    idx = torch.tensor([2, 0, 3])
    o, final = fused_recurrent_kda(*x.args(), initial_state=pool, ssm_state_indices=idx,
                                   inplace_final_state=False, **x.kwargs)
    assert torch.equal(pool, pool_before) and final.shape == (3, 2, 16, 8)
    kw = {k: v for k, v in x.kwargs.items() if k != "cu_seqlens"}
    o_ref, s_ref = naive_recurrent_kda(*x.args(), initial_state=pool_before[idx], output_final_state=True,
                                       cu_seqlens=x.kwargs["cu_seqlens"], **kw)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(final, s_ref) < 1e-5


def test_decode_continues_a_chunked_prefill():
    x = make_inputs(2, 40, 2, 2, 16, 16, gate="bounded", seed=21)
    o_full, s_full = chunk_kda(*x.args(), output_final_state=True, chunk_size=16, **x.kwargs)
    _, s_pre = chunk_kda(*(t[:, :39] for t in x.args()), output_final_state=True, chunk_size=16, **x.kwargs)
    o_last, s_last = fused_recurrent_kda(*(t[:, 39:] for t in x.args()), initial_state=s_pre.clone(), **x.kwargs)
    assert rel_err(o_last, o_full[:, 39:]) < 1e-5 and rel_err(s_last, s_full) < 1e-5


@pytest.mark.parametrize(
    "change,field",
    [
        (lambda a: a.update(v=a["v"][:, :, :1].expand(-1, -1, 3, -1)), "HV"),
        (lambda a: a.update(beta=a["beta"][..., :1]), "beta"),
        (lambda a: a.update(g=a["g"][..., :4]), "g"),
        (lambda a: a.update(initial_state=torch.zeros(3, 2, 16, 16)), "initial_state"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0, 3, 2, 64])), "cu_seqlens"),
        (lambda a: a.update(A_log=torch.zeros(2)), "A_log"),
        (lambda a: a.update(dt_bias=torch.zeros(5)), "dt_bias"),
        (lambda a: a.update(lower_bound=1.0), "lower_bound"),
    ],
)
def test_bad_input_names_the_field(change, field):
    x = make_inputs(1, 64, 2, 2, 16, 16, gate="bounded", seed=0)
    a = dict(q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta, **x.kwargs)
    change(a)
    with pytest.raises(ValueError, match=field):
        chunk_kda(**a)


@pytest.mark.parametrize("f_shift", [0.0, 6.0])  # 6.0 drives the bounded gate to its bound (range ~80 per chunk)
def test_factored_fp32_chunks_match_fp64_reference(f_shift, monkeypatch):
    """fp32 inputs take the matmul-factored 16-token chunks; fp64 naive recurrence is the reference."""
    from kernels.kda import chunk_torch

    calls = []
    factored = chunk_torch._intra_factored
    monkeypatch.setattr(chunk_torch, "_intra_factored", lambda *a: calls.append(1) or factored(*a))
    x = make_inputs(2, 45, 2, 4, 16, 16, gate="bounded", f_shift=f_shift, initial_state=True, seed=3)
    leaves = [x.q, x.k, x.v, x.g, x.beta, x.kwargs["initial_state"], x.kwargs["dt_bias"]]
    for t in leaves:
        t.requires_grad_(True)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(2, 45, 4, 16, generator=gen)

    def run(fn, cast):
        args = [cast(a) for a in x.args()]
        kw = {k: cast(v) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in x.kwargs.items()}
        o, s = fn(*args, output_final_state=True, **kw)
        return o, s, torch.autograd.grad((o * cast(do)).sum() + s.sum(), leaves)

    o, s, grads = run(chunk_kda, lambda t: t)
    o_ref, s_ref, grads_ref = run(naive_recurrent_kda, lambda t: t.double())
    assert calls, "the factored path was not taken"
    assert o.dtype == torch.float32
    assert rel_err(o, o_ref) < 1e-4
    assert rel_err(s, s_ref) < 1e-4
    for i, (a, b) in enumerate(zip(grads, grads_ref, strict=True)):
        assert torch.isfinite(a).all(), f"gradient {i} not finite"
        assert rel_err(a, b) < 1e-3, f"gradient {i} differs"
