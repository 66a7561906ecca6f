/*
 * tool_common.h — what colibri_cli, colibri_bench and colibri_server share: exit statuses,
 * usage and engine error reports, number, --precision, --expert_cache_policy and --backend /
 * --gpu_memory_fraction / --gpu_device parsing, option splitting, the expert cache's counters,
 * the backend's facts and a monotonic clock.
 * Header-only (static functions); define TOOL_NAME before including it.
 */
#ifndef COLIBRI_TOOL_COMMON_H
#define COLIBRI_TOOL_COMMON_H

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "colibri.h"

#ifndef TOOL_NAME
#error "define TOOL_NAME before including tool_common.h"
#endif

#define EXIT_ENGINE 1
#define EXIT_USAGE 2

/* "TOOL: <message>" and a pointer to --help on stderr; returns EXIT_USAGE. */
static inline int usage_error(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;
static inline int usage_error(const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, TOOL_NAME ": ");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\nTry '" TOOL_NAME " --help'.\n");
    return EXIT_USAGE;
}

/* Report a failed engine call (the context's message, else the status name); returns
 * EXIT_ENGINE. */
static inline int engine_error(colibri_ctx *ctx, colibri_status st, const char *what) {
    const char *msg = ctx ? colibri_last_error(ctx) : "";
    fprintf(stderr, TOOL_NAME ": error: %s: %s\n", what, (msg && *msg) ? msg : colibri_status_string(st));
    return EXIT_ENGINE;
}

static inline int parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return 0;
    *out = v;
    return 1;
}

static inline int parse_u64(const char *s, uint64_t *out) {
    char *end;
    if (*s == '-') return 0;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end) return 0;
    *out = v;
    return 1;
}

/* Split the option argv[*i] ("--name VALUE" or "--name=VALUE") into name and value,
 * consuming argv[*i + 1] when the value is separate. The name must be one of `known`.
 * Returns -1 on success, else the exit status of the usage error it reported. */
static inline int split_option(int argc, char **argv, int *i, const char *const *known, size_t n_known,
                        char name[64], const char **val) {
    const char *arg = argv[*i];
    const char *eq = strchr(arg, '=');
    size_t n = eq ? (size_t)(eq - arg) : strlen(arg);
    if (n >= 64) return usage_error("unknown option '%s'", arg);
    memcpy(name, arg, n);
    name[n] = '\0';
    *val = eq ? eq + 1 : NULL;
    int is_known = 0;
    for (size_t k = 0; k < n_known; k++)
        if (!strcmp(name, known[k])) is_known = 1;
    if (!is_known) return usage_error("unknown option '%s'", name);
    if (!*val) {
        if (*i + 1 >= argc) return usage_error("option '%s' needs a value", name);
        *val = argv[++*i];
    }
    return -1;
}

/* The value of --precision: "exact" (COLIBRI_PRECISION_EXACT) or "fast" (COLIBRI_PRECISION_FAST).
 * Returns 1 and sets *out, or 0 when `s` is neither (the caller reports the usage error, e.g.
 * with PRECISION_USAGE). */
#define PRECISION_USAGE "--precision must be 'exact' or 'fast', got '%s'"
static inline int parse_precision(const char *s, int32_t *out) {
    if (!strcmp(s, "exact")) *out = COLIBRI_PRECISION_EXACT;
    else if (!strcmp(s, "fast")) *out = COLIBRI_PRECISION_FAST;
    else return 0;
    return 1;
}

/* The name of expert-cache policy COLIBRI_CACHE_* `p` (as --expert_cache_policy takes it);
 * "none" for anything else (colibri_get_int "expert_cache_policy" is -1 without a cache). */
static inline const char *cache_policy_name(int64_t p) {
    switch (p) {
    case COLIBRI_CACHE_LRU: return "lru";
    case COLIBRI_CACHE_LFU: return "lfu";
    case COLIBRI_CACHE_PINNED: return "pinned";
    case COLIBRI_CACHE_PREDICT: return "predict";
    default: return "none";
    }
}

/* The value of --expert_cache_policy: "lru", "lfu", "pinned" or "predict" (COLIBRI_CACHE_*).
 * Returns 1 and sets *out, or 0 when `s` is none of them (the caller reports the usage error,
 * e.g. with CACHE_POLICY_USAGE). */
