/*
 * fast.h — the kernels of the fast numeric mode (COLIBRI_PRECISION_FAST; docs/kernels.md,
 * "Numeric modes"), behind their own table: which of them a CPU can run depends on
 * instructions (VNNI, AVX512_BF16) that the exact tables do not need, so cb_fast_best()
 * picks this table separately from cb_kernels_best().
 *
 * What fast mode computes, for a weight matrix of a block type with an int8 path (every
 * block type but MXFP4, which cb_fast_takes hands to the exact kernels):
 *
 *  - each token's activation row is quantized in blocks of 32 (cb_fast_quant_act): d =
 *    amax / 127, q = round-to-nearest-even(x * (127 / amax)) in [-127, 127], and the sums of
 *    q over each half and the whole block, already multiplied by d;
 *  - each weight row is read as unsigned bytes u with, per sub-block g of G weights (G = 16
 *    for Q6_K, Q2_K and Q3_K, 32 otherwise), a scale ws[g] and an offset wm[g] such that the
 *    weight is ws[g] * u + wm[g] (cb_fast_unpack: Q8_0 u = q + 128, wm = -128 ws; Q4_K/Q5_K
 *    ws = d sc, wm = -dmin m; Q6_K ws = d sc, wm = -32 ws; Q4_0 ws = d, wm = -8 d; Q5_0
 *    ws = d, wm = -16 d; Q4_1/Q5_1 ws = d, wm = m; IQ4_NL u = kvalue + 128, ws = d,
 *    wm = -128 d; IQ4_XS the same with ws = d (ls - 32); Q3_K u = q + 4, ws = d (sc - 32),
 *    wm = -4 ws; Q2_K ws = d sc, wm = -dmin m; the grid types (G = 16) u = their signed code
 *    + 64 (IQ2, IQ3_XXS) or + 16 (IQ3_S; IQ1, whose code is 8 g +- 1), ws = the sub-block's
 *    factor, wm = -64 ws or -16 ws (cb_fast_grid_off); every product rounded to float as the
 *    reference dequantizer rounds it, so that ws u + wm is the weight up to one rounding);
 *  - y[t, n] is ONE float chain over the sub-blocks in ascending order, starting at 0:
 *        acc = fma((float)isum_g, ws[g] * d_b, acc);  acc = fma(wm[g], dS_g, acc)
 *    where isum_g = sum of u * q over the sub-block (an exact integer, |isum| < 2^24), d_b
 *    the scale of the activation block holding it and dS_g = d_b * (sum of q over g).
 *
 * The integer sums are exact in any order and the float steps are the same operations in
 * the same order in every table, so every table gives the reference's results BIT FOR BIT,
 * whatever the number of tokens, their tiling or the thread split (native/tests/
 * test_kernels.c checks it). For BF16 weights the activations are rounded to bf16 before the
 * matmul (backend/cpu/stages.c, cb_round_bf16); tables with native_bf16 then take BF16 weights too
 * (vdpbf16ps, float32 accumulation in their own order), the others run the exact kernels
 * on the rounded activations (bf16 x bf16 products are exact in float32); the avx512bf16
 * table also reads the engine's panel copies of them (cpu/panel.h), with the same bits, and the
 * x86 tables read interleaved copies of the block-type weights (cpu/qpanel.h), also
 * with the row-major kernels' bits. The x86 tables
 * with native BF16 kernels also run attention their own way (float32, keys in lanes:
 * fast_attention_avx512.c); the int8 tables keep the exact kernels' attention.
 */
#ifndef COLIBRI_CPU_FAST_H
#define COLIBRI_CPU_FAST_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "core/dtype.h"
#include "core/quant_grid.h" /* the grid types' codes (cb_fast_unpack) */
#include "cpu/bf16.h" /* cb_round_bf16 */
#include "cpu/kernels.h" /* cb_kv_view, CB_ATT_HEADS */
#include "cpu/panel.h"
#include "cpu/qpanel.h"

/* One activation block of 32: its scale and its sums of q (times d), for the offsets. */
typedef struct cb_fast_ablk {
    float d;        /* amax / 127 (0 for an all-zero block) */
    float ds32;     /* d * sum of the 32 q */
    float ds16[2];  /* d * sum of q[0..16), of q[16..32) */
    int32_t s32;    /* the sum of the 32 q (a table that multiplies the wide types' bytes as
                     * signed adds 128 s32 back: fast_x86_256.inc) */
} cb_fast_ablk;

