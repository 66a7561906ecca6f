/*
 * fast_bf16dp.c — the fast mode's BF16 kernels on AVX512_BF16 (vdpbf16ps: 32 bf16
 * multiply-adds into 16 float32 lanes per instruction), for CPUs that have it without AMX
 * (AMD Zen 4/5, where it doubles the f32 FMA's multiply-add rate). The activations are
 * already rounded to bf16 (backend/cpu.c), so their conversion here is exact.
 *
 * Lanes are outputs, as in the int8 panels (fast_simd.inc): for W [N, K] (a matmul, gate/up)
 * a panel of 16 rows is transposed once per call so that one vector holds a pair of columns
 * of every row, and each token's pair of activations is broadcast; for the packed experts'
 * down projection (w2^T [I, H]) the lanes are 16 output columns and two w2^T rows are
 * interleaved into pairs, no transpose. Every output is one chain of vdpbf16ps over the
 * pairs in ascending order: deterministic and batch-invariant (native/tests/test_kernels.c),
 * not other tables' bits (the instruction's internal rounding is the CPU's).
 *
 * Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mavx2 -mfma -mf16c; entered
 * only after cb_fast_by_name("avx512bf16") has checked the CPU. Buffers on the stack
 * (about 300 KiB at most); rows up to 4096 wide (cb_fast_bf16_k_ok), other shapes take the
 * f32 path.
 */
#include "cpu/fast.h"

#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && !defined(COLIBRI_NO_SIMD_TABLES)
#include <immintrin.h>

#include "cpu/simd_avx512.h"
#include "cpu/simd_math.h"

#define DKMAX CB_FAST_BF16_MAX_K /* the longest rows here */
#define DTT 16     /* tokens per activation tile */

int cb_bf16dp_built(void) { return 1; }

/* the bf16 bits of 16 floats already rounded to bf16 (exact) */
static inline __m256i bf16_bits(vf v) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)); }

/* nt tokens (rows of x, stride ldx) as dword pairs: xp[t * (K/2) + r] = (x[t][2r], x[t][2r+1]) */
static void pairs_of(uint32_t *xp, const float *x, int64_t ldx, int64_t nt, int64_t K) {
    for (int64_t t = 0; t < nt; t++)
        for (int64_t k = 0; k < K; k += 16)
            _mm256_storeu_si256((__m256i *)((uint16_t *)(xp + t * (K / 2)) + k), bf16_bits(_mm512_loadu_ps(x + t * ldx + k)));
}

/* 16 rows (pointers, K bf16 each) as pair vectors: P[q] lane r = row r's columns 2q, 2q + 1 */
static void pack16(__m512i *P, const uint16_t *const *rows, int64_t K) {
    for (int64_t c = 0; c < K; c += 32) {
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(rows[i] + c);
        tr16x16_epi32(r);
        for (int j = 0; j < 16; j++) P[c / 2 + j] = r[j];
    }
}

/* y[t * ldy + r] for r < nr, t < nt (<= 4): the panel times the tokens' pairs */
static inline __attribute__((always_inline)) void micro(float *y, int64_t ldy, const __m512i *P, const uint32_t *xp,
                                                        int64_t np, const int NT, int64_t nr) {
    vf acc[4];
    for (int t = 0; t < NT; t++) acc[t] = vzero();
    for (int64_t q = 0; q < np; q++) {
        __m512bh w = (__m512bh)P[q];
        for (int t = 0; t < NT; t++)
            acc[t] = _mm512_dpbf16_ps(acc[t], w, (__m512bh)_mm512_set1_epi32((int)xp[t * np + q]));
    }
    __mmask16 m = (__mmask16)(nr >= 16 ? 0xFFFFu : (1u << nr) - 1u);
    for (int t = 0; t < NT; t++) _mm512_mask_storeu_ps(y + t * ldy, m, acc[t]);
}

static void silu_mul16(float *g, const float *u, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) vstore(g + i, vmul(vsilu(vload(g + i)), vload(u + i)));
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(g + i, m, vmul(vsilu(_mm512_maskz_loadu_ps(m, g + i)), _mm512_maskz_loadu_ps(m, u + i)));
    }
}

#define BW 16
#define BF(name) cb_bf16dp_##name
#define BF_PANEL __m512i
#define pack_panel pack16
#define silu_mul_panel silu_mul16
#include "cpu/fast_bf16_rows.inc"