#define CACHE_POLICY_USAGE "--expert_cache_policy must be 'lru', 'lfu', 'pinned' or 'predict', got '%s'"
static inline int parse_cache_policy(const char *s, int32_t *out) {
    for (int32_t p = COLIBRI_CACHE_LRU; p <= COLIBRI_CACHE_PREDICT; p++)
        if (!strcmp(s, cache_policy_name(p))) {
            *out = p;
            return 1;
        }
    return 0;
}

/* The checks every tool makes of the three --expert_cache_* values (mb and slots as parsed,
 * 0 when absent; policy_given: the flag was on the command line). Returns -1 when they go
 * together, else the exit status of the usage error it reported. */
static inline int check_cache_flags(int64_t mb, int64_t slots, int policy_given) {
    if (mb > 0 && slots > 0)
        return usage_error("--expert_cache_mb and --expert_cache_slots are two ways to size the one "
                           "expert cache; give one of them");
    if (policy_given && mb == 0 && slots == 0)
        return usage_error("--expert_cache_policy needs an expert cache: give --expert_cache_mb or "
                           "--expert_cache_slots too");
    return -1;
}

/* The value of --backend: "cpu" (COLIBRI_BACKEND_CPU) or "cuda" (COLIBRI_BACKEND_CUDA;
 * docs/backends.md). Returns 1 and sets *out, or 0 when `s` is neither (the caller reports the
 * usage error, e.g. with BACKEND_USAGE). */
#define BACKEND_USAGE "--backend must be 'cpu' or 'cuda', got '%s'"
static inline int parse_backend(const char *s, int32_t *out) {
    if (!strcmp(s, "cpu")) *out = COLIBRI_BACKEND_CPU;
    else if (!strcmp(s, "cuda")) *out = COLIBRI_BACKEND_CUDA;
    else return 0;
    return 1;
}

/* The value of --gpu_memory_fraction: a number in (0, 1] (the share of the device's memory the
 * CUDA backend's plan may take). Returns 1 and sets *out, or 0 (GPU_FRACTION_USAGE). */
#define GPU_FRACTION_USAGE "--gpu_memory_fraction must be a number in (0, 1], got '%s'"
static inline int parse_gpu_fraction(const char *s, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v > 0.0 && v <= 1.0)) return 0;
    *out = v;
    return 1;
}

/* The value of --gpu_device: a device ordinal, 0..1023. Returns 1 and sets *out, or 0
 * (GPU_DEVICE_USAGE). */
#define GPU_DEVICE_USAGE "--gpu_device must be an integer in 0..1023 (a CUDA device ordinal), got '%s'"
static inline int parse_gpu_device(const char *s, int32_t *out) {
    int64_t v;
    if (!parse_i64(s, 0, 1023, &v)) return 0;
    *out = (int32_t)v;
    return 1;
}

/* The checks every tool makes of --backend, --gpu_memory_fraction and --gpu_device (gpu_given:
 * either GPU flag was on the command line). Returns -1 when they go together, else the exit
 * status of the usage error it reported. */
static inline int check_backend_flags(int32_t backend, int gpu_given) {
    if (gpu_given && backend != COLIBRI_BACKEND_CUDA)
        return usage_error("--gpu_memory_fraction and --gpu_device set up the CUDA backend: give "
                           "--backend cuda too");
    return -1;
}

/* The engine options colibri_cli and colibri_bench take alike: the expert cache and the
 * backend (policy_given / gpu_given: the flag was on the command line). */
typedef struct engine_flags {
    int64_t expert_cache_mb, expert_cache_slots;
    int32_t expert_cache_policy;
    int32_t backend, gpu_device;
    double gpu_memory_fraction; /* 0: the engine's default (0.9) */
    int policy_given, gpu_given;
} engine_flags;

/* One of those flags: -2 when `name` is none of them, -1 when it is taken, else the exit
 * status of the usage error it reported. */
