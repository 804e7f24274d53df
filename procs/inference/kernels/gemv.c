/* Matrix-vector products for decode: one activation row against a weight read once, so the
 * speed is the bytes a weight takes. Weights stay in their packed form (int4 groups with f16
 * scale and min, int8 or Q5_0's 5-bit groups with an f16 scale, or dense bf16/f32) and are widened to f32 in
 * registers; activations and sums are f32.
 *
 * Each group's dot product is a vector, scaled by the group's scale into a vector
 * accumulator (two, alternating, to hide the FMA latency); one horizontal sum per row. The
 * AVX-512 and AVX2 paths and the portable one compute the same sums in different orders: a
 * given build is deterministic, builds on different CPUs agree to rounding.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* One group of 32 weights widened to f32 once (unpack), then multiplied into any number of
 * activation rows (dot32): a row's sums are the same operations whether the group was
 * unpacked for it alone or for several rows (mat_mul), so batched rows equal single ones. */
#if defined(__AVX512F__)
typedef __m512 V;
typedef struct { __m512 v[2]; } W32;
static inline void q5_unpack(const uint8_t *q, const uint32_t *qh, int g, W32 *w) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * g)));
    const __m512i m16 = _mm512_set1_epi32(-16), h16 = _mm512_set1_epi32(16);
    const uint32_t h = qh[g];
    __m512i lo = _mm512_add_epi32(_mm512_and_si512(b, _mm512_set1_epi32(15)), m16);
    __m512i hi = _mm512_add_epi32(_mm512_srli_epi32(b, 4), m16);
    lo = _mm512_mask_add_epi32(lo, (__mmask16)(h & 0xFFFF), lo, h16);
    hi = _mm512_mask_add_epi32(hi, (__mmask16)(h >> 16), hi, h16);
    w->v[0] = _mm512_cvtepi32_ps(lo);
    w->v[1] = _mm512_cvtepi32_ps(hi);
}
/* the group's scale is folded into the widened weights once (scale32), for every row: a row
 * then costs two FMAs per group, on four accumulators (NACC) to cover their latency */
#define NACC 4
static inline void scale32(W32 *w, __m512 s) {
    w->v[0] = _mm512_mul_ps(w->v[0], s);
    w->v[1] = _mm512_mul_ps(w->v[1], s);
}
static inline __m512 dot32(const W32 *w, const float *x, int g, __m512 acc, __m512 s) {
    (void)s;
    acc = _mm512_fmadd_ps(w->v[0], _mm512_loadu_ps(x + 32 * g), acc);
    return _mm512_fmadd_ps(w->v[1], _mm512_loadu_ps(x + 32 * g + 16), acc);
}
#define VSET1 _mm512_set1_ps
#define VZERO _mm512_setzero_ps()
#define VADD _mm512_add_ps
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 V;
typedef struct { __m256 v[4]; } W32;      /* values 0-7, 8-15, 16-23, 24-31 */
static inline void q5_unpack(const uint8_t *q, const uint32_t *qh, int g, W32 *w) {
    const __m256i m15 = _mm256_set1_epi32(15), m16 = _mm256_set1_epi32(-16), h16 = _mm256_set1_epi32(16);
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    __m128i b = _mm_loadu_si128((const __m128i *)(q + 16 * g));
    __m256i w0 = _mm256_cvtepu8_epi32(b), w1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    __m256i v[4] = {_mm256_and_si256(w0, m15), _mm256_and_si256(w1, m15), _mm256_srli_epi32(w0, 4),
                    _mm256_srli_epi32(w1, 4)};
    const uint32_t h = qh[g];
    for (int i = 0; i < 4; i++) {        /* values 8i..8i+7 take bits 8i..8i+7 */
        __m256i hb = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)(h >> (8 * i))), bit), bit);
        w->v[i] = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_add_epi32(v[i], m16), _mm256_and_si256(hb, h16)));
    }
}
/* 16 registers: the scale stays per row (a row's four products summed, then scaled into one
 * of two accumulators), which keeps the accumulators' chains short */
