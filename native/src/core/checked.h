/*
 * checked.h — overflow-safe 64-bit arithmetic. Every size and offset that comes from a
 * file or from options goes through these before it is used: a 12 GB model does not fit
 * 32 bits, and a corrupt file must not wrap an offset around.
 */
#ifndef COLIBRI_CORE_CHECKED_H
#define COLIBRI_CORE_CHECKED_H

#include <stdint.h>

/* *out = a * b; returns 0 (and leaves *out) when the product overflows 64 bits. */
static inline int cb_mul_u64(uint64_t a, uint64_t b, uint64_t *out) {
    if (a != 0 && b > UINT64_MAX / a) return 0;
    *out = a * b;
    return 1;
}

/* *out = a + b; returns 0 (and leaves *out) when the sum overflows 64 bits. */
static inline int cb_add_u64(uint64_t a, uint64_t b, uint64_t *out) {
    if (b > UINT64_MAX - a) return 0;
    *out = a + b;
    return 1;
}

#endif
