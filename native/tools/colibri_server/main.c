/*
 * colibri_server — serve a .colibri model over an OpenAI-compatible HTTP API with
 * iteration-level continuous batching (docs/serving.md).
 *
 *   colibri_server --model m.colibri --port 8000 --parallel 8
 *
 * Start-up: the HTTP server listens first (GET /health says 503 "loading"), then the
 * model is opened, its router norms checked, the scheduler made and one warm-up forward
 * run; only then does /health say 200. The main thread then runs the scheduler (the only
 * thread that touches the engine) until SIGINT or SIGTERM.
 *
 * Shutdown: the first SIGINT/SIGTERM starts a drain: /health and every new request answer
 * 503 (a load balancer takes the replica out, a client retries elsewhere) while the
 * requests already accepted, queued or running, go on, and the server exits 0 when the last
 * has ended. What still runs after --shutdown_timeout_s, or when a second signal comes, is
 * cancelled (plain requests get a 503, streams an error event and [DONE]); exit 0 as well.
 *
 * Exit status: 0 after a signal, 1 an engine or start-up error (message on stderr),
 * 2 a usage error.
 */
#define _POSIX_C_SOURCE 200809L
#define TOOL_NAME "colibri_server"
#include "../tool_common.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chat.h"
#include "server.h"

typedef struct args {
    const char *model, *alias, *host, *api_key;
    int64_t decode_prefill_tokens;
    int64_t port, num_threads, max_batch_size, max_seq_len, prefetch_batches, parallel, max_batch_tokens, kv_tokens,
        kv_block_tokens, max_queue, timeout, max_body_bytes, default_max_tokens, shutdown_timeout_s, prefix_cache;
    int64_t expert_cache_mb, expert_cache_slots;
    double gpu_memory_fraction; /* 0: the engine's default (0.9) */
    int32_t precision, expert_cache_policy, backend, gpu_device;
} args;

