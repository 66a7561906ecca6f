/*
 * kernels_avx2.c — the "avx2" kernel table: AVX2 + FMA + F16C, 8 float lanes.
 *
 * This file is compiled with -mavx2 -mfma -mf16c (native/CMakeLists.txt, per-file flags)
 * and only entered when cb_kernels_by_name() has checked the CPU (__builtin_cpu_supports),
 * so the rest of the library stays portable. The kernel bodies are shared with the AVX-512
 * table: this file defines the vector primitives (vf, vload, vfma, ...) for 256-bit
 * vectors and includes kernels_simd.inc, which writes every kernel once in terms of them.
 */
#include "cpu/kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(COLIBRI_NO_SIMD_TABLES)
#include <immintrin.h>

#define CB_SIMD_NAME "avx2"
#define CB_SIMD(name) name##_avx2
#define VL 8

#include "cpu/x86/simd_avx2.h"

/* Q4_K: vq4_idx widens VL bytes of nibbles at p into lanes; vq4 gives the values of their
 * low (or, when hi, high) nibbles for a sub-block with value(q) = dl * q - ml, computed as
 * the reference does (AVX2 has no 16-entry permute of floats, so no table: tab is unused) */
typedef __m256i vqi;
static inline __attribute__((always_inline)) vf vkeep(vf v);
static inline __attribute__((always_inline)) vf vq4_table(float dl, float ml) {
    (void)dl;
    (void)ml;
    return _mm256_setzero_ps();
}
static inline __attribute__((always_inline)) vqi vq4_idx(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
/* Q2_K (kernels_simd.inc bt_w): the values of 8 elements of one group, code shift j; i: their
 * code bytes widened (vq4_idx; the code of shift j at bits 2j, 2j + 1), a, c: the group's
 * factors (a q exact, a q - c rounded once as the reference's). The permute reads a lane's
 * low three bits: after the shift, the code and one bit of the next, so the group's table
 * holds code k mod 4's value at k (the same table for the group's two vectors). */
#define CB_Q2K_LOOKUP 1
static inline __attribute__((always_inline)) vf vq2k(vqi i, int j, vf a, vf c) {
    if (j) i = _mm256_srli_epi32(i, 2 * j);
    return _mm256_permutevar8x32_ps(_mm256_fmsub_ps(_mm256_setr_ps(0, 1, 2, 3, 0, 1, 2, 3), a, c), i);
}
/* the lanes' bits s .. s + log2(m + 1) of i (m a mask of low bits; i's lanes bytes, as
 * vq4_idx makes them), as float (exact); no mask where the shift leaves only those bits */
static inline __attribute__((always_inline)) vf vbits_f(vqi i, int s, int m) {
    __m256i v = _mm256_srli_epi32(i, s);
    if ((m + 1) >> (8 - s) == 0) v = _mm256_and_si256(v, _mm256_set1_epi32(m));
    return _mm256_cvtepi32_ps(v);
}
/* lane l: bit e0 + l of bits, as float (0 or 1) */
static inline __attribute__((always_inline)) vf vbit_lanes_f(uint32_t bits, int e0) {
    __m256i s = _mm256_add_epi32(_mm256_set1_epi32(e0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)bits), s), _mm256_set1_epi32(1)));
}
/* Q5_0 / Q5_1 codes of VL lanes as float (exact): lane l the nibble of i's byte (the high one
 * when s is 4) with bit e0 + l of qh as its bit 4, the bit shifted straight to place (e0 0:
 * from qh << 4, whose bits 4 .. 11 are qh's 0 .. 7) */