/* Activation rows quantized beforehand (cb_fast_kernels.quant_rows, whole rows of K: the
 * bytes and blocks cb_fast_quant_act gives pass by pass): row t's q at q + t K, its blocks at
 * a + t K / 32. Quantizing a layer's input once for every matrix, expert and chunk that
 * reads it saves the re-quantization of each call. */
typedef struct cb_fast_qrows {
    const int8_t *q;
    const cb_fast_ablk *a;
} cb_fast_qrows;

typedef struct cb_fast_kernels {
    const char *name;   /* the int8 path's instructions: "reference", "avx2", "avxvnni", "avx512vnni" */
    const char *bf16;   /* the BF16 path: "amx" (AMX-BF16 tiles), "avx512bf16" (vdpbf16ps) or
                         * "f32" (the exact kernels on the rounded activations) */
    int native_bf16;    /* 1: matmul_ld/gateup also take BF16 weights */
    /* y[t * ldy + n] for t < T, n < N, as matmul_ld (kernels.h) but in fast mode:
     * dt a block type (K a whole number of its blocks) or BF16 when native_bf16. */
    void (*matmul_ld)(float *y, int64_t ldy, const float *x, const void *w, uint32_t dt, int64_t T,
                      int64_t N, int64_t K);
    /* h[r, i] = silu(gate_i . x_r) * (up_i . x_r) for i0 <= i < i1, the split FFN's gate and
     * up [I, H] in dt (as expert_gateup with up != NULL), each dot as matmul_ld computes it. */
    void (*gateup)(float *h, const float *x, const void *gate, const void *up, uint32_t dt, int64_t R,
                   int64_t H, int64_t I, int64_t i0, int64_t i1);
    /* The int8 path on rows quantized beforehand (every table): quant_rows quantizes x [T, K]
     * (K a multiple of 32) into q [T, K] and a [T, K / 32]; matmul_q8 and gateup_q8 are
     * matmul_ld and gateup (block types only, not BF16) on such rows, with their bits, reading
     * the row-major blocks (il 0) or, in tables with qpanels, an interleaved copy (il 1: the
     * bits of qpanels' kernels). */
    void (*quant_rows)(int8_t *q, cb_fast_ablk *a, const float *x, int64_t T, int64_t K);
    void (*matmul_q8)(float *y, int64_t ldy, const cb_fast_qrows *x, const void *w, int il, uint32_t dt, int64_t T,
                      int64_t N, int64_t K);
    void (*gateup_q8)(float *h, const cb_fast_qrows *x, const void *gate, const void *up, int il, uint32_t dt,
                      int64_t R, int64_t H, int64_t I, int64_t i0, int64_t i1);
    /* native_bf16 only (else NULL): a BF16 packed expert (docs/format.md, EXPERTS_PACKED):
     * gate/up for columns i0 <= i < i1 of h [R, I] (blocks of B rows), h rounded as
     * cb_round_bf16 rounds it (it is the input of the expert's BF16 down projection), and the down
     * projection for output columns c0 <= c < c1 of y [R, H]: one accumulation over all of
     * I, or by blocks where down_part is set. */
    void (*gateup_packed)(float *h, const float *x, const void *expert, int64_t R, int64_t H, int64_t I, int64_t B,
                          int64_t i0, int64_t i1);
    void (*down_packed)(float *y, const float *h, const void *expert, int64_t R, int64_t H, int64_t I, int64_t c0,
                        int64_t c1);
    /* NULL, or: down_packed's sum is by blocks of CB_DOWN_BLOCK intermediate rows, as the exact
     * kernels' (kernels.h, expert_down), and this is block blk's part for every column,
     * part[r, c] for r < R <= CB_FAST_PART_MAX_ROWS, c < H: adding the parts of blocks 0, 1,
     * ... in order gives down_packed's y bit for bit (decode splits the projection this way). */
    void (*down_part)(float *part, const float *h, const void *expert, int64_t R, int64_t H, int64_t I,
                      int64_t blk);
    /* NULL (the exact kernels' attention runs), or fast mode's: kernels.h's attention_heads
     * contract (causal, windows, sinks; each query's result independent of the call), in
     * float32 but in its own order (fast_attention_avx512.c has the definition), for head
     * sizes cb_fast_takes_att accepts; work: the running thread's own area of
     * att_work_bytes(start_pos + T, D) bytes. */
    void (*attention_heads)(float *out, const float *q, const cb_kv_view *kv, void *work, int64_t T,
                            int64_t start_pos, int64_t Hq, int64_t Hkv, int64_t D, int64_t window,
                            const float *sinks, int64_t h0, int64_t h1);
    size_t (*att_work_bytes)(int64_t S, int64_t D);
    /* NULL, or: the BF16 kernels also read a panel copy (cpu/panel.h) in this layout, with
     * the bits of matmul_ld, gateup_packed, down_packed and down_part on the row-major
     * weights. */
    const cb_panel_kernels *panels;
    /* NULL, or: the int8 kernels also read interleaved copies of block-type matrices
     * (cpu/qpanel.h), with the bits of matmul_ld and gateup on the row-major blocks. */
    const cb_qpanel_kernels *qpanels;
} cb_fast_kernels;

