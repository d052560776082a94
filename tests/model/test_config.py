import pytest

from model.config import FULL_ATTENTION, LINEAR_ATTENTION, TaperConfig, default_full_attn_layers
from model.modeling import TaperForCausalLM
from model.tokenizer import load_tokenizer


def test_tiny_preset_matches_the_tokenizer_and_serving_constraints():
    config = TaperConfig.preset("tiny")
    assert config.model_type == "taper"
    assert config.vocab_size == len(load_tokenizer())
    assert config.qk_head_dim == config.v_head_dim == config.head_dim == 32
    assert config.num_key_value_heads == config.num_attention_heads
    assert config.layer_types == [LINEAR_ATTENTION] * 3 + [FULL_ATTENTION]
    model = TaperForCausalLM(config)
    actual = sum(p.numel() for p in model.parameters())
    assert actual == config.parameter_counts()["total"]
    assert 1_000_000 <= actual <= 2_000_000


@pytest.mark.parametrize(("name", "low", "high"), [("small", 80e6, 130e6), ("large", 5e9, 50e9)])
def test_larger_presets_have_their_documented_size(name, low, high):
    counts = TaperConfig.preset(name).parameter_counts()
    assert low <= counts["total"] <= high
    assert counts["active"] < counts["total"]


def test_default_layer_pattern_is_every_fourth_and_the_last():
    assert default_full_attn_layers(10) == [3, 7, 9]
    config = TaperConfig.preset("tiny", num_hidden_layers=6)
    assert config.full_attn_layers == [3, 5]
    assert config.layer_types.count(FULL_ATTENTION) == 2


def test_preset_overrides_and_unknown_preset():
    assert TaperConfig.preset("tiny", kda_gate="softplus").kda_gate == "softplus"
    with pytest.raises(ValueError, match="preset name"):
        TaperConfig.preset("huge")


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"full_attn_layers": [4]}, "full_attn_layers"),
        ({"full_attn_layers": [1, 1]}, "full_attn_layers"),
        ({"kda_num_v_heads": 3}, "kda_num_v_heads"),
        ({"kda_gate": "relu"}, "kda_gate"),
        ({"gate_lower_bound": 0.5}, "gate_lower_bound"),
        ({"moe_latent_size": 256}, "moe_latent_size"),
        ({"balancing_momentum": 1.0}, "balancing_momentum"),
        ({"first_k_dense": 5}, "first_k_dense"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"q_lora_rank": -1}, "q_lora_rank"),
        ({"situ_beta": 0.0}, "situ_beta"),
        ({"head_dim": 64}, "head_dim"),
        ({"layer_types": ["full_attention"] * 4}, "layer_types"),
    ],
)
def test_invalid_combinations_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        TaperConfig.preset("tiny", **overrides)


def test_config_round_trips_through_json(tmp_path):
    config = TaperConfig.preset("tiny", q_lora_rank=32, kda_num_v_heads=4)
    config.save_pretrained(tmp_path)
    loaded = TaperConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == config.to_dict()
