/*
 * trace.c — colibri_trace (colibri.h, "Observation"): one allocation at create, carved
 * into the per-token and per-layer buffers that model/forward.c's run_stage fills while the trace
 * is attached; and the public entry points of stage-by-stage execution.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/arena.h"
#include "core/context.h"
#include "core/trace.h"

colibri_status colibri_trace_create(const colibri_ctx *ctx, int64_t capacity, colibri_trace **out,
                                    char *err, size_t err_len) {
    if (err && err_len) err[0] = 0;
    if (out) *out = NULL;
    if (!ctx || !out) {
        cb_set_err(err, err_len, "colibri_trace_create: ctx and out must not be NULL");
        return COLIBRI_E_INVALID_ARG;
    }
    if (capacity <= 0 || capacity > ((int64_t)1 << 32)) {
        cb_set_err(err, err_len, "colibri_trace_create: capacity %lld must be in [1, 2^32] tokens",
                   (long long)capacity);
        return COLIBRI_E_INVALID_ARG;
    }
    uint64_t C = (uint64_t)capacity, L = ctx->cfg.n_layers, E = ctx->cfg.n_experts, K = ctx->cfg.top_k;
    colibri_trace *tr = calloc(1, sizeof *tr);
    if (!tr) {
        cb_set_err(err, err_len, "cannot allocate a trace; trace fewer tokens");
        return COLIBRI_E_NOMEM;
    }
    uint64_t lc = L * C; /* L < 2^32 and C <= 2^32: cannot overflow */
    cb_arena_item items[] = {
        {(void **)&tr->positions, C, 8, "positions"},
        {(void **)&tr->group_sizes, L * E, 8, "group_sizes"},
        {(void **)&tr->padded_sizes, L * E, 8, "padded_group_sizes"},
        {(void **)&tr->layer_ns, L * 5, 8, "layer_ns"},
        {(void **)&tr->router_probs, lc, 4 * E, "router_probs"},
        {(void **)&tr->topk_ids, lc, 4 * K, "topk_ids"},
        {(void **)&tr->topk_w, lc, 4 * K, "topk_weights"},
        {(void **)&tr->pred_ids, lc, 4 * K, "predicted_ids"},
        {(void **)&tr->cache_stats, L * CB_EC_N_STATS, 8, "cache_stats"},
        {(void **)&tr->shared_gate, lc, 4, "shared_gate"},
        {(void **)&tr->margins, lc, 8, "routing_margins"},
        {(void **)&tr->token_ids, C, 4, "token_ids"},
        {(void **)&tr->seq_ids, C, 4, "seq_ids"},
    };
    const size_t n_items = sizeof items / sizeof items[0];
    uint64_t offs[sizeof items / sizeof items[0]], total = 0;
    size_t bad = 0;
    if (!cb_arena_layout(items, n_items, offs, &total, &bad) || total > (uint64_t)SIZE_MAX) {
        free(tr);
        cb_set_err(err, err_len, "colibri_trace_create: a trace of %lld tokens overflows 64 bits",
                   (long long)capacity);
        return COLIBRI_E_NOMEM;
    }
    /* one zeroed block, carved like the arena (64-byte aligned buffers) */
    void *mem = NULL;
    if (posix_memalign(&mem, CB_ARENA_CARVE, (size_t)total + 1) != 0 || !mem) {
        free(tr);
        cb_set_err(err, err_len, "cannot allocate a trace of %.1f MiB for %lld tokens; trace fewer tokens",
                   (double)total / 1048576.0, (long long)capacity);
        return COLIBRI_E_NOMEM;
    }
    memset(mem, 0, (size_t)total + 1);
    cb_arena_assign(items, n_items, offs, mem);
    tr->mem = mem;
    tr->capacity = capacity;
    tr->n_layers = (uint32_t)L;
    tr->n_experts = (uint32_t)E;
    tr->top_k = (uint32_t)K;
    *out = tr;
    return COLIBRI_OK;
}

void colibri_trace_free(colibri_trace *tr) {
    if (!tr) return;
    if (tr->owner) ((colibri_ctx *)tr->owner)->trace = NULL;
    free(tr->mem);
    free(tr);
}

