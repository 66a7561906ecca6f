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

#include "cpu/x86/simd_avx512.h"
#include "cpu/simd_math.h"
#include "cpu/x86/simd_x86_bytes.h"

#define VL 16
#define FS(name) name##_avx512vnni
#define FS_NAME "avx512vnni"

typedef __m512i vi;

#define FVI static inline __attribute__((always_inline))
FVI vi vi_zero(void) { return _mm512_setzero_si512(); }
FVI vi vi_load(const void *p) { return _mm512_loadu_si512(p); }
FVI void vi_store(void *p, vi v) { _mm512_storeu_si512(p, v); }
FVI vi vi_dot(vi acc, vi w, int32_t b, const int wide) {
    (void)wide;
    return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(b));
}
FVI vf vf_cvt(vi v) { return _mm512_cvtepi32_ps(v); }
FVI vf vf_load_n(const float *p, int64_t n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p); }
FVI void vf_store_n(float *p, vf v, int64_t n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1u), v); }
FVI void vi_transpose(vi r[16]) { tr16x16_epi32(r); }

/* 8 vectors z[i] = [dwords 0..7 of row i | of row i + 8] -> out[j], lane r = dword j of row
 * r (an 8 x 8 transpose in each half, then the halves' 128-bit lanes interleaved) */
FVI void tr8x16(const vi z[8], vi *out) {
    vi t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
    }
    for (int g = 0; g < 2; g++) { /* u[4g + c], lane L: rows 4g..4g+3 (+8 for L >= 2), dword 4(L & 1) + c */
        u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int c = 0; c < 4; c++) { /* immediates written out: no loop variable in them */
        vi lo = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), hi = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
        out[c] = _mm512_shuffle_i32x4(lo, lo, 0xD8);
        out[4 + c] = _mm512_shuffle_i32x4(hi, hi, 0xD8);
    }
}

/* 32 bytes at offset off of each row (rp[r]) as the 8 vectors tr8x16 takes */
FVI void load_rows32(const uint8_t *const *rp, size_t off, vi z[8]) {
    for (int i = 0; i < 8; i++)
        z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(rp[i] + off))),
                                  _mm256_loadu_si256((const __m256i *)(rp[i + 8] + off)), 1);
}

/* The packs of fast_simd.inc for Q8_0, Q4_K, Q5_K and Q6_K straight from the blocks, 16 rows at a
 * time (the same bytes, scales and offsets as cb_fast_unpack + the transpose, which the
 * other types take): rows past `rows` read the last row (lanes never stored). idx: the
 * rows' byte offsets from row 0, for the gather of Q6_K's d (the other scales come by
 * head16's loads). */
FVI void rows_at(const uint8_t *w, size_t rb, int64_t rows, size_t off, const uint8_t **rp, __m512i *idx) {
    int32_t o[16];
    for (int r = 0; r < 16; r++) {
        o[r] = (int32_t)((size_t)(r < rows ? r : rows - 1) * rb);
        rp[r] = w + (size_t)o[r] + off;
    }
    *idx = _mm512_loadu_si512(o);
}
/* The same bytes (off) of the next 16 rows (ahead: 16 row strides) into L2, so that the next
 * panel streams in while this one is read: a decode reads each weight once, and sixteen short
 * row streams are more than the hardware prefetchers follow (into L2, not L1, and by panel
 * rather than along each row: the fastest of the three on a Zen 4 EPYC, measured by
 * tools/kernel_bench.c). */
FVI void prefetch_next16(const uint8_t *const *rp, size_t off, size_t ahead) {
    for (int r = 0; r < 16; r++) _mm_prefetch((const char *)(rp[r] + off + ahead), _MM_HINT_T1);
}
FVI vf f16_lo(vi v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); }
FVI vf f16_hi(vi v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16))); }
FVI vf neg(vf v) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN))); }
#define GATHER(idx, p) _mm512_i32gather_epi32((idx), (const void *)(p), 1)

/* cb_fast_quant_act on vectors, the same operations lane by lane (so the same bytes and
 * scales): two vectors per block of 32, the rounding of cvtps (nearest even, as nearbyintf) */