/* The most rows a fast table's down_part takes. */
#define CB_FAST_PART_MAX_ROWS 8

/* The rows (K) the native BF16 kernels take: whole steps of 32, at most 4096 (their stack
 * buffers); other matrices run the exact kernels on the rounded activations. */
#define CB_FAST_BF16_MAX_K 4096
static inline int cb_fast_bf16_k_ok(int64_t K) { return K % 32 == 0 && K <= CB_FAST_BF16_MAX_K; }

/* The panel layout of the avx512bf16 table (cpu/panel.h): matrices by groups of CB_PANEL_ROWS
 * rows, experts by runs of CB_PANEL_UNITS units (gate/up groups of 2 * CB_PANEL_UNITS rows),
 * w2^T by slabs. */
#define CB_PANEL_ROWS 64
#define CB_PANEL_UNITS 32
extern const cb_panel_kernels cb_bf16dp_panels;

/* fast_amx.c: the BF16 kernels on AMX tiles; 1 when compiled with them. */
int cb_amx_built(void);
void cb_amx_matmul_ld(float *y, int64_t ldy, const float *x, const void *w, int64_t T, int64_t N, int64_t K);
void cb_amx_gateup_split(float *h, const float *x, const void *gate, const void *up, int64_t R, int64_t H, int64_t I,
                         int64_t i0, int64_t i1);
void cb_amx_gateup_packed(float *h, const float *x, const void *expert, int64_t R, int64_t H, int64_t I,
                          int64_t B, int64_t i0, int64_t i1);
void cb_amx_down_packed(float *y, const float *h, const void *expert, int64_t R, int64_t H, int64_t I, int64_t c0,
                        int64_t c1);
/* fast_bf16dp.c: the same four on AVX512_BF16 (vdpbf16ps), and down_part; 1 when compiled
 * with them. */
int cb_bf16dp_built(void);
void cb_bf16dp_matmul_ld(float *y, int64_t ldy, const float *x, const void *w, int64_t T, int64_t N, int64_t K);
void cb_bf16dp_gateup_split(float *h, const float *x, const void *gate, const void *up, int64_t R, int64_t H,
                            int64_t I, int64_t i0, int64_t i1);
void cb_bf16dp_gateup_packed(float *h, const float *x, const void *expert, int64_t R, int64_t H, int64_t I,
                             int64_t B, int64_t i0, int64_t i1);
void cb_bf16dp_down_packed(float *y, const float *h, const void *expert, int64_t R, int64_t H, int64_t I, int64_t c0,
                           int64_t c1);
void cb_bf16dp_down_part(float *part, const float *h, const void *expert, int64_t R, int64_t H, int64_t I,
                         int64_t blk);
void cb_bf16dp_matmul_panels(float *y, int64_t ldy, const float *x, const void *P, int64_t T, int64_t N, int64_t K,
                             int64_t n0, int64_t n1);
void cb_bf16dp_gateup_panels(float *h, const float *x, const void *expert, int64_t R, int64_t H, int64_t I,
                             int64_t i0, int64_t i1);
void cb_bf16dp_down_panels(float *y, const float *h, const void *expert, int64_t R, int64_t H, int64_t I, int64_t c0,
                           int64_t c1);
void cb_bf16dp_down_part_panels(float *part, const float *h, const void *expert, int64_t R, int64_t H, int64_t I,
                                int64_t blk);

/* fast_attention_avx512.c: fast mode's attention on AVX-512 (float32, keys in lanes), and
 * the bytes of its work area for S positions of head size D. */
void cb_fast_att_avx512(float *out, const float *q, const cb_kv_view *kv, void *work, int64_t T, int64_t start_pos,
                        int64_t Hq, int64_t Hkv, int64_t D, int64_t window, const float *sinks, int64_t h0, int64_t h1);
