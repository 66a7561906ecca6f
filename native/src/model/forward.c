/*
 * forward.c — the forward pass's orchestration, the same for every backend: the checks of a
 * request (nothing is changed by a refused one), the chunks of at most max_batch rows, the
 * batch of many sequences (colibri_batch), stage-by-stage runs (colibri_stage_*) and what an
 * attached trace records. The stages themselves are the backend's (backend/backend.h;
 * backend/cpu/stages.c on the host), dispatched from one place, run_stage: the fused forward runs
 * them all in order (or the backend replays the whole chunk, a captured graph, when no trace
 * or stage run watches), colibri_stage_run runs them one call at a time, and an attached
 * trace times and records each.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"
#include "core/context.h"
#include "core/trace.h"

/* ---- tracing: what the stages record into an attached trace ------------------------- */

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* The k-th minus the (k+1)-th largest of v[0..E) (k = 1..E-1; ties count once each), by
 * k+1 passes of an argmax over the values not yet taken (taken: [E] scratch). */
static float kth_gap(const float *v, int64_t E, int64_t k, uint8_t *taken) {
    float a = 0.0f, b = 0.0f;
    memset(taken, 0, (size_t)E);
    for (int64_t j = 0; j <= k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || v[e] > v[best])) best = e;
        taken[best] = 1;
        if (j == k - 1) a = v[best];
        if (j == k) b = v[best];
    }
    return a - b;
}

/* Record what `stage` of layer l just produced; tokens past the capacity are dropped. */
static void trace_record(colibri_ctx *ctx, int32_t stage, uint32_t l) {
    colibri_trace *tr = ctx->trace;
    const cb_config *c = &ctx->cfg;
    const cb_layer *L = l < c->n_layers ? &ctx->w.layers[l] : NULL;
    cb_scratch *s = &ctx->s;
    int64_t T = ctx->run.T, C = tr->capacity, E = c->n_experts, K = c->top_k;
    int64_t base = tr->chunk_base;
    int64_t keep = base >= C ? 0 : (T < C - base ? T : C - base);
    switch (stage) {
    case COLIBRI_STAGE_EMBEDDING:
        for (int64_t t = 0; t < keep; t++) {
            tr->token_ids[base + t] = s->run_ids[t];
            tr->seq_ids[base + t] = s->row_seq[t];
            tr->positions[base + t] = s->row_pos[t];
        }
        break;
    case COLIBRI_STAGE_ROUTER: {
        float *probs = tr->router_probs + ((int64_t)l * C + base) * E;
        int32_t *ids = tr->topk_ids + ((int64_t)l * C + base) * K;
        float *w = tr->topk_w + ((int64_t)l * C + base) * K;
        int32_t *pred = tr->pred_ids + ((int64_t)l * C + base) * K;
        if (L->moe && ctx->run.pred_layer == (int32_t)l)
            memcpy(pred, s->pred_ids, (size_t)(keep * K) * sizeof(int32_t));
        else
            for (int64_t i = 0; i < keep * K; i++) pred[i] = -1;
        float *mg = tr->margins + ((int64_t)l * C + base) * 2;
        if (L->moe) {
            memcpy(probs, s->router_probs, (size_t)(keep * E) * sizeof(float));
            memcpy(ids, s->topk_ids, (size_t)(keep * K) * sizeof(int32_t));
            memcpy(w, s->topk_w, (size_t)(keep * K) * sizeof(float));
            for (int64_t t = 0; t < keep; t++) { /* route_skip is free after the ROUTER stage */
                mg[2 * t] = K < E ? kth_gap(s->router_logits + t * E, E, K, s->route_skip) : NAN;
                mg[2 * t + 1] = K < E ? kth_gap(s->router_probs + t * E, E, K, s->route_skip) : NAN;
            }
        } else {
            for (int64_t i = 0; i < keep * 2; i++) mg[i] = NAN;
            for (int64_t i = 0; i < keep * E; i++) probs[i] = NAN;
            for (int64_t i = 0; i < keep * K; i++) { ids[i] = -1; w[i] = 0.0f; }
        }
        break;
    }
    case COLIBRI_STAGE_GROUPING:
        if (L->moe) {
            for (int64_t e = 0; e < E; e++) {
                tr->group_sizes[(int64_t)l * E + e] += s->expert_count[e];
                tr->padded_sizes[(int64_t)l * E + e] += s->expert_offset[e + 1] - s->expert_offset[e];
            }
        }
        break;
    case COLIBRI_STAGE_EXPERT_FFN: {
        float *g = tr->shared_gate + (int64_t)l * C + base;
        for (int64_t t = 0; t < keep; t++)
            g[t] = !L->moe || !L->has_shared ? NAN : L->shared_gate.w ? s->sh_gate[t] : 1.0f;
        break;
    }
    case COLIBRI_STAGE_LM_HEAD:
        tr->n_tokens = base + keep;
        tr->dropped += T - keep;
        tr->chunk_base = tr->n_tokens;
        tr->n_forwards++;
        break;
    default:
        break;
    }
}

