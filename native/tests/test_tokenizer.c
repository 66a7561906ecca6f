/*
 * test_tokenizer.c — the tokenizer on a small hand-made vocabulary, without Python:
 * known encodings (merge order, leftmost ties, byte fallback, U+FFFD for malformed bytes),
 * sentencepiece's decoding rules, argument and range errors, and robustness against
 * truncated and corrupted sections (every outcome must be a status, never a crash).
 * Parity with the real `sentencepiece` library on the Mixtral vocabulary is checked by
 * tests/test_tokenizer_spm.py. The section is built here as docs/format.md specifies.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"

static int g_fail = 0;
#define CHECK(cond)                                                           \
    do {                                                                      \
        if (!(cond)) {                                                        \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            g_fail++;                                                         \
        }                                                                     \
    } while (0)

/* ---- a tiny section writer (docs/format.md, "Tokenizer section encoding") ---- */

typedef struct {
    const char *s;
    float score;
    int type; /* 1 normal 2 unknown 3 control 4 user-defined 5 unused 6 byte */
} piece;

#define MAXP 300
#define MAXN 2048

static piece g_p[MAXP];
static char g_bytes[256][7];
static int g_np;

static void add(const char *s, float score, int type) {
    g_p[g_np].s = s;
    g_p[g_np].score = score;
    g_p[g_np].type = type;
    g_np++;
}

static void w32(uint8_t *b, uint64_t off, uint32_t v) { memcpy(b + off, &v, 4); }
static void w64(uint8_t *b, uint64_t off, uint64_t v) { memcpy(b + off, &v, 8); }
static uint64_t al8(uint64_t x) { return (x + 7) & ~(uint64_t)7; }

static uint32_t pack_char(const uint8_t *s, uint32_t n) {
    uint32_t v = 0;
    memcpy(&v, s, n);
    return v;
}
static uint32_t clen(uint8_t c) { return c < 0xC0 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4; }

