/*
 * error.c — the engine's error helpers (error.h) and the names of its statuses. Kept apart
 * so that the API (colibri.c), the file reader (format/) and the forward pass (model/)
 * all report failures the same way without calling into each other.
 */
#include <stdarg.h>
#include <stdio.h>

#include "core/context.h"
#include "core/error.h"

void cb_set_err(char *buf, size_t len, const char *fmt, ...) {
    if (!buf || len == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, len, fmt, ap);
    va_end(ap);
}

colibri_status cb_fail(colibri_ctx *ctx, colibri_status st, const char *fmt, ...) {
    if (ctx) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(ctx->err, sizeof ctx->err, fmt, ap);
        va_end(ap);
    }
    return st;
}

const char *colibri_status_string(colibri_status s) {
    switch (s) {
    case COLIBRI_OK: return "ok";
    case COLIBRI_E_INVALID_ARG: return "invalid argument";
    case COLIBRI_E_IO: return "i/o error";
    case COLIBRI_E_FORMAT: return "bad file format";
    case COLIBRI_E_VERSION: return "unsupported format version";
    case COLIBRI_E_CHECKSUM: return "checksum mismatch";
    case COLIBRI_E_UNSUPPORTED: return "unsupported model";
    case COLIBRI_E_NOMEM: return "out of memory";
    case COLIBRI_E_TOKEN_RANGE: return "token id out of range";
    case COLIBRI_E_SEQ_TOO_LONG: return "sequence too long";
    case COLIBRI_E_BUFFER_TOO_SMALL: return "buffer too small";
    case COLIBRI_E_NUMERIC: return "numeric error (NaN or Inf)";
    case COLIBRI_E_INTERNAL: return "internal error";
    }
    return "unknown status";
}
