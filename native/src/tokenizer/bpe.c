/*
 * bpe.c — byte-level BPE tokenizer (GPT-2 / Qwen2 / Llama-3 style) read in place
 * from a tokenizer section of type 2 (docs/format.md, "Tokenizer section encoding",
 * "Byte-level BPE"). It reproduces Hugging Face `tokenizers` for a tokenizer.json with a BPE
 * model over the ByteLevel alphabet:
 *
 *   encode = added tokens (not normalized) split off the raw text, leftmost-longest;
 *            optional NFC normalization of the rest; added tokens (normalized) split off;
 *            the pre-tokenizer split pattern (hand-written matchers of the GPT-2, Qwen2,
 *            Llama-3, Mistral tekken, OpenAI o200k (gpt-oss), Kimi regexes and DeepSeek-V3's
 *            sequence of three splits, Oniguruma / fancy-regex semantics, Unicode
 *            tables from unicode_tables.c), on each stretch whole or, with flag bit 3 (Kimi's
 *            tiktoken class), in the class's parts;
 *            BPE per pre-token with the ranked merges (Word::merge_all: a min-heap of
 *            (rank, position), stale entries dropped by checking the merged id), or the
 *            whole pre-token when `ignore_merges` is set and it is in the vocabulary;
 *   decode = ByteLevel decoder: the bytes of each token (precomputed by the builder), joined,
 *            malformed UTF-8 replaced by U+FFFD per maximal subpart (Rust's
 *            String::from_utf8_lossy); special tokens are skipped (skip_special_tokens=True);
 *            with header flag bit 2 (tekken) each run of non-special tokens is made valid
 *            UTF-8 on its own, as mistral-common's Tekkenizer.decode does.
 *
 * A tekken (tiktoken-style) vocabulary is stored as the same section: its ranks become pair
 * merges (every split of every token into two tokens, ranked by the whole token's rank),
 * with ignore_merges set (tiktoken looks a whole pre-token up first); its control tokens
 * are special but not added (never matched in the text).
 *
 * Input that is not valid UTF-8 is first made valid the same way (one U+FFFD per maximal
 * malformed subpart), which is what Python's bytes.decode("utf-8", "replace") gives.
 *
 * Everything of the section is validated in cb_bpe_load; the hot paths only index arrays
 * whose extents were proven. Encode allocates scratch (freed before returning).
 */
#include "tokenizer/bpe.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/unicode_tables.h"

#define BPE_HEADER_SIZE 128u
#define BPE_TOKEN_SIZE 16u
#define BPE_MERGE_SIZE 16u

#define TF_MODEL 0x1u      /* in the BPE model's vocabulary (ignore_merges lookups) */
#define TF_ADDED 0x2u      /* an added token, matched in the text before pre-tokenization */
#define TF_SPECIAL 0x4u    /* special: skipped by decode (not added: never matched in the text, tekken) */
#define TF_NORMALIZED 0x8u /* added token matched in the normalized text (else in the raw text) */
#define TF_KNOWN 0xFu