#define FS_QUANT_ACT 1
static void quant_act(const float *x, int64_t n, int8_t *q, cb_fast_ablk *a) {
    const vi sign = _mm512_set1_epi32(0x7fffffff);
    for (int64_t b = 0; b < n / 32; b++) {
        vf v0 = _mm512_loadu_ps(x + 32 * b), v1 = _mm512_loadu_ps(x + 32 * b + 16);
        vf a0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v0), sign));
        vf a1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v1), sign));
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
        float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        vi q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
        vi q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)(q + 32 * b), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(q + 32 * b + 16), _mm512_cvtepi32_epi8(q1));
        int s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
        a[b].d = d;
        a[b].ds32 = d * (float)(s0 + s1);
        a[b].s32 = s0 + s1;
        a[b].ds16[0] = d * (float)s0;
        a[b].ds16[1] = d * (float)s1;
    }
}

/* The 16 bytes at off of rows k, k + 4, k + 8, k + 12 in the four 128-bit lanes (the inserts'
 * lanes spelled out: they must be immediates, also in unoptimized builds) */
FVI vi rows4x16(const uint8_t *const *rp, size_t off, int k) {
    vi z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(rp[k] + off)));
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(rp[4 + k] + off)), 1);
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(rp[8 + k] + off)), 2);
    return _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(rp[12 + k] + off)), 3);
}
/* The 16 bytes at off of the 16 rows as 4 vectors: h[c] lane r = dword c of row r. Four
 * loads into each of 4 vectors (rows k, k + 4, k + 8, k + 12 in its 128-bit lanes), then a
 * 4 x 4 transpose in every 128-bit lane: cheaper than 4 gathers on Zen 4. */
FVI void head16(const uint8_t *const *rp, size_t off, vi h[4]) {
    vi z[4], t[4];
    for (int k = 0; k < 4; k++) z[k] = rows4x16(rp, off, k);
    t[0] = _mm512_unpacklo_epi32(z[0], z[1]), t[1] = _mm512_unpackhi_epi32(z[0], z[1]);
    t[2] = _mm512_unpacklo_epi32(z[2], z[3]), t[3] = _mm512_unpackhi_epi32(z[2], z[3]);
    h[0] = _mm512_unpacklo_epi64(t[0], t[2]), h[1] = _mm512_unpackhi_epi64(t[0], t[2]);
    h[2] = _mm512_unpacklo_epi64(t[1], t[3]), h[3] = _mm512_unpackhi_epi64(t[1], t[3]);
}

/* A Q4_K (or Q5_K) super-block's eight sub-blocks for 16 rows (its bytes at off of each row):
 * ws[j] = d * sc[j], wm[j] = -(dmin * m[j]) lane-wise, the 6-bit scales unpacked as
 * cb_k4_unpack does. */
FVI void k4_scales16(const uint8_t *const *rp, size_t off, vf ws[8], vf wm[8]) {
    vi hd[4];
    head16(rp, off, hd);
    vi dd = hd[0], u0 = hd[1], u1 = hd[2], u2 = hd[3];
    vf d = f16_lo(dd), dmin = f16_hi(dd);
    const vi m6 = _mm512_set1_epi32(0x3f3f3f3f), m4w = _mm512_set1_epi32(0x0f0f0f0f),
             m2 = _mm512_set1_epi32(0x03030303), ff = _mm512_set1_epi32(0xFF);
    vi sc[2], mn[2];
    sc[0] = _mm512_and_si512(u0, m6);
    sc[1] = _mm512_or_si512(_mm512_and_si512(u2, m4w),
                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u0, 6), m2), 4));
    mn[0] = _mm512_and_si512(u1, m6);
    mn[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), m4w),
                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u1, 6), m2), 4));
    for (int j = 0; j < 8; j++) {
        vf scj = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(sc[j / 4], 8 * (j % 4)), ff));
        vf mj = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(mn[j / 4], 8 * (j % 4)), ff));
        ws[j] = _mm512_mul_ps(d, scj);
        wm[j] = neg(_mm512_mul_ps(dmin, mj));
    }
}

/* Q5_K's fifth bit of each weight: bit k of the qh bytes, moved to bit 4 */
FVI vi q5_bit(vi h, int k) {
    vi s = k < 4 ? _mm512_slli_epi16(h, 4 - k) : k > 4 ? _mm512_srli_epi16(h, k - 4) : h;
    return _mm512_and_si512(s, _mm512_set1_epi8(0x10));
}
/* The weights u of group p (0..3) of the Q4_K or Q5_K super-blocks at b of the rows (16 rows,
 * the 8 vectors tr8x16 takes): lo = sub-block 2p, hi = 2p + 1 (cb_fast_unpack's bytes; qh: the
 * rows' 32 high-bit bytes, Q5_K only). Also prefetches the next 16 rows' lines of this group. */
