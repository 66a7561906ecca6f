/*
 * kernels.c — plain reference kernels (see kernels.h for each contract).
 *
 * These are written for clarity and for float32 parity with PyTorch, not speed: each
 * loop says what it computes. The fast versions are the SIMD tables (kernels_avx2.c,
 * kernels_avx512.c, both from kernels_simd.inc); test_kernels.c compares them with these.
 * Weight loops are ordered "weight row outer, token inner" so that one pass over the
 * weights serves the whole token batch. The end of this file chooses the table at run
 * time (cb_kernels_best; docs/kernels.md).
 */
#include "cpu/kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- row primitives ---- */

float cb_dot_ref(const void *w_row, uint32_t dt, const float *x, int64_t n) {
    float acc = 0.0f;
    if (cb_dtype_is_quant(dt)) { /* dequantize a chunk at a time, then the same chain */
        float w[CB_QCHUNK];
        cb_dequant_fn deq = cb_dtype_dequant(dt);
        uint64_t chunk_bytes = cb_row_bytes(dt, CB_QCHUNK);
        for (int64_t k0 = 0; k0 < n; k0 += CB_QCHUNK) {
            int64_t m = n - k0 < CB_QCHUNK ? n - k0 : CB_QCHUNK;
            deq(w, (const uint8_t *)w_row + (size_t)(k0 / CB_QCHUNK) * chunk_bytes, m);
            for (int64_t i = 0; i < m; i++) acc += w[i] * x[k0 + i];
        }
    } else if (dt == COLIBRI_DTYPE_F32) {
        const float *w = (const float *)w_row;
        for (int64_t i = 0; i < n; i++) acc += w[i] * x[i];
    } else if (dt == COLIBRI_DTYPE_F16) {
        const uint16_t *w = (const uint16_t *)w_row;
        for (int64_t i = 0; i < n; i++) acc += cb_f16_to_f32(w[i]) * x[i];
    } else { /* BF16 */
        const uint16_t *w = (const uint16_t *)w_row;
        for (int64_t i = 0; i < n; i++) acc += cb_bf16_to_f32(w[i]) * x[i];
    }
    return acc;
}

void cb_axpy_ref(float *y, float a, const void *w_row, uint32_t dt, int64_t n) {
    if (dt == COLIBRI_DTYPE_F32) {
        const float *w = (const float *)w_row;
        for (int64_t i = 0; i < n; i++) y[i] += a * w[i];
    } else if (dt == COLIBRI_DTYPE_F16) {
        const uint16_t *w = (const uint16_t *)w_row;
        for (int64_t i = 0; i < n; i++) y[i] += a * cb_f16_to_f32(w[i]);
    } else {
        const uint16_t *w = (const uint16_t *)w_row;
        for (int64_t i = 0; i < n; i++) y[i] += a * cb_bf16_to_f32(w[i]);
    }
}

/* ---- reference kernels ---- */

static void dequant_row_ref(float *dst, const void *src, uint32_t dt, int64_t n) {
    cb_dtype_dequant(dt)(dst, src, n);
}

static void matmul_ld_ref(float *y, int64_t ldy, const float *x, const void *w, uint32_t dt,
                          int64_t T, int64_t N, int64_t K) {
    size_t row_bytes = (size_t)cb_row_bytes(dt, (uint64_t)K);
    for (int64_t n = 0; n < N; n++) {
        const void *row = (const uint8_t *)w + (size_t)n * row_bytes;
        for (int64_t t = 0; t < T; t++) y[t * ldy + n] = cb_dot_ref(row, dt, x + t * K, K);
    }
}

static void matmul_ref(float *y, const float *x, const void *w, uint32_t dt, int64_t T,
                       int64_t N, int64_t K) {
    matmul_ld_ref(y, N, x, w, dt, T, N, K);
}

static void matmul_i8_ref(float *y, const float *x, const int8_t *q, const float *scale,
                          const float *zero, int64_t T, int64_t N, int64_t K) {
    for (int64_t n = 0; n < N; n++) {
        const int8_t *row = q + n * K;
        for (int64_t t = 0; t < T; t++) {
            const float *xt = x + t * K;
            float acc = 0.0f;
            /* dequantise exactly as the writer defines it, then the same float dot */
            for (int64_t k = 0; k < K; k++) acc += (((float)row[k] - zero[n]) * scale[n]) * xt[k];
            y[t * N + n] = acc;
        }
    }
}

static void rmsnorm_ref(float *y, const float *x, const float *w, int64_t T, int64_t H,
                        float eps) {
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * H;
        float *yt = y + t * H;
        /* the mean of squares is reduced in double: torch's vectorised float sum is
         * closer to the exact value than a naive float loop */
        double ss = 0.0;
        for (int64_t i = 0; i < H; i++) ss += (double)xt[i] * (double)xt[i];
        float var = (float)(ss / (double)H);
        float r = 1.0f / sqrtf(var + eps);
        for (int64_t i = 0; i < H; i++) yt[i] = w[i] * (xt[i] * r);
    }
}

