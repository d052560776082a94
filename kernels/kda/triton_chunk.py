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
from kernels.kda.triton_chunk_infer import solve_wu_kernel
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


def infer_kernels(cfg: KDAKernelConfig, lower_bound: float | None, save_for_backward: bool) -> bool:
    """A forward without autograd with bounded gates (chunks of 2 or 4 sub-blocks) runs the solve and w/u as
    one kernel (triton_chunk_infer.py): nothing reads the inverse afterwards, so it is not stored."""
    return (cfg.infer_kernels and lower_bound is not None and not save_for_backward
            and cfg.chunk_size // cfg.sub_chunk in (2, 4))


def kda_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta: torch.Tensor, scale: float,
    initial_state: torch.Tensor | None, output_final_state: bool, use_gate: bool, lower_bound: float | None,
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, cu: torch.Tensor, chunk_indices: torch.Tensor,
    chunk_offsets: torch.Tensor, cfg: KDAKernelConfig, save_for_backward: bool = True, norm_in_kernels: bool = False,
) -> dict[str, torch.Tensor | None]:
    """Flattened inputs: q, k [T, H, K]; v [T, HV, V]; f [T, HV, K]; beta [T, HV] probabilities. Without
    `save_for_backward` the states h and new values vn are not written (returned empty). With `norm_in_kernels`
    (bounded gates) q and k are raw and the scores and w/u kernels l2-normalise the rows they load."""
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
    fused_wu = infer_kernels(cfg, lower_bound, save_for_backward)
    kge = torch.empty(T, HV, K, dtype=k.dtype, device=dev) if fused_wu else None
    row_first = cfg.scores_row_block_first
    NB = BT // BC
    intra_scores_kernel[(NB, NC, HV) if row_first else (NC, HV, NB)](
        q, k, gcum, Aqk, Akk, qg, kg, kge, cu, chunk_indices, scale,
        H=H, HV=HV, K=K, BT=BT, BC=BC, BK=BK, BKS=16, SAFE=safe, DOT_PREC=prec, L2NORM=norm_in_kernels,
        STORE_KGE=fused_wu, ROW_BLOCK_FIRST=row_first,
        UPPER_KK=not (fused_wu and cfg.infer_skip_upper_akk), num_warps=cfg.num_warps_scores,
    )
    work_dtype = cfg.work_dtype or v.dtype
    w = torch.empty(T, HV, K, dtype=work_dtype, device=dev)
    u = torch.empty(T, HV, V, dtype=work_dtype, device=dev)
    if fused_wu:  # Ai stays in registers: not stored
        BW = min(cfg.infer_wu_block, BK)
        solve_wu_kernel[(NC, HV)](
            beta, Akk, kge, v, w, u, cu, chunk_indices, H=H, HV=HV, K=K, V=V, BT=BT, BC=BC, BK=BW,
            BV=min(cfg.infer_wu_block, triton.next_power_of_2(V)), DOT_PREC=prec, num_warps=cfg.num_warps_solve_wu,
        )
        Ai = Akk.new_empty(0)
    else:
        Ai = torch.empty(T, HV, BT, dtype=torch.float32, device=dev)
        solve_kernel[(NC, HV)](beta, Akk, Ai, cu, chunk_indices, H=H, HV=HV, BT=BT, BC=BC,
                               num_warps=cfg.num_warps_solve)
        BVU = min(64, BV)
        wu_kernel[(NC, HV, 1 + triton.cdiv(V, BVU))](
            k, v, beta, gcum, Ai, w, u, cu, chunk_indices,
            H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BVU, DOT_PREC=prec, L2NORM=norm_in_kernels,
            num_warps=cfg.num_warps_solve,
        )
    state_dtype = cfg.state_dtype or (torch.float32 if q.dtype == torch.float32 else q.dtype)
    if save_for_backward:
        h = torch.empty(max(NC, 1), HV, K, V, dtype=state_dtype, device=dev)
        vn = torch.empty(T, HV, V, dtype=work_dtype, device=dev)
    else:  # never written: the kernel only needs pointers of the right type
        h, vn = torch.empty(1, dtype=state_dtype, device=dev), torch.empty(1, dtype=work_dtype, device=dev)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev) if output_final_state else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    BVS = min(cfg.fwd_state_block_v, triton.next_power_of_2(V))
    o = torch.empty(T, HV, V, dtype=q.dtype, device=dev)
    fwd_state_kernel[(triton.cdiv(V, BVS), N * HV)](
        kg, gcum, w, u, vn, h, h0, ht, qg, Aqk, o, cu, chunk_offsets,
        H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BVS, HAS_H0=h0 is not None, STORE_FINAL=ht is not None, DOT_PREC=prec,
        STORE_SAVED=save_for_backward, num_warps=cfg.num_warps_state, num_stages=cfg.num_stages_state,
    )
    if not save_for_backward:
        h, vn = h.new_empty(0), vn.new_empty(0)
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


