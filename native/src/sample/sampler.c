/*
 * sampler.c — colibri_sampler: the sampling state of one sequence. Logit bias, repetition,
 * presence and frequency penalties, the grammar mask and ignore_eos are applied to a copy of
 * the raw logits, then the shared core (cb_sample_row: temperature, top-k, top-p, min-p)
 * picks the token. Everything is allocated by colibri_sampler_create; a step allocates
 * nothing. The order of the steps is the header's (colibri.h, "Per-sequence sampler").
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"
#include "core/error.h"
#include "grammar/grammar.h"
#include "sample/sample.h"

struct colibri_sampler {
    colibri_sampling_params p;
    int32_t V, eos_id;
    float *lg;          /* [V] working copy of the logits */
    int32_t *idx;       /* [V] candidate ids */
    float *prob;        /* [V] candidate probabilities */
    float *bias;        /* [V] logit bias (0: none) */
    int32_t *gen_count; /* [V] times generated */
    int32_t *rep_count; /* [V] occurrences in the repetition window */
    int32_t *window;    /* [repetition_last_n] ring of the window's tokens (last_n > 0) */
    int64_t n_seen;     /* tokens pushed into the window so far */
    int32_t *seen;      /* [V] distinct ids with a non-zero count (either array) */
    uint8_t *in_seen;   /* [V] */
    int32_t n_distinct;
    int32_t *stop;      /* [V] stop ids */
    int32_t n_stop;
    int32_t *end;       /* [V] end ids (colibri_sampler_set_end_ids; EOS apart) */
    int32_t n_end;
    uint8_t *kind;      /* [V] END_TOK (EOS or an end id) | STOP_TOK (a stop id), 0 for the others */
    uint8_t *mask;      /* [V] grammar mask */
    int has_bias;
    const colibri_grammar *g;
    cb_matcher *m;
    int32_t finished;
    char err[CB_ERR_LEN];
};

#define END_TOK 1
#define STOP_TOK 2

static colibri_status s_fail(colibri_sampler *s, colibri_status st, const char *fmt, ...) CB_PRINTF(3, 4);
static colibri_status s_fail(colibri_sampler *s, colibri_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->err, sizeof s->err, fmt, ap);
    va_end(ap);
    return st;
}

void colibri_sampling_params_init(colibri_sampling_params *p) {
    if (!p) return;
    memset(p, 0, sizeof *p);
    p->struct_size = (uint32_t)sizeof *p;
    p->temperature = 1.0f;
    p->top_p = 1.0f;
    p->repetition_penalty = 1.0f;
}

static const char *check_params(const colibri_sampling_params *p, char *buf, size_t len) {
    if (p->struct_size != sizeof *p) {
        snprintf(buf, len, "colibri_sampler_create: params.struct_size %u is not %zu (call colibri_sampling_params_init)",
                 p->struct_size, sizeof *p);
        return buf;
    }
    if (!(p->temperature >= 0.0f) || isinf(p->temperature))
        snprintf(buf, len, "temperature %g must be finite and >= 0 (0 = greedy)", (double)p->temperature);
    else if (p->top_k < 0)
        snprintf(buf, len, "top_k %d must be >= 0 (0 = off)", p->top_k);
    else if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        snprintf(buf, len, "top_p %g must be in (0, 1] (1 = off)", (double)p->top_p);
    else if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        snprintf(buf, len, "min_p %g must be in [0, 1] (0 = off)", (double)p->min_p);
    else if (!(p->presence_penalty >= -2.0f && p->presence_penalty <= 2.0f))
        snprintf(buf, len, "presence_penalty %g must be in [-2, 2]", (double)p->presence_penalty);
    else if (!(p->frequency_penalty >= -2.0f && p->frequency_penalty <= 2.0f))
        snprintf(buf, len, "frequency_penalty %g must be in [-2, 2]", (double)p->frequency_penalty);
    else if (!(p->repetition_penalty > 0.0f) || isinf(p->repetition_penalty))
        snprintf(buf, len, "repetition_penalty %g must be finite and > 0 (1 = off)", (double)p->repetition_penalty);
    else if (p->repetition_last_n < 0)
        snprintf(buf, len, "repetition_last_n %d must be >= 0 (0 = the whole sequence)", p->repetition_last_n);
    else
        return NULL;
    return buf;
}