#define NACC 2
static inline void scale32(W32 *w, __m256 s) { (void)w; (void)s; }
static inline __m256 dot32(const W32 *w, const float *x, int g, __m256 acc, __m256 s) {
    const float *xg = x + 32 * g;
    __m256 d = _mm256_mul_ps(w->v[0], _mm256_loadu_ps(xg));
    d = _mm256_fmadd_ps(w->v[1], _mm256_loadu_ps(xg + 8), d);
    d = _mm256_fmadd_ps(w->v[2], _mm256_loadu_ps(xg + 16), d);
    d = _mm256_fmadd_ps(w->v[3], _mm256_loadu_ps(xg + 24), d);
    return _mm256_fmadd_ps(d, s, acc);
}
#define VSET1 _mm256_set1_ps
#define VZERO _mm256_setzero_ps()
#define VADD _mm256_add_ps
#else
typedef float V;
typedef struct { float v[32]; } W32;
static inline void q5_unpack(const uint8_t *q, const uint32_t *qh, int g, W32 *w) {
    for (int j = 0; j < 16; j++) {
        w->v[j] = (float)((int)((q[16 * g + j] & 15) | ((qh[g] >> j & 1) << 4)) - 16);
        w->v[j + 16] = (float)((int)((q[16 * g + j] >> 4) | ((qh[g] >> (j + 16) & 1) << 4)) - 16);
    }
}
#define NACC 2
static inline void scale32(W32 *w, float s) { (void)w; (void)s; }
static inline float dot32(const W32 *w, const float *x, int g, float acc, float s) {
    float d = 0.0f;
    for (int j = 0; j < 16; j++) d += w->v[j] * x[32 * g + j] + w->v[j + 16] * x[32 * g + 16 + j];
    return acc + d * s;
}
static inline float hsum(float v) { return v; }
#define VSET1(x) (x)
#define VZERO 0.0f
#define VADD(a, b) ((a) + (b))
#endif

/* A block of VW weights widened to f32 (bf16 or f32 rows), none on the portable path */
#if defined(__AVX512F__)
#define VW 16
#define VLOAD _mm512_loadu_ps
#define VFMA _mm512_fmadd_ps
static inline V wload_bf16(const uint16_t *w) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w)), 16));
}
static inline V wload_f32(const float *w) { return _mm512_loadu_ps(w); }
#elif defined(__AVX2__) && defined(__FMA__)
#define VW 8
#define VLOAD _mm256_loadu_ps
#define VFMA _mm256_fmadd_ps
static inline V wload_bf16(const uint16_t *w) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w)), 16));
}
static inline V wload_f32(const float *w) { return _mm256_loadu_ps(w); }
#endif

/* One weight row against nb (<= NB, a constant where inlined) activation rows: x row b at
 * x + b*ldx, its result to y[b*ldy]. Two accumulators per activation row take alternate
 * groups (blocks) to hide the FMA latency; one horizontal sum per row. The weight row is
 * widened once per group for all nb rows; each row's operations do not depend on nb. */
#define NB 4
#define INLINE static inline __attribute__((always_inline))

/* groups in order, group g on accumulator g % NACC (indices constant: a runtime index would
 * keep the accumulators in memory); summed in one fixed order */
#if NACC == 4
#define GROUP_LOOP(STEP)                                                                        \
    int g = 0;                                                                                  \
    for (; g + 3 < groups; g += 4) {                                                            \
        STEP(g, 0)                                                                              \
        STEP(g + 1, 1)                                                                          \
        STEP(g + 2, 2)                                                                          \
        STEP(g + 3, 3)                                                                          \
    }                                                                                           \
    if (g < groups) STEP(g, 0)                                                                  \
    if (g + 1 < groups) STEP(g + 1, 1)                                                          \
    if (g + 2 < groups) STEP(g + 2, 2)
INLINE V acc_sum(const V *a) { return VADD(VADD(a[0], a[1]), VADD(a[2], a[3])); }
#else
#define GROUP_LOOP(STEP)                                                                        \
    int g = 0;                                                                                  \
    for (; g + 1 < groups; g += 2) {                                                            \
        STEP(g, 0)                                                                              \
        STEP(g + 1, 1)                                                                          \
    }                                                                                           \
    if (g < groups) STEP(g, 0)
INLINE V acc_sum(const V *a) { return VADD(a[0], a[1]); }
#endif

