/*
 * metrics.c — histograms and the Prometheus text rendering of GET /metrics (metrics.h).
 */
#include "metrics.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void cs_hist_init(cs_histogram *h, const double *bounds, int n_bounds) {
    memset(h, 0, sizeof *h);
    if (n_bounds > CS_HIST_MAX_BUCKETS) n_bounds = CS_HIST_MAX_BUCKETS;
    h->n_bounds = n_bounds;
    for (int i = 0; i < n_bounds; i++) h->bounds[i] = bounds[i];
}

void cs_hist_observe(cs_histogram *h, double v) {
    int i = 0;
    while (i < h->n_bounds && v > h->bounds[i]) i++;
    h->counts[i]++;
    h->sum += v;
    h->count++;
}

void cs_hist_init_ttft(cs_histogram *h) {
    static const double b[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 60.0};
    cs_hist_init(h, b, (int)(sizeof b / sizeof b[0]));
}

void cs_hist_init_tpot(cs_histogram *h) {
    static const double b[] = {0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075,
                               0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0};
    cs_hist_init(h, b, (int)(sizeof b / sizeof b[0]));
}

/* A growing string buffer; on allocation failure `bad` is set and appends stop. */
typedef struct sbuf {
    char *p;
    size_t len, cap;
    int bad;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static void sb_printf(sbuf *b, const char *fmt, ...) {
    if (b->bad) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) { b->bad = 1; return; }
        if ((size_t)n < b->cap - b->len) { b->len += (size_t)n; return; }
        size_t want = (b->cap + (size_t)n + 1) * 2;
        char *np = realloc(b->p, want);
        if (!np) { b->bad = 1; return; }
        b->p = np;
        b->cap = want;
    }
}

static void gauge(sbuf *b, const char *name, const char *help, int64_t v) {
    sb_printf(b, "# HELP %s %s\n# TYPE %s gauge\n%s %" PRId64 "\n", name, help, name, name, v);
}

static void counter(sbuf *b, const char *name, const char *help, uint64_t v) {
    sb_printf(b, "# HELP %s %s\n# TYPE %s counter\n%s %" PRIu64 "\n", name, help, name, name, v);
}

