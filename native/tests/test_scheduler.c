/*
 * test_scheduler.c — colibri_server's continuous-batching scheduler
 * (native/tools/colibri_server/scheduler.c) over a fake engine: a paged KV cache of
 * refcounted blocks with copy-on-write forks that refuses a batch that does not fit
 * (COLIBRI_E_NOMEM, nothing changed), and logits that are a hash of the sequence's own
 * tokens, so a sequence's tokens do not depend on what else is in the batch.
 *
 * Checked: a request run under load gives the same tokens as alone (greedy and seeded);
 * every step holds at most max_batch_tokens entries and max_batch_size decodes; admission
 * never overfills the cache; blocks on demand with preemption (all complete, tokens as alone);
 * FIFO admission; n > 1 forks (choice 0 equals the request
 * alone); EOS, stop (on_token), max_tokens and context-full endings; cancel (waiting and
 * running) frees the blocks in the same step; a full queue refuses; a refused batch fails
 * only its requests; and at the end every block and every sequence is free.
 * Exit 0 when every check passes.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "scheduler.h"

#define V 50
#define MAXS 8
#define CTX 96
#define BT 8
#define NBLK 40
#define EOS 0

static int fails;
#define CHECK(cond, ...)                                                                 \
    do {                                                                                 \
        if (!(cond)) {                                                                   \
            if (fails++ < 20) {                                                          \
                printf("FAIL %s:%d: ", __FILE__, __LINE__);                              \
                printf(__VA_ARGS__);                                                     \
                printf("\n");                                                            \
            }                                                                            \
        }                                                                                \
    } while (0)

/* g_decoding[seq]: the sequence has generated its first token (set by the callbacks) */
static int g_decoding[MAXS];

/* ---- the fake engine ---------------------------------------------------------------- */

typedef struct fake {
    int32_t len[MAXS];
    uint64_t hash[MAXS][CTX];       /* hash of tokens 0..p of the sequence */
    int32_t blocks[MAXS][CTX / BT + 1];
    int32_t refc[NBLK];
    int64_t steps, max_entries, max_decodes;
    int64_t max_prefill_beside;     /* most prompt entries in a step that also decodes */
    int fail_next;                  /* refuse the next batch with COLIBRI_E_NUMERIC */
    int eos_allowed;
    char err[128];
} fake;

static uint64_t mix(uint64_t h, uint64_t x) {
    h ^= x + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    h *= 0xBF58476D1CE4E5B9ull;
    return h ^ (h >> 31);
}

static int32_t alloc_block(fake *f) {
    for (int32_t b = 0; b < NBLK; b++)
        if (f->refc[b] == 0) {
            f->refc[b] = 1;
            return b;
        }
    return -1;
}

static int fk_batch_inner(fake *f, const colibri_batch_entry *e, int64_t n, float *logits) {
    int64_t row = 0, decodes = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t s = e[i].seq;
        if (s < 0 || s >= MAXS || e[i].token < 0 || e[i].token >= V || e[i].pos != f->len[s] ||
            f->len[s] >= CTX) {
            snprintf(f->err, sizeof f->err, "bad entry %lld (seq %d pos %lld len %d)", (long long)i, s,
                     (long long)e[i].pos, s >= 0 && s < MAXS ? f->len[s] : -1);
            return COLIBRI_E_INVALID_ARG;
        }
        int64_t p = e[i].pos, bi = p / BT;
        if (p % BT == 0) {
            int32_t b = alloc_block(f);
            if (b < 0) { snprintf(f->err, sizeof f->err, "no free KV block"); return COLIBRI_E_NOMEM; }
            f->blocks[s][bi] = b;
        } else if (f->refc[f->blocks[s][bi]] > 1) { /* copy on write */
            int32_t b = alloc_block(f);
            if (b < 0) { snprintf(f->err, sizeof f->err, "no free KV block"); return COLIBRI_E_NOMEM; }
            f->refc[f->blocks[s][bi]]--;
            f->blocks[s][bi] = b;
        }
        f->hash[s][p] = mix(p ? f->hash[s][p - 1] : 12345, (uint64_t)e[i].token);
        f->len[s]++;
        if (e[i].logits) {
            for (int v = 0; v < V; v++)
                logits[row * V + v] = (float)(mix(f->hash[s][p], (uint64_t)v) % 1000) / 100.0f;
            if (!f->eos_allowed) logits[row * V + EOS] = -1e9f;
            row++;
        }
        if (g_decoding[s]) decodes++;
    }
    if (n > f->max_entries) f->max_entries = n;
    if (decodes > f->max_decodes) f->max_decodes = decodes;
    if (decodes > 0 && n - decodes > f->max_prefill_beside) f->max_prefill_beside = n - decodes;
    f->steps++;
    return 0;
}

