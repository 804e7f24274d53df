/* A mixture-of-experts MLP for decode.c's whole step (procs/inference/moe.py is the torch
 * path): the router's softmax over every expert, the top k of each row (renormalized where
 * the model says), each chosen expert's gated MLP on the packed weights (gemv.c / qdot.c),
 * the k outputs summed in choice order with their weights.
 *
 * The rows that chose one expert are multiplied together, so a batched step reads each
 * chosen expert once; a row's sums are the same whichever rows share the product (mat_mul's
 * promise), so a batch row equals the row alone.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

int moe_block(const MoeW *w, int B, const float *h, int dim, int act, float *out) {
    const int E = w->n, K = w->k, F = w->ffn;
    float *logit = malloc(sizeof(float) * (size_t)B * E), *wt = malloc(sizeof(float) * (size_t)B * K);
    int *chosen = malloc(sizeof(int) * (size_t)B * K), *idx = malloc(sizeof(int) * (size_t)B * K);
    float *xin = malloc(sizeof(float) * (size_t)B * K * dim), *g = malloc(sizeof(float) * (size_t)B * K * 2 * F);
    float *y = malloc(sizeof(float) * (size_t)B * K * dim), *pout = malloc(sizeof(float) * (size_t)B * K * dim);
    int rc = -1;
    if (!logit || !wt || !chosen || !idx || !xin || !g || !y || !pout) goto done;
    if (mat_mul(&w->router, B, h, dim, logit, E)) goto done;
    for (int b = 0; b < B; b++) {
        float *l = logit + (long)b * E, mx = l[0], sum = 0.0f;
        for (int e = 1; e < E; e++) mx = l[e] > mx ? l[e] : mx;
        for (int e = 0; e < E; e++) sum += (l[e] = expf(l[e] - mx));
        for (int e = 0; e < E; e++) l[e] /= sum;
        float picked = 0.0f;
        for (int j = 0; j < K; j++) {             /* the k largest, best first (k is small) */
            int best = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++) taken |= chosen[b * K + i] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            chosen[b * K + j] = best;
            picked += (wt[b * K + j] = l[best]);
        }
        for (int j = 0; j < K; j++) wt[b * K + j] = (w->norm_topk ? wt[b * K + j] / picked : wt[b * K + j]) * w->scale;
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
            for (int i = 0; i < F; i++) gr[i] = act_fn(act, gr[i]) * gr[F + i];
        }
        if (mat_mul(&w->down[e], n, g, 2 * F, y, dim)) goto done;
        for (int r = 0; r < n; r++) memcpy(pout + (long)idx[r] * dim, y + (long)r * dim, sizeof(float) * dim);
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
    free(logit); free(wt); free(chosen); free(idx); free(xin); free(g); free(y); free(pout);
    return rc;
}