static void rope_ref(float *x, int64_t T, int64_t n_heads, int64_t D, const float *cos,
                     const float *sin) {
    int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * half;
        const float *s = sin + t * half;
        for (int64_t h = 0; h < n_heads; h++) {
            float *v = x + (t * n_heads + h) * D;
            for (int64_t i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                /* HF: q*cos + rotate_half(q)*sin, rotate_half(q) = (-q2, q1) */
                v[i] = a * c[i] + (-b) * s[i];
                v[i + half] = b * c[i] + a * s[i];
            }
        }
    }
}

/* softmax over x[0..n); with `sink` non-NULL, one more logit *sink in the max and the
 * denominator whose own probability is not written: transformers' softmax of
 * cat([scores, sink]) minus the sink's column (gpt-oss's attention sinks). */
static void softmax_opt_sink(float *x, int64_t n, const float *sink) {
    float m = sink ? *sink : x[0];
    for (int64_t i = 0; i < n; i++)
        if (x[i] > m) m = x[i];
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        x[i] = expf(x[i] - m);
        sum += x[i];
    }
    if (sink) sum += expf(*sink - m);
    float inv = 1.0f / sum;
    for (int64_t i = 0; i < n; i++) x[i] *= inv;
}

static void softmax_ref(float *x, int64_t n) { softmax_opt_sink(x, n, NULL); }

static void softmax_sink_ref(float *x, int64_t n, float sink) { softmax_opt_sink(x, n, &sink); }

static void attention_heads_ref(float *out, const float *q, const cb_kv_view *kv, float *scores, int64_t T,
                                int64_t start_pos, int64_t Hq, int64_t Hkv, int64_t D, int64_t window,
                                const float *sinks, int64_t h0, int64_t h1) {
    int64_t group = Hq / Hkv;
    int64_t nq = Hq * D;
    float scale = (float)(1.0 / sqrt((double)D));
    for (int64_t t = 0; t < T; t++) {
        int64_t pos = start_pos + t;
        int64_t lo = (window > 0 && pos >= window) ? pos - window + 1 : 0;
        int64_t cnt = pos - lo + 1;
        for (int64_t h = h0; h < h1; h++) {
            const float *qh = q + t * nq + h * D;
            int64_t kvh = h / group;
            for (int64_t j = 0; j < cnt; j++) {
                const float *kr = cb_kv_at(kv->k, kv, kvh, lo + j, D);
                float acc = 0.0f;
                for (int64_t d = 0; d < D; d++) acc += qh[d] * kr[d];
                scores[j] = acc * scale;
            }
            if (sinks) softmax_sink_ref(scores, cnt, sinks[h]);
            else softmax_ref(scores, cnt);
            float *oh = out + t * nq + h * D;
            for (int64_t d = 0; d < D; d++) oh[d] = 0.0f;
            for (int64_t j = 0; j < cnt; j++) {
                const float *vr = cb_kv_at(kv->v, kv, kvh, lo + j, D);
                float p = scores[j];
                for (int64_t d = 0; d < D; d++) oh[d] += p * vr[d];
            }
        }
    }
}

static void attention_ref(float *out, const float *q, const cb_kv_view *kv, float *scores, int64_t T,
                          int64_t start_pos, int64_t Hq, int64_t Hkv, int64_t D, int64_t window,
                          const float *sinks) {
    attention_heads_ref(out, q, kv, scores, T, start_pos, Hq, Hkv, D, window, sinks, 0, Hq);
}

static void gateup_one_ref(float *h, const float *x, const void *grow, const void *urow, uint32_t dt,
                           int64_t R, int64_t H, int64_t I, int64_t i) {
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * H;
        float g = cb_dot_ref(grow, dt, xr, H);
        float u = cb_dot_ref(urow, dt, xr, H);
        float s = g / (1.0f + expf(-g)); /* silu, as torch */
        h[r * I + i] = s * u;
    }
}

static void expert_gateup_ref(float *h, const float *x, const void *gate, const void *up, uint32_t dt,
                              int64_t R, int64_t H, int64_t I, int64_t B, int64_t i0,
                              int64_t i1) {
    size_t row_bytes = (size_t)cb_row_bytes(dt, (uint64_t)H);
    const uint8_t *base = (const uint8_t *)gate;
    if (up) { /* split: row i of each matrix */
        for (int64_t i = i0; i < i1; i++)
            gateup_one_ref(h, x, base + (size_t)i * row_bytes, (const uint8_t *)up + (size_t)i * row_bytes, dt,
                           R, H, I, i);
        return;
    }
    /* gate/up, streamed block by block: block b = packed rows 2bB .. 2bB + 2nb - 1 */
    for (int64_t b0 = i0 / B * B; b0 < i1; b0 += B) {
        int64_t nb = (I - b0 < B) ? I - b0 : B;
        const uint8_t *blk = base + (size_t)(2 * b0) * row_bytes;
        for (int64_t j = 0; j < nb; j++) {
            if (b0 + j < i0 || b0 + j >= i1) continue;
            gateup_one_ref(h, x, blk + (size_t)j * row_bytes, blk + (size_t)(nb + j) * row_bytes, dt, R, H, I,
                           b0 + j);
        }
    }
}

