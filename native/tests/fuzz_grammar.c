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

#include "bpe_section.h"
#include "colibri.h"

static int failures = 0;
#define CHECK(c) \
    do {         \
        if (!(c)) failures++; \
    } while (0)

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
