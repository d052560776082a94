import math

import pytest
import torch
import torch.nn.functional as F

from kernels.kda import naive_recurrent_kda
from model.config import TaperConfig
from model.layers.attn_res import AttnResState, BlockAttnRes
from model.layers.kda import KimiDeltaAttention, _zero_history_state, causal_conv1d
from model.layers.mla import GatedMLA
from model.layers.moe import (
    ExpertRouting,
    StableLatentMoE,
    expert_counts,
    quantile_balancing_target,
    top_k_indices,
    update_balancing,
)
from model.layers.situ_glu import situ_glu

TINY = TaperConfig.preset("tiny")


def _randomise(module: torch.nn.Module, generator: torch.Generator) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * (0.3 if p.dim() > 1 else 1.0))


def test_situ_glu_is_bounded_for_huge_inputs():
    a = torch.tensor([1e6, -1e6, 1e30, 3e4, -7.0, float("inf")])
    u = torch.tensor([1e6, 1e6, -1e30, -3e4, 1e9, float("inf")])
    h = situ_glu(a, u, beta=4.0, beta_linear=25.0)
    assert torch.isfinite(h).all()
    assert h.abs().max() <= 4.0 * 25.0
    assert h[0] == pytest.approx(100.0, rel=1e-5)  # saturates at beta * beta_L


def test_situ_glu_is_swiglu_for_small_inputs():
    # |a| stays well inside the region where beta*tanh(a/beta) ~ a to rtol (error ~ (a/beta)^2 / 3)
    gen = torch.Generator().manual_seed(0)
    a, u = torch.randn(1000, generator=gen) * 0.05, torch.randn(1000, generator=gen) * 0.05
    torch.testing.assert_close(situ_glu(a, u, 4.0, 25.0), F.silu(a) * u, rtol=2e-3, atol=1e-5)


def test_situ_glu_keeps_bf16_dtype():
    a = torch.randn(8, dtype=torch.bfloat16)
    assert situ_glu(a, a, 4.0, 25.0).dtype == torch.bfloat16


def test_attn_res_weights_sum_to_one_and_mix_candidates():
    g = torch.Generator().manual_seed(0)
    mix = BlockAttnRes(16)
    _randomise(mix, g)
    candidates = [torch.randn(2, 5, 16, generator=g) * s for s in (1.0, 10.0, 0.1)]
    weights = mix.weights(candidates)
    assert weights.shape == (3, 2, 5)
    torch.testing.assert_close(weights.sum(0), torch.ones(2, 5))
    expected = sum(w.unsqueeze(-1) * c for w, c in zip(weights, candidates, strict=True))
    torch.testing.assert_close(mix(candidates), expected)
    # scores use rms-normalised candidates: scaling a candidate does not change its weight
    scaled = [candidates[0] * 1000.0, candidates[1], candidates[2]]
    torch.testing.assert_close(mix.weights(scaled), weights, rtol=1e-5, atol=1e-6)


def test_attn_res_zero_query_is_a_uniform_average():
    mix = BlockAttnRes(8)
    candidates = [torch.randn(3, 8) for _ in range(4)]
    torch.testing.assert_close(mix(candidates), torch.stack(candidates).mean(0))


def test_attn_res_state_pushes_blocks():
    state = AttnResState.start(torch.zeros(1))
    for layer in range(5):
        assert len(state.candidates()) == 1 + layer // 2 + (0 if layer % 2 == 0 else 1)
        state.add(torch.ones(1))
        state.add(torch.ones(1))
        state.end_layer(block_size=2)
    assert [float(b) for b in state.blocks] == [0.0, 4.0, 4.0]
    assert float(state.partial) == 2.0


def test_causal_conv_with_state_equals_full_sequence():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 9, 6, generator=g), torch.randn(6, 1, 4, generator=g)
    full, _ = causal_conv1d(x, w)
    reference = F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), w, groups=6).transpose(1, 2)
    torch.testing.assert_close(full, reference)
    state, pieces = None, []
    for chunk in x.split([4, 1, 1, 3], dim=1):
        y, state = causal_conv1d(chunk, w, state)
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces, 1), full)