FVI void k45_group(const uint8_t *const *rp, size_t b, int p, int q5, const vi *qh, size_t ahead, vi lo[8], vi hi[8]) {
    vi z[8];
    if (q5) { /* 176 bytes: the lines at 0, 44, 88, 132 and 175 */
        prefetch_next16(rp, b + 44 * (size_t)p, ahead);
        if (p == 3) prefetch_next16(rp, b + 175, ahead);
    } else {
        prefetch_next16(rp, b + 32 * (size_t)p, ahead);
    }
    load_rows32(rp, b + (q5 ? 48 : 16) + 32 * (size_t)p, z);
    const vi m4 = _mm512_set1_epi8(0x0F);
    for (int i = 0; i < 8; i++) {
        lo[i] = _mm512_and_si512(z[i], m4);
        hi[i] = _mm512_and_si512(_mm512_srli_epi16(z[i], 4), m4);
        if (q5) {
            lo[i] = _mm512_or_si512(lo[i], q5_bit(qh[i], 2 * p));
            hi[i] = _mm512_or_si512(hi[i], q5_bit(qh[i], 2 * p + 1));
        }
    }
}

#define FS_DIRECT_PACK 1
static int pack_direct(void *panel, const uint8_t *w, size_t rb, uint32_t dt, int64_t rows, int64_t k0, int64_t kc);

/* Interleaved copies (cpu/qpanel.h): a panel of 16 rows is two groups, each unpacked by the
 * 256-bit table of the same instructions (fast_avx512vl.c) and put in its 8 lanes. Calls of
 * up to 4 tokens go to that table's kernels on a copy, which read a group's four bytes per
 * vector load and multiply them where they are loaded, and on the row-major blocks of the
 * types this table has no fused decode for, which it packs 8 rows at a time straight from the
 * blocks (measured on a Zen 5 EPYC, Q4_0 decode: 34 tok/s through this table's
 * cb_fast_unpack packs, 269 on the copies) */
#define FS_QPANELS 1
#define FS_FEW cb_fast_avx512vl()
#define FS_FEW_TAKES(dt, il)                                                                                     \
    ((il) || !((dt) == COLIBRI_DTYPE_Q8_0 || (dt) == COLIBRI_DTYPE_Q4_K || (dt) == COLIBRI_DTYPE_Q5_K ||       \
               (dt) == COLIBRI_DTYPE_Q6_K))
static void pack_il(void *panel, const uint8_t *g, size_t rb, int64_t rows, uint32_t dt, int64_t k0, int64_t kc);
static int fused_il(float *y, int first, const uint8_t *w, size_t rb, uint32_t dt, int64_t N, int64_t k0, int64_t kc,
                    const void *tile) {
    (void)y, (void)first, (void)w, (void)rb, (void)dt, (void)N, (void)k0, (void)kc, (void)tile;
    return 0; /* one token on a copy: FS_FEW's */
}

#define FS_FUSED_DECODE 1
struct act_tile_avx512vnni;
static int fused_decode(float *y, int64_t ldy, int first, const uint8_t *w, size_t rb, uint32_t dt, int64_t N,
                        int64_t k0, int64_t kc, const struct act_tile_avx512vnni *A, int nt);

#include "cpu/fast_simd.inc"

/* The fused decode's step for sub-block g of G weights (its G/4 quads, transposed, in q):
 * each token's exact integer sum, then the two float steps of fast.h, as FS(micro) does. */
FAI void fused_sub(vf *acc, const vi *q, vf ws, vf wm, const FS(act_tile) *A, int64_t g, const int64_t G,
                   const int WIDE, const int NT) {
    for (int t = 0; t < NT; t++) {
        vi is = vi_zero();
        for (int i = 0; i < G / 4; i++) {
            int32_t b;
            memcpy(&b, FS_AQ(A, t) + g * G + 4 * i, 4);
            is = vi_dot(is, q[i], b, WIDE);
        }
        const cb_fast_ablk *ab = FS_AA(A, t) + g * G / 32;
        acc[t] = vfma(vf_cvt(is), vmul(ws, vset1(ab->d)), acc[t]);
        acc[t] = vfma(wm, vset1(G == 32 ? ab->ds32 : ab->ds16[g & 1]), acc[t]);
    }
}

