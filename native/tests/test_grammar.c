/*
 * test_grammar.c — the JSON-schema grammar (colibri_grammar_compile) and the per-sequence
 * sampler (colibri_sampler_*) on a small byte-level BPE section built here (256 byte tokens,
 * "he", "ll", "hell" and the special <|eot|>, also EOS): masks at odd points (mid-string,
 * mid-UTF-8, escapes, integer bounds, closed objects, $ref recursion, anyOf), special-token
 * literals, forced EOS, refusals by keyword name, malformed schemas, and the sampler's bias,
 * penalties and seeded repeatability. (A random model under many schemas is tests/test_grammar.py.)
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bpe_section.h"
#include "colibri.h"

static int failures = 0;
#define CHECK(c)                                                           \
    do {                                                                   \
        if (!(c)) {                                                        \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #c); \
            failures++;                                                    \
        }                                                                  \
    } while (0)

static colibri_tokenizer *tok;

/* Feed text byte tokens (and "he"/"ll"/"hell" are not used) into a sampler; returns 0 if all accepted. */
static int feed(colibri_sampler *s, const char *text) {
    for (const unsigned char *p = (const unsigned char *)text; *p; p++)
        if (colibri_sampler_accept(s, *p) != COLIBRI_OK) return -1;
    return 0;
}

static colibri_sampler *make(const char *schema, const char *prefix, const char *suffix, colibri_grammar **g) {
    char err[512] = "";
    colibri_status st = colibri_grammar_compile(tok, schema, prefix, suffix, g, err, sizeof err);
    if (st != COLIBRI_OK) {
        fprintf(stderr, "compile %s: %s\n", schema ? schema : "(any)", err);
        return NULL;
    }
    colibri_sampling_params p;
    colibri_sampling_params_init(&p);
    p.temperature = 0.0f;
    colibri_sampler *s = NULL;
    if (colibri_sampler_create(NT, ID_EOT, &p, &s, err, sizeof err) != COLIBRI_OK) return NULL;
    if (colibri_sampler_set_grammar(s, *g) != COLIBRI_OK) return NULL;
    return s;
}

/* does text parse completely under the schema (then the grammar is complete)? */
static int full(const char *schema, const char *text) {
    colibri_grammar *g = NULL;
    colibri_sampler *s = make(schema, NULL, NULL, &g);
    int ok = s && feed(s, text) == 0 && colibri_sampler_grammar_complete(s);
    colibri_sampler_free(s);
    colibri_grammar_free(g);
    return ok;
}

/* is text a viable prefix under the schema? */
static int prefix_ok(const char *schema, const char *text) {
    colibri_grammar *g = NULL;
    colibri_sampler *s = make(schema, NULL, NULL, &g);
    int ok = s && feed(s, text) == 0;
    colibri_sampler_free(s);
    colibri_grammar_free(g);
    return ok;
}

static colibri_status compile_status(const char *schema, char *err, size_t n) {
    colibri_grammar *g = NULL;
    colibri_status st = colibri_grammar_compile(tok, schema, NULL, NULL, &g, err, n);
    colibri_grammar_free(g);
    return st;
}

