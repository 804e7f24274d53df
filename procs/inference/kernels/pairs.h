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

/* A block of nk keys (a multiple of 16; its n valid rows of D bf16 values at k, D % 64 == 0)
 * as pairs: kp [D/2][nk] (16 x 16 transposes of uint32). Rows n..nk-1 are zero: they are
 * masked, and must not be NaN (0 * NaN). */
static inline void pack_k_pairs(const uint16_t *k, int n, int nk, int D, uint32_t *restrict kp) {
    const int D2 = D / 2;
    for (int j0 = 0; j0 < nk; j0 += 16)
        for (int d0 = 0; d0 < D2; d0 += 16) {
            __m512 t[16];
            for (int j = 0; j < 16; j++)
                t[j] = j0 + j < n ? _mm512_loadu_ps((const float *)(k + (long)(j0 + j) * D) + d0) : _mm512_setzero_ps();
            transpose(t);
            for (int d = 0; d < 16; d++) _mm512_storeu_ps((float *)(kp + (long)(d0 + d) * nk + j0), t[d]);
        }
}

/* The block's V rows likewise: vp [nk/2][D] (two rows interleaved), rows n.. zero. */
static inline void pack_v_pairs(const uint16_t *v, int n, int nk, int D, uint32_t *restrict vp) {
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

static inline void pack_pairs(const uint16_t *k, const uint16_t *v, int n, int nk, int D, uint32_t *restrict kp,
                              uint32_t *restrict vp) {
    pack_k_pairs(k, n, nk, D, kp);
    pack_v_pairs(v, n, nk, D, vp);
}

/* pv_tile_bf on V rows as the cache holds them (v: n rows of D bf16, D % 64 == 0), for a
 * block read once by few queries: rows 2j and 2j+1 are interleaved in registers as they are
 * used (vpunpck[lh]wd), not stored as pairs first. The products and their order are
 * pv_tile_bf's, so each sum has the same bits; only the lanes hold another order of d: o's
 * value at d0 + p (p < 64) is that of d0 + unpacked_d(p). Rows n.. read as zero. */
static inline int unpacked_d(int p) {
    const int g = p & 32, q = p & 31;    /* 32 d per pair of loads; 16 lanes each, 4 per 128 bits */
    return g + 8 * ((q & 15) >> 2) + 4 * (q >> 4) + (q & 3);
}

static inline __attribute__((always_inline)) void pv_tile_rows(const int M, const uint32_t *restrict p2, long ldp,
                                                               int np, int n, int D, const uint16_t *restrict v,
                                                               float *restrict o) {
    for (int d0 = 0; d0 < D; d0 += 64) {
        __m512 acc[PT][4];
        for (int i = 0; i < M; i++)
            for (int q = 0; q < 4; q++) acc[i][q] = _mm512_setzero_ps();
        for (int j = 0; j < np; j++) {
            const uint16_t *a = v + (long)(2 * j) * D + d0, *b = a + D;
            const __m512i a0 = _mm512_loadu_si512(a), a1 = _mm512_loadu_si512(a + 32);
            const __m512i b0 = 2 * j + 1 < n ? _mm512_loadu_si512(b) : _mm512_setzero_si512();
            const __m512i b1 = 2 * j + 1 < n ? _mm512_loadu_si512(b + 32) : _mm512_setzero_si512();
            const VB x[4] = {(VB)_mm512_unpacklo_epi16(a0, b0), (VB)_mm512_unpackhi_epi16(a0, b0),
                             (VB)_mm512_unpacklo_epi16(a1, b1), (VB)_mm512_unpackhi_epi16(a1, b1)};
            for (int i = 0; i < M; i++) {
                const VB w = (VB)_mm512_set1_epi32((int)p2[i * ldp + j]);
                for (int q = 0; q < 4; q++) acc[i][q] = _mm512_dpbf16_ps(acc[i][q], w, x[q]);
            }
        }
        for (int i = 0; i < M; i++)
            for (int q = 0; q < 4; q++) _mm512_storeu_ps(o + (long)i * D + d0 + q * 16, acc[i][q]);
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