#define BF_IGNORE_MERGES 0x1u
#define BF_NFC 0x2u
#define BF_SPECIAL_SPLITS_DECODE 0x4u /* decode: each run of non-special tokens is made valid UTF-8 on its own */
#define BF_CHUNKED 0x8u /* encode each stretch between special tokens in parts, as Kimi's tiktoken class: every
                         * 400,000 code points, and inside each before the 25,001st code point of a run of
                         * whitespace (Python's isspace) or of other characters, and every 25,000 after */
#define BF_KNOWN 0xFu

enum { PAT_GPT2 = 1, PAT_QWEN2 = 2, PAT_LLAMA3 = 3, PAT_TEKKEN = 4, PAT_O200K = 5, PAT_DEEPSEEK_V3 = 6,
       PAT_DEEPSEEK_LLM = 7, PAT_KIMI_K2 = 8, PAT_LLAMA_DEFAULT = 9 };

#define EMPTY64 UINT64_MAX
#define EMPTY32 UINT32_MAX
#define HASH_MUL 0x9E3779B97F4A7C15ull
#define MAX_ENCODE_BYTES ((uint64_t)(INT32_MAX / 4))

static inline uint32_t rd_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline int32_t rd_i32(const uint8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t rd_u64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint16_t rd_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

static colibri_status fail(char *err, size_t err_len, colibri_status st, const char *fmt, ...) {
    if (err && err_len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, err_len, fmt, ap);
        va_end(ap);
    }
    return st;
}

static int range_ok(uint64_t off, uint64_t count, uint64_t elem, uint64_t size) {
    if (off > size) return 0;
    if (elem != 0 && count > (size - off) / elem) return 0;
    return 1;
}

/* ---- token records ---- */
static inline const uint8_t *tok_rec(const cb_bpe *b, int32_t id) { return b->tokens + (uint64_t)id * BPE_TOKEN_SIZE; }
static inline const uint8_t *tok_piece(const cb_bpe *b, int32_t id, uint32_t *len) {
    const uint8_t *r = tok_rec(b, id);
    *len = rd_u16(r + 8);
    return b->blob + rd_u32(r);
}
static inline const uint8_t *tok_bytes(const cb_bpe *b, int32_t id, uint32_t *len) {
    const uint8_t *r = tok_rec(b, id);
    *len = rd_u16(r + 10);
    return b->blob + rd_u32(r + 4);
}
static inline uint32_t tok_flags(const cb_bpe *b, int32_t id) { return tok_rec(b, id)[12]; }

/* ---- hashes ---- */
static inline uint64_t bytes_hash(const uint8_t *s, uint64_t n) { /* FNV-1a 64 */
    uint64_t h = 0xcbf29ce484222325ull;
    for (uint64_t i = 0; i < n; i++) h = (h ^ s[i]) * 0x100000001b3ull;
    return h;
}

/* Merge of (left, right): 1 and *rank, *merged, or 0. */
static inline int merge_get(const cb_bpe *b, uint32_t left, uint32_t right, uint32_t *rank, uint32_t *merged) {
    uint64_t key = ((uint64_t)left << 32) | right;
    uint64_t mask = ((uint64_t)1 << b->merges_log2) - 1;
    uint64_t i = (key * HASH_MUL) >> (64 - b->merges_log2);
    for (uint64_t probes = 0; probes <= mask; probes++) {
        const uint8_t *e = b->merges + i * BPE_MERGE_SIZE;
        uint64_t k = rd_u64(e);
        if (k == key) {
            *rank = rd_u32(e + 8);
            *merged = rd_u32(e + 12);
            return 1;
        }
        if (k == EMPTY64) return 0;
        i = (i + 1) & mask;
    }
    return 0;
}

/* Model-vocabulary token whose bytes are s[0..n), or -1. */
static int32_t vocab_get(const cb_bpe *b, const uint8_t *s, uint64_t n) {
    if (b->vhash == NULL) return -1;
    uint64_t mask = ((uint64_t)1 << b->vocab_log2) - 1;
    uint64_t i = (bytes_hash(s, n) * HASH_MUL) >> (64 - b->vocab_log2);
    for (uint64_t probes = 0; probes <= mask; probes++) {
        uint32_t id = rd_u32(b->vhash + 4 * i);
        if (id == EMPTY32) return -1;
        uint32_t tl;
        const uint8_t *t = tok_bytes(b, (int32_t)id, &tl);
        if (tl == n && memcmp(t, s, n) == 0) return (int32_t)id;
        i = (i + 1) & mask;
    }
    return -1;
}

/* ---- loading ---- */

static inline uint32_t utf8_valid_len(const uint8_t *s, uint64_t len); /* below, with the UTF-8 helpers */

colibri_status cb_bpe_load(cb_bpe *b, const uint8_t *data, uint64_t size, char *err, size_t err_len) {
    const colibri_status F = COLIBRI_E_FORMAT;
    memset(b, 0, sizeof *b);
    uint32_t hsize = rd_u32(data + 16);
    if (hsize < BPE_HEADER_SIZE || hsize > size)
        return fail(err, err_len, F, "tokenizer section: header_size %u is invalid", hsize);
    uint32_t n_tokens = rd_u32(data + 20);
    int32_t ids4[4] = {rd_i32(data + 24), rd_i32(data + 28), rd_i32(data + 32), rd_i32(data + 36)};
    uint32_t flags = rd_u32(data + 40), pattern = rd_u32(data + 44), n_merges = rd_u32(data + 48);
    uint32_t merges_log2 = rd_u32(data + 52);
    uint64_t tokens_off = rd_u64(data + 56), merges_off = rd_u64(data + 64), vhash_off = rd_u64(data + 72);
    uint32_t vocab_log2 = rd_u32(data + 80), n_added = rd_u32(data + 84);
    uint64_t added_off = rd_u64(data + 88), blob_off = rd_u64(data + 96), blob_size = rd_u64(data + 104);
    uint64_t byte_ids_off = rd_u64(data + 112), reserved = rd_u64(data + 120);

    if (n_tokens < 256 || n_tokens > (uint32_t)INT32_MAX)
        return fail(err, err_len, F, "tokenizer section: byte-level BPE with %u tokens (needs 256..2^31-1)", n_tokens);
    static const char *names4[4] = {"bos_id", "eos_id", "unk_id", "pad_id"};
    for (int i = 0; i < 4; i++)
        if (ids4[i] < -1 || ids4[i] >= (int32_t)n_tokens)
            return fail(err, err_len, F, "tokenizer section: %s %d is outside -1..%u", names4[i], ids4[i], n_tokens - 1);
    if (flags & ~BF_KNOWN)
        return fail(err, err_len, COLIBRI_E_UNSUPPORTED,
                    "tokenizer section: unknown byte-level BPE flag bits 0x%x (written by a newer converter?)",
                    flags & ~BF_KNOWN);
    if (pattern < PAT_GPT2 || pattern > PAT_LLAMA_DEFAULT)
        return fail(err, err_len, COLIBRI_E_UNSUPPORTED,
                    "tokenizer section: pre-tokenizer pattern %u is not supported by this build "
                    "(1 gpt2, 2 qwen2, 3 llama3, 4 tekken, 5 o200k, 6 deepseek_v3, 7 deepseek_llm, 8 kimi_k2, "
                    "9 llama_default)",
                    pattern);
    if (reserved != 0) return fail(err, err_len, F, "tokenizer section: reserved header bytes are not zero");
    if (merges_log2 < 1 || merges_log2 > 31 || vocab_log2 > 31 || n_merges >= ((uint64_t)1 << merges_log2) ||
        (vocab_log2 > 0 && n_tokens >= ((uint64_t)1 << vocab_log2)) || ((flags & BF_IGNORE_MERGES) && vocab_log2 == 0))
        return fail(err, err_len, F, "tokenizer section: hash table sizes are invalid");
    if (!range_ok(tokens_off, n_tokens, BPE_TOKEN_SIZE, size) ||
        !range_ok(merges_off, (uint64_t)1 << merges_log2, BPE_MERGE_SIZE, size) ||
        (vocab_log2 > 0 && !range_ok(vhash_off, (uint64_t)1 << vocab_log2, 4, size)) ||
        !range_ok(added_off, n_added, 4, size) || !range_ok(blob_off, blob_size, 1, size) ||
        !range_ok(byte_ids_off, 256, 4, size) || n_added > n_tokens)
        return fail(err, err_len, F, "tokenizer section: an array lies outside the %llu-byte section (truncated or corrupt file)",
                    (unsigned long long)size);
    if (tokens_off < hsize || merges_off < hsize || (vocab_log2 > 0 && vhash_off < hsize) || added_off < hsize ||
        blob_off < hsize || byte_ids_off < hsize || (tokens_off | added_off | byte_ids_off) % 4 ||
        merges_off % 8 || (vocab_log2 > 0 && vhash_off % 4))
        return fail(err, err_len, F, "tokenizer section: an array overlaps the header or is misaligned");

    b->base = data;
    b->size = size;
    b->tokens = data + tokens_off;
    b->merges = data + merges_off;
    b->vhash = vocab_log2 ? data + vhash_off : NULL;
    b->added = data + added_off;
    b->blob = data + blob_off;
    b->blob_size = blob_size;
    b->byte_ids = data + byte_ids_off;
    b->n_tokens = (int32_t)n_tokens;
    b->bos_id = ids4[0];
    b->eos_id = ids4[1];
    b->unk_id = ids4[2];
    b->pad_id = ids4[3];
    b->flags = flags;
    b->pattern = pattern;
    b->n_merges = n_merges;
    b->merges_log2 = merges_log2;
    b->vocab_log2 = vocab_log2;
    b->n_added = n_added;

    /* Tokens: strings inside the blob, known flags, zero reserved bytes. */
    uint64_t n_model = 0, n_added_flag = 0;
    for (uint32_t i = 0; i < n_tokens; i++) {
        const uint8_t *r = tok_rec(b, (int32_t)i);
        uint32_t po = rd_u32(r), bo = rd_u32(r + 4), pl = rd_u16(r + 8), bl = rd_u16(r + 10), fl = r[12];
        if (pl == 0 || !range_ok(po, pl, 1, blob_size) || !range_ok(bo, bl, 1, blob_size) || (fl & ~TF_KNOWN) ||
            r[13] || r[14] || r[15] || ((fl & TF_MODEL) && bl == 0) ||
            ((fl & TF_NORMALIZED) && !(fl & TF_ADDED))) {
            memset(b, 0, sizeof *b);
            return fail(err, err_len, F, "tokenizer section: token %u has an invalid record", i);
        }
        if (fl & TF_MODEL) n_model++;
        if (fl & TF_ADDED) n_added_flag++;
    }
    if (n_added_flag != n_added) {
        memset(b, 0, sizeof *b);
        return fail(err, err_len, F, "tokenizer section: %llu tokens are flagged added, the added list has %u",
                    (unsigned long long)n_added_flag, n_added);
    }
    for (int i = 0; i < 256; i++) {
        int32_t id = rd_i32(b->byte_ids + 4 * i);
        uint32_t bl;
        const uint8_t *bs = (id >= 0 && id < (int32_t)n_tokens) ? tok_bytes(b, id, &bl) : NULL;
        if (bs == NULL || bl != 1 || bs[0] != (uint8_t)i || !(tok_flags(b, id) & TF_MODEL)) {
            memset(b, 0, sizeof *b);
            return fail(err, err_len, F, "tokenizer section: byte table entry %d is not a model token of that byte", i);
        }
        b->byte_id[i] = id;
    }
    /* Added tokens: each flagged added, listed once (by the flag count), ordered longest first. */
    for (uint32_t k = 0; k < n_added; k++) {
        int32_t id = rd_i32(b->added + 4 * (uint64_t)k);
        if (id < 0 || id >= (int32_t)n_tokens || !(tok_flags(b, id) & TF_ADDED)) {
            memset(b, 0, sizeof *b);
            return fail(err, err_len, F, "tokenizer section: added token entry %u (id %d) is invalid", k, id);
        }
        uint32_t pl;
        const uint8_t *p = tok_piece(b, id, &pl);
        /* Added tokens are matched byte-wise in the (valid UTF-8) text; a piece that is not
         * whole UTF-8 characters (tokenizer.json strings always are) could split the text
         * inside a character, and the pre-tokenizer, which decodes the pieces between added
         * tokens as valid UTF-8, would then read past the end of the caller's text. */
        for (uint32_t q = 0; q < pl;) {
            uint32_t cl = utf8_valid_len(p + q, pl - q);
            if (cl == 0) {
                memset(b, 0, sizeof *b);
                return fail(err, err_len, F, "tokenizer section: added token %d is not valid UTF-8", id);
            }
            q += cl;
        }
        if (k > 0) {
            uint32_t ql;
            tok_piece(b, rd_i32(b->added + 4 * (uint64_t)(k - 1)), &ql);
            if (ql < pl) {
                memset(b, 0, sizeof *b);
                return fail(err, err_len, F, "tokenizer section: the added tokens are not sorted longest first");
            }
        }
        int pass = (tok_flags(b, id) & TF_NORMALIZED) ? 1 : 0;
        b->added_first[pass][p[0] >> 3] |= (uint8_t)(1u << (p[0] & 7));
    }
    /* Merges: every entry findable (so probing terminates and finds it), ids in range,
     * merged bytes = left bytes + right bytes, exactly n_merges entries. */
    {
        uint64_t slots = (uint64_t)1 << merges_log2, used = 0;
        for (uint64_t s = 0; s < slots; s++) {
            const uint8_t *e = b->merges + s * BPE_MERGE_SIZE;
            uint64_t key = rd_u64(e);
            if (key == EMPTY64) continue;
            used++;
            uint32_t l = (uint32_t)(key >> 32), r = (uint32_t)key, merged = rd_u32(e + 12), rk, mg;
            if (l >= n_tokens || r >= n_tokens || merged >= n_tokens || !merge_get(b, l, r, &rk, &mg) ||
                rk != rd_u32(e + 8) || mg != merged) {
                memset(b, 0, sizeof *b);
                return fail(err, err_len, F, "tokenizer section: merge table slot %llu is invalid", (unsigned long long)s);
            }
            uint32_t ll, rl, ml;
            const uint8_t *lb = tok_bytes(b, (int32_t)l, &ll), *rb = tok_bytes(b, (int32_t)r, &rl);
            const uint8_t *mb = tok_bytes(b, (int32_t)merged, &ml);
            if (ml != ll + rl || memcmp(mb, lb, ll) != 0 || memcmp(mb + ll, rb, rl) != 0) {
                memset(b, 0, sizeof *b);
                return fail(err, err_len, F, "tokenizer section: merge table slot %llu does not spell its merged token",
                            (unsigned long long)s);
            }
        }
        if (used != n_merges) {
            memset(b, 0, sizeof *b);
            return fail(err, err_len, F, "tokenizer section: the merge table holds %llu merges, the header says %u",
                        (unsigned long long)used, n_merges);
        }
    }
    /* Vocabulary hash: exactly the model tokens, each findable. Two passes: every slot's
     * id is range-checked before any lookup, because vocab_get probes from a token's home
     * slot onwards (wrapping) and would otherwise read the record of a not-yet-checked
     * slot's id far outside the token array (a corrupt file could crash the load). */
    if (vocab_log2) {
        uint64_t slots = (uint64_t)1 << vocab_log2, used = 0;
        for (uint64_t s = 0; s < slots; s++) {
            uint32_t id = rd_u32(b->vhash + 4 * s);
            if (id != EMPTY32 && id >= n_tokens) {
                memset(b, 0, sizeof *b);
                return fail(err, err_len, F, "tokenizer section: vocabulary hash slot %llu holds id %u, outside 0..%u",
                            (unsigned long long)s, id, n_tokens - 1);
            }
        }
        for (uint64_t s = 0; s < slots; s++) {
            uint32_t id = rd_u32(b->vhash + 4 * s);
            if (id == EMPTY32) continue;
            used++;
            uint32_t bl;
            const uint8_t *bs;
            if (!(tok_flags(b, (int32_t)id) & TF_MODEL) ||
                (bs = tok_bytes(b, (int32_t)id, &bl), vocab_get(b, bs, bl) != (int32_t)id)) {
                memset(b, 0, sizeof *b);
                return fail(err, err_len, F, "tokenizer section: vocabulary hash slot %llu is invalid (or two model tokens share bytes)",
                            (unsigned long long)s);
            }
        }
        if (used != n_model) {
            memset(b, 0, sizeof *b);
            return fail(err, err_len, F, "tokenizer section: the vocabulary hash holds %llu tokens, %llu are model tokens",
                        (unsigned long long)used, (unsigned long long)n_model);
        }
    }
    return COLIBRI_OK;
}

void cb_bpe_piece(const cb_bpe *b, int32_t id, const char **piece, uint64_t *len) {
    uint32_t l;
    *piece = (const char *)tok_piece(b, id, &l);
    *len = l;
}

const uint8_t *cb_bpe_token_bytes(const cb_bpe *b, int32_t id, uint32_t *len, int *special) {
    if (tok_flags(b, id) & TF_SPECIAL) {
        *special = 1;
        return tok_piece(b, id, len);
    }
    *special = 0;
    return tok_bytes(b, id, len);
}

/* ---- UTF-8 ---- */

/* Length of the well-formed UTF-8 character at s[0..len) (len >= 1), or 0 if malformed. */
static inline uint32_t utf8_valid_len(const uint8_t *s, uint64_t len) {
    uint8_t c = s[0];
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) return (len >= 2 && (s[1] & 0xC0) == 0x80) ? 2 : 0;
    if (c >= 0xE0 && c <= 0xEF) {
        if (len < 3) return 0;
        uint8_t lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
        return (s[1] >= lo && s[1] <= hi && (s[2] & 0xC0) == 0x80) ? 3 : 0;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        if (len < 4) return 0;
        uint8_t lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
        return (s[1] >= lo && s[1] <= hi && (s[2] & 0xC0) == 0x80 && (s[3] & 0xC0) == 0x80) ? 4 : 0;
    }
    return 0;
}

