#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* R, the latent width, is set before this source (one build per width: the loops over it unroll) */
#define TILE 32   /* tokens per tile, a multiple of ROWS */
#define ROWS 8    /* tokens per score block */
/* Without AVX GCC notes that 32-byte vectors are passed differently from how an AVX build passes them; here
   they pass only between static functions of this file, built together, so the note cannot matter. */
#pragma GCC diagnostic ignored "-Wpsabi"
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
