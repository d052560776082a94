"""The serving plugin's fast paths against the HF modules they stand in for, on random inputs: fused
projections (and that they follow in-place weight changes), prepared matmuls (vLLM's CPU GEMM kernels), the
AttnRes depth mix, the dense decode MoE, MLA over a latent cache."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from model.config import TaperConfig
from model.layers.attn_res import BlockAttnRes
from model.vllm_plugin.fused import (
    FusedLinear,
    derived_arrays,
    derived_linear,
    drop_fused,
    fused,
    linear,
    set_prepared_matmuls,
    step_check,
)

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


def test_step_check_vouches_for_caches_within_a_step_and_catches_every_change_between_steps() -> None:
    """Caches registered with a model's `StepCheck` skip their own checks inside a step; a change before a step
    (in place, a parameter assigned anew, a buffer) reaches every cache, also one the next step does not use."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(8, 6, bias=False), nn.Linear(8, 3, bias=False))
    model.register_buffer("scale", torch.randn(3))
    a, b = model[0], model[1]
    check = step_check(model)
    x = torch.randn(4, 8)

    def scaled() -> torch.Tensor:
        (w,) = derived_arrays(model, "scaled", lambda: (b.weight, model.scale), lambda w, s: (w * s[:, None],))()
        return torch.from_numpy(w)

    def expect() -> None:
        torch.testing.assert_close(fused(model, "ab", lambda: (a, b))(x)[0], a(x), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(scaled(), b.weight.detach() * model.scale[:, None], rtol=1e-6, atol=1e-6)

    expect()
    assert len(check._members) == 2
    with check.step():
        assert check.trusted
        expect()
    with torch.no_grad():
        a.weight.mul_(3)
    with check.step():
        expect()  # the fused weight was rebuilt at the step's start
    with torch.no_grad():
        model.scale.add_(1)
    with check.step():
        fused(model, "ab", lambda: (a, b))(x)  # this step uses one cache only
    with check.step():
        expect()  # the other was rebuilt too
    b.weight = nn.Parameter(torch.randn(3, 8))  # a new parameter object: its stamp was never taken
    with check.step():
        expect()
    with check.step():  # inside a step the caches trust the check made at its start
        with torch.no_grad():
            a.weight.mul_(2)
        assert not torch.allclose(fused(model, "ab", lambda: (a, b))(x)[0], a(x))
    assert not check.trusted
    expect()  # outside a step every cache checks its sources itself
    drop_fused(model)
    assert not check._members
    with check.step():
        expect()
    assert len(check._members) == 2


def test_prepared_matmuls_serve_matching_inputs_and_are_rebuilt_with_the_weights() -> None:
    """The logic around a prepared matmul, with a stand-in `prepare` that records its builds and marks its
    outputs (+1000), so that every result says which path computed it."""
    torch.manual_seed(1)
    builds: list[torch.Tensor] = []

    def prepare(weight: torch.Tensor):
        builds.append(weight.clone())
        if weight.shape[0] == 3:  # "no faster form for this weight"
            return None
        return lambda x: x @ weight.t() + 1000

    model = nn.Sequential(nn.Linear(8, 6, bias=False), nn.Linear(8, 3, bias=False))
    a, b = model[0], model[1]
    x = torch.randn(4, 8)
    assert fused(model, "before", lambda: (a, b))(x)[0].abs().max() < 100  # not prepared yet: F.linear
    set_prepared_matmuls(model, prepare)
    assert "_serving_fused" not in model.__dict__  # caches made before are dropped
    ya, yb = fused(model, "ab", lambda: (a, b))(x)
    torch.testing.assert_close(ya, a(x) + 1000, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(yb, b(x) + 1000, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(linear(a, x), a(x) + 1000, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(linear(b, x), b(x), rtol=1e-6, atol=1e-6)  # prepare gave None: F.linear
    torch.testing.assert_close(linear(a, x.double()), x.double() @ a.weight.double().t())  # another dtype: F.linear
    wide = torch.randn(4, 16)
    torch.testing.assert_close(linear(a, wide[:, ::2]), a(wide[:, ::2]) + 1000, rtol=1e-6, atol=1e-4)  # strided
    count = len(builds)
    linear(a, x)
    assert len(builds) == count  # unchanged weights: no rebuild
    with torch.no_grad():
        a.weight.mul_(2)  # in place, as a weight push does
    torch.testing.assert_close(linear(a, x), a(x) + 1000, rtol=1e-6, atol=1e-4)
    assert torch.equal(builds[-1], a.weight)
    stacked = nn.Parameter(torch.randn(2, 5, 8))  # e.g. experts' weights as one matrix
    holder = nn.Module()
    set_prepared_matmuls(holder, prepare)
    both = derived_linear(holder, "stacked", lambda: (stacked,), lambda w: w.flatten(0, 1))(x)
    torch.testing.assert_close(both, x @ stacked.detach().flatten(0, 1).t() + 1000, rtol=1e-6, atol=1e-4)
    with pytest.raises(ValueError, match="bias-free"):
        linear(nn.Linear(8, 2), x)


def test_cpu_matmuls_prepared_by_vllms_dispatch_match_fp64() -> None:
    """`prepare_cpu_matmul` with vLLM's real kernels (whichever its dispatch picks on this CPU), bf16 weights of
    decode and prefill shapes against fp64; fp32 weights are left to F.linear."""
    from model.vllm_plugin.cpu_gemm import prepare_cpu_matmul

    torch.manual_seed(2)
    assert prepare_cpu_matmul(torch.randn(64, 32)) is None
    for tokens, k, n in [(8, 256, 900), (1, 128, 256), (8, 32, 8), (300, 256, 640)]:
        weight = (torch.randn(n, k) / k**0.5).bfloat16()
        x = torch.randn(tokens, k).bfloat16()
        matmul = prepare_cpu_matmul(weight)
        y = matmul(x)
        ref = x.double() @ weight.double().t()
        assert y.dtype == torch.bfloat16 and y.shape == (tokens, n)
        assert (y.double() - ref).norm() / ref.norm() < 1e-2, (tokens, k, n)


def test_cpu_matmuls_padded_for_sgl_kernels_return_the_weights_columns() -> None:
    """A weight padded with zero rows (as `prepare_cpu_matmul` pads one whose N is not a multiple of 16 where
    the padded weight gets sgl-kernel's brgemm): vLLM's kernel for the padded weight, its leading columns
    against fp64. fp32 here, so that every CPU runs it (the padding is the same for bf16)."""
    from model.vllm_plugin.cpu_gemm import SGL_ROWS, sgl_padding, vllm_cpu_matmul

    torch.manual_seed(5)
    weight, x = torch.randn(900, 256) / 16, torch.randn(8, 256)
    y = vllm_cpu_matmul(weight, pad_rows=-900 % SGL_ROWS)(x)
    assert y.shape == (8, 900) and y.stride(0) == 912
    ref = x.double() @ weight.double().t()
    assert (y.double() - ref).norm() / ref.norm() < 1e-5
    assert sgl_padding(896, 256, torch.bfloat16) == 0 and sgl_padding(8, 256, torch.bfloat16) == 0
    assert sgl_padding(900, 256, torch.bfloat16) in (0, 12)  # 12 where this CPU has AMX


@pytest.mark.parametrize("n_candidates,tokens", [(1, 3), (2, 1), (5, 8), (1, 130), (6, 200)])  # stacked / per candidate
def test_attn_res_matches_hf(n_candidates: int, tokens: int) -> None:
    from model.vllm_plugin.per_token import VllmBlockAttnRes

    torch.manual_seed(n_candidates)
    hf = BlockAttnRes(32, eps=1e-6)
    with torch.no_grad():
        hf.query.normal_(0, 1.0)
        hf.norm.weight.uniform_(0.5, 1.5)
    served = VllmBlockAttnRes(32, eps=1e-6)
    served.load_state_dict(hf.state_dict())
    candidates = [torch.randn(tokens, 32) * (i + 1) for i in range(n_candidates)]
    torch.testing.assert_close(served(candidates), hf(candidates), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("n_candidates,tokens", [(1, 1), (3, 8), (6, 127), (4, 128)])  # compiled / torch form
def test_attn_res_then_norm_matches_hf_and_follows_weight_pushes(
        dtype: torch.dtype, tol: float, n_candidates: int, tokens: int) -> None:
    from model.layers.norm import RMSNorm
    from model.vllm_plugin.per_token import VllmBlockAttnRes

    torch.manual_seed(n_candidates + tokens)
    hf, hf_norm = BlockAttnRes(32, eps=1e-6), RMSNorm(32, eps=1e-5)
    served, served_norm = VllmBlockAttnRes(32, eps=1e-6), RMSNorm(32, eps=1e-5)
    candidates = [(torch.randn(tokens, 32) * (i + 1)).to(dtype) for i in range(n_candidates)]
    for _ in range(2):  # the second round: new weights pushed in place, which the compiled loop must see
        with torch.no_grad():
            hf.query.normal_(0, 1.0)
            hf.norm.weight.uniform_(0.5, 1.5)
            hf_norm.weight.uniform_(0.5, 1.5)
            served.load_state_dict(hf.state_dict())
            served_norm.load_state_dict(hf_norm.state_dict())
        out = served.mix_and_norm(candidates, served_norm)
        ref = hf_norm(hf([c.double() for c in candidates]))
        assert out.dtype == dtype and out.shape == (tokens, 32)
        assert ((out.double() - ref).norm() / ref.norm()).item() < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tokens", [4, 32])
def test_dense_decode_moe_matches_hf_and_follows_a_weight_push(dtype: torch.dtype, tol: float, tokens: int) -> None:
    """The decode-sized MoE (on CPU `_dense_step_cpu`: fp32 with the router in the fused projection, bf16 with the
    routing pass computing the logits) against the HF module in fp64."""
    from model.layers.moe import StableLatentMoE
    from model.vllm_plugin.per_token import DENSE_EXPERTS_MAX_TOKENS, VllmStableLatentMoE

    cfg = TaperConfig.preset("tiny")
    assert tokens <= DENSE_EXPERTS_MAX_TOKENS and 2 * tokens * cfg.num_experts_per_tok >= cfg.n_routed_experts
    torch.manual_seed(3)
    hf = StableLatentMoE(cfg).eval().double()
    served = VllmStableLatentMoE(cfg).eval().to(dtype)
    x = torch.randn(tokens, cfg.hidden_size).to(dtype)
    for _ in range(2):  # the second round checks the fused router/shared-expert weights were refreshed
        with torch.no_grad():
            for p in hf.parameters():
                p.normal_(0, 0.3)
            hf.router.bias_correction.normal_(0, 0.5)
            targets = {**dict(served.named_parameters()), **dict(served.named_buffers())}
            for name, t in hf.state_dict().items():
                targets[name].copy_(t)
            hf.router.bias_correction.copy_(targets["router.bias_correction"])
            # the routing from the served router's weights as rounded, so both choose the same experts
            hf.router.weight.copy_(served.router.weight)
            out, ref = served(x), hf(x.double())
        assert out.dtype == dtype
        assert ((out.double() - ref).norm() / ref.norm()).item() < tol


def test_inference_expert_selection_equals_the_routers() -> None:
    from model.layers.moe import Router
    from model.vllm_plugin.per_token import select_experts

    torch.manual_seed(6)
    router = Router(16, n_experts=12, top_k=3, routed_scaling_factor=2.5)
    router.bias_correction.normal_(0, 0.3)
    scores = torch.rand(40, 12)
    ids, weights = select_experts(router, scores)
    ref_ids, ref_weights = router.select(scores)
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)  # the same set of experts, in any order
    assert torch.equal(ids.gather(-1, order), ref_ids.gather(-1, ref_order))
    torch.testing.assert_close(weights.gather(-1, order), ref_weights.gather(-1, ref_order), rtol=1e-6, atol=1e-7)


def test_fewer_op_forms_match_hf() -> None:
    from model.layers.situ_glu import SiTUGLUMLP
    from model.vllm_plugin.per_token import VllmSiTUGLUMLP

    torch.manual_seed(4)
    x = torch.randn(5, 3, 24) * 3
    close = dict(rtol=1e-5, atol=1e-6)
    hf = SiTUGLUMLP(24, 40, 4.0, 25.0)
    served = VllmSiTUGLUMLP(24, 40, 4.0, 25.0)
    served.load_state_dict(hf.state_dict())
    torch.testing.assert_close(served(x[:, 0]), hf(x[:, 0]), **close)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_cache_attention_matches_up_projected_attention(dtype: torch.dtype) -> None:
    """MLA decode over a latent cache as served (absorbed queries in `latent_decode_attention`, the values
    up-projected after) against standard attention over the up-projected keys/values, on random latents that
    vLLM's own cache writer put into random pages in this CPU's layout; and the latents read back from the
    pages (the prefill path) are the ones written."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kernels.mla_decode_cpu import latent_decode_attention
    from model.vllm_plugin.layers import absorbed_queries, cached_latents, expanded_values

    torch.manual_seed(5)
    H, Dqk, Dv, r, block, n_pages = 4, 32, 16, 64, 32, 12
    lengths = [1, 33, 64, 150]
    scale = Dqk**-0.5
    isa = _get_attn_isa(dtype, block, r)
    kv_cache = torch.zeros(n_pages, 1, block, 2 * r, dtype=dtype)
    key_cache, value_cache = kv_cache.view(n_pages, 1, 2 * block, r).chunk(2, dim=2)
    w_uk, w_uv = torch.randn(H, Dqk, r) / r**0.5, torch.randn(H, Dv, r) / r**0.5
    q = torch.randn(len(lengths), H, Dqk)
    free = torch.randperm(n_pages).tolist()
    block_table = torch.zeros(len(lengths), n_pages, dtype=torch.int32)
    expected = []
    for i, length in enumerate(lengths):
        pages = torch.tensor([free.pop() for _ in range(-(-length // block))], dtype=torch.int32)
        block_table[i, : len(pages)] = pages
        c = torch.randn(length, r)
        pos = torch.arange(length)
        slots = (pages.long()[pos // block] * block + pos % block)
        ops.cpu_attn_reshape_and_cache(c.to(dtype)[:, None], c.to(dtype)[:, None], key_cache, value_cache, slots,
                                       isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        assert torch.equal(cached_latents(kv_cache, pages, length, isa), c.to(dtype))
        c = c.to(dtype).float()  # what the cache holds
        k, v = torch.einsum("hdr,tr->htd", w_uk, c), torch.einsum("hdr,tr->htd", w_uv, c)
        p = torch.softmax(torch.einsum("hd,htd->ht", q[i], k) * scale, dim=-1)
        expected.append(torch.einsum("ht,htd->hd", p, v))
    mixed = latent_decode_attention(absorbed_queries(q, w_uk), kv_cache, block_table,
                                    torch.tensor(lengths, dtype=torch.int32), scale, packed=isa == "amx")
    # the cache's latents are exact in the reference too: only fp32 arithmetic differs, also for a bf16 cache
    got, want = expanded_values(mixed, w_uv), torch.stack(expected)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