/* Decode (nt <= 4 tokens), Q8_0, Q4_K, Q5_K and Q6_K: for each 16 rows, the quads are transposed in
 * registers and go straight into vpdpbusd, the scales into the float steps, with no panel
 * stored and reloaded: the same operations on the same values as pack + micro. */
FAI void fused_rows(float *y, int64_t ldy, int first, const uint8_t *w, size_t rb, uint32_t dt, int64_t rows,
                    int64_t k0, int64_t kc, const FS(act_tile) *A, const int NT) {
    const uint8_t *rp[16];
    __m512i idx;
    vf acc[4];
    __mmask16 m = (__mmask16)(rows >= 16 ? 0xFFFFu : (1u << rows) - 1u);
    for (int t = 0; t < NT; t++) acc[t] = first ? vzero() : _mm512_maskz_loadu_ps(m, y + t * ldy);
    if (dt == COLIBRI_DTYPE_Q8_0) {
        size_t off = (size_t)(k0 / 32) * 34;
        rows_at(w, rb, rows, off, rp, &idx);
        const vi x80 = _mm512_set1_epi8((char)0x80);
        for (int64_t g = 0; g < kc / 32; g++) {
            vi z[8], q[8];
            if (g % 2 == 0) prefetch_next16(rp, (size_t)g * 34, 16 * rb);
            load_rows32(rp, (size_t)g * 34 + 2, z);
            for (int i = 0; i < 8; i++) z[i] = _mm512_xor_si512(z[i], x80);
            tr8x16(z, q);
            vi hd[4]; /* dword 0: the block's d (the compiler drops the rest) */
            head16(rp, (size_t)g * 34, hd);
            vf d = f16_lo(hd[0]);
            fused_sub(acc, q, d, _mm512_mul_ps(_mm512_set1_ps(-128.0f), d), A, g, 32, 1, NT);
        }
    } else if (dt == COLIBRI_DTYPE_Q6_K) { /* the bytes and scales of pack_direct's Q6_K */
        size_t off = (size_t)(k0 / 256) * 210;
        rows_at(w, rb, rows, off, rp, &idx);
        const vi m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
        for (int64_t s = 0; s < kc / 256; s++) {
            size_t b = (size_t)s * 210;
            const uint8_t *blk = w + off + b;
            vf ws16[16], wm16[16];
            vf d = f16_hi(GATHER(idx, blk + 206)); /* bytes 206..209: two scales, then d */
            vi sc16[4]; /* the 16 scales, bytes 192..207 */
            head16(rp, b + 192, sc16);
            for (int q = 0; q < 4; q++) {
                vi g4 = sc16[q];
                for (int j = 0; j < 4; j++) {
                    vf scj = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(g4, 24 - 8 * j), 24));
                    ws16[4 * q + j] = _mm512_mul_ps(d, scj);
                    wm16[4 * q + j] = _mm512_mul_ps(_mm512_set1_ps(-32.0f), ws16[4 * q + j]);
                }
            }
            for (int h = 0; h < 2; h++) {
                vi l0[8], l1[8], qh[8];
                prefetch_next16(rp, b + 64 * (size_t)h, 16 * rb);
                prefetch_next16(rp, b + 64 * (size_t)h + 128, 16 * rb);
                load_rows32(rp, b + 64 * (size_t)h, l0);
                load_rows32(rp, b + 64 * (size_t)h + 32, l1);
                load_rows32(rp, b + 128 + 32 * (size_t)h, qh);
                for (int m = 0; m < 4; m++) { /* the four groups of 32 weights of this half */
                    vi v[8], q[8];
                    for (int i = 0; i < 8; i++) {
                        vi lo = m & 1 ? l1[i] : l0[i];
                        lo = m < 2 ? _mm512_and_si512(lo, m4) : _mm512_and_si512(_mm512_srli_epi16(lo, 4), m4);
                        vi hb = m == 0 ? _mm512_slli_epi16(qh[i], 4)
                                : m == 1 ? _mm512_slli_epi16(qh[i], 2)
                                : m == 2 ? qh[i]
                                         : _mm512_srli_epi16(qh[i], 2);
                        v[i] = _mm512_or_si512(lo, _mm512_and_si512(hb, m30));
                    }
                    tr8x16(v, q);
                    for (int sb = 0; sb < 2; sb++) { /* two sub-blocks of 16 weights */
                        int j = 8 * h + 2 * m + sb;
                        fused_sub(acc, q + 4 * sb, ws16[j], wm16[j], A, s * 16 + j, 16, 0, NT);
                    }
                }
            }
        }
    } else { /* Q4_K, Q5_K */
        const int q5 = dt == COLIBRI_DTYPE_Q5_K;
        const size_t bb = q5 ? 176 : 144;
        size_t off = (size_t)(k0 / 256) * bb;
        rows_at(w, rb, rows, off, rp, &idx);
        for (int64_t s = 0; s < kc / 256; s++) {
            size_t b = (size_t)s * bb;
            vf ws8[8], wm8[8];
            vi qh[8];
            k4_scales16(rp, b, ws8, wm8);
            if (q5) load_rows32(rp, b + 16, qh);
            for (int p = 0; p < 4; p++) {
                vi lo[8], hi[8], q[2][8];
                k45_group(rp, b, p, q5, qh, 16 * rb, lo, hi);
                tr8x16(lo, q[0]);
                tr8x16(hi, q[1]);
                for (int h = 0; h < 2; h++) {
                    int j = 2 * p + h; /* the sub-block */
                    fused_sub(acc, q[h], ws8[j], wm8[j], A, s * 8 + j, 32, 0, NT);
                }
            }
        }
    }
    for (int t = 0; t < NT; t++) _mm512_mask_storeu_ps(y + t * ldy, m, acc[t]);
}

