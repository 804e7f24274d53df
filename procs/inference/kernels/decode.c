/* One decode step of the whole model in one call: the token's hidden row through every layer
 * (norms, packed matrix-vector products, q/k norms, RoPE, the K/V write, attention, the MLP)
 * and the output projection, in f32 with the weights in their packed form (gemv.c).
 *
 * Why: a decode step in torch is ~1,000 small ops, each a few microseconds of dispatch, about
 * as long as the weight reads themselves on a small model. Here the only per-op cost left is
 * an OpenMP fork per matrix (the serial parts are vectors of a few thousand floats).
 *
 * What a layer carries arrives as optional pointers (NULL: the architecture has none), the
 * same facts procs/inference/layer.Layer holds. Experts run in moe.c; a Gated DeltaNet layer
 * (Qwen3.5) runs its projections here and the rest in gdn.c, on each sequence's recurrent
 * state; a latent-attention layer (DeepSeek, GLM-4.7-Flash) its own projections around
 * attention.c's (mla_layer).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

typedef struct {
    const float *attn_norm, *bqkv, *q_norm, *k_norm, *post_attn_norm, *ffn_norm, *post_ffn_norm;
    Mat qkv, wo, gu, down;        /* [(H+2KV)*D (+ H*D gate rows), dim], [dim, H*D], [2*ffn, dim], [dim, ffn];
                                     a DeltaNet's: qkv its in-projection [lin_in, dim], wo [dim, lin_out] */
    int32_t window, rope;         /* sliding window (0: global); which rotary table */
    int32_t kv, gated;            /* the layer's index into the K/V caches; an output gate (Qwen3-Next) */
    const GdnW *gdn;              /* a Gated DeltaNet in place of attention (NULL: attention) */
    int32_t slot, pad;            /* its index into the sequences' recurrent states */
    const MoeW *moe;              /* experts (moe.c) beside gu/down (the shared expert; w NULL: none) */
    const float *bo;              /* [dim]: the attention output's bias (gpt-oss) */
    const float *sinks;           /* [H]: each head's sink logit (gpt-oss; attention.c) */
    const MlaW *mla;              /* latent attention (NULL: none); qkv is then its first projection */
} LayerW;

typedef struct {
    int32_t n_layers, dim, H, KV, D, ffn, act, kv_bf16, rope_bf16, pad;
    float eps, scale;
    const void *cos[2], *sin[2];  /* [ctx][D] in the compute dtype; sin carries rotate-half's sign */
    const LayerW *layers;
    const float *norm;
    Mat head;                     /* [V, dim] */
    const float *q_scale;         /* [ctx]: q times q_scale[pos] after RoPE (Ministral 3); NULL: 1 */
    int32_t lin_in, lin_out;      /* a DeltaNet's in-projection rows and output width (0: none) */
    long conv_slot, ssm_slot;     /* elements of one layer's convolution inputs and state */
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

#define MAX_D 1024     /* rope()'s buffers */

static inline float table(const void *t, int bf16, long i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)t)[i]) : ((const float *)t)[i];
}

/* x*cos + roll(x, R/2)*sin on n vectors of R dims (stride apart), the model's half-split RoPE
 * from its [ctx][Dt] tables: a head of Dt dims reads every column (R = Dt); latent
 * attention's rotary part (R < Dt) the first R/2 of each half (mla.py's idx) */
