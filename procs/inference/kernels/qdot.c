/* 4- and 8-bit weights times int8 activations: decode's matrix products on quantized weights
 * as integer dot products (llama.cpp's way), with the output rows in the vector lanes.
 *
 * Why: widening each group to f32 and folding its scale (and min) in cost ~10 vector ops per
 * 32 weights, more than the 2 FMAs a row then takes; decode was bound by that arithmetic, not
 * by the weight bytes, and a batch of 4 rows cost 1.8x one. Here the weights of 16 rows widen
 * to bytes in 3 ops per 64 bytes (int4) or none (int8), and a row takes one vpdpbusd
 * (AVX-512 VNNI) or vpmaddubsw + vpmaddwd (AVX2, AVX-512BW) per 4 values of 16 (8) rows,
 * with no horizontal sums.
 *
 * Layouts (kernels.h MAT_Q4, MAT_Q8): rows in blocks of QROWS = 16 (the last padded with zero
 * rows), then groups of 32 values; a block's group is chunks of 64 bytes, byte 4*r + e of a
 * chunk belonging to row r of the block (so 4 consecutive values of a row are one 32-bit
 * lane of a 16-lane register).
 * - Q4: 256 bytes at w + (b * groups + g) * 256: chunk c (0-3), byte 4r + e holds value
 *   4c + e of row r's group in its low nibble, value 16 + 4c + e in its high nibble; f16
 *   [16] scales and [16] mins at s + (b * groups + g) * 32.
 * - Q8: 512 bytes at w + (b * groups + g) * 512: chunk c (0-7), byte 4r + e holds value
 *   4c + e plus 128 (unsigned: vpdpbusd's first operand); f16 [16] scales at s + (b *
 *   groups + g) * 16.
 *
 * Activations: each row of x is quantized per group of 32 to int8 (d = max |x| / 127,
 * q8 = round-to-even(x / d)), as llama.cpp's Q8_1:
 *     Q4: y[r] = sum over g of  scale[r,g] * d[g] * (sum_j q4[r,g,j] * q8[g,j])  +  min[r,g] * d[g] * (sum_j q8[g,j])
 *     Q8: y[r] = sum over g of  scale[r,g] * d[g] * (sum_j w8[r,g,j] * q8[g,j])
 * in that order, one f32 accumulator per row (Q4: acc = fma(min, dsum, fma(isum, scale*d,
 * acc))). The integer sums are exact, and every path (AVX-512, AVX2, portable) does the same
 * float operations in the same order per row, so every build gives the same bits, and a
 * row's value does not depend on the other rows of the batch or on the thread count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define QB 256                /* bytes of one block's group */
#define INLINE static inline __attribute__((always_inline))

/* One activation row of k values to int8 groups: q [k], d [k/GROUP] (the step), qs
 * [k/GROUP] (the sum of the group's int8 values) and dsum = d * qs (int4's min term then
 * multiplies the same dequantized x as its scale term: the row is W times the dequantized x
 * to f32 rounding). Exact operations but the rounding of the step and of q: every build
 * gives the same bytes. */
static void quantize_row(const float *x, int k, int8_t *q, float *d, int32_t *qs, float *dsum) {
    for (int g = 0; g < k / GROUP; g++) {
        const float *xg = x + GROUP * g;
        float amax = 0.0f;
        for (int j = 0; j < GROUP; j++) {
            const float a = fabsf(xg[j]);
            amax = a > amax ? a : amax;
        }
        const float step = amax / 127.0f, inv = step > 0.0f ? 1.0f / step : 0.0f;
        int32_t s = 0;
        for (int j = 0; j < GROUP; j++) {
            q[GROUP * g + j] = (int8_t)lrintf(xg[j] * inv);
            s += q[GROUP * g + j];
        }
        d[g] = step;
        qs[g] = s;
        dsum[g] = step * (float)s;
    }
}

/* The quantized activation rows of one call: row b's int8 values at q + b * k, its groups'
 * step, int8 sum and step * sum at d, qs, dsum + b * groups. */
typedef struct {
    const int8_t *q;
    const float *d, *dsum;
    const int32_t *qs;
    long k, groups;
} Acts;

/* NB activation rows at most per pass over a block's weights (kernels.h's batches are split) */
#define NB 4
#define XQ(a, b, g) ((const int32_t *)((a)->q + (b) * (a)->k + GROUP * (g)))   /* row b's group g, 4 at a time */
#define D(a, b, g) ((a)->d[(b) * (a)->groups + (g)])