/* Run one stage of the current chunk: the only place stages are dispatched, so the fused
 * forward and the stage-by-stage API compute the same thing, and a trace costs nothing
 * but one pointer test when none is attached. */
static void run_stage(colibri_ctx *ctx, int32_t stage, uint32_t l, float *logits, int watched) {
    uint64_t t0 = ctx->trace ? now_ns() : 0;
    /* the cache's counters move in layer l's expert FFN, and layer l+1's (its prefetches) */
    int64_t before[2][CB_EC_N_STATS] = {{0}};
    int count_cache = ctx->trace && ctx->ecache && stage == COLIBRI_STAGE_EXPERT_FFN;
    if (count_cache)
        for (int j = 0; j < 2; j++)
            for (int k = 0; k < CB_EC_N_STATS; k++) before[j][k] = cb_ecache_stat(ctx->ecache, (int32_t)l + j, k);
    const cb_backend *be = ctx->be;
    switch (stage) {
    case COLIBRI_STAGE_EMBEDDING: be->embedding(ctx); break;
    case COLIBRI_STAGE_ATTENTION: be->attention(ctx, l); break;
    case COLIBRI_STAGE_ROUTER: be->router(ctx, l); break;
    case COLIBRI_STAGE_GROUPING: be->grouping(ctx, l); break;
    case COLIBRI_STAGE_EXPERT_FFN: be->expert_ffn(ctx, l); break;
    case COLIBRI_STAGE_COMBINE: be->combine(ctx, l); break;
    default: be->lm_head(ctx, logits); break;
    }
    /* a device backend's outputs come to the host scratch only for those who read them */
    if (be->to_host && (ctx->trace || watched)) be->to_host(ctx, stage, l);
    if (ctx->trace) {
        uint64_t dt = now_ns() - t0;
        colibri_trace *tr = ctx->trace;
        tr->stage_ns[stage] += dt;
        if (stage >= COLIBRI_STAGE_ATTENTION && stage <= COLIBRI_STAGE_COMBINE)
            tr->layer_ns[(int64_t)l * 5 + (stage - COLIBRI_STAGE_ATTENTION)] += dt;
        trace_record(ctx, stage, l);
        for (uint32_t j = 0; count_cache && j < 2 && l + j < ctx->cfg.n_layers; j++)
            for (int k = 0; k < CB_EC_N_STATS; k++)
                tr->cache_stats[(int64_t)(l + j) * CB_EC_N_STATS + k] +=
                    cb_ecache_stat(ctx->ecache, (int32_t)(l + j), k) - before[j][k];
    }
}

/* The attention segments of the chunk's rows: maximal runs of rows of one sequence at
 * consecutive positions (a batch's rows of one sequence may interleave with others'). */
static void run_segments(colibri_ctx *ctx) {
    cb_scratch *s = &ctx->s;
    int64_t T = ctx->run.T, n = 0;
    for (int64_t t = 0; t < T; t++)
        if (t == 0 || s->row_seq[t] != s->row_seq[t - 1] || s->row_pos[t] != s->row_pos[t - 1] + 1)
            s->seg_row[n++] = t;
    s->seg_row[n] = T;
    ctx->run.n_seg = n;
}

