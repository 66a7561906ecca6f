/*
 * fast_bf16dp.c — the fast mode's BF16 kernels on AVX512_BF16 (vdpbf16ps: 32 bf16
 * multiply-adds into 16 float32 lanes per instruction), for CPUs that have it without AMX
 * (AMD Zen 4/5: one zmm vdpbf16ps per cycle, twice the multiply-adds of a zmm FMA). The
 * activations are already rounded to bf16 (backend/cpu/stages.c), so their conversion here is exact.
 *
 * The definition (what every path below computes, bit for bit): output (t, n) of x W^T is ONE
 * chain of vdpbf16ps over the column pairs (2q, 2q + 1) in ascending q, starting at 0; the
 * packed experts' down projection likewise over the pairs of intermediate rows (2i, 2i + 1),
 * per block of CB_DOWN_BLOCK rows, the blocks' sums then added in order. A lane's result does not depend on which lane or which vector it ran in, so the layouts
 * below give the same bits, whatever the number of tokens, their tiling or the thread split:
 * deterministic and batch-invariant (native/tests/test_kernels.c: a token alone = the batch,
 * through both layouts). Not other tables' bits (the instruction's internal rounding is the
 * CPU's: round-to-nearest-even, denormals flushed).
 *
 * Two layouts for W [N, K] (a matmul, a split or packed gate/up), chosen by the token count:
 *
 *  - prefill (T > CB_DP_ROWS_T): lanes = 16 TOKENS. The tokens' activations are converted
 *    once per tile of up to 64 tokens to bf16 pairs and transposed (XT[q] = pair q of 16
 *    tokens); each weight pair is broadcast straight from the row-major mapping, so the weights
 *    are never repacked. The micro-kernel keeps RB rows x NV token vectors of accumulators
 *    (6 x 4, 8 x 3, 8 x 2 or 8 x 1: 8 to 24 zmm; never more than 8 rows below 4 vectors:
 *    rows 2 KiB apart share two L1 sets, and 12 or 16 of them evict each other): per pair,
 *    NV loads and RB broadcasts feed RB * NV vdpbf16ps. At the end of the chains the outputs
 *    go through a tile on the stack (Zen 4 runs vscatterdps slowly). The tokens past the last
 *    whole vector, up to CB_DP_ROWS_T of them, take the decode layout instead (tok_lanes).
 *  - decode and small groups (T <= CB_DP_ROWS_T = 8): lanes = 16 ROWS. Each step loads 32
 *    columns of 16 rows, transposes them in registers (16 pair vectors, lane = row) and runs
 *    the tokens' broadcast pairs through them: nothing is stored but the outputs, the panel
 *    streams once, and the next panel is prefetched into L2 on the way.
 *
 * The packed experts' down projection (w2^T [I, H]) has lanes = output columns in both cases:
 * two w2^T rows become pairs in column order (vpermq, vpunpck{l,h}wd) and each token's pair of
 * h is broadcast, up to 6 tokens by 64 columns per step; its sum runs by blocks of
 * CB_DOWN_BLOCK rows, as the exact kernels' (see below).
 *
 * The *_panels entries read the engine's panel copies (cpu/panel.h, backend/cpu/panels.c) instead: the
 * same chains (same bits), but the decode layout loads 16 rows' pair q as one vector (no
 * transpose; pan_chain), prefill runs the same pan_chain by steps of 6 tokens over each
 * group's vectors (the token lanes, broadcasting weight pairs 256 bytes apart, ran gate/up
 * slower there than on row-major rows: tools/kernel_bench.c), and the down projection finds
 * its pairs already made, one slab after another.
 *
 * Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mavx2 -mfma -mf16c; entered
 * only after cb_fast_by_name("avx512bf16") has checked the CPU. Buffers on the stack (at most
 * about 260 KiB); rows up to 4096 wide (cb_fast_bf16_k_ok), other shapes take the f32 path.
 */
#include "cpu/fast.h"

#include <string.h>

#include "cpu/kernels.h" /* CB_DOWN_BLOCK */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && !defined(COLIBRI_NO_SIMD_TABLES)
#include <immintrin.h>

#include "cpu/x86/simd_avx512.h"
#include "cpu/simd_math.h"

#define DKMAX CB_FAST_BF16_MAX_K /* the longest rows here */
#define CB_DP_ROWS_T 8            /* up to this many tokens take the decode layout */
#define XT_DWORDS 65536           /* the prefill's transposed activations: 256 KiB */
#define DP_AI static inline __attribute__((always_inline))

int cb_bf16dp_built(void) { return 1; }

typedef __m512i vi;

/* 32 floats already rounded to bf16 as 32 bf16 (exact): dword j = the pair (p[2j], p[2j+1]) */
DP_AI vi bf16x32(const float *p) {
    return (vi)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p));
}
DP_AI vf dp(vf acc, vi a, vi b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
/* cb_round_bf16 on 16 lanes: the same integer steps (ties to even; nan stays nan) */
DP_AI vf round_bf16(vf v) {
    vi u = _mm512_castps_si512(v);
    vi odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    vi r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))),
                            _mm512_set1_epi32((int)0xffff0000u));
    __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, nan, u));
}
/* silu(g) * u, rounded to bf16 when rnd (the packed expert's h, fast.h) */
DP_AI vf silu_mul_out(vf g, vf u, int rnd) {
    vf h = vmul(vsilu(g), u);
    return rnd ? round_bf16(h) : h;
}
DP_AI __mmask16 lanes(int64_t n) { return (__mmask16)(n >= 16 ? 0xFFFFu : n <= 0 ? 0u : (1u << n) - 1u); }

/* ---- prefill: lanes = tokens ----------------------------------------------------------- */

/* Tokens [0, nt) of x (rows of stride ldx), columns k0 .. k0 + kc (kc a multiple of 32), as
 * pairs with tokens in lanes: XT[(q * NV + v) * 16 + l] = pair q of token 16 v + l (0 past nt). */
static void xt_pack(uint32_t *XT, const float *x, int64_t ldx, int64_t nt, int64_t k0, int64_t kc) {
    int64_t NV = (nt + 15) / 16;
    for (int64_t v = 0; v < NV; v++)
        for (int64_t c = 0; c < kc; c += 32) {
            vi r[16];
            for (int l = 0; l < 16; l++)
                r[l] = 16 * v + l < nt ? bf16x32(x + (16 * v + l) * ldx + k0 + c) : _mm512_setzero_si512();
            tr16x16_epi32(r);
            for (int j = 0; j < 16; j++) _mm512_storeu_si512(XT + ((c / 2 + j) * NV + v) * 16, r[j]);
        }
}

/* The micro-kernels: RB rows by NV token vectors of accumulators, acc[r][v] lane l the chain
 * of row r (row-major: dword pointer w[r], pair q at w[r][q]) and token 16 v + l. One function per shape
 * with arrays of literal sizes, so that the compiler keeps them all in registers. */
