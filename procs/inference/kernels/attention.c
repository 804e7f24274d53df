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
#include <omp.h>

#include "kernels.h"

#define CHUNK ATT_CHUNK
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

/* s[r] = scale * (q . row r of kb) for n rows of D floats */
static inline void scores(const float *restrict q, const float *restrict kb, const int D, int n, float scale,
                          float *restrict s) {
    for (int r = 0; r < n; r++) {
        const float *restrict kr = kb + r * D;
        float acc = 0.0f;
#pragma omp simd reduction(+:acc)
        for (int d = 0; d < D; d++) acc += q[d] * kr[d];
        s[r] = acc * scale;
    }
}

/* G queries against n rows of one K/V head, already widened to f32 (kb, vb: [n][D]).
 * part: [G][D + 2] = acc, max, sum. D is a compile-time constant in the specialized copies
 * below, so a query and its accumulator stay in registers. Every partial, shared chunk or
 * not, comes from this one function: a chunk's partial depends only on its rows and q. */
static inline __attribute__((always_inline)) void part_impl(
        const float *restrict q, const float *restrict kb, const float *restrict vb, int G, const int D,
        int n, float scale, float *restrict part) {
    float s[MAXG][CHUNK];
    for (int g = 0; g < G; g++) scores(q + g * D, kb, D, n, scale, s[g]);
    for (int g = 0; g < G; g++) {
        float m = -FLT_MAX, l = 0.0f, *restrict p = part + g * (D + 2);
#pragma omp simd reduction(max:m)
        for (int r = 0; r < n; r++) m = s[g][r] > m ? s[g][r] : m;
#pragma omp simd reduction(+:l)
        for (int r = 0; r < n; r++) {
            s[g][r] = exp_nonpos(s[g][r] - m);
            l += s[g][r];
        }
        float acc[MAXD];
        for (int d = 0; d < D; d++) acc[d] = 0.0f;
        for (int r = 0; r < n; r++) {
            const float w = s[g][r], *restrict vr = vb + r * D;
#pragma omp simd
            for (int d = 0; d < D; d++) acc[d] += w * vr[d];
        }
        for (int d = 0; d < D; d++) p[d] = acc[d];
        p[D] = m;
        p[D + 1] = l;
    }
}

#define SPECIALIZE(DIM)                                                                          \
    static __attribute__((noinline)) void part_##DIM(const float *q, const float *kb, const float *vb, \
                                                     int G, int n, float scale, float *part) {   \
        part_impl(q, kb, vb, G, DIM, n, scale, part);                                            \
    }
SPECIALIZE(64)
SPECIALIZE(128)
SPECIALIZE(256)

static __attribute__((noinline)) void part_any(const float *q, const float *kb, const float *vb, int G, int D,
                                               int n, float scale, float *part) {
    part_impl(q, kb, vb, G, D, n, scale, part);
}

static void partial(const float *q, const float *kb, const float *vb, int G, int D, int n, float scale,
                    float *part) {
    switch (D) {
    case 64: part_64(q, kb, vb, G, n, scale, part); break;
    case 128: part_128(q, kb, vb, G, n, scale, part); break;
    case 256: part_256(q, kb, vb, G, n, scale, part); break;
    default: part_any(q, kb, vb, G, D, n, scale, part);
    }
}

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
 * [KV*G][D]. lead[b] = a < b with shared[b] > 0: the first shared[b] whole chunks of b's rows
 * are bit for bit a's (the caller has compared them), so they are read once, from a, for
 * every query of the group; lead[b] = b: none shared. Each sequence's partials are combined
 * in its own chunk order, so row b is what it gives alone, whatever else runs. scratch: the
 * sum of decode_attention_scratch over the sequences. Returns 0, or -1 for a shape past
 * MAXG/MAXD. */
int decode_attention_many(int B, const float *const *q, const void *const *k, const void *const *v,
                          const long *head_stride, const int *S, const int *lead, const int *shared, int KV,
                          int G, int D, float scale, int bf16, float *const *out, float *scratch) {
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
            if (bf16) {
                const uint16_t *kx = (const uint16_t *)kp, *vx = (const uint16_t *)vp;
                for (long i = 0; i < (long)n * D; i++) kbuf[i] = bf16_to_f32(kx[i]);
                for (long i = 0; i < (long)n * D; i++) vbuf[i] = bf16_to_f32(vx[i]);
            } else {
                memcpy(kbuf, kp, sizeof(float) * n * D);
                memcpy(vbuf, vp, sizeof(float) * n * D);
            }
            partial(q[b] + (long)h * G * D, kbuf, vbuf, G, D, n, scale, scratch + off[b] + ((long)h * chunks[b] + c) * psize);
            if (lead[b] == b)
                for (int m = b + 1; m < B; m++)
                    if (lead[m] == b && c < own[m])
                        partial(q[m] + (long)h * G * D, kbuf, vbuf, G, D, n, scale,
                                scratch + off[m] + ((long)h * chunks[m] + c) * psize);
        }
    }
    /* combine the chunks of each (sequence, head, query) in chunk order */
#pragma omp parallel for schedule(static)
    for (long t = 0; t < (long)B * KV * G; t++) {
        const int b = (int)(t / (KV * G)), h = (int)(t / G % KV), g = (int)(t % G), nc = chunks[b];
        const float *base = scratch + off[b] + (long)h * nc * psize + g * (D + 2);
        float m = -FLT_MAX, l = 0.0f, *o = out[b] + ((long)h * G + g) * D;
        for (int c = 0; c < nc; c++) m = base[c * psize + D] > m ? base[c * psize + D] : m;
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
 * floats. bf16: 1 for bfloat16 K/V, 0 for float32. Returns 0, or -1 for shapes past
 * MAXG/MAXD. */
int decode_attention(const float *q, const void *k, const void *v, long head_stride, int KV, int G,
                     int D, int S, float scale, int bf16, float *out, float *scratch) {
    const int none = 0, self = 0;
    return decode_attention_many(1, &q, &k, &v, &head_stride, &S, &self, &none, KV, G, D, scale, bf16, &out,
                                 scratch);
}

/* Whether a model's grouping (query heads per K/V head) and head dim fit the task buffers. */
int decode_attention_takes(int G, int D) { return G >= 1 && G <= MAXG && D >= 1 && D <= MAXD; }
