"""KDA's per-token recurrence as one compiled CPU loop: the CPU path wherever no gradient is needed (the
engine's prefill and decode, evaluation). The CPU training path, which needs autograd, stays the chunked
torch one (`chunk_torch.py`).

Why a recurrence and not chunks on CPU: with K = V = 64 per head, a token costs a few multiply-adds per
state element, the state (16 KiB) stays in L1 and nothing is materialised, while the chunked torch path
spends most of its time in small batched matmuls and elementwise temporaries (measured 2.4x slower at 4K,
2.6x at 16K, AVX2 CPU; a chunked form built for inference alone was 4-15x slower on an AMX CPU; issue 30).

Per token, with the decay d = exp(g), S' = Diag(d) S, e = v - S'^T k:
    S = S' + beta k e^T,    o = S^T (scale q) = S'^T (scale q) + (scale q . beta k) e.
Each token's rank-1 update is applied lazily, in the next token's one sweep over the state: that sweep
forms S_{t-1} = Diag(d_{t-1}) S_{t-2} + beta k e^T row by row and, from the same rows, S'_t^T k_t and
S'_t^T q_t. So the state is read and written once per token. The sweep is C (`recurrent_cpu.c`, built for
this CPU by `kernels.native`), which keeps its running sums in registers; the passes around it (gate, conv,
output norm) are numba (`recurrent_cpu_numba.py`).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from kernels.cpu_math import empty_f32_or_bf16, f32_or_bf16_bits
from kernels.cpu_threads import run_row_blocks, threads_for
from kernels.kda.common import L2NORM_EPS, preprocess, sequence_rows
from kernels.native import load as load_native
from kernels.native import read_source

Array = torch.Tensor | np.ndarray
STATE_ELEMENTS_PER_THREAD = 1 << 20  # ~0.2 ms of the recurrence on one core; a C thread starts in ~20 us


def slots_contiguous(pool: torch.Tensor) -> bool:
    """Whether each slot of a state pool [P, HV, K, V] is one contiguous block (the slots themselves may lie
    apart, as in a serving engine's pages): what the compiled loops read and write in place."""
    _, HV, K, V = pool.shape
    return pool.stride()[1:] == (K * V, V, 1) or pool.shape[0] == 0 or pool[0].is_contiguous()


@functools.cache
def _kda_rows_c() -> ctypes._CFuncPtr:
    fn = load_native("kda_recurrence", read_source(__file__, "recurrent_cpu.c")).kda_rows
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr] * 5 + [i64, i64, i64, ctypes.c_float, ctypes.c_int32, ctypes.c_float, ptr, ptr, ptr, i64,
                               ptr, i64, ptr, ctypes.c_int32]
    fn.restype = None
    return fn


def kda_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
             scale: float, l2norm: bool, starts: torch.Tensor, ends: torch.Tensor, slots: torch.Tensor,
             pool: torch.Tensor, o: torch.Tensor, threads: int | None = None) -> None:
    """The compiled recurrence over token rows: q, k, decay [R, HV, K], v [R, HV, V], beta [R, HV] fp32 (rows =
    tokens); sequence n is rows starts[n] .. ends[n]-1 and continues the state pool[slots[n]] (pool [P, HV, K, V]
    fp32 with `slots_contiguous`, updated in place); slots[n] < 0 skips it (zero output). o [R, HV, V] gets the
    outputs of the sequences' rows. With `l2norm`, q and k are divided by sqrt(|x|^2 + eps) first. It runs on
    `threads` threads (default: torch's intra-op count, fewer for small work), with the same result on any
    number. The C loop trusts its pointers, so every shape, dtype and layout is checked here."""
    R, HV, K = q.shape
    V = v.shape[2]
    for name, x, shape in (("q", q, (R, HV, K)), ("k", k, (R, HV, K)), ("decay", decay, (R, HV, K)),
                           ("v", v, (R, HV, V)), ("beta", beta, (R, HV)), ("o", o, (R, HV, V))):
        if x.shape != shape or x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
            raise ValueError(f"{name} must be a contiguous fp32 CPU tensor of shape {shape}, got "
                             f"{type(x).__name__} {x.dtype} {tuple(x.shape)}")
    _check_pool("pool", pool)
    index = [x.to("cpu", torch.int64).contiguous() for x in (starts, ends, slots)]
    P = pool.shape[0]
    if pool.shape[1:] != (HV, K, V) or not (len(index[0]) == len(index[1]) == len(index[2])):
        raise ValueError(f"pool {tuple(pool.shape)} / sequence bounds do not fit rows of {HV} x ({K}, {V})")
    if len(index[0]) and bool((index[0] < 0).any() | (index[1] > R).any() | (index[0] > index[1]).any()
                              | (index[2] >= P).any()):
        raise ValueError(f"sequence bounds outside the {R} rows or slots outside the pool's {P}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    _kda_rows_unchecked(tuple(x.data_ptr() for x in (q, k, v, decay, beta)), R, HV, K, V, scale, l2norm, *index,
                        pool, o, threads)