#define TOK_CHAIN(RB, NV)                                                                                \
    for (int64_t q = 0; q < np; q++) {                                                                   \
        vi xv[NV];                                                                                       \
        for (int v = 0; v < NV; v++) xv[v] = _mm512_loadu_si512(XT + (q * NV + v) * 16);                 \
        for (int r = 0; r < RB; r++) {                                                                   \
            vi b = _mm512_set1_epi32((int)w[r][q]);                                                  \
            for (int v = 0; v < NV; v++) acc[r][v] = dp(acc[r][v], xv[v], b);                            \
        }                                                                                                \
    }

/* y[t * ldy + r] (t < nt, r < nr) for rows wp[0 .. RB) (pairs [0, np) of this pass), continuing
 * the chains stored in y when cont; rows past nr repeat a valid one and are not stored. */
#define TOK_MM(RB, NV)                                                                                             \
    static __attribute__((noinline)) void tok_mm_##RB##x##NV(float *y, int64_t ldy, const uint32_t *XT, const uint32_t *const *wp,          \
                                   int64_t np, int64_t nr, int64_t nt, int cont) {                                 \
        vf acc[RB][NV];                                                                                            \
        const uint32_t *w[RB];                                                                                     \
        float tile[RB][NV * 16];                                                                                   \
        if (cont) { /* (k0 > 0) the chains so far; the rest of the tile zero, never stored */                   \
            memset(tile, 0, sizeof tile);                                                                          \
            for (int64_t t = 0; t < nt; t++)                                                                       \
                for (int64_t r = 0; r < nr; r++) tile[r][t] = y[t * ldy + r];                                      \
        }                                                                                                          \
        for (int r = 0; r < RB; r++) {                                                                             \
            w[r] = wp[r];                                                                                          \
            for (int v = 0; v < NV; v++)                                                                           \
                acc[r][v] = cont && r < nr ? _mm512_maskz_loadu_ps(lanes(nt - 16 * v), tile[r] + 16 * v) : vzero(); \
        }                                                                                                          \
        TOK_CHAIN(RB, NV)                                                                                          \
        for (int r = 0; r < RB; r++)                                                                               \
            for (int v = 0; v < NV; v++) _mm512_storeu_ps(tile[r] + 16 * v, acc[r][v]);                            \
        for (int64_t t = 0; t < nt; t++)                                                                           \
            for (int64_t r = 0; r < nr; r++) y[t * ldy + r] = tile[r][t];                                          \
    }
TOK_MM(6, 4)
TOK_MM(8, 3)
TOK_MM(8, 2)
TOK_MM(8, 1)

/* h[t * ldh + r] = silu(gate_r . x_t) * (up_r . x_t) for t < nt, r < nr: RG gate rows gp[] and
 * RG up rows up[] (dword pointers), whole rows (np pairs) in one pass. */
#define TOK_GU(RG, NV)                                                                                             \
    static __attribute__((noinline)) void tok_gu_##RG##x##NV(float *h, int64_t ldh, const uint32_t *XT, const uint32_t *const *gp,          \
                                   const uint32_t *const *up, int64_t np, int64_t nr, int64_t nt, int rnd) {       \
        vf acc[2 * RG][NV];                                                                                        \
        const uint32_t *w[2 * RG];                                                                                 \
        for (int r = 0; r < RG; r++) w[r] = gp[r], w[RG + r] = up[r];                                              \
        for (int r = 0; r < 2 * RG; r++)                                                                           \
            for (int v = 0; v < NV; v++) acc[r][v] = vzero();                                                      \
        TOK_CHAIN(2 * RG, NV)                                                                                      \
        float out[RG][NV * 16];                                                                                    \
        for (int r = 0; r < RG; r++)                                                                               \
            for (int v = 0; v < NV; v++) _mm512_storeu_ps(out[r] + 16 * v, silu_mul_out(acc[r][v], acc[RG + r][v], rnd)); \
        for (int64_t t = 0; t < nt; t++)                                                                           \
            for (int64_t r = 0; r < nr; r++) h[t * ldh + r] = out[r][t];                                           \
    }
TOK_GU(3, 4)
TOK_GU(4, 3)
TOK_GU(4, 2)
TOK_GU(4, 1)

/* Rows per micro-kernel call for NV token vectors: 24 accumulators for 4 and 3 vectors, 16 and
 * 8 for 2 and 1 (at most 8 rows there: see the top of this file). */
static int64_t tok_rows(int64_t NV) { return NV == 4 ? 6 : 8; }

/* A matrix's rows: row-major (G == 0: row n at w + n K) or the panel layout of N rows by
 * groups of G (fast.h). */
typedef struct wmat {
    const uint16_t *w;
    int64_t K, N, G;
} wmat;

/* Row n's dword pointer at pair 0, and its stride in dwords per pair (*S). */
DP_AI const uint32_t *wrow(const wmat *m, int64_t n, int64_t *S) {
    if (!m->G) {
        *S = 1;
        return (const uint32_t *)(m->w + (size_t)n * (size_t)m->K);
    }
    int64_t g0 = n / m->G * m->G, r = n - g0;
    *S = (m->N - g0 < m->G ? m->N - g0 : m->G);
    return (const uint32_t *)m->w + (size_t)g0 * (size_t)(m->K / 2) + r;
}
/* The end of row n's group (the rows that share its stride). */
DP_AI int64_t wgroup_end(const wmat *m, int64_t n) { return m->G ? (n / m->G + 1) * m->G : INT64_MAX; }

/* A SwiGLU FFN's gate/up rows: split (B = 0, G = 0: gate and up [I, H]), packed (B > 0: the
 * expert, blocks of B rows) or the expert's panel copy (G = 2 CB_PANEL_UNITS; up unused). */
typedef struct wgu {
    const uint16_t *gate, *up;
    int64_t H, I, B, G;
} wgu;

/* Unit i's gate and up rows (dword pointers at pair 0; ur may be NULL) and their stride. */
DP_AI void gu_row(const wgu *m, int64_t i, const uint32_t **gr, const uint32_t **ur, int64_t *S) {
    int64_t H = m->H, I = m->I;
    if (m->G) {
        int64_t u0 = i / CB_PANEL_UNITS * CB_PANEL_UNITS, nu = I - u0 < CB_PANEL_UNITS ? I - u0 : CB_PANEL_UNITS;
        wmat p = {m->gate, H, 2 * I, m->G};
        *gr = wrow(&p, 2 * u0 + (i - u0), S);
        if (ur) *ur = *gr + nu; /* the up vectors follow the gate ones in each pair's run */
        return;
    }
    *S = 1;
    if (m->B > 0) {
        int64_t bs = i / m->B * m->B, nb = I - bs < m->B ? I - bs : m->B;
        *gr = (const uint32_t *)(m->gate + (size_t)(2 * bs + (i - bs)) * (size_t)H);
        if (ur) *ur = *gr + (size_t)nb * (size_t)(H / 2);
    } else {
        *gr = (const uint32_t *)(m->gate + (size_t)i * (size_t)H);
        if (ur) *ur = (const uint32_t *)(m->up + (size_t)i * (size_t)H);
    }
}
DP_AI int64_t gu_group_end(const wgu *m, int64_t i) {
    return m->G ? (i / CB_PANEL_UNITS + 1) * CB_PANEL_UNITS : INT64_MAX;
}

