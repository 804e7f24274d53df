/* One decode step of a Gated DeltaNet layer (procs/inference/gdn.py) for B sequences, one
 * token each: the causal convolution over the state's last K - 1 inputs, SiLU, L2-normed q
 * and k, the gated delta rule on each value head's f32 state, the gated RMSNorm. The
 * projections in and out are the caller's: torch's path (gdn.py), or decode.c's whole step.
 *
 * Why: in torch this is ~50 small ops per layer, each a few microseconds of dispatch, and
 * the state update is three passes over the state; here it is one fork and two passes (one
 * read for both S^T k and S^T q, one in-place decay and update).
 *
 * The values are rounded where gdn.py's torch path rounds them to the compute dtype
 * (rnd: bf16 when bf16 is set), so both paths compute the same function up to f32
 * summation order.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

static inline float rnd(float x, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(x)) : x; }
static inline float silu(float x) { return x / (1.0f + expf(-x)); }

int gdn_step(const GdnW *w, int B, const float *p, long ldp, void *const *conv, float *const *ssm,
             float *out, long ldo) {
    const int nk = w->nk, nv = w->nv, dk = w->dk, dv = w->dv, K = w->K, K1 = K - 1, bf = w->bf16;
    const int key = nk * dk, cd = 2 * key + nv * dv, r = nv / nk;
    float *x = malloc(sizeof(float) * (size_t)B * cd);
    if (!x) return -1;
    const float qscale = 1.0f / sqrtf((float)dk);
#pragma omp parallel
    {
        /* convolution, SiLU, L2 norms: x[b] = q | k | v in f32 */
#pragma omp for schedule(static)
        for (long bc = 0; bc < (long)B * cd; bc++) {
            const int b = (int)(bc / cd), c = (int)(bc % cd);
            const float xin = rnd(p[b * ldp + c], bf);
            const float *wc = w->conv + (long)c * K;
            float y = 0.0f;
            if (bf) {
                uint16_t *st = (uint16_t *)conv[b] + (long)c * K1;
                for (int j = 0; j < K1; j++) y += bf16_to_f32(st[j]) * wc[j];
                for (int j = 0; j + 1 < K1; j++) st[j] = st[j + 1];
                st[K1 - 1] = f32_to_bf16(xin);
            } else {
                float *st = (float *)conv[b] + (long)c * K1;
                for (int j = 0; j < K1; j++) y += st[j] * wc[j];
                for (int j = 0; j + 1 < K1; j++) st[j] = st[j + 1];
                st[K1 - 1] = xin;
            }
            y += xin * wc[K1];
            x[(long)b * cd + c] = rnd(silu(rnd(y, bf)), bf);
        }
#pragma omp for schedule(static)
        for (long bh = 0; bh < (long)B * 2 * nk; bh++) {
            float *v = x + (bh / (2 * nk)) * cd + (bh % (2 * nk)) * dk;    /* q heads, then k heads */
            float ss = 0.0f;
            for (int i = 0; i < dk; i++) ss += v[i] * v[i];
            const float s = 1.0f / sqrtf(ss + 1e-6f) * ((bh % (2 * nk)) < nk ? qscale : 1.0f);
            for (int i = 0; i < dk; i++) v[i] *= s;
        }
        /* the delta rule and the gated norm, one value head a task */
#pragma omp for schedule(static)
        for (long bh = 0; bh < (long)B * nv; bh++) {
            const int b = (int)(bh / nv), h = (int)(bh % nv), kh = w->tiled ? h % nk : h / r;
            const float *xb = x + (long)b * cd, *pb = p + b * ldp;
            const float *q = xb + kh * dk, *k = xb + key + kh * dk, *v = xb + 2 * key + h * dv;
            const float *z = pb + cd + h * dv;
            const float beta = rnd(1.0f / (1.0f + expf(-pb[cd + nv * dv + h])), bf);
            const float sp = pb[cd + nv * dv + nv + h] + w->dt[h];
            const float e = expf(w->a[h] * (sp > 20.0f ? sp : log1pf(expf(sp))));
            float *S = ssm[b] + (long)h * dk * dv;
            float mk[dv], mq[dv], d[dv];
            for (int j = 0; j < dv; j++) mk[j] = mq[j] = 0.0f;
            float kq = 0.0f;
            for (int i = 0; i < dk; i++) {
                const float ki = k[i], qi = q[i], *row = S + (long)i * dv;
                kq += ki * qi;
                for (int j = 0; j < dv; j++) {
                    mk[j] += ki * row[j];
                    mq[j] += qi * row[j];
                }
            }
            for (int j = 0; j < dv; j++) d[j] = (v[j] - e * mk[j]) * beta;
            for (int i = 0; i < dk; i++) {
                const float ki = k[i];
                float *row = S + (long)i * dv;
                for (int j = 0; j < dv; j++) row[j] = row[j] * e + ki * d[j];
            }
            float ss = 0.0f;
            for (int j = 0; j < dv; j++) {
                mq[j] = rnd(e * mq[j] + kq * d[j], bf);      /* o, as the compute dtype */
                ss += mq[j] * mq[j];
            }
            const float rs = 1.0f / sqrtf(ss / dv + w->eps);
            float *ob = out + b * ldo + h * dv;
            for (int j = 0; j < dv; j++)
                ob[j] = rnd(rnd(rnd(mq[j] * rs, bf) * w->norm[j], bf) * silu(z[j]), bf);
        }
    }
    free(x);
    return 0;
}
