/*
 * kernels.h — the compute kernels of the forward pass, behind one table of function
 * pointers (cb_kernels) so that a SIMD version can replace any entry while the plain
 * reference version stays beside it (native/tests/test_kernels.c compares every table
 * the CPU can run against the reference on random odd-sized inputs).
 *
 * Tables (docs/kernels.md): "reference" (kernels.c, portable C), "avx2" (kernels_avx2.c,
 * AVX2+FMA+F16C), "avx512" (kernels_avx512.c, AVX-512F) and "neon" (kernels_neon.c, AArch64
 * Advanced SIMD), each a row of the registry (cpu/registry.c: its name, CPU probe and
 * priority). cb_kernels_best() picks the best one the CPU supports at run time; the
 * environment variable COLIBRI_KERNELS=ref|avx2|avx512|neon forces one (an unsupported or
 * unknown name falls back to the best supported table, so a forced name never crashes).
 *
 * Conventions: every matrix is row-major; weights are stored as nn.Linear, [out, in],
 * so y = W x is one dot product per weight row. Activations are float32 [T, width]:
 * each stage processes a batch of T tokens. The *_range / _ld entries compute a slice of
 * the output so that the thread pool (threadpool.h) can split one matmul between threads
 * by output rows or columns; the full-size entries are the same computation on the whole
 * range. All arithmetic is float32 unless a comment says otherwise.
 */
#ifndef COLIBRI_CPU_KERNELS_H
#define COLIBRI_CPU_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "core/dtype.h" /* dtype codes, sizes, f16/bf16 conversion */

/* Plain row primitives. cb_dot_ref: a weight row of any weight dtype (F32/F16/BF16 or a
 * block type, n a whole number of its blocks): the row dequantized (core/dtype.h) and one
 * float chain over i ascending. cb_axpy_ref: F32/F16/BF16 rows only. */
float cb_dot_ref(const void *w_row, uint32_t dt, const float *x, int64_t n);
void cb_axpy_ref(float *y, float a, const void *w_row, uint32_t dt, int64_t n); /* y += a*w */

/* Elements per chunk in which the kernels dequantize a block-quantized row (a multiple of
 * every block size; a row's last chunk may be shorter, a whole number of blocks). */
#define CB_QCHUNK 256

/* Query heads of one KV group that attention_heads processes together. */
#define CB_ATT_HEADS 4

/* Intermediate rows per block of the down projection's sum (see expert_down). */
#define CB_DOWN_BLOCK 256

/* One sequence's keys and values in the paged KV cache, at one layer: position p of KV head
 * g is the D floats at k (or v) + blocks[p / block_len] * block_stride + g * head_stride
 * + (p % block_len) * D. A contiguous cache [Hkv, S, D] is the view blocks = {0},
 * block_len = S, head_stride = S * D. */
typedef struct cb_kv_view {
    const float *k, *v;
    const int32_t *blocks;  /* [ceil(positions / block_len)] block ids of the sequence */
    int64_t block_len;      /* positions per block */
    int64_t block_stride;   /* floats from one block to the next */
    int64_t head_stride;    /* floats from one KV head to the next inside a block (>= block_len * D) */
} cb_kv_view;

/* The D floats of position pos, KV head g, in `base` (kv->k or kv->v). */
static inline const float *cb_kv_at(const float *base, const cb_kv_view *kv, int64_t g, int64_t pos,
                                    int64_t D) {
    return base + (int64_t)kv->blocks[pos / kv->block_len] * kv->block_stride + g * kv->head_stride +
           (pos % kv->block_len) * D;
}

