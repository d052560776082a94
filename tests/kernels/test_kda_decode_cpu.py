"""The CPU path of `fused_recurrent_kda` (the compiled recurrence over state slots: one-token decodes and
multi-token prefills) against the naive fp64 recurrence, on random inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kda_inputs import make_inputs, rel_err

from kernels.kda import chunk_kda, fused_recurrent_kda, naive_recurrent_kda
from kernels.kda.recurrent_cpu import conv_recurrent_kda_decode_cpu, conv_silu_prefill_cpu, gated_rms_norm_cpu
from model.layers.norm import GatedRMSNorm


@pytest.mark.parametrize("inplace", [True, False])
def test_prefill_over_state_slots_matches_naive(inplace: bool, cpu_threads: int) -> None:
    """Several prompts back to back, each continuing its own slot of a pool (a padded row skipped), as the
    engine's prefill runs them."""
    cu = [0, 7, 7, 30, 31, 52]
    x = make_inputs(1, 52, 2, 4, 16, 8, gate="bounded", beta_logits=True, cu_seqlens=cu, seed=9)
    pool = torch.randn(8, 4, 16, 8, generator=torch.Generator().manual_seed(4)) * 0.5
    before = pool.clone()
    idx = torch.tensor([6, 1, -1, 0, 3])
    o, final = fused_recurrent_kda(*x.args(), initial_state=pool, ssm_state_indices=idx,
                                   inplace_final_state=inplace, **x.kwargs)
    kw = {k: v for k, v in x.kwargs.items() if k != "cu_seqlens"}
    for n, (s, e) in enumerate(zip(cu, cu[1:], strict=False)):
        sl = slice(s, e)
        if idx[n] < 0:
            assert (o[:, sl] == 0).all()
            continue
        got = pool[idx[n]] if inplace else final[n]
        if e == s:  # an empty prompt leaves its slot as it was
            assert torch.equal(got, before[idx[n]])
            continue
        o_ref, s_ref = naive_recurrent_kda(x.q[:, sl], x.k[:, sl], x.v[:, sl], x.g[:, sl], x.beta[:, sl],
                                           initial_state=before[idx[n]][None], output_final_state=True, **kw)
        assert rel_err(o[:, sl], o_ref) < 1e-5
        assert rel_err(got, s_ref[0]) < 1e-5
    if not inplace:
        assert torch.equal(pool, before)
    untouched = [i for i in range(8) if i not in (6, 1, 0, 3)]
    assert torch.equal(pool[untouched], before[untouched])


