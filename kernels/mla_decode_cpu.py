"""MLA decode over a latent cache on CPU (C, built by `kernels.native`): each sequence's one query per head, in
the absorbed form, attends over the sequence's cached latents c_t where they lie in vLLM's CPU cache pages.

    out_h = sum_t softmax_t(scale * q'_h . c_t) c_t        q' [H, r] per sequence, c_t [r]

vLLM's CPU attention kernel reads such a cache as one shared key/value head of width r, so each latent is read
twice (its key copy and its value copy), and in 16-wide head-size blocks that suit a head dim of 32-64, not 8
query heads over one 128-wide latent. Here each latent is read once per step, converted to fp32 in tiles of
`TILE` tokens, and every head's scores and running output (online softmax, fp32) are taken from that tile.
The cache pages hold keys then values, and keys and values are the same latents: the values are read, row by
row, or in the AMX kernel's packing (16-column strips of interleaved row pairs) for bf16 caches on AMX CPUs.
Sequences run in blocks on torch's intra-op threads (`kernels.cpu_threads`), with the same result on any number.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels.cpu_threads import run_row_blocks, threads_for
from kernels.native import load as load_native

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
#define TILE 32
typedef float vf __attribute__((vector_size(VW * sizeof(float))));
typedef uint32_t vu __attribute__((vector_size(VW * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(VW * sizeof(uint16_t))));
typedef uint16_t h32 __attribute__((vector_size(64)));
typedef uint16_t h16 __attribute__((vector_size(32)));
typedef uint32_t u16x __attribute__((vector_size(64)));

static inline float hsum(vf x) { float s = 0; for (int l = 0; l < VW; l++) s += x[l]; return s; }

/* latent row j of a page (its values region `vals`) into dst [r] fp32 */
static inline void load_row(const void *vals, int bf16, int packed, int64_t block, int64_t r, int64_t j,
                            float *restrict dst)
{
    if (packed) {  /* element (j, d) at ((d / 16) * (block / 2) + j / 2) * 32 + (d % 16) * 2 + j % 2 */
        const uint16_t *p = (const uint16_t *)vals + (j / 2) * 32;
        for (int64_t s = 0; s < r / 16; s++, p += block * 16) {
            h32 x; memcpy(&x, p, sizeof x);
            h16 y = (j & 1) ? __builtin_shufflevector(x, x, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31)
                            : __builtin_shufflevector(x, x, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            u16x w = __builtin_convertvector(y, u16x) << 16;
            memcpy(dst + s * 16, &w, sizeof w);
        }
    } else if (bf16) {
        const uint16_t *p = (const uint16_t *)vals + j * r;
        for (int64_t d = 0; d < r; d += VW) {
            vh h; memcpy(&h, p + d, sizeof h);
            vu b = __builtin_convertvector(h, vu) << 16;
            memcpy(dst + d, &b, sizeof b);
        }
    } else {
        memcpy(dst, (const float *)vals + j * r, r * sizeof(float));
    }
}

/* sequences lo .. hi-1. q [n, H, r] fp32; cache: pages of page_elems elements, the values at value_off;
   pages [n, page_stride] int32, lens [n] int32; out [n, H, r] fp32. r % 16 == 0. */
void latent_decode(const float *restrict q, const void *cache, int bf16, int packed, int64_t page_elems,
                   int64_t value_off, int64_t block, int64_t r, int64_t H, const int32_t *restrict pages,
                   int64_t page_stride, const int32_t *restrict lens, float scale, float *restrict out,
                   int64_t lo, int64_t hi)
{
    float *buf = aligned_alloc(64, TILE * r * sizeof(float));
    float *acc = aligned_alloc(64, H * r * sizeof(float));
    float *m = malloc(H * sizeof(float)), *l = malloc(H * sizeof(float)), *s = malloc(H * TILE * sizeof(float));
    const int64_t esize = bf16 ? 2 : 4;
    for (int64_t seq = lo; seq < hi; seq++) {
        const float *qs = q + seq * H * r;
        const int32_t *pg = pages + seq * page_stride;
        const int64_t len = lens[seq];
        for (int64_t h = 0; h < H; h++) { m[h] = -INFINITY; l[h] = 0.0f; }
        memset(acc, 0, H * r * sizeof(float));
        for (int64_t t0 = 0; t0 < len; t0 += TILE) {
            const int64_t n = len - t0 < TILE ? len - t0 : TILE;
            for (int64_t i = 0; i < n; i++) {
                const int64_t t = t0 + i;
                const char *vals = (const char *)cache + (pg[t / block] * page_elems + value_off) * esize;
                load_row(vals, bf16, packed, block, r, t % block, buf + i * r);
            }
            for (int64_t h = 0; h < H; h++) {
                const float *qh = qs + h * r;
                float top = -INFINITY;
                for (int64_t i = 0; i < n; i++) {
                    vf dot = {0};
                    for (int64_t d = 0; d < r; d += VW) {
                        vf a, b; memcpy(&a, qh + d, sizeof a); memcpy(&b, buf + i * r + d, sizeof b);
                        dot += a * b;
                    }
                    const float v = scale * hsum(dot);
                    s[h * TILE + i] = v;
                    if (v > top) top = v;
                }
                const float mx = top > m[h] ? top : m[h];
                const float corr = expf(m[h] - mx);  /* 0 on the first tile (m = -inf) */
                float sum = 0.0f;
                for (int64_t i = 0; i < n; i++) { const float p = expf(s[h * TILE + i] - mx); s[h * TILE + i] = p; sum += p; }
                l[h] = l[h] * corr + sum;
                m[h] = mx;
                float *ah = acc + h * r;
                for (int64_t d = 0; d < r; d += VW) {
                    vf a; memcpy(&a, ah + d, sizeof a);
                    a *= corr;
                    for (int64_t i = 0; i < n; i++) { vf b; memcpy(&b, buf + i * r + d, sizeof b); a += s[h * TILE + i] * b; }
                    memcpy(ah + d, &a, sizeof a);
                }
            }
        }
        float *os = out + seq * H * r;
        for (int64_t h = 0; h < H; h++) {
            const float inv = len > 0 ? 1.0f / l[h] : 0.0f;
            for (int64_t d = 0; d < r; d++) os[h * r + d] = acc[h * r + d] * inv;
        }
    }
    free(s); free(l); free(m); free(acc); free(buf);
}
"""


