/*
 * bf16.c — rounding float32 activations to bfloat16 in place (cpu/bf16.h): fast mode's input
 * of every BF16 weight matmul, the same integer steps as the vector versions in the AMX
 * and vdpbf16ps files. Compiled without instruction-set flags, called by both.
 */
#include <string.h>

#include "cpu/bf16.h"

/* Branch-free, so that the compiler vectorizes it (it runs on every activation entering a
 * BF16 matmul in fast mode); the magnitude compare is signed-safe (both sides < 2^31). */
void cb_round_bf16(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], 4);
        uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
        u = (int32_t)(u & 0x7fffffffu) > (int32_t)0x7f800000 ? u : r; /* nan stays nan */
        memcpy(&x[i], &u, 4);
    }
}

void cb_round_bf16_cols(float *h, int64_t R, int64_t I, int64_t i0, int64_t i1) {
    for (int64_t r = 0; r < R; r++) cb_round_bf16(h + r * I + i0, i1 - i0);
}