/* Builds the section for g_p; returns malloc'd bytes. */
static uint8_t *build_section(uint64_t *size_out, int with_pairs) {
    /* trie with 256-way temporary nodes */
    static int32_t kid[MAXN][256];
    static int32_t nid[MAXN];
    int nn = 1;
    memset(kid, 0xFF, sizeof kid);
    memset(nid, 0xFF, sizeof nid);
    for (int i = 0; i < g_np; i++) {
        int nd = 0;
        for (const uint8_t *c = (const uint8_t *)g_p[i].s; *c; c++) {
            if (kid[nd][*c] < 0) kid[nd][*c] = nn++;
            nd = kid[nd][*c];
        }
        nid[nd] = i;
    }
    /* breadth-first renumbering */
    static int32_t order[MAXN], newix[MAXN];
    int head = 0, tail = 0;
    order[tail++] = 0;
    newix[0] = 0;
    while (head < tail) {
        int o = order[head++];
        for (int b = 0; b < 256; b++)
            if (kid[o][b] >= 0) {
                newix[kid[o][b]] = tail;
                order[tail++] = kid[o][b];
            }
    }
    uint32_t n_edges = (uint32_t)nn - 1;
    /* pair table */
    static uint64_t keys[4096];
    int nk = 0;
    for (int i = 0; i < g_np && with_pairs; i++) {
        if (g_p[i].type != 1 && g_p[i].type != 4 && g_p[i].type != 5) continue;
        const uint8_t *s = (const uint8_t *)g_p[i].s;
        size_t L = strlen(g_p[i].s), p = 0;
        int have = 0;
        uint32_t prev = 0;
        while (p < L) {
            uint32_t m = clen(s[p]);
            uint32_t c = pack_char(s + p, m);
            if (have) keys[nk++] = ((uint64_t)prev << 32) | c;
            prev = c;
            have = 1;
            p += m;
        }
    }
    uint32_t bits = 0;
    if (with_pairs) {
        bits = 1;
        while ((1u << bits) < 2u * (uint32_t)nk) bits++;
    }
    uint64_t blob_len = 0;
    for (int i = 0; i < g_np; i++) blob_len += strlen(g_p[i].s);
    const char *unk_surface = " \xE2\x81\x87 ";
    blob_len += strlen(unk_surface);

    uint64_t pieces_off = 128, byte_ids_off = al8(pieces_off + 12u * (uint64_t)g_np);
    uint64_t nodes_off = al8(byte_ids_off + 1024), children_off = al8(nodes_off + 12u * (uint64_t)nn);
    uint64_t labels_off = al8(children_off + 4u * n_edges), pairs_off = al8(labels_off + n_edges);
    uint64_t blob_off = al8(pairs_off + (bits ? 8u << bits : 0)), size = al8(blob_off + blob_len);
    uint8_t *b = (uint8_t *)calloc(1, size);
    if (!b) return NULL;
    memcpy(b, "CBTOKEN", 8);
    w32(b, 8, 1);
    w32(b, 12, 1);
    w32(b, 16, 128);
    w32(b, 20, (uint32_t)g_np);
    w32(b, 24, 1);
    w32(b, 28, 2);
    w32(b, 32, 0);
    w32(b, 36, UINT32_MAX); /* pad -1 */
    w32(b, 40, 0x1 | 0x4 | 0x8);
    w32(b, 44, (uint32_t)nn);
    w64(b, 48, pieces_off);
    w64(b, 56, byte_ids_off);
    w64(b, 64, nodes_off);
    w64(b, 72, children_off);
    w64(b, 80, labels_off);
    w64(b, 88, blob_off);
    w64(b, 96, blob_len);
    w32(b, 104, n_edges);
    w32(b, 108, bits);
    w64(b, 112, bits ? pairs_off : 0);
    uint64_t bo = 0;
    for (int i = 0; i < g_np; i++) {
        size_t L = strlen(g_p[i].s);
        uint8_t *r = b + pieces_off + 12u * (uint64_t)i;
        w32(r, 0, (uint32_t)bo);
        memcpy(r + 4, &g_p[i].score, 4);
        uint16_t l16 = (uint16_t)L;
        memcpy(r + 8, &l16, 2);
        r[10] = (uint8_t)g_p[i].type;
        memcpy(b + blob_off + bo, g_p[i].s, L);
        bo += L;
    }
    w32(b, 120, (uint32_t)bo);
    w32(b, 124, (uint32_t)strlen(unk_surface));
    memcpy(b + blob_off + bo, unk_surface, strlen(unk_surface));
    for (int v = 0; v < 256; v++) {
        int32_t id = 0;
        for (int i = 0; i < g_np; i++)
            if (strcmp(g_p[i].s, g_bytes[v]) == 0) id = i;
        memcpy(b + byte_ids_off + 4u * (uint64_t)v, &id, 4);
    }
    uint32_t e = 0;
    for (int k = 0; k < nn; k++) {
        int o = order[k];
        uint8_t *r = b + nodes_off + 12u * (uint64_t)k;
        uint32_t cnt = 0;
        w32(r, 0, e);
        for (int c = 0; c < 256; c++)
            if (kid[o][c] >= 0) {
                b[labels_off + e] = (uint8_t)c;
                w32(b, children_off + 4u * e, (uint32_t)newix[kid[o][c]]);
                e++;
                cnt++;
            }
        w32(r, 4, cnt);
        w32(r, 8, (uint32_t)nid[o]);
    }
    if (bits) {
        uint64_t mask = (1u << bits) - 1;
        for (uint64_t i = 0; i <= mask; i++) w64(b, pairs_off + 8 * i, UINT64_MAX);
        for (int k = 0; k < nk; k++) {
            uint64_t i = (keys[k] * 0x9E3779B97F4A7C15ull) >> (64 - bits);
            for (;;) {
                uint64_t cur;
                memcpy(&cur, b + pairs_off + 8 * i, 8);
                if (cur == keys[k]) break;
                if (cur == UINT64_MAX) {
                    w64(b, pairs_off + 8 * i, keys[k]);
                    break;
                }
                i = (i + 1) & mask;
            }
        }
    }
    *size_out = size;
    return b;
}

/* ---- helpers ---- */

#define SP "\xE2\x96\x81" /* U+2581 */
enum { ID_SP = 259, ID_A, ID_B, ID_C, ID_AB, ID_SPAB, ID_AA, ID_BC, ID_SPSP };

static void make_vocab(void) {
    g_np = 0;
    add("<unk>", 0, 2);
    add("<s>", 0, 3);
    add("</s>", 0, 3);
    for (int v = 0; v < 256; v++) {
        snprintf(g_bytes[v], sizeof g_bytes[v], "<0x%02X>", v);
        add(g_bytes[v], 0, 6);
    }
    add(SP, -10, 1);       /* 259 */
    add("a", -11, 1);      /* 260 */
    add("b", -12, 1);      /* 261 */
    add("c", -13, 1);      /* 262 */
    add("ab", -1, 1);      /* 263 */
    add(SP "ab", -2, 1);   /* 264 */
    add("aa", -3, 1);      /* 265 */
    add("bc", -0.5f, 1);   /* 266 */
    add(SP SP, -4, 1);     /* 267 */
}

