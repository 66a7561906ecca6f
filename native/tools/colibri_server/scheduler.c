/*
 * scheduler.c — continuous batching over a cs_engine (scheduler.h says what a step does).
 */
#define _POSIX_C_SOURCE 200809L
#include "scheduler.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* PREFILL: the prompt goes into the first choice's sequence; REFILL: after a preemption, each
 * unfinished choice's prompt and generated tokens go back into its sequence */
enum { ST_WAITING = 0, ST_PREFILL = 1, ST_DECODE = 2, ST_DONE = 3, ST_REFILL = 4 };

struct cs_sched {
    cs_sched_config cfg;
    cs_engine eng;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop;
    int draining;            /* cs_sched_drain: no new requests; run returns when idle */
    /* waiting requests, FIFO (under mu) */
    cs_request *wait_head, *wait_tail;
    int64_t n_waiting;
    /* admitted requests in admission order (engine thread; the count is mirrored under mu) */
    cs_request **active;
    int32_t n_active;
    uint8_t *seq_used;       /* [max_seqs] */
    int32_t seqs_free;
    int64_t rotate;          /* first decode candidate of the next step */
    /* the batch */
    colibri_batch_entry *entries;  /* [max_batch_tokens] */
    float *logits;                 /* [min(max_batch_tokens, max_batch_size + max_seqs), vocab] */
    cs_request **row_req;          /* per logits row */
    int32_t *row_choice;           /* -1: a finished prompt */
    /* retired this step: on_done is called at the end of the step, after the statistics
     * are published, so nothing of the step touches a request after its on_done */
    cs_request *done_head;
    char step_err[512];
    /* statistics (under mu) */
    cs_metrics stats;
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

cs_sched *cs_sched_create(const cs_sched_config *cfg, const cs_engine *eng, char *err, size_t err_len) {
    if (!cfg || !eng || !eng->batch || !eng->seq_clear || !eng->seq_fork || !eng->sample ||
        !eng->blocks_free || !eng->blocks_total) {
        snprintf(err, err_len, "scheduler: an engine function is missing");
        return NULL;
    }
    if (cfg->max_seqs < 1 || cfg->max_batch_size < 1 || cfg->max_batch_tokens < 1 || cfg->max_queue < 0 ||
        cfg->ctx_len < 2 || cfg->block_tokens < 1 || cfg->vocab < 1) {
        snprintf(err, err_len, "scheduler: bad configuration (max_seqs %d, max_batch_size %d, "
                 "max_batch_tokens %lld, max_queue %lld, ctx_len %lld, block_tokens %lld)",
                 cfg->max_seqs, cfg->max_batch_size, (long long)cfg->max_batch_tokens,
                 (long long)cfg->max_queue, (long long)cfg->ctx_len, (long long)cfg->block_tokens);
        return NULL;
    }
    cs_sched *s = calloc(1, sizeof *s);
    if (!s) goto oom;
    s->cfg = *cfg;
    if (s->cfg.max_batch_size > s->cfg.max_seqs) s->cfg.max_batch_size = s->cfg.max_seqs;
    if (s->cfg.max_batch_size > s->cfg.max_batch_tokens) s->cfg.max_batch_size = (int32_t)s->cfg.max_batch_tokens;
    s->eng = *eng;
    size_t T = (size_t)s->cfg.max_batch_tokens;
    /* rows with logits in one step: one per decode, one per prompt that ends in it */
    size_t R = (size_t)s->cfg.max_batch_size + (size_t)s->cfg.max_seqs;
    if (R > T) R = T;
    s->active = calloc((size_t)cfg->max_seqs, sizeof *s->active);
    s->seq_used = calloc((size_t)cfg->max_seqs, 1);
    s->entries = calloc(T, sizeof *s->entries);
    s->logits = malloc(R * (size_t)cfg->vocab * sizeof(float));
    s->row_req = calloc(R, sizeof *s->row_req);
    s->row_choice = calloc(R, sizeof *s->row_choice);
    if (!s->active || !s->seq_used || !s->entries || !s->logits || !s->row_req || !s->row_choice) {
        cs_sched_free(s);
        goto oom;
    }
    s->seqs_free = cfg->max_seqs;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    cs_hist_init_ttft(&s->stats.ttft);
    cs_hist_init_tpot(&s->stats.tpot);
    s->stats.kv_blocks_total = eng->blocks_total(eng->self);
    s->stats.kv_blocks_used = s->stats.kv_blocks_total - eng->blocks_free(eng->self);
    s->stats.kv_blocks_cached = eng->blocks_cached ? eng->blocks_cached(eng->self) : 0;
    return s;
oom:
    snprintf(err, err_len, "scheduler: out of memory");
    return NULL;
}

void cs_sched_free(cs_sched *s) {
    if (!s) return;
    if (s->active) {
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->cv);
    }
    free(s->active);
    free(s->seq_used);
    free(s->entries);
    free(s->logits);
    free(s->row_req);
    free(s->row_choice);
    free(s);
}

