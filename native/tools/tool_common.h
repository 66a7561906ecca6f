/*
 * tool_common.h — what colibri_cli and colibri_bench share: exit statuses, usage and
 * engine error reports, number and --precision parsing, option splitting and a monotonic clock.
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

static inline double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

#endif