static inline int parse_engine_flag(const char *name, const char *val, engine_flags *f) {
    if (!strcmp(name, "--expert_cache_mb")) {
        if (!parse_i64(val, 0, INT64_C(1) << 40, &f->expert_cache_mb))
            return usage_error("--expert_cache_mb must be an integer >= 0 (MiB), got '%s'", val);
    } else if (!strcmp(name, "--expert_cache_slots")) {
        if (!parse_i64(val, 0, INT32_MAX, &f->expert_cache_slots))
            return usage_error("--expert_cache_slots must be an integer >= 0, got '%s'", val);
    } else if (!strcmp(name, "--expert_cache_policy")) {
        if (!parse_cache_policy(val, &f->expert_cache_policy)) return usage_error(CACHE_POLICY_USAGE, val);
        f->policy_given = 1;
    } else if (!strcmp(name, "--backend")) {
        if (!parse_backend(val, &f->backend)) return usage_error(BACKEND_USAGE, val);
    } else if (!strcmp(name, "--gpu_memory_fraction")) {
        if (!parse_gpu_fraction(val, &f->gpu_memory_fraction)) return usage_error(GPU_FRACTION_USAGE, val);
        f->gpu_given = 1;
    } else if (!strcmp(name, "--gpu_device")) {
        if (!parse_gpu_device(val, &f->gpu_device)) return usage_error(GPU_DEVICE_USAGE, val);
        f->gpu_given = 1;
    } else {
        return -2;
    }
    return -1;
}

/* Whether they go together (check_cache_flags, check_backend_flags): -1, or the exit status. */
static inline int check_engine_flags(const engine_flags *f) {
    int bad = check_cache_flags(f->expert_cache_mb, f->expert_cache_slots, f->policy_given);
    if (bad >= 0) return bad;
    return check_backend_flags(f->backend, f->gpu_given);
}

/* Into the engine's options. */
static inline void engine_flags_apply(const engine_flags *f, colibri_options *opt) {
    opt->expert_cache_mb = f->expert_cache_mb;
    opt->expert_cache_slots = (int32_t)f->expert_cache_slots;
    opt->expert_cache_policy = f->expert_cache_policy;
    opt->backend = f->backend;
    opt->gpu_device = f->gpu_device;
    opt->gpu_memory_fraction = f->gpu_memory_fraction;
}

/* What the backend says of itself (colibri_get_string "backend" / "backend_device",
 * colibri_get_int "backend_*"). */
typedef struct backend_facts {
    const char *name, *device;
    int64_t device_bytes, weight_bytes, experts_resident, experts_host, graphs_captured, graph_replays;
} backend_facts;

/* Read them all; COLIBRI_OK, or the failing call's status. */
static inline colibri_status read_backend_facts(const colibri_ctx *ctx, backend_facts *b) {
    colibri_status st;
    b->name = b->device = "";
    if ((st = colibri_get_string(ctx, "backend", &b->name)) != COLIBRI_OK ||
        (st = colibri_get_string(ctx, "backend_device", &b->device)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "backend_device_bytes", &b->device_bytes)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "backend_weight_bytes", &b->weight_bytes)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "backend_experts_resident", &b->experts_resident)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "backend_experts_host", &b->experts_host)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "backend_graphs_captured", &b->graphs_captured)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "backend_graph_replays", &b->graph_replays)) != COLIBRI_OK)
        return st;
    return COLIBRI_OK;
}

/* The expert cache's counters, as colibri_get_int gives them ("expert_cache_*"). */
typedef struct cache_counts {
    int64_t hits, misses, prefetches, prefetch_hits, wasted, bytes_read;
} cache_counts;

/* Read the counters of every layer together; COLIBRI_OK, or the failing call's status. */
static inline colibri_status read_cache_counts(const colibri_ctx *ctx, cache_counts *c) {
    colibri_status st;
    if ((st = colibri_get_int(ctx, "expert_cache_hits", &c->hits)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "expert_cache_misses", &c->misses)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "expert_cache_prefetches", &c->prefetches)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "expert_cache_prefetch_hits", &c->prefetch_hits)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "expert_cache_wasted_prefetches", &c->wasted)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "expert_cache_bytes_read", &c->bytes_read)) != COLIBRI_OK)
        return st;
    return COLIBRI_OK;
}

/* a - b, counter by counter (what happened between two readings). */
static inline cache_counts cache_counts_sub(cache_counts a, cache_counts b) {
    return (cache_counts){a.hits - b.hits, a.misses - b.misses, a.prefetches - b.prefetches,
                          a.prefetch_hits - b.prefetch_hits, a.wasted - b.wasted, a.bytes_read - b.bytes_read};
}

static inline double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

#endif
