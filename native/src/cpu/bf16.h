/*
 * bf16.h — rounding to bfloat16 (bf16.c), for fast mode's BF16 paths: the CPU backend's
 * activations before a BF16 matmul, the AMX kernels' h (fast_amx.c) and the vdpbf16ps
 * kernels' (fast_bf16dp.c). No dependency but the C library.
 */
#ifndef COLIBRI_CPU_BF16_H
#define COLIBRI_CPU_BF16_H

#include <stdint.h>

/* x[i] <- x[i] rounded to the nearest bfloat16 (ties to even; nan stays nan). */
void cb_round_bf16(float *x, int64_t n);
/* The same on columns i0 .. i1 of R rows of h [R, I]. */
void cb_round_bf16_cols(float *h, int64_t R, int64_t I, int64_t i0, int64_t i1);

#endif
