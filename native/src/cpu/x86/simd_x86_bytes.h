/*
 * simd_x86_bytes.h — the byte unpacking the x86 tables share (kernels_avx2.c,
 * kernels_avx512.c, the fast tables; all compiled with SSSE3's byte shuffle available):
 * MXFP4's codes, the K-quants' 6-bit scales, the IQ4 types' unsigned bytes. kernels_neon.c
 * has its own.
 */
#ifndef COLIBRI_CPU_SIMD_X86_BYTES_H
#define COLIBRI_CPU_SIMD_X86_BYTES_H

#include <immintrin.h>
#include <stdint.h>

#include "core/dtype.h"

/* kvalues_iq4nl + 128 (cb_iq4nl_table's values as unsigned bytes), 16 bytes: the fast
 * tables' IQ4 bytes u by code, one vpshufb */
static inline __attribute__((always_inline)) __m128i iq4nl_lut128(void) {
    return _mm_xor_si128(_mm_loadu_si128((const __m128i *)cb_iq4nl_table()), _mm_set1_epi8((char)0x80));
}

/* MXFP4: the 32 doubled e2m1 values (cb_mxfp4_k2) of a block's 16 code bytes qs, in element
 * order (the low nibbles, then the high ones), by one 16-entry byte shuffle per half */
static inline __attribute__((always_inline)) void vmx4_bytes(const uint8_t *qs, int8_t *out) {
    const __m128i k2 = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    __m128i q = _mm_loadu_si128((const __m128i *)qs);
    _mm_storeu_si128((__m128i *)out, _mm_shuffle_epi8(k2, _mm_and_si128(q, m4)));
    _mm_storeu_si128((__m128i *)(out + 16), _mm_shuffle_epi8(k2, _mm_and_si128(_mm_srli_epi16(q, 4), m4)));
}

/* Q4_K / Q5_K: the 16 6-bit scales and mins of a block's 12 scale bytes q, in cb_k4_unpack's
 * order (sc[0..8), m[0..8)), in one register by two byte shuffles (reads 16 bytes at q). The
 * scalar unpack and the inserts that move its words into a vector measured 1.04x slower on
 * the Q4_K decode tile. Each 16-bit shift's bits that cross into the other byte are masked. */
static inline __attribute__((always_inline)) __m128i vk4_unpack(const uint8_t *q) {
    const __m128i v = _mm_loadu_si128((const __m128i *)q);
    /* sc[0..4) = q[0..4) & 63, sc[4..8) = q[8..12) & 15, m[0..4) = q[4..8) & 63, m[4..8) = q[8..12) >> 4 */
    const __m128i a = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i lo = _mm_or_si128(_mm_and_si128(a, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0)),
                                    _mm_and_si128(_mm_srli_epi16(a, 4), _mm_setr_epi32(0, 0, 0, 0x0f0f0f0f)));
    /* the top two bits of q[0..4) (sc[4..8)) and of q[4..8) (m[4..8)) as bits 4-5 */
    const __m128i h = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    return _mm_or_si128(lo, _mm_and_si128(_mm_srli_epi16(h, 2), _mm_set1_epi8(0x30)));
}

#endif