static int fused_decode(float *y, int64_t ldy, int first, const uint8_t *w, size_t rb, uint32_t dt, int64_t N,
                        int64_t k0, int64_t kc, const struct act_tile_avx512vnni *At, int nt) {
    if (dt != COLIBRI_DTYPE_Q8_0 && dt != COLIBRI_DTYPE_Q4_K && dt != COLIBRI_DTYPE_Q5_K && dt != COLIBRI_DTYPE_Q6_K)
        return 0;
    const FS(act_tile) *A = At;
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
        int64_t rows = N - n0 < 16 ? N - n0 : 16;
        const uint8_t *wr = w + (size_t)n0 * rb;
        if (nt == 1) fused_rows(y + n0, ldy, first, wr, rb, dt, rows, k0, kc, A, 1);
        else if (nt == 2) fused_rows(y + n0, ldy, first, wr, rb, dt, rows, k0, kc, A, 2);
        else if (nt == 3) fused_rows(y + n0, ldy, first, wr, rb, dt, rows, k0, kc, A, 3);
        else fused_rows(y + n0, ldy, first, wr, rb, dt, rows, k0, kc, A, 4);
    }
    return 1;
}

static int pack_direct(void *panel, const uint8_t *w, size_t rb, uint32_t dt, int64_t rows, int64_t k0, int64_t kc) {
    FS(panel) *P = (FS(panel) *)panel;
    const uint8_t *rp[16];
    __m512i idx;
    if (dt == COLIBRI_DTYPE_Q8_0) {
        size_t off = (size_t)(k0 / 32) * 34;
        rows_at(w, rb, rows, off, rp, &idx);
        const vi x80 = _mm512_set1_epi8((char)0x80);
        for (int64_t g = 0; g < kc / 32; g++) {
            vi z[8];
            if (g % 2 == 0) prefetch_next16(rp, (size_t)g * 34, 16 * rb);
            load_rows32(rp, (size_t)g * 34 + 2, z);
            for (int i = 0; i < 8; i++) z[i] = _mm512_xor_si512(z[i], x80);
            tr8x16(z, &P->u[8 * g]);
            vi hd[4]; /* dword 0: the block's d (the compiler drops the rest) */
            head16(rp, (size_t)g * 34, hd);
            vf d = f16_lo(hd[0]);
            P->ws[g] = d;
            P->wm[g] = _mm512_mul_ps(_mm512_set1_ps(-128.0f), d);
        }
        return 1;
    }
    if (dt == COLIBRI_DTYPE_Q4_K || dt == COLIBRI_DTYPE_Q5_K) {
        const int q5 = dt == COLIBRI_DTYPE_Q5_K;
        const size_t bb = q5 ? 176 : 144;
        size_t off = (size_t)(k0 / 256) * bb;
        rows_at(w, rb, rows, off, rp, &idx);
        for (int64_t s = 0; s < kc / 256; s++) {
            size_t b = (size_t)s * bb;
            vi qh[8];
            if (q5) load_rows32(rp, b + 16, qh);
            for (int p = 0; p < 4; p++) {
                vi lo[8], hi[8];
                k45_group(rp, b, p, q5, qh, 16 * rb, lo, hi);
                tr8x16(lo, &P->u[s * 64 + 16 * p]);
                tr8x16(hi, &P->u[s * 64 + 16 * p + 8]);
            }
            vf ws[8], wm[8];
            k4_scales16(rp, b, ws, wm);
            for (int j = 0; j < 8; j++) {
                P->ws[s * 8 + j] = ws[j];
                P->wm[s * 8 + j] = wm[j];
            }
        }
        return 1;
    }
    if (dt == COLIBRI_DTYPE_Q6_K) {
        size_t off = (size_t)(k0 / 256) * 210;
        rows_at(w, rb, rows, off, rp, &idx);
        const vi m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
        for (int64_t s = 0; s < kc / 256; s++) {
            size_t b = (size_t)s * 210;
            for (int h = 0; h < 2; h++) {
                vi l0[8], l1[8], qh[8], v[8];
                prefetch_next16(rp, b + 64 * (size_t)h, 16 * rb);
                prefetch_next16(rp, b + 64 * (size_t)h + 128, 16 * rb);
                load_rows32(rp, b + 64 * (size_t)h, l0);
                load_rows32(rp, b + 64 * (size_t)h + 32, l1);
                load_rows32(rp, b + 128 + 32 * (size_t)h, qh);
                vi *u = &P->u[s * 64 + 32 * h];
                for (int i = 0; i < 8; i++)
                    v[i] = _mm512_or_si512(_mm512_and_si512(l0[i], m4), _mm512_and_si512(_mm512_slli_epi16(qh[i], 4), m30));
                tr8x16(v, u);
                for (int i = 0; i < 8; i++)
                    v[i] = _mm512_or_si512(_mm512_and_si512(l1[i], m4), _mm512_and_si512(_mm512_slli_epi16(qh[i], 2), m30));
                tr8x16(v, u + 8);
                for (int i = 0; i < 8; i++)
                    v[i] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0[i], 4), m4), _mm512_and_si512(qh[i], m30));
                tr8x16(v, u + 16);
                for (int i = 0; i < 8; i++)
                    v[i] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1[i], 4), m4),
                                           _mm512_and_si512(_mm512_srli_epi16(qh[i], 2), m30));
                tr8x16(v, u + 24);
            }
            const uint8_t *blk = w + off + b;
            vf d = f16_hi(GATHER(idx, blk + 206)); /* bytes 206..209: two scales, then d */
            vi sc16[4]; /* the 16 scales, bytes 192..207 */
            head16(rp, b + 192, sc16);
            for (int q = 0; q < 4; q++) {
                vi g4 = sc16[q];
                for (int j = 0; j < 4; j++) {
                    vf scj = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(g4, 24 - 8 * j), 24));
                    vf ws = _mm512_mul_ps(d, scj);
                    P->ws[s * 16 + 4 * q + j] = ws;
                    P->wm[s * 16 + 4 * q + j] = _mm512_mul_ps(_mm512_set1_ps(-32.0f), ws);
                }
            }
        }
        return 1;
    }
    return 0;
}