/* Q5_0's 5-bit groups (the file's nibbles, then a uint32 of high bits per group) */
INLINE void rows_q5(const uint8_t *q, const uint16_t *sc, int groups, const float *x, long ldx, float *y, long ldy,
                    const int nb) {
    const uint32_t *qh = (const uint32_t *)(q + groups * 16);
    V acc[NB][NACC];
    for (int b = 0; b < nb; b++)
        for (int a = 0; a < NACC; a++) acc[b][a] = VZERO;
#define Q5_STEP(G, A)                                                                          \
    {                                                                                          \
        W32 w;                                                                                 \
        q5_unpack(q, qh, G, &w);                                                               \
        const V s = VSET1(f16_to_f32(sc[G]));                                                  \
        scale32(&w, s);                                                                        \
        for (int b = 0; b < nb; b++) acc[b][A] = dot32(&w, x + b * ldx, G, acc[b][A], s);      \
    }
    GROUP_LOOP(Q5_STEP)
    for (int b = 0; b < nb; b++) y[b * ldy] = hsum(acc_sum(acc[b]));
}

/* bf16 (bf16 = 1) or f32 weights: blocks of VW, then a scalar tail */
INLINE void rows_dense(const void *wr, int bf16, int k, const float *x, long ldx, float *y, long ldy, const int nb) {
    float tail[NB];
    int i = 0;
#ifdef VW
    V acc[NB][2];
    for (int b = 0; b < nb; b++) acc[b][0] = acc[b][1] = VZERO;
#define DENSE_STEP(I, A)                                                                        \
    {                                                                                           \
        const V v = bf16 ? wload_bf16((const uint16_t *)wr + (I)) : wload_f32((const float *)wr + (I)); \
        for (int b = 0; b < nb; b++) acc[b][A] = VFMA(v, VLOAD(x + b * ldx + (I)), acc[b][A]);  \
    }
    for (; i + 2 * VW <= k; i += 2 * VW) {
        DENSE_STEP(i, 0)
        DENSE_STEP(i + VW, 1)
    }
    if (i + VW <= k) {
        DENSE_STEP(i, 0)
        i += VW;
    }
    for (int b = 0; b < nb; b++) tail[b] = hsum(VADD(acc[b][0], acc[b][1]));
#else
    for (int b = 0; b < nb; b++) tail[b] = 0.0f;
#endif
    for (int b = 0; b < nb; b++) {
        float t = tail[b];
        for (int j = i; j < k; j++)
            t += (bf16 ? bf16_to_f32(((const uint16_t *)wr)[j]) : ((const float *)wr)[j]) * x[b * ldx + j];
        y[b * ldy] = t;
    }
}

/* weight row r of m (Q5 or dense) against nb activation rows */
INLINE void row_times(const Mat *m, long r, const float *x, long ldx, float *y, long ldy, const int nb) {
    const int k = m->k, groups = k / GROUP;
    switch (m->kind) {
    case MAT_Q5:
        rows_q5((const uint8_t *)m->w + r * Q5_ROW(k), m->s + r * groups, groups, x, ldx, y, ldy, nb);
        break;
    case MAT_BF16:
        rows_dense((const uint16_t *)m->w + r * k, 1, k, x, ldx, y, ldy, nb);
        break;
    default:
        rows_dense((const float *)m->w + r * k, 0, k, x, ldx, y, ldy, nb);
    }
}

/* Weight row r of m (dense or Q5) against all B activation rows, NB at a time. Row (r, b)
 * gets the same operations whatever B is. */
INLINE void row_all(const Mat *m, int r, int B, const float *x, long ldx, float *y, long ldy) {
#ifndef VW
    /* portable build: one activation row at a time (the compiler vectorizes the scalar loops
     * differently for each row count, which would break the bit-equality with single rows) */
    for (int b = 0; b < B; b++) row_times(m, r, x + b * ldx, ldx, y + b * ldy + r, ldy, 1);
#else
    for (int b0 = 0; b0 < B; b0 += NB) {
        const float *xb = x + b0 * ldx;
        float *yb = y + b0 * ldy + r;
        switch (B - b0) {
        case 1: row_times(m, r, xb, ldx, yb, ldy, 1); break;
        case 2: row_times(m, r, xb, ldx, yb, ldy, 2); break;
        case 3: row_times(m, r, xb, ldx, yb, ldy, 3); break;
        default: row_times(m, r, xb, ldx, yb, ldy, 4);
        }
    }
#endif
}

