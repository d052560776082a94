import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from model import TaperCache, TaperConfig, TaperForCausalLM

STACKS = {"kda_only": [], "mla_only": [0, 1, 2, 3], "mixed": [1, 3]}


def _tiny(seed: int = 0, **overrides) -> TaperForCausalLM:
    torch.manual_seed(seed)
    model = TaperForCausalLM(TaperConfig.preset("tiny", **overrides))
    with torch.no_grad():  # non-trivial AttnRes mixes and balancing biases, so the test exercises them
        for name, p in model.named_parameters():
            if name.endswith("_res.query"):
                p.normal_(0.0, 1.0)
        for moe in model.model.moe_layers():
            moe.router.bias_correction.normal_(0.0, 0.05)
    return model


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_forward_shapes_and_dtypes(preset):
    torch.manual_seed(0)
    config = TaperConfig.preset(preset)
    model = TaperForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 6))
    with torch.no_grad():
        out = model(ids, use_cache=False, output_router_loads=True)
    assert out.logits.shape == (2, 6, config.vocab_size) and out.logits.dtype == torch.float32
    assert torch.isfinite(out.logits).all()
    assert len(out.router_loads) == config.num_hidden_layers - config.first_k_dense
    for load in out.router_loads:
        assert load.shape == (config.n_routed_experts,)
        assert float(load.sum()) == pytest.approx(1.0)


def test_bf16_forward_keeps_bf16_hidden_states_and_fp32_state():
    model = _tiny().to(torch.bfloat16).eval()
    ids = torch.randint(0, 1536, (1, 5))
    cache = TaperCache(model.config)
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
    assert out.logits.dtype == torch.bfloat16
    conv, state = cache.kda_states(0)
    assert conv.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert state.shape == (1, 2, 64, 64) and conv.shape == (1, 3 * 128, 3)


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_full_forward_equals_token_by_token_decode(stack):
    model = _tiny(full_attn_layers=STACKS[stack]).eval()
    ids = torch.randint(0, 1536, (2, 9))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = TaperCache(model.config)
        steps = [model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(9)]
        cache = TaperCache(model.config)
        prefill = model(ids[:, :5], past_key_values=cache, use_cache=True).logits
        rest = [model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(5, 9)]
    assert cache.get_seq_length() == 9
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat([prefill, *rest], 1), full, rtol=1e-4, atol=1e-4)


def test_left_padding_does_not_change_the_result():
    model = _tiny(full_attn_layers=[1, 3]).eval()
    ids = torch.randint(3, 1536, (1, 9))
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 9, dtype=torch.long)], 1)
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits
        out = model(padded, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(out[:, 4:], reference, rtol=1e-4, atol=1e-4)


def test_softplus_gate_trains_a_log():
    model = _tiny(kda_gate="softplus").train()
    ids = torch.randint(0, 1536, (1, 8))
    model(ids, labels=ids, use_cache=False).loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_every_parameter_gets_a_gradient_and_the_balancing_bias_does_not():
    model = _tiny().train()
    ids = torch.randint(0, 1536, (2, 24))
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing
    # A_log belongs to the unbounded gate only: frozen (and unused) with the default bounded gate
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    assert frozen == [f"model.layers.{i}.mixer.A_log" for i in model.config.kda_layers]
    non_finite = [name for name, p in model.named_parameters() if p.grad is not None
                  and not torch.isfinite(p.grad).all()]
    assert not non_finite, non_finite
    for moe in model.model.moe_layers():
        assert not moe.router.bias_correction.requires_grad
        assert moe.router.bias_correction.grad is None
    assert "model.layers.1.mlp.router.bias_correction" not in dict(model.named_parameters())


def test_update_balancing_moves_the_bias_after_training_forwards_only():
    model = _tiny().train()
    before = [moe.router.bias_correction.clone() for moe in model.model.moe_layers()]
    ids = torch.randint(0, 1536, (2, 32))
    model(ids, use_cache=False)
    metrics = model.update_balancing()
    assert "moe/max_over_mean_load" in metrics and metrics["moe/max_over_mean_load"] >= 1.0
    after = [moe.router.bias_correction.clone() for moe in model.model.moe_layers()]
    assert all(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    model.eval()
    with torch.no_grad():
        model(ids, use_cache=False)
    model.update_balancing()
    assert all(torch.equal(a, moe.router.bias_correction) for a, moe in zip(after, model.model.moe_layers(),
                                                                             strict=True))


def test_save_load_round_trip_is_bit_exact(tmp_path):
    model = _tiny(q_lora_rank=32).eval()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    stored = load_file(tmp_path / "model.safetensors")
    assert "model.layers.1.mlp.router.bias_correction" in stored
    assert AutoConfig.from_pretrained(tmp_path).model_type == "taper"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, TaperForCausalLM)
    original = model.state_dict()
    reloaded = loaded.state_dict()
    assert original.keys() == reloaded.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, reloaded[name]), name
    # which parameters train survives loading (the bounded gate's A_log stays frozen)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and frozen == {n for n, p in loaded.named_parameters() if not p.requires_grad}
    ids = torch.randint(0, 1536, (1, 7))
    with torch.no_grad():
        assert torch.equal(model(ids, use_cache=False).logits, loaded(ids, use_cache=False).logits)