/* fast_avx512vl.c's panel of one group (its FS(panel) at VL 8) */
typedef struct {
    __m256i u[FKC / 4];
    __m256 ws[FKC / 16], wm[FKC / 16];
} il8_panel;
_Static_assert(sizeof(il8_panel) == CB_FAST_IL8_PANEL_BYTES(FKC), "fast_avx512vl.c's panel of one group");
/* a with its upper 8 lanes b */
FVI vf ins_hi(vf a, __m256 b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(a), _mm256_castps_pd(b), 1));
}

/* IQ4_XS: the panel of the groups at g and g + 8 rb (one group: its lanes twice) made at 512
 * bits, a dword of both groups per vector, with the operations fast_x86_256.inc's
 * il_xs_scales and il_xs_quads apply to one group (the same panel); by halves and their copy
 * into the lanes below, the unpacking took a fifth of a Qwen3-A3B-shaped IQ4_XS prefill */
static void pack_il_xs(FS(panel) *P, const uint8_t *g, size_t rb, int two, int64_t k0, int64_t kc) {
    const size_t gbb = 8 * (size_t)cb_dtype_block_bytes(COLIBRI_DTYPE_IQ4_XS);
    const int64_t nb = kc / 256;
    const uint8_t *b0 = g + (size_t)(k0 / 256) * gbb, *b1 = two ? b0 + 8 * rb : b0;
    /* the next panel pair's groups (4 groups on) into L2 while this one is read, as pack_il_ahead */
    for (size_t l = 0; l < (size_t)nb * gbb; l += 64) {
        _mm_prefetch((const char *)(b0 + 4 * 8 * rb + l), _MM_HINT_T1);
        if (two) _mm_prefetch((const char *)(b1 + 4 * 8 * rb + l), _MM_HINT_T1);
    }
    const vi m4 = _mm512_set1_epi8(0x0F), m4w = _mm512_set1_epi32(0xF), m2 = _mm512_set1_epi32(3);
    const vi kv = _mm512_broadcast_i32x4(iq4nl_lut128()); /* in all four 128-bit lanes */
#define IL2(off)                                                                                      \
    _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 8 * (size_t)(off)))), \
                       _mm256_loadu_si256((const __m256i *)(b1 + 8 * (size_t)(off))), 1)
    for (int64_t s = 0; s < nb; s++, b0 += gbb, b1 += gbb) {
        const vi hd = IL2(0), sl = IL2(4), sh = _mm512_srli_epi32(hd, 16);
        const vf d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hd)); /* each lane's low half: d */
        for (int j = 0; j < 8; j++) {
            vi lo = _mm512_and_si512(_mm512_srli_epi32(sl, 4 * (unsigned)j), m4w);
            vi hi = _mm512_and_si512(_mm512_srli_epi32(sh, 2 * (unsigned)j), m2);
            vi ls = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), _mm512_set1_epi32(32));
            vf ws = _mm512_mul_ps(d, _mm512_cvtepi32_ps(ls));
            P->ws[s * 8 + j] = ws;
            P->wm[s * 8 + j] = _mm512_mul_ps(_mm512_set1_ps(-128.0f), ws);
            for (int c = 0; c < 4; c++) {
                vi v = IL2(8 + 16 * j + 4 * c);
                P->u[s * 64 + 8 * j + c] = _mm512_shuffle_epi8(kv, _mm512_and_si512(v, m4));
                P->u[s * 64 + 8 * j + 4 + c] = _mm512_shuffle_epi8(kv, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
            }
        }
    }
