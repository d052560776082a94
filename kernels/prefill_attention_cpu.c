#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KEYS 32          /* keys per step: the depth of one P.V tile product */
#define BLOCKS 64        /* query blocks of 16 per work item */
#define SUPER 2048       /* keys per pass over a work item's query blocks (their tiles stay in L2) */
#define LAZY 8.0f        /* a lane's max is raised only when it grows by more than this (log2 units) */

/* Without AVX-512 GCC notes that 64-byte vectors are passed differently from how an AVX-512 build passes them;
   here they pass only between static functions of this file, built together, so the note cannot matter. */
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float v16 __attribute__((vector_size(64)));     /* one lane per query of a block */
typedef int32_t i16 __attribute__((vector_size(64)));
typedef uint32_t u16 __attribute__((vector_size(64)));

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX 1
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define TILE_STORE(t, p, stride) _tile_stored(t, p, stride)
#define TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg;
#else
/* the same tile products in C: 8 tiles of 16 rows x 64 bytes per thread */
#define AMX 0
static __thread uint8_t tiles[8][1024] __attribute__((aligned(64)));
static inline float bf(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static void tile_load(int t, const void *p, int64_t stride)
{ for (int r = 0; r < 16; r++) memcpy(tiles[t] + 64 * r, (const char *)p + r * stride, 64); }
static void tile_store(int t, void *p, int64_t stride)
{ for (int r = 0; r < 16; r++) memcpy((char *)p + r * stride, tiles[t] + 64 * r, 64); }
/* C[m][n] += sum_k A[m][2k] B[k][2n] + A[m][2k+1] B[k][2n+1]: A rows of 32 bf16, B rows of 16 bf16 pairs */
static void tile_dp(int c, int a, int b)
{
    float *C = (float *)tiles[c];
    const uint16_t *A = (const uint16_t *)tiles[a], *B = (const uint16_t *)tiles[b];
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {
            float acc = C[m * 16 + n];
            for (int k = 0; k < 16; k++)
                acc += bf(A[m * 32 + 2 * k]) * bf(B[k * 32 + 2 * n]) + bf(A[m * 32 + 2 * k + 1]) * bf(B[k * 32 + 2 * n + 1]);
            C[m * 16 + n] = acc;
        }
}
#define TILE_ZERO(t) memset(tiles[t], 0, 1024)
#define TILE_LOAD(t, p, stride) tile_load(t, p, stride)
#define TILE_STORE(t, p, stride) tile_store(t, p, stride)
#define TILE_DP(c, a, b) tile_dp(c, a, b)
#endif

/* tiles (literal numbers: the AMX intrinsics paste them into register names): queries (B), keys and values
   (A), scores S^T (C), probabilities P^T (B), the first 32 output channels O^T (C) */
#define TQ 0
#define TK 1
#define TV 2
#define TS0 3
#define TS1 4
#define TP 5
#define TO0 6
#define TO1 7

int amx_built(void) { return AMX; }

/* whether this process may use the tiles (Linux has a process request the tile state before its first use) */
int amx_ready(void)
{
#if AMX
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
    return 0;
#endif
}

/* vmaxps where AVX-512 is built (AMX CPUs have it): GCC's compare-and-blend takes twice its latency */
static inline v16 vmax(v16 a, v16 b)
{
#if AMX
    return (v16)_mm512_max_ps((__m512)a, (__m512)b);
#else
    i16 m = a < b; return (v16)(((i16)a & ~m) | ((i16)b & m));
#endif
}

/* 2^f for f in [-0.5, 0.5]: Cephes' exp2f polynomial (relative error ~2e-7) */
static inline v16 exp2_reduced(v16 f)
{
    return 1.0f + f * (6.931472028550421e-1f + f * (2.402264791363012e-1f + f * (5.550332471162809e-2f + f * (
        9.618437357674640e-3f + f * (1.339887440266574e-3f + f * 1.535336188319500e-4f)))));
}

#if AMX
/* 2^x for x <= LAZY, 0 at and below -126: 2^k 2^f, k the integer nearest x */
static inline v16 vexp2(v16 x)
{
    const __mmask16 live = _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(-126.0f), _CMP_GT_OQ);
    const __m512 k = _mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return (v16)_mm512_maskz_scalef_ps(live, (__m512)exp2_reduced((v16)_mm512_sub_ps((__m512)x, k)), k);
}

/* bf16 of a and b (round to nearest even), interleaved: lane i holds a_i in its low half, b_i in its high */
static inline u16 bf16_pairs(v16 a, v16 b)
{
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                           22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return (u16)_mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh((__m512)b, (__m512)a));
}