/* y[r, c] = sum_i h[r, i] w2T[i, c] for c0 <= c < c1: lanes = 16 columns, four vectors (64
 * columns, two cache lines of each w2T row) per step, w2T rows i, i + 1 interleaved into
 * pairs, each token's h pair broadcast; one chain over all of I (passes of 8192 rows, the
 * chain carried in registers). h is converted to pairs once per 4 tokens and pass. */
void cb_bf16dp_down_packed(float *y, const float *h, const void *expert, int64_t R, int64_t H, int64_t I, int64_t c0,
                           int64_t c1) {
    const uint16_t *w2 = (const uint16_t *)expert + (size_t)2 * (size_t)I * (size_t)H;
    uint32_t hp[4 * 4096]; /* 4 tokens' h pairs over a pass of 8192 rows (64 KiB) */
    for (int64_t t0 = 0; t0 < R; t0 += 4) {
        int64_t nt = R - t0 < 4 ? R - t0 : 4;
        for (int64_t i0 = 0; i0 < I; i0 += 8192) {
            int64_t ic = I - i0 < 8192 ? I - i0 : 8192;
            for (int64_t t = 0; t < nt; t++)
                for (int64_t k = 0; k < ic; k += 16)
                    _mm256_storeu_si256((__m256i *)((uint16_t *)(hp + t * 4096) + k),
                                        bf16_bits(_mm512_loadu_ps(h + (t0 + t) * I + i0 + k)));
            for (int64_t c = c0; c < c1; c += 64) {
                __mmask16 m[4];
                for (int v = 0; v < 4; v++) {
                    int64_t n = c1 - c - 16 * v;
                    m[v] = (__mmask16)(n >= 16 ? 0xFFFFu : n <= 0 ? 0u : (1u << n) - 1u);
                }
                vf acc[4][4];
                for (int t = 0; t < 4; t++)
                    for (int v = 0; v < 4; v++)
                        acc[t][v] = i0 == 0 || t >= nt ? vzero() : _mm512_maskz_loadu_ps(m[v], y + (t0 + t) * H + c + 16 * v);
                for (int64_t r = 0; r < ic / 2; r++) {
                    const uint16_t *ra = w2 + (size_t)(i0 + 2 * r) * (size_t)H + c;
                    _mm_prefetch((const char *)(ra + (size_t)16 * H), _MM_HINT_T0);
                    _mm_prefetch((const char *)(ra + (size_t)17 * H), _MM_HINT_T0);
                    __m512bh wv[4];
                    for (int v = 0; v < 4; v++) {
                        __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m[v], ra + 16 * v));
                        __m512i hi = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m[v], ra + H + 16 * v));
                        wv[v] = (__m512bh)_mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
                    }
                    for (int64_t t = 0; t < nt; t++) {
                        __m512bh hb = (__m512bh)_mm512_set1_epi32((int)hp[t * 4096 + r]);
                        for (int v = 0; v < 4; v++) acc[t][v] = _mm512_dpbf16_ps(acc[t][v], wv[v], hb);
                    }
                }
                for (int64_t t = 0; t < nt; t++)
                    for (int v = 0; v < 4; v++) _mm512_mask_storeu_ps(y + (t0 + t) * H + c + 16 * v, m[v], acc[t][v]);
            }
        }
    }
}

#else /* no AVX512_BF16 in this build, or the fuzzers' build */
int cb_bf16dp_built(void) { return 0; }
void cb_bf16dp_matmul_ld(float *y, int64_t ldy, const float *x, const void *w, int64_t T, int64_t N, int64_t K) {
    (void)y, (void)ldy, (void)x, (void)w, (void)T, (void)N, (void)K;
}
void cb_bf16dp_gateup_split(float *h, const float *x, const void *gate, const void *up, int64_t R, int64_t H,
                            int64_t I, int64_t i0, int64_t i1) {
    (void)h, (void)x, (void)gate, (void)up, (void)R, (void)H, (void)I, (void)i0, (void)i1;
}
void cb_bf16dp_gateup_packed(float *h, const float *x, const void *expert, int64_t R, int64_t H, int64_t I,
                             int64_t B, int64_t i0, int64_t i1) {
    (void)h, (void)x, (void)expert, (void)R, (void)H, (void)I, (void)B, (void)i0, (void)i1;
}
void cb_bf16dp_down_packed(float *y, const float *h, const void *expert, int64_t R, int64_t H, int64_t I, int64_t c0,
                           int64_t c1) {
    (void)y, (void)h, (void)expert, (void)R, (void)H, (void)I, (void)c0, (void)c1;
}
#endif
