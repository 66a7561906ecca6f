/*
 * dtype.h — the element types of the engine, as data: one table (dtype.c) says for each
 * colibri_dtype (colibri.h: one name space for the types of file tensors and of the arrays
 * handed to callers) its name, its size in bytes and whether a .colibri file may store a
 * tensor of it. Code asks the table instead of testing types one by one, so that a new
 * type (a quantized block format, say) is a new row here and kernels that consume it.
 */
#ifndef COLIBRI_CORE_DTYPE_H
#define COLIBRI_CORE_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "colibri.h"

/* Bytes per element of an element type (F32 ... U64); 0 for a block type or an unknown dtype. */
size_t cb_dtype_size(uint32_t dt);
/* Elements per block (1 for element types) and bytes per block; 0 for an unknown dtype. */
uint32_t cb_dtype_block(uint32_t dt);
uint32_t cb_dtype_block_bytes(uint32_t dt);
/* Bytes of a row of n elements; 0 when dt is unknown or n is not a whole number of blocks. */
uint64_t cb_row_bytes(uint32_t dt, uint64_t n);
/* 1 for the dtypes a weight matrix may have: F32, F16, BF16 and the block types. */
int cb_dtype_is_weight(uint32_t dt);
/* 1 for the block-quantized types (Q8_0, Q4_K, Q5_K, Q6_K, MXFP4, Q4_0, Q4_1, Q5_0, Q5_1,
 * Q2_K, Q3_K, IQ4_NL, IQ4_XS and the grid types IQ2_XXS ... IQ1_M). */
int cb_dtype_is_quant(uint32_t dt);

/* The reference dequantize-row of a weight dtype: n elements (whole blocks) of src into
 * dst. NULL for a dtype that is not a weight type. */
typedef void (*cb_dequant_fn)(float *dst, const void *src, int64_t n);
cb_dequant_fn cb_dtype_dequant(uint32_t dt);
/* Its name ("f32", "f16", "bf16", "int8", "i32", "i64", "u64", "q8_0", "q4_k", "q5_k",
 * "q6_k", "mxfp4", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "iq4_nl", "iq4_xs",
 * "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m");
 * "unknown" otherwise. */
const char *cb_dtype_name(uint32_t dt);
/* 1 when a tensor of a .colibri file may have this dtype (docs/format.md, "Tensor
 * directory section"): f32, f16, bf16, int8 and the block types. The array-only types are
 * not file types. */
int cb_dtype_in_file(uint32_t dt);

/* IEEE binary16 <-> binary32 in software (subnormals, inf and nan handled;
 * f32 -> f16 rounds to nearest, ties to even). */
float cb_f16_to_f32(uint16_t h);
uint16_t cb_f32_to_f16(float f);
/* cb_f16_to_f32 of every binary16, for the SIMD kernels, which convert a block's scale by one
 * load (F16C's scalar conversion costs a move into a vector register, a conversion and a
 * broadcast; NEON's is the function call): filled once by cb_f16_table_init (thread-safe),
 * which each such kernel table's getter calls, so nothing reads it before. 256 KiB of which
 * a model's scales touch a few lines. */
extern float cb_f16_table[65536];
void cb_f16_table_init(void);
/* the little-endian binary16 at p as a float, from the table */
static inline float cb_f16_at(const uint8_t *p) { return cb_f16_table[p[0] | (p[1] << 8)]; }
/* bfloat16 <-> binary32: bf16 is the upper half; f32 -> bf16 rounds to nearest even
 * (nan stays nan). */
float cb_bf16_to_f32(uint16_t h);
uint16_t cb_f32_to_bf16(float f);

/* core/quant.c: the block types' reference dequantizers (ggml's dequantize_row_* semantics,
 * float32 products in the order docs/format.md gives, none fused). */
void cb_dequant_q8_0(float *dst, const void *src, int64_t n);
void cb_dequant_q4_k(float *dst, const void *src, int64_t n);
void cb_dequant_q5_k(float *dst, const void *src, int64_t n);
void cb_dequant_q6_k(float *dst, const void *src, int64_t n);
void cb_dequant_mxfp4(float *dst, const void *src, int64_t n);
void cb_dequant_q4_0(float *dst, const void *src, int64_t n);
void cb_dequant_q4_1(float *dst, const void *src, int64_t n);
void cb_dequant_q5_0(float *dst, const void *src, int64_t n);
void cb_dequant_q5_1(float *dst, const void *src, int64_t n);
void cb_dequant_q2_k(float *dst, const void *src, int64_t n);
void cb_dequant_q3_k(float *dst, const void *src, int64_t n);
void cb_dequant_iq4_nl(float *dst, const void *src, int64_t n);
void cb_dequant_iq4_xs(float *dst, const void *src, int64_t n);
/* core/quant_grid.c: the grid types' (ggml's i-quants), which read their codebook */
void cb_dequant_iq2_xxs(float *dst, const void *src, int64_t n);
void cb_dequant_iq2_xs(float *dst, const void *src, int64_t n);
void cb_dequant_iq2_s(float *dst, const void *src, int64_t n);
void cb_dequant_iq3_xxs(float *dst, const void *src, int64_t n);
void cb_dequant_iq3_s(float *dst, const void *src, int64_t n);
void cb_dequant_iq1_s(float *dst, const void *src, int64_t n);
void cb_dequant_iq1_m(float *dst, const void *src, int64_t n);

