/*
 * tokenizer.c — SentencePiece-BPE tokenizer read in place from a tokenizer section
 * (docs/format.md, "Tokenizer section encoding"), and the public tokenizer API, which
 * dispatches sections of type 2 (byte-level BPE) to bpe.c. For both types
 * colibri_tokenize(add_bos = 1) on a tokenizer without BOS adds nothing.
 *
 * What it reproduces, byte for byte, is `sentencepiece`'s SentencePieceProcessor for a BPE
 * model whose normalizer has no character map (the Llama / Mistral / Mixtral models):
 *   encode  = Normalizer::Normalize (user-defined symbols kept whole, malformed UTF-8 bytes
 *             replaced one by one by U+FFFD, optional extra-whitespace removal, ' ' -> U+2581,
 *             dummy prefix U+2581), then bpe::Model::Encode (characters, then the best
 *             adjacent pair that is a vocabulary piece is merged: highest score first, the
 *             leftmost on ties; unused pieces re-split as they were merged), then
 *             PopulateSentencePieceText (an unknown piece becomes its bytes' <0xXX> pieces with
 *             byte fallback; without it runs of unknown pieces collapse to one unk id);
 *   decode  = SentencePieceProcessor::Decode (control pieces vanish, the unknown piece becomes
 *             the unk surface " \u2047 ", the first U+2581 of the text is dropped, U+2581 -> ' ',
 *             runs of byte pieces are joined and each malformed byte becomes U+FFFD).
 *
 * Speed without changing the result: the text is cut where two neighbouring characters
 * never occur next to each other inside a mergeable piece (the section's pair table), since
 * no merge can cross such a boundary; each segment (for Mistral: each word) is merged with
 * its own small heap, and pair lookups are memoised per call by (left node, right node).
 *
 * The vocabulary is never copied: piece records, strings and the trie are read from the
 * section through bounds-checked, alignment-free little-endian loads. Every count and offset
 * of the section is validated once in cb_tokenizer_load, so the hot paths only index arrays
 * whose extents were proven. Encode allocates scratch (freed before returning) and reports
 * COLIBRI_E_NOMEM if it cannot; nothing here prints, exits or aborts.
 */
#include "tokenizer/bpe.h"
#include "tokenizer/tokenizer.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <pthread.h>
#include <string.h>

/* ---- section constants (docs/format.md) ---- */
#define TOK_MAGIC "CBTOKEN"           /* 8 bytes with the NUL */
#define TOK_VERSION 1u
#define TOK_TYPE_SENTENCEPIECE_BPE 1u
#define TOK_HEADER_SIZE 128u
#define TOK_PIECE_SIZE 12u
#define TOK_NODE_SIZE 12u

enum { PT_NORMAL = 1, PT_UNKNOWN = 2, PT_CONTROL = 3, PT_USER_DEFINED = 4, PT_UNUSED = 5, PT_BYTE = 6 };

#define FLAG_ADD_DUMMY_PREFIX 0x1u
#define FLAG_REMOVE_EXTRA_WS 0x2u
#define FLAG_ESCAPE_WS 0x4u
#define FLAG_BYTE_FALLBACK 0x8u
#define FLAG_KNOWN 0xFu

#define NO_NODE UINT32_MAX
/* Longest text one encode call takes: the normalized text (≤ 3 bytes per input byte + a
 * 3-byte prefix) must index with int32 symbol links. */
#define MAX_ENCODE_BYTES ((uint64_t)(INT32_MAX - 8) / 3u)

struct colibri_tokenizer {
    /* Borrowed from the section, valid while the caller keeps `base` alive. */
    const uint8_t *base;       /* section start */
    uint64_t size;             /* section size in bytes */
    const uint8_t *pieces;     /* (n_pieces, 12) records: u32 str_off, f32 score, u16 len, u8 type, u8 0 */
    const uint8_t *byte_ids;   /* (256,) i32: id of <0xXX> (unk_id when absent) */
    const uint8_t *nodes;      /* (n_nodes, 12) records: u32 edge_begin, u32 edge_count, i32 piece id */
    const uint8_t *children;   /* (n_edges,) u32 child node index */
    const uint8_t *labels;     /* (n_edges,) u8 edge byte, sorted within a node */
    const uint8_t *pairs;      /* (1 << pairs_log2,) u64 set of adjacent-character pairs of pieces; NULL if absent */
    const uint8_t *blob;       /* (blob_size,) piece strings */
    const uint8_t *unk_surface; /* (unk_surface_len,) inside blob */
    uint64_t blob_size;
    uint64_t n_edges;
    uint32_t n_nodes;
    uint32_t unk_surface_len;
    uint32_t pairs_log2;       /* 0: no pair table (encode runs BPE over the whole text at once) */
    int32_t n_pieces, bos_id, eos_id, unk_id, pad_id;
    uint32_t flags;
    uint32_t root_child[256]; /* children of the root node by byte (NO_NODE if none) */
    int has_user_defined;
    int has_unused;
    int has_tokenizer; /* 0: the file has no tokenizer (empty section) */
    int owned_by_ctx;
    uint32_t type;             /* TOK_TYPE_SENTENCEPIECE_BPE or CB_BPE_TYPE (byte-level BPE, bpe.c) */
    cb_bpe bpe;                /* the byte-level BPE tokenizer when type == CB_BPE_TYPE */
    void *cache;               /* cb_tokenizer_cache's object (the grammar's token tables), NULL until built */
    void (*cache_free)(void *);
    char err[256];
};