@pytest.mark.parametrize("T", [1, 2, 3, 7])
def test_zero_history_conv_state_equals_the_torch_paths(T):
    """The state the fused (CUDA) conv path returns is the one causal_conv1d returns from no state."""
    x, w = torch.randn(2, T, 6), torch.randn(6, 1, 4)
    torch.testing.assert_close(_zero_history_state(x, 4), causal_conv1d(x, w)[1], rtol=0, atol=0)


def _naive_kda_layer(layer: KimiDeltaAttention, x: torch.Tensor) -> torch.Tensor:
    """The KDA layer written out from docs/design.md section 2 with the kernels' naive per-token recurrence."""
    B, T, _ = x.shape
    H, HV, K, V = layer.num_heads, layer.num_v_heads, layer.head_dim, layer.v_head_dim
    pre = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], -1).transpose(1, 2)
    conv = F.silu(F.conv1d(F.pad(pre, (layer.conv_size - 1, 0)), layer.conv_weight(), groups=pre.shape[1]))
    q, k, v = conv.transpose(1, 2).split([H * K, H * K, HV * V], -1)
    q = F.normalize(q.reshape(B, T, H, K), dim=-1, eps=1e-12)
    k = F.normalize(k.reshape(B, T, H, K), dim=-1, eps=1e-12)
    f = layer.f_b_proj(layer.f_a_proj(x)).reshape(B, T, HV, K) + layer.dt_bias.reshape(HV, K)
    if layer.bounded_gate:
        g = layer.lower_bound * torch.sigmoid(f)
    else:
        g = -layer.A_log.exp().reshape(HV, 1) * F.softplus(f)
    beta = torch.sigmoid(layer.b_proj(x))
    o, _ = naive_recurrent_kda(q, k, v.reshape(B, T, HV, V), g, beta, scale=K**-0.5)
    gate = layer.g_b_proj(layer.g_a_proj(x)).reshape(B, T, HV, V)
    o = o.float()
    normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * layer.o_norm.weight
    return layer.o_proj((normed * torch.sigmoid(gate)).reshape(B, T, HV * V))


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
@pytest.mark.parametrize("v_heads", [2, 4])
def test_kda_layer_matches_a_naive_reference(gate, v_heads):
    torch.manual_seed(0)
    config = TaperConfig.preset("tiny", kda_gate=gate, kda_num_v_heads=v_heads, kda_head_dim=16, hidden_size=32,
                                moe_latent_size=32)
    layer = KimiDeltaAttention(config)
    layer.reset_gate_parameters()
    x = torch.randn(2, 37, 32)
    y, _, _ = layer(x)
    torch.testing.assert_close(y, _naive_kda_layer(layer, x), rtol=1e-4, atol=1e-5)


def test_kda_padding_leaves_the_state_untouched():
    torch.manual_seed(0)
    layer = KimiDeltaAttention(TINY)
    layer.reset_gate_parameters()
    x = torch.randn(1, 6, TINY.hidden_size)
    padded = torch.cat([torch.randn(1, 3, TINY.hidden_size), x], 1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    y_ref, conv_ref, state_ref = layer(x, output_states=True)
    y_pad, conv_pad, state_pad = layer(padded, output_states=True, token_mask=mask)
    torch.testing.assert_close(y_pad[:, 3:], y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state_pad, state_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(conv_pad, conv_ref)


def test_mla_matches_explicit_softmax_attention():
    torch.manual_seed(0)
    config = TaperConfig.preset("tiny", q_lora_rank=16)
    layer = GatedMLA(config)
    x = torch.randn(2, 7, config.hidden_size)
    q = layer.q_b_proj(layer.q_a_norm(layer.q_a_proj(x))).reshape(2, 7, 4, 32)
    kv = layer.kv_b_proj(layer.kv_a_norm(layer.kv_a_proj(x))).reshape(2, 7, 4, 64)
    k, v = kv[..., :32], kv[..., 32:]
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(32)
    scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v).reshape(2, 7, 128)
    expected = layer.o_proj(attn * torch.sigmoid(layer.g_proj(x)))
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)


