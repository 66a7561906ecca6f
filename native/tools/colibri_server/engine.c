/*
 * engine.c — the scheduler's engine interface (scheduler.h, cs_engine) over a colibri_ctx,
 * and the per-layer expert load for /metrics, read from a colibri_trace after every step.
 * Everything here runs on the engine thread except cs_colibri_expert_counts.
 */
#define _POSIX_C_SOURCE 200809L
#include "server.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int e_batch(void *self, const colibri_batch_entry *e, int64_t n, float *logits) {
    return colibri_batch(((cs_colibri *)self)->ctx, e, n, logits);
}
static int e_clear(void *self, int32_t seq) { return colibri_seq_clear(((cs_colibri *)self)->ctx, seq); }
static int e_fork(void *self, int32_t src, int32_t dst) {
    return colibri_seq_fork(((cs_colibri *)self)->ctx, src, dst);
}
static int e_sample(void *self, const float *logits, float t, int32_t k, float p, uint64_t *rng, int32_t *id) {
    return colibri_sample(((cs_colibri *)self)->ctx, logits, t, k, p, rng, id);
}
static int64_t e_total(void *self) { return ((cs_colibri *)self)->blocks_total; }
static int64_t e_free(void *self) {
    cs_colibri *cc = self;
    int64_t used = 0;
    if (colibri_get_int(cc->ctx, "kv_blocks_used", &used) != COLIBRI_OK) return 0;
    return cc->blocks_total - used;
}
static const char *e_error(void *self) { return colibri_last_error(((cs_colibri *)self)->ctx); }

/* Count the top-k ids the last step recorded, then empty the trace. */
static void e_after(void *self) {
    cs_colibri *cc = self;
    if (!cc->trace) return;
    int64_t tokens = 0;
    const void *data;
    int32_t dtype, ndim;
    int64_t shape[4];
    if (colibri_trace_get_int(cc->trace, "tokens", &tokens) == COLIBRI_OK && tokens > 0 &&
        colibri_trace_array(cc->trace, "topk_ids", &data, &dtype, &ndim, shape) == COLIBRI_OK &&
        dtype == COLIBRI_DTYPE_I32 && ndim == 3) {
        const int32_t *ids = data;
        int64_t C = shape[1], K = shape[2];
        if (tokens > C) tokens = C;
        pthread_mutex_lock(&cc->mu);
        for (int64_t l = 0; l < shape[0] && l < cc->n_layers; l++)
            for (int64_t t = 0; t < tokens; t++)
                for (int64_t k = 0; k < K; k++) {
                    int32_t e = ids[(l * C + t) * K + k];
                    if (e >= 0 && e < cc->n_experts) cc->expert_tokens[l * cc->n_experts + e]++;
                }
        pthread_mutex_unlock(&cc->mu);
    }
    colibri_trace_reset(cc->trace);
}

int cs_colibri_init(cs_colibri *cc, colibri_ctx *ctx, int64_t trace_tokens, cs_engine *eng, char *err,
                    size_t err_len) {
    memset(cc, 0, sizeof *cc);
    cc->ctx = ctx;
    pthread_mutex_init(&cc->mu, NULL);
    int64_t L = 0, E = 0, K = 0, total = 0;
    if (colibri_get_int(ctx, "n_layers", &L) || colibri_get_int(ctx, "n_experts", &E) ||
        colibri_get_int(ctx, "top_k", &K) || colibri_get_int(ctx, "kv_blocks_total", &total)) {
        snprintf(err, err_len, "reading the model's settings: %s", colibri_last_error(ctx));
        return -1;
    }
    cc->n_layers = (int32_t)L;
    cc->n_experts = (int32_t)E;
    cc->top_k = (int32_t)K;
    cc->blocks_total = total;
    if (L > 0 && E > 0 && K > 0) {
        cc->expert_tokens = calloc((size_t)(L * E), sizeof *cc->expert_tokens);
        if (!cc->expert_tokens) {
            snprintf(err, err_len, "out of memory");
            return -1;
        }
        char terr[256] = "";
        colibri_status st = colibri_trace_create(ctx, trace_tokens, &cc->trace, terr, sizeof terr);
        if (st == COLIBRI_OK) st = colibri_trace_attach(ctx, cc->trace);
        if (st != COLIBRI_OK) {
            snprintf(err, err_len, "cannot trace the router: %s", *terr ? terr : colibri_last_error(ctx));
            return -1;
        }
    }
    *eng = (cs_engine){cc, e_batch, e_clear, e_fork, e_sample, e_free, e_total, e_error, e_after};
    return 0;
}

void cs_colibri_free(cs_colibri *cc) {
    if (cc->trace) {
        if (cc->ctx) colibri_trace_attach(cc->ctx, NULL);
        colibri_trace_free(cc->trace);
    }
    free(cc->expert_tokens);
    pthread_mutex_destroy(&cc->mu);
    memset(cc, 0, sizeof *cc);
}

uint64_t *cs_colibri_expert_counts(cs_colibri *cc) {
    if (!cc->expert_tokens) return NULL;
    size_t n = (size_t)cc->n_layers * (size_t)cc->n_experts;
    uint64_t *out = malloc(n * sizeof *out);
    if (!out) return NULL;
    pthread_mutex_lock(&cc->mu);
    memcpy(out, cc->expert_tokens, n * sizeof *out);
    pthread_mutex_unlock(&cc->mu);
    return out;
}
