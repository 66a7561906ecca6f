/*
 * simd_neon.h — the float vector primitives of the neon tables (4 float lanes, AArch64
 * Advanced SIMD), each a one-line intrinsic with the semantics of its simd_avx2.h
 * counterpart: included by kernels_neon.c (the exact table) and fast_neon*.c (the fast
 * mode's tables). Advanced SIMD is part of every AArch64 CPU, so the exact table needs no
 * flags; the fast tables' extra instructions (dotprod, i8mm) are per-file flags.
 */
#ifndef COLIBRI_CPU_SIMD_NEON_H
#define COLIBRI_CPU_SIMD_NEON_H

#include <arm_neon.h>
#include <stdint.h>

#include "colibri.h"

typedef float32x4_t vf;

static inline __attribute__((always_inline)) vf vzero(void) { return vdupq_n_f32(0.0f); }
static inline __attribute__((always_inline)) vf vset1(float a) { return vdupq_n_f32(a); }
static inline __attribute__((always_inline)) vf vload(const float *p) { return vld1q_f32(p); }
static inline __attribute__((always_inline)) void vstore(float *p, vf v) { vst1q_f32(p, v); }
/* a * b + c and c - a * b, fused (FMLA, FMLS), as _mm256_fmadd_ps / _mm256_fnmadd_ps */
static inline __attribute__((always_inline)) vf vfma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
static inline __attribute__((always_inline)) vf vfnma(vf a, vf b, vf c) { return vfmsq_f32(c, a, b); }
static inline __attribute__((always_inline)) vf vadd(vf a, vf b) { return vaddq_f32(a, b); }
static inline __attribute__((always_inline)) vf vsub(vf a, vf b) { return vsubq_f32(a, b); }
static inline __attribute__((always_inline)) vf vmul(vf a, vf b) { return vmulq_f32(a, b); }
static inline __attribute__((always_inline)) vf vdiv(vf a, vf b) { return vdivq_f32(a, b); }
static inline __attribute__((always_inline)) vf vmax(vf a, vf b) { return vmaxq_f32(a, b); }
static inline __attribute__((always_inline)) vf vmin(vf a, vf b) { return vminq_f32(a, b); }
/* to the nearest integer, ties to even (FRINTN), as _MM_FROUND_TO_NEAREST_INT */
static inline __attribute__((always_inline)) vf vround(vf a) { return vrndnq_f32(a); }
/* 2^n for integral n in [-127, 128) (the caller clamps): build the exponent field */
static inline __attribute__((always_inline)) vf vpow2i(vf n) {
    int32x4_t e = vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127));
    return vreinterpretq_f32_s32(vshlq_n_s32(e, 23));
}
/* (v0 + v1) + (v2 + v3) (FADDP twice), and the maximum of the lanes */
static inline __attribute__((always_inline)) float vhsum(vf v) { return vaddvq_f32(v); }
/* s[i] = vhsum(v[i]) for i < n <= VHSUM_N (the x86 tables reduce their vectors together) */
#define VHSUM_N 16
static inline __attribute__((always_inline)) void vhsum_n(float *s, const vf *v, const int n) {
    for (int i = 0; i < n; i++) s[i] = vaddvq_f32(v[i]);
}
static inline __attribute__((always_inline)) float vhmax(vf v) { return vmaxvq_f32(v); }
/* VL weights of dtype DT (a compile-time constant after inlining) widened to float: bf16
 * by a 16-bit left shift, f16 by FCVTL (exact, as cb_f16_to_f32) */
static inline __attribute__((always_inline)) vf vload_w(const void *p, int64_t k, const uint32_t DT) {
    if (DT == COLIBRI_DTYPE_F32) return vld1q_f32((const float *)p + k);
    uint16x4_t h = vld1_u16((const uint16_t *)p + k);
    if (DT == COLIBRI_DTYPE_BF16) return vreinterpretq_f32_u32(vshll_n_u16(h, 16));
    return vcvt_f32_f16(vreinterpret_f16_u16(h));
}
/* PRFM PLDL1KEEP, and PLDL2KEEP for the far-ahead streaming prefetches (nta: the x86 tables'
 * non-temporal hint, which no AArch64 CPU sets) */
static inline __attribute__((always_inline)) void vprefetch(const void *p) { __builtin_prefetch(p, 0, 3); }
static inline __attribute__((always_inline)) void vprefetch_l2(const void *p, int nta) {
    (void)nta;
    __builtin_prefetch(p, 0, 2);
}

/* q[j] = t[qs[j] & 15], q[j + 16] = t[qs[j] >> 4] for j < 16: a 16-entry table looked up by
 * the nibbles of 16 bytes (TBL) */
static inline __attribute__((always_inline)) void vlut16_nibbles(int8_t *q, const uint8_t *qs, const int8_t *t) {
    int8x16_t tab = vld1q_s8(t);
    uint8x16_t x = vld1q_u8(qs);
    vst1q_s8(q, vqtbl1q_s8(tab, vandq_u8(x, vdupq_n_u8(0x0F))));
    vst1q_s8(q + 16, vqtbl1q_s8(tab, vshrq_n_u8(x, 4)));
}

#endif
