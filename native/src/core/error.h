/*
 * error.h — how the engine reports failure: a colibri_status and a message. Library code
 * never prints, exits or aborts; it writes its message into the caller's buffer (init-time
 * calls, which have no context yet) or into the context (every later call), and returns.
 * Every message says what went wrong and what to do about it.
 */
#ifndef COLIBRI_CORE_ERROR_H
#define COLIBRI_CORE_ERROR_H

#include <stddef.h>

#include "colibri.h"

/* Size of every message buffer of the engine (the context's, the trace's, the tokenizer's). */
#define CB_ERR_LEN 512

#if defined(__GNUC__)
#define CB_PRINTF(fmt_idx, arg_idx) __attribute__((format(printf, fmt_idx, arg_idx)))
#else
#define CB_PRINTF(fmt_idx, arg_idx)
#endif

/* Format a message into buf[len] (always NUL-terminated; a NULL or empty buffer is ignored). */
void cb_set_err(char *buf, size_t len, const char *fmt, ...) CB_PRINTF(3, 4);

/* Keep a message in ctx (colibri_last_error) and return st; ctx may be NULL. */
colibri_status cb_fail(colibri_ctx *ctx, colibri_status st, const char *fmt, ...) CB_PRINTF(3, 4);

#endif
