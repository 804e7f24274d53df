/* Single-query attention for decode on the CPU: one query row per head against S cached
 * keys, at memory bandwidth.
 *
 * The K/V rows are read once each: every K/V head's G query heads (GQA) are scored against a
 * key row while it is in cache, and the softmax is the streaming (flash-decoding) kind, so V
 * is read once too. Work is split into fixed tasks of (K/V head, CHUNK rows) whose partial
 * (max, sum, acc) are combined afterwards in task order: the result does not depend on the
 * thread count or schedule, only on S (deterministic, as --deterministic needs).
 *
 * Several sequences of one batched step go through one call (decode_attention_many); a chunk
 * whose rows two sequences hold bit for bit alike (a system prompt their sessions copied) is
 * widened once and serves every query of both: every query of a chunk, shared or not, is
 * scored and weighted by the same code with sums in one fixed order, so sharing changes no
 * bit of any answer. Scores transpose blocks of K rows in registers (one vector of rows per
 * query, no horizontal sums); the V products take several queries per V row. bf16 caches on
 * CPUs with avx512_bf16 skip the widening: a chunk's K is packed as bf16 pairs once, its V
 * rows are paired in registers as the products use them, and both products run on vdpbf16ps
 * tiles (pairs.h; q and the weights rounded to bf16), 1.3-1.4x the widened path's rate on a
 * Zen 4 at 4,700-8,000 rows.
 *
 * Built by procs/inference/native.py with the other kernels (-O3 -march=native -fopenmp, reassociation allowed so the
 * reductions vectorize: a given build is still deterministic); OpenMP is torch's own
 * runtime (the same libgomp.so.1 soname, already loaded), so torch.set_num_threads applies.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "kernels.h"

#define CHUNK ATT_CHUNK
/* decode's limits (native_attention.DECODE): up to DeepSeek-V3's 128 query heads on one
 * latent K/V head of 576 */
#define MAXG 128
#define MAXD 576

#include "simd.h"
#include "pairs.h"

/* Scores of up to QG queries at once against the chunk's n rows (kb [n][D], f32): blocks of
 * VW rows are transposed in registers so that each query's dot products accumulate VW rows in
 * one vector, d in order, with no horizontal sum; the block's K is loaded once for every
 * query of the group. A query's score for a row is the same whatever else is in its group
 * (each lane's sum runs over d in one fixed order), so a shared chunk gives each sequence
 * the bits its own copy would. Rows past the last whole block are summed one at a time. */
#if VW == 16
#define QG 12
#elif VW == 8
#define QG 7
#else
#define QG 8
#endif

/* one row's score, d in order (rows past the last whole block, and builds without vectors) */
static inline float row_score(const float *restrict q, const float *restrict k, int D) {
    float acc = 0.0f;
    for (int d = 0; d < D; d++) acc += q[d] * k[d];
    return acc;
}

#ifdef VW
/* M queries (a compile-time count: their accumulators stay in registers) */
static inline __attribute__((always_inline)) void block_scores(
        const int M, const float *const *q, const float *restrict kb, int D, int n, float scale, float (*s)[CHUNK]) {
    int r = 0;
    for (; r + VW <= n; r += VW) {
        VF acc[QG];
        for (int i = 0; i < M; i++) acc[i] = VZERO;
        for (int d0 = 0; d0 < D; d0 += VW) {
            VF t[VW];
            for (int j = 0; j < VW; j++) t[j] = VLOADU(kb + (long)(r + j) * D + d0);
            transpose(t);
            for (int j = 0; j < VW; j++)
                for (int i = 0; i < M; i++) acc[i] = VFMA(VSET1(q[i][d0 + j]), t[j], acc[i]);
        }
        for (int i = 0; i < M; i++) VSTOREU(s[i] + r, VMUL(acc[i], VSET1(scale)));
    }
    for (; r < n; r++)
        for (int i = 0; i < M; i++) s[i][r] = row_score(q[i], kb + (long)r * D, D) * scale;
}
#endif

static void scores(int m, const float *const *q, const float *restrict kb, int D, int n, float scale,
                   float (*s)[CHUNK]) {
#ifdef VW
    if (D % VW == 0) {
        switch (m) {
#define CASE(M) case M: block_scores(M, q, kb, D, n, scale, s); return;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7)
#if QG > 7
        CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
#endif
#undef CASE
        }
    }
#endif
    for (int r = 0; r < n; r++)
        for (int i = 0; i < m; i++) s[i][r] = row_score(q[i], kb + (long)r * D, D) * scale;
}