int main(void) {
    build();
    char err[512];
    colibri_status st = colibri_tokenizer_from_memory(sec, sec_size, &tok, err, sizeof err);
    CHECK(st == COLIBRI_OK);
    if (st != COLIBRI_OK) return 1;

    /* any object */
    CHECK(full(NULL, "{}"));
    CHECK(full(NULL, "{\"a\":[1,2.5,-3,true,null,\"x\"],\"b\":{\"c\":{}}}"));
    CHECK(!prefix_ok(NULL, "[")); /* an object, not an array */
    CHECK(!prefix_ok(NULL, "{ ")); /* no whitespace */
    CHECK(!prefix_ok(NULL, "{\"a\":01"));
    CHECK(!full(NULL, "{\"a\":1"));

    /* strings: escapes, UTF-8, lengths in characters */
    const char *s25 = "{\"type\":\"string\",\"minLength\":2,\"maxLength\":5}";
    CHECK(full(s25, "\"ab\""));
    CHECK(full(s25, "\"\\u00e9\\n\xc3\xa9\xf0\x9f\x98\x80\"")); /* 4 characters */
    CHECK(!prefix_ok(s25, "\"abcdef"));
    CHECK(!prefix_ok(s25, "\"a\"")); /* too short to close */
    CHECK(!prefix_ok(s25, "\"\xc3\x28")); /* bad continuation byte */
    CHECK(!prefix_ok(s25, "\"\xed\xa0\x80")); /* an encoded surrogate */
    CHECK(!prefix_ok(s25, "\"\\ud800")); /* an escaped lone surrogate */
    CHECK(!prefix_ok(s25, "\"a\x01")); /* a raw control character */
    CHECK(!prefix_ok(s25, "\"\\x"));

    /* integers: bounds exact */
    const char *ib = "{\"type\":\"integer\",\"minimum\":-5,\"exclusiveMaximum\":120}";
    CHECK(full(ib, "-5") && full(ib, "0") && full(ib, "119") && full(ib, "7"));
    CHECK(!prefix_ok(ib, "-6") && !prefix_ok(ib, "120") && !prefix_ok(ib, "1190") && !prefix_ok(ib, "-0"  "1"));
    CHECK(!prefix_ok(ib, "1.5") && !prefix_ok(ib, "00"));
    const char *big = "{\"type\":\"integer\",\"minimum\":1000}";
    CHECK(!prefix_ok(big, "-") && !prefix_ok(big, "0") && full(big, "1000") && !full(big, "999"));
    const char *nonneg = "{\"type\":\"integer\",\"minimum\":0}"; /* "-" would lead to a dead end ("-0" is not generated) */
    CHECK(!prefix_ok(nonneg, "-") && full(nonneg, "0") && !prefix_ok(nonneg, "01"));
    /* numbers */
    const char *nb = "{\"type\":\"number\",\"exclusiveMinimum\":0.5,\"maximum\":2}";
    CHECK(full(nb, "0.75") && full(nb, "2") && full(nb, "1.999999") && !full(nb, "0.5"));
    CHECK(!prefix_ok(nb, "3") && !prefix_ok(nb, "2.1") && !prefix_ok(nb, "-"));

    /* closed objects: order, optional, required */
    const char *ob = "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"boolean\"},"
                     "\"c\":{\"enum\":[\"x\",\"y\",1,12]}},\"required\":[\"b\"]}";
    CHECK(full(ob, "{\"b\":true}") && full(ob, "{\"a\":1,\"b\":false,\"c\":12}") && full(ob, "{\"b\":true,\"c\":1}"));
    CHECK(!prefix_ok(ob, "{\"c\"") && !prefix_ok(ob, "{\"d\"") && !full(ob, "{}") && !full(ob, "{\"a\":1}"));
    CHECK(!prefix_ok(ob, "{\"b\":true,\"a\"")); /* schema order */
    CHECK(!prefix_ok(ob, "{\"b\":true,\"c\":2"));

    /* arrays */
    const char *ab = "{\"type\":\"array\",\"items\":{\"type\":\"null\"},\"minItems\":1,\"maxItems\":2}";
    CHECK(full(ab, "[null]") && full(ab, "[null,null]") && !full(ab, "[]") && !prefix_ok(ab, "[null,null,"));

    /* $ref recursion and anyOf */
    const char *tree = "{\"$defs\":{\"n\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},"
                       "\"kids\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/n\"}}},\"required\":[\"v\"]}},"
                       "\"$ref\":\"#/$defs/n\"}";
    CHECK(full(tree, "{\"v\":1,\"kids\":[{\"v\":2},{\"v\":3,\"kids\":[]}]}"));
    const char *any = "{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"object\",\"properties\":{\"k\":{\"const\":5}},"
                      "\"required\":[\"k\"]},{\"type\":\"object\",\"properties\":{\"k\":{\"const\":\"s\"}},\"required\":[\"k\"]}]}";
    CHECK(full(any, "\"q\"") && full(any, "{\"k\":5}") && full(any, "{\"k\":\"s\"}") && !prefix_ok(any, "{\"k\":6"));
    const char *cyc = "{\"$defs\":{\"a\":{\"$ref\":\"#/$defs/a\"}},\"$ref\":\"#/$defs/a\"}";
    CHECK(compile_status(cyc, err, sizeof err) == COLIBRI_OK && !prefix_ok(cyc, "{")); /* no value: nothing */

    /* refusals by name; malformed schemas */
    CHECK(compile_status("{\"type\":\"string\",\"pattern\":\"a+\"}", err, sizeof err) == COLIBRI_E_UNSUPPORTED &&
          strstr(err, "unsupported schema keyword: pattern") != NULL);
    CHECK(compile_status("{\"patternProperties\":{}}", err, sizeof err) == COLIBRI_E_UNSUPPORTED &&
          strstr(err, "patternProperties") != NULL);
    CHECK(compile_status("{\"$ref\":\"http://x/y\"}", err, sizeof err) == COLIBRI_E_UNSUPPORTED);
    CHECK(compile_status("{\"type\":", err, sizeof err) == COLIBRI_E_INVALID_ARG);
    CHECK(compile_status("{\"type\":\"strin\"}", err, sizeof err) == COLIBRI_E_INVALID_ARG);
    CHECK(compile_status("{\"type\":\"integer\",\"minimum\":3,\"maximum\":2}", err, sizeof err) == COLIBRI_E_INVALID_ARG);
    CHECK(compile_status("[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[", err,
                         sizeof err) == COLIBRI_E_INVALID_ARG);
    CHECK(compile_status("{\"required\":[\"x\"]}", err, sizeof err) == COLIBRI_E_UNSUPPORTED);

    /* masks: a token may span grammar steps ("hell" inside a string), specials only in literals,
     * EOS only (forced) once complete */
    {
        colibri_grammar *g = NULL;
        colibri_sampler *s = make("{\"type\":\"string\",\"maxLength\":4}", "<|eot|>x", "\n", &g);
        uint8_t mask[NT];
        CHECK(s != NULL);
        if (s) {
            CHECK(colibri_sampler_grammar_mask(s, mask) == COLIBRI_OK);
            int n = 0;
            for (int i = 0; i < NT; i++) n += mask[i];
            CHECK(n == 2 && mask[ID_EOT] && mask['<']); /* the special token by its text, or the text in bytes */
            CHECK(colibri_sampler_accept(s, ID_EOT) == COLIBRI_OK && feed(s, "x\"") == 0);
            colibri_sampler_grammar_mask(s, mask);
            CHECK(mask[ID_HELL] && mask[ID_HE] && mask['"'] && !mask[ID_EOT] && !mask['\n'] && !mask[0x80]);
            CHECK(colibri_sampler_accept(s, ID_HELL) == COLIBRI_OK);
            colibri_sampler_grammar_mask(s, mask);
            CHECK(mask['"'] && !mask['a'] && !mask[ID_HE]); /* 4 characters: only the close */
            CHECK(feed(s, "\"") == 0 && !colibri_sampler_grammar_complete(s) && feed(s, "\n") == 0);
            CHECK(colibri_sampler_grammar_complete(s));
            float logits[NT];
            for (int i = 0; i < NT; i++) logits[i] = (float)i * 0.01f;
            logits[ID_EOT] = -50.0f;
            uint64_t rng = 1;
            int32_t id = -1;
            CHECK(colibri_sampler_sample(s, logits, &rng, &id) == COLIBRI_OK && id == ID_EOT);
            CHECK(colibri_sampler_finished(s) == COLIBRI_FINISH_EOS);
        }
        colibri_sampler_free(s);
        colibri_grammar_free(g);
    }

    /* an end id may end a complete grammar as EOS does (masked before it is one) */
    {
        colibri_grammar *g = NULL;
        colibri_sampler *s = make("{\"type\":\"string\",\"maxLength\":4}", NULL, NULL, &g);
        CHECK(s != NULL);
        if (s) {
            CHECK(feed(s, "\"ab\"") == 0 && colibri_sampler_grammar_complete(s));
            uint8_t mask[NT];
            CHECK(colibri_sampler_grammar_mask(s, mask) == COLIBRI_OK && !mask[ID_HE]);
            float logits[NT];
            for (int i = 0; i < NT; i++) logits[i] = (float)i * 0.01f;
            logits[ID_EOT] = -50.0f;
            logits[ID_HE] = 50.0f;
            int32_t end = ID_HE;
            CHECK(colibri_sampler_set_end_ids(s, &end, 1) == COLIBRI_OK);
            uint64_t rng = 1;
            int32_t id = -1;
            CHECK(colibri_sampler_sample(s, logits, &rng, &id) == COLIBRI_OK && id == ID_HE);
            CHECK(colibri_sampler_finished(s) == COLIBRI_FINISH_EOS);
        }
        colibri_sampler_free(s);
        colibri_grammar_free(g);
    }

    /* the sampler without a grammar: bias, penalties, min-p, stop ids, seeded repeatability */
    {
        colibri_sampling_params p;
        colibri_sampling_params_init(&p);
        p.temperature = 0.0f;
        colibri_sampler *s = NULL;
        CHECK(colibri_sampler_create(NT, ID_EOT, &p, &s, err, sizeof err) == COLIBRI_OK);
        float logits[NT];
        for (int i = 0; i < NT; i++) logits[i] = 0.0f;
        logits[7] = 5.0f;
        uint64_t rng = 3;
        int32_t id = -1;
        CHECK(colibri_sampler_sample(s, logits, &rng, &id) == COLIBRI_OK && id == 7);
        int32_t bid[2] = {7, 9};
        float bv[2] = {-100.0f, 100.0f};
        CHECK(colibri_sampler_set_logit_bias(s, bid, bv, 2) == COLIBRI_OK);
        CHECK(colibri_sampler_sample(s, logits, &rng, &id) == COLIBRI_OK && id == 9);
        int32_t bad = NT;
        CHECK(colibri_sampler_set_logit_bias(s, &bad, bv, 1) == COLIBRI_E_TOKEN_RANGE);
        CHECK(colibri_sampler_set_stop_ids(s, bid + 1, 1) == COLIBRI_OK);
        CHECK(colibri_sampler_sample(s, logits, &rng, &id) == COLIBRI_OK && colibri_sampler_finished(s) == COLIBRI_FINISH_STOP_ID);
        colibri_sampler_free(s);

        /* end ids: EOS's finish; replaced, not added; EOS stays one; a stop id wins; ignore_eos */
        CHECK(colibri_sampler_create(NT, ID_EOT, &p, &s, err, sizeof err) == COLIBRI_OK);
        int32_t ends[2] = {7, 8};
        CHECK(colibri_sampler_set_end_ids(s, ends, 2) == COLIBRI_OK);
        CHECK(colibri_sampler_sample(s, logits, &rng, &id) == COLIBRI_OK && id == 7 &&
              colibri_sampler_finished(s) == COLIBRI_FINISH_EOS);
        CHECK(colibri_sampler_set_end_ids(s, ends + 1, 1) == COLIBRI_OK);
        CHECK(colibri_sampler_accept(s, 7) == COLIBRI_OK && colibri_sampler_finished(s) == COLIBRI_FINISH_NONE);
        CHECK(colibri_sampler_accept(s, 8) == COLIBRI_OK && colibri_sampler_finished(s) == COLIBRI_FINISH_EOS);
        CHECK(colibri_sampler_accept(s, ID_EOT) == COLIBRI_OK && colibri_sampler_finished(s) == COLIBRI_FINISH_EOS);
        CHECK(colibri_sampler_set_stop_ids(s, ends + 1, 1) == COLIBRI_OK);
        CHECK(colibri_sampler_accept(s, 8) == COLIBRI_OK && colibri_sampler_finished(s) == COLIBRI_FINISH_STOP_ID);
        CHECK(colibri_sampler_set_stop_ids(s, NULL, 0) == COLIBRI_OK);
        CHECK(colibri_sampler_accept(s, 8) == COLIBRI_OK && colibri_sampler_finished(s) == COLIBRI_FINISH_EOS);
        int32_t far = NT;
        CHECK(colibri_sampler_set_end_ids(s, &far, 1) == COLIBRI_E_TOKEN_RANGE);
        colibri_sampler_free(s);
        p.ignore_eos = 1;
        CHECK(colibri_sampler_create(NT, ID_EOT, &p, &s, err, sizeof err) == COLIBRI_OK);
        CHECK(colibri_sampler_set_end_ids(s, ends, 2) == COLIBRI_OK);
        CHECK(colibri_sampler_accept(s, 7) == COLIBRI_OK && colibri_sampler_finished(s) == COLIBRI_FINISH_NONE);
        colibri_sampler_free(s);
        p.ignore_eos = 0;

        /* presence penalty: after 7 is generated, 8 (4.5) wins over 7 (5 - 1) */
        p.presence_penalty = 1.0f;
        CHECK(colibri_sampler_create(NT, ID_EOT, &p, &s, err, sizeof err) == COLIBRI_OK);
        logits[8] = 4.5f;
        CHECK(colibri_sampler_sample(s, logits, &rng, &id) == COLIBRI_OK && id == 7);
        CHECK(colibri_sampler_sample(s, logits, &rng, &id) == COLIBRI_OK && id == 8);
        colibri_sampler_free(s);
        /* repetition penalty over the prompt: 7 in the prompt -> 5 / 2 < 4.5 */
        p.presence_penalty = 0.0f;
        p.repetition_penalty = 2.0f;
        CHECK(colibri_sampler_create(NT, ID_EOT, &p, &s, err, sizeof err) == COLIBRI_OK);
        CHECK(colibri_sampler_add_prompt(s, bid, 1) == COLIBRI_OK);
        CHECK(colibri_sampler_sample(s, logits, &rng, &id) == COLIBRI_OK && id == 8);
        colibri_sampler_free(s);
        /* bad params */
        p.repetition_penalty = 0.0f;
        CHECK(colibri_sampler_create(NT, ID_EOT, &p, &s, err, sizeof err) == COLIBRI_E_INVALID_ARG && s == NULL &&
              strstr(err, "repetition_penalty") != NULL);
        p.repetition_penalty = 1.0f;
        p.min_p = 2.0f;
        CHECK(colibri_sampler_create(NT, ID_EOT, &p, &s, err, sizeof err) == COLIBRI_E_INVALID_ARG);
        /* min-p 0.5: only the tokens within half of the best's probability can come out */
        p.min_p = 0.5f;
        p.temperature = 1.0f;
        CHECK(colibri_sampler_create(NT, ID_EOT, &p, &s, err, sizeof err) == COLIBRI_OK);
        for (int i = 0; i < NT; i++) logits[i] = 0.0f;
        logits[1] = 3.0f;
        logits[2] = 3.0f - 0.5f; /* p2/p1 = 0.61 */
        logits[3] = 3.0f - 1.0f; /* 0.37: cut */
        int seen[4] = {0, 0, 0, 0}, other = 0;
        rng = 11;
        for (int k = 0; k < 400; k++) {
            CHECK(colibri_sampler_sample(s, logits, &rng, &id) == COLIBRI_OK);
            if (id >= 1 && id <= 3) seen[id]++;
            else other++;
        }
        CHECK(seen[1] > 0 && seen[2] > 0 && seen[3] == 0 && other == 0);
        colibri_sampler_free(s);
    }
    colibri_tokenizer_free(tok);
    if (failures) fprintf(stderr, "%d check(s) failed\n", failures);
    return failures ? 1 : 0;
}
