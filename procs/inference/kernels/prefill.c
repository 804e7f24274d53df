/* Causal attention for prefill on the CPU: T query rows at absolute positions pos..pos+T-1
 * against the cached keys 0..pos+T-1 (a sliding window: only the last `window` of them), in
 * f32 whatever the cache holds, with the streaming (flash) softmax.
 *
 * Why not torch's SDPA: on CPUs without AMX its bf16 flash attention runs at 60 GFLOP/s on 2
 * Zen 4 cores and its f32 one at 70 (AVX2) to 105 (AVX-512); attention is most of a long
 * prefill. Here the products are register-blocked FMA tiles (RT query rows x a strip of keys
 * or of head dims) on K and V widened to f32 once per block and task.
 *
 * Every row's result depends only on its own query and the keys it may see: keys go in
 * blocks of NK aligned at absolute multiples of NK, a row visits its blocks in order and
 * skips those it may see none of, masked keys weigh exactly 0, and each row's sums run in one
 * fixed order whatever rows share its tile or task. So a prompt split into any chunks, or
 * resumed from any position, gives the same bits row by row, and the thread count and
 * schedule change nothing.
 *
 * Tasks are (K/V head, QB query positions): the G query heads of a K/V head (GQA) read each
 * widened block together. Heaviest (latest) positions first, handed out dynamically.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "kernels.h"
#include "simd.h"
#include "pairs.h"

#define NK 64      /* keys per block */
#define QB 32      /* query positions per task */
#define RT 6       /* query rows per register tile */
#define MAXG 16
#define MAXD 256

/* F(M, ...) for the row count m of a tile (1..RT), M a compile-time constant */
#define TILE_CASES(F, ...) switch (m) { \
    case 1: F(1, __VA_ARGS__); break; case 2: F(2, __VA_ARGS__); break; case 3: F(3, __VA_ARGS__); break; \
    case 4: F(4, __VA_ARGS__); break; case 5: F(5, __VA_ARGS__); break; case 6: F(6, __VA_ARGS__); break; }


#ifdef VW
#define NV (VW == 16 ? 4 : 2)   /* vectors per strip: RT * NV accumulators fit the registers */
#define SW (NV * VW)            /* keys (scores) or head dims (PV) per strip */

/* s[i][j] = q[i] . kt[.][j] for M rows (compile-time: accumulators in registers), the NK keys
 * of the block in strips of SW, d in order. kt: [D][NK], the block transposed. */
static inline __attribute__((always_inline)) void score_tile(const int M, const float *restrict q, int D,
                                                             const float *restrict kt, float *restrict s) {
    for (int j0 = 0; j0 < NK; j0 += SW) {
        VF acc[RT][NV];
        for (int i = 0; i < M; i++)
            for (int v = 0; v < NV; v++) acc[i][v] = VZERO;
        for (int d = 0; d < D; d++) {
            VF k[NV];
            for (int v = 0; v < NV; v++) k[v] = VLOADU(kt + (long)d * NK + j0 + v * VW);
            for (int i = 0; i < M; i++) {
                const VF x = VSET1(q[(long)i * D + d]);
                for (int v = 0; v < NV; v++) acc[i][v] = VFMA(x, k[v], acc[i][v]);
            }
        }
        for (int i = 0; i < M; i++)
            for (int v = 0; v < NV; v++) VSTOREU(s + (long)i * NK + j0 + v * VW, acc[i][v]);
    }
}

