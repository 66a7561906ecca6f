/*
 * simd_avx2.h — the float vector primitives of the avx2 tables (8 float lanes), each a
 * one-line intrinsic: included by kernels_avx2.c (the exact table) and fast_*.c (the fast
 * mode's tables), which are compiled with at least the instruction-set flags these need.
 */
#ifndef COLIBRI_CPU_SIMD_AVX2_H
#define COLIBRI_CPU_SIMD_AVX2_H

#include <immintrin.h>
#include <stdint.h>

#include "colibri.h"

typedef __m256 vf;

static inline __attribute__((always_inline)) vf vzero(void) { return _mm256_setzero_ps(); }
static inline __attribute__((always_inline)) vf vset1(float a) { return _mm256_set1_ps(a); }
static inline __attribute__((always_inline)) vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline __attribute__((always_inline)) void vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline __attribute__((always_inline)) vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline __attribute__((always_inline)) vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline __attribute__((always_inline)) vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline __attribute__((always_inline)) vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline __attribute__((always_inline)) vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline __attribute__((always_inline)) vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline __attribute__((always_inline)) vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline __attribute__((always_inline)) vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline __attribute__((always_inline)) vf vround(vf a) {
    return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* 2^n for integral n in [-127, 128) (the caller clamps): build the exponent field */
static inline __attribute__((always_inline)) vf vpow2i(vf n) {
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
static inline __attribute__((always_inline)) float vhsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* s[i] = vhsum(v[i]) for i < n <= VHSUM_N, bit for bit: the same additions of the same pairs
 * (lanes j and j + 4, then j + 2, j + 1), the vectors reduced together, 8 at a time (21
 * operations for 8 sums). Lanes past n: zero vectors, not stored. */
#define VHSUM_N 16
static inline __attribute__((always_inline)) void vhsum8(float *s, const vf *v, const int n) {
    vf a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) a[i] = i < n ? v[i] : _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) /* [v lo | w lo] + [v hi | w hi] */
        b[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++) /* 128-bit lane k: (vector 4i + k, 4i + 2 + k) x (j, j + 2) */
        c[i] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* lane 4k + m: the sum of vector 2m + k; back in vector order */
    vf r = _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm256_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
    r = _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if (n >= 8) _mm256_storeu_ps(s, r);
    else _mm256_maskstore_ps(s, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), r);
}
static inline __attribute__((always_inline)) void vhsum_n(float *s, const vf *v, const int n) {
    vhsum8(s, v, n);
    if (n > 8) vhsum8(s + 8, v + 8, n - 8);
}
static inline __attribute__((always_inline)) float vhmax(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* VL weights of dtype DT (a compile-time constant after inlining) widened to float */
static inline __attribute__((always_inline)) vf vload_w(const void *p, int64_t k, const uint32_t DT) {
    if (DT == COLIBRI_DTYPE_F32) return _mm256_loadu_ps((const float *)p + k);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + k));
    if (DT == COLIBRI_DTYPE_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}
static inline __attribute__((always_inline)) void vprefetch(const void *p) {
    _mm_prefetch((const char *)p, _MM_HINT_T0);
}
/* into L2 only: for far-ahead streaming prefetches, which would evict L1 lines in use; or
 * non-temporal where the CPU streams faster so (nta: cb_cpu_stream_nta(), read once by the
 * caller) */
static inline __attribute__((always_inline)) void vprefetch_l2(const void *p, int nta) {
    if (nta) _mm_prefetch((const char *)p, _MM_HINT_NTA);
    else _mm_prefetch((const char *)p, _MM_HINT_T1);
}


/* q[j] = t[qs[j] & 15], q[j + 16] = t[qs[j] >> 4] for j < 16: a 16-entry table looked up by
 * the nibbles of 16 bytes (pshufb) */
static inline __attribute__((always_inline)) void vlut16_nibbles(int8_t *q, const uint8_t *qs, const int8_t *t) {
    const __m128i m4 = _mm_set1_epi8(0x0F), tab = _mm_loadu_si128((const __m128i *)(const void *)t);
    __m128i x = _mm_loadu_si128((const __m128i *)(const void *)qs);
    _mm_storeu_si128((__m128i *)(void *)q, _mm_shuffle_epi8(tab, _mm_and_si128(x, m4)));
    _mm_storeu_si128((__m128i *)(void *)(q + 16), _mm_shuffle_epi8(tab, _mm_and_si128(_mm_srli_epi16(x, 4), m4)));
}

#endif