# ---- the autograd op ----------------------------------------------------------------------------------
# Registered as torch.library custom ops (forward and backward), so torch.compile treats the Triton launches
# as one opaque op with known output shapes instead of tracing into them, and a compiled decoder layer has no
# graph break. The kernel config travels by name (custom ops take no dataclasses).
_CONFIGS: dict[str, KDAKernelConfig] = {}
_SAVED = ("gcum", "Aqk", "Akk", "Ai", "w", "u", "h", "vn", "qg", "kg", "chunk_indices", "chunk_offsets")
_LAYOUTS: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def config_key(cfg: KDAKernelConfig) -> str:
    """Name an explicit (benchmark) config; the default ones are named by `_default_key`."""
    key = repr(cfg)
    _CONFIGS.setdefault(key, cfg)
    return key


def _default_key(chunk_size: int, dtype: torch.dtype) -> str:
    # built from constants only, so torch.compile traces it
    return f"default-{chunk_size}-{'fp32' if dtype == torch.float32 else 'lowp'}"


def _config(key: str) -> KDAKernelConfig:
    if key not in _CONFIGS:
        _, chunk, kind = key.split("-")
        cfg = DEFAULT_CONFIG if int(chunk) == DEFAULT_CONFIG.chunk_size else KDAKernelConfig(chunk_size=int(chunk))
        _CONFIGS[key] = cfg.for_inputs(torch.float32 if kind == "fp32" else torch.bfloat16)
    return _CONFIGS[key]


def _layout(B: int, T: int, cu_seqlens: torch.Tensor | None, BT: int, device: torch.device):
    """seq_layout, kept per (B, T, chunk, device) for fixed-length batches: one host-to-device copy per shape."""
    if cu_seqlens is not None:
        return seq_layout(B, T, cu_seqlens, BT, device)
    key = (B, T, BT, device)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = seq_layout(B, T, None, BT, device)
    return _LAYOUTS[key]


