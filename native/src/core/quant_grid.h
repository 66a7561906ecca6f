/*
 * quant_grid.h — the grid types' blocks (core/quant_grid.c) decoded into small integers and
 * factors, shared by the SIMD kernel tables (kernels_simd.inc's exact tiles) and the fast
 * mode's definition (fast.h's cb_fast_unpack): plain C, inline, compiled by each table.
 */
#ifndef COLIBRI_CORE_QUANT_GRID_H
#define COLIBRI_CORE_QUANT_GRID_H

#include <stdint.h>
#include <string.h>

#include "core/dtype.h"

#define CB_QG static inline __attribute__((always_inline))

/* The grid types (core/quant_grid.c), decoded a block at a time: each group of 8 weights' codebook
 * entry as bytes q (IQ2 / IQ3: the magnitudes, below 64; IQ1: 8 g +- 1, g the entry's -1, 0, 1),
 * per 16 weights a factor a, and per 32 a sign word (bit j: weight j negative; 0 for IQ1), so
 * that grid_dequant's (a * q) * sign is the reference's value bit for bit: IQ2 / IQ3 the same
 * product db * g, then the same sign; IQ1 a = dl / 8 (exact), and dl * (g +- 0.125) is the same
 * real number as (dl / 8) * (8 g +- 1), rounded once. */
CB_QG uint64_t grid_u64(const uint8_t *p, int n) { /* n = 8, or 4 (zero-extended) */
    uint64_t v = 0;
    memcpy(&v, p, (size_t)n);
    return v;
}
CB_QG uint64_t grid_byte_add(uint64_t x, uint64_t y) { /* bytewise x + y mod 256, no carries between bytes */
    const uint64_t H = 0x8080808080808080ull;
    return ((x & ~H) + (y & ~H)) ^ ((x ^ y) & H);
}
/* ggml's 7-bit sign pattern widened to 8 bits (bit 7 set where the 7 have odd parity) */
CB_QG unsigned grid_ksigns(unsigned k) { return k | (unsigned)(__builtin_popcount(k) & 1) << 7; }
CB_QG uint32_t grid_rd32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
/* two 8-byte or four 4-byte entries stored as one 16-byte vector: the 16-byte loads of the
 * codes that follow are then forwarded from one store (from two 8-byte stores a load waits for
 * both to reach the cache) */