/* o[i] += sum over the block's keys j, in order, of p[i][j] * vb[j]: strips of SW head dims */
static inline __attribute__((always_inline)) void pv_tile(const int M, const float *restrict p, int D,
                                                          const float *restrict vb, float *restrict o) {
    for (int d0 = 0; d0 < D; d0 += SW) {
        VF acc[RT][NV];
        for (int i = 0; i < M; i++)
            for (int v = 0; v < NV; v++) acc[i][v] = VLOADU(o + (long)i * D + d0 + v * VW);
        for (int j = 0; j < NK; j++) {
            VF x[NV];
            for (int v = 0; v < NV; v++) x[v] = VLOADU(vb + (long)j * D + d0 + v * VW);
            for (int i = 0; i < M; i++) {
                const VF w = VSET1(p[(long)i * NK + j]);
                for (int v = 0; v < NV; v++) acc[i][v] = VFMA(w, x[v], acc[i][v]);
            }
        }
        for (int i = 0; i < M; i++)
            for (int v = 0; v < NV; v++) VSTOREU(o + (long)i * D + d0 + v * VW, acc[i][v]);
    }
}
#endif

#if PAIRS
/* bf16 caches where the CPU has avx512_bf16: the products on bf16 pairs (pairs.h), a block
 * packed once per task (kt: K's pairs [D/2][NK], vb: V's [NK/2][D]) */
#define DP 1
static void scores_bf(int m, const uint32_t *q2, int D2, const uint32_t *kp, float scale, float *s) {
    PAIR_TILES(score_tile_bf, q2, D2, D2, kp, NK, scale, s, NK)
}

static void pv_bf(int m, const uint32_t *p2, int D, const uint32_t *vp, float *o) {
    PAIR_TILES(pv_tile_bf, p2, NK / 2, NK / 2, D, vp, o)
}
#else
#define DP 0
#endif

static void scores(int m, const float *q, int D, const float *kt, float *s) {
#ifdef VW
    if (D % SW == 0) {
        TILE_CASES(score_tile, q, D, kt, s)
        return;
    }
#endif
    for (int i = 0; i < m; i++)
        for (int j = 0; j < NK; j++) {
            float a = 0.0f;
            for (int d = 0; d < D; d++) a += q[(long)i * D + d] * kt[(long)d * NK + j];
            s[(long)i * NK + j] = a;
        }
}

static void pv(int m, const float *p, int D, const float *vb, float *o) {
#ifdef VW
    if (D % SW == 0) {
        TILE_CASES(pv_tile, p, D, vb, o)
        return;
    }
#endif
    for (int i = 0; i < m; i++)
        for (int d = 0; d < D; d++) {
            float a = o[(long)i * D + d];
            for (int j = 0; j < NK; j++) a += p[(long)i * NK + j] * vb[(long)j * D + d];
            o[(long)i * D + d] = a;
        }
}

/* The block's n valid rows of K (transposed to kt [D][NK]) and V ([NK][D]) in f32, rows
 * n..NK-1 zero (they are masked, and must not be NaN: 0 * NaN is not 0). kr: [NK][D]. Returns
 * where V's rows are: the cache itself for a whole f32 block, else vb. */
static const float *widen(const char *kp, const char *vp, int bf16, int n, int D, float *kr,
                          float *restrict kt, float *vb) {
    if (!bf16 && n == NK) {     /* read in place */
        kr = (float *)kp;
        vb = (float *)vp;
    } else {
        widen_rows(kp, vp, bf16, (long)n * D, kr, vb);
    }
    if (n < NK) {
        memset(kr + (long)n * D, 0, sizeof(float) * (NK - n) * D);
        memset(vb + (long)n * D, 0, sizeof(float) * (NK - n) * D);
    }
#ifdef VW
    if (D % VW == 0) {
        for (int j0 = 0; j0 < NK; j0 += VW)
            for (int d0 = 0; d0 < D; d0 += VW) {
                VF t[VW];
                for (int j = 0; j < VW; j++) t[j] = VLOADU(kr + (long)(j0 + j) * D + d0);
                transpose(t);
                for (int d = 0; d < VW; d++) VSTOREU(kt + (long)(d0 + d) * NK + j0, t[d]);
            }
        return vb;
    }
#endif
    for (int j = 0; j < NK; j++)
        for (int d = 0; d < D; d++) kt[(long)d * NK + j] = kr[(long)j * D + d];
    return vb;
}