static int64_t enc(colibri_tokenizer *t, const char *s, size_t n, int32_t *out, int64_t cap) {
    int64_t k = -1;
    colibri_status st = colibri_tokenize(t, s, n, 0, out, cap, &k);
    return st == COLIBRI_OK ? k : -1;
}

static int ids_eq(const int32_t *a, int64_t na, const int32_t *b, int64_t nb) {
    return na == nb && (na == 0 || memcmp(a, b, (size_t)na * 4) == 0);
}

#define ENC_EQ(tok, str, ...)                                                          \
    do {                                                                               \
        const int32_t want_[] = {__VA_ARGS__};                                         \
        int32_t got_[64];                                                              \
        int64_t n_ = enc(tok, str, sizeof(str) - 1, got_, 64);                         \
        CHECK(ids_eq(got_, n_, want_, (int64_t)(sizeof want_ / sizeof want_[0])));     \
    } while (0)

static int dec_eq(colibri_tokenizer *t, const int32_t *ids, int64_t n, const char *want) {
    char buf[256];
    uint64_t len = 0;
    if (colibri_detokenize(t, ids, n, buf, sizeof buf, &len) != COLIBRI_OK) return 0;
    return len == strlen(want) && memcmp(buf, want, len) == 0;
}

static void test_known(colibri_tokenizer *t) {
    CHECK(colibri_tokenizer_vocab_size(t) == 268);
    CHECK(colibri_tokenizer_bos_id(t) == 1 && colibri_tokenizer_eos_id(t) == 2);
    ENC_EQ(t, "ab", ID_SPAB);                 /* (a,b) first, then (▁,ab) */
    ENC_EQ(t, "abc", ID_SP, ID_A, ID_BC);     /* (b,c) scores higher than (a,b) */
    ENC_EQ(t, "aaa", ID_SP, ID_AA, ID_A);     /* equal scores: leftmost pair first */
    ENC_EQ(t, "x", ID_SP, 3 + 'x');           /* byte fallback */
    ENC_EQ(t, "\x80", ID_SP, 3 + 0xEF, 3 + 0xBF, 3 + 0xBD); /* malformed byte -> U+FFFD */
    ENC_EQ(t, "  ab", ID_SPSP, ID_SPAB);      /* spaces become ▁ */
    ENC_EQ(t, "ab ab", ID_SPAB, ID_SPAB);
    {
        int32_t out[4];
        int64_t n = -1;
        CHECK(colibri_tokenize(t, "ab", 2, 1, out, 4, &n) == COLIBRI_OK && n == 2 && out[0] == 1 && out[1] == ID_SPAB);
        CHECK(colibri_tokenize(t, "", 0, 0, out, 0, &n) == COLIBRI_OK && n == 0);
        CHECK(colibri_tokenize(t, "abc", 3, 0, out, 1, &n) == COLIBRI_E_BUFFER_TOO_SMALL && n == 3 && out[0] == ID_SP);
        CHECK(colibri_tokenize(t, NULL, 3, 0, out, 1, &n) == COLIBRI_E_INVALID_ARG);
        CHECK(colibri_tokenize(t, "a", 1, 0, out, -1, &n) == COLIBRI_E_INVALID_ARG);
        CHECK(strlen(colibri_tokenizer_last_error(t)) > 0);
    }
    {
        const int32_t a[] = {ID_SPAB, ID_SPAB};
        CHECK(dec_eq(t, a, 2, "ab ab"));
        const int32_t b[] = {1, ID_SP, ID_A}; /* control vanishes, first ▁ dropped */
        CHECK(dec_eq(t, b, 3, "a"));
        const int32_t c[] = {ID_SP, ID_SPAB}; /* only one leading ▁ is dropped */
        CHECK(dec_eq(t, c, 2, " ab"));
        const int32_t d[] = {0, ID_A};
        CHECK(dec_eq(t, d, 2, " \xE2\x81\x87 a"));
        const int32_t e[] = {3 + 0xE2, 3 + 0x96, 3 + 0x81, 3 + 0xE2, 3 + 0x96}; /* ▁ then 2 stray bytes */
        CHECK(dec_eq(t, e, 5, SP "\xEF\xBF\xBD\xEF\xBF\xBD"));
        const int32_t f[] = {3 + 0xC3, 1, 3 + 0xA9}; /* a control piece splits a byte run */
        CHECK(dec_eq(t, f, 3, "\xEF\xBF\xBD\xEF\xBF\xBD"));
        const int32_t g[] = {ID_A, 268};
        uint64_t len = 0;
        char buf[8];
        CHECK(colibri_detokenize(t, g, 2, buf, 8, &len) == COLIBRI_E_TOKEN_RANGE);
        CHECK(strstr(colibri_tokenizer_last_error(t), "268") != NULL);
        CHECK(colibri_detokenize(t, a, 2, buf, 2, &len) == COLIBRI_E_BUFFER_TOO_SMALL && len == 5);
        const char *p = NULL;
        uint64_t pl = 0;
        CHECK(colibri_token_piece(t, ID_SPAB, &p, &pl) == COLIBRI_OK && pl == 5 && memcmp(p, SP "ab", 5) == 0);
        CHECK(colibri_token_piece(t, -1, &p, &pl) == COLIBRI_E_TOKEN_RANGE);
    }
}