#if defined(__AVX512BW__)
/* 16 rows of block w (its groups), nb activation rows: out[b][16] */
INLINE void block_q4(const uint8_t *w, const uint16_t *s, int groups, const Acts *a, int b0, float out[][QROWS],
                     const int nb) {
    const __m512i lo4 = _mm512_set1_epi8(15);
    __m512 acc[NB];
    for (int b = 0; b < nb; b++) acc[b] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const uint8_t *p = w + (long)g * QB;
        __m512i u[8];
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512((const void *)(p + 64 * c));
            u[c] = _mm512_and_si512(v, lo4);
            u[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
        }
        const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + 32L * g)));
        const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + 32L * g + 16)));
        for (int b = 0; b < nb; b++) {
            const int32_t *xq = XQ(a, b0 + b, g);
#if defined(__AVX512VNNI__)
            __m512i i = _mm512_setzero_si512();
            for (int c = 0; c < 8; c++) i = _mm512_dpbusd_epi32(i, u[c], _mm512_set1_epi32(xq[c]));
#else       /* pair sums <= 2*15*127, eight of them < 2^15: no saturation */
            __m512i t = _mm512_maddubs_epi16(u[0], _mm512_set1_epi32(xq[0]));
            for (int c = 1; c < 8; c++) t = _mm512_add_epi16(t, _mm512_maddubs_epi16(u[c], _mm512_set1_epi32(xq[c])));
            const __m512i i = _mm512_madd_epi16(t, _mm512_set1_epi16(1));
#endif
            const __m512 sd = _mm512_mul_ps(sc, _mm512_set1_ps(D(a, b0 + b, g)));
            acc[b] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a->dsum[(b0 + b) * a->groups + g]),
                                     _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), sd, acc[b]));
        }
    }
    for (int b = 0; b < nb; b++) _mm512_storeu_ps(out[b], acc[b]);
}

INLINE void block_q8(const uint8_t *w, const uint16_t *s, int groups, const Acts *a, int b0, float out[][QROWS],
                     const int nb) {
    __m512 acc[NB];
    for (int b = 0; b < nb; b++) acc[b] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const uint8_t *p = w + (long)g * 2 * QB;
        __m512i u[8];
#if !defined(__AVX512VNNI__)
        __mmask64 neg[8];                   /* |w| times x with w's sign: products <= 128*127 */
        for (int c = 0; c < 8; c++) {
            const __m512i v = _mm512_xor_si512(_mm512_loadu_si512((const void *)(p + 64 * c)), _mm512_set1_epi8(-128));
            neg[c] = _mm512_movepi8_mask(v);
            u[c] = _mm512_abs_epi8(v);
        }
#else
        for (int c = 0; c < 8; c++) u[c] = _mm512_loadu_si512((const void *)(p + 64 * c));
#endif
        const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + 16L * g)));
        for (int b = 0; b < nb; b++) {
            const int32_t *xq = XQ(a, b0 + b, g);
            __m512i i = _mm512_setzero_si512();
#if defined(__AVX512VNNI__)     /* sum (w + 128) x, less 128 sum x */
            for (int c = 0; c < 8; c++) i = _mm512_dpbusd_epi32(i, u[c], _mm512_set1_epi32(xq[c]));
            i = _mm512_sub_epi32(i, _mm512_set1_epi32(128 * a->qs[(b0 + b) * a->groups + g]));
#else
            for (int c = 0; c < 8; c++) {
                const __m512i x = _mm512_set1_epi32(xq[c]);
                const __m512i t = _mm512_maddubs_epi16(u[c], _mm512_mask_sub_epi8(x, neg[c], _mm512_setzero_si512(), x));
                i = _mm512_add_epi32(i, _mm512_madd_epi16(t, _mm512_set1_epi16(1)));
            }
#endif
            acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(sc, _mm512_set1_ps(D(a, b0 + b, g))), acc[b]);
        }
    }
    for (int b = 0; b < nb; b++) _mm512_storeu_ps(out[b], acc[b]);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* the block as two halves of 8 rows (bytes 32h..32h+31 of each chunk, scales 8h..8h+7) */