/* Length of the maximal malformed subpart at s (≥ 1): the longest prefix of a well-formed
 * sequence, or 1 byte (Unicode "maximal subpart" practice, Rust's from_utf8_lossy). */
static inline uint32_t utf8_bad_len(const uint8_t *s, uint64_t len) {
    uint8_t c = s[0];
    uint32_t need;
    uint8_t lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) need = 1;
    else if (c >= 0xE0 && c <= 0xEF) { need = 2; if (c == 0xE0) lo = 0xA0; if (c == 0xED) hi = 0x9F; }
    else if (c >= 0xF0 && c <= 0xF4) { need = 3; if (c == 0xF0) lo = 0x90; if (c == 0xF4) hi = 0x8F; }
    else return 1;
    uint32_t k = 1;
    while (k <= need && k < len && s[k] >= lo && s[k] <= hi) { k++; lo = 0x80; hi = 0xBF; }
    return k; /* k <= need here: a complete character is not malformed */
}

/* Decode the valid character at s[pos] (the text is known to be valid UTF-8). */
static inline uint32_t dec(const uint8_t *s, uint64_t pos, uint32_t *cp) {
    uint8_t c = s[pos];
    if (c < 0x80) { *cp = c; return 1; }
    if (c < 0xE0) { *cp = ((uint32_t)(c & 0x1F) << 6) | (s[pos + 1] & 0x3Fu); return 2; }
    if (c < 0xF0) {
        *cp = ((uint32_t)(c & 0x0F) << 12) | ((uint32_t)(s[pos + 1] & 0x3F) << 6) | (s[pos + 2] & 0x3Fu);
        return 3;
    }
    *cp = ((uint32_t)(c & 0x07) << 18) | ((uint32_t)(s[pos + 1] & 0x3F) << 12) | ((uint32_t)(s[pos + 2] & 0x3F) << 6) |
          (s[pos + 3] & 0x3Fu);
    return 4;
}