/* One (row, column) element of block blk's chain: acc += h[i] * w2T[i, c] for i in the
 * block, ascending from 0 (the same expression as cb_axpy_ref's, so the same rounding). */
static float down_block_ref(const float *h, const uint8_t *down, size_t row_bytes, uint32_t dt,
                            int64_t I, int64_t blk, int64_t c) {
    int64_t i1 = (blk + 1) * CB_DOWN_BLOCK < I ? (blk + 1) * CB_DOWN_BLOCK : I;
    float acc = 0.0f;
    for (int64_t i = blk * CB_DOWN_BLOCK; i < i1; i++)
        cb_axpy_ref(&acc, h[i], down + (size_t)i * row_bytes + (size_t)c * cb_dtype_size(dt), dt, 1);
    return acc;
}

static void expert_down_ref(float *y, const float *h, const void *expert, uint32_t dt, int64_t R,
                            int64_t H, int64_t I, int64_t c0, int64_t c1) {
    /* y[r, c0:c1] = sum over blocks (ascending) of the block chains of h[r, i] * w2T[i, c] */
    size_t row_bytes = (size_t)H * cb_dtype_size(dt);
    const uint8_t *down = (const uint8_t *)expert + (size_t)(2 * I) * row_bytes;
    int64_t nblk = (I + CB_DOWN_BLOCK - 1) / CB_DOWN_BLOCK;
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = c0; c < c1; c++) {
            float acc = down_block_ref(h + r * I, down, row_bytes, dt, I, 0, c);
            for (int64_t b = 1; b < nblk; b++) acc = acc + down_block_ref(h + r * I, down, row_bytes, dt, I, b, c);
            y[r * H + c] = acc;
        }
}

static void expert_down_part_ref(float *part, const float *h, const void *expert, uint32_t dt,
                                 int64_t R, int64_t H, int64_t I, int64_t blk) {
    size_t row_bytes = (size_t)H * cb_dtype_size(dt);
    const uint8_t *down = (const uint8_t *)expert + (size_t)(2 * I) * row_bytes;
    int64_t i1 = (blk + 1) * CB_DOWN_BLOCK < I ? (blk + 1) * CB_DOWN_BLOCK : I;
    for (int64_t k = 0; k < R * H; k++) part[k] = 0.0f;
    for (int64_t i = blk * CB_DOWN_BLOCK; i < i1; i++)
        for (int64_t r = 0; r < R; r++) cb_axpy_ref(part + r * H, h[r * I + i], down + (size_t)i * row_bytes, dt, H);
}

static void expert_ffn_ref(float *y, float *h, const float *x, const void *expert, uint32_t dt,
                           int64_t R, int64_t H, int64_t I, int64_t B) {
    expert_gateup_ref(h, x, expert, NULL, dt, R, H, I, B, 0, I);
    expert_down_ref(y, h, expert, dt, R, H, I, 0, H);
}

static void rows_combine_ref(float *o, int64_t ldo, const float *p, int64_t ldp, const float *rows, int64_t ldr,
                             int64_t nh, int64_t n, int64_t D) {
    for (int64_t j = 0; j < n; j++) {
        const float *r = rows + j * ldr;
        for (int64_t h = 0; h < nh; h++) {
            float pj = p[h * ldp + j];
            float *oh = o + h * ldo;
            for (int64_t i = 0; i < D; i++) oh[i] += pj * r[i];
        }
    }
}

/* the library is compiled without contraction (CMakeLists.txt): a product, then a sum */
static void add_scaled_ref(float *d, const float *y, float w, int64_t n) {
    for (int64_t i = 0; i < n; i++) d[i] += y[i] * w;
}

static const cb_kernels k_ref = {
    .name = "reference",
    .dequant_row = dequant_row_ref,
    .matmul = matmul_ref,
    .matmul_ld = matmul_ld_ref,
    .matmul_i8 = matmul_i8_ref,
    .rmsnorm = rmsnorm_ref,
    .rope = rope_ref,
    .softmax = softmax_ref,
    .attention = attention_ref,
    .attention_heads = attention_heads_ref,
    .expert_ffn = expert_ffn_ref,
    .expert_gateup = expert_gateup_ref,
    .expert_down = expert_down_ref,
    .expert_down_part = expert_down_part_ref,
    .rows_combine = rows_combine_ref,
    .add_scaled = add_scaled_ref,
};

const cb_kernels *cb_kernels_ref(void) { return &k_ref; }
