/* Single-query attention for decode on the CPU: one query row per head against S cached
 * keys, at memory bandwidth.
 *
 * The K/V rows are read once each: every K/V head's G query heads (GQA) are scored against a
 * key row while it is in cache, and the softmax is the streaming (flash-decoding) kind, so V
 * is read once too. Work is split into fixed tasks of (K/V head, CHUNK rows) whose partial
 * (max, sum, acc) are combined afterwards in task order: the result does not depend on the
 * thread count or schedule, only on S (deterministic, as --deterministic needs).
 *
 * Built by procs/inference/native.py with the other kernels (-O3 -march=native -fopenmp, reassociation allowed so the
 * reductions vectorize: a given build is still deterministic); OpenMP is torch's own
 * runtime (the same libgomp.so.1 soname, already loaded), so torch.set_num_threads applies.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define CHUNK 128
#define MAXG 16
#define MAXD 256

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

/* count elements from offset `from` of a head as f32: bf16 widened (exact), f32 copied. */
static inline void widen(const void *base, int bf16, long from, long count, float *restrict dst) {
    if (bf16) {
        const uint16_t *restrict x = (const uint16_t *)base + from;
        for (long i = 0; i < count; i++) dst[i] = bf16_to_f32(x[i]);
    } else {
        memcpy(dst, (const float *)base + from, sizeof(float) * count);
    }
}

/* One task: G queries against rows [r0, r1) of one K/V head. part: [G][D + 2] = acc, max, sum.
 * The chunk's K rows, then its V rows, are widened to f32 once into buf (L2-resident), then
 * each query streams through them: D is a compile-time constant in the specialized copies
 * below, so a query and its accumulator stay in registers. */
static inline __attribute__((always_inline)) void task_impl(
        const float *restrict q, const void *k, const void *v, int bf16, int G, const int D, int r0,
        int r1, float scale, float *restrict part, float *restrict buf) {
    float s[MAXG][CHUNK];
    const int n = r1 - r0;
    widen(k, bf16, (long)r0 * D, (long)n * D, buf);
    for (int g = 0; g < G; g++) {
        const float *restrict qg = q + g * D;
        for (int r = 0; r < n; r++) {
            const float *restrict kr = buf + r * D;
            float acc = 0.0f;
#pragma omp simd reduction(+:acc)
            for (int d = 0; d < D; d++) acc += qg[d] * kr[d];
            s[g][r] = acc * scale;
        }
    }
    widen(v, bf16, (long)r0 * D, (long)n * D, buf);
    for (int g = 0; g < G; g++) {
        float m = -FLT_MAX, l = 0.0f, *restrict p = part + g * (D + 2);
        for (int r = 0; r < n; r++) m = s[g][r] > m ? s[g][r] : m;
#pragma omp simd reduction(+:l)
        for (int r = 0; r < n; r++) {
            s[g][r] = exp_nonpos(s[g][r] - m);
            l += s[g][r];
        }
        float acc[MAXD];
        for (int d = 0; d < D; d++) acc[d] = 0.0f;
        for (int r = 0; r < n; r++) {
            const float w = s[g][r], *restrict vr = buf + r * D;
#pragma omp simd
            for (int d = 0; d < D; d++) acc[d] += w * vr[d];
        }
        for (int d = 0; d < D; d++) p[d] = acc[d];
        p[D] = m;
        p[D + 1] = l;
    }
}

#define SPECIALIZE(DIM)                                                                        \
    static void task_##DIM(const float *q, const void *k, const void *v, int bf16, int G, int r0, \
                           int r1, float scale, float *part, float *buf) {                     \
        task_impl(q, k, v, bf16, G, DIM, r0, r1, scale, part, buf);                            \
    }
SPECIALIZE(64)
SPECIALIZE(128)
SPECIALIZE(256)

static void task(const float *q, const void *k, const void *v, int bf16, int G, int D, int r0, int r1,
                 float scale, float *part) {
    float buf[CHUNK * MAXD];
    switch (D) {
    case 64: task_64(q, k, v, bf16, G, r0, r1, scale, part, buf); break;
    case 128: task_128(q, k, v, bf16, G, r0, r1, scale, part, buf); break;
    case 256: task_256(q, k, v, bf16, G, r0, r1, scale, part, buf); break;
    default: task_impl(q, k, v, bf16, G, D, r0, r1, scale, part, buf);
    }
}

/* q: [KV*G][D] f32; k, v: head h's row r at base + h*head_stride + r*D (elements), S rows;
 * out: [KV*G][D] f32; scratch: at least decode_attention_scratch(KV, G, D, S) floats.
 * bf16: 1 for bfloat16 K/V, 0 for float32. Returns 0, or -1 for shapes past MAXG/MAXD. */
long decode_attention_scratch(int KV, int G, int D, int S) {
    long chunks = (S + CHUNK - 1) / CHUNK;
    return (long)KV * chunks * G * (D + 2);
}

int decode_attention(const float *q, const void *k, const void *v, long head_stride, int KV, int G,
                     int D, int S, float scale, int bf16, float *out, float *scratch) {
    if (G > MAXG || D > MAXD || S <= 0) return -1;
    int chunks = (S + CHUNK - 1) / CHUNK;
    long tasks = (long)KV * chunks, psize = (long)G * (D + 2);
#pragma omp parallel for schedule(static)
    for (long t = 0; t < tasks; t++) {
        int h = (int)(t / chunks), c = (int)(t % chunks);
        int r0 = c * CHUNK, r1 = r0 + CHUNK < S ? r0 + CHUNK : S;
        const float *qh = q + (long)h * G * D;
        float *part = scratch + t * psize;
        long off = h * head_stride * (bf16 ? 2 : 4);
        task(qh, (const char *)k + off, (const char *)v + off, bf16, G, D, r0, r1, scale, part);
    }
    /* combine the chunks of each (head, query) in chunk order */
    for (int h = 0; h < KV; h++)
        for (int g = 0; g < G; g++) {
            float m = -FLT_MAX, l = 0.0f, *o = out + ((long)h * G + g) * D;
            for (int c = 0; c < chunks; c++) {
                float pm = scratch[((long)h * chunks + c) * psize + g * (D + 2) + D];
                m = pm > m ? pm : m;
            }
            memset(o, 0, sizeof(float) * D);
            for (int c = 0; c < chunks; c++) {
                const float *p = scratch + ((long)h * chunks + c) * psize + g * (D + 2);
                float w = expf(p[D] - m);
                l += w * p[D + 1];
                for (int d = 0; d < D; d++) o[d] += w * p[d];
            }
            float inv = 1.0f / l;
            for (int d = 0; d < D; d++) o[d] *= inv;
        }
    return 0;
}

/* Whether a model's grouping (query heads per K/V head) and head dim fit the task buffers. */
int decode_attention_takes(int G, int D) { return G >= 1 && G <= MAXG && D >= 1 && D <= MAXD; }
