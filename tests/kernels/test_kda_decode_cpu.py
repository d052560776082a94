"""The CPU one-token decode path of `fused_recurrent_kda` (T = 1, state slots gathered/scattered by index)
against the general per-token loop and the naive fp64 recurrence, on random inputs."""

from __future__ import annotations

import pytest
import torch
from kda_inputs import make_inputs, rel_err

from kernels.kda import fused_recurrent_kda, naive_recurrent_kda
from kernels.kda.common import preprocess
from kernels.kda.recurrent_torch import recurrent_kda_step_torch, recurrent_kda_torch


@pytest.mark.parametrize("gate,H,HV", [("bounded", 2, 2), ("unbounded", 1, 3), ("precomputed", 2, 4)])
def test_step_matches_per_token_loop(gate: str, H: int, HV: int) -> None:
    x = make_inputs(6, 1, H, HV, 16, 8, gate=gate, beta_logits=True, initial_state=True, seed=11)
    kw = {k: v for k, v in x.kwargs.items() if k != "initial_state"}
    pre = preprocess(*x.args(), dtype=torch.float32, use_qk_l2norm_in_kernel=kw["use_qk_l2norm_in_kernel"],
                     use_gate_in_kernel=kw.get("use_gate_in_kernel", False), use_beta_sigmoid_in_kernel=True,
                     lower_bound=kw.get("lower_bound"), A_log=kw.get("A_log"), dt_bias=kw.get("dt_bias"))
    s0 = x.kwargs["initial_state"]
    o_ref, s_ref = recurrent_kda_torch(*pre, 0.25, s0.clone(), None)
    s = s0.clone()
    o = recurrent_kda_step_torch(*(t[:, 0] for t in pre), 0.25, s)
    assert rel_err(o, o_ref[:, 0]) < 1e-6 and rel_err(s, s_ref) < 1e-6


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
