/*
 * bpe.h — byte-level BPE tokenizer (GPT-2 / Qwen2 / Llama-3 style, from a Hugging
 * Face tokenizer.json; or Mistral tekken, from a tiktoken-style tekken_*.json), read in place from a tokenizer section of type 2 (docs/format.md,
 * "Tokenizer section encoding", "Byte-level BPE"). Used by tokenizer.c, which dispatches the
 * public colibri_tokenize / colibri_detokenize / colibri_token_piece calls on the type.
 */
#ifndef COLIBRI_TOKENIZER_BPE_H
#define COLIBRI_TOKENIZER_BPE_H

#include <stddef.h>
#include <stdint.h>

#include "colibri.h"

#define CB_BPE_TYPE 2u

typedef struct cb_bpe {
    const uint8_t *base;     /* section start (borrowed) */
    uint64_t size;
    const uint8_t *tokens;   /* (n_tokens, 16) records */
    const uint8_t *merges;   /* (1 << merges_log2, 16) hash slots: u64 key, u32 rank, u32 merged id */
    const uint8_t *vhash;    /* (1 << vocab_log2,) u32 token ids by bytes hash; NULL if absent */
    const uint8_t *added;    /* (n_added,) u32 ids, in matching order */
    const uint8_t *blob;
    const uint8_t *byte_ids; /* (256,) i32 */
    uint64_t blob_size;
    int32_t n_tokens, bos_id, eos_id, unk_id, pad_id;
    uint32_t flags, pattern, n_merges, merges_log2, vocab_log2, n_added;
    int32_t byte_id[256];     /* copy of byte_ids */
    uint8_t added_first[2][32]; /* bitmaps of the first bytes of added tokens: [0] raw pass, [1] normalized pass */
} cb_bpe;

/* Validate a type-2 section (the common 16-byte prefix is already checked). */
colibri_status cb_bpe_load(cb_bpe *b, const uint8_t *data, uint64_t size, char *err, size_t err_len);
/* colibri_tokenize for a byte-level BPE tokenizer (arguments already checked). */
colibri_status cb_bpe_tokenize(const cb_bpe *b, const uint8_t *text, uint64_t len, int add_bos, int32_t *out,
                               int64_t cap, int64_t *n_out, char *err, size_t err_len);
/* colibri_detokenize (ids already range-checked). */
colibri_status cb_bpe_detokenize(const cb_bpe *b, const int32_t *ids, int64_t n, char *out, uint64_t cap,
                                 uint64_t *len_out, char *err, size_t err_len);
/* The tokenizer.json string of a token (e.g. "Ġhello", "<|endoftext|>"). */
void cb_bpe_piece(const cb_bpe *b, int32_t id, const char **piece, uint64_t *len);

/* A token's bytes (decoded text) and whether it is special (then *bytes is its piece). */
const uint8_t *cb_bpe_token_bytes(const cb_bpe *b, int32_t id, uint32_t *len, int *special);

#endif