/* s[r] -> exp(s[r] - max) in place (round: rounded to bf16); returns (max, sum) in mx, l */
static inline __attribute__((always_inline)) void softmax_part(float *restrict s, int n, float *mx, float *sum,
                                                               const int round) {
    float m = -FLT_MAX, l = 0.0f;
#pragma omp simd reduction(max:m)
    for (int r = 0; r < n; r++) m = s[r] > m ? s[r] : m;
#pragma omp simd reduction(+:l)
    for (int r = 0; r < n; r++) {
        float p = exp_nonpos(s[r] - m);
        if (round) p = bf16_to_f32(f32_to_bf16(p));
        s[r] = p;
        l += p;
    }
    *mx = m;
    *sum = l;
}

/* part[i][d] = sum over rows r, in order, of w[i][r] * vb[r][d]: M queries' weights against
 * each V row while it is in registers, NV vectors of d at a time from d0. A query's sums do
 * not depend on M, NV or which queries share its group. */
#ifdef VW
#define PG (VW == 16 ? 4 : 2)
static inline __attribute__((always_inline)) void pv_block(const int M, const int NV, float (*w)[CHUNK],
                                                           const float *restrict vb, int D, int n, int d0,
                                                           float *const *part) {
    VF acc[4][4];
    for (int i = 0; i < M; i++)
        for (int j = 0; j < NV; j++) acc[i][j] = VZERO;
    for (int r = 0; r < n; r++) {
        VF v[4];
        for (int j = 0; j < NV; j++) v[j] = VLOADU(vb + (long)r * D + d0 + j * VW);
        for (int i = 0; i < M; i++) {
            const VF x = VSET1(w[i][r]);
            for (int j = 0; j < NV; j++) acc[i][j] = VFMA(x, v[j], acc[i][j]);
        }
    }
    for (int i = 0; i < M; i++)
        for (int j = 0; j < NV; j++) VSTOREU(part[i] + d0 + j * VW, acc[i][j]);
}
#endif

static void pv(int m, float (*w)[CHUNK], const float *restrict vb, int D, int n, float *const *part) {
    int i0 = 0, d0 = 0;
#ifdef VW
    for (; i0 < m; i0 += PG) {
        const int M = m - i0 < PG ? m - i0 : PG;
        for (d0 = 0; d0 + 4 * VW <= D; d0 += 4 * VW) {
            switch (M) {
            case 1: pv_block(1, 4, w + i0, vb, D, n, d0, part + i0); break;
            case 2: pv_block(2, 4, w + i0, vb, D, n, d0, part + i0); break;
#if PG > 2
            case 3: pv_block(3, 4, w + i0, vb, D, n, d0, part + i0); break;
            case 4: pv_block(4, 4, w + i0, vb, D, n, d0, part + i0); break;
#endif
            }
        }
        for (; d0 + VW <= D; d0 += VW)
            for (int i = i0; i < i0 + M; i++) pv_block(1, 1, w + i, vb, D, n, d0, part + i);
        for (int i = i0; i < i0 + M; i++)
            for (int d = d0; d < D; d++) {
                float a = 0.0f;
                for (int r = 0; r < n; r++) a += w[i][r] * vb[(long)r * D + d];
                part[i][d] = a;
            }
    }
#else
    for (; i0 < m; i0++)
        for (int d = d0; d < D; d++) {
            float a = 0.0f;
            for (int r = 0; r < n; r++) a += w[i0][r] * vb[(long)r * D + d];
            part[i0][d] = a;
        }
#endif
}

/* nq queries (q[i]: D floats, their partials part[i]: [D + 2] = acc, max, sum) against the
 * chunk's n rows, widened to f32 in kb and vb ([n][D]), in groups of QG. Every partial,
 * shared chunk or not, comes from here: a chunk's partial for a query depends only on its
 * rows and that query. */
static void partials(int nq, const float *const *q, float *const *part, const float *kb, const float *vb, int D,
                     int n, float scale) {
    float s[QG][CHUNK];
    for (int i0 = 0; i0 < nq; i0 += QG) {
        const int m = nq - i0 < QG ? nq - i0 : QG;
        scores(m, q + i0, kb, D, n, scale, s);
        for (int i = 0; i < m; i++) softmax_part(s[i], n, part[i0 + i] + D, part[i0 + i] + D + 1, 0);
        pv(m, s, vb, D, n, part + i0);
    }
}

#if PAIRS
/* partials() on a chunk of bf16 rows: K packed as pairs (pack_k_pairs: kp [D/2][CHUNK]), V
 * read as the cache holds it (v: n rows of D, pv_tile_rows: a decode chunk serves a few
 * queries, so interleaving its rows in registers costs less than storing them as pairs);
 * the products in vdpbf16ps tiles, q and the weights rounded to bf16 (pairs.h), in groups of
 * QG queries, tiles of PT. D % 64 == 0. */