static inline uint32_t enc_utf8(uint32_t cp, uint8_t *o) {
    if (cp < 0x80) { o[0] = (uint8_t)cp; return 1; }
    if (cp < 0x800) { o[0] = (uint8_t)(0xC0 | (cp >> 6)); o[1] = (uint8_t)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        o[0] = (uint8_t)(0xE0 | (cp >> 12)); o[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F)); o[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (uint8_t)(0xF0 | (cp >> 18)); o[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F)); o[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

/* ---- character classes of the split patterns ---- */
static inline int is_L(uint32_t cp) { int c = cb_ucat(cp); return c >= UC_Lu && c <= UC_Lo; }
static inline int is_N(uint32_t cp) { int c = cb_ucat(cp); return c >= UC_Nd && c <= UC_No; }
static inline int is_S(uint32_t cp) { return cb_uspace(cp); }
/* [^\s\p{L}\p{N}] */
static inline int is_X(uint32_t cp) { int c = cb_ucat(cp); return !(c >= UC_Lu && c <= UC_Lo) && !(c >= UC_Nd && c <= UC_No) && !cb_uspace(cp); }

static inline uint64_t run_L(const uint8_t *s, uint64_t len, uint64_t p) {
    uint32_t cp;
    while (p < len) { uint32_t l = dec(s, p, &cp); if (!is_L(cp)) break; p += l; }
    return p;
}
static inline uint64_t run_N(const uint8_t *s, uint64_t len, uint64_t p, uint32_t max) {
    uint32_t cp, k = 0;
    while (p < len && k < max) { uint32_t l = dec(s, p, &cp); if (!is_N(cp)) break; p += l; k++; }
    return p;
}
static inline uint64_t run_X(const uint8_t *s, uint64_t len, uint64_t p) {
    uint32_t cp;
    while (p < len) { uint32_t l = dec(s, p, &cp); if (!is_X(cp)) break; p += l; }
    return p;
}

/* The whitespace alternatives at p (s[p] is whitespace): [\s*[\r\n]+ when `newline`], then
 * \s+(?!\S), then \s+. */
static uint64_t match_space(const uint8_t *s, uint64_t len, uint64_t p, int newline) {
    uint64_t r = p, last = p, nl_end = 0;
    uint32_t cp, n = 0;
    while (r < len) {
        uint32_t l = dec(s, r, &cp);
        if (!is_S(cp)) break;
        last = r;
        r += l;
        n++;
        if (cp == '\r' || cp == '\n') nl_end = r;
    }
    if (newline && nl_end) return nl_end;
    if (r == len) return r;
    return n >= 2 ? last : r;
}

/* GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static uint64_t match_gpt2(const uint8_t *s, uint64_t len, uint64_t pos) {
    uint32_t c0, c;
    uint32_t l0 = dec(s, pos, &c0);
    if (c0 == '\'' && pos + 1 < len) {
        uint8_t a = s[pos + 1];
        if (a == 's' || a == 't' || a == 'm' || a == 'd') return pos + 2;
        if (pos + 2 < len) {
            uint8_t z = s[pos + 2];
            if ((a == 'r' && z == 'e') || (a == 'v' && z == 'e') || (a == 'l' && z == 'l')) return pos + 3;
        }
    }
    uint64_t p = pos;
    c = c0;
    if (c0 == ' ' && pos + 1 < len) {
        p = pos + 1;
        dec(s, p, &c);
    }
    if (is_L(c)) return run_L(s, len, p);
    if (is_N(c)) return run_N(s, len, p, UINT32_MAX);
    if (!is_S(c)) return run_X(s, len, p);
    (void)l0;
    return match_space(s, len, pos, 0);
}

/* Case-insensitive letter of the contractions: the ASCII lower-case letter, or 0.
 * Oniguruma folds U+017F (long s) to 's'; no other character folds to these letters. */
static inline uint32_t fold_c(uint32_t cp) {
    if (cp == 0x17F) return 's';
    if (cp >= 'A' && cp <= 'Z') return cp + 32;
    return cp < 0x80 ? cp : 0;
}

/* Qwen2 (digits = 1) / Llama-3 (digits = 3):
 * (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,digits}| ?[^\s\p{L}\p{N}]+[\r\n]*|
 * \s*[\r\n]+|\s+(?!\S)|\s+ */
static uint64_t match_qwen(const uint8_t *s, uint64_t len, uint64_t pos, uint32_t digits) {
    uint32_t c0, c1 = 0;
    uint32_t l0 = dec(s, pos, &c0);
    uint32_t l1 = 0;
    if (pos + l0 < len) l1 = dec(s, pos + l0, &c1);
    if (c0 == '\'' && l1) {
        uint32_t f1 = fold_c(c1);
        if (f1 == 's' || f1 == 't' || f1 == 'm' || f1 == 'd') return pos + l0 + l1;
        if ((f1 == 'r' || f1 == 'v' || f1 == 'l') && pos + l0 + l1 < len) {
            uint32_t c2;
            uint32_t l2 = dec(s, pos + l0 + l1, &c2);
            uint32_t f2 = fold_c(c2);
            if (((f1 == 'r' || f1 == 'v') && f2 == 'e') || (f1 == 'l' && f2 == 'l')) return pos + l0 + l1 + l2;
        }
    }
    if (is_L(c0)) return run_L(s, len, pos);
    int n0 = is_N(c0);
    if (!n0 && c0 != '\r' && c0 != '\n' && l1 && is_L(c1)) return run_L(s, len, pos + l0);
    if (n0) return run_N(s, len, pos, digits);
    uint64_t p = len + 1;
    if (!is_S(c0)) p = run_X(s, len, pos);
    else if (c0 == ' ' && l1 && is_X(c1)) p = run_X(s, len, pos + 1);
    if (p <= len) {
        while (p < len && (s[p] == '\r' || s[p] == '\n')) p++;
        return p;
    }
    return match_space(s, len, pos, 1);
}

/* Tekken (Mistral's tiktoken vocabularies):
 * [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|
 * [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|
 *  ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * (backtracking, leftmost alternative first: fancy-regex / PCRE semantics). Note that marks
 * (\p{M}) are in both letter classes and also in [^\r\n\p{L}\p{N}] and [^\s\p{L}\p{N}]. */
static inline int cat_M(int c) { return c >= UC_Mn && c <= UC_Me; }
static inline int cat_U(int c) { return c == UC_Lu || c == UC_Lt || c == UC_Lm || c == UC_Lo || cat_M(c); }
static inline int cat_W(int c) { return c == UC_Ll || c == UC_Lm || c == UC_Lo || cat_M(c); }
/* [^\r\n\p{L}\p{N}] */
static inline int tk_P(uint32_t cp) {
    if (cp == '\r' || cp == '\n') return 0;
    int c = cb_ucat(cp);
    return !(c >= UC_Lu && c <= UC_Lo) && !(c >= UC_Nd && c <= UC_No);
}
/* The letter classes with \p{Han} taken out when `han` (Kimi's [\p{Lu}..\p{M}&&[^\p{Han}]]) */
static inline int tk_U(uint32_t cp, int han) { return cat_U(cb_ucat(cp)) && !(han && cb_uhan(cp)); }
static inline int tk_W(uint32_t cp, int han) { return cat_W(cb_ucat(cp)) && !(han && cb_uhan(cp)); }
static inline uint64_t run_U(const uint8_t *s, uint64_t len, uint64_t p, int han) {
    uint32_t cp;
    while (p < len) { uint32_t l = dec(s, p, &cp); if (!tk_U(cp, han)) break; p += l; }
    return p;
}
static inline uint64_t run_W(const uint8_t *s, uint64_t len, uint64_t p, int han) {
    uint32_t cp;
    while (p < len) { uint32_t l = dec(s, p, &cp); if (!tk_W(cp, han)) break; p += l; }
    return p;
}
/* [U]*[W]+ at q, with backtracking: the end of the match, or 0 when there is none. U* takes
 * the longest run e; if s[e] is in W (then Ll: Lm, Lo, M would be in the run, and an Ll is
 * never Han) W+ runs from e; else U* gives back characters until one in W is last (W+ is
 * then that one character, the next being outside W), i.e. the match ends after the run's
 * last W character. */
static uint64_t tk_upper_lower(const uint8_t *s, uint64_t len, uint64_t q, int han) {
    uint64_t p = q, last_w_end = 0;
    uint32_t cp;
    while (p < len) {
        uint32_t l = dec(s, p, &cp);
        int c = cb_ucat(cp);
        if (!cat_U(c) || (han && cb_uhan(cp))) {
            if (c == UC_Ll) return run_W(s, len, p, han);
            break;
        }
        p += l;
        if (cat_W(c)) last_w_end = p;
    }
    return last_w_end;
}

/* (?i:'s|'t|'re|'ve|'m|'ll|'d)? at p: the end of the optional contraction suffix of o200k's
 * letter alternatives (p itself when there is none; it never fails). */
static uint64_t opt_contraction(const uint8_t *s, uint64_t len, uint64_t p) {
    if (p + 1 >= len || s[p] != '\'') return p;
    uint32_t c1, c2;
    uint32_t l1 = dec(s, p + 1, &c1);
    uint32_t f1 = fold_c(c1);
    if (f1 == 's' || f1 == 't' || f1 == 'm' || f1 == 'd') return p + 1 + l1;
    if ((f1 == 'r' || f1 == 'v' || f1 == 'l') && p + 1 + l1 < len) {
        uint32_t l2 = dec(s, p + 1 + l1, &c2);
        uint32_t f2 = fold_c(c2);
        if (((f1 == 'r' || f1 == 'v') && f2 == 'e') || (f1 == 'l' && f2 == 'l')) return p + 1 + l1 + l2;
    }
    return p;
}

/* The tiktoken-style patterns: Mistral's tekken (TK_TEKKEN), OpenAI's o200k (TK_O200K,
 * gpt-oss) and Moonshot's Kimi (TK_KIMI). o200k is tekken's pattern with
 * (?i:'s|'t|'re|'ve|'m|'ll|'d)? after both letter alternatives and \p{N}{1,3} for \p{N}:
 * [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|...)?|
 * [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|...)?|\p{N}{1,3}|
 *  ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * Kimi's puts [\p{Han}]+ first, takes \p{Han} out of the letter classes
 * ([\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]], [\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]) and ends
 * the punctuation alternative with [\r\n]* (no '/'). The optional suffix cannot fail, so it
 * never makes the regex backtrack into the letters: it is appended to the letter match
 * tekken's rules find. */
enum { TK_TEKKEN = 0, TK_O200K = 1, TK_KIMI = 2 };
static uint64_t match_tekken(const uint8_t *s, uint64_t len, uint64_t pos, int kind) {
    uint32_t c0, c1 = 0;
    uint32_t l0 = dec(s, pos, &c0);
    const int han = kind == TK_KIMI, o200k = kind != TK_TEKKEN, slash = kind != TK_KIMI;
    /* [\p{Han}]+ */
    if (han && cb_uhan(c0)) {
        uint64_t p = pos + l0;
        while (p < len) { uint32_t l = dec(s, p, &c1); if (!cb_uhan(c1)) break; p += l; }
        return p;
    }
    int p0 = tk_P(c0);
    uint64_t e = 0;
    /* [P]?[U]*[W]+ */
    if (p0 && pos + l0 < len) e = tk_upper_lower(s, len, pos + l0, han);
    if (e == 0) e = tk_upper_lower(s, len, pos, han);
    /* [P]?[U]+[W]* */
    if (e == 0 && p0 && run_U(s, len, pos + l0, han) > pos + l0) e = run_W(s, len, run_U(s, len, pos + l0, han), han);
    if (e == 0 && run_U(s, len, pos, han) > pos) e = run_W(s, len, run_U(s, len, pos, han), han);
    if (e != 0) return o200k ? opt_contraction(s, len, e) : e;
    /* \p{N} (tekken) or \p{N}{1,3} */
    if (is_N(c0)) return o200k ? run_N(s, len, pos, 3) : pos + l0;
    /*  ?[^\s\p{L}\p{N}]+[\r\n/]* (Kimi: [\r\n]*) */
    uint64_t p = len + 1;
    if (c0 == ' ' && pos + 1 < len && (dec(s, pos + 1, &c1), is_X(c1))) p = run_X(s, len, pos + 1);
    else if (is_X(c0)) p = run_X(s, len, pos);
    if (p <= len) {
        while (p < len && (s[p] == '\r' || s[p] == '\n' || (slash && s[p] == '/'))) p++;
        return p;
    }
    /* \s*[\r\n]+|\s+(?!\S)|\s+ */
    return match_space(s, len, pos, 1);
}

/* DeepSeek-V3: three Isolated splits in sequence, each applied to the pieces of the one before
 * (a piece is a match or the unmatched stretch between two matches):
 *   1. \p{N}{1,3}
 *   2. [\u4E00-\u9FA5\u3040-\u309F\u30A0-\u30FF]+
 *   3. [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|
 *       ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * (Oniguruma, leftmost alternative first). */
static inline int is_PS(uint32_t cp) { int c = cb_ucat(cp); return c >= UC_Pc && c <= UC_So; }
static inline int is_LM(uint32_t cp) { int c = cb_ucat(cp); return (c >= UC_Lu && c <= UC_Lo) || cat_M(c); }
static inline int ds_cjk(uint32_t cp) {
    return (cp >= 0x4E00 && cp <= 0x9FA5) || (cp >= 0x3040 && cp <= 0x30FF);
}
static inline int ds_ascii_punct(uint32_t cp) {
    return (cp >= '!' && cp <= '/') || (cp >= ':' && cp <= '@') || (cp >= '[' && cp <= '`') || (cp >= '{' && cp <= '~');
}
static inline int ds_ascii_alpha(uint8_t c) { return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z'); }
static inline uint64_t run_LM(const uint8_t *s, uint64_t len, uint64_t p) {
    uint32_t cp;
    while (p < len) { uint32_t l = dec(s, p, &cp); if (!is_LM(cp)) break; p += l; }
    return p;
}
static inline uint64_t run_PS(const uint8_t *s, uint64_t len, uint64_t p) {
    uint32_t cp;
    while (p < len) { uint32_t l = dec(s, p, &cp); if (!is_PS(cp)) break; p += l; }
    return p;
}

/* Split 3 at pos: the end of its match there, or 0 when no alternative matches. */
static uint64_t match_ds3(const uint8_t *s, uint64_t len, uint64_t pos) {
    uint32_t c0, c1 = 0;
    uint32_t l0 = dec(s, pos, &c0);
    uint32_t l1 = 0;
    if (pos + l0 < len) l1 = dec(s, pos + l0, &c1);
    /* [ASCII punctuation][A-Za-z]+ */
    if (ds_ascii_punct(c0) && l1 && ds_ascii_alpha(s[pos + 1])) {
        uint64_t p = pos + 1;
        while (p < len && ds_ascii_alpha(s[p])) p++;
        return p;
    }
    /* [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+ (a mark is in both classes: the run from pos) */
    if (is_LM(c0)) return run_LM(s, len, pos);
    if (c0 != '\r' && c0 != '\n' && !is_PS(c0) && l1 && is_LM(c1)) return run_LM(s, len, pos + l0);
    /*  ?[\p{P}\p{S}]+[\r\n]* */
    uint64_t p = 0;
    if (is_PS(c0)) p = run_PS(s, len, pos);
    else if (c0 == ' ' && l1 && is_PS(c1)) p = run_PS(s, len, pos + 1);
    if (p) {
        while (p < len && (s[p] == '\r' || s[p] == '\n')) p++;
        return p;
    }
    /* \s*[\r\n]+|\s+(?!\S)|\s+ */
    if (is_S(c0)) return match_space(s, len, pos, 1);
    return 0;
}

/* ---- NFC ---- */
#define SB 0xAC00u
#define LB 0x1100u
#define VB 0x1161u
#define TB 0x11A7u
#define LC 19u
#define VC 21u
#define TC 28u
#define NC (VC * TC)
#define SC (LC * NC)

static uint32_t compose2(uint32_t a, uint32_t b) {
    if (a >= LB && a < LB + LC && b >= VB && b < VB + VC) return SB + ((a - LB) * VC + (b - VB)) * TC;
    if (a >= SB && a < SB + SC && (a - SB) % TC == 0 && b > TB && b < TB + TC) return a + (b - TB);
    return cb_ucomp(a, b);
}

/* NFC of valid UTF-8 s[0..n) into a malloc'd buffer (*out, *out_len); 0 on allocation failure. */
static int nfc(const uint8_t *s, uint64_t n, uint8_t **out, uint64_t *out_len) {
    /* decomposed length: at most 18 code points per input code point (U+FDFA), bound by 18 n */
    uint64_t cap = 0, k = 0;
    for (uint64_t p = 0; p < n;) {
        uint32_t cp, m;
        const uint32_t *d;
        p += dec(s, p, &cp);
        if (cp >= SB && cp < SB + SC) cap += 3;
        else if (cb_udecomp(cp, &d, &m)) cap += m;
        else cap += 1;
    }
    uint32_t *buf = (uint32_t *)malloc((size_t)(cap ? cap : 1) * sizeof(uint32_t));
    uint8_t *o = (uint8_t *)malloc((size_t)(4 * cap + 1));
    if (buf == NULL || o == NULL) { free(buf); free(o); return 0; }
    for (uint64_t p = 0; p < n;) {
        uint32_t cp, m;
        const uint32_t *d;
        p += dec(s, p, &cp);
        if (cp >= SB && cp < SB + SC) {
            uint32_t si = cp - SB;
            buf[k++] = LB + si / NC;
            buf[k++] = VB + (si % NC) / TC;
            if (si % TC) buf[k++] = TB + si % TC;
        } else if (cb_udecomp(cp, &d, &m)) {
            for (uint32_t i = 0; i < m; i++) buf[k++] = d[i];
        } else {
            buf[k++] = cp;
        }
    }
    /* canonical ordering: stable sort of each run of non-starters by combining class */
    for (uint64_t i = 1; i < k; i++) {
        int ci = cb_uccc(buf[i]);
        if (ci == 0) continue;
        uint64_t j = i;
        uint32_t v = buf[i];
        while (j > 0) {
            int cj = cb_uccc(buf[j - 1]);
            if (cj == 0 || cj <= ci) break;
            buf[j] = buf[j - 1];
            j--;
        }
        buf[j] = v;
    }
    /* canonical composition */
    uint64_t w = 0;
    if (k > 0) {
        uint64_t starter = 0;
        int last_class = cb_uccc(buf[0]);
        int have_starter = last_class == 0;
        if (last_class != 0) last_class = 256;
        w = 1;
        for (uint64_t i = 1; i < k; i++) {
            uint32_t ch = buf[i];
            int cc = cb_uccc(ch);
            if (have_starter && (last_class < cc || last_class == 0)) {
                uint32_t comp = compose2(buf[starter], ch);
                if (comp) {
                    buf[starter] = comp;
                    continue;
                }
            }
            if (cc == 0) {
                starter = w;
                have_starter = 1;
            }
            last_class = cc;
            buf[w++] = ch;
        }
    }
    uint64_t ol = 0;
    for (uint64_t i = 0; i < w; i++) ol += enc_utf8(buf[i], o + ol);
    free(buf);
    *out = o;
    *out_len = ol;
    return 1;
}

/* ---- encode ---- */

typedef struct {
    uint32_t rank, pos, id;
} bmerge_t;

typedef struct {
    int32_t id, prev, next;
    uint32_t len;
} bsym_t;

typedef struct {
    const cb_bpe *b;
    int32_t *out;
    int64_t cap, n;
    bsym_t *sym;
    uint64_t sym_cap;
    bmerge_t *heap;
    uint64_t heap_n, heap_cap;
} benc_t;

static inline void emit(benc_t *e, int32_t id) {
    if (e->n < e->cap) e->out[e->n] = id;
    e->n++;
}

static inline int m_less(const bmerge_t *a, const bmerge_t *c) { /* a pops before c */
    return a->rank < c->rank || (a->rank == c->rank && a->pos < c->pos);
}

static int hpush(benc_t *e, bmerge_t m) {
    if (e->heap_n == e->heap_cap) {
        uint64_t nc = e->heap_cap ? 2 * e->heap_cap : 256;
        bmerge_t *nv = (bmerge_t *)realloc(e->heap, (size_t)nc * sizeof *nv);
        if (nv == NULL) return 0;
        e->heap = nv;
        e->heap_cap = nc;
    }
    uint64_t i = e->heap_n++;
    while (i > 0) {
        uint64_t par = (i - 1) / 2;
        if (!m_less(&m, &e->heap[par])) break;
        e->heap[i] = e->heap[par];
        i = par;
    }
    e->heap[i] = m;
    return 1;
}

static bmerge_t hpop(benc_t *e) {
    bmerge_t top = e->heap[0], last = e->heap[--e->heap_n];
    uint64_t i = 0, n = e->heap_n;
    for (;;) {
        uint64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && m_less(&e->heap[c + 1], &e->heap[c])) c++;
        if (!m_less(&e->heap[c], &last)) break;
        e->heap[i] = e->heap[c];
        i = c;
    }
    if (n > 0) e->heap[i] = last;
    return top;
}

/* BPE of one pre-token (bytes w[0..n)): Word::merge_all of `tokenizers`. */
static int bpe_word(benc_t *e, const uint8_t *w, uint64_t n) {
    const cb_bpe *b = e->b;
    if (n == 0) return 1;
    if (n == 1) { emit(e, b->byte_id[w[0]]); return 1; }
    if (b->flags & BF_IGNORE_MERGES) {
        int32_t id = vocab_get(b, w, n);
        if (id >= 0) { emit(e, id); return 1; }
    }
    if (n > e->sym_cap) {
        uint64_t nc = n < 256 ? 256 : n;
        bsym_t *ns = (bsym_t *)realloc(e->sym, (size_t)nc * sizeof *ns);
        if (ns == NULL) return 0;
        e->sym = ns;
        e->sym_cap = nc;
    }
    bsym_t *sy = e->sym;
    for (uint64_t i = 0; i < n; i++) {
        sy[i].id = b->byte_id[w[i]];
        sy[i].prev = (int32_t)i - 1;
        sy[i].next = (i + 1 < n) ? (int32_t)i + 1 : -1;
        sy[i].len = 1;
    }
    e->heap_n = 0;
    uint32_t rank, mid;
    for (uint64_t i = 0; i + 1 < n; i++)
        if (merge_get(b, (uint32_t)sy[i].id, (uint32_t)sy[i + 1].id, &rank, &mid))
            if (!hpush(e, (bmerge_t){rank, (uint32_t)i, mid})) return 0;
    while (e->heap_n > 0) {
        bmerge_t top = hpop(e);
        bsym_t *cur = &sy[top.pos];
        if (cur->len == 0 || cur->next < 0) continue;
        bsym_t *right = &sy[cur->next];
        if (!merge_get(b, (uint32_t)cur->id, (uint32_t)right->id, &rank, &mid) || mid != top.id) continue;
        cur->id = (int32_t)top.id;
        cur->len += right->len;
        cur->next = right->next;
        right->len = 0;
        if (cur->next >= 0) sy[cur->next].prev = (int32_t)top.pos;
        if (cur->prev >= 0 && merge_get(b, (uint32_t)sy[cur->prev].id, (uint32_t)cur->id, &rank, &mid))
            if (!hpush(e, (bmerge_t){rank, (uint32_t)cur->prev, mid})) return 0;
        if (cur->next >= 0 && merge_get(b, (uint32_t)cur->id, (uint32_t)sy[cur->next].id, &rank, &mid))
            if (!hpush(e, (bmerge_t){rank, top.pos, mid})) return 0;
    }
    for (int32_t i = 0; i >= 0; i = sy[i].next) emit(e, sy[i].id);
    return 1;
}

/* Split 3 over a piece: its matches and the unmatched stretches between them, each a word. */
static int ds_split3(benc_t *e, const uint8_t *s, uint64_t len) {
    uint64_t gap = 0, pos = 0;
    while (pos < len) {
        uint64_t end = match_ds3(s, len, pos);
        if (end == 0 || end <= pos || end > len) { /* unmatched character: part of a gap */
            uint32_t cp;
            pos += dec(s, pos, &cp);
            continue;
        }
        if (pos > gap && !bpe_word(e, s + gap, pos - gap)) return 0;
        if (!bpe_word(e, s + pos, end - pos)) return 0;
        pos = gap = end;
    }
    if (len > gap && !bpe_word(e, s + gap, len - gap)) return 0;
    return 1;
}

/* Split 2 (runs of CJK / kana): the runs and the stretches between them go to split 3. */
static int ds_split2(benc_t *e, const uint8_t *s, uint64_t len) {
    uint64_t gap = 0, pos = 0;
    while (pos < len) {
        uint32_t cp;
        uint32_t l = dec(s, pos, &cp);
        if (!ds_cjk(cp)) { pos += l; continue; }
        uint64_t end = pos + l;
        while (end < len && (l = dec(s, end, &cp), ds_cjk(cp))) end += l;
        if (pos > gap && !ds_split3(e, s + gap, pos - gap)) return 0;
        if (!ds_split3(e, s + pos, end - pos)) return 0;
        pos = gap = end;
    }
    if (len > gap && !ds_split3(e, s + gap, len - gap)) return 0;
    return 1;
}

/* Split 1 (\p{N}{1,3}): the digit groups and the stretches between them go to split 2. */
static int ds_pretok(benc_t *e, const uint8_t *s, uint64_t len) {
    uint64_t gap = 0, pos = 0;
    while (pos < len) {
        uint32_t cp;
        uint32_t l = dec(s, pos, &cp);
        if (!is_N(cp)) { pos += l; continue; }
        uint64_t end = run_N(s, len, pos, 3);
        if (pos > gap && !ds_split2(e, s + gap, pos - gap)) return 0;
        if (!ds_split2(e, s + pos, end - pos)) return 0;
        pos = gap = end;
    }
    if (len > gap && !ds_split2(e, s + gap, len - gap)) return 0;
    return 1;
}

/* DeepSeek-LLM / DeepSeek-V2 (llama.cpp's `deepseek-llm`): six Isolated splits in sequence, each
 * applied to the pieces of the one before (as DeepSeek-V3's above):
 *   1. [\r\n]
 *   2. \s?[...]+  with the tokenizer.json's class of cased letters (DSL_LETTERS, by code point)
 *   3. \s?[...]+  with ASCII !-/ and :-~ (the ASCII letters too), fullwidth U+FF01..FF0F and
 *                 U+FF1A..FF5E, U+2018..201F, U+3000..3002 (DSL_PUNCT)
 *   4. \s+$       a piece's trailing whitespace (no \n is left inside a piece after split 1, so
 *                 Oniguruma's end-of-line $ is the piece's end)
 *   5. [...]+      U+4E00..9FA5, U+0800..4E00, U+AC00..D7FF
 *   6. \p{N}+
 * A \s? followed by a character of the class starts the match at the space. */
typedef struct { uint32_t lo, hi; } cp_range;
static const cp_range DSL_LETTERS[] = {
    {0x41, 0x5A}, {0x61, 0x7A}, {0xB5, 0xB5}, {0xC0, 0xD6}, {0xD8, 0xF6}, {0xF8, 0x1BA}, {0x1BC, 0x1BF},
    {0x1C4, 0x293}, {0x295, 0x2AF}, {0x370, 0x373}, {0x376, 0x376}, {0x377, 0x377}, {0x37B, 0x37D},
    {0x37F, 0x37F}, {0x386, 0x386}, {0x388, 0x38A}, {0x38C, 0x38C}, {0x38E, 0x3A1}, {0x3A3, 0x3F5},
    {0x3F7, 0x481}, {0x48A, 0x52F}, {0x531, 0x556}, {0x10A0, 0x10C5}, {0x13A0, 0x13F5}, {0x13F8, 0x13FD},
    {0x1C90, 0x1CBA}, {0x1CBD, 0x1CBF}, {0x1D00, 0x1D2B}, {0x1D6B, 0x1D77}, {0x1D79, 0x1D9A},
    {0x1E00, 0x1F15}, {0x1F18, 0x1F1D}, {0x1F20, 0x1F45}, {0x1F48, 0x1F4D}, {0x1F50, 0x1F57},
    {0x1F59, 0x1F59}, {0x1F5B, 0x1F5B}, {0x1F5D, 0x1F5D}, {0x1F5F, 0x1F7D}, {0x1F80, 0x1FB4},
    {0x1FB6, 0x1FBC}, {0x1FBE, 0x1FBE}, {0x1FC2, 0x1FC4}, {0x1FC6, 0x1FCC}, {0x1FD0, 0x1FD3},
    {0x1FD6, 0x1FDB}, {0x1FE0, 0x1FEC}, {0x1FF2, 0x1FF4}, {0x1FF6, 0x1FFC}, {0x2102, 0x2102},
    {0x2107, 0x2107}, {0x210A, 0x2113}, {0x2115, 0x2115}, {0x2119, 0x211D}, {0x2124, 0x2124},
    {0x2126, 0x2126}, {0x2128, 0x2128}, {0x212A, 0x212D}, {0x212F, 0x2134}, {0x2139, 0x2139},
    {0x213C, 0x213F}, {0x2145, 0x2149}, {0x214E, 0x214E}, {0x2183, 0x2183}, {0x2184, 0x2184},
    {0x2C00, 0x2C7B}, {0x2C7E, 0x2CE4}, {0x2CEB, 0x2CEE}, {0x2CF2, 0x2CF2}, {0x2CF3, 0x2CF3},
    {0xA640, 0xA66D}, {0xA680, 0xA69B}, {0xA722, 0xA76F}, {0xA771, 0xA787}, {0xA78B, 0xA78E},
    {0xAB70, 0xABBF}, {0xFB00, 0xFB06}, {0xFB13, 0xFB17}, {0xFF21, 0xFF3A}, {0xFF41, 0xFF5A},
    {0x10400, 0x1044F}, {0x104B0, 0x104D3}, {0x104D8, 0x104FB}, {0x10C80, 0x10CB2}, {0x10CC0, 0x10CF2},
    {0x118A0, 0x118DF}, {0x1E900, 0x1E943}
};
static const cp_range DSL_PUNCT[] = {
    {0x21, 0x2F}, {0x3A, 0x7E}, {0x2018, 0x201F}, {0x3000, 0x3002}, {0xFF01, 0xFF0F}, {0xFF1A, 0xFF5E}
};
static int in_ranges(const cp_range *r, size_t n, uint32_t cp) { /* r sorted, disjoint */
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < r[mid].lo) hi = mid;
        else if (cp > r[mid].hi) lo = mid + 1;
        else return 1;
    }
    return 0;
}
static int dsl_letter(uint32_t cp) { return in_ranges(DSL_LETTERS, sizeof DSL_LETTERS / sizeof DSL_LETTERS[0], cp); }
static int dsl_punct(uint32_t cp) { return in_ranges(DSL_PUNCT, sizeof DSL_PUNCT / sizeof DSL_PUNCT[0], cp); }
static int dsl_cjk(uint32_t cp) { return (cp >= 0x0800 && cp <= 0x9FA5) || (cp >= 0xAC00 && cp <= 0xD7FF); }
static int dsl_newline(uint32_t cp) { return cp == '\r' || cp == '\n'; }