@functools.cache
def _latent_decode_c() -> ctypes._CFuncPtr:
    fn = load_native("mla_latent_decode", SOURCE).latent_decode
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
    fn.argtypes = [ptr, ptr, i32, i32, i64, i64, i64, i64, i64, ptr, i64, ptr, f32, ptr, i64, i64]
    fn.restype = None
    return fn


def latent_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, packed: bool,
                            threads: int | None = None) -> torch.Tensor:
    """Decode attention over cached latents: q [n, H, r] (absorbed queries, one token per sequence),
    kv_cache [pages, 1, block, 2r] as vLLM's CPU backend holds a one-head cache of width r (bf16 or fp32;
    per page `block` key rows, then `block` value rows; pages at any stride), block_table [n, >= pages per sequence] page ids,
    seq_lens [n] (each sequence's cached tokens, this step's included), `packed` for the AMX kernel's value
    layout (bf16 only). Returns [n, H, r] fp32."""
    n, H, r = q.shape
    pages, heads, block, width = kv_cache.shape
    if heads != 1 or width != 2 * r:
        raise ValueError(f"kv_cache must be [pages, 1, block, {2 * r}] for latents of width {r}, got {tuple(kv_cache.shape)}")
    if r % 16:
        raise ValueError(f"the latent width must be a multiple of 16, got {r}")
    # pages may lie apart (a hybrid cache pads them to its largest page size), each page's rows may not
    if kv_cache.dtype not in (torch.bfloat16, torch.float32) or kv_cache[:1].stride()[1:] != (block * 2 * r, 2 * r, 1):
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
        raise ValueError(f"seq_lens must lie in [0, {table.shape[1] * block}] for a block table of {table.shape[1]} pages")
    queries = q.detach().to(torch.float32).contiguous()
    out = torch.empty(n, H, r, dtype=torch.float32)
    fn = _latent_decode_c()
    bf16 = int(kv_cache.dtype == torch.bfloat16)

    def run(lo: int, hi: int) -> None:
        fn(queries.data_ptr(), kv_cache.data_ptr(), bf16, int(packed), kv_cache.stride(0), block * r, block, r, H,
           table.data_ptr(), table.shape[1], lens.data_ptr(), scale, out.data_ptr(), lo, hi)

    run_row_blocks(run, n, threads or threads_for(sum(lengths) * r))
    return out
