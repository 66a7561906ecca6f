/*
 * fast.c — the reference kernels of the fast numeric mode (fast.h: the definition they
 * implement in plain C, one (row, token) at a time) and the tables with native BF16
 * kernels, made of an int8 table and a BF16 back end (cpu/registry.c lists every table).
 */
#include "cpu/fast.h"

#include <stdlib.h>
#include <string.h>

/* Columns per pass of the reference (a multiple of every block size). */
#define REF_KC 2048

/* One (row, token) dot over columns k0 .. k0 + kc, continuing the chain acc. */
static float ref_chain(float acc, const uint8_t *u, const float *ws, const float *wm, const int8_t *q,
                       const cb_fast_ablk *a, int64_t kc, int64_t G) {
    for (int64_t g = 0; g < kc / G; g++) {
        int32_t isum = 0;
        for (int64_t i = 0; i < G; i++) isum += (int32_t)u[g * G + i] * (int32_t)q[g * G + i];
        const cb_fast_ablk *b = &a[g * G / 32];
        float ds = G == 32 ? b->ds32 : b->ds16[g & 1];
        acc = cb_fast_step(acc, isum, ws[g], wm[g], b->d, ds);
    }
    return acc;
}

/* x float rows, or (x NULL) rows quantized beforehand */
static void matmul_ref(float *y, int64_t ldy, const float *x, const cb_fast_qrows *xq, const void *w, uint32_t dt,
                       int64_t T, int64_t N, int64_t K) {
    size_t rb = (size_t)cb_row_bytes(dt, (uint64_t)K);
    int64_t G = cb_fast_group(dt);
    uint8_t u[REF_KC];
    float ws[REF_KC / 16], wm[REF_KC / 16];
    int8_t qb[REF_KC];
    cb_fast_ablk ab[REF_KC / 32];
    for (int64_t t = 0; t < T; t++)
        for (int64_t n = 0; n < N; n++) y[t * ldy + n] = 0.0f;
    for (int64_t k0 = 0; k0 < K; k0 += REF_KC) {
        int64_t kc = K - k0 < REF_KC ? K - k0 : REF_KC;
        for (int64_t t = 0; t < T; t++) {
            const int8_t *q = qb;
            const cb_fast_ablk *a = ab;
            if (x) cb_fast_quant_act(x + t * K + k0, kc, qb, ab);
            else q = xq->q + t * K + k0, a = xq->a + t * (K / 32) + k0 / 32;
            for (int64_t n = 0; n < N; n++) {
                cb_fast_unpack((const uint8_t *)w + (size_t)n * rb, dt, k0, kc, u, ws, wm);
                y[t * ldy + n] = ref_chain(y[t * ldy + n], u, ws, wm, q, a, kc, G);
            }
        }
    }
}
static void matmul_ld_ref(float *y, int64_t ldy, const float *x, const void *w, uint32_t dt, int64_t T,
                          int64_t N, int64_t K) {
    matmul_ref(y, ldy, x, NULL, w, dt, T, N, K);
}

/* Intermediate columns per pass of the gate/up reference. */
#define REF_GU_COLS 16

static void gateup_ref_src(float *h, const float *x, const cb_fast_qrows *xq, const void *gate, const void *up,
                           uint32_t dt, int64_t R, int64_t H, int64_t I, int64_t i0, int64_t i1) {
    size_t rb = (size_t)cb_row_bytes(dt, (uint64_t)H);
    float g[REF_GU_COLS], v[REF_GU_COLS];
    for (int64_t r = 0; r < R; r++) {
        cb_fast_qrows row = {0};
        if (!x) row = (cb_fast_qrows){xq->q + r * H, xq->a + r * (H / 32)};
        const float *xr = x ? x + r * H : NULL;
        for (int64_t c = i0; c < i1; c += REF_GU_COLS) {
            int64_t n = i1 - c < REF_GU_COLS ? i1 - c : REF_GU_COLS;
            matmul_ref(g, n, xr, &row, (const uint8_t *)gate + (size_t)c * rb, dt, 1, n, H);
            matmul_ref(v, n, xr, &row, (const uint8_t *)up + (size_t)c * rb, dt, 1, n, H);
            for (int64_t i = 0; i < n; i++) h[r * I + c + i] = cb_fast_silu_mul(g[i], v[i]);
        }
    }
}
static void gateup_ref(float *h, const float *x, const void *gate, const void *up, uint32_t dt, int64_t R,
                       int64_t H, int64_t I, int64_t i0, int64_t i1) {
    gateup_ref_src(h, x, NULL, gate, up, dt, R, H, I, i0, i1);
}

