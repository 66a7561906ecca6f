/*
 * fast_avx512.c — the fast mode's "avx512vnni" table (fast.h): the int8 kernels of
 * fast_simd.inc on 512-bit vectors, 16 weight rows per panel, vpdpbusd for the integer dot
 * products (AVX512_VNNI).
 *
 * Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx2 -mfma -mf16c
 * (native/CMakeLists.txt) and entered only after cb_fast_by_name() has checked the CPU and
 * the OS (cpuid leaf 7, XCR0).
 */
#include "cpu/fast.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(COLIBRI_NO_SIMD_TABLES)
#include <immintrin.h>
#include <string.h>

#include "cpu/simd_avx512.h"
#include "cpu/simd_math.h"

#define VL 16
#define FS(name) name##_avx512vnni
#define FS_NAME "avx512vnni"

typedef __m512i vi;

#define FVI static inline __attribute__((always_inline))
FVI vi vi_zero(void) { return _mm512_setzero_si512(); }
FVI vi vi_load(const void *p) { return _mm512_loadu_si512(p); }
FVI void vi_store(void *p, vi v) { _mm512_storeu_si512(p, v); }
FVI vi vi_dot(vi acc, vi w, int32_t b) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(b)); }
FVI vf vf_cvt(vi v) { return _mm512_cvtepi32_ps(v); }
FVI vf vf_load_n(const float *p, int64_t n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p); }
FVI void vf_store_n(float *p, vf v, int64_t n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1u), v); }
/* the 16 x 16 int32 transpose: pairs, quads, then 128-bit lanes */
FVI void vi_transpose(vi r[16]) {
    vi t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* r[4i + j], 128-bit lane L: rows 4i..4i+3 at column 4L + j */
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    vi o[16];
    for (int j = 0; j < 4; j++) {
        vi ab0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), ab1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
        vi cd0 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44), cd1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
        o[j] = _mm512_shuffle_i32x4(ab0, cd0, 0x88);
        o[4 + j] = _mm512_shuffle_i32x4(ab0, cd0, 0xDD);
        o[8 + j] = _mm512_shuffle_i32x4(ab1, cd1, 0x88);
        o[12 + j] = _mm512_shuffle_i32x4(ab1, cd1, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = o[i];
}

#include "cpu/fast_simd.inc"

const cb_fast_kernels *cb_fast_avx512vnni(void) { return &FS(table); }

#else /* built without the flags (not x86, an old compiler) or for the fuzzers: no table */
const cb_fast_kernels *cb_fast_avx512vnni(void) { return NULL; }
#endif

const cb_fast_kernels *cb_fast_avxvnni(void) { return NULL; }
const cb_fast_kernels *cb_fast_avx2(void) { return NULL; }
