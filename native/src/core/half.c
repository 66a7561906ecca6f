/*
 * half.c — binary16 and bfloat16 <-> binary32 conversions (core/dtype.h), in integer steps:
 * exact, and the same bits on every CPU. Apart from dtype.c so that the dtype table and the
 * reference dequantizers (quant.c) both call them without calling each other.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "core/dtype.h"

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

float cb_f16_table[65536];
static pthread_once_t f16_once = PTHREAD_ONCE_INIT;
static void f16_fill(void) {
    for (uint32_t h = 0; h < 65536u; h++) cb_f16_table[h] = cb_f16_to_f32((uint16_t)h);
}
void cb_f16_table_init(void) { pthread_once(&f16_once, f16_fill); }

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
