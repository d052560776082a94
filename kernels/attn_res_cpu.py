"""Block-AttnRes mix followed by the sub-layer's RMSNorm as one CPU pass (C, built by `kernels.native`), for
serving steps of any size: the candidates are read where they lie, in bf16 or fp32, and each token's output is
written once, in their dtype. The torch form makes ~25 ops of a decode step's few tokens, and at a prefill's
thousands it passes over fp32 copies of every candidate several times. The math is
`model.layers.attn_res.BlockAttnRes` then `RMSNorm` (the reference the tests compare against), in fp32:

    s_i = <V_i, key> / sqrt(mean(V_i^2) + eps),  w = softmax(s),  m = sum_i w_i V_i,
    out = m / sqrt(mean(m^2) + norm_eps) * norm_weight,           with key = gamma * w_query.

(The torch form rounds m to the candidates' dtype before the norm; this pass keeps it in fp32.) Rows run in
blocks on torch's intra-op threads (`kernels.cpu_threads`), with the same result on any number."""

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
typedef float vf __attribute__((vector_size(VW * sizeof(float))));
typedef uint32_t vu __attribute__((vector_size(VW * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(VW * sizeof(uint16_t))));

/* bf16 is the top half of an fp32; the way back rounds to nearest even */
static inline float from_bf16(uint16_t h) { uint32_t b = (uint32_t)h << 16; float x; memcpy(&x, &b, 4); return x; }
static inline uint16_t to_bf16(float x) {
    uint32_t b; memcpy(&b, &x, 4); return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}
static inline vf load_vec(const void *p, int64_t j, int bf16) {
    vf x;
    if (bf16) {
        vh h; memcpy(&h, (const uint16_t *)p + j, sizeof h);
        vu b = __builtin_convertvector(h, vu) << 16;
        memcpy(&x, &b, sizeof x);
    } else {
        memcpy(&x, (const float *)p + j, sizeof x);
    }
    return x;
}
static inline float load_one(const void *p, int64_t j, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)p)[j]) : ((const float *)p)[j];
}
static inline float hsum(vf x) { float s = 0; for (int l = 0; l < VW; l++) s += x[l]; return s; }