/* Every truncation and many corruptions: a status, and a loaded tokenizer still works. */
static void test_corruption(const uint8_t *sec, uint64_t size) {
    uint8_t *b = (uint8_t *)malloc(size);
    if (!b) { g_fail++; return; }
    char err[256];
    colibri_tokenizer *t = NULL;
    for (uint64_t cut = 0; cut < size; cut++) {
        memcpy(b, sec, cut);
        colibri_status st = colibri_tokenizer_from_memory(b, cut, &t, err, sizeof err);
        if (st == COLIBRI_OK) { /* only the final padding may be cut */
            CHECK(cut + 8 > size);
            colibri_tokenizer_free(t);
        } else {
            CHECK(t == NULL && err[0] != '\0');
        }
    }
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    int loaded = 0;
    for (int iter = 0; iter < 20000; iter++) {
        memcpy(b, sec, size);
        int flips = 1 + (int)(iter % 3);
        for (int f = 0; f < flips; f++) {
            rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
            uint64_t pos = (iter & 1) ? rng % 128 : (rng >> 8) % size;
            b[pos] ^= (uint8_t)(1u << ((rng >> 40) & 7));
        }
        if (colibri_tokenizer_from_memory(b, size, &t, err, sizeof err) != COLIBRI_OK) continue;
        loaded++;
        int32_t out[64];
        int64_t n;
        colibri_tokenize(t, "ab aab\x80 c  x\xE2\x96\x81", 15, 1, out, 64, &n);
        int32_t ids[300];
        for (int i = 0; i < 300; i++) ids[i] = i % 268;
        char buf[64];
        uint64_t len;
        colibri_detokenize(t, ids, 300, buf, sizeof buf, &len);
        colibri_tokenizer_free(t);
    }
    CHECK(loaded > 0);
    free(b);
}

int main(void) {
    make_vocab();
    for (int with_pairs = 0; with_pairs <= 1; with_pairs++) {
        uint64_t size = 0;
        uint8_t *sec = build_section(&size, with_pairs);
        if (!sec) { fprintf(stderr, "out of memory\n"); return 1; }
        char err[256] = {0};
        colibri_tokenizer *t = NULL;
        colibri_status st = colibri_tokenizer_from_memory(sec, size, &t, err, sizeof err);
        CHECK(st == COLIBRI_OK);
        if (st != COLIBRI_OK) {
            fprintf(stderr, "load: %s\n", err);
            free(sec);
            return 1;
        }
        test_known(t);
        colibri_tokenizer_free(t);
        test_corruption(sec, size);
        free(sec);
    }
    {
        colibri_tokenizer *t = (colibri_tokenizer *)1;
        char err[64];
        CHECK(colibri_tokenizer_from_memory(NULL, 0, &t, err, sizeof err) == COLIBRI_E_INVALID_ARG && t == NULL);
        colibri_tokenizer_free(NULL);
    }
    if (g_fail) {
        fprintf(stderr, "test_tokenizer: %d check(s) failed\n", g_fail);
        return 1;
    }
    printf("test_tokenizer: ok\n");
    return 0;
}
