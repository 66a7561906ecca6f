/*
 * interv.c — the intervention setters (colibri.h, "Interventions"; core/interv.h): every
 * argument is checked before anything changes, the memory is taken here (never in the
 * forward), and ctx->iv goes back to NULL when nothing is left, so a forward without
 * interventions pays one pointer test per hook.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/context.h"
#include "core/interv.h"

static void set_free(cb_iv_set *s) {
    free(s->bias);
    free(s->mask);
    free(s->force);
    free(s->force_ids);
    free(s->force_w);
    for (int64_t i = 0; i < s->n_patch; i++)
        if (s->patch[i].mode != COLIBRI_PATCH_RECORD) free(s->patch[i].vec);
    free(s->patch);
    memset(s, 0, sizeof *s);
}

void cb_iv_free(colibri_ctx *ctx) {
    cb_interv *iv = ctx->iv;
    if (!iv) return;
    for (int32_t i = 0; i < iv->n_sets; i++) set_free(&iv->sets[i]);
    free(iv->sets);
    free(iv);
    ctx->iv = NULL;
}

int cb_iv_seq_active(const colibri_ctx *ctx, int32_t q) {
    return ctx->iv && cb_iv_for(ctx->iv, q) != NULL;
}

int64_t cb_iv_find_force(const cb_iv_set *s, int32_t layer, int64_t pos) {
    for (int64_t i = 0; i < s->n_force; i++)
        if (s->force[i].layer == layer && s->force[i].pos == pos) return i;
    return -1;
}

/* The checks every setter shares; on success *out is the set of `seq` (created, with ctx->iv,
 * when missing: COLIBRI_E_NOMEM otherwise). */
static colibri_status get_set(colibri_ctx *ctx, const char *fn, int32_t seq, int32_t layer, int need_moe,
                              cb_iv_set **out) {
    if (!ctx->be->interventions)
        return cb_fail(ctx, COLIBRI_E_UNSUPPORTED, "%s: the %s backend does not apply interventions; open the "
                       "context with the CPU backend (colibri_options.backend) to intervene", fn, ctx->be->name);
    if (seq != COLIBRI_IV_ALL_SEQS && (seq < 0 || seq >= ctx->max_seqs))
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "%s: sequence %d is not in [0, %d) nor COLIBRI_IV_ALL_SEQS (-1)",
                       fn, seq, ctx->max_seqs);
    if (layer < 0 || (uint32_t)layer >= ctx->cfg.n_layers + (need_moe == 2 ? 1u : 0u))
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "%s: layer %d is not in [0, %u%s)", fn, layer,
                       ctx->cfg.n_layers + (need_moe == 2 ? 1u : 0u), need_moe == 2 ? " (n_layers: the final residual)" : "");
    if (need_moe == 1 && !ctx->w.layers[layer].moe)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "%s: layer %d is a dense layer: it has no router or experts", fn,
                       layer);
    if (!ctx->iv) {
        cb_interv *iv = calloc(1, sizeof *iv);
        if (iv) iv->sets = calloc((size_t)ctx->max_seqs + 1, sizeof *iv->sets);
        if (!iv || !iv->sets) {
            free(iv);
            return cb_fail(ctx, COLIBRI_E_NOMEM, "%s: out of memory", fn);
        }
        iv->n_sets = ctx->max_seqs + 1;
        ctx->iv = iv;
    }
    *out = &ctx->iv->sets[seq == COLIBRI_IV_ALL_SEQS ? 0 : 1 + seq];
    return COLIBRI_OK;
}

/* ctx->iv back to NULL when no set is used. */
static void tidy(colibri_ctx *ctx) {
    if (!ctx->iv) return;
    for (int32_t i = 0; i < ctx->iv->n_sets; i++)
        if (ctx->iv->sets[i].used) return;
    cb_iv_free(ctx);
}

