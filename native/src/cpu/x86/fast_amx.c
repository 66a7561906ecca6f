/*
 * fast_amx.c — the fast mode's BF16 kernels on AMX (Intel AMX-TILE + AMX-BF16): BF16
 * weights times bf16-rounded activations (backend/cpu/stages.c rounds them; the conversion here is
 * exact), float32 accumulation in the tile unit (TDPBF16PS).
 *
 * y = x W^T with W row-major [N, K] (nn.Linear) maps onto TDPBF16PS without moving the
 * weights: an A tile is 16 weight rows by 32 columns loaded straight from the mapping (row
 * stride = the row's bytes), a B tile is 32 columns (16 pairs) by 16 tokens of the
 * activations, packed once per call as pairs (the layout TDPBF16PS reads), and a C tile
 * holds 16 rows by 16 tokens. Two A, two B, four C tiles: 32 rows by 32 tokens per step.
 * The packed experts' down projection (w2^T [I, H], docs/format.md) is the other way round:
 * A = the intermediate activations (16 tokens by 32), B = pairs of w2^T rows interleaved
 * (32 intermediate rows by 16 output columns), C = 16 tokens by 16 columns.
 *
 * Every output is the tile unit's dot product over K in steps of 32 in ascending order, the
 * same for a token alone or in any batch and any split of rows or columns: deterministic
 * and batch-invariant (native/tests/test_kernels.c checks it), not the bits of another
 * table (the unit's internal order and its flushing of bf16 subnormals are its own).
 * Rows, tokens or columns short of a whole tile are padded in stack buffers (a tile load
 * never reads past a matrix). K must be a multiple of 32 and at most 4096 (I of the down
 * projection any multiple of 32); other shapes run the exact kernels on the rounded
 * activations (cb_fast_bf16_k_ok). Buffers are on the stack (up to about 450 KiB).
 *
 * Compiled with -mamx-tile -mamx-bf16 -mavx512f -mavx512bw -mavx2 -mfma -mf16c; entered
 * only after cb_cpu_amx() (cpu/features.c: cpuid, XCR0, and the kernel's permission for the
 * tile data state, asked once per process with arch_prctl(ARCH_REQ_XCOMP_PERM)).
 */
#include "cpu/fast.h"

#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__linux__) && !defined(COLIBRI_NO_SIMD_TABLES)
#include <immintrin.h>

#include "cpu/x86/simd_avx512.h"
#include "cpu/simd_math.h"


#define AKC 1024 /* columns (K) per pass of the padded copies */
#define ATT 32   /* tokens per pass */
#define PF_R 12  /* pairs of w2T rows ahead that the down projection prefetches */
#define AMX_MAX_K CB_FAST_BF16_MAX_K /* the longest rows (K) of a matmul or gate/up: the packed tokens' stack */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;

static void amx_config(void) {
    amx_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.colsb[i] = 64;
        c.rows[i] = 16;
    }
    _tile_loadconfig(&c);
}

int cb_amx_built(void) { return 1; }


/* The bf16 bits of an f32 already rounded to bf16 (exact). */
static inline __m256i to_bf16(vf v) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
}

/* Tokens t0 .. t0+nt-1 (nt <= 32) of x [., K] (f32, bf16-exact) as two B operands: for each
 * pair r of columns and token j, the dword (x[j][2r], x[j][2r+1]) at xb[j / 16][r][j % 16];
 * missing tokens are zero. */
static void pack_tokens(uint32_t *xb, const float *x, int64_t ldx, int64_t nt, int64_t K) {
    int64_t np = K / 2;
    if (nt == 1) { /* a decode step: each pair alone in its row (token 0), the rest zero */
        for (int64_t r = 0; r < np; r++) {
            uint32_t lo, hi;
            memcpy(&lo, &x[2 * r], 4);
            memcpy(&hi, &x[2 * r + 1], 4);
            _mm512_storeu_si512(xb + r * 16, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)((lo >> 16) | (hi & 0xffff0000u)))));
        }
        return;
    }
    for (int h = 0; h < (nt > 16 ? 2 : 1); h++) { /* the second B operand only when it holds tokens */
        uint32_t *dst = xb + (size_t)h * (size_t)np * 16;
        for (int64_t r0 = 0; r0 < np; r0 += 16) { /* 16 pairs (32 columns) of 16 tokens: a transpose */
            __m512i rows[16];
            for (int j = 0; j < 16; j++) {
                int64_t t = h * 16 + j;
                if (t < nt) {
                    const float *p = x + t * ldx + 2 * r0;
                    __m256i lo = to_bf16(_mm512_loadu_ps(p)), hi = to_bf16(_mm512_loadu_ps(p + 16));
                    rows[j] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
                } else {
                    rows[j] = _mm512_setzero_si512();
                }
            }
            tr16x16_epi32(rows); /* rows[j] dword r = token j's pair r0 + r: to pair-major */
            for (int j = 0; j < 16; j++) _mm512_storeu_si512(dst + (r0 + j) * 16, rows[j]);
        }
    }
}

