"""Causal attention of a prompt chunk on CPU, the prefill half of MLA's attention (queries and keys/values
up-projected per head), in one of two kernels:

    out_i = sum_{j <= past + i} softmax_j(scale * q_i . k_j) v_j      q [H, Tq, D], k [H, Tk, D], v [H, Tk, Dv]

The query chunk is the last Tq of the Tk tokens (past = Tk - Tq).

- `chunk_attention`: torch's CPU flash-attention kernel, any CPU and dtype.
- `prefill_attention`: our own, for bf16 on CPUs with AMX (C: `prefill_attention_cpu.c`, built by
  `kernels.native`). Flash attention in one pass, transposed so that queries lie on a vector's lanes: each
  16-query block computes S^T = K Q^T and O^T = V^T P^T with bf16 tile products (fp32 sums), so the online
  softmax's running max and sum are per-lane vectors and need no horizontal reductions. The scores of the next
  32 keys are computed in tiles while the vectors run this step's softmax; the first 32 output channels stay
  in tiles; the max is raised lazily (a block rescales its output only when a lane's max grows by more than
  2^8); the keys are taken in L2-sized passes over 1,024 queries at a time. At head size 32 torch's kernel and
  vLLM's AMX kernel spend most of their time in the softmax between two library matmuls: a 4K chunk at 16K
  tokens, 8 heads, took 448-483 ms in torch's and 168-181 ms in ours on one Xeon core (the history of
  the git history of benchmarks/NOTES.md).

The tile products are AMX instructions where the compiler targets a CPU with AMX (`-march=native`), and a C
emulation of the same products elsewhere: the emulation is slow and serves only to test the kernel's blocking,
masking and softmax on any machine (`amx_available()` says which one was built). Work items (a head's 1,024
queries) run in blocks on torch's intra-op threads (`kernels.cpu_threads`), with the same result on any number.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from kernels.cpu_threads import run_row_blocks, threads_for
from kernels.native import load as load_native
from kernels.native import read_source

KEYS, QUERIES, BLOCKS_PER_ITEM = 32, 16, 64  # must match the C source



def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a prompt chunk over its sequence: q [H, Tq, D], k/v [H, Tk, D] with the chunk's
    own tokens last (Tk >= Tq). Returns [Tq, H, Dv].

    Two calls of torch's CPU flash-attention kernel merged by their log-sum-exps: the earlier tokens
    without a mask, the chunk's own tokens with the kernel's causal mask. One call with an explicit mask
    computes every block of the masked-out half too (1.8x the time for a 4K chunk at 16K in bf16)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    past = k.shape[1] - q.shape[1]
    dqk, dv = q.shape[-1], v.shape[-1]
    if dqk != dv:  # the kernel wants one head size: zero channels change neither scores nor outputs
        q, k = F.pad(q, (0, max(dv - dqk, 0))), F.pad(k, (0, max(dv - dqk, 0)))
        v = F.pad(v, (0, max(dqk - dv, 0)))
    new, lse_new = flash(q[None], k[None, :, past:], v[None, :, past:], 0.0, True, scale=scale)[:2]
    if past:
        old, lse_old = flash(q[None], k[None, :, :past], v[None, :, :past], 0.0, False, scale=scale)[:2]
        w_old = torch.sigmoid(lse_old - lse_new).unsqueeze(-1)  # e^lse_old / (e^lse_old + e^lse_new)
        new = torch.lerp(new.float(), old.float(), w_old).to(q.dtype)
    return new[0, ..., :dv].transpose(0, 1)


@functools.cache
def _library() -> tuple[ctypes.CDLL, bool]:
    lib = load_native("prefill_attention_cpu", read_source(__file__, "prefill_attention_cpu.c"))
    ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.prefill_attention.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, f32, ptr, i64, i64]
    lib.prefill_attention.restype = None
    lib.amx_built.restype = lib.amx_ready.restype = ctypes.c_int
    return lib, bool(lib.amx_built())


@functools.cache
def amx_available() -> bool:
    """Whether this CPU's build of the kernel runs its tile products on AMX (else in the slow C emulation) and
    the OS lets this process use the tiles (a sandbox may refuse the request)."""
    lib, built = _library()
    return built and bool(lib.amx_ready())


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      threads: int | None = None) -> torch.Tensor:
    """Causal attention of the last Tq of Tk tokens: q [H, Tq, D], k [H, Tk, D], v [H, Tk, Dv], bf16, any
    strides (Tk >= Tq). Scores and sums in fp32, probabilities rounded to bf16 for the value product, as in
    bf16 flash attention. Returns [Tq, H, Dv] bf16."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [H, T, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    H, tq, d = q.shape
    tk, dv = k.shape[1], v.shape[2]
    if k.shape != (H, tk, d) or v.shape[:2] != (H, tk) or tq > tk or tq == 0:
        raise ValueError(f"k [{H}, Tk, {d}] and v [{H}, Tk, Dv] with Tk >= Tq = {tq} > 0 expected, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if not q.dtype == k.dtype == v.dtype == torch.bfloat16:
        raise ValueError(f"q, k, v must be bf16, got {q.dtype}, {k.dtype}, {v.dtype}")
    nds, nvb = -(-d // 32), -(-dv // 16)
    nqb, nk = -(-tq // QUERIES), -(-tk // KEYS) * KEYS
    # the tile layouts, zero padded: padded channels add nothing, padded keys lie after every query
    qp = q.new_zeros(H, nqb * QUERIES, nds * 32)
    qp[:, :tq, :d] = q
    qp = qp.view(H, nqb, QUERIES, nds, 16, 2).permute(0, 1, 3, 4, 2, 5).contiguous()
    kp = k.new_zeros(H, nk, nds * 32)
    kp[:, :tk, :d] = k
    vp = v.new_zeros(H, nk, nvb * 16)
    vp[:, :tk, :dv] = v
    vp = vp.view(H, nk // KEYS, KEYS, nvb, 16).permute(0, 1, 3, 4, 2).contiguous()
    out = torch.empty(tq, H, dv, dtype=torch.bfloat16)
    items = H * -(-nqb // BLOCKS_PER_ITEM)
    lib, built = _library()
    if built and not amx_available():  # the tile instructions would fault
        raise RuntimeError("this CPU's build of the kernel uses AMX tiles, but the OS refused this process the "
                           "tile state: use chunk_attention")
    fn = lib.prefill_attention

    def run(lo: int, hi: int) -> None:
        fn(qp.data_ptr(), kp.data_ptr(), vp.data_ptr(), H, tq, tk, nds, nvb, dv, scale, out.data_ptr(), lo, hi)

    run_row_blocks(run, items, threads or threads_for(H * tq * tk // 2, 1 << 22))
    return out