colibri_status colibri_iv_mask(colibri_ctx *ctx, int32_t seq, int32_t layer, const int32_t *experts, int32_t n,
                               int32_t mode) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    const int64_t E = ctx->cfg.n_experts, K = ctx->cfg.top_k;
    if (n < 0 || (n > 0 && !experts))
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_iv_mask: n (%d) must be >= 0 and experts non-NULL", n);
    if (mode != COLIBRI_MASK_EXCLUDE && mode != COLIBRI_MASK_ZERO)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_iv_mask: mode %d is neither COLIBRI_MASK_EXCLUDE (1) nor "
                       "COLIBRI_MASK_ZERO (2)", mode);
    for (int32_t i = 0; i < n; i++)
        if (experts[i] < 0 || experts[i] >= E)
            return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_iv_mask: expert %d is not in [0, %lld)", experts[i],
                           (long long)E);
    cb_iv_set *s;
    colibri_status st = get_set(ctx, "colibri_iv_mask", seq, layer, 1, &s);
    if (st != COLIBRI_OK) return st;
    /* at least top_k experts stay choosable */
    int64_t excluded = 0;
    for (int64_t e = 0; e < E; e++) {
        int m = s->mask ? s->mask[(int64_t)layer * E + e] : 0;
        for (int32_t i = 0; i < n; i++)
            if (experts[i] == e) m = mode;
        excluded += m == COLIBRI_MASK_EXCLUDE;
    }
    if (E - excluded < K) {
        tidy(ctx);
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_iv_mask: layer %d would keep %lld choosable experts, "
                       "fewer than top_k = %lld", layer, (long long)(E - excluded), (long long)K);
    }
    if (!s->mask) {
        s->mask = calloc((size_t)(ctx->cfg.n_layers * E), 1);
        if (!s->mask) {
            tidy(ctx);
            return cb_fail(ctx, COLIBRI_E_NOMEM, "colibri_iv_mask: out of memory");
        }
    }
    for (int32_t i = 0; i < n; i++) s->mask[(int64_t)layer * E + experts[i]] = (uint8_t)mode;
    s->used = 1;
    return COLIBRI_OK;
}

colibri_status colibri_iv_router_bias(colibri_ctx *ctx, int32_t seq, int32_t layer, const float *bias) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    const int64_t E = ctx->cfg.n_experts;
    if (!bias) return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_iv_router_bias: bias must not be NULL");
    for (int64_t e = 0; e < E; e++)
        if (!isfinite(bias[e]))
            return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_iv_router_bias: bias[%lld] is not finite (use "
                           "colibri_iv_mask to exclude an expert)", (long long)e);
    cb_iv_set *s;
    colibri_status st = get_set(ctx, "colibri_iv_router_bias", seq, layer, 1, &s);
    if (st != COLIBRI_OK) return st;
    if (!s->bias) {
        s->bias = calloc((size_t)(ctx->cfg.n_layers * E), sizeof(float));
        if (!s->bias) {
            tidy(ctx);
            return cb_fail(ctx, COLIBRI_E_NOMEM, "colibri_iv_router_bias: out of memory");
        }
    }
    memcpy(s->bias + (int64_t)layer * E, bias, (size_t)E * sizeof(float));
    s->used = 1;
    return COLIBRI_OK;
}

colibri_status colibri_iv_force(colibri_ctx *ctx, int32_t seq, int32_t layer, int64_t pos, const int32_t *ids,
                                const float *weights, int32_t k) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    const int64_t E = ctx->cfg.n_experts, K = ctx->cfg.top_k;
    if (!ids || !weights || k != K)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_iv_force: ids and weights must be non-NULL and k (%d) "
                       "must be top_k = %lld", k, (long long)K);
    if (pos < 0 || pos >= ctx->max_seq_len)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_iv_force: position %lld is not in [0, %lld)",
                       (long long)pos, (long long)ctx->max_seq_len);
    for (int32_t i = 0; i < k; i++) {
        if (ids[i] < 0 || ids[i] >= E)
            return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_iv_force: expert id %d is not in [0, %lld)", ids[i],
                           (long long)E);
        for (int32_t j = 0; j < i; j++)
            if (ids[j] == ids[i])
                return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_iv_force: expert %d is given twice", ids[i]);
        if (!isfinite(weights[i]))
            return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_iv_force: weight %d is not finite", i);
    }
    cb_iv_set *s;
    colibri_status st = get_set(ctx, "colibri_iv_force", seq, layer, 1, &s);
    if (st != COLIBRI_OK) return st;
    int64_t i = cb_iv_find_force(s, layer, pos);
    if (i < 0) {
        if (s->n_force == s->cap_force) {
            int64_t cap = s->cap_force ? 2 * s->cap_force : 16;
            cb_iv_force *f = realloc(s->force, (size_t)cap * sizeof *f);
            if (f) s->force = f;
            int32_t *fi = f ? realloc(s->force_ids, (size_t)(cap * K) * sizeof *fi) : NULL;
            if (fi) s->force_ids = fi;
            float *fw = fi ? realloc(s->force_w, (size_t)(cap * K) * sizeof *fw) : NULL;
            if (fw) s->force_w = fw;
            if (!fw) {
                tidy(ctx);
                return cb_fail(ctx, COLIBRI_E_NOMEM, "colibri_iv_force: out of memory");
            }
            s->cap_force = cap;
        }
        i = s->n_force++;
        s->force[i].layer = layer;
        s->force[i].pos = pos;
    }
    memcpy(s->force_ids + i * K, ids, (size_t)K * sizeof(int32_t));
    memcpy(s->force_w + i * K, weights, (size_t)K * sizeof(float));
    s->used = 1;
    return COLIBRI_OK;
}

