/*
 * quant_grid.c — ggml's grid ("i-quant") block types, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
 * IQ3_S, IQ1_S and IQ1_M: their reference dequantizers (ggml's dequantize_row_iq*, float32
 * products in its order, none fused: the bits of the `gguf` package's
 * gguf.quants.dequantize) and the codebooks they index.
 *
 * A grid type stores, per 8 (or 4) weights, the index of an entry of a fixed codebook of
 * magnitudes (the grid), a sign pattern and a scale. The grids are ggml's format constants
 * (256 to 2048 entries); the engine does not carry them in its source: a .colibri file that
 * holds a grid type carries the grid as a tensor ("codebook.<type>", written by the
 * converter from the `gguf` package), and the engine installs it when it opens the file
 * (cb_codebook_install), after checking its size and its CRC-32 against the checksum of
 * ggml's grid. The codebooks are process-wide (every file carries the same ones): one
 * install serves every later file, and a later file's must equal it.
 *
 * The sign patterns are computed, not tabled: ggml's ksigns_iq2xs[i] is i with bit 7 set
 * when i has an odd number of bits (an even-parity 8-bit pattern from 7 stored bits).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>

#include "core/dtype.h"
#include "core/quant_grid.h" /* grid_ksigns, grid_rd32 */
#include "format/container.h"

/* ---- the codebooks ---- */

/* entries, bytes per entry, CRC-32 of ggml's grid (its entries' values as bytes, int8 for
 * IQ1's) */
static const struct {
    const char *name;
    uint32_t entries, width, crc;
} books[CB_N_CODEBOOKS] = {
    [CB_BOOK_IQ2_XXS] = {"iq2_xxs", 256, 8, 0x9924ff02u},
    [CB_BOOK_IQ2_XS] = {"iq2_xs", 512, 8, 0xfa1e1bfdu},
    [CB_BOOK_IQ2_S] = {"iq2_s", 1024, 8, 0x25ae5bf1u},
    [CB_BOOK_IQ3_XXS] = {"iq3_xxs", 256, 4, 0x07ba9ed0u},
    [CB_BOOK_IQ3_S] = {"iq3_s", 512, 4, 0xf576e4f3u},
    [CB_BOOK_IQ1_S] = {"iq1_s", 2048, 8, 0xb85e6ccfu},
};
enum { BOOK_MAX = 2048 * 8 };
static uint8_t book_data[CB_N_CODEBOOKS][BOOK_MAX];
static atomic_int book_ready[CB_N_CODEBOOKS];
static pthread_mutex_t book_lock = PTHREAD_MUTEX_INITIALIZER;

int cb_dtype_codebook(uint32_t dt) {
    switch (dt) {
    case COLIBRI_DTYPE_IQ2_XXS: return CB_BOOK_IQ2_XXS;
    case COLIBRI_DTYPE_IQ2_XS: return CB_BOOK_IQ2_XS;
    case COLIBRI_DTYPE_IQ2_S: return CB_BOOK_IQ2_S;
    case COLIBRI_DTYPE_IQ3_XXS: return CB_BOOK_IQ3_XXS;
    case COLIBRI_DTYPE_IQ3_S: return CB_BOOK_IQ3_S;
    case COLIBRI_DTYPE_IQ1_S:
    case COLIBRI_DTYPE_IQ1_M: return CB_BOOK_IQ1_S;
    default: return -1;
    }
}

const char *cb_codebook_name(int book) { return book >= 0 && book < CB_N_CODEBOOKS ? books[book].name : "unknown"; }

uint64_t cb_codebook_bytes(int book) {
    return book >= 0 && book < CB_N_CODEBOOKS ? (uint64_t)books[book].entries * books[book].width : 0;
}

int cb_codebook_ready(int book) {
    return book >= 0 && book < CB_N_CODEBOOKS && atomic_load_explicit(&book_ready[book], memory_order_acquire);
}

