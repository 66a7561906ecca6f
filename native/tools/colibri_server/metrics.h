/*
 * metrics.h — the counters and histograms colibri_server exports on GET /metrics, and
 * their Prometheus text rendering (text exposition format 0.0.4). Pure data: no locking
 * here; the scheduler updates its copy under its own mutex and hands out snapshots.
 */
#ifndef COLIBRI_SERVER_METRICS_H
#define COLIBRI_SERVER_METRICS_H

#include <stddef.h>
#include <stdint.h>

#define CS_HIST_MAX_BUCKETS 24

/* A cumulative histogram: counts[i] = observations <= bounds[i] is computed when rendering;
 * here counts[i] holds the observations in (bounds[i-1], bounds[i]], counts[n] the rest. */
typedef struct cs_histogram {
    int n_bounds;
    double bounds[CS_HIST_MAX_BUCKETS];
    uint64_t counts[CS_HIST_MAX_BUCKETS + 1];
    double sum;
    uint64_t count;
} cs_histogram;

void cs_hist_init(cs_histogram *h, const double *bounds, int n_bounds);
void cs_hist_observe(cs_histogram *h, double v);

/* Time to first token: 1 ms .. 60 s. Time per output token: 1 ms .. 5 s. */
void cs_hist_init_ttft(cs_histogram *h);
void cs_hist_init_tpot(cs_histogram *h);

/* The expert cache's per-layer counters (colibri_get_layer_int "cache_hits", "cache_misses",
 * "cache_prefetches", "cache_prefetch_hits", "cache_wasted_prefetches"), in this order. */
enum { CS_CACHE_HITS, CS_CACHE_MISSES, CS_CACHE_PREFETCHES, CS_CACHE_PREFETCH_HITS, CS_CACHE_WASTED,
       CS_CACHE_N_STATS };

/* Everything /metrics shows, as one snapshot. */
typedef struct cs_metrics {
    int64_t requests_running, requests_waiting;
    int64_t kv_blocks_used, kv_blocks_total;
    uint64_t prompt_tokens_total, generation_tokens_total;
    uint64_t requests_finished_total, requests_cancelled_total, requests_rejected_total;
    uint64_t steps_total;
    /* the prefix cache: prompt positions reused of those looked up (tokens), the cached blocks
     * no sequence holds; preemptions (a request's blocks freed and its work requeued) */
    uint64_t prefix_cache_hit_tokens_total, prefix_cache_query_tokens_total, preemptions_total;
    int64_t kv_blocks_cached;
    cs_histogram ttft, tpot;
    /* per-layer expert load: expert_tokens[l * n_experts + e]; NULL when the model has no
     * router trace (n_layers or n_experts 0) */
    int32_t n_layers, n_experts;
    const uint64_t *expert_tokens;
    /* the expert cache: cache_slots per MoE layer, 0 when the server runs without one (then
     * none of its metrics is shown); cache_layer[l * CS_CACHE_N_STATS + k] counter k of layer
     * l (n_layers rows), shown for the layers with cache_moe[l] set (a dense layer has no
     * slots); cache_bytes_read the bytes read into the slots */
    int32_t cache_slots;
    const uint64_t *cache_layer;
    const uint8_t *cache_moe;
    uint64_t cache_bytes_read;
    /* the backend (docs/backends.md): NULL while loading (then none of its metrics is shown) */
    const char *backend, *backend_device;
    int64_t backend_device_bytes, backend_experts_resident, backend_experts_host;
} cs_metrics;

/* Render `m` in the Prometheus text format into a malloc'd NUL-terminated string
 * (*len its length); NULL when out of memory. */
char *cs_metrics_render(const cs_metrics *m, size_t *len);

#endif