/* Tokens per tile and columns per pass of the prefill matmul: 64 x 2048 (XT_DWORDS). */
#define MM_TT 64
#define MM_KC 2048
#define PF_LINES 4 /* lines of each of the next gate/up call's rows prefetched (row-major) */

/* The decode layout's kernels (below), which also take the tokens past the last whole vector
 * of a prefill: a vector of 16 token lanes costs one vdpbf16ps per row and pair however few of
 * its lanes are used, the decode layout 16 loads and a transpose per 16 rows and 32 columns
 * plus one vdpbf16ps per token, less for up to CB_DP_ROWS_T tokens. Same bits either way.
 * Rows [n0, n1) of W into y + (n - n0); units [i0, i1) of h. */
static void row_matmul(float *y, int64_t ldy, const float *x, const uint16_t *W, int64_t T, int64_t N, int64_t K);
static void row_gateup(float *h, const float *x, const wgu *W, int64_t R, int64_t i0, int64_t i1, int rnd);

/* Of T > CB_DP_ROWS_T tokens, how many the token lanes take: all, or all but a last partial
 * vector that the decode layout takes. */
static int64_t tok_lanes(int64_t T) { return T % 16 <= CB_DP_ROWS_T ? T - T % 16 : T; }

static void tok_matmul(float *y, int64_t ldy, const float *x, const wmat *W, int64_t T0, int64_t n0, int64_t n1) {
    uint32_t XT[XT_DWORDS];
    int64_t T = tok_lanes(T0), K = W->K;
    if (T < T0) row_matmul(y + T * ldy, ldy, x + T * K, W->w + (size_t)n0 * (size_t)K, T0 - T, n1 - n0, K);
    for (int64_t t0 = 0; t0 < T; t0 += MM_TT) {
        int64_t nt = T - t0 < MM_TT ? T - t0 : MM_TT, NV = (nt + 15) / 16, RB = tok_rows(NV);
        for (int64_t k0 = 0; k0 < K; k0 += MM_KC) {
            int64_t kc = K - k0 < MM_KC ? K - k0 : MM_KC;
            xt_pack(XT, x + t0 * K, K, nt, k0, kc);
            for (int64_t n = n0, nr; n < n1; n += nr) {
                nr = n1 - n < RB ? n1 - n : RB;
                const uint32_t *w[16];
                for (int64_t r = 0; r < RB; r++)
                    w[r] = (const uint32_t *)(W->w + (size_t)(n + (r < nr ? r : nr - 1)) * (size_t)K) + k0 / 2;
                float *yt = y + t0 * ldy + (n - n0);
                int cont = k0 > 0;
                if (NV == 4) tok_mm_6x4(yt, ldy, XT, w, kc / 2, nr, nt, cont);
                else if (NV == 3) tok_mm_8x3(yt, ldy, XT, w, kc / 2, nr, nt, cont);
                else if (NV == 2) tok_mm_8x2(yt, ldy, XT, w, kc / 2, nr, nt, cont);
                else tok_mm_8x1(yt, ldy, XT, w, kc / 2, nr, nt, cont);
            }
        }
    }
}

static void tok_gateup(float *h, const float *x, const wgu *W, int64_t R0, int64_t i0, int64_t i1, int rnd) {
    uint32_t XT[XT_DWORDS];
    int64_t R = tok_lanes(R0), H = W->H, I = W->I;
    if (R < R0) row_gateup(h + R * I, x + R * H, W, R0 - R, i0, i1, rnd);
    int64_t TT = (int64_t)XT_DWORDS / (H / 2) / 16 * 16; /* whole rows in one pass */
    if (TT > 64) TT = 64;
    for (int64_t t0 = 0; t0 < R; t0 += TT) {
        int64_t nt = R - t0 < TT ? R - t0 : TT, NV = (nt + 15) / 16, RG = tok_rows(NV) / 2;
        xt_pack(XT, x + t0 * H, H, nt, 0, H);
        for (int64_t c = i0, nr; c < i1; c += nr) {
            int64_t S; /* 1: row-major rows */
            nr = i1 - c < RG ? i1 - c : RG;
            const uint32_t *g[8], *u[8];
            for (int64_t r = 0; r < RG; r++) gu_row(W, c + (r < nr ? r : nr - 1), &g[r], &u[r], &S);
            if (c + RG < i1) /* the next call's rows: their first lines, the prefetchers then follow */
                for (int64_t r = 0; r < RG && c + RG + r < i1; r++) {
                    const uint32_t *gp, *up_;
                    int64_t S1;
                    gu_row(W, c + RG + r, &gp, &up_, &S1);
                    for (int l = 0; l < PF_LINES; l++) {
                        _mm_prefetch((const char *)gp + 64 * l, _MM_HINT_T0);
                        _mm_prefetch((const char *)up_ + 64 * l, _MM_HINT_T0);
                    }
                }
            float *ht = h + t0 * I + c;
            if (NV == 4) tok_gu_3x4(ht, I, XT, g, u, H / 2, nr, nt, rnd);
            else if (NV == 3) tok_gu_4x3(ht, I, XT, g, u, H / 2, nr, nt, rnd);
            else if (NV == 2) tok_gu_4x2(ht, I, XT, g, u, H / 2, nr, nt, rnd);
            else tok_gu_4x1(ht, I, XT, g, u, H / 2, nr, nt, rnd);
        }
    }
}

/* ---- decode: lanes = rows -------------------------------------------------------------- */

/* nt tokens of x (stride ldx) as pairs: xp[t * (K/2) + q] = pair q of token t */
static void pairs_of(uint32_t *xp, const float *x, int64_t ldx, int64_t nt, int64_t K) {
    for (int64_t t = 0; t < nt; t++)
        for (int64_t k = 0; k < K; k += 32) _mm512_storeu_si512(xp + t * (K / 2) + k / 2, bf16x32(x + t * ldx + k));
}

/* The chains of 16 rows (pointers p[16]) by NT tokens over all K: per 32 columns, 16 loads,
 * a transpose in registers, then pair j of every row (vector j) times each token's pair. The
 * step consumes 16 lines; as many lines of the next panel (pf: 16 rows of K, contiguous in
 * the split and packed layouts) are prefetched into L2 in address order, so that the whole
 * next panel is in flight by the end of this one. */
DP_AI void row_chain(vf *acc, const uint16_t *const *p, const uint32_t *xp, int64_t K, const int NT,
                     const uint16_t *pf) {
    int64_t np = K / 2;
    for (int t = 0; t < NT; t++) acc[t] = vzero();
    for (int64_t c = 0; c < K; c += 32) {
        vi r[16];
        for (int l = 0; l < 16; l++) r[l] = _mm512_loadu_si512(p[l] + c);
        const char *pfc = (const char *)(pf + 16 * c);
        for (int l = 0; l < 16; l++) _mm_prefetch(pfc + 64 * l, _MM_HINT_T1);
        tr16x16_epi32(r);
        for (int j = 0; j < 16; j++)
            for (int t = 0; t < NT; t++) acc[t] = dp(acc[t], r[j], _mm512_set1_epi32((int)xp[t * np + c / 2 + j]));
    }
}

