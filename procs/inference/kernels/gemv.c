/* Matrix-vector products for decode: one activation row against a weight read once, so the
 * speed is the bytes a weight takes. Weights stay in their packed form (int4 groups with f16
 * scale and min, int8 groups with an f16 scale, or dense bf16/f32) and are widened to f32 in
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

static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023;
    union { uint32_t u; float f; } c;
    if (e == 0) {                                  /* zero or subnormal: m * 2^-24 */
        c.f = (float)m * 5.9604644775390625e-8f;
        c.u |= s;
        return c.f;
    }
    c.u = s | (e == 31 ? 0x7F800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    return c.f;
#endif
}

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

/* Two accumulators over groups: acc0 takes even groups, acc1 odd ones (FMA latency). */
#define OVER_GROUPS(ZERO, ADD, BODY)                 \
    __typeof__(ZERO) acc0 = ZERO, acc1 = ZERO;       \
    int g = 0;                                       \
    for (; g + 1 < groups; g += 2) {                 \
        acc0 = BODY(g, acc0);                        \
        acc1 = BODY(g + 1, acc1);                    \
    }                                                \
    if (g < groups) acc0 = BODY(g, acc0);            \
    const __typeof__(ZERO) acc = ADD(acc0, acc1);

#if defined(__AVX512F__)
static inline __m512 q4_group(const uint8_t *q, const uint16_t *sm, const float *x, int g, __m512 acc) {
    __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * g)));
    const __m512i m15 = _mm512_set1_epi32(15);
    __m512 d = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(w, m15)), _mm512_loadu_ps(x + 32 * g));
    d = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4)), _mm512_loadu_ps(x + 32 * g + 16), d);
    return _mm512_fmadd_ps(d, _mm512_set1_ps(f16_to_f32(sm[2 * g])), acc);
}
static inline __m512 q8_group(const int8_t *q, const uint16_t *s, const float *x, int g, __m512 acc) {
    __m512i a = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 32 * g)));
    __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 32 * g + 16)));
    __m512 d = _mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_loadu_ps(x + 32 * g));
    d = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), _mm512_loadu_ps(x + 32 * g + 16), d);
    return _mm512_fmadd_ps(d, _mm512_set1_ps(f16_to_f32(s[g])), acc);
}
#define VZERO _mm512_setzero_ps()
#define VADD _mm512_add_ps
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256 q4_group(const uint8_t *q, const uint16_t *sm, const float *x, int g, __m256 acc) {
    const __m256i m15 = _mm256_set1_epi32(15);
    __m128i b = _mm_loadu_si128((const __m128i *)(q + 16 * g));
    __m256i w0 = _mm256_cvtepu8_epi32(b), w1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    const float *xg = x + 32 * g;
    __m256 d = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(w0, m15)), _mm256_loadu_ps(xg));
    d = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(w1, m15)), _mm256_loadu_ps(xg + 8), d);
    d = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(w0, 4)), _mm256_loadu_ps(xg + 16), d);
    d = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(w1, 4)), _mm256_loadu_ps(xg + 24), d);
    return _mm256_fmadd_ps(d, _mm256_set1_ps(f16_to_f32(sm[2 * g])), acc);
}
static inline __m256 q8_group(const int8_t *q, const uint16_t *s, const float *x, int g, __m256 acc) {
    const int8_t *qg = q + 32 * g;
    const float *xg = x + 32 * g;
    __m256 d = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)qg))),
                             _mm256_loadu_ps(xg));
    for (int i = 1; i < 4; i++) {
        __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qg + 8 * i)));
        d = _mm256_fmadd_ps(_mm256_cvtepi32_ps(w), _mm256_loadu_ps(xg + 8 * i), d);
    }
    return _mm256_fmadd_ps(d, _mm256_set1_ps(f16_to_f32(s[g])), acc);
}
#define VZERO _mm256_setzero_ps()
#define VADD _mm256_add_ps
#else
static inline float q4_group(const uint8_t *q, const uint16_t *sm, const float *x, int g, float acc) {
    float d = 0.0f;
    for (int j = 0; j < 16; j++) d += (q[16 * g + j] & 15) * x[32 * g + j] + (q[16 * g + j] >> 4) * x[32 * g + 16 + j];
    return acc + d * f16_to_f32(sm[2 * g]);
}
static inline float q8_group(const int8_t *q, const uint16_t *s, const float *x, int g, float acc) {
    float d = 0.0f;
    for (int j = 0; j < 32; j++) d += q[32 * g + j] * x[32 * g + j];
    return acc + d * f16_to_f32(s[g]);
}
static inline float hsum(float v) { return v; }
#define VZERO 0.0f
#define VADD(a, b) ((a) + (b))
#endif

