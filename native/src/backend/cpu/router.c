/*
 * router.c — the router of a MoE layer in the CPU backend: its logits (an int8 row-quantised
 * router or a float one) and the routings that are not grouped (softmax then top-k, as
 * Mixtral, Qwen and OLMoE; top-k then softmax, as gpt-oss), with the grouped, sigmoid and
 * scaled routers of route_group.c; which of them a layer runs is bound once at start-up
 * (cb_cpu_bind_router: cb_layer.router_op), and stage_router (stages.c) calls it without
 * asking.
 */
#include <string.h>

#include "backend/cpu/cpu.h"

/* The K largest of v[0..E), highest first, into ids (and their values into w): strict >
 * keeps the lower id on ties; NaN never wins unless all are NaN. */
void cb_cpu_topk_desc(const float *v, int64_t E, int64_t K, int32_t *ids, float *w) {
    for (int64_t k = 0; k < K; k++) {
        int32_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t j = 0; j < k; j++) taken |= ids[j] == (int32_t)e;
            if (taken) continue;
            if (best < 0 || v[e] > v[best]) best = (int32_t)e;
        }
        ids[k] = best;
        w[k] = v[best];
    }
}

/* Route T tokens: softmax over experts, top-k (highest first, lower id wins ties),
 * optional renormalisation. logits: [T, E] -> probs [T, E], ids/w [T, K]. */
static void route_softmax_topk(colibri_ctx *ctx, uint32_t l, int64_t T) {
    (void)l;
    const cb_config *c = &ctx->cfg;
    cb_scratch *s = &ctx->s;
    int64_t E = c->n_experts, K = c->top_k;
    memcpy(s->router_probs, s->router_logits, (size_t)(T * E) * sizeof(float));
    for (int64_t t = 0; t < T; t++) {
        float *p = s->router_probs + t * E;
        ctx->kern->softmax(p, E);
        int32_t *ids = s->topk_ids + t * K;
        float *w = s->topk_w + t * K;
        cb_cpu_topk_desc(p, E, K, ids, w);
        if (c->norm_topk_prob) {
            float sum = 0.0f;
            for (int64_t k = 0; k < K; k++) sum += w[k];
            for (int64_t k = 0; k < K; k++) w[k] /= sum;
        }
    }
}

/* Route T tokens as transformers' GptOssTopKRouter (model.routing topk_softmax): top-k of
 * the logits (highest first, lower id wins ties), then softmax over the k selected logits.
 * router_probs gets the softmax over all experts, for observation only. */
static void route_topk_softmax(colibri_ctx *ctx, uint32_t l, int64_t T) {
    (void)l;
    const cb_config *c = &ctx->cfg;
    cb_scratch *s = &ctx->s;
    int64_t E = c->n_experts, K = c->top_k;
    memcpy(s->router_probs, s->router_logits, (size_t)(T * E) * sizeof(float));
    for (int64_t t = 0; t < T; t++) {
        const float *lg = s->router_logits + t * E;
        int32_t *ids = s->topk_ids + t * K;
        float *w = s->topk_w + t * K;
        cb_cpu_topk_desc(lg, E, K, ids, w);
        ctx->kern->softmax(w, K);
        ctx->kern->softmax(s->router_probs + t * E, E);
    }
}

/* The router's logits: an int8 row-quantised router, or a float one (F32/F16/BF16). */
static void router_logits_i8(const colibri_ctx *ctx, const cb_layer *L, float *y, const float *x, int64_t T) {
    const cb_config *c = &ctx->cfg;
    ctx->kern->matmul_i8(y, x, (const int8_t *)L->router, L->router_scale, L->router_zero, T, c->n_experts, c->hidden);
}

static void router_logits_float(const colibri_ctx *ctx, const cb_layer *L, float *y, const float *x, int64_t T) {
    const cb_config *c = &ctx->cfg;
    ctx->kern->matmul(y, x, L->router, c->router_dtype, T, c->n_experts, c->hidden);
}

/* [int8 router][routing]: 0 softmax then top-k, 1 top-k then softmax, 2 grouped / sigmoid /
 * scaled (route_group.c) */
static const cb_router_op router_ops[2][3] = {
    {{router_logits_float, route_softmax_topk}, {router_logits_float, route_topk_softmax},
     {router_logits_float, cb_route_grouped}},
    {{router_logits_i8, route_softmax_topk}, {router_logits_i8, route_topk_softmax},
     {router_logits_i8, cb_route_grouped}},
};

void cb_cpu_bind_router(const colibri_ctx *ctx, cb_layer *L) {
    const cb_config *c = &ctx->cfg;
    int routing = c->routing == CB_ROUTE_TOPK_SOFTMAX ? 1
                  : c->routing == CB_ROUTE_SIGMOID_TOPK || c->n_group > 1 || c->routed_scale != 1.0f ? 2
                                                                                                      : 0;
    L->router_op = &router_ops[c->router_int8 ? 1 : 0][routing];
}