size_t cb_fast_att_avx512_bytes(int64_t S, int64_t D);
/* fast_neon_bf16.c: the same four on AArch64 BFDOT (FEAT_BF16); 1 when compiled with it. */
int cb_neonbf16_built(void);
void cb_neonbf16_matmul_ld(float *y, int64_t ldy, const float *x, const void *w, int64_t T, int64_t N, int64_t K);
void cb_neonbf16_gateup_split(float *h, const float *x, const void *gate, const void *up, int64_t R, int64_t H,
                              int64_t I, int64_t i0, int64_t i1);
void cb_neonbf16_gateup_packed(float *h, const float *x, const void *expert, int64_t R, int64_t H, int64_t I,
                               int64_t B, int64_t i0, int64_t i1);
void cb_neonbf16_down_packed(float *y, const float *h, const void *expert, int64_t R, int64_t H, int64_t I,
                             int64_t c0, int64_t c1);
/* 1 for the block types of the int8 path: every block type but MXFP4 (which runs the exact
 * kernels). Measured against the exact kernels (docs/performance.md, the h512 Mixtral on 2
 * AVX2 cores, loaded): decode 1.6-2.2x for Q4_0 / Q4_1 / Q5_0 / Q5_1, 5-7.5x for IQ4_NL /
 * IQ4_XS, 1.25-1.34x for Q3_K / Q2_K; prefill 512 1.17-1.64x, except Q3_K / Q2_K at 0.9x
 * (sub-blocks of 16), kept here for their decode. */
static inline int cb_fast_int8_type(uint32_t dt) {
    switch (dt) {
    case COLIBRI_DTYPE_Q8_0:
    case COLIBRI_DTYPE_Q4_K:
    case COLIBRI_DTYPE_Q5_K:
    case COLIBRI_DTYPE_Q6_K:
    case COLIBRI_DTYPE_Q4_0:
    case COLIBRI_DTYPE_Q4_1:
    case COLIBRI_DTYPE_Q5_0:
    case COLIBRI_DTYPE_Q5_1:
    case COLIBRI_DTYPE_Q2_K:
    case COLIBRI_DTYPE_Q3_K:
    case COLIBRI_DTYPE_IQ4_NL:
    case COLIBRI_DTYPE_IQ4_XS: return 1;
    default: return cb_dtype_codebook(dt) >= 0; /* the grid types */
    }
}
/* The grid types (core/quant_grid.h): u = their signed code + this offset (IQ2 and IQ3_XXS:
 * codes up to +-43 and +-62, IQ3_S +-15, IQ1 8 g +- 1 up to +-9: ggml's grids, which a file's
 * codebook is checked to be), so that every u is below 128 */
static inline int cb_fast_grid_off(uint32_t dt) {
    return dt == COLIBRI_DTYPE_IQ3_S || dt == COLIBRI_DTYPE_IQ1_S || dt == COLIBRI_DTYPE_IQ1_M ? 16 : 64;
}
/* 1 when the fast table computes a matrix of dtype dt with rows of K (else the exact
 * kernels run it, on bf16-rounded activations for BF16). MXFP4 is not a fast-mode type: in
 * fast mode its matrices run the exact kernels (kernels_simd.inc: the block's values
 * decoded, then the f32 dot), on the unrounded activations. */
static inline int cb_fast_takes(const cb_fast_kernels *f, uint32_t dt, int64_t K) {
    return f && (cb_fast_int8_type(dt) ||
                 (dt == COLIBRI_DTYPE_BF16 && f->native_bf16 && cb_fast_bf16_k_ok(K)));
}
/* 1 when the fast table runs the attention of head size D (whole 16-lane vectors; else the
 * exact kernels' runs). */
static inline int cb_fast_takes_att(const cb_fast_kernels *f, int64_t D) {
    return f && f->attention_heads && D > 0 && D % 16 == 0;
}
/* 1 when it computes a packed BF16 expert of hidden H and intermediate I. */
static inline int cb_fast_takes_packed(const cb_fast_kernels *f, uint32_t dt, int64_t H, int64_t I) {
    return f && f->native_bf16 && dt == COLIBRI_DTYPE_BF16 && cb_fast_bf16_k_ok(H) && I % 32 == 0;
}

const cb_fast_kernels *cb_fast_ref(void);
/* x86 (fast_avx2.c, fast_avxvnni.c, fast_avx512.c): NULL when not compiled in (another
 * architecture, or a compiler without the instruction set). */
const cb_fast_kernels *cb_fast_avx2(void);
const cb_fast_kernels *cb_fast_avxvnni(void);
const cb_fast_kernels *cb_fast_avx512vnni(void);
/* fast_avx512vl.c: the 256-bit kernels the avx512vnni table hands a few tokens on
 * interleaved copies to, and their unpack of one copy's group over columns k0 .. k0 + kc into
 * a panel of 8 lanes (fast_x86_256.inc's; `ahead`: the bytes on to prefetch) */
