/*
 * interv.c — the CPU backend's intervention hooks (core/interv.h; colibri.h,
 * "Interventions"). Each works row by row with the settings of the row's own sequence
 * (cb_iv_for), so a sequence's results do not depend on what else is in the chunk, and
 * allocates nothing. The stages call them only when ctx->iv is set.
 */
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu.h"

void cb_cpu_iv_router_logits(colibri_ctx *ctx, uint32_t l) {
    cb_scratch *s = &ctx->s;
    int64_t T = ctx->run.T, E = ctx->cfg.n_experts;
    for (int64_t t = 0; t < T; t++) {
        const cb_iv_set *v = cb_iv_for(ctx->iv, s->row_seq[t]);
        if (!v) continue;
        float *lg = s->router_logits + t * E;
        if (v->bias)
            for (int64_t e = 0; e < E; e++) lg[e] += v->bias[(int64_t)l * E + e];
        if (v->mask)
            for (int64_t e = 0; e < E; e++)
                if (v->mask[(int64_t)l * E + e] == COLIBRI_MASK_EXCLUDE) lg[e] = -INFINITY;
    }
}

void cb_cpu_iv_force(colibri_ctx *ctx, uint32_t l) {
    cb_scratch *s = &ctx->s;
    int64_t T = ctx->run.T, K = ctx->cfg.top_k;
    for (int64_t t = 0; t < T; t++) {
        const cb_iv_set *v = cb_iv_for(ctx->iv, s->row_seq[t]);
        if (!v || !v->n_force) continue;
        int64_t i = cb_iv_find_force(v, (int32_t)l, s->row_pos[t]);
        if (i < 0) continue;
        memcpy(s->topk_ids + t * K, v->force_ids + i * K, (size_t)K * sizeof(int32_t));
        memcpy(s->topk_w + t * K, v->force_w + i * K, (size_t)K * sizeof(float));
    }
}

void cb_cpu_iv_zero(colibri_ctx *ctx, uint32_t l) {
    cb_scratch *s = &ctx->s;
    int64_t E = ctx->cfg.n_experts;
    for (int64_t e = 0; e < E; e++)
        for (int64_t r = s->expert_offset[e]; r < s->expert_offset[e + 1]; r++) {
            int32_t t = s->row_token[r];
            if (t < 0) continue;
            const cb_iv_set *v = cb_iv_for(ctx->iv, s->row_seq[t]);
            if (v && v->mask && v->mask[(int64_t)l * E + e] == COLIBRI_MASK_ZERO) s->row_weight[r] = 0.0f;
        }
}

/* Apply patch p to one row. */
static void patch_row(const cb_iv_patch *p, float *row, int64_t H) {
    if (p->mode == COLIBRI_PATCH_RECORD) memcpy(p->vec, row, (size_t)H * sizeof(float));
    else if (p->mode == COLIBRI_PATCH_REPLACE) memcpy(row, p->vec, (size_t)H * sizeof(float));
    else
        for (int64_t i = 0; i < H; i++) row[i] += p->vec[i];
}

void cb_cpu_iv_patch(colibri_ctx *ctx, int32_t point, uint32_t l, float *buf) {
    cb_scratch *s = &ctx->s;
    int64_t T = ctx->run.T, H = ctx->cfg.hidden, E = ctx->cfg.n_experts;
    if (point != COLIBRI_POINT_EXPERT_OUT) {
        for (int64_t t = 0; t < T; t++) {
            const cb_iv_set *v = cb_iv_for(ctx->iv, s->row_seq[t]);
            for (int64_t i = 0; v && i < v->n_patch; i++) {
                const cb_iv_patch *p = &v->patch[i];
                if (p->point == point && p->layer == (int32_t)l && p->pos == s->row_pos[t]) patch_row(p, buf + t * H, H);
            }
        }
        return;
    }
    for (int64_t e = 0; e < E; e++)
        for (int64_t r = s->expert_offset[e]; r < s->expert_offset[e + 1]; r++) {
            int32_t t = s->row_token[r];
            if (t < 0) continue;
            const cb_iv_set *v = cb_iv_for(ctx->iv, s->row_seq[t]);
            for (int64_t i = 0; v && i < v->n_patch; i++) {
                const cb_iv_patch *p = &v->patch[i];
                if (p->point == point && p->layer == (int32_t)l && p->expert == e && p->pos == s->row_pos[t])
                    patch_row(p, buf + r * H, H);
            }
        }
}

void cb_cpu_iv_shared(colibri_ctx *ctx, uint32_t l) {
    cb_scratch *s = &ctx->s;
    const int gated = ctx->w.layers[l].shared_gate.w != NULL;
    int64_t T = ctx->run.T, H = ctx->cfg.hidden;
    for (int64_t t = 0; t < T; t++) {
        const cb_iv_set *v = cb_iv_for(ctx->iv, s->row_seq[t]);
        int gated_now = 0;
        for (int64_t i = 0; v && i < v->n_patch; i++) {
            const cb_iv_patch *p = &v->patch[i];
            if (p->point != COLIBRI_POINT_SHARED_OUT || p->layer != (int32_t)l || p->pos != s->row_pos[t]) continue;
            float *y = s->sh_out + t * H;
            if (gated && !gated_now) { /* the value COMBINE would add: g * y, then g = 1 (1 * v == v) */
                float g = s->sh_gate[t];
                for (int64_t j = 0; j < H; j++) y[j] = g * y[j];
                s->sh_gate[t] = 1.0f;
            }
            gated_now = 1;
            patch_row(p, y, H);
        }
    }
}
