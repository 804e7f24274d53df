/* A mixture-of-experts MLP for decode.c's whole step (procs/inference/moe.py is the torch
 * path, whose choices this makes): the router's softmax over every expert and its top k
 * (Qwen3 MoE, gpt-oss), or sigmoid scores whose top k plus a bias choose within the best
 * groups (GLM-4.5); the chosen weights renormalized where the model says; each chosen
 * expert's gated MLP on the packed weights (gemv.c / qdot.c) with its biases; the k outputs
 * summed in choice order with their weights.
 *
 * The rows that chose one expert are multiplied together, so a batched step reads each
 * chosen expert once; a row's sums are the same whichever rows share the product (mat_mul's
 * promise), so a batch row equals the row alone.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* score [E] of `groups` equal groups: each group's score is its two best; experts outside the
 * best `used` groups drop to -inf (transformers' Glm4MoeTopkRouter) */
static void drop_groups(float *score, int E, int groups, int used) {
    const int per = E / groups;
    float gs[groups];
    int keep[groups];
    for (int g = 0; g < groups; g++) {
        float a = -INFINITY, b = -INFINITY;
        for (int e = g * per; e < (g + 1) * per; e++) {
            if (score[e] > a) { b = a; a = score[e]; }
            else if (score[e] > b) b = score[e];
        }
        gs[g] = a + b;
        keep[g] = 0;
    }
    for (int j = 0; j < used; j++) {
        int best = -1;
        for (int g = 0; g < groups; g++)
            if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
        keep[best] = 1;
    }
    for (int g = 0; g < groups; g++)
        if (!keep[g])
            for (int e = g * per; e < (g + 1) * per; e++) score[e] = -INFINITY;
}

int moe_block(const MoeW *w, int B, const float *h, int dim, int act, float *out) {
    const int E = w->n, K = w->k, F = w->ffn;
    float *logit = malloc(sizeof(float) * (size_t)B * E), *wt = malloc(sizeof(float) * (size_t)B * K);
    int *chosen = malloc(sizeof(int) * (size_t)B * K), *idx = malloc(sizeof(int) * (size_t)B * K);
    float *xin = malloc(sizeof(float) * (size_t)B * K * dim), *g = malloc(sizeof(float) * (size_t)B * K * 2 * F);
    float *y = malloc(sizeof(float) * (size_t)B * K * dim), *pout = malloc(sizeof(float) * (size_t)B * K * dim);
    float *score = malloc(sizeof(float) * (size_t)E);     /* a row's choosing scores */
    int rc = -1;
    if (!logit || !wt || !chosen || !idx || !xin || !g || !y || !pout || !score) goto done;
    if (mat_mul(&w->router, B, h, dim, logit, E)) goto done;
    for (int b = 0; b < B; b++) {
        float *l = logit + (long)b * E;
        if (w->router_b)
            for (int e = 0; e < E; e++) l[e] += w->router_b[e];
        if (w->sigmoid) {
            for (int e = 0; e < E; e++) score[e] = (l[e] = 1.0f / (1.0f + expf(-l[e]))) + (w->score_b ? w->score_b[e] : 0.0f);
            if (w->groups > 1) drop_groups(score, E, w->groups, w->groups_used);
        } else {
            float mx = l[0], sum = 0.0f;
            for (int e = 1; e < E; e++) mx = l[e] > mx ? l[e] : mx;
            for (int e = 0; e < E; e++) sum += (l[e] = expf(l[e] - mx));
            for (int e = 0; e < E; e++) score[e] = (l[e] /= sum);
        }
        float picked = 0.0f;
        for (int j = 0; j < K; j++) {             /* the k best scores, best first (k is small) */
            int best = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++) taken |= chosen[b * K + i] == e;
                if (!taken && (best < 0 || score[e] > score[best])) best = e;
            }
            chosen[b * K + j] = best;
            picked += (wt[b * K + j] = l[best]);
        }
        const float norm = w->sigmoid ? picked + 1e-20f : picked;
        for (int j = 0; j < K; j++) wt[b * K + j] = (w->norm_topk ? wt[b * K + j] / norm : wt[b * K + j]) * w->scale;
    }
    for (int e = 0; e < E; e++) {
        int n = 0;
        for (int p = 0; p < B * K; p++)
            if (chosen[p] == e) {
                idx[n] = p;
                memcpy(xin + (long)n * dim, h + (long)(p / K) * dim, sizeof(float) * dim);
                n++;
            }
        if (!n) continue;
        if (mat_mul(&w->gu[e], n, xin, dim, g, 2 * F)) goto done;
        for (int r = 0; r < n; r++) {
            float *gr = g + (long)r * 2 * F;
            if (w->gu_b)
                for (int i = 0; i < 2 * F; i++) gr[i] += w->gu_b[(long)e * 2 * F + i];
            if (act == ACT_SWIGLU_OAI)
                for (int i = 0; i < F; i++) {
                    const float x = gr[i] < w->limit ? gr[i] : w->limit;
                    const float u = gr[F + i] < -w->limit ? -w->limit : gr[F + i] > w->limit ? w->limit : gr[F + i];
                    gr[i] = x / (1.0f + expf(-w->alpha * x)) * (u + 1.0f);
                }
            else
                for (int i = 0; i < F; i++) gr[i] = act_fn(act, gr[i]) * gr[F + i];
        }
        if (mat_mul(&w->down[e], n, g, 2 * F, y, dim)) goto done;
        for (int r = 0; r < n; r++) {
            float *dst = pout + (long)idx[r] * dim;
            memcpy(dst, y + (long)r * dim, sizeof(float) * dim);
            if (w->down_b)
                for (int i = 0; i < dim; i++) dst[i] += w->down_b[(long)e * dim + i];
        }
    }
    for (int b = 0; b < B; b++) {
        float *ob = out + (long)b * dim;
        for (int i = 0; i < dim; i++) ob[i] = 0.0f;
        for (int j = 0; j < K; j++) {
            const float *pj = pout + (long)(b * K + j) * dim, wj = wt[b * K + j];
            for (int i = 0; i < dim; i++) ob[i] += wj * pj[i];
        }
    }
    rc = 0;
done:
    free(logit); free(wt); free(chosen); free(idx); free(xin); free(g); free(y); free(pout); free(score);
    return rc;
}
