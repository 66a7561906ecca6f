/*
 * api.c — the OpenAI-compatible request and response bodies of colibri_server (jansson):
 * checking a request and tokenizing its prompt (cs_api_parse), the scheduler callbacks
 * that turn generated ids into text (stop strings matched on the decoded text across
 * token boundaries, log-probabilities) and into server-sent events, and the final JSON.
 *
 * Text of a choice: decode(tail of the prompt + generated ids) minus decode(tail), as
 * Engine.generate and colibri_cli do with the whole prompt (a SentencePiece first piece
 * keeps its space). Text is released only when it can no longer change: a trailing
 * U+FFFD (a character whose bytes are still arriving) and a tail that could begin a stop
 * string are held back until the next token or the end.
 */
#define _GNU_SOURCE /* memmem */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chat.h"
#include "server.h"
#include "tools.h"

#define CS_MAX_STOP_IDS 64 /* stop token ids per request (stop_token_ids and ids in stop) */

#define PREFIX_TOKENS 8

typedef struct job_choice {
    int32_t *ids;        /* generated ids, EOS excluded */
    int64_t n_ids, cap;
    char *text;          /* decoded generated text */
    size_t len;
    size_t emitted;      /* bytes of text released (streamed, or kept for the response) */
    int stopped;         /* a stop string matched at `emitted` */
    cs_finish why;
    json_t *lp;          /* completions: {tokens, token_logprobs, top_logprobs, text_offset};
                          * chat: [entries] */
    /* chat with a reasoning block or tools: the output taken apart (tools.h) */
    size_t sent_reasoning, sent_content; /* bytes of each streamed */
    cs_parsed parsed;    /* the final split (set in cb_finish) */
    int have_parsed;
    char call_ids[CS_MAX_TOOL_CALLS][96];
} job_choice;

enum { TC_AUTO = 0, TC_NONE, TC_REQUIRED, TC_NAMED };

struct cs_job {
    cs_request req;      /* first: the scheduler's view */
    cs_server *srv;
    cs_api_kind kind;
    int stream, echo, logprobs; /* logprobs: -1 off, else the number of alternatives */
    int n_stops;
    char *stops[CS_MAX_STOPS];
    size_t stop_len[CS_MAX_STOPS];
    int32_t *prompt;
    int64_t n_prompt;
    char *echo_text;
    size_t echo_len;
    int64_t n_prefix;    /* the prompt tail decoded before the generated ids */
    size_t prefix_len;   /* bytes of decode(tail), trailing U+FFFD excluded */
    char id[64];
    int64_t created;
    int n_finished;
    /* one prompt of a streamed list (cs_job_join_stream): its choices are numbered from
     * index_base, and the combined stream (http.c) sends the usage and [DONE] once */
    int index_base, stream_part;
    /* chat: the template's output syntax and the request's tools */
    const cs_chat_format *fmt;
    int structured;      /* reasoning / tool calls are taken out of the text */
    int thinking;        /* the output begins inside the reasoning block */
    int parse_tools;     /* tool calls are looked for (tools given, tool_choice not "none") */
    int parallel;        /* parallel_tool_calls */
    int forced_call;     /* tool_choice required / named: a grammar makes the output one call */
    json_t *tools;       /* the request's tools, or NULL */
    const char **tool_names;
    int n_tool_names;
    /* markers of the output syntax that the tokenizer holds as special tokens (decoding
     * drops them): written back into the decoded text */
    int n_marks;
    int32_t mark_id[8];
    const char *mark_text[8];
    job_choice ch[CS_MAX_CHOICES];
    /* the library's per-choice sampler, when a request asks for more than temperature /
     * top_k / top_p (penalties, min_p, logit_bias, stop ids, response_format) */
    int use_sampler;
    colibri_sampling_params sp;
    int32_t *bias_ids;
    float *bias_vals;
    int32_t n_bias;
    int32_t stop_ids[CS_MAX_STOP_IDS];
    int32_t n_stop_ids;
    colibri_grammar *grammar;
    colibri_sampler *samplers[CS_MAX_CHOICES];
    /* shared with the HTTP thread */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    char *out;           /* pending server-sent events */
    size_t out_len, out_cap, out_sent;
    int done;
    char *error;
    int shutdown;        /* cancelled because the server stops */
    int refs;
    int fd;
};

/* ---- small helpers ------------------------------------------------------------------- */

int cs_utf8_valid(const char *str, size_t n, size_t *bad) {
    const unsigned char *s = (const unsigned char *)str;
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        size_t k;
        uint32_t cp, min;
        if (c < 0x80) { i++; continue; }
        else if ((c & 0xE0) == 0xC0) { k = 1; cp = c & 0x1F; min = 0x80; }
        else if ((c & 0xF0) == 0xE0) { k = 2; cp = c & 0x0F; min = 0x800; }
        else if ((c & 0xF8) == 0xF0) { k = 3; cp = c & 0x07; min = 0x10000; }
        else goto fail;
        if (i + k >= n) goto fail;
        for (size_t j = 1; j <= k; j++) {
            if ((s[i + j] & 0xC0) != 0x80) goto fail;
            cp = (cp << 6) | (s[i + j] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) goto fail;
        i += k + 1;
    }
    return 1;
fail:
    if (bad) *bad = i;
    return 0;
}

void cs_api_set_error(cs_api_error *e, int status, const char *type, const char *param, const char *code,
                      const char *fmt, ...) {
    e->status = status;
    e->type = type;
    e->param = param;
    e->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    size_t bad;
    if (!cs_utf8_valid(e->message, strlen(e->message), &bad)) e->message[bad] = '\0';
}

#define BAD(param, ...) cs_api_set_error(err, 400, "invalid_request_error", param, NULL, __VA_ARGS__)

static char *dump(json_t *o, size_t *len) {
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (s && len) *len = strlen(s);
    return s;
}

char *cs_api_error_json(const cs_api_error *e, size_t *len) {
    json_t *o = json_pack("{s:{s:s, s:s, s:o, s:o}}", "error", "message", e->message, "type",
                          e->type ? e->type : "invalid_request_error", "param",
                          e->param ? json_string(e->param) : json_null(), "code",
                          e->code ? json_string(e->code) : json_null());
    return o ? dump(o, len) : NULL;
}

char *cs_api_models_json(const cs_server *srv, size_t *len) {
    /* beside OpenAI's fields: the context length, the engine's numeric mode and kernels, and the
     * backend (docs/backends.md) and its device */
    json_t *o = json_pack("{s:s, s:[{s:s, s:s, s:I, s:s, s:I, s:s, s:s, s:s, s:s}]}", "object", "list", "data", "id",
                          srv->model_id, "object", "model", "created", (json_int_t)srv->created,
                          "owned_by", "colibri", "max_model_len", (json_int_t)srv->ctx_len, "precision",
                          srv->precision ? srv->precision : "", "kernels", srv->kernels ? srv->kernels : "",
                          "backend", srv->backend ? srv->backend : "", "backend_device",
                          srv->backend_device ? srv->backend_device : "");
    return o ? dump(o, len) : NULL;
}

/* Tokenize (caller holds tok_mu). 0, or -1 with the tokenizer's message in err. */
static int tokenize(colibri_tokenizer *tok, const char *text, size_t len, int add_bos, int32_t **ids,
                    int64_t *n, char *err, size_t err_len) {
    int64_t cap = (int64_t)len + 2;
    int32_t *buf = malloc((size_t)cap * sizeof *buf);
    if (!buf) goto oom;
    colibri_status st = colibri_tokenize(tok, text, len, add_bos, buf, cap, n);
    if (st == COLIBRI_E_BUFFER_TOO_SMALL) {
        cap = *n;
        int32_t *nb = realloc(buf, (size_t)cap * sizeof *buf);
        if (!nb) goto oom;
        buf = nb;
        st = colibri_tokenize(tok, text, len, add_bos, buf, cap, n);
    }
    if (st != COLIBRI_OK) {
        const char *m = colibri_tokenizer_last_error(tok);
        snprintf(err, err_len, "tokenizing the prompt failed: %s", m && *m ? m : colibri_status_string(st));
        free(buf);
        return -1;
    }
    *ids = buf;
    return 0;
oom:
    free(buf);
    snprintf(err, err_len, "out of memory");
    return -1;
}

/* Decode (caller holds tok_mu) into a malloc'd buffer; NULL on failure. */
static char *detok(colibri_tokenizer *tok, const int32_t *ids, int64_t n, size_t *len) {
    uint64_t cap = (uint64_t)n * 8 + 16, got = 0;
    char *buf = malloc(cap + 1);
    for (int tries = 0; buf && tries < 4; tries++) {
        colibri_status st = colibri_detokenize(tok, ids, n, buf, cap, &got);
        if (st == COLIBRI_OK) {
            buf[got] = '\0';
            *len = got;
            return buf;
        }
        if (st != COLIBRI_E_BUFFER_TOO_SMALL) break;
        cap = got + 16;
        char *nb = realloc(buf, cap + 1);
        if (!nb) break;
        buf = nb;
    }
    free(buf);
    return NULL;
}

/* detok, with the job's special-token markers written as their text (caller holds tok_mu). */
static char *detok_job(const cs_job *j, const int32_t *ids, int64_t n, size_t *len) {
    if (j->n_marks == 0) return detok(j->srv->tok, ids, n, len);
    char *out = malloc(1);
    size_t total = 0;
    int64_t start = 0;
    if (!out) return NULL;
    for (int64_t k = 0; k <= n; k++) {
        int m = -1;
        for (int q = 0; k < n && q < j->n_marks && m < 0; q++)
            if (ids[k] == j->mark_id[q]) m = q;
        if (k < n && m < 0) continue;
        size_t sl = 0, ml = m >= 0 ? strlen(j->mark_text[m]) : 0;
        char *seg = k > start ? detok(j->srv->tok, ids + start, k - start, &sl) : NULL;
        if (k > start && !seg) {
            free(out);
            return NULL;
        }
        char *grown = realloc(out, total + sl + ml + 1);
        if (!grown) {
            free(seg);
            free(out);
            return NULL;
        }
        out = grown;
        if (sl) memcpy(out + total, seg, sl);
        total += sl;
        if (ml) memcpy(out + total, j->mark_text[m], ml);
        total += ml;
        free(seg);
        start = k + 1;
    }
    out[total] = 0;
    *len = total;
    return out;
}

/* The markers of the job's output syntax that are special tokens (caller holds tok_mu). */
static void find_marks(cs_job *j) {
    const char *const *mk = cs_output_markers(j->fmt);
    for (int q = 0; mk[q] && j->n_marks < 8; q++) {
        int32_t ids[4];
        int64_t got = 0;
        if (colibri_tokenize(j->srv->tok, mk[q], strlen(mk[q]), 0, ids, 4, &got) != COLIBRI_OK || got != 1) continue;
        size_t dl = 1;
        char *d = detok(j->srv->tok, ids, 1, &dl);
        if (d && dl == 0) {
            j->mark_id[j->n_marks] = ids[0];
            j->mark_text[j->n_marks++] = mk[q];
        }
        free(d);
    }
}

