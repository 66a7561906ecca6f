/*
 * fast_attention_avx512.c — the fast mode's attention (fast.h, attention_heads) on AVX-512:
 * float32 throughout, like the exact kernels' (kernels_simd.inc), but with the keys in the
 * lanes of the score vectors instead of the head dimensions, so that no score needs a
 * horizontal sum. Its summation order is its own; so are its bits (fast mode's tables
 * each define theirs, fast.h).
 *
 * The definition, for query t (position pos, the keys lo .. pos as kernels.h defines them)
 * and query head h of KV head g, bit for bit whatever the tokens, heads or cache blocks that
 * share the call (native/tests/test_kernels.c checks it):
 *  - s_j = scale * (ONE fused multiply-add chain over the dimensions d ascending, from 0,
 *    of q[d] * k_j[d]);
 *  - m = the max of the s_j (and of the sink); e_j = vexp(s_j - m) (simd_math.h); their sum
 *    runs by lanes over the keys' vectors of 16 (aligned to multiples of 16 positions, from
 *    the vector holding lo, ascending; lanes outside lo .. pos add nothing), then vhsum,
 *    then, with sinks, + expf(sink - m);
 *  - out[d] = (ONE fused multiply-add chain over the keys j = lo .. pos ascending, from 0,
 *    of e_j * v_j[d]) * (1 / sum).
 *
 * A call transposes the keys it reads once (the KV head's positions from the first query's
 * lo, aligned down to 32, up to start_pos + T) into vectors of 16 keys by dimension (KT, in
 * the thread's work area; up to FA_FEW_T queries, a decode step, transpose each 4 vectors
 * as they go instead, into a tile that stays in L1). A query's scores then take 4 key
 * vectors by up to 4 heads per pass over d (16 accumulators: a load per key vector and a
 * broadcast per head feed 16 FMAs), and its output 64 dimensions by up to 4 heads per pass
 * over the keys, each value row read straight from the cache once for all the heads. Per
 * (head, key) that is 2 x D / 16 FMAs and little else; the exact kernels' scores also pay a
 * horizontal sum.
 *
 * The tables with native BF16 kernels on x86 (avx512bf16, AMX: cpu/fast.c) run it; they
 * already sum in their own order. The int8 tables keep the exact kernels' attention, so that
 * each of them still gives the reference table's bits (fast.h).
 *
 * Compiled with -mavx512f -mavx2 -mfma -mf16c; entered only through those tables, which
 * cb_fast_by_name() has checked the CPU for (AVX-512 included).
 */
#include "cpu/fast.h"

#if defined(__AVX512F__) && !defined(COLIBRI_NO_SIMD_TABLES)
#include <immintrin.h>

#include "cpu/x86/simd_avx512.h"
#include "cpu/simd_math.h"

#define FA_AI static inline __attribute__((always_inline))
#define FA_NH CB_ATT_HEADS /* query heads per pass */

/* CALL(NH, N) with the run-time nh and n (1 .. 4 each) as compile-time constants, so that
 * the tiles' accumulators stay in registers */
#define FA_CASES(NH, n, CALL)                                                                           \
    switch (n) {                                                                                        \
    case 1: CALL(NH, 1); break;                                                                         \
    case 2: CALL(NH, 2); break;                                                                         \
    case 3: CALL(NH, 3); break;                                                                         \
    default: CALL(NH, 4); break;                                                                        \
    }
#define FA_DISPATCH(nh, n, CALL)                                                                        \
    switch (nh) {                                                                                       \
    case 1: FA_CASES(1, n, CALL) break;                                                                 \
    case 2: FA_CASES(2, n, CALL) break;                                                                 \
    case 3: FA_CASES(3, n, CALL) break;                                                                 \
    default: FA_CASES(4, n, CALL) break;                                                                \
    }

/* the lanes of keys k0 .. k0 + 15 that lie in lo .. pos */
FA_AI __mmask16 key_lanes(int64_t k0, int64_t lo, int64_t pos) {
    int64_t a = lo - k0 > 0 ? lo - k0 : 0, b = pos - k0 + 1 < 16 ? pos - k0 + 1 : 16;
    return b <= a ? 0 : (__mmask16)(((1u << b) - 1u) & ~((1u << a) - 1u));
}

/* Scores of NH heads (query rows qh[i]) against the key vectors v0 .. v0 + NV (kt: their
 * keys, transposed as att_keys stores them): scaled, lanes outside lo .. pos set to -inf,
 * stored to the heads' score rows (SC + i * S16) and maxed into mx[i]. */
