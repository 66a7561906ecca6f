/*
 * qpanel.h — interleaved copies of block-type weights (Q8_0, the K-quants, Q4_0 ... IQ4_XS:
 * every type of fast mode's int8 path, cpu/fast.h): a layout in which one vector load gives
 * the same four bytes of 8 consecutive rows, lane = row, so that fast mode's kernels unpack 8
 * rows' weights with whole-vector masks and shifts and no 8 x 8 transpose (which, measured,
 * costs a decode step more than its dot products). The blocks keep their bytes and their bit
 * widths; only their order changes.
 *
 * The layout of a matrix [N, K] of block type dt (N a multiple of 8, K of the block size):
 * group g of rows 8g .. 8g+7 starts at byte g * 8 * rp (rp = cb_qpanel_row_bytes(dt, K), the
 * row-major row's bytes: the copy is exactly as large as the matrix), and its block b at b * 8
 * * bb (bb the block's bytes). There a block's bytes are dwords, dword j of row 8g + r at byte
 * (8 j + r) * 4, except, in the types whose blocks are not whole dwords, their 2-byte f16
 * scale: at offset s = cb_qpanel_split(dt) of the block (0: Q8_0, Q4_0, Q5_0, IQ4_NL, whose
 * quants follow d; bb - 2: Q3_K, Q6_K, whose d ends the block), the 8 rows' scales are 16
 * bytes of their own (row r's at 2r), first when s is 0 (and the dwords then start at byte
 * 16), last otherwise; the dwords are the block's other bb - 2 bytes in order. The blocks
 * keep their bytes and bit widths; only their order changes.
 *
 * The engine makes the copies at load (backend/cpu/panels.c) when the running fast table
 * has kernels that read them (cb_fast_kernels.qpanels); they give the bits of the table's
 * row-major kernels, so results never depend on whether a copy was made (native/tests/
 * test_kernels.c checks it).
 */
#ifndef COLIBRI_CPU_QPANEL_H
#define COLIBRI_CPU_QPANEL_H

#include <stdint.h>

#include "core/dtype.h"

/* The rows of a group. */
#define CB_QPANEL_ROWS 8

typedef struct cb_qpanel_kernels {
    const char *name;
    /* y[t * ldy + n] for t < T, n < N, as the table's matmul_ld computes it, from the copy P
     * of rows [0, N) (N a multiple of 8; P at the copy of row 0, a group's start) */
    void (*matmul)(float *y, int64_t ldy, const float *x, const void *P, uint32_t dt, int64_t T, int64_t N,
                   int64_t K);
    /* the table's gateup on the copies of gate and up [I, H] (I and i0 multiples of 8) */
    void (*gateup)(float *h, const float *x, const void *gate, const void *up, uint32_t dt, int64_t R, int64_t H,
                   int64_t I, int64_t i0, int64_t i1);
} cb_qpanel_kernels;

/* Where a block's 2-byte scale is kept apart in the copy (its offset in the block), or -1 for
 * the types whose blocks are whole dwords. */
static inline int cb_qpanel_split(uint32_t dt) {
    switch (dt) {
    case COLIBRI_DTYPE_Q8_0:
    case COLIBRI_DTYPE_Q4_0:
    case COLIBRI_DTYPE_Q5_0:
    case COLIBRI_DTYPE_IQ4_NL: return 0;
    case COLIBRI_DTYPE_Q3_K:
    case COLIBRI_DTYPE_Q6_K: return (int)cb_dtype_block_bytes(dt) - 2;
    default: return -1;
    }
}
/* A row's bytes in the copy (the offset of group g is g * 8 times this): the row-major row's. */
static inline uint64_t cb_qpanel_row_bytes(uint32_t dt, uint64_t K) { return cb_row_bytes(dt, K); }
/* 1 when a matrix [N, K] of dt has a copy: a type of the int8 path, whole groups of rows. */
int cb_qpanel_takes(uint32_t dt, int64_t N, int64_t K);
/* dst (N * cb_qpanel_row_bytes(dt, K) bytes) = the copy of the row-major src [N, K]. */
void cb_qpanel_pack(void *dst, const void *src, uint32_t dt, int64_t N, int64_t K);

#endif