/* Row weights for one block: s -> exp(s - new max) on the keys lo..hi the row may see, 0
 * elsewhere; the running max, sum and output rescaled. */
static inline void softmax_row(float *restrict s, int lo, int hi, float *m, float *l, float *restrict o, int D,
                               int round) {
    float mb = -FLT_MAX, sum = 0.0f;
#pragma omp simd reduction(max:mb)
    for (int j = lo; j <= hi; j++) mb = s[j] > mb ? s[j] : mb;
    const float mn = mb > *m ? mb : *m, alpha = exp_nonpos(*m - mn);
    if (lo == 0 && hi == NK - 1 && !round) {     /* a whole block: no masking (most blocks) */
#pragma omp simd reduction(+:sum)
        for (int j = 0; j < NK; j++) {
            s[j] = exp_nonpos(s[j] - mn);
            sum += s[j];
        }
    } else {
#pragma omp simd reduction(+:sum)
        for (int j = 0; j < NK; j++) {
            float p = j >= lo && j <= hi ? exp_nonpos(s[j] - mn) : 0.0f;
            if (round) p = bf16_to_f32(f32_to_bf16(p));
            s[j] = p;
            sum += p;
        }
    }
    if (alpha != 1.0f)
        for (int d = 0; d < D; d++) o[d] *= alpha;
    *l = *l * alpha + sum;
    *m = mn;
}

static long task_floats(int G, int D) {
    const long rows = (long)QB * G;
    return rows * D * 2 + rows * NK + (long)NK * D * 3 + rows * 2 + rows * (D + NK) / 2;
}

static void task(const float *q, const char *k, const char *v, long esz, int bf16, int H, int G, int D,
                 int pos, int t0, int nt, int window, float scale, const float *sinks, float *out, float *buf) {
    const int rows = nt * G;
    float *Q = buf, *O = Q + (long)rows * D, *S = O + (long)rows * D, *kr = S + (long)rows * NK;
    float *kt = kr + (long)NK * D, *vb = kt + (long)NK * D, *m = vb + (long)NK * D, *l = m + rows;
    uint32_t *q2 = (uint32_t *)(l + rows);   /* the bf16 pairs' rows: q's, then the weights' */
    const int dp = DP && bf16 == 1 && D % 64 == 0;
    for (int r = 0; r < rows; r++) {      /* row r: position pos + t0 + r / G, query head r % G */
        const float *src = q + (long)(t0 + r / G) * H * D + (long)(r % G) * D;
        for (int d = 0; d < D; d++) Q[(long)r * D + d] = src[d] * scale;
        if (dp)
            for (int d = 0; d < D; d += 2)
                q2[((long)r * D + d) / 2] = f32_to_bf16(src[d]) | (uint32_t)f32_to_bf16(src[d + 1]) << 16;
        m[r] = -FLT_MAX;
        l[r] = 0.0f;
    }
    memset(O, 0, sizeof(float) * rows * D);
    const int first = pos + t0, last = pos + t0 + nt - 1;
    int j0 = window ? first - window + 1 : 0;
    j0 = j0 < 0 ? 0 : j0 / NK * NK;
    for (; j0 <= last; j0 += NK) {
        const int n = last + 1 - j0 < NK ? last + 1 - j0 : NK;
        const float *vrows = vb;
#if DP
        if (dp)
            pack_pairs((const uint16_t *)k + (long)j0 * D, (const uint16_t *)v + (long)j0 * D, n, NK, D,
                       (uint32_t *)kt, (uint32_t *)vb);
        else
#endif
            vrows = widen(k + (long)j0 * D * esz, v + (long)j0 * D * esz, bf16, n, D, kr, kt, vb);
        for (int r0 = 0; r0 < rows; r0 += RT) {
            const int M = rows - r0 < RT ? rows - r0 : RT;
            int any = 0;
            for (int i = 0; i < M; i++) {
                const int p = pos + t0 + (r0 + i) / G;
                any |= j0 <= p && (!window || j0 + NK - 1 > p - window);
            }
            if (!any) continue;     /* every row of the tile sees none of this block */
#if DP
            if (dp)
                scores_bf(M, q2 + (long)r0 * D / 2, D / 2, (const uint32_t *)kt, scale, S + (long)r0 * NK);
            else
#endif
                scores(M, Q + (long)r0 * D, D, kt, S + (long)r0 * NK);
            for (int i = 0; i < M; i++) {
                const int r = r0 + i, p = pos + t0 + r / G;
                int lo = window ? p - window + 1 - j0 : 0, hi = p - j0;
                lo = lo < 0 ? 0 : lo;
                hi = hi > NK - 1 ? NK - 1 : hi;
                if (hi < lo) {      /* this row sees none: weights 0, its sums untouched */
                    memset(S + (long)r * NK, 0, sizeof(float) * NK);
                    continue;
                }
                softmax_row(S + (long)r * NK, lo, hi, m + r, l + r, O + (long)r * D, D, dp);
            }
#if DP
            if (dp) {    /* the rounded weights as pairs: exact */
                uint32_t *p2 = q2 + (long)rows * D / 2;
                pair_up(S + (long)r0 * NK, M * NK / 2, p2 + (long)r0 * NK / 2);
                pv_bf(M, p2 + (long)r0 * NK / 2, D, (const uint32_t *)vb, O + (long)r0 * D);
            } else
#endif
                pv(M, S + (long)r0 * NK, D, vrows, O + (long)r0 * D);
        }
    }
    for (int r = 0; r < rows; r++) {
        float *dst = out + (long)(t0 + r / G) * H * D + (long)(r % G) * D;
        float inv = 1.0f / l[r];
        if (sinks) {      /* the sink's term joins the denominator: rescaled to a common max */
            const float s = sinks[r % G], top = s > m[r] ? s : m[r], a = expf(m[r] - top);
            inv = a / (l[r] * a + expf(s - top));
        }
        for (int d = 0; d < D; d++) dst[d] = O[(long)r * D + d] * inv;
    }
}