static fake saved;
static int fk_batch(void *self, const colibri_batch_entry *e, int64_t n, float *logits) {
    fake *f = self;
    if (f->fail_next) {
        f->fail_next = 0;
        snprintf(f->err, sizeof f->err, "injected failure");
        return COLIBRI_E_NUMERIC;
    }
    saved = *f;
    int st = fk_batch_inner(f, e, n, logits);
    if (st) {
        char msg[128];
        memcpy(msg, f->err, sizeof msg);
        *f = saved; /* a refused batch changes nothing */
        memcpy(f->err, msg, sizeof msg);
    }
    return st;
}

static int fk_clear(void *self, int32_t s) {
    fake *f = self;
    for (int32_t i = 0; i < (f->len[s] + BT - 1) / BT; i++) f->refc[f->blocks[s][i]]--;
    f->len[s] = 0;
    return 0;
}

static int fk_fork(void *self, int32_t src, int32_t dst) {
    fake *f = self;
    fk_clear(f, dst);
    f->len[dst] = f->len[src];
    memcpy(f->hash[dst], f->hash[src], sizeof f->hash[src]);
    for (int32_t i = 0; i < (f->len[src] + BT - 1) / BT; i++) {
        f->blocks[dst][i] = f->blocks[src][i];
        f->refc[f->blocks[src][i]]++;
    }
    return 0;
}

/* greedy (lowest id on ties) at temperature 0, else a draw driven by the rng only */
static int fk_sample(void *self, const float *lg, float temperature, int32_t top_k, float top_p, uint64_t *rng,
                     int32_t *id) {
    (void)self, (void)top_k, (void)top_p;
    if (temperature == 0.0f) {
        int32_t best = 0;
        for (int32_t v = 1; v < V; v++)
            if (lg[v] > lg[best]) best = v;
        *id = best;
        return 0;
    }
    *rng = mix(*rng, 77);
    int32_t pick = (int32_t)(*rng % (V - 1)) + 1;
    *id = lg[pick] < -1e8f ? 1 : pick; /* EOS only when the logits allow it */
    if (lg[EOS] > -1e8f && (*rng >> 20) % 40 == 0) *id = EOS;
    return 0;
}

static int64_t fk_free(void *self) {
    fake *f = self;
    int64_t n = 0;
    for (int b = 0; b < NBLK; b++) n += f->refc[b] == 0;
    return n;
}
static int64_t fk_total(void *self) { (void)self; return NBLK; }
static const char *fk_err(void *self) { return ((fake *)self)->err; }

/* ---- requests that record what happens to them ------------------------------------ */

typedef struct job {
    cs_request r;
    int32_t prompt[CTX];
    int32_t toks[CS_MAX_CHOICES][CTX];
    int n_toks[CS_MAX_CHOICES];
    int32_t seq[CS_MAX_CHOICES];
    cs_finish why[CS_MAX_CHOICES];
    int stop_after;         /* on_token asks to stop after this many tokens (0 = never) */
    int done;
    int cancel_at;          /* cancel after this many tokens of choice 0 (0 = never) */
    char err[256];
} job;

static cs_sched *g_sched;
static int g_eos_allowed;
static int64_t g_decode_prefill; /* cs_sched_config.decode_prefill_tokens of the next make_sched */
static const int32_t *g_end_ids;  /* cs_sched_config.end_ids / n_end_ids of the next make_sched */
static int32_t g_n_end;