const cb_fast_kernels *cb_fast_avx512vl(void);
void cb_fast_avx512vl_pack_il(void *panel, const uint8_t *g, size_t ahead, uint32_t dt, int64_t k0, int64_t kc);
/* that panel's bytes for passes of fkc columns: a 32-byte vector per quad, two per sub-block of 16 */
#define CB_FAST_IL8_PANEL_BYTES(fkc) ((size_t)(fkc) / 4 * 32 + 2 * ((size_t)(fkc) / 16) * 32)
/* AArch64 (fast_neon*.c): plain Advanced SIMD, SDOT (FEAT_DotProd), USDOT (FEAT_I8MM). */
const cb_fast_kernels *cb_fast_neon(void);
const cb_fast_kernels *cb_fast_neon_dotprod(void);
const cb_fast_kernels *cb_fast_neon_i8mm(void);
/* fast.c: an int8 table with native BF16 kernels: avx512vnni with them on AMX tiles
 * ("avx512vnni-amx") or on vdpbf16ps ("avx512bf16"), neon-i8mm with them on BFDOT
 * ("neon-bf16"); NULL when this build lacks either part. Which of all these tables a CPU
 * runs, and by which name, is the registry's (cpu/registry.h). */
const cb_fast_kernels *cb_fast_avx512vnni_amx(void);
const cb_fast_kernels *cb_fast_avx512bf16(void);
const cb_fast_kernels *cb_fast_neon_bf16(void);

/* Weights per sub-block (its own scale and offset) of a block type in fast mode. */
static inline int64_t cb_fast_group(uint32_t dt) {
    return dt == COLIBRI_DTYPE_Q6_K || dt == COLIBRI_DTYPE_Q2_K || dt == COLIBRI_DTYPE_Q3_K ||
                   (dt >= COLIBRI_DTYPE_IQ2_XXS && dt <= COLIBRI_DTYPE_IQ1_M)
               ? 16
               : 32;
}
/* 1 when a block type's bytes u reach 128 or more (Q8_0, IQ4_NL, IQ4_XS): the tables whose
 * integer dot multiplies signed bytes split them (fast_simd.inc's WIDE). */
static inline int cb_fast_wide(uint32_t dt) {
    return dt == COLIBRI_DTYPE_Q8_0 || dt == COLIBRI_DTYPE_IQ4_NL || dt == COLIBRI_DTYPE_IQ4_XS;
}
/* The largest byte u of a type's weights (cb_fast_unpack): the bound a table's 16-bit partial
 * sums of u * q products are kept under (fast_simd.inc, FS_I16_DOT). */
static inline int cb_fast_umax(uint32_t dt) {
    switch (dt) {
    case COLIBRI_DTYPE_Q2_K: return 3;
    case COLIBRI_DTYPE_Q3_K: return 7;
    case COLIBRI_DTYPE_Q4_0:
    case COLIBRI_DTYPE_Q4_1:
    case COLIBRI_DTYPE_Q4_K: return 15;
    case COLIBRI_DTYPE_Q5_0:
    case COLIBRI_DTYPE_Q5_1:
    case COLIBRI_DTYPE_Q5_K: return 31;
    case COLIBRI_DTYPE_Q6_K: return 63;
    case COLIBRI_DTYPE_IQ2_XXS:
    case COLIBRI_DTYPE_IQ2_XS:
    case COLIBRI_DTYPE_IQ2_S: return 64 + 43;
    case COLIBRI_DTYPE_IQ3_XXS: return 64 + 62;
    case COLIBRI_DTYPE_IQ3_S: return 16 + 15;
    case COLIBRI_DTYPE_IQ1_S:
    case COLIBRI_DTYPE_IQ1_M: return 16 + 9;
    default: return 255;
    }
}

/* ---- the shared definitions: inline, so that each kernel file compiles (and vectorizes)
 * them for its own instruction set, the same C and therefore the same results ---------- */