static void partials_pairs(int nq, const float *const *q, float *const *part, const uint32_t *kp,
                           const uint16_t *v, int D, int n, float scale) {
    float s[QG][CHUNK], o[PT * MAXD];
    uint32_t q2[QG][MAXD / 2], p2[QG][CHUNK / 2];
    const int np = (n + 1) / 2, keys = (n + 63) / 64 * 64;
    for (int i0 = 0; i0 < nq; i0 += QG) {
        const int mq = nq - i0 < QG ? nq - i0 : QG;
        for (int i = 0; i < mq; i++) pairs_of(q[i0 + i], D, q2[i]);
        for (int r0 = 0; r0 < mq; r0 += PT) {
            const int m = mq - r0 < PT ? mq - r0 : PT;
            for (int j0 = 0; j0 < keys; j0 += 64)
                PAIR_TILES(score_tile_bf, q2[r0], MAXD / 2, D / 2, kp + j0, CHUNK, scale, s[r0] + j0, CHUNK)
        }
        for (int i = 0; i < mq; i++) {
            softmax_part(s[i], n, part[i0 + i] + D, part[i0 + i] + D + 1, 1);
            if (n & 1) s[i][n] = 0.0f;       /* the odd last row's partner (n < CHUNK then) */
            pair_up(s[i], np, p2[i]);
        }
        for (int r0 = 0; r0 < mq; r0 += PT) {
            const int m = mq - r0 < PT ? mq - r0 : PT;
            PAIR_TILES(pv_tile_rows, p2[r0], CHUNK / 2, np, n, D, v, o)
            for (int i = 0; i < m; i++) {     /* the lanes' order of d back to d's */
                float *dst = part[i0 + r0 + i];
                const float *src = o + (long)i * D;
                for (int d0 = 0; d0 < D; d0 += 64)
                    for (int p = 0; p < 64; p++) dst[d0 + unpacked_d(p)] = src[d0 + p];
            }
        }
    }
}
#endif

/* The chunk's K and V rows widened once (L2-resident) for every query that reads them. */
static _Thread_local float kbuf[CHUNK * MAXD], vbuf[CHUNK * MAXD];

long decode_attention_scratch(int KV, int G, int D, int S) {
    long chunks = (S + CHUNK - 1) / CHUNK;
    return (long)KV * chunks * G * (D + 2);
}

/* Task t of decode_attention_many: sequence b, head h, chunk c of n rows at kp, vp. */
static inline void locate(long t, int B, const long *start, const int *chunks, const int *own, const int *S,
                          const long *head_stride, const void *const *k, const void *const *v, int D, long esz,
                          int *b, int *h, int *c, int *n, const char **kp, const char **vp) {
    int i = 0;
    while (i + 1 < B && t >= start[i + 1]) i++;
    const int per = chunks[i] - own[i], r0 = (own[i] + (int)((t - start[i]) % per)) * CHUNK;
    *b = i;
    *h = (int)((t - start[i]) / per);
    *c = r0 / CHUNK;
    *n = (r0 + CHUNK < S[i] ? r0 + CHUNK : S[i]) - r0;
    const long first = (*h * head_stride[i] + (long)r0 * D) * esz;
    *kp = (const char *)k[i] + first;
    *vp = (const char *)v[i] + first;
}

/* B sequences' single-query attention in one parallel region. Sequence b: queries q [KV*G][D]
 * f32, head h's row r of K at k + h*head_stride + r*D (elements; likewise V), S rows, out
 * [KV*G][D]. sinks [KV*G] (NULL: none): each query head's learned logit (gpt-oss), one more
 * term of its softmax's denominator that weighs no value. lead[b] = a < b with shared[b] > 0: the first shared[b] whole chunks of b's rows
 * are bit for bit a's (the caller has compared them), so they are read once, from a, for
 * every query of the group; lead[b] = b: none shared. Each sequence's partials are combined
 * in its own chunk order, so row b is what it gives alone, whatever else runs. scratch: the
 * sum of decode_attention_scratch over the sequences. Returns 0, or -1 for a shape past
 * MAXG/MAXD. */