def _kda_rows_unchecked(inputs: tuple[int, int, int, int, int], rows: int, HV: int, K: int, V: int, scale: float,
                        l2norm: bool, starts: torch.Tensor, ends: torch.Tensor, slots: torch.Tensor,
                        pool: torch.Tensor, o: torch.Tensor, threads: int | None = None) -> None:
    """`kda_rows` for arrays already known to fit (built by the caller): at a decode step the checks would cost
    as much as the recurrence. `inputs`: the addresses of q, k, v, decay and beta (tensors' `data_ptr`, or the
    decode step's numpy scratch); the rest by `data_ptr` (numpy's `.ctypes.data` costs ~3 us each)."""
    _kda_rows_c()(*inputs, HV, K, V, scale, int(l2norm), L2NORM_EPS, starts.data_ptr(), ends.data_ptr(),
                  slots.data_ptr(), len(starts), pool.data_ptr(), pool.stride(0), o.data_ptr(),
                  threads or threads_for(rows * HV * K * V, STATE_ELEMENTS_PER_THREAD))


def recurrent_kda_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, scale: float,
    pool: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor | None, use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, lower_bound: float | None,
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
) -> torch.Tensor:
    """The op's inputs as `chunk_kda` takes them (checked); sequence n (a batch row, or a `cu_seqlens`
    segment) continues state pool[slots[n]] (pool: [P, HV, K, V] fp32 with `slots_contiguous`, updated in
    place; a negative slot skips the sequence: zero output, no state touched). Returns o [B, T, HV, V] fp32."""
    _check_pool("pool", pool)
    B, T, _, _ = q.shape
    HV, V = pool.shape[1], pool.shape[3]
    with torch.no_grad():
        # the l2norm runs in the kernel: a few multiply-adds per token there, several tensor passes here; the
        # gate too, in one compiled pass that reads a bf16 input as its bits (torch: a cast and four passes)
        if use_gate_in_kernel:
            g = _gate_decay(g, lower_bound, A_log, dt_bias)
        qe, ke, ve, decay, be = preprocess(
            q, k, v, g, beta, dtype=torch.float32, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, lower_bound=None, A_log=None, dt_bias=None,
        )
        if not use_gate_in_kernel:  # g is the log-decay
            decay = torch.exp(decay)
        rows = B * T
        flat = [x.reshape(rows, *x.shape[2:]).contiguous() for x in (qe, ke, ve, decay, be)]
        o = torch.empty(B, T, HV, V)
        kda_rows(*flat, scale, use_qk_l2norm_in_kernel, *sequence_rows(T, B, cu_seqlens), slots, pool,
                 o.view(rows, HV, V))
    return o


def _gate_decay(f: torch.Tensor, lower_bound: float | None, A_log: torch.Tensor | None,
                dt_bias: torch.Tensor | None) -> torch.Tensor:
    """exp(kda_gate(f)) as one compiled pass: f [..., HV, K] (fp32, bf16 read as its bits, else cast) ->
    fp32 of f's shape."""
    HV, K = f.shape[-2:]
    flat = f.reshape(-1, HV * K).contiguous()
    decay = torch.empty(flat.shape)
    bounded = lower_bound is not None
    from kernels.kda.recurrent_cpu_numba import gate_decay_rows

    f32, bits, from_bf16 = f32_or_bf16_bits(flat)
    bias = _f32(torch.zeros(HV * K) if dt_bias is None else dt_bias.reshape(-1))
    a_log = np.zeros(HV, np.float32) if bounded else _f32(A_log.reshape(-1))
    out = decay.numpy()
    bound = np.float32(lower_bound if bounded else 0.0)
    run_row_blocks(lambda lo, hi: gate_decay_rows(f32[lo:hi], bits[lo:hi], from_bf16, bias, bounded, bound, a_log, K,
                                                  out[lo:hi]),
                   len(flat), threads_for(flat.numel()))
    return decay.view(f.shape)