#undef IL2
}

static void pack_il(void *panel, const uint8_t *g, size_t rb, int64_t rows, uint32_t dt, int64_t k0, int64_t kc) {
    FS(panel) *P = (FS(panel) *)panel;
    if (dt == COLIBRI_DTYPE_IQ4_XS) {
        pack_il_xs(P, g, rb, rows > 8, k0, kc);
        return;
    }
    il8_panel h;
    const int64_t nq = kc / 4, ng = kc / cb_fast_group(dt);
    for (int half = 0; half < 2; half++) {
        if (half && rows <= 8) { /* one group: its lanes again (never stored) */
            for (int64_t q = 0; q < nq; q++) P->u[q] = _mm512_inserti64x4(P->u[q], _mm512_castsi512_si256(P->u[q]), 1);
            break;
        }
        cb_fast_avx512vl_pack_il(&h, g + (size_t)half * 8 * rb, 4 * 8 * rb, dt, k0, kc);
        for (int64_t q = 0; q < nq; q++)
            P->u[q] = half ? _mm512_inserti64x4(P->u[q], h.u[q], 1) : _mm512_castsi256_si512(h.u[q]);
        for (int64_t j = 0; j < ng; j++) {
            P->ws[j] = half ? ins_hi(P->ws[j], h.ws[j]) : _mm512_castps256_ps512(h.ws[j]);
            P->wm[j] = half ? ins_hi(P->wm[j], h.wm[j]) : _mm512_castps256_ps512(h.wm[j]);
        }
    }
    if (rows <= 8)
        for (int64_t j = 0; j < ng; j++) {
            P->ws[j] = ins_hi(P->ws[j], _mm512_castps512_ps256(P->ws[j]));
            P->wm[j] = ins_hi(P->wm[j], _mm512_castps512_ps256(P->wm[j]));
        }
}

const cb_fast_kernels *cb_fast_avx512vnni(void) { return &FS(table); }

#else /* built without the flags (not x86, an old compiler) or for the fuzzers: no table */
const cb_fast_kernels *cb_fast_avx512vnni(void) { return NULL; }
#endif