/* Set up a chunk of one sequence: T tokens at positions pos0.. of sequence seq, ids copied
 * into the arena (a stage run outlives the caller's array); LM head on every row. */
static void run_setup(colibri_ctx *ctx, const int32_t *ids, int64_t T, int32_t seq, int64_t pos0) {
    cb_scratch *s = &ctx->s;
    memcpy(s->run_ids, ids, (size_t)T * sizeof(int32_t));
    for (int64_t t = 0; t < T; t++) {
        s->row_seq[t] = seq;
        s->row_pos[t] = pos0 + t;
        s->head_idx[t] = (int32_t)t;
    }
    ctx->run.T = T;
    ctx->run.stage = COLIBRI_STAGE_EMBEDDING;
    ctx->run.layer = -1;
    ctx->run.head_rows = T;
    ctx->run.att_layer = -1;
    ctx->run.pred_layer = -1;
    run_segments(ctx);
}

/* The next stage after the current one. */
static void run_advance(colibri_ctx *ctx) {
    cb_run *r = &ctx->run;
    if (r->stage == COLIBRI_STAGE_EMBEDDING) {
        r->stage = ctx->cfg.n_layers ? COLIBRI_STAGE_ATTENTION : COLIBRI_STAGE_LM_HEAD;
        r->layer = ctx->cfg.n_layers ? 0 : -1;
    } else if (r->stage == COLIBRI_STAGE_COMBINE) {
        if ((uint32_t)r->layer + 1 < ctx->cfg.n_layers) {
            r->stage = COLIBRI_STAGE_ATTENTION;
            r->layer++;
        } else {
            r->stage = COLIBRI_STAGE_LM_HEAD;
            r->layer = -1;
        }
    } else if (r->stage == COLIBRI_STAGE_LM_HEAD) {
        r->stage = -1;
    } else {
        r->stage++;
    }
}

/* Run every stage of the chunk set up in ctx->run; logits: [head_rows, V]. */
static void run_chunk(colibri_ctx *ctx, float *logits) {
    const cb_backend *be = ctx->be;
    if (be->begin_chunk) be->begin_chunk(ctx);
    if (be->run_chunk && !ctx->trace && be->run_chunk(ctx, logits)) {
        ctx->run.stage = -1;
        return;
    }
    while (ctx->run.stage >= 0) {
        run_stage(ctx, ctx->run.stage, (uint32_t)ctx->run.layer, logits, 0);
        run_advance(ctx);
    }
}

static colibri_status check_logits(colibri_ctx *ctx, const float *lg, int64_t T, int64_t first) {
    const int64_t V = ctx->cfg.vocab;
    for (int64_t i = 0; i < T * V; i++) {
        if (!isfinite(lg[i]))
            return cb_fail(ctx, COLIBRI_E_NUMERIC, "logit %lld of token %lld is %s: the weights or the "
                           "activations overflowed; check the model with colibri_verify or use f32 weights",
                           (long long)(i % V), (long long)(first + i / V), isnan(lg[i]) ? "NaN" : "Inf");
    }
    return COLIBRI_OK;
}