def paged_pool(slots: int, HV: int, K: int, V: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A state pool laid out as a serving engine's hybrid cache lays it out: each slot's [HV, K, V] state at
    the start of a page twice its size, whose second half holds other data. Returns (pool view, pages)."""
    pages = torch.randn(slots, 2 * HV * K * V, generator=gen) * 0.5
    return pages[:, :HV * K * V].view(slots, HV, K, V), pages


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("layout", ["contiguous", "paged", "transposed"])
def test_slot_decode_matches_naive(dtype: torch.dtype, tol: float, padded: bool, inplace: bool, layout: str) -> None:
    """Pools laid out as given, as a serving engine's pages, or with each slot strided (copied compactly)."""
    N, H, HV, K, V, slots = 7, 2, 4, 16, 8, 12
    x = make_inputs(N, 1, H, HV, K, V, gate="unbounded", beta_logits=True, dtype=dtype, seed=5)
    gen = torch.Generator().manual_seed(2)
    paged = layout == "paged"
    if paged:
        pool, pages = paged_pool(slots, HV, K, V, gen)
        assert not pool.is_contiguous()
        other_data = pages[:, HV * K * V:].clone()
    elif layout == "transposed":
        pool = (torch.randn(slots, HV, V, K, generator=gen) * 0.5).transpose(-1, -2)
    else:
        pool = torch.randn(slots, HV, K, V, generator=gen) * 0.5
    before = pool.clone()
    idx = torch.tensor([9, 3, -1, 0, 11, -1, 4] if padded else [9, 3, 2, 0, 11, 5, 4], dtype=torch.int32)
    o, final = fused_recurrent_kda(*x.args(), initial_state=pool, ssm_state_indices=idx,
                                   inplace_final_state=inplace, **x.kwargs)
    valid = idx >= 0
    o_ref, s_ref = naive_recurrent_kda(*(t[valid] for t in x.args()), initial_state=before[idx[valid].long()],
                                       output_final_state=True, **x.kwargs)
    assert o.dtype == dtype and o.shape == (N, 1, HV, V)
    assert rel_err(o[valid], o_ref) < tol
    assert (o[~valid] == 0).all()
    written = torch.zeros(slots, dtype=torch.bool)
    written[idx[valid].long()] = True
    if inplace:
        assert final is pool
        assert rel_err(pool[idx[valid].long()], s_ref) < 1e-5
        assert torch.equal(pool[~written], before[~written])
    else:
        assert torch.equal(pool, before) and final.shape == (N, HV, K, V)
        assert rel_err(final[valid], s_ref) < 1e-5 and (final[~valid] == 0).all()
    if paged:  # the rest of each page is not the kernel's to touch
        assert torch.equal(pages[:, HV * K * V:], other_data)


def test_decode_without_slots_keeps_or_updates_the_given_state() -> None:
    x = make_inputs(3, 1, 2, 2, 16, 16, gate="bounded", initial_state=True, seed=8)
    s0 = x.kwargs.pop("initial_state")
    o_ref, s_ref = naive_recurrent_kda(*x.args(), initial_state=s0, output_final_state=True, **x.kwargs)
    state = s0.clone()
    o, s = fused_recurrent_kda(*x.args(), initial_state=state, inplace_final_state=False,
                               output_final_state=True, **x.kwargs)
    assert torch.equal(state, s0) and rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5
    o, s = fused_recurrent_kda(*x.args(), initial_state=state, **x.kwargs)
    assert s is state and rel_err(state, s_ref) < 1e-5 and rel_err(o, o_ref) < 1e-5
    o, s = fused_recurrent_kda(*x.args(), output_final_state=True, **x.kwargs)  # zero initial state
    o0, s0_ref = naive_recurrent_kda(*x.args(), output_final_state=True, **x.kwargs)
    assert rel_err(o, o0) < 1e-5 and rel_err(s, s0_ref) < 1e-5


@pytest.mark.parametrize("inputs", ["fp32", "bf16 column slices"])
@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_conv_and_recurrence_in_one_decode_step_match_their_torch_forms(gate: str, inputs: str) -> None:
    """`conv_recurrent_kda_decode_cpu` (the engine's CPU decode step from pre-conv channels) against the
    causal conv + SiLU written out in torch and the fp64 naive recurrence: grouped heads (HV = 2H), paged
    pools, a skipped sequence; the inputs as fp32 tensors or as bf16 columns of one projection's output."""
    N, H, HV, K, V, W, slots = 5, 2, 4, 16, 8, 4, 9
    C = 2 * H * K + HV * V
    gen = torch.Generator().manual_seed(11)
    if inputs == "fp32":
        qkv, f, beta_logits = (torch.randn(N, C, generator=gen), torch.randn(N, HV, K, generator=gen),
                               torch.randn(N, HV, generator=gen))
    else:
        fused = torch.randn(N, C + HV * K + HV + 3, generator=gen).bfloat16()
        qkv, f, beta_logits = fused[:, :C], fused[:, C:C + HV * K].unflatten(1, (HV, K)), fused[:, -HV - 3:-3]
    conv_weight = torch.randn(W, C, generator=gen) * 0.5
    conv_pages = torch.randn(slots, 2 * (W - 1) * C, generator=gen)
    conv_pool = conv_pages[:, :(W - 1) * C].view(slots, W - 1, C)
    pool, pages = paged_pool(slots, HV, K, V, gen)
    gate_kwargs = dict(lower_bound=-5.0, A_log=None) if gate == "bounded" else dict(
        lower_bound=None, A_log=torch.randn(HV, generator=gen) * 0.5)
    dt_bias = torch.randn(HV * K, generator=gen) * 0.5
    idx = torch.tensor([7, -1, 2, 0, 5])
    conv_before, pool_before, pages_before = conv_pool.clone(), pool.clone(), pages.clone()

    o = conv_recurrent_kda_decode_cpu(qkv, conv_weight, conv_pool, f, beta_logits, num_heads=H, scale=K**-0.5,
                                      dt_bias=dt_bias, slots=idx, pool=pool, **gate_kwargs)

    valid = idx >= 0
    used = idx[valid]
    window = torch.cat([conv_before[used], qkv[valid, None].float()], dim=1)  # [n, W, C], oldest first
    y = F.silu((window * conv_weight).sum(1))
    q, k, v = y.split([H * K, H * K, HV * V], dim=-1)
    o_ref, s_ref = naive_recurrent_kda(
        q.view(-1, 1, H, K), k.view(-1, 1, H, K), v.view(-1, 1, HV, V), f[valid, None].float(),
        beta_logits[valid, None].float(),
        scale=K**-0.5, initial_state=pool_before[used], output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, dt_bias=dt_bias, **gate_kwargs)
    assert rel_err(o[valid], o_ref[:, 0]) < 1e-5 and (o[~valid] == 0).all()
    assert rel_err(pool[used], s_ref) < 1e-5
    assert torch.equal(conv_pool[used], window[:, 1:])  # each window moved on by the new token
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[used] = False
    assert torch.equal(conv_pool[untouched], conv_before[untouched]) and torch.equal(pool[untouched], pool_before[untouched])
    assert torch.equal(pages[:, HV * K * V:], pages_before[:, HV * K * V:])


@pytest.mark.parametrize("inputs", ["fp32", "fp32 column slice", "bf16 column slice"])
def test_prefill_conv_and_silu_in_one_pass_match_conv1d(inputs: str, cpu_threads: int) -> None:
    """`conv_silu_prefill_cpu` against fp64 `conv1d` + SiLU per sequence: sequences shorter and longer than
    the window, an empty one, fresh and continued histories, a pool with other data between its slots;
    inputs up to +-40 so the SiLU's exp spans its range, given as they are or as a projection's columns."""
    W, Cq, Cv, slots = 4, 8, 12, 7
    C = 2 * Cq + Cv
    gen = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 2, 19, 19, 20, 33])
    idx = torch.tensor([5, 0, 3, 6, 2])
    keep = torch.tensor([True, False, True, True, True])
    x = torch.randn(int(cu[-1]), C, generator=gen) * 8
    x[5] *= 5
    if inputs != "fp32":  # the q|k|v columns of a wider projection output, as the engine passes them
        wide = torch.randn(len(x), C + 5, generator=gen)
        wide[:, 2:2 + C] = x
        x = wide.to(torch.bfloat16 if inputs.startswith("bf16") else torch.float32)[:, 2:2 + C]
        assert not x.is_contiguous()
    weight = torch.randn(W, C, generator=gen)
    pages = torch.randn(slots, 2 * (W - 1) * C, generator=gen)
    pool = pages[:, :(W - 1) * C].view(slots, W - 1, C)
    pool_before, pages_before = pool.clone(), pages.clone()

    q, k, v = conv_silu_prefill_cpu(x, weight, pool, cu, idx, keep, key_dim=Cq)

    y = torch.cat([q, k, v], dim=1)
    for r in range(len(idx)):
        a, b, s = int(cu[r]), int(cu[r + 1]), int(idx[r])
        hist = pool_before[s] if keep[r] else torch.zeros(W - 1, C)
        ext = torch.cat([hist, x[a:b].float()]).double()  # [W-1+L, C], oldest first
        if b > a:
            ref = F.silu(F.conv1d(ext.t()[None], weight.double().t()[:, None], groups=C)[0].t())
            assert rel_err(y[a:b], ref) < 1e-6
        assert torch.equal(pool[s], ext[-(W - 1):].float())
    untouched = [i for i in range(slots) if i not in idx.tolist()]
    assert torch.equal(pool[untouched], pool_before[untouched])
    assert torch.equal(pages[:, (W - 1) * C:], pages_before[:, (W - 1) * C:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_norm_in_one_pass_matches_the_gated_rms_norm(dtype: torch.dtype, cpu_threads: int) -> None:
    """KDA's output norm as the CPU engine runs it, against fp64 and the torch module: a strided gate (a
    column slice of a projection), bf16 read as its bits and written rounded to nearest even."""
    gen = torch.Generator().manual_seed(5)
    T, HV, V = 37, 3, 16
    o = torch.randn(T, HV, V, generator=gen) * 3
    gate = (torch.randn(T, 2 * HV * V, generator=gen) * 4).to(dtype)[:, ::2]
    norm = GatedRMSNorm(V, eps=1e-6)
    norm.weight.data = torch.randn(V, generator=gen)
    got = gated_rms_norm_cpu(o, gate, norm.weight, norm.eps)
    g64 = gate.double().unflatten(-1, (HV, V))
    ref64 = o.double() * torch.rsqrt(o.double().pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    ref64 = (ref64 * torch.sigmoid(g64)).flatten(-2)
    with torch.no_grad():
        module = norm(o, gate.unflatten(-1, (HV, V))).flatten(-2)
    assert got.dtype == dtype and got.shape == (T, HV * V)
    bound = 1e-6 if dtype == torch.float32 else 4e-3  # bf16: half an ulp of the rounded output
    assert rel_err(got, ref64) < bound
    assert rel_err(got, module) <= max(bound, 2 * rel_err(module, ref64))


@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_prefill_reads_a_bf16_gate_input_as_its_bits(gate: str) -> None:
    """The compiled prefill's gate pass on a bf16 gate input (read as bits, no cast) equals the same values
    given in fp32, and both match the naive recurrence."""
    x = make_inputs(1, 40, 2, 2, 16, 8, gate=gate, beta_logits=True, seed=11)
    g_bf16 = x.g.bfloat16()
    args = list(x.args())
    args[3] = g_bf16
    o_bits, s_bits = chunk_kda(*args, output_final_state=True, **x.kwargs)
    args[3] = g_bf16.float()
    o_f32, s_f32 = chunk_kda(*args, output_final_state=True, **x.kwargs)
    assert torch.equal(o_bits, o_f32) and torch.equal(s_bits, s_f32)
    o_ref, s_ref = naive_recurrent_kda(*args, output_final_state=True, **x.kwargs)
    assert rel_err(o_bits, o_ref) < 1e-5 and rel_err(s_bits, s_ref) < 1e-5


def test_a_decode_step_with_a_slot_outside_the_pools_raises_before_writing() -> None:
    N, H, HV, K, V, W, slots = 3, 1, 2, 8, 8, 4, 4
    C = 2 * H * K + HV * V
    gen = torch.Generator().manual_seed(2)
    conv_pool, pool = torch.randn(slots, W - 1, C, generator=gen), torch.randn(slots, HV, K, V, generator=gen)
    before = conv_pool.clone(), pool.clone()
    with pytest.raises(ValueError, match="outside the state pools"):
        conv_recurrent_kda_decode_cpu(
            torch.randn(N, C, generator=gen), torch.randn(W, C, generator=gen), conv_pool,
            torch.randn(N, HV, K, generator=gen), torch.randn(N, HV, generator=gen), num_heads=H, scale=K**-0.5,
            lower_bound=-5.0, A_log=None, dt_bias=torch.zeros(HV * K), slots=torch.tensor([0, slots, 1]), pool=pool)
    assert torch.equal(conv_pool, before[0]) and torch.equal(pool, before[1])
