/* What the native decode kernels share: the weight matrix a decode step reads, and the
 * entry points of each source file (built together into one library by native.py). */
#ifndef RICORDO_KERNELS_H
#define RICORDO_KERNELS_H
#include <stdint.h>

/* Matrix kinds. Rows are the output dim (n), each row k values; quantized rows are groups of
 * GROUP values with their own f16 scale (int4 also an f16 min: w = q * scale + min). */
enum { MAT_F32 = 0, MAT_BF16 = 1, MAT_Q4 = 2, MAT_Q8 = 3, MAT_Q5 = 4 };
#define GROUP 32
#define ATT_CHUNK 128   /* attention.c's rows per task: shared prefixes are whole chunks */
#define Q5_ROW(k) ((long)(k) / 2 + (long)(k) / GROUP * 4)

typedef struct {
    int32_t kind, n, k, pad;
    /* F32/BF16: [n][k]. Q4: uint8 [n][k/2], group g's byte j holds value j (low nibble) and
     * value j + 16 (high nibble). Q8: int8 [n][k]. Q5 (GGUF's Q5_0 levels, 5.5 bits a value):
     * row r at r * Q5_ROW(k) bytes, its k/2 nibble bytes laid out as Q4's, then k/GROUP uint32
     * of high bits (bit j: value j of the group); value = (nibble | high << 4) - 16. */
    const void *w;
    /* Q4: f16 [n][k/GROUP][2] (scale, min); Q8, Q5: f16 [n][k/GROUP] (scale); else unused */
    const uint16_t *s;
} Mat;

/* y[n] = W x for x [k] f32; xs: per-group sums of x (Q4 only, k/GROUP of them). Rows are
 * split across threads statically and each row is summed in one fixed order: the result does
 * not depend on the thread count. */
void mat_vec(const Mat *m, const float *x, const float *xs, float *y);
void group_sums(const float *x, int k, float *xs);
void mat_mul(const Mat *m, int B, const float *x, long ldx, const float *xs, long ldxs, float *y, long ldy);

int decode_attention(const float *q, const void *k, const void *v, long head_stride, int KV, int G,
                     int D, int S, float scale, int bf16, float *out, float *scratch);
long decode_attention_scratch(int KV, int G, int D, int S);
int decode_attention_many(int B, const float *const *q, const void *const *k, const void *const *v,
                          const long *head_stride, const int *S, const int *lead, const int *shared, int KV,
                          int G, int D, float scale, int bf16, float *const *out, float *scratch);

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

/* round to nearest even, as torch's .to(torch.bfloat16) (finite values) */
static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } c;
    c.f = f;
    return (uint16_t)((c.u + 0x7FFFu + ((c.u >> 16) & 1u)) >> 16);
}

/* count values of K and V rows (bf16 or f32) into f32 buffers kr and vb */
static inline void widen_rows(const void *k, const void *v, int bf16, long count, float *kr, float *vb) {
    if (bf16) {
        const uint16_t *kx = (const uint16_t *)k, *vx = (const uint16_t *)v;
        for (long i = 0; i < count; i++) kr[i] = bf16_to_f32(kx[i]);
        for (long i = 0; i < count; i++) vb[i] = bf16_to_f32(vx[i]);
    } else {
        for (long i = 0; i < count; i++) kr[i] = ((const float *)k)[i];
        for (long i = 0; i < count; i++) vb[i] = ((const float *)v)[i];
    }
}
#endif