FA_AI void att_qk(float *SC, int64_t S16, vf *mx, const float *const *qh, const float *kt, int64_t D, int64_t v0,
                  int64_t base, int64_t lo, int64_t pos, float scale, const int NH, const int NV) {
    vf acc[FA_NH][4];
    for (int i = 0; i < NH; i++)
        for (int k = 0; k < NV; k++) acc[i][k] = vzero();
    for (int64_t d = 0; d < D; d++) {
        vf kv[4];
        for (int k = 0; k < NV; k++) kv[k] = vload(kt + (k * D + d) * 16);
        for (int i = 0; i < NH; i++) {
            vf b = vset1(qh[i][d]);
            for (int k = 0; k < NV; k++) acc[i][k] = vfma(b, kv[k], acc[i][k]);
        }
    }
    for (int k = 0; k < NV; k++) {
        __mmask16 m = key_lanes(base + 16 * (v0 + k), lo, pos);
        for (int i = 0; i < NH; i++) {
            vf s = vmul(acc[i][k], vset1(scale));
            if (m != 0xFFFF) s = _mm512_mask_mov_ps(vset1(-INFINITY), m, s);
            mx[i] = vmax(mx[i], s);
            vstore(SC + i * S16 + 16 * (v0 + k), s);
        }
    }
}

/* o[i][d0 .. d0 + 16 ND) = (the chain over the keys lo .. pos of e[i][j] * v_j) * inv[i] for
 * NH heads, e[i] the heads' exps (E + i * S16, from position base), the values from the
 * cache one block's run at a time. */
FA_AI void att_pv(float *const *o, const cb_kv_view *kv, int64_t g, const float *E, int64_t S16, int64_t base,
                  int64_t D, int64_t d0, int64_t lo, int64_t pos, const float *inv, const int NH, const int ND) {
    vf acc[FA_NH][4];
    for (int i = 0; i < NH; i++)
        for (int k = 0; k < ND; k++) acc[i][k] = vzero();
    const int64_t P = kv->block_len;
    for (int64_t j = lo; j <= pos;) {
        const int64_t run = P - j % P < pos + 1 - j ? P - j % P : pos + 1 - j; /* positions left in the block */
        const float *vb = cb_kv_at(kv->v, kv, g, j, D) + d0;
        const float *e = E + (j - base);
        for (int64_t jj = 0; jj < run; jj++) {
            vf vv[4];
            for (int k = 0; k < ND; k++) vv[k] = vload(vb + jj * D + 16 * k);
            for (int i = 0; i < NH; i++) {
                vf b = vset1(e[i * S16 + jj]);
                for (int k = 0; k < ND; k++) acc[i][k] = vfma(b, vv[k], acc[i][k]);
            }
        }
        j += run;
    }
    for (int i = 0; i < NH; i++)
        for (int k = 0; k < ND; k++) vstore(o[i] + d0 + 16 * k, vmul(acc[i][k], vset1(inv[i])));
}

/* KT = the keys of KV head g at positions k0 .. k0 + n (n a multiple of 16, zeros from kend
 * on) as vectors of 16 keys by dimension: KT[(v * D + d) * 16 + l] = key k0 + 16 v + l, dim d. */
static void att_keys(float *KT, const cb_kv_view *kv, int64_t g, int64_t k0, int64_t kend, int64_t n, int64_t D) {
    for (int64_t v = 0; v < n / 16; v++) {
        const float *kr[16];
        for (int l = 0; l < 16; l++) {
            int64_t j = k0 + 16 * v + l;
            kr[l] = j < kend ? cb_kv_at(kv->k, kv, g, j, D) : NULL;
        }
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            __m512i r[16];
            for (int l = 0; l < 16; l++) r[l] = kr[l] ? _mm512_loadu_si512(kr[l] + d0) : _mm512_setzero_si512();
            tr16x16_epi32(r);
            for (int j = 0; j < 16; j++) _mm512_storeu_si512(KT + (v * D + d0 + j) * 16, r[j]);
        }
    }
}

/* Up to this many queries transpose each 4 vectors of keys as their scores need them (into a
 * tile that stays in L1) instead of all the call's keys once: a decode step reads its keys
 * once, as the exact kernels do. The same operations on the same values either way. */
#define FA_FEW_T 4

/* The work area: KT [S16 / 16][D][16], then the score rows [FA_NH][S16] (S16 covers the keys
 * from the first query's lo aligned down to 32, rounded up to 16), then the few queries' tile
 * of 4 key vectors [4][D][16]. */
size_t cb_fast_att_avx512_bytes(int64_t S, int64_t D) {
    uint64_t S16 = (uint64_t)S + 48;
    return (size_t)(S16 * (uint64_t)D * 4 + S16 * FA_NH * 4 + 64 * (uint64_t)D * 4 + 64);
}