INLINE void half_q4(const uint8_t *w, const uint16_t *s, int groups, const Acts *a, int b0, float out[][QROWS],
                    const int nb, const int h) {
    const __m256i lo4 = _mm256_set1_epi8(15), one = _mm256_set1_epi16(1);
    __m256 acc[NB];
    for (int b = 0; b < nb; b++) acc[b] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const uint8_t *p = w + (long)g * QB + 32 * h;
        __m256i u[8];
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * c));
            u[c] = _mm256_and_si256(v, lo4);
            u[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
        }
        const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 32L * g + 8 * h)));
        const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 32L * g + 16 + 8 * h)));
        for (int b = 0; b < nb; b++) {
            const int32_t *xq = XQ(a, b0 + b, g);
            __m256i t = _mm256_maddubs_epi16(u[0], _mm256_set1_epi32(xq[0]));
            for (int c = 1; c < 8; c++) t = _mm256_add_epi16(t, _mm256_maddubs_epi16(u[c], _mm256_set1_epi32(xq[c])));
            const __m256 sd = _mm256_mul_ps(sc, _mm256_set1_ps(D(a, b0 + b, g)));
            acc[b] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a->dsum[(b0 + b) * a->groups + g]),
                                     _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(t, one)), sd, acc[b]));
        }
    }
    for (int b = 0; b < nb; b++) _mm256_storeu_ps(out[b] + 8 * h, acc[b]);
}
INLINE void block_q4(const uint8_t *w, const uint16_t *s, int groups, const Acts *a, int b0, float out[][QROWS],
                     const int nb) {
    half_q4(w, s, groups, a, b0, out, nb, 0);
    half_q4(w, s, groups, a, b0, out, nb, 1);
}

INLINE void half_q8(const uint8_t *w, const uint16_t *s, int groups, const Acts *a, int b0, float out[][QROWS],
                    const int nb, const int h) {
    const __m256i one = _mm256_set1_epi16(1);
    __m256 acc[NB];
    for (int b = 0; b < nb; b++) acc[b] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const uint8_t *p = w + (long)g * 2 * QB + 32 * h;
        __m256i u[8], sg[8];                /* |w| times x with w's sign: products <= 128*127 */
        for (int c = 0; c < 8; c++) {
            sg[c] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 64 * c)), _mm256_set1_epi8(-128));
            u[c] = _mm256_abs_epi8(sg[c]);
        }
        const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 16L * g + 8 * h)));
        for (int b = 0; b < nb; b++) {
            const int32_t *xq = XQ(a, b0 + b, g);
            __m256i i = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i t = _mm256_maddubs_epi16(u[c], _mm256_sign_epi8(_mm256_set1_epi32(xq[c]), sg[c]));
                i = _mm256_add_epi32(i, _mm256_madd_epi16(t, one));
            }
            acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(sc, _mm256_set1_ps(D(a, b0 + b, g))), acc[b]);
        }
    }
    for (int b = 0; b < nb; b++) _mm256_storeu_ps(out[b] + 8 * h, acc[b]);
}
INLINE void block_q8(const uint8_t *w, const uint16_t *s, int groups, const Acts *a, int b0, float out[][QROWS],
                     const int nb) {
    half_q8(w, s, groups, a, b0, out, nb, 0);
    half_q8(w, s, groups, a, b0, out, nb, 1);
}
#else
INLINE void block_q4(const uint8_t *w, const uint16_t *s, int groups, const Acts *a, int b0, float out[][QROWS],
                     const int nb) {
    for (int b = 0; b < nb; b++)
        for (int r = 0; r < QROWS; r++) {
            float acc = 0.0f;
            for (int g = 0; g < groups; g++) {
                const uint8_t *p = w + (long)g * QB + 4 * r;
                const int8_t *xq = (const int8_t *)XQ(a, b0 + b, g);
                int32_t i = 0;
                for (int c = 0; c < 4; c++)
                    for (int e = 0; e < 4; e++)
                        i += (p[64 * c + e] & 15) * xq[4 * c + e] + (p[64 * c + e] >> 4) * xq[16 + 4 * c + e];
                const float sd = f16_to_f32(s[32L * g + r]) * D(a, b0 + b, g);
                acc = fmaf(f16_to_f32(s[32L * g + 16 + r]), a->dsum[(b0 + b) * a->groups + g], fmaf((float)i, sd, acc));
            }
            out[b][r] = acc;
        }
}

