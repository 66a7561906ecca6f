/*
 * qpanel.c — packing block-type weights into the interleaved layout (qpanel.h): plain C,
 * run by the thread pool at load (backend/cpu/panels.c), one matrix (or part) per call.
 */
#include "cpu/qpanel.h"

#include <string.h>

#include "cpu/fast.h" /* cb_fast_int8_type */

int cb_qpanel_takes(uint32_t dt, int64_t N, int64_t K) {
    /* the grid types have no interleaved layout: the fast tables unpack their row-major blocks */
    if (cb_dtype_codebook(dt) >= 0) return 0;
    return cb_fast_int8_type(dt) && N > 0 && N % CB_QPANEL_ROWS == 0 && K > 0 && K % cb_dtype_block(dt) == 0;
}

void cb_qpanel_pack(void *dst, const void *src, uint32_t dt, int64_t N, int64_t K) {
    const uint32_t bb = cb_dtype_block_bytes(dt);
    const int split = cb_qpanel_split(dt);
    const uint32_t body = split < 0 ? bb : bb - 2; /* the dwords' bytes */
    const size_t lead = split == 0 ? 16 : 0;   /* the scales before the dwords */
    const int64_t nb = K / cb_dtype_block(dt);
    const size_t rb = (size_t)cb_row_bytes(dt, (uint64_t)K);
    uint8_t *d = (uint8_t *)dst;
    for (int64_t g = 0; g < N / CB_QPANEL_ROWS; g++)
        for (int64_t b = 0; b < nb; b++, d += CB_QPANEL_ROWS * (size_t)bb)
            for (int r = 0; r < CB_QPANEL_ROWS; r++) {
                const uint8_t *blk = (const uint8_t *)src + (size_t)(g * CB_QPANEL_ROWS + r) * rb + (size_t)b * bb;
                const uint8_t *rest = blk + (split == 0 ? 2 : 0);
                for (uint32_t j = 0; j < body / 4; j++) memcpy(d + lead + (8 * (size_t)j + (size_t)r) * 4, rest + 4 * j, 4);
                if (split >= 0) memcpy(d + (split == 0 ? 0 : 8 * (size_t)body) + 2 * (size_t)r, blk + split, 2);
            }
}