static void row_matmul(float *y, int64_t ldy, const float *x, const uint16_t *W, int64_t T, int64_t N, int64_t K) {
    uint32_t xp[CB_DP_ROWS_T * DKMAX / 2];
    pairs_of(xp, x, K, T, K);
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
        int64_t nr = N - n0 < 16 ? N - n0 : 16;
        const uint16_t *p[16];
        for (int l = 0; l < 16; l++) p[l] = W + (size_t)(n0 + (l < nr ? l : nr - 1)) * (size_t)K;
        const uint16_t *pf = W + (size_t)(n0 + 16 < N ? n0 + 16 : n0) * (size_t)K;
        vf acc[CB_DP_ROWS_T];
        switch (T) {
        case 1: row_chain(acc, p, xp, K, 1, pf); break;
        case 2: row_chain(acc, p, xp, K, 2, pf); break;
        case 3: row_chain(acc, p, xp, K, 3, pf); break;
        case 4: row_chain(acc, p, xp, K, 4, pf); break;
        case 5: row_chain(acc, p, xp, K, 5, pf); break;
        case 6: row_chain(acc, p, xp, K, 6, pf); break;
        case 7: row_chain(acc, p, xp, K, 7, pf); break;
        default: row_chain(acc, p, xp, K, 8, pf); break;
        }
        for (int64_t t = 0; t < T; t++) _mm512_mask_storeu_ps(y + t * ldy + n0, lanes(nr), acc[t]);
    }
}

static void row_gateup(float *h, const float *x, const wgu *W, int64_t R, int64_t i0, int64_t i1, int rnd) {
    int64_t H = W->H, I = W->I;
    uint32_t xp[CB_DP_ROWS_T * DKMAX / 2];
    pairs_of(xp, x, H, R, H);
    for (int64_t c = i0; c < i1; c += 16) {
        int64_t nr = i1 - c < 16 ? i1 - c : 16, S;
        const uint16_t *gp[16], *up_[16];
        const uint32_t *g32, *u32, *gn; /* gn: the next gate panel */
        for (int l = 0; l < 16; l++) {
            gu_row(W, c + (l < nr ? l : nr - 1), &g32, &u32, &S);
            gp[l] = (const uint16_t *)g32, up_[l] = (const uint16_t *)u32;
        }
        gu_row(W, c + 16 < i1 ? c + 16 : c, &gn, NULL, &S);
        vf g[CB_DP_ROWS_T], u[CB_DP_ROWS_T];
        switch (R) {
#define GU_CASE(n) \
    case n: row_chain(g, gp, xp, H, n, up_[0]), row_chain(u, up_, xp, H, n, (const uint16_t *)gn); break;
        GU_CASE(1) GU_CASE(2) GU_CASE(3) GU_CASE(4) GU_CASE(5) GU_CASE(6) GU_CASE(7)
        default: row_chain(g, gp, xp, H, 8, up_[0]), row_chain(u, up_, xp, H, 8, (const uint16_t *)gn); break;
#undef GU_CASE
        }
        for (int64_t t = 0; t < R; t++) _mm512_mask_storeu_ps(h + t * I + c, lanes(nr), silu_mul_out(g[t], u[t], rnd));
    }
}

/* ---- decode on the panel layout: lanes = rows, no transpose ----------------------------- */

/* NV vectors of 16 rows (dword pointers vp[v] at pair 0, S dwords per pair) by NT tokens:
 * acc[v * NT + t], each lane one chain over the pairs from 0 (row_chain's chains: same bits). */
DP_AI void pan_chain(vf *acc, const uint32_t *const *vp, int64_t S, const uint32_t *xp, int64_t np, const int NV,
                     const int NT) {
    for (int i = 0; i < NV * NT; i++) acc[i] = vzero();
    for (int64_t q = 0; q < np; q++) {
        vi xb[CB_DP_ROWS_T];
        for (int t = 0; t < NT; t++) xb[t] = _mm512_set1_epi32((int)xp[t * np + q]);
        for (int v = 0; v < NV; v++) {
            vi w = _mm512_loadu_si512(vp[v] + q * S);
            for (int t = 0; t < NT; t++) acc[v * NT + t] = dp(acc[v * NT + t], w, xb[t]);
        }
    }
}

/* pan_chain on PAN4_PER(T) vectors by T <= CB_DP_ROWS_T tokens (at most 24 accumulators). */
#define PAN4_PER(T) ((T) <= 6 ? 4 : 3)
DP_AI void pan_chain4(vf *acc, const uint32_t *const *vp, int64_t S, const uint32_t *xp, int64_t np, int64_t T) {
    switch (T) {
    case 1: pan_chain(acc, vp, S, xp, np, 4, 1); break;
    case 2: pan_chain(acc, vp, S, xp, np, 4, 2); break;
    case 3: pan_chain(acc, vp, S, xp, np, 4, 3); break;
    case 4: pan_chain(acc, vp, S, xp, np, 4, 4); break;
    case 5: pan_chain(acc, vp, S, xp, np, 4, 5); break;
    case 6: pan_chain(acc, vp, S, xp, np, 4, 6); break;
    case 7: pan_chain(acc, vp, S, xp, np, 3, 7); break;
    default: pan_chain(acc, vp, S, xp, np, 3, 8); break;
    }
}

/* Prefill on the panel copies: the tokens by tiles whose pairs fit XT_DWORDS, and in a tile,
 * pass by pass (a group's vectors), steps of PAN_STEP tokens: each step reads the pass's lines
 * whole (from L2 after the first step), one vector per load, the tokens' pairs broadcast, as
 * decode does. Faster than the lanes-are-tokens kernels (tok_*) on these copies and near the
 * vdpbf16ps peak (tools/kernel_bench.c; figures in docs/kernels.md, "Panel copies").
 * Decode (T <= CB_DP_ROWS_T: one tile, one step) keeps a small stack buffer. */
#define PAN_STEP 6
_Static_assert(XT_DWORDS / (DKMAX / 2) >= PAN_STEP, "a tile holds a step");
/* A tile of pairs for steps of PAN_STEP tokens of rows of K: whole steps */
static int64_t pan_tile(int64_t K) { return XT_DWORDS / (K / 2) / PAN_STEP * PAN_STEP; }

/* Rows [n0, n1) (multiples of 16) of a panel matrix, PAN4_PER(step) vectors of one group per
 * pass, tiles of TT tokens, steps of `step` tokens. */