static size_t fffd_tail(const char *s, size_t n) {
    size_t k = n;
    while (k >= 3 && (unsigned char)s[k - 3] == 0xEF && (unsigned char)s[k - 2] == 0xBF &&
           (unsigned char)s[k - 1] == 0xBD)
        k -= 3;
    return n - k;
}

/* The text of one token for logprobs (caller holds tok_mu): its decoded text, with the
 * space a SentencePiece "▁" stands for; a byte piece <0xHH> gives its byte in *byte. */
static char *token_text(colibri_tokenizer *tok, int32_t id, size_t *len, int *byte) {
    const char *piece = NULL;
    uint64_t plen = 0;
    *byte = -1;
    if (colibri_token_piece(tok, id, &piece, &plen) == COLIBRI_OK && plen == 6 && !memcmp(piece, "<0x", 3) &&
        piece[5] == '>') {
        char hex[3] = {piece[3], piece[4], 0};
        char *end;
        long v = strtol(hex, &end, 16);
        if (!*end) *byte = (int)v;
    }
    size_t n = 0;
    char *t = detok(tok, &id, 1, &n);
    if (!t) {
        t = strdup("");
        n = 0;
    }
    /* SentencePiece drops the space of a first piece's "▁" (byte-level pieces never hold
     * a literal U+2581: their bytes are mapped) */
    if (t && piece && plen >= 3 && !memcmp(piece, "\xE2\x96\x81", 3)) {
        char *w = malloc(n + 2);
        if (w) {
            w[0] = ' ';
            memcpy(w + 1, t, n + 1);
            free(t);
            t = w;
            n++;
        }
    }
    *len = n;
    return t;
}

/* ---- the job ------------------------------------------------------------------------- */

static void job_free(cs_job *j) {
    json_decref(j->tools);
    free(j->tool_names);
    for (int c = 0; c < CS_MAX_CHOICES; c++) colibri_sampler_free(j->samplers[c]);
    colibri_grammar_free(j->grammar);
    free(j->bias_ids);
    free(j->bias_vals);
    for (int c = 0; c < CS_MAX_CHOICES; c++) {
        cs_parsed_free(&j->ch[c].parsed);
        free(j->ch[c].ids);
        free(j->ch[c].text);
        json_decref(j->ch[c].lp);
    }
    for (int i = 0; i < j->n_stops; i++) free(j->stops[i]);
    free(j->prompt);
    free(j->echo_text);
    free(j->out);
    free(j->error);
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j);
}

void cs_job_unref(cs_job *j) {
    if (!j) return;
    pthread_mutex_lock(&j->mu);
    int left = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (left == 0) job_free(j);
}

int cs_job_stream(const cs_job *j) { return j->stream; }
void cs_job_set_fd(cs_job *j, int fd) { j->fd = fd; }
void cs_job_cancel(cs_job *j) { cs_sched_cancel(j->srv->sched, &j->req); }

/* Append one server-sent event (caller holds j->mu); takes the reference to o. */
static void sse(cs_job *j, json_t *o) {
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!s) return;
    size_t n = strlen(s), need = j->out_len + n + 9;
    if (need > j->out_cap) {
        size_t cap = need * 2;
        char *nb = realloc(j->out, cap);
        if (!nb) {
            free(s);
            return;
        }
        j->out = nb;
        j->out_cap = cap;
    }
    memcpy(j->out + j->out_len, "data: ", 6);
    memcpy(j->out + j->out_len + 6, s, n);
    memcpy(j->out + j->out_len + 6 + n, "\n\n", 2);
    j->out_len += n + 8;
    free(s);
}

static void sse_raw(cs_job *j, const char *s) {
    size_t n = strlen(s), need = j->out_len + n;
    if (need > j->out_cap) {
        char *nb = realloc(j->out, need * 2);
        if (!nb) return;
        j->out = nb;
        j->out_cap = need * 2;
    }
    memcpy(j->out + j->out_len, s, n);
    j->out_len += n;
}

/* usage as OpenAI reports it; prompt_tokens_details.cached_tokens: the prompt positions the
 * prefix cache served */
static json_t *usage_json(const cs_job *j) {
    return json_pack("{s:I, s:I, s:I, s:{s:I}}", "prompt_tokens", (json_int_t)j->n_prompt, "completion_tokens",
                     (json_int_t)j->req.completion_tokens, "total_tokens",
                     (json_int_t)(j->n_prompt + j->req.completion_tokens), "prompt_tokens_details",
                     "cached_tokens", (json_int_t)j->req.cached_tokens);
}

static json_t *text_json(const char *s, size_t n) {
    json_t *t = json_stringn(s, n);
    return t ? t : json_string("\xEF\xBF\xBD");
}

/* A stream chunk for choice c: `delta` text (may be empty), a logprobs piece (taken),
 * a finish reason or NULL, usage or NULL (taken). */
static json_t *chunk(cs_job *j, int c, const char *delta, size_t dlen, json_t *lp, const char *finish,
                     json_t *usage, int role) {
    json_t *choice = json_object();
    json_object_set_new(choice, "index", json_integer(j->index_base + c));
    if (j->kind == CS_API_CHAT) {
        json_t *d = json_object();
        if (role) json_object_set_new(d, "role", json_string("assistant"));
        if (dlen || role || !finish) json_object_set_new(d, "content", text_json(delta, dlen));
        json_object_set_new(choice, "delta", d);
    } else {
        json_object_set_new(choice, "text", text_json(delta, dlen));
    }
    json_object_set_new(choice, "logprobs", lp ? lp : json_null());
    json_object_set_new(choice, "finish_reason", finish ? json_string(finish) : json_null());
    json_t *o = json_pack("{s:s, s:s, s:I, s:s, s:[o]}", "id", j->id, "object",
                          j->kind == CS_API_CHAT ? "chat.completion.chunk" : "text_completion", "created",
                          (json_int_t)j->created, "model", j->srv->model_id, "choices", choice);
    if (o && usage) json_object_set_new(o, "usage", usage);
    else json_decref(usage);
    return o;
}

static uint64_t random_seed(cs_server *srv);

/* A chat stream chunk with a ready delta object (taken). */
static json_t *chunk_delta(cs_job *j, int c, json_t *delta, const char *finish, json_t *usage) {
    json_t *choice = json_pack("{s:i, s:o, s:n, s:o}", "index", j->index_base + c, "delta", delta, "logprobs", "finish_reason",
                               finish ? json_string(finish) : json_null());
    json_t *o = json_pack("{s:s, s:s, s:I, s:s, s:[o]}", "id", j->id, "object", "chat.completion.chunk", "created",
                          (json_int_t)j->created, "model", j->srv->model_id, "choices", choice);
    if (o && usage) json_object_set_new(o, "usage", usage);
    else json_decref(usage);
    return o;
}

/* Stream what is new in the split of the text so far (caller holds j->mu): reasoning and
 * content deltas. */
static void stream_split(cs_job *j, int c, const cs_parsed *p) {
    job_choice *ch = &j->ch[c];
    if (p->reasoning && p->reasoning_len > ch->sent_reasoning) {
        json_t *d = json_pack("{s:o}", "reasoning_content",
                              text_json(p->reasoning + ch->sent_reasoning, p->reasoning_len - ch->sent_reasoning));
        sse(j, chunk_delta(j, c, d, NULL, NULL));
        ch->sent_reasoning = p->reasoning_len;
    }
    if (p->content_len > ch->sent_content) {
        json_t *d = json_pack("{s:o}", "content", text_json(p->content + ch->sent_content, p->content_len - ch->sent_content));
        sse(j, chunk_delta(j, c, d, NULL, NULL));
        ch->sent_content = p->content_len;
    }
}

