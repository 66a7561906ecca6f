/*
 * quant.c — the reference dequantizers of the block types (docs/format.md, "Version 2"):
 * ggml's Q8_0, Q4_K, Q5_K, Q6_K, MXFP4, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL and IQ4_XS
 * blocks, read byte by byte (no alignment assumed).
 *
 * These are the definition the engine's kernels are tested against, and they give the bits
 * of the `gguf` package's gguf.quants.dequantize (tests/test_quant_native.py): float32
 * products in the order written, the subtraction separate. This file is compiled with
 * -ffp-contract=off (native/CMakeLists.txt) so that no compiler fuses `a * q - m` into an
 * FMA, which would round once instead of twice.
 */
#include "core/dtype.h"

static inline float rd_f16(const uint8_t *p) { return cb_f16_to_f32((uint16_t)(p[0] | (p[1] << 8))); }

void cb_dequant_q8_0(float *dst, const void *src, int64_t n) {
    const uint8_t *b = (const uint8_t *)src;
    for (int64_t i = 0; i < n; i += 32, b += 34) {
        float d = rd_f16(b);
        const int8_t *q = (const int8_t *)(b + 2);
        for (int j = 0; j < 32; j++) dst[i + j] = (float)q[j] * d;
    }
}

/* Q4_K: f16 d, f16 dmin, 12 scale bytes, 128 bytes of nibbles; 64 elements per pair of
 * sub-blocks: low nibbles of qs[0..32) then their high nibbles. */
void cb_dequant_q4_k(float *dst, const void *src, int64_t n) {
    const uint8_t *b = (const uint8_t *)src;
    for (int64_t i = 0; i < n; i += 256, b += 144) {
        float d = rd_f16(b), dmin = rd_f16(b + 2);
        const uint8_t *qs = b + 16;
        uint8_t sm[16];
        cb_k4_unpack(b + 4, sm);
        float *y = dst + i;
        for (int j = 0; j < 8; j += 2, qs += 32, y += 64) {
            float d0 = d * (float)sm[j], n0 = dmin * (float)sm[8 + j];
            float d1 = d * (float)sm[j + 1], n1 = dmin * (float)sm[9 + j];
            for (int l = 0; l < 32; l++) y[l] = d0 * (float)(qs[l] & 0xF) - n0;
            for (int l = 0; l < 32; l++) y[32 + l] = d1 * (float)(qs[l] >> 4) - n1;
        }
    }
}

/* Q5_K: as Q4_K with 32 bytes of high bits (qh) before the nibbles: bit 2p (low nibble) or
 * 2p + 1 (high nibble) of qh[l] for the pair p of sub-blocks. */
void cb_dequant_q5_k(float *dst, const void *src, int64_t n) {
    const uint8_t *b = (const uint8_t *)src;
    for (int64_t i = 0; i < n; i += 256, b += 176) {
        float d = rd_f16(b), dmin = rd_f16(b + 2);
        const uint8_t *qh = b + 16, *qs = b + 48;
        uint8_t sm[16];
        cb_k4_unpack(b + 4, sm);
        float *y = dst + i;
        for (int j = 0; j < 8; j += 2, qs += 32, y += 64) {
            float d0 = d * (float)sm[j], n0 = dmin * (float)sm[8 + j];
            float d1 = d * (float)sm[j + 1], n1 = dmin * (float)sm[9 + j];
            int lo = j, hi = j + 1; /* qh bit of this pair's low and high nibbles */
            for (int l = 0; l < 32; l++)
                y[l] = d0 * (float)((qs[l] & 0xF) | (((qh[l] >> lo) & 1) << 4)) - n0;
            for (int l = 0; l < 32; l++)
                y[32 + l] = d1 * (float)((qs[l] >> 4) | (((qh[l] >> hi) & 1) << 4)) - n1;
        }
    }
}

/* Q6_K: 128 bytes of low nibbles (ql), 64 of 2-bit highs (qh), 16 int8 scales, f16 d. Per
 * half of 128 elements and l < 32: elements l, l+32, l+64, l+96 take the low nibble of
 * ql[l], of ql[l+32], the high nibble of ql[l], of ql[l+32], and bits 0-1, 2-3, 4-5, 6-7 of
 * qh[l]; sub-blocks of 16 elements each have a scale. */