colibri_status colibri_iv_patch(colibri_ctx *ctx, int32_t seq, int32_t point, int32_t layer, int32_t expert,
                                int64_t pos, int32_t mode, float *vec) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    const int64_t H = ctx->cfg.hidden, E = ctx->cfg.n_experts;
    if (point != COLIBRI_POINT_RESID && point != COLIBRI_POINT_ATTN_OUT && point != COLIBRI_POINT_EXPERT_OUT &&
        point != COLIBRI_POINT_SHARED_OUT)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_iv_patch: point %d is not COLIBRI_POINT_RESID (0), "
                       "_ATTN_OUT (1), _EXPERT_OUT (2) or _SHARED_OUT (3)", point);
    if (mode != COLIBRI_PATCH_RECORD && mode != COLIBRI_PATCH_REPLACE && mode != COLIBRI_PATCH_ADD)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_iv_patch: mode %d is not COLIBRI_PATCH_RECORD (0), "
                       "_REPLACE (1) or _ADD (2)", mode);
    if (!vec) return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_iv_patch: vec must not be NULL");
    if (pos < 0 || pos >= ctx->max_seq_len)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_iv_patch: position %lld is not in [0, %lld)",
                       (long long)pos, (long long)ctx->max_seq_len);
    if (point == COLIBRI_POINT_EXPERT_OUT && (expert < 0 || expert >= E))
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_iv_patch: expert %d is not in [0, %lld)", expert,
                       (long long)E);
    if (mode != COLIBRI_PATCH_RECORD)
        for (int64_t i = 0; i < H; i++)
            if (!isfinite(vec[i]))
                return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_iv_patch: vec[%lld] is not finite", (long long)i);
    if (point == COLIBRI_POINT_SHARED_OUT && layer >= 0 && (uint32_t)layer < ctx->cfg.n_layers &&
        !(ctx->w.layers[layer].moe && ctx->w.layers[layer].has_shared))
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_iv_patch: layer %d has no shared expert (COLIBRI_POINT_"
                       "SHARED_OUT is a MoE layer's shared expert output)", layer);
    cb_iv_set *s;
    colibri_status st = get_set(ctx, "colibri_iv_patch", seq, layer,
                                point == COLIBRI_POINT_RESID ? 2 : point == COLIBRI_POINT_ATTN_OUT ? 0 : 1, &s);
    if (st != COLIBRI_OK) return st;
    float *v = vec;
    if (mode != COLIBRI_PATCH_RECORD) {
        v = malloc((size_t)H * sizeof(float));
        if (!v) {
            tidy(ctx);
            return cb_fail(ctx, COLIBRI_E_NOMEM, "colibri_iv_patch: out of memory");
        }
        memcpy(v, vec, (size_t)H * sizeof(float));
    }
    if (s->n_patch == s->cap_patch) {
        int64_t cap = s->cap_patch ? 2 * s->cap_patch : 16;
        cb_iv_patch *p = realloc(s->patch, (size_t)cap * sizeof *p);
        if (!p) {
            if (v != vec) free(v);
            tidy(ctx);
            return cb_fail(ctx, COLIBRI_E_NOMEM, "colibri_iv_patch: out of memory");
        }
        s->patch = p;
        s->cap_patch = cap;
    }
    cb_iv_patch *p = &s->patch[s->n_patch++];
    p->point = point;
    p->layer = layer;
    p->expert = point == COLIBRI_POINT_EXPERT_OUT ? expert : -1;
    p->mode = mode;
    p->pos = pos;
    p->vec = v;
    s->used = 1;
    return COLIBRI_OK;
}

colibri_status colibri_iv_clear(colibri_ctx *ctx, int32_t seq) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    if (seq != COLIBRI_IV_ALL_SEQS && (seq < 0 || seq >= ctx->max_seqs))
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_iv_clear: sequence %d is not in [0, %d) nor "
                       "COLIBRI_IV_ALL_SEQS (-1)", seq, ctx->max_seqs);
    if (seq == COLIBRI_IV_ALL_SEQS) cb_iv_free(ctx);
    else if (ctx->iv) set_free(&ctx->iv->sets[1 + seq]);
    tidy(ctx);
    return COLIBRI_OK;
}