DP_AI void pan_matmul_in(float *y, int64_t ldy, const float *x, const wmat *W, int64_t T, int64_t n0, int64_t n1,
                         uint32_t *xp, int64_t TT, const int64_t step) {
    int64_t K = W->K, np = K / 2;
    const int64_t per = PAN4_PER(step);
    for (int64_t t0 = 0; t0 < T; t0 += TT) {
        int64_t nt = T - t0 < TT ? T - t0 : TT;
        pairs_of(xp, x + t0 * K, K, nt, K);
        for (int64_t n = n0, nv; n < n1; n += 16 * nv) {
            int64_t e = wgroup_end(W, n) < n1 ? wgroup_end(W, n) : n1, S = 0;
            nv = (e - n) / 16 < per ? (e - n) / 16 : per;
            const uint32_t *vp[4];
            for (int64_t v = 0; v < 4; v++) vp[v] = wrow(W, n + 16 * (v < nv ? v : nv - 1), &S);
            for (int64_t s = 0; s < nt; s += step) {
                int64_t ns = nt - s < step ? nt - s : step;
                vf acc[24];
                pan_chain4(acc, vp, S, xp + s * np, np, ns);
                float *ys = y + (t0 + s) * ldy + (n - n0);
                for (int64_t v = 0; v < nv; v++)
                    for (int64_t t = 0; t < ns; t++) _mm512_storeu_ps(ys + t * ldy + 16 * v, acc[v * ns + t]);
            }
        }
    }
}
static void pan_matmul(float *y, int64_t ldy, const float *x, const wmat *W, int64_t T, int64_t n0, int64_t n1) {
    if (T <= CB_DP_ROWS_T) {
        uint32_t xp[CB_DP_ROWS_T * DKMAX / 2];
        pan_matmul_in(y, ldy, x, W, T, n0, n1, xp, T, T);
    } else {
        uint32_t xp[XT_DWORDS];
        pan_matmul_in(y, ldy, x, W, T, n0, n1, xp, pan_tile(W->K), PAN_STEP);
    }
}

/* Units [i0, i1) (multiples of 16) of a packed expert's panel copy: GU_PER(step) vectors of
 * units (their gate and up vectors, 2 GU_PER chains per token) of one group per pass, at most
 * 24 accumulators, tiles of TT tokens, steps of `step` tokens. */
#define GU_PER0(R) ((R) <= 3 ? 4 : (R) == 4 ? 3 : (R) <= 6 ? 2 : 1)
#define GU_PER(R) (GU_PER0(R) < CB_PANEL_UNITS / 16 ? GU_PER0(R) : CB_PANEL_UNITS / 16)
/* n tokens on the pass's vectors: GU_PER(n) of them for a lone step (decode), GU_PER(PAN_STEP)
 * for every step of a prefill tile, its last and shorter one too */
#define GU_CHAIN(n) pan_chain(acc, vp, S, xs, np, 2 * GU_PER(step == PAN_STEP ? PAN_STEP : (n)), n)
DP_AI void pan_gateup_in(float *h, const float *x, const wgu *W, int64_t T, int64_t i0, int64_t i1, int rnd,
                         uint32_t *xp, int64_t TT, const int64_t step) {
    int64_t H = W->H, I = W->I, np = H / 2;
    const int64_t per = GU_PER(step);
    for (int64_t t0 = 0; t0 < T; t0 += TT) {
        int64_t nt = T - t0 < TT ? T - t0 : TT;
        pairs_of(xp, x + t0 * H, H, nt, H);
        for (int64_t i = i0, nv; i < i1; i += 16 * nv) {
            int64_t e = gu_group_end(W, i) < i1 ? gu_group_end(W, i) : i1, S = 0;
            nv = (e - i) / 16 < per ? (e - i) / 16 : per;
            const uint32_t *vp[8];
            for (int64_t v = 0; v < per; v++) gu_row(W, i + 16 * (v < nv ? v : nv - 1), &vp[v], &vp[per + v], &S);
            for (int64_t s = 0; s < nt; s += step) {
                int64_t ns = nt - s < step ? nt - s : step;
                const uint32_t *xs = xp + s * np;
                vf acc[24];
                switch (ns) {
                case 1: GU_CHAIN(1); break;
                case 2: GU_CHAIN(2); break;
                case 3: GU_CHAIN(3); break;
                case 4: GU_CHAIN(4); break;
                case 5: GU_CHAIN(5); break;
                case 6: GU_CHAIN(6); break;
                case 7: GU_CHAIN(7); break;
                default: GU_CHAIN(8); break;
                }
                float *hs = h + (t0 + s) * I + i;
                for (int64_t v = 0; v < nv; v++)
                    for (int64_t t = 0; t < ns; t++)
                        _mm512_storeu_ps(hs + t * I + 16 * v, silu_mul_out(acc[v * ns + t], acc[(per + v) * ns + t], rnd));
            }
        }
    }
}
#undef GU_CHAIN
static void pan_gateup(float *h, const float *x, const wgu *W, int64_t T, int64_t i0, int64_t i1, int rnd) {
    if (T <= CB_DP_ROWS_T) {
        uint32_t xp[CB_DP_ROWS_T * DKMAX / 2];
        pan_gateup_in(h, x, W, T, i0, i1, rnd, xp, T, T);
    } else {
        uint32_t xp[XT_DWORDS];
        pan_gateup_in(h, x, W, T, i0, i1, rnd, xp, pan_tile(W->H), PAN_STEP);
    }
}

/* ---- the entries -------------------------------------------------------------------------- */

static void matmul_any(float *y, int64_t ldy, const float *x, const wmat *W, int64_t T, int64_t n0, int64_t n1) {
    if (W->G) pan_matmul(y, ldy, x, W, T, n0, n1); /* a panel copy: every token count */
    else if (T <= CB_DP_ROWS_T) row_matmul(y, ldy, x, W->w + (size_t)n0 * (size_t)W->K, T, n1 - n0, W->K);
    else tok_matmul(y, ldy, x, W, T, n0, n1);
}

/* y[t * ldy + n] = x[t] . W[n] (BF16 W [N, K]) */
void cb_bf16dp_matmul_ld(float *y, int64_t ldy, const float *x, const void *w, int64_t T, int64_t N, int64_t K) {
    wmat W = {(const uint16_t *)w, K, N, 0};
    matmul_any(y, ldy, x, &W, T, 0, N);
}

void cb_bf16dp_matmul_panels(float *y, int64_t ldy, const float *x, const void *P, int64_t T, int64_t N, int64_t K,
                             int64_t n0, int64_t n1) {
    wmat W = {(const uint16_t *)P, K, N, CB_PANEL_ROWS};
    matmul_any(y, ldy, x, &W, T, n0, n1);
}

/* rnd: h rounded to bf16 (the packed expert's, fast.h) */
static void gateup_any(float *h, const float *x, const wgu *W, int64_t R, int64_t i0, int64_t i1, int rnd) {
    if (W->G) pan_gateup(h, x, W, R, i0, i1, rnd); /* a panel copy: every token count */
    else if (R <= CB_DP_ROWS_T) row_gateup(h, x, W, R, i0, i1, rnd);
    else tok_gateup(h, x, W, R, i0, i1, rnd);
}

void cb_bf16dp_gateup_split(float *h, const float *x, const void *gate, const void *up, int64_t R, int64_t H,
                            int64_t I, int64_t i0, int64_t i1) {
    wgu W = {(const uint16_t *)gate, (const uint16_t *)up, H, I, 0, 0};
    gateup_any(h, x, &W, R, i0, i1, 0);
}

