/* What the native decode kernels share: the weight matrix a decode step reads, and the
 * entry points of each source file (built together into one library by native.py). */
#ifndef RICORDO_KERNELS_H
#define RICORDO_KERNELS_H
#include <math.h>
#include <stdint.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* Matrix kinds. Rows are the output dim (n), each row k values; quantized rows are groups of
 * GROUP values with their own f16 scale (int4 also an f16 min: w = q * scale + min). */
enum { MAT_F32 = 0, MAT_BF16 = 1, MAT_Q4 = 2, MAT_Q8 = 3, MAT_Q5 = 4 };
#define GROUP 32
#define QROWS 16        /* Q4's and Q8's rows per block (qdot.c) */
#define ATT_CHUNK 128   /* attention.c's rows per task: shared prefixes are whole chunks */
#define Q5_ROW(k) ((long)(k) / 2 + (long)(k) / GROUP * 4)

typedef struct {
    int32_t kind, n, k, pad;
    /* F32/BF16: [n][k]. Q4, Q8: blocks of QROWS rows (n rounded up), interleaved as qdot.c
     * describes, k/2 (k) bytes a row. Q5 (GGUF's Q5_0 levels, 5.5 bits a value):
     * row r at r * Q5_ROW(k) bytes, its k/2 nibble bytes laid out as Q4's, then k/GROUP uint32
     * of high bits (bit j: value j of the group), value = (nibble | high << 4) - 16; the
     * nibble bytes as Q4's were in rows: group g's byte j holds value j (low nibble) and value
     * j + 16 (high nibble). */
    const void *w;
    /* Q4: f16 [blocks][k/GROUP][2][QROWS] (the block's scales, then its mins); Q8: f16
     * [blocks][k/GROUP][QROWS]; Q5: f16 [n][k/GROUP]; else unused */
    const uint16_t *s;
} Mat;

/* Y[b] = W X[b] for B activation rows (gemv.c; Q4 and Q8 in qdot.c). Rows are split across
 * threads statically and each row is summed in one fixed order: the result does not depend
 * on the thread count or on the other rows. Returns 0, or -1 when scratch memory is refused. */
int mat_mul(const Mat *m, int B, const float *x, long ldx, float *y, long ldy);
int mat_mul_q(const Mat *m, int B, const float *x, long ldx, float *y, long ldy);
/* nm matrices of one shape and kind, each on its own B activation rows: matrix h reads
 * x + h*xh and writes y + h*yh (rows ldx, ldy apart), every row as mat_mul computes it, in
 * one parallel region (a latent-attention layer's per-head products). 0, or -1 for
 * matrices of different shapes or kinds (or scratch memory refused). */
int mat_mul_heads(const Mat *ms, int nm, int B, const float *x, long ldx, long xh, float *y, long ldy, long yh);
void q_row(const Mat *m, long r, void *dst, int bf16);

int decode_attention(const float *q, const void *k, const void *v, long head_stride, int KV, int G,
                     int D, int S, float scale, int bf16, const float *sinks, float *out, float *scratch);
long decode_attention_scratch(int KV, int G, int D, int S);
int decode_attention_many(int B, const float *const *q, const void *const *k, const void *const *v,
                          const long *head_stride, const int *S, const int *lead, const int *shared, int KV,
                          int G, int D, float scale, int bf16, const float *sinks, float *const *out,
                          float *scratch);

/* A Gated DeltaNet layer's constants (gdn.c; procs/inference/native_gdn.py builds them) */
typedef struct {
    int32_t nk, nv, dk, dv, K, tiled, bf16, pad;
    float eps;
    const float *conv;  /* [conv_dim][K], the current token's weight last */
    const float *a;     /* [nv]: -exp(A_log) */
    const float *dt;    /* [nv] */
    const float *norm;  /* [dv]: the gated RMSNorm's weight (compute-dtype values) */
} GdnW;

/* One decode step of a Gated DeltaNet layer for B sequences (gdn.c). p [B][conv_dim + nv*dv
 * + 2*nv] (row stride ldp): the in-projection's q|k|v, z, b, a; conv[b]: [conv_dim][K - 1]
 * (bf16 when w->bf16, else f32), shifted by one input; ssm[b]: [nv][dk][dv] f32, updated;
 * out [B][nv*dv] (row stride ldo), rounded as the compute dtype. Returns 0, or -1 when
 * scratch memory is refused. */
int gdn_step(const GdnW *w, int B, const float *p, long ldp, void *const *conv, float *const *ssm,
             float *out, long ldo);

/* A latent-attention layer (DeepSeek's MLA, GLM-4.7-Flash), absorbed as procs/inference/mla.py
 * runs it: its first projection (LayerW.qkv) gives the query's rows (q_lora of them, or the
 * query itself), then kv_a's r latent and rope rotary values; the cache's one K/V head of
 * D = r + rope holds K rows [c, k_pe], which are its V rows too (decode.c) */
typedef struct {
    int32_t r, rope, nope, v, q_lora, pad;  /* latent rank, rotary dims, a query head's other dims, value
                                               dims, the query's rank (0: the first projection is q) */
    const float *q_a_norm, *kv_a_norm;      /* [q_lora] (NULL without q_lora), [r] */
    Mat wq_b;                               /* [H*(nope+rope), q_lora] (w NULL without q_lora) */
    const Mat *uk, *uv;                     /* [H] each: [r, nope] (a head's W_UK, absorbed into its
                                               query), [v, r] (its W_UV, applied after attention) */
} MlaW;

/* A mixture-of-experts layer's weights (moe.c): the router's choice (softmax over every
 * expert, or sigmoid scores plus a bias within the best groups), the chosen experts' gated
 * MLPs (SiLU, tanh-GELU or gpt-oss's clamped SwiGLU, as the model's act), optional biases */
typedef struct {
    int32_t n, k, norm_topk, ffn;   /* experts, chosen per row, renormalize the chosen weights, an expert's ffn */
    float scale;                    /* times each chosen weight */
    int32_t sigmoid;                /* 0: softmax over all n; 1: sigmoid scores, score_b added to choose */
    Mat router;                     /* [n, dim] */
    const Mat *gu, *down;           /* [n] each: [2*ffn, dim] (gate rows, then up), [dim, ffn] */
    const float *sh_gate;           /* [dim]: the shared expert's output times sigmoid(h . sh_gate); NULL: 1 */
    int32_t groups, groups_used;    /* sigmoid: experts only from the best groups_used of groups (a group's
                                       score: its two best); 1, 1: no groups */
    float alpha, limit;             /* ACT_SWIGLU_OAI's */
    const float *router_b, *score_b; /* [n] each (NULL: none): the router's bias; sigmoid's choosing bias */
    const float *gu_b, *down_b;     /* [n][2*ffn], [n][dim] (NULL: none): the experts' biases */
} MoeW;

/* out [B][dim] = the experts' weighted sum for the normed rows h [B][dim] (moe.c); 0, or -1
 * when scratch memory is refused */
int moe_block(const MoeW *w, int B, const float *h, int dim, int act, float *out);

enum { ACT_SILU = 0, ACT_GELU_TANH = 1, ACT_SWIGLU_OAI = 2 };

static inline float act_fn(int act, float g) {
    return act == ACT_GELU_TANH ? 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)))
                                : g / (1.0f + expf(-g));
}

/* f16 scales and mins (kernels.h's Mat.s) to f32, exactly */
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