void cb_dequant_q6_k(float *dst, const void *src, int64_t n) {
    const uint8_t *b = (const uint8_t *)src;
    for (int64_t i = 0; i < n; i += 256, b += 210) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = rd_f16(b + 208);
        float *y = dst + i;
        for (int h = 0; h < 2; h++, ql += 64, qh += 32, sc += 8, y += 128) {
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                int q1 = (int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = (d * (float)sc[is + 0]) * (float)q1;
                y[l + 32] = (d * (float)sc[is + 2]) * (float)q2;
                y[l + 64] = (d * (float)sc[is + 4]) * (float)q3;
                y[l + 96] = (d * (float)sc[is + 6]) * (float)q4;
            }
        }
    }
}

/* MXFP4: e (the e8m0 scale byte), then 16 bytes of codes: element j < 16 is the low nibble
 * of qs[j], element j + 16 its high nibble; value = k2[code] * 2^(e - 128), as ggml's
 * dequantize_row_mxfp4 (one product, exact unless it overflows to inf for e >= 253). */
void cb_dequant_mxfp4(float *dst, const void *src, int64_t n) {
    const uint8_t *b = (const uint8_t *)src;
    for (int64_t i = 0; i < n; i += 32, b += 17) {
        float d = cb_e8m0_half(b[0]);
        const uint8_t *qs = b + 1;
        for (int j = 0; j < 16; j++) {
            dst[i + j] = (float)cb_mxfp4_k2(qs[j] & 0xF) * d;
            dst[i + j + 16] = (float)cb_mxfp4_k2(qs[j] >> 4) * d;
        }
    }
}

/* Q4_0: f16 d, 16 bytes of nibbles (element j < 16 the low nibble of qs[j], j + 16 its high
 * nibble); value d * (q - 8). */
