/* bf16 caches on CPUs with vdpbf16ps (AVX512-BF16): each instruction sums the products of a
 * pair of bf16 values into an f32 lane, twice the rate of FMA on widened values, and the
 * K/V rows are read as the cache holds them. What prefill.c and attention.c share: packing a
 * block of K and V rows as pairs, and the register tiles of the two products.
 *
 * Pairs are uint32, the lower-indexed value in the low half. A query and its weights are
 * rounded to bf16 (a bf16 model's q is bf16 already; weights in [0, 1] lose at most 2^-9 of
 * themselves), and the caller sums the rounded weights, so a row's weights still sum to its
 * divisor. Each lane's sum runs over the pairs in one fixed order, whatever else shares the
 * tile: a query's result does not depend on which queries are scored beside it. */
#ifndef RICORDO_PAIRS_H
#define RICORDO_PAIRS_H
#include "kernels.h"
#include "simd.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PAIRS 1
#define PT 6          /* query rows per register tile: PT x 4 accumulators, 4 loads, 1 broadcast */
typedef __m512bh VB;

/* q's D values rounded to bf16 pairs: q2 [D/2] */
static inline void pairs_of(const float *restrict q, int D, uint32_t *restrict q2) {
    for (int d = 0; d < D; d += 2) q2[d / 2] = f32_to_bf16(q[d]) | (uint32_t)f32_to_bf16(q[d + 1]) << 16;
}

/* s[i * lds + j] = scale * q[i] . k[j] for the 64 keys j of kp: q2 [M][D2] pairs of d (rows
 * ldq apart), kp [D2][nk] pairs of key j (the block's first key at kp) */
static inline __attribute__((always_inline)) void score_tile_bf(const int M, const uint32_t *restrict q2, long ldq,
                                                                int D2, const uint32_t *restrict kp, int nk,
                                                                float scale, float *restrict s, long lds) {
    __m512 acc[PT][4];
    for (int i = 0; i < M; i++)
        for (int v = 0; v < 4; v++) acc[i][v] = _mm512_setzero_ps();
    for (int d = 0; d < D2; d++) {
        VB k[4];
        for (int v = 0; v < 4; v++) k[v] = (VB)_mm512_loadu_si512(kp + (long)d * nk + v * 16);
        for (int i = 0; i < M; i++) {
            const VB x = (VB)_mm512_set1_epi32((int)q2[i * ldq + d]);
            for (int v = 0; v < 4; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], x, k[v]);
        }
    }
    for (int i = 0; i < M; i++)
        for (int v = 0; v < 4; v++)
            _mm512_storeu_ps(s + i * lds + v * 16, _mm512_mul_ps(acc[i][v], _mm512_set1_ps(scale)));
}

/* o[i] += sum over the key pairs j < np, in order, of p2[i][j] . vp[j]: p2 [M] rows ldp apart,
 * vp [np][D] pairs of keys for each d; o rows D apart; strips of 64 d (D % 64 == 0) */
static inline __attribute__((always_inline)) void pv_tile_bf(const int M, const uint32_t *restrict p2, long ldp,
                                                             int np, int D, const uint32_t *restrict vp,
                                                             float *restrict o) {
    for (int d0 = 0; d0 < D; d0 += 64) {
        __m512 acc[PT][4];
        for (int i = 0; i < M; i++)
            for (int v = 0; v < 4; v++) acc[i][v] = _mm512_loadu_ps(o + (long)i * D + d0 + v * 16);
        for (int j = 0; j < np; j++) {
            VB x[4];
            for (int v = 0; v < 4; v++) x[v] = (VB)_mm512_loadu_si512(vp + (long)j * D + d0 + v * 16);
            for (int i = 0; i < M; i++) {
                const VB w = (VB)_mm512_set1_epi32((int)p2[i * ldp + j]);
                for (int v = 0; v < 4; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], w, x[v]);
            }
        }
        for (int i = 0; i < M; i++)
            for (int v = 0; v < 4; v++) _mm512_storeu_ps(o + (long)i * D + d0 + v * 16, acc[i][v]);
    }
}

/* F(M, ...) for the row count m of a tile (1..PT), M a compile-time constant */
#define PAIR_TILES(F, ...) switch (m) { \
    case 1: F(1, __VA_ARGS__); break; case 2: F(2, __VA_ARGS__); break; case 3: F(3, __VA_ARGS__); break; \
    case 4: F(4, __VA_ARGS__); break; case 5: F(5, __VA_ARGS__); break; case 6: F(6, __VA_ARGS__); break; }

/* A block of nk keys (a multiple of 16; its n valid rows of D bf16 values at k and v, D % 64
 * == 0) as pairs: kp [D/2][nk] (16 x 16 transposes of uint32), vp [nk/2][D] (two rows
 * interleaved). Rows n..nk-1 are zero: they are masked, and must not be NaN (0 * NaN). */
static inline void pack_pairs(const uint16_t *k, const uint16_t *v, int n, int nk, int D, uint32_t *restrict kp,
                              uint32_t *restrict vp) {
    const int D2 = D / 2;
    for (int j0 = 0; j0 < nk; j0 += 16)
        for (int d0 = 0; d0 < D2; d0 += 16) {
            __m512 t[16];
            for (int j = 0; j < 16; j++)
                t[j] = j0 + j < n ? _mm512_loadu_ps((const float *)(k + (long)(j0 + j) * D) + d0) : _mm512_setzero_ps();
            transpose(t);
            for (int d = 0; d < 16; d++) _mm512_storeu_ps((float *)(kp + (long)(d0 + d) * nk + j0), t[d]);
        }
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int j = 0; j < nk / 2; j++)
        for (int d0 = 0; d0 < D; d0 += 32) {
            const __m512i a = 2 * j < n ? _mm512_loadu_si512(v + (long)(2 * j) * D + d0) : _mm512_setzero_si512();
            const __m512i b = 2 * j + 1 < n ? _mm512_loadu_si512(v + (long)(2 * j + 1) * D + d0) : _mm512_setzero_si512();
            _mm512_storeu_si512(vp + (long)j * D + d0, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(vp + (long)j * D + d0 + 16, _mm512_permutex2var_epi16(a, hi, b));
        }
}

/* weights w[0..2 np) that are bf16 values already (rounded by the softmax) as pairs p2 [np] */
static inline void pair_up(const float *restrict w, int np, uint32_t *restrict p2) {
    const uint32_t *u = (const uint32_t *)w;
    for (int j = 0; j < np; j++) p2[j] = u[2 * j] >> 16 | (u[2 * j + 1] & 0xFFFF0000u);
}
#else
#define PAIRS 0
#endif
#endif