colibri_status colibri_sampler_create(int32_t n_vocab, int32_t eos_id, const colibri_sampling_params *p,
                                      colibri_sampler **out, char *err, size_t err_len) {
    if (out) *out = NULL;
    if (!out || !p) {
        cb_set_err(err, err_len, "colibri_sampler_create: params and out must not be NULL");
        return COLIBRI_E_INVALID_ARG;
    }
    if (n_vocab <= 0 || eos_id < -1 || eos_id >= n_vocab) {
        cb_set_err(err, err_len, "colibri_sampler_create: n_vocab %d must be > 0 and eos_id %d in -1..n_vocab-1",
                   n_vocab, eos_id);
        return COLIBRI_E_INVALID_ARG;
    }
    char buf[256];
    const char *bad = check_params(p, buf, sizeof buf);
    if (bad) {
        cb_set_err(err, err_len, "colibri_sampler_create: %s", bad);
        return COLIBRI_E_INVALID_ARG;
    }
    colibri_sampler *s = calloc(1, sizeof *s);
    if (!s) goto nomem;
    s->p = *p;
    s->V = n_vocab;
    s->eos_id = eos_id;
    size_t V = (size_t)n_vocab;
    s->lg = malloc(V * sizeof(float));
    s->idx = malloc(V * sizeof(int32_t));
    s->prob = malloc(V * sizeof(float));
    s->bias = calloc(V, sizeof(float));
    s->gen_count = calloc(V, sizeof(int32_t));
    s->rep_count = calloc(V, sizeof(int32_t));
    s->seen = malloc(V * sizeof(int32_t));
    s->in_seen = calloc(V, 1);
    s->stop = malloc(V * sizeof(int32_t));
    s->end = malloc(V * sizeof(int32_t));
    s->kind = calloc(V, 1);
    s->mask = malloc(V);
    if (p->repetition_last_n > 0) s->window = malloc((size_t)p->repetition_last_n * sizeof(int32_t));
    if (!s->lg || !s->idx || !s->prob || !s->bias || !s->gen_count || !s->rep_count || !s->seen || !s->in_seen ||
        !s->stop || !s->end || !s->kind || !s->mask || (p->repetition_last_n > 0 && !s->window)) {
        colibri_sampler_free(s);
        goto nomem;
    }
    if (eos_id >= 0) s->kind[eos_id] = END_TOK;
    *out = s;
    return COLIBRI_OK;
nomem:
    cb_set_err(err, err_len, "colibri_sampler_create: out of memory for a vocabulary of %d", n_vocab);
    return COLIBRI_E_NOMEM;
}

void colibri_sampler_free(colibri_sampler *s) {
    if (!s) return;
    cb_matcher_free(s->m);
    free(s->lg);
    free(s->idx);
    free(s->prob);
    free(s->bias);
    free(s->gen_count);
    free(s->rep_count);
    free(s->seen);
    free(s->in_seen);
    free(s->stop);
    free(s->end);
    free(s->kind);
    free(s->mask);
    free(s->window);
    free(s);
}

const char *colibri_sampler_last_error(const colibri_sampler *s) { return s ? s->err : ""; }

colibri_status colibri_sampler_set_logit_bias(colibri_sampler *s, const int32_t *ids, const float *bias, int32_t n) {
    if (!s) return COLIBRI_E_INVALID_ARG;
    if (n < 0 || (n > 0 && (!ids || !bias)))
        return s_fail(s, COLIBRI_E_INVALID_ARG, "colibri_sampler_set_logit_bias: n %d < 0 or NULL arrays", n);
    for (int32_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= s->V)
            return s_fail(s, COLIBRI_E_TOKEN_RANGE, "logit_bias: token id %d is outside 0..%d", ids[i], s->V - 1);
        if (!isfinite(bias[i]))
            return s_fail(s, COLIBRI_E_INVALID_ARG, "logit_bias: the bias of token %d is not finite", ids[i]);
    }
    memset(s->bias, 0, (size_t)s->V * sizeof(float));
    for (int32_t i = 0; i < n; i++) s->bias[ids[i]] += bias[i];
    s->has_bias = n > 0;
    return COLIBRI_OK;
}

/* Replace the ids of one kind (STOP_TOK in s->stop, END_TOK in s->end): checked, the old
 * ones' flag cleared (EOS stays an end), the new ones' set. fn and what name them in errors. */