typedef uint64_t grid_u64x2 __attribute__((vector_size(16)));
typedef uint32_t grid_u32x4 __attribute__((vector_size(16)));
CB_QG void grid_put2(uint8_t *q, const uint8_t *e0, const uint8_t *e1) {
    grid_u64x2 v = {grid_u64(e0, 8), grid_u64(e1, 8)};
    memcpy(q, &v, 16);
}
CB_QG void grid_put4(uint8_t *q, const uint8_t *e0, const uint8_t *e1, const uint8_t *e2, const uint8_t *e3) {
    uint32_t w0, w1, w2, w3;
    memcpy(&w0, e0, 4);
    memcpy(&w1, e1, 4);
    memcpy(&w2, e2, 4);
    memcpy(&w3, e3, 4);
    grid_u32x4 v = {w0, w1, w2, w3};
    memcpy(q, &v, 16);
}
CB_QG void cb_grid_decode(const uint8_t *b, uint8_t *q, float *a, uint32_t *sg, const uint32_t DT) {
    const uint8_t *grid = cb_codebook(cb_dtype_codebook(DT));
    for (int s = 0; s < 8; s++) {
        uint8_t *qs8 = q + 32 * s;
        uint32_t w = 0;
        if (DT == COLIBRI_DTYPE_IQ2_XXS) {
            const uint8_t *p = b + 2 + 8 * s;
            const uint32_t aux = grid_rd32(p + 4);
            a[2 * s] = a[2 * s + 1] = cb_f16_at(b) * (0.5f + (float)(aux >> 28)) * 0.25f;
            grid_put2(qs8, grid + 8 * p[0], grid + 8 * p[1]);
            grid_put2(qs8 + 16, grid + 8 * p[2], grid + 8 * p[3]);
            for (int l = 0; l < 4; l++) w |= grid_ksigns((aux >> (7 * l)) & 127) << (8 * l);
        } else if (DT == COLIBRI_DTYPE_IQ2_XS || DT == COLIBRI_DTYPE_IQ2_S) {
            const float d = cb_f16_at(b);
            const uint8_t sc = b[DT == COLIBRI_DTYPE_IQ2_XS ? 66 + s : 74 + s];
            a[2 * s] = d * (0.5f + (float)(sc & 0xF)) * 0.25f;
            a[2 * s + 1] = d * (0.5f + (float)(sc >> 4)) * 0.25f;
            unsigned idx[4];
            for (int l = 0; l < 4; l++) {
                if (DT == COLIBRI_DTYPE_IQ2_XS) {
                    const unsigned v = (unsigned)b[2 + 2 * (4 * s + l)] | (unsigned)b[3 + 2 * (4 * s + l)] << 8;
                    idx[l] = v & 511;
                    w |= grid_ksigns(v >> 9) << (8 * l);
                } else {
                    idx[l] = b[2 + 4 * s + l] | (((unsigned)b[66 + s] >> (2 * l)) & 3) << 8;
                    w |= (uint32_t)b[34 + 4 * s + l] << (8 * l);
                }
            }
            grid_put2(qs8, grid + 8 * idx[0], grid + 8 * idx[1]);
            grid_put2(qs8 + 16, grid + 8 * idx[2], grid + 8 * idx[3]);
        } else if (DT == COLIBRI_DTYPE_IQ3_XXS) {
            const uint8_t *p = b + 2 + 8 * s;
            const uint32_t aux = grid_rd32(b + 66 + 4 * s);
            a[2 * s] = a[2 * s + 1] = cb_f16_at(b) * (0.5f + (float)(aux >> 28)) * 0.5f;
            grid_put4(qs8, grid + 4 * p[0], grid + 4 * p[1], grid + 4 * p[2], grid + 4 * p[3]);
            grid_put4(qs8 + 16, grid + 4 * p[4], grid + 4 * p[5], grid + 4 * p[6], grid + 4 * p[7]);
            for (int l = 0; l < 4; l++) w |= grid_ksigns((aux >> (7 * l)) & 127) << (8 * l);
        } else if (DT == COLIBRI_DTYPE_IQ3_S) {
            a[2 * s] = a[2 * s + 1] = cb_f16_at(b) * (float)(1 + 2 * ((b[106 + s / 2] >> (4 * (s % 2))) & 0xF));
            const unsigned qh = b[66 + s];
            const uint8_t *e[8];
            for (int l = 0; l < 8; l++) e[l] = grid + 4 * (b[2 + 8 * s + l] | ((qh >> l) & 1) << 8);
            grid_put4(qs8, e[0], e[1], e[2], e[3]);
            grid_put4(qs8 + 16, e[4], e[5], e[6], e[7]);
            w = grid_rd32(b + 74 + 4 * s);
        } else { /* IQ1_S, IQ1_M: 8 g +- 1 from the int8 entries (-1, 0, 1) */
            unsigned neg[4], hi[4];
            if (DT == COLIBRI_DTYPE_IQ1_S) {
                const unsigned qh = (unsigned)b[34 + 2 * s] | (unsigned)b[35 + 2 * s] << 8;
                a[2 * s] = a[2 * s + 1] = cb_f16_at(b) * (float)(2 * ((qh >> 12) & 7) + 1) * 0.125f;
                for (int l = 0; l < 4; l++) {
                    hi[l] = (qh >> (3 * l)) & 7;
                    neg[l] = qh >> 15;
                }
            } else {
                const uint16_t sc[4] = {(uint16_t)(b[48] | b[49] << 8), (uint16_t)(b[50] | b[51] << 8),
                                        (uint16_t)(b[52] | b[53] << 8), (uint16_t)(b[54] | b[55] << 8)};
                const uint16_t dh = (uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) | ((sc[2] >> 4) & 0x0F00) |
                                               (sc[3] & 0xF000));
                const float d = cb_f16_table[dh];
                const unsigned v = sc[s / 2] >> (6 * (s % 2));
                a[2 * s] = d * (float)(2 * (v & 7) + 1) * 0.125f;
                a[2 * s + 1] = d * (float)(2 * ((v >> 3) & 7) + 1) * 0.125f;
                for (int l = 0; l < 4; l++) {
                    const unsigned h = (b[32 + 2 * s + l / 2] >> (4 * (l % 2))) & 0xF;
                    hi[l] = h & 7;
                    neg[l] = h >> 3;
                }
            }
            const uint8_t *p = DT == COLIBRI_DTYPE_IQ1_S ? b + 2 + 4 * s : b + 4 * s;
            uint64_t v[4];
            for (int l = 0; l < 4; l++) {
                const uint64_t g = grid_u64(grid + 8 * (p[l] | hi[l] << 8), 8);
                v[l] = grid_byte_add((g << 3) & 0xF8F8F8F8F8F8F8F8ull, neg[l] ? 0xFFFFFFFFFFFFFFFFull : 0x0101010101010101ull);
            }
            grid_put2(qs8, (const uint8_t *)&v[0], (const uint8_t *)&v[1]);
            grid_put2(qs8 + 16, (const uint8_t *)&v[2], (const uint8_t *)&v[3]);
        }
        sg[s] = w;
    }
}
#endif