/* c[16][16] (row = weight row i, column = token j) into y[j * ldy + i] for i < nr, j < nt. */
static void store_transposed(float *y, int64_t ldy, const float *c, int64_t nr, int64_t nt) {
    for (int64_t j = 0; j < nt; j++)
        for (int64_t i = 0; i < nr; i++) y[j * ldy + i] = c[i * 16 + j];
}

/* Rows 0 .. nr-1 (nr <= 32) of W (bf16, stride rb) times the packed tokens (nt <= 32).
 * next: the 32 rows (stride rb) the caller computes after these, or NULL: their lines are
 * prefetched into L2 one per row and step, a block ahead (a decode reads each weight once,
 * and 32 row streams are more than the hardware prefetchers follow). */
static void rows_block(float *y, int64_t ldy, const uint8_t *w, size_t rb, int64_t nr, const uint32_t *xb,
                       int64_t nt, int64_t K, const uint8_t *next) {
    uint16_t pad[32 * AKC]; /* zero-padded copies of a partial row tile (64 KiB of stack) */
    int64_t np = K / 2;
    const uint32_t *b0 = xb, *b1 = xb + (size_t)np * 16;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    int whole = nr == 32;
    for (int64_t k0 = 0; k0 < K; k0 += AKC) {
        int64_t kc = K - k0 < AKC ? K - k0 : AKC;
        const uint8_t *a;
        size_t as;
        if (whole) {
            a = w + (size_t)k0 * 2;
            as = rb;
        } else {
            for (int64_t r = 0; r < 32; r++) {
                if (r < nr) memcpy(pad + r * AKC, w + (size_t)r * rb + (size_t)k0 * 2, (size_t)kc * 2);
                else memset(pad + r * AKC, 0, (size_t)kc * 2);
            }
            a = (const uint8_t *)pad;
            as = AKC * 2;
        }
        for (int64_t k = 0; k < kc; k += 32) {
            if (next)
                for (int r = 0; r < 32; r++)
                    _mm_prefetch((const char *)(next + (size_t)r * rb + (size_t)(k0 + k) * 2), _MM_HINT_T1);
            _tile_loadd(4, a + (size_t)k * 2, as);
            _tile_loadd(5, a + 16 * as + (size_t)k * 2, as);
            _tile_loadd(6, b0 + (k0 + k) / 2 * 16, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            if (nt > 16) { /* the second B operand only when it holds tokens (each C is its own) */
                _tile_loadd(7, b1 + (k0 + k) / 2 * 16, 64);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
    }
    float c[16 * 16];
    for (int q = 0; q < 4; q++) {
        int64_t ri = (q >> 1) * 16, tj = (q & 1) * 16;
        if (ri >= nr || tj >= nt) continue;
        if (q == 0) _tile_stored(0, c, 64);
        else if (q == 1) _tile_stored(1, c, 64);
        else if (q == 2) _tile_stored(2, c, 64);
        else _tile_stored(3, c, 64);
        store_transposed(y + tj * ldy + ri, ldy, c, nr - ri < 16 ? nr - ri : 16, nt - tj < 16 ? nt - tj : 16);
    }
}

/* y[t * ldy + n] = x[t] . W[n] for t < T, n < N (BF16 W [N, K], cb_amx_shape_ok(K)). */
void cb_amx_matmul_ld(float *y, int64_t ldy, const float *x, const void *w, int64_t T, int64_t N, int64_t K) {
    uint32_t xb[2 * 16 * (AMX_MAX_K / 2)]; /* two B operands (256 KiB of stack) */
    size_t rb = (size_t)K * 2;
    amx_config();
    for (int64_t t0 = 0; t0 < T; t0 += ATT) {
        int64_t nt = T - t0 < ATT ? T - t0 : ATT;
        pack_tokens(xb, x + t0 * K, K, nt, K);
        for (int64_t n0 = 0; n0 < N; n0 += 32) {
            const uint8_t *wr = (const uint8_t *)w + (size_t)n0 * rb;
            rows_block(y + t0 * ldy + n0, ldy, wr, rb, N - n0 < 32 ? N - n0 : 32, xb, nt, K,
                       N - n0 >= 64 && t0 == 0 ? wr + 32 * rb : NULL);
        }
    }
    _tile_release();
}

/* g[i] <- silu(g[i]) * u[i] */
static void silu_mul(float *g, const float *u, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) vstore(g + i, vmul(vsilu(vload(g + i)), vload(u + i)));
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(g + i, m, vmul(vsilu(_mm512_maskz_loadu_ps(m, g + i)), _mm512_maskz_loadu_ps(m, u + i)));
    }
}

/* The split FFN's gate/up (BF16 [I, H] each) for columns i0 .. i1 of h [R, I]. */
void cb_amx_gateup_split(float *h, const float *x, const void *gate, const void *up, int64_t R, int64_t H, int64_t I,
                         int64_t i0, int64_t i1) {
    float ub[ATT * 256];
    size_t rb = (size_t)H * 2;
    for (int64_t t0 = 0; t0 < R; t0 += ATT) {
        int64_t nt = R - t0 < ATT ? R - t0 : ATT;
        for (int64_t c0 = i0; c0 < i1; c0 += 256) {
            int64_t nc = i1 - c0 < 256 ? i1 - c0 : 256;
            cb_amx_matmul_ld(h + t0 * I + c0, I, x + t0 * H, (const uint8_t *)gate + (size_t)c0 * rb, nt, nc, H);
            cb_amx_matmul_ld(ub, nc, x + t0 * H, (const uint8_t *)up + (size_t)c0 * rb, nt, nc, H);
            for (int64_t t = 0; t < nt; t++) silu_mul(h + (t0 + t) * I + c0, ub + t * nc, nc);
        }
    }
}

/* The packed expert's gate/up (docs/format.md: gate and up rows interleaved by blocks of B
 * rows) for columns i0 .. i1 of h [R, I]. */
void cb_amx_gateup_packed(float *h, const float *x, const void *expert, int64_t R, int64_t H, int64_t I,
                          int64_t B, int64_t i0, int64_t i1) {
    uint32_t xb[2 * 16 * (AMX_MAX_K / 2)];
    float g[ATT * 32], u[ATT * 32];
    size_t rb = (size_t)H * 2;
    amx_config();
    for (int64_t t0 = 0; t0 < R; t0 += ATT) {
        int64_t nt = R - t0 < ATT ? R - t0 : ATT;
        pack_tokens(xb, x + t0 * H, H, nt, H);
        for (int64_t s = i0; s < i1;) {
            int64_t b = s / B, bs = b * B, nb = I - bs < B ? I - bs : B;
            int64_t e = bs + nb < i1 ? bs + nb : i1; /* s .. e: in block b */
            for (int64_t c = s; c < e; c += 32) {
                int64_t nr = e - c < 32 ? e - c : 32;
                const uint8_t *gr = (const uint8_t *)expert + (size_t)(2 * bs + (c - bs)) * rb;
                /* prefetched meanwhile: the up rows after the gate rows, then the next 32 gate rows */
                rows_block(g, 32, gr, rb, nr, xb, nt, H, t0 == 0 && nr == 32 ? gr + (size_t)nb * rb : NULL);
                rows_block(u, 32, gr + (size_t)nb * rb, rb, nr, xb, nt, H,
                           t0 == 0 && nr == 32 && c + 32 < e ? gr + 32 * rb : NULL);
                for (int64_t t = 0; t < nt; t++) {
                    silu_mul(g + t * 32, u + t * 32, nr);
                    memcpy(h + (t0 + t) * I + c, g + t * 32, (size_t)nr * sizeof(float));
                }
            }
            s = e;
        }
    }
    _tile_release();
    cb_round_bf16_cols(h, R, I, i0, i1);
}

/* The packed expert's down projection, y[r, c] = sum_i h[r, i] w2T[i, c] for c0 <= c < c1
 * (w2T: rows 2I .. 3I-1 of the expert, [I, H]). Columns in blocks of 128 (8 B tiles), I in
 * passes of DP rows: each pass repacks its w2T rows once for every token (reading each row's
 * columns contiguously, which a decode needs) and converts each 32 tokens' h once for
 * every column; y holds the first pass's sums, then each pass's is added, in order. */
#define DP 512
void cb_amx_down_packed(float *y, const float *h, const void *expert, int64_t R, int64_t H, int64_t I, int64_t c0,
                        int64_t c1) {
    uint16_t ab[32 * DP];          /* 32 tokens' h in bf16 for one pass (32 KiB of stack) */
    uint32_t bb[8][DP / 2 * 16];   /* pairs of w2T rows, 8 column tiles (128 KiB) */
    const uint16_t *w2 = (const uint16_t *)expert + (size_t)2 * (size_t)I * (size_t)H;
    float c[16 * 16];
    amx_config();
    for (int64_t sb = c0; sb < c1; sb += 128) {
        int64_t nsb = c1 - sb < 128 ? c1 - sb : 128, ntile = (nsb + 15) / 16;
        for (int64_t i0 = 0; i0 < I; i0 += DP) {
            int64_t ic = I - i0 < DP ? I - i0 : DP;
            for (int64_t r = 0; r < ic / 2; r++) { /* B: rows i, i + 1 interleaved per column */
                const uint16_t *ra = w2 + (size_t)(i0 + 2 * r) * H + sb, *rb2 = ra + H;
                if (2 * (r + PF_R) + 1 < ic) {
                    _mm_prefetch((const char *)(ra + (size_t)(2 * PF_R) * H), _MM_HINT_T0);
                    _mm_prefetch((const char *)(rb2 + (size_t)(2 * PF_R) * H), _MM_HINT_T0);
                    if (nsb > 32) {
                        _mm_prefetch((const char *)(ra + (size_t)(2 * PF_R) * H + 32), _MM_HINT_T0);
                        _mm_prefetch((const char *)(rb2 + (size_t)(2 * PF_R) * H + 32), _MM_HINT_T0);
                    }
                }
                for (int64_t q = 0; q < ntile; q++) {
                    int64_t n = nsb - 16 * q;
                    __mmask16 m = (__mmask16)(n >= 16 ? 0xFFFFu : (1u << n) - 1u);
                    __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, ra + 16 * q));
                    __m512i hi = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, rb2 + 16 * q));
                    _mm512_storeu_si512(&bb[q][r * 16], _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
                }
            }
            for (int64_t t0 = 0; t0 < R; t0 += 32) {
                int64_t nt = R - t0 < 32 ? R - t0 : 32;
                for (int64_t t = 0; t < (nt > 16 ? 32 : 16); t++) { /* A: the tokens' h, bf16, zero rows past nt */
                    if (t < nt) {
                        for (int64_t i = 0; i < ic; i += 16)
                            _mm256_storeu_si256((__m256i *)(ab + t * DP + i),
                                                to_bf16(_mm512_loadu_ps(h + (t0 + t) * I + i0 + i)));
                    } else {
                        memset(ab + t * DP, 0, (size_t)ic * 2);
                    }
                }
                for (int64_t q = 0; q < ntile; q += 2) {
                    int two = q + 1 < ntile;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t k = 0; k < ic; k += 32) {
                        _tile_loadd(4, ab + k, DP * 2);
                        _tile_loadd(6, &bb[q][k / 2 * 16], 64);
                        _tile_dpbf16ps(0, 4, 6);
                        if (two) {
                            _tile_loadd(7, &bb[q + 1][k / 2 * 16], 64);
                            _tile_dpbf16ps(1, 4, 7);
                        }
                        if (nt > 16) { /* the second 16 tokens (each C is its own) */
                            _tile_loadd(5, ab + 16 * DP + k, DP * 2);
                            _tile_dpbf16ps(2, 5, 6);
                            if (two) _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                    for (int z = 0; z < 4; z++) {
                        int64_t qt = q + (z & 1), tt = 16 * (z >> 1);
                        if (qt >= ntile || tt >= nt) continue;
                        int64_t n = nsb - 16 * qt < 16 ? nsb - 16 * qt : 16;
                        if (z == 0) _tile_stored(0, c, 64);
                        else if (z == 1) _tile_stored(1, c, 64);
                        else if (z == 2) _tile_stored(2, c, 64);
                        else _tile_stored(3, c, 64);
                        for (int64_t t = tt; t < nt && t < tt + 16; t++) {
                            float *yr = y + (t0 + t) * H + sb + 16 * qt;
                            const float *cr = c + (t - tt) * 16;
                            if (i0 == 0) memcpy(yr, cr, (size_t)n * sizeof(float));
                            else
                                for (int64_t j = 0; j < n; j++) yr[j] += cr[j];
                        }
                    }
                }
            }
        }
    }
    _tile_release();
}