/* Quantize x[0..n) (n a multiple of 32) into q[0..n) and a[0..n/32). */
static inline void cb_fast_quant_act(const float *x, int64_t n, int8_t *q, cb_fast_ablk *a) {
    for (int64_t b = 0; b < n / 32; b++) {
        const float *xb = x + b * 32;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            float v = fabsf(xb[i]);
            amax = v > amax ? v : amax;
        }
        float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int s0 = 0, s1 = 0;
        int8_t *qb = q + b * 32;
        for (int i = 0; i < 32; i++) qb[i] = (int8_t)(int)nearbyintf(xb[i] * id);
        for (int i = 0; i < 16; i++) s0 += qb[i];
        for (int i = 16; i < 32; i++) s1 += qb[i];
        a[b].d = d;
        a[b].ds32 = d * (float)(s0 + s1);
        a[b].s32 = s0 + s1;
        a[b].ds16[0] = d * (float)s0;
        a[b].ds16[1] = d * (float)s1;
    }
}

/* The little-endian binary16 at p: by F16C where the including file is compiled for it
 * (exact, as the software conversion, which the others use). */
#if defined(__F16C__)
#include <immintrin.h>
static inline float cb_fast_f16(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | (p[1] << 8))); }
#else
static inline float cb_fast_f16(const uint8_t *p) { return cb_f16_to_f32((uint16_t)(p[0] | (p[1] << 8))); }
#endif

/* Columns k0 .. k0 + kc of a weight row of block type dt (k0, kc whole blocks) as bytes
 * u[0..kc) and per sub-block ws, wm [kc / cb_fast_group(dt)] (see the top of this file). */