static void histogram(sbuf *b, const char *name, const char *help, const cs_histogram *h) {
    sb_printf(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    uint64_t cum = 0;
    for (int i = 0; i < h->n_bounds; i++) {
        cum += h->counts[i];
        sb_printf(b, "%s_bucket{le=\"%g\"} %" PRIu64 "\n", name, h->bounds[i], cum);
    }
    cum += h->counts[h->n_bounds];
    sb_printf(b, "%s_bucket{le=\"+Inf\"} %" PRIu64 "\n", name, cum);
    sb_printf(b, "%s_sum %.9g\n%s_count %" PRIu64 "\n", name, h->sum, name, h->count);
}

/* The expert cache's counters: each one's total over the MoE layers unlabelled, and per layer
 * as a family of its own (colibri_expert_cache_layer_*_total{layer="L"}), so that no family
 * mixes a total with its parts and a sum over a family's series counts every use once. */
static void cache_metrics(sbuf *b, const cs_metrics *m) {
    static const char *const names[CS_CACHE_N_STATS] = {"hits", "misses", "prefetches", "prefetch_hits",
                                                        "wasted_prefetches"};
    static const char *const helps[CS_CACHE_N_STATS] = {
        "Expert-cache hits: uses of a routed expert found in its layer's slots (an expert used by R rows "
        "of a step counts R uses)",
        "Expert-cache misses: uses of a routed expert that was read from the model file first",
        "Experts read ahead into the expert cache (policy predict)",
        "Prefetched experts used before their eviction",
        "Prefetched experts evicted before any use"};
    gauge(b, "colibri_expert_cache_slots", "Expert-cache slots per MoE layer.", m->cache_slots);
    for (int k = 0; k < CS_CACHE_N_STATS; k++) {
        uint64_t total = 0;
        for (int32_t l = 0; l < m->n_layers; l++)
            if (m->cache_moe[l]) total += m->cache_layer[(size_t)l * CS_CACHE_N_STATS + (size_t)k];
        sb_printf(b, "# HELP colibri_expert_cache_%s_total %s; all MoE layers.\n"
                     "# TYPE colibri_expert_cache_%s_total counter\ncolibri_expert_cache_%s_total %" PRIu64 "\n",
                  names[k], helps[k], names[k], names[k], total);
    }
    counter(b, "colibri_expert_cache_bytes_read_total", "Bytes read from the model file into expert-cache slots.",
            m->cache_bytes_read);
    for (int k = 0; k < CS_CACHE_N_STATS; k++) {
        sb_printf(b, "# HELP colibri_expert_cache_layer_%s_total %s; per MoE layer.\n"
                     "# TYPE colibri_expert_cache_layer_%s_total counter\n",
                  names[k], helps[k], names[k]);
        for (int32_t l = 0; l < m->n_layers; l++)
            if (m->cache_moe[l])
                sb_printf(b, "colibri_expert_cache_layer_%s_total{layer=\"%d\"} %" PRIu64 "\n", names[k], l,
                          m->cache_layer[(size_t)l * CS_CACHE_N_STATS + (size_t)k]);
    }
}

/* A label value, escaped as the text format wants (backslash, double quote, newline). */
static void label_value(sbuf *b, const char *s) {
    for (; *s; s++) {
        if (*s == '\\' || *s == '"') sb_printf(b, "\\%c", *s);
        else if (*s == '\n') sb_printf(b, "\\n");
        else sb_printf(b, "%c", *s);
    }
}

/* colibri_backend_info{backend, device} 1 and the backend's memory figures. */
static void backend_metrics(sbuf *b, const cs_metrics *m) {
    sb_printf(b, "# HELP colibri_backend_info The backend the stages run on (--backend) and its device; always 1.\n"
                 "# TYPE colibri_backend_info gauge\ncolibri_backend_info{backend=\"");
    label_value(b, m->backend);
    sb_printf(b, "\",device=\"");
    label_value(b, m->backend_device ? m->backend_device : "");
    sb_printf(b, "\"} 1\n");
    gauge(b, "colibri_backend_device_bytes", "Device memory the backend took (0: the CPU backend, host memory only).",
          m->backend_device_bytes);
    gauge(b, "colibri_backend_experts_resident", "Routed experts resident on the backend's device, all MoE layers.",
          m->backend_experts_resident);
    gauge(b, "colibri_backend_experts_host",
          "Routed experts a device backend computes on the CPU (they did not fit --gpu_memory_fraction).",
          m->backend_experts_host);
}

char *cs_metrics_render(const cs_metrics *m, size_t *len) {
    sbuf b = {malloc(4096), 0, 4096, 0};
    if (!b.p) return NULL;
    b.p[0] = '\0';
    gauge(&b, "colibri_requests_running", "Requests holding sequences (prefilling or decoding).",
          m->requests_running);
    gauge(&b, "colibri_requests_waiting", "Requests queued for admission.", m->requests_waiting);
    gauge(&b, "colibri_kv_blocks_used", "KV-cache blocks held by running sequences.", m->kv_blocks_used);
    gauge(&b, "colibri_kv_blocks_cached", "KV-cache blocks kept by the prefix cache, held by no sequence "
          "(evicted least recently used when a sequence needs room).", m->kv_blocks_cached);
    gauge(&b, "colibri_kv_blocks_total", "KV-cache blocks in the paged cache.", m->kv_blocks_total);
    counter(&b, "colibri_prompt_tokens_total", "Prompt tokens prefilled.", m->prompt_tokens_total);
    counter(&b, "colibri_generation_tokens_total", "Tokens generated.", m->generation_tokens_total);
    counter(&b, "colibri_requests_finished_total", "Requests that ran to the end.",
            m->requests_finished_total);
    counter(&b, "colibri_requests_cancelled_total", "Requests cancelled (client gone).",
            m->requests_cancelled_total);
    counter(&b, "colibri_requests_rejected_total", "Requests refused because the queue was full.",
            m->requests_rejected_total);
    counter(&b, "colibri_engine_steps_total", "Batched forward steps run.", m->steps_total);
    counter(&b, "colibri_prefix_cache_hits_total", "Prompt tokens taken from the prefix cache instead of computed.",
            m->prefix_cache_hit_tokens_total);
    counter(&b, "colibri_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
            m->prefix_cache_query_tokens_total);
    counter(&b, "colibri_preemptions_total", "Requests preempted because the KV cache was full (their blocks "
            "freed, their work recomputed later).", m->preemptions_total);
    histogram(&b, "colibri_time_to_first_token_seconds",
              "Seconds from a request's arrival to its first generated token.", &m->ttft);
    histogram(&b, "colibri_time_per_output_token_seconds",
              "Seconds between consecutive generated tokens of a sequence.", &m->tpot);
    if (m->expert_tokens && m->n_layers > 0 && m->n_experts > 0) {
        sb_printf(&b, "# HELP colibri_expert_tokens_total Tokens routed to each expert, per layer "
                      "(MoE layers only).\n# TYPE colibri_expert_tokens_total counter\n");
        for (int32_t l = 0; l < m->n_layers; l++)
            for (int32_t e = 0; e < m->n_experts; e++)
                sb_printf(&b, "colibri_expert_tokens_total{layer=\"%d\",expert=\"%d\"} %" PRIu64 "\n",
                          l, e, m->expert_tokens[(size_t)l * (size_t)m->n_experts + (size_t)e]);
    }
    if (m->cache_slots > 0 && m->cache_layer && m->cache_moe && m->n_layers > 0) cache_metrics(&b, m);
    if (m->backend) backend_metrics(&b, m);
    if (b.bad) {
        free(b.p);
        return NULL;
    }
    *len = b.len;
    return b.p;
}
