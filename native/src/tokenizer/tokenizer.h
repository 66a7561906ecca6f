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

/* Release whatever cb_tokenizer_load allocated (not the struct itself). */
void cb_tokenizer_unload(colibri_tokenizer *tok);

#endif