static colibri_status set_ids(colibri_sampler *s, uint8_t flag, int32_t *list, int32_t *count, const int32_t *ids,
                              int32_t n, const char *fn, const char *what) {
    if (n < 0 || n > s->V || (n > 0 && !ids))
        return s_fail(s, COLIBRI_E_INVALID_ARG, "%s: n %d outside 0..%d or NULL ids", fn, n, s->V);
    for (int32_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= s->V)
            return s_fail(s, COLIBRI_E_TOKEN_RANGE, "%s: token id %d is outside 0..%d", what, ids[i], s->V - 1);
    for (int32_t i = 0; i < *count; i++) s->kind[list[i]] &= (uint8_t)~flag;
    if (s->eos_id >= 0) s->kind[s->eos_id] |= END_TOK;
    if (n) memcpy(list, ids, (size_t)n * sizeof(int32_t));
    *count = n;
    for (int32_t i = 0; i < n; i++) s->kind[ids[i]] |= flag;
    return COLIBRI_OK;
}

colibri_status colibri_sampler_set_stop_ids(colibri_sampler *s, const int32_t *ids, int32_t n) {
    if (!s) return COLIBRI_E_INVALID_ARG;
    return set_ids(s, STOP_TOK, s->stop, &s->n_stop, ids, n, "colibri_sampler_set_stop_ids", "stop");
}

colibri_status colibri_sampler_set_end_ids(colibri_sampler *s, const int32_t *ids, int32_t n) {
    if (!s) return COLIBRI_E_INVALID_ARG;
    return set_ids(s, END_TOK, s->end, &s->n_end, ids, n, "colibri_sampler_set_end_ids", "end");
}

colibri_status colibri_sampler_set_grammar(colibri_sampler *s, const colibri_grammar *g) {
    if (!s) return COLIBRI_E_INVALID_ARG;
    cb_matcher_free(s->m);
    s->m = NULL;
    s->g = NULL;
    if (!g) return COLIBRI_OK;
    if (cb_grammar_vocab(g) > s->V)
        return s_fail(s, COLIBRI_E_INVALID_ARG, "colibri_sampler_set_grammar: the grammar's vocabulary (%d) is larger "
                      "than the sampler's (%d)", cb_grammar_vocab(g), s->V);
    colibri_status st = cb_matcher_create(g, &s->m);
    if (st != COLIBRI_OK) return s_fail(s, st, "colibri_sampler_set_grammar: out of memory for the grammar's state");
    s->g = g;
    return COLIBRI_OK;
}

static void mark_seen(colibri_sampler *s, int32_t id) {
    if (!s->in_seen[id]) {
        s->in_seen[id] = 1;
        s->seen[s->n_distinct++] = id;
    }
}

/* Push one token into the repetition window. */
static void window_push(colibri_sampler *s, int32_t id) {
    int32_t n = s->p.repetition_last_n;
    if (n > 0) {
        int64_t slot = s->n_seen % n;
        if (s->n_seen >= n) s->rep_count[s->window[slot]]--;
        s->window[slot] = id;
    }
    s->rep_count[id]++;
    s->n_seen++;
    mark_seen(s, id);
}

colibri_status colibri_sampler_add_prompt(colibri_sampler *s, const int32_t *ids, int64_t n) {
    if (!s) return COLIBRI_E_INVALID_ARG;
    if (n < 0 || (n > 0 && !ids)) return s_fail(s, COLIBRI_E_INVALID_ARG, "colibri_sampler_add_prompt: bad n or ids");
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= s->V)
            return s_fail(s, COLIBRI_E_TOKEN_RANGE, "colibri_sampler_add_prompt: token id %d is outside 0..%d", ids[i],
                          s->V - 1);
    for (int64_t i = 0; i < n; i++) window_push(s, ids[i]);
    return COLIBRI_OK;
}

/* an id that may end a sequence: EOS, an end id or a stop id */
static int is_end(const colibri_sampler *s, int32_t id) { return s->kind[id] != 0; }

