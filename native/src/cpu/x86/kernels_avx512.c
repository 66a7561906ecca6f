/*
 * kernels_avx512.c — the "avx512" kernel table: AVX-512F, 16 float lanes.
 *
 * Compiled with -mavx512f -mavx2 -mfma -mf16c (native/CMakeLists.txt, per-file flags) and
 * only entered when cb_kernels_by_name() has checked the CPU (__builtin_cpu_supports).
 * The kernels are kernels_simd.inc, the same source as the avx2 table; this file only maps
 * the vector primitives onto 512-bit intrinsics (each a one-line, documented equivalent of
 * its AVX2 counterpart), so the table is correct by construction wherever the avx2 table
 * is, and test_kernels.c checks it against the reference on any CPU that has AVX-512F.
 * On a CPU without AVX-512F the table is compiled but never entered.
 */
#include "cpu/kernels.h"

#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(COLIBRI_NO_SIMD_TABLES)
#include <immintrin.h>

#define CB_SIMD_NAME "avx512"
#define CB_SIMD(name) name##_avx512
#define VL 16
/* Float weights decode by 8-row tiles here, block types by 4 rows: on a Zen 4 EPYC each is
 * the faster of the two for its weights (tools/kernel_bench.c and colibri_bench; figures in
 * docs/kernels.md, "Decode"). */
#define MR_DEC_F 8
/* and BF16 weights also from panel copies (cpu/panel.h) */
#define CB_SIMD_PANELS "cpu/x86/kernels_panels_avx512.inc"

#include "cpu/x86/simd_avx512.h"

/* Q4_K: vq4_idx widens VL bytes of nibbles at p into lanes; vq4 gives the values of their
 * low (or, when hi, high) nibbles for a sub-block with value(q) = dl * q - ml. AVX-512 looks
 * them up in tab (vq4_table: the 16 values, each computed as the reference does), one
 * permute per vector; the lanes of one vq4_idx serve both nibbles. */
typedef __m512i vqi;
static inline __attribute__((always_inline)) vf vq4_table(float dl, float ml);
static inline __attribute__((always_inline)) vqi vq4_idx(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
/* the lanes' bits s .. s + log2(m + 1) of i (m a mask of low bits), as float (exact) */
static inline __attribute__((always_inline)) vf vbits_f(vqi i, int s, int m) {
    __m512i v = _mm512_srli_epi32(i, (unsigned)s);
    if ((m + 1) >> (8 - s) == 0) v = _mm512_and_si512(v, _mm512_set1_epi32(m)); /* as kernels_avx2.c */
    return _mm512_cvtepi32_ps(v);
}
/* lane l: bit e0 + l of bits, as float (0 or 1) */
static inline __attribute__((always_inline)) vf vbit_lanes_f(uint32_t bits, int e0) {
    __m512i s = _mm512_add_epi32(_mm512_set1_epi32(e0),
                                 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)bits), s), _mm512_set1_epi32(1)));
}
/* Q5 codes in lanes, as kernels_avx2.c's (the avx512 table's Q5 tiles look their values up
 * instead: vtab32) */
