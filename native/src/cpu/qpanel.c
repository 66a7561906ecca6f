/*
 * qpanel.c — packing block-type weights into the interleaved layout (qpanel.h): plain C,
 * run by the thread pool at load (backend/cpu/panels.c), one matrix (or part) per call.
 */
#include "cpu/qpanel.h"

#include <string.h>

#include "cpu/fast.h" /* cb_fast_int8_type */

int cb_qpanel_takes(uint32_t dt, int64_t N, int64_t K) {
    return cb_fast_int8_type(dt) && N > 0 && N % CB_QPANEL_ROWS == 0 && K > 0 && K % cb_dtype_block(dt) == 0;
}

void cb_qpanel_pack(void *dst, const void *src, uint32_t dt, int64_t N, int64_t K) {
    const uint32_t bb = cb_dtype_block_bytes(dt), bbp = cb_qpanel_block_bytes(dt), lead = cb_qpanel_lead(dt);
    const int64_t nb = K / cb_dtype_block(dt);
    const size_t rb = (size_t)cb_row_bytes(dt, (uint64_t)K);
    uint8_t pad[CB_QPANEL_ROWS][256];
    for (int64_t g = 0; g < N / CB_QPANEL_ROWS; g++) {
        uint8_t *d = (uint8_t *)dst + (size_t)g * CB_QPANEL_ROWS * (size_t)nb * bbp;
        for (int64_t b = 0; b < nb; b++, d += CB_QPANEL_ROWS * bbp) {
            for (int r = 0; r < CB_QPANEL_ROWS; r++) {
                memset(pad[r], 0, bbp);
                memcpy(pad[r] + lead, (const uint8_t *)src + (size_t)(g * CB_QPANEL_ROWS + r) * rb + (size_t)b * bb, bb);
            }
            for (uint32_t j = 0; j < bbp / 4; j++)
                for (int r = 0; r < CB_QPANEL_ROWS; r++) memcpy(d + (8 * (size_t)j + (size_t)r) * 4, pad[r] + 4 * j, 4);
        }
    }
}