def _dense_moe_reference(moe: StableLatentMoE, x: torch.Tensor) -> torch.Tensor:
    scores = torch.sigmoid(x @ moe.router.weight.t())
    chosen = torch.topk(scores + moe.router.bias_correction, moe.top_k, dim=-1).indices
    mask = torch.zeros_like(scores).scatter(-1, chosen, 1.0)
    weights = scores * mask / (scores * mask).sum(-1, keepdim=True) * moe.router.routed_scaling_factor
    z = moe.latent_down(x)
    y = torch.zeros_like(z)
    for e in range(moe.n_experts):
        y = y + weights[:, e:e + 1] * moe.experts.expert(e, z)
    return moe.latent_up(moe.latent_norm(y)) + moe.shared_expert(x)


def test_moe_matches_a_dense_reference_and_runs_standalone():
    torch.manual_seed(0)
    moe = StableLatentMoE(TaperConfig.preset("tiny", routed_scaling_factor=2.5))
    _randomise(moe, torch.Generator().manual_seed(3))
    with torch.no_grad():
        moe.router.bias_correction.copy_(torch.randn(moe.n_experts))
    x = torch.randn(3, 5, TINY.hidden_size)
    out = moe(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out.reshape(-1, x.shape[-1]), _dense_moe_reference(moe, x.reshape(-1, x.shape[-1])),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("n", "k"), [(16, 2), (8, 3), (256, 8), (4, 4)])
def test_top_k_indices_equal_torch_topk(n, k):
    values = torch.rand(500, n, generator=torch.Generator().manual_seed(n + k))
    assert torch.equal(top_k_indices(values, k), torch.topk(values, k, dim=-1).indices)


@pytest.mark.parametrize("compiled", [False, True])
def test_expert_routing_is_the_stable_sort_by_expert_and_its_inverse(compiled):
    ids = torch.randint(0, 8, (1000, 3), generator=torch.Generator().manual_seed(0))  # 3000 pairs: 12 scan blocks
    ids[5] = ids[6]  # repeated choices: ties keep pair order
    # compiled: the block totals' exclusive sum as a masked sum (the branch torch.compile traces)
    routing = (torch.compile(ExpertRouting.of, backend="aot_eager") if compiled else ExpertRouting.of)(ids, 8)
    assert torch.equal(routing.order, torch.argsort(ids.reshape(-1), stable=True))
    assert torch.equal(routing.order[routing.slot], torch.arange(ids.numel()))
    assert torch.equal(routing.counts, torch.bincount(ids.reshape(-1), minlength=8).to(routing.counts.dtype))


@pytest.mark.parametrize("grouped", [True, False])
def test_moe_gradients_match_a_dense_reference(grouped, monkeypatch):
    """The gathers into and out of expert order (forward and their gather-only backward) against every
    expert on every token, weighted by the routing: output, input and parameter gradients (fp32)."""
    from model.layers.moe import LatentExperts

    monkeypatch.setattr(LatentExperts, "use_grouped_mm", grouped)
    torch.manual_seed(0)
    moe = StableLatentMoE(TaperConfig.preset("tiny", routed_scaling_factor=2.5))
    _randomise(moe, torch.Generator().manual_seed(8))
    with torch.no_grad():
        moe.router.bias_correction.copy_(torch.randn(moe.n_experts))
    x = torch.randn(40, TINY.hidden_size)
    grad_out = torch.randn(40, TINY.hidden_size)
    results = []
    for forward in (moe, lambda x: _dense_moe_reference(moe, x)):
        moe.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out = forward(xi)
        (out * grad_out).sum().backward()
        results.append([out.detach(), xi.grad, *(p.grad for p in moe.parameters())])
    for got, ref in zip(*results, strict=True):  # relative error of the whole tensor, fp32 bound
        assert float((got - ref).norm() / ref.norm()) < 1e-5


