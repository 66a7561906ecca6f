/*
 * http.c — colibri_server's HTTP front end on libmicrohttpd: routing, the API key, the
 * body limit, JSON and server-sent-event responses, and noticing a client that left.
 *
 * libmicrohttpd runs one thread per connection (MHD_USE_THREAD_PER_CONNECTION), so a
 * handler may block: a plain request waits in its handler for the job to finish; a
 * streaming one returns a response whose reader callback blocks until the scheduler has
 * produced the next events. Both look at the socket every 200 ms, and a client that
 * closed its connection cancels its job (its KV blocks return in the next step).
 *
 * Shutting down (main.c drains the scheduler): the daemon keeps listening so that /health
 * can say 503 and new requests get a clean 503 rather than a refused connection; those
 * answers, and the answers of requests that end during the drain, carry "Connection:
 * close", so a keep-alive client (or a proxy's connection pool) reconnects, through its
 * load balancer, to a replica that is not going away.
 */
#define _GNU_SOURCE /* POLLRDHUP */
#include <arpa/inet.h>
#include <microhttpd.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>

#include "server.h"

struct cs_http {
    struct MHD_Daemon *d;
    cs_server *srv;
    int port;
    atomic_int inflight;  /* requests between their first call and their completion */
};

enum route {
    R_NONE = 0, R_HEALTH, R_METRICS, R_MODELS, R_COMPLETIONS, R_CHAT, R_TOKENIZE, R_DETOKENIZE
};

typedef struct conn {
    enum route route;
    char *body;
    size_t len, cap;
    int done;          /* a response was queued */
    int too_big;       /* the body passed --max_body_bytes: the rest is read and dropped */
    uint64_t dropped;  /* bytes dropped so far */
} conn;

/* A body over the limit is still read (and dropped) up to this many bytes, so the 413
 * reaches the client before the connection closes (closing with unread data makes the
 * kernel reset the connection, which can destroy the answer in flight); past it the
 * server answers at once. */
static uint64_t drain_limit(const cs_server *srv) {
    uint64_t m = (uint64_t)srv->max_body_bytes * 4;
    return m > (64u << 20) ? m : (64u << 20);
}

static enum MHD_Result send_error_hdr(struct MHD_Connection *c, const cs_api_error *e, const char *hname,
                                      const char *hval);

static enum MHD_Result too_large(struct MHD_Connection *c, const cs_server *srv) {
    cs_api_error e;
    cs_api_set_error(&e, 413, "invalid_request_error", NULL, "body_too_large",
                     "the request body is larger than %lld bytes, the most this server accepts (--max_body_bytes)",
                     (long long)srv->max_body_bytes);
    return send_error_hdr(c, &e, MHD_HTTP_HEADER_CONNECTION, "close");
}

typedef struct stream_ctx {
    cs_job *job;
    int fd;
} stream_ctx;

/* ---- responses ---------------------------------------------------------------------- */

/* buf (malloc'd, taken over; NULL: out of memory, a 500 instead) as the response, with one
 * extra header when hname is not NULL */