colibri_status colibri_sampler_accept(colibri_sampler *s, int32_t id) {
    if (!s) return COLIBRI_E_INVALID_ARG;
    if (id < 0 || id >= s->V)
        return s_fail(s, COLIBRI_E_TOKEN_RANGE, "colibri_sampler_accept: token id %d is outside 0..%d", id, s->V - 1);
    int end = is_end(s, id), complete = 0;
    if (s->m) {
        /* an end token ends a complete grammar; otherwise it must continue the grammar */
        complete = cb_matcher_complete(s->m);
        if (!(end && complete) && cb_matcher_accept(s->m, id) != 0)
            return s_fail(s, COLIBRI_E_INVALID_ARG, "colibri_sampler_accept: token %d cannot continue the grammar", id);
    }
    s->gen_count[id]++;
    window_push(s, id);
    if (s->kind[id] & STOP_TOK) s->finished = COLIBRI_FINISH_STOP_ID;
    else if ((s->kind[id] & END_TOK) && (!s->p.ignore_eos || (end && complete))) s->finished = COLIBRI_FINISH_EOS;
    else if (s->m && cb_matcher_complete(s->m) && s->eos_id < 0 && s->n_end == 0 && s->n_stop == 0)
        s->finished = COLIBRI_FINISH_GRAMMAR;
    else s->finished = COLIBRI_FINISH_NONE;
    return COLIBRI_OK;
}

colibri_status colibri_sampler_sample(colibri_sampler *s, const float *logits, uint64_t *rng, int32_t *out_id) {
    if (!s) return COLIBRI_E_INVALID_ARG;
    if (!logits || !rng || !out_id)
        return s_fail(s, COLIBRI_E_INVALID_ARG, "colibri_sampler_sample: logits, rng and out_id must not be NULL");
    const int32_t V = s->V;
    float *lg = s->lg;
    for (int32_t i = 0; i < V; i++) {
        if (isnan(logits[i])) return s_fail(s, COLIBRI_E_NUMERIC, "colibri_sampler_sample: logit %d is NaN", i);
        lg[i] = logits[i];
    }
    if (s->has_bias)
        for (int32_t i = 0; i < V; i++) lg[i] += s->bias[i];
    const float rp = s->p.repetition_penalty, pp = s->p.presence_penalty, fp = s->p.frequency_penalty;
    if (rp != 1.0f || pp != 0.0f || fp != 0.0f) {
        for (int32_t k = 0; k < s->n_distinct; k++) {
            int32_t id = s->seen[k];
            if (rp != 1.0f && s->rep_count[id] > 0) lg[id] = lg[id] > 0.0f ? lg[id] / rp : lg[id] * rp;
            int32_t c = s->gen_count[id];
            if (c > 0) lg[id] -= (float)c * fp + pp;
        }
    }
    if (s->m) {
        int complete = cb_matcher_mask(s->m, s->mask, V);
        /* complete: the end tokens (EOS, end and stop ids) may follow, with their values */
        for (int32_t i = 0; i < V; i++)
            if (!s->mask[i] && !(complete && s->kind[i])) lg[i] = -INFINITY;
    }
    int32_t id = -1;
    if (cb_sample_row(lg, V, s->p.temperature, s->p.top_k, s->p.top_p, s->p.min_p, s->idx, s->prob, rng, &id) != 0)
        return s_fail(s, COLIBRI_E_INVALID_ARG,
                      s->m ? "colibri_sampler_sample: no token can continue the grammar (every token is masked)"
                           : "colibri_sampler_sample: every token is masked (logit -inf)");
    colibri_status st = colibri_sampler_accept(s, id);
    if (st != COLIBRI_OK) return st;
    *out_id = id;
    return COLIBRI_OK;
}

int32_t colibri_sampler_finished(const colibri_sampler *s) { return s ? s->finished : COLIBRI_FINISH_NONE; }

int32_t colibri_sampler_grammar_complete(const colibri_sampler *s) {
    return (s && s->m) ? cb_matcher_complete(s->m) : 0;
}

colibri_status colibri_sampler_grammar_mask(colibri_sampler *s, uint8_t *out) {
    if (!s) return COLIBRI_E_INVALID_ARG;
    if (!out) return s_fail(s, COLIBRI_E_INVALID_ARG, "colibri_sampler_grammar_mask: out must not be NULL");
    if (!s->m) return s_fail(s, COLIBRI_E_INVALID_ARG, "colibri_sampler_grammar_mask: no grammar is attached");
    cb_matcher_mask(s->m, out, s->V);
    return COLIBRI_OK;
}
