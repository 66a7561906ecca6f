/*
 * fast_neon_bf16.c — the fast mode's BF16 kernels on AArch64 BFDOT (FEAT_BF16: 8 bf16
 * multiply-adds into 4 float32 lanes per instruction, twice an FMLA's), the AArch64
 * counterpart of fast_bf16dp.c. The activations are already rounded to bf16 (backend/cpu/stages.c), so
 * their conversion here is exact.
 *
 * Lanes are outputs: for W [N, K] (a matmul, gate/up) a panel of 4 rows is transposed once per
 * call so that one vector holds a pair of columns of each row, and each token's pairs are
 * taken four at a time (BFDOT's by-element form selects one); for the packed experts' down
 * projection (w2^T [I, H]) the lanes are 4 output columns and two w2^T rows are interleaved
 * into pairs. Every output is one chain of BFDOT over the pairs in ascending order:
 * deterministic and batch-invariant (native/tests/test_kernels.c), not other tables' bits
 * (the instruction's internal rounding is the CPU's: FPCR.EBF on FEAT_EBF16 cores).
 *
 * Compiled with -march=armv8.2-a+dotprod+i8mm+bf16; entered only after cb_fast_by_name
 * ("neon-bf16") has checked HWCAP2_BF16. Buffers on the stack (about 170 KiB at most); rows
 * up to 4096 wide (cb_fast_bf16_k_ok), other shapes take the f32 path.
 */
#include "cpu/fast.h"

#include <string.h>

#if defined(__aarch64__) && defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC) && !defined(COLIBRI_NO_SIMD_TABLES)
#include <arm_neon.h>

#include "cpu/arm/simd_neon.h"
#include "cpu/simd_math.h"

#define DKMAX CB_FAST_BF16_MAX_K /* the longest rows here */
#define DTT 16                   /* tokens per activation tile */

int cb_neonbf16_built(void) { return 1; }

/* the bf16 bits of 4 floats already rounded to bf16 (exact: their high halves) */
static inline uint16x4_t bf16_bits(vf v) { return vshrn_n_u32(vreinterpretq_u32_f32(v), 16); }

/* nt tokens (rows of x, stride ldx) as pairs: xp[t * (K/2) + r] = (x[t][2r], x[t][2r+1]) */
static void pairs_of(uint32_t *xp, const float *x, int64_t ldx, int64_t nt, int64_t K) {
    for (int64_t t = 0; t < nt; t++)
        for (int64_t k = 0; k < K; k += 8)
            vst1q_u16((uint16_t *)(xp + t * (K / 2)) + k,
                      vcombine_u16(bf16_bits(vld1q_f32(x + t * ldx + k)), bf16_bits(vld1q_f32(x + t * ldx + k + 4))));
}

/* the 4 x 4 transpose of 32-bit lanes */
static inline void tr4(uint32x4_t r[4]) {
    uint32x4_t a0 = vtrn1q_u32(r[0], r[1]), a1 = vtrn2q_u32(r[0], r[1]);
    uint32x4_t a2 = vtrn1q_u32(r[2], r[3]), a3 = vtrn2q_u32(r[2], r[3]);
    r[0] = vreinterpretq_u32_u64(vtrn1q_u64(vreinterpretq_u64_u32(a0), vreinterpretq_u64_u32(a2)));
    r[1] = vreinterpretq_u32_u64(vtrn1q_u64(vreinterpretq_u64_u32(a1), vreinterpretq_u64_u32(a3)));
    r[2] = vreinterpretq_u32_u64(vtrn2q_u64(vreinterpretq_u64_u32(a0), vreinterpretq_u64_u32(a2)));
    r[3] = vreinterpretq_u32_u64(vtrn2q_u64(vreinterpretq_u64_u32(a1), vreinterpretq_u64_u32(a3)));
}