void colibri_trace_reset(colibri_trace *tr) {
    if (!tr) return;
    uint64_t LE = (uint64_t)tr->n_layers * tr->n_experts;
    memset(tr->group_sizes, 0, LE * 8);
    memset(tr->padded_sizes, 0, LE * 8);
    memset(tr->layer_ns, 0, (uint64_t)tr->n_layers * 5 * 8);
    memset(tr->cache_stats, 0, (uint64_t)tr->n_layers * CB_EC_N_STATS * 8);
    memset(tr->stage_ns, 0, sizeof tr->stage_ns);
    tr->n_tokens = tr->dropped = tr->n_forwards = tr->chunk_base = tr->prefix_cached = 0;
}

colibri_status colibri_trace_attach(colibri_ctx *ctx, colibri_trace *tr) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    if (tr) {
        if (tr->owner && tr->owner != ctx)
            return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "this trace is attached to another context; detach it there first");
        if (tr->n_layers != ctx->cfg.n_layers || tr->n_experts != ctx->cfg.n_experts ||
            tr->top_k != ctx->cfg.top_k)
            return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "the trace was made for %u layers, %u experts, top-%u; "
                           "this model has %u, %u, top-%u", tr->n_layers, tr->n_experts, tr->top_k,
                           ctx->cfg.n_layers, ctx->cfg.n_experts, ctx->cfg.top_k);
    }
    if (ctx->trace && ctx->trace != tr) ctx->trace->owner = NULL;
    ctx->trace = tr;
    if (tr) {
        tr->owner = ctx;
        tr->chunk_base = tr->n_tokens;
    }
    return COLIBRI_OK;
}

colibri_status colibri_trace_get_int(const colibri_trace *tr, const char *name, int64_t *out) {
    if (!tr || !name || !out) return COLIBRI_E_INVALID_ARG;
    struct { const char *n; int64_t v; } tab[] = {
        {"tokens", tr->n_tokens}, {"dropped", tr->dropped}, {"prefix_cached", tr->prefix_cached}, {"capacity", tr->capacity},
        {"forwards", tr->n_forwards}, {"n_layers", tr->n_layers}, {"n_experts", tr->n_experts},
        {"top_k", tr->top_k},
    };
    for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++) {
        if (strcmp(tab[i].n, name) == 0) {
            *out = tab[i].v;
            return COLIBRI_OK;
        }
    }
    return COLIBRI_E_INVALID_ARG;
}

colibri_status colibri_trace_array(const colibri_trace *tr, const char *name, const void **data,
                                   int32_t *dtype, int32_t *ndim, int64_t shape[4]) {
    if (!tr || !name || !data || !dtype || !ndim || !shape) return COLIBRI_E_INVALID_ARG;
    int64_t C = tr->capacity, L = tr->n_layers, E = tr->n_experts, K = tr->top_k;
    struct { const char *n; const void *p; int32_t dt; int32_t nd; int64_t d[3]; } tab[] = {
        {"token_ids", tr->token_ids, COLIBRI_DTYPE_I32, 1, {C, 0, 0}},
        {"seq_ids", tr->seq_ids, COLIBRI_DTYPE_I32, 1, {C, 0, 0}},
        {"positions", tr->positions, COLIBRI_DTYPE_I64, 1, {C, 0, 0}},
        {"router_probs", tr->router_probs, COLIBRI_DTYPE_F32, 3, {L, C, E}},
        {"topk_ids", tr->topk_ids, COLIBRI_DTYPE_I32, 3, {L, C, K}},
        {"topk_weights", tr->topk_w, COLIBRI_DTYPE_F32, 3, {L, C, K}},
        {"predicted_ids", tr->pred_ids, COLIBRI_DTYPE_I32, 3, {L, C, K}},
        {"cache_stats", tr->cache_stats, COLIBRI_DTYPE_I64, 2, {L, CB_EC_N_STATS, 0}},
        {"shared_gate", tr->shared_gate, COLIBRI_DTYPE_F32, 2, {L, C, 0}},
        {"routing_margins", tr->margins, COLIBRI_DTYPE_F32, 3, {L, C, 2}},
        {"group_sizes", tr->group_sizes, COLIBRI_DTYPE_I64, 2, {L, E, 0}},
        {"padded_group_sizes", tr->padded_sizes, COLIBRI_DTYPE_I64, 2, {L, E, 0}},
        {"layer_ns", tr->layer_ns, COLIBRI_DTYPE_U64, 2, {L, 5, 0}},
        {"stage_ns", tr->stage_ns, COLIBRI_DTYPE_U64, 1, {COLIBRI_N_STAGES, 0, 0}},
    };
    for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++) {
        if (strcmp(tab[i].n, name) != 0) continue;
        *data = tab[i].p;
        *dtype = tab[i].dt;
        *ndim = tab[i].nd;
        for (int j = 0; j < 4; j++) shape[j] = j < 3 && j < tab[i].nd ? tab[i].d[j] : 0;
        return COLIBRI_OK;
    }
    return COLIBRI_E_INVALID_ARG;
}