colibri_status cb_check_input(colibri_ctx *ctx, const int32_t *ids, int64_t n, int64_t start_pos) {
    const int64_t V = ctx->cfg.vocab;
    const cb_kv *kv = &ctx->sess.kv;
    if (start_pos < 0 || start_pos > kv->len[0])
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "start_pos %lld is not in [0, %lld] (the cached length); "
                       "continue at or before the cached length, or start again at 0",
                       (long long)start_pos, (long long)kv->len[0]);
    if (n > ctx->max_seq_len - start_pos)
        return cb_fail(ctx, COLIBRI_E_SEQ_TOO_LONG, "start_pos %lld + %lld tokens = %lld exceeds max_seq_len %lld; "
                       "raise colibri_options.max_seq_len (the file allows up to %llu) or shorten the input",
                       (long long)start_pos, (long long)n, (long long)(start_pos + n),
                       (long long)ctx->max_seq_len, (unsigned long long)ctx->cfg.file_max_seq_len);
    /* ids are read only once n is known to be a sane length */
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= (int64_t)V)
            return cb_fail(ctx, COLIBRI_E_TOKEN_RANGE, "token id %d at position %lld is out of range [0, %lld)",
                           ids[i], (long long)i, (long long)V);
    }
    /* room in the KV cache once the positions from start_pos on are given back */
    int64_t need = cb_kv_blocks_needed(kv, 0, start_pos, start_pos + n);
    int64_t have = cb_kv_available(kv) + cb_kv_blocks_freed(kv, 0, start_pos);
    if (need > have)
        return cb_fail(ctx, COLIBRI_E_NOMEM, "the KV cache has %lld free blocks of %lld positions, %lld are needed "
                       "for %lld more positions of sequence 0; free other sequences (colibri_seq_clear) or open "
                       "the context with a larger kv_tokens", (long long)have, (long long)kv->block_len,
                       (long long)need, (long long)n);
    return COLIBRI_OK;
}

/* Sequence 0 keeps positions [0, start_pos) and grows to start_pos + n (checked); the prefix
 * cache learns the new positions' tokens. */
static void seq0_prepare(colibri_ctx *ctx, const int32_t *ids, int64_t start_pos, int64_t n) {
    cb_kv_truncate(&ctx->sess.kv, 0, start_pos);
    cb_kv_grow(&ctx->sess.kv, 0, start_pos + n);
    for (int64_t i = 0; i < n; i++) cb_kv_set_token(&ctx->sess.kv, 0, start_pos + i, ids[i]);
}

/* The chunk's keys and values are computed: the prefix cache registers the blocks it filled. */
static void chunk_written(colibri_ctx *ctx) {
    if (!ctx->sess.kv.prefix) return;
    for (int64_t t = 0; t < ctx->run.T; t++) /* never what interventions changed */
        if (!ctx->iv || !cb_iv_for(ctx->iv, ctx->s.row_seq[t]))
            cb_kv_written(&ctx->sess.kv, ctx->s.row_seq[t], ctx->s.row_pos[t]);
}

/* Caller (colibri_forward_at) guarantees ctx, ids, logits non-NULL, n >= 1, start_pos >= 0.
 * Every check happens before the cache is touched, so a refused call changes nothing.
 * last_only: logits is [V], the last token's logits; the LM head runs on that row only. */
colibri_status cb_forward(colibri_ctx *ctx, const int32_t *ids, int64_t n, int64_t start_pos,
                          float *logits, int last_only) {
    colibri_status st = cb_check_input(ctx, ids, n, start_pos);
    if (st != COLIBRI_OK) return st;
    seq0_prepare(ctx, ids, start_pos, n);
    for (int64_t c0 = 0; c0 < n; c0 += ctx->max_batch) {
        int64_t T = n - c0 < ctx->max_batch ? n - c0 : ctx->max_batch;
        int64_t rows = !last_only ? T : c0 + T == n ? 1 : 0;
        float *lg = last_only ? logits : logits + c0 * ctx->cfg.vocab;
        run_setup(ctx, ids + c0, T, 0, start_pos + c0);
        if (last_only) {
            ctx->run.head_rows = rows;
            ctx->s.head_idx[0] = (int32_t)(T - 1);
        }
        run_chunk(ctx, lg);
        if (ctx->be->status && (st = ctx->be->status(ctx)) != COLIBRI_OK) return st;
        chunk_written(ctx);
        st = check_logits(ctx, lg, rows, c0 + T - rows);
        if (st != COLIBRI_OK) return st;
    }
    return COLIBRI_OK;
}

/* colibri_batch: check every entry and the room in the cache, grow every sequence, then run
 * the entries in chunks of at most max_batch rows. With targets (colibri_batch_logprobs) the
 * LM head writes into the arena's lp_logits, so a chunk also ends at lp_rows entries with
 * logits, and each row becomes its target's log-probability in logprobs. */
