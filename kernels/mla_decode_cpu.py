"""MLA decode over a latent cache on CPU (C, built by `kernels.native`): each sequence's one query per head, in
the absorbed form, attends over the sequence's cached latents c_t where they lie in vLLM's CPU cache pages.

    out_h = sum_t softmax_t(scale * q'_h . c_t) c_t        q' [H, r] per sequence, c_t [r]

vLLM's CPU attention kernel reads such a cache as one shared key/value head of width r, so it reads each
latent twice, as a key and as a value. Here each latent is read once per step and converted to fp32 in tiles
of `TILE` tokens; 8 heads lie on a vector's lanes, so a token's 8 scores are one vector (no horizontal sums) and
the online softmax's running max and sum are vectors too. The cache pages hold keys then values, and keys and
values are the same latents: the values are read, row by row, or in the AMX kernel's packing (16-column strips
of interleaved row pairs) for bf16 caches on AMX CPUs. Measured against vLLM's kernel at 8 x 16K latents: 2x
faster on an AVX2 CPU, 1.6x on an AVX-512 one (its vec kernel), 1.5x slower than its AMX kernel
(`model.vllm_plugin.layers.vllm_kernel_decodes_latents` picks; the history of benchmarks/NOTES.md). Sequences run in blocks
on torch's intra-op threads (`kernels.cpu_threads`), with the same result on any number.
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

/* R, the latent width, is set before this source (one build per width: the loops over it unroll) */
#define TILE 32   /* tokens per tile, a multiple of ROWS */
#define ROWS 8    /* tokens per score block */
typedef float v8 __attribute__((vector_size(32)));      /* one lane per head, 8 heads per block */
typedef int32_t i8 __attribute__((vector_size(32)));
typedef uint16_t h8 __attribute__((vector_size(16)));
typedef uint32_t u8 __attribute__((vector_size(32)));
typedef uint16_t h32 __attribute__((vector_size(64)));
typedef uint16_t h16 __attribute__((vector_size(32)));
typedef uint32_t u16 __attribute__((vector_size(64)));

static inline v8 vmax(v8 a, v8 b) { i8 m = a < b; return (v8)(((i8)a & ~m) | ((i8)b & m)); }

/* exp(x) for x <= 0 (softmax terms): 2^k e^f, k the integer nearest x / ln 2, e^f by its Taylor polynomial to
   degree 7, ln 2 split in two (Cody-Waite); x clamped at -87, where exp is ~1e-38 */
static inline v8 vexp(v8 x) {
    x = vmax(x, (v8){0} - 87.0f);
    const v8 kf = x * 1.4426950408889634f + 0.5f;
    i8 k = __builtin_convertvector(kf, i8);            /* truncates toward zero: floor for kf >= 0 */
    k -= (i8)(__builtin_convertvector(k, v8) > kf) & 1;  /* floor for kf < 0 */
    const v8 kv = __builtin_convertvector(k, v8);
    const v8 f = (x - kv * 0.693359375f) - kv * -2.12194440e-4f;
    const v8 p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (
        1.0f / 720 + f * (1.0f / 5040)))))));
    return p * (v8)((k + 127) << 23);
}

/* latent row j of a page (its values region `vals`) into dst [R] fp32 */
static inline void load_row(const void *vals, int bf16, int packed, int64_t block, int64_t j, float *restrict dst)
{
    if (packed) {  /* element (j, d) at ((d / 16) * (block / 2) + j / 2) * 32 + (d % 16) * 2 + j % 2 */
        const uint16_t *p = (const uint16_t *)vals + (j / 2) * 32;
        for (int s = 0; s < R / 16; s++, p += block * 16) {
            h32 x; memcpy(&x, p, sizeof x);
            h16 y = (j & 1) ? __builtin_shufflevector(x, x, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31)
                            : __builtin_shufflevector(x, x, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            u16 w = __builtin_convertvector(y, u16) << 16;
            memcpy(dst + s * 16, &w, sizeof w);
        }
    } else if (bf16) {
        const uint16_t *p = (const uint16_t *)vals + j * R;
        for (int d = 0; d < R; d += 8) {
            h8 h; memcpy(&h, p + d, sizeof h);
            u8 b = __builtin_convertvector(h, u8) << 16;
            memcpy(dst + d, &b, sizeof b);
        }
    } else {
        memcpy(dst, (const float *)vals + j * R, R * sizeof(float));
    }
}

/* ask for latent row j of a page ahead of its use (the rows are read once, from memory) */
static inline void prefetch_row(const void *vals, int bf16, int packed, int64_t block, int64_t j)
{
    if (packed) {
        if (j & 1) return;  /* a row pair shares its cache lines */
        const char *p = (const char *)vals + (j / 2) * 64;
        for (int s = 0; s < R / 16; s++) __builtin_prefetch(p + s * block * 32);
    } else {
        const int64_t bytes = R * (bf16 ? 2 : 4);
        const char *p = (const char *)vals + j * bytes;
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
    }
}

/* sequences lo .. hi-1. q [n, H, R] fp32; cache: pages page_elems elements apart, the values at value_off;
   pages [n, page_stride] int32, lens [n] int32; out [n, H, R] fp32. Heads in blocks of 8 on a vector's
   lanes: the scores of a token for 8 heads are one vector (no horizontal sums), and so are the running max
   and sum of the online softmax. */
void latent_decode(const float *restrict q, const void *cache, int bf16, int packed, int64_t page_elems,
                   int64_t value_off, int64_t block, int64_t H, const int32_t *restrict pages,
                   int64_t page_stride, const int32_t *restrict lens, float scale, float *restrict out,
                   int64_t lo, int64_t hi)
{
    float *buf = aligned_alloc(64, TILE * R * sizeof(float));
    v8 *qt = aligned_alloc(64, R * sizeof(v8)), *acc = aligned_alloc(64, R * sizeof(v8));
    v8 P[TILE];
    memset(buf, 0, TILE * R * sizeof(float));
    const int64_t esize = bf16 ? 2 : 4;
    for (int64_t seq = lo; seq < hi; seq++) {
        const int32_t *pg = pages + seq * page_stride;
        const int64_t len = lens[seq];
        for (int64_t h0 = 0; h0 < H; h0 += 8) {
            const int64_t nh = H - h0 < 8 ? H - h0 : 8;
            for (int d = 0; d < R; d++) {
                v8 col = {0};
                for (int64_t h = 0; h < nh; h++) col[h] = scale * q[(seq * H + h0 + h) * R + d];
                qt[d] = col;
                acc[d] = (v8){0};
            }
            v8 m = (v8){0} - INFINITY, l = {0};
            for (int64_t t0 = 0; t0 < len; t0 += TILE) {
                const int64_t n = len - t0 < TILE ? len - t0 : TILE;
                int64_t page = t0 / block, j = t0 % block;  /* one division per tile, not per row */
                const char *vals = (const char *)cache + (pg[page] * page_elems + value_off) * esize;
                for (int64_t i = 0; i < n; i++, j++) {
                    if (j == block) {
                        j = 0;
                        vals = (const char *)cache + (pg[++page] * page_elems + value_off) * esize;
                    }
                    if (j + TILE < block) prefetch_row(vals, bf16, packed, block, j + TILE);  /* the next tile's row */
                    load_row(vals, bf16, packed, block, j, buf + i * R);
                }
                /* scores, ROWS tokens at a time (rows past n hold earlier latents: their scores are unused) */
                for (int64_t i = 0; i < n; i += ROWS) {
                    v8 s[ROWS] = {{0}};
                    const float *b = buf + i * R;
                    for (int d = 0; d < R; d++) {
                        const v8 qd = qt[d];
                        for (int k = 0; k < ROWS; k++) s[k] += b[k * R + d] * qd;
                    }
                    for (int k = 0; k < ROWS; k++) P[i + k] = s[k];
                }
                v8 top = P[0];
                for (int64_t i = 1; i < n; i++) top = vmax(top, P[i]);
                const v8 mx = vmax(m, top), corr = vexp(m - mx);
                v8 sum = {0};
                for (int64_t i = 0; i < n; i++) { P[i] = vexp(P[i] - mx); sum += P[i]; }
                l = l * corr + sum;
                m = mx;
                for (int d0 = 0; d0 < R; d0 += 8) {
                    v8 a[8];
                    for (int k = 0; k < 8; k++) a[k] = acc[d0 + k] * corr;
                    for (int64_t i = 0; i < n; i++) {
                        const v8 p = P[i];
                        const float *b = buf + i * R + d0;
                        for (int k = 0; k < 8; k++) a[k] += b[k] * p;
                    }
                    for (int k = 0; k < 8; k++) acc[d0 + k] = a[k];
                }
            }
            const v8 inv = len > 0 ? 1.0f / l : (v8){0};
            for (int64_t h = 0; h < nh; h++)
                for (int d = 0; d < R; d++) out[(seq * H + h0 + h) * R + d] = acc[d][h] * inv[h];
        }
    }
    free(acc); free(qt); free(buf);
}
"""


@functools.cache
def _latent_decode_c(r: int) -> ctypes._CFuncPtr:
    fn = load_native(f"mla_latent_decode_r{r}", f"#define R {r}\n" + SOURCE).latent_decode
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
