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

static inline float bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

float cb_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign; /* +-0 */
        } else {
            /* subnormal: value = mant * 2^-24; normalise into a binary32 normal */
            int32_t e = 127 - 15 + 1;
            while ((mant & 0x400u) == 0) {
                mant <<= 1;
                e--;
            }
            mant &= 0x3ffu;
            bits = sign | ((uint32_t)e << 23) | (mant << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13); /* inf, or nan keeping its payload */
    } else {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    return bits_to_f32(bits);
}

uint16_t cb_f32_to_f16(float f) {
    uint32_t x = f32_to_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t exp = (x >> 23) & 0xffu;
    uint32_t mant = x & 0x7fffffu;
    if (exp == 0xff) { /* inf / nan (keep nan quiet and non-zero) */
        if (mant == 0) return (uint16_t)(sign | 0x7c00u);
        return (uint16_t)(sign | 0x7e00u | (mant >> 13));
    }
    int32_t e = (int32_t)exp - 127 + 15;
    if (e >= 31) return (uint16_t)(sign | 0x7c00u); /* overflow -> inf */
    if (e <= 0) {
        /* subnormal half (or zero): shift the full significand right with RNE */
        if (e < -10) return sign; /* below half of the smallest subnormal */
        uint32_t m = mant | 0x800000u;
        uint32_t shift = (uint32_t)(14 - e); /* 24-bit significand -> 10-bit at exponent -14 */
        uint32_t half = 1u << (shift - 1);
        uint32_t rem = m & ((1u << shift) - 1u);
        uint32_t q = m >> shift;
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (uint16_t)(sign | q); /* q may carry into the exponent field: correct */
    }
    uint32_t q = ((uint32_t)e << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) q++; /* carry may give inf: correct */
    return (uint16_t)(sign | q);
}

float cb_bf16_to_f32(uint16_t h) { return bits_to_f32((uint32_t)h << 16); }

uint16_t cb_f32_to_bf16(float f) {
    uint32_t x = f32_to_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* quiet nan */
    uint32_t lsb = (x >> 16) & 1u;
    x += 0x7fffu + lsb;
    return (uint16_t)(x >> 16);
}