static void usage(FILE *f) {
    fprintf(f,
            "usage: colibri_server --model PATH [options]\n"
            "\n"
            "Serves a .colibri model over an OpenAI-compatible HTTP API (POST /v1/completions,\n"
            "POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics) with\n"
            "continuous batching: every step runs one batched forward over the decoding\n"
            "sequences and prompt chunks of newly admitted requests. See docs/serving.md.\n"
            "\n"
            "options:\n"
            "  --model PATH              .colibri file (required)\n"
            "  --alias NAME              model id in the API (default: the file's name without .colibri)\n"
            "  --host HOST[:PORT]        address to listen on (default 127.0.0.1)\n"
            "  --port N                  port, 0 = any free one (default 8000; HOST:PORT wins)\n"
            "  --num_threads N           threads of the forward pass, 0 = physical cores (default 0)\n"
            "  --precision MODE          exact or fast: int8 / bf16 activations into the weight\n"
            "                            matmuls (docs/quantization.md, \"Fast mode accuracy\");\n"
            "                            /v1/models says which (default exact)\n"
            "  --parallel N              sequences held at once (max_seqs; a request with n\n"
            "                            choices takes n of them) (default 4)\n"
            "  --max_batch_size N        most sequences decoding in one step, <= --parallel\n"
            "                            (default: --parallel)\n"
            "  --max_batch_tokens N      token budget of one step: decodes first, then prompt\n"
            "                            chunks; >= --max_batch_size (default 256)\n"
            "  --decode_prefill_tokens N prompt tokens a step adds to running decodes, 0 = no\n"
            "                            cap: lower keeps inter-token latency flat, higher gives\n"
            "                            a shorter time to first token (default 32)\n"
            "  --max_seq_len N           context per sequence (prompt + completion), 0 = the\n"
            "                            engine's default, min(file's, 4096) (default 0)\n"
            "  --kv_tokens N             positions of the shared paged KV cache, 0 = max_seq_len\n"
            "                            x parallel (default 0)\n"
            "  --kv_block_tokens N       positions per KV block, 0 = the engine's (32) (default 0)\n"
            "  --prefix_cache 0|1        keep full KV blocks for later prompts that start with the\n"
            "                            same tokens; answers are bitwise the same (default 1)\n"
            "  --expert_cache_mb N       keep the routed experts in N MiB of cache slots, read\n"
            "                            from the file on a miss (models larger than memory;\n"
            "                            docs/expert_cache.md); /metrics then shows its counters;\n"
            "                            0 = every expert mapped (default 0)\n"
            "  --expert_cache_slots N    the cache as N slots per MoE layer instead (more than\n"
            "                            n_experts: n_experts; not with --expert_cache_mb) (default 0)\n"
            "  --expert_cache_policy P   which expert a full layer evicts: lru, lfu, pinned (LRU\n"
            "                            around experts pinned through the API; the server pins\n"
            "                            none) or predict (LRU, and the next layer's experts read\n"
            "                            ahead) (default lru; needs a cache)\n"
            "  --max_queue N             requests waiting for admission; more get 429 (default 64)\n"
            "  --timeout S               idle connection timeout in seconds (default 60)\n"
            "  --max_body_bytes N        largest request body; more gets 413 (default 1048576)\n"
            "  --shutdown_timeout_s S    on SIGTERM/SIGINT: stop admitting (new requests and\n"
            "                            /health get 503), let accepted requests finish for up\n"
            "                            to S seconds, then cancel the rest and exit 0; a second\n"
            "                            signal cuts the drain short; 0 = cancel at once\n"
            "                            (default 30)\n"
            "  --default_max_tokens N    max_tokens of /v1/completions when the request has none\n"
            "                            (default 16, as OpenAI's)\n"
            "  --api-key KEY             require 'Authorization: Bearer KEY' on /v1/* (also --api_key)\n"
            "  --prefetch_batches N      accepted for compatibility, has no effect on CPU\n"
            "  --backend B               where the stages run: cpu or cuda (an NVIDIA GPU; a build\n"
            "                            with -DCOLIBRI_CUDA=ON; docs/backends.md); /v1/models\n"
            "                            and /metrics say which (default cpu)\n"
            "  --gpu_memory_fraction F   cuda: share of the device's memory the engine may take,\n"
            "                            0 < F <= 1; experts that do not fit run on the CPU;\n"
            "                            0 = the default (0.9)\n"
            "  --gpu_device N            cuda: the device ordinal (default 0)\n"
            "  --help                    print this help and exit\n"
            "\n"
            "Exit status: 0 after SIGINT/SIGTERM (drained or cancelled), 1 engine or start-up\n"
            "error, 2 usage error.\n");
}

static int parse_args(int argc, char **argv, args *a) {
    memset(a, 0, sizeof *a);
    a->host = "127.0.0.1";
    a->port = 8000;
    a->parallel = 4;
    a->max_batch_size = -1;
    a->max_batch_tokens = 256;
    a->decode_prefill_tokens = 32;
    a->max_queue = 64;
    a->timeout = 60;
    a->max_body_bytes = 1 << 20;
    a->default_max_tokens = 16;
    a->prefix_cache = 1;
    a->shutdown_timeout_s = 30;
    int port_in_host = 0, policy_given = 0, gpu_given = 0;
    static char host_buf[256];
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
            usage(stdout);
            return 0;
        }
        if (strncmp(arg, "--", 2) != 0) return usage_error("unexpected argument '%s'", arg);
        static const char *const known[] = {
            "--model", "--alias", "--host", "--port", "--num_threads", "--max_batch_size", "--max_seq_len",
            "--prefetch_batches", "--gpu_memory_fraction", "--parallel", "--max_batch_tokens", "--decode_prefill_tokens", "--kv_tokens",
            "--kv_block_tokens", "--api-key", "--api_key", "--max_queue", "--timeout", "--max_body_bytes",
            "--default_max_tokens", "--precision", "--shutdown_timeout_s", "--expert_cache_mb", "--expert_cache_slots",
            "--expert_cache_policy", "--backend", "--gpu_device", "--prefix_cache"};
        char name[64];
        const char *val = NULL;
        int bad = split_option(argc, argv, &i, known, sizeof known / sizeof known[0], name, &val);
        if (bad >= 0) return bad;