/* Worst-case blocks of a request (scheduler.h). */
static void reservation(const cs_sched *s, const cs_request *r, int64_t *shared, int64_t *per_choice) {
    int64_t B = s->cfg.block_tokens;
    int64_t L = r->n_prompt + r->max_tokens;
    if (L > s->cfg.ctx_len) L = s->cfg.ctx_len;
    *shared = r->n_prompt / B;
    *per_choice = ceil_div(L, B) - *shared;
}

int cs_sched_check(const cs_sched *s, const cs_request *r, char *msg, size_t msg_len) {
    if (!r->cb || !r->cb->on_token || !r->cb->on_finish || !r->cb->on_done) {
        snprintf(msg, msg_len, "internal: request callbacks missing");
        return CS_E_INVALID;
    }
    if (r->n < 1 || r->n > CS_MAX_CHOICES || r->n > s->cfg.max_seqs) {
        snprintf(msg, msg_len, "n must be between 1 and %d on this server, got %d",
                 s->cfg.max_seqs < CS_MAX_CHOICES ? s->cfg.max_seqs : CS_MAX_CHOICES, r->n);
        return CS_E_INVALID;
    }
    if (r->n_prompt < 1 || !r->prompt) {
        snprintf(msg, msg_len, "the prompt is empty");
        return CS_E_INVALID;
    }
    if (r->n_prompt >= s->cfg.ctx_len) {
        snprintf(msg, msg_len, "the prompt has %lld tokens, but this server's context is %lld tokens "
                 "(prompt and completion together), so a prompt may have at most %lld tokens",
                 (long long)r->n_prompt, (long long)s->cfg.ctx_len, (long long)(s->cfg.ctx_len - 1));
        return CS_E_INVALID;
    }
    if (r->max_tokens < 1) {
        snprintf(msg, msg_len, "max_tokens must be at least 1, got %lld", (long long)r->max_tokens);
        return CS_E_INVALID;
    }
    for (int64_t i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= s->cfg.vocab) {
            snprintf(msg, msg_len, "token id %d at prompt position %lld is out of range [0, %lld)",
                     r->prompt[i], (long long)i, (long long)s->cfg.vocab);
            return CS_E_INVALID;
        }
    int64_t sh, pc;
    reservation(s, r, &sh, &pc);
    int64_t need = sh + (int64_t)r->n * pc;
    int64_t total = s->stats.kv_blocks_total;
    if (need > total) {
        snprintf(msg, msg_len, "the request needs up to %lld KV-cache blocks of %lld tokens (prompt %lld "
                 "tokens, max_tokens %lld, n %d) but the cache has %lld; lower max_tokens or n",
                 (long long)need, (long long)s->cfg.block_tokens, (long long)r->n_prompt,
                 (long long)r->max_tokens, r->n, (long long)total);
        return CS_E_INVALID;
    }
    return CS_OK;
}

int cs_sched_submit(cs_sched *s, cs_request *r) {
    char msg[256];
    if (cs_sched_check(s, r, msg, sizeof msg) != CS_OK) return CS_E_INVALID;
    pthread_mutex_lock(&s->mu);
    if (s->stop || s->draining) {
        pthread_mutex_unlock(&s->mu);
        return CS_E_STOPPED;
    }
    if (s->n_waiting >= s->cfg.max_queue) {
        s->stats.requests_rejected_total++;
        pthread_mutex_unlock(&s->mu);
        return CS_E_QUEUE_FULL;
    }
    r->state = ST_WAITING;
    r->next = NULL;
    r->n_fed = 0;
    r->resume = 0;
    r->completion_tokens = 0;
    r->cached_tokens = 0;
    r->preemptions = 0;
    r->got_first = 0;
    r->t_arrival = now_s();
    for (int c = 0; c < CS_MAX_CHOICES; c++) {
        memset(&r->ch[c], 0, sizeof r->ch[c]);
        r->ch[c].seq = -1;
        r->ch[c].rng = r->seed + (uint64_t)c;
    }
    if (s->wait_tail) s->wait_tail->next = r;
    else s->wait_head = r;
    s->wait_tail = r;
    s->n_waiting++;
    s->stats.requests_waiting = s->n_waiting;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return CS_OK;
}