static void make_call_id(cs_job *j, char *out, size_t cap) {
    static const char ALNUM[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    uint64_t x = random_seed(j->srv), y = random_seed(j->srv);
    if (j->fmt && j->fmt->call_id_len > 0 && (size_t)j->fmt->call_id_len < cap && j->fmt->call_id_len <= 10) {
        /* its template wants that many alphanumerics (Mistral: 9) */
        for (int k = 0; k < j->fmt->call_id_len; k++, x /= 62) out[k] = ALNUM[x % 62];
        out[j->fmt->call_id_len] = 0;
    } else {
        snprintf(out, cap, "call_%016" PRIx64 "%08" PRIx64, x, y & 0xFFFFFFFFu);
    }
}

/* The final split of choice c (engine thread, at its end). */
static void finish_split(cs_job *j, int c) {
    job_choice *ch = &j->ch[c];
    if (cs_output_parse(j->fmt, j->thinking, j->parse_tools, j->tool_names, j->n_tool_names, ch->text ? ch->text : "",
                        ch->emitted, 1, &ch->parsed) != 0)
        return;
    if (!j->parallel && ch->parsed.n_calls > 1) { /* parallel_tool_calls: false keeps the first */
        cs_parsed first = ch->parsed;
        first.n_calls = 1;
        for (int k = 1; k < ch->parsed.n_calls; k++) {
            free(ch->parsed.calls[k].name);
            free(ch->parsed.calls[k].arguments);
            free(ch->parsed.calls[k].id);
        }
        ch->parsed = first;
    }
    for (int k = 0; k < ch->parsed.n_calls; k++) {
        const char *id = ch->parsed.calls[k].id;
        if (id && strlen(id) < sizeof ch->call_ids[k]) snprintf(ch->call_ids[k], sizeof ch->call_ids[k], "%s", id);
        else make_call_id(j, ch->call_ids[k], sizeof ch->call_ids[k]);
    }
    ch->have_parsed = 1;
}

static json_t *tool_calls_json(const job_choice *ch) {
    json_t *a = json_array();
    for (int k = 0; k < ch->parsed.n_calls; k++)
        json_array_append_new(a, json_pack("{s:s, s:s, s:{s:s, s:s}}", "id", ch->call_ids[k], "type", "function",
                                           "function", "name", ch->parsed.calls[k].name, "arguments",
                                           ch->parsed.calls[k].arguments));
    return a;
}

static const char *finish_name(cs_finish f) {
    return f == CS_FINISH_STOP ? "stop" : f == CS_FINISH_LENGTH ? "length" : NULL;
}

/* log-softmax of row at `tok` and the `top` best alternatives, as OpenAI shapes them
 * (caller holds tok_mu). Returns the entry for the stream and appends to ch->lp. */
static json_t *logprobs_entry(cs_job *j, job_choice *ch, int32_t tok, const float *row, size_t text_offset) {
    cs_server *srv = j->srv;
    int64_t V = srv->vocab;
    double mx = -INFINITY;
    for (int64_t v = 0; v < V; v++)
        if (row[v] > mx) mx = row[v];
    double sum = 0;
    for (int64_t v = 0; v < V; v++) sum += exp((double)row[v] - mx);
    double lse = mx + log(sum);
    int top = j->logprobs;
    int32_t best[CS_MAX_TOP_LOGPROBS];
    int nb = 0;
    for (int64_t v = 0; v < V && top > 0; v++) {
        int pos = nb;
        while (pos > 0 && row[v] > row[best[pos - 1]]) pos--;
        if (pos >= top) continue;
        int last = nb < top ? nb : top - 1;
        for (int k = last; k > pos; k--) best[k] = best[k - 1];
        best[pos] = (int32_t)v;
        if (nb < top) nb++;
    }
    size_t tl;
    int byte;
    char *tt = token_text(srv->tok, tok, &tl, &byte);
    double lp = (double)row[tok] - lse;
    json_t *entry;
    if (j->kind == CS_API_CHAT) {
        json_t *bytes = json_array();
        if (byte >= 0) json_array_append_new(bytes, json_integer(byte));
        else for (size_t i = 0; tt && i < tl; i++) json_array_append_new(bytes, json_integer((unsigned char)tt[i]));
        json_t *alts = json_array();
        for (int k = 0; k < nb; k++) {
            size_t al;
            int ab;
            char *at = token_text(srv->tok, best[k], &al, &ab);
            json_t *ab_arr = json_array();
            if (ab >= 0) json_array_append_new(ab_arr, json_integer(ab));
            else for (size_t i = 0; at && i < al; i++) json_array_append_new(ab_arr, json_integer((unsigned char)at[i]));
            json_array_append_new(alts, json_pack("{s:o, s:f, s:o}", "token", text_json(at ? at : "", al), "logprob",
                                                  (double)row[best[k]] - lse, "bytes", ab_arr));
            free(at);
        }
        entry = json_pack("{s:o, s:f, s:o, s:o}", "token", text_json(tt ? tt : "", tl), "logprob", lp, "bytes", bytes,
                          "top_logprobs", alts);
        if (!ch->lp) ch->lp = json_array();
        json_array_append(ch->lp, entry);
        free(tt);
        return json_pack("{s:[o]}", "content", entry);
    }
    json_t *alts = json_object();
    for (int k = 0; k < nb; k++) {
        size_t al;
        int ab;
        char *at = token_text(srv->tok, best[k], &al, &ab);
        char *key = at ? at : strdup("");
        size_t bad;
        if (key && cs_utf8_valid(key, al, &bad) && !memchr(key, 0, al))
            json_object_set_new(alts, key, json_real((double)row[best[k]] - lse));
        free(key);
    }
    if (!ch->lp)
        ch->lp = json_pack("{s:[], s:[], s:[], s:[]}", "tokens", "token_logprobs", "top_logprobs", "text_offset");
    json_t *tokj = text_json(tt ? tt : "", tl);
    json_array_append(json_object_get(ch->lp, "tokens"), tokj);
    json_array_append_new(json_object_get(ch->lp, "token_logprobs"), json_real(lp));
    json_array_append(json_object_get(ch->lp, "top_logprobs"), alts);
    json_array_append_new(json_object_get(ch->lp, "text_offset"), json_integer((json_int_t)text_offset));
    free(tt);
    return json_pack("{s:[o], s:[f], s:[o], s:[I]}", "tokens", tokj, "token_logprobs", lp, "top_logprobs", alts,
                     "text_offset", (json_int_t)text_offset);
}

/* Where the text of ch may be released up to (nothing that could still change or begin
 * a stop string), and whether a stop string matched (then *stop_at is its offset). */
static size_t release_point(const cs_job *j, const job_choice *ch, int *stopped, size_t *stop_at) {
    const char *t = ch->text;
    size_t len = ch->len;
    *stopped = 0;
    size_t best = (size_t)-1;
    for (int i = 0; i < j->n_stops; i++) {
        if (ch->emitted >= len) break;
        const char *p = memmem(t + ch->emitted, len - ch->emitted, j->stops[i], j->stop_len[i]);
        if (p && (size_t)(p - t) < best) best = (size_t)(p - t);
    }
    if (best != (size_t)-1) {
        *stopped = 1;
        *stop_at = best;
        return best;
    }
    size_t end = len - fffd_tail(t, len), hold = 0;
    for (int i = 0; i < j->n_stops; i++) {
        size_t l = j->stop_len[i] - 1;
        if (l > end) l = end;
        for (; l > hold; l--)
            if (!memcmp(t + end - l, j->stops[i], l)) {
                hold = l;
                break;
            }
    }
    end -= hold;
    return end > ch->emitted ? end : ch->emitted;
}

/* ---- scheduler callbacks (engine thread) -------------------------------------------- */

static int cb_token(cs_request *r, int c, int32_t tok, const float *logits) {
    cs_job *j = (cs_job *)r;
    cs_server *srv = j->srv;
    job_choice *ch = &j->ch[c];
    if (ch->n_ids == ch->cap) {
        int64_t cap = ch->cap ? ch->cap * 2 : 64;
        int32_t *n = realloc(ch->ids, (size_t)(cap + j->n_prefix) * sizeof *n);
        if (!n) return 1;
        ch->ids = n;
        ch->cap = cap;
    }
    if (j->kind == CS_API_CHAT && j->n_stops) {
        /* a stop string that is one special token (e.g. <|im_end|>): the decoded text
         * never shows it, so it is matched on the token's piece */
        const char *piece = NULL;
        uint64_t plen = 0;
        pthread_mutex_lock(&srv->tok_mu);
        int ok = colibri_token_piece(srv->tok, tok, &piece, &plen) == COLIBRI_OK;
        int hit = 0;
        for (int i = 0; ok && i < j->n_stops && !hit; i++) hit = plen == j->stop_len[i] && !memcmp(piece, j->stops[i], plen);
        pthread_mutex_unlock(&srv->tok_mu);
        if (hit) {
            ch->stopped = 1;
            return 1;
        }
    }
    ch->ids[ch->n_ids++] = tok;
    /* ids of the decode: the prompt tail, then the generated ids */
    int32_t *ids = malloc((size_t)(j->n_prefix + ch->n_ids) * sizeof *ids);
    if (!ids) return 1;
    memcpy(ids, j->prompt + j->n_prompt - j->n_prefix, (size_t)j->n_prefix * sizeof *ids);
    memcpy(ids + j->n_prefix, ch->ids, (size_t)ch->n_ids * sizeof *ids);
    size_t before = ch->len;
    json_t *lp = NULL;
    pthread_mutex_lock(&srv->tok_mu);
    size_t full_len = 0;
    char *full = detok_job(j, ids, j->n_prefix + ch->n_ids, &full_len);
    if (j->logprobs >= 0) lp = logprobs_entry(j, ch, tok, logits, j->echo_len + before);
    pthread_mutex_unlock(&srv->tok_mu);
    free(ids);
    if (full) {
        size_t skip = j->prefix_len <= full_len ? j->prefix_len : full_len;
        memmove(full, full + skip, full_len - skip + 1);
        free(ch->text);
        ch->text = full;
        ch->len = full_len - skip;
        if (ch->emitted > ch->len) ch->emitted = ch->len;
    }
    int stopped = 0;
    size_t stop_at = 0, upto = release_point(j, ch, &stopped, &stop_at);
    size_t from = ch->emitted;
    ch->emitted = upto;
    if (stopped) ch->stopped = 1;
    if (j->stream && j->structured) {
        cs_parsed p;
        if (cs_output_parse(j->fmt, j->thinking, j->parse_tools, j->tool_names, j->n_tool_names, ch->text, upto, 0,
                            &p) == 0) {
            pthread_mutex_lock(&j->mu);
            stream_split(j, c, &p);
            if (lp) sse(j, chunk(j, c, "", 0, lp, NULL, NULL, 0));
            pthread_cond_broadcast(&j->cv);
            pthread_mutex_unlock(&j->mu);
            lp = NULL;
        }
        json_decref(lp);
    } else if (j->stream && (upto > from || lp)) {
        pthread_mutex_lock(&j->mu);
        sse(j, chunk(j, c, ch->text + from, upto - from, lp, NULL, NULL, 0));
        pthread_cond_broadcast(&j->cv);
        pthread_mutex_unlock(&j->mu);
    } else {
        json_decref(lp);
    }
    return stopped;
}

static void cb_finish(cs_request *r, int c, cs_finish why) {
    cs_job *j = (cs_job *)r;
    job_choice *ch = &j->ch[c];
    ch->why = why;
    j->n_finished++;
    if (why != CS_FINISH_STOP && why != CS_FINISH_LENGTH) return;
    size_t from = ch->emitted;
    if (!ch->stopped) ch->emitted = ch->len; /* the end: everything held back goes out */
    if (j->structured) finish_split(j, c);
    if (j->stream && j->structured) {
        int last = j->n_finished == r->n;
        const char *fin = finish_name(why);
        pthread_mutex_lock(&j->mu);
        if (ch->have_parsed) {
            stream_split(j, c, &ch->parsed);
            for (int k = 0; k < ch->parsed.n_calls; k++) {
                /* as OpenAI streams a call: id, type and name first, then the arguments in pieces */
                json_t *d = json_pack("{s:[{s:i, s:s, s:s, s:{s:s, s:s}}]}", "tool_calls", "index", k, "id",
                                      ch->call_ids[k], "type", "function", "function", "name",
                                      ch->parsed.calls[k].name, "arguments", "");
                sse(j, chunk_delta(j, c, d, NULL, NULL));
                const char *a = ch->parsed.calls[k].arguments;
                size_t n = strlen(a), at = 0;
                while (at < n) {
                    size_t step = n - at < 16 ? n - at : 16;
                    while (at + step < n && ((unsigned char)a[at + step] & 0xC0) == 0x80) step++;
                    d = json_pack("{s:[{s:i, s:{s:s%}}]}", "tool_calls", "index", k, "function", "arguments", a + at,
                                  step);
                    sse(j, chunk_delta(j, c, d, NULL, NULL));
                    at += step;
                }
            }
            if (ch->parsed.n_calls && why == CS_FINISH_STOP) fin = "tool_calls";
        }
        sse(j, chunk_delta(j, c, json_object(), fin, last && !j->stream_part ? usage_json(j) : NULL));
        pthread_cond_broadcast(&j->cv);
        pthread_mutex_unlock(&j->mu);
    } else if (j->stream) {
        int last = j->n_finished == r->n;
        pthread_mutex_lock(&j->mu);
        sse(j, chunk(j, c, ch->text ? ch->text + from : "", ch->emitted - from, NULL, finish_name(why),
                     last && !j->stream_part ? usage_json(j) : NULL, 0));
        pthread_cond_broadcast(&j->cv);
        pthread_mutex_unlock(&j->mu);
    }
}

static void cb_done(cs_request *r, const char *error) {
    cs_job *j = (cs_job *)r;
    pthread_mutex_lock(&j->mu);
    j->done = 1;
    if (!error && atomic_load(&r->cancel) && atomic_load(&j->srv->state) == CS_STATE_STOPPING) {
        error = "the server is shutting down; the request was cancelled";
        j->shutdown = 1;
    }
    if (error && !j->error) j->error = strdup(error);
    if (j->stream) {
        if (error) {
            cs_api_error e;
            cs_api_set_error(&e, j->shutdown ? 503 : 500, "server_error", NULL,
                             j->shutdown ? "server_shutting_down" : NULL, "%s", error);
            size_t n;
            char *s = cs_api_error_json(&e, &n);
            if (s) {
                sse_raw(j, "data: ");
                sse_raw(j, s);
                sse_raw(j, "\n\n");
                free(s);
            }
        }
        if (!j->stream_part) sse_raw(j, "data: [DONE]\n\n");
    }
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    cs_job_unref(j);
}

static const cs_request_callbacks CALLBACKS = {cb_token, cb_finish, cb_done};

/* ---- parsing ------------------------------------------------------------------------- */

/* An optional field: NULL when absent or null. */
static json_t *field(json_t *root, const char *name) {
    json_t *v = json_object_get(root, name);
    return v && !json_is_null(v) ? v : NULL;
}

static int get_int(json_t *root, const char *name, int64_t lo, int64_t hi, int64_t *out, cs_api_error *err) {
    json_t *v = field(root, name);
    if (!v) return 0;
    if (!json_is_integer(v)) {
        BAD(name, "'%s' must be an integer between %" PRId64 " and %" PRId64, name, lo, hi);
        return -1;
    }
    json_int_t x = json_integer_value(v);
    if (x < lo || x > hi) {
        BAD(name, "'%s' must be between %" PRId64 " and %" PRId64 ", got %" JSON_INTEGER_FORMAT, name, lo, hi, x);
        return -1;
    }
    *out = x;
    return 1;
}

static int get_num(json_t *root, const char *name, double lo, double hi, int lo_open, double *out,
                   cs_api_error *err) {
    json_t *v = field(root, name);
    if (!v) return 0;
    if (!json_is_number(v)) {
        BAD(name, "'%s' must be a number", name);
        return -1;
    }
    double x = json_number_value(v);
    if (!isfinite(x) || x > hi || x < lo || (lo_open && x == lo)) {
        BAD(name, "'%s' must be in %s%g, %g], got %g", name, lo_open ? "(" : "[", lo, hi, x);
        return -1;
    }
    *out = x;
    return 1;
}

static int get_bool(json_t *root, const char *name, int *out, cs_api_error *err) {
    json_t *v = field(root, name);
    if (!v) return 0;
    if (!json_is_boolean(v)) {
        BAD(name, "'%s' must be true or false", name);
        return -1;
    }
    *out = json_is_true(v);
    return 1;
}

static int add_stop(cs_job *j, const char *s, size_t n, cs_api_error *err) {
    if (n == 0) {
        BAD("stop", "a stop string must not be empty");
        return -1;
    }
    if (n > CS_MAX_STOP_LEN) {
        BAD("stop", "a stop string may have at most %d bytes", CS_MAX_STOP_LEN);
        return -1;
    }
    for (int i = 0; i < j->n_stops; i++)
        if (j->stop_len[i] == n && !memcmp(j->stops[i], s, n)) return 0;
    if (j->n_stops >= CS_MAX_STOPS) {
        BAD("stop", "at most %d stop strings", CS_MAX_STOPS);
        return -1;
    }
    char *c = malloc(n + 1);
    if (!c) {
        BAD("stop", "out of memory");
        return -1;
    }
    memcpy(c, s, n);
    c[n] = '\0';
    j->stops[j->n_stops] = c;
    j->stop_len[j->n_stops++] = n;
    return 0;
}

/* A function name as OpenAI allows it: a-z, A-Z, 0-9, _ and -, at most 64. */
static int good_name(const char *s) {
    size_t n = strlen(s);
    if (n == 0 || n > 64) return 0;
    for (size_t k = 0; k < n; k++)
        if (!((s[k] >= 'a' && s[k] <= 'z') || (s[k] >= 'A' && s[k] <= 'Z') || (s[k] >= '0' && s[k] <= '9') ||
              s[k] == '_' || s[k] == '-'))
            return 0;
    return 1;
}

/* tools, tool_choice, parallel_tool_calls and chat_template_kwargs of a chat request. */
static int parse_tools(cs_job *j, json_t *root, cs_chat_opts *opts, cs_api_error *err) {
    cs_server *srv = j->srv;
    json_t *tools = field(root, "tools");
    int choice = TC_AUTO;
    const char *named = NULL;
    opts->enable_thinking = -1;
    j->parallel = 1;
    if (get_bool(root, "parallel_tool_calls", &j->parallel, err) < 0) return -1;
    if (tools) {
        if (!json_is_array(tools)) {
            BAD("tools", "'tools' must be an array of {\"type\": \"function\", \"function\": {\"name\", "
                "\"description\", \"parameters\"}} objects");
            return -1;
        }
        j->tool_names = calloc(json_array_size(tools) + 1, sizeof *j->tool_names);
        if (!j->tool_names) {
            BAD("tools", "out of memory");
            return -1;
        }
        for (size_t k = 0; k < json_array_size(tools); k++) {
            json_t *t = json_array_get(tools, k);
            json_t *type = json_is_object(t) ? json_object_get(t, "type") : NULL;
            json_t *fn = json_is_object(t) ? json_object_get(t, "function") : NULL;
            json_t *nm = json_is_object(fn) ? json_object_get(fn, "name") : NULL;
            json_t *desc = json_is_object(fn) ? json_object_get(fn, "description") : NULL;
            json_t *params = json_is_object(fn) ? json_object_get(fn, "parameters") : NULL;
            if (!json_is_string(type) || strcmp(json_string_value(type), "function")) {
                BAD("tools", "tools[%zu].type must be \"function\"", k);
                return -1;
            }
            if (!json_is_string(nm) || !good_name(json_string_value(nm))) {
                BAD("tools", "tools[%zu].function.name must be a string of 1 to 64 characters a-z, A-Z, 0-9, _ "
                    "and -", k);
                return -1;
            }
            if (desc && !json_is_string(desc) && !json_is_null(desc)) {
                BAD("tools", "tools[%zu].function.description must be a string", k);
                return -1;
            }
            if (params && !json_is_object(params)) {
                BAD("tools", "tools[%zu].function.parameters must be a JSON schema object", k);
                return -1;
            }
            for (int q = 0; q < j->n_tool_names; q++)
                if (!strcmp(j->tool_names[q], json_string_value(nm))) {
                    BAD("tools", "tools[%zu]: the function name \"%s\" is given twice", k, json_string_value(nm));
                    return -1;
                }
            j->tool_names[j->n_tool_names++] = json_string_value(nm);
        }
        j->tools = json_incref(tools);
    }
    json_t *tc = field(root, "tool_choice");
    if (tc) {
        if (json_is_string(tc)) {
            const char *v = json_string_value(tc);
            if (!strcmp(v, "auto")) choice = TC_AUTO;
            else if (!strcmp(v, "none")) choice = TC_NONE;
            else if (!strcmp(v, "required")) choice = TC_REQUIRED;
            else {
                BAD("tool_choice", "'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": "
                    "\"function\", \"function\": {\"name\": ...}}, not \"%.64s\"", v);
                return -1;
            }
        } else {
            json_t *fn = json_is_object(tc) ? json_object_get(tc, "function") : NULL;
            json_t *nm = json_is_object(fn) ? json_object_get(fn, "name") : NULL;
            json_t *type = json_is_object(tc) ? json_object_get(tc, "type") : NULL;
            if (!json_is_string(nm) || !json_is_string(type) || strcmp(json_string_value(type), "function")) {
                BAD("tool_choice", "'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": "
                    "\"function\", \"function\": {\"name\": ...}}");
                return -1;
            }
            named = json_string_value(nm);
            int found = 0;
            for (int q = 0; q < j->n_tool_names; q++) found |= !strcmp(j->tool_names[q], named);
            if (!found) {
                BAD("tool_choice", "tool_choice names the function \"%.64s\", which is not in 'tools'", named);
                return -1;
            }
            choice = TC_NAMED;
        }
        if ((choice == TC_REQUIRED || choice == TC_NAMED) && j->n_tool_names == 0) {
            BAD("tool_choice", "tool_choice \"required\" needs 'tools'");
            return -1;
        }
    }
    json_t *kw = field(root, "chat_template_kwargs");
    if (kw) {
        if (!json_is_object(kw)) {
            BAD("chat_template_kwargs", "'chat_template_kwargs' must be an object");
            return -1;
        }
        const char *names[] = {"enable_thinking", "thinking"};
        for (int q = 0; q < 2; q++) {
            json_t *v = json_object_get(kw, names[q]);
            if (!v || json_is_null(v)) continue;
            if (!json_is_boolean(v)) {
                BAD("chat_template_kwargs", "chat_template_kwargs.%s must be true or false", names[q]);
                return -1;
            }
            opts->enable_thinking = json_is_true(v);
        }
    }
    json_t *effort = field(root, "reasoning_effort");
    if (effort) {
        const char *v = json_is_string(effort) ? json_string_value(effort) : "";
        if (strcmp(v, "low") && strcmp(v, "medium") && strcmp(v, "high") && strcmp(v, "minimal")) {
            BAD("reasoning_effort", "'reasoning_effort' must be \"minimal\", \"low\", \"medium\" or \"high\"");
            return -1;
        }
        opts->reasoning_effort = v;
    }
    j->fmt = cs_chat_template_format(srv->chat_template);
    opts->tools = j->tools;
    if (j->n_tool_names && j->fmt && j->fmt->tools == CS_TOOLS_NONE) {
        BAD("tools", "the model's chat template (%s) takes no tools in colibri_server; send the request without "
            "'tools'", j->fmt->name);
        return -1;
    }
    if (j->fmt && (choice == TC_REQUIRED || choice == TC_NAMED)) { /* no format: the template is refused */
        char *pre = NULL, *suf = NULL, *sch = NULL, msg[256], cid[40];
        make_call_id(j, cid, sizeof cid); /* where the syntax writes an id outside the JSON, the prefix writes this */
        if (j->fmt->tools == CS_TOOLS_KIMI) { /* Kimi's ids number the calls: of this message, or of the conversation */
            size_t calls = 0;
            json_t *msgs = field(root, "messages");
            for (size_t i = 0; j->fmt->calls_numbered && i < json_array_size(msgs); i++) {
                json_t *tc = json_object_get(json_array_get(msgs, i), "tool_calls");
                calls += json_is_array(tc) ? json_array_size(tc) : 0;
            }
            snprintf(cid, sizeof cid, "%zu", calls);
        }
        if (cs_tool_call_constraint(j->fmt, j->tools, named, cid, &pre, &suf, &sch, msg, sizeof msg) != 0) {
            BAD("tool_choice", "%s", msg);
            return -1;
        }
        /* the output is constrained to be one call of the given functions: the family's text
         * before the call, the call object (or its arguments) by its JSON schema, the text after */
        json_t *rf = field(root, "response_format");
        json_t *rft = json_is_object(rf) ? json_object_get(rf, "type") : NULL;
        if (rf && !(json_is_string(rft) && !strcmp(json_string_value(rft), "text"))) {
            free(pre);
            free(suf);
            free(sch);
            BAD("tool_choice", "a required tool call and 'response_format' cannot be combined");
            return -1;
        }
        char gmsg[512] = "";
        pthread_mutex_lock(&srv->tok_mu);
        colibri_status gst = colibri_grammar_compile(srv->tok, sch, pre, suf, &j->grammar, gmsg, sizeof gmsg);
        pthread_mutex_unlock(&srv->tok_mu);
        free(pre);
        free(suf);
        free(sch);
        if (gst != COLIBRI_OK) {
            BAD("tools", "the parameters of the function to call cannot be used as a JSON schema: %s", gmsg);
            return -1;
        }
        j->use_sampler = 1;
        j->forced_call = 1;
    }
    j->parse_tools = choice != TC_NONE && j->n_tool_names > 0 && j->fmt && j->fmt->tools != CS_TOOLS_NONE;
    /* a forced call starts at once: no reasoning block is written before it */
    j->thinking = j->fmt && j->fmt->starts_thinking && (opts->enable_thinking == 1 || j->fmt->starts_thinking == 2) &&
                  !j->forced_call;
    j->structured = j->fmt && (j->parse_tools || j->fmt->think_open);
    return 0;
}

/* The sampling controls beyond temperature / top_p / top_k (OpenAI's and llama-server's
 * names), checked with OpenAI-style 400s; j->use_sampler says whether any is in effect. */
static int parse_sampling(cs_job *j, json_t *root, cs_api_error *err) {
    cs_server *srv = j->srv;
    double pp = 0, fp = 0, rp = 1, mp = 0;
    int64_t last_n = 0, best_of = 0, n = 1;
    int k = 0;
    if ((k = get_num(root, "presence_penalty", -2, 2, 0, &pp, err)) < 0) return -1;
    j->use_sampler |= k && pp != 0;
    if ((k = get_num(root, "frequency_penalty", -2, 2, 0, &fp, err)) < 0) return -1;
    j->use_sampler |= k && fp != 0;
    if (field(root, "repetition_penalty") && field(root, "repeat_penalty")) {
        BAD("repetition_penalty", "give 'repetition_penalty' or its llama-server name 'repeat_penalty', not both");
        return -1;
    }
    const char *rname = field(root, "repeat_penalty") ? "repeat_penalty" : "repetition_penalty";
    if ((k = get_num(root, rname, 0, 100, 1, &rp, err)) < 0) return -1;
    j->use_sampler |= k && rp != 1;
    if (get_int(root, "repeat_last_n", 0, INT32_MAX, &last_n, err) < 0) return -1;
    if ((k = get_num(root, "min_p", 0, 1, 0, &mp, err)) < 0) return -1;
    j->use_sampler |= k && mp != 0;
    if (get_int(root, "n", 1, CS_MAX_CHOICES, &n, err) < 0) return -1;
    if (get_int(root, "best_of", 1, INT32_MAX, &best_of, err) < 0) return -1;
    if (best_of > 1 && best_of != n) {
        BAD("best_of", "'best_of' %" PRId64 " is not supported: this server does not rank completions; give 'n' "
            "(best_of equal to n, or 1, is accepted)", best_of);
        return -1;
    }
    colibri_sampling_params_init(&j->sp);
    j->sp.presence_penalty = (float)pp;
    j->sp.frequency_penalty = (float)fp;
    j->sp.repetition_penalty = (float)rp;
    j->sp.repetition_last_n = (int32_t)last_n;
    j->sp.min_p = (float)mp;
    json_t *lb = field(root, "logit_bias");
    if (lb) {
        if (!json_is_object(lb)) {
            BAD("logit_bias", "'logit_bias' must be an object of token ids (strings) to biases in [-100, 100]");
            return -1;
        }
        size_t cnt = json_object_size(lb);
        if (cnt > 1024) {
            BAD("logit_bias", "'logit_bias' may have at most 1024 entries");
            return -1;
        }
        j->bias_ids = malloc((cnt ? cnt : 1) * sizeof *j->bias_ids);
        j->bias_vals = malloc((cnt ? cnt : 1) * sizeof *j->bias_vals);
        if (!j->bias_ids || !j->bias_vals) {
            BAD("logit_bias", "out of memory");
            return -1;
        }
        const char *key;
        json_t *v;
        json_object_foreach(lb, key, v) {
            char *end;
            errno = 0;
            long id = strtol(key, &end, 10);
            if (!*key || *end || errno || id < 0 || id >= srv->vocab) {
                BAD("logit_bias", "logit_bias key '%.40s' is not a token id in 0..%" PRId64, key, srv->vocab - 1);
                return -1;
            }
            double b = json_is_number(v) ? json_number_value(v) : NAN;
            if (!(b >= -100 && b <= 100)) {
                BAD("logit_bias", "the bias of token %ld must be a number in [-100, 100]", id);
                return -1;
            }
            j->bias_ids[j->n_bias] = (int32_t)id;
            j->bias_vals[j->n_bias++] = (float)b;
        }
        j->use_sampler |= j->n_bias > 0;
    }
    json_t *sti = field(root, "stop_token_ids");
    if (sti && !json_is_array(sti)) {
        BAD("stop_token_ids", "'stop_token_ids' must be an array of token ids");
        return -1;
    }
    for (size_t i = 0; sti && i < json_array_size(sti); i++) {
        json_t *v = json_array_get(sti, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= srv->vocab) {
            BAD("stop_token_ids", "stop_token_ids[%zu] is not a token id in 0..%" PRId64, i, srv->vocab - 1);
            return -1;
        }
        if (j->n_stop_ids >= CS_MAX_STOP_IDS) {
            BAD("stop_token_ids", "at most %d stop token ids", CS_MAX_STOP_IDS);
            return -1;
        }
        j->stop_ids[j->n_stop_ids++] = (int32_t)json_integer_value(v);
    }
    j->use_sampler |= j->n_stop_ids > 0;
    return 0;
}

/* response_format: text (nothing), json_object (any object) or json_schema; compiles the
 * grammar for the model's tokenizer. */
static int parse_response_format(cs_job *j, json_t *root, cs_api_error *err) {
    json_t *rf = field(root, "response_format");
    if (!rf || j->forced_call) return 0; /* a forced tool call has its own grammar (parse_tools) */
    json_t *ty = json_is_object(rf) ? json_object_get(rf, "type") : NULL;
    if (!ty || !json_is_string(ty)) {
        BAD("response_format", "'response_format' must be an object with a 'type': text, json_object or json_schema");
        return -1;
    }
    const char *t = json_string_value(ty);
    if (!strcmp(t, "text")) return 0;
    char *schema = NULL;
    if (!strcmp(t, "json_schema")) {
        json_t *js = json_object_get(rf, "json_schema");
        json_t *sc = json_is_object(js) ? json_object_get(js, "schema") : NULL;
        if (!js || !json_is_object(js)) {
            BAD("response_format", "response_format of type json_schema needs a 'json_schema' object");
            return -1;
        }
        json_t *st = json_object_get(js, "strict");
        if (st && !json_is_boolean(st) && !json_is_null(st)) {
            BAD("response_format", "json_schema.strict must be true or false");
            return -1;
        }
        if (sc && !json_is_object(sc) && !json_is_boolean(sc)) {
            BAD("response_format", "json_schema.schema must be a JSON schema object");
            return -1;
        }
        /* no schema: any JSON object */
        if (sc && !(schema = json_dumps(sc, JSON_COMPACT | JSON_ENCODE_ANY))) {
            BAD("response_format", "out of memory");
            return -1;
        }
    } else if (strcmp(t, "json_object") != 0) {
        BAD("response_format", "response_format type '%.40s' is not supported (text, json_object, json_schema)", t);
        return -1;
    }
    char msg[512] = "";
    pthread_mutex_lock(&j->srv->tok_mu);
    colibri_status st = colibri_grammar_compile(j->srv->tok, schema, NULL, NULL, &j->grammar, msg, sizeof msg);
    pthread_mutex_unlock(&j->srv->tok_mu);
    free(schema);
    if (st != COLIBRI_OK) {
        BAD("response_format", "the JSON schema cannot be used: %s", msg);
        return -1;
    }
    j->use_sampler = 1;
    return 0;
}

/* One sampler per choice, with the request's settings (after the prompt is known). */
static int make_samplers(cs_job *j, cs_api_error *err) {
    cs_server *srv = j->srv;
    for (int c = 0; c < j->req.n; c++) {
        char msg[512] = "";
        colibri_sampler *s = NULL;
        colibri_status st = colibri_sampler_create((int32_t)srv->vocab, srv->eos_id, &j->sp, &s, msg, sizeof msg);
        if (st == COLIBRI_OK && j->n_bias) st = colibri_sampler_set_logit_bias(s, j->bias_ids, j->bias_vals, j->n_bias);
        if (st == COLIBRI_OK && srv->n_end_ids) st = colibri_sampler_set_end_ids(s, srv->end_ids, srv->n_end_ids);
        if (st == COLIBRI_OK && j->n_stop_ids) st = colibri_sampler_set_stop_ids(s, j->stop_ids, j->n_stop_ids);
        if (st == COLIBRI_OK && j->grammar) st = colibri_sampler_set_grammar(s, j->grammar);
        if (st == COLIBRI_OK) st = colibri_sampler_add_prompt(s, j->prompt, j->n_prompt);
        if (st != COLIBRI_OK) {
            BAD(NULL, "sampling settings: %s", s ? colibri_sampler_last_error(s) : msg);
            colibri_sampler_free(s);
            return -1;
        }
        j->samplers[c] = s;
        j->req.sampler[c] = s;
    }
    return 0;
}

static uint64_t random_seed(cs_server *srv) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t x = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^ (atomic_fetch_add(&srv->next_id, 1) << 17);
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* The prompt of /v1/completions: a string, an array of token ids, or an array of one of
 * them. */
static int parse_prompt(cs_job *j, json_t *p, cs_api_error *err) {
    cs_server *srv = j->srv;
    if (json_is_array(p) && json_array_size(p) == 1 &&
        (json_is_string(json_array_get(p, 0)) || json_is_array(json_array_get(p, 0))))
        p = json_array_get(p, 0);
    if (json_is_string(p)) {
        const char *s = json_string_value(p);
        size_t n = json_string_length(p);
        char msg[512];
        pthread_mutex_lock(&srv->tok_mu);
        int rc = tokenize(srv->tok, s, n, 1, &j->prompt, &j->n_prompt, msg, sizeof msg);
        pthread_mutex_unlock(&srv->tok_mu);
        if (rc) {
            BAD("prompt", "%s", msg);
            return -1;
        }
        if (j->echo) {
            j->echo_text = malloc(n + 1);
            if (j->echo_text) memcpy(j->echo_text, s, n + 1);
            j->echo_len = j->echo_text ? n : 0;
        }
        return 0;
    }
    if (!json_is_array(p)) {
        BAD("prompt", "'prompt' must be a string or an array of token ids");
        return -1;
    }
    size_t n = json_array_size(p);
    if (n == 0) {
        BAD("prompt", "'prompt' is an empty array: give text or at least one token id");
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(p, i);
        if (json_is_string(v) || json_is_array(v)) {
            BAD("prompt", "'prompt' mixes token ids with strings or arrays: give one array of token ids, or a list "
                "whose elements are all strings or arrays of token ids");
            return -1;
        }
        if (!json_is_integer(v)) {
            BAD("prompt", "'prompt' must be a string or an array of integer token ids (element %zu is not)", i);
            return -1;
        }
        json_int_t x = json_integer_value(v);
        if (x < 0 || x >= srv->vocab) {
            BAD("prompt", "token id %" JSON_INTEGER_FORMAT " at prompt position %zu is out of range: this model's "
                "vocabulary has ids 0 to %" PRId64, x, i, srv->vocab - 1);
            return -1;
        }
    }
    j->prompt = malloc(n * sizeof *j->prompt);
    if (!j->prompt) {
        BAD("prompt", "out of memory");
        return -1;
    }
    for (size_t i = 0; i < n; i++) j->prompt[i] = (int32_t)json_integer_value(json_array_get(p, i));
    j->n_prompt = (int64_t)n;
    if (j->echo) {
        pthread_mutex_lock(&srv->tok_mu);
        j->echo_text = detok(srv->tok, j->prompt, j->n_prompt, &j->echo_len);
        pthread_mutex_unlock(&srv->tok_mu);
        if (!j->echo_text) j->echo_len = 0;
    }
    return 0;
}

/* The messages of /v1/chat/completions, rendered with the model's chat template. */
/* messages[i].tool_calls as the templates take them: checked, each function.arguments
 * string parsed into its JSON value (as vLLM hands them to the template). The message
 * object is replaced in `m` by a copy when it changes. */
static int parse_tool_calls(json_t *m, size_t i, cs_api_error *err) {
    json_t *o = json_array_get(m, i);
    json_t *tc = json_object_get(o, "tool_calls");
    if (!tc || json_is_null(tc)) return 0;
    if (!json_is_array(tc)) {
        BAD("messages", "messages[%zu].tool_calls must be an array", i);
        return -1;
    }
    json_t *copy = json_deep_copy(o);
    if (!copy) {
        BAD("messages", "out of memory");
        return -1;
    }
    tc = json_object_get(copy, "tool_calls");
    for (size_t k = 0; k < json_array_size(tc); k++) {
        json_t *c = json_array_get(tc, k);
        json_t *fn = json_is_object(c) ? json_object_get(c, "function") : NULL;
        json_t *nm = json_is_object(fn) ? json_object_get(fn, "name") : NULL;
        json_t *args = json_is_object(fn) ? json_object_get(fn, "arguments") : NULL;
        if (!json_is_string(nm)) {
            BAD("messages", "messages[%zu].tool_calls[%zu] must be {\"id\", \"type\": \"function\", \"function\": "
                "{\"name\", \"arguments\"}}", i, k);
            json_decref(copy);
            return -1;
        }
        if (json_is_string(args)) {
            json_error_t je;
            json_t *v = json_loadb(json_string_value(args), json_string_length(args), JSON_DECODE_ANY, &je);
            if (!v) {
                BAD("messages", "messages[%zu].tool_calls[%zu].function.arguments is not valid JSON: %s", i, k, je.text);
                json_decref(copy);
                return -1;
            }
            json_object_set_new(fn, "arguments", v);
        }
    }
    json_array_set_new(m, i, copy);
    return 0;
}

static int parse_messages(cs_job *j, json_t *m, const cs_chat_opts *opts, cs_api_error *err) {
    cs_server *srv = j->srv;
    if (!json_is_array(m) || json_array_size(m) == 0) {
        BAD("messages", "'messages' must be a non-empty array of {\"role\", \"content\"} objects");
        return -1;
    }
    size_t n = json_array_size(m);
    cs_message *msgs = calloc(n, sizeof *msgs);
    char **owned = calloc(n, sizeof *owned);
    int rc = -1;
    if (!msgs || !owned) {
        BAD("messages", "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *o = json_array_get(m, i);
        json_t *role = json_is_object(o) ? json_object_get(o, "role") : NULL;
        json_t *content = json_is_object(o) ? json_object_get(o, "content") : NULL;
        if (!json_is_object(o) || !json_is_string(role)) {
            BAD("messages", "messages[%zu] must be an object with a string 'role'", i);
            goto out;
        }
        if (parse_tool_calls(m, i, err)) goto out;
        o = json_array_get(m, i);
        content = json_object_get(o, "content");
        role = json_object_get(o, "role");
        json_t *tcid = json_object_get(o, "tool_call_id");
        if (tcid && !json_is_string(tcid) && !json_is_null(tcid)) {
            BAD("messages", "messages[%zu].tool_call_id must be a string", i);
            goto out;
        }
        msgs[i].json = o;
        msgs[i].role = json_string_value(role);
        if (!content || json_is_null(content)) {
            msgs[i].content = "";
        } else if (json_is_string(content)) {
            if (memchr(json_string_value(content), 0, json_string_length(content))) {
                BAD("messages", "messages[%zu].content contains a NUL character", i);
                goto out;
            }
            msgs[i].content = json_string_value(content);
        } else if (json_is_array(content)) {
            /* content parts: only {"type": "text", "text": ...}, joined */
            size_t total = 0;
            for (size_t k = 0; k < json_array_size(content); k++) {
                json_t *part = json_array_get(content, k);
                json_t *type = json_is_object(part) ? json_object_get(part, "type") : NULL;
                json_t *text = json_is_object(part) ? json_object_get(part, "text") : NULL;
                if (!json_is_string(type) || strcmp(json_string_value(type), "text") || !json_is_string(text)) {
                    BAD("messages", "messages[%zu].content[%zu]: only text parts ({\"type\": \"text\", \"text\": "
                        "...}) are supported", i, k);
                    goto out;
                }
                total += json_string_length(text);
            }
            owned[i] = malloc(total + 1);
            if (!owned[i]) {
                BAD("messages", "out of memory");
                goto out;
            }
            size_t at = 0;
            for (size_t k = 0; k < json_array_size(content); k++) {
                json_t *text = json_object_get(json_array_get(content, k), "text");
                memcpy(owned[i] + at, json_string_value(text), json_string_length(text));
                at += json_string_length(text);
            }
            owned[i][at] = '\0';
            if (strlen(owned[i]) != at) {
                BAD("messages", "messages[%zu].content contains a NUL character", i);
                goto out;
            }
            msgs[i].content = owned[i];
        } else {
            BAD("messages", "messages[%zu].content must be a string, an array of text parts or null", i);
            goto out;
        }
    }
    char msg[1024] = "";
    pthread_mutex_lock(&srv->tok_mu);
    int crc = cs_chat_tokenize_ex(srv->tok, srv->chat_template, msgs, n, opts, &j->prompt, &j->n_prompt, msg,
                                  sizeof msg);
    pthread_mutex_unlock(&srv->tok_mu);
    if (crc != 0) {
        BAD("messages", "%s", *msg ? msg : "the chat template could not be applied");
        goto out;
    }
    const char *const *stops = cs_chat_stop_strings(srv->chat_template);
    for (int i = 0; stops && stops[i]; i++)
        if (add_stop(j, stops[i], strlen(stops[i]), err)) goto out;
    rc = 0;
out:
    for (size_t i = 0; owned && i < n; i++) free(owned[i]);
    free(owned);
    free(msgs);
    return rc;
}

int cs_api_parse(cs_server *srv, cs_api_kind kind, const char *body, size_t len, cs_job **out, cs_api_error *err) {
    *out = NULL;
    size_t bad = 0;
    if (!cs_utf8_valid(body, len, &bad)) {
        BAD(NULL, "the request body is not valid UTF-8 (the first bad byte is at offset %zu)", bad);
        return -1;
    }
    json_error_t je;
    json_t *root = json_loadb(body, len, 0, &je);
    if (!root) {
        BAD(NULL, "the request body is not valid JSON: %s (line %d, column %d)", je.text, je.line, je.column);
        return -1;
    }
    cs_job *j = NULL;
    if (!json_is_object(root)) {
        BAD(NULL, "the request body must be a JSON object");
        goto fail;
    }
    json_t *model = field(root, "model");
    if (model && !json_is_string(model)) {
        BAD("model", "'model' must be a string");
        goto fail;
    }
    if (model && strcmp(json_string_value(model), srv->model_id)) {
        cs_api_set_error(err, 404, "invalid_request_error", "model", "model_not_found",
                         "The model '%.200s' does not exist: this server serves '%s' (GET /v1/models)",
                         json_string_value(model), srv->model_id);
        goto fail;
    }
    j = calloc(1, sizeof *j);
    if (!j) {
        cs_api_set_error(err, 500, "server_error", NULL, NULL, "out of memory");
        goto fail;
    }
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    j->refs = 1;
    j->fd = -1;
    j->srv = srv;
    j->kind = kind;
    j->logprobs = -1;
    j->created = (int64_t)time(NULL);
    snprintf(j->id, sizeof j->id, "%s-%016" PRIx64 "%08" PRIx64, kind == CS_API_CHAT ? "chatcmpl" : "cmpl",
             random_seed(srv), (uint64_t)atomic_fetch_add(&srv->next_id, 1));

    int64_t max_tokens = -1, n = 1, top_k = 0, seed = 0, lp = -1;
    double temperature = 1.0, top_p = 1.0;
    int have_seed = 0, b = 0;
    if (get_int(root, "max_tokens", 1, srv->ctx_len, &max_tokens, err) < 0) goto fail;
    if (kind == CS_API_CHAT && get_int(root, "max_completion_tokens", 1, srv->ctx_len, &max_tokens, err) < 0)
        goto fail;
    if (get_num(root, "temperature", 0, 100, 0, &temperature, err) < 0) goto fail;
    if (get_num(root, "top_p", 0, 1, 1, &top_p, err) < 0) goto fail;
    if (get_int(root, "top_k", -1, INT32_MAX, &top_k, err) < 0) goto fail;
    if ((have_seed = get_int(root, "seed", INT64_MIN, INT64_MAX, &seed, err)) < 0) goto fail;
    int64_t max_n = srv->max_seqs < CS_MAX_CHOICES ? srv->max_seqs : CS_MAX_CHOICES;
    if (get_int(root, "n", 1, max_n, &n, err) < 0) goto fail;
    if ((b = get_bool(root, "stream", &j->stream, err)) < 0) goto fail;
    if (get_bool(root, "ignore_eos", &j->req.ignore_eos, err) < 0) goto fail;
    int cache_prompt = 1; /* llama-server's flag: false computes the whole prompt */
    if (get_bool(root, "cache_prompt", &cache_prompt, err) < 0) goto fail;
    j->req.no_prefix_cache = !cache_prompt;
    json_t *so = field(root, "stream_options");
    if (so && !json_is_object(so)) {
        BAD("stream_options", "'stream_options' must be an object");
        goto fail;
    }
    if (kind == CS_API_COMPLETIONS) {
        if (get_bool(root, "echo", &j->echo, err) < 0) goto fail;
        json_t *l = field(root, "logprobs");
        if (l && json_is_false(l)) l = NULL;
        if (l && get_int(root, "logprobs", 0, CS_MAX_TOP_LOGPROBS, &lp, err) < 0) goto fail;
    } else {
        int want = 0;
        int64_t top = -1;
        if (get_bool(root, "logprobs", &want, err) < 0) goto fail;
        if (get_int(root, "top_logprobs", 0, CS_MAX_TOP_LOGPROBS, &top, err) < 0) goto fail;
        if (top >= 0 && !want) {
            BAD("top_logprobs", "'top_logprobs' needs 'logprobs': true");
            goto fail;
        }
        if (want) lp = top >= 0 ? top : 0;
    }
    j->logprobs = (int)lp;
    if (parse_sampling(j, root, err)) goto fail;
    json_t *stop = field(root, "stop");
    if (stop) {
        if (json_is_string(stop)) {
            if (add_stop(j, json_string_value(stop), json_string_length(stop), err)) goto fail;
        } else if (json_is_array(stop)) {
            for (size_t i = 0; i < json_array_size(stop); i++) {
                json_t *s = json_array_get(stop, i);
                if (json_is_integer(s)) { /* a stop token id */
                    if (json_integer_value(s) < 0 || json_integer_value(s) >= srv->vocab) {
                        BAD("stop", "stop[%zu] is not a token id in 0..%" PRId64, i, srv->vocab - 1);
                        goto fail;
                    }
                    if (j->n_stop_ids >= CS_MAX_STOP_IDS) {
                        BAD("stop", "at most %d stop token ids", CS_MAX_STOP_IDS);
                        goto fail;
                    }
                    j->stop_ids[j->n_stop_ids++] = (int32_t)json_integer_value(s);
                    j->use_sampler = 1;
                    continue;
                }
                if (!json_is_string(s)) {
                    BAD("stop", "'stop' must be a string or an array of strings and token ids");
                    goto fail;
                }
                if (add_stop(j, json_string_value(s), json_string_length(s), err)) goto fail;
            }
        } else {
            BAD("stop", "'stop' must be a string or an array of strings");
            goto fail;
        }
    }
    if (kind == CS_API_COMPLETIONS) {
        json_t *p = json_object_get(root, "prompt");
        if (!p || json_is_null(p)) {
            BAD("prompt", "'prompt' is required");
            goto fail;
        }
        if (parse_prompt(j, p, err)) goto fail;
    } else {
        json_t *m = json_object_get(root, "messages");
        if (!m) {
            BAD("messages", "'messages' is required");
            goto fail;
        }
        cs_chat_opts opts = {0};
        if (parse_tools(j, root, &opts, err)) goto fail;
        if (parse_messages(j, m, &opts, err)) goto fail;
    }
    if (j->n_prompt < 1) {
        BAD(kind == CS_API_CHAT ? "messages" : "prompt", "the prompt has no tokens");
        goto fail;
    }
    if (j->n_prompt >= srv->ctx_len) {
        cs_api_set_error(err, 400, "invalid_request_error", kind == CS_API_CHAT ? "messages" : "prompt",
                         "context_length_exceeded",
                         "the prompt has %" PRId64 " tokens, but this server's context is %" PRId64
                         " tokens (prompt and completion together), so a prompt may have at most %" PRId64
                         " tokens; nothing is truncated",
                         j->n_prompt, srv->ctx_len, srv->ctx_len - 1);
        goto fail;
    }
    int64_t room = srv->ctx_len - j->n_prompt;
    if (max_tokens < 0) {
        max_tokens = kind == CS_API_CHAT ? room : srv->default_completion_tokens;
        if (max_tokens > room) max_tokens = room;
    }
    j->n_prefix = j->n_prompt < PREFIX_TOKENS ? j->n_prompt : PREFIX_TOKENS;
    {
        pthread_mutex_lock(&srv->tok_mu);
        size_t plen = 0;
        if (j->structured) find_marks(j);
        char *pt = detok_job(j, j->prompt + j->n_prompt - j->n_prefix, j->n_prefix, &plen);
        pthread_mutex_unlock(&srv->tok_mu);
        j->prefix_len = pt ? plen - fffd_tail(pt, plen) : 0;
        free(pt);
    }
    j->req.prompt = j->prompt;
    j->req.n_prompt = j->n_prompt;
    j->req.n = (int32_t)n;
    j->req.max_tokens = max_tokens;
    j->req.temperature = (float)temperature;
    j->req.top_p = (float)top_p;
    j->req.top_k = top_k < 0 ? 0 : (int32_t)top_k;
    j->req.seed = have_seed ? (uint64_t)seed : random_seed(srv);
    if (parse_response_format(j, root, err)) goto fail;
    if (j->use_sampler) {
        j->sp.temperature = (float)temperature;
        j->sp.top_k = j->req.top_k;
        j->sp.top_p = (float)top_p;
        j->sp.ignore_eos = j->req.ignore_eos;
        if (make_samplers(j, err)) goto fail;
    }
    j->req.cb = &CALLBACKS;
    j->req.user = j;
    char msg[512];
    if (cs_sched_check(srv->sched, &j->req, msg, sizeof msg) != CS_OK) {
        BAD(NULL, "%s", msg);
        goto fail;
    }
    (void)b;
    json_decref(root);
    *out = j;
    return 0;
fail:
    json_decref(root);
    if (j) job_free(j);
    return -1;
}

int cs_api_submit(cs_job *j, cs_api_error *err) {
    pthread_mutex_lock(&j->mu);
    j->refs++;
    if (j->stream) {
        for (int c = 0; c < j->req.n; c++) {
            if (j->kind == CS_API_CHAT) sse(j, chunk(j, c, "", 0, NULL, NULL, NULL, 1));
            else if (j->echo && j->echo_len) sse(j, chunk(j, c, j->echo_text, j->echo_len, NULL, NULL, NULL, 0));
        }
    }
    pthread_mutex_unlock(&j->mu);
    int rc = cs_sched_submit(j->srv->sched, &j->req);
    if (rc == CS_OK) return 0;
    pthread_mutex_lock(&j->mu);
    j->refs--;
    pthread_mutex_unlock(&j->mu);
    if (rc == CS_E_QUEUE_FULL)
        cs_api_set_error(err, 429, "rate_limit_exceeded", NULL, "queue_full",
                         "the server is busy: its queue of waiting requests is full (--max_queue); retry later");
    else if (rc == CS_E_STOPPED)
        cs_api_set_error(err, 503, "server_error", NULL, "server_shutting_down",
                         "the server is shutting down and admits no new requests; retry on another replica");
    else
        cs_api_set_error(err, 400, "invalid_request_error", NULL, NULL, "the request cannot run on this server");
    return -1;
}

void cs_job_wait(cs_job *j, int (*gone)(int fd)) {
    pthread_mutex_lock(&j->mu);
    int cancelled = 0;
    while (!j->done) {
        struct timespec ts = cs_deadline_ms(200);
        pthread_cond_timedwait(&j->cv, &j->mu, &ts);
        if (!j->done && !cancelled && gone && j->fd >= 0) {
            pthread_mutex_unlock(&j->mu);
            if (gone(j->fd)) {
                cs_job_cancel(j);
                cancelled = 1;
            }
            pthread_mutex_lock(&j->mu);
        }
    }
    pthread_mutex_unlock(&j->mu);
}

long cs_job_read_stream(cs_job *j, char *buf, size_t max, int wait_ms) {
    pthread_mutex_lock(&j->mu);
    if (j->out_sent == j->out_len && !j->done) {
        struct timespec ts = cs_deadline_ms(wait_ms);
        pthread_cond_timedwait(&j->cv, &j->mu, &ts);
    }
    long got;
    if (j->out_sent < j->out_len) {
        size_t n = j->out_len - j->out_sent;
        if (n > max) n = max;
        memcpy(buf, j->out + j->out_sent, n);
        j->out_sent += n;
        got = (long)n;
    } else {
        got = j->done ? -1 : 0;
    }
    pthread_mutex_unlock(&j->mu);
    return got;
}

void cs_job_join_stream(cs_job *j, const cs_job *first, int part) {
    j->index_base = part * j->req.n;
    j->stream_part = 1;
    memcpy(j->id, first->id, sizeof j->id);
    j->created = first->created;
}

char *cs_api_stream_usage(cs_job *const *jobs, int n, size_t *len) {
    json_int_t pt = 0, ct = 0, cached = 0;
    for (int i = 0; i < n; i++) {
        pt += (json_int_t)jobs[i]->n_prompt;
        ct += (json_int_t)jobs[i]->req.completion_tokens;
        cached += (json_int_t)jobs[i]->req.cached_tokens;
    }
    json_t *o = json_pack("{s:s, s:s, s:I, s:s, s:[], s:{s:I, s:I, s:I, s:{s:I}}}", "id", jobs[0]->id, "object",
                          "text_completion", "created", (json_int_t)jobs[0]->created, "model",
                          jobs[0]->srv->model_id, "choices", "usage", "prompt_tokens", pt, "completion_tokens", ct,
                          "total_tokens", pt + ct, "prompt_tokens_details", "cached_tokens", cached);
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!s) return NULL;
    size_t m = strlen(s);
    char *out = malloc(m + 9);
    if (out) {
        memcpy(out, "data: ", 6);
        memcpy(out + 6, s, m);
        memcpy(out + 6 + m, "\n\n", 3);
        *len = m + 8;
    }
    free(s);
    return out;
}

char *cs_job_response(cs_job *j, size_t *len, int *status) {
    if (j->error) {
        cs_api_error e;
        cs_api_set_error(&e, j->shutdown ? 503 : 500, "server_error", NULL,
                         j->shutdown ? "server_shutting_down" : NULL, "%s", j->error);
        *status = e.status;
        return cs_api_error_json(&e, len);
    }
    json_t *choices = json_array();
    for (int c = 0; c < j->req.n; c++) {
        job_choice *ch = &j->ch[c];
        const char *fin = finish_name(ch->why);
        json_t *o = json_object();
        json_object_set_new(o, "index", json_integer(c));
        size_t tl = ch->emitted;
        if (j->kind == CS_API_CHAT && ch->have_parsed) {
            const cs_parsed *p = &ch->parsed;
            json_t *msg = json_pack("{s:s, s:o}", "role", "assistant", "content",
                                    p->has_content ? text_json(p->content, p->content_len) : json_null());
            if (p->reasoning) json_object_set_new(msg, "reasoning_content", text_json(p->reasoning, p->reasoning_len));
            if (p->n_calls) {
                json_object_set_new(msg, "tool_calls", tool_calls_json(ch));
                if (ch->why == CS_FINISH_STOP) fin = "tool_calls";
            }
            json_object_set_new(o, "message", msg);
            json_object_set_new(o, "logprobs",
                                j->logprobs >= 0 ? json_pack("{s:o}", "content", ch->lp ? json_incref(ch->lp) : json_array())
                                                 : json_null());
        } else if (j->kind == CS_API_CHAT) {
            json_object_set_new(o, "message", json_pack("{s:s, s:o}", "role", "assistant", "content",
                                                        text_json(ch->text ? ch->text : "", tl)));
            json_object_set_new(o, "logprobs",
                                j->logprobs >= 0 ? json_pack("{s:o}", "content", ch->lp ? json_incref(ch->lp) : json_array())
                                                 : json_null());
        } else {
            json_t *t;
            if (j->echo && j->echo_len) {
                char *both = malloc(j->echo_len + tl + 1);
                if (both) {
                    memcpy(both, j->echo_text, j->echo_len);
                    if (tl) memcpy(both + j->echo_len, ch->text, tl);
                    t = text_json(both, j->echo_len + tl);
                    free(both);
                } else {
                    t = json_string("");
                }
            } else {
                t = text_json(ch->text ? ch->text : "", tl);
            }
            json_object_set_new(o, "text", t);
            json_object_set_new(o, "logprobs",
                                j->logprobs >= 0 ? (ch->lp ? json_incref(ch->lp)
                                                           : json_pack("{s:[], s:[], s:[], s:[]}", "tokens",
                                                                       "token_logprobs", "top_logprobs", "text_offset"))
                                                 : json_null());
        }
        json_object_set_new(o, "finish_reason", fin ? json_string(fin) : json_null());
        json_array_append_new(choices, o);
    }
    json_t *root = json_pack("{s:s, s:s, s:I, s:s, s:o, s:o}", "id", j->id, "object",
                             j->kind == CS_API_CHAT ? "chat.completion" : "text_completion", "created",
                             (json_int_t)j->created, "model", j->srv->model_id, "choices", choices, "usage",
                             usage_json(j));
    *status = 200;
    char *s = root ? dump(root, len) : NULL;
    if (!s) {
        cs_api_error e;
        cs_api_set_error(&e, 500, "server_error", NULL, NULL, "out of memory");
        *status = 500;
        return cs_api_error_json(&e, len);
    }
    return s;
}

/* ---- /tokenize and /detokenize (llama-server's shapes) ----------------------------------- */

static json_t *load_object(const char *body, size_t len, cs_api_error *err) {
    size_t bad = 0;
    if (!cs_utf8_valid(body, len, &bad)) {
        BAD(NULL, "the request body is not valid UTF-8 (the first bad byte is at offset %zu)", bad);
        return NULL;
    }
    json_error_t je;
    json_t *root = json_loadb(body, len, 0, &je);
    if (!root) {
        BAD(NULL, "the request body is not valid JSON: %s (line %d, column %d)", je.text, je.line, je.column);
        return NULL;
    }
    if (!json_is_object(root)) {
        BAD(NULL, "the request body must be a JSON object");
        json_decref(root);
        return NULL;
    }
    return root;
}

char *cs_api_tokenize(cs_server *srv, const char *body, size_t len, size_t *out_len, cs_api_error *err) {
    json_t *root = load_object(body, len, err), *out = NULL;
    if (!root) return NULL;
    json_t *content = field(root, "content");
    int add_special = 0, with_pieces = 0;
    int32_t *ids = NULL;
    int64_t n = 0;
    char msg[512];
    if (!content || !json_is_string(content)) {
        BAD("content", "'content' must be the text to tokenize (a string)");
        goto done;
    }
    if (get_bool(root, "add_special", &add_special, err) < 0 || get_bool(root, "with_pieces", &with_pieces, err) < 0)
        goto done;
    pthread_mutex_lock(&srv->tok_mu);
    int rc = tokenize(srv->tok, json_string_value(content), json_string_length(content), add_special, &ids, &n, msg,
                      sizeof msg);
    json_t *toks = rc ? NULL : json_array();
    for (int64_t i = 0; toks && i < n; i++) {
        if (!with_pieces) {
            json_array_append_new(toks, json_integer(ids[i]));
            continue;
        }
        /* the piece as text, or as its bytes when they are not UTF-8 on their own */
        size_t plen = 0;
        int byte = -1;
        char *t = token_text(srv->tok, ids[i], &plen, &byte);
        json_t *piece;
        if (byte >= 0) piece = json_pack("[i]", byte);
        else piece = t ? text_json(t, plen) : json_string("");
        free(t);
        json_array_append_new(toks, json_pack("{s:i, s:o}", "id", ids[i], "piece", piece));
    }
    pthread_mutex_unlock(&srv->tok_mu);
    if (rc) {
        BAD("content", "%s", msg);
        goto done;
    }
    out = json_pack("{s:o}", "tokens", toks);
done:
    free(ids);
    json_decref(root);
    if (!out) {
        if (!err->message[0]) cs_api_set_error(err, 500, "server_error", NULL, NULL, "out of memory");
        return NULL;
    }
    return dump(out, out_len);
}

char *cs_api_detokenize(cs_server *srv, const char *body, size_t len, size_t *out_len, cs_api_error *err) {
    json_t *root = load_object(body, len, err), *out = NULL;
    if (!root) return NULL;
    json_t *t = field(root, "tokens");
    int32_t *ids = NULL;
    size_t n = t && json_is_array(t) ? json_array_size(t) : 0;
    if (!t || !json_is_array(t)) {
        BAD("tokens", "'tokens' must be an array of token ids");
        goto done;
    }
    ids = malloc((n ? n : 1) * sizeof *ids);
    if (!ids) goto done;
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(t, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= srv->vocab) {
            BAD("tokens", "element %zu of 'tokens' is not a token id of this model (integers 0 to %" PRId64 ")", i,
                srv->vocab - 1);
            goto done;
        }
        ids[i] = (int32_t)json_integer_value(v);
    }
    size_t tl = 0;
    pthread_mutex_lock(&srv->tok_mu);
    char *text = detok(srv->tok, ids, (int64_t)n, &tl);
    pthread_mutex_unlock(&srv->tok_mu);
    if (text) out = json_pack("{s:o}", "content", text_json(text, tl));
    free(text);
done:
    free(ids);
    json_decref(root);
    if (!out) {
        if (!err->message[0]) cs_api_set_error(err, 500, "server_error", NULL, NULL, "out of memory");
        return NULL;
    }
    return dump(out, out_len);
}