static void quant_rows_ref(int8_t *q, cb_fast_ablk *a, const float *x, int64_t T, int64_t K) {
    for (int64_t t = 0; t < T; t++) cb_fast_quant_act(x + t * K, K, q + t * K, a + t * (K / 32));
}
/* the reference reads no interleaved copies: il is always 0 here */
static void matmul_q8_ref(float *y, int64_t ldy, const cb_fast_qrows *x, const void *w, int il, uint32_t dt,
                          int64_t T, int64_t N, int64_t K) {
    (void)il;
    matmul_ref(y, ldy, NULL, x, w, dt, T, N, K);
}
static void gateup_q8_ref(float *h, const cb_fast_qrows *x, const void *gate, const void *up, int il, uint32_t dt,
                          int64_t R, int64_t H, int64_t I, int64_t i0, int64_t i1) {
    (void)il;
    gateup_ref_src(h, NULL, x, gate, up, dt, R, H, I, i0, i1);
}

static const cb_fast_kernels fast_ref = {
    .name = "reference",
    .bf16 = "f32",
    .native_bf16 = 0,
    .matmul_ld = matmul_ld_ref,
    .gateup = gateup_ref,
    .quant_rows = quant_rows_ref,
    .matmul_q8 = matmul_q8_ref,
    .gateup_q8 = gateup_q8_ref,
};

const cb_fast_kernels *cb_fast_ref(void) { return &fast_ref; }

/* An int8 table's kernels with native BF16 ones (cb_fast_kernels.native_bf16): the
 * avx512vnni table with "avx512vnni-amx" on AMX tiles (fast_amx.c) or "avx512bf16" on
 * vdpbf16ps (fast_bf16dp.c); the neon-i8mm table with "neon-bf16" on BFDOT
 * (fast_neon_bf16.c). One definition of the table and its two dispatching entries per BF16
 * back end. */
#define CB_FAST_BF16_TABLE(TAB, INT8, NAME, BF16NAME, P, PART, ATT, ATT_BYTES, PANELS, QPANELS)                       \
    static void TAB##_matmul_ld(float *y, int64_t ldy, const float *x, const void *w, uint32_t dt, int64_t T,   \
                                int64_t N, int64_t K) {                                                         \
        if (dt == COLIBRI_DTYPE_BF16) P##_matmul_ld(y, ldy, x, w, T, N, K);                                     \
        else INT8()->matmul_ld(y, ldy, x, w, dt, T, N, K);                                                      \
    }                                                                                                            \
    static void TAB##_gateup(float *h, const float *x, const void *gate, const void *up, uint32_t dt, int64_t R, \
                             int64_t H, int64_t I, int64_t i0, int64_t i1) {                                    \
        if (dt == COLIBRI_DTYPE_BF16) P##_gateup_split(h, x, gate, up, R, H, I, i0, i1);                       \
        else INT8()->gateup(h, x, gate, up, dt, R, H, I, i0, i1);                                               \
    }                                                                                                            \
    static void TAB##_quant_rows(int8_t *q, cb_fast_ablk *a, const float *x, int64_t T, int64_t K) {            \
        INT8()->quant_rows(q, a, x, T, K);                                                                       \
    }                                                                                                            \
    static void TAB##_matmul_q8(float *y, int64_t ldy, const cb_fast_qrows *x, const void *w, int il, uint32_t dt, \
                                int64_t T, int64_t N, int64_t K) {                                              \
        INT8()->matmul_q8(y, ldy, x, w, il, dt, T, N, K);                                                       \
    }                                                                                                            \
    static void TAB##_gateup_q8(float *h, const cb_fast_qrows *x, const void *gate, const void *up, int il,     \
                                uint32_t dt, int64_t R, int64_t H, int64_t I, int64_t i0, int64_t i1) {         \
        INT8()->gateup_q8(h, x, gate, up, il, dt, R, H, I, i0, i1);                                             \
    }                                                                                                            \
    static const cb_fast_kernels TAB = {.name = NAME,                                                           \
                                        .bf16 = BF16NAME,                                                       \
                                        .native_bf16 = 1,                                                       \
                                        .matmul_ld = TAB##_matmul_ld,                                           \
                                        .gateup = TAB##_gateup,                                                 \
                                        .quant_rows = TAB##_quant_rows,                                         \
                                        .matmul_q8 = TAB##_matmul_q8,                                           \
                                        .gateup_q8 = TAB##_gateup_q8,                                           \
                                        .gateup_packed = P##_gateup_packed,                                     \
                                        .down_packed = P##_down_packed,                                         \
                                        .down_part = PART,                                                      \
                                        .attention_heads = ATT,                                                 \
                                        .att_work_bytes = ATT_BYTES,                                            \
                                        .panels = PANELS,                                                       \
                                        .qpanels = QPANELS}
