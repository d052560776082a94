"""The Triton KDA kernels on CPU (TRITON_INTERPRET=1, fp32, small shapes) against the naive recurrence.

The interpreter must be switched on before triton is imported, so the checks run in one subprocess
(triton_interpret_checks.py) and each test asserts on its part of the JSON it prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("triton_interpret_checks.py")
TOL = 1e-4  # fp32 throughout; observed errors are ~1e-6 or less
# With every gate at the bound, dg sums terms carrying e^+-75 factors that cancel: fp32 keeps ~2e-4.
GATE_GRAD_TOL_AT_BOUND = 1e-3


@pytest.fixture(scope="module")
def results() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=900, env=env,
                          cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["bounded", "unbounded_varlen", "precomputed", "at_bound_chunk64",
                                  "varlen_short_chunks",
                                  "bwd_intra_whole_k", "precomputed_bounded"])
def test_triton_chunk_forward_and_gradients(results, case):
    r = results[case]
    assert r.pop("finite")
    tol = {name: TOL for name in r}
    if case == "at_bound_chunk64":
        tol.update(dg=GATE_GRAD_TOL_AT_BOUND, ddt_bias=GATE_GRAD_TOL_AT_BOUND)
    bad = {name: err for name, err in r.items() if not err < tol[name]}
    assert not bad, f"{case}: relative errors over {TOL}: {bad}"


@pytest.mark.parametrize("case", ["decode_slots", "decode_slots_bv8", "decode_slots_paged"])
def test_triton_decode_state_slots(results, case):
    r = results[case]
    assert r["o"] < TOL and r["slots"] < TOL
    assert r["padded_zero"] and r["others_untouched"] and r["returned_pool"]


@pytest.mark.parametrize("case", ["decode_step_slots", "decode_step_slots_tma", "decode_step_out_of_place",
                                  "decode_step_no_slots", "decode_step_no_state", "decode_step_varlen_ones",
                                  "decode_step_varlen_ones_bv8", "decode_step_varlen_mixed",
                                  "decode_step_varlen_mixed_out", "decode_step_slots_paged",
                                  "decode_step_varlen_mixed_paged"])
def test_triton_decode_one_token_kernel(results, case):
    r = results[case]
    assert r["o"] < TOL and r["state"] < TOL
    assert r["padded_zero"] and r["others_untouched"] and r.get("padded_state_zero", True)


@pytest.mark.parametrize("case", ["decode_varlen", "decode_varlen_bv8"])
def test_triton_decode_varlen_out_of_place(results, case):
    r = results[case]
    assert r["o"] < TOL and r["final_state"] < TOL


def test_chunk_op_is_a_compilable_custom_op(results):
    r = results["custom_op"]
    assert r["opcheck_fixed"] and r["opcheck_varlen"]
    assert r["compiled_loss"] < TOL and r["compiled_grads"] < TOL


def test_gradients_of_plain_sums_with_expanded_output_gradients(results):
    bad = {name: err for name, err in results["expanded_grads"].items() if not err < TOL}
    assert not bad, f"relative errors over {TOL}: {bad}"


def test_fused_attn_res_mix_matches_the_reference(results):
    r = results["attn_res"]
    assert r.pop("opcheck")
    bad = {name: err for name, err in r.items() if not err < TOL}
    assert not bad, f"relative errors over {TOL}: {bad}"


def test_fused_short_conv_matches_the_reference(results):
    r = results["short_conv"]
    assert r.pop("opcheck")
    zero = {name: r.pop(name) for name in [n for n in r if n.endswith("_slice_grad_zero")]}
    assert not any(zero.values()), f"gradient written outside the input's columns: {zero}"
    bad = {name: err for name, err in r.items() if not err < TOL}
    assert not bad, f"relative errors over {TOL}: {bad}"


@pytest.mark.parametrize("case", ["no_grad", "no_grad_chunk64", "no_grad_precomputed", "no_grad_separate",
                                  "no_grad_chunk64_upper_akk"])
def test_forward_without_autograd_skips_saving_and_matches(results, case):
    r = results[case]
    if case == "no_grad_separate":  # the same kernels as the saving forward, less written
        assert r["o_vs_saved"] == 0.0 and r["state_vs_saved"] == 0.0
    assert r["o_vs_saved"] < TOL and r["state_vs_saved"] < TOL
    assert r["o_vs_ref"] < TOL and r["state_vs_ref"] < TOL


def test_short_conv_decode_on_state_slots(results):
    """Serving's conv step: live rows against the fp64 window sum; a padded row (slot -1, as a CUDA graph's batch
    pads) writes zeros and no slot; slots not in the step and the pages' other bytes stay as they were."""
    r = results["short_conv_decode"]
    bad = {name: err for name, err in r.items() if not err < (TOL if name.endswith(("_out", "_state")) else 1e-30)}
    assert not bad, bad
