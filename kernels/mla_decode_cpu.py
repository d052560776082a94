"""MLA decode over a latent cache on CPU (C: `mla_decode_cpu.c`, built by `kernels.native`): each sequence's
one query per head, in the absorbed form, attends over the sequence's cached latents c_t where they lie in vLLM's CPU cache pages.

    out_h = sum_t softmax_t(scale * q'_h . c_t) c_t        q' [H, r] per sequence, c_t [r]

vLLM's CPU attention kernel reads such a cache as one shared key/value head of width r, so it reads each
latent twice, as a key and as a value. Here each latent is read once per step and converted to fp32 in tiles
of `TILE` tokens; 8 heads lie on a vector's lanes, so a token's 8 scores are one vector (no horizontal sums) and
the online softmax's running max and sum are vectors too. The cache pages hold keys then values, and keys and
values are the same latents: the values are read, row by row, or in the AMX kernel's packing (16-column strips
of interleaved row pairs) for bf16 caches on AMX CPUs. Measured against vLLM's kernel at 8 x 16K latents: 2x
faster on an AVX2 CPU, 1.6x on an AVX-512 one (its vec kernel), 1.5x slower than its AMX kernel
(`model.vllm_plugin.layers.vllm_kernel_decodes_latents` picks; the git history of benchmarks/NOTES.md). Sequences run in blocks
on torch's intra-op threads (`kernels.cpu_threads`), with the same result on any number.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels.cpu_threads import run_row_blocks, threads_for
from kernels.native import load as load_native
from kernels.native import read_source


@functools.cache
def _latent_decode_c(r: int) -> ctypes._CFuncPtr:
    fn = load_native(f"mla_latent_decode_r{r}", f"#define R {r}\n" + read_source(__file__, "mla_decode_cpu.c")).latent_decode
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
    fn.argtypes = [ptr, ptr, i32, i32, i64, i64, i64, i64, ptr, i64, ptr, f32, ptr, i64, i64]
    fn.restype = None
    return fn


def latent_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, packed: bool,
                            threads: int | None = None) -> torch.Tensor:
    """Decode attention over cached latents: q [n, H, r] (absorbed queries, one token per sequence),
    kv_cache [pages, 1, block, 2r] as vLLM's CPU backend holds a one-head cache of width r (bf16 or fp32;
    per page `block` key rows, then `block` value rows; pages at any stride), block_table [n, >= pages per
    sequence] page ids, seq_lens [n] (each sequence's cached tokens, this step's included), `packed` for the
    AMX kernel's value layout (bf16 only). Returns [n, H, r] fp32."""
    n, H, r = q.shape
    pages, heads, block, width = kv_cache.shape
    if heads != 1 or width != 2 * r:
        raise ValueError(f"kv_cache must be [pages, 1, block, {2 * r}] for latents of width {r}, "
                         f"got {tuple(kv_cache.shape)}")
    if r % 16:
        raise ValueError(f"the latent width must be a multiple of 16, got {r}")
    # pages may lie apart (a hybrid cache pads them to its largest page size), each page's rows may not
    page_strides = kv_cache[:1].stride()[1:]
    if kv_cache.dtype not in (torch.bfloat16, torch.float32) or page_strides != (block * 2 * r, 2 * r, 1):
        raise ValueError(f"kv_cache must be a bf16 or fp32 tensor with contiguous pages, got {kv_cache.dtype} "
                         f"with strides {kv_cache.stride()}")
    if packed and (kv_cache.dtype != torch.bfloat16 or block % 2):
        raise ValueError("the packed (AMX) layout needs a bf16 cache with an even block size")
    if block_table.dim() != 2 or block_table.shape[0] < n or seq_lens.shape != (n,):
        raise ValueError(f"block_table [{n}, P] and seq_lens [{n}] expected, got {tuple(block_table.shape)} and "
                         f"{tuple(seq_lens.shape)}")
    lens = seq_lens.to(torch.int32).contiguous()
    table = block_table[:n].to(torch.int32).contiguous()
    lengths = lens.tolist()  # a decode step's few sequences: Python is cheaper than tensor reductions
    if any(not 0 <= length <= table.shape[1] * block for length in lengths):
        raise ValueError(f"seq_lens must lie in [0, {table.shape[1] * block}] for a block table of "
                         f"{table.shape[1]} pages")
    queries = q.detach().to(torch.float32).contiguous()
    out = torch.empty(n, H, r, dtype=torch.float32)
    fn = _latent_decode_c(r)
    bf16 = int(kv_cache.dtype == torch.bfloat16)

    def run(lo: int, hi: int) -> None:
        fn(queries.data_ptr(), kv_cache.data_ptr(), bf16, int(packed), kv_cache.stride(0), block * r, block, H,
           table.data_ptr(), table.shape[1], lens.data_ptr(), scale, out.data_ptr(), lo, hi)

    run_row_blocks(run, n, threads or threads_for(sum(lengths) * r))
    return out