def conv_recurrent_kda_decode_cpu(
    qkv: torch.Tensor, conv_weight: Array, conv_pool: torch.Tensor, f: torch.Tensor, beta_logits: torch.Tensor,
    *, num_heads: int, scale: float, lower_bound: float | None, A_log: Array | None, dt_bias: Array,
    slots: torch.Tensor, pool: torch.Tensor,
) -> torch.Tensor:
    """A decode step of the KDA token mixer from its pre-conv channels, as two compiled loops: the depthwise
    causal conv + SiLU on each sequence's newest window (conv_pool [P, W-1, C] fp32, advanced in place),
    the gate in the kernel, sigmoid beta, the qk l2norm and the recurrence on pool [P, HV, K, V] fp32
    (in place; the C loop). qkv [n, C], f [n, HV, K] and beta_logits [n, HV] all fp32 or all bf16 (any strides
    but f's last, e.g. column slices of a projection: read where they lie), conv_weight [W, C], dt_bias [HV*K];
    `lower_bound` set: the bounded gate, else A_log [HV]. Returns o [n, HV, V] fp32. Pools may have any
    strides but conv_pool's channels contiguous (vLLM's CPU layout) and `pool` with `slots_contiguous`;
    nothing of this step is materialised in torch, where it costs ~100 small ops a layer. The parameters may be
    given as fp32 numpy arrays (a caller's cached copies)."""
    _check_pool("pool", pool)
    if conv_pool.dtype != torch.float32 or conv_pool.device.type != "cpu" or conv_pool.stride(-1) != 1:
        raise ValueError(f"conv_pool must be fp32 on the CPU with its channels contiguous, got {conv_pool.dtype} on "
                         f"{conv_pool.device} with strides {conv_pool.stride()}")
    n, HV, K = f.shape
    V = pool.shape[-1]
    # the recurrence's inputs live only between the two loops: numpy scratch in one block (q, k, decay, v, beta),
    # no tensors
    nhk, nhv = n * HV * K, n * HV * V
    scratch = np.empty(3 * nhk + nhv + n * HV, np.float32)
    q, k, decay = (scratch[i * nhk:(i + 1) * nhk].reshape(n, HV, K) for i in range(3))
    v, beta = scratch[3 * nhk:3 * nhk + nhv].reshape(n, HV, V), scratch[3 * nhk + nhv:].reshape(n, HV)
    bounded = lower_bound is not None
    a_log = np.zeros(HV, np.float32) if bounded else _f32(A_log)
    slots = slots.to("cpu", torch.int64).contiguous()
    from kernels.kda.recurrent_cpu_numba import conv_decode_inputs

    (qkv_f32, qkv_bits, from_bf16), (f_f32, f_bits, f_bf16), (b_f32, b_bits, b_bf16) = (
        f32_or_bf16_bits(x) for x in (qkv, f.reshape(n, HV * K), beta_logits))
    if not from_bf16 == f_bf16 == b_bf16:
        raise ValueError(f"qkv, f and beta_logits must share one dtype (fp32 or bf16), got {qkv.dtype}, {f.dtype} "
                         f"and {beta_logits.dtype}")
    P, W1, C = conv_pool.shape
    slot_stride, tap_stride = conv_pool.stride(0), conv_pool.stride(1)
    span = torch.as_strided(conv_pool.detach(), (max(P - 1, 0) * slot_stride + (W1 - 1) * tap_stride + C,), (1,))
    conv_decode_inputs(qkv_f32, qkv_bits, f_f32, f_bits, b_f32, b_bits, from_bf16, _f32(conv_weight), span.numpy(),
                       slot_stride, tap_stride, bounded, np.float32(lower_bound if bounded else 0.0), a_log,
                       _f32(dt_bias), num_heads, slots.numpy(), min(P, pool.shape[0]), q, k, v, decay, beta)
    o = torch.empty(n, HV, V)
    starts, ends = _decode_rows(n)
    q_at = scratch.ctypes.data  # float32: 4 bytes; q, k, decay, v, beta in that order
    inputs = (q_at, q_at + 4 * nhk, q_at + 12 * nhk, q_at + 8 * nhk, q_at + 12 * nhk + 4 * nhv)  # q, k, v, decay, beta
    _kda_rows_unchecked(inputs, n, HV, K, V, scale, True, starts, ends, slots, pool, o)
    return o