static colibri_status batch_run(colibri_ctx *ctx, const colibri_batch_entry *e, int64_t n, float *logits,
                                const int32_t *targets, float *logprobs) {
    cb_kv *kv = &ctx->sess.kv;
    cb_scratch *s = &ctx->s;
    const int64_t V = ctx->cfg.vocab;
    if (!e || n <= 0)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_batch: entries must not be NULL and n (%lld) must be "
                       ">= 1", (long long)n);
    for (int64_t q = 0; q < ctx->max_seqs; q++) s->seq_next[q] = kv->len[q];
    int64_t n_logits = 0;
    for (int64_t i = 0; i < n; i++) {
        if (e[i].seq < 0 || e[i].seq >= ctx->max_seqs)
            return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_batch: entry %lld has sequence %d, not in [0, %d); "
                           "open the context with a larger max_seqs", (long long)i, e[i].seq, ctx->max_seqs);
        if (e[i].token < 0 || e[i].token >= V)
            return cb_fail(ctx, COLIBRI_E_TOKEN_RANGE, "colibri_batch: entry %lld has token id %d, out of range "
                           "[0, %lld)", (long long)i, e[i].token, (long long)V);
        if ((e[i].logits != 0 && e[i].logits != 1) || e[i].reserved != 0)
            return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_batch: entry %lld has logits %d (must be 0 or 1) "
                           "and reserved %d (must be 0)", (long long)i, e[i].logits, e[i].reserved);
        int64_t *next = &s->seq_next[e[i].seq];
        if (e[i].pos != *next)
            return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_batch: entry %lld is position %lld of sequence %d, "
                           "but that sequence continues at position %lld (its length, then one more per entry); "
                           "truncate it first to rewrite positions", (long long)i, (long long)e[i].pos,
                           e[i].seq, (long long)*next);
        if (*next >= ctx->max_seq_len)
            return cb_fail(ctx, COLIBRI_E_SEQ_TOO_LONG, "colibri_batch: entry %lld would be position %lld of "
                           "sequence %d, past max_seq_len %lld; end the sequence or raise max_seq_len",
                           (long long)i, (long long)*next, e[i].seq, (long long)ctx->max_seq_len);
        (*next)++;
        n_logits += e[i].logits;
    }
    if (n_logits > 0 && !logits && !targets)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_batch: %lld entries ask for logits but the logits "
                       "buffer is NULL", (long long)n_logits);
    if (targets) {
        if (n_logits > 0 && !logprobs)
            return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_batch_logprobs: %lld entries ask for a "
                           "log-probability but logprobs is NULL", (long long)n_logits);
        for (int64_t j = 0; j < n_logits; j++)
            if (targets[j] < 0 || targets[j] >= V)
                return cb_fail(ctx, COLIBRI_E_TOKEN_RANGE, "colibri_batch_logprobs: target %lld is token id %d, "
                               "out of range [0, %lld)", (long long)j, targets[j], (long long)V);
    }
    int64_t need = 0;
    for (int32_t q = 0; q < ctx->max_seqs; q++) need += cb_kv_blocks_needed(kv, q, kv->len[q], s->seq_next[q]);
    if (need > cb_kv_available(kv))
        return cb_fail(ctx, COLIBRI_E_NOMEM, "colibri_batch: the KV cache has %lld free blocks of %lld positions "
                       "and this batch needs %lld; run fewer entries, free finished sequences "
                       "(colibri_seq_clear) or open the context with a larger kv_tokens",
                       (long long)cb_kv_available(kv), (long long)kv->block_len, (long long)need);
    for (int32_t q = 0; q < ctx->max_seqs; q++) cb_kv_grow(kv, q, s->seq_next[q]);
    for (int64_t i = 0; kv->prefix && i < n; i++) cb_kv_set_token(kv, e[i].seq, e[i].pos, e[i].token);
    int64_t done_logits = 0, max_rows = targets ? s->lp_rows : ctx->max_batch;
    for (int64_t c0 = 0, T = 0; c0 < n; c0 += T) {
        int64_t R = 0;
        for (T = 0; c0 + T < n && T < ctx->max_batch && R < max_rows; T++) {
            const colibri_batch_entry *x = &e[c0 + T];
            s->run_ids[T] = x->token;
            s->row_seq[T] = x->seq;
            s->row_pos[T] = x->pos;
            if (x->logits) s->head_idx[R++] = (int32_t)T;
        }
        ctx->run.T = T;
        ctx->run.stage = COLIBRI_STAGE_EMBEDDING;
        ctx->run.layer = -1;
        ctx->run.head_rows = R;
        ctx->run.att_layer = -1;
        ctx->run.pred_layer = -1;
        run_segments(ctx);
        float *lg = !R ? NULL : targets ? s->lp_logits : logits + done_logits * V;
        run_chunk(ctx, lg);
        colibri_status st = ctx->be->status ? ctx->be->status(ctx) : COLIBRI_OK;
        if (st != COLIBRI_OK) return st;
        chunk_written(ctx);
        st = check_logits(ctx, lg, R, done_logits);
        if (st != COLIBRI_OK) return st;
        if (targets && R) cb_logprob_rows(ctx, lg, R, targets + done_logits, logprobs + done_logits);
        done_logits += R;
    }
    return COLIBRI_OK;
}