void cb_bf16dp_gateup_packed(float *h, const float *x, const void *expert, int64_t R, int64_t H, int64_t I, int64_t B,
                             int64_t i0, int64_t i1) {
    wgu W = {(const uint16_t *)expert, NULL, H, I, B, 0};
    gateup_any(h, x, &W, R, i0, i1, 1);
}

void cb_bf16dp_gateup_panels(float *h, const float *x, const void *expert, int64_t R, int64_t H, int64_t I,
                             int64_t i0, int64_t i1) {
    wgu W = {(const uint16_t *)expert, NULL, H, I, 0, 2 * CB_PANEL_UNITS};
    gateup_any(h, x, &W, R, i0, i1, 1);
}

/* ---- the packed experts' down projection: lanes = columns -------------------------------- */

/* The definition, as the exact kernels' (kernels.h, expert_down): the sum runs over blocks of
 * CB_DOWN_BLOCK intermediate rows, within a block one chain of vdpbf16ps over its pairs of rows
 * (2i, 2i + 1) in ascending order from 0, then the blocks' sums added in order (y = p0,
 * y = y + p1, ...), so that decode can split it by blocks (cb_bf16dp_down_part: each thread
 * streams whole w2T rows) and prefill by columns, with the same bits. */
#define DN_NT 6   /* tokens per step */
#define DN_CW 64  /* prefill: columns per packed block */
#define DN_TCH 192 /* prefill: tokens per conversion of a block's h to pairs (96 KiB) */
#define DN_PF_BYTES 16384 /* decode's prefetch distance ahead of the rows being read */

/* The pairs of w2T rows a, b (32 columns each, the first n; zeros past them) in column order:
 * P[0] dword j = (a[j], b[j]) for j < 16, P[1] the same for j = 16 .. 31. vpermq puts 64-bit
 * pieces j and j + 4 in 128-bit lane j, so that vpunpck{l,h}wd interleave columns in order. */
DP_AI void pair_rows(vi P[2], const uint16_t *a, const uint16_t *b, int64_t n) {
    __mmask32 m = (__mmask32)(n >= 32 ? 0xFFFFFFFFu : n <= 0 ? 0u : (1u << n) - 1u);
    const vi perm = _mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7);
    vi va = _mm512_permutexvar_epi64(perm, _mm512_maskz_loadu_epi16(m, a));
    vi vb = _mm512_permutexvar_epi64(perm, _mm512_maskz_loadu_epi16(m, b));
    P[0] = _mm512_unpacklo_epi16(va, vb);
    P[1] = _mm512_unpackhi_epi16(va, vb);
}

/* One block's chains for y[t * H + 16 v ..] (t < NT, v < 4: 64 columns, the first nc stored)
 * over pairs q < np whose vectors PAIRS(q) yields into wv[4], each token's h pair
 * hp[t * ldp + q] broadcast; stored (first block) or added to y. */
#define DOWN_TILE(NT, PAIRS)                                                                              \
    do {                                                                                                  \
        vf acc[DN_NT][4];                                                                                 \
        for (int t = 0; t < NT; t++)                                                                      \
            for (int v = 0; v < 4; v++) acc[t][v] = vzero();                                              \
        for (int64_t q = 0; q < np; q++) {                                                                \
            vi wv[4];                                                                                     \
            PAIRS(q);                                                                                     \
            for (int t = 0; t < NT; t++) {                                                                \
                vi hb = _mm512_set1_epi32((int)hp[t * ldp + q]);                                          \
                for (int v = 0; v < 4; v++) acc[t][v] = dp(acc[t][v], wv[v], hb);                        \
            }                                                                                             \
        }                                                                                                 \
        for (int t = 0; t < NT; t++)                                                                      \
            for (int v = 0; v < 4; v++) {                                                                 \
                float *yv = y + t * H + 16 * v;                                                           \
                __mmask16 m = lanes(nc - 16 * v);                                                         \
                _mm512_mask_storeu_ps(yv, m, add ? vadd(_mm512_maskz_loadu_ps(m, yv), acc[t][v]) : acc[t][v]); \
            }                                                                                             \
    } while (0)

/* few tokens: the pairs straight from w2T (rows 2q, 2q + 1 of w, stride H), the rows 8 pairs
 * on prefetched */
#define PAIRS_DIRECT(q)                                                                                   \
    do {                                                                                                  \
        const uint16_t *ra = w + (size_t)(2 * (q)) * (size_t)H;                                           \
        for (int a = 16; a < 18; a++)                                                                     \
            for (int s = 0; s < 2; s++) _mm_prefetch((const char *)(ra + (size_t)a * H + 32 * s), _MM_HINT_T0); \
        pair_rows(wv, ra, ra + H, nc);                                                                    \
        pair_rows(wv + 2, ra + 32, ra + H + 32, nc - 32);                                                 \
    } while (0)
DP_AI void down_direct(float *y, int64_t H, const uint32_t *hp, int64_t ldp, const uint16_t *w, int64_t np,
                       int64_t nc, const int NT, int add) {
    DOWN_TILE(NT, PAIRS_DIRECT);
}

/* many tokens: the pairs from a packed block (pb[q * DN_CW + c], column c of pair q) */
#define PAIRS_PACKED(q)                                                                                   \
    for (int v = 0; v < 4; v++) wv[v] = _mm512_loadu_si512(pb + (q) * DN_CW + 16 * v)
DP_AI void down_block(float *y, int64_t H, const uint32_t *hp, int64_t ldp, const uint32_t *pb, int64_t np,
                      int64_t nc, const int NT, int add) {
    DOWN_TILE(NT, PAIRS_PACKED);
}

/* Tokens in steps of DN_NT over the block of rows [i0, i0 + ic): their h pairs into hp, then f
 * on y + t0 * H + c. */
#define DOWN_STEPS(R, c, f, ...)                                                                          \
    for (int64_t t0 = 0; t0 < (R); t0 += DN_NT) {                                                         \
        int64_t nt = (R) - t0 < DN_NT ? (R) - t0 : DN_NT;                                                 \
        pairs_of(hp, h + t0 * I + i0, I, nt, ic);                                                         \
        float *yt = y + t0 * H + (c);                                                                     \
        switch (nt) {                                                                                     \
        case 1: f(yt, H, hp, ic / 2, __VA_ARGS__, 1, i0 > 0); break;                                      \
        case 2: f(yt, H, hp, ic / 2, __VA_ARGS__, 2, i0 > 0); break;                                      \
        case 3: f(yt, H, hp, ic / 2, __VA_ARGS__, 3, i0 > 0); break;                                      \
        case 4: f(yt, H, hp, ic / 2, __VA_ARGS__, 4, i0 > 0); break;                                      \
        case 5: f(yt, H, hp, ic / 2, __VA_ARGS__, 5, i0 > 0); break;                                      \
        default: f(yt, H, hp, ic / 2, __VA_ARGS__, 6, i0 > 0); break;                                     \
        }                                                                                                 \
    }

/* The token steps of one packed block (rows [i0, i0 + ic) by the DN_CW columns at cs), R
 * tokens whose h pairs are hp[t * ic / 2 + q]: before each step, a share of the next block's
 * rows (pf: nr rows of pfb bytes, stride H) is prefetched, so that the next pack finds them in
 * cache: the pack's reads are a first touch, short and strided, the rest of the block runs
 * from L1/L2. */
