/*
 * kernels_neon.c — the "neon" kernel table: AArch64 Advanced SIMD, 4 float lanes.
 *
 * Advanced SIMD (with its FMLA and the f16 conversions) is part of every AArch64 CPU, so
 * this file needs no instruction-set flags and cb_kernels_by_name() enters it on any AArch64
 * CPU. As for the x86 tables, the kernels are kernels_simd.inc; this file maps the vector
 * primitives onto NEON intrinsics (simd_neon.h) and defines the quantized types' unpacking
 * for 4 lanes, so the table is correct by construction wherever the avx2 table is, and
 * test_kernels.c checks it against the reference (under qemu-aarch64 in CI). With 4 lanes
 * the dot tiles take 2 tokens (a gate/up tile's (rows / 2) x tokens values fill one vector);
 * AArch64's 32 vector registers hold them.
 */
#include "cpu/kernels.h"

#if defined(__aarch64__) && defined(__ARM_NEON) && !defined(COLIBRI_NO_SIMD_TABLES)
#include <string.h>

#include "cpu/arm/simd_neon.h"

#define CB_SIMD_NAME "neon"
#define CB_SIMD(name) name##_neon
#define VL 4
#define NT_DOT 2 /* (MR_DOT / 2) * NT_DOT <= VL */

/* four bytes at p (no further: the callers' buffers end on them) */
static inline __attribute__((always_inline)) uint8x8_t load4_u8(const uint8_t *p) {
    uint32_t w;
    memcpy(&w, p, 4);
    return vreinterpret_u8_u32(vdup_n_u32(w));
}
/* v unchanged, but opaque to the compiler: a product passed through it is rounded on its
 * own and never fused with the next addition into an FMA (GNU C contracts a*b-c) */
static inline __attribute__((always_inline)) vf vkeep(vf v) {
    __asm__("" : "+w"(v));
    return v;
}
/* Q4_K: vq4_idx widens 4 bytes of nibbles at p into lanes; vq4 gives the values of their low
 * (or, when hi, high) nibbles for a sub-block with value(q) = dl * q - ml, computed as the
 * reference does (no table: tab is unused, as in the avx2 table) */
typedef uint32x4_t vqi;
static inline __attribute__((always_inline)) vf vq4_table(float dl, float ml) {
    (void)dl;
    (void)ml;
    return vzero();
}
static inline __attribute__((always_inline)) vqi vq4_idx(const uint8_t *p) {
    return vmovl_u16(vget_low_u16(vmovl_u8(load4_u8(p))));
}
/* the lanes' bits s .. s + log2(m + 1) of i (m a mask of low bits), as float (exact) */
static inline __attribute__((always_inline)) vf vbits_f(vqi i, int s, int m) {
    uint32x4_t v = vshlq_u32(i, vdupq_n_s32(-s));
    if ((m + 1) >> (8 - s) == 0) v = vandq_u32(v, vdupq_n_u32((uint32_t)m)); /* as kernels_avx2.c */
    return vcvtq_f32_u32(v);
}
/* lane l: bit e0 + l of bits, as float (0 or 1) */
static inline __attribute__((always_inline)) vf vbit_lanes_f(uint32_t bits, int e0) {
    const int32_t iota[4] = {0, 1, 2, 3};
    int32x4_t s = vnegq_s32(vaddq_s32(vdupq_n_s32(e0), vld1q_s32(iota))); /* negative: right shifts */
    return vcvtq_f32_u32(vandq_u32(vshlq_u32(vdupq_n_u32(bits), s), vdupq_n_u32(1)));
}
/* Q5 codes in lanes, as kernels_avx2.c's */
static inline __attribute__((always_inline)) vf vq5_lanes(vqi i, int s, uint32_t qh, int e0) {
    const int32_t iota[4] = {0, 1, 2, 3};
    uint32x4_t nib = s ? vshlq_u32(i, vdupq_n_s32(-s)) : vandq_u32(i, vdupq_n_u32(15));
    int32x4_t cnt = vnegq_s32(vaddq_s32(vdupq_n_s32(e0 >= 4 ? e0 - 4 : e0), vld1q_s32(iota))); /* right shifts */
    uint32x4_t hb = vshlq_u32(vdupq_n_u32(e0 >= 4 ? qh : qh << 4), cnt);
    return vcvtq_f32_u32(vorrq_u32(nib, vandq_u32(hb, vdupq_n_u32(16))));
}
static inline __attribute__((always_inline)) vf vq4(vqi i, int hi, vf tab, float dl, float ml) {
    (void)tab;
    if (hi) i = vshrq_n_u32(i, 4); /* bytes: the high nibble alone */
    else i = vandq_u32(i, vdupq_n_u32(15));
    vf q = vcvtq_f32_u32(i);
    return vfmaq_f32(vdupq_n_f32(-ml), vdupq_n_f32(dl), q); /* dl * q exact: one rounding either way */
}
/* Q6_K: the 128 6-bit values of one half (docs/format.md) into out[0..128), as bytes in
 * element order, from 64 bytes of ql and 32 of qh, 16 values per step */