colibri_status cb_batch(colibri_ctx *ctx, const colibri_batch_entry *e, int64_t n, float *logits) {
    return batch_run(ctx, e, n, logits, NULL, NULL);
}

colibri_status cb_batch_logprobs(colibri_ctx *ctx, const colibri_batch_entry *e, int64_t n, const int32_t *targets,
                                 float *logprobs) {
    if (!targets)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_batch_logprobs: targets must not be NULL");
    return batch_run(ctx, e, n, NULL, targets, logprobs);
}

/* ---- stage-by-stage execution (colibri_stage_*) -------------------------------------- */

static const char *const STAGE_NAMES[COLIBRI_N_STAGES] = {
    "EMBEDDING", "ATTENTION", "ROUTER", "GROUPING", "EXPERT_FFN", "COMBINE", "LM_HEAD"};

colibri_status cb_stage_begin(colibri_ctx *ctx, const int32_t *ids, int64_t n, int64_t start_pos) {
    ctx->run.stage = -1;
    if (n > ctx->max_batch)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "a stage run takes at most max_batch = %lld tokens, got %lld; "
                       "split the input or raise colibri_options.max_batch",
                       (long long)ctx->max_batch, (long long)n);
    colibri_status st = cb_check_input(ctx, ids, n, start_pos);
    if (st != COLIBRI_OK) return st;
    seq0_prepare(ctx, ids, start_pos, n);
    run_setup(ctx, ids, n, 0, start_pos);
    return COLIBRI_OK;
}

colibri_status cb_stage_run(colibri_ctx *ctx, int32_t stage, float *logits) {
    cb_run *r = &ctx->run;
    if (r->stage < 0)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "no stage run is active; call colibri_stage_begin first");
    if (stage < 0 || stage >= COLIBRI_N_STAGES)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "stage %d is not a colibri_stage (0..%d)", stage,
                       COLIBRI_N_STAGES - 1);
    if (stage != r->stage)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "stage %s was asked but %s%s%d runs next; stages run in order",
                       STAGE_NAMES[stage], STAGE_NAMES[r->stage], r->layer >= 0 ? " of layer " : "",
                       r->layer >= 0 ? r->layer : 0);
    if (stage == COLIBRI_STAGE_LM_HEAD && !logits)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "the LM_HEAD stage needs a logits buffer of %lld x %u floats",
                       (long long)r->T, ctx->cfg.vocab);
    if (stage == COLIBRI_STAGE_EMBEDDING && ctx->be->begin_chunk) ctx->be->begin_chunk(ctx);
    run_stage(ctx, stage, r->layer < 0 ? 0 : (uint32_t)r->layer, logits, 1);
    run_advance(ctx);
    if (ctx->be->status) {
        colibri_status st = ctx->be->status(ctx);
        if (st != COLIBRI_OK) {
            r->stage = -1; /* the device state is lost: the stage run ends */
            return st;
        }
    }
    /* a stage run's blocks are not offered to the prefix cache: its caller may have written
     * into any stage tensor between stages (colibri_stage_tensor hands out writable views),
     * so its keys and values need not be what its tokens compute */
    if (stage == COLIBRI_STAGE_LM_HEAD) return check_logits(ctx, logits, r->T, 0);
    return COLIBRI_OK;
}