#define DN_CASES(f, ...)                                                                                  \
    switch (nt) {                                                                                         \
    case 1: f(__VA_ARGS__, 1, i0 > 0); break;                                                             \
    case 2: f(__VA_ARGS__, 2, i0 > 0); break;                                                             \
    case 3: f(__VA_ARGS__, 3, i0 > 0); break;                                                             \
    case 4: f(__VA_ARGS__, 4, i0 > 0); break;                                                             \
    case 5: f(__VA_ARGS__, 5, i0 > 0); break;                                                             \
    default: f(__VA_ARGS__, 6, i0 > 0); break;                                                            \
    }
/* A packed block's pairs at pb[q * ld + c] (ld = DN_CW: a whole block; else a panel copy's
 * narrow last slab, down_slab below). */
DP_AI void down_slab(float *y, int64_t H, const uint32_t *hp, int64_t ldp, const uint32_t *pb, int64_t ld,
                     int64_t np, int64_t nc, const int NT, int add);
static void down_block_steps(float *y, const uint32_t *hp, const uint32_t *pb, int64_t ld, int64_t R, int64_t H,
                             int64_t i0, int64_t ic, int64_t cs, int64_t ncs, const uint16_t *pf, int64_t nr,
                             int64_t pfb) {
    int64_t steps = (R + DN_NT - 1) / DN_NT, per = (nr + steps - 1) / steps, r0 = 0, np = ic / 2;
    for (int64_t t0 = 0; t0 < R; t0 += DN_NT, r0 += per) {
        for (int64_t r = r0; r < r0 + per && r < nr; r++)
            for (int64_t b = 0; b < pfb; b += 64) _mm_prefetch((const char *)(pf + (size_t)r * (size_t)H) + b, _MM_HINT_T1);
        int64_t nt = R - t0 < DN_NT ? R - t0 : DN_NT;
        const uint32_t *ht = hp + t0 * np;
        float *yt = y + t0 * H + cs;
        if (ld == DN_CW) DN_CASES(down_block, yt, H, ht, np, pb, np, ncs)
        else DN_CASES(down_slab, yt, H, ht, np, pb, ld, np, ncs)
    }
}

/* y[r, c] = sum_i h[r, i] w2T[i, c] for c0 <= c < c1, by blocks of CB_DOWN_BLOCK rows. Up to
 * CB_DP_ROWS_T tokens read the pairs straight from w2T, 64 columns at a time; more pack each
 * block by DN_CW columns into pairs once (32 KiB) and run every token through it, block by
 * block, the column slabs of a block one after another (so a row's lines are read together). */
void cb_bf16dp_down_packed(float *y, const float *h, const void *expert, int64_t R, int64_t H, int64_t I, int64_t c0,
                           int64_t c1) {
    const uint16_t *w2 = (const uint16_t *)expert + (size_t)2 * (size_t)I * (size_t)H;
    uint32_t pb[CB_DOWN_BLOCK / 2 * DN_CW], hp[DN_NT * CB_DOWN_BLOCK / 2];
    if (R <= CB_DP_ROWS_T) {
        for (int64_t cs = c0; cs < c1; cs += DN_CW) {
            int64_t ncs = c1 - cs < DN_CW ? c1 - cs : DN_CW;
            for (int64_t i0 = 0; i0 < I; i0 += CB_DOWN_BLOCK) {
                int64_t ic = I - i0 < CB_DOWN_BLOCK ? I - i0 : CB_DOWN_BLOCK;
                const uint16_t *w = w2 + (size_t)i0 * (size_t)H + cs;
                DOWN_STEPS(R, cs, down_direct, w, ic / 2, ncs)
            }
        }
        return;
    }
    uint32_t hpb[DN_TCH * CB_DOWN_BLOCK / 2]; /* a block's h pairs, for every slab */
    for (int64_t i0 = 0; i0 < I; i0 += CB_DOWN_BLOCK) {
        int64_t ic = I - i0 < CB_DOWN_BLOCK ? I - i0 : CB_DOWN_BLOCK;
        for (int64_t tc = 0; tc < R; tc += DN_TCH) {
            int64_t nt = R - tc < DN_TCH ? R - tc : DN_TCH;
            pairs_of(hpb, h + tc * I + i0, I, nt, ic);
            for (int64_t cs = c0; cs < c1; cs += DN_CW) {
                int64_t ncs = c1 - cs < DN_CW ? c1 - cs : DN_CW;
                const uint16_t *w = w2 + (size_t)i0 * (size_t)H + cs;
                for (int64_t q = 0; q < ic / 2; q++)
                    for (int64_t c = 0; c < ncs; c += 32) {
                        vi P[2];
                        pair_rows(P, w + (size_t)(2 * q) * (size_t)H + c, w + (size_t)(2 * q + 1) * (size_t)H + c,
                                  ncs - c);
                        _mm512_storeu_si512(pb + q * DN_CW + c, P[0]);
                        _mm512_storeu_si512(pb + q * DN_CW + c + 16, P[1]);
                    }
                /* the next pack's rows: this block's next slab, or the next block's first */
                int64_t ni0 = cs + DN_CW < c1 ? i0 : i0 + CB_DOWN_BLOCK, ncs0 = cs + DN_CW < c1 ? cs + DN_CW : c0;
                int64_t nr = ni0 < I ? (I - ni0 < CB_DOWN_BLOCK ? I - ni0 : CB_DOWN_BLOCK) : 0;
                int64_t nb = c1 - ncs0 < DN_CW ? c1 - ncs0 : DN_CW;
                down_block_steps(y + tc * H, hpb, pb, DN_CW, nt, H, i0, ic, cs, ncs,
                                 nr ? w2 + (size_t)ni0 * (size_t)H + ncs0 : w2, nr, 2 * nb);
            }
        }
    }
}

/* Block blk's sums for every column: part[r * H + c] (c < H) = block blk's chain (the rows
 * [blk * CB_DOWN_BLOCK, ..) of w2T), for few tokens (decode). Four pairs of rows (eight whole
 * w2T rows, one linear stream, prefetched DN_PF_BYTES ahead) per pass over the part rows,
 * which stay in L1. */
