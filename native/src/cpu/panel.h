/*
 * panel.h — panel copies of BF16 weights: a layout in which a decode step reads 16 rows'
 * weights as one stream of whole vectors, and the kernels of one table that read it.
 *
 * The engine makes the copy at load (backend/cpu/panels.c) when the table it runs (the fast table in
 * fast mode, the exact table in exact mode) points to a cb_panel_kernels, and its kernels
 * give the bits of that table's row-major kernels on the same weights, so results never
 * depend on whether the copy was made (native/tests/test_kernels.c checks every one).
 *
 * The layout of a BF16 matrix [N, K] (N a multiple of 16, K of 32; group size G a multiple
 * of 16): groups of G rows (the last one N mod G), group g at dword g * G * K / 2 (where its
 * first row starts in the row-major matrix); in a group of nv = rows / 16 vectors, the pair q
 * (columns 2q, 2q + 1) of its row 16 v + l at dword (q * nv + v) * 16 + l, the first column
 * in the low half. A decode step then loads 16 rows' pair q as one vector (no transpose), and
 * a group's pairs are one stream. Matrices take G = rows (below). A packed expert's copy
 * (cb_panel_pack_expert) has the same bytes as the expert (docs/format.md, EXPERTS_PACKED):
 * its 2I gate/up rows in that layout with G = gu_rows, of the row sequence holding, for each
 * run of `units` units, their gate rows then their up rows (run [u0, u0 + units) at dword
 * u0 * K); then w2^T [I, H], as it is in the file (CB_PANEL_DOWN_FILE) or by blocks of
 * CB_DOWN_BLOCK rows (block [i0, i0 + ic) at element i0 * H of that region), each block by
 * slabs of down_cols columns (the last one H mod that; slab [c0, c0 + nc) at element ic * c0
 * of the block), a slab either its rows in order, nc elements each (CB_PANEL_DOWN_ROWS), or
 * its pairs of rows in column order (CB_PANEL_DOWN_PAIRS): dword q * nc + c =
 * (w2^T[i0 + 2q, c0 + c], w2^T[i0 + 2q + 1, c0 + c]), the first in the low half.
 *
 * Two layouts exist: fast mode's on AVX512_BF16 (G 64, units 32, w2^T by slabs of 64 columns
 * and pairs of rows: vdpbf16ps takes a row's pair of columns per lane; fast_bf16dp.c) and the
 * exact avx512 table's (G 16, units 16, w2^T by slabs of 32 columns and rows: a group is one
 * row per lane, the f32 chains of the row-major kernels by lanes, and a slab one stream of
 * the down projection's rows; kernels_panels_avx512.inc).
 */
#ifndef COLIBRI_CPU_PANEL_H
#define COLIBRI_CPU_PANEL_H

#include <stdint.h>

#define CB_PANEL_DOWN_COLS 64 /* fast mode's slab columns */
/* How a copy lays out w2^T (above). */
#define CB_PANEL_DOWN_FILE 0
#define CB_PANEL_DOWN_PAIRS 1
#define CB_PANEL_DOWN_ROWS 2
/* The widest rows (K) a panel copy takes: the kernels' stack buffers hold 16 of them. */
#define CB_PANEL_MAX_K 4096
/* The most rows of a group (rows, gu_rows) or of a run's gate and up rows (2 units): the
 * packers keep their row pointers on the stack. */
#define CB_PANEL_MAX_ROWS 128

typedef struct cb_panel_kernels {
    const char *name;
    int64_t rows;      /* a matrix's group rows G; a thread's rows start at multiples of it */
    int64_t units;     /* a packed expert's units per run (I a multiple of it); ranges of units
                        * start at multiples of it */
    int64_t gu_rows;   /* the expert's gate/up group rows: 2 * units, or 16 */
    int64_t down_cols; /* w2^T's slab columns; down_panels' columns start at multiples of it */
    int down_layout;   /* CB_PANEL_DOWN_FILE, _PAIRS or _ROWS */
    /* rows n0 <= n < n1 of the panel matrix P [N, K] into y[t * ldy + n - n0], t < T (n0 a
     * multiple of rows) */
    void (*matmul_panels)(float *y, int64_t ldy, const float *x, const void *P, int64_t T, int64_t N, int64_t K,
                          int64_t n0, int64_t n1);
    /* h[r, i] = silu(gate_i . x_r) * (up_i . x_r) for i0 <= i < i1 of an expert's copy */
    void (*gateup_panels)(float *h, const float *x, const void *expert, int64_t R, int64_t H, int64_t I, int64_t i0,
                          int64_t i1);
    /* the table's expert down projection (output columns c0 <= c < c1) and its block blk's
     * part, on an expert's copy */
    void (*down_panels)(float *y, const float *h, const void *expert, int64_t R, int64_t H, int64_t I, int64_t c0,
                        int64_t c1);
    void (*down_part_panels)(float *part, const float *h, const void *expert, int64_t R, int64_t H, int64_t I,
                             int64_t blk);
} cb_panel_kernels;

/* 1 when a matrix [N, K] has a panel copy */
static inline int cb_panel_takes(int64_t N, int64_t K) {
    return N > 0 && N % 16 == 0 && K % 32 == 0 && K <= CB_PANEL_MAX_K;
}
/* 1 when a packed BF16 expert of hidden H, intermediate I has one in pk's layout */
static inline int cb_panel_takes_expert(const cb_panel_kernels *pk, int64_t H, int64_t I) {
    return pk && cb_panel_takes(16, H) && I > 0 && I % pk->units == 0 &&
           (pk->down_layout != CB_PANEL_DOWN_ROWS || H % pk->down_cols == 0);
}
/* dst [N, K] (N * K / 2 dwords) = the panel layout of rows[n] (n < N, each K bf16), groups of G */
void cb_panel_pack(uint32_t *dst, const uint16_t *const *rows, int64_t N, int64_t K, int64_t G);
/* the copy of a matrix [N, K] (cb_panel_takes) in pk's layout */
void cb_panel_pack_matrix(const cb_panel_kernels *pk, void *dst, const void *src, int64_t N, int64_t K);
/* the copy of one packed BF16 expert (block size B; cb_panel_takes_expert) in pk's layout */
void cb_panel_pack_expert(const cb_panel_kernels *pk, void *dst, const void *src, int64_t H, int64_t I, int64_t B);

#endif