typedef struct cb_kernels {
    const char *name;

    /* dst[0..n) = the n weights of a row of dtype dt (any weight dtype; n whole blocks) as
     * floats: bit for bit the reference dequantizer's values (core/quant.c). */
    void (*dequant_row)(float *dst, const void *src, uint32_t dt, int64_t n);

    /* y[t, n] = sum_k x[t, k] * W[n, k] for t < T, n < N.
     * w: [N, K] in dt (any weight dtype: F32/F16/BF16, or a block type with K a whole number
     * of its blocks: each row is cb_row_bytes(dt, K) bytes); x: [T, K]; y: [T, N]
     * (overwritten). A block-quantized W computes on its dequantized values, so the result is
     * that of the f32 matrix they form (float reassociation aside). */
    void (*matmul)(float *y, const float *x, const void *w, uint32_t dt, int64_t T, int64_t N,
                   int64_t K);

    /* The same with an output row stride: y[t * ldy + n] for t < T, n < N (ldy >= N).
     * Threads split a matmul by output rows: w + n0 rows, y + n0, N = n1 - n0. */
    void (*matmul_ld)(float *y, int64_t ldy, const float *x, const void *w, uint32_t dt,
                      int64_t T, int64_t N, int64_t K);

    /* Same with an int8 weight: W[n, k] = ((float)q[n, k] - zero[n]) * scale[n].
     * q: [N, K]; scale, zero: [N]. */
    void (*matmul_i8)(float *y, const float *x, const int8_t *q, const float *scale,
                      const float *zero, int64_t T, int64_t N, int64_t K);

    /* y[t, :] = x[t, :] * rsqrt(mean(x[t, :]^2) + eps) * w  (as HF RMSNorm, float32).
     * x, y: [T, H] (may alias); w: [H]. */
    void (*rmsnorm)(float *y, const float *x, const float *w, int64_t T, int64_t H, float eps);

    /* RoPE "default", rotate_half (non-interleaved): pairs (i, i + D/2) of each head.
     * x: [T, n_heads * D] in place; cos, sin: [T, D/2] for each token's position. */
    void (*rope)(float *x, int64_t T, int64_t n_heads, int64_t D, const float *cos,
                 const float *sin);

    /* x[0..n) <- softmax(x) in float32 (max-subtracted). n >= 1. */
    void (*softmax)(float *x, int64_t n);

    /* Causal grouped-query attention of T queries at positions start_pos.. of one sequence
     * over its cache (cb_kv_view: the paged KV cache; positions 0..start_pos+T-1 of the
     * sequence must be in it). q: [T, Hq*D]; out: [T, Hq*D];
     * scores: [CB_ATT_HEADS, start_pos+T] scratch. window > 0: key j visible from query i iff
     * j <= i and i - j < window. Scale 1/sqrt(D). Every query's result depends only on its
     * own inputs (not on T, start_pos of the call, the block layout or the heads range).
     * sinks: NULL, or [Hq] attention sinks (gpt-oss): query head h's softmax denominator
     * gains exp(sinks[h] - m) (m the max over its scores and sinks[h]) and no value is
     * attended for it, as transformers' eager_attention_forward with `sinks`. NULL computes
     * exactly what a table without sinks computes. */
    void (*attention)(float *out, const float *q, const cb_kv_view *kv, float *scores, int64_t T,
                      int64_t start_pos, int64_t Hq, int64_t Hkv, int64_t D, int64_t window,
                      const float *sinks);

    /* The same for query heads h0 <= h < h1 only (out is written for those heads only);
     * each thread passes its own scores scratch [CB_ATT_HEADS, start_pos+T]: the heads of
     * one KV group are done CB_ATT_HEADS at a time, sharing every key and value they load. */
    void (*attention_heads)(float *out, const float *q, const cb_kv_view *kv, float *scores, int64_t T,
                            int64_t start_pos, int64_t Hq, int64_t Hkv, int64_t D, int64_t window,
                            const float *sinks, int64_t h0, int64_t h1);

    /* SwiGLU expert FFN over a group of R rows with the EXPERTS_PACKED layout
     * (docs/format.md): expert: [3I, H] in dt, rows 0..2I-1 gate/up interleaved by
     * blocks of B rows, rows 2I..3I-1 = w2^T [I, H].
     * x: [R, H]; h: [R, I] scratch (silu(gate)*up); y: [R, H] (overwritten). */
    void (*expert_ffn)(float *y, float *h, const float *x, const void *expert, uint32_t dt,
                       int64_t R, int64_t H, int64_t I, int64_t B);

    /* The first half of expert_ffn for intermediate columns i0 <= i < i1 only:
     * h[r, i] = silu(gate_i . x_r) * (up_i . x_r); other columns of h are not touched.
     * up == NULL: gate is the packed expert (rows 0..2I-1 gate/up interleaved by blocks of
     * B rows, F32/F16/BF16); else gate and up are the split FFN's [I, H] matrices
     * (docs/format.md, "Version 2"), row-major in dt (any weight dtype), and B is unused. */
    void (*expert_gateup)(float *h, const float *x, const void *gate, const void *up, uint32_t dt,
                          int64_t R, int64_t H, int64_t I, int64_t B, int64_t i0, int64_t i1);

    /* The second half for output columns c0 <= c < c1 only:
     * y[r, c] = sum_i h[r, i] * w2T[i, c]; other columns of y are not touched.
     * The sum runs over fixed blocks of CB_DOWN_BLOCK intermediate rows: within a block one
     * chain over i ascending from 0, then the blocks' sums added in ascending order
     * (y = p0, y = y + p1, ...), so that expert_down_part can split it by blocks. */
    void (*expert_down)(float *y, const float *h, const void *expert, uint32_t dt, int64_t R,
                        int64_t H, int64_t I, int64_t c0, int64_t c1);

    /* Block blk of that sum for every output column: part[r, c] for c < H, = the chain over
     * blk * CB_DOWN_BLOCK <= i < min(I, (blk + 1) * CB_DOWN_BLOCK). Adding the parts of
     * blocks 0, 1, ... in order gives expert_down's y bit for bit. Few rows (decode) split
     * the down projection this way, so each thread streams whole w2T rows. */
    void (*expert_down_part)(float *part, const float *h, const void *expert, uint32_t dt,
                             int64_t R, int64_t H, int64_t I, int64_t blk);

    /* o[h * ldo + i] += sum over j < n of p[h * ldp + j] * rows[j * ldr + i], for h < nh and
     * i < D: nh rows of weights times n rows of values, added to o; within each element the
     * j ascending (a SIMD table may fuse each multiply-add). MLA's attention-weighted sum of
     * cached latent rows (backend/cpu/mla.c). */
    void (*rows_combine)(float *o, int64_t ldo, const float *p, int64_t ldp, const float *rows, int64_t ldr,
                         int64_t nh, int64_t n, int64_t D);

    /* d[i] += y[i] * w for i < n, the product rounded on its own, then the sum (never fused:
     * the MoE combine's weighted expert rows, as transformers multiplies, then index_add_s):
     * the same bits in every table. */
    void (*add_scaled)(float *d, const float *y, float w, int64_t n);

    /* NULL, or: these kernels also read panel copies of BF16 weights (cpu/panel.h) in this
     * layout, with the bits of matmul_ld, expert_gateup, expert_down and expert_down_part. */
    const struct cb_panel_kernels *panels;
} cb_kernels;

/* The plain reference kernels (always available). */
const cb_kernels *cb_kernels_ref(void);
/* The SIMD tables; NULL when not compiled into this build (non-x86 or an old compiler).
 * Calling one on a CPU without the instruction set faults: the registry (cpu/registry.h)
 * enters a table only after its CPU probe. */
const cb_kernels *cb_kernels_avx2(void);
const cb_kernels *cb_kernels_avx512(void);
const cb_kernels *cb_kernels_neon(void); /* AArch64 Advanced SIMD (kernels_neon.c) */

#endif
