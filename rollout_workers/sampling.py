"""How to sample episodes: the engine's sampling parameters and the agent loop's limits.

Independent of rl_service (its RolloutSpec maps onto this one field for field).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SamplingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 = off")
    max_turns: int = Field(4, ge=1, le=256, description="Policy turns per episode.")
    max_tokens_per_turn: int = Field(64, ge=1, le=65536)
    max_total_tokens: int = Field(
        512, ge=2, description="Budget for the whole sequence: prompt + sampled + inserted tokens."
    )
    tool_timeout_s: float = Field(5.0, gt=0.0, le=3600.0, description="Per tool call (and per env reset).")
    max_tool_calls_per_turn: int = Field(4, ge=1, le=64)
    seed: int | None = Field(None, description="Per-request sampling seeds derive from it (None: engine RNG).")

    @model_validator(mode="after")
    def _check(self) -> SamplingConfig:
        if self.max_tokens_per_turn > self.max_total_tokens:
            raise ValueError("max_tokens_per_turn: must not exceed max_total_tokens")
        return self