/* The attention sinks' share of each (row, query head)'s softmax at the layer whose
 * attention ran last: exp(sink - m) / (sum_j exp(s_j - m) + exp(sink - m)) over the row's
 * visible keys, recomputed (in double) from the chunk's q and the KV cache, only when the
 * lab asks for it, so the forward pass pays nothing. */
static void fill_sink_share(colibri_ctx *ctx) {
    const cb_config *c = &ctx->cfg;
    cb_scratch *s = &ctx->s;
    int64_t T = ctx->run.T, Hq = c->n_heads, D = c->head_dim, group = c->n_heads / c->n_kv_heads;
    int32_t l = ctx->run.att_layer;
    if (l < 0) {
        for (int64_t i = 0; i < T * Hq; i++) s->sink_share[i] = NAN;
        return;
    }
    const cb_layer *L = &ctx->w.layers[l];
    double scale = 1.0 / sqrt((double)D);
    for (int64_t t = 0; t < T; t++) {
        cb_kv_view kv = cb_kv_layer_view(&ctx->sess.kv, s->row_seq[t], (uint32_t)l);
        int64_t pos = s->row_pos[t];
        int64_t lo = (L->window > 0 && pos >= L->window) ? pos - L->window + 1 : 0;
        for (int64_t h = 0; h < Hq; h++) {
            const float *qh = s->q + t * Hq * D + h * D;
            double m = L->sinks[h], sum = 0.0;
            for (int pass = 0; pass < 2; pass++)
                for (int64_t j = lo; j <= pos; j++) {
                    const float *kr = cb_kv_at(kv.k, &kv, h / group, j, D);
                    double acc = 0.0;
                    for (int64_t d = 0; d < D; d++) acc += (double)qh[d] * kr[d];
                    acc *= scale;
                    if (pass == 0 && acc > m) m = acc;
                    if (pass == 1) sum += exp(acc - m);
                }
            double e = exp((double)L->sinks[h] - m);
            s->sink_share[t * Hq + h] = (float)(e / (sum + e));
        }
    }
}