INLINE void block_q8(const uint8_t *w, const uint16_t *s, int groups, const Acts *a, int b0, float out[][QROWS],
                     const int nb) {
    for (int b = 0; b < nb; b++)
        for (int r = 0; r < QROWS; r++) {
            float acc = 0.0f;
            for (int g = 0; g < groups; g++) {
                const uint8_t *p = w + (long)g * 2 * QB + 4 * r;
                const int8_t *xq = (const int8_t *)XQ(a, b0 + b, g);
                int32_t i = 0;
                for (int c = 0; c < 8; c++)
                    for (int e = 0; e < 4; e++) i += ((int)p[64 * c + e] - 128) * xq[4 * c + e];
                acc = fmaf((float)i, f16_to_f32(s[16L * g + r]) * D(a, b0 + b, g), acc);
            }
            out[b][r] = acc;
        }
}
#endif

/* y[b][r] = (W x[b])[r] for B activation rows x (ldx apart), y rows ldy apart, W int4 or int8
 * blocks. Blocks are split across threads statically; each is read once per NB activation
 * rows. Returns -1 when the scratch cannot be had. */
int mat_mul_q(const Mat *m, int B, const float *x, long ldx, float *y, long ldy) {
    const int k = m->k, groups = k / GROUP, n = m->n, blocks = (n + QROWS - 1) / QROWS, q8 = m->kind == MAT_Q8;
    int8_t *q = malloc((size_t)B * k + 3 * sizeof(float) * (size_t)B * groups);
    if (!q) return -1;
    float *d = (float *)(q + (size_t)B * k), *dsum = d + (size_t)B * groups;
    int32_t *qs = (int32_t *)(dsum + (size_t)B * groups);
    for (int b = 0; b < B; b++)
        quantize_row(x + b * ldx, k, q + (long)b * k, d + (long)b * groups, qs + (long)b * groups, dsum + (long)b * groups);
    const Acts acts = {q, d, dsum, qs, k, groups};
    const uint8_t *w = (const uint8_t *)m->w;
    const long wstep = (long)groups * QB * (q8 ? 2 : 1), sstep = (long)groups * (q8 ? 16 : 32);
#pragma omp parallel for schedule(static)
    for (int blk = 0; blk < blocks; blk++) {
        const uint8_t *wb = w + blk * wstep;
        const uint16_t *sb = m->s + blk * sstep;
        const int rows = n - blk * QROWS < QROWS ? n - blk * QROWS : QROWS;
        float out[NB][QROWS];
        for (int b0 = 0; b0 < B; b0 += NB) {
            const int nb = B - b0 < NB ? B - b0 : NB;
#define CALL(F) switch (nb) {                                               case 1: F(wb, sb, groups, &acts, b0, out, 1); break;              case 2: F(wb, sb, groups, &acts, b0, out, 2); break;              case 3: F(wb, sb, groups, &acts, b0, out, 3); break;              default: F(wb, sb, groups, &acts, b0, out, 4); }
            if (q8) {
                CALL(block_q8)
            } else {
                CALL(block_q4)
            }
            for (int b = 0; b < nb; b++) memcpy(y + (b0 + b) * ldy + (long)blk * QROWS, out[b], sizeof(float) * rows);
        }
    }
    free(q);
    return 0;
}