/* ---- /v1/completions with a list of prompts ---------------------------------------------- */

int cs_api_split_prompts(cs_server *srv, const char *body, size_t len, char ***bodies, size_t **lens,
                         cs_api_error *err) {
    (void)srv;
    *bodies = NULL;
    *lens = NULL;
    json_error_t je;
    json_t *root = json_loadb(body, len, 0, &je);
    if (!root || !json_is_object(root)) { /* cs_api_parse says what is wrong with it */
        json_decref(root);
        return 0;
    }
    json_t *p = field(root, "prompt");
    size_t n = p && json_is_array(p) ? json_array_size(p) : 0;
    json_t *first = n >= 2 ? json_array_get(p, 0) : NULL;
    if (!first || !(json_is_string(first) || json_is_array(first))) {
        json_decref(root);
        return 0; /* one prompt: a string, ids, or a list of one */
    }
    if (n > CS_MAX_PROMPTS) {
        BAD("prompt", "at most %d prompts per request, got %zu", CS_MAX_PROMPTS, n);
        json_decref(root);
        return -1;
    }
    char **b = calloc(n, sizeof *b);
    size_t *l = calloc(n, sizeof *l);
    int ok = b && l;
    json_incref(p); /* root's "prompt" is replaced below */
    for (size_t i = 0; ok && i < n; i++) {
        json_t *e = json_array_get(p, i);
        if (!json_is_string(e) && !json_is_array(e)) {
            BAD("prompt", "element %zu of the list of prompts is neither a string nor an array of token ids", i);
            ok = 0;
            break;
        }
        json_object_set(root, "prompt", e);
        size_t need = json_dumpb(root, NULL, 0, JSON_COMPACT);
        b[i] = need ? malloc(need) : NULL;
        if (!b[i]) {
            cs_api_set_error(err, 500, "server_error", NULL, NULL, "out of memory");
            ok = 0;
            break;
        }
        l[i] = json_dumpb(root, b[i], need, JSON_COMPACT);
    }
    json_decref(p);
    json_decref(root);
    if (!ok) {
        for (size_t i = 0; b && i < n; i++) free(b[i]);
        free(b);
        free(l);
        if (!err->message[0]) cs_api_set_error(err, 500, "server_error", NULL, NULL, "out of memory");
        return -1;
    }
    *bodies = b;
    *lens = l;
    return (int)n;
}

