/*
 * engine.c — the scheduler's engine interface (scheduler.h, cs_engine) over a colibri_ctx,
 * and for /metrics the per-layer expert load, read from a colibri_trace after every step, and
 * the expert cache's counters, copied after every step. Everything here runs on the engine
 * thread except cs_colibri_expert_counts and cs_colibri_cache_counts.
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
static int e_sample_seq(void *self, void *sampler, const float *logits, uint64_t *rng, int32_t *id, int *end) {
    (void)self;
    int st = colibri_sampler_sample(sampler, logits, rng, id);
    if (st != COLIBRI_OK) return st;
    int32_t f = colibri_sampler_finished(sampler);
    *end = (f == COLIBRI_FINISH_EOS || f == COLIBRI_FINISH_STOP_ID) ? CS_SAMPLE_END_BEFORE
           : f == COLIBRI_FINISH_GRAMMAR                            ? CS_SAMPLE_END_AFTER
                                                                    : CS_SAMPLE_GO;
    return COLIBRI_OK;
}
static int64_t e_total(void *self) { return ((cs_colibri *)self)->blocks_total; }
static int64_t e_free(void *self) {
    cs_colibri *cc = self;
    int64_t used = 0;
    if (colibri_get_int(cc->ctx, "kv_blocks_used", &used) != COLIBRI_OK) return 0;
    return cc->blocks_total - used;
}
static int64_t e_reuse(void *self, int32_t seq, const int32_t *ids, int64_t n) {
    int64_t k = 0;
    return colibri_seq_reuse_prefix(((cs_colibri *)self)->ctx, seq, ids, n, &k) == COLIBRI_OK ? k : 0;
}
static int64_t e_cached(void *self) {
    int64_t k = 0;
    return colibri_get_int(((cs_colibri *)self)->ctx, "kv_blocks_cached", &k) == COLIBRI_OK ? k : 0;
}
static const char *e_error(void *self) { return colibri_last_error(((cs_colibri *)self)->ctx); }

static const char *const cache_names[CS_CACHE_N_STATS] = {"cache_hits", "cache_misses", "cache_prefetches",
                                                           "cache_prefetch_hits", "cache_wasted_prefetches"};

/* The engine's cache counters now, in cache_base's layout; 0, or -1 when a read failed.
 * Engine thread: the forward writes them without a lock. */
static int read_cache(cs_colibri *cc, int64_t *out) {
    int64_t n = (int64_t)cc->n_layers * CS_CACHE_N_STATS;
    for (int32_t l = 0; l < cc->n_layers; l++)
        for (int k = 0; k < CS_CACHE_N_STATS; k++) {
            int64_t *v = &out[(int64_t)l * CS_CACHE_N_STATS + k];
            *v = 0;
            if (cc->moe[l] && colibri_get_layer_int(cc->ctx, l, cache_names[k], v) != COLIBRI_OK) return -1;
        }
    return colibri_get_int(cc->ctx, "expert_cache_bytes_read", &out[n]) == COLIBRI_OK ? 0 : -1;
}

/* Copy the cache's counters, less the base, for /metrics. */
static void snapshot_cache(cs_colibri *cc) {
    int64_t n = (int64_t)cc->n_layers * CS_CACHE_N_STATS + 1;
    if (read_cache(cc, cc->cache_now)) return; /* keeps the last copy */
    pthread_mutex_lock(&cc->mu);
    for (int64_t i = 0; i < n; i++) cc->cache_counts[i] = (uint64_t)(cc->cache_now[i] - cc->cache_base[i]);
    pthread_mutex_unlock(&cc->mu);
}

/* Copy the cache's counters; count the top-k ids the last step recorded, then empty the
 * trace. */
static void e_after(void *self) {
    cs_colibri *cc = self;
    if (cc->cache_slots > 0) snapshot_cache(cc);
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
    int64_t slots = 0;
    if (colibri_get_int(ctx, "expert_cache_slots", &slots)) {
        snprintf(err, err_len, "reading the model's settings: %s", colibri_last_error(ctx));
        return -1;
    }
    if (slots > 0 && L > 0) {
        size_t n = (size_t)L * CS_CACHE_N_STATS + 1;
        cc->moe = calloc((size_t)L, sizeof *cc->moe);
        cc->cache_base = calloc(n, sizeof *cc->cache_base);
        cc->cache_now = calloc(n, sizeof *cc->cache_now);
        cc->cache_counts = calloc(n, sizeof *cc->cache_counts);
        if (!cc->moe || !cc->cache_base || !cc->cache_now || !cc->cache_counts) {
            snprintf(err, err_len, "out of memory");
            return -1;
        }
        for (int32_t l = 0; l < (int32_t)L; l++) {
            int64_t moe = 0;
            if (colibri_get_layer_int(ctx, l, "moe", &moe)) {
                snprintf(err, err_len, "reading the model's settings: %s", colibri_last_error(ctx));
                return -1;
            }
            cc->moe[l] = moe != 0;
        }
        cc->cache_slots = (int32_t)slots;
    }
    *eng = (cs_engine){cc, e_batch, e_clear, e_fork, e_sample, e_free, e_total, e_error, e_after, e_reuse, e_cached,
                       e_sample_seq};
    return 0;
}

void cs_colibri_reset_counts(cs_colibri *cc) {
    pthread_mutex_lock(&cc->mu);
    if (cc->expert_tokens)
        memset(cc->expert_tokens, 0, (size_t)cc->n_layers * (size_t)cc->n_experts * sizeof *cc->expert_tokens);
    if (cc->cache_slots > 0 && read_cache(cc, cc->cache_base) == 0)
        memset(cc->cache_counts, 0, ((size_t)cc->n_layers * CS_CACHE_N_STATS + 1) * sizeof *cc->cache_counts);
    pthread_mutex_unlock(&cc->mu);
}

void cs_colibri_free(cs_colibri *cc) {
    if (cc->trace) {
        if (cc->ctx) colibri_trace_attach(cc->ctx, NULL);
        colibri_trace_free(cc->trace);
    }
    free(cc->expert_tokens);
    free(cc->moe);
    free(cc->cache_base);
    free(cc->cache_now);
    free(cc->cache_counts);
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

uint64_t *cs_colibri_cache_counts(cs_colibri *cc, uint64_t *bytes_read) {
    if (cc->cache_slots <= 0) return NULL;
    size_t n = (size_t)cc->n_layers * CS_CACHE_N_STATS;
    uint64_t *out = malloc(n * sizeof *out);
    if (!out) return NULL;
    pthread_mutex_lock(&cc->mu);
    memcpy(out, cc->cache_counts, n * sizeof *out);
    *bytes_read = cc->cache_counts[n];
    pthread_mutex_unlock(&cc->mu);
    return out;
}
