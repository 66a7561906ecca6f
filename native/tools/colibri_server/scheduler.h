/*
 * scheduler.h — iteration-level continuous batching for colibri_server.
 *
 * Pure logic over a small engine interface (cs_engine: batch, seq_clear, seq_fork,
 * sample, blocks free/total), so it runs as well over a fake engine in a unit test
 * (native/tests/test_scheduler.c) as over a colibri_ctx (engine.c).
 *
 * One thread (the engine thread) calls cs_sched_step / cs_sched_run; any thread may call
 * cs_sched_submit, cs_sched_cancel and cs_sched_snapshot. Each step:
 *   1. drops cancelled requests (their sequences are cleared: the blocks return at once);
 *   2. admits waiting requests in queue order (FIFO, no overtaking; a preempted request goes
 *      back to the front) while there are free sequence ids for all their choices and the KV
 *      blocks they need now — their prompt, less nothing for cache hits, plus one block of
 *      headroom per decoding choice — are free beside what admitted prompts still need. An
 *      admitted prompt first takes what the engine's prefix cache holds of it (reuse_prefix;
 *      cs_request.cached_tokens) and computes only the rest; while it waits for its turn
 *      at a block boundary it looks again every step, so requests that share a prefix (a
 *      system prompt) compute it once even when they arrive together;
 *   3. builds one batch: first one decode entry for each running choice (at most
 *      max_batch_size sequences, rotating when more are running), then prompt chunks of
 *      admitted requests in admission order until max_batch_tokens entries are used. A batch
 *      the KV cache cannot hold (the engine refuses it and changes nothing) preempts the most
 *      recently admitted request: its sequences are cleared (their full blocks stay in the
 *      prefix cache), it goes back to the front of the queue, and the batch is built again;
 *      a preempted request that had generated tokens recomputes its prompt and those tokens
 *      (most of it from the prefix cache) before it decodes on, so its output is bitwise what
 *      it would have been (results are batch-invariant; its rng state is kept);
 *   4. runs it, samples every flagged row with the choice's own rng state (so a seeded
 *      request gives the same tokens alone or under load), and applies the stop rules:
 *      EOS ("stop"), the on_token callback asking to stop (a stop string, "stop"),
 *      max_tokens or a full context ("length"). A finished choice's sequence is cleared in
 *      the same step.
 * A request with n > 1 choices prefills its prompt once on its first sequence, then forks
 * it (copy-on-write) to the others before sampling each choice from the same logits.
 *
 * KV blocks are taken on demand, as sequences grow: a request whose worst case (prompt +
 * max_tokens, capped at the context: floor(P/B) shared prompt blocks + n × (ceil(min(P +
 * max_tokens, ctx) / B) - floor(P/B))) exceeds the whole cache is refused up front, since it
 * could not finish even alone; any other finishes, preempted as often as the cache needs.
 */
#ifndef COLIBRI_SERVER_SCHEDULER_H
#define COLIBRI_SERVER_SCHEDULER_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "colibri.h"
#include "metrics.h"

/* The CLOCK_REALTIME instant `ms` milliseconds from now (pthread_cond_timedwait's deadline). */
static inline struct timespec cs_deadline_ms(long ms) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

#define CS_MAX_CHOICES 16

/* What the scheduler needs from an engine. Every function gets `self`. Statuses are
 * colibri_status values (0 = ok). */
typedef struct cs_engine {
    void *self;
    int (*batch)(void *self, const colibri_batch_entry *entries, int64_t n, float *logits);
    int (*seq_clear)(void *self, int32_t seq);
    int (*seq_fork)(void *self, int32_t src, int32_t dst);
    int (*sample)(void *self, const float *logits, float temperature, int32_t top_k, float top_p,
                  uint64_t *rng, int32_t *id);
    int64_t (*blocks_free)(void *self);
    int64_t (*blocks_total)(void *self);
    const char *(*last_error)(void *self);  /* the message of the last failed call */
    void (*after_step)(void *self);         /* optional: called after every batch */
    /* optional: extend empty sequence `seq` with the prefix cache's blocks holding ids[0..n);
     * returns the positions taken (at most n - 1), 0 when none or on error */
    int64_t (*reuse_prefix)(void *self, int32_t seq, const int32_t *ids, int64_t n);
    int64_t (*blocks_cached)(void *self);   /* optional: cached blocks no sequence holds (free) */
    /* optional: sample with a request's per-choice sampler (cs_request.sampler[c]) instead of
     * `sample`. *end: CS_SAMPLE_GO on, CS_SAMPLE_END_BEFORE (the token ends the choice and is
     * not content: a stop id, or EOS), CS_SAMPLE_END_AFTER (the token is content and the last:
     * a grammar completed with no end token to force) */
    int (*sample_seq)(void *self, void *sampler, const float *logits, uint64_t *rng, int32_t *id, int *end);
} cs_engine;

enum { CS_SAMPLE_GO = 0, CS_SAMPLE_END_BEFORE = 1, CS_SAMPLE_END_AFTER = 2 };

typedef struct cs_sched_config {
    int32_t max_seqs;          /* sequence ids 0 .. max_seqs-1 */
    int32_t max_batch_size;    /* decoding sequences per step (<= max_seqs) */
    int64_t max_batch_tokens;  /* entries per step, decodes and prompt chunks together */
    int64_t max_queue;         /* waiting requests; more are refused (CS_E_QUEUE_FULL) */
    int64_t ctx_len;           /* positions one sequence may hold */
    int64_t block_tokens;      /* positions per KV block */
    int64_t vocab;
    int32_t eos_id;            /* -1: none */
    int64_t decode_prefill_tokens; /* prompt tokens a step may add to running decodes; 0: no cap
                                    * (each one makes every running stream's next token later) */
    const int32_t *end_ids;    /* n_end_ids more ids that end a choice as EOS does (colibri_get_end_ids;
                                * NULL, 0: none); the caller keeps them alive */
    int32_t n_end_ids;
} cs_sched_config;

