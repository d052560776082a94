"""Host side of the Triton chunked KDA: launches, saved tensors, and the autograd Function."""

from __future__ import annotations

import torch
import triton

from kernels.kda.common import check_cu_seqlens_values
from kernels.kda.triton_chunk_bwd import bwd_gate_kernel, bwd_inter_kernel, bwd_intra_kernel, bwd_state_kernel
from kernels.kda.triton_chunk_fwd import (
    fwd_state_kernel,
    gate_cumsum_kernel,
    intra_scores_kernel,
    solve_kernel,
    wu_kernel,
)
from kernels.kda.triton_config import DEFAULT_CONFIG, KDAKernelConfig
from kernels.kda.triton_l2norm import l2norm_bwd, l2norm_fwd


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host-built index tensors to the GPU without waiting for the stream (pinned, non-blocking)."""
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def flat_cu_seqlens(B: int, T: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if cu_seqlens is not None:
        return cu_seqlens.to(device=device, dtype=torch.int32)
    return to_device(torch.arange(0, (B + 1) * T, T, dtype=torch.int32), device)


def seq_layout(
    B: int, T: int, cu_seqlens: torch.Tensor | None, BT: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cu [N+1] int32, chunk_indices [NC, 2] int32 of (sequence, chunk in sequence), chunk_offsets [N]
    int32 (first chunk of each sequence), all on `device`. Varlen costs one host read of cu_seqlens."""
    if cu_seqlens is None:
        lens = [T] * B
    else:
        cs = cu_seqlens.tolist()
        check_cu_seqlens_values(cs, T)
        lens = [b - a for a, b in zip(cs, cs[1:], strict=False)]
    counts = [-(-n // BT) for n in lens]
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(counts, dtype=torch.long))
    starts = torch.tensor([0] + counts[:-1], dtype=torch.long).cumsum(0)
    within = torch.arange(seq.numel()) - starts[seq]
    indices = torch.stack([seq, within], 1).to(torch.int32)
    return (flat_cu_seqlens(B, T, cu_seqlens, device), to_device(indices, device),
            to_device(starts.to(torch.int32), device))


def kda_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta: torch.Tensor, scale: float,
    initial_state: torch.Tensor | None, output_final_state: bool, use_gate: bool, lower_bound: float | None,
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, cu: torch.Tensor, chunk_indices: torch.Tensor,
    chunk_offsets: torch.Tensor, cfg: KDAKernelConfig,
) -> dict[str, torch.Tensor | None]:
    """Flattened inputs: q, k [T, H, K]; v [T, HV, V]; f [T, HV, K]; beta [T, HV] probabilities."""
    T, H, K = q.shape
    HV, V = v.shape[1:]
    N = cu.numel() - 1
    BT, BC = cfg.chunk_size, cfg.sub_chunk
    BK = triton.next_power_of_2(K)
    BV = min(cfg.block_v, triton.next_power_of_2(V))
    NC = chunk_indices.shape[0]
    dev = q.device
    prec = cfg.dot_precision(q.dtype)
    gcum = torch.empty(T, HV, K, dtype=torch.float32, device=dev)
    safe = lower_bound is not None
    BKG = min(cfg.gate_block_k, BK)
    gate_cumsum_kernel[(NC, HV, triton.cdiv(K, BKG))](
        f, dt_bias, A_log, gcum, cu, chunk_indices, lower_bound if safe else 0.0,
        HV=HV, K=K, BT=BT, BK=BKG, USE_GATE=use_gate, BOUNDED=safe, HAS_BIAS=use_gate and dt_bias is not None,
        num_warps=cfg.num_warps_gate,
    )
    Aqk = torch.empty(T, HV, BT, dtype=k.dtype, device=dev)  # only ever a bf16 dot operand
    Akk = torch.empty(T, HV, BT, dtype=torch.float32, device=dev)
    qg = torch.empty(T, HV, K, dtype=k.dtype, device=dev)
    kg = torch.empty(T, HV, K, dtype=k.dtype, device=dev)
    intra_scores_kernel[(NC, HV, BT // BC)](
        q, k, gcum, Aqk, Akk, qg, kg, cu, chunk_indices, scale,
        H=H, HV=HV, K=K, BT=BT, BC=BC, BK=BK, BKS=16, SAFE=safe, DOT_PREC=prec, num_warps=cfg.num_warps_scores,
    )
    Ai = torch.empty(T, HV, BT, dtype=torch.float32, device=dev)
    solve_kernel[(NC, HV)](beta, Akk, Ai, cu, chunk_indices, H=H, HV=HV, BT=BT, BC=BC,
                           num_warps=cfg.num_warps_solve)
    work_dtype = cfg.work_dtype or v.dtype
    w = torch.empty(T, HV, K, dtype=work_dtype, device=dev)
    u = torch.empty(T, HV, V, dtype=work_dtype, device=dev)
    BVU = min(64, BV)
    wu_kernel[(NC, HV, 1 + triton.cdiv(V, BVU))](
        k, v, beta, gcum, Ai, w, u, cu, chunk_indices,
        H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BVU, DOT_PREC=prec, num_warps=cfg.num_warps_solve,
    )
    state_dtype = cfg.state_dtype or (torch.float32 if q.dtype == torch.float32 else q.dtype)
    h = torch.empty(max(NC, 1), HV, K, V, dtype=state_dtype, device=dev)
    vn = torch.empty(T, HV, V, dtype=work_dtype, device=dev)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev) if output_final_state else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    BVS = min(cfg.fwd_state_block_v, triton.next_power_of_2(V))
    o = torch.empty(T, HV, V, dtype=q.dtype, device=dev)
    fwd_state_kernel[(triton.cdiv(V, BVS), N * HV)](
        kg, gcum, w, u, vn, h, h0, ht, qg, Aqk, o, cu, chunk_offsets,
        H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BVS, HAS_H0=h0 is not None, STORE_FINAL=ht is not None, DOT_PREC=prec,
        num_warps=cfg.num_warps_state, num_stages=cfg.num_stages_state,
    )
    return dict(o=o, ht=ht, gcum=gcum, Aqk=Aqk, Akk=Akk, Ai=Ai, w=w, u=u, h=h, vn=vn, qg=qg, kg=kg,
                chunk_indices=chunk_indices, chunk_offsets=chunk_offsets)