@functools.lru_cache(maxsize=64)
def _decode_rows(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row bounds of n one-token sequences (0..n-1, 1..n; int64), kept: every decode step of a batch size uses them."""
    return torch.arange(n), torch.arange(1, n + 1)


def conv_silu_prefill_cpu(
    x: torch.Tensor, conv_weight: Array, conv_pool: torch.Tensor, query_start_loc: torch.Tensor,
    slots: torch.Tensor, has_initial_state: torch.Tensor | None, key_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The KDA short conv + SiLU of a prefill, as one compiled pass: x [T, C] the pre-conv q|k|v channels
    of back-to-back sequences (query_start_loc [n+1]; fp32 or bf16, any strides), conv_weight [W, C],
    conv_pool [P, W-1, C] fp32 (any strides) whose slot slots[r] holds the inputs before sequence r (used
    where has_initial_state, None: everywhere; zeros elsewhere) and receives its last W-1 inputs. Returns
    q, k [T, key_dim] and v [T, C - 2 key_dim], fp32 and contiguous, as the recurrence reads them."""
    if conv_pool.dtype != torch.float32 or conv_pool.device.type != "cpu":
        raise ValueError(f"conv_pool must be fp32 on the CPU, got {conv_pool.dtype} on {conv_pool.device}")
    T, C = x.shape
    bounds = query_start_loc.to(torch.int64)
    keep = (torch.ones(len(slots), dtype=torch.bool) if has_initial_state is None
            else has_initial_state.to(torch.bool).contiguous())
    q, k, v = torch.empty(T, key_dim), torch.empty(T, key_dim), torch.empty(T, C - 2 * key_dim)
    from kernels.kda.recurrent_cpu_numba import conv_pool_advance, conv_silu_rows

    # bf16 is read as its bits where it lies: casting a strided column slice first costs more than the pass
    x_args = f32_or_bf16_bits(x)
    seq = (bounds[:-1].contiguous().numpy(), bounds[1:].contiguous().numpy(),
           slots.to(torch.int64).contiguous().numpy(), keep.numpy())
    weight, pool, outs = _f32(conv_weight), conv_pool.detach().numpy(), (q.numpy(), k.numpy(), v.numpy())
    run_row_blocks(lambda lo, hi: conv_silu_rows(*x_args, weight, pool, *seq, lo, hi, *outs), T, threads_for(T * C))
    conv_pool_advance(*x_args, pool, *seq)  # after every block has read the histories
    return q, k, v


def gated_rms_norm_cpu(o: torch.Tensor, gate: torch.Tensor, weight: Array, eps: float) -> torch.Tensor:
    """`GatedRMSNorm` (model/layers/norm.py) over KDA's output heads as one compiled pass: o [T, HV, V] fp32,
    gate [T, HV*V] fp32 or bf16 (any strides; bf16 read as its bits), weight [V]. Returns [T, HV*V] in
    gate's dtype. torch's form makes ~8 passes over [T, HV, V], each slow in bf16 on a CPU."""
    T, HV, V = o.shape
    gate_f32, gate_bits, from_bf16 = f32_or_bf16_bits(gate)
    out, out_f32, out_bits = empty_f32_or_bf16(T, HV * V, from_bf16)
    from kernels.kda.recurrent_cpu_numba import gated_rms_norm_rows

    o_rows, w = _f32(o), _f32(weight)
    run_row_blocks(lambda lo, hi: gated_rms_norm_rows(o_rows[lo:hi], gate_f32[lo:hi], gate_bits[lo:hi], from_bf16, w,
                                                      np.float32(eps), out_f32[lo:hi], out_bits[lo:hi], from_bf16),
                   T, threads_for(T * HV * V))
    return out


def _f32(x: Array) -> np.ndarray:
    """A contiguous fp32 numpy array of x (x itself when it is one)."""
    if isinstance(x, np.ndarray):
        return x
    if x.dtype == torch.float32 and not x.requires_grad and x.is_contiguous():
        return x.numpy()  # (a third of the cost of the general form, which a decode step runs ~100 times)
    return x.detach().to(torch.float32).contiguous().numpy()


def _check_pool(name: str, pool: torch.Tensor) -> None:
    if pool.dtype != torch.float32 or pool.device.type != "cpu" or not slots_contiguous(pool):
        raise ValueError(f"{name} must be fp32 on the CPU with each slot contiguous, got {pool.dtype} on "
                         f"{pool.device} with strides {pool.stride()}")