static inline void cb_fast_unpack(const void *row, uint32_t dt, int64_t k0, int64_t kc, uint8_t *u, float *ws,
                                  float *wm) {
    const uint8_t *r = (const uint8_t *)row;
    if (cb_dtype_codebook(dt) >= 0) { /* the grid types, sub-blocks of 16: u = the signed code + off, ws = its factor, wm = -off ws */
        const int one = dt == COLIBRI_DTYPE_IQ1_S || dt == COLIBRI_DTYPE_IQ1_M, off = cb_fast_grid_off(dt);
        const size_t bb = cb_dtype_block_bytes(dt);
        const uint8_t *b = r + k0 / 256 * bb;
        for (int64_t s = 0; s < kc / 256; s++, b += bb) {
            uint8_t q[256];
            float a[16];
            uint32_t sg[8];
            cb_grid_decode(b, q, a, sg, dt);
            for (int g = 0; g < 16; g++) {
                ws[s * 16 + g] = a[g];
                wm[s * 16 + g] = -(float)off * a[g];
            }
            const uint64_t offs = 0x0101010101010101ull * (uint64_t)off;
            for (int l = 0; l < 32; l++) { /* 8 codes at a time, bytewise (no carries between bytes) */
                uint64_t v;
                memcpy(&v, q + 8 * l, 8);
                if (!one) { /* negated where the sign bit is set: ~v + 1 */
                    const unsigned bits = (sg[l / 4] >> (8 * (l % 4))) & 0xFF;
                    const uint64_t spread = ((uint64_t)bits * 0x0101010101010101ull) & 0x8040201008040201ull;
                    const uint64_t neg = ((spread + 0x7f7f7f7f7f7f7f7full) >> 7) & 0x0101010101010101ull;
                    v = grid_byte_add(v ^ (neg * 0xFF), neg);
                }
                v = grid_byte_add(v, offs);
                memcpy(u + s * 256 + 8 * l, &v, 8);
            }
        }
        return;
    }
    switch (dt) {
    case COLIBRI_DTYPE_Q8_0: {
        const uint8_t *b = r + k0 / 32 * 34;
        for (int64_t g = 0; g < kc / 32; g++, b += 34) {
            float d = cb_fast_f16(b);
            ws[g] = d;
            wm[g] = -128.0f * d;
            for (int i = 0; i < 32; i++) u[g * 32 + i] = (uint8_t)(b[2 + i] ^ 0x80u);
        }
        return;
    }
    case COLIBRI_DTYPE_Q4_K:
    case COLIBRI_DTYPE_Q5_K: {
        int q5 = dt == COLIBRI_DTYPE_Q5_K;
        int64_t bb = q5 ? 176 : 144;
        const uint8_t *b = r + k0 / 256 * bb;
        for (int64_t s = 0; s < kc / 256; s++, b += bb) {
            float d = cb_fast_f16(b), dmin = cb_fast_f16(b + 2);
            uint8_t sm[16];
            cb_k4_unpack(b + 4, sm);
            const uint8_t *qh = b + 16, *qs = b + (q5 ? 48 : 16);
            uint8_t *us = u + s * 256;
            for (int j = 0; j < 8; j++) {
                ws[s * 8 + j] = d * (float)sm[j];
                wm[s * 8 + j] = -(dmin * (float)sm[8 + j]);
            }
            for (int p = 0; p < 4; p++) {
                const uint8_t *qp = qs + p * 32;
                for (int l = 0; l < 32; l++) {
                    uint8_t lo = qp[l] & 0xF, hi = qp[l] >> 4;
                    if (q5) {
                        lo |= (uint8_t)(((qh[l] >> (2 * p)) & 1) << 4);
                        hi |= (uint8_t)(((qh[l] >> (2 * p + 1)) & 1) << 4);
                    }
                    us[p * 64 + l] = lo;
                    us[p * 64 + 32 + l] = hi;
                }
            }
        }
        return;
    }
    case COLIBRI_DTYPE_Q6_K: {
        const uint8_t *b = r + k0 / 256 * 210;
        for (int64_t s = 0; s < kc / 256; s++, b += 210) {
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t *sc = (const int8_t *)(b + 192);
            float d = cb_fast_f16(b + 208);
            uint8_t *us = u + s * 256;
            for (int j = 0; j < 16; j++) {
                float w = d * (float)sc[j];
                ws[s * 16 + j] = w;
                wm[s * 16 + j] = -32.0f * w;
            }
            for (int h = 0; h < 2; h++) {
                const uint8_t *l0 = ql + h * 64, *h0 = qh + h * 32;
                uint8_t *y = us + h * 128;
                for (int l = 0; l < 32; l++) {
                    y[l] = (uint8_t)((l0[l] & 0xF) | (((h0[l] >> 0) & 3) << 4));
                    y[l + 32] = (uint8_t)((l0[l + 32] & 0xF) | (((h0[l] >> 2) & 3) << 4));
                    y[l + 64] = (uint8_t)((l0[l] >> 4) | (((h0[l] >> 4) & 3) << 4));
                    y[l + 96] = (uint8_t)((l0[l + 32] >> 4) | (((h0[l] >> 6) & 3) << 4));
                }
            }
        }
        return;
    }
    case COLIBRI_DTYPE_Q4_0:   /* f16 d, 16 bytes of nibbles: u = q, ws = d, wm = -8 d */
    case COLIBRI_DTYPE_Q4_1:   /* f16 d, f16 m, nibbles: u = q, ws = d, wm = m */
    case COLIBRI_DTYPE_IQ4_NL: /* f16 d, nibbles: u = kvalue + 128, ws = d, wm = -128 d */
    case COLIBRI_DTYPE_Q5_0:   /* f16 d, 4 bytes qh, nibbles: u = q (5 bits), ws = d, wm = -16 d */
    case COLIBRI_DTYPE_Q5_1: { /* f16 d, f16 m, 4 bytes qh, nibbles: u = q, ws = d, wm = m */
        int64_t bb = (int64_t)cb_dtype_block_bytes(dt);
        int has_m = dt == COLIBRI_DTYPE_Q4_1 || dt == COLIBRI_DTYPE_Q5_1;
        int q5 = dt == COLIBRI_DTYPE_Q5_0 || dt == COLIBRI_DTYPE_Q5_1;
        const uint8_t *b = r + k0 / 32 * bb;
        for (int64_t g = 0; g < kc / 32; g++, b += bb) {
            float d = cb_fast_f16(b);
            const uint8_t *qs = b + 2 + 2 * has_m + 4 * q5;
            uint8_t *ug = u + g * 32;
            ws[g] = d;
            if (dt == COLIBRI_DTYPE_IQ4_NL) {
                wm[g] = -128.0f * d;
                for (int j = 0; j < 16; j++) {
                    ug[j] = (uint8_t)(cb_iq4nl_value(qs[j] & 0xF) + 128);
                    ug[j + 16] = (uint8_t)(cb_iq4nl_value(qs[j] >> 4) + 128);
                }
                continue;
            }
            wm[g] = has_m ? cb_fast_f16(b + 2) : (q5 ? -16.0f : -8.0f) * d;
            uint32_t qh = 0;
            if (q5) {
                const uint8_t *h = b + 2 + 2 * has_m;
                qh = (uint32_t)h[0] | ((uint32_t)h[1] << 8) | ((uint32_t)h[2] << 16) | ((uint32_t)h[3] << 24);
            }
            for (int j = 0; j < 16; j++) {
                ug[j] = (uint8_t)((qs[j] & 0xF) | (((qh >> j) & 1) << 4));
                ug[j + 16] = (uint8_t)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
            }
        }
        return;
    }
    case COLIBRI_DTYPE_IQ4_XS: { /* sub-blocks of 32: u = kvalue + 128, ws = d (ls - 32), wm = -128 ws */
        const uint8_t *b = r + k0 / 256 * 136;
        for (int64_t s = 0; s < kc / 256; s++, b += 136) {
            float d = cb_fast_f16(b);
            unsigned sh = (unsigned)b[2] | ((unsigned)b[3] << 8);
            const uint8_t *sl = b + 4, *qs = b + 8;
            for (int j = 0; j < 8; j++) {
                int ls = (int)(((sl[j / 2] >> (4 * (j % 2))) & 0xF) | (((sh >> (2 * j)) & 3) << 4)) - 32;
                float w = d * (float)ls;
                ws[s * 8 + j] = w;
                wm[s * 8 + j] = -128.0f * w;
                const uint8_t *q = qs + 16 * j;
                uint8_t *ug = u + s * 256 + 32 * j;
                for (int i = 0; i < 16; i++) {
                    ug[i] = (uint8_t)(cb_iq4nl_value(q[i] & 0xF) + 128);
                    ug[i + 16] = (uint8_t)(cb_iq4nl_value(q[i] >> 4) + 128);
                }
            }
        }
        return;
    }
    case COLIBRI_DTYPE_Q2_K: /* sub-blocks of 16: u = q (2 bits), ws = d sc, wm = -(dmin m) */
    case COLIBRI_DTYPE_Q3_K: { /* sub-blocks of 16: u = q + 4 (3 bits), ws = d (sc - 32), wm = -4 ws */
        int q3 = dt == COLIBRI_DTYPE_Q3_K;
        int64_t bb = q3 ? 110 : 84;
        const uint8_t *b = r + k0 / 256 * bb;
        for (int64_t s = 0; s < kc / 256; s++, b += bb) {
            const uint8_t *hm = b, *qs = b + (q3 ? 32 : 16);
            if (q3) {
                const uint8_t *sc = b + 96;
                float d = cb_fast_f16(b + 108);
                for (int k = 0; k < 16; k++) {
                    int lo = k < 8 ? (sc[k] & 0xF) : (sc[k - 8] >> 4);
                    int hi = (sc[8 + k % 4] >> (2 * (k / 4))) & 3;
                    float w = d * (float)((lo | (hi << 4)) - 32);
                    ws[s * 16 + k] = w;
                    wm[s * 16 + k] = -4.0f * w;
                }
            } else {
                float d = cb_fast_f16(b + 80), dmin = cb_fast_f16(b + 82);
                for (int k = 0; k < 16; k++) {
                    ws[s * 16 + k] = d * (float)(b[k] & 0xF);
                    wm[s * 16 + k] = -(dmin * (float)(b[k] >> 4));
                }
            }
            uint8_t *us = u + s * 256; /* element 128h + 32j + l: bits 2j..2j+1 of qs[32h + l] */
            for (int h = 0; h < 2; h++)
                for (int j = 0; j < 4; j++)
                    for (int l = 0; l < 32; l++) {
                        uint8_t q = (uint8_t)((qs[32 * h + l] >> (2 * j)) & 3);
                        if (q3) q |= (uint8_t)(((hm[l] >> (4 * h + j)) & 1) << 2);
                        us[128 * h + 32 * j + l] = q;
                    }
        }
        return;
    }
    default:
        return;
    }
}

/* The float steps of one sub-block g (see the top): the one definition every table uses. */
static inline float cb_fast_step(float acc, int32_t isum, float ws, float wm, float d, float ds) {
    acc = fmaf((float)isum, ws * d, acc);
    return fmaf(wm, ds, acc);
}

/* silu(g) * u as the SIMD tables compute it (simd_math.h: vexp, Cephes with a clamp, and
 * vsilu), operation by operation in scalar C (fmaf where they fuse), so that the reference
 * table's gate/up gives the vector tables' bits and a whole fast forward is the same
 * whichever fast table runs. */
static inline float cb_fast_exp(float x) {
    x = fminf(x, 88.7f);
    x = fmaxf(x, -87.3f);
    float n = nearbyintf(x * 1.44269504088896341f);
    float r = fmaf(-n, 0.693359375f, x);
    r = fmaf(-n, -2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r + 1.0f);
    uint32_t e = (uint32_t)((int32_t)n + 127) << 23; /* 2^n, n integral in [-126, 128] */
    float two_n;
    memcpy(&two_n, &e, 4);
    return p * two_n;
}
static inline float cb_fast_silu_mul(float g, float u) { return g / (1.0f + cb_fast_exp(0.0f - g)) * u; }

#endif
