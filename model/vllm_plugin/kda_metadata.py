"""The KDA layers' per-step metadata: vLLM's gated-delta-net metadata, built in a few field reads when a step
only decodes.

vLLM's GDN builder classifies every step's requests with tensor ops (query lengths, prefill masks, a copy of
the common metadata) for each KDA cache group. A hybrid model has a group for every few KDA layers, so a decode
step of the served model paid for three such builds, ~0.3 ms of a ~20 ms CPU step on a 2-core AMD EPYC (a
profile of the engine step; the git history of benchmarks/NOTES.md). When every request brings exactly one token to a state it
already has, the answer is known without them: all requests are decodes, their states are the block table's
(as vLLM's build selects them, for each state cache mode) and their query offsets are the common ones. Any
other step takes vLLM's build unchanged.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.gdn_attn import (
    GDNAttentionBackend,
    GDNAttentionMetadata,
    GDNAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.utils import mamba_get_block_table_tensor


def decode_only(m: CommonAttentionMetadata) -> bool:
    """Whether every request of the step brings one token to a state it already has (vLLM's GDN builder
    counts a request as a prefill when it is still prefilling and has no earlier tokens)."""
    if m.max_query_len != 1 or int(m.query_start_loc_cpu[m.num_reqs]) != m.num_reqs:
        return False
    return m.is_prefilling is None or not bool(m.is_prefilling[: m.num_reqs].any())


class KDAMetadataBuilder(GDNAttentionMetadataBuilder):
    """`GDNAttentionMetadataBuilder` with a direct build for decode-only steps. Speculative decoding (which the
    KDA layers refuse) and full CUDA graphs (whose builds stage the metadata in fixed buffers) take vLLM's."""

    def build(  # type: ignore[override]
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        num_accepted_tokens: torch.Tensor | None = None,
        num_decode_draft_tokens_cpu: torch.Tensor | None = None,
        fast_build: bool = False,
    ) -> GDNAttentionMetadata:
        m = common_attn_metadata
        if not self.use_spec_decode and not self.use_full_cuda_graph and decode_only(m):
            n = m.num_reqs
            blocks = mamba_get_block_table_tensor(m.block_table_tensor, m.seq_lens, self.kv_cache_spec,
                                                  self.vllm_config.cache_config.mamba_cache_mode)
            return GDNAttentionMetadata(
                num_prefills=0, num_prefill_tokens=0, num_decodes=n, num_decode_tokens=n, num_spec_decodes=0,
                num_spec_decode_tokens=0, num_actual_tokens=m.num_actual_tokens,
                non_spec_query_start_loc=m.query_start_loc, non_spec_state_indices_tensor=blocks[:, 0],
            )
        return super().build(common_prefix_len, m, num_accepted_tokens, num_decode_draft_tokens_cpu, fast_build)


class KDAAttentionBackend(GDNAttentionBackend):
    """vLLM's GDN backend (the KDA layers read its metadata) with `KDAMetadataBuilder`."""

    @staticmethod
    def get_builder_cls() -> type[KDAMetadataBuilder]:
        return KDAMetadataBuilder