static inline int any_greater(v16 a, v16 b) { return _mm512_cmp_ps_mask((__m512)a, (__m512)b, _CMP_GT_OQ) != 0; }
#else
static inline v16 vexp2(v16 x)
{
    const i16 live = x > -126.0f;
    x = vmax(x, (v16){0} - 126.0f);
    const v16 kf = x + 0.5f;
    i16 k = __builtin_convertvector(kf, i16);            /* truncates toward zero: floor for kf >= 0 */
    k -= (i16)(__builtin_convertvector(k, v16) > kf) & 1;  /* floor for kf < 0 */
    const v16 p = exp2_reduced(x - __builtin_convertvector(k, v16));
    return (v16)((i16)(p * (v16)((k + 127) << 23)) & live);
}

static inline u16 bf16_pairs(v16 a, v16 b)
{
    const u16 ua = (u16)a, ub = (u16)b;
    const u16 ra = ua + 0x7FFF + ((ua >> 16) & 1), rb = ub + 0x7FFF + ((ub >> 16) & 1);
    return (ra >> 16) | (rb & 0xFFFF0000u);
}

static inline int any_greater(v16 a, v16 b)
{
    const i16 g = a > b;
    int any = 0;
    for (int i = 0; i < 16; i++) any |= g[i];
    return any;
}
#endif

/* the output tiles held in registers, loaded from or stored to a block's O^T */
#define HOLD_OUTPUT(op, O, nvb) do { op(TO0, (O), 64); if ((nvb) > 1) op(TO1, (O) + 256, 64); } while (0)

/* S^T [KEYS keys][16 queries] of one query block (its B tiles at q, one per 32 channels, the first already in
   TQ when there is only one) against KEYS key rows at k (nds * 32 channels each), into dst */
static inline void scores(const uint16_t *q, const uint16_t *k, int64_t nds, float *dst)
{
    TILE_ZERO(TS0);
    TILE_ZERO(TS1);
    for (int64_t d = 0; d < nds; d++) {
        if (nds > 1) TILE_LOAD(TQ, q + d * 512, 64);
        TILE_LOAD(TK, k + d * 32, nds * 64);
        TILE_LOAD(TV, k + 16 * nds * 32 + d * 32, nds * 64);
        TILE_DP(TS0, TK, TQ);
        TILE_DP(TS1, TV, TQ);
    }
    TILE_STORE(TS0, dst, 64);
    TILE_STORE(TS1, dst + 256, 64);
}

/* Work items lo .. hi-1, item = head * items_per_head + a range of BLOCKS query blocks.
   qp [H, nqb, nds, 16 (d pairs), 16 (queries), 2] bf16: each block's queries as B tiles per 32 channels;
   kp [H, nk, nds * 32] bf16: keys in rows (A tiles of 16 keys), nk = tk rounded up to KEYS, zero padded;
   vp [H, nk / KEYS, nvb, 16 (channels), KEYS] bf16: values transposed, A tiles of 16 channels x KEYS keys;
   out [tq, H, dv] bf16. */