int cb_dtype_ready(uint32_t dt) {
    int book = cb_dtype_codebook(dt);
    return book < 0 || cb_codebook_ready(book);
}

static colibri_status install(int book, const void *data, uint64_t bytes, int check, char *err, size_t len) {
    if (book < 0 || book >= CB_N_CODEBOOKS || !data) {
        if (err && len) snprintf(err, len, "no such codebook");
        return COLIBRI_E_INVALID_ARG;
    }
    const uint64_t want = cb_codebook_bytes(book);
    if (bytes != want) {
        if (err && len)
            snprintf(err, len, "the %s codebook has %llu bytes, not the %llu of ggml's grid (%u entries of %u)",
                     books[book].name, (unsigned long long)bytes, (unsigned long long)want, books[book].entries,
                     books[book].width);
        return COLIBRI_E_FORMAT;
    }
    if (check && cb_crc32(0, data, bytes) != books[book].crc) {
        if (err && len)
            snprintf(err, len, "the %s codebook is not ggml's grid (CRC-32 %08x, expected %08x)", books[book].name,
                     cb_crc32(0, data, bytes), books[book].crc);
        return COLIBRI_E_FORMAT;
    }
    colibri_status st = COLIBRI_OK;
    pthread_mutex_lock(&book_lock);
    if (atomic_load_explicit(&book_ready[book], memory_order_relaxed)) {
        if (memcmp(book_data[book], data, (size_t)bytes) != 0) {
            if (err && len)
                snprintf(err, len, "the %s codebook differs from the one this process installed before",
                         books[book].name);
            st = COLIBRI_E_FORMAT;
        }
    } else {
        memcpy(book_data[book], data, (size_t)bytes);
        atomic_store_explicit(&book_ready[book], 1, memory_order_release);
    }
    pthread_mutex_unlock(&book_lock);
    return st;
}

colibri_status cb_codebook_install(int book, const void *data, uint64_t bytes, char *err, size_t len) {
    return install(book, data, bytes, 1, err, len);
}

colibri_status cb_codebook_install_any(int book, const void *data, uint64_t bytes) {
    return install(book, data, bytes, 0, NULL, 0);
}

const uint8_t *cb_codebook(int book) { return cb_codebook_ready(book) ? book_data[book] : NULL; }

/* ---- the dequantizers ---- */

static inline float rd_f16(const uint8_t *p) { return cb_f16_to_f32((uint16_t)(p[0] | (p[1] << 8))); }
static inline uint16_t rd_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline float sgn(unsigned signs, int j) { return (signs >> j) & 1 ? -1.0f : 1.0f; }
/* n weights of one codebook entry g: (db * g[j]) * sign j */
static inline void put_signed(float *y, float db, const uint8_t *g, unsigned signs, int j0, int n) {
    for (int j = 0; j < n; j++) y[j] = db * (float)g[j] * sgn(signs, j0 + j);
}

/* IQ2_XXS (66 bytes): f16 d, then per 32 weights two u32: four grid indices (bytes) and
 * (four 7-bit sign patterns | scale << 28); value d (0.5 + scale) 0.25 * grid * sign */
void cb_dequant_iq2_xxs(float *dst, const void *src, int64_t n) {
    const uint8_t *b = (const uint8_t *)src, *grid = book_data[CB_BOOK_IQ2_XXS];
    for (int64_t i = 0; i < n; i += 256, b += 66) {
        const float d = rd_f16(b);
        for (int s = 0; s < 8; s++) {
            const uint8_t *q = b + 2 + 8 * s;
            const uint32_t aux = grid_rd32(q + 4);
            const float db = d * (0.5f + (float)(aux >> 28)) * 0.25f;
            float *y = dst + i + 32 * s;
            for (int l = 0; l < 4; l++) {
                put_signed(y + 8 * l, db, grid + 8 * q[l], grid_ksigns((aux >> (7 * l)) & 127), 0, 8);
            }
        }
    }
}