def test_balancing_of_all_layers_at_once_equals_each_layer_alone():
    """One sort for several layers, padding dropped on the device, two forwards recorded, one layer seeing
    only padding: the same biases as each layer's quantile target over its real tokens."""
    torch.manual_seed(0)
    config = TaperConfig.preset("tiny", balancing_momentum=0.6)
    layers = [StableLatentMoE(config).train() for _ in range(3)]
    for i, moe in enumerate(layers):
        _randomise(moe, torch.Generator().manual_seed(20 + i))
        with torch.no_grad():
            moe.router.bias_correction.copy_(torch.randn(moe.n_experts) * 0.1)
    before = [moe.router.bias_correction.clone() for moe in layers]
    masks = [torch.rand(2, 30, generator=torch.Generator().manual_seed(i)) > 0.3 for i in range(2)]
    inputs = [torch.randn(2, 30, config.hidden_size) for _ in range(2)]
    expected = []
    for i, moe in enumerate(layers):
        real = []
        for x, mask in zip(inputs, masks, strict=True):
            keep = torch.zeros_like(mask) if i == 2 else mask  # the third layer sees only padding
            moe(x, keep.float())
            real.append(moe.router.scores(x.reshape(-1, config.hidden_size))[keep.reshape(-1)])
        scores = torch.cat(real)
        expected.append(before[i] if scores.shape[0] == 0 else
                        0.6 * before[i] + 0.4 * quantile_balancing_target(scores, moe.top_k))
    applied = update_balancing(layers)
    assert [layer for layer, _ in applied] == layers
    assert [bool(valid) for _, valid in applied] == [True, True, False]
    for moe, bias in zip(layers, expected, strict=True):
        torch.testing.assert_close(moe.router.bias_correction, bias, rtol=1e-6, atol=1e-7)
        assert moe._recorded_scores == []
    assert update_balancing(layers) == []


def test_grouped_experts_match_the_loop_over_experts_with_gradients():
    torch.manual_seed(0)
    experts = StableLatentMoE(TINY).experts
    _randomise(experts, torch.Generator().manual_seed(4))
    assert experts._uses_grouped_mm(torch.zeros(1))  # the pinned torch has a CPU fp32 grouped GEMM
    rows = torch.randn(50, TINY.moe_latent_size, requires_grad=True)
    counts = torch.tensor([9, 0, 14, 3, 0, 11, 6, 7])  # empty experts included
    grad_out = torch.randn(50, TINY.moe_latent_size)
    results = []
    for path in (experts._grouped, experts._looped):
        out = path(rows, counts)
        results.append((out, *torch.autograd.grad((out * grad_out).sum(), [rows, *experts.parameters()])))
    for grouped, looped in zip(*results, strict=True):
        torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-6)


def test_quantile_target_is_the_centred_negative_quantile():
    scores = torch.rand(4000, 8) ** torch.linspace(0.2, 3.0, 8)
    target = quantile_balancing_target(scores, top_k=2)
    quantile = torch.quantile(scores, 1 - 2 / 8, dim=0)
    torch.testing.assert_close(target, -(quantile - quantile.mean()))
    # a shift by the mean moves every threshold alike: k/n of the tokens lie past each expert's threshold
    above = (scores + target - quantile.mean() > 0).float().mean(0)
    torch.testing.assert_close(above, torch.full((8,), 2 / 8), atol=1e-3, rtol=0)


