/* KDA's per-token recurrence on the CPU (see recurrent_cpu.py for the algebra): kda_rows.
 *
 * Per token, with the decay d = exp(g), S' = Diag(d) S, e = v - S'^T k:
 *     S = S' + beta k e^T,    o = S^T (scale q) = S'^T (scale q) + (scale q . beta k) e.
 * Each token's rank-1 update is applied lazily, in the next token's one sweep over the state, which also forms
 * S'^T k and S'^T q from the same rows. The sweep runs over blocks of 2 vectors of columns with the four
 * running sums in registers, row by row: per state vector one load, one store and four multiply-adds. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
typedef float vf __attribute__((vector_size(VW * sizeof(float))));

static inline vf load(const float *p) { vf x; memcpy(&x, p, sizeof x); return x; }
static inline void store(float *p, vf x) { memcpy(p, &x, sizeof x); }

#define NB 2  /* vectors of columns per block (4 measured level, 1 slower) */
#define BW (NB * VW)  /* columns per block */

/* S <- Diag(a) S + bk err^T (if pending; else S stays, and is only read), then ks = S^T c and qs = S^T f, for
 * columns j0 .. j0 + BW. */
static inline void sweep_block(float *restrict S, int64_t K, int64_t V, int64_t j0, int pending,
                               const float *restrict a, const float *restrict bk, const float *restrict err,
                               const float *restrict c, const float *restrict f, float *restrict ks,
                               float *restrict qs)
{
    vf e[NB], kv[NB], qv[NB];
    for (int b = 0; b < NB; b++) {
        e[b] = load(err + j0 + b * VW);
        kv[b] = (vf){0};
        qv[b] = (vf){0};
    }
    if (pending) {
        for (int64_t i = 0; i < K; i++) {
            float *row = S + i * V + j0;
            for (int b = 0; b < NB; b++) {
                const vf s = a[i] * load(row + b * VW) + bk[i] * e[b];
                store(row + b * VW, s);
                kv[b] += c[i] * s;
                qv[b] += f[i] * s;
            }
        }
    } else {
        for (int64_t i = 0; i < K; i++) {
            const float *row = S + i * V + j0;
            for (int b = 0; b < NB; b++) {
                const vf s = load(row + b * VW);
                kv[b] += c[i] * s;
                qv[b] += f[i] * s;
            }
        }
    }
    for (int b = 0; b < NB; b++) {
        store(ks + j0 + b * VW, kv[b]);
        store(qs + j0 + b * VW, qv[b]);
    }
}

/* The sweep over columns j_lo .. j_hi - 1 (j_lo a multiple of BW). */
static void sweep(float *restrict S, int64_t K, int64_t V, int64_t j_lo, int64_t j_hi, int pending,
                  const float *restrict a, const float *restrict bk, const float *restrict err, const float *restrict c,
                  const float *restrict f, float *restrict ks, float *restrict qs)
{
    int64_t j0 = j_lo;
    for (; j0 + BW <= j_hi; j0 += BW)
        sweep_block(S, K, V, j0, pending, a, bk, err, c, f, ks, qs);
    if (j0 == j_hi)
        return;
    for (int64_t j = j0; j < j_hi; j++) {  /* the columns left over when V is not a multiple of BW */
        ks[j] = 0.f;
        qs[j] = 0.f;
    }
    for (int64_t i = 0; i < K; i++)
        for (int64_t j = j0; j < j_hi; j++) {
            const float s = a[i] * S[i * V + j] + bk[i] * err[j];
            S[i * V + j] = s;
            ks[j] += c[i] * s;
            qs[j] += f[i] * s;
        }
}

/* S <- Diag(a) S + bk err^T over columns j_lo .. j_hi - 1. */
static void apply_update(float *restrict S, int64_t K, int64_t V, int64_t j_lo, int64_t j_hi,
                         const float *restrict a, const float *restrict bk, const float *restrict err)
{
    for (int64_t i = 0; i < K; i++) {
        float *row = S + i * V;
        int64_t j = j_lo;
        for (; j + VW <= j_hi; j += VW)
            store(row + j, a[i] * load(row + j) + bk[i] * load(err + j));
        for (; j < j_hi; j++)
            row[j] = a[i] * row[j] + bk[i] * err[j];
    }
}

struct job {
    const float *q, *k, *v, *decay, *beta;
    int64_t HV, K, V;
    float scale, eps;
    int32_t l2norm;
    const int64_t *starts, *ends, *slots;
    float *pool;
    int64_t slot_stride;
    float *o;
    int64_t col_blocks, block_cols, units;
    int64_t next;  /* the next unit to take (atomic) */
};

/* One unit of work: columns j_lo .. j_hi - 1 of head h of sequence n, all its tokens. A value column of the
 * state evolves on its own (S e^T and o = S^T q touch only their column), so the units are independent and
 * each gives exactly the numbers the whole head would. */
