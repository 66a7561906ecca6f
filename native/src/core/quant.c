/*
 * quant.c — the reference dequantizers of the block types (docs/format.md, "Version 2"):
 * ggml's Q8_0, Q4_K, Q5_K, Q6_K and MXFP4 blocks, read byte by byte (no alignment assumed).
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
