"""Tunable parameters of the Triton KDA kernels, in one place (the H200 speed work varies these)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class KDAKernelConfig:
    chunk_size: int = 64  # BT: tokens per chunk
    sub_chunk: int = 16  # BC: intra-chunk block; the lower bound keeps e^(5*BC) in range
    block_v: int = 64  # BV: value columns per backward-inter program (and per u tile of the w/u kernel, at most 64)
    fwd_state_block_v: int = 32  # value columns per program of the sequential state kernels (H*V/BV programs)
    bwd_state_block_v: int = 32
    gate_block_k: int = 64  # K columns per program of the gate cumsum kernels (forward and backward)
    num_warps_gate: int = 4
    state_dtype: torch.dtype | None = None  # per-chunk states h and their gradients; None: the input dtype
    work_dtype: torch.dtype | None = None  # w, u, vn, dvn between kernels; None: the input dtype
    l2norm_in_kernels: bool = True  # forward without autograd, bounded gates: no separate l2norm pass over q, k
    # forward without autograd, bounded gates: solve and w/u as one kernel (triton_chunk_infer.py)
    infer_kernels: bool = True
    infer_wu_block: int = 64  # K / V columns per step of its w/u products
    num_warps_solve_wu: int = 1  # H200, 32K, forward: 2.68 ms at 1 warp, 2.87 at 2, 3.08 at 4
    # the intra-scores grid (row block, chunk, head): a chunk's row blocks, which re-read the earlier blocks' k
    # and gcum, run side by side. H200, 32K, against (chunk, head, row block): forward without autograd 2.87 ->
    # 2.71 ms; forward+backward 15.81 -> 15.58 and 16.1 -> 15.9 ms (two runs)
    scores_row_block_first: bool = True
    # forward without autograd (the fused solve + w/u, which reads only Akk's diagonal and lower blocks): Akk's
    # zero blocks above the diagonal are not written (3/8 of its fp32 bytes). H200, 32K: 2.472 -> 2.462 ms
    infer_skip_upper_akk: bool = True
    num_warps_scores: int = 4
    num_warps_solve: int = 2  # solve and w/u (H200, 32K: forward 4.15 -> 3.94 ms against 4 warps)
    num_warps_state: int = 4
    num_warps_bwd: int = 4  # backward inter
    # K slice of backward inter's key side (one pass over V per slice). H200, 32K, fwd+bwd: 16.5 ms with
    # all of K at 8 warps, 15.6 with slices of 64 at 8 warps, 14.7 with slices of 32 at 4 warps
    bwd_inter_block_k: int = 32
    num_warps_bwd_intra: int = 2  # H200, 32K: fwd+bwd 21.6 (8 warps) -> 16.9 ms
    bwd_intra_k_split: int = 2  # backward-intra programs per (chunk, head), each a slice of K: fewer registers
    bwd_fp32_dots: bool = True  # fp32-operand dots for the score-matrix gradients (dg accuracy; see _mm)
    bwd_score_precision: str = "tf32"  # their input_precision (tf32: one pass; tf32x3: ~fp32, three)
    bwd_score_precision_diag: str | None = "tf32x3"  # the diagonal blocks (e^+-80 factors cancel in dg); None: as above
    num_stages_state: int = 3  # software pipelining of the sequential state loops (shared memory bound)
    num_stages_bwd_state: int = 2  # 3 stages need ~271 KB of shared memory on Triton 3.6 / H200
    num_stages_bwd_inter: int = 3
    # Dots whose operands stay fp32 (fp32 inputs): "ieee" keeps fp32 accuracy; "tf32" (Triton's default) is
    # faster but its ~1e-3 error flips near-tied MoE routes of a whole fp32 model (measured on an H200).
    fp32_dot_precision: str = "ieee"
    decode_block_v: int = 32
    decode_num_warps: int = 1  # H200, 256 sequences: 423 us at 4 warps, 355 at 1 (fla-core 0.6.0: 375)
    decode_evict_first: bool = False  # L2 eviction hint on the state slots' load and store (read once, written once)
    # one token per sequence (B rows of T = 1, no cu_seqlens): a persistent kernel whose loop over (sequence, head,
    # value tile) units is software-pipelined, the next units' state tiles copied to shared memory while this one
    # is computed (through TMA descriptors with decode_step_tma). H200, 256 sequences: 366 us with the general
    # kernel, 299 with these; 16 columns / 1 warp 322-334, 8 programs per SM 303, 2 or 4 stages 320-333. 289 us since
    # no decode call builds cu_seqlens on the host (its pinned copy cost ~10 us of GPU time per call)
    decode_step: bool = True
    decode_step_block_v: int = 32
    decode_step_warps: int = 2
    decode_step_stages: int = 3
    decode_step_programs_per_sm: int = 4
    decode_step_tma: bool = True
    # TMA only from this many bytes of state read (N x HV x K x V x 4): its descriptor adds ~20-30 us of host time
    # per launch, which an eager caller waits for below ~64 sequences of 32 heads 128 x 128 (H200, do_bench: 64
    # sequences 79 us with TMA, 84 with pointer loads, 95 the general kernel; 32 sequences 60-64 / 46.5 / 52.5)
    decode_step_tma_min_bytes: int = 128 * 2**20
    # cu_seqlens layout with as many tokens as sequences: the one-token kernel too (H200, 256 sequences: 296 us,
    # the general kernel 355)
    decode_step_varlen: bool = True

    def __post_init__(self) -> None:
        if self.chunk_size % self.sub_chunk or self.sub_chunk < 16:
            raise ValueError(f"chunk_size {self.chunk_size} must be a multiple of sub_chunk {self.sub_chunk} >= 16")
        for name in ("fp32_dot_precision", "bwd_score_precision", "bwd_score_precision_diag"):
            if getattr(self, name) not in ("ieee", "tf32x3", "tf32") and getattr(self, name) is not None:
                raise ValueError(f"{name} must be 'ieee', 'tf32x3' or 'tf32', got {getattr(self, name)!r}")

    def dot_precision(self, dtype: torch.dtype) -> str:
        """`input_precision` of the kernels' dots: it only acts on fp32 operands, which bf16 inputs never give."""
        return self.fp32_dot_precision if dtype == torch.float32 else "tf32"

    def for_inputs(self, dtype: torch.dtype) -> KDAKernelConfig:
        """fp32 inputs double every pipelined tile: at K=128 the bf16 settings need more shared memory than
        an H200 has (fwd_state at 3 stages ~312 KB on Triton 3.6; bwd_inter ~344 KB). Compiled for sm_90,
        these fit in under 90 KB: no pipelining of the state and backward-inter loops, BV=32 there."""
        if dtype != torch.float32:
            return self
        score = "tf32" if self.fp32_dot_precision == "tf32" else "tf32x3"  # tf32x3: fp32 error, measured
        return replace(self, num_stages_state=1, num_stages_bwd_state=1, num_stages_bwd_inter=1,
                       block_v=min(self.block_v, 32), bwd_score_precision=score,
                       bwd_score_precision_diag=None)


DEFAULT_CONFIG = KDAKernelConfig()