/* q [T][KV*G][D] f32 (rows at positions pos..pos+T-1, not yet scaled), out the same shape;
 * K/V head h's row i at k + h*head_stride + i*D elements, rows 0..pos+T-1 written. bf16: 0 for
 * f32 K/V; 1 for bf16 K/V, the products on bf16 pairs where built (PAIRS); 2 for bf16 K/V
 * widened to f32 whatever was built (where the CPU's pair products are no faster than its
 * FMAs: Intel's avx512_bf16 without AMX). window > 0: a row at p sees keys p-window+1..p.
 * sinks [KV*G] (NULL: none): each query head's learned logit (gpt-oss), one more term of its
 * softmax's denominator that weighs no value. Returns 0, or -1 for shapes past MAXG/MAXD or a
 * failed allocation. */
int prefill_attention(const float *q, const void *k, const void *v, long head_stride, int bf16, int KV, int G,
                      int D, int T, int pos, int window, float scale, const float *sinks, float *out) {
    if (G < 1 || G > MAXG || D < 1 || D > MAXD || T < 1 || pos < 0 || window < 0) return -1;
    const long esz = bf16 ? 2 : 4, nb = (T + QB - 1) / QB, ntask = (long)KV * nb;
    int failed = 0;
#pragma omp parallel
    {
        float *buf = aligned_alloc(64, ((sizeof(float) * task_floats(G, D)) + 63) / 64 * 64);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (long t = 0; t < ntask; t++) {
            const int b = (int)(nb - 1 - t / KV), h = (int)(t % KV), t0 = b * QB;
            const int nt = T - t0 < QB ? T - t0 : QB;
            if (buf)
                task(q + (long)h * G * D, (const char *)k + h * head_stride * esz,
                     (const char *)v + h * head_stride * esz, esz, bf16, KV * G, G, D, pos, t0, nt, window,
                     scale, sinks ? sinks + (long)h * G : NULL, out + (long)h * G * D, buf);
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
