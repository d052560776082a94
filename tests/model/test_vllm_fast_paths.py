"""The serving plugin's fast paths against the HF modules they stand in for, on random inputs: fused
projections (and that they follow in-place weight changes), the AttnRes depth mix, the dense decode MoE."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from model.config import TaperConfig
from model.layers.attn_res import BlockAttnRes
from model.vllm_plugin.fused import FusedLinear, drop_fused, fused

pytestmark = pytest.mark.usefixtures("vllm_env")


def test_fused_linear_matches_separate_linears_and_follows_weight_changes() -> None:
    torch.manual_seed(0)
    a, b, c = nn.Linear(16, 5, bias=False), nn.Linear(16, 7, bias=False), nn.Linear(16, 3, bias=False)
    x = torch.randn(4, 16)
    f = FusedLinear(a, b, c, groups=(2, 1))
    ab, out_c = f(x)
    torch.testing.assert_close(ab, torch.cat([a(x), b(x)], -1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out_c, c(x), rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        b.weight.copy_(torch.randn(7, 16))  # in place, as a weight push does
    torch.testing.assert_close(f(x)[0][:, 5:], b(x), rtol=1e-6, atol=1e-6)
    c.load_state_dict({"weight": torch.randn(3, 16)})
    torch.testing.assert_close(f(x)[1], c(x), rtol=1e-6, atol=1e-6)
    a.weight = nn.Parameter(torch.randn(5, 16))  # replaced outright
    torch.testing.assert_close(f(x)[0][:, :5], a(x), rtol=1e-6, atol=1e-6)
    holder = nn.Module()
    assert fused(holder, "p", lambda: (a,)) is fused(holder, "p", lambda: (b,))
    drop_fused(holder)
    assert "_serving_fused" not in holder.__dict__
    with pytest.raises(ValueError, match="groups"):
        FusedLinear(a, b, groups=(3,))
    with torch.inference_mode():  # weights without a version counter: computed unfused, still right
        inf = nn.Linear(16, 4, bias=False)
    torch.testing.assert_close(FusedLinear(inf, c)(x)[0], inf(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n_candidates,tokens", [(1, 3), (2, 1), (5, 8)])
def test_attn_res_matches_hf(n_candidates: int, tokens: int) -> None:
    from model.vllm_plugin.model import VllmBlockAttnRes

    torch.manual_seed(n_candidates)
    hf = BlockAttnRes(32, eps=1e-6)
    with torch.no_grad():
        hf.query.normal_(0, 1.0)
        hf.norm.weight.uniform_(0.5, 1.5)
    served = VllmBlockAttnRes(32, eps=1e-6)
    served.load_state_dict(hf.state_dict())
    candidates = [torch.randn(tokens, 32) * (i + 1) for i in range(n_candidates)]
    torch.testing.assert_close(served(candidates), hf(candidates), rtol=1e-5, atol=1e-5)


def test_dense_decode_moe_follows_a_weight_push() -> None:
    from model.layers.moe import StableLatentMoE
    from model.vllm_plugin.layers import DENSE_EXPERTS_MAX_TOKENS, VllmStableLatentMoE

    cfg = TaperConfig.preset("tiny")
    torch.manual_seed(3)
    hf = StableLatentMoE(cfg).eval()
    served = VllmStableLatentMoE(cfg).eval()
    x = torch.randn(DENSE_EXPERTS_MAX_TOKENS, cfg.hidden_size)
    for _ in range(2):  # the second round checks the fused router/shared-expert weights were refreshed
        with torch.no_grad():
            for p in hf.parameters():
                p.normal_(0, 0.3)
            hf.router.bias_correction.normal_(0, 0.5)
            targets = {**dict(served.named_parameters()), **dict(served.named_buffers())}
            for name, t in hf.state_dict().items():
                targets[name].copy_(t)
            torch.testing.assert_close(served(x), hf(x), rtol=1e-5, atol=1e-5)


def test_fewer_op_forms_match_hf() -> None:
    from model.layers.situ_glu import SiTUGLUMLP, situ_glu
    from model.vllm_plugin.fast_ops import situ_glu_fast
    from model.vllm_plugin.model import VllmSiTUGLUMLP

    torch.manual_seed(4)
    x = torch.randn(5, 3, 24) * 3
    close = dict(rtol=1e-5, atol=1e-6)
    a, u = torch.randn(6, 40) * 10, torch.randn(6, 40) * 40  # beyond both caps
    torch.testing.assert_close(situ_glu_fast(a, u, 4.0, 25.0), situ_glu(a, u, 4.0, 25.0), **close)
    ab, ub = a.bfloat16(), u.bfloat16()  # other dtypes take the HF function itself
    assert torch.equal(situ_glu_fast(ab, ub, 4.0, 25.0), situ_glu(ab, ub, 4.0, 25.0))
    hf = SiTUGLUMLP(24, 40, 4.0, 25.0)
    served = VllmSiTUGLUMLP(24, 40, 4.0, 25.0)
    served.load_state_dict(hf.state_dict())
    torch.testing.assert_close(served(x[:, 0]), hf(x[:, 0]), **close)