/* 4 rows (pointers, K bf16 each) as pair vectors: P[q] lane r = row r's columns 2q, 2q + 1 */
static void pack4(uint32x4_t *P, const uint16_t *const *rows, int64_t K) {
    for (int64_t c = 0; c < K; c += 8) {
        uint32x4_t r[4];
        for (int i = 0; i < 4; i++) r[i] = vreinterpretq_u32_u16(vld1q_u16(rows[i] + c));
        tr4(r);
        for (int j = 0; j < 4; j++) P[c / 2 + j] = r[j];
    }
}

/* y[t * ldy + r] for r < nr, t < nt (<= 4): the panel times the tokens' pairs */
static inline __attribute__((always_inline)) void micro(float *y, int64_t ldy, const uint32x4_t *P,
                                                        const uint32_t *xp, int64_t np, const int NT, int64_t nr) {
    vf acc[4];
    for (int t = 0; t < NT; t++) acc[t] = vzero();
    for (int64_t q = 0; q < np; q += 4) { /* np is a multiple of 16 */
        bfloat16x8_t w0 = vreinterpretq_bf16_u32(P[q]), w1 = vreinterpretq_bf16_u32(P[q + 1]);
        bfloat16x8_t w2 = vreinterpretq_bf16_u32(P[q + 2]), w3 = vreinterpretq_bf16_u32(P[q + 3]);
        for (int t = 0; t < NT; t++) {
            bfloat16x8_t xv = vreinterpretq_bf16_u32(vld1q_u32(xp + t * np + q));
            acc[t] = vbfdotq_laneq_f32(acc[t], w0, xv, 0);
            acc[t] = vbfdotq_laneq_f32(acc[t], w1, xv, 1);
            acc[t] = vbfdotq_laneq_f32(acc[t], w2, xv, 2);
            acc[t] = vbfdotq_laneq_f32(acc[t], w3, xv, 3);
        }
    }
    for (int t = 0; t < NT; t++) {
        if (nr >= 4) {
            vst1q_f32(y + t * ldy, acc[t]);
        } else {
            float tmp[4];
            vst1q_f32(tmp, acc[t]);
            memcpy(y + t * ldy, tmp, (size_t)nr * sizeof(float));
        }
    }
}

/* g[i] <- silu(g[i]) * u[i] for i < n <= 4, lane-wise */
static void silu_mul4(float *g, const float *u, int64_t n) {
    float a[4] = {0, 0, 0, 0}, b[4] = {0, 0, 0, 0};
    memcpy(a, g, (size_t)n * sizeof(float));
    memcpy(b, u, (size_t)n * sizeof(float));
    vst1q_f32(a, vmul(vsilu(vld1q_f32(a)), vld1q_f32(b)));
    memcpy(g, a, (size_t)n * sizeof(float));
}

#define BW 4
#define BF(name) cb_neonbf16_##name
#define BF_PANEL uint32x4_t
#define pack_panel pack4
#define silu_mul_panel silu_mul4
#include "cpu/arm/fast_bf16_rows.inc"

/* the n (< 4 or 4) bf16 at p, zero-padded to 4 */
static inline uint16x4_t load4_bf16(const uint16_t *p, int64_t n) {
    if (n >= 4) return vld1_u16(p);
    uint16_t t[4] = {0, 0, 0, 0};
    for (int64_t i = 0; i < n; i++) t[i] = p[i];
    return vld1_u16(t);
}

/* y[r, c] = sum_i h[r, i] w2T[i, c] for c0 <= c < c1: lanes = 4 columns, four vectors (16
 * columns) per step, w2T rows i, i + 1 interleaved into pairs, each token's h pair
 * broadcast; one chain over all of I (passes of 8192 rows, the chain carried through y). */