def test_generate_with_sampling_and_padding_runs():
    model = _tiny().eval()
    ids = torch.randint(3, 1536, (2, 6))
    ids[0, :2] = 0
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    torch.manual_seed(1)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, temperature=0.9, top_k=50,
                         pad_token_id=0, eos_token_id=None)
    assert out.shape == (2, 14)
    assert torch.equal(out[:, :6], ids)


def test_greedy_generate_equals_argmax_of_full_forwards():
    model = _tiny(full_attn_layers=[1, 3]).eval()
    ids = torch.randint(3, 1536, (1, 5))
    out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = ids
    with torch.no_grad():
        for _ in range(6):
            next_id = model(expected, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, next_id], 1)
    assert torch.equal(out, expected)


def test_foreign_cache_and_bad_mask_are_rejected():
    from transformers import DynamicCache

    model = _tiny().eval()
    ids = torch.randint(0, 1536, (1, 4))
    with pytest.raises(TypeError, match="TaperCache"):
        model(ids, past_key_values=DynamicCache(), use_cache=True)
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, attention_mask=torch.ones(1, 3), use_cache=False)


def test_balancing_bias_stays_fp32_when_the_model_is_cast():
    model = _tiny()
    expected = [moe.router.bias_correction.clone() for moe in model.model.moe_layers()]
    model = model.to(torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    for moe, bias in zip(model.model.moe_layers(), expected, strict=True):
        assert moe.router.bias_correction.dtype == torch.float32
        assert torch.equal(moe.router.bias_correction, bias)


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    model = _tiny().train()
    ids = torch.randint(0, 1536, (2, 16))

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = loss_and_grads()
    model.gradient_checkpointing_enable()
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    loss_ckpt, grads_ckpt = loss_and_grads()
    torch.testing.assert_close(loss_ckpt, loss)
    assert grads_ckpt.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_unsupported_outputs_raise_instead_of_returning_nothing():
    model = _tiny().eval()
    ids = torch.randint(0, 1536, (1, 3))
    with pytest.raises(NotImplementedError, match="output_hidden_states"):
        model(ids, use_cache=False, output_hidden_states=True)
    assert model(ids, use_cache=False, output_hidden_states=False, output_attentions=False).logits.shape[1] == 3


@pytest.mark.parametrize("scope", ["parts", "stack"])
def test_compiled_layers_give_the_same_loss_and_gradients(monkeypatch, scope):
    """compile_layers (the GPU training path) computes what the eager model computes. aot_eager: Dynamo and
    AOTAutograd as on the GPU, without inductor's code generation (CPU compile time); the GPU run checks the
    generated kernels (benchmarks/model.py, compiled_vs_eager). The CPU KDA path is plain torch (with graph
    breaks); the Triton op that the GPU compiles through is checked fullgraph in tests/kernels."""
    from model.layers.moe import LatentExperts

    monkeypatch.setattr(LatentExperts, "use_grouped_mm", False)  # torch's grouped GEMM traces for bf16 CUDA only
    torch._dynamo.reset()
    config = TaperConfig.preset("tiny")  # every kind of part: a dense and MoE MLPs, KDA and MLA mixers
    torch.manual_seed(0)
    eager = TaperForCausalLM(config).train()
    compiled = TaperForCausalLM(config).train()
    compiled.load_state_dict(eager.state_dict())
    compiled.model.compile_layers(scope, backend="aot_eager")
    ids = torch.randint(0, config.vocab_size, (2, 24))
    results = []
    for model in (eager, compiled):
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss, grads), (loss_c, grads_c) = results
    torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=0)
    assert grads_c.keys() == grads.keys()
    # relative to each gradient's norm: one compiled stack sums the gradients of tensors that many layers read
    # (the embeddings' block summary) in another order than autograd does, which moves near-zero elements
    errors = {name: float((grads_c[name] - grad).norm() / grad.norm().clamp_min(1e-30)) for name, grad in grads.items()}
    assert max(errors.values()) < 1e-5, {name: err for name, err in errors.items() if err >= 1e-5}
    torch._dynamo.reset()