static uint64_t run_of(const uint8_t *s, uint64_t len, uint64_t p, int (*in)(uint32_t)) {
    uint32_t cp;
    while (p < len) { uint32_t l = dec(s, p, &cp); if (!in(cp)) break; p += l; }
    return p;
}

/* The first match of split k (1..6) at or after pos in s[0..len): [*ms, *me); 0 when none. */
static int dsl_find(int k, const uint8_t *s, uint64_t len, uint64_t pos, uint64_t *ms, uint64_t *me) {
    if (k == 4) { /* \s+$: the whitespace run that ends the piece, from its first character */
        uint64_t start = len, p = pos;
        uint32_t cp;
        while (p < len) {
            uint32_t l = dec(s, p, &cp);
            if (!is_S(cp)) start = len;
            else if (start == len) start = p;
            p += l;
        }
        if (start == len) return 0;
        *ms = start, *me = len;
        return 1;
    }
    int (*cls)(uint32_t) = k == 1 ? dsl_newline : k == 2 ? dsl_letter : k == 3 ? dsl_punct : k == 5 ? dsl_cjk : is_N;
    while (pos < len) {
        uint32_t c0, c1;
        uint32_t l0 = dec(s, pos, &c0);
        if (k == 1) {
            if (cls(c0)) { *ms = pos, *me = pos + l0; return 1; }
        } else if ((k == 2 || k == 3) && is_S(c0) && pos + l0 < len && (dec(s, pos + l0, &c1), cls(c1))) {
            *ms = pos, *me = run_of(s, len, pos + l0, cls); /* \s? then the class */
            return 1;
        } else if (cls(c0)) {
            *ms = pos, *me = run_of(s, len, pos, cls);
            return 1;
        }
        pos += l0;
    }
    return 0;
}