/* ---- little-endian loads (the library refuses big-endian hosts in cb_tokenizer_load) ---- */
static inline uint32_t rd_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline int32_t rd_i32(const uint8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t rd_u64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint16_t rd_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline float rd_f32(const uint8_t *p) { float v; memcpy(&v, p, 4); return v; }

static void put_err(char *dst, size_t cap, const char *fmt, va_list ap) {
    if (dst == NULL || cap == 0) return;
    vsnprintf(dst, cap, fmt, ap);
}

static void tok_err(colibri_tokenizer *t, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    put_err(t->err, sizeof t->err, fmt, ap);
    va_end(ap);
}

static colibri_status load_fail(char *err, size_t err_len, colibri_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    put_err(err, err_len, fmt, ap);
    va_end(ap);
    return st;
}

/* ---- piece and trie accessors (indices proven in range at load) ---- */
static inline uint32_t piece_off(const colibri_tokenizer *t, int32_t id) {
    return rd_u32(t->pieces + (uint64_t)id * TOK_PIECE_SIZE);
}
static inline float piece_score(const colibri_tokenizer *t, int32_t id) {
    return rd_f32(t->pieces + (uint64_t)id * TOK_PIECE_SIZE + 4);
}
static inline uint32_t piece_len(const colibri_tokenizer *t, int32_t id) {
    return rd_u16(t->pieces + (uint64_t)id * TOK_PIECE_SIZE + 8);
}
static inline int piece_type(const colibri_tokenizer *t, int32_t id) {
    return t->pieces[(uint64_t)id * TOK_PIECE_SIZE + 10];
}
static inline int32_t node_id(const colibri_tokenizer *t, uint32_t node) {
    return rd_i32(t->nodes + (uint64_t)node * TOK_NODE_SIZE + 8);
}

/* Child of `node` along byte `b`, or NO_NODE. */
static inline uint32_t trie_child(const colibri_tokenizer *t, uint32_t node, uint8_t b) {
    if (node == 0) return t->root_child[b];
    const uint8_t *nd = t->nodes + (uint64_t)node * TOK_NODE_SIZE;
    uint32_t lo = rd_u32(nd), n = rd_u32(nd + 4);
    const uint8_t *lab = t->labels + lo;
    if (n <= 8) {
        for (uint32_t i = 0; i < n; i++) {
            if (lab[i] == b) return rd_u32(t->children + 4 * ((uint64_t)lo + i));
            if (lab[i] > b) return NO_NODE;
        }
        return NO_NODE;
    }
    uint32_t a = 0, z = n;
    while (a < z) {
        uint32_t m = a + (z - a) / 2;
        if (lab[m] < b) a = m + 1; else z = m;
    }
    if (a < n && lab[a] == b) return rd_u32(t->children + 4 * ((uint64_t)lo + a));
    return NO_NODE;
}

/* Walk `len` bytes from `node`; NO_NODE if the path leaves the trie. */
static inline uint32_t trie_walk(const colibri_tokenizer *t, uint32_t node, const uint8_t *s, uint64_t len) {
    for (uint64_t i = 0; i < len && node != NO_NODE; i++) node = trie_child(t, node, s[i]);
    return node;
}

/* PieceToId: the id of the piece spelled s[0..len), else unk_id. */
static int32_t piece_to_id(const colibri_tokenizer *t, const uint8_t *s, uint64_t len) {
    uint32_t nd = trie_walk(t, 0, s, len);
    if (nd == NO_NODE) return t->unk_id;
    int32_t id = node_id(t, nd);
    return id >= 0 ? id : t->unk_id;
}

/* Length of the longest user-defined piece that prefixes s[0..len), 0 if none. */
static uint64_t user_match(const colibri_tokenizer *t, const uint8_t *s, uint64_t len) {
    uint64_t best = 0;
    uint32_t nd = 0;
    for (uint64_t i = 0; i < len; i++) {
        nd = trie_child(t, nd, s[i]);
        if (nd == NO_NODE) break;
        int32_t id = node_id(t, nd);
        if (id >= 0 && piece_type(t, id) == PT_USER_DEFINED) best = i + 1;
    }
    return best;
}

/* ---- the pair table: adjacent characters that occur inside some mergeable piece ---- */
#define PAIR_EMPTY UINT64_MAX
#define PAIR_HASH_MUL 0x9E3779B97F4A7C15ull

/* The UTF-8 bytes of one character (len ≤ 4) as a little-endian u32. */
static inline uint32_t pack_char(const uint8_t *s, uint32_t len) {
    uint32_t v = 0;
    memcpy(&v, s, len);
    return v;
}

/* Whether the pair key is in the table; a (corrupt) table without an empty slot answers 1,
 * the safe answer. */
static int pair_present(const colibri_tokenizer *t, uint64_t key) {
    uint64_t mask = ((uint64_t)1 << t->pairs_log2) - 1;
    uint64_t i = (key * PAIR_HASH_MUL) >> (64 - t->pairs_log2);
    for (uint64_t probes = 0; probes <= mask; probes++) {
        uint64_t k = rd_u64(t->pairs + 8 * i);
        if (k == key) return 1;
        if (k == PAIR_EMPTY) return 0;
        i = (i + 1) & mask;
    }
    return 1;
}

/* ---- UTF-8 as sentencepiece's string_util::DecodeUTF8 / IsValidDecodeUTF8 ---- */
static inline int is_trail(uint8_t c) { return (c & 0xC0) == 0x80; }
static inline int valid_cp(uint32_t c) { return c < 0xD800 || (c >= 0xE000 && c <= 0x10FFFF); }

/* 1 and *mblen = the character's length if s[0..len) (len ≥ 1) starts with a well-formed
 * character; else 0 and *mblen = 1. */
static inline int utf8_decode_valid(const uint8_t *s, uint64_t len, uint32_t *mblen) {
    uint8_t c = s[0];
    if (c < 0x80) { *mblen = 1; return 1; }
    if (len >= 2 && (c & 0xE0) == 0xC0) {
        uint32_t cp = ((uint32_t)(c & 0x1F) << 6) | (s[1] & 0x3Fu);
        if (is_trail(s[1]) && cp >= 0x80 && valid_cp(cp)) { *mblen = 2; return 1; }
    } else if (len >= 3 && (c & 0xF0) == 0xE0) {
        uint32_t cp = ((uint32_t)(c & 0x0F) << 12) | ((uint32_t)(s[1] & 0x3F) << 6) | (s[2] & 0x3Fu);
        if (is_trail(s[1]) && is_trail(s[2]) && cp >= 0x800 && valid_cp(cp)) { *mblen = 3; return 1; }
    } else if (len >= 4 && (c & 0xF8) == 0xF0) {
        uint32_t cp = ((uint32_t)(c & 0x07) << 18) | ((uint32_t)(s[1] & 0x3F) << 12) |
                      ((uint32_t)(s[2] & 0x3F) << 6) | (s[3] & 0x3Fu);
        if (is_trail(s[1]) && is_trail(s[2]) && is_trail(s[3]) && cp >= 0x10000 && valid_cp(cp)) {
            *mblen = 4;
            return 1;
        }
    }
    *mblen = 1;
    return 0;
}

/* string_util::OneCharLen, clipped to the bytes left. */
static inline uint32_t one_char_len(const uint8_t *s, uint64_t len) {
    static const uint8_t tab[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    uint32_t n = tab[s[0] >> 4];
    return (uint64_t)n < len ? n : (uint32_t)len;
}

static const uint8_t kSpaceSymbol[3] = {0xE2, 0x96, 0x81}; /* U+2581 */
static const uint8_t kReplacement[3] = {0xEF, 0xBF, 0xBD}; /* U+FFFD */

/* ---- loading ---- */

size_t cb_tokenizer_struct_size(void) { return sizeof(struct colibri_tokenizer); }

/* [off, off + count * elem) lies inside [0, size), computed without overflow. */
static int range_ok(uint64_t off, uint64_t count, uint64_t elem, uint64_t size) {
    if (off > size) return 0;
    if (elem != 0 && count > (size - off) / elem) return 0;
    return 1;
}

colibri_status cb_tokenizer_load(colibri_tokenizer *tok, const uint8_t *data, uint64_t size,
                                 int owned_by_ctx, char *err, size_t err_len) {
    if (tok == NULL) return load_fail(err, err_len, COLIBRI_E_INVALID_ARG, "tokenizer: NULL tokenizer struct");
    memset(tok, 0, sizeof *tok);
    tok->owned_by_ctx = owned_by_ctx ? 1 : 0;
    tok->bos_id = tok->eos_id = tok->unk_id = tok->pad_id = -1;
    if (err && err_len) err[0] = '\0';

    {
        const uint32_t one = 1;
        uint8_t b;
        memcpy(&b, &one, 1);
        if (b != 1)
            return load_fail(err, err_len, COLIBRI_E_UNSUPPORTED,
                             "tokenizer: big-endian hosts are not supported (the format is little-endian)");
    }
    if (size == 0) { /* the file has no tokenizer: a valid, empty tokenizer whose calls fail */
        tok->has_tokenizer = 0;
        return COLIBRI_OK;
    }
    if (data == NULL) return load_fail(err, err_len, COLIBRI_E_INVALID_ARG, "tokenizer: NULL section data");
    if (size < TOK_HEADER_SIZE)
        return load_fail(err, err_len, COLIBRI_E_FORMAT,
                         "tokenizer section: %llu bytes, shorter than its %u-byte header (truncated or corrupt file; re-convert the model)",
                         (unsigned long long)size, TOK_HEADER_SIZE);
    if (memcmp(data, TOK_MAGIC, 8) != 0)
        return load_fail(err, err_len, COLIBRI_E_FORMAT,
                         "tokenizer section: bad magic (expected \"CBTOKEN\\0\"; corrupt file or not a tokenizer section)");
    uint32_t version = rd_u32(data + 8), type = rd_u32(data + 12), hsize = rd_u32(data + 16);
    if (version != TOK_VERSION)
        return load_fail(err, err_len, COLIBRI_E_UNSUPPORTED,
                         "tokenizer section: version %u, this build reads version %u (use a newer Colibri or re-convert)",
                         version, TOK_VERSION);
    if (type == CB_BPE_TYPE) {
        colibri_status bst = cb_bpe_load(&tok->bpe, data, size, err, err_len);
        if (bst != COLIBRI_OK) return bst;
        tok->type = CB_BPE_TYPE;
        tok->base = data;
        tok->size = size;
        tok->n_pieces = tok->bpe.n_tokens;
        tok->bos_id = tok->bpe.bos_id;
        tok->eos_id = tok->bpe.eos_id;
        tok->unk_id = tok->bpe.unk_id;
        tok->pad_id = tok->bpe.pad_id;
        tok->has_tokenizer = 1;
        return COLIBRI_OK;
    }
    if (type != TOK_TYPE_SENTENCEPIECE_BPE)
        return load_fail(err, err_len, COLIBRI_E_UNSUPPORTED,
                         "tokenizer section: tokenizer type %u is not supported by this build (1 = sentencepiece_bpe, 2 = byte_level_bpe)",
                         type);
    if (hsize < TOK_HEADER_SIZE || hsize > size)
        return load_fail(err, err_len, COLIBRI_E_FORMAT, "tokenizer section: header_size %u is invalid", hsize);

    uint32_t n_pieces = rd_u32(data + 20);
    int32_t bos = rd_i32(data + 24), eos = rd_i32(data + 28), unk = rd_i32(data + 32), pad = rd_i32(data + 36);
    uint32_t flags = rd_u32(data + 40), n_nodes = rd_u32(data + 44);
    uint64_t pieces_off = rd_u64(data + 48), byte_ids_off = rd_u64(data + 56), nodes_off = rd_u64(data + 64);
    uint64_t children_off = rd_u64(data + 72), labels_off = rd_u64(data + 80), blob_off = rd_u64(data + 88);
    uint64_t blob_size = rd_u64(data + 96);
    uint32_t n_edges = rd_u32(data + 104), pairs_log2 = rd_u32(data + 108);
    uint64_t pairs_off = rd_u64(data + 112);
    uint32_t unk_surf_off = rd_u32(data + 120), unk_surf_len = rd_u32(data + 124);

    if (n_pieces == 0 || n_pieces > (uint32_t)INT32_MAX)
        return load_fail(err, err_len, COLIBRI_E_FORMAT, "tokenizer section: n_pieces %u is invalid", n_pieces);
    if (flags & ~FLAG_KNOWN)
        return load_fail(err, err_len, COLIBRI_E_UNSUPPORTED,
                         "tokenizer section: unknown flag bits 0x%x (written by a newer converter?)", flags & ~FLAG_KNOWN);
    int32_t ids4[4] = {bos, eos, unk, pad};
    const char *names4[4] = {"bos_id", "eos_id", "unk_id", "pad_id"};
    for (int i = 0; i < 4; i++)
        if (ids4[i] < -1 || ids4[i] >= (int32_t)n_pieces)
            return load_fail(err, err_len, COLIBRI_E_FORMAT, "tokenizer section: %s %d is outside -1..%u",
                             names4[i], ids4[i], n_pieces - 1);
    if (n_nodes == 0 || n_edges >= n_nodes)
        return load_fail(err, err_len, COLIBRI_E_FORMAT,
                         "tokenizer section: trie with %u nodes and %u edges is invalid", n_nodes, n_edges);
    if (!range_ok(pieces_off, n_pieces, TOK_PIECE_SIZE, size) || !range_ok(byte_ids_off, 256, 4, size) ||
        !range_ok(nodes_off, n_nodes, TOK_NODE_SIZE, size) || !range_ok(children_off, n_edges, 4, size) ||
        !range_ok(labels_off, n_edges, 1, size) || !range_ok(blob_off, blob_size, 1, size) ||
        pairs_log2 > 30 || (pairs_log2 > 0 && !range_ok(pairs_off, (uint64_t)1 << pairs_log2, 8, size)))
        return load_fail(err, err_len, COLIBRI_E_FORMAT,
                         "tokenizer section: an array lies outside the %llu-byte section (truncated or corrupt file)",
                         (unsigned long long)size);
    if (pieces_off < hsize || byte_ids_off < hsize || nodes_off < hsize || children_off < hsize ||
        labels_off < hsize || blob_off < hsize || (pairs_log2 > 0 && pairs_off < hsize) ||
        (pieces_off | byte_ids_off | nodes_off | children_off) % 4 || (pairs_log2 > 0 && pairs_off % 8))
        return load_fail(err, err_len, COLIBRI_E_FORMAT,
                         "tokenizer section: an array overlaps the header or is not 4-byte aligned");
    if (!range_ok(unk_surf_off, unk_surf_len, 1, blob_size))
        return load_fail(err, err_len, COLIBRI_E_FORMAT, "tokenizer section: unk surface lies outside the string blob");

    colibri_tokenizer *t = tok;
    t->base = data;
    t->size = size;
    t->pieces = data + pieces_off;
    t->byte_ids = data + byte_ids_off;
    t->nodes = data + nodes_off;
    t->children = data + children_off;
    t->labels = data + labels_off;
    t->pairs = pairs_log2 ? data + pairs_off : NULL;
    t->pairs_log2 = pairs_log2;
    t->blob = data + blob_off;
    t->blob_size = blob_size;
    t->n_edges = n_edges;
    t->n_nodes = n_nodes;
    t->unk_surface = t->blob + unk_surf_off;
    t->unk_surface_len = unk_surf_len;
    t->n_pieces = (int32_t)n_pieces;
    t->bos_id = bos;
    t->eos_id = eos;
    t->unk_id = unk;
    t->pad_id = pad;
    t->flags = flags;
    t->type = TOK_TYPE_SENTENCEPIECE_BPE;

    colibri_status st = COLIBRI_E_FORMAT;
    /* Pieces: strings inside the blob, known types, one unknown piece = unk_id, byte pieces
     * spelled <0xXX>, no NaN score. */
    int n_unknown = 0;
    for (uint32_t i = 0; i < n_pieces; i++) {
        uint32_t off = piece_off(t, (int32_t)i), len = piece_len(t, (int32_t)i);
        int ty = piece_type(t, (int32_t)i);
        if (len == 0 || !range_ok(off, len, 1, blob_size)) {
            load_fail(err, err_len, st, "tokenizer section: piece %u string lies outside the blob or is empty", i);
            goto fail;
        }
        if (ty < PT_NORMAL || ty > PT_BYTE) {
            load_fail(err, err_len, st, "tokenizer section: piece %u has unknown type %d", i, ty);
            goto fail;
        }
        if (isnan(piece_score(t, (int32_t)i))) {
            load_fail(err, err_len, st, "tokenizer section: piece %u has a NaN score", i);
            goto fail;
        }
        if (ty == PT_UNKNOWN) {
            n_unknown++;
            if ((int32_t)i != unk) {
                load_fail(err, err_len, st, "tokenizer section: piece %u is of type unknown but unk_id is %d", i, unk);
                goto fail;
            }
        }
        if (ty == PT_BYTE) {
            const uint8_t *s = t->blob + off;
            static const char hex[] = "0123456789ABCDEF";
            if (len != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>' || s[3] == 0 || s[4] == 0 ||
                !strchr(hex, s[3]) || !strchr(hex, s[4])) {
                load_fail(err, err_len, st, "tokenizer section: byte piece %u is not spelled <0xXX>", i);
                goto fail;
            }
        }
        if (ty == PT_USER_DEFINED) t->has_user_defined = 1;
        if (ty == PT_UNUSED) t->has_unused = 1;
    }
    if (unk < 0 || n_unknown != 1) {
        load_fail(err, err_len, st, "tokenizer section: the vocabulary needs exactly one unknown piece (unk_id %d)", unk);
        goto fail;
    }
    for (int b = 0; b < 256; b++) {
        int32_t id = rd_i32(t->byte_ids + 4 * b);
        if (id < 0 || id >= (int32_t)n_pieces) {
            load_fail(err, err_len, st, "tokenizer section: byte table entry %d = %d is out of range", b, id);
            goto fail;
        }
    }
    /* Trie: edges of each node inside the edge arrays, labels strictly increasing, every
     * child after its parent (so walks cannot loop), ids in range. */
    uint64_t n_with_id = 0;
    for (uint32_t k = 0; k < n_nodes; k++) {
        const uint8_t *nd = t->nodes + (uint64_t)k * TOK_NODE_SIZE;
        uint32_t eb = rd_u32(nd), ec = rd_u32(nd + 4);
        int32_t id = rd_i32(nd + 8);
        if (ec > 256 || !range_ok(eb, ec, 1, n_edges)) {
            load_fail(err, err_len, st, "tokenizer section: trie node %u has invalid edges", k);
            goto fail;
        }
        if (id < -1 || id >= (int32_t)n_pieces) {
            load_fail(err, err_len, st, "tokenizer section: trie node %u has invalid piece id %d", k, id);
            goto fail;
        }
        if (id >= 0) n_with_id++;
        for (uint32_t e = 0; e < ec; e++) {
            uint32_t child = rd_u32(t->children + 4 * ((uint64_t)eb + e));
            if (child <= k || child >= n_nodes || (e > 0 && t->labels[eb + e] <= t->labels[eb + e - 1])) {
                load_fail(err, err_len, st, "tokenizer section: trie node %u has an invalid edge %u", k, e);
                goto fail;
            }
        }
    }
    for (int b = 0; b < 256; b++) t->root_child[b] = NO_NODE;
    {
        uint32_t eb = rd_u32(t->nodes), ec = rd_u32(t->nodes + 4);
        for (uint32_t e = 0; e < ec; e++) t->root_child[t->labels[eb + e]] = rd_u32(t->children + 4 * ((uint64_t)eb + e));
    }
    /* Every piece's string leads to a node carrying its id, and no other node carries one:
     * the trie is exactly the vocabulary. */
    if (n_with_id != n_pieces) {
        load_fail(err, err_len, st, "tokenizer section: the trie holds %llu pieces, the vocabulary %u",
                  (unsigned long long)n_with_id, n_pieces);
        goto fail;
    }
    for (uint32_t i = 0; i < n_pieces; i++) {
        uint32_t nd = trie_walk(t, 0, t->blob + piece_off(t, (int32_t)i), piece_len(t, (int32_t)i));
        if (nd == NO_NODE || node_id(t, nd) != (int32_t)i) {
            load_fail(err, err_len, st, "tokenizer section: piece %u is not found in the trie", i);
            goto fail;
        }
    }
    /* The pair table must hold every adjacent-character pair of every mergeable piece (it
     * may hold more: extra pairs only make the encoder cut the text less). */
    if (t->pairs_log2) {
        for (uint32_t i = 0; i < n_pieces; i++) {
            int ty = piece_type(t, (int32_t)i);
            if (ty != PT_NORMAL && ty != PT_USER_DEFINED && ty != PT_UNUSED) continue;
            const uint8_t *s = t->blob + piece_off(t, (int32_t)i);
            uint64_t len = piece_len(t, (int32_t)i), p = 0;
            uint32_t prev = 0;
            int have_prev = 0;
            while (p < len) {
                uint32_t m = one_char_len(s + p, len - p);
                uint32_t c = pack_char(s + p, m);
                if (have_prev && !pair_present(t, ((uint64_t)prev << 32) | c)) {
                    load_fail(err, err_len, st, "tokenizer section: the pair table misses a pair of piece %u", i);
                    goto fail;
                }
                prev = c;
                have_prev = 1;
                p += m;
            }
        }
    }
    t->has_tokenizer = 1;
    return COLIBRI_OK;

fail:
    memset(tok, 0, sizeof *tok);
    tok->owned_by_ctx = owned_by_ctx ? 1 : 0;
    tok->bos_id = tok->eos_id = tok->unk_id = tok->pad_id = -1;
    return st;
}

/* one lock for every tokenizer's cache: it is taken once per grammar compile */
static pthread_mutex_t cache_mu = PTHREAD_MUTEX_INITIALIZER;

void *cb_tokenizer_cache(colibri_tokenizer *tok, void *(*build)(colibri_tokenizer *), void (*free_fn)(void *)) {
    pthread_mutex_lock(&cache_mu);
    if (!tok->cache) {
        tok->cache = build(tok);
        tok->cache_free = tok->cache ? free_fn : NULL;
    }
    void *c = tok->cache;
    pthread_mutex_unlock(&cache_mu);
    return c;
}

void cb_tokenizer_unload(colibri_tokenizer *tok) {
    /* the section is borrowed; only cb_tokenizer_cache's object was allocated */
    if (tok && tok->cache && tok->cache_free) tok->cache_free(tok->cache);
    if (tok) tok->cache = NULL;
}

/* ---- public object functions ---- */

colibri_status colibri_tokenizer_from_memory(const void *data, uint64_t size, colibri_tokenizer **out, char *err,
                                             size_t err_len) {
    if (out == NULL) return load_fail(err, err_len, COLIBRI_E_INVALID_ARG, "colibri_tokenizer_from_memory: out is NULL");
    *out = NULL;
    if (data == NULL || size == 0)
        return load_fail(err, err_len, COLIBRI_E_INVALID_ARG,
                         "colibri_tokenizer_from_memory: no data (pass the bytes of a tokenizer section)");
    colibri_tokenizer *t = (colibri_tokenizer *)calloc(1, sizeof *t);
    if (t == NULL) return load_fail(err, err_len, COLIBRI_E_NOMEM, "colibri_tokenizer_from_memory: out of memory");
    colibri_status st = cb_tokenizer_load(t, (const uint8_t *)data, size, 0, err, err_len);
    if (st != COLIBRI_OK) {
        free(t);
        return st;
    }
    *out = t;
    return COLIBRI_OK;
}

void colibri_tokenizer_free(colibri_tokenizer *tok) {
    if (tok == NULL || tok->owned_by_ctx) return;
    cb_tokenizer_unload(tok);
    free(tok);
}

const char *colibri_tokenizer_last_error(const colibri_tokenizer *tok) {
    if (tok == NULL) return "tokenizer is NULL";
    return tok->err;
}

int32_t colibri_tokenizer_vocab_size(const colibri_tokenizer *tok) {
    return (tok && tok->has_tokenizer) ? tok->n_pieces : 0;
}
int32_t colibri_tokenizer_bos_id(const colibri_tokenizer *tok) {
    return (tok && tok->has_tokenizer) ? tok->bos_id : -1;
}
int32_t colibri_tokenizer_eos_id(const colibri_tokenizer *tok) {
    return (tok && tok->has_tokenizer) ? tok->eos_id : -1;
}

static colibri_status no_tokenizer(colibri_tokenizer *tok, const char *fn) {
    tok_err(tok, "%s: this model file has no tokenizer (tokenizer.type = none); pass token ids instead", fn);
    return COLIBRI_E_UNSUPPORTED;
}

colibri_status colibri_token_piece(colibri_tokenizer *tok, int32_t id, const char **piece, uint64_t *len) {
    if (tok == NULL) return COLIBRI_E_INVALID_ARG;
    if (piece == NULL || len == NULL) {
        tok_err(tok, "colibri_token_piece: piece and len must not be NULL");
        return COLIBRI_E_INVALID_ARG;
    }
    *piece = NULL;
    *len = 0;
    if (!tok->has_tokenizer) return no_tokenizer(tok, "colibri_token_piece");
    if (id < 0 || id >= tok->n_pieces) {
        tok_err(tok, "colibri_token_piece: token id %d is outside 0..%d", id, tok->n_pieces - 1);
        return COLIBRI_E_TOKEN_RANGE;
    }
    if (tok->type == CB_BPE_TYPE) {
        cb_bpe_piece(&tok->bpe, id, piece, len);
        return COLIBRI_OK;
    }
    *piece = (const char *)(tok->blob + piece_off(tok, id));
    *len = piece_len(tok, id);
    return COLIBRI_OK;
}

int cb_token_bytes(const colibri_tokenizer *tok, int32_t id, uint8_t *buf, uint32_t cap, uint32_t *len,
                   int *special) {
    const uint8_t *s;
    uint32_t sl;
    *len = 0;
    if (tok->type == CB_BPE_TYPE) {
        s = cb_bpe_token_bytes(&tok->bpe, id, &sl, special);
        if (sl > cap) return -1;
        memcpy(buf, s, sl);
        *len = sl;
        return 0;
    }
    int ty = piece_type(tok, id);
    s = tok->blob + piece_off(tok, id);
    sl = piece_len(tok, id);
    *special = (ty == PT_CONTROL || ty == PT_UNKNOWN);
    if (ty == PT_BYTE) {
        uint8_t hi = s[3], lo = s[4]; /* validated "<0xXX>" */
        if (cap < 1) return -1;
        buf[0] = (uint8_t)(((hi <= '9' ? hi - '0' : hi - 'A' + 10) << 4) | (lo <= '9' ? lo - '0' : lo - 'A' + 10));
        *len = 1;
        return 0;
    }
    uint32_t n = 0;
    for (uint32_t k = 0; k < sl;) {
        if (!*special && k + 3 <= sl && s[k] == 0xE2 && s[k + 1] == 0x96 && s[k + 2] == 0x81) {
            if (n + 1 > cap) return -1;
            buf[n++] = ' ';
            k += 3;
        } else {
            if (n + 1 > cap) return -1;
            buf[n++] = s[k++];
        }
    }
    *len = n;
    return 0;
}

/* ---- encode ---- */

typedef struct {
    uint32_t start; /* byte offset in the normalized text */
    uint32_t len;   /* 0 once merged into its left neighbour */
    int32_t prev, next;
    uint32_t node;  /* trie node spelling this symbol, NO_NODE if none */
    uint32_t freeze; /* a user-defined symbol: never merged */
} sym_t;

typedef struct {
    float score;
    uint32_t left, right;
    uint32_t size; /* byte length of the merged piece when pushed */
    uint32_t node; /* trie node of the merged piece */
} pair_t;

typedef struct {
    pair_t *v;
    uint64_t n, cap;
} heap_t;

/* a ranks above b: higher score, then smaller left index (sentencepiece's agenda order). */
static inline int pair_above(const pair_t *a, const pair_t *b) {
    return a->score > b->score || (a->score == b->score && a->left < b->left);
}

static int heap_push(heap_t *h, pair_t p) {
    if (h->n == h->cap) {
        uint64_t nc = h->cap ? h->cap * 2 : 1024;
        if (nc > SIZE_MAX / sizeof(pair_t)) return 0;
        pair_t *nv = (pair_t *)realloc(h->v, (size_t)nc * sizeof(pair_t));
        if (nv == NULL) return 0;
        h->v = nv;
        h->cap = nc;
    }
    uint64_t i = h->n++;
    while (i > 0) {
        uint64_t parent = (i - 1) / 2;
        if (!pair_above(&p, &h->v[parent])) break;
        h->v[i] = h->v[parent];
        i = parent;
    }
    h->v[i] = p;
    return 1;
}

static pair_t heap_pop(heap_t *h) {
    pair_t top = h->v[0];
    pair_t last = h->v[--h->n];
    uint64_t i = 0, n = h->n;
    for (;;) {
        uint64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && pair_above(&h->v[c + 1], &h->v[c])) c++;
        if (!pair_above(&h->v[c], &last)) break;
        h->v[i] = h->v[c];
        i = c;
    }
    if (n > 0) h->v[i] = last;
    return top;
}

/* Per-call memo of pair lookups between trie strings. */
typedef struct {
    uint32_t l, r;  /* trie nodes of the two symbols; l = NO_NODE: empty slot */
    uint32_t node;  /* node of the merged piece */
    int32_t id;     /* the merged mergeable piece, -1 if none */
    float score;
} pcache_t;

typedef struct {
    colibri_tokenizer *t;
    const uint8_t *norm;
    pcache_t *cache;     /* (1 << cache_log2,) or NULL */
    uint32_t cache_log2;
    sym_t *sym;
    heap_t heap;
    uint32_t *rev_split; /* (n_pieces,) left length of the last pair pushed for an unused piece; 0 = none */
    int32_t *out;
    int64_t cap, n;
    int prev_unk;
} enc_t;

/* MaybeAddNewSymbolPair of bpe_model.cc. Returns 0 on allocation failure. */
/* The mergeable piece spelled by node `l` followed by the bytes of symbol `r`:
 * *node and *id, or *id = -1 if there is none. */
static inline void pair_lookup(const enc_t *e, uint32_t l, const sym_t *r, uint32_t *node, int32_t *id, float *score) {
    *id = -1;
    uint32_t nd = trie_walk(e->t, l, e->norm + r->start, r->len);
    if (nd == NO_NODE) return;
    int32_t pid = node_id(e->t, nd);
    if (pid < 0) return;
    int ty = piece_type(e->t, pid);
    if (ty != PT_NORMAL && ty != PT_USER_DEFINED && ty != PT_UNUSED) return;
    *node = nd;
    *id = pid;
    *score = piece_score(e->t, pid);
}

/* MaybeAddNewSymbolPair of bpe_model.cc. Returns 0 on allocation failure. */
static int maybe_add_pair(enc_t *e, int32_t left, int32_t right) {
    if (left < 0 || right < 0) return 1;
    const sym_t *l = &e->sym[left], *r = &e->sym[right];
    if (l->freeze || r->freeze || l->node == NO_NODE) return 1;
    uint32_t nd = NO_NODE;
    int32_t id;
    float score = 0.0f;
    if (r->node != NO_NODE && e->cache != NULL) {
        /* both symbols are trie strings: the answer depends on (l->node, r->node) only */
        uint64_t h = (((uint64_t)l->node << 32) | r->node) * PAIR_HASH_MUL >> (64 - e->cache_log2);
        pcache_t *c = &e->cache[h];
        if (c->l == l->node && c->r == r->node) {
            nd = c->node;
            id = c->id;
            score = c->score;
        } else {
            pair_lookup(e, l->node, r, &nd, &id, &score);
            c->l = l->node;
            c->r = r->node;
            c->node = nd;
            c->id = id;
            c->score = score;
        }
    } else {
        pair_lookup(e, l->node, r, &nd, &id, &score);
    }
    if (id < 0) return 1;
    pair_t p = {score, (uint32_t)left, (uint32_t)right, l->len + r->len, nd};
    if (!heap_push(&e->heap, p)) return 0;
    if (piece_type(e->t, id) == PT_UNUSED) e->rev_split[id] = l->len;
    return 1;
}

static inline void emit_id(enc_t *e, int32_t id) {
    if (e->n < e->cap) e->out[e->n] = id;
    e->n++;
}

/* PopulateSentencePieceText for one (piece, id) of the model's output. */
static void emit_piece(enc_t *e, const uint8_t *w, uint32_t len, int32_t id) {
    colibri_tokenizer *t = e->t;
    int ty = piece_type(t, id);
    if (ty == PT_CONTROL) {
        emit_id(e, id);
        e->prev_unk = 0;
        return;
    }
    if (ty == PT_UNKNOWN) {
        if (t->flags & FLAG_BYTE_FALLBACK) {
            for (uint32_t i = 0; i < len; i++) emit_id(e, rd_i32(t->byte_ids + 4 * (uint32_t)w[i]));
        } else if (!e->prev_unk) {
            emit_id(e, id);
        }
        e->prev_unk = 1;
        return;
    }
    emit_id(e, id);
    e->prev_unk = 0;
}

/* resegment() of bpe_model.cc: an unused piece is split back into the pair that formed it. */
static int emit_resegmented(enc_t *e, uint32_t start, uint32_t len) {
    uint32_t stack_local[128];
    uint32_t *stack = stack_local; /* pairs (start, len) */
    uint64_t cap = 64, sp = 0;
    int ok = 1;
    stack[sp * 2] = start;
    stack[sp * 2 + 1] = len;
    sp++;
    while (sp > 0) {
        sp--;
        uint32_t s = stack[sp * 2], n = stack[sp * 2 + 1];
        int32_t id = piece_to_id(e->t, e->norm + s, n);
        uint32_t split = (piece_type(e->t, id) == PT_UNUSED) ? e->rev_split[id] : 0;
        if (split == 0 || split >= n) {
            emit_piece(e, e->norm + s, n, id);
            continue;
        }
        if (sp + 2 > cap) {
            uint64_t nc = cap * 2;
            uint32_t *ns = (uint32_t *)malloc((size_t)nc * 2 * sizeof(uint32_t));
            if (ns == NULL) { ok = 0; break; }
            memcpy(ns, stack, (size_t)sp * 2 * sizeof(uint32_t));
            if (stack != stack_local) free(stack);
            stack = ns;
            cap = nc;
        }
        /* right first, so that the left half is emitted first */
        stack[sp * 2] = s + split;
        stack[sp * 2 + 1] = n - split;
        sp++;
        stack[sp * 2] = s;
        stack[sp * 2 + 1] = split;
        sp++;
    }
    if (stack != stack_local) free(stack);
    return ok;
}

/* Normalizer::Normalize for a normalizer without a character map. `dst` holds at least
 * 3 * len + 3 bytes. Returns the normalized length. */
static uint64_t normalize(const colibri_tokenizer *t, const uint8_t *in, uint64_t len, uint8_t *dst) {
    const int remove_ws = (t->flags & FLAG_REMOVE_EXTRA_WS) != 0;
    const int escape = (t->flags & FLAG_ESCAPE_WS) != 0;
    uint64_t pos = 0, o = 0;
    if (len == 0) return 0;

/* NormalizePrefix: the next unit of input: a user-defined piece, one well-formed character,
 * or one malformed byte standing for U+FFFD. */
#define NORM_PREFIX(P, S, SL, CONSUMED)                                                   \
    do {                                                                                  \
        uint64_t um_ = t->has_user_defined ? user_match(t, in + (P), len - (P)) : 0;      \
        if (um_) { S = in + (P); SL = um_; CONSUMED = um_; break; }                       \
        uint32_t mb_;                                                                     \
        if (utf8_decode_valid(in + (P), len - (P), &mb_)) { S = in + (P); SL = mb_; CONSUMED = mb_; } \
        else { S = kReplacement; SL = 3; CONSUMED = 1; }                                  \
    } while (0)

    if (remove_ws) {
        while (pos < len) {
            const uint8_t *s;
            uint64_t sl, c;
            NORM_PREFIX(pos, s, sl, c);
            if (!(sl == 1 && s[0] == ' ')) break;
            pos += c;
        }
        if (pos == len) return 0;
    }
    if (t->flags & FLAG_ADD_DUMMY_PREFIX) {
        if (escape) { memcpy(dst + o, kSpaceSymbol, 3); o += 3; }
        else dst[o++] = ' ';
    }
    int is_prev_space = remove_ws;
    while (pos < len) {
        const uint8_t *s;
        uint64_t sl, c;
        if (!t->has_user_defined && in[pos] < 0x80) { /* fast path: ASCII */
            s = in + pos;
            sl = 1;
            c = 1;
        } else {
            NORM_PREFIX(pos, s, sl, c);
        }
        while (is_prev_space && sl > 0 && s[0] == ' ') { s++; sl--; }
        if (sl > 0) {
            for (uint64_t i = 0; i < sl; i++) {
                if (escape && s[i] == ' ') { memcpy(dst + o, kSpaceSymbol, 3); o += 3; }
                else dst[o++] = s[i];
            }
            is_prev_space = s[sl - 1] == ' ';
        }
        pos += c;
        if (!remove_ws) is_prev_space = 0;
    }
#undef NORM_PREFIX
    if (remove_ws) {
        const uint8_t *sp = escape ? kSpaceSymbol : (const uint8_t *)" ";
        uint64_t spl = escape ? 3 : 1;
        while (o >= spl && memcmp(dst + o - spl, sp, spl) == 0) o -= spl;
    }
    return o;
}

colibri_status colibri_tokenize(colibri_tokenizer *tok, const char *text, uint64_t len, int add_bos, int32_t *out,
                                int64_t cap, int64_t *n_out) {
    if (tok == NULL) return COLIBRI_E_INVALID_ARG;
    if (n_out == NULL || cap < 0 || (cap > 0 && out == NULL) || (len > 0 && text == NULL)) {
        tok_err(tok, "colibri_tokenize: invalid arguments (n_out NULL, cap < 0, out NULL with cap > 0, or text NULL with len > 0)");
        return COLIBRI_E_INVALID_ARG;
    }
    *n_out = 0;
    if (!tok->has_tokenizer) return no_tokenizer(tok, "colibri_tokenize");
    if (add_bos && tok->bos_id < 0) add_bos = 0; /* no BOS piece: add_bos is a no-op */
    if (tok->type == CB_BPE_TYPE)
        return cb_bpe_tokenize(&tok->bpe, (const uint8_t *)text, len, add_bos, out, cap, n_out, tok->err, sizeof tok->err);
    if (len > MAX_ENCODE_BYTES || len > (SIZE_MAX - 8) / 3) {
        tok_err(tok, "colibri_tokenize: %llu bytes of text exceed the %llu-byte limit of one call; split the text",
                (unsigned long long)len, (unsigned long long)MAX_ENCODE_BYTES);
        return COLIBRI_E_INVALID_ARG;
    }

    enc_t e;
    memset(&e, 0, sizeof e);
    e.t = tok;
    e.out = out;
    e.cap = cap;
    if (add_bos) emit_id(&e, tok->bos_id);

    colibri_status st = COLIBRI_OK;
    uint8_t *norm = NULL;
    if (len == 0) goto done;
    norm = (uint8_t *)malloc((size_t)(3 * len + 3));
    if (norm == NULL) goto nomem;
    uint64_t nlen = normalize(tok, (const uint8_t *)text, len, norm);
    e.norm = norm;
    if (nlen == 0) goto done;

    /* Split into characters (user-defined symbols whole and frozen). */
    e.sym = (sym_t *)malloc((size_t)nlen * sizeof(sym_t));
    if (e.sym == NULL) goto nomem;
    if (tok->has_unused) {
        e.rev_split = (uint32_t *)calloc((size_t)tok->n_pieces, sizeof(uint32_t));
        if (e.rev_split == NULL) goto nomem;
    }
    /* Pair memo: up to 4096 slots, fewer for short texts (it is cleared per call). */
    e.cache_log2 = 6;
    while (e.cache_log2 < 12 && ((uint64_t)1 << e.cache_log2) < nlen) e.cache_log2++;
    e.cache = (pcache_t *)malloc(sizeof(pcache_t) << e.cache_log2);
    if (e.cache == NULL) goto nomem;
    memset(e.cache, 0xFF, sizeof(pcache_t) << e.cache_log2);
    int32_t n_sym = 0;
    for (uint64_t p = 0; p < nlen;) {
        uint64_t m = tok->has_user_defined ? user_match(tok, norm + p, nlen - p) : 0;
        sym_t *s = &e.sym[n_sym];
        s->freeze = m != 0;
        if (m == 0) m = one_char_len(norm + p, nlen - p);
        s->start = (uint32_t)p;
        s->len = (uint32_t)m;
        s->prev = n_sym - 1;
        s->next = (p + m < nlen) ? n_sym + 1 : -1;
        s->node = trie_walk(tok, 0, norm + p, m);
        n_sym++;
        p += m;
    }

    /* BPE merges: best pair first (score, then leftmost). A boundary between two characters
     * that never occur next to each other inside a mergeable piece (or next to a frozen
     * symbol) can never be merged across, so the text is cut there and each segment is
     * merged on its own: the same merges in the same relative order as one global agenda,
     * with a small heap. Unused pieces are re-split by the last pair recorded for their
     * string anywhere in the text, which depends on the global order: no cutting then. */
    const int cut = tok->pairs_log2 != 0 && !tok->has_unused;
    int32_t seg = 0;
    for (int32_t i = 1; i <= n_sym; i++) {
        if (i < n_sym) {
            if (!cut) continue;
            const sym_t *a = &e.sym[i - 1], *b = &e.sym[i];
            if (!a->freeze && !b->freeze &&
                pair_present(tok, ((uint64_t)pack_char(norm + a->start, a->len) << 32) | pack_char(norm + b->start, b->len)))
                continue;
        }
        /* merge the segment [seg, i) */
        e.heap.n = 0;
        for (int32_t k = seg + 1; k < i; k++)
            if (!maybe_add_pair(&e, k - 1, k)) goto nomem;
        while (e.heap.n > 0) {
            pair_t top = heap_pop(&e.heap);
            sym_t *l = &e.sym[top.left], *r = &e.sym[top.right];
            if (l->len == 0 || r->len == 0 || l->len + r->len != top.size) continue; /* stale */
            l->len += r->len;
            l->node = top.node;
            l->next = r->next;
            if (r->next >= 0) e.sym[r->next].prev = (int32_t)top.left;
            r->len = 0;
            if (!maybe_add_pair(&e, l->prev, (int32_t)top.left)) goto nomem;
            if (!maybe_add_pair(&e, (int32_t)top.left, l->next)) goto nomem;
        }
        seg = i;
    }

    /* Emit in order. */
    for (int32_t i = 0; i != -1; i = e.sym[i].next) {
        const sym_t *s = &e.sym[i];
        int32_t id = tok->unk_id;
        if (s->node != NO_NODE) {
            int32_t nid = node_id(tok, s->node);
            if (nid >= 0) id = nid;
        }
        if (tok->has_unused && piece_type(tok, id) == PT_UNUSED) {
            if (!emit_resegmented(&e, s->start, s->len)) goto nomem;
        } else {
            emit_piece(&e, norm + s->start, s->len, id);
        }
    }
    goto done;

nomem:
    st = COLIBRI_E_NOMEM;
    tok_err(tok, "colibri_tokenize: out of memory for %llu bytes of text; split the text", (unsigned long long)len);
done:
    free(e.heap.v);
    free(e.cache);
    free(e.rev_split);
    free(e.sym);
    free(norm);
    if (st != COLIBRI_OK) {
        *n_out = 0;
        return st;
    }
    *n_out = e.n;
    if (e.n > cap) {
        tok_err(tok, "colibri_tokenize: %lld ids do not fit in a buffer of %lld; call again with a larger buffer",
                (long long)e.n, (long long)cap);
        return COLIBRI_E_BUFFER_TOO_SMALL;
    }
    return COLIBRI_OK;
}

/* ---- decode ---- */

typedef struct {
    char *out;
    uint64_t cap, len;
} wbuf_t;

static inline void wput(wbuf_t *w, const uint8_t *p, uint64_t n) {
    if (w->len < w->cap) {
        uint64_t room = w->cap - w->len, k = n < room ? n : room;
        memcpy(w->out + w->len, p, (size_t)k);
    }
    w->len += n;
}

/* ProcessBytePieces, streamed: `pend` holds up to 4 pending bytes of the current run; a
 * character is decided once 4 bytes are pending (DecodeUTF8 never looks further) or at the
 * end of the run (flush). */
typedef struct {
    uint8_t b[4];
    uint32_t n;
} pend_t;

static void bytes_drain(wbuf_t *w, pend_t *pd, int flush) {
    while (pd->n > 0 && (flush || pd->n == 4)) {
        uint32_t mb;
        if (utf8_decode_valid(pd->b, pd->n, &mb)) wput(w, pd->b, mb);
        else wput(w, kReplacement, 3);
        memmove(pd->b, pd->b + mb, pd->n - mb);
        pd->n -= mb;
    }
}

colibri_status colibri_detokenize(colibri_tokenizer *tok, const int32_t *ids, int64_t n, char *out, uint64_t cap,
                                  uint64_t *len_out) {
    if (tok == NULL) return COLIBRI_E_INVALID_ARG;
    if (len_out == NULL || n < 0 || (n > 0 && ids == NULL) || (cap > 0 && out == NULL)) {
        tok_err(tok, "colibri_detokenize: invalid arguments (len_out NULL, n < 0, ids NULL with n > 0, or out NULL with cap > 0)");
        return COLIBRI_E_INVALID_ARG;
    }
    *len_out = 0;
    if (!tok->has_tokenizer) return no_tokenizer(tok, "colibri_detokenize");
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= tok->n_pieces) {
            tok_err(tok, "colibri_detokenize: token id %d at position %lld is outside 0..%d", ids[i], (long long)i,
                    tok->n_pieces - 1);
            return COLIBRI_E_TOKEN_RANGE;
        }
    }
    if (tok->type == CB_BPE_TYPE) return cb_bpe_detokenize(&tok->bpe, ids, n, out, cap, len_out, tok->err, sizeof tok->err);
    const int strip_first = (tok->flags & (FLAG_ADD_DUMMY_PREFIX | FLAG_REMOVE_EXTRA_WS)) != 0;
    const int remove_ws = (tok->flags & FLAG_REMOVE_EXTRA_WS) != 0;
    wbuf_t w = {out, cap, 0};
    pend_t pd = {{0, 0, 0, 0}, 0};
    int is_bos_ws = 1, bos_ws_seen = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        int ty = piece_type(tok, id);
        const uint8_t *s = tok->blob + piece_off(tok, id);
        uint64_t sl = piece_len(tok, id);
        if (ty == PT_BYTE) {
            uint8_t hi = s[3], lo = s[4]; /* validated "<0xXX>" */
            uint8_t v = (uint8_t)(((hi <= '9' ? hi - '0' : hi - 'A' + 10) << 4) | (lo <= '9' ? lo - '0' : lo - 'A' + 10));
            pd.b[pd.n++] = v;
            bytes_drain(&w, &pd, 0);
            continue;
        }
        bytes_drain(&w, &pd, 1);
        if (bos_ws_seen || w.len > 0) is_bos_ws = 0;
        if (ty == PT_CONTROL) {
            bos_ws_seen = 0;
            continue;
        }
        if (ty == PT_UNKNOWN) {
            wput(&w, tok->unk_surface, tok->unk_surface_len);
            bos_ws_seen = 0;
            continue;
        }
        bos_ws_seen = 0;
        if (is_bos_ws && strip_first && sl >= 3 && memcmp(s, kSpaceSymbol, 3) == 0) {
            s += 3;
            sl -= 3;
            bos_ws_seen = remove_ws ? 0 : 1;
        }
        uint64_t run = 0;
        for (uint64_t k = 0; k < sl;) {
            if (k + 3 <= sl && s[k] == 0xE2 && s[k + 1] == 0x96 && s[k + 2] == 0x81) {
                wput(&w, s + run, k - run);
                wput(&w, (const uint8_t *)" ", 1);
                k += 3;
                run = k;
            } else {
                k++;
            }
        }
        wput(&w, s + run, sl - run);
    }
    bytes_drain(&w, &pd, 1);
    *len_out = w.len;
    if (w.len > cap) {
        tok_err(tok, "colibri_detokenize: %llu bytes of text do not fit in a buffer of %llu; call again with a larger buffer",
                (unsigned long long)w.len, (unsigned long long)cap);
        return COLIBRI_E_BUFFER_TOO_SMALL;
    }
    return COLIBRI_OK;
}