static inline __attribute__((always_inline)) vf vq5_lanes(vqi i, int s, uint32_t qh, int e0) {
    __m512i nib = s ? _mm512_srli_epi32(i, (unsigned)s) : _mm512_and_si512(i, _mm512_set1_epi32(15));
    __m512i cnt = _mm512_add_epi32(_mm512_set1_epi32(e0 >= 4 ? e0 - 4 : e0),
                                   _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    __m512i hb = _mm512_srlv_epi32(_mm512_set1_epi32((int)(e0 >= 4 ? qh : qh << 4)), cnt);
    return _mm512_cvtepi32_ps(_mm512_or_si512(nib, _mm512_and_si512(hb, _mm512_set1_epi32(16))));
}
static inline __attribute__((always_inline)) vf vq4(vqi i, int hi, vf tab, float dl, float ml) {
    (void)dl;
    (void)ml;
    if (hi) i = _mm512_srli_epi32(i, 4);
    return _mm512_permutexvar_ps(i, tab); /* the low 4 bits of each index select */
}
/* Q6_K: the 128 6-bit values of one half (docs/format.md) into out[0..128), as bytes in
 * element order, from 64 bytes of ql and 32 of qh, with six 512-bit operations for each
 * 64 values (AVX-512F only: 32-bit shifts, the masks drop what crossed a byte) */
static inline __attribute__((always_inline)) void vq6_half(const uint8_t *ql, const uint8_t *qh, uint8_t *out) {
    const __m512i m4 = _mm512_set1_epi32(0x0F0F0F0F), m30 = _mm512_set1_epi32(0x30303030);
    __m512i L = _mm512_loadu_si512((const void *)ql);
    __m256i h = _mm256_loadu_si256((const __m256i *)qh);
    __m512i H = _mm512_inserti64x4(_mm512_castsi256_si512(h), h, 1); /* [qh | qh] */
    /* elements 0..31: low nibbles of ql[0..32), qh bits 0-1; 32..63: of ql[32..64), bits 2-3 */
    const __m512i s0 = _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2, 2, 2);
    /* elements 64..95: high nibbles of ql[0..32), bits 4-5; 96..127: of ql[32..64), bits 6-7 */
    const __m512i s1 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    __m512i z0 = _mm512_or_si512(_mm512_and_si512(L, m4), _mm512_and_si512(_mm512_sllv_epi32(H, s0), m30));
    __m512i z1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(L, 4), m4),
                                 _mm512_and_si512(_mm512_srlv_epi32(H, s1), m30));
    _mm512_storeu_si512((void *)out, z0);
    _mm512_storeu_si512((void *)(out + 64), z1);
}
/* Q5_K values of VL elements: the nibbles at qs (low, or high when hi) with bit `bit` of the
 * qh bytes as bit 4, for a sub-block with value(q) = dl * q - ml: looked up in the 32 values
 * tab0 (q < 16), tab1 (q >= 16) (vq5_tables), one two-table permute per vector */
static inline __attribute__((always_inline)) vf vq5(const uint8_t *qs, const uint8_t *qh, int hi, int bit, vf tab0,
                                                    vf tab1, float dl, float ml) {
    (void)dl;
    (void)ml;
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qh));
    if (hi) q = _mm512_srli_epi32(q, 4);
    h = bit <= 4 ? _mm512_slli_epi32(h, 4 - bit) : _mm512_srli_epi32(h, bit - 4); /* the bit at bit 4 */
    /* bits 0-3 from q, bit 4 (and higher, which the permute ignores) from h */
    __m512i idx = _mm512_ternarylogic_epi32(q, h, _mm512_set1_epi32(15), 0xE4);
    return _mm512_permutex2var_ps(tab0, idx, tab1);
}
/* VL int8 values widened to float (exact) */
static inline __attribute__((always_inline)) vf vcvt_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* VL of the 16 int8 values held in the little-endian words w[0], w[1] (bytes 0..7, 8..15),
 * from byte j, widened to float (exact) from registers: a vector load of bytes just stored
 * by narrower scalar stores waits for them to retire (no store forwarding) */
static inline __attribute__((always_inline)) vf vcvt_i8_w(const uint64_t w[2], int j) {
    (void)j; /* 0: VL is 16 */
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_set_epi64x((long long)w[1], (long long)w[0])));
}
/* v unchanged, but opaque to the compiler: a product passed through it is rounded on its
 * own and never fused with the next addition into an FMA (GNU C contracts a*b-c) */
static inline __attribute__((always_inline)) vf vkeep(vf v) {
    __asm__("" : "+v"(v));
    return v;
}

/* The byte-decoded 4-bit types' values by lookup too (kernels_simd.inc bt_w): 0 + o, 1 + o,
 * ..., 15 + o */
#define CB_VTAB16 1
static inline __attribute__((always_inline)) vf vtab16_iota(float o) {
    return _mm512_add_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_ps(o));
}
/* Q5_0 / Q5_1: the value of element e0 + l (lane l) whose low 4 bits are the low (or, when hi,
 * high) nibble of i's lane and whose fifth is bit e0 + l of qh: t0 for codes 0..15, t1 16..31 */
