"""The CPU path of `fused_recurrent_kda` (the compiled recurrence over state slots: one-token decodes and
multi-token prefills) against the naive fp64 recurrence, on random inputs."""

from __future__ import annotations

import pytest
import torch
from kda_inputs import make_inputs, rel_err

from kernels.kda import fused_recurrent_kda, naive_recurrent_kda


@pytest.mark.parametrize("inplace", [True, False])
def test_prefill_over_state_slots_matches_naive(inplace: bool) -> None:
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


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("inplace", [True, False])
def test_slot_decode_matches_naive(dtype: torch.dtype, tol: float, padded: bool, inplace: bool) -> None:
    N, H, HV, K, V, slots = 7, 2, 4, 16, 8, 12
    x = make_inputs(N, 1, H, HV, K, V, gate="unbounded", beta_logits=True, dtype=dtype, seed=5)
    gen = torch.Generator().manual_seed(2)
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