#define INT_OPT(flag, field, lo, hi)                                                               \
    else if (!strcmp(name, flag)) {                                                                \
        if (!parse_i64(val, lo, hi, &a->field))                                                    \
            return usage_error(flag " must be an integer in %lld..%lld, got '%s'", (long long)(lo), \
                               (long long)(hi), val);                                              \
    }
        if (!strcmp(name, "--model")) {
            if (!*val) return usage_error("--model needs a path");
            a->model = val;
        } else if (!strcmp(name, "--alias")) {
            if (!*val || strlen(val) > 200) return usage_error("--alias needs a name of 1 to 200 bytes");
            a->alias = val;
        } else if (!strcmp(name, "--host")) {
            if (!*val || strlen(val) >= sizeof host_buf) return usage_error("--host needs an address");
            snprintf(host_buf, sizeof host_buf, "%s", val);
            char *colon = strrchr(host_buf, ':');
            /* HOST:PORT (an IPv6 address needs brackets: [::1]:8000) */
            if (colon && (host_buf[0] == '[' || !strchr(host_buf, ':') || colon == strchr(host_buf, ':'))) {
                if (!parse_i64(colon + 1, 0, 65535, &a->port))
                    return usage_error("--host: bad port in '%s' (HOST:PORT, port 0..65535)", val);
                *colon = '\0';
                port_in_host = 1;
            }
            char *h = host_buf;
            size_t hl = strlen(h);
            if (hl >= 2 && h[0] == '[' && h[hl - 1] == ']') {
                h[hl - 1] = '\0';
                h++;
            }
            if (!*h) return usage_error("--host needs an address, got '%s'", val);
            a->host = h;
        } else if (!strcmp(name, "--port")) {
            int64_t p;
            if (!parse_i64(val, 0, 65535, &p)) return usage_error("--port must be an integer in 0..65535, got '%s'", val);
            if (!port_in_host) a->port = p;
        } else if (!strcmp(name, "--api-key") || !strcmp(name, "--api_key")) {
            if (!*val) return usage_error("%s needs a key", name);
            a->api_key = val;
        } else if (!strcmp(name, "--gpu_memory_fraction")) {
            /* 0: the engine's default, accepted with any backend (as before the CUDA backend) */
            char *end;
            double v = strtod(val, &end);
            if (end != val && !*end && v == 0.0) {
                a->gpu_memory_fraction = 0.0;
            } else {
                if (!parse_gpu_fraction(val, &a->gpu_memory_fraction)) return usage_error(GPU_FRACTION_USAGE, val);
                gpu_given = 1;
            }
        } else if (!strcmp(name, "--backend")) {
            if (!parse_backend(val, &a->backend)) return usage_error(BACKEND_USAGE, val);
        } else if (!strcmp(name, "--gpu_device")) {
            if (!parse_gpu_device(val, &a->gpu_device)) return usage_error(GPU_DEVICE_USAGE, val);
            gpu_given = 1;
        } else if (!strcmp(name, "--precision")) {
            if (!parse_precision(val, &a->precision)) return usage_error(PRECISION_USAGE, val);
        } else if (!strcmp(name, "--expert_cache_policy")) {
            if (!parse_cache_policy(val, &a->expert_cache_policy)) return usage_error(CACHE_POLICY_USAGE, val);
            policy_given = 1;
        }
        INT_OPT("--num_threads", num_threads, 0, 4096)
        INT_OPT("--max_batch_size", max_batch_size, 1, 4096)
        INT_OPT("--max_seq_len", max_seq_len, 0, INT32_MAX)
        INT_OPT("--prefetch_batches", prefetch_batches, 0, 1 << 20)
        INT_OPT("--parallel", parallel, 1, 4096)
        INT_OPT("--max_batch_tokens", max_batch_tokens, 1, 1 << 20)
        INT_OPT("--decode_prefill_tokens", decode_prefill_tokens, 0, 1 << 20)
        INT_OPT("--kv_tokens", kv_tokens, 0, INT64_C(1) << 40)
        INT_OPT("--kv_block_tokens", kv_block_tokens, 0, 1 << 20)
        INT_OPT("--prefix_cache", prefix_cache, 0, 1)
        INT_OPT("--max_queue", max_queue, 0, 1 << 20)
        INT_OPT("--timeout", timeout, 1, 86400)
        INT_OPT("--max_body_bytes", max_body_bytes, 64, INT64_C(1) << 32)
        INT_OPT("--default_max_tokens", default_max_tokens, 1, INT32_MAX)
        INT_OPT("--shutdown_timeout_s", shutdown_timeout_s, 0, 86400)
        INT_OPT("--expert_cache_mb", expert_cache_mb, 0, INT64_C(1) << 40)
        INT_OPT("--expert_cache_slots", expert_cache_slots, 0, INT32_MAX)
