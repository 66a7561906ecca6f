/*
 * dtype.c — the dtype table (dtype.h) and the software f16/bf16 conversions.
 */
#include "core/dtype.h"

static void dequant_f32(float *dst, const void *src, int64_t n) { memcpy(dst, src, (size_t)n * 4); }
static void dequant_f16(float *dst, const void *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = cb_f16_to_f32(((const uint16_t *)src)[i]);
}
static void dequant_bf16(float *dst, const void *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = cb_bf16_to_f32(((const uint16_t *)src)[i]);
}

/* One row per colibri_dtype, indexed by its value. */
static const struct {
    const char *name;
    uint32_t block;       /* elements per block (1: an element type) */
    uint32_t block_bytes; /* bytes per block */
    int in_file;          /* a .colibri tensor may have it */
    int quant;            /* a block-quantized type */
    cb_dequant_fn dequant; /* reference dequantize-row; NULL: not a weight type */
} dtype_table[] = {
    [COLIBRI_DTYPE_F32] = {"f32", 1, 4, 1, 0, dequant_f32},
    [COLIBRI_DTYPE_F16] = {"f16", 1, 2, 1, 0, dequant_f16},
    [COLIBRI_DTYPE_BF16] = {"bf16", 1, 2, 1, 0, dequant_bf16},
    [COLIBRI_DTYPE_I8] = {"int8", 1, 1, 1, 0, NULL},
    [COLIBRI_DTYPE_I32] = {"i32", 1, 4, 0, 0, NULL},
    [COLIBRI_DTYPE_I64] = {"i64", 1, 8, 0, 0, NULL},
    [COLIBRI_DTYPE_U64] = {"u64", 1, 8, 0, 0, NULL},
    [COLIBRI_DTYPE_Q8_0] = {"q8_0", 32, 34, 1, 1, cb_dequant_q8_0},
    [COLIBRI_DTYPE_Q4_K] = {"q4_k", 256, 144, 1, 1, cb_dequant_q4_k},
    [COLIBRI_DTYPE_Q5_K] = {"q5_k", 256, 176, 1, 1, cb_dequant_q5_k},
    [COLIBRI_DTYPE_Q6_K] = {"q6_k", 256, 210, 1, 1, cb_dequant_q6_k},
    [COLIBRI_DTYPE_MXFP4] = {"mxfp4", 32, 17, 1, 1, cb_dequant_mxfp4},
    [COLIBRI_DTYPE_Q4_0] = {"q4_0", 32, 18, 1, 1, cb_dequant_q4_0},
    [COLIBRI_DTYPE_Q4_1] = {"q4_1", 32, 20, 1, 1, cb_dequant_q4_1},
    [COLIBRI_DTYPE_Q5_0] = {"q5_0", 32, 22, 1, 1, cb_dequant_q5_0},
    [COLIBRI_DTYPE_Q5_1] = {"q5_1", 32, 24, 1, 1, cb_dequant_q5_1},
    [COLIBRI_DTYPE_Q2_K] = {"q2_k", 256, 84, 1, 1, cb_dequant_q2_k},
    [COLIBRI_DTYPE_Q3_K] = {"q3_k", 256, 110, 1, 1, cb_dequant_q3_k},
    [COLIBRI_DTYPE_IQ4_NL] = {"iq4_nl", 32, 18, 1, 1, cb_dequant_iq4_nl},
    [COLIBRI_DTYPE_IQ4_XS] = {"iq4_xs", 256, 136, 1, 1, cb_dequant_iq4_xs},
    [COLIBRI_DTYPE_IQ2_XXS] = {"iq2_xxs", 256, 66, 1, 1, cb_dequant_iq2_xxs},
    [COLIBRI_DTYPE_IQ2_XS] = {"iq2_xs", 256, 74, 1, 1, cb_dequant_iq2_xs},
    [COLIBRI_DTYPE_IQ2_S] = {"iq2_s", 256, 82, 1, 1, cb_dequant_iq2_s},
    [COLIBRI_DTYPE_IQ3_XXS] = {"iq3_xxs", 256, 98, 1, 1, cb_dequant_iq3_xxs},
    [COLIBRI_DTYPE_IQ3_S] = {"iq3_s", 256, 110, 1, 1, cb_dequant_iq3_s},
    [COLIBRI_DTYPE_IQ1_S] = {"iq1_s", 256, 50, 1, 1, cb_dequant_iq1_s},
    [COLIBRI_DTYPE_IQ1_M] = {"iq1_m", 256, 56, 1, 1, cb_dequant_iq1_m},
};
#define N_DTYPES (sizeof dtype_table / sizeof dtype_table[0])

size_t cb_dtype_size(uint32_t dt) {
    return dt < N_DTYPES && dtype_table[dt].block == 1 ? dtype_table[dt].block_bytes : 0;
}

uint32_t cb_dtype_block(uint32_t dt) { return dt < N_DTYPES ? dtype_table[dt].block : 0; }

uint32_t cb_dtype_block_bytes(uint32_t dt) { return dt < N_DTYPES ? dtype_table[dt].block_bytes : 0; }

uint64_t cb_row_bytes(uint32_t dt, uint64_t n) {
    if (dt >= N_DTYPES || n % dtype_table[dt].block) return 0;
    return n / dtype_table[dt].block * dtype_table[dt].block_bytes;
}

int cb_dtype_is_weight(uint32_t dt) { return dt < N_DTYPES && dtype_table[dt].dequant != NULL; }

int cb_dtype_is_quant(uint32_t dt) { return dt < N_DTYPES && dtype_table[dt].quant; }

cb_dequant_fn cb_dtype_dequant(uint32_t dt) { return dt < N_DTYPES ? dtype_table[dt].dequant : NULL; }

const char *cb_dtype_name(uint32_t dt) { return dt < N_DTYPES ? dtype_table[dt].name : "unknown"; }

int cb_dtype_in_file(uint32_t dt) { return dt < N_DTYPES && dtype_table[dt].in_file; }