/* The grid types' codebooks (quant_grid.c): process-wide, installed from a file (or by
 * colibri_install_codebook) once their size and CRC-32 are ggml's grid's. */
enum { CB_BOOK_IQ2_XXS, CB_BOOK_IQ2_XS, CB_BOOK_IQ2_S, CB_BOOK_IQ3_XXS, CB_BOOK_IQ3_S, CB_BOOK_IQ1_S, CB_N_CODEBOOKS };
/* the codebook a dtype reads, or -1 */
int cb_dtype_codebook(uint32_t dt);
/* its name ("iq2_xxs", ...: a file's tensor "codebook.<name>") and size in bytes */
const char *cb_codebook_name(int book);
uint64_t cb_codebook_bytes(int book);
/* 1 once installed; cb_dtype_ready: 1 for a dtype without a codebook or whose is installed */
int cb_codebook_ready(int book);
int cb_dtype_ready(uint32_t dt);
/* install (err: why not); _any skips the CRC (tests, with codebooks of their own) */
colibri_status cb_codebook_install(int book, const void *data, uint64_t bytes, char *err, size_t len);
colibri_status cb_codebook_install_any(int book, const void *data, uint64_t bytes);
/* the installed codebook's bytes (entry e at width * e), NULL before */
const uint8_t *cb_codebook(int book);

/* IQ4_NL / IQ4_XS: the value of a 4-bit code (ggml's kvalues_iq4nl), times the block's or
 * sub-block's scale. */
static inline const int8_t *cb_iq4nl_table(void) {
    static const int8_t kv[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
    return kv;
}
static inline int8_t cb_iq4nl_value(unsigned code) { return cb_iq4nl_table()[code & 15u]; }

/* MXFP4 (ggml's block_mxfp4: e, then qs[16]; element j < 16 the low nibble of qs[j], j + 16
 * its high nibble): the doubled e2m1 value of a 4-bit code (ggml's kvalues_mxfp4: bit 3 the
 * sign, bits 0-2 index {0, 0.5, 1, 1.5, 2, 3, 4, 6} times 2) ... */
static inline int8_t cb_mxfp4_k2(unsigned code) {
    static const int8_t k2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    return k2[code & 15u];
}
/* ... and the block's half scale 2^(e - 128) (ggml's GGML_E8M0_TO_FP32_HALF: subnormal for
 * e < 2; e = 255, NaN in OCP, is 2^127 here as in ggml), so that an element is exactly
 * (float)cb_mxfp4_k2(code) * cb_e8m0_half(e) = e2m1 * 2^(e - 127), one float product. */
static inline float cb_e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
/* The eight 6-bit scales (out[0..8)) and mins (out[8..16)) of a Q4_K/Q5_K block's 12 scale
 * bytes (ggml's get_scale_min_k4 for j = 0..7: sc[j] = q[j] & 63, m[j] = q[j+4] & 63 for
 * j < 4; for j >= 4 the low four bits from q[j+4], the top two from q[j-4] (sc) or q[j]
 * (m)), all at once with 32-bit masks and shifts. */
static inline void cb_k4_unpack(const uint8_t *q, uint8_t out[16]) {
    uint32_t u0, u1, u2;
    memcpy(&u0, q, 4);
    memcpy(&u1, q + 4, 4);
    memcpy(&u2, q + 8, 4);
    uint32_t sc_lo = u0 & 0x3f3f3f3fu;                                          /* sc[0..4) */
    uint32_t sc_hi = (u2 & 0x0f0f0f0fu) | (((u0 >> 6) & 0x03030303u) << 4);       /* sc[4..8) */
    uint32_t m_lo = u1 & 0x3f3f3f3fu;                                           /* m[0..4) */
    uint32_t m_hi = ((u2 >> 4) & 0x0f0f0f0fu) | (((u1 >> 6) & 0x03030303u) << 4); /* m[4..8) */
    memcpy(out, &sc_lo, 4);
    memcpy(out + 4, &sc_hi, 4);
    memcpy(out + 8, &m_lo, 4);
    memcpy(out + 12, &m_hi, 4);
}

#endif
