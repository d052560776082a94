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
