"""Triton recurrent KDA for decode: one program per (V tile, sequence, value head), the state tile in
registers (fp32) across the sequence's tokens, read from and written back to its slot. Rows of one token
each (the serving call: [N, 1, ...] without cu_seqlens), or cu_seqlens over as many tokens as sequences, take
recurrent_kda_step_kernel instead, a persistent kernel whose pipelined loop keeps the next units' state tiles
in flight."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kda.gate import gate_fn
from kernels.kda.recurrent_cpu import slots_contiguous
from kernels.kda.triton_chunk import flat_cu_seqlens
from kernels.kda.triton_config import DEFAULT_CONFIG, KDAKernelConfig


@triton.jit
def _recurrent_unit(
    q, k, v, f, beta, dt_bias, a_log, o, h0, ht, slot, i_n, i_v, i_hv, i_h, bos, eos, scale, lower_bound,
    stride_slot, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr, INPLACE: tl.constexpr, USE_GATE: tl.constexpr,
    BOUNDED: tl.constexpr, HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr,
    EVICT: tl.constexpr,
):
    """Value tile i_v of sequence i_n (tokens bos..eos-1, state slot `slot`), value head i_hv: the state tile in
    registers across the tokens. Slot s of the pool h0 starts stride_slot elements after slot s - 1 (a serving
    engine's pages hold other states between the slots)."""
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    if slot < 0:  # padded row: zero output, no state touched
        for t in range(bos, eos):
            tl.store(o + t * (HV * V) + i_hv * V + o_v, tl.zeros([BV], dtype=tl.float32).to(o.dtype.element_ty),
                     mask=m_v)
        if STORE_FINAL:
            tl.store(ht + (i_n * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :],
                     tl.zeros([BK, BV], dtype=tl.float32), mask=m_kv)
    else:
        s_off = o_k[:, None] * V + o_v[None, :]
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
        if HAS_H0:
            # each state tile is read once and written once: EVICT keeps it from displacing what is reused in L2
            if EVICT:
                b_h += tl.load(h0 + slot * stride_slot + i_hv * K * V + s_off, mask=m_kv, other=0.0,
                               eviction_policy="evict_first").to(tl.float32)
            else:
                b_h += tl.load(h0 + slot * stride_slot + i_hv * K * V + s_off, mask=m_kv, other=0.0).to(tl.float32)
        bias = tl.zeros([BK], dtype=tl.float32)
        if HAS_BIAS:
            bias += tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        a = 0.0
        if USE_GATE and not BOUNDED:
            a = tl.load(a_log + i_hv).to(tl.float32)
        for t in range(bos, eos):
            b_q = tl.load(q + t * (H * K) + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_k = tl.load(k + t * (H * K) + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            if L2NORM:
                b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 0) + 1e-6)
                b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 0) + 1e-6)
            b_v = tl.load(v + t * (HV * V) + i_hv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            b_g = tl.load(f + t * (HV * K) + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            if USE_GATE:
                b_g = tl.where(m_k, gate_fn(b_g + bias, a, lower_bound, BOUNDED), 0.0)
            b_b = tl.load(beta + t * HV + i_hv).to(tl.float32)
            if BETA_SIGMOID:
                b_b = tl.sigmoid(b_b)
            b_h = b_h * tl.exp(b_g)[:, None]
            err = b_v - tl.sum(b_h * b_k[:, None], 0)
            b_h += (b_b * b_k)[:, None] * err[None, :]
            b_o = tl.sum(b_h * (b_q * scale)[:, None], 0)
            tl.store(o + t * (HV * V) + i_hv * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        if INPLACE:
            if EVICT:
                tl.store(h0 + slot * stride_slot + i_hv * K * V + s_off, b_h.to(h0.dtype.element_ty), mask=m_kv,
                         eviction_policy="evict_first")
            else:
                tl.store(h0 + slot * stride_slot + i_hv * K * V + s_off, b_h.to(h0.dtype.element_ty), mask=m_kv)
        if STORE_FINAL:
            tl.store(ht + (i_n * HV + i_hv) * K * V + s_off, b_h, mask=m_kv)


@triton.jit
def recurrent_kda_kernel(
    q, k, v, f, beta, dt_bias, a_log, o, h0, ht, cu_seqlens, slots, scale, lower_bound, stride_slot,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, HAS_SLOTS: tl.constexpr, STORE_FINAL: tl.constexpr, INPLACE: tl.constexpr,
    USE_GATE: tl.constexpr, BOUNDED: tl.constexpr, HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, EVICT: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    slot = i_n
    if HAS_SLOTS:
        slot = tl.load(slots + i_n).to(tl.int64)
    _recurrent_unit(q, k, v, f, beta, dt_bias, a_log, o, h0, ht, slot, i_n, i_v, i_hv, i_h, bos, eos, scale,
                    lower_bound, stride_slot, H, HV, K, V, BK, BV, HAS_H0, STORE_FINAL, INPLACE, USE_GATE, BOUNDED,
                    HAS_BIAS, L2NORM, BETA_SIGMOID, EVICT)


@triton.jit
def recurrent_kda_step_kernel(
    q, k, v, f, beta, dt_bias, a_log, o, h0, pool, ht, slots, cu_seqlens, scale, lower_bound, stride_slot, n_units,
    n_seqs, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, HAS_SLOTS: tl.constexpr, STORE_FINAL: tl.constexpr, INPLACE: tl.constexpr,
    USE_GATE: tl.constexpr, BOUNDED: tl.constexpr, HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, TMA: tl.constexpr, STAGES: tl.constexpr, HAS_CU: tl.constexpr = False,
):
    """One token per sequence (row n of [N, 1, ...] inputs): a persistent program loops over (value tile,
    sequence x value head) units. The loop has no branches, so Triton software-pipelines it: the slot index and
    state tile of the next STAGES - 1 units are copied to shared memory while this unit is computed (the one-unit
    programs of recurrent_kda_kernel each wait for their own tile). With TMA, h0 is a tensor descriptor over
    the pool as [slots * HV * K, V] (K == BK, a contiguous pool) and the tiles move by bulk copies; `pool` is the
    same memory as a pointer, slot s stride_slot elements after slot s - 1. HAS_CU: [1, T, ...] inputs with
    cu_seqlens and T == N sequences (the varlen layout of a decode step): sequence n's token is cu_seqlens[n]; the loop stores only for sequences of exactly one token, and if
    any sequence has another length (read on the device: no host sync) a plain loop afterwards runs those
    sequences token by token as recurrent_kda_kernel does."""
    NVT: tl.constexpr = (V + BV - 1) // BV
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    for unit in tl.range(tl.program_id(0), n_units, tl.num_programs(0), num_stages=STAGES):
        i_v = unit % NVT
        i_nh = unit // NVT
        i_n = (i_nh // HV).to(tl.int64)
        i_hv = i_nh % HV
        i_h = i_hv // (HV // H)
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_kv = m_k[:, None] & m_v[None, :]
        s_off = o_k[:, None] * V + o_v[None, :]
        slot = i_n
        if HAS_SLOTS:
            slot = tl.load(slots + i_n).to(tl.int64)
        live = slot >= 0  # a padded row (slot < 0): zero output, no slot touched
        m_live = m_kv & ((s_off * 0 + slot) >= 0)  # as a tensor (the interpreter takes no scalar in a mask)
        t = i_n  # the token
        m_out = m_v
        m_fin = m_kv
        if HAS_CU:  # store only for a sequence of one token (the loop after this one takes the others)
            bos = tl.load(cu_seqlens + i_n).to(tl.int64)
            n_tok = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
            t = tl.where(n_tok == 1, bos, 0)
            live = live & (n_tok == 1)
            m_live = m_live & ((s_off * 0 + n_tok) == 1)
            m_out = m_v & ((o_v * 0 + n_tok) == 1)
            m_fin = m_kv & ((s_off * 0 + n_tok) == 1)
        row = (tl.maximum(slot, 0) * HV + i_hv) * K  # the tile's first row in the TMA view
        tile = tl.maximum(slot, 0) * stride_slot + i_hv * K * V  # its first element through the pointer
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
        if HAS_H0:
            if TMA:
                b_h += tl.where(live, h0.load([row.to(tl.int32), i_v * BV]), 0.0)
            else:
                b_h += tl.load(h0 + tile + s_off, mask=m_live, other=0.0).to(tl.float32)
        b_q = tl.load(q + t * (H * K) + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + t * (H * K) + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + t * (HV * V) + i_hv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(f + t * (HV * K) + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_b = tl.load(beta + t * HV + i_hv).to(tl.float32)
        if HAS_BIAS:
            b_g += tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        if L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 0) + 1e-6)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 0) + 1e-6)
        if USE_GATE:
            a = 0.0
            if not BOUNDED:
                a = tl.load(a_log + i_hv).to(tl.float32)
            b_g = tl.where(m_k, gate_fn(b_g, a, lower_bound, BOUNDED), 0.0)
        if BETA_SIGMOID:
            b_b = tl.sigmoid(b_b)
        b_h = b_h * tl.exp(b_g)[:, None]
        err = b_v - tl.sum(b_h * b_k[:, None], 0)
        b_h += (b_b * b_k)[:, None] * err[None, :]
        b_o = tl.sum(b_h * (b_q * scale)[:, None], 0)
        tl.store(o + t * (HV * V) + i_hv * V + o_v, tl.where(live, b_o, 0.0).to(o.dtype.element_ty), mask=m_out)
        if INPLACE:
            if TMA:
                if live:
                    h0.store([row.to(tl.int32), i_v * BV], b_h)
            else:
                tl.store(h0 + tile + s_off, b_h.to(h0.dtype.element_ty), mask=m_live)
        if STORE_FINAL:
            tl.store(ht + (i_n * HV + i_hv) * K * V + s_off, tl.where(live, b_h, 0.0), mask=m_fin)
    if HAS_CU:
        BN: tl.constexpr = 1024
        odd = tl.zeros([BN], dtype=tl.int32)
        for s0 in range(0, n_seqs, BN):
            o_s = s0 + tl.arange(0, BN)
            m_s = o_s < n_seqs
            lens = (tl.load(cu_seqlens + o_s + 1, mask=m_s, other=1).to(tl.int64)
                    - tl.load(cu_seqlens + o_s, mask=m_s, other=0).to(tl.int64))
            odd += (lens != 1).to(tl.int32)
        if tl.sum(odd, 0) > 0:  # some sequence has 0 or several tokens: its units here, token by token
            for unit in range(tl.program_id(0), n_units, tl.num_programs(0)):
                i_v = unit % NVT
                i_nh = unit // NVT
                i_n = (i_nh // HV).to(tl.int64)
                i_hv = i_nh % HV
                bos = tl.load(cu_seqlens + i_n).to(tl.int64)
                eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
                if eos - bos != 1:
                    slot = i_n
                    if HAS_SLOTS:
                        slot = tl.load(slots + i_n).to(tl.int64)
                    _recurrent_unit(q, k, v, f, beta, dt_bias, a_log, o, pool, ht, slot, i_n, i_v, i_hv,
                                    i_hv // (HV // H), bos, eos, scale, lower_bound, stride_slot, H, HV, K, V, BK,
                                    BV, HAS_H0, STORE_FINAL, INPLACE, USE_GATE, BOUNDED, HAS_BIAS, L2NORM,
                                    BETA_SIGMOID, False)


_SMS: dict[int, int] = {}


def _step_programs(n_units: int, cfg: KDAKernelConfig, device: torch.device) -> int:
    if device.type != "cuda":
        return min(n_units, 3)  # the interpreter: a few programs, each several units
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return max(1, min(n_units, _SMS[index] * cfg.decode_step_programs_per_sm))


def _launch_step(q, k, v, g, beta, o, initial_state, ht, slots, cu_seqlens, N, scale, lower_bound, A_log, dt_bias,
                 inplace, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, cfg) -> None:
    """recurrent_kda_step_kernel over N sequences of one token: [N, 1, ...] inputs, or [1, N, ...] with
    cu_seqlens."""
    H, K = q.shape[2:]
    HV, V = v.shape[2:]
    BK = triton.next_power_of_2(K)
    BV = min(cfg.decode_step_block_v, triton.next_power_of_2(V))
    n_units = triton.cdiv(V, BV) * N * HV
    h0 = initial_state
    # the descriptor costs host time per launch (H200: ~20 us); below the size where the kernel outlasts the
    # host's launch work, pointer loads (see decode_step_tma_min_bytes)
    tma = (cfg.decode_step_tma and initial_state is not None and initial_state.dtype == torch.float32
           and initial_state.is_contiguous() and BK == K and V % BV == 0 and initial_state.data_ptr() % 16 == 0
           and N * HV * K * V * 4 >= cfg.decode_step_tma_min_bytes)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        h0 = TensorDescriptor.from_tensor(initial_state.view(-1, V), [BK, BV])
    recurrent_kda_step_kernel[(_step_programs(n_units, cfg, q.device),)](
        q, k, v, g, beta, dt_bias, A_log, o, h0, initial_state, ht, slots, cu_seqlens, scale,
        lower_bound if lower_bound is not None else 0.0, _slot_stride(initial_state, HV, K, V), n_units, N,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        HAS_H0=initial_state is not None, HAS_SLOTS=slots is not None, STORE_FINAL=ht is not None, INPLACE=inplace,
        USE_GATE=use_gate_in_kernel, BOUNDED=lower_bound is not None, HAS_BIAS=dt_bias is not None,
        L2NORM=use_qk_l2norm_in_kernel, BETA_SIGMOID=use_beta_sigmoid_in_kernel, TMA=tma,
        STAGES=cfg.decode_step_stages, HAS_CU=cu_seqlens is not None, num_warps=cfg.decode_step_warps,
    )


def _slot_stride(pool: torch.Tensor | None, HV: int, K: int, V: int) -> int:
    """Elements from one slot of a state pool to the next: HV * K * V when contiguous, a page in a serving engine."""
    return HV * K * V if pool is None or pool.shape[0] < 2 else pool.stride(0)


_ROWS_CU: dict[tuple, torch.Tensor] = {}


def _rows_cu_seqlens(B: int, T: int, device: torch.device) -> torch.Tensor:
    """cu_seqlens of B rows of T tokens, kept per shape (no host-to-device copy per decode call); made on the device
    and not kept while a CUDA graph is being captured (the graph's copy would hold it)."""
    if device.type != "cuda":
        return flat_cu_seqlens(B, T, None, device)
    if torch.cuda.is_current_stream_capturing():
        return torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device)
    key = (B, T, device)
    if key not in _ROWS_CU:
        _ROWS_CU[key] = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device)
    return _ROWS_CU[key]


def fused_recurrent_kda_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, scale: float,
    initial_state: torch.Tensor | None, output_final_state: bool, use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, lower_bound: float | None,
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
    ssm_state_indices: torch.Tensor | None, inplace_final_state: bool, config: KDAKernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Arguments validated by `fused_recurrent_kda` (same state semantics)."""
    cfg = config or DEFAULT_CONFIG
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    N = cu_seqlens.numel() - 1 if cu_seqlens is not None else B
    BK = triton.next_power_of_2(K)
    BV = min(cfg.decode_block_v, triton.next_power_of_2(V))
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty(B, T, HV, V, dtype=q.dtype, device=q.device)
    inplace = initial_state is not None and inplace_final_state
    if initial_state is not None and not slots_contiguous(initial_state):
        raise ValueError("initial_state: each slot [HV, K, V] must be contiguous (the slots may lie apart)")
    store_final = not inplace and (output_final_state or ssm_state_indices is not None)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=q.device) if store_final else None
    # one token per sequence: rows of T = 1, or cu_seqlens over as many tokens as sequences (if some sequence then
    # has another length, the kernel finds out on the device and runs it token by token)
    if cfg.decode_step and ((T == 1 and cu_seqlens is None) or (cu_seqlens is not None and T == N
                                                                 and cfg.decode_step_varlen)):
        _launch_step(q, k, v, g, beta, o, initial_state, ht, ssm_state_indices, cu_seqlens, N, scale, lower_bound,
                     A_log, dt_bias, inplace, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                     cfg)
        return (o, initial_state) if inplace else (o, ht)
    # varlen: cu_seqlens as given (any integer dtype), so decode launches without a host sync
    cu = cu_seqlens if cu_seqlens is not None else _rows_cu_seqlens(B, T, q.device)
    recurrent_kda_kernel[(triton.cdiv(V, BV), N * HV)](
        q, k, v, g, beta, dt_bias, A_log, o, initial_state, ht, cu, ssm_state_indices, scale,
        lower_bound if lower_bound is not None else 0.0, _slot_stride(initial_state, HV, K, V),
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, HAS_H0=initial_state is not None,
        HAS_SLOTS=ssm_state_indices is not None, STORE_FINAL=store_final, INPLACE=inplace,
        USE_GATE=use_gate_in_kernel, BOUNDED=lower_bound is not None, HAS_BIAS=dt_bias is not None,
        L2NORM=use_qk_l2norm_in_kernel, BETA_SIGMOID=use_beta_sigmoid_in_kernel, EVICT=cfg.decode_evict_first,
        num_warps=cfg.decode_num_warps,
    )
    if inplace:
        return o, initial_state
    return o, ht
