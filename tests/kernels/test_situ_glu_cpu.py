"""The compiled CPU SiTU-GLU (serving and evaluation without autograd) against the torch formula in fp64, on
random inputs spanning small values (tanh's series branch) to far beyond both caps."""

from __future__ import annotations

import pytest
import torch
from kda_inputs import rel_err

from kernels.situ_glu_cpu import situ_glu_cpu
from model.layers.situ_glu import situ_glu

BETA, BETA_LINEAR = 4.0, 25.0


def gate_up(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The halves of one fused projection (strided views), with magnitudes from 1e-3 to ~200."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-3, 1.7, 96)
    both = (torch.randn(37, 2 * 96, generator=gen) * torch.cat([scales, scales * 4])).to(dtype)
    return both[:, :96], both[:, 96:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_pass_matches_fp64(dtype: torch.dtype, cpu_threads: int) -> None:
    gate, up = gate_up(dtype, seed=3)
    ref = situ_glu(gate.double(), up.double(), BETA, BETA_LINEAR)  # fp64: the torch formula itself
    got = situ_glu_cpu(gate, up, BETA, BETA_LINEAR)
    assert got.dtype == dtype and got.shape == gate.shape and got.is_contiguous()
    if dtype == torch.float32:
        elementwise = ((got.double() - ref).abs() / ref.abs().clamp_min(1e-30)).max()
        assert elementwise < 5e-6  # every value, the small ones (tanh's series) included
    else:  # bf16 output: half an ulp, as torch's own bf16 result
        assert rel_err(got, ref) < 4e-3
        assert rel_err(got, ref) <= 1.01 * rel_err(situ_glu(gate.float(), up.float(), BETA, BETA_LINEAR).to(dtype), ref)


def test_situ_glu_takes_the_compiled_pass_only_without_autograd() -> None:
    gate, up = gate_up(torch.float32, seed=4)
    with torch.no_grad():
        assert torch.allclose(situ_glu(gate, up, BETA, BETA_LINEAR), situ_glu_cpu(gate, up, BETA, BETA_LINEAR),
                              rtol=0, atol=0)
    gate.requires_grad_(True)
    out = situ_glu(gate, up, BETA, BETA_LINEAR)
    assert out.grad_fn is not None
    out.sum().backward()
    assert gate.grad is not None and torch.isfinite(gate.grad).all()


def test_mismatched_inputs_are_refused() -> None:
    gate, up = gate_up(torch.float32, seed=5)
    with pytest.raises(ValueError, match="gate and up"):
        situ_glu_cpu(gate, up.bfloat16(), BETA, BETA_LINEAR)
