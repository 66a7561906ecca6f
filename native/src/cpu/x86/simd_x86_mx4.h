/*
 * simd_x86_mx4.h — the MXFP4 code unpacking the x86 exact tables share (kernels_avx2.c,
 * kernels_avx512.c; both compiled with SSSE3's byte shuffle available). kernels_neon.c has
 * its own, by TBL.
 */
#ifndef COLIBRI_CPU_SIMD_X86_MX4_H
#define COLIBRI_CPU_SIMD_X86_MX4_H

#include <immintrin.h>
#include <stdint.h>

/* MXFP4: the 32 doubled e2m1 values (cb_mxfp4_k2) of a block's 16 code bytes qs, in element
 * order (the low nibbles, then the high ones), by one 16-entry byte shuffle per half */
static inline __attribute__((always_inline)) void vmx4_bytes(const uint8_t *qs, int8_t *out) {
    const __m128i k2 = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    __m128i q = _mm_loadu_si128((const __m128i *)qs);
    _mm_storeu_si128((__m128i *)out, _mm_shuffle_epi8(k2, _mm_and_si128(q, m4)));
    _mm_storeu_si128((__m128i *)(out + 16), _mm_shuffle_epi8(k2, _mm_and_si128(_mm_srli_epi16(q, 4), m4)));
}

#endif