static inline int32_t ld32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if defined(__AVX512F__)
/* 16 values (f32) to dst as f32, or as bf16 rounded to nearest even (f32_to_bf16's rule) */
static inline void put16(__m512 v, void *dst, int bf16) {
    if (!bf16) {
        _mm512_storeu_ps(dst, v);
        return;
    }
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
    _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi32_epi16(r));
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline void put8(__m256 v, void *dst, int bf16) {
    if (!bf16) {
        _mm256_storeu_ps(dst, v);
        return;
    }
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
    _mm_storeu_si128((__m128i *)dst, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
#endif

/* Row r (kind Q4 or Q8) as the values it stands for (q * scale + min, or (w - 128) * scale),
 * in f32 or (rounded to nearest even) bf16: dst [k]. A row's 4-byte pieces are gathered
 * from its group's chunks straight into a register (prefill dequantizes every weight this way
 * per call: a detour through memory cost it 2x). */
void q_row(const Mat *m, long r, void *dst, int bf16) {
    const int groups = m->k / GROUP, lane = (int)(r % QROWS), q8 = m->kind == MAT_Q8, es = bf16 ? 2 : 4;
    const long first = (r / QROWS) * groups;
    for (int g = 0; g < groups; g++) {
        const long at = first + g;
        char *out = (char *)dst + (long)GROUP * g * es;
#if defined(__AVX512F__)
        if (q8) {
            const uint8_t *p = (const uint8_t *)m->w + at * 2 * QB + 4 * lane;
            const __m512 s = _mm512_set1_ps(f16_to_f32(m->s[at * 16 + lane]));
            for (int h = 0; h < 2; h++) {
                const __m128i v = _mm_setr_epi32(ld32(p + 256 * h), ld32(p + 256 * h + 64), ld32(p + 256 * h + 128),
                                                 ld32(p + 256 * h + 192));
                const __m512i w = _mm512_sub_epi32(_mm512_cvtepu8_epi32(v), _mm512_set1_epi32(128));
                put16(_mm512_mul_ps(_mm512_cvtepi32_ps(w), s), out + 16 * h * es, bf16);
            }
        } else {
            const uint8_t *p = (const uint8_t *)m->w + at * QB + 4 * lane;
            const __m512 s = _mm512_set1_ps(f16_to_f32(m->s[at * 32 + lane])), mn = _mm512_set1_ps(f16_to_f32(m->s[at * 32 + 16 + lane]));
            const __m512i b = _mm512_cvtepu8_epi32(_mm_setr_epi32(ld32(p), ld32(p + 64), ld32(p + 128), ld32(p + 192)));
            put16(_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))), s, mn), out, bf16);
            put16(_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), s, mn), out + 16 * es, bf16);
        }
#elif defined(__AVX2__) && defined(__FMA__)
        const uint8_t *p = (const uint8_t *)m->w + at * (q8 ? 2 : 1) * QB + 4 * lane;
        const __m128i v0 = _mm_setr_epi32(ld32(p), ld32(p + 64), ld32(p + 128), ld32(p + 192));
        if (q8) {
            const __m256 s = _mm256_set1_ps(f16_to_f32(m->s[at * 16 + lane]));
            const __m128i v1 = _mm_setr_epi32(ld32(p + 256), ld32(p + 320), ld32(p + 384), ld32(p + 448));
            const __m128i part[4] = {v0, _mm_srli_si128(v0, 8), v1, _mm_srli_si128(v1, 8)};
            for (int i = 0; i < 4; i++) {
                const __m256i w = _mm256_sub_epi32(_mm256_cvtepu8_epi32(part[i]), _mm256_set1_epi32(128));
                put8(_mm256_mul_ps(_mm256_cvtepi32_ps(w), s), out + 8 * i * es, bf16);
            }
        } else {
            const __m256 s = _mm256_set1_ps(f16_to_f32(m->s[at * 32 + lane])), mn = _mm256_set1_ps(f16_to_f32(m->s[at * 32 + 16 + lane]));
            const __m256i m15 = _mm256_set1_epi32(15);
            for (int i = 0; i < 2; i++) {
                const __m256i b = _mm256_cvtepu8_epi32(i ? _mm_srli_si128(v0, 8) : v0);
                put8(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, m15)), s, mn), out + 8 * i * es, bf16);
                put8(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), s, mn), out + (16 + 8 * i) * es, bf16);
            }
        }
#else
        uint8_t b[GROUP];
        float v[GROUP];
        if (q8) {
            const uint8_t *p = (const uint8_t *)m->w + at * 2 * QB + 4 * lane;
            for (int c = 0; c < 8; c++) memcpy(b + 4 * c, p + 64 * c, 4);
            const float s = f16_to_f32(m->s[at * 16 + lane]);
            for (int j = 0; j < GROUP; j++) v[j] = (float)((int)b[j] - 128) * s;
        } else {
            const uint8_t *p = (const uint8_t *)m->w + at * QB + 4 * lane;
            for (int c = 0; c < 4; c++) memcpy(b + 4 * c, p + 64 * c, 4);
            const float s = f16_to_f32(m->s[at * 32 + lane]), mn = f16_to_f32(m->s[at * 32 + 16 + lane]);
            for (int j = 0; j < 16; j++) {
                v[j] = fmaf((float)(b[j] & 15), s, mn);
                v[16 + j] = fmaf((float)(b[j] >> 4), s, mn);
            }
        }
        if (bf16)
            for (int j = 0; j < GROUP; j++) ((uint16_t *)out)[j] = f32_to_bf16(v[j]);
        else
            memcpy(out, v, sizeof v);
#endif
    }
}
