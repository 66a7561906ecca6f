/*
 * server.h — what the parts of colibri_server share: the server state (cs_server), the
 * engine adapter (engine.c: a cs_engine over a colibri_ctx, with the expert-load trace and
 * the expert cache's counters),
 * the request jobs (api.c: JSON in, callbacks, JSON out) and the HTTP front end (http.c).
 *
 * Threads: libmicrohttpd runs one thread per connection (parsing, tokenizing, waiting for
 * results, writing); the main thread runs the scheduler, the only one touching the
 * colibri_ctx; a signal thread stops it. The tokenizer is shared under tok_mu (its calls
 * keep a last-error message and are not thread-safe).
 */
#ifndef COLIBRI_SERVER_H
#define COLIBRI_SERVER_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "colibri.h"
#include "scheduler.h"

#define CS_MAX_STOPS 16
#define CS_MAX_STOP_LEN 256
#define CS_MAX_TOP_LOGPROBS 20

enum { CS_STATE_LOADING = 0, CS_STATE_READY = 1, CS_STATE_STOPPING = 2 };

/* ---- engine.c ---- */
typedef struct cs_colibri {
    colibri_ctx *ctx;
    colibri_trace *trace;
    int32_t n_layers, n_experts, top_k;
    int64_t blocks_total;
    pthread_mutex_t mu;          /* guards expert_tokens and the cache_* counts */
    uint64_t *expert_tokens;     /* [n_layers * n_experts] */
    /* the expert cache, when the context has one (cache_slots > 0): its counters are plain
     * integers the forward writes, so the engine thread copies them here after every step and
     * /metrics reads the copies; counted from the last cs_colibri_reset_counts */
    int32_t cache_slots;         /* slots per MoE layer; 0: no expert cache */
    uint8_t *moe;                /* [n_layers] 1: a MoE layer */
    int64_t *cache_base;         /* [n_layers * CS_CACHE_N_STATS + 1] the engine's counters at the reset,
                                  * bytes read last (engine thread only) */
    int64_t *cache_now;          /* the same layout: the counters of the step just run (engine thread only) */
    uint64_t *cache_counts;      /* the same layout: the counts since the reset */
} cs_colibri;

/* Fill *eng with the functions over cc->ctx; attach a trace of `trace_tokens` rows for the
 * expert counts (no trace, and no expert metrics, when the model has no router). */
int cs_colibri_init(cs_colibri *cc, colibri_ctx *ctx, int64_t trace_tokens, cs_engine *eng, char *err,
                    size_t err_len);
void cs_colibri_free(cs_colibri *cc);
/* Copy the expert counts (n_layers * n_experts) into out (malloc'd; caller frees). */
uint64_t *cs_colibri_expert_counts(cs_colibri *cc);
/* Start the expert counts and the cache's counters from zero (after the warm-up). Engine
 * thread only. */
void cs_colibri_reset_counts(cs_colibri *cc);
/* Copy the cache's counters (n_layers * CS_CACHE_N_STATS, cs_metrics.cache_layer's layout)
 * into a malloc'd array (caller frees) and the bytes read into *bytes_read; NULL without a
 * cache or when out of memory. */
uint64_t *cs_colibri_cache_counts(cs_colibri *cc, uint64_t *bytes_read);

/* ---- the server ---- */
typedef struct cs_server {
    /* settings */
    const char *model_path;
    char model_id[256];
    const char *api_key;
    int64_t max_body_bytes;
    int64_t default_completion_tokens; /* /v1/completions without max_tokens */
    int64_t created;                   /* start time (unix seconds) */
    /* the engine, once loaded */
    colibri_ctx *ctx;
    colibri_tokenizer *tok;
    pthread_mutex_t tok_mu;
    int64_t vocab, ctx_len;
    int32_t bos_id, eos_id, max_seqs;
    const int32_t *end_ids;            /* colibri_get_end_ids: EOS first, then the model's other end ids */
    int32_t n_end_ids;
    const char *chat_template;
    const char *precision;             /* colibri_get_string "precision": "exact" / "fast" (NULL until loaded) */
    const char *kernels;               /* colibri_get_string "kernels" */
    const char *backend;               /* colibri_get_string "backend": "cpu" / "cuda" (NULL until loaded) */
    const char *backend_device;        /* colibri_get_string "backend_device" */
    int64_t backend_device_bytes;      /* colibri_get_int "backend_device_bytes", "backend_experts_*" */
    int64_t backend_experts_resident, backend_experts_host;
    cs_sched *sched;
    cs_colibri engine;
    atomic_int state;
    atomic_ullong next_id;
} cs_server;