colibri_status cb_stage_tensor(colibri_ctx *ctx, const char *name, const void **data,
                               int32_t *dtype, int32_t *ndim, int64_t shape[4]) {
    const cb_config *c = &ctx->cfg;
    cb_scratch *s = &ctx->s;
    int64_t T = ctx->run.T, H = c->hidden, E = c->n_experts, K = c->top_k;
    int64_t Nq = (int64_t)c->n_heads * c->head_dim, Nkv = (int64_t)c->n_kv_heads * c->head_dim;
    int64_t rows = s->expert_offset[E];
    int64_t F = c->dense_inter > c->shared_inter ? c->dense_inter : c->shared_inter;
    int mla = c->attention == CB_ATTN_MLA;
    if (mla) { /* q [T, nh*(dn+dr)], k the latent rows [T, r+dr], v [T, 0], att [T, nh*dv] */
        Nq = (int64_t)c->n_heads * (c->qk_nope_dim + c->head_dim);
        Nkv = (int64_t)c->kv_lora_rank + c->head_dim;
    }
    int64_t Natt = mla ? (int64_t)c->n_heads * c->v_head_dim : Nq;
    struct { const char *n; const void *p; int32_t dt; int32_t nd; int64_t d0, d1; } tab[] = {
        {"x", s->x, COLIBRI_DTYPE_F32, 2, T, H},
        {"xn", s->xn, COLIBRI_DTYPE_F32, 2, T, H},
        {"q", s->q, COLIBRI_DTYPE_F32, 2, T, Nq},
        {"k", s->k, COLIBRI_DTYPE_F32, 2, T, Nkv},
        {"v", s->v, COLIBRI_DTYPE_F32, 2, T, mla ? 0 : Nkv}, /* MLA: no values, [T, 0] */
        {"att", s->att, COLIBRI_DTYPE_F32, 2, T, Natt},
        {"delta", s->delta, COLIBRI_DTYPE_F32, 2, T, H},
        {"router_logits", s->router_logits, COLIBRI_DTYPE_F32, 2, T, E},
        {"router_probs", s->router_probs, COLIBRI_DTYPE_F32, 2, T, E},
        {"topk_ids", s->topk_ids, COLIBRI_DTYPE_I32, 2, T, K},
        {"topk_weights", s->topk_w, COLIBRI_DTYPE_F32, 2, T, K},
        {"expert_count", s->expert_count, COLIBRI_DTYPE_I64, 1, E, 0},
        {"expert_offset", s->expert_offset, COLIBRI_DTYPE_I64, 1, E + 1, 0},
        {"row_token", s->row_token, COLIBRI_DTYPE_I32, 1, rows, 0},
        {"row_weight", s->row_weight, COLIBRI_DTYPE_F32, 1, rows, 0},
        {"ex_in", s->ex_in, COLIBRI_DTYPE_F32, 2, rows, H},
        {"ex_h", s->ex_h, COLIBRI_DTYPE_F32, 2, rows, c->inter},
        {"ex_out", s->ex_out, COLIBRI_DTYPE_F32, 2, rows, H},
        {"shared_out", s->sh_out, COLIBRI_DTYPE_F32, 2, c->shared_inter ? T : 0, H},
        {"shared_gate", s->sh_gate, COLIBRI_DTYPE_F32, 1, c->shared_gate ? T : 0, 0},
        {"ffn_h", s->ffn_h, COLIBRI_DTYPE_F32, 2, T, F},
        {"sink_share", c->attn_sinks ? s->sink_share : NULL, COLIBRI_DTYPE_F32, 2, T, c->n_heads},
    };
    for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++) {
        if (strcmp(tab[i].n, name) != 0) continue;
        if (!tab[i].p)
            return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "this model has no '%s' tensor (no such block)", name);
        if (strcmp(name, "sink_share") == 0) fill_sink_share(ctx); /* (a zero-size buffer may share another's address) */
        *data = tab[i].p;
        *dtype = tab[i].dt;
        *ndim = tab[i].nd;
        shape[0] = tab[i].d0;
        shape[1] = tab[i].nd > 1 ? tab[i].d1 : 0;
        shape[2] = shape[3] = 0;
        return COLIBRI_OK;
    }
    return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_stage_tensor: unknown name '%s'; see colibri.h for the list",
                   name);
}

/* colibri_lens: the final norm and LM head on caller rows, through the LM_HEAD stage's
 * code on a chunk of n rows whose residual is the caller's (x and xn are overwritten; no
 * stage run is active). */
colibri_status cb_lens(colibri_ctx *ctx, const float *resid, int64_t n, float *logits) {
    const int64_t H = ctx->cfg.hidden;
    if (!resid || !logits || n <= 0 || n > ctx->max_batch)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_lens: resid and logits must be non-NULL and n (%lld) in "
                       "[1, max_batch = %lld]", (long long)n, (long long)ctx->max_batch);
    if (ctx->run.stage >= 0)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_lens: a stage run is active; finish it first");
    cb_scratch *s = &ctx->s;
    memcpy(s->x, resid, (size_t)(n * H) * sizeof(float));
    for (int64_t t = 0; t < n; t++) {
        s->head_idx[t] = (int32_t)t;
        s->row_seq[t] = -1;
    }
    ctx->run.T = n;
    ctx->run.head_rows = n;
    struct cb_interv *iv = ctx->iv; /* no patch applies to these rows */
    ctx->iv = NULL;
    if (ctx->be->begin_chunk) ctx->be->begin_chunk(ctx);
    ctx->be->lm_head(ctx, logits);
    ctx->iv = iv;
    return ctx->be->status ? ctx->be->status(ctx) : COLIBRI_OK;
}