static void run_unit(const struct job *jb, int64_t unit)
{
    const int64_t HV = jb->HV, K = jb->K, V = jb->V;
    const int64_t n = unit / (HV * jb->col_blocks), h = unit / jb->col_blocks % HV;
    const int64_t j_lo = unit % jb->col_blocks * jb->block_cols;
    const int64_t j_hi = j_lo + jb->block_cols < V ? j_lo + jb->block_cols : V;
    const int64_t t0 = jb->starts[n], t1 = jb->ends[n];
    if (jb->slots[n] < 0) {
        for (int64_t t = t0; t < t1; t++)
            memset(jb->o + (t * HV + h) * V + j_lo, 0, sizeof(float) * (size_t)(j_hi - j_lo));
        return;
    }
    float a[K], bk[K], c[K], f[K], ks[V], qs[V], err[V];  /* a, bk, err: the pending update */
    float *S = jb->pool + jb->slots[n] * jb->slot_stride + h * K * V;
    for (int64_t i = 0; i < K; i++) {  /* no pending update yet: the identity */
        a[i] = 1.f;
        bk[i] = 0.f;
    }
    for (int64_t j = j_lo; j < j_hi; j++)
        err[j] = 0.f;
    for (int64_t t = t0; t < t1; t++) {
        const float *qt = jb->q + (t * HV + h) * K, *kt = jb->k + (t * HV + h) * K;
        const float *dt = jb->decay + (t * HV + h) * K;
        float rq = 1.f, rk = 1.f;
        if (jb->l2norm) {
            float sq = 0.f, sk = 0.f;
            for (int64_t i = 0; i < K; i++) {
                sq += qt[i] * qt[i];
                sk += kt[i] * kt[i];
            }
            rq = 1.f / sqrtf(sq + jb->eps);
            rk = 1.f / sqrtf(sk + jb->eps);
        }
        for (int64_t i = 0; i < K; i++) {
            c[i] = dt[i] * kt[i] * rk;
            f[i] = dt[i] * qt[i] * rq;
        }
        sweep(S, K, V, j_lo, j_hi, t > t0, a, bk, err, c, f, ks, qs);
        const float b = jb->beta[t * HV + h];
        float qbk = 0.f;
        for (int64_t i = 0; i < K; i++) {
            a[i] = dt[i];
            bk[i] = b * kt[i] * rk;
            qbk += qt[i] * rq * bk[i];
        }
        const float *vt = jb->v + (t * HV + h) * V;
        float *ot = jb->o + (t * HV + h) * V;
        for (int64_t j = j_lo; j < j_hi; j++) {
            err[j] = vt[j] - ks[j];
            ot[j] = jb->scale * (qs[j] + qbk * err[j]);
        }
    }
    apply_update(S, K, V, j_lo, j_hi, a, bk, err);  /* the last token's */
}

static void *worker(void *arg)
{
    struct job *jb = arg;
    for (int64_t u; (u = __atomic_fetch_add(&jb->next, 1, __ATOMIC_RELAXED)) < jb->units;)
        run_unit(jb, u);
    return NULL;
}

/* q, k, decay [rows, HV, K]; v [rows, HV, V]; beta [rows, HV] (rows = tokens, all contiguous). Sequence n is
 * rows starts[n] .. ends[n]-1 and continues the state of slot slots[n] ([HV, K, V] contiguous at
 * pool + slots[n] * slot_stride, updated in place); slots[n] < 0 skips it (zero output). o [rows, HV, V] gets
 * the outputs of the sequences' rows. With l2norm, q and k are divided by sqrt(|x|^2 + eps) here. Runs on up to
 * `threads` threads (this one included): the units are (sequence, head), and where they are fewer than the
 * threads, each head's value columns split into blocks of whole vectors. */
void kda_rows(const float *q, const float *k, const float *v, const float *decay, const float *beta, int64_t HV,
              int64_t K, int64_t V, float scale, int32_t l2norm, float eps, const int64_t *starts,
              const int64_t *ends, const int64_t *slots, int64_t N, float *pool, int64_t slot_stride, float *o,
              int32_t threads)
{
    struct job jb = {q, k, v, decay, beta, HV, K, V, scale, eps, l2norm, starts, ends, slots, pool, slot_stride, o,
                     1, V, 0, 0};
    const int64_t heads = N * HV, max_blocks = (V + BW - 1) / BW;
    if (threads > 1 && heads > 0 && heads < threads) {
        int64_t want = (threads + heads - 1) / heads;
        want = want < max_blocks ? want : max_blocks;
        jb.block_cols = ((V + want - 1) / want + BW - 1) / BW * BW;
        jb.col_blocks = (V + jb.block_cols - 1) / jb.block_cols;
    }
    jb.units = heads * jb.col_blocks;
    int64_t spawn = (threads < jb.units ? threads : jb.units) - 1;
    pthread_t helpers[spawn > 0 ? spawn : 1];
    int64_t started = 0;
    for (; started < spawn; started++)  /* a thread that cannot start leaves its units to the others */
        if (pthread_create(&helpers[started], NULL, worker, &jb) != 0)
            break;
    worker(&jb);
    for (int64_t i = 0; i < started; i++)
        pthread_join(helpers[i], NULL);
}