#undef INT_OPT
    }
    if (!a->model) return usage_error("--model is required");
    int bad = check_cache_flags(a->expert_cache_mb, a->expert_cache_slots, policy_given);
    if (bad >= 0) return bad;
    bad = check_backend_flags(a->backend, gpu_given);
    if (bad >= 0) return bad;
    if (a->max_batch_size < 0) a->max_batch_size = a->parallel;
    if (a->max_batch_size > a->parallel)
        return usage_error("--max_batch_size %lld is more than --parallel %lld (the sequences there are)",
                           (long long)a->max_batch_size, (long long)a->parallel);
    if (a->max_batch_tokens < a->max_batch_size)
        return usage_error("--max_batch_tokens %lld must be at least --max_batch_size %lld (a step holds one token "
                           "per decoding sequence)", (long long)a->max_batch_tokens, (long long)a->max_batch_size);
    return -1;
}

/* ---- signals: a thread waits for SIGINT/SIGTERM, drains the scheduler, then stops it ---- */

static pthread_mutex_t g_stop_mu = PTHREAD_MUTEX_INITIALIZER;
static cs_server *g_srv;
static int g_stop_requested;
static int64_t g_shutdown_timeout_s;

/* What the scheduler still holds (0 when it is gone); caller holds g_stop_mu. */
static int64_t pending_locked(int64_t *waiting) {
    cs_metrics m;
    *waiting = 0;
    if (!g_srv || !g_srv->sched) return 0;
    cs_sched_snapshot(g_srv->sched, &m);
    *waiting = m.requests_waiting;
    return m.requests_running;
}

static void *signal_thread(void *arg) {
    sigset_t *set = arg;
    int sig = 0;
    while (sigwait(set, &sig) != 0) {
    }
    /* 1. stop admitting: /health and new requests answer 503 from here on */
    pthread_mutex_lock(&g_stop_mu);
    g_stop_requested = 1;
    int draining = 0;
    if (g_srv) {
        atomic_store(&g_srv->state, CS_STATE_STOPPING);
        if (g_srv->sched) {
            int64_t waiting, running = pending_locked(&waiting);
            if (g_shutdown_timeout_s > 0) {
                cs_sched_drain(g_srv->sched);
                draining = 1;
                fprintf(stderr, "colibri_server: %s: draining %" PRId64 " running and %" PRId64
                                " waiting request(s) for up to %" PRId64 " s (a second signal stops at once)\n",
                        sig == SIGINT ? "SIGINT" : "SIGTERM", running, waiting, g_shutdown_timeout_s);
            } else {
                cs_sched_stop(g_srv->sched);
            }
        }
    }
    pthread_mutex_unlock(&g_stop_mu);
    if (draining) {
        /* 2. wait for the drain's deadline or a second signal; the main thread leaves on its
         * own when the last request ends (then g_srv is NULL below and nothing is left) */
        struct timespec end, now;
        clock_gettime(CLOCK_MONOTONIC, &end);
        end.tv_sec += (time_t)g_shutdown_timeout_s;
        const char *why = "the drain deadline (--shutdown_timeout_s) passed";
        for (;;) {
            clock_gettime(CLOCK_MONOTONIC, &now);
            struct timespec left = {end.tv_sec - now.tv_sec, end.tv_nsec - now.tv_nsec};
            if (left.tv_nsec < 0) {
                left.tv_sec--;
                left.tv_nsec += 1000000000L;
            }
            if (left.tv_sec < 0) break;
            int got = sigtimedwait(set, NULL, &left);
            if (got > 0) {
                why = "a second signal came";
                break;
            }
            if (errno == EAGAIN) break;
            /* EINTR: wait for the rest */
        }
        /* 3. cancel whatever still runs: its clients get a 503 / an error event */
        pthread_mutex_lock(&g_stop_mu);
        if (g_srv && g_srv->sched) {
            int64_t waiting, running = pending_locked(&waiting);
            if (running + waiting > 0)
                fprintf(stderr, "colibri_server: %s: cancelling %" PRId64 " running and %" PRId64
                                " waiting request(s)\n", why, running, waiting);
            cs_sched_stop(g_srv->sched);
        }
        pthread_mutex_unlock(&g_stop_mu);
    }
    /* the server is stopping already: later signals change nothing */
    for (;;) sigwait(set, &sig);
    return NULL;
}