/* IQ2_XS (74 bytes): f16 d, 32 u16 (9-bit grid index | 7-bit sign pattern << 9), 8 bytes of
 * 4-bit scales (one per 16 weights) */
void cb_dequant_iq2_xs(float *dst, const void *src, int64_t n) {
    const uint8_t *b = (const uint8_t *)src, *grid = book_data[CB_BOOK_IQ2_XS];
    for (int64_t i = 0; i < n; i += 256, b += 74) {
        const float d = rd_f16(b);
        const uint8_t *sc = b + 66;
        for (int s = 0; s < 8; s++) {
            const float db[2] = {d * (0.5f + (float)(sc[s] & 0xF)) * 0.25f, d * (0.5f + (float)(sc[s] >> 4)) * 0.25f};
            float *y = dst + i + 32 * s;
            for (int l = 0; l < 4; l++) {
                const unsigned q = rd_u16(b + 2 + 2 * (4 * s + l));
                put_signed(y + 8 * l, db[l / 2], grid + 8 * (q & 511), grid_ksigns(q >> 9), 0, 8);
            }
        }
    }
}

/* IQ2_S (82 bytes): f16 d, 32 index bytes, 32 sign bytes, 8 bytes of the indices' high two
 * bits, 8 bytes of 4-bit scales (one per 16 weights) */
void cb_dequant_iq2_s(float *dst, const void *src, int64_t n) {
    const uint8_t *b = (const uint8_t *)src, *grid = book_data[CB_BOOK_IQ2_S];
    for (int64_t i = 0; i < n; i += 256, b += 82) {
        const float d = rd_f16(b);
        const uint8_t *qs = b + 2, *signs = b + 34, *qh = b + 66, *sc = b + 74;
        for (int s = 0; s < 8; s++) {
            const float db[2] = {d * (0.5f + (float)(sc[s] & 0xF)) * 0.25f, d * (0.5f + (float)(sc[s] >> 4)) * 0.25f};
            float *y = dst + i + 32 * s;
            for (int l = 0; l < 4; l++) {
                const uint8_t *g = grid + 8 * (qs[4 * s + l] | (((qh[s] >> (2 * l)) & 3) << 8));
                put_signed(y + 8 * l, db[l / 2], g, signs[4 * s + l], 0, 8);
            }
        }
    }
}

/* IQ3_XXS (98 bytes): f16 d, 64 index bytes (4 weights each), then per 32 weights a u32 of
 * four 7-bit sign patterns | scale << 28; value d (0.5 + scale) 0.5 * grid * sign */
void cb_dequant_iq3_xxs(float *dst, const void *src, int64_t n) {
    const uint8_t *b = (const uint8_t *)src, *grid = book_data[CB_BOOK_IQ3_XXS];
    for (int64_t i = 0; i < n; i += 256, b += 98) {
        const float d = rd_f16(b);
        for (int s = 0; s < 8; s++) {
            const uint8_t *qs = b + 2 + 8 * s;
            const uint32_t aux = grid_rd32(b + 66 + 4 * s);
            const float db = d * (0.5f + (float)(aux >> 28)) * 0.5f;
            float *y = dst + i + 32 * s;
            for (int l = 0; l < 4; l++) {
                const unsigned sg = grid_ksigns((aux >> (7 * l)) & 127);
                put_signed(y + 8 * l, db, grid + 4 * qs[2 * l], sg, 0, 4);
                put_signed(y + 8 * l + 4, db, grid + 4 * qs[2 * l + 1], sg, 4, 4);
            }
        }
    }
}

/* IQ3_S (110 bytes): f16 d, 64 index bytes, 8 bytes of the indices' ninth bits, 32 sign
 * bytes, 4 bytes of 4-bit scales (one per 32 weights); value d (1 + 2 scale) * grid * sign */