/* Split k of a sequence over a piece: its matches (find) and the unmatched stretches between
 * them are the pieces split k + 1 takes (next). */
typedef int (*split_find_fn)(int k, const uint8_t *s, uint64_t len, uint64_t pos, uint64_t *ms, uint64_t *me);
typedef int (*split_next_fn)(benc_t *e, int k, const uint8_t *s, uint64_t len);
static int split_pieces(benc_t *e, int k, const uint8_t *s, uint64_t len, split_find_fn find, split_next_fn next) {
    uint64_t gap = 0, ms, me;
    while (gap < len && find(k, s, len, gap, &ms, &me)) {
        if (ms > gap && !next(e, k + 1, s + gap, ms - gap)) return 0;
        if (!next(e, k + 1, s + ms, me - ms)) return 0;
        gap = me;
    }
    if (len > gap && !next(e, k + 1, s + gap, len - gap)) return 0;
    return 1;
}

/* DeepSeek-LLM's six splits; after split 6, each piece is a word. */
static int dsl_split(benc_t *e, int k, const uint8_t *s, uint64_t len) {
    if (k > 6) return bpe_word(e, s, len);
    return split_pieces(e, k, s, len, dsl_find, dsl_split);
}

/* llama.cpp's "default" BPE pre-tokenizer (pattern 9): four splits in sequence, each over
 * the pieces of the one before (a match, or a stretch between matches, is a piece):
 * (1) [\p{P}\$\+<=>\^~\|]+; (2) GPT-2's regex, whose matches cover a piece (match_gpt2);
 * (3) \p{N}+; (4) [0-9][0-9][0-9]. */