void cb_neonbf16_down_packed(float *y, const float *h, const void *expert, int64_t R, int64_t H, int64_t I, int64_t c0,
                             int64_t c1) {
    const uint16_t *w2 = (const uint16_t *)expert + (size_t)2 * (size_t)I * (size_t)H;
    uint32_t hp[4 * 4096]; /* 4 tokens' h pairs over a pass of 8192 rows (64 KiB) */
    for (int64_t t0 = 0; t0 < R; t0 += 4) {
        int64_t nt = R - t0 < 4 ? R - t0 : 4;
        for (int64_t i0 = 0; i0 < I; i0 += 8192) {
            int64_t ic = I - i0 < 8192 ? I - i0 : 8192;
            for (int64_t t = 0; t < nt; t++) pairs_of(hp + t * 4096, h + (t0 + t) * I + i0, ic, 1, ic);
            for (int64_t c = c0; c < c1; c += 16) {
                int64_t n[4];
                for (int v = 0; v < 4; v++) {
                    int64_t m = c1 - c - 4 * v;
                    n[v] = m >= 4 ? 4 : m < 0 ? 0 : m;
                }
                vf acc[4][4];
                for (int t = 0; t < 4; t++)
                    for (int v = 0; v < 4; v++) {
                        acc[t][v] = vzero();
                        if (i0 > 0 && t < nt && n[v] > 0) {
                            float tmp[4] = {0, 0, 0, 0};
                            memcpy(tmp, y + (t0 + t) * H + c + 4 * v, (size_t)n[v] * sizeof(float));
                            acc[t][v] = vld1q_f32(tmp);
                        }
                    }
                for (int64_t r = 0; r < ic / 2; r++) {
                    const uint16_t *ra = w2 + (size_t)(i0 + 2 * r) * (size_t)H + c;
                    __builtin_prefetch(ra + (size_t)16 * H, 0, 3);
                    __builtin_prefetch(ra + (size_t)17 * H, 0, 3);
                    bfloat16x8_t wv[4];
                    for (int v = 0; v < 4; v++) {
                        uint16x4x2_t z = vzip_u16(load4_bf16(ra + 4 * v, n[v]), load4_bf16(ra + H + 4 * v, n[v]));
                        wv[v] = vreinterpretq_bf16_u16(vcombine_u16(z.val[0], z.val[1]));
                    }
                    for (int64_t t = 0; t < nt; t++) {
                        bfloat16x8_t hb = vreinterpretq_bf16_u32(vdupq_n_u32(hp[t * 4096 + r]));
                        for (int v = 0; v < 4; v++) acc[t][v] = vbfdotq_f32(acc[t][v], wv[v], hb);
                    }
                }
                for (int64_t t = 0; t < nt; t++)
                    for (int v = 0; v < 4; v++) {
                        if (n[v] == 0) continue;
                        float tmp[4];
                        vst1q_f32(tmp, acc[t][v]);
                        memcpy(y + (t0 + t) * H + c + 4 * v, tmp, (size_t)n[v] * sizeof(float));
                    }
            }
        }
    }
}

#else /* no FEAT_BF16 in this build (x86, or the compiler lacks +bf16), or the fuzzers' build */
int cb_neonbf16_built(void) { return 0; }
void cb_neonbf16_matmul_ld(float *y, int64_t ldy, const float *x, const void *w, int64_t T, int64_t N, int64_t K) {
    (void)y, (void)ldy, (void)x, (void)w, (void)T, (void)N, (void)K;
}
void cb_neonbf16_gateup_split(float *h, const float *x, const void *gate, const void *up, int64_t R, int64_t H,
                              int64_t I, int64_t i0, int64_t i1) {
    (void)h, (void)x, (void)gate, (void)up, (void)R, (void)H, (void)I, (void)i0, (void)i1;
}
void cb_neonbf16_gateup_packed(float *h, const float *x, const void *expert, int64_t R, int64_t H, int64_t I,
                               int64_t B, int64_t i0, int64_t i1) {
    (void)h, (void)x, (void)expert, (void)R, (void)H, (void)I, (void)B, (void)i0, (void)i1;
}
void cb_neonbf16_down_packed(float *y, const float *h, const void *expert, int64_t R, int64_t H, int64_t I, int64_t c0,
                             int64_t c1) {
    (void)y, (void)h, (void)expert, (void)R, (void)H, (void)I, (void)c0, (void)c1;
}
#endif