char *cs_api_merge_completions(char *const *responses, const size_t *lens, int n, size_t *out_len) {
    json_t *out = NULL, *choices = json_array();
    json_int_t pt = 0, ct = 0, cached = 0;
    for (int i = 0; choices && i < n; i++) {
        json_t *r = json_loadb(responses[i], lens[i], 0, NULL);
        json_t *ch = r ? json_object_get(r, "choices") : NULL;
        size_t k = ch ? json_array_size(ch) : 0;
        /* OpenAI's order: prompt i's choices are indices i * n_choices .. */
        for (size_t c = 0; c < k; c++) {
            json_t *x = json_array_get(ch, c);
            json_object_set_new(x, "index", json_integer((json_int_t)((size_t)i * k + c)));
            json_array_append(choices, x);
        }
        json_t *u = r ? json_object_get(r, "usage") : NULL;
        pt += json_integer_value(json_object_get(u, "prompt_tokens"));
        ct += json_integer_value(json_object_get(u, "completion_tokens"));
        cached += json_integer_value(json_object_get(json_object_get(u, "prompt_tokens_details"), "cached_tokens"));
        if (i == 0 && r) {
            out = json_deep_copy(r);
        }
        json_decref(r);
    }
    if (!out || !choices) {
        json_decref(out);
        json_decref(choices);
        return NULL;
    }
    json_object_set_new(out, "choices", choices);
    json_object_set_new(out, "usage", json_pack("{s:I, s:I, s:I, s:{s:I}}", "prompt_tokens", pt, "completion_tokens",
                                                ct, "total_tokens", pt + ct, "prompt_tokens_details",
                                                "cached_tokens", cached));
    return dump(out, out_len);
}