/* ---- api.c ---- */
typedef enum cs_api_kind { CS_API_COMPLETIONS = 0, CS_API_CHAT = 1 } cs_api_kind;

/* An OpenAI-style error: {"error": {"message", "type", "param", "code"}} with an HTTP status. */
typedef struct cs_api_error {
    int status;
    const char *type;
    const char *param;  /* NULL: null */
    const char *code;   /* NULL: null */
    char message[768];
} cs_api_error;

typedef struct cs_job cs_job;

/* Parse and check a request body; tokenize its prompt. 0 and a job holding one reference,
 * or -1 and *err filled. */
int cs_api_parse(cs_server *srv, cs_api_kind kind, const char *body, size_t len, cs_job **out,
                 cs_api_error *err);
/* Queue the job in the scheduler (it then holds a second reference until on_done).
 * 0, or -1 with *err (a full queue: 429). */
int cs_api_submit(cs_job *j, cs_api_error *err);
int cs_job_stream(const cs_job *j);
void cs_job_set_fd(cs_job *j, int fd);
void cs_job_unref(cs_job *j);
void cs_job_cancel(cs_job *j);
/* Wait until the scheduler is done with the job; every ~200 ms `gone(fd)` is asked whether
 * the client left (the job is then cancelled). */
void cs_job_wait(cs_job *j, int (*gone)(int fd));
/* The whole response of a finished non-streaming job: JSON text (malloc'd) and its HTTP
 * status (200, or 500 with an error body when the engine failed). */
char *cs_job_response(cs_job *j, size_t *len, int *status);
/* Streaming: copy up to `max` bytes of pending SSE text into buf, waiting up to
 * `wait_ms`. Returns bytes copied (> 0), 0 when nothing came yet, -1 at the end of the
 * stream (everything was sent). */
long cs_job_read_stream(cs_job *j, char *buf, size_t max, int wait_ms);
/* A streamed list of prompts: job j answers prompt `part` of the list whose first job is
 * `first` (call before cs_api_submit): its choices are numbered from part * n, it shares the
 * first job's id, and it sends neither usage nor [DONE] (the combined stream does, once). */
void cs_job_join_stream(cs_job *j, const cs_job *first, int part);
/* The combined stream's last event but [DONE]: "data: {...}\n\n" with no choices and the
 * usage of all n jobs summed (malloc'd; NULL when out of memory). */
char *cs_api_stream_usage(cs_job *const *jobs, int n, size_t *len);

char *cs_api_error_json(const cs_api_error *e, size_t *len);
void cs_api_set_error(cs_api_error *e, int status, const char *type, const char *param, const char *code,
                      const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 6, 7)))
#endif
    ;
char *cs_api_models_json(const cs_server *srv, size_t *len);
/* POST /tokenize, llama-server's shape: {"content": text, "add_special": false, "with_pieces": false}
 * -> {"tokens": [ids]} (with_pieces: [{"id", "piece"}], a piece that is a lone byte as [byte]).
 * POST /detokenize: {"tokens": [ids]} -> {"content": text}. JSON text (malloc'd), or NULL
 * with *err (400 for a bad body). */
char *cs_api_tokenize(cs_server *srv, const char *body, size_t len, size_t *out_len, cs_api_error *err);
char *cs_api_detokenize(cs_server *srv, const char *body, size_t len, size_t *out_len, cs_api_error *err);
/* /v1/completions with a list of prompts (strings or arrays of ids): one body per prompt, the
 * rest of the request as it is (malloc'd; *bodies and *lens freed by the caller). The count
 * (>= 2), 0 for a request of one prompt, -1 with *err (stream true: unsupported with a list). */
#define CS_MAX_PROMPTS 64
int cs_api_split_prompts(cs_server *srv, const char *body, size_t len, char ***bodies, size_t **lens,
                         cs_api_error *err);
/* One response from the n answers (in prompt order, each 200): their choices, numbered
 * prompt by prompt, and their usage summed. NULL when out of memory. */
char *cs_api_merge_completions(char *const *responses, const size_t *lens, int n, size_t *out_len);
/* Whether s[0..n) is valid UTF-8; *bad gets the offset of the first bad byte. */
int cs_utf8_valid(const char *s, size_t n, size_t *bad);

/* ---- http.c ---- */
typedef struct cs_http cs_http;
typedef struct cs_http_options {
    const char *host;        /* numeric address or name */
    int port;
    unsigned timeout_s;      /* idle connection timeout */
    unsigned max_connections;
} cs_http_options;
cs_http *cs_http_start(cs_server *srv, const cs_http_options *opt, char *err, size_t err_len);
int cs_http_port(const cs_http *h);
void cs_http_stop(cs_http *h);

#endif