static void rope(float *x, int n, long stride, int R, const void *cos, const void *sin, int bf16, int Dt, int pos) {
    float c[MAX_D], s[MAX_D], t[MAX_D];
    const int half = R / 2;
    for (int i = 0; i < R; i++) {
        const long col = (long)pos * Dt + (i < half ? i : Dt / 2 + i - half);
        c[i] = table(cos, bf16, col);
        s[i] = table(sin, bf16, col);
    }
    for (int h = 0; h < n; h++) {
        float *v = x + h * stride;
        for (int i = 0; i < R; i++) t[i] = v[i] * c[i] + v[i < half ? i + half : i - half] * s[i];
        memcpy(v, t, sizeof(float) * R);
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

/* x[b] += post_norm(W in[b] + bias) for B rows: a block's output projection and its residual
 * (o: scratch rows of x's stride; bias NULL: none) */
static int residual(const Mat *w, const float *bias, int B, const float *in, long ld_in, const float *post_norm,
                    float eps, int dim, float *x, long ld, float *o) {
    if (mat_mul(w, B, in, ld_in, o, ld)) return -1;
    for (int b = 0; b < B; b++) {
        float *ob = o + b * ld, *xb = x + b * ld;
        if (bias)
            for (int i = 0; i < dim; i++) ob[i] += bias[i];
        if (post_norm) rms_norm(ob, post_norm, eps, dim, ob);
        for (int i = 0; i < dim; i++) xb[i] += ob[i];
    }
    return 0;
}

/* Floats a latent-attention layer's projections take per activation row (mla_layer's buf: the
 * first projection, the query, the absorbed query); 0 without such layers */
static long mla_row(const ModelW *m) {
    long most = 0;
    for (int l = 0; l < m->n_layers; l++) {
        const LayerW *L = m->layers + l;
        if (L->mla) {
            const long row = L->qkv.n + (long)m->H * (L->mla->nope + L->mla->rope) + (long)m->H * m->D;
            most = row > most ? row : most;
        }
    }
    return most;
}

/* A latent-attention layer on B normed rows h: its projections, the K row [c, k_pe] written at
 * pos[b] (the V rows are the K rows, mla.py: one tensor where the session keeps one, else the
 * same values written twice), each head's query absorbed (W_UK), attention over the one K/V
 * head, each head's latent output's first r dims expanded (W_UV): buf row b (ld >= mla_row(m) floats apart)
 * ends holding [H*v] for the output projection. The caches, lead and shared as decode_batch
 * takes them; att [B][H*D] and att_scratch are decode_batch's. */
static int mla_layer(const ModelW *m, const LayerW *L, int B, const float *h, const int *pos, void *const *kc,
                     void *const *vc, const long *layer_stride, const long *head_stride, const int *lead,
                     const int *shared, float *buf, long ld, float *att, float *att_scratch) {
    const MlaW *A = L->mla;
    const int H = m->H, D = m->D, r = A->r, R = A->rope, nope = A->nope, qd = nope + R;
    const int nq = A->q_lora ? A->q_lora : H * qd, wa = nq + r + R, esz = m->kv_bf16 ? 2 : 4;
    if (D != r + R || m->KV != 1 || L->qkv.n != wa) return -1;
    /* a row of buf: the first projection [wa], the query [H*qd] (q_lora), the absorbed query [H*D] */
    float *q = A->q_lora ? buf + wa : buf, *Q = buf + wa + (long)H * qd, kv[MAX_D];
    if (mat_mul(&L->qkv, B, h, m->dim, buf, ld)) return -1;
    if (A->q_lora) {
        for (int b = 0; b < B; b++) rms_norm(buf + b * ld, A->q_a_norm, m->eps, nq, buf + b * ld);
        if (mat_mul(&A->wq_b, B, buf, ld, q, ld)) return -1;
    }
    if (mat_mul_heads(A->uk, H, B, q, ld, qd, Q, ld, D)) return -1;
    const float *qs[B];
    const void *ks[B], *vs[B];
    float *outs[B];
    int rows[B], ldr[B], sh[B];
    for (int b = 0; b < B; b++) {
        const float *a = buf + b * ld, *qb = q + b * ld;
        float *Qb = Q + b * ld;
        for (int i = 0; i < H; i++) memcpy(Qb + (long)i * D + r, qb + (long)i * qd + nope, sizeof(float) * R);
        rope(Qb + r, H, D, R, m->cos[L->rope], m->sin[L->rope], m->rope_bf16, D, pos[b]);
        rms_norm(a + nq, A->kv_a_norm, m->eps, r, kv);
        memcpy(kv + r, a + nq + r, sizeof(float) * R);
        rope(kv + r, 1, 0, R, m->cos[L->rope], m->sin[L->rope], m->rope_bf16, D, pos[b]);
        const long base = L->kv * layer_stride[b];
        store_rows(kc[b], m->kv_bf16, base + (long)pos[b] * D, kv, D);
        if (vc[b] != kc[b]) store_rows(vc[b], m->kv_bf16, base + (long)pos[b] * D, kv, D);
        qs[b] = Qb;
        ks[b] = (const char *)kc[b] + base * esz;
        vs[b] = (const char *)vc[b] + base * esz;
        outs[b] = att + (long)b * H * D;
        rows[b] = pos[b] + 1;
        ldr[b] = lead ? lead[b] : b;         /* no window: every layer's keys start at row 0 */
        sh[b] = lead && lead[b] != b ? shared[b] / ATT_CHUNK : 0;
    }
    if (decode_attention_many(B, qs, ks, vs, head_stride, rows, ldr, sh, 1, H, D, m->scale, m->kv_bf16, NULL, outs,
                              att_scratch))
        return -1;
    return mat_mul_heads(A->uv, H, B, att, (long)H * D, D, buf, ld, A->v);
}

/* Scratch floats one activation row takes (every buffer of a step, but attention's) */
static long row_floats(const ModelW *m) {
    const long qkv = imax((2 * m->H + 2 * m->KV) * m->D, m->lin_in), mla = mla_row(m);
    return 3L * m->dim + (qkv > mla ? qkv : mla) + imax(m->H * m->D, m->lin_out) + 2L * m->ffn;
}

long decode_batch_scratch(const ModelW *m, int B, int S) {
    return B * (row_floats(m) + decode_attention_scratch(m->KV, m->H / m->KV, m->D, S));
}

/* B tokens of B sequences, one step: x [B][dim] holds their embedding rows (scaled as the
 * model scales them; overwritten); sequence b is at position pos[b] with its own caches:
 * the K/V of layer l, head h, position p is at kc[b] + l*layer_stride[b] + h*head_stride[b]
 * + p*D (elements of the cache dtype). The linears read each weight once for all B rows
 * (mat_mul); RoPE and the K/V write are per sequence, attention one call for all of them.
 * lead[b], shared[b] (NULL: nothing shared): the first shared[b] rows of sequence b are bit
 * for bit those of sequence lead[b] < b in every layer (a multiple of attention.c's chunk);
 * a layer whose keys all start at row 0 for both reads them once for both. Writes logits
 * [B][V] (row b is what a batch of that sequence alone gives, bit for bit); returns 0, or -1
 * for a shape the kernels do not take (or scratch memory refused). scratch:
 * decode_batch_scratch(m, B, max pos + 1) floats. conv[b], ssm[b] (NULL without DeltaNet
 * layers): sequence b's recurrent state, layer slot s at s * conv_slot (ssm_slot) elements. */
int decode_batch(const ModelW *m, int B, float *x, const int *pos, void *const *kc, void *const *vc,
                 const long *layer_stride, const long *head_stride, const int *lead, const int *shared,
                 float *logits, float *scratch, void *const *conv, float *const *ssm) {
    const int dim = m->dim, H = m->H, KV = m->KV, D = m->D, ffn = m->ffn, esz = m->kv_bf16 ? 2 : 4;
    if (D > MAX_D || H % KV || B < 1) return -1;
    const int QKV0 = (H + 2 * KV) * D;
    const long mla = mla_row(m), qkv_min = imax(QKV0 + H * D, m->lin_in), att_max = imax(H * D, m->lin_out);
    const long qkv_max = qkv_min > mla ? qkv_min : mla;
    float *h = scratch, *o = h + (long)B * dim, *qkv = o + (long)B * dim, *att = qkv + (long)B * qkv_max;
    float *gu = att + (long)B * att_max, *mo = gu + (long)B * 2 * ffn, *att_scratch = mo + (long)B * dim;
    const float *qs[B];
    const void *ks_[B], *vs_[B];
    float *outs[B];
    int rows[B], ld[B], sh[B];
    void *cs[B];
    float *ss[B];
    for (int l = 0; l < m->n_layers; l++) {
        const LayerW *L = m->layers + l;
        for (int b = 0; b < B; b++) rms_norm(x + (long)b * dim, L->attn_norm, m->eps, dim, h + (long)b * dim);
        if (L->gdn) {
            const int esz_c = L->gdn->bf16 ? 2 : 4;
            if (!conv || !ssm || mat_mul(&L->qkv, B, h, dim, qkv, m->lin_in)) return -1;
            for (int b = 0; b < B; b++) {
                cs[b] = (char *)conv[b] + L->slot * m->conv_slot * esz_c;
                ss[b] = ssm[b] + L->slot * m->ssm_slot;
            }
            if (gdn_step(L->gdn, B, qkv, m->lin_in, cs, ss, att, m->lin_out)) return -1;
            if (residual(&L->wo, NULL, B, att, m->lin_out, L->post_attn_norm, m->eps, dim, x, dim, o)) return -1;
            goto mlp;
        }
        if (L->mla) {
            if (mla_layer(m, L, B, h, pos, kc, vc, layer_stride, head_stride, lead, shared, qkv, mla, att, att_scratch) ||
                residual(&L->wo, L->bo, B, qkv, mla, L->post_attn_norm, m->eps, dim, x, dim, o))
                return -1;
            goto mlp;
        }
        const int QKV = QKV0 + (L->gated ? H * D : 0);
        if (mat_mul(&L->qkv, B, h, dim, qkv, QKV)) return -1;
        for (int b = 0; b < B; b++) {
            float *q = qkv + (long)b * QKV, *k = q + H * D, *v = k + KV * D;
            if (L->bqkv)
                for (int i = 0; i < QKV; i++) q[i] += L->bqkv[i];
            if (L->q_norm) {
                for (int i = 0; i < H; i++) rms_norm(q + i * D, L->q_norm, m->eps, D, q + i * D);
                for (int i = 0; i < KV; i++) rms_norm(k + i * D, L->k_norm, m->eps, D, k + i * D);
            }
            rope(q, H + KV, D, D, m->cos[L->rope], m->sin[L->rope], m->rope_bf16, D, pos[b]);
            if (m->q_scale)
                for (int i = 0; i < H * D; i++) q[i] *= m->q_scale[pos[b]];
            const long base = L->kv * layer_stride[b], hs = head_stride[b];
            for (int i = 0; i < KV; i++) {
                store_rows(kc[b], m->kv_bf16, base + i * hs + (long)pos[b] * D, k + i * D, D);
                store_rows(vc[b], m->kv_bf16, base + i * hs + (long)pos[b] * D, v + i * D, D);
            }
            const int first = L->window ? imax(0, pos[b] - L->window + 1) : 0;
            const long at = (base + (long)first * D) * esz;
            qs[b] = q;
            ks_[b] = (const char *)kc[b] + at;
            vs_[b] = (const char *)vc[b] + at;
            outs[b] = att + (long)b * H * D;
            rows[b] = pos[b] + 1 - first;
            ld[b] = b;
            sh[b] = 0;
            /* shared rows count only where both sequences' keys start at row 0 */
            if (lead && lead[b] != b && first == 0 && rows[lead[b]] == pos[lead[b]] + 1) {
                ld[b] = lead[b];
                sh[b] = shared[b] / ATT_CHUNK;
            }
        }
        if (decode_attention_many(B, qs, ks_, vs_, head_stride, rows, ld, sh, KV, H / KV, D, m->scale, m->kv_bf16,
                                  L->sinks, outs, att_scratch))
            return -1;
        if (L->gated)               /* Qwen3-Next's output gate: the rows after q|k|v */
            for (int b = 0; b < B; b++) {
                float *a = att + (long)b * H * D;
                const float *g = qkv + (long)b * QKV + QKV0;
                for (int i = 0; i < H * D; i++) a[i] /= 1.0f + expf(-g[i]);
            }
        if (residual(&L->wo, L->bo, B, att, H * D, L->post_attn_norm, m->eps, dim, x, dim, o)) return -1;
    mlp:
        for (int b = 0; b < B; b++) rms_norm(x + (long)b * dim, L->ffn_norm, m->eps, dim, h + (long)b * dim);
        if (L->moe && moe_block(L->moe, B, h, dim, m->act, mo)) return -1;
        if (L->gu.w) {              /* the dense MLP, or beside the experts the shared one */
            const int f = L->gu.n / 2;
            if (mat_mul(&L->gu, B, h, dim, gu, 2 * f)) return -1;
            for (int b = 0; b < B; b++) {
                float *g = gu + (long)b * 2 * f;
                for (int i = 0; i < f; i++) g[i] = act_fn(m->act, g[i]) * g[f + i];
            }
            if (mat_mul(&L->down, B, gu, 2 * f, o, dim)) return -1;
            if (L->moe)
                for (int b = 0; b < B; b++) {
                    float *ob = o + (long)b * dim, s = 1.0f;
                    const float *hb = h + (long)b * dim, *mb = mo + (long)b * dim;
                    if (L->moe->sh_gate) {
                        float d = 0.0f;
                        for (int i = 0; i < dim; i++) d += hb[i] * L->moe->sh_gate[i];
                        s = 1.0f / (1.0f + expf(-d));
                    }
                    for (int i = 0; i < dim; i++) ob[i] = mb[i] + ob[i] * s;
                }
        } else {
            memcpy(o, mo, sizeof(float) * (size_t)B * dim);
        }
        for (int b = 0; b < B; b++) {
            float *ob = o + (long)b * dim, *xb = x + (long)b * dim;
            if (L->post_ffn_norm) rms_norm(ob, L->post_ffn_norm, m->eps, dim, ob);
            for (int i = 0; i < dim; i++) xb[i] += ob[i];
        }
    }
    for (int b = 0; b < B; b++) rms_norm(x + (long)b * dim, m->norm, m->eps, dim, h + (long)b * dim);
    return mat_mul(&m->head, B, h, dim, logits, m->head.n);
}