static inline __attribute__((always_inline)) vf vq5_lanes(vqi i, int s, uint32_t qh, int e0) {
    __m256i nib = s ? _mm256_srli_epi32(i, s) : _mm256_and_si256(i, _mm256_set1_epi32(15));
    __m256i cnt = _mm256_add_epi32(_mm256_set1_epi32(e0 >= 4 ? e0 - 4 : e0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i hb = _mm256_srlv_epi32(_mm256_set1_epi32((int)(e0 >= 4 ? qh : qh << 4)), cnt);
    return _mm256_cvtepi32_ps(_mm256_or_si256(nib, _mm256_and_si256(hb, _mm256_set1_epi32(16))));
}
static inline __attribute__((always_inline)) vf vq4(vqi i, int hi, vf tab, float dl, float ml) {
    (void)tab;
    if (hi) i = _mm256_srli_epi32(i, 4); /* bytes: the high nibble alone */
    else i = _mm256_and_si256(i, _mm256_set1_epi32(15));
    vf q = _mm256_cvtepi32_ps(i);
    return _mm256_fmsub_ps(_mm256_set1_ps(dl), q, _mm256_set1_ps(ml)); /* dl * q exact: one rounding either way */
}
/* Q6_K: the 128 6-bit values of one half (docs/format.md) into out[0..128), as bytes in
 * element order, from 64 bytes of ql and 32 of qh, 32 values per four 256-bit operations
 * (32-bit shifts: the masks drop what crossed a byte) */
static inline __attribute__((always_inline)) void vq6_half(const uint8_t *ql, const uint8_t *qh, uint8_t *out) {
    const __m256i m4 = _mm256_set1_epi32(0x0F0F0F0F), m30 = _mm256_set1_epi32(0x30303030);
    __m256i l0 = _mm256_loadu_si256((const __m256i *)ql), l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
    __m256i h = _mm256_loadu_si256((const __m256i *)qh);
    __m256i c0 = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi32(h, 4), m30));
    __m256i c1 = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi32(h, 2), m30));
    __m256i c2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(l0, 4), m4), _mm256_and_si256(h, m30));
    __m256i c3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(l1, 4), m4),
                                 _mm256_and_si256(_mm256_srli_epi32(h, 2), m30));
    _mm256_storeu_si256((__m256i *)out, c0);
    _mm256_storeu_si256((__m256i *)(out + 32), c1);
    _mm256_storeu_si256((__m256i *)(out + 64), c2);
    _mm256_storeu_si256((__m256i *)(out + 96), c3);
}
/* Q5_K values of VL elements: the nibbles at qs (low, or high when hi) with bit `bit` of the
 * qh bytes as bit 4, value(q) = dl * q - ml computed as the reference does (tables unused) */
static inline __attribute__((always_inline)) void vq5_tables(float dl, float ml, vf *tab0, vf *tab1) {
    (void)dl;
    (void)ml;
    *tab0 = *tab1 = _mm256_setzero_ps();
}
static inline __attribute__((always_inline)) vf vq5(const uint8_t *qs, const uint8_t *qh, int hi, int bit, vf tab0,
                                                    vf tab1, float dl, float ml) {
    (void)tab0;
    (void)tab1;
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));
    __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qh));
    if (hi) q = _mm256_srli_epi32(q, 4); /* bytes: the high nibble alone */
    else q = _mm256_and_si256(q, _mm256_set1_epi32(15));
    h = _mm256_and_si256(_mm256_srli_epi32(h, bit), _mm256_set1_epi32(1));
    q = _mm256_or_si256(q, _mm256_slli_epi32(h, 4));
    vf v = _mm256_cvtepi32_ps(q);
    return _mm256_fmsub_ps(_mm256_set1_ps(dl), v, _mm256_set1_ps(ml)); /* dl * v exact, as vq4 */
}
/* VL int8 values widened to float (exact) */
static inline __attribute__((always_inline)) vf vcvt_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
/* VL of the 16 int8 values held in the little-endian words w[0], w[1] (bytes 0..7, 8..15),
 * from byte j, widened to float (exact) from registers: a vector load of bytes just stored
 * by narrower scalar stores waits for them to retire (no store forwarding) */
static inline __attribute__((always_inline)) vf vcvt_i8_w(const uint64_t w[2], int j) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128((long long)w[j / 8])));
}
/* v unchanged, but opaque to the compiler: a product passed through it is rounded on its
 * own and never fused with the next addition into an FMA (GNU C contracts a*b-c) */
static inline __attribute__((always_inline)) vf vkeep(vf v) {
    __asm__("" : "+x"(v));
    return v;
}

#include "cpu/x86/simd_x86_bytes.h"

/* VL of the 16 6-bit scales and mins of a Q4_K / Q5_K block's scale bytes q, from j, as float */
static inline __attribute__((always_inline)) vf vk4_scales(const uint8_t *q, int j) {
    const __m128i u = vk4_unpack(q);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(j ? _mm_srli_si128(u, 8) : u));
}
#include "cpu/kernels_simd.inc"

#else /* built without the instruction-set flags (not x86), or for the fuzzers: no table */
const cb_kernels *cb_kernels_avx2(void) { return NULL; }
#endif
