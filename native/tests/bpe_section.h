/*
 * bpe_section.h — a small byte-level BPE tokenizer section (tokenizer section type 2, the
 * layout of docs/format.md) built in memory for the C tests and fuzz targets that need a
 * tokenizer without a model file: 256 byte tokens (GPT-2's byte -> character map), the merges
 * (h, e) -> "he", (l, l) -> "ll", ("he", "ll") -> "hell", and the special added token
 * <|eot|>, also EOS. build() writes it into sec[0 .. sec_size); a test may then patch the
 * header or a token's record with w16 / w32 / w64 (offsets into sec) before loading it with
 * colibri_tokenizer_from_memory. Header-only (static), for one translation unit each.
 */
#ifndef COLIBRI_TESTS_BPE_SECTION_H
#define COLIBRI_TESTS_BPE_SECTION_H

#include <stdint.h>
#include <string.h>

#define NT 260
enum { ID_HE = 256, ID_LL = 257, ID_HELL = 258, ID_EOT = 259 };

static uint8_t sec[64 * 1024];
static uint64_t sec_size;

static inline void w32(uint64_t o, uint32_t v) { memcpy(sec + o, &v, 4); }
static inline void w64(uint64_t o, uint64_t v) { memcpy(sec + o, &v, 8); }
static inline void w16(uint64_t o, uint16_t v) { memcpy(sec + o, &v, 2); }

static inline uint32_t enc_utf8(uint32_t cp, uint8_t *o) {
    if (cp < 0x80) { o[0] = (uint8_t)cp; return 1; }
    o[0] = (uint8_t)(0xC0 | (cp >> 6));
    o[1] = (uint8_t)(0x80 | (cp & 0x3F));
    return 2;
}

/* GPT-2's byte -> character map. */
static inline uint32_t byte_char(int b) {
    if ((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF)) return (uint32_t)b;
    int n = 0;
    for (int k = 0; k < b; k++)
        if (!((k >= '!' && k <= '~') || (k >= 0xA1 && k <= 0xAC) || (k >= 0xAE && k <= 0xFF))) n++;
    return 256u + (uint32_t)n;
}

static inline void build(void) {
    memset(sec, 0, sizeof sec);
    const uint64_t tokens = 128, byte_ids = tokens + 16 * NT, merges = byte_ids + 1024, mlog2 = 3;
    const uint64_t added = merges + 16 * (1u << mlog2), blob = added + 8;
    uint64_t bp = 0;
    memcpy(sec, "CBTOKEN", 8);
    w32(8, 1); w32(12, 2); w32(16, 128); w32(20, NT);
    w32(24, (uint32_t)-1); w32(28, ID_EOT); w32(32, (uint32_t)-1); w32(36, (uint32_t)-1);
    w32(40, 0); w32(44, 1); w32(48, 3); w32(52, (uint32_t)mlog2);
    w64(56, tokens); w64(64, merges); w64(72, 0); w32(80, 0); w32(84, 1); w64(88, added);
    w64(96, blob); w64(112, byte_ids);
    for (int b = 0; b < 256; b++) {
        uint8_t u[4];
        uint32_t ul = enc_utf8(byte_char(b), u);
        uint64_t r = tokens + 16 * (uint64_t)b;
        w32(r, (uint32_t)bp); memcpy(sec + blob + bp, u, ul); bp += ul;
        w32(r + 4, (uint32_t)bp); sec[blob + bp++] = (uint8_t)b;
        w16(r + 8, (uint16_t)ul); w16(r + 10, 1); sec[r + 12] = 1;
        w32(byte_ids + 4 * (uint64_t)b, (uint32_t)b);
    }
    const char *strs[4] = {"he", "ll", "hell", "<|eot|>"};
    for (int i = 0; i < 4; i++) {
        uint64_t r = tokens + 16 * (uint64_t)(256 + i), l = strlen(strs[i]);
        w32(r, (uint32_t)bp); w32(r + 4, (uint32_t)bp); memcpy(sec + blob + bp, strs[i], l); bp += l;
        w16(r + 8, (uint16_t)l); w16(r + 10, (uint16_t)l); sec[r + 12] = i < 3 ? 1 : (2 | 4);
    }
    w32(added, ID_EOT);
    for (uint64_t s = 0; s < (1u << mlog2); s++) w64(merges + 16 * s, UINT64_MAX);
    const uint32_t m[3][3] = {{'h', 'e', ID_HE}, {'l', 'l', ID_LL}, {ID_HE, ID_LL, ID_HELL}};
    for (uint32_t k = 0; k < 3; k++) {
        uint64_t key = ((uint64_t)m[k][0] << 32) | m[k][1];
        uint64_t s = (key * 0x9E3779B97F4A7C15ull) >> (64 - mlog2);
        while (memcmp(sec + merges + 16 * s, "\xff\xff\xff\xff\xff\xff\xff\xff", 8) != 0) s = (s + 1) & ((1u << mlog2) - 1);
        w64(merges + 16 * s, key); w32(merges + 16 * s + 8, k); w32(merges + 16 * s + 12, m[k][2]);
    }
    w64(104, bp);
    sec_size = (blob + bp + 7) & ~(uint64_t)7;
}

#endif