void cb_dequant_q4_0(float *dst, const void *src, int64_t n) {
    const uint8_t *b = (const uint8_t *)src;
    for (int64_t i = 0; i < n; i += 32, b += 18) {
        float d = rd_f16(b);
        const uint8_t *qs = b + 2;
        for (int j = 0; j < 16; j++) {
            dst[i + j] = d * (float)((int)(qs[j] & 0xF) - 8);
            dst[i + j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
        }
    }
}

/* Q4_1: f16 d, f16 m, 16 bytes of nibbles as Q4_0; value (d * q) + m. */
void cb_dequant_q4_1(float *dst, const void *src, int64_t n) {
    const uint8_t *b = (const uint8_t *)src;
    for (int64_t i = 0; i < n; i += 32, b += 20) {
        float d = rd_f16(b), m = rd_f16(b + 2);
        const uint8_t *qs = b + 4;
        for (int j = 0; j < 16; j++) {
            dst[i + j] = d * (float)(qs[j] & 0xF) + m;
            dst[i + j + 16] = d * (float)(qs[j] >> 4) + m;
        }
    }
}

/* The 32 high bits of a Q5_0/Q5_1 block (little-endian): bit j is element j's fifth bit. */
static inline uint32_t rd_u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* Q5_0: f16 d, 4 bytes qh, 16 bytes of nibbles; value d * (q - 16). */
void cb_dequant_q5_0(float *dst, const void *src, int64_t n) {
    const uint8_t *b = (const uint8_t *)src;
    for (int64_t i = 0; i < n; i += 32, b += 22) {
        float d = rd_f16(b);
        uint32_t qh = rd_u32(b + 2);
        const uint8_t *qs = b + 6;
        for (int j = 0; j < 16; j++) {
            int q0 = (int)((qs[j] & 0xF) | (((qh >> j) & 1) << 4)) - 16;
            int q1 = (int)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16;
            dst[i + j] = d * (float)q0;
            dst[i + j + 16] = d * (float)q1;
        }
    }
}

/* Q5_1: f16 d, f16 m, 4 bytes qh, 16 bytes of nibbles; value (d * q) + m. */
void cb_dequant_q5_1(float *dst, const void *src, int64_t n) {
    const uint8_t *b = (const uint8_t *)src;
    for (int64_t i = 0; i < n; i += 32, b += 24) {
        float d = rd_f16(b), m = rd_f16(b + 2);
        uint32_t qh = rd_u32(b + 4);
        const uint8_t *qs = b + 8;
        for (int j = 0; j < 16; j++) {
            uint32_t q0 = (qs[j] & 0xFu) | (((qh >> j) & 1u) << 4);
            uint32_t q1 = (qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4);
            dst[i + j] = d * (float)q0 + m;
            dst[i + j + 16] = d * (float)q1 + m;
        }
    }
}

/* Q2_K: 16 scale bytes (low nibble the scale, high nibble the min of a sub-block of 16),
 * 64 bytes of 2-bit codes, f16 d, f16 dmin. Element 128h + 32j + l (h < 2, j < 4, l < 32)
 * is bits 2j..2j+1 of qs[32h + l]; value (d * sc) * q - (dmin * m). */
void cb_dequant_q2_k(float *dst, const void *src, int64_t n) {
    const uint8_t *b = (const uint8_t *)src;
    for (int64_t i = 0; i < n; i += 256, b += 84) {
        const uint8_t *sc = b, *qs = b + 16;
        float d = rd_f16(b + 80), dmin = rd_f16(b + 82);
        float *y = dst + i;
        for (int e = 0; e < 256; e++) {
            int h = e / 128, j = (e / 32) % 4, l = e % 32;
            float dl = d * (float)(sc[e / 16] & 0xF), ml = dmin * (float)(sc[e / 16] >> 4);
            y[e] = dl * (float)((qs[32 * h + l] >> (2 * j)) & 3) - ml;
        }
    }
}

/* Q3_K: 32 bytes hmask, 64 bytes of 2-bit codes, 12 bytes of 6-bit scales, f16 d. Element
 * 128h + 32j + l: low bits 2j..2j+1 of qs[32h + l], minus 4 where bit 4h + j of hmask[l] is
 * clear; the scale of sub-block s (of 16) has its low four bits from byte s (s < 8) or the
 * high nibble of byte s - 8, its top two from bits 2 (s / 4) of byte 8 + s % 4, minus 32;
 * value (d * scale) * q. */
void cb_dequant_q3_k(float *dst, const void *src, int64_t n) {
    const uint8_t *b = (const uint8_t *)src;
    for (int64_t i = 0; i < n; i += 256, b += 110) {
        const uint8_t *hm = b, *qs = b + 32, *s = b + 96;
        float d = rd_f16(b + 108);
        float dl[16];
        for (int k = 0; k < 16; k++) {
            int lo = k < 8 ? (s[k] & 0xF) : (s[k - 8] >> 4);
            int hi = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
            dl[k] = d * (float)((lo | (hi << 4)) - 32);
        }
        float *y = dst + i;
        for (int e = 0; e < 256; e++) {
            int h = e / 128, j = (e / 32) % 4, l = e % 32;
            int q = (int)((qs[32 * h + l] >> (2 * j)) & 3) - (((hm[l] >> (4 * h + j)) & 1) ? 0 : 4);
            y[e] = dl[e / 16] * (float)q;
        }
    }
}

/* IQ4_NL: f16 d, 16 bytes of codes as Q4_0; value d * kvalues_iq4nl[code]. */
void cb_dequant_iq4_nl(float *dst, const void *src, int64_t n) {
    const uint8_t *b = (const uint8_t *)src;
    for (int64_t i = 0; i < n; i += 32, b += 18) {
        float d = rd_f16(b);
        const uint8_t *qs = b + 2;
        for (int j = 0; j < 16; j++) {
            dst[i + j] = d * (float)cb_iq4nl_value(qs[j] & 0xF);
            dst[i + j + 16] = d * (float)cb_iq4nl_value(qs[j] >> 4);
        }
    }
}

/* IQ4_XS: f16 d, u16 scales_h, 4 bytes scales_l, 128 bytes of codes. Sub-block s (of 32):
 * scale (nibble s % 2 of scales_l[s / 2]) | (bits 2s..2s+1 of scales_h) << 4, minus 32; its
 * codes are qs[16s .. 16s + 16) as Q4_0's; value (d * scale) * kvalues_iq4nl[code]. */
void cb_dequant_iq4_xs(float *dst, const void *src, int64_t n) {
    const uint8_t *b = (const uint8_t *)src;
    for (int64_t i = 0; i < n; i += 256, b += 136) {
        float d = rd_f16(b);
        unsigned sh = (unsigned)b[2] | ((unsigned)b[3] << 8);
        const uint8_t *sl = b + 4, *qs = b + 8;
        for (int s = 0; s < 8; s++) {
            int ls = (int)(((sl[s / 2] >> (4 * (s % 2))) & 0xF) | (((sh >> (2 * s)) & 3) << 4)) - 32;
            float dl = d * (float)ls;
            float *y = dst + i + 32 * s;
            const uint8_t *q = qs + 16 * s;
            for (int j = 0; j < 16; j++) {
                y[j] = dl * (float)cb_iq4nl_value(q[j] & 0xF);
                y[j + 16] = dl * (float)cb_iq4nl_value(q[j] >> 4);
            }
        }
    }
}
