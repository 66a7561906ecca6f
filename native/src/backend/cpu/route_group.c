/*
 * route_group.c — the routers with groups, a choice bias and scaling (model.routing
 * softmax_topk or sigmoid_topk with model.n_group, model.topk_group, model.router_bias,
 * model.routed_scaling_factor; docs/format.md "Family options"), as transformers computes
 * DeepSeek's (modeling_deepseek_v2.py / modeling_deepseek_v3.py):
 *
 *   softmax_topk, 1 group    (V2 "greedy"): p = softmax(logits); top-k of p.
 *   softmax_topk, n groups   (V2 "group_limited_greedy"): p = softmax(logits); a group's
 *                  score is the max of its p; the top topk_group groups are kept; top-k of
 *                  p among the experts of the kept groups (transformers zeroes the others).
 *   sigmoid_topk  (V3 "noaux_tc"): p = sigmoid(logits); choice = p + correction bias; with
 *                  groups, a group's score is the sum of its two best choice values and the
 *                  top topk_group groups are kept; top-k of choice inside them; the weights
 *                  are the un-biased p of the chosen experts.
 *
 * Then, when norm_topk_prob, w /= (sum w + 1e-20) (transformers' V3; V2 never
 * renormalises and its files say so), and w *= routed_scaling_factor.
 * Ties everywhere: the lower id wins (the engine's rule; torch.topk leaves it unspecified).
 * router_probs holds p (softmax or sigmoid), for traces. Nothing allocates: the choice
 * values, group scores and masks are arena buffers (route_choice, route_group, route_skip).
 */
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu.h"

/* Index of the largest v[i] among i < n with !skip(i) (strict >: lower index on ties;
 * NaN never wins unless all are NaN); -1 when none. */
static int64_t argmax_masked(const float *v, int64_t n, const uint8_t *skip) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; i++) {
        if (skip[i]) continue;
        if (best < 0 || v[i] > v[best]) best = i;
    }
    return best;
}

void cb_route_grouped(colibri_ctx *ctx, uint32_t l, int64_t T) {
    const cb_config *c = &ctx->cfg;
    const float *bias = ctx->w.layers[l].router_bias;
    cb_scratch *s = &ctx->s;
    int64_t E = c->n_experts, K = c->top_k, G = c->n_group ? c->n_group : 1, TG = c->topk_group;
    int64_t per = E / G;
    int sigmoid = c->routing == CB_ROUTE_SIGMOID_TOPK;
    int grouped = G > 1;
    if (TG <= 0 || TG > G) TG = G;
    for (int64_t t = 0; t < T; t++) {
        const float *lg = s->router_logits + t * E;
        float *p = s->router_probs + t * E;
        float *choice = s->route_choice; /* [E] the values the choice ranks */
        uint8_t *skip = s->route_skip;
        int32_t *ids = s->topk_ids + t * K;
        float *w = s->topk_w + t * K;
        if (sigmoid) {
            for (int64_t e = 0; e < E; e++) p[e] = 1.0f / (1.0f + expf(-lg[e]));
            for (int64_t e = 0; e < E; e++) choice[e] = bias ? p[e] + bias[e] : p[e];
            if (ctx->iv) /* an excluded expert (logit -inf) is never chosen, whatever its bias */
                for (int64_t e = 0; e < E; e++)
                    if (lg[e] == -INFINITY) choice[e] = -INFINITY;
        } else {
            memcpy(p, lg, (size_t)E * sizeof(float));
            ctx->kern->softmax(p, E);
            memcpy(choice, p, (size_t)E * sizeof(float));
        }
        memset(skip, 0, (size_t)E);
        if (grouped) {
            float *gs = s->route_group; /* [G] group scores */
            uint8_t *gskip = skip + E;  /* [G] */
            for (int64_t g = 0; g < G; g++) {
                const float *v = choice + g * per;
                if (sigmoid) { /* sum of the two best (torch.topk(2).sum) */
                    memset(gskip, 0, (size_t)per);
                    int64_t a = argmax_masked(v, per, gskip);
                    gskip[a] = 1;
                    int64_t b = argmax_masked(v, per, gskip);
                    gs[g] = v[a] + v[b];
                } else { /* the best probability */
                    memset(gskip, 0, (size_t)per);
                    gs[g] = v[argmax_masked(v, per, gskip)];
                }
            }
            memset(gskip, 0, (size_t)G);
            for (int64_t k = 0; k < TG; k++) gskip[argmax_masked(gs, G, gskip)] = 1;
            for (int64_t g = 0; g < G; g++)
                if (!gskip[g]) memset(skip + g * per, 1, (size_t)per);
        }
        for (int64_t k = 0; k < K; k++) {
            int64_t e = argmax_masked(choice, E, skip);
            if (e < 0) { /* fewer experts than k in the kept groups: refused at load */
                ids[k] = 0;
                w[k] = 0.0f;
                continue;
            }
            skip[e] = 1;
            ids[k] = (int32_t)e;
            w[k] = p[e];
        }
        if (c->norm_topk_prob) {
            float sum = 0.0f;
            for (int64_t k = 0; k < K; k++) sum += w[k];
            sum += 1e-20f;
            for (int64_t k = 0; k < K; k++) w[k] /= sum;
        }
        for (int64_t k = 0; k < K; k++) w[k] *= c->routed_scale;
    }
}