static int ldf_sym(uint32_t cp) {
    int c = cb_ucat(cp);
    return (c >= UC_Pc && c <= UC_Po) || cp == '$' || cp == '+' || cp == '<' || cp == '=' || cp == '>' ||
           cp == '^' || cp == '~' || cp == '|';
}
static int ldf_digit(uint32_t cp) { return cp >= '0' && cp <= '9'; }

/* The first match of split k (1, 3 or 4) at or after pos in s[0..len): [*ms, *me); 0 when none. */
static int ldf_find(int k, const uint8_t *s, uint64_t len, uint64_t pos, uint64_t *ms, uint64_t *me) {
    while (pos < len) {
        uint32_t c0;
        uint32_t l0 = dec(s, pos, &c0);
        if (k == 4) {
            if (pos + 3 <= len && ldf_digit(s[pos]) && ldf_digit(s[pos + 1]) && ldf_digit(s[pos + 2])) {
                *ms = pos, *me = pos + 3;
                return 1;
            }
        } else if (k == 1 ? ldf_sym(c0) : is_N(c0)) {
            *ms = pos, *me = run_of(s, len, pos, k == 1 ? ldf_sym : is_N);
            return 1;
        }
        pos += l0;
    }
    return 0;
}

static int ldf_split(benc_t *e, int k, const uint8_t *s, uint64_t len) {
    if (k > 4) return bpe_word(e, s, len);
    if (k == 2) {
        for (uint64_t pos = 0; pos < len;) {
            uint64_t end = match_gpt2(s, len, pos);
            if (end <= pos || end > len) end = len; /* cannot happen; keeps the loop finite */
            if (!ldf_split(e, 3, s + pos, end - pos)) return 0;
            pos = end;
        }
        return 1;
    }
    return split_pieces(e, k, s, len, ldf_find, ldf_split);
}

/* Pre-tokenize and BPE a piece of normalized text without added tokens. */
static int pretok_whole(benc_t *e, const uint8_t *s, uint64_t len) {
    uint64_t pos = 0;
    if (e->b->pattern == PAT_DEEPSEEK_V3) return ds_pretok(e, s, len);
    if (e->b->pattern == PAT_DEEPSEEK_LLM) return dsl_split(e, 1, s, len);
    if (e->b->pattern == PAT_LLAMA_DEFAULT) return ldf_split(e, 1, s, len);
    while (pos < len) {
        uint64_t end;
        switch (e->b->pattern) {
        case PAT_GPT2: end = match_gpt2(s, len, pos); break;
        case PAT_QWEN2: end = match_qwen(s, len, pos, 1); break;
        case PAT_LLAMA3: end = match_qwen(s, len, pos, 3); break;
        case PAT_TEKKEN: end = match_tekken(s, len, pos, TK_TEKKEN); break;
        case PAT_KIMI_K2: end = match_tekken(s, len, pos, TK_KIMI); break;
        default: end = match_tekken(s, len, pos, TK_O200K); break;
        }
        if (end <= pos || end > len) end = len; /* cannot happen; keeps the loop finite */
        if (!bpe_word(e, s + pos, end - pos)) return 0;
        pos = end;
    }
    return 1;
}

/* Longest added token of the pass (0 raw, 1 normalized) at s[0..len): its id and length. */
static int32_t added_at(const cb_bpe *b, int pass, const uint8_t *s, uint64_t len, uint64_t *mlen) {
    if (!(b->added_first[pass][s[0] >> 3] & (1u << (s[0] & 7)))) return -1;
    for (uint32_t k = 0; k < b->n_added; k++) {
        int32_t id = rd_i32(b->added + 4 * (uint64_t)k);
        if (((tok_flags(b, id) & TF_NORMALIZED) != 0) != pass) continue;
        uint32_t pl;
        const uint8_t *p = tok_piece(b, id, &pl);
        if (pl <= len && p[0] == s[0] && memcmp(p, s, pl) == 0) {
            *mlen = pl;
            return id;
        }
    }
    return -1;
}