typedef enum cs_finish {
    CS_FINISH_NONE = 0,
    CS_FINISH_STOP = 1,       /* EOS or a stop string */
    CS_FINISH_LENGTH = 2,     /* max_tokens or the context is full */
    CS_FINISH_CANCELLED = 3,  /* cs_sched_cancel, or the scheduler stopped */
    CS_FINISH_ERROR = 4       /* the engine refused the batch (message in on_done) */
} cs_finish;

enum {
    CS_OK = 0,
    CS_E_QUEUE_FULL = 1,      /* max_queue requests are waiting */
    CS_E_INVALID = 2,         /* a request that can never run (see cs_sched_check) */
    CS_E_STOPPED = 3          /* the scheduler is shutting down (stopped or draining) */
};

typedef struct cs_request cs_request;

/* Called on the engine thread, without the scheduler's lock held. */
typedef struct cs_request_callbacks {
    /* Choice `choice` generated `token` (never EOS), sampled from `logits` (vocab floats).
     * Return 1 to finish the choice with CS_FINISH_STOP (a stop string matched). */
    int (*on_token)(cs_request *r, int choice, int32_t token, const float *logits);
    /* Choice `choice` finished (once per choice). */
    void (*on_finish)(cs_request *r, int choice, cs_finish why);
    /* The scheduler is done with r and never touches it again. error: NULL, or the
     * engine's message when a batch failed. */
    void (*on_done)(cs_request *r, const char *error);
} cs_request_callbacks;

typedef struct cs_choice_state {
    int32_t seq;        /* sequence id, -1 when none */
    uint64_t rng;       /* sampler state */
    int64_t len;        /* positions in its sequence */
    int64_t n_gen;      /* tokens generated (EOS included) */
    int32_t next_tok;   /* the token to feed in the next step */
    int finished;
    double t_last;      /* when its last token came (seconds, monotonic) */
    int32_t *gen;       /* the tokens it generated (n_gen of them), to recompute after a preemption */
    int64_t gen_cap;
} cs_choice_state;

struct cs_request {
    /* ---- set by the submitter; read-only once submitted */
    const int32_t *prompt;      /* n_prompt >= 1 ids (BOS included if wanted) */
    int64_t n_prompt;
    int32_t n;                  /* choices, 1 .. CS_MAX_CHOICES */
    int64_t max_tokens;         /* per choice, >= 1 */
    float temperature, top_p;
    int32_t top_k;
    uint64_t seed;              /* choice i's rng starts at seed + i */
    int ignore_eos;             /* 1: EOS is a token like any other (benchmarks) */
    int no_prefix_cache;        /* 1: compute the whole prompt even where the prefix cache holds it */
    void *sampler[CS_MAX_CHOICES]; /* per choice, for cs_engine.sample_seq (penalties, bias, grammar);
                                 * NULL: `sample` with temperature / top_k / top_p */
    const cs_request_callbacks *cb;
    void *user;
    /* ---- set by any thread through cs_sched_cancel */
    atomic_int cancel;
    /* ---- results: valid in on_done */
    int64_t completion_tokens;  /* over all choices, EOS included */
    int64_t cached_tokens;      /* prompt positions taken from the prefix cache at first admission */
    int32_t preemptions;        /* times it was preempted */
    /* ---- scheduler private */
    cs_request *next;           /* waiting list, then the step's retired list */
    const char *done_err;
    int state;
    int64_t n_fed;              /* prompt tokens in the first sequence */
    int resume;                 /* preempted after generating: recompute each choice's tokens */
    double t_arrival;
    int got_first;
    cs_choice_state ch[CS_MAX_CHOICES];
};

typedef struct cs_sched cs_sched;

/* NULL with a message in err on a bad config or out of memory. */
cs_sched *cs_sched_create(const cs_sched_config *cfg, const cs_engine *eng, char *err, size_t err_len);
void cs_sched_free(cs_sched *s);

/* Whether `r` could ever run here: 0, or CS_E_INVALID with the reason in msg. */
int cs_sched_check(const cs_sched *s, const cs_request *r, char *msg, size_t msg_len);
/* Queue `r` (its fields set, cancel 0). CS_OK: the callbacks will be called, on_done last.
 * Anything else: nothing was queued and no callback will come. */
int cs_sched_submit(cs_sched *s, cs_request *r);
/* Ask for `r` to end (safe from any thread, any time before its on_done). */
void cs_sched_cancel(cs_sched *s, cs_request *r);

/* One iteration. Returns the entries run (0: nothing to do). Engine thread only. */
int64_t cs_sched_step(cs_sched *s);
/* Step until cs_sched_stop, sleeping while there is no work; then cancels what is left.
 * After cs_sched_drain it also returns once nothing waits or runs. */
void cs_sched_run(cs_sched *s);
void cs_sched_stop(cs_sched *s);
/* Graceful shutdown: from now on cs_sched_submit refuses (CS_E_STOPPED), while every request
 * already queued or running goes on to its end; cs_sched_run returns when none is left
 * (cs_sched_stop, e.g. at a deadline, cancels what still runs). Safe from any thread. */
void cs_sched_drain(cs_sched *s);
/* Wake cs_sched_run (e.g. after a cancel) without submitting. */
void cs_sched_wake(cs_sched *s);

/* The numbers /metrics shows (the expert fields are left zero). */
void cs_sched_snapshot(cs_sched *s, cs_metrics *out);

#endif