/* rows lo .. hi-1: cand[i] [T, d] and out [T, d], all bf16 (bf16 set) or all fp32, rows contiguous */
void attn_res_rmsnorm(const void *const *cand, int64_t n, int64_t d, int bf16, const float *restrict key,
                      float eps, const float *restrict norm_w, float norm_eps, void *out, int64_t lo, int64_t hi)
{
    float *mixed = malloc(d * sizeof(float));
    float *w = malloc(n * sizeof(float));
    const int64_t dv = d - d % VW;
    for (int64_t t = lo; t < hi; t++) {
        float top = -INFINITY;
        for (int64_t i = 0; i < n; i++) {
            const int64_t base = t * d;
            vf sq = {0}, dot = {0};
            for (int64_t j = 0; j < dv; j += VW) {
                const vf x = load_vec(cand[i], base + j, bf16);
                vf k; memcpy(&k, key + j, sizeof k);
                sq += x * x;
                dot += x * k;
            }
            float s2 = hsum(sq), dt = hsum(dot);
            for (int64_t j = dv; j < d; j++) {
                const float x = load_one(cand[i], base + j, bf16);
                s2 += x * x;
                dt += x * key[j];
            }
            w[i] = dt / sqrtf(s2 / d + eps);
            if (w[i] > top) top = w[i];
        }
        float total = 0;
        for (int64_t i = 0; i < n; i++) { w[i] = expf(w[i] - top); total += w[i]; }
        for (int64_t i = 0; i < n; i++) w[i] /= total;
        /* the mix, candidate by candidate into the fp32 row (L1-resident), then the norm */
        for (int64_t i = 0; i < n; i++) {
            const int64_t base = t * d;
            const float wi = w[i];
            for (int64_t j = 0; j < dv; j += VW) {
                vf m;
                if (i == 0) m = (vf){0}; else memcpy(&m, mixed + j, sizeof m);
                m += wi * load_vec(cand[i], base + j, bf16);
                memcpy(mixed + j, &m, sizeof m);
            }
            for (int64_t j = dv; j < d; j++)
                mixed[j] = (i == 0 ? 0.0f : mixed[j]) + wi * load_one(cand[i], base + j, bf16);
        }
        vf sq = {0};
        for (int64_t j = 0; j < dv; j += VW) { vf m; memcpy(&m, mixed + j, sizeof m); sq += m * m; }
        float s2 = hsum(sq);
        for (int64_t j = dv; j < d; j++) s2 += mixed[j] * mixed[j];
        const float r = 1.0f / sqrtf(s2 / d + norm_eps);
        if (bf16) {
            uint16_t *o = (uint16_t *)out + t * d;
            for (int64_t j = 0; j < d; j++) o[j] = to_bf16(mixed[j] * r * norm_w[j]);
        } else {
            float *o = (float *)out + t * d;
            for (int64_t j = 0; j < d; j++) o[j] = mixed[j] * r * norm_w[j];
        }
    }
    free(w);
    free(mixed);
}
"""


@functools.cache
def _attn_res_rmsnorm_c() -> ctypes._CFuncPtr:
    fn = load_native("attn_res_rmsnorm", SOURCE).attn_res_rmsnorm
    ptr, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32
    fn.argtypes = [ptr, i64, i64, i32, ptr, f32, ptr, f32, ptr, i64, i64]
    fn.restype = None
    return fn


def attn_res_rmsnorm(candidates: list[torch.Tensor], key: torch.Tensor, eps: float, norm_weight: torch.Tensor,
                     norm_eps: float, threads: int | None = None) -> torch.Tensor:
    """norm(mix(candidates)) of N CPU candidates [T, d] -> [T, d] in the first candidate's dtype (bf16 stays
    bf16, fp32 stays fp32, others compute and return in fp32). key = gamma * w_query and norm_weight: fp32 [d].
    On `threads` threads (default: torch's intra-op count, fewer for small work)."""
    if not candidates:
        raise ValueError("attn_res_rmsnorm needs at least one candidate")
    T, d = candidates[0].shape
    dtype = candidates[0].dtype if candidates[0].dtype in (torch.bfloat16, torch.float32) else torch.float32
    rows = []  # (a decode step calls this twice per layer: no needless tensor ops)
    for i, c in enumerate(candidates):
        if c.shape != (T, d) or not c.is_cpu:
            raise ValueError(f"candidate {i} must be a CPU tensor of shape {(T, d)}, got {c.device} {tuple(c.shape)}")
        rows.append(c if c.dtype == dtype and c.is_contiguous() else c.detach().to(dtype).contiguous())
    for name, x in (("key", key), ("norm_weight", norm_weight)):
        if x.shape != (d,) or x.dtype != torch.float32 or not x.is_cpu or not x.is_contiguous():
            raise ValueError(f"{name} must be a contiguous fp32 CPU tensor of shape {(d,)}, got {x.dtype} "
                             f"{tuple(x.shape)}")
    out = torch.empty(T, d, dtype=dtype)
    pointers = (ctypes.c_void_p * len(rows))(*[c.data_ptr() for c in rows])
    args = (pointers, len(rows), d, int(dtype == torch.bfloat16), key.data_ptr(), eps, norm_weight.data_ptr(),
            norm_eps, out.data_ptr())
    fn = _attn_res_rmsnorm_c()
    threads = threads or threads_for(T * d * len(rows))
    if threads == 1:  # a decode step's call: no blocks to hand out
        fn(*args, 0, T)
    else:
        run_row_blocks(lambda lo, hi: fn(*args, lo, hi), T, threads)
    return out