static int on_token(cs_request *r, int c, int32_t t, const float *lg) {
    job *j = (job *)r;
    CHECK(lg != NULL && t != EOS, "on_token got EOS or no logits");
    j->toks[c][j->n_toks[c]++] = t;
    g_decoding[r->ch[c].seq] = 1;
    j->seq[c] = r->ch[c].seq;
    if (c == 0 && j->cancel_at && j->n_toks[0] == j->cancel_at) cs_sched_cancel(g_sched, r);
    return j->stop_after && j->n_toks[c] >= j->stop_after;
}
static void on_finish(cs_request *r, int c, cs_finish why) {
    job *j = (job *)r;
    CHECK(j->why[c] == CS_FINISH_NONE, "choice %d finished twice", c);
    j->why[c] = why;
    if (j->n_toks[c] > 0) g_decoding[j->seq[c]] = 0;
}
static void on_done(cs_request *r, const char *e) {
    job *j = (job *)r;
    CHECK(!j->done, "on_done twice");
    j->done = 1;
    if (e) snprintf(j->err, sizeof j->err, "%s", e);
}
static const cs_request_callbacks CB = {on_token, on_finish, on_done};

static void job_init(job *j, uint64_t seed, int plen, int64_t max_tokens, float temp, int n) {
    memset(j, 0, sizeof *j);
    for (int i = 0; i < plen; i++) j->prompt[i] = 1 + (int32_t)(mix(seed, (uint64_t)i) % (V - 1));
    j->r.prompt = j->prompt;
    j->r.n_prompt = plen;
    j->r.n = n;
    j->r.max_tokens = max_tokens;
    j->r.temperature = temp;
    j->r.top_p = 1.0f;
    j->r.seed = seed;
    j->r.cb = &CB;
}

static cs_engine make_engine(fake *f) {
    cs_engine e = {f, fk_batch, fk_clear, fk_fork, fk_sample, fk_free, fk_total, fk_err, NULL, NULL, NULL, NULL};
    return e;
}

static cs_sched *make_sched(fake *f, int32_t max_seqs, int32_t mbs, int64_t mbt, int64_t queue) {
    memset(f, 0, sizeof *f);
    memset(g_decoding, 0, sizeof g_decoding);
    f->eos_allowed = g_eos_allowed;
    cs_sched_config cfg = {max_seqs, mbs, mbt, queue, CTX, BT, V, EOS, g_decode_prefill, g_end_ids, g_n_end};
    cs_engine e = make_engine(f);
    char err[256];
    cs_sched *s = cs_sched_create(&cfg, &e, err, sizeof err);
    if (!s) {
        printf("FAIL: %s\n", err);
        exit(1);
    }
    g_sched = s;
    return s;
}

/* step until every job is done (bounded) */
static void drain(cs_sched *s, job *jobs, int n) {
    for (int it = 0; it < 100000; it++) {
        int all = 1;
        for (int i = 0; i < n; i++) all &= jobs[i].done;
        if (all) return;
        cs_sched_step(s);
    }
    CHECK(0, "requests did not finish");
}

static void check_empty(cs_sched *s, fake *f, const char *what) {
    cs_metrics m;
    cs_sched_snapshot(s, &m);
    CHECK(fk_free(f) == NBLK, "%s: %lld blocks still used", what, (long long)(NBLK - fk_free(f)));
    CHECK(m.kv_blocks_used == 0 && m.requests_running == 0 && m.requests_waiting == 0,
          "%s: metrics say %lld blocks used, %lld running, %lld waiting", what, (long long)m.kv_blocks_used,
          (long long)m.requests_running, (long long)m.requests_waiting);
    for (int i = 0; i < MAXS; i++) CHECK(f->len[i] == 0, "%s: seq %d holds %d positions", what, i, f->len[i]);
}