static inline __attribute__((always_inline)) void vq6_half(const uint8_t *ql, const uint8_t *qh, uint8_t *out) {
    const uint8x16_t m4 = vdupq_n_u8(0x0F), m30 = vdupq_n_u8(0x30);
    for (int j = 0; j < 32; j += 16) {
        uint8x16_t l0 = vld1q_u8(ql + j), l1 = vld1q_u8(ql + 32 + j), h = vld1q_u8(qh + j);
        vst1q_u8(out + j, vorrq_u8(vandq_u8(l0, m4), vandq_u8(vshlq_n_u8(h, 4), m30)));
        vst1q_u8(out + 32 + j, vorrq_u8(vandq_u8(l1, m4), vandq_u8(vshlq_n_u8(h, 2), m30)));
        vst1q_u8(out + 64 + j, vorrq_u8(vshrq_n_u8(l0, 4), vandq_u8(h, m30)));
        vst1q_u8(out + 96 + j, vorrq_u8(vshrq_n_u8(l1, 4), vandq_u8(vshrq_n_u8(h, 2), m30)));
    }
}
/* Q5_K values of VL elements: the nibbles at qs (low, or high when hi) with bit `bit` of the
 * qh bytes as bit 4, value(q) = dl * q - ml computed as the reference does (tables unused) */
static inline __attribute__((always_inline)) void vq5_tables(float dl, float ml, vf *tab0, vf *tab1) {
    (void)dl;
    (void)ml;
    *tab0 = *tab1 = vzero();
}
static inline __attribute__((always_inline)) vf vq5(const uint8_t *qs, const uint8_t *qh, int hi, int bit, vf tab0,
                                                    vf tab1, float dl, float ml) {
    (void)tab0;
    (void)tab1;
    uint32x4_t q = vmovl_u16(vget_low_u16(vmovl_u8(load4_u8(qs))));
    uint32x4_t h = vmovl_u16(vget_low_u16(vmovl_u8(load4_u8(qh))));
    if (hi) q = vshrq_n_u32(q, 4); /* bytes: the high nibble alone */
    else q = vandq_u32(q, vdupq_n_u32(15));
    h = vandq_u32(vshlq_u32(h, vdupq_n_s32(-bit)), vdupq_n_u32(1)); /* a negative count shifts right */
    q = vorrq_u32(q, vshlq_n_u32(h, 4));
    vf v = vcvtq_f32_u32(q);
    return vfmaq_f32(vdupq_n_f32(-ml), vdupq_n_f32(dl), v); /* dl * v exact, as vq4 */
}
/* VL int8 values widened to float (exact) */
static inline __attribute__((always_inline)) vf vcvt_i8(const int8_t *p) {
    int16x8_t w = vmovl_s8(vreinterpret_s8_u8(load4_u8((const uint8_t *)p)));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(w)));
}
/* VL of the 16 int8 values held in the little-endian words w[0], w[1] (bytes 0..7, 8..15),
 * from byte j, widened to float (exact); a 4-byte load inside one 8-byte store forwards */
static inline __attribute__((always_inline)) vf vcvt_i8_w(const uint64_t w[2], int j) {
    return vcvt_i8((const int8_t *)w + j);
}
/* VL of the 16 6-bit scales and mins of a Q4_K / Q5_K block's scale bytes q (cb_k4_unpack's
 * order), from j, as float */
static inline __attribute__((always_inline)) vf vk4_scales(const uint8_t *q, int j) {
    uint8_t sm[16];
    cb_k4_unpack(q, sm);
    return vcvt_i8((const int8_t *)sm + j); /* values < 64: the same as unsigned */
}

/* MXFP4: the 32 doubled e2m1 values (cb_mxfp4_k2) of a block's 16 code bytes qs, in element
 * order (the low nibbles, then the high ones), by one 16-entry table lookup per half */
static inline __attribute__((always_inline)) void vmx4_bytes(const uint8_t *qs, int8_t *out) {
    static const int8_t k2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    int8x16_t t = vld1q_s8(k2);
    uint8x16_t q = vld1q_u8(qs);
    vst1q_s8(out, vqtbl1q_s8(t, vandq_u8(q, vdupq_n_u8(0x0F))));
    vst1q_s8(out + 16, vqtbl1q_s8(t, vshrq_n_u8(q, 4)));
}

#include "cpu/kernels_simd.inc"

#else /* built for another architecture, or for the fuzzers: no table */
const cb_kernels *cb_kernels_neon(void) { return NULL; }
#endif
