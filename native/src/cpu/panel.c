/*
 * panel.c — packing BF16 weights into the panel layout (panel.h): plain C, run by the thread
 * pool at load (backend/cpu/panels.c), one matrix or expert per call.
 */
#include "cpu/panel.h"

#include <string.h>

#include "cpu/kernels.h" /* CB_DOWN_BLOCK */

void cb_panel_pack(uint32_t *dst, const uint16_t *const *rows, int64_t N, int64_t K, int64_t G) {
    int64_t np = K / 2;
    for (int64_t g0 = 0; g0 < N; g0 += G) {
        int64_t nv = (N - g0 < G ? N - g0 : G) / 16;
        uint32_t *d = dst + (size_t)g0 * (size_t)np;
        for (int64_t q0 = 0; q0 < np; q0 += 16) /* 16 pairs (a line) of each row at a time */
            for (int64_t v = 0; v < nv; v++)
                for (int64_t l = 0; l < 16; l++) {
                    const uint16_t *r = rows[g0 + 16 * v + l];
                    for (int64_t q = q0; q < q0 + 16 && q < np; q++) {
                        uint32_t p;
                        memcpy(&p, r + 2 * q, 4);
                        d[(q * nv + v) * 16 + l] = p;
                    }
                }
    }
}

void cb_panel_pack_matrix(const cb_panel_kernels *pk, void *dst, const void *src, int64_t N, int64_t K) {
    const uint16_t *rows[CB_PANEL_MAX_ROWS];
    int64_t G = pk->rows;
    for (int64_t g0 = 0; g0 < N; g0 += G) {
        int64_t n = N - g0 < G ? N - g0 : G;
        for (int64_t r = 0; r < n; r++) rows[r] = (const uint16_t *)src + (size_t)(g0 + r) * (size_t)K;
        cb_panel_pack((uint32_t *)dst + (size_t)g0 * (size_t)(K / 2), rows, n, K, G);
    }
}

void cb_panel_pack_expert(const cb_panel_kernels *pk, void *dst, const void *src, int64_t H, int64_t I, int64_t B) {
    const uint16_t *rows[CB_PANEL_MAX_ROWS], *w = (const uint16_t *)src;
    int64_t U = pk->units;
    for (int64_t u0 = 0; u0 < I; u0 += U) {
        int64_t nu = I - u0 < U ? I - u0 : U;
        for (int64_t k = 0; k < nu; k++) { /* unit i's gate row in the file: block i / B, nb rows of gate then up */
            int64_t i = u0 + k, bs = i / B * B, nb = I - bs < B ? I - bs : B;
            rows[k] = w + (size_t)(2 * bs + (i - bs)) * (size_t)H;
            rows[nu + k] = rows[k] + (size_t)nb * (size_t)H;
        }
        cb_panel_pack((uint32_t *)dst + (size_t)u0 * (size_t)H, rows, 2 * nu, H, pk->gu_rows);
    }
    const uint16_t *w2 = w + (size_t)2 * (size_t)I * (size_t)H;
    uint16_t *d2 = (uint16_t *)dst + (size_t)2 * (size_t)I * (size_t)H;
    if (pk->down_layout == CB_PANEL_DOWN_FILE) {
        memcpy(d2, w2, (size_t)I * (size_t)H * 2u);
        return;
    }
    for (int64_t i0 = 0; i0 < I; i0 += CB_DOWN_BLOCK) { /* w2^T by blocks and slabs */
        int64_t ic = I - i0 < CB_DOWN_BLOCK ? I - i0 : CB_DOWN_BLOCK;
        for (int64_t c0 = 0; c0 < H; c0 += pk->down_cols) {
            int64_t nc = H - c0 < pk->down_cols ? H - c0 : pk->down_cols;
            uint16_t *d = d2 + (size_t)i0 * (size_t)H + (size_t)ic * (size_t)c0;
            if (pk->down_layout == CB_PANEL_DOWN_ROWS) { /* its rows in order */
                for (int64_t i = 0; i < ic; i++)
                    memcpy(d + i * nc, w2 + (size_t)(i0 + i) * (size_t)H + c0, (size_t)nc * 2u);
                continue;
            }
            uint32_t *dp = (uint32_t *)d; /* its pairs of rows, in column order */
            for (int64_t q = 0; q < ic / 2; q++) {
                const uint16_t *a = w2 + (size_t)(i0 + 2 * q) * (size_t)H + c0, *b = a + H;
                for (int64_t c = 0; c < nc; c++) dp[q * nc + c] = (uint32_t)a[c] | (uint32_t)b[c] << 16;
            }
        }
    }
}
