/* What the attention kernels share: the vector width of this build, its register
 * transpose, and exp for the softmax. */
#ifndef RICORDO_SIMD_H
#define RICORDO_SIMD_H
#include <stdint.h>

/* exp(x) for x <= 0 (arguments are score - max): 2^(x log2 e) as 2^n * 2^f, f in [-0.5, 0.5],
 * a degree-6 polynomial for 2^f (relative error < 2e-7); straight-line code that vectorizes. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f;
    float n = __builtin_roundf(t);
    float f = t - n;
    float p = 1.5353362e-4f;
    p = p * f + 1.3398874e-3f;
    p = p * f + 9.6184183e-3f;
    p = p * f + 5.5503406e-2f;
    p = p * f + 2.4022650e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * c.f;
}

/* Vectors of VW floats: AVX-512, AVX2 (with FMA), or none (VW undefined: portable loops). */
#if defined(__AVX512F__)
#include <immintrin.h>
#define VW 16
typedef __m512 VF;
#define VLOADU _mm512_loadu_ps
#define VFMA _mm512_fmadd_ps
#define VSET1 _mm512_set1_ps
#define VMUL _mm512_mul_ps
#define VSTOREU _mm512_storeu_ps
#define VZERO _mm512_setzero_ps()
/* t[i] = row i's 16 values -> t[j] = value j of the 16 rows */
static inline __attribute__((always_inline)) void transpose(VF *t) {
    VF u[16];
    for (int i = 0; i < 8; i++) {
        u[2 * i] = _mm512_unpacklo_ps(t[2 * i], t[2 * i + 1]);
        u[2 * i + 1] = _mm512_unpackhi_ps(t[2 * i], t[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(u[4 * i]), b = _mm512_castps_pd(u[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(u[4 * i + 2]), d = _mm512_castps_pd(u[4 * i + 3]);
        t[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        t[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        t[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        t[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int k = 0; k < 4; k++) {
        const VF x0 = _mm512_shuffle_f32x4(t[k], t[4 + k], 0x88), x1 = _mm512_shuffle_f32x4(t[k], t[4 + k], 0xDD);
        const VF y0 = _mm512_shuffle_f32x4(t[8 + k], t[12 + k], 0x88), y1 = _mm512_shuffle_f32x4(t[8 + k], t[12 + k], 0xDD);
        u[k] = _mm512_shuffle_f32x4(x0, y0, 0x88);
        u[8 + k] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
        u[4 + k] = _mm512_shuffle_f32x4(x1, y1, 0x88);
        u[12 + k] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
    }
    for (int i = 0; i < 16; i++) t[i] = u[i];
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VW 8
typedef __m256 VF;
#define VLOADU _mm256_loadu_ps
#define VFMA _mm256_fmadd_ps
#define VSET1 _mm256_set1_ps
#define VMUL _mm256_mul_ps
#define VSTOREU _mm256_storeu_ps
#define VZERO _mm256_setzero_ps()
static inline __attribute__((always_inline)) void transpose(VF *t) {
    VF u[8], v[8];
    for (int i = 0; i < 4; i++) {
        u[2 * i] = _mm256_unpacklo_ps(t[2 * i], t[2 * i + 1]);
        u[2 * i + 1] = _mm256_unpackhi_ps(t[2 * i], t[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        v[4 * i] = _mm256_shuffle_ps(u[4 * i], u[4 * i + 2], 0x44);
        v[4 * i + 1] = _mm256_shuffle_ps(u[4 * i], u[4 * i + 2], 0xEE);
        v[4 * i + 2] = _mm256_shuffle_ps(u[4 * i + 1], u[4 * i + 3], 0x44);
        v[4 * i + 3] = _mm256_shuffle_ps(u[4 * i + 1], u[4 * i + 3], 0xEE);
    }
    for (int k = 0; k < 4; k++) {
        t[k] = _mm256_permute2f128_ps(v[k], v[4 + k], 0x20);
        t[4 + k] = _mm256_permute2f128_ps(v[k], v[4 + k], 0x31);
    }
}
#endif

#endif