static inline __attribute__((always_inline)) vf vtab32(vqi i, int hi, vf t0, vf t1, uint32_t qh, int e0) {
    if (hi) i = _mm512_srli_epi32(i, 4);
    const __m512i bit = _mm512_sllv_epi32(_mm512_set1_epi32(1), _mm512_add_epi32(_mm512_set1_epi32(e0),
                                          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)));
    __mmask16 k = _mm512_test_epi32_mask(_mm512_set1_epi32((int)qh), bit);
    return _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(i, t0), k, i, t1);
}
#define CB_Q2K_LOOKUP 1
/* Q2_K (kernels_simd.inc bt_w): the values of one group of 16 elements, a vector, with code
 * shift j; i: its 16 code bytes widened (vq4_idx; a byte's code of shift j at bits 2j, 2j + 1),
 * a, c: the group's factors (a q exact, a q - c rounded once as the reference's). A lane's low
 * four bits hold the codes of shifts j & ~1 and (j | 1), so it looks its value up in the
 * group's 16-entry table of one of them (lane k: code k & 3, or k >> 2), and only j >= 2 shifts. */
static inline __attribute__((always_inline)) vf vq2k(vqi i, int j, vf a, vf c) {
    const vf q = j & 1 ? _mm512_setr_ps(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                       : _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
    if (j >= 2) i = _mm512_srli_epi32(i, 4);
    return _mm512_permutexvar_ps(i, _mm512_fmsub_ps(q, a, c));
}
/* Q3_K (kernels_simd.inc bt_w): the values of one group of 16 elements, a vector: i its 16
 * code bytes widened (the code of shift j at bits 2j, 2j + 1), hm its 16 hmask bytes widened
 * (its bit at `bit`), a the group's factor. Index code | hmask bit << 2 looks the value
 * a (k - 4) up in the group's table, each product the reference's. */
static inline __attribute__((always_inline)) vf vq3k(vqi i, vqi hm, int bit, int j, vf a) {
    const vf q = _mm512_setr_ps(-4, -3, -2, -1, 0, 1, 2, 3, -4, -3, -2, -1, 0, 1, 2, 3);
    if (j) i = _mm512_srli_epi32(i, (unsigned)(2 * j));
    hm = bit >= 2 ? _mm512_srli_epi32(hm, (unsigned)(bit - 2)) : _mm512_slli_epi32(hm, (unsigned)(2 - bit));
    /* bits 0-1 of i, the rest (bit 2: the hmask bit; bit 3 picks a copy) of hm */
    return _mm512_permutexvar_ps(_mm512_ternarylogic_epi32(i, hm, _mm512_set1_epi32(3), 0xE4), vmul(a, q));
}
/* dl * q - ml for q = 0..15 (vq5_tables: 0..31): one fused operation, the reference's two
 * (product, then difference) rounded once, since dl * q is exact (dl = d * sc has at most
 * 17 significant bits, q at most 5) */
static inline __attribute__((always_inline)) vf vq4_table(float dl, float ml) {
    const vf iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_fmsub_ps(iota, vset1(dl), vset1(ml));
}

static inline __attribute__((always_inline)) void vq5_tables(float dl, float ml, vf *tab0, vf *tab1) {
    const vf iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    *tab0 = _mm512_fmsub_ps(iota, vset1(dl), vset1(ml));
    *tab1 = _mm512_fmsub_ps(vadd(iota, vset1(16.0f)), vset1(dl), vset1(ml));
}

#include "cpu/x86/simd_x86_bytes.h"

/* VL of the 16 6-bit scales and mins of a Q4_K / Q5_K block's scale bytes q, from j, as float */
static inline __attribute__((always_inline)) vf vk4_scales(const uint8_t *q, int j) {
    (void)j; /* 0: VL is 16 */
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(vk4_unpack(q)));
}
#include "cpu/kernels_simd.inc"

#else /* built without the instruction-set flags (not x86), or for the fuzzers: no table */
const cb_kernels *cb_kernels_avx512(void) { return NULL; }
#endif
