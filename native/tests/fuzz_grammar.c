/*
 * fuzz_grammar.c — libFuzzer target over the JSON-schema grammar (native/src/grammar/): the
 * schema compiler (colibri_grammar_compile: its JSON parser, keyword checks, $ref resolution)
 * and the matcher (masks and token steps through colibri_sampler_*), for a small byte-level
 * BPE tokenizer built here (256 byte tokens, "he", "ll", "hell", the special <|eot|>).
 *
 * Input: the schema text up to the first NUL byte (no NUL: the whole input is the schema);
 * after it, byte 0 is a prefix length P (mod 8), then P bytes of literal prefix, then token
 * ids, one byte each (a byte token, or 256 + (b & 3) for b >= 0xFC), stepped at most 48 at
 * a time: each step computes the mask and accepts the token when the mask allows it.
 * Everything is copied to exact-size heap blocks, so ASan sees any read past them.
 *
 * Seeds: native/tests/fuzz_corpus/grammar/; crash inputs found: …/grammar/regressions/.
 * Build and run: tools/fuzz.sh grammar.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"

static int failures = 0;
#define CHECK(c) \
    do {         \
        if (!(c)) failures++; \
    } while (0)

#define NT 260
enum { ID_HE = 256, ID_LL = 257, ID_HELL = 258, ID_EOT = 259 };

static uint8_t sec[64 * 1024];
static uint64_t sec_size;

static void w32(uint64_t o, uint32_t v) { memcpy(sec + o, &v, 4); }
static void w64(uint64_t o, uint64_t v) { memcpy(sec + o, &v, 8); }
static void w16(uint64_t o, uint16_t v) { memcpy(sec + o, &v, 2); }

static uint32_t enc_utf8(uint32_t cp, uint8_t *o) {
    if (cp < 0x80) { o[0] = (uint8_t)cp; return 1; }
    o[0] = (uint8_t)(0xC0 | (cp >> 6));
    o[1] = (uint8_t)(0x80 | (cp & 0x3F));
    return 2;
}

/* GPT-2's byte -> character map. */
static uint32_t byte_char(int b) {
    if ((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF)) return (uint32_t)b;
    int n = 0;
    for (int k = 0; k < b; k++)
        if (!((k >= '!' && k <= '~') || (k >= 0xA1 && k <= 0xAC) || (k >= 0xAE && k <= 0xFF))) n++;
    return 256u + (uint32_t)n;
}

static void build(void) {
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



static colibri_tokenizer *tok;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!tok) {
        build();
        char err[256];
        if (colibri_tokenizer_from_memory(sec, sec_size, &tok, err, sizeof err) != COLIBRI_OK) abort();
    }
    const uint8_t *nul = memchr(data, 0, size);
    size_t sl = nul ? (size_t)(nul - data) : size;
    char *schema = malloc(sl + 1);
    if (!schema) return 0;
    memcpy(schema, data, sl);
    schema[sl] = 0;
    const uint8_t *rest = nul ? nul + 1 : data + size;
    size_t rl = (size_t)(data + size - rest);
    size_t pl = rl ? (size_t)(rest[0] % 8) : 0;
    if (pl + 1 > rl) pl = rl ? rl - 1 : 0;
    char *prefix = malloc(pl + 1);
    if (!prefix) {
        free(schema);
        return 0;
    }
    if (pl) memcpy(prefix, rest + 1, pl);
    prefix[pl] = 0;
    const uint8_t *ids = rl ? rest + 1 + pl : rest;
    size_t n_ids = rl ? rl - 1 - pl : 0;

    colibri_grammar *g = NULL;
    char err[512];
    colibri_status st = colibri_grammar_compile(tok, *schema == '~' ? NULL : schema, prefix, "\n", &g, err, sizeof err);
    CHECK((st == COLIBRI_OK) == (g != NULL));
    if (g) {
        colibri_sampling_params p;
        colibri_sampling_params_init(&p);
        p.temperature = 0.0f;
        colibri_sampler *s = NULL;
        if (colibri_sampler_create(NT, ID_EOT, &p, &s, err, sizeof err) == COLIBRI_OK &&
            colibri_sampler_set_grammar(s, g) == COLIBRI_OK) {
            uint8_t mask[NT];
            for (size_t i = 0; i < n_ids && i < 48; i++) {
                int32_t id = ids[i] >= 0xFC ? 256 + (ids[i] & 3) : ids[i];
                CHECK(colibri_sampler_grammar_mask(s, mask) == COLIBRI_OK);
                colibri_status a = colibri_sampler_accept(s, id);
                /* a token the mask allows is accepted; an end token may also end a complete grammar */
                if (mask[id] && id != ID_EOT) CHECK(a == COLIBRI_OK);
                if (!mask[id] && id != ID_EOT && a == COLIBRI_OK) failures++;
                /* no dead end: an incomplete grammar always has a token to go on with */
                if (a == COLIBRI_OK && !colibri_sampler_grammar_complete(s)) {
                    CHECK(colibri_sampler_grammar_mask(s, mask) == COLIBRI_OK);
                    int any = 0;
                    for (int t = 0; t < NT && !any; t++) any = mask[t];
                    CHECK(any);
                }
            }
            float logits[NT];
            for (int i = 0; i < NT; i++) logits[i] = (float)((i * 37) % 11);
            uint64_t rng = 1;
            int32_t out = 0;
            colibri_sampler_sample(s, logits, &rng, &out);
        }
        colibri_sampler_free(s);
    }
    colibri_grammar_free(g);
    free(schema);
    free(prefix);
    if (failures) abort(); /* the mask and accept disagree: a finding */
    return 0;
}
