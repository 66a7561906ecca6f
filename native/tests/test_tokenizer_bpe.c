/*
 * test_tokenizer_bpe.c — the byte-level BPE tokenizer (tokenizer section type 2) on a small
 * section built here: 256 byte tokens, three merges, one special added token. Checks merge
 * order, added-token splitting, the GPT-2 split pattern, malformed UTF-8, decode, add_bos
 * without BOS, the tekken layout (pattern 4, special tokens that are not added, decode runs
 * split at special tokens), and that corrupt sections are refused. (Parity with Hugging Face
 * `tokenizers` on real text is tests/test_tokenizer_bpe.py.)
 */
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

static int64_t enc(colibri_tokenizer *t, const char *s, int add_bos, int32_t *out) {
    int64_t n = -1;
    if (colibri_tokenize(t, s, strlen(s), add_bos, out, 64, &n) != COLIBRI_OK) return -1;
    return n;
}

int main(void) {
    build();
    colibri_tokenizer *t = NULL;
    char err[256];
    colibri_status st = colibri_tokenizer_from_memory(sec, sec_size, &t, err, sizeof err);
    if (st != COLIBRI_OK) fprintf(stderr, "load: %s\n", err);
    CHECK(st == COLIBRI_OK && t != NULL);
    if (t == NULL) return 1;
    CHECK(colibri_tokenizer_vocab_size(t) == NT && colibri_tokenizer_bos_id(t) == -1 && colibri_tokenizer_eos_id(t) == ID_EOT);
    int32_t out[64];
    CHECK(enc(t, "hello", 0, out) == 2 && out[0] == ID_HELL && out[1] == 'o');
    CHECK(enc(t, "hello", 1, out) == 2 && out[0] == ID_HELL); /* add_bos without BOS: no-op */
    CHECK(enc(t, "", 1, out) == 0);
    /* " hello": the GPT-2 pattern keeps the space with the word; (h,e) cannot merge across it */
    CHECK(enc(t, "x hello<|eot|>he", 0, out) == 6 && out[0] == 'x' && out[1] == ' ' &&
          out[2] == ID_HELL && out[3] == 'o' && out[4] == ID_EOT && out[5] == ID_HE);
    CHECK(enc(t, "\xff", 0, out) == 3 && out[0] == 0xEF && out[1] == 0xBF && out[2] == 0xBD); /* U+FFFD */
    {
        const int32_t ids[] = {ID_HELL, 'o', ID_EOT, 0xE2, 0x82, ' '};
        char buf[64];
        uint64_t len = 0;
        CHECK(colibri_detokenize(t, ids, 6, buf, sizeof buf, &len) == COLIBRI_OK);
        CHECK(len == 9 && memcmp(buf, "hello\xEF\xBF\xBD ", 9) == 0); /* special skipped, E2 82 -> one U+FFFD */
        const int32_t bad[] = {NT};
        CHECK(colibri_detokenize(t, bad, 1, buf, sizeof buf, &len) == COLIBRI_E_TOKEN_RANGE);
        const char *p;
        uint64_t pl;
        CHECK(colibri_token_piece(t, ' ', &p, &pl) == COLIBRI_OK && pl == 2 && memcmp(p, "\xC4\xA0", 2) == 0); /* Ġ */
    }
    colibri_tokenizer_free(t);

    {
        /* Tekken layout: pattern 4, header flag bit 2, <|eot|> special but not added (never
         * matched in the text; ends the UTF-8 run before it when decoding). */
        build();
        w32(40, 4); w32(44, 4); w32(84, 0);
        sec[128 + 16 * ID_EOT + 12] = 4;
        t = NULL;
        st = colibri_tokenizer_from_memory(sec, sec_size, &t, err, sizeof err);
        if (st != COLIBRI_OK) fprintf(stderr, "load (tekken): %s\n", err);
        CHECK(st == COLIBRI_OK && t != NULL);
        if (t) {
            /* pre-tokens "x" "<|" "eot" "|>" "he" */
            CHECK(enc(t, "x<|eot|>he", 0, out) == 9 && out[0] == 'x' && out[1] == '<' && out[7] == '>' && out[8] == ID_HE);
            /* "xhello" is one pre-token ([\p{Ll}...]+); "/\n" one ([^\s\p{L}\p{N}]+[\r\n/]*) */
            CHECK(enc(t, "xhello/\n", 0, out) == 5 && out[0] == 'x' && out[1] == ID_HELL && out[2] == 'o' &&
                  out[3] == '/' && out[4] == '\n');
            const int32_t ids[] = {0xE2, ID_EOT, 0x82, 0xAC};
            char buf[64];
            uint64_t len = 0;
            CHECK(colibri_detokenize(t, ids, 4, buf, sizeof buf, &len) == COLIBRI_OK);
            CHECK(len == 9 && memcmp(buf, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD", 9) == 0);
            colibri_tokenizer_free(t);
        }
    }

    /* Corruptions are refused. */
    static const uint64_t offs[] = {20, 40, 44, 48, 52, 56, 64, 84, 88, 104, 112, 120};
    for (size_t k = 0; k < sizeof offs / sizeof offs[0]; k++) {
        build();
        sec[offs[k]] ^= 0x40;
        t = NULL;
        CHECK(colibri_tokenizer_from_memory(sec, sec_size, &t, err, sizeof err) != COLIBRI_OK && t == NULL);
    }
    build();
    sec[128 + 16 * ID_HELL + 12] = 0x10; /* unknown token flag */
    CHECK(colibri_tokenizer_from_memory(sec, sec_size, &t, err, sizeof err) == COLIBRI_E_FORMAT);
    build();
    w32(128 + 16 * 'h' + 4, 0); /* byte table entry whose token is not that byte */
    CHECK(colibri_tokenizer_from_memory(sec, sec_size, &t, err, sizeof err) == COLIBRI_E_FORMAT);
    {
        /* Regression (fuzzing): a vocabulary hash whose slot 0 holds a valid token 'a' whose
         * home slot h > 0 holds an out-of-range id. Checking slot 0 probed from h and read the
         * record of id 0x7FFFFFF0, far outside the section (a crash at load). Now refused. */
        build();
        const uint32_t vlog2 = 9, G = 0x7FFFFFF0u;
        const uint64_t vh = (sec_size + 7) & ~(uint64_t)7;
        uint64_t h = 0xcbf29ce484222325ull;
        h = (h ^ (uint8_t)'a') * 0x100000001b3ull;
        h = (h * 0x9E3779B97F4A7C15ull) >> (64 - vlog2);
        CHECK(h > 0);
        for (uint64_t k = 0; k < (1u << vlog2); k++) w32(vh + 4 * k, k >= h ? G : UINT32_MAX);
        w32(vh, 'a');
        w64(72, vh); w32(80, vlog2);
        sec_size = vh + 4 * (1u << vlog2);
        t = NULL;
        CHECK(colibri_tokenizer_from_memory(sec, sec_size, &t, err, sizeof err) == COLIBRI_E_FORMAT && t == NULL);
    }
    {
        /* Regression (fuzzing): an added token that is not whole UTF-8 characters ("\xC3")
         * split "\xC3\xA9" inside the character, and the pre-tokenizer decoded the lone
         * continuation byte 0xA9 as a 2-byte character, reading one byte past the caller's
         * text (ASan: heap-buffer-overflow). Such a section is now refused. */
        build();
        uint64_t r = 128 + 16 * (uint64_t)ID_EOT, blob = 0;
        memcpy(&blob, sec + 96, 8);
        uint32_t po = 0;
        memcpy(&po, sec + r, 4);
        sec[blob + po] = 0xC3;
        w16(r + 8, 1);
        t = NULL;
        st = colibri_tokenizer_from_memory(sec, sec_size, &t, err, sizeof err);
        CHECK(st == COLIBRI_E_FORMAT && t == NULL && strstr(err, "UTF-8") != NULL);
        if (t) { /* (without the fix) show the over-read under ASan */
            char *txt = malloc(2);
            if (txt) {
                int64_t n = 0;
                memcpy(txt, "\xC3\xA9", 2);
                (void)colibri_tokenize(t, txt, 2, 0, out, 64, &n);
                free(txt);
            }
            colibri_tokenizer_free(t);
        }
    }
    for (uint64_t cut = 0; cut < sec_size; cut += 97) {
        build();
        t = NULL;
        CHECK(colibri_tokenizer_from_memory(sec, cut, &t, err, sizeof err) != COLIBRI_OK);
    }
    if (failures) fprintf(stderr, "%d failures\n", failures);
    else printf("test_tokenizer_bpe: ok\n");
    return failures ? 1 : 0;
}