static float row_q4(const uint8_t *q, const uint16_t *sm, const float *x, const float *xs, int groups) {
    float mins = 0.0f;
    for (int i = 0; i < groups; i++) mins += f16_to_f32(sm[2 * i + 1]) * xs[i];
#define Q4(G, A) q4_group(q, sm, x, G, A)
    OVER_GROUPS(VZERO, VADD, Q4)
    return hsum(acc) + mins;
}

static float row_q8(const int8_t *q, const uint16_t *s, const float *x, int groups) {
#define Q8(G, A) q8_group(q, s, x, G, A)
    OVER_GROUPS(VZERO, VADD, Q8)
    return hsum(acc);
}

static float row_bf16(const uint16_t *w, const float *x, int k) {
    int i = 0;
    float tail = 0.0f;
#if defined(__AVX512F__)
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (; i + 16 <= k; i += 16) {
        __m512i v = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w + i))), 16);
        acc[(i >> 4) & 1] = _mm512_fmadd_ps(_mm512_castsi512_ps(v), _mm512_loadu_ps(x + i), acc[(i >> 4) & 1]);
    }
    tail = hsum(_mm512_add_ps(acc[0], acc[1]));
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (; i + 8 <= k; i += 8) {
        __m256i v = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + i))), 16);
        acc[(i >> 3) & 1] = _mm256_fmadd_ps(_mm256_castsi256_ps(v), _mm256_loadu_ps(x + i), acc[(i >> 3) & 1]);
    }
    tail = hsum(_mm256_add_ps(acc[0], acc[1]));
#endif
    for (; i < k; i++) tail += bf16_to_f32(w[i]) * x[i];
    return tail;
}

static float row_f32(const float *w, const float *x, int k) {
    int i = 0;
    float tail = 0.0f;
#if defined(__AVX512F__)
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (; i + 16 <= k; i += 16)
        acc[(i >> 4) & 1] = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), acc[(i >> 4) & 1]);
    tail = hsum(_mm512_add_ps(acc[0], acc[1]));
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (; i + 8 <= k; i += 8)
        acc[(i >> 3) & 1] = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), acc[(i >> 3) & 1]);
    tail = hsum(_mm256_add_ps(acc[0], acc[1]));
#endif
    for (; i < k; i++) tail += w[i] * x[i];
    return tail;
}

void group_sums(const float *x, int k, float *xs) {
    for (int g = 0; g < k / GROUP; g++) {
        float s = 0.0f;
        for (int j = 0; j < GROUP; j++) s += x[GROUP * g + j];
        xs[g] = s;
    }
}

void mat_vec(const Mat *m, const float *x, const float *xs, float *y) {
    const int n = m->n, k = m->k, groups = k / GROUP;
    switch (m->kind) {
    case MAT_Q4:
#pragma omp parallel for schedule(static)
        for (int r = 0; r < n; r++)
            y[r] = row_q4((const uint8_t *)m->w + (long)r * (k / 2), m->s + (long)r * groups * 2, x, xs, groups);
        break;
    case MAT_Q8:
#pragma omp parallel for schedule(static)
        for (int r = 0; r < n; r++)
            y[r] = row_q8((const int8_t *)m->w + (long)r * k, m->s + (long)r * groups, x, groups);
        break;
    case MAT_BF16:
#pragma omp parallel for schedule(static)
        for (int r = 0; r < n; r++) y[r] = row_bf16((const uint16_t *)m->w + (long)r * k, x, k);
        break;
    default:
#pragma omp parallel for schedule(static)
        for (int r = 0; r < n; r++) y[r] = row_f32((const float *)m->w + (long)r * k, x, k);
    }
}

/* The Python side's check of the packing: y = W x for one matrix (tests, the bench). */
void mat_vec_one(const Mat *m, const float *x, float *y, float *xs) {
    if (m->kind == MAT_Q4) group_sums(x, m->k, xs);
    mat_vec(m, x, xs, y);
}

/* Row r of m as the values mat_vec multiplies by, in f32 or (rounded to nearest even) bf16. */
static void dequant_row(const Mat *m, long r, void *dst, int bf16) {
    const int k = m->k, groups = k / GROUP;
    float row[GROUP];
    for (int g = 0; g < (m->kind == MAT_Q4 || m->kind == MAT_Q8 ? groups : 0); g++) {
        if (m->kind == MAT_Q4) {
            const uint8_t *q = (const uint8_t *)m->w + r * (k / 2) + 16 * g;
            const float s = f16_to_f32(m->s[(r * groups + g) * 2]), mn = f16_to_f32(m->s[(r * groups + g) * 2 + 1]);
            for (int j = 0; j < 16; j++) {
                row[j] = (q[j] & 15) * s + mn;
                row[j + 16] = (q[j] >> 4) * s + mn;
            }
        } else {
            const int8_t *q = (const int8_t *)m->w + r * k + GROUP * g;
            const float s = f16_to_f32(m->s[r * groups + g]);
            for (int j = 0; j < GROUP; j++) row[j] = q[j] * s;
        }
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