void cb_fast_att_avx512(float *out, const float *q, const cb_kv_view *kv, void *work, int64_t T, int64_t start_pos,
                        int64_t Hq, int64_t Hkv, int64_t D, int64_t window, const float *sinks, int64_t h0, int64_t h1) {
    const int64_t group = Hq / Hkv, nq = Hq * D, kend = start_pos + T;
    const float scale = (float)(1.0 / sqrt((double)D)); /* the exact kernels' */
    const int64_t lo0 = (window > 0 && start_pos >= window) ? start_pos - window + 1 : 0;
    const int64_t base = lo0 & ~(int64_t)31, S16 = (kend - base + 15) & ~(int64_t)15;
    float *KT = (float *)(((uintptr_t)work + 63) & ~(uintptr_t)63);
    float *SC = KT + S16 * D;         /* scores, then their exps */
    float *tile = SC + FA_NH * S16;   /* few queries: 4 key vectors at a time */
    const int few = T <= FA_FEW_T;
    for (int64_t g = h0 / group; g * group < h1; g++) {
        if (!few) att_keys(KT, kv, g, base, kend, S16, D);
        const int64_t ha = g * group > h0 ? g * group : h0, hb = (g + 1) * group < h1 ? (g + 1) * group : h1;
        for (int64_t t = 0; t < T; t++) {
            const int64_t pos = start_pos + t, lo = (window > 0 && pos >= window) ? pos - window + 1 : 0;
            const int64_t v_lo = (lo - base) / 16, v_hi = (pos - base) / 16;
            for (int64_t h = ha; h < hb; h += FA_NH) {
                const int nh = (int)(hb - h < FA_NH ? hb - h : FA_NH);
                const float *qh[FA_NH];
                float *o[FA_NH], inv[FA_NH];
                vf mx[FA_NH];
                for (int i = 0; i < nh; i++) {
                    qh[i] = q + t * nq + (h + i) * D;
                    o[i] = out + t * nq + (h + i) * D;
                    mx[i] = vset1(-INFINITY);
                }
                for (int64_t v = v_lo; v <= v_hi; v += 4) {
                    const int nv = (int)(v_hi - v + 1 < 4 ? v_hi - v + 1 : 4);
                    const float *kt = KT + v * D * 16;
                    if (few) {
                        att_keys(tile, kv, g, base + 16 * v, kend, 16 * nv, D);
                        kt = tile;
                    }
#define FA_QK(NH, NV) att_qk(SC, S16, mx, qh, kt, D, v, base, lo, pos, scale, NH, NV)
                    FA_DISPATCH(nh, nv, FA_QK);
#undef FA_QK
                }
                for (int i = 0; i < nh; i++) { /* the exps in place of the scores, and their sum */
                    float m = vhmax(mx[i]);
                    if (sinks && sinks[h + i] > m) m = sinks[h + i];
                    vf sum = vzero(), mv = vset1(m);
                    for (int64_t v = v_lo; v <= v_hi; v++) {
                        float *sv = SC + i * S16 + 16 * v;
                        vf e = _mm512_maskz_mov_ps(key_lanes(base + 16 * v, lo, pos), vexp(vsub(vload(sv), mv)));
                        sum = vadd(sum, e);
                        vstore(sv, e);
                    }
                    float tot = vhsum(sum);
                    if (sinks) tot += expf(sinks[h + i] - m);
                    inv[i] = 1.0f / tot;
                }
                for (int64_t d0 = 0; d0 < D; d0 += 64) {
                    const int nd = (int)(D - d0 < 64 ? (D - d0) / 16 : 4);
#define FA_PV(NH, ND) att_pv(o, kv, g, SC, S16, base, D, d0, lo, pos, inv, NH, ND)
                    FA_DISPATCH(nh, nd, FA_PV);
#undef FA_PV
                }
            }
        }
    }
}

#else /* built without AVX-512 (not x86, an old compiler) or for the fuzzers: never entered */
size_t cb_fast_att_avx512_bytes(int64_t S, int64_t D) {
    (void)S, (void)D;
    return 0;
}
void cb_fast_att_avx512(float *out, const float *q, const cb_kv_view *kv, void *work, int64_t T, int64_t start_pos,
                        int64_t Hq, int64_t Hkv, int64_t D, int64_t window, const float *sinks, int64_t h0, int64_t h1) {
    (void)out, (void)q, (void)kv, (void)work, (void)T, (void)start_pos, (void)Hq, (void)Hkv, (void)D, (void)window;
    (void)sinks, (void)h0, (void)h1;
}
#endif