int decode_attention_many(int B, const float *const *q, const void *const *k, const void *const *v,
                          const long *head_stride, const int *S, const int *lead, const int *shared, int KV,
                          int G, int D, float scale, int bf16, const float *sinks, float *const *out,
                          float *scratch) {
    if (G > MAXG || D > MAXD || B < 1) return -1;
    const long psize = (long)G * (D + 2), esz = bf16 ? 2 : 4;
    int chunks[B], own[B];
    long off[B + 1], start[B + 1];   /* partials of b; first task of b */
    off[0] = start[0] = 0;
    for (int b = 0; b < B; b++) {
        if (S[b] <= 0 || lead[b] < 0 || lead[b] > b || (lead[b] != b && lead[lead[b]] != lead[b])) return -1;
        chunks[b] = (S[b] + CHUNK - 1) / CHUNK;
        own[b] = lead[b] == b ? 0 : shared[b];    /* chunks b does not read itself */
        if (own[b] < 0 || (long)own[b] * CHUNK > S[b] || (long)own[b] * CHUNK > S[lead[b]]) return -1;
        off[b + 1] = off[b] + KV * chunks[b] * psize;
        start[b + 1] = start[b] + (long)KV * (chunks[b] - own[b]);
    }
    /* task t: sequence b, head h, chunk c >= own[b]; a leader's task also serves every member
     * whose shared chunks include c. Tasks go round-robin: a thread's next task is nthreads
     * on, and its rows are prefetched (to L2) while this one computes, so the K/V reads
     * overlap the partials' arithmetic. */
#pragma omp parallel
    {
        const long step = omp_get_num_threads();
#pragma omp for schedule(static, 1)
        for (long t = 0; t < start[B]; t++) {
            const char *kp, *vp;
            int b, h, c, n;
            const float *qs[MAXG * B];
            float *ps[MAXG * B];
            locate(t, B, start, chunks, own, S, head_stride, k, v, D, esz, &b, &h, &c, &n, &kp, &vp);
            if (t + step < start[B]) {
                const char *kn, *vn;
                int b2, h2, c2, n2;
                locate(t + step, B, start, chunks, own, S, head_stride, k, v, D, esz, &b2, &h2, &c2, &n2, &kn, &vn);
                for (long i = 0; i < (long)n2 * D * esz; i += 64) {
                    __builtin_prefetch(kn + i, 0, 2);
                    __builtin_prefetch(vn + i, 0, 2);
                }
            }
            /* this sequence's G queries, then those of each sequence reading the chunk from here */
            int nq = 0;
            for (int m = b; m < B; m++) {
                if (m != b && !(lead[b] == b && lead[m] == b && c < own[m])) continue;
                for (int g = 0; g < G; g++, nq++) {
                    qs[nq] = q[m] + ((long)h * G + g) * D;
                    ps[nq] = scratch + off[m] + ((long)h * chunks[m] + c) * psize + g * (D + 2);
                }
            }
#if PAIRS
            if (bf16 && D % 64 == 0) {
                pack_k_pairs((const uint16_t *)kp, n, CHUNK, D, (uint32_t *)kbuf);
                partials_pairs(nq, qs, ps, (const uint32_t *)kbuf, (const uint16_t *)vp, D, n, scale);
                continue;
            }
#endif
            if (!bf16) {     /* f32 rows are read where they are: a copy would only add stores */
                partials(nq, qs, ps, (const float *)kp, (const float *)vp, D, n, scale);
                continue;
            }
            widen_rows(kp, vp, bf16, (long)n * D, kbuf, vbuf);
            partials(nq, qs, ps, kbuf, vbuf, D, n, scale);
        }
    }
    /* combine the chunks of each (sequence, head, query) in chunk order */
#pragma omp parallel for schedule(static)
    for (long t = 0; t < (long)B * KV * G; t++) {
        const int b = (int)(t / (KV * G)), h = (int)(t / G % KV), g = (int)(t % G), nc = chunks[b];
        const float *base = scratch + off[b] + (long)h * nc * psize + g * (D + 2);
        float m = sinks ? sinks[h * G + g] : -FLT_MAX, l = 0.0f, *o = out[b] + ((long)h * G + g) * D;
        for (int c = 0; c < nc; c++) m = base[c * psize + D] > m ? base[c * psize + D] : m;
        if (sinks) l = expf(sinks[h * G + g] - m);
        memset(o, 0, sizeof(float) * D);
        for (int c = 0; c < nc; c++) {
            const float *p = base + c * psize, w = expf(p[D] - m);
            l += w * p[D + 1];
            for (int d = 0; d < D; d++) o[d] += w * p[d];
        }
        const float inv = 1.0f / l;
        for (int d = 0; d < D; d++) o[d] *= inv;
    }
    return 0;
}

/* One sequence: q [KV*G][D] f32; k, v: head h's row r at base + h*head_stride + r*D
 * (elements), S rows; out [KV*G][D] f32; scratch: decode_attention_scratch(KV, G, D, S)
 * floats. bf16: 1 for bfloat16 K/V, 0 for float32; sinks: as decode_attention_many's.
 * Returns 0, or -1 for shapes past MAXG/MAXD. */
int decode_attention(const float *q, const void *k, const void *v, long head_stride, int KV, int G,
                     int D, int S, float scale, int bf16, const float *sinks, float *out, float *scratch) {
    const int none = 0, self = 0;
    return decode_attention_many(1, &q, &k, &v, &head_stride, &S, &self, &none, KV, G, D, scale, bf16, sinks,
                                 &out, scratch);
}

/* Whether a model's grouping (query heads per K/V head) and head dim fit the task buffers. */
int decode_attention_takes(int G, int D) { return G >= 1 && G <= MAXG && D >= 1 && D <= MAXD; }