void cb_dequant_iq3_s(float *dst, const void *src, int64_t n) {
    const uint8_t *b = (const uint8_t *)src, *grid = book_data[CB_BOOK_IQ3_S];
    for (int64_t i = 0; i < n; i += 256, b += 110) {
        const float d = rd_f16(b);
        const uint8_t *qs = b + 2, *qh = b + 66, *signs = b + 74, *sc = b + 106;
        for (int s = 0; s < 8; s++) {
            const float db = d * (float)(1 + 2 * ((sc[s / 2] >> (4 * (s % 2))) & 0xF));
            float *y = dst + i + 32 * s;
            for (int l = 0; l < 8; l++) { /* 4 weights each */
                const int k = 8 * s + l;
                const uint8_t *g = grid + 4 * (qs[k] | (((qh[k / 8] >> (k % 8)) & 1) << 8));
                put_signed(y + 4 * l, db, g, signs[4 * s + l / 2], 4 * (l % 2), 4);
            }
        }
    }
}

#define IQ1_DELTA 0.125f
/* IQ1_S (50 bytes): f16 d, 32 index bytes, 8 u16 per 32 weights (four 3-bit index high
 * parts | 3-bit scale << 12 | the delta's sign << 15); value d (2 scale + 1) * (grid + delta),
 * the grid's values -1, 0, 1 */
void cb_dequant_iq1_s(float *dst, const void *src, int64_t n) {
    const uint8_t *b = (const uint8_t *)src, *grid = book_data[CB_BOOK_IQ1_S];
    for (int64_t i = 0; i < n; i += 256, b += 50) {
        const float d = rd_f16(b);
        for (int s = 0; s < 8; s++) {
            const unsigned qh = rd_u16(b + 34 + 2 * s);
            const float dl = d * (float)(2 * ((qh >> 12) & 7) + 1);
            const float delta = qh & 0x8000 ? -IQ1_DELTA : IQ1_DELTA;
            float *y = dst + i + 32 * s;
            for (int l = 0; l < 4; l++) {
                const int8_t *g = (const int8_t *)grid + 8 * (b[2 + 4 * s + l] | (((qh >> (3 * l)) & 7) << 8));
                for (int j = 0; j < 8; j++) y[8 * l + j] = dl * ((float)g[j] + delta);
            }
        }
    }
}

/* IQ1_M (56 bytes): 32 index bytes, 16 bytes of (3-bit index high part | the delta's sign
 * << 3) nibbles, 4 u16 of 3-bit scales (one per 16 weights) whose top nibbles make the f16 d */
void cb_dequant_iq1_m(float *dst, const void *src, int64_t n) {
    const uint8_t *b = (const uint8_t *)src, *grid = book_data[CB_BOOK_IQ1_S];
    for (int64_t i = 0; i < n; i += 256, b += 56) {
        const uint8_t *qs = b, *qh = b + 32;
        uint16_t sc[4];
        for (int k = 0; k < 4; k++) sc[k] = rd_u16(b + 48 + 2 * k);
        const uint16_t dh = (uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) | ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000));
        const float d = cb_f16_to_f32(dh);
        for (int s = 0; s < 8; s++) {
            const unsigned w = sc[s / 2] >> (6 * (s % 2));
            const float dl[2] = {d * (float)(2 * (w & 7) + 1), d * (float)(2 * ((w >> 3) & 7) + 1)};
            float *y = dst + i + 32 * s;
            for (int l = 0; l < 4; l++) {
                const unsigned h = (qh[2 * s + l / 2] >> (4 * (l % 2))) & 0xF;
                const int8_t *g = (const int8_t *)grid + 8 * (qs[4 * s + l] | ((h & 7) << 8));
                const float delta = h & 8 ? -IQ1_DELTA : IQ1_DELTA;
                for (int j = 0; j < 8; j++) y[8 * l + j] = dl[l / 2] * ((float)g[j] + delta);
            }
        }
    }
}
