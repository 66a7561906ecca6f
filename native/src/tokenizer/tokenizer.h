/*
 * tokenizer.h — internal interface between the engine (core/colibri.c) and the tokenizer
 * (tokenizer.c, bpe.c). The tokenizer reads the tokenizer section of a .colibri file in place
 * (docs/format.md, "Tokenizer section encoding"); it never copies the vocabulary.
 */
#ifndef COLIBRI_TOKENIZER_H
#define COLIBRI_TOKENIZER_H

#include "colibri.h"

/* Size of the full struct colibri_tokenizer, so that the engine can reserve it. */
size_t cb_tokenizer_struct_size(void);

/* Parse and validate a tokenizer section (bounds-checked; never trusts the bytes).
 * `tok` points to cb_tokenizer_struct_size() zeroed bytes owned by the caller.
 * `owned_by_ctx` = 1 makes colibri_tokenizer_free a no-op for it. On failure the
 * message goes to err and the status is COLIBRI_E_FORMAT (or COLIBRI_E_UNSUPPORTED
 * for a tokenizer type this build does not know). */
colibri_status cb_tokenizer_load(colibri_tokenizer *tok, const uint8_t *data, uint64_t size,
                                 int owned_by_ctx, char *err, size_t err_len);

/* The bytes a token stands for in generated text, for constrained decoding (grammar/):
 * *special = 0: the bytes the token adds to decoded text (SentencePiece: "▁" as a space, a
 * byte piece as its byte; byte-level BPE: the token's bytes); *special = 1: a control,
 * unknown or special token, and *bytes is its text (the piece, e.g. "</s>", "<|im_end|>").
 * Id range-checked by the caller. Returns 0, or -1 when the text exceeds cap bytes. */
int cb_token_bytes(const colibri_tokenizer *tok, int32_t id, uint8_t *buf, uint32_t cap, uint32_t *len,
                   int *special);

/* Something built once from a tokenizer and kept with it until it is freed (the grammar's
 * token tables): the cached pointer, or build(tok) made now under a lock (NULL when build
 * fails; nothing is cached then). free_fn releases it when the tokenizer goes. */
void *cb_tokenizer_cache(colibri_tokenizer *tok, void *(*build)(colibri_tokenizer *), void (*free_fn)(void *));

/* Release whatever cb_tokenizer_load allocated (not the struct itself). */
void cb_tokenizer_unload(colibri_tokenizer *tok);

#endif