def test_quantile_balancing_lowers_max_over_mean_load_on_a_skewed_router():
    torch.manual_seed(0)
    config = TaperConfig.preset("tiny", balancing_momentum=0.5)
    moe = StableLatentMoE(config).train()
    _randomise(moe, torch.Generator().manual_seed(5))
    with torch.no_grad():  # skew: experts 0 and 1 score high for almost every token (not exactly alike: how
        # exact ties are broken is up to the top-k, and the test is about the balancing)
        moe.router.weight[:2] = moe.router.weight[:2].abs().mean(0) * 0.5
        moe.router.weight[1] *= 1.01
    x = torch.randn(512, config.hidden_size).abs()
    ratios = []
    for _ in range(8):
        moe(x)
        ratios.append(float(moe.last_load.max() / moe.last_load.mean()))
        moe.update_balancing()
    assert ratios[0] > 3.0
    assert ratios[-1] < 2.0
    assert ratios[-1] < ratios[0] / 2
    assert all(later <= earlier + 1e-6 for earlier, later in zip(ratios, ratios[1:], strict=False))


def test_balancing_bias_is_frozen_in_eval_and_without_autograd():
    moe = StableLatentMoE(TINY)
    _randomise(moe, torch.Generator().manual_seed(5))
    with torch.no_grad():  # e.g. an inference engine that left the module in train mode
        moe(torch.randn(64, TINY.hidden_size))
    moe.eval()
    moe(torch.randn(64, TINY.hidden_size))
    assert moe.update_balancing() is None
    assert torch.equal(moe.router.bias_correction, torch.zeros(TINY.n_routed_experts))


def test_expert_counts_equal_bincount_and_weigh_masked_tokens():
    ids = torch.randint(0, 8, (37, 2), generator=torch.Generator().manual_seed(0))
    assert torch.equal(expert_counts(ids, 8), torch.bincount(ids.reshape(-1), minlength=8))
    keep = torch.rand(37, generator=torch.Generator().manual_seed(1)) > 0.4
    torch.testing.assert_close(expert_counts(ids, 8, keep), torch.bincount(ids[keep].reshape(-1), minlength=8).float())


def test_masked_balancing_uses_only_real_tokens():
    """Padding rows are recorded with their mask and dropped when the bias is updated: the same bias as a
    forward over the real tokens alone."""
    torch.manual_seed(0)
    config = TaperConfig.preset("tiny", balancing_momentum=0.0)
    moe = StableLatentMoE(config).train()
    _randomise(moe, torch.Generator().manual_seed(6))
    x = torch.randn(2, 20, config.hidden_size)
    mask = torch.ones(2, 20)
    mask[0, :7] = 0
    moe(x, mask)
    masked_bias = moe.update_balancing()
    masked_load = moe.last_load.clone()
    moe.router.bias_correction.zero_()
    moe(x.reshape(-1, config.hidden_size)[mask.reshape(-1) > 0])
    torch.testing.assert_close(masked_bias, moe.update_balancing())
    torch.testing.assert_close(masked_load, moe.last_load)
    moe(x, torch.zeros(2, 20))  # only padding: nothing to balance on
    assert moe.update_balancing() is None


def test_kda_input_projections_equal_the_separate_projections():
    layer = KimiDeltaAttention(TINY)
    _randomise(layer, torch.Generator().manual_seed(7))
    x = torch.randn(2, 9, TINY.hidden_size)
    qkv, f, beta, g_low = layer.input_projections(x)
    torch.testing.assert_close(qkv, layer.project(x))
    torch.testing.assert_close(f, layer.gate_input(x))
    torch.testing.assert_close(beta, layer.beta_logits(x))
    torch.testing.assert_close(g_low, layer.g_a_proj(x))


def test_router_picks_the_chosen_scores_and_their_gradient():
    """The combine weights come from a masked sum over the experts: the same values and gradient as a gather."""
    torch.manual_seed(0)
    moe = StableLatentMoE(TINY)
    scores = torch.rand(64, TINY.n_routed_experts, requires_grad=True)
    chosen, weights = moe.router.select(scores)
    picked = scores.gather(-1, chosen)
    expected = picked / picked.sum(-1, keepdim=True) * moe.router.routed_scaling_factor
    assert torch.equal(weights, expected)
    grad = torch.randn_like(weights)
    got = torch.autograd.grad(weights, scores, grad)[0]
    want = torch.autograd.grad(expected, scores, grad)[0]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
