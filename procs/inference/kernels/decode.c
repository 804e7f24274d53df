/* One decode step of the whole model in one call: the token's hidden row through every layer
 * (norms, packed matrix-vector products, q/k norms, RoPE, the K/V write, attention, the MLP)
 * and the output projection, in f32 with the weights in their packed form (gemv.c).
 *
 * Why: a decode step in torch is ~1,000 small ops, each a few microseconds of dispatch, about
 * as long as the weight reads themselves on a small model. Here the only per-op cost left is
 * an OpenMP fork per matrix (the serial parts are vectors of a few thousand floats).
 *
 * What a layer carries arrives as optional pointers (NULL: the architecture has none), the
 * same facts procs/inference/model.Layer holds; a mixture-of-experts layer is not taken here
 * (native.py leaves such models on torch's path).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

typedef struct {
    const float *attn_norm, *bqkv, *q_norm, *k_norm, *post_attn_norm, *ffn_norm, *post_ffn_norm;
    Mat qkv, wo, gu, down;        /* [(H+2KV)*D, dim], [dim, H*D], [2*ffn, dim], [dim, ffn] */
    int32_t window, rope;         /* sliding window (0: global); which rotary table */
} LayerW;

typedef struct {
    int32_t n_layers, dim, H, KV, D, ffn, act, kv_bf16, rope_bf16, pad;
    float eps, scale;
    const void *cos[2], *sin[2];  /* [ctx][D] in the compute dtype; sin carries rotate-half's sign */
    const LayerW *layers;
    const float *norm;
    Mat head;                     /* [V, dim] */
} ModelW;

static void rms_norm(const float *x, const float *w, float eps, int n, float *out) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / n + eps);
    if (w)
        for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
    else
        for (int i = 0; i < n; i++) out[i] = x[i] * r;
}

static inline float table(const void *t, int bf16, long i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)t)[i]) : ((const float *)t)[i];
}

/* x*cos + roll(x, D/2)*sin on each of n heads (the model's half-split RoPE) */
static void rope(float *x, int n, int D, const void *cos, const void *sin, int bf16, int pos) {
    float c[512], s[512], t[512];
    const int half = D / 2;
    for (int i = 0; i < D; i++) {
        c[i] = table(cos, bf16, (long)pos * D + i);
        s[i] = table(sin, bf16, (long)pos * D + i);
    }
    for (int h = 0; h < n; h++) {
        float *v = x + (long)h * D;
        for (int i = 0; i < D; i++) t[i] = v[i] * c[i] + v[i < half ? i + half : i - half] * s[i];
        memcpy(v, t, sizeof(float) * D);
    }
}

static void store_rows(void *cache, int bf16, long at, const float *src, int D) {
    if (bf16) {
        uint16_t *dst = (uint16_t *)cache + at;
        for (int i = 0; i < D; i++) dst[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)cache + at, src, sizeof(float) * D);
    }
}

static inline int imax(int a, int b) { return a > b ? a : b; }

/* x += post_norm(W in): a block's output projection and its residual (o, xs: scratch) */
static void residual(const Mat *w, const float *in, int n_in, const float *post_norm, float eps, int dim,
                     float *x, float *o, float *xs) {
    group_sums(in, n_in, xs);
    mat_vec(w, in, xs, o);
    if (post_norm) rms_norm(o, post_norm, eps, dim, o);
    for (int i = 0; i < dim; i++) x[i] += o[i];
}

long decode_step_scratch(const ModelW *m, int S) {
    const int qkv = (m->H + 2 * m->KV) * m->D, wide = imax(imax(m->dim, qkv), 2 * m->ffn);
    return 2L * m->dim + qkv + m->H * m->D + 2L * m->ffn + wide / GROUP + 1 +
           decode_attention_scratch(m->KV, m->H / m->KV, m->D, S);
}

/* x [dim]: the token's embedding row (scaled as the model scales it), overwritten. The K/V of
 * layer l, head h, position p is at kc + l*layer_stride + h*head_stride + p*D (elements of
 * the cache dtype). Writes logits [V]; returns 0, or -1 for a shape the kernels do not take. */
int decode_step(const ModelW *m, float *x, int pos, void *kc, void *vc, long layer_stride, long head_stride,
                float *logits, float *scratch) {
    const int dim = m->dim, H = m->H, KV = m->KV, D = m->D, ffn = m->ffn, esz = m->kv_bf16 ? 2 : 4;
    if (D > 512 || H % KV) return -1;
    float *h = scratch, *o = h + dim, *qkv = o + dim, *att = qkv + (H + 2 * KV) * D, *gu = att + H * D;
    const int wide = imax(imax(dim, (H + 2 * KV) * D), 2 * ffn);
    float *xs = gu + 2 * ffn, *att_scratch = xs + wide / GROUP + 1;
    for (int l = 0; l < m->n_layers; l++) {
        const LayerW *L = m->layers + l;
        rms_norm(x, L->attn_norm, m->eps, dim, h);
        group_sums(h, dim, xs);
        mat_vec(&L->qkv, h, xs, qkv);
        if (L->bqkv)
            for (int i = 0; i < (H + 2 * KV) * D; i++) qkv[i] += L->bqkv[i];
        float *q = qkv, *k = qkv + H * D, *v = k + KV * D;
        if (L->q_norm) {
            for (int i = 0; i < H; i++) rms_norm(q + i * D, L->q_norm, m->eps, D, q + i * D);
            for (int i = 0; i < KV; i++) rms_norm(k + i * D, L->k_norm, m->eps, D, k + i * D);
        }
        rope(q, H + KV, D, m->cos[L->rope], m->sin[L->rope], m->rope_bf16, pos);
        const long base = l * layer_stride;
        for (int i = 0; i < KV; i++) {
            store_rows(kc, m->kv_bf16, base + i * head_stride + (long)pos * D, k + i * D, D);
            store_rows(vc, m->kv_bf16, base + i * head_stride + (long)pos * D, v + i * D, D);
        }
        const int ks = L->window ? imax(0, pos - L->window + 1) : 0;
        const long first = (base + (long)ks * D) * esz;
        if (decode_attention(q, (const char *)kc + first, (const char *)vc + first, head_stride, KV, H / KV, D,
                             pos + 1 - ks, m->scale, m->kv_bf16, att, att_scratch))
            return -1;
        residual(&L->wo, att, H * D, L->post_attn_norm, m->eps, dim, x, o, xs);
        rms_norm(x, L->ffn_norm, m->eps, dim, h);
        group_sums(h, dim, xs);
        mat_vec(&L->gu, h, xs, gu);
        for (int i = 0; i < ffn; i++) {
            const float g = gu[i];
            const float a = m->act == ACT_GELU_TANH
                ? 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)))
                : g / (1.0f + expf(-g));
            gu[i] = a * gu[ffn + i];
        }
        residual(&L->down, gu, ffn, L->post_ffn_norm, m->eps, dim, x, o, xs);
    }
    rms_norm(x, m->norm, m->eps, dim, h);
    group_sums(h, dim, xs);
    mat_vec(&m->head, h, xs, logits);
    return 0;
}