/* Split s on the added tokens of `pass`; the pieces between go to `next`. */
static int split_added(benc_t *e, int pass, const uint8_t *s, uint64_t len,
                       int (*next)(benc_t *, const uint8_t *, uint64_t)) {
    uint64_t start = 0;
    for (uint64_t p = 0; p < len;) {
        uint64_t ml;
        int32_t id = added_at(e->b, pass, s + p, len - p, &ml);
        if (id < 0) { p++; continue; }
        if (p > start && !next(e, s + start, p - start)) return 0;
        emit(e, id);
        p += ml;
        start = p;
    }
    if (len > start && !next(e, s + start, len - start)) return 0;
    return 1;
}

/* Python's str.isspace: White_Space and U+001C..U+001F */
static inline int py_isspace(uint32_t cp) { return cb_uspace(cp) || (cp >= 0x1C && cp <= 0x1F); }

/* BF_CHUNKED: the parts of Kimi's tokenizer class (its encode cuts a text every 400,000
 * characters, then each chunk where a run of whitespace or of other characters passes 25,000,
 * and encodes the parts apart), each pre-tokenized on its own. */
#define CHUNK_CPS 400000u
#define RUN_CPS 25000u
static int pretok(benc_t *e, const uint8_t *s, uint64_t len) {
    if (!(e->b->flags & BF_CHUNKED)) return pretok_whole(e, s, len);
    uint64_t pos = 0;
    while (pos < len) {
        uint64_t part = pos, run = 0, n = 0;
        int space = -1;
        for (; pos < len && n < CHUNK_CPS; n++) {
            uint32_t cp;
            uint32_t l = dec(s, pos, &cp);
            int sp = py_isspace(cp);
            if (space < 0) space = sp;
            if (sp != space) {
                space = sp;
                run = 1;
            } else if (++run > RUN_CPS) {
                if (!pretok_whole(e, s + part, pos - part)) return 0;
                part = pos;
                run = 1;
            }
            pos += l;
        }
        if (pos > part && !pretok_whole(e, s + part, pos - part)) return 0;
    }
    return 1;
}

static int after_norm(benc_t *e, const uint8_t *s, uint64_t len) { return split_added(e, 1, s, len, pretok); }

/* A piece of raw text between non-normalized added tokens: normalize, then the rest. */
static int normalize_piece(benc_t *e, const uint8_t *s, uint64_t len) {
    if (e->b->flags & BF_NFC) {
        int plain = 1; /* below U+0300 nothing decomposes or composes */
        for (uint64_t i = 0; i < len; i++)
            if (s[i] >= 0xCC) { plain = 0; break; }
        if (!plain) {
            uint8_t *nb;
            uint64_t nl;
            if (!nfc(s, len, &nb, &nl)) return 0;
            int ok = after_norm(e, nb, nl);
            free(nb);
            return ok;
        }
    }
    return after_norm(e, s, len);
}

colibri_status cb_bpe_tokenize(const cb_bpe *b, const uint8_t *text, uint64_t len, int add_bos, int32_t *out,
                               int64_t cap, int64_t *n_out, char *err, size_t err_len) {
    *n_out = 0;
    if (len > MAX_ENCODE_BYTES)
        return fail(err, err_len, COLIBRI_E_INVALID_ARG,
                    "colibri_tokenize: %llu bytes of text exceed the %llu-byte limit of one call; split the text",
                    (unsigned long long)len, (unsigned long long)MAX_ENCODE_BYTES);
    benc_t e;
    memset(&e, 0, sizeof e);
    e.b = b;
    e.out = out;
    e.cap = cap;
    if (add_bos && b->bos_id >= 0) emit(&e, b->bos_id);
    /* Malformed UTF-8: replace each maximal malformed subpart by U+FFFD first. */
    uint8_t *clean = NULL;
    const uint8_t *s = text;
    uint64_t n = len;
    int ok = 1;
    for (uint64_t p = 0; p < len;) {
        if (text[p] < 0x80) { p++; continue; }
        uint32_t l = utf8_valid_len(text + p, len - p);
        if (l) { p += l; continue; }
        clean = (uint8_t *)malloc((size_t)(3 * len));
        if (clean == NULL) { ok = 0; break; }
        memcpy(clean, text, (size_t)p);
        uint64_t o = p;
        while (p < len) {
            uint32_t v = utf8_valid_len(text + p, len - p);
            if (v) { memcpy(clean + o, text + p, v); o += v; p += v; continue; }
            p += utf8_bad_len(text + p, len - p);
            clean[o++] = 0xEF; clean[o++] = 0xBF; clean[o++] = 0xBD;
        }
        s = clean;
        n = o;
        break;
    }
    if (ok) ok = split_added(&e, 0, s, n, normalize_piece);
    free(clean);
    free(e.sym);
    free(e.heap);
    if (!ok) {
        *n_out = 0;
        return fail(err, err_len, COLIBRI_E_NOMEM, "colibri_tokenize: out of memory for %llu bytes of text; split the text",
                    (unsigned long long)len);
    }
    *n_out = e.n;
    if (e.n > cap)
        return fail(err, err_len, COLIBRI_E_BUFFER_TOO_SMALL,
                    "colibri_tokenize: %lld ids do not fit in a buffer of %lld; call again with a larger buffer",
                    (long long)e.n, (long long)cap);
    return COLIBRI_OK;
}

/* ---- decode ---- */

typedef struct {
    char *out;
    uint64_t cap, len;
    uint8_t pend[4];
    uint32_t np, need;
    uint8_t lo, hi;
} bdec_t;

static inline void put(bdec_t *d, const uint8_t *p, uint64_t n) {
    if (d->len < d->cap) {
        uint64_t room = d->cap - d->len, k = n < room ? n : room;
        memcpy(d->out + d->len, p, (size_t)k);
    }
    d->len += n;
}

static const uint8_t kFFFD[3] = {0xEF, 0xBF, 0xBD};

/* from_utf8_lossy, one byte at a time. */
static void feed(bdec_t *d, uint8_t c) {
    for (;;) {
        if (d->need == 0) {
            if (c < 0x80) { put(d, &c, 1); return; }
            d->lo = 0x80;
            d->hi = 0xBF;
            if (c >= 0xC2 && c <= 0xDF) d->need = 1;
            else if (c >= 0xE0 && c <= 0xEF) { d->need = 2; if (c == 0xE0) d->lo = 0xA0; if (c == 0xED) d->hi = 0x9F; }
            else if (c >= 0xF0 && c <= 0xF4) { d->need = 3; if (c == 0xF0) d->lo = 0x90; if (c == 0xF4) d->hi = 0x8F; }
            else { put(d, kFFFD, 3); return; }
            d->pend[0] = c;
            d->np = 1;
            return;
        }
        if (c >= d->lo && c <= d->hi) {
            d->pend[d->np++] = c;
            d->lo = 0x80;
            d->hi = 0xBF;
            if (--d->need == 0) put(d, d->pend, d->np);
            return;
        }
        put(d, kFFFD, 3); /* the incomplete sequence; c starts afresh */
        d->need = 0;
        d->np = 0;
    }
}

colibri_status cb_bpe_detokenize(const cb_bpe *b, const int32_t *ids, int64_t n, char *out, uint64_t cap,
                                 uint64_t *len_out, char *err, size_t err_len) {
    bdec_t d;
    memset(&d, 0, sizeof d);
    d.out = out;
    d.cap = cap;
    for (int64_t i = 0; i < n; i++) {
        if (tok_flags(b, ids[i]) & TF_SPECIAL) {
            if ((b->flags & BF_SPECIAL_SPLITS_DECODE) && d.need) { /* the run before it ends here */
                put(&d, kFFFD, 3);
                d.need = 0;
                d.np = 0;
            }
            continue;
        }
        uint32_t bl;
        const uint8_t *bs = tok_bytes(b, ids[i], &bl);
        for (uint32_t k = 0; k < bl; k++) {
            if (d.need == 0 && bs[k] < 0x80) { /* fast path for ASCII runs */
                uint32_t j = k;
                while (j < bl && bs[j] < 0x80) j++;
                put(&d, bs + k, j - k);
                k = j - 1;
                continue;
            }
            feed(&d, bs[k]);
        }
    }
    if (d.need) put(&d, kFFFD, 3);
    *len_out = d.len;
    if (d.len > cap)
        return fail(err, err_len, COLIBRI_E_BUFFER_TOO_SMALL,
                    "colibri_detokenize: %llu bytes of text do not fit in a buffer of %llu; call again with a larger buffer",
                    (unsigned long long)d.len, (unsigned long long)cap);
    return COLIBRI_OK;
}
