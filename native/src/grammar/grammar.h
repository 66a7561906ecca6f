/*
 * grammar.h — constrained decoding: a JSON schema compiled into a grammar (schema.c) and the
 * matcher that walks it byte by byte and masks the tokens that cannot continue it
 * (matcher.c). Internal interface for the per-sequence sampler (sample/sampler.c).
 */
#ifndef COLIBRI_GRAMMAR_GRAMMAR_H
#define COLIBRI_GRAMMAR_GRAMMAR_H

#include <stdint.h>

#include "colibri.h"

/* ---- the compiled grammar (schema.c builds it, matcher.c reads it) ---- */
enum {
    GK_ROOT = 0,  /* a: the value node; the prefix literal, the value, the suffix literal */
    GK_OBJECT,    /* a: first property in props[], b: property count (a closed object) */
    GK_MAP,       /* a: the value node, b: the key node (an object with any keys) */
    GK_ARRAY,     /* a: the item node; lo/hi: min/max items (hi -1: none) */
    GK_STRING,    /* lo/hi: min/max length in characters (hi -1: none) */
    GK_INTEGER,   /* lo/hi: inclusive bounds */
    GK_NUMBER,    /* dlo/dhi with has_lo/has_hi and lo_ex/hi_ex */
    GK_LITERALS,  /* a: first literal in lits[], b: count (sorted by bytes) */
    GK_ANYOF      /* a: first alternative in alts[], b: count */
};

typedef struct cb_gnode {
    int32_t kind, a, b;
    int32_t has_lo, has_hi, lo_ex, hi_ex;
    int64_t lo, hi;
    double dlo, dhi;
} cb_gnode;

typedef struct cb_gprop {
    int32_t key_off, key_len; /* the key as JSON text, quotes included, in text[] */
    int32_t value, required;
} cb_gprop;

typedef struct cb_glit {
    int32_t off, len; /* in text[] */
} cb_glit;

/* A byte trie of token byte strings: node 0 is the root; children as first-child /
 * next-sibling lists in byte order; tok[node] the first token ending there, tok_next[id] the
 * next one with the same bytes. */
typedef struct cb_trie {
    int32_t *child, *next, *tok, *tok_next;
    uint8_t *byte;
    int32_t n;
} cb_trie;

/* The token tables of a tokenizer, built once and kept with it (cb_tokenizer_cache): bytes
 * of each token (tok_off/tok_len into tok_bytes), special flags; a byte trie of the
 * non-special tokens, and a second one without the "inside" tokens: those whose bytes are
 * whole UTF-8 characters with no quote, backslash or control character, which any string
 * body with room for them takes (tok_inside[id] = 1). */
typedef struct cb_gtokens {
    int32_t V, max_tok_len;
    uint8_t *tok_bytes;
    int64_t *tok_off;
    int32_t *tok_len;
    uint8_t *tok_special;
    int32_t *special_ids;
    int32_t n_special;
    cb_trie all, edge;
    uint8_t *tok_inside;
} cb_gtokens;

struct colibri_grammar {
    cb_gnode *nodes;
    int32_t n_nodes, cap_nodes;
    cb_gprop *props;
    int32_t n_props, cap_props;
    cb_glit *lits;
    int32_t n_lits, cap_lits;
    int32_t *alts;
    int32_t n_alts, cap_alts;
    char *text;
    int64_t text_len, text_cap;
    int32_t root;                        /* the GK_ROOT node */
    int32_t prefix_off, prefix_len, suffix_off, suffix_len;
    const cb_gtokens *tk;                /* the tokenizer's token tables (kept by the tokenizer) */
};

/* A matcher: the state of one sequence in a grammar, with all its scratch (allocated once). */
typedef struct cb_matcher cb_matcher;

colibri_status cb_matcher_create(const colibri_grammar *g, cb_matcher **out);
void cb_matcher_free(cb_matcher *m);
void cb_matcher_reset(cb_matcher *m);
/* allowed[id] = 1 for every token (id < n) that can continue the grammar from the current
 * state, else 0. Returns 1 when the grammar is complete here (an end token may follow). */
int cb_matcher_mask(cb_matcher *m, uint8_t *allowed, int32_t n);
/* Advance by token id. Returns 0, or -1 (state unchanged) when the token cannot continue. */
int cb_matcher_accept(cb_matcher *m, int32_t id);
/* 1 when the grammar is complete in the current state. */
int cb_matcher_complete(cb_matcher *m);
int32_t cb_grammar_vocab(const colibri_grammar *g);

#endif
