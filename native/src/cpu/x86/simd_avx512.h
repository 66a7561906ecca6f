/*
 * simd_avx512.h — the float vector primitives of the avx512 tables (16 float lanes), each a
 * one-line intrinsic: included by kernels_avx512.c (the exact table) and fast_*.c (the fast
 * mode's tables), which are compiled with at least the instruction-set flags these need.
 */
#ifndef COLIBRI_CPU_SIMD_AVX512_H
#define COLIBRI_CPU_SIMD_AVX512_H

#include <immintrin.h>
#include <stdint.h>

#include "colibri.h"
#include "cpu/features.h"

typedef __m512 vf;

static inline __attribute__((always_inline)) vf vzero(void) { return _mm512_setzero_ps(); }
static inline __attribute__((always_inline)) vf vset1(float a) { return _mm512_set1_ps(a); }
static inline __attribute__((always_inline)) vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline __attribute__((always_inline)) void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline __attribute__((always_inline)) vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline __attribute__((always_inline)) vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
static inline __attribute__((always_inline)) vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline __attribute__((always_inline)) vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline __attribute__((always_inline)) vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline __attribute__((always_inline)) vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline __attribute__((always_inline)) vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline __attribute__((always_inline)) vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline __attribute__((always_inline)) vf vround(vf a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* 2^n for integral n in [-127, 128) (the caller clamps): build the exponent field */
static inline __attribute__((always_inline)) vf vpow2i(vf n) {
    __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}
/* lanes j and j + 8 added, then j + 4, j + 2, j + 1 (GCC's _mm512_reduce_add_ps, written out
 * so that vhsum_n's tree is this one whatever the compiler) */
static inline __attribute__((always_inline)) float vhsum(vf v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
/* s[i] = vhsum(v[i]) for i < n <= VHSUM_N, bit for bit: the same additions of the same pairs
 * (lanes j and j + 8, then j + 4, j + 2, j + 1; float addition is commutative), but the
 * vectors reduced together, two shuffles and one add per pair of vectors and level (45 in
 * all for 16 sums, against about 7 per vhsum). Lanes past n: zero vectors, not stored. */
#define VHSUM_N 16
static inline __attribute__((always_inline)) void vhsum_n(float *s, const vf *v, const int n) {
    vf a[16], b[8], c[4], d[2];
    for (int i = 0; i < 16; i++) a[i] = i < n ? v[i] : _mm512_setzero_ps();
    for (int i = 0; i < 8; i++) /* [v lo 256 | w lo 256] + [v hi 256 | w hi 256] */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++) /* 128-bit lane k of c[i]: vector 4i + k, pairs (j, j + 4) added */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; i++) /* lane k: (vector 8i + k, 8i + 4 + k) x (j, j + 2) */
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* lane 4k + m: the sum of vector 4m + k; back in vector order */
    vf r = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
    r = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
    if (n == 16) _mm512_storeu_ps(s, r);
    else _mm512_mask_storeu_ps(s, (__mmask16)((1u << n) - 1u), r);
}
static inline __attribute__((always_inline)) float vhmax(vf v) { return _mm512_reduce_max_ps(v); }
/* VL weights of dtype DT (a compile-time constant after inlining) widened to float */
static inline __attribute__((always_inline)) vf vload_w(const void *p, int64_t k, const uint32_t DT) {
    if (DT == COLIBRI_DTYPE_F32) return _mm512_loadu_ps((const float *)p + k);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + k));
    if (DT == COLIBRI_DTYPE_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}
static inline __attribute__((always_inline)) void vprefetch(const void *p) {
    _mm_prefetch((const char *)p, _MM_HINT_T0);
}
/* into L2 only: for far-ahead streaming prefetches, which would evict L1 lines in use; or
 * non-temporal where the CPU streams faster so (nta: cb_cpu_stream_nta(), cpu/features.h
 * CB_CPU_STREAM_NTA, read once by the caller: exact decode of a Q4_K_M file 1.12x on a Zen 5) */
static inline __attribute__((always_inline)) void vprefetch_l2(const void *p, int nta) {
    if (nta) _mm_prefetch((const char *)p, _MM_HINT_NTA);
    else _mm_prefetch((const char *)p, _MM_HINT_T1);
}


/* the 16 x 16 int32 transpose, in place: r[i] lane j <-> r[j] lane i (pairs, quads, then
 * 128-bit lanes; AVX-512F only) */
static inline __attribute__((always_inline)) void tr16x16_epi32(__m512i r[16]) {
    __m512i t[16];
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
    __m512i o[16];
    for (int j = 0; j < 4; j++) {
        __m512i ab0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), ab1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
        __m512i cd0 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44), cd1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
        o[j] = _mm512_shuffle_i32x4(ab0, cd0, 0x88);
        o[4 + j] = _mm512_shuffle_i32x4(ab0, cd0, 0xDD);
        o[8 + j] = _mm512_shuffle_i32x4(ab1, cd1, 0x88);
        o[12 + j] = _mm512_shuffle_i32x4(ab1, cd1, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = o[i];
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
