"""`TaperConfig`: every hyper-parameter of the KDA-hybrid Stable-LatentMoE LM (docs/design.md section 2), with presets."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

KDA_GATES = ("bounded", "softplus")
LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"

# Presets. The tokenizer we ship has 1536 tokens; a real deployment overrides vocab_size and the token ids.
_PRESETS: dict[str, dict[str, Any]] = {
    # ~1.3M parameters: CPU tests, the demo and vLLM-CPU (MLA head dims 32: the CPU attention rejects 16).
    "tiny": dict(
        vocab_size=1536, hidden_size=128, num_hidden_layers=4, full_attn_layers=[3],
        kda_num_heads=2, kda_head_dim=64, kda_conv_size=4,
        num_attention_heads=4, qk_head_dim=32, v_head_dim=32, kv_lora_rank=64, q_lora_rank=None,
        attn_res_block_size=2,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, moe_latent_size=64,
        n_shared_experts=1, shared_expert_intermediate_size=128, first_k_dense=1, intermediate_size=256,
    ),
    # ~110M parameters (~65M active per token): one GPU.
    "small": dict(
        vocab_size=1536, hidden_size=768, num_hidden_layers=12, full_attn_layers=[3, 7, 11],
        kda_num_heads=6, kda_head_dim=128, kda_conv_size=4,
        num_attention_heads=12, qk_head_dim=64, v_head_dim=64, kv_lora_rank=256, q_lora_rank=None,
        attn_res_block_size=4,
        n_routed_experts=16, num_experts_per_tok=2, moe_intermediate_size=256, moe_latent_size=384,
        n_shared_experts=1, shared_expert_intermediate_size=512, first_k_dense=1, intermediate_size=2048,
    ),
    # The documented large layout (~19B total / ~3B active with a 160K vocabulary); config only in CI.
    "large": dict(
        vocab_size=163840, hidden_size=2304, num_hidden_layers=28,
        full_attn_layers=[3, 7, 11, 15, 19, 23, 27],
        kda_num_heads=32, kda_head_dim=128, kda_conv_size=4,
        num_attention_heads=32, qk_head_dim=128, v_head_dim=128, kv_lora_rank=512, q_lora_rank=1536,
        attn_res_block_size=4,
        n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=768, moe_latent_size=1024,
        n_shared_experts=1, shared_expert_intermediate_size=2304, first_k_dense=1, intermediate_size=9216,
    ),
}


def default_full_attn_layers(num_hidden_layers: int) -> list[int]:
    """Every 4th layer and the last one are MLA (3:1 KDA:MLA like Kimi Linear)."""
    return [i for i in range(num_hidden_layers) if (i + 1) % 4 == 0 or i == num_hidden_layers - 1]


class TaperConfig(PretrainedConfig):
    """Configuration of `TaperForCausalLM`. Layer i is gated MLA when i is in `full_attn_layers`, else KDA.

    Derived fields read by vLLM and by `transformers` caches: `layer_types` ("linear_attention" for KDA,
    "full_attention" for MLA), `num_key_value_heads` (= `num_attention_heads`: MLA is served as plain
    multi-head attention over up-projected keys/values) and `head_dim` (= `qk_head_dim`).
    """

    model_type = "taper"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 1536,
        hidden_size: int = 128,
        num_hidden_layers: int = 4,
        full_attn_layers: list[int] | None = None,
        # Kimi Delta Attention
        kda_num_heads: int = 2,
        kda_num_v_heads: int | None = None,
        kda_head_dim: int = 64,
        kda_v_head_dim: int | None = None,
        kda_conv_size: int = 4,
        kda_gate: str = "bounded",
        gate_lower_bound: float = -5.0,
        # gated MLA (NoPE)
        num_attention_heads: int = 4,
        qk_head_dim: int = 32,
        v_head_dim: int = 32,
        kv_lora_rank: int = 64,
        q_lora_rank: int | None = None,
        # Block AttnRes
        attn_res_block_size: int = 2,
        # Stable LatentMoE
        n_routed_experts: int = 8,
        num_experts_per_tok: int = 2,
        moe_intermediate_size: int = 64,
        moe_latent_size: int = 64,
        n_shared_experts: int = 1,
        shared_expert_intermediate_size: int = 128,
        routed_scaling_factor: float = 1.0,
        balancing_momentum: float = 0.9,
        first_k_dense: int = 1,
        intermediate_size: int = 256,
        # SiTU-GLU
        situ_beta: float = 4.0,
        situ_beta_linear: float = 25.0,
        # misc
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        max_position_embeddings: int = 1 << 20,
        use_cache: bool = True,
        pad_token_id: int | None = 0,
        eos_token_id: int | None = 2,
        bos_token_id: int | None = None,
        tie_word_embeddings: bool = False,
        layer_types: list[str] | None = None,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.full_attn_layers = (
            default_full_attn_layers(num_hidden_layers) if full_attn_layers is None else sorted(full_attn_layers)
        )
        self.kda_num_heads = kda_num_heads
        self.kda_num_v_heads = kda_num_heads if kda_num_v_heads is None else kda_num_v_heads
        self.kda_head_dim = kda_head_dim
        self.kda_v_head_dim = kda_head_dim if kda_v_head_dim is None else kda_v_head_dim
        self.kda_conv_size = kda_conv_size
        self.kda_gate = kda_gate
        self.gate_lower_bound = gate_lower_bound
        self.num_attention_heads = num_attention_heads
        self.qk_head_dim = qk_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.q_lora_rank = q_lora_rank
        self.attn_res_block_size = attn_res_block_size
        self.n_routed_experts = n_routed_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.moe_latent_size = moe_latent_size
        self.n_shared_experts = n_shared_experts
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.routed_scaling_factor = routed_scaling_factor
        self.balancing_momentum = balancing_momentum
        self.first_k_dense = first_k_dense
        self.intermediate_size = intermediate_size
        self.situ_beta = situ_beta
        self.situ_beta_linear = situ_beta_linear
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.max_position_embeddings = max_position_embeddings
        self.use_cache = use_cache
        self._validate()
        derived_types = [
            FULL_ATTENTION if i in self.full_attn_layers else LINEAR_ATTENTION for i in range(num_hidden_layers)
        ]
        if layer_types is not None and list(layer_types) != derived_types:
            raise ValueError(f"layer_types {layer_types} disagrees with full_attn_layers {self.full_attn_layers}")
        self.layer_types = derived_types
        for name, given, derived in (
            ("num_key_value_heads", num_key_value_heads, num_attention_heads),
            ("head_dim", head_dim, qk_head_dim),
        ):
            if given is not None and given != derived:
                raise ValueError(f"{name}={given} is derived from the MLA fields and must be {derived}")
        self.num_key_value_heads = num_attention_heads
        self.head_dim = qk_head_dim
        super().__init__(
            pad_token_id=pad_token_id,
            eos_token_id=eos_token_id,
            bos_token_id=bos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> TaperConfig:
        """`tiny` (CPU tests, ~1.3M params), `small` (~100M, one GPU) or `large` (documented layout)."""
        if name not in _PRESETS:
            raise ValueError(f"unknown preset name {name!r}; choose one of {sorted(_PRESETS)}")
        fields = dict(_PRESETS[name])
        if "num_hidden_layers" in overrides and "full_attn_layers" not in overrides:
            fields.pop("full_attn_layers")
        fields.update(overrides)
        return cls(**fields)

    @property
    def kda_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if i not in self.full_attn_layers]

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense

    def _validate(self) -> None:
        def require(condition: bool, field: str, why: str) -> None:
            if not condition:
                raise ValueError(f"{field}={getattr(self, field)!r}: {why}")

        for field in ("vocab_size", "hidden_size", "num_hidden_layers", "kda_num_heads", "kda_head_dim",
                      "kda_v_head_dim", "kda_conv_size", "num_attention_heads", "qk_head_dim", "v_head_dim",
                      "kv_lora_rank", "attn_res_block_size", "n_routed_experts", "num_experts_per_tok",
                      "moe_intermediate_size", "moe_latent_size", "intermediate_size"):
            require(isinstance(getattr(self, field), int) and getattr(self, field) > 0, field,
                    "must be a positive integer")
        L = self.num_hidden_layers
        require(all(isinstance(i, int) and 0 <= i < L for i in self.full_attn_layers), "full_attn_layers",
                f"layer indices must lie in [0, {L})")
        require(len(set(self.full_attn_layers)) == len(self.full_attn_layers), "full_attn_layers",
                "indices must be unique")
        require(self.kda_num_v_heads > 0 and self.kda_num_v_heads % self.kda_num_heads == 0, "kda_num_v_heads",
                f"must be a positive multiple of kda_num_heads={self.kda_num_heads}")
        require(self.kda_gate in KDA_GATES, "kda_gate", f"must be one of {KDA_GATES}")
        require(self.gate_lower_bound < 0, "gate_lower_bound", "must be negative (log-space decay floor)")
        require(self.q_lora_rank is None or (isinstance(self.q_lora_rank, int) and self.q_lora_rank > 0),
                "q_lora_rank", "must be None (full-rank queries) or a positive integer")
        require(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
                f"cannot exceed n_routed_experts={self.n_routed_experts}")
        require(self.moe_latent_size <= self.hidden_size, "moe_latent_size",
                f"the expert latent width must not exceed hidden_size={self.hidden_size}")
        require(self.n_shared_experts >= 0, "n_shared_experts", "must be >= 0")
        require(self.n_shared_experts == 0 or self.shared_expert_intermediate_size > 0,
                "shared_expert_intermediate_size", "must be positive when n_shared_experts > 0")
        require(self.routed_scaling_factor > 0, "routed_scaling_factor", "must be positive")
        require(0.0 <= self.balancing_momentum < 1.0, "balancing_momentum", "must lie in [0, 1)")
        require(0 <= self.first_k_dense <= L, "first_k_dense", f"must lie in [0, num_hidden_layers={L}]")
        require(self.situ_beta > 0, "situ_beta", "must be positive")
        require(self.situ_beta_linear > 0, "situ_beta_linear", "must be positive")
        require(self.rms_norm_eps > 0, "rms_norm_eps", "must be positive")

    def parameter_counts(self) -> dict[str, int]:
        """Analytic parameter counts without building the model: total, active per token, embeddings."""
        d, V = self.hidden_size, self.vocab_size
        H, HV, K, Vd = self.kda_num_heads, self.kda_num_v_heads, self.kda_head_dim, self.kda_v_head_dim
        kda = (2 * H * K * d + HV * Vd * d + (2 * H * K + HV * Vd) * self.kda_conv_size
               + K * d + HV * K * K + HV * K + HV + HV * d + Vd * d + HV * Vd * Vd + Vd + d * HV * Vd)
        Hq, Dqk, Dv, r = self.num_attention_heads, self.qk_head_dim, self.v_head_dim, self.kv_lora_rank
        q = Hq * Dqk * d if self.q_lora_rank is None else self.q_lora_rank * (d + 1) + Hq * Dqk * self.q_lora_rank
        mla = q + r * d + r + Hq * (Dqk + Dv) * r + Hq * Dv * d + d * Hq * Dv
        dense = 3 * d * self.intermediate_size
        n, k, ell, ie = self.n_routed_experts, self.num_experts_per_tok, self.moe_latent_size, self.moe_intermediate_size
        shared = 3 * d * self.n_shared_experts * self.shared_expert_intermediate_size
        moe_fixed = n * d + 2 * ell * d + ell + shared
        expert = 3 * ell * ie
        per_layer_res = 4 * d  # two AttnRes (query + norm) per layer
        norms = 2 * d
        total = active = 0
        for i in range(self.num_hidden_layers):
            mixer = mla if i in self.full_attn_layers else kda
            base = mixer + per_layer_res + norms
            if self.is_moe_layer(i):
                total += base + moe_fixed + n * expert
                active += base + moe_fixed + k * expert
            else:
                total += base + dense
                active += base + dense
        embeddings = V * d * (1 if self.tie_word_embeddings else 2)
        tail = 3 * d  # final AttnRes (query + norm) and final norm
        return {"total": total + embeddings + tail, "active": active + embeddings + tail, "embeddings": embeddings}