void prefill_attention(const uint16_t *qp, const uint16_t *kp, const uint16_t *vp, int64_t H, int64_t tq,
                       int64_t tk, int64_t nds, int64_t nvb, int64_t dv, float scale, uint16_t *out,
                       int64_t lo, int64_t hi)
{
    const int64_t nqb = (tq + 15) / 16, nk = (tk + KEYS - 1) / KEYS * KEYS, past = tk - tq;
    const int64_t per_head = (nqb + BLOCKS - 1) / BLOCKS, dp = nds * 32;
    float *state = aligned_alloc(64, BLOCKS * nvb * 1024);      /* O^T per block: nvb tiles [16 channels][16 queries] */
    v16 *ms = aligned_alloc(64, 2 * BLOCKS * sizeof(v16)), *ls = ms + BLOCKS;
    float sbuf[2][KEYS * 16] __attribute__((aligned(64)));
    u16 pbuf[KEYS / 2] __attribute__((aligned(64)));
    const float c = scale * 1.4426950408889634f;               /* scores in log2 units */
    const i16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16 neg_inf = (v16){0} - INFINITY;
#if AMX
    tilecfg saved, cfg = {.palette = 1};
    _tile_storeconfig(&saved);   /* restored at the end: other AMX code may cache its own configuration */
    for (int t = 0; t < 8; t++) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
    _tile_loadconfig(&cfg);
#endif
    for (int64_t item = lo; item < hi; item++) {
        const int64_t h = item / per_head, b0 = item % per_head * BLOCKS, b1 = b0 + BLOCKS < nqb ? b0 + BLOCKS : nqb;
        const uint16_t *qh = qp + h * nqb * nds * 512, *kh = kp + h * nk * dp, *vh = vp + h * nk * nvb * 16;
        memset(state, 0, (b1 - b0) * nvb * 1024);
        for (int64_t b = 0; b < b1 - b0; b++) { ms[b] = neg_inf; ls[b] = (v16){0}; }
        const int64_t last = past + b1 * 16;   /* past the item's last query position */
        for (int64_t s0 = 0; s0 < last && s0 < nk; s0 += SUPER) {
            for (int64_t b = b0; b < b1; b++) {
                const int64_t p0 = past + b * 16;                 /* the block's first query position */
                int64_t end = s0 + SUPER < nk ? s0 + SUPER : nk;  /* keys before end, visible to some lane */
                if (end > p0 + 16) end = p0 + 16;
                if (s0 >= end) continue;
                float *O = state + (b - b0) * nvb * 256;
                v16 m = ms[b - b0], l = ls[b - b0];
                const i16 pos = (int32_t)p0 + lane;  /* positions < 2^31 */
                if (nds == 1) TILE_LOAD(TQ, qh + b * 512, 64);
                /* output channels 0-31 stay in tiles for the pass (the rest, if any, are read and written per step) */
                HOLD_OUTPUT(TILE_LOAD, O, nvb);
                /* the scores of the next step are computed (tiles) while this step's softmax runs (vectors) */
                scores(qh + b * nds * 512, kh + s0 * dp, nds, sbuf[0]);
                for (int64_t j0 = s0, cur = 0; j0 < end; j0 += KEYS, cur ^= 1) {
                    if (j0 + KEYS < end) scores(qh + b * nds * 512, kh + (j0 + KEYS) * dp, nds, sbuf[cur ^ 1]);
                    v16 *s = (v16 *)sbuf[cur];
                    if (j0 + KEYS - 1 > p0) {  /* some key lies after some query: those scores -> -inf */
                        for (int r = 0; r < KEYS; r++) {
                            const i16 seen = (int32_t)(j0 + r) <= pos;
                            s[r] = (v16)(((i16)s[r] & seen) | ((i16)neg_inf & ~seen));
                        }
                    }
                    v16 t[4] = {s[0], s[1], s[2], s[3]};  /* four running maxima, not a chain of KEYS */
                    for (int r = 4; r < KEYS; r += 4)
                        for (int u = 0; u < 4; u++) t[u] = vmax(t[u], s[r + u]);
                    const v16 top = vmax(vmax(t[0], t[1]), vmax(t[2], t[3])) * c;
                    if (any_greater(top, m + LAZY)) {
                        const v16 raised = vmax(m, top), alpha = vexp2(m - raised);
                        HOLD_OUTPUT(TILE_STORE, O, nvb);
                        for (int64_t r = 0; r < nvb * 16; r++) ((v16 *)O)[r] *= alpha;
                        HOLD_OUTPUT(TILE_LOAD, O, nvb);
                        l *= alpha;
                        m = raised;
                    }
                    const v16 shift = -m;
                    for (int r = 0; r < KEYS; r += 2) {
                        const v16 pa = vexp2(s[r] * c + shift), pb = vexp2(s[r + 1] * c + shift);
                        l += pa + pb;
                        pbuf[r / 2] = bf16_pairs(pa, pb);  /* keys r, r+1 interleaved */
                    }
                    const uint16_t *v = vh + (j0 / KEYS) * nvb * 16 * KEYS;
                    TILE_LOAD(TP, pbuf, 64);
                    TILE_LOAD(TV, v, KEYS * 2);
                    TILE_DP(TO0, TV, TP);
                    if (nvb > 1) {
                        TILE_LOAD(TK, v + 16 * KEYS, KEYS * 2);
                        TILE_DP(TO1, TK, TP);
                    }
                    for (int64_t n = 2; n < nvb; n++) {  /* channels past 32 through memory, TS0 as their C tile */
                        TILE_LOAD(TS0, O + n * 256, 64);
                        TILE_LOAD(TV, v + n * 16 * KEYS, KEYS * 2);
                        TILE_DP(TS0, TV, TP);
                        TILE_STORE(TS0, O + n * 256, 64);
                    }
                }
                HOLD_OUTPUT(TILE_STORE, O, nvb);
                ms[b - b0] = m;
                ls[b - b0] = l;
            }
        }
        for (int64_t b = b0; b < b1; b++) {
            const float *O = state + (b - b0) * nvb * 256;
            const v16 inv = 1.0f / ls[b - b0];
            for (int i = 0; i < 16 && b * 16 + i < tq; i++) {
                const int64_t row = ((b * 16 + i) * H + h) * dv;
                for (int64_t d = 0; d < dv; d++) {
                    const float y = O[(d / 16) * 256 + (d % 16) * 16 + i] * inv[i];
                    uint32_t u;
                    memcpy(&u, &y, 4);
                    out[row + d] = (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
                }
            }
        }
    }
#if AMX
    if (saved.palette) _tile_loadconfig(&saved); else _tile_release();
#endif
    free(ms);
    free(state);
}