def kda_bwd(
    saved: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta: torch.Tensor,
    scale: float, initial_state: torch.Tensor | None, do: torch.Tensor, dht: torch.Tensor | None,
    use_gate: bool, lower_bound: float | None, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
    cu: torch.Tensor, cfg: KDAKernelConfig,
) -> tuple[torch.Tensor, ...]:
    """Returns dq, dk [T, HV, K] fp32 (per value head), dv, dgate (df for the bounded gate, else dg),
    dbeta [T, HV] fp32, dh0 (or None)."""
    T, H, K = q.shape
    HV, V = v.shape[1:]
    N = cu.numel() - 1
    BT, BC = cfg.chunk_size, cfg.sub_chunk
    BK = triton.next_power_of_2(K)
    BV = min(cfg.block_v, triton.next_power_of_2(V))
    chunk_indices, chunk_offsets = saved["chunk_indices"], saved["chunk_offsets"]
    NC = chunk_indices.shape[0]
    dev = q.device
    prec = cfg.dot_precision(q.dtype)
    gcum, h = saved["gcum"], saved["h"]
    do = do.contiguous()
    dh = torch.empty_like(h)
    dvn = torch.empty(T, HV, V, dtype=cfg.work_dtype or v.dtype, device=dev)
    dh0 = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev) if initial_state is not None else None
    BVS = min(cfg.bwd_state_block_v, triton.next_power_of_2(V))
    bwd_state_kernel[(triton.cdiv(V, BVS), N * HV)](
        saved["qg"], saved["kg"], gcum, saved["w"], saved["Aqk"], do, dht, dh, dh0, dvn, cu, chunk_offsets,
        H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BVS, HAS_DHT=dht is not None, STORE_DH0=dh0 is not None, DOT_PREC=prec,
        num_warps=cfg.num_warps_state, num_stages=cfg.num_stages_bwd_state,
    )
    f32 = dict(dtype=torch.float32, device=dev)
    dv = torch.empty(T, HV, V, dtype=v.dtype, device=dev)
    dAqk, dAkk = torch.empty(T, HV, BT, **f32), torch.empty(T, HV, BT, **f32)
    dq_p, dk_p, dg_p = (torch.empty(T, HV, K, **f32) for _ in range(3))
    dgam = torch.empty(max(NC, 1), HV, K, **f32)
    dbeta = torch.empty(T, HV, **f32)
    bwd_inter_kernel[(NC, HV)](
        q, k, v, beta, gcum, saved["Akk"], saved["Ai"], saved["w"], saved["u"], saved["vn"], h, dh, do, dvn,
        dv, dAqk, dAkk, dq_p, dk_p, dg_p, dgam, dbeta, cu, chunk_indices, scale,
        H=H, HV=HV, K=K, V=V, BT=BT, BK=min(cfg.bwd_inter_block_k, BK), BV=BV, DOT_PREC=prec, num_warps=cfg.num_warps_bwd,
        num_stages=cfg.num_stages_bwd_inter,
    )
    dq, dk, dgate = (torch.empty(T, HV, K, **f32) for _ in range(3))
    bounded = lower_bound is not None
    BKI = max(16, BK // cfg.bwd_intra_k_split)
    bwd_intra_kernel[(NC, HV, triton.cdiv(K, BKI) * (BT // BC))](
        q, k, gcum, dAqk, dAkk, dq_p, dk_p, dg_p, dq, dk, dgate, cu, chunk_indices, scale,
        H=H, HV=HV, K=K, BT=BT, BC=BC, BK=BKI, SAFE=bounded, FP32_DOTS=cfg.bwd_fp32_dots,
        DOT_PREC=cfg.bwd_score_precision if cfg.bwd_fp32_dots else prec,
        DIAG_PREC=(cfg.bwd_score_precision_diag or cfg.bwd_score_precision) if cfg.bwd_fp32_dots else prec,
        num_warps=cfg.num_warps_bwd_intra,
    )
    BKG = min(cfg.gate_block_k, BK)
    bwd_gate_kernel[(NC, HV, triton.cdiv(K, BKG))](
        dgate, dgam, f, dt_bias, cu, chunk_indices, lower_bound if bounded else 0.0,
        HV=HV, K=K, BT=BT, BK=BKG, USE_GATE=use_gate, BOUNDED=bounded, HAS_BIAS=use_gate and dt_bias is not None,
        num_warps=cfg.num_warps_gate,
    )
    return dq, dk, dv, dgate, dbeta, dh0


class ChunkKDAFunction(torch.autograd.Function):
    """beta already probabilities; q/k l2norm (optional) and the gate run in the kernels."""

    @staticmethod
    def forward(ctx, q, k, v, f, beta, A_log, dt_bias, initial_state, scale, output_final_state, use_gate,
                lower_bound, cu, chunk_indices, chunk_offsets, cfg, use_l2norm):
        q, k, v, f, beta = (x.contiguous() for x in (q, k, v, f, beta))
        q_rstd = k_rstd = None
        if use_l2norm:
            (q, q_rstd), (k, k_rstd) = l2norm_fwd(q), l2norm_fwd(k)
        saved = kda_fwd(q, k, v, f, beta, scale, initial_state, output_final_state, use_gate, lower_bound,
                        A_log, dt_bias, cu, chunk_indices, chunk_offsets, cfg)
        ctx.save_for_backward(q, k, v, f, beta, A_log, dt_bias, initial_state, cu, q_rstd, k_rstd,
                              *(saved[n] for n in _SAVED))
        ctx.cfg, ctx.scale, ctx.use_gate, ctx.lower_bound = cfg, scale, use_gate, lower_bound
        return saved["o"], saved["ht"]

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, f, beta, A_log, dt_bias, initial_state, cu, q_rstd, k_rstd, *rest = ctx.saved_tensors
        saved = dict(zip(_SAVED, rest, strict=True))
        dq, dk, dv, dgate, dbeta, dh0 = kda_bwd(
            saved, q, k, v, f, beta, ctx.scale, initial_state, do, dht, ctx.use_gate, ctx.lower_bound, A_log,
            dt_bias, cu, ctx.cfg,
        )
        T, H, K = q.shape
        HV = v.shape[1]
        if HV != H:
            dq, dk = dq.view(T, H, HV // H, K).sum(2), dk.view(T, H, HV // H, K).sum(2)
        dA_log = ddt_bias = None
        df = dgate
        if ctx.use_gate and ctx.lower_bound is None:
            x = f.float() + (dt_bias.float().view(HV, K) if dt_bias is not None else 0.0)
            e_a = A_log.float().exp().view(HV, 1)
            df = -dgate * e_a * torch.sigmoid(x)
            dA_log = (dgate * (-e_a * torch.nn.functional.softplus(x))).sum((0, 2)).to(A_log.dtype)
        if ctx.use_gate and dt_bias is not None:
            ddt_bias = df.sum(0).reshape(dt_bias.shape).to(dt_bias.dtype)
        if q_rstd is not None:  # through the l2norm, straight from the fp32 gradients
            dq, dk = l2norm_bwd(q, q_rstd, dq, q.dtype), l2norm_bwd(k, k_rstd, dk, k.dtype)
        return (dq.to(q.dtype), dk.to(k.dtype), dv, df.to(f.dtype), dbeta.to(beta.dtype), dA_log, ddt_bias,
                dh0, None, None, None, None, None, None, None, None, None)


_SAVED = ("gcum", "Aqk", "Akk", "Ai", "w", "u", "h", "vn", "qg", "kg", "chunk_indices", "chunk_offsets")


def chunk_kda_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, scale: float,
    initial_state: torch.Tensor | None, output_final_state: bool, use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, lower_bound: float | None,
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, cu_seqlens: torch.Tensor | None, chunk_size: int,
    config: KDAKernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Arguments validated by `chunk_kda`. Works on any device Triton runs on (CUDA, or the CPU
    interpreter under TRITON_INTERPRET=1)."""
    cfg = config or (DEFAULT_CONFIG if chunk_size == DEFAULT_CONFIG.chunk_size else
                     KDAKernelConfig(chunk_size=chunk_size))
    cfg = cfg.for_inputs(q.dtype)
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.float()).to(beta.dtype)
    cu, chunk_indices, chunk_offsets = seq_layout(B, T, cu_seqlens, cfg.chunk_size, q.device)
    h0 = initial_state.float() if initial_state is not None else None
    o, ht = ChunkKDAFunction.apply(
        q.reshape(B * T, H, K), k.reshape(B * T, H, K), v.reshape(B * T, HV, V), g.reshape(B * T, HV, K),
        beta.reshape(B * T, HV), A_log, dt_bias, h0, scale, output_final_state, use_gate_in_kernel,
        lower_bound, cu, chunk_indices, chunk_offsets, cfg, use_qk_l2norm_in_kernel,
    )
    return o.view(B, T, HV, V), ht