#else /* no AMX in this build (not x86-64 Linux, an old compiler) or the fuzzers' build */
int cb_amx_built(void) { return 0; }
void cb_amx_matmul_ld(float *y, int64_t ldy, const float *x, const void *w, int64_t T, int64_t N, int64_t K) {
    (void)y, (void)ldy, (void)x, (void)w, (void)T, (void)N, (void)K;
}
void cb_amx_gateup_split(float *h, const float *x, const void *gate, const void *up, int64_t R, int64_t H, int64_t I,
                         int64_t i0, int64_t i1) {
    (void)h, (void)x, (void)gate, (void)up, (void)R, (void)H, (void)I, (void)i0, (void)i1;
}
void cb_amx_gateup_packed(float *h, const float *x, const void *expert, int64_t R, int64_t H, int64_t I,
                          int64_t B, int64_t i0, int64_t i1) {
    (void)h, (void)x, (void)expert, (void)R, (void)H, (void)I, (void)B, (void)i0, (void)i1;
}
void cb_amx_down_packed(float *y, const float *h, const void *expert, int64_t R, int64_t H, int64_t I, int64_t c0,
                        int64_t c1) {
    (void)y, (void)h, (void)expert, (void)R, (void)H, (void)I, (void)c0, (void)c1;
}
#endif