void cs_sched_cancel(cs_sched *s, cs_request *r) {
    atomic_store(&r->cancel, 1);
    cs_sched_wake(s);
}

void cs_sched_wake(cs_sched *s) {
    pthread_mutex_lock(&s->mu);
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

void cs_sched_stop(cs_sched *s) {
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

void cs_sched_drain(cs_sched *s) {
    pthread_mutex_lock(&s->mu);
    s->draining = 1;
    pthread_cond_broadcast(&s->cv); /* an idle cs_sched_run returns now */
    pthread_mutex_unlock(&s->mu);
}

void cs_sched_snapshot(cs_sched *s, cs_metrics *out) {
    pthread_mutex_lock(&s->mu);
    *out = s->stats;
    pthread_mutex_unlock(&s->mu);
}

/* ---- engine-thread helpers ---------------------------------------------------------- */

static int32_t take_seq(cs_sched *s) {
    for (int32_t i = 0; i < s->cfg.max_seqs; i++)
        if (!s->seq_used[i]) {
            s->seq_used[i] = 1;
            s->seqs_free--;
            return i;
        }
    return -1;
}

/* End choice c of r: its sequence is cleared now (its blocks go back this step). */
static void finish_choice(cs_sched *s, cs_request *r, int c, cs_finish why) {
    cs_choice_state *ch = &r->ch[c];
    if (ch->finished) return;
    ch->finished = 1;
    if (ch->seq >= 0) {
        s->eng.seq_clear(s->eng.self, ch->seq);
        s->seq_used[ch->seq] = 0;
        s->seqs_free++;
        ch->seq = -1;
    }
    r->cb->on_finish(r, c, why);
}

static int all_finished(const cs_request *r) {
    for (int c = 0; c < r->n; c++)
        if (!r->ch[c].finished) return 0;
    return 1;
}

/* Take r out of the active list and hand it back (on_done). */
static void retire(cs_sched *s, cs_request *r, const char *error, uint64_t *finished, uint64_t *cancelled) {
    for (int32_t i = 0; i < s->n_active; i++)
        if (s->active[i] == r) {
            memmove(&s->active[i], &s->active[i + 1], (size_t)(s->n_active - i - 1) * sizeof *s->active);
            s->n_active--;
            break;
        }
    r->state = ST_DONE;
    if (atomic_load(&r->cancel)) (*cancelled)++;
    else (*finished)++;
    r->done_err = error;
    r->next = s->done_head;
    s->done_head = r;
}

static void end_request(cs_sched *s, cs_request *r, cs_finish why, const char *error, uint64_t *fin,
                        uint64_t *can) {
    for (int c = 0; c < r->n; c++) finish_choice(s, r, c, why);
    retire(s, r, error, fin, can);
}

/* Sample choice c's next token from row: its own sampler when it has one, else the plain one. */
static int sample_choice(cs_sched *s, cs_request *r, int c, const float *row, int32_t *tok, int *end) {
    *end = CS_SAMPLE_GO;
    if (r->sampler[c] && s->eng.sample_seq)
        return s->eng.sample_seq(s->eng.self, r->sampler[c], row, &r->ch[c].rng, tok, end);
    return s->eng.sample(s->eng.self, row, r->temperature, r->top_k, r->top_p, &r->ch[c].rng, tok);
}

/* EOS or one of the model's end ids */
static int end_token(const cs_sched_config *cfg, int32_t tok) {
    if (cfg->eos_id >= 0 && tok == cfg->eos_id) return 1;
    for (int32_t i = 0; i < cfg->n_end_ids; i++)
        if (tok == cfg->end_ids[i]) return 1;
    return 0;
}

/* A token of choice c (sampled from row): stop rules. */
static void handle_token(cs_sched *s, cs_request *r, int c, int32_t tok, int end, const float *row, double now,
                         uint64_t *gen, cs_histogram *ttft, cs_histogram *tpot) {
    cs_choice_state *ch = &r->ch[c];
    if (ch->n_gen < ch->gen_cap) ch->gen[ch->n_gen] = tok; /* gen_cap covers every token it may make */
    ch->n_gen++;
    r->completion_tokens++;
    (*gen)++;
    if (!r->got_first) {
        r->got_first = 1;
        cs_hist_observe(ttft, now - r->t_arrival);
    }
    if (ch->n_gen > 1) cs_hist_observe(tpot, now - ch->t_last);
    ch->t_last = now;
    if ((end_token(&s->cfg, tok) && !r->ignore_eos) || end == CS_SAMPLE_END_BEFORE) {
        finish_choice(s, r, c, CS_FINISH_STOP);
        return;
    }
    if (r->cb->on_token(r, c, tok, row) || end == CS_SAMPLE_END_AFTER) {
        finish_choice(s, r, c, CS_FINISH_STOP);
        return;
    }
    if (ch->n_gen >= r->max_tokens || r->n_prompt + ch->n_gen >= s->cfg.ctx_len) {
        finish_choice(s, r, c, CS_FINISH_LENGTH);
        return;
    }
    ch->next_tok = tok;
}

/* The token at position p of choice c's sequence: the prompt's, then the choice's own. */
static int32_t token_at(const cs_request *r, int c, int64_t p) {
    return p < r->n_prompt ? r->prompt[p] : r->ch[c].gen[p - r->n_prompt];
}

/* Positions a preempted choice holds again before it decodes on: its prompt and every token
 * it generated but the last (which is fed next). */
static int64_t refill_target(const cs_request *r, int c) { return r->n_prompt + r->ch[c].n_gen - 1; }

static int32_t choices_left(const cs_request *r) {
    int32_t k = 0;
    for (int c = 0; c < r->n; c++) k += !r->ch[c].finished;
    return k;
}

/* KV blocks a waiting request needs to start: its prompt (or each unfinished choice's
 * prompt and tokens), whatever the prefix cache may hold of it. */
static int64_t admit_need(const cs_sched *s, const cs_request *r) {
    int64_t B = s->cfg.block_tokens;
    if (!r->resume) return ceil_div(r->n_prompt, B);
    int64_t need = 0;
    for (int c = 0; c < r->n; c++)
        if (!r->ch[c].finished) need += ceil_div(refill_target(r, c), B);
    return need;
}

/* Blocks admitted requests still need for their prompts (or refills), plus one per decoding
 * choice: what admission leaves free so that the next steps can run. */
static int64_t promised(const cs_sched *s) {
    int64_t B = s->cfg.block_tokens, k = 0;
    for (int32_t i = 0; i < s->n_active; i++) {
        const cs_request *r = s->active[i];
        if (r->state == ST_PREFILL) k += ceil_div(r->n_prompt, B) - (r->n_fed > 0 ? r->n_fed / B : 0);
        for (int c = 0; c < r->n; c++) {
            const cs_choice_state *ch = &r->ch[c];
            if (ch->finished) continue;
            if (r->state == ST_REFILL) k += ceil_div(refill_target(r, c), B) - ch->len / B;
            if (r->state == ST_DECODE) k++;
        }
    }
    return k;
}

/* A request just admitted (n_fed = -1): the buffers of its generated tokens, then what the
 * prefix cache holds of its prompt (or, resumed, of each choice's prompt and tokens).
 * -1: out of memory. */
static int start_request(cs_sched *s, cs_request *r, uint64_t *hits, uint64_t *queries) {
    int64_t cap = s->cfg.ctx_len - r->n_prompt;
    if (r->max_tokens < cap) cap = r->max_tokens;
    for (int c = 0; c < r->n; c++) {
        cs_choice_state *ch = &r->ch[c];
        if (ch->gen) continue;
        ch->gen = malloc((size_t)cap * sizeof *ch->gen);
        if (!ch->gen) return -1;
        ch->gen_cap = cap;
    }
    int reuse = s->eng.reuse_prefix && !r->no_prefix_cache;
    if (!r->resume) {
        int64_t k = reuse ? s->eng.reuse_prefix(s->eng.self, r->ch[0].seq, r->prompt, r->n_prompt) : 0;
        if (k < 0 || k >= r->n_prompt) k = 0;
        r->n_fed = k;
        if (r->preemptions == 0) r->cached_tokens = k;
        *hits += (uint64_t)k;
        *queries += (uint64_t)r->n_prompt;
        return 0;
    }
    r->n_fed = r->n_prompt;
    for (int c = 0; c < r->n; c++) {
        cs_choice_state *ch = &r->ch[c];
        if (ch->finished) continue;
        int64_t t = refill_target(r, c), k = 0;
        ch->len = 0;
        if (reuse) {
            int32_t *ids = malloc((size_t)t * sizeof *ids);
            if (!ids) return -1;
            for (int64_t p = 0; p < t; p++) ids[p] = token_at(r, c, p);
            k = s->eng.reuse_prefix(s->eng.self, ch->seq, ids, t);
            free(ids);
            if (k < 0 || k >= t) k = 0;
        }
        ch->len = k;
        *hits += (uint64_t)k;
        *queries += (uint64_t)t;
    }
    return 0;
}

/* Free r's sequences (their full blocks stay in the prefix cache) and put it back at the
 * front of the queue; what it generated is kept, to be recomputed on readmission. */
static void preempt(cs_sched *s, cs_request *r) {
    for (int c = 0; c < r->n; c++) {
        cs_choice_state *ch = &r->ch[c];
        if (ch->seq >= 0) {
            s->eng.seq_clear(s->eng.self, ch->seq);
            s->seq_used[ch->seq] = 0;
            s->seqs_free++;
            ch->seq = -1;
        }
        ch->len = 0;
    }
    if (r->state == ST_DECODE || r->state == ST_REFILL) r->resume = 1;
    r->state = ST_WAITING;
    r->n_fed = 0;
    r->preemptions++;
    for (int32_t i = 0; i < s->n_active; i++)
        if (s->active[i] == r) {
            memmove(&s->active[i], &s->active[i + 1], (size_t)(s->n_active - i - 1) * sizeof *s->active);
            s->n_active--;
            break;
        }
    pthread_mutex_lock(&s->mu);
    r->next = s->wait_head;
    s->wait_head = r;
    if (!s->wait_tail) s->wait_tail = r;
    s->n_waiting++;
    s->stats.requests_waiting = s->n_waiting;
    pthread_mutex_unlock(&s->mu);
}

/* The step's batch: decodes first (rotating), then prompt and refill chunks in admission
 * order. *n entries, *rows of them with logits, the first *n_dec decodes. */
static void build_batch(cs_sched *s, int64_t *n_out, int64_t *rows_out, int32_t *n_dec_out) {
    const cs_sched_config *cfg = &s->cfg;
    int64_t n = 0, rows = 0;
    int64_t budget = cfg->max_batch_tokens;
    int32_t n_dec = 0;
    int32_t n_cand = 0;
    for (int32_t i = 0; i < s->n_active; i++)
        if (s->active[i]->state == ST_DECODE) n_cand += s->active[i]->n;
    if (n_cand > 0) {
        int64_t start = s->rotate % n_cand, k = 0;
        /* walk the candidates from `start`, wrapping once */
        for (int pass = 0; pass < 2 && n_dec < cfg->max_batch_size && n < budget; pass++) {
            k = 0;
            for (int32_t i = 0; i < s->n_active && n_dec < cfg->max_batch_size && n < budget; i++) {
                cs_request *r = s->active[i];
                if (r->state != ST_DECODE) continue;
                for (int c = 0; c < r->n && n_dec < cfg->max_batch_size && n < budget; c++, k++) {
                    if ((pass == 0 && k < start) || (pass == 1 && k >= start)) continue;
                    cs_choice_state *ch = &r->ch[c];
                    if (ch->finished) continue;
                    s->entries[n] = (colibri_batch_entry){ch->next_tok, ch->seq, ch->len, 1, 0};
                    s->row_req[rows] = r;
                    s->row_choice[rows] = c;
                    n++, rows++, n_dec++;
                }
            }
        }
        s->rotate = (start + n_dec) % n_cand;
    }
    /* ... then prompt chunks in admission order; beside running decodes at most
     * decode_prefill_tokens of them, so a long prompt cannot stall every stream for a step */
    if (n_dec > 0 && cfg->decode_prefill_tokens > 0 && n + cfg->decode_prefill_tokens < budget)
        budget = n + cfg->decode_prefill_tokens;
    for (int32_t i = 0; i < s->n_active && n < budget; i++) {
        cs_request *r = s->active[i];
        if (r->state == ST_REFILL) { /* a resumed request's choices, no logits: the next tokens are known */
            for (int c = 0; c < r->n && n < budget; c++) {
                cs_choice_state *ch = &r->ch[c];
                if (ch->finished) continue;
                for (int64_t p = ch->len; p < refill_target(r, c) && n < budget; p++)
                    s->entries[n++] = (colibri_batch_entry){token_at(r, c, p), ch->seq, p, 0, 0};
            }
            continue;
        }
        if (r->state != ST_PREFILL) continue;
        int64_t left = r->n_prompt - r->n_fed, take = budget - n < left ? budget - n : left;
        for (int64_t j = 0; j < take; j++) {
            int64_t p = r->n_fed + j;
            int last = p == r->n_prompt - 1;
            s->entries[n++] = (colibri_batch_entry){r->prompt[p], r->ch[0].seq, p, last, 0};
            if (last) {
                s->row_req[rows] = r;
                s->row_choice[rows] = -1;
                rows++;
            }
        }
    }
    *n_out = n;
    *rows_out = rows;
    *n_dec_out = n_dec;
}

int64_t cs_sched_step(cs_sched *s) {
    const cs_sched_config *cfg = &s->cfg;
    cs_request *dropped = NULL; /* cancelled while waiting: singly linked through next */
    uint64_t fin = 0, can = 0, gen = 0, prompt_tokens = 0, hits = 0, queries = 0, preemptions = 0;
    cs_histogram ttft, tpot;
    /* what admission may hand out: free blocks (cached ones count) less what admitted
     * prompts and decoding choices will take next (engine thread state: read unlocked) */
    int64_t room = s->eng.blocks_free(s->eng.self) - promised(s);
    pthread_mutex_lock(&s->mu);
    ttft = s->stats.ttft;
    tpot = s->stats.tpot;
    /* 1. cancelled waiting requests leave the queue */
    for (cs_request **pp = &s->wait_head; *pp;) {
        cs_request *r = *pp;
        if (atomic_load(&r->cancel)) {
            *pp = r->next;
            s->n_waiting--;
            r->next = dropped;
            dropped = r;
        } else {
            pp = &r->next;
        }
    }
    s->wait_tail = NULL;
    for (cs_request *r = s->wait_head; r; r = r->next) s->wait_tail = r;
    /* 2. admission, FIFO */
    while (s->wait_head) {
        cs_request *r = s->wait_head;
        int32_t seqs = r->resume ? choices_left(r) : r->n;
        int64_t need = admit_need(s, r);
        if (seqs > s->seqs_free || (need > room && s->n_active > 0)) break;
        s->wait_head = r->next;
        if (!s->wait_head) s->wait_tail = NULL;
        s->n_waiting--;
        r->next = NULL;
        room -= need;
        for (int c = 0; c < r->n; c++)
            if (!r->resume || !r->ch[c].finished) r->ch[c].seq = take_seq(s);
        r->state = r->resume ? ST_REFILL : ST_PREFILL;
        r->n_fed = -1; /* started below, outside the lock */
        s->active[s->n_active++] = r;
    }
    s->stats.requests_waiting = s->n_waiting;
    pthread_mutex_unlock(&s->mu);

    for (cs_request *r = dropped, *nx; r; r = nx) {
        nx = r->next;
        r->state = ST_DONE;
        for (int c = 0; c < r->n; c++) {
            if (r->ch[c].finished) continue; /* a preempted request's choice may have ended */
            r->ch[c].finished = 1;
            r->cb->on_finish(r, c, CS_FINISH_CANCELLED);
        }
        can++;
        r->done_err = NULL;
        r->next = s->done_head;
        s->done_head = r;
    }

    /* 1b. cancelled running requests; the admitted ones start */
    for (int32_t i = 0; i < s->n_active;) {
        cs_request *r = s->active[i];
        if (atomic_load(&r->cancel)) {
            end_request(s, r, CS_FINISH_CANCELLED, NULL, &fin, &can);
            continue;
        }
        if (r->n_fed < 0 && start_request(s, r, &hits, &queries) != 0) {
            end_request(s, r, CS_FINISH_ERROR, "out of memory", &fin, &can);
            continue;
        }
        /* a prompt at a block boundary looks again: blocks an earlier request registered
         * since (the same system prompt prefilled a step ahead) are taken, not recomputed */
        if (r->state == ST_PREFILL && r->n_fed % cfg->block_tokens == 0 && r->n_fed < r->n_prompt - 1 &&
            s->eng.reuse_prefix && !r->no_prefix_cache) {
            int64_t k = s->eng.reuse_prefix(s->eng.self, r->ch[0].seq, r->prompt + r->n_fed, r->n_prompt - r->n_fed);
            if (k > 0 && k < r->n_prompt - r->n_fed) {
                r->n_fed += k;
                if (r->preemptions == 0) r->cached_tokens += k;
                hits += (uint64_t)k;
            }
        }
        i++;
    }

    /* 3. the batch; one the KV cache cannot hold preempts the newest request and is built again */
    int64_t n = 0, rows = 0;
    int32_t n_dec = 0;
    int st = 0;
    int64_t rotate0 = s->rotate;
    for (;;) {
        s->rotate = rotate0;
        build_batch(s, &n, &rows, &n_dec);
        if (n == 0) break;
        st = s->eng.batch(s->eng.self, s->entries, n, rows ? s->logits : NULL);
        if (st != COLIBRI_E_NOMEM || s->n_active < 2) break;
        preempt(s, s->active[s->n_active - 1]);
        preemptions++;
    }

    /* 4. what it did */
    if (n > 0) {
        if (s->eng.after_step) s->eng.after_step(s->eng.self);
        if (st != 0) {
            /* a refused batch changes nothing: fail the requests that were in it */
            char *msg = s->step_err;
            const char *e = s->eng.last_error ? s->eng.last_error(s->eng.self) : NULL;
            snprintf(msg, sizeof s->step_err, "the engine refused the batch: %s (status %d)",
                     e && *e ? e : colibri_status_string((colibri_status)st), st);
            for (int64_t j = 0; j < n; j++) {
                for (int32_t i = 0; i < s->n_active; i++) {
                    cs_request *r = s->active[i];
                    int mine = 0;
                    for (int c = 0; c < r->n; c++) mine |= r->ch[c].seq == s->entries[j].seq;
                    if (mine) {
                        end_request(s, r, CS_FINISH_ERROR, msg, &fin, &can);
                        break;
                    }
                }
            }
        } else {
            double now = now_s();
            /* prompt and refill progress */
            for (int64_t j = n_dec; j < n; j++) {
                for (int32_t i = 0; i < s->n_active; i++) {
                    cs_request *r = s->active[i];
                    if (r->state == ST_PREFILL && r->ch[0].seq == s->entries[j].seq) {
                        r->n_fed++;
                        prompt_tokens++;
                        break;
                    }
                    int hit = 0;
                    for (int c = 0; r->state == ST_REFILL && c < r->n; c++)
                        if (r->ch[c].seq == s->entries[j].seq) {
                            r->ch[c].len++;
                            hit = 1;
                            break;
                        }
                    if (hit) break;
                }
            }
            for (int32_t i = 0; i < s->n_active; i++) { /* refilled requests decode on */
                cs_request *r = s->active[i];
                if (r->state != ST_REFILL) continue;
                int done = 1;
                for (int c = 0; c < r->n; c++) done &= r->ch[c].finished || r->ch[c].len == refill_target(r, c);
                if (done) r->state = ST_DECODE;
            }
            for (int64_t row = 0; row < rows; row++) {
                cs_request *r = s->row_req[row];
                const float *lg = s->logits + (size_t)row * (size_t)cfg->vocab;
                int c = s->row_choice[row];
                if (c >= 0) {
                    cs_choice_state *ch = &r->ch[c];
                    if (ch->finished) continue;
                    ch->len++;
                    int32_t tok = 0;
                    int end = 0;
                    int st2 = sample_choice(s, r, c, lg, &tok, &end);
                    if (st2 != 0) {
                        end_request(s, r, CS_FINISH_ERROR, "sampling failed", &fin, &can);
                        continue;
                    }
                    handle_token(s, r, c, tok, end, lg, now, &gen, &ttft, &tpot);
                } else {
                    /* the whole prompt is in: fork it to the other choices, then sample each */
                    r->state = ST_DECODE;
                    int failed = 0;
                    for (int k = 0; k < r->n; k++) {
                        r->ch[k].len = r->n_prompt;
                        if (k > 0 && s->eng.seq_fork(s->eng.self, r->ch[0].seq, r->ch[k].seq) != 0) failed = 1;
                    }
                    if (failed) {
                        end_request(s, r, CS_FINISH_ERROR, "forking the prompt's sequence failed", &fin, &can);
                        continue;
                    }
                    for (int k = 0; k < r->n; k++) {
                        int32_t tok = 0;
                        int end = 0;
                        if (sample_choice(s, r, k, lg, &tok, &end) != 0) {
                            failed = 1;
                            break;
                        }
                        handle_token(s, r, k, tok, end, lg, now, &gen, &ttft, &tpot);
                    }
                    if (failed) {
                        end_request(s, r, CS_FINISH_ERROR, "sampling failed", &fin, &can);
                        continue;
                    }
                }
                if (r->state != ST_DONE && all_finished(r)) retire(s, r, NULL, &fin, &can);
            }
        }
    }
    /* requests whose every choice ended (e.g. all at their first token) */
    for (int32_t i = 0; i < s->n_active;) {
        cs_request *r = s->active[i];
        if (all_finished(r)) retire(s, r, NULL, &fin, &can);
        else i++;
    }

    /* 5. publish */
    int64_t used = s->stats.kv_blocks_total - s->eng.blocks_free(s->eng.self);
    int64_t cached = s->eng.blocks_cached ? s->eng.blocks_cached(s->eng.self) : 0;
    pthread_mutex_lock(&s->mu);
    s->stats.ttft = ttft;
    s->stats.tpot = tpot;
    s->stats.requests_running = s->n_active;
    s->stats.requests_waiting = s->n_waiting;
    s->stats.kv_blocks_used = used;
    s->stats.kv_blocks_cached = cached;
    s->stats.prompt_tokens_total += prompt_tokens;
    s->stats.generation_tokens_total += gen;
    s->stats.requests_finished_total += fin;
    s->stats.requests_cancelled_total += can;
    s->stats.prefix_cache_hit_tokens_total += hits;
    s->stats.prefix_cache_query_tokens_total += queries;
    s->stats.preemptions_total += preemptions;
    if (n > 0) s->stats.steps_total++;
    pthread_mutex_unlock(&s->mu);
    /* 6. hand back what ended */
    cs_request *done = s->done_head;
    s->done_head = NULL;
    for (cs_request *r = done, *nx; r; r = nx) {
        nx = r->next;
        for (int c = 0; c < r->n; c++) {
            free(r->ch[c].gen);
            r->ch[c].gen = NULL;
        }
        r->cb->on_done(r, r->done_err);
    }
    return n;
}

void cs_sched_run(cs_sched *s) {
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (!s->stop && !s->draining && !s->wait_head && s->n_active == 0) {
            struct timespec ts = cs_deadline_ms(100);
            pthread_cond_timedwait(&s->cv, &s->mu, &ts);
        }
        /* draining ends when the last accepted request has ended: submit refuses new ones,
         * so nothing can arrive after this check */
        int stop = s->stop || (s->draining && !s->wait_head && s->n_active == 0);
        pthread_mutex_unlock(&s->mu);
        if (stop) break;
        if (cs_sched_step(s) == 0) {
            /* admitted nothing and ran nothing (e.g. waiting for blocks): do not spin */
            pthread_mutex_lock(&s->mu);
            int idle = s->n_active == 0 || s->wait_head != NULL;
            if (idle && !s->stop) {
                struct timespec ts = cs_deadline_ms(5);
                pthread_cond_timedwait(&s->cv, &s->mu, &ts);
            }
            pthread_mutex_unlock(&s->mu);
        }
    }
    /* shutting down: everything still here is cancelled */
    pthread_mutex_lock(&s->mu);
    for (cs_request *r = s->wait_head; r; r = r->next) atomic_store(&r->cancel, 1);
    pthread_mutex_unlock(&s->mu);
    for (int32_t i = 0; i < s->n_active; i++) atomic_store(&s->active[i]->cancel, 1);
    cs_sched_step(s);
}
