"""Kimi Delta Attention ops: chunked (training/prefill), recurrent (decode), the gate, a naive reference."""

from kernels.kda.chunk import chunk_kda
from kernels.kda.fused_recurrent import fused_recurrent_kda
from kernels.kda.gate import kda_gate
from kernels.kda.naive import naive_recurrent_kda

__all__ = ["chunk_kda", "fused_recurrent_kda", "kda_gate", "naive_recurrent_kda"]
