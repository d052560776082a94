"""Triton recurrent KDA for decode: one program per (V tile, sequence, value head), the state tile in
registers (fp32) across the sequence's tokens, read from and written back to its slot. Rows of one token
each (the serving call: [N, 1, ...] without cu_seqlens) take recurrent_kda_step_kernel instead, a persistent
kernel whose pipelined loop keeps the next units' state tiles in flight."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kda.gate import gate_fn
from kernels.kda.triton_chunk import flat_cu_seqlens
from kernels.kda.triton_config import DEFAULT_CONFIG, KDAKernelConfig


@triton.jit
def recurrent_kda_kernel(
    q, k, v, f, beta, dt_bias, a_log, o, h0, ht, cu_seqlens, slots, scale, lower_bound,
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
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    slot = i_n
    if HAS_SLOTS:
        slot = tl.load(slots + i_n).to(tl.int64)
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
                b_h += tl.load(h0 + (slot * HV + i_hv) * K * V + s_off, mask=m_kv, other=0.0,
                               eviction_policy="evict_first").to(tl.float32)
            else:
                b_h += tl.load(h0 + (slot * HV + i_hv) * K * V + s_off, mask=m_kv, other=0.0).to(tl.float32)
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
                tl.store(h0 + (slot * HV + i_hv) * K * V + s_off, b_h.to(h0.dtype.element_ty), mask=m_kv,
                         eviction_policy="evict_first")
            else:
                tl.store(h0 + (slot * HV + i_hv) * K * V + s_off, b_h.to(h0.dtype.element_ty), mask=m_kv)
        if STORE_FINAL:
            tl.store(ht + (i_n * HV + i_hv) * K * V + s_off, b_h, mask=m_kv)


@triton.jit
def recurrent_kda_step_kernel(
    q, k, v, f, beta, dt_bias, a_log, o, h0, ht, slots, scale, lower_bound, n_units,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, HAS_SLOTS: tl.constexpr, STORE_FINAL: tl.constexpr, INPLACE: tl.constexpr,
    USE_GATE: tl.constexpr, BOUNDED: tl.constexpr, HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, TMA: tl.constexpr, STAGES: tl.constexpr,
):
    """One token per sequence (row n of [N, 1, ...] inputs): a persistent program loops over (value tile,
    sequence x value head) units. The loop has no branches, so Triton software-pipelines it: the slot index and
    state tile of the next STAGES - 1 units are copied to shared memory while this unit is computed (the one-unit
    programs of recurrent_kda_kernel each wait for their own tile). With TMA, h0 is a tensor descriptor over
    the pool as [slots * HV * K, V] (K == BK) and the tiles move by bulk copies."""
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
        row = (tl.maximum(slot, 0) * HV + i_hv) * K
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
        if HAS_H0:
            if TMA:
                b_h += tl.where(live, h0.load([row.to(tl.int32), i_v * BV]), 0.0)
            else:
                b_h += tl.load(h0 + row * V + s_off, mask=m_live, other=0.0).to(tl.float32)
        b_q = tl.load(q + i_n * (H * K) + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + i_n * (H * K) + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + i_n * (HV * V) + i_hv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(f + i_n * (HV * K) + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_b = tl.load(beta + i_n * HV + i_hv).to(tl.float32)
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
        tl.store(o + i_n * (HV * V) + i_hv * V + o_v, tl.where(live, b_o, 0.0).to(o.dtype.element_ty), mask=m_v)
        if INPLACE:
            if TMA:
                if live:
                    h0.store([row.to(tl.int32), i_v * BV], b_h)
            else:
                tl.store(h0 + row * V + s_off, b_h.to(h0.dtype.element_ty), mask=m_live)
        if STORE_FINAL:
            tl.store(ht + (i_n * HV + i_hv) * K * V + s_off, tl.where(live, b_h, 0.0), mask=m_kv)


def _step_programs(n_units: int, cfg: KDAKernelConfig, device: torch.device) -> int:
    if device.type != "cuda":
        return min(n_units, 3)  # the interpreter: a few programs, each several units
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(n_units, sms * cfg.decode_step_programs_per_sm))


def _launch_step(q, k, v, g, beta, o, initial_state, ht, slots, scale, lower_bound, A_log, dt_bias, inplace,
                 use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, cfg) -> None:
    """recurrent_kda_step_kernel over [N, 1, ...] inputs."""
    N, _, H, K = q.shape
    HV, V = v.shape[2:]
    BK = triton.next_power_of_2(K)
    BV = min(cfg.decode_step_block_v, triton.next_power_of_2(V))
    n_units = triton.cdiv(V, BV) * N * HV
    h0 = initial_state
    tma = (cfg.decode_step_tma and initial_state is not None and initial_state.dtype == torch.float32
           and initial_state.is_contiguous() and BK == K and V % BV == 0 and initial_state.data_ptr() % 16 == 0)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        h0 = TensorDescriptor.from_tensor(initial_state.view(-1, V), [BK, BV])
    recurrent_kda_step_kernel[(_step_programs(n_units, cfg, q.device),)](
        q, k, v, g, beta, dt_bias, A_log, o, h0, ht, slots, scale, lower_bound if lower_bound is not None else 0.0,
        n_units, H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, HAS_H0=initial_state is not None, HAS_SLOTS=slots is not None,
        STORE_FINAL=ht is not None, INPLACE=inplace, USE_GATE=use_gate_in_kernel, BOUNDED=lower_bound is not None,
        HAS_BIAS=dt_bias is not None, L2NORM=use_qk_l2norm_in_kernel, BETA_SIGMOID=use_beta_sigmoid_in_kernel,
        TMA=tma, STAGES=cfg.decode_step_stages, num_warps=cfg.decode_step_warps,
    )


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
    # varlen: cu_seqlens as given (any integer dtype), so decode launches without a host sync
    cu = cu_seqlens if cu_seqlens is not None else flat_cu_seqlens(B, T, None, q.device)
    N = cu.numel() - 1
    BK = triton.next_power_of_2(K)
    BV = min(cfg.decode_block_v, triton.next_power_of_2(V))
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty(B, T, HV, V, dtype=q.dtype, device=q.device)
    inplace = initial_state is not None and inplace_final_state
    if inplace and not initial_state.is_contiguous():
        raise ValueError("initial_state must be contiguous to be updated in place")
    store_final = not inplace and (output_final_state or ssm_state_indices is not None)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=q.device) if store_final else None
    if cfg.decode_step and T == 1 and cu_seqlens is None:
        _launch_step(q, k, v, g, beta, o, initial_state, ht, ssm_state_indices, scale, lower_bound, A_log, dt_bias,
                     inplace, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, cfg)
        return (o, initial_state) if inplace else (o, ht)
    recurrent_kda_kernel[(triton.cdiv(V, BV), N * HV)](
        q, k, v, g, beta, dt_bias, A_log, o, initial_state, ht, cu, ssm_state_indices, scale,
        lower_bound if lower_bound is not None else 0.0,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, HAS_H0=initial_state is not None,
        HAS_SLOTS=ssm_state_indices is not None, STORE_FINAL=store_final, INPLACE=inplace,
        USE_GATE=use_gate_in_kernel, BOUNDED=lower_bound is not None, HAS_BIAS=dt_bias is not None,
        L2NORM=use_qk_l2norm_in_kernel, BETA_SIGMOID=use_beta_sigmoid_in_kernel, EVICT=cfg.decode_evict_first,
        num_warps=cfg.decode_num_warps,
    )
    if inplace:
        return o, initial_state
    return o, ht