static const char *base_name(const char *p, char *out, size_t cap) {
    const char *b = strrchr(p, '/');
    b = b ? b + 1 : p;
    snprintf(out, cap, "%s", b);
    size_t n = strlen(out);
    if (n > 8 && !strcmp(out + n - 8, ".colibri")) out[n - 8] = '\0';
    return out;
}

int main(int argc, char **argv) {
    args a;
    int rc = parse_args(argc, argv, &a);
    if (rc >= 0) return rc;
    if (colibri_abi_version() != COLIBRI_ABI_VERSION) {
        fprintf(stderr, "colibri_server: error: library ABI %d, tool built for %d\n", colibri_abi_version(),
                COLIBRI_ABI_VERSION);
        return EXIT_ENGINE;
    }

    g_shutdown_timeout_s = a.shutdown_timeout_s; /* set before the signal thread reads it */
    /* every thread made from here on has SIGINT/SIGTERM blocked; one waits for them */
    static sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);
    pthread_t sig_tid;
    pthread_create(&sig_tid, NULL, signal_thread, &set);
    pthread_detach(sig_tid);

    static cs_server srv;
    memset(&srv, 0, sizeof srv);
    pthread_mutex_init(&srv.tok_mu, NULL);
    atomic_store(&srv.state, CS_STATE_LOADING);
    srv.model_path = a.model;
    srv.api_key = a.api_key;
    srv.max_body_bytes = a.max_body_bytes;
    srv.default_completion_tokens = a.default_max_tokens;
    srv.created = (int64_t)time(NULL);
    if (a.alias) snprintf(srv.model_id, sizeof srv.model_id, "%s", a.alias);
    else base_name(a.model, srv.model_id, sizeof srv.model_id);
    pthread_mutex_lock(&g_stop_mu);
    g_srv = &srv;
    pthread_mutex_unlock(&g_stop_mu);

    char err[1024] = "";
    cs_http_options ho = {a.host, (int)a.port, (unsigned)a.timeout,
                          (unsigned)(a.max_queue + a.parallel * 2 + 64)};
    cs_http *http = cs_http_start(&srv, &ho, err, sizeof err);
    if (!http) {
        fprintf(stderr, "colibri_server: error: %s\n", err);
        return EXIT_ENGINE;
    }
    fprintf(stderr, "colibri_server: listening on http://%s%s%s:%d (loading %s)\n", strchr(a.host, ':') ? "[" : "",
            a.host, strchr(a.host, ':') ? "]" : "", cs_http_port(http), a.model);

    rc = EXIT_ENGINE;
    double t0 = now_ms();
    colibri_options opt;
    colibri_options_init(&opt);
    opt.num_threads = (int32_t)a.num_threads;
    opt.max_seq_len = a.max_seq_len;
    opt.max_batch = a.max_batch_tokens;
    opt.max_seqs = (int32_t)a.parallel;
    opt.kv_block_tokens = (int32_t)a.kv_block_tokens;
    opt.kv_tokens = a.kv_tokens;
    opt.prefix_cache = (int32_t)a.prefix_cache;
    opt.precision = a.precision;
    opt.expert_cache_mb = a.expert_cache_mb;
    opt.expert_cache_slots = (int32_t)a.expert_cache_slots;
    opt.expert_cache_policy = a.expert_cache_policy;
    opt.backend = a.backend;
    opt.gpu_device = a.gpu_device;
    opt.gpu_memory_fraction = a.gpu_memory_fraction;
    colibri_ctx *ctx = NULL;
    colibri_status st = colibri_init_ex(a.model, &opt, &ctx, err, sizeof err);
    if (st != COLIBRI_OK) {
        fprintf(stderr, "colibri_server: error: cannot open model: %s\n", *err ? err : colibri_status_string(st));
        goto out;
    }
    srv.ctx = ctx;
    st = colibri_verify_router(ctx);
    if (st != COLIBRI_OK) {
        engine_error(ctx, st, "router weights do not match their stored norms");
        goto out;
    }
    int64_t vocab = 0, max_seq = 0, blocks = 0, block_tokens = 0, max_seqs = 0, threads = 0, ec_slots = 0,
            ec_policy = -1, ec_slot_bytes = 0, ec_direct = 0;
    if ((st = colibri_get_int(ctx, "vocab_size", &vocab)) || (st = colibri_get_int(ctx, "max_seq_len", &max_seq)) ||
        (st = colibri_get_int(ctx, "kv_blocks_total", &blocks)) ||
        (st = colibri_get_int(ctx, "kv_block_tokens", &block_tokens)) ||
        (st = colibri_get_int(ctx, "max_seqs", &max_seqs)) || (st = colibri_get_int(ctx, "threads_used", &threads)) ||
        (st = colibri_get_int(ctx, "expert_cache_slots", &ec_slots)) ||
        (st = colibri_get_int(ctx, "expert_cache_policy", &ec_policy)) ||
        (st = colibri_get_int(ctx, "expert_cache_slot_bytes", &ec_slot_bytes)) ||
        (st = colibri_get_int(ctx, "expert_cache_direct", &ec_direct))) {
        engine_error(ctx, st, "reading the model's settings");
        goto out;
    }
    srv.tok = colibri_get_tokenizer(ctx);
    if (!srv.tok) {
        fprintf(stderr, "colibri_server: error: the model has no tokenizer\n");
        goto out;
    }
    srv.vocab = vocab;
    srv.bos_id = colibri_tokenizer_bos_id(srv.tok);
    srv.eos_id = colibri_tokenizer_eos_id(srv.tok);
    if ((st = colibri_get_end_ids(ctx, &srv.end_ids, &srv.n_end_ids)) != COLIBRI_OK) {
        engine_error(ctx, st, "reading the model's end ids");
        goto out;
    }
    srv.max_seqs = (int32_t)max_seqs;
    srv.ctx_len = max_seq < blocks * block_tokens ? max_seq : blocks * block_tokens;
    if (colibri_get_string(ctx, "chat_template", &srv.chat_template) != COLIBRI_OK || !srv.chat_template)
        srv.chat_template = "";
    {
        const char *tn = *srv.chat_template ? cs_chat_template_name(srv.chat_template) : NULL;
        if (tn)
            fprintf(stderr, "colibri_server: chat template %s\n", tn);
        else
            fprintf(stderr, "colibri_server: chat template %s; /v1/chat/completions answers 400 (the templates "
                            "rendered: %s)\n",
                    *srv.chat_template ? "not recognised" : "absent", cs_chat_known_templates());
    }
    if (colibri_get_string(ctx, "precision", &srv.precision) != COLIBRI_OK || !srv.precision) srv.precision = "";
    if (colibri_get_string(ctx, "kernels", &srv.kernels) != COLIBRI_OK || !srv.kernels) srv.kernels = "";
    {
        backend_facts bf;
        if ((st = read_backend_facts(ctx, &bf)) != COLIBRI_OK) {
            engine_error(ctx, st, "reading the backend's facts");
            goto out;
        }
        srv.backend = bf.name ? bf.name : "";
        srv.backend_device = bf.device ? bf.device : "";
        srv.backend_device_bytes = bf.device_bytes;
        srv.backend_experts_resident = bf.experts_resident;
        srv.backend_experts_host = bf.experts_host;
    }

    cs_engine eng;
    if (cs_colibri_init(&srv.engine, ctx, a.max_batch_tokens, &eng, err, sizeof err)) {
        fprintf(stderr, "colibri_server: error: %s\n", err);
        goto out;
    }
    cs_sched_config cfg = {(int32_t)max_seqs, (int32_t)a.max_batch_size, a.max_batch_tokens, a.max_queue,
                           srv.ctx_len, block_tokens, vocab, srv.eos_id, a.decode_prefill_tokens,
                           srv.end_ids, srv.n_end_ids};
    cs_sched *sched = cs_sched_create(&cfg, &eng, err, sizeof err);
    if (!sched) {
        fprintf(stderr, "colibri_server: error: %s\n", err);
        goto out;
    }

    /* warm-up: one forward and one sample, so the first request meets a warm engine */
    {
        float *lg = malloc((size_t)vocab * sizeof *lg);
        colibri_batch_entry e = {srv.bos_id >= 0 ? srv.bos_id : 0, 0, 0, 1, 0};
        int32_t id = 0;
        uint64_t rng = 1;
        double tw = now_ms();
        st = lg ? colibri_batch(ctx, &e, 1, lg) : COLIBRI_E_NOMEM;
        if (st == COLIBRI_OK) st = colibri_sample(ctx, lg, 0.0f, 0, 1.0f, &rng, &id);
        if (st == COLIBRI_OK) st = colibri_seq_clear(ctx, 0);
        free(lg);
        if (eng.after_step) eng.after_step(eng.self);
        cs_colibri_reset_counts(&srv.engine); /* /metrics counts the requests, not the warm-up */
        if (st != COLIBRI_OK) {
            engine_error(ctx, st, "warm-up forward");
            cs_sched_free(sched);
            goto out;
        }
        fprintf(stderr, "colibri_server: loaded '%s' in %.0f ms (warm-up %.1f ms): vocab %" PRId64 ", context %" PRId64
                        ", %" PRId64 " sequences, %" PRId64 " KV blocks of %" PRId64 " tokens, %" PRId64
                        " thread(s), precision %s (kernels %s), backend %s (%s)\n",
                srv.model_id, now_ms() - t0, now_ms() - tw, vocab, srv.ctx_len, max_seqs, blocks, block_tokens,
                threads, srv.precision, srv.kernels, srv.backend, srv.backend_device);
        if (ec_slots > 0)
            fprintf(stderr, "colibri_server: expert cache: %" PRId64 " slot(s) per MoE layer, policy %s, %" PRId64
                            " bytes per slot, %s\n",
                    ec_slots, cache_policy_name(ec_policy), ec_slot_bytes,
                    ec_direct ? "O_DIRECT reads" : "buffered reads (no O_DIRECT here)");
    }

    pthread_mutex_lock(&g_stop_mu);
    srv.sched = sched;
    int stop_now = g_stop_requested;
    if (!stop_now) atomic_store(&srv.state, CS_STATE_READY);
    pthread_mutex_unlock(&g_stop_mu);
    if (!stop_now) {
        fprintf(stderr, "colibri_server: ready\n");
        cs_sched_run(sched);
    }
    atomic_store(&srv.state, CS_STATE_STOPPING);
    fprintf(stderr, "colibri_server: stopping\n");
    cs_http_stop(http);
    http = NULL;
    pthread_mutex_lock(&g_stop_mu);
    g_srv = NULL;
    srv.sched = NULL;
    pthread_mutex_unlock(&g_stop_mu);
    cs_sched_free(sched);
    rc = 0;
out:
    atomic_store(&srv.state, CS_STATE_STOPPING);
    cs_http_stop(http);
    pthread_mutex_lock(&g_stop_mu);
    g_srv = NULL;
    pthread_mutex_unlock(&g_stop_mu);
    cs_colibri_free(&srv.engine);
    colibri_free(ctx);
    return rc;
}