void cb_bf16dp_down_part(float *part, const float *h, const void *expert, int64_t R, int64_t H, int64_t I,
                         int64_t blk) {
    const uint16_t *w2 = (const uint16_t *)expert + (size_t)2 * (size_t)I * (size_t)H;
    int64_t i0 = blk * CB_DOWN_BLOCK, ic = I - i0 < CB_DOWN_BLOCK ? I - i0 : CB_DOWN_BLOCK;
    uint32_t hp[CB_FAST_PART_MAX_ROWS * CB_DOWN_BLOCK / 2];
    int64_t np = ic / 2;
    for (int64_t t = 0; t < R; t++) {
        for (int64_t k = 0; k < ic; k += 32) _mm512_storeu_si512(hp + t * np + k / 2, bf16x32(h + t * I + i0 + k));
        memset(part + t * H, 0, (size_t)H * sizeof(float));
    }
    for (int64_t q = 0; q < np; q += 4) {
        int64_t nq = np - q < 4 ? np - q : 4;
        const uint16_t *w = w2 + (size_t)(i0 + 2 * q) * (size_t)H;
        const char *pf = (const char *)w + DN_PF_BYTES;
        for (int64_t c = 0; c < H; c += 32, pf += 8 * 64) {
            for (int l = 0; l < 8; l++) _mm_prefetch(pf + 64 * l, _MM_HINT_T1);
            vi P[4][2];
            for (int64_t j = 0; j < nq; j++)
                pair_rows(P[j], w + (size_t)(2 * j) * (size_t)H + c, w + (size_t)(2 * j + 1) * (size_t)H + c, 32);
            for (int64_t t = 0; t < R; t++)
                for (int s = 0; s < 2; s++) {
                    float *pv = part + t * H + c + 16 * s;
                    vf a = _mm512_loadu_ps(pv);
                    for (int64_t j = 0; j < nq; j++) a = dp(a, P[j][s], _mm512_set1_epi32((int)hp[t * np + q + j]));
                    _mm512_storeu_ps(pv, a);
                }
        }
    }
}

/* ---- the packed down projection from a panel copy (cpu/panel.h): the pairs already made ------ */

_Static_assert(CB_PANEL_DOWN_COLS == DN_CW, "a panel copy's whole slab is a packed block");

/* The slab of columns [c0, c0 + nc) of block [i0, i0 + ic) in a panel copy's w2^T region. */
DP_AI const uint32_t *dn_slab(const void *expert, int64_t H, int64_t I, int64_t i0, int64_t ic, int64_t c0) {
    const uint32_t *w2 = (const uint32_t *)((const uint16_t *)expert + (size_t)2 * (size_t)I * (size_t)H);
    return w2 + (size_t)(i0 / 2) * (size_t)H + (size_t)(ic / 2) * (size_t)c0;
}

/* pb[q * ld + c], c < nc: the slab's vectors past nc not read (masked loads; the last slab of
 * an H that is not a multiple of DN_CW) */
#define PAIRS_PANEL(q)                                                                                    \
    for (int v = 0; v < 4; v++) wv[v] = _mm512_maskz_loadu_epi32(lanes(nc - 16 * v), pb + (q) * ld + 16 * v)
DP_AI void down_slab(float *y, int64_t H, const uint32_t *hp, int64_t ldp, const uint32_t *pb, int64_t ld,
                     int64_t np, int64_t nc, const int NT, int add) {
    DOWN_TILE(NT, PAIRS_PANEL);
}

/* down_packed's y from a panel copy (columns c0, c1: multiples of CB_PANEL_DOWN_COLS or H):
 * the same chains, block by block, each slab read as it lies (no pack). */
void cb_bf16dp_down_panels(float *y, const float *h, const void *expert, int64_t R, int64_t H, int64_t I, int64_t c0,
                           int64_t c1) {
    uint32_t hpb[DN_TCH * CB_DOWN_BLOCK / 2];
    for (int64_t i0 = 0; i0 < I; i0 += CB_DOWN_BLOCK) {
        int64_t ic = I - i0 < CB_DOWN_BLOCK ? I - i0 : CB_DOWN_BLOCK;
        for (int64_t tc = 0; tc < R; tc += DN_TCH) {
            int64_t nt0 = R - tc < DN_TCH ? R - tc : DN_TCH;
            pairs_of(hpb, h + tc * I + i0, I, nt0, ic);
            for (int64_t cs = c0; cs < c1; cs += CB_PANEL_DOWN_COLS) { /* a whole slab is a packed block */
                int64_t nc = H - cs < CB_PANEL_DOWN_COLS ? H - cs : CB_PANEL_DOWN_COLS;
                down_block_steps(y + tc * H, hpb, dn_slab(expert, H, I, i0, ic, cs), nc, nt0, H, i0, ic, cs, nc, NULL, 0,
                                 0);
            }
        }
    }
}

/* down_part's block blk from a panel copy: each slab one stream, its 16-column vectors' chains
 * (pan_chain over the block's pairs, a token's h pairs broadcast) stored once. */
void cb_bf16dp_down_part_panels(float *part, const float *h, const void *expert, int64_t R, int64_t H, int64_t I,
                                int64_t blk) {
    int64_t i0 = blk * CB_DOWN_BLOCK, ic = I - i0 < CB_DOWN_BLOCK ? I - i0 : CB_DOWN_BLOCK, np = ic / 2;
    uint32_t hp[CB_FAST_PART_MAX_ROWS * CB_DOWN_BLOCK / 2];
    pairs_of(hp, h + i0, I, R, ic);
    const int64_t per = PAN4_PER(R);
    for (int64_t cs = 0; cs < H; cs += CB_PANEL_DOWN_COLS) {
        int64_t nc = H - cs < CB_PANEL_DOWN_COLS ? H - cs : CB_PANEL_DOWN_COLS, nv = nc / 16;
        const uint32_t *pb = dn_slab(expert, H, I, i0, ic, cs);
        for (int64_t v0 = 0; v0 < nv; v0 += per) {
            const uint32_t *vp[4];
            for (int64_t v = 0; v < 4; v++) vp[v] = pb + 16 * (v0 + v < nv ? v0 + v : nv - 1);
            vf acc[24];
            pan_chain4(acc, vp, nc, hp, np, R);
            for (int64_t v = 0; v < per && v0 + v < nv; v++)
                for (int64_t t = 0; t < R; t++) _mm512_storeu_ps(part + t * H + cs + 16 * (v0 + v), acc[v * R + t]);
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
void cb_bf16dp_down_part(float *part, const float *h, const void *expert, int64_t R, int64_t H, int64_t I,
                         int64_t blk) {
    (void)part, (void)h, (void)expert, (void)R, (void)H, (void)I, (void)blk;
}
void cb_bf16dp_matmul_panels(float *y, int64_t ldy, const float *x, const void *P, int64_t T, int64_t N, int64_t K,
                             int64_t n0, int64_t n1) {
    (void)y, (void)ldy, (void)x, (void)P, (void)T, (void)N, (void)K, (void)n0, (void)n1;
}
void cb_bf16dp_gateup_panels(float *h, const float *x, const void *expert, int64_t R, int64_t H, int64_t I,
                             int64_t i0, int64_t i1) {
    (void)h, (void)x, (void)expert, (void)R, (void)H, (void)I, (void)i0, (void)i1;
}
void cb_bf16dp_down_panels(float *y, const float *h, const void *expert, int64_t R, int64_t H, int64_t I, int64_t c0,
                           int64_t c1) {
    (void)y, (void)h, (void)expert, (void)R, (void)H, (void)I, (void)c0, (void)c1;
}
void cb_bf16dp_down_part_panels(float *part, const float *h, const void *expert, int64_t R, int64_t H, int64_t I,
                                int64_t blk) {
    (void)part, (void)h, (void)expert, (void)R, (void)H, (void)I, (void)blk;
}
#endif