static enum MHD_Result send_buf(struct MHD_Connection *c, unsigned status, char *buf, size_t len,
                                const char *type, const char *hname, const char *hval) {
    if (!buf) {
        static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"param\":null,"
                                  "\"code\":null}}";
        buf = strdup(oom);
        if (!buf) return MHD_NO;
        len = strlen(buf);
        status = 500;
    }
    struct MHD_Response *r = MHD_create_response_from_buffer(len, buf, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(buf);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    if (hname) MHD_add_response_header(r, hname, hval);
    enum MHD_Result ok = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ok;
}

/* The name of an answer's extra header, with the value "close": "Connection" once shutting
 * down (the client should reconnect elsewhere), else NULL (none). */
static const char *close_if_stopping(cs_server *srv) {
    return atomic_load(&srv->state) == CS_STATE_STOPPING ? MHD_HTTP_HEADER_CONNECTION : NULL;
}

static enum MHD_Result send_json(struct MHD_Connection *c, unsigned status, char *json, size_t len) {
    return send_buf(c, status, json, len, "application/json", NULL, NULL);
}

static enum MHD_Result send_error_hdr(struct MHD_Connection *c, const cs_api_error *e, const char *hname,
                                      const char *hval) {
    size_t len = 0;
    char *s = cs_api_error_json(e, &len);
    return send_buf(c, (unsigned)e->status, s, len, "application/json", hname, hval);
}

static enum MHD_Result send_error(struct MHD_Connection *c, const cs_api_error *e) {
    return send_error_hdr(c, e, NULL, NULL);
}

static enum MHD_Result fail(struct MHD_Connection *c, int status, const char *type, const char *code,
                            const char *msg) {
    cs_api_error e;
    cs_api_set_error(&e, status, type, NULL, code, "%s", msg);
    return send_error(c, &e);
}

/* ---- the client's socket ------------------------------------------------------------ */

/* 1 when the peer closed its side (or the socket failed). */
static int client_gone(int fd) {
    struct pollfd p = {fd, POLLIN | POLLRDHUP, 0};
    if (poll(&p, 1, 0) <= 0) return 0;
    if (p.revents & (POLLHUP | POLLERR | POLLRDHUP | POLLNVAL)) return 1;
    if (p.revents & POLLIN) {
        char b;
        ssize_t r = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
        if (r == 0) return 1;
    }
    return 0;
}

static int conn_fd(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    return ci ? ci->connect_fd : -1;
}

/* ---- streaming ------------------------------------------------------------------------ */

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    stream_ctx *sc = cls;
    (void)pos;
    for (int i = 0; i < 75; i++) { /* up to 15 s, then a comment line keeps the stream alive */
        long n = cs_job_read_stream(sc->job, buf, max, 200);
        if (n > 0) return (ssize_t)n;
        if (n < 0) return MHD_CONTENT_READER_END_OF_STREAM;
        if (sc->fd >= 0 && client_gone(sc->fd)) {
            cs_job_cancel(sc->job);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
    }
    static const char ka[] = ": keep-alive\n\n";
    if (max < sizeof ka - 1) return 0;
    memcpy(buf, ka, sizeof ka - 1);
    return (ssize_t)(sizeof ka - 1);
}

static void stream_free(void *cls) {
    stream_ctx *sc = cls;
    cs_job_cancel(sc->job); /* a no-op once it is done; else the client went away */
    cs_job_unref(sc->job);
    free(sc);
}

/* A streamed list of prompts: the jobs' events interleaved as they come, whole events only
 * (an event read in part keeps its job until the rest is out), then the summed usage and one
 * [DONE]. */
typedef struct multi_stream {
    cs_job **jobs;
    int n, fd;
    int next;     /* the job to ask first */
    int sticky;   /* -1, or the job whose event was sent in part */
    uint8_t *ended;
    int tail;     /* 0 streaming, 1 the usage and [DONE] are out */
} multi_stream;

static ssize_t multi_read(void *cls, uint64_t pos, char *buf, size_t max) {
    multi_stream *ms = cls;
    (void)pos;
    if (ms->tail) return MHD_CONTENT_READER_END_OF_STREAM;
    for (int round = 0; round < 1500; round++) { /* up to 15 s, then a keep-alive comment */
        int open = 0;
        for (int k = 0; k < ms->n; k++) {
            int i = ms->sticky >= 0 ? ms->sticky : (ms->next + k) % ms->n;
            if (ms->ended[i]) continue;
            open++;
            long got = cs_job_read_stream(ms->jobs[i], buf, max, 0);
            if (got < 0) {
                ms->ended[i] = 1;
                if (ms->sticky == i) ms->sticky = -1;
                continue;
            }
            if (got == 0) {
                if (ms->sticky == i) break; /* the rest of its event is not written yet */
                continue;
            }
            /* events end with a blank line and never hold one */
            ms->sticky = got >= 2 && buf[got - 1] == '\n' && buf[got - 2] == '\n' ? -1 : i;
            ms->next = (i + 1) % ms->n;
            return (ssize_t)got;
        }
        if (!open) {
            size_t len = 0;
            char *u = cs_api_stream_usage(ms->jobs, ms->n, &len);
            static const char done[] = "data: [DONE]\n\n";
            size_t need = (u ? len : 0) + sizeof done - 1;
            if (need > max) { /* MHD's buffer (16 KiB) always holds it */
                free(u);
                return MHD_CONTENT_READER_END_WITH_ERROR;
            }
            if (u) memcpy(buf, u, len);
            memcpy(buf + (u ? len : 0), done, sizeof done - 1);
            free(u);
            ms->tail = 1;
            return (ssize_t)need;
        }
        if (ms->fd >= 0 && round % 20 == 19 && client_gone(ms->fd)) {
            for (int i = 0; i < ms->n; i++) cs_job_cancel(ms->jobs[i]);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    static const char ka[] = ": keep-alive\n\n";
    if (ms->sticky >= 0 || max < sizeof ka - 1) return 0;
    memcpy(buf, ka, sizeof ka - 1);
    return (ssize_t)(sizeof ka - 1);
}

static void multi_free(void *cls) {
    multi_stream *ms = cls;
    for (int i = 0; i < ms->n; i++) {
        cs_job_cancel(ms->jobs[i]); /* no-ops once they are done; else the client went away */
        cs_job_unref(ms->jobs[i]);
    }
    free(ms->jobs);
    free(ms->ended);
    free(ms);
}

/* Hands the submitted jobs to a streamed response (taken, also on failure). */
static enum MHD_Result stream_prompt_list(struct MHD_Connection *c, cs_job **jobs, int n) {
    multi_stream *ms = calloc(1, sizeof *ms);
    uint8_t *ended = calloc((size_t)n, 1);
    struct MHD_Response *r = NULL;
    if (ms && ended) {
        ms->jobs = jobs;
        ms->n = n;
        ms->fd = conn_fd(c);
        ms->sticky = -1;
        ms->ended = ended;
        r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, multi_read, ms, multi_free);
    }
    if (!r) {
        if (ms && ended) {
            multi_free(ms);
        } else {
            for (int i = 0; i < n; i++) {
                cs_job_cancel(jobs[i]);
                cs_job_unref(jobs[i]);
            }
            free(jobs);
            free(ms);
            free(ended);
        }
        return fail(c, 500, "server_error", NULL, "out of memory");
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    enum MHD_Result ok = MHD_queue_response(c, 200, r);
    MHD_destroy_response(r);
    return ok;
}

/* ---- the handler ----------------------------------------------------------------------- */

static enum route route_of(const char *url) {
    if (!strcmp(url, "/health")) return R_HEALTH;
    if (!strcmp(url, "/metrics")) return R_METRICS;
    if (!strcmp(url, "/v1/models")) return R_MODELS;
    if (!strcmp(url, "/v1/completions")) return R_COMPLETIONS;
    if (!strcmp(url, "/v1/chat/completions")) return R_CHAT;
    if (!strcmp(url, "/tokenize")) return R_TOKENIZE;
    if (!strcmp(url, "/detokenize")) return R_DETOKENIZE;
    return R_NONE;
}

/* Constant-time comparison of the presented key with ours. */
static int key_ok(const cs_server *srv, struct MHD_Connection *c) {
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!h || strncasecmp(h, "Bearer ", 7)) return 0;
    h += 7;
    while (*h == ' ') h++;
    size_t a = strlen(h), b = strlen(srv->api_key);
    unsigned diff = (unsigned)(a ^ b);
    for (size_t i = 0; i < a; i++) diff |= (unsigned char)h[i] ^ (unsigned char)srv->api_key[i % (b ? b : 1)];
    return diff == 0;
}

static enum MHD_Result handle_metrics(cs_server *srv, struct MHD_Connection *c) {
    cs_metrics m;
    memset(&m, 0, sizeof m);
    cs_hist_init_ttft(&m.ttft);
    cs_hist_init_tpot(&m.tpot);
    uint64_t *ex = NULL, *cache = NULL;
    if (atomic_load(&srv->state) != CS_STATE_LOADING && srv->sched) {
        cs_sched_snapshot(srv->sched, &m);
        ex = cs_colibri_expert_counts(&srv->engine);
        m.n_layers = srv->engine.n_layers;
        m.n_experts = srv->engine.n_experts;
        m.expert_tokens = ex;
        m.backend = srv->backend;
        m.backend_device = srv->backend_device;
        m.backend_device_bytes = srv->backend_device_bytes;
        m.backend_experts_resident = srv->backend_experts_resident;
        m.backend_experts_host = srv->backend_experts_host;
        /* the copies the engine thread made after its last step (engine.c), never the engine's own */
        cache = cs_colibri_cache_counts(&srv->engine, &m.cache_bytes_read);
        if (cache) {
            m.cache_slots = srv->engine.cache_slots;
            m.cache_layer = cache;
            m.cache_moe = srv->engine.moe;
        }
    }
    size_t len = 0;
    char *t = cs_metrics_render(&m, &len);
    free(cache);
    free(ex);
    return send_buf(c, 200, t, len, "text/plain; version=0.0.4; charset=utf-8", NULL, NULL);
}

/* /v1/completions with a list of prompts: a job per prompt, all queued at once (they batch
 * together), one answer with every prompt's choices (or one stream of all their events). */
static enum MHD_Result handle_prompt_list(cs_server *srv, struct MHD_Connection *c, char **bodies, size_t *lens,
                                          int n) {
    cs_api_error err;
    memset(&err, 0, sizeof err);
    cs_job **jobs = calloc((size_t)n, sizeof *jobs);
    char **res = calloc((size_t)n, sizeof *res);
    size_t *res_len = calloc((size_t)n, sizeof *res_len);
    int failed = -1, status = 200, bad = -1;
    enum MHD_Result ok;
    if (!jobs || !res || !res_len) {
        cs_api_set_error(&err, 500, "server_error", NULL, NULL, "out of memory");
        failed = 0;
    }
    for (int i = 0; failed < 0 && i < n; i++) {
        if (cs_api_parse(srv, CS_API_COMPLETIONS, bodies[i], lens[i], &jobs[i], &err)) {
            failed = i;
            break;
        }
        cs_job_set_fd(jobs[i], conn_fd(c));
        if (cs_job_stream(jobs[i])) cs_job_join_stream(jobs[i], jobs[0], i);
        if (cs_api_submit(jobs[i], &err)) {
            cs_job_unref(jobs[i]);
            jobs[i] = NULL;
            failed = i;
        }
    }
    if (failed < 0 && cs_job_stream(jobs[0])) {
        for (int i = 0; i < n; i++) free(bodies[i]);
        free(bodies);
        free(lens);
        free(res);
        free(res_len);
        return stream_prompt_list(c, jobs, n);
    }
    for (int i = 0; jobs && i < n && jobs[i]; i++) {
        if (failed >= 0) cs_job_cancel(jobs[i]); /* the request as a whole failed */
        cs_job_wait(jobs[i], client_gone);
        int st = 200;
        res[i] = cs_job_response(jobs[i], &res_len[i], &st);
        if (st != 200 && status == 200) status = st, bad = i;
        cs_job_unref(jobs[i]);
    }
    if (failed >= 0) {
        ok = send_error(c, &err);
    } else if (status != 200) { /* the first failed answer, as it is */
        char *s = res[bad];
        res[bad] = NULL;
        ok = s ? send_buf(c, (unsigned)status, s, res_len[bad], "application/json", NULL, NULL)
               : fail(c, 500, "server_error", NULL, "out of memory");
    } else {
        size_t len = 0;
        char *s = cs_api_merge_completions(res, res_len, n, &len);
        ok = s ? send_buf(c, 200, s, len, "application/json", close_if_stopping(srv), "close")
               : fail(c, 500, "server_error", NULL, "out of memory");
    }
    for (int i = 0; res && i < n; i++) free(res[i]);
    for (int i = 0; i < n; i++) free(bodies[i]);
    free(bodies);
    free(lens);
    free(jobs);
    free(res);
    free(res_len);
    return ok;
}

static enum MHD_Result handle_generate(cs_server *srv, struct MHD_Connection *c, conn *k) {
    cs_api_error err;
    cs_job *j = NULL;
    if (k->route == R_COMPLETIONS) {
        char **bodies = NULL;
        size_t *lens = NULL;
        memset(&err, 0, sizeof err);
        int n = cs_api_split_prompts(srv, k->body ? k->body : "", k->len, &bodies, &lens, &err);
        if (n < 0) return send_error(c, &err);
        if (n > 0) return handle_prompt_list(srv, c, bodies, lens, n);
    }
    if (cs_api_parse(srv, k->route == R_CHAT ? CS_API_CHAT : CS_API_COMPLETIONS, k->body ? k->body : "", k->len, &j,
                     &err))
        return send_error(c, &err);
    int fd = conn_fd(c);
    cs_job_set_fd(j, fd);
    if (cs_api_submit(j, &err)) {
        cs_job_unref(j);
        return send_error_hdr(c, &err, close_if_stopping(srv), "close"); /* 503 when the drain began meanwhile */
    }
    if (cs_job_stream(j)) {
        stream_ctx *sc = malloc(sizeof *sc);
        if (!sc) {
            cs_job_cancel(j);
            cs_job_unref(j);
            return fail(c, 500, "server_error", NULL, "out of memory");
        }
        sc->job = j;
        sc->fd = fd;
        struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, stream_read, sc,
                                                                   stream_free);
        if (!r) {
            stream_free(sc);
            return MHD_NO;
        }
        MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
        MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        enum MHD_Result ok = MHD_queue_response(c, 200, r);
        MHD_destroy_response(r);
        return ok;
    }
    cs_job_wait(j, client_gone);
    size_t len = 0;
    int status = 200;
    char *s = cs_job_response(j, &len, &status);
    cs_job_unref(j);
    return send_buf(c, (unsigned)status, s, len, "application/json", close_if_stopping(srv), "close");
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    cs_http *h = cls;
    cs_server *srv = h->srv;
    conn *k = *con_cls;
    (void)version;
    if (!k) {
        /* first call: the headers are in; refuse what we can before the body */
        k = calloc(1, sizeof *k);
        if (!k) return MHD_NO;
        *con_cls = k;
        atomic_fetch_add(&h->inflight, 1);
        k->route = route_of(url);
        int post = k->route == R_COMPLETIONS || k->route == R_CHAT || k->route == R_TOKENIZE ||
                   k->route == R_DETOKENIZE;
        int is_get = !strcmp(method, MHD_HTTP_METHOD_GET) || !strcmp(method, MHD_HTTP_METHOD_HEAD);
        int is_post = !strcmp(method, MHD_HTTP_METHOD_POST);
        if (k->route == R_NONE) {
            char msg[512];
            snprintf(msg, sizeof msg, "no such endpoint: %.200s (try POST /v1/completions, POST /v1/chat/completions, "
                     "POST /tokenize, POST /detokenize, GET /v1/models, GET /health, GET /metrics)", url);
            k->done = 1;
            return fail(c, 404, "invalid_request_error", "not_found", msg);
        }
        if ((post && !is_post) || (!post && !is_get)) {
            k->done = 1;
            cs_api_error e;
            cs_api_set_error(&e, 405, "invalid_request_error", NULL, "method_not_allowed", "%s is not allowed on %s; use %s",
                             method, url, post ? "POST" : "GET");
            return send_error_hdr(c, &e, MHD_HTTP_HEADER_ALLOW, post ? "POST" : "GET, HEAD");
        }
        if (k->route != R_HEALTH && k->route != R_METRICS && srv->api_key && *srv->api_key && !key_ok(srv, c)) {
            k->done = 1;
            return fail(c, 401, "invalid_request_error", "invalid_api_key",
                        "missing or wrong API key: send 'Authorization: Bearer <key>'");
        }
        if (post) {
            const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
            unsigned long long n = cl ? strtoull(cl, NULL, 10) : 0;
            if (n > (unsigned long long)srv->max_body_bytes) {
                if (n > drain_limit(srv)) {
                    k->done = 1;
                    return too_large(c, srv);
                }
                k->too_big = 1;
            }
        }
        return MHD_YES;
    }
    if (*upload_size) {
        if (!k->done && !k->too_big && k->len + *upload_size > (size_t)srv->max_body_bytes) {
            k->too_big = 1;
            free(k->body);
            k->body = NULL;
            k->len = k->cap = 0;
        }
        if (!k->done && k->too_big) {
            k->dropped += *upload_size;
            *upload_size = 0;
            if (k->dropped > drain_limit(srv)) {
                k->done = 1;
                return too_large(c, srv);
            }
            return MHD_YES;
        }
        if (!k->done) {
            if (k->len + *upload_size + 1 > k->cap) {
                size_t cap = (k->len + *upload_size + 1) * 2;
                if (cap > (size_t)srv->max_body_bytes + 1) cap = (size_t)srv->max_body_bytes + 1;
                char *nb = realloc(k->body, cap);
                if (!nb) return MHD_NO;
                k->body = nb;
                k->cap = cap;
            }
            memcpy(k->body + k->len, upload, *upload_size);
            k->len += *upload_size;
        }
        *upload_size = 0;
        return MHD_YES;
    }
    if (!k->done && k->too_big) {
        k->done = 1;
        return too_large(c, srv);
    }
    if (k->done) return MHD_YES;
    k->done = 1;
    int ready = atomic_load(&srv->state) == CS_STATE_READY;
    switch (k->route) {
    case R_HEALTH: {
        int state = atomic_load(&srv->state);
        const char *body = state == CS_STATE_READY     ? "{\"status\":\"ok\"}"
                           : state == CS_STATE_LOADING ? "{\"status\":\"loading\"}"
                                                       : "{\"status\":\"stopping\"}";
        return send_buf(c, state == CS_STATE_READY ? 200 : 503, strdup(body), strlen(body), "application/json",
                        close_if_stopping(srv), "close");
    }
    case R_METRICS:
        return handle_metrics(srv, c);
    default:
        break;
    }
    if (!ready) {
        if (atomic_load(&srv->state) == CS_STATE_LOADING)
            return fail(c, 503, "server_error", "model_loading",
                        "the model is still loading; retry when GET /health says ok");
        /* draining: nothing new is admitted; the request is safe to send elsewhere, since
         * none of it ran here */
        cs_api_error e;
        cs_api_set_error(&e, 503, "server_error", NULL, "server_shutting_down",
                         "the server is shutting down and admits no new requests; retry on another replica");
        return send_error_hdr(c, &e, MHD_HTTP_HEADER_CONNECTION, "close");
    }
    if (k->route == R_MODELS) {
        size_t len = 0;
        char *s = cs_api_models_json(srv, &len);
        return send_json(c, 200, s, len);
    }
    if (k->route == R_TOKENIZE || k->route == R_DETOKENIZE) {
        cs_api_error err;
        memset(&err, 0, sizeof err);
        size_t len = 0;
        char *s = (k->route == R_TOKENIZE ? cs_api_tokenize : cs_api_detokenize)(srv, k->body ? k->body : "", k->len,
                                                                                 &len, &err);
        return s ? send_json(c, 200, s, len) : send_error(c, &err);
    }
    return handle_generate(srv, c, k);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    cs_http *h = cls;
    (void)c, (void)toe;
    conn *k = *con_cls;
    if (k) {
        atomic_fetch_sub(&h->inflight, 1);
        free(k->body);
        free(k);
        *con_cls = NULL;
    }
}

cs_http *cs_http_start(cs_server *srv, const cs_http_options *opt, char *err, size_t err_len) {
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    char port[16];
    snprintf(port, sizeof port, "%d", opt->port);
    int gai = getaddrinfo(opt->host, port, &hints, &res);
    if (gai || !res) {
        snprintf(err, err_len, "cannot resolve host '%s': %s", opt->host, gai ? gai_strerror(gai) : "no address");
        return NULL;
    }
    cs_http *h = calloc(1, sizeof *h);
    if (!h) {
        freeaddrinfo(res);
        snprintf(err, err_len, "out of memory");
        return NULL;
    }
    h->srv = srv;
    /* no MHD_USE_ERROR_LOG: a client leaving mid-stream is normal here, not worth a line */
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD;
    if (res->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    h->d = MHD_start_daemon(flags, (uint16_t)opt->port, NULL, NULL, on_request, h,
                            MHD_OPTION_SOCK_ADDR, res->ai_addr,
                            MHD_OPTION_CONNECTION_TIMEOUT, opt->timeout_s,
                            MHD_OPTION_CONNECTION_LIMIT, opt->max_connections,
                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, h,
                            MHD_OPTION_END);
    freeaddrinfo(res);
    if (!h->d) {
        snprintf(err, err_len, "cannot listen on %s:%d (address in use, or not an address of this machine)",
                 opt->host, opt->port);
        free(h);
        return NULL;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_BIND_PORT);
    h->port = di ? di->port : opt->port;
    return h;
}

int cs_http_port(const cs_http *h) { return h->port; }

void cs_http_stop(cs_http *h) {
    if (!h) return;
    /* let the answers of requests in flight (the scheduler has ended them) go out first:
     * stopping the daemon closes every connection */
    for (int i = 0; i < 1000 && atomic_load(&h->inflight) > 0; i++) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    MHD_stop_daemon(h->d);
    free(h);
}