def _none(x: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Custom ops return tensors only: an absent output is an empty one."""
    return like.new_empty(0) if x is None else x


def _some(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None or x.numel() == 0 else x


def _norm_in_kernels(cfg: KDAKernelConfig, use_l2norm: bool, lower_bound: float | None, save_for_backward: bool) -> bool:
    """Without autograd nothing reads the normalised q, k but the scores and w/u kernels, which (bounded gates:
    they load whole rows of K) normalise the rows they load instead of a separate l2norm pass."""
    return use_l2norm and lower_bound is not None and not save_for_backward and cfg.l2norm_in_kernels


@torch.library.custom_op("taper::chunk_kda_fwd", mutates_args=())
def chunk_kda_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta: torch.Tensor,
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, batch: int, scale: float, output_final_state: bool, use_gate: bool,
    lower_bound: float | None, use_l2norm: bool, config: str, save_for_backward: bool = True,
) -> list[torch.Tensor]:
    """Flattened q, k [B*T, H, K], v [B*T, HV, V], f [B*T, HV, K], beta [B*T, HV] (probabilities).
    Returns [o, final state, normalised q, its rstd, normalised k, its rstd, *_SAVED] (empty when absent;
    h and vn also without `save_for_backward`, which a forward with no input needing a gradient passes, and then
    for bounded gates the normalised q, k too)."""
    cfg = _config(config)
    q, k, v, f, beta = (x.contiguous() for x in (q, k, v, f, beta))
    cu, chunk_indices, chunk_offsets = _layout(batch, q.shape[0] // batch, cu_seqlens, cfg.chunk_size, q.device)
    qn = q_rstd = kn = k_rstd = None
    norm_in_kernels = _norm_in_kernels(cfg, use_l2norm, lower_bound, save_for_backward)
    if use_l2norm and not norm_in_kernels:
        (qn, q_rstd), (kn, k_rstd) = l2norm_fwd(q), l2norm_fwd(k)
    saved = kda_fwd(qn if qn is not None else q, kn if kn is not None else k, v, f, beta, scale, initial_state,
                    output_final_state, use_gate, lower_bound, A_log, dt_bias, cu, chunk_indices, chunk_offsets, cfg,
                    save_for_backward, norm_in_kernels)
    # outputs may not alias the layout cache: fixed-length batches return empty ones and look them up again
    fixed = cu_seqlens is None
    saved["chunk_indices"] = chunk_indices.new_empty(0) if fixed else chunk_indices
    saved["chunk_offsets"] = chunk_offsets.new_empty(0) if fixed else chunk_offsets
    return [saved["o"], _none(saved["ht"], q), *(_none(x, q) for x in (qn, q_rstd, kn, k_rstd)),
            *(saved[n] for n in _SAVED)]


@chunk_kda_fwd_op.register_fake
def _(q, k, v, f, beta, A_log, dt_bias, initial_state, cu_seqlens, batch, scale, output_final_state, use_gate,
      lower_bound, use_l2norm, config, save_for_backward=True):
    cfg = _config(config)
    T, H, K = q.shape
    HV, V = v.shape[1:]
    BT = cfg.chunk_size
    if cu_seqlens is None:
        N, NC = batch, batch * (-(-(T // batch) // BT))
    else:
        N, NC = cu_seqlens.shape[0] - 1, torch.library.get_ctx().new_dynamic_size()
    f32, i32 = torch.float32, torch.int32
    work = cfg.work_dtype or v.dtype
    state = cfg.state_dtype or (f32 if q.dtype == f32 else q.dtype)

    def e(*shape, dtype):
        return q.new_empty(shape, dtype=dtype)

    norm_in_kernels = _norm_in_kernels(cfg, use_l2norm, lower_bound, save_for_backward)
    norm = [e(T, H, K, dtype=q.dtype), e(T * H, dtype=f32), e(T, H, K, dtype=k.dtype), e(T * H, dtype=f32)] \
        if use_l2norm and not norm_in_kernels else [e(0, dtype=q.dtype) for _ in range(4)]
    saved = dict(gcum=e(T, HV, K, dtype=f32), Aqk=e(T, HV, BT, dtype=k.dtype), Akk=e(T, HV, BT, dtype=f32),
                 Ai=e(T, HV, BT, dtype=f32), w=e(T, HV, K, dtype=work), u=e(T, HV, V, dtype=work),
                 h=e(NC, HV, K, V, dtype=state), vn=e(T, HV, V, dtype=work), qg=e(T, HV, K, dtype=k.dtype),
                 kg=e(T, HV, K, dtype=k.dtype), chunk_indices=e(0, dtype=i32), chunk_offsets=e(0, dtype=i32))
    if not save_for_backward:
        saved.update(h=e(0, dtype=state), vn=e(0, dtype=work))
    if infer_kernels(cfg, lower_bound, save_for_backward):
        saved.update(Ai=e(0, dtype=f32))
    if cu_seqlens is not None:  # fixed-length layouts come from the cache in the backward
        saved.update(chunk_indices=e(NC, 2, dtype=i32), chunk_offsets=e(N, dtype=i32))
    ht = e(N, HV, K, V, dtype=f32) if output_final_state else e(0, dtype=q.dtype)
    return [e(T, HV, V, dtype=q.dtype), ht, *norm, *(saved[n] for n in _SAVED)]


@torch.library.custom_op("taper::chunk_kda_bwd", mutates_args=())
def chunk_kda_bwd_op(
    do: torch.Tensor, dht: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    f: torch.Tensor, beta: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, qn: torch.Tensor, q_rstd: torch.Tensor,
    kn: torch.Tensor, k_rstd: torch.Tensor, saved: list[torch.Tensor], batch: int, scale: float, use_gate: bool,
    lower_bound: float | None, config: str,
) -> list[torch.Tensor]:
    """Returns [dq, dk (in q's dtype), dv, dgate, dbeta (fp32), dh0 (empty when absent)]. dgate is the
    gradient of the log-decay g; `_backward` turns it into those of f, A_log and dt_bias outside the op,
    where torch.compile fuses that elementwise work and the casts with their neighbours."""
    cfg = _config(config)
    use_l2norm = qn.numel() > 0
    q, k, v, f, beta = (x.contiguous() for x in (q, k, v, f, beta))
    qk, kk = (qn, kn) if use_l2norm else (q, k)
    T, H, K = q.shape
    HV = v.shape[1]
    saved = dict(zip(_SAVED, saved, strict=True))
    if cu_seqlens is None:
        cu, saved["chunk_indices"], saved["chunk_offsets"] = _layout(batch, T // batch, None, cfg.chunk_size, q.device)
    else:
        cu = flat_cu_seqlens(batch, T // batch, cu_seqlens, q.device)
    dq, dk, dv, dgate, dbeta, dh0 = kda_bwd(
        saved, qk, kk, v, f, beta, scale, initial_state, do, dht, use_gate, lower_bound, A_log, dt_bias, cu, cfg,
    )
    if HV != H:
        dq, dk = dq.view(T, H, HV // H, K).sum(2), dk.view(T, H, HV // H, K).sum(2)
    if use_l2norm:  # through the l2norm, straight from the fp32 gradients
        dq, dk = l2norm_bwd(qn, q_rstd, dq, q.dtype), l2norm_bwd(kn, k_rstd, dk, k.dtype)
    return [dq.to(q.dtype), dk.to(k.dtype), dv, dgate, dbeta, _none(dh0, q)]


@chunk_kda_bwd_op.register_fake
def _(do, dht, q, k, v, f, beta, A_log, dt_bias, initial_state, cu_seqlens, qn, q_rstd, kn, k_rstd, saved, batch,
      scale, use_gate, lower_bound, config):
    f32 = torch.float32
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(f, dtype=f32),
            torch.empty_like(beta, dtype=f32),
            q.new_empty(0) if initial_state is None else q.new_empty(initial_state.shape, dtype=f32)]


def _gate_grads(
    dgate: torch.Tensor, f: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
    use_gate: bool, lower_bound: float | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(df, dA_log, ddt_bias) from the kernels' dgate [T, HV, K] fp32: for the bounded gate and a precomputed
    g it already is df (bwd_gate applies the bounded gate's derivative); the unbounded gate's derivative is
    applied here."""
    HV, K = f.shape[1:]
    df, dA_log, ddt_bias = dgate, None, None
    if use_gate and lower_bound is None:
        x = f.float() + (dt_bias.float().view(HV, K) if dt_bias is not None else 0.0)
        e_a = A_log.float().exp().view(HV, 1)
        df = -dgate * e_a * torch.sigmoid(x)
        dA_log = (dgate * (-e_a * torch.nn.functional.softplus(x))).sum((0, 2)).to(A_log.dtype)
    if use_gate and dt_bias is not None:
        ddt_bias = df.sum(0).reshape(dt_bias.shape).to(dt_bias.dtype)
    return df, dA_log, ddt_bias


def _setup_context(ctx, inputs, output) -> None:
    (q, k, v, f, beta, A_log, dt_bias, initial_state, cu_seqlens, batch, scale, _, use_gate, lower_bound, _,
     config, *_) = inputs
    ctx.save_for_backward(q, k, v, f, beta, A_log, dt_bias, initial_state, cu_seqlens, *output[2:])
    ctx.args = (batch, scale, use_gate, lower_bound, config)
    ctx.has_final = output[1].numel() > 0


def _backward(ctx, grads):
    q, k, v, f, beta, A_log, dt_bias, initial_state, cu_seqlens, qn, q_rstd, kn, k_rstd, *saved = ctx.saved_tensors
    # autograd may hand over expanded (stride-0) gradients, e.g. of final_state.sum(); the kernels index densely
    do, dht = grads[0], grads[1].contiguous() if ctx.has_final and grads[1] is not None else None
    if do is None:
        do = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    dq, dk, dv, dgate, dbeta, dh0 = chunk_kda_bwd_op(
        do, dht, q, k, v, f, beta, A_log, dt_bias, initial_state, cu_seqlens, qn, q_rstd, kn, k_rstd, saved,
        *ctx.args,
    )
    _, _, use_gate, lower_bound, _ = ctx.args
    df, dA_log, ddt_bias = _gate_grads(dgate, f, A_log, dt_bias, use_gate, lower_bound)
    return (dq, dk, dv, df.to(f.dtype), dbeta.to(beta.dtype), dA_log, ddt_bias, _some(dh0), None, None, None,
            None, None, None, None, None)


chunk_kda_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def chunk_kda_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, scale: float,
    initial_state: torch.Tensor | None, output_final_state: bool, use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, lower_bound: float | None,
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, cu_seqlens: torch.Tensor | None, chunk_size: int,
    config: KDAKernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Arguments validated by `chunk_kda`. Works on any device Triton runs on (CUDA, or the CPU
    interpreter under TRITON_INTERPRET=1)."""
    key = _default_key(chunk_size, q.dtype) if config is None else config_key(config.for_inputs(q.dtype))
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    if use_beta_sigmoid_in_kernel:
        if torch.is_grad_enabled() and beta.requires_grad:  # the gradient through an fp32 sigmoid
            beta = torch.sigmoid(beta.float()).to(beta.dtype)
        else:  # the same values (torch computes a low-precision sigmoid in fp32), one kernel instead of three
            beta = torch.sigmoid(beta)
    h0 = initial_state.float() if initial_state is not None else None
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, A_log, dt_bias, initial_state))
    o, ht, *_ = chunk_kda_fwd_op(
        q.reshape(B * T, H, K), k.reshape(B * T, H, K), v.reshape(B * T, HV, V), g.reshape(B * T, HV, K),
        beta.reshape(B * T, HV), A_log, dt_bias, h0, cu_seqlens, B, scale, output_final_state,
        use_gate_in_kernel, lower_bound, use_qk_l2norm_in_kernel, key, needs_grad,
    )
    return o.view(B, T, HV, V), (ht if output_final_state else None)