/* ---- stage-by-stage execution: argument checks, then model/forward.c ---- */

colibri_status colibri_stage_begin(colibri_ctx *ctx, const int32_t *input_ids, int64_t n_tokens,
                                   int64_t start_pos) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    if (!input_ids || n_tokens <= 0 || start_pos < 0)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_stage_begin: need input_ids, n_tokens >= 1 and "
                       "start_pos >= 0 (got n_tokens %lld, start_pos %lld)", (long long)n_tokens,
                       (long long)start_pos);
    return cb_stage_begin(ctx, input_ids, n_tokens, start_pos);
}

colibri_status colibri_stage_next(const colibri_ctx *ctx, int32_t *stage, int32_t *layer) {
    if (!ctx || !stage || !layer) return COLIBRI_E_INVALID_ARG;
    *stage = ctx->run.stage;
    *layer = ctx->run.stage < 0 ? -1 : ctx->run.layer;
    return COLIBRI_OK;
}

colibri_status colibri_stage_run(colibri_ctx *ctx, int32_t stage, float *logits) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    return cb_stage_run(ctx, stage, logits);
}

colibri_status colibri_stage_tensor(colibri_ctx *ctx, const char *name, const void **data,
                                    int32_t *dtype, int32_t *ndim, int64_t shape[4]) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    if (!name || !data || !dtype || !ndim || !shape)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_stage_tensor: NULL argument");
    return cb_stage_tensor(ctx, name, data, dtype, ndim, shape);
}

colibri_status colibri_lens(colibri_ctx *ctx, const float *resid, int64_t n, float *logits) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    if (!ctx->be->interventions)
        return cb_fail(ctx, COLIBRI_E_UNSUPPORTED, "colibri_lens: the %s backend does not take host rows into its "
                       "LM head; use the CPU backend", ctx->be->name);
    return cb_lens(ctx, resid, n, logits);
}

colibri_status colibri_unembedding(colibri_ctx *ctx, int32_t token, float *out) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    const int64_t H = ctx->cfg.hidden;
    if (!out) return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_unembedding: out must not be NULL");
    if (token < 0 || token >= (int64_t)ctx->cfg.vocab)
        return cb_fail(ctx, COLIBRI_E_TOKEN_RANGE, "colibri_unembedding: token id %d is out of range [0, %u)", token,
                       ctx->cfg.vocab);
    cb_mat W = ctx->w.lm_head;
    size_t rb = (size_t)cb_row_bytes(W.dt, (uint64_t)H);
    ctx->kern->dequant_row(out, (const uint8_t *)W.w + (size_t)token * rb, W.dt, H);
    for (int64_t i = 0; i < H; i++) out[i] *= ctx->w.out_norm[i];
    return COLIBRI_OK;
}

colibri_status colibri_stage_tensor_device(colibri_ctx *ctx, const char *name, const void **data) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    if (!name || !data) return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_stage_tensor_device: NULL argument");
    const void *p = ctx->be->device_tensor ? ctx->be->device_tensor(ctx, name) : NULL;
    if (!p)
        return cb_fail(ctx, COLIBRI_E_UNSUPPORTED, "colibri_stage_tensor_device: the %s backend keeps '%s' on the "
                       "host (or has no such tensor); read it with colibri_stage_tensor", ctx->be->name, name);
    *data = p;
    return COLIBRI_OK;
}