_Static_assert(CB_PANEL_ROWS <= CB_PANEL_MAX_ROWS && 2 * CB_PANEL_UNITS <= CB_PANEL_MAX_ROWS, "the packers' row pointers");
const cb_panel_kernels cb_bf16dp_panels = {.name = "avx512bf16",
                                          .rows = CB_PANEL_ROWS,
                                          .units = CB_PANEL_UNITS,
                                          .gu_rows = 2 * CB_PANEL_UNITS,
                                          .down_cols = CB_PANEL_DOWN_COLS,
                                          .down_layout = CB_PANEL_DOWN_PAIRS,
                                          .matmul_panels = cb_bf16dp_matmul_panels,
                                          .gateup_panels = cb_bf16dp_gateup_panels,
                                          .down_panels = cb_bf16dp_down_panels,
                                          .down_part_panels = cb_bf16dp_down_part_panels};
/* the avx512vnni table's kernels on interleaved copies, for the two tables built on it */
static void avx512vnni_il_matmul(float *y, int64_t ldy, const float *x, const void *P, uint32_t dt, int64_t T,
                                 int64_t N, int64_t K) {
    cb_fast_avx512vnni()->qpanels->matmul(y, ldy, x, P, dt, T, N, K);
}
static void avx512vnni_il_gateup(float *h, const float *x, const void *gate, const void *up, uint32_t dt, int64_t R,
                                 int64_t H, int64_t I, int64_t i0, int64_t i1) {
    cb_fast_avx512vnni()->qpanels->gateup(h, x, gate, up, dt, R, H, I, i0, i1);
}
static const cb_qpanel_kernels avx512vnni_il = {.name = "avx512vnni", .matmul = avx512vnni_il_matmul,
                                                .gateup = avx512vnni_il_gateup};
CB_FAST_BF16_TABLE(fast_amx, cb_fast_avx512vnni, "avx512vnni", "amx", cb_amx, NULL, cb_fast_att_avx512,
                   cb_fast_att_avx512_bytes, NULL, &avx512vnni_il);
CB_FAST_BF16_TABLE(fast_bf16dp, cb_fast_avx512vnni, "avx512vnni", "avx512bf16", cb_bf16dp, cb_bf16dp_down_part,
                   cb_fast_att_avx512, cb_fast_att_avx512_bytes, &cb_bf16dp_panels, &avx512vnni_il);
CB_FAST_BF16_TABLE(fast_neonbf16, cb_fast_neon_i8mm, "neon-i8mm", "bfdot", cb_neonbf16, NULL, NULL, NULL, NULL, NULL);

/* The three tables with native BF16 kernels, where this build has them (registry.c checks
 * the CPU). */
const cb_fast_kernels *cb_fast_avx512vnni_amx(void) { return cb_amx_built() && cb_fast_avx512vnni() ? &fast_amx : NULL; }
const cb_fast_kernels *cb_fast_avx512bf16(void) {
    return cb_bf16dp_built() && cb_fast_avx512vnni() ? &fast_bf16dp : NULL;
}
const cb_fast_kernels *cb_fast_neon_bf16(void) {
    return cb_neonbf16_built() && cb_fast_neon_i8mm() ? &fast_neonbf16 : NULL;
}