/* A job's reference tokens: run alone on a scheduler of its own. */
static void solo(const job *tmpl, job *out) {
    fake f;
    cs_sched *s = make_sched(&f, MAXS, MAXS, 16, 4);
    *out = *tmpl;
    out->done = 0;
    memset(out->n_toks, 0, sizeof out->n_toks);
    memset(out->why, 0, sizeof out->why);
    out->r.prompt = out->prompt;
    atomic_store(&out->r.cancel, 0);
    CHECK(cs_sched_submit(s, &out->r) == CS_OK, "solo submit");
    drain(s, out, 1);
    check_empty(s, &f, "solo");
    cs_sched_free(s);
}

static int same_choice(const job *a, int ca, const job *b, int cb) {
    if (a->n_toks[ca] != b->n_toks[cb]) return 0;
    return memcmp(a->toks[ca], b->toks[cb], (size_t)a->n_toks[ca] * sizeof(int32_t)) == 0;
}
static int same_tokens(const job *a, const job *b, int c) { return same_choice(a, c, b, c); }

#define NJ 30

int main(void) {
    static job jobs[NJ], ref;
    fake f;

    /* 1. load: 30 requests of mixed lengths, greedy and seeded, on 6 sequences */
    {
        g_eos_allowed = 1;
        cs_sched *s = make_sched(&f, 6, 4, 16, NJ);
        for (int i = 0; i < NJ; i++) {
            job_init(&jobs[i], 1000 + (uint64_t)i, 1 + (int)(mix(i, 3) % 40), 1 + (int64_t)(mix(i, 4) % 30),
                     i % 2 ? 0.8f : 0.0f, 1);
            CHECK(cs_sched_submit(s, &jobs[i].r) == CS_OK, "submit %d", i);
        }
        drain(s, jobs, NJ);
        CHECK(f.max_entries <= 16, "a step held %lld entries (max_batch_tokens 16)", (long long)f.max_entries);
        CHECK(f.max_decodes <= 4, "a step held %lld decodes (max_batch_size 4)", (long long)f.max_decodes);
        check_empty(s, &f, "load");
        cs_metrics m;
        cs_sched_snapshot(s, &m);
        uint64_t want_prompt = 0, want_gen = 0;
        for (int i = 0; i < NJ; i++) {
            want_prompt += (uint64_t)jobs[i].r.n_prompt;
            want_gen += (uint64_t)jobs[i].r.completion_tokens;
        }
        CHECK(m.prompt_tokens_total == want_prompt && m.generation_tokens_total == want_gen,
              "token counters %llu/%llu, want %llu/%llu", (unsigned long long)m.prompt_tokens_total,
              (unsigned long long)m.generation_tokens_total, (unsigned long long)want_prompt,
              (unsigned long long)want_gen);
        CHECK(m.requests_finished_total == NJ, "finished %llu", (unsigned long long)m.requests_finished_total);
        CHECK(m.ttft.count == NJ, "ttft count %llu", (unsigned long long)m.ttft.count);
        for (int i = 0; i < NJ; i++) {
            solo(&jobs[i], &ref);
            CHECK(same_tokens(&jobs[i], &ref, 0), "job %d: tokens under load differ from alone", i);
            CHECK(jobs[i].why[0] == ref.why[0] && jobs[i].why[0] != CS_FINISH_NONE, "job %d: finish %d vs %d", i,
                  jobs[i].why[0], ref.why[0]);
            int eos = jobs[i].r.completion_tokens > jobs[i].n_toks[0];
            if (eos) CHECK(jobs[i].why[0] == CS_FINISH_STOP, "job %d: EOS not 'stop'", i);
            else CHECK(jobs[i].why[0] == CS_FINISH_LENGTH && jobs[i].n_toks[0] == jobs[i].r.max_tokens,
                       "job %d: %d tokens of max %lld, finish %d", i, jobs[i].n_toks[0],
                       (long long)jobs[i].r.max_tokens, jobs[i].why[0]);
        }
        cs_sched_free(s);
        g_eos_allowed = 0;
    }

    /* 1b. the same load with at most 5 prompt tokens beside running decodes: the cap holds
     * and every request still gets the tokens it gets alone */
    {
        g_eos_allowed = 1;
        g_decode_prefill = 5;
        cs_sched *s = make_sched(&f, 6, 4, 16, NJ);
        for (int i = 0; i < NJ; i++) {
            job_init(&jobs[i], 1000 + (uint64_t)i, 1 + (int)(mix(i, 3) % 40), 1 + (int64_t)(mix(i, 4) % 30),
                     i % 2 ? 0.8f : 0.0f, 1);
            CHECK(cs_sched_submit(s, &jobs[i].r) == CS_OK, "submit %d", i);
        }
        drain(s, jobs, NJ);
        CHECK(f.max_prefill_beside <= 5, "a step held %lld prompt tokens beside decodes (cap 5)",
              (long long)f.max_prefill_beside);
        CHECK(f.max_entries > 5, "without decodes a step still fills the budget (%lld)", (long long)f.max_entries);
        check_empty(s, &f, "load, capped prefill");
        for (int i = 0; i < NJ; i++) {
            solo(&jobs[i], &ref);
            CHECK(same_tokens(&jobs[i], &ref, 0), "job %d (capped prefill): tokens differ from alone", i);
        }
        cs_sched_free(s);
        g_decode_prefill = 0;
        g_eos_allowed = 0;
    }

    /* 2. blocks on demand: long requests on a cache far smaller than their worst cases all run
     * at once, the newest is preempted when the cache is full, and every one ends with the
     * tokens it gets alone (greedy and seeded, one and two choices) */
    {
        cs_sched *s = make_sched(&f, 8, 8, 32, NJ);
        for (int i = 0; i < 6; i++) { /* 90 positions: 12 blocks each, 72 (+9 for the fork) in a cache of 40 */
            job_init(&jobs[i], 50 + (uint64_t)i, 30, 60, i % 2 ? 0.8f : 0.0f, i == 5 ? 2 : 1);
            CHECK(cs_sched_submit(s, &jobs[i].r) == CS_OK, "submit");
        }
        int64_t max_running = 0;
        for (int it = 0; it < 10000; it++) {
            int all = 1;
            for (int i = 0; i < 6; i++) all &= jobs[i].done;
            if (all) break;
            cs_sched_step(s);
            cs_metrics m;
            cs_sched_snapshot(s, &m);
            if (m.requests_running > max_running) max_running = m.requests_running;
            CHECK(m.kv_blocks_used <= NBLK, "%lld blocks used", (long long)m.kv_blocks_used);
        }
        cs_metrics m;
        cs_sched_snapshot(s, &m);
        CHECK(max_running == 6, "every request runs at once at first (worst cases admit 3), ran %lld",
              (long long)max_running);
        CHECK(m.preemptions_total > 0, "a cache of 40 blocks preempts");
        for (int i = 0; i < 6; i++) {
            CHECK(jobs[i].done && !jobs[i].err[0] && jobs[i].n_toks[0] == 60, "job %d: %d tokens, err '%s'", i,
                  jobs[i].n_toks[0], jobs[i].err);
            job alone;
            solo(&jobs[i], &alone);
            for (int c = 0; c < jobs[i].r.n; c++)
                CHECK(same_tokens(&jobs[i], &alone, c), "job %d choice %d: preempted tokens differ from alone", i, c);
            CHECK(jobs[i].r.n == 1 || !same_choice(&jobs[i], 0, &jobs[i], 1), "job %d: both choices alike", i);
        }
        check_empty(s, &f, "blocks");
        cs_sched_free(s);
    }

    /* 3. n > 1: a shared prompt, forks; choice 0 equals the request alone */
    {
        cs_sched *s = make_sched(&f, 8, 8, 16, NJ);
        job_init(&jobs[0], 7, 21, 20, 0.9f, 4);
        job_init(&jobs[1], 8, 5, 10, 0.0f, 3);
        CHECK(cs_sched_submit(s, &jobs[0].r) == CS_OK && cs_sched_submit(s, &jobs[1].r) == CS_OK, "submit n");
        drain(s, jobs, 2);
        job one;
        job_init(&one, 7, 21, 20, 0.9f, 1);
        solo(&one, &ref);
        CHECK(same_tokens(&jobs[0], &ref, 0), "n=4: choice 0 differs from n=1");
        int differ = 0;
        for (int c = 1; c < 4; c++) differ |= !same_choice(&jobs[0], c, &jobs[0], 0);
        CHECK(differ, "n=4 seeded choices are all the same");
        for (int c = 0; c < 4; c++) CHECK(jobs[0].why[c] == CS_FINISH_LENGTH, "n=4 choice %d finish %d", c, jobs[0].why[c]);
        for (int c = 1; c < 3; c++)
            CHECK(jobs[1].n_toks[c] == 10 && same_choice(&jobs[1], c, &jobs[1], 0), "greedy n=3: choice %d differs", c);
        check_empty(s, &f, "fork");
        cs_sched_free(s);
    }

    /* 4. stop from on_token, context full, queue full, cancel */
    {
        cs_sched *s = make_sched(&f, 2, 2, 16, 2);
        job_init(&jobs[0], 1, 4, 50, 0.0f, 1);
        jobs[0].stop_after = 5;
        job_init(&jobs[1], 2, CTX - 3, 50, 0.0f, 1);   /* room for 3 tokens */
        job_init(&jobs[2], 3, 4, 50, 0.0f, 1);
        job_init(&jobs[3], 4, 4, 50, 0.0f, 1);
        CHECK(cs_sched_submit(s, &jobs[0].r) == CS_OK && cs_sched_submit(s, &jobs[1].r) == CS_OK, "submit");
        CHECK(cs_sched_submit(s, &jobs[2].r) == CS_E_QUEUE_FULL, "a third waiting request is refused");
        drain(s, jobs, 2);
        CHECK(jobs[0].why[0] == CS_FINISH_STOP && jobs[0].n_toks[0] == 5, "stop: %d tokens, finish %d",
              jobs[0].n_toks[0], jobs[0].why[0]);
        CHECK(jobs[1].why[0] == CS_FINISH_LENGTH && jobs[1].n_toks[0] == 3, "context full: %d tokens, finish %d",
              jobs[1].n_toks[0], jobs[1].why[0]);
        /* cancel while running (from on_token) and while waiting */
        job_init(&jobs[2], 3, 20, 50, 0.0f, 1);
        jobs[2].cancel_at = 4;
        job_init(&jobs[3], 4, 20, 50, 0.0f, 2);
        job_init(&jobs[4], 5, 4, 5, 0.0f, 1);
        CHECK(cs_sched_submit(s, &jobs[2].r) == CS_OK && cs_sched_submit(s, &jobs[3].r) == CS_OK, "submit");
        cs_sched_step(s);  /* admits 2 (one sequence), 3 waits for two sequences */
        CHECK(cs_sched_submit(s, &jobs[4].r) == CS_OK, "submit");
        cs_sched_cancel(s, &jobs[3].r);
        cs_sched_step(s);
        CHECK(jobs[3].done && jobs[3].why[0] == CS_FINISH_CANCELLED && jobs[3].why[1] == CS_FINISH_CANCELLED,
              "waiting request cancelled");
        drain(s, jobs + 2, 3);
        CHECK(jobs[2].why[0] == CS_FINISH_CANCELLED && jobs[2].n_toks[0] == 4, "running cancelled after %d tokens",
              jobs[2].n_toks[0]);
        CHECK(jobs[4].why[0] == CS_FINISH_LENGTH && jobs[4].n_toks[0] == 5, "the request behind the cancelled ones ran");
        check_empty(s, &f, "cancel");
        cs_metrics m;
        cs_sched_snapshot(s, &m);
        CHECK(m.requests_cancelled_total == 2 && m.requests_rejected_total == 1, "cancelled %llu rejected %llu",
              (unsigned long long)m.requests_cancelled_total, (unsigned long long)m.requests_rejected_total);
        /* a refused batch fails its requests only; the next ones run */
        job_init(&jobs[5], 9, 6, 8, 0.0f, 1);
        CHECK(cs_sched_submit(s, &jobs[5].r) == CS_OK, "submit");
        f.fail_next = 1;
        drain(s, jobs + 5, 1);
        CHECK(jobs[5].why[0] == CS_FINISH_ERROR && strstr(jobs[5].err, "injected failure"), "error: finish %d '%s'",
              jobs[5].why[0], jobs[5].err);
        job_init(&jobs[6], 9, 6, 8, 0.0f, 1);
        CHECK(cs_sched_submit(s, &jobs[6].r) == CS_OK, "submit");
        drain(s, jobs + 6, 1);
        CHECK(jobs[6].why[0] == CS_FINISH_LENGTH && jobs[6].n_toks[0] == 8, "after an error the engine runs on");
        check_empty(s, &f, "error");
        /* requests that can never run are refused up front */
        char msg[256];
        job_init(&jobs[7], 1, CTX, 4, 0.0f, 1);
        CHECK(cs_sched_check(s, &jobs[7].r, msg, sizeof msg) == CS_E_INVALID && strstr(msg, "at most"), "too long: %s", msg);
        job_init(&jobs[7], 1, 4, 4, 0.0f, 3);
        CHECK(cs_sched_submit(s, &jobs[7].r) == CS_E_INVALID, "n above max_seqs");
        job_init(&jobs[7], 1, 4, 4, 0.0f, 1);
        jobs[7].prompt[2] = V;
        CHECK(cs_sched_check(s, &jobs[7].r, msg, sizeof msg) == CS_E_INVALID && strstr(msg, "out of range"), "range");
        cs_sched_free(s);
    }

    /* 4b. the model's end ids end a choice as EOS does (finish 'stop', the token not
     * passed on), unless the request ignores EOS */
    {
        job j, ref;
        job_init(&j, 4242, 7, 12, 0.0f, 1);
        solo(&j, &ref);
        CHECK(ref.n_toks[0] == 12, "greedy reference: %d tokens", ref.n_toks[0]);
        int32_t end[2] = {V - 1 == ref.toks[0][5] ? V - 2 : V - 1, ref.toks[0][5]};
        int k = 0;
        while (k < 5 && ref.toks[0][k] != end[1] && ref.toks[0][k] != end[0]) k++;
        g_end_ids = end;
        g_n_end = 2;
        job e;
        solo(&j, &e);
        CHECK(e.why[0] == CS_FINISH_STOP && e.n_toks[0] == k && e.r.completion_tokens == k + 1,
              "end id: finish %d after %d tokens (%lld counted), want stop after %d", e.why[0], e.n_toks[0],
              (long long)e.r.completion_tokens, k);
        for (int i = 0; i < e.n_toks[0]; i++) CHECK(e.toks[0][i] == ref.toks[0][i], "end id: token %d differs", i);
        j.r.ignore_eos = 1;
        solo(&j, &e);
        CHECK(e.why[0] == CS_FINISH_LENGTH && same_tokens(&e, &ref, 0), "ignore_eos: finish %d, %d tokens", e.why[0],
              e.n_toks[0]);
        g_end_ids = NULL;
        g_n_end = 0;
    }

    /* 5. metrics text */
    {
        cs_metrics m;
        memset(&m, 0, sizeof m);
        cs_hist_init_ttft(&m.ttft);
        cs_hist_init_tpot(&m.tpot);
        cs_hist_observe(&m.ttft, 0.03);
        uint64_t ex[6] = {1, 2, 3, 4, 5, 6};
        m.n_layers = 2;
        m.n_experts = 3;
        m.expert_tokens = ex;
        size_t len = 0;
        char *t = cs_metrics_render(&m, &len);
        CHECK(t && strlen(t) == len, "render");
        CHECK(t && strstr(t, "colibri_time_to_first_token_seconds_bucket{le=\"0.04\"} 1\n") &&
              strstr(t, "colibri_time_to_first_token_seconds_bucket{le=\"0.02\"} 0\n") &&
              strstr(t, "colibri_expert_tokens_total{layer=\"1\",expert=\"2\"} 6\n") &&
              strstr(t, "# TYPE colibri_kv_blocks_used gauge\ncolibri_kv_blocks_used 0\n"),
              "metrics text:\n%s", t ? t : "(null)");
        free(t);
    }

    if (fails) {
        printf("%d check(s) failed\n", fails);
        return 1;
    }
    printf("OK\n");
    return 0;
}
