"""Kernel-config rules that decide what the GPU compiles: fp32 inputs get tiles that fit an H200's shared
memory and fp32-accurate dots; bad settings name the field."""

from __future__ import annotations

import pytest
import torch

from kernels.kda.triton_config import DEFAULT_CONFIG, KDAKernelConfig


def test_fp32_inputs_take_unpipelined_loops_and_fp32_dots() -> None:
    cfg = DEFAULT_CONFIG.for_inputs(torch.float32)
    assert (cfg.num_stages_state, cfg.num_stages_bwd_state, cfg.num_stages_bwd_inter) == (1, 1, 1)
    assert cfg.block_v <= 32
    assert cfg.dot_precision(torch.float32) == "ieee"
    assert cfg.bwd_score_precision == "tf32x3" and cfg.bwd_score_precision_diag is None


def test_bf16_inputs_keep_the_tuned_config() -> None:
    assert DEFAULT_CONFIG.for_inputs(torch.bfloat16) is DEFAULT_CONFIG
    assert DEFAULT_CONFIG.dot_precision(torch.bfloat16) == "tf32"


def test_tf32_choice_for_fp32_is_respected() -> None:
    cfg = KDAKernelConfig(fp32_dot_precision="tf32").for_inputs(torch.float32)
    assert cfg.dot_precision(torch.float32) == "tf32" and cfg.bwd_score_precision == "tf32"


@pytest.mark.parametrize("field", ["fp32_dot_precision", "bwd_score_precision", "bwd_score_precision_diag"])
def test_unknown_precision_names_the_field(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        KDAKernelConfig(**{field: "fp16"})