/* Y[b] = W X[b] for B activation rows (x rows ldx apart, y rows ldy apart): each weight row
 * is read from memory once and multiplied by up to NB activation rows per pass while it is in
 * cache, so B rows cost about one row's weight traffic. Row (r, b) gets the same operations
 * whatever B is: batched rows equal single ones bit for bit. Rows are split across threads
 * statically and each row is summed in one fixed order: the result does not depend on the
 * thread count. */
int mat_mul(const Mat *m, int B, const float *x, long ldx, float *y, long ldy) {
    const int n = m->n;
    if (m->kind == MAT_Q4 || m->kind == MAT_Q8) return mat_mul_q(m, B, x, ldx, y, ldy);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < n; r++) row_all(m, r, B, x, ldx, y, ldy);
    return 0;
}

int mat_mul_heads(const Mat *ms, int nm, int B, const float *x, long ldx, long xh, float *y, long ldy, long yh) {
    for (int h = 1; h < nm; h++)
        if (ms[h].kind != ms[0].kind || ms[h].n != ms[0].n || ms[h].k != ms[0].k) return -1;
    if (ms[0].kind == MAT_Q4 || ms[0].kind == MAT_Q8) {     /* their own blocked regions, one by one */
        for (int h = 0; h < nm; h++)
            if (mat_mul_q(ms + h, B, x + h * xh, ldx, y + h * yh, ldy)) return -1;
        return 0;
    }
    const long n = ms[0].n;
#pragma omp parallel for schedule(static)
    for (long t = 0; t < nm * n; t++) {
        const int h = (int)(t / n);
        row_all(ms + h, (int)(t % n), B, x + h * xh, ldx, y + h * yh, ldy);
    }
    return 0;
}

/* The Python side's check of the packing: y = W x for one matrix (tests, the bench). */
int mat_vec_one(const Mat *m, const float *x, float *y) { return mat_mul(m, 1, x, 0, y, 0); }

_Static_assert(sizeof(W32) == GROUP * sizeof(float), "W32 holds one group's values, in order");

/* Row r of m as the values mat_vec multiplies by, in f32 or (rounded to nearest even) bf16. */
static void dequant_row(const Mat *m, long r, void *dst, int bf16) {
    const int k = m->k, groups = k / GROUP;
    float row[GROUP];
    if (m->kind == MAT_Q4 || m->kind == MAT_Q8) {
        q_row(m, r, dst, bf16);
        return;
    }
    for (int g = 0; g < (m->kind == MAT_Q5 ? groups : 0); g++) {
        /* every path's W32 holds the group's values in order */
        const uint8_t *q = (const uint8_t *)m->w + r * Q5_ROW(k);
        const float s = f16_to_f32(m->s[r * groups + g]);
        W32 w;
        q5_unpack(q, (const uint32_t *)(q + k / 2), g, &w);
        memcpy(row, &w, sizeof row);
        for (int j = 0; j < GROUP; j++) row[j] *= s;
        if (bf16)
            for (int j = 0; j < GROUP; j++) ((uint16_t *)dst)[GROUP * g + j] = f32_to_bf16(row[j]);
        else
            memcpy((float *)dst + GROUP * g, row, sizeof row);
    }
    if (m->kind == MAT_BF16 || m->kind == MAT_F32) {
        for (int i = 0; i < k; i++) {
            const float v = m->kind == MAT_BF16 ? bf16_to_f32(((const uint16_t *)m->w)[r * k + i])
                                                : ((const float *)m->w)[r * k + i];
            if (bf16)
                ((uint16_t *)dst)[i] = f32_to_bf16(v);
            else
                ((float *)dst)[i] = v;
        }
    }
}

/* Rows ids[0..count) of m into out [count][k] (f32, or bf16 when bf16); ids NULL: rows
 * 0..count-1. Prefill's weights and the embedding's rows, from the one packed copy. */
void mat_rows(const Mat *m, const int64_t *ids, long count, void *out, int bf16) {
    const long row_bytes = (long)m->k * (bf16 ? 2 : 4);
#pragma omp parallel for schedule(static)
    for (long i = 0; i < count; i++) dequant_row(m, ids ? ids[i] : i, (char *)out + i * row_bytes, bf16);
}
