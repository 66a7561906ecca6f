/*
 * unicode_tables.h — Unicode character data for the byte-level BPE tokenizer, generated
 * into unicode_tables.c by gen_unicode_tables.py beside it (from Python's unicodedata),
 * plus small lookup helpers.
 */
#ifndef COLIBRI_UNICODE_TABLES_H
#define COLIBRI_UNICODE_TABLES_H

#include <stdint.h>

/* General categories, numbered as in the generator's CATS list. */
enum {
    UC_Cn = 0, UC_Lu, UC_Ll, UC_Lt, UC_Lm, UC_Lo, UC_Mn, UC_Mc, UC_Me, UC_Nd, UC_Nl, UC_No,
    UC_Pc, UC_Pd, UC_Ps, UC_Pe, UC_Pi, UC_Pf, UC_Po, UC_Sm, UC_Sc, UC_Sk, UC_So, UC_Zs, UC_Zl,
    UC_Zp, UC_Cc, UC_Cf, UC_Cs, UC_Co
};

extern const char cb_unicode_version[];
extern const uint8_t cb_ucat_latin1[256];
extern const uint32_t cb_ucat_n;
extern const uint32_t cb_ucat_start[];
extern const uint32_t cb_ucat_end_cat[];
extern const uint32_t cb_han_n;
extern const uint32_t cb_han_ranges[][2];
extern const uint32_t cb_ccc_n;
extern const uint32_t cb_ccc_ranges[][2];
extern const uint32_t cb_decomp_n;
extern const uint32_t cb_decomp[][2];
extern const uint32_t cb_decomp_pool[];
extern const uint32_t cb_comp_n;
extern const uint64_t cb_comp[][2];

/* General category of a code point (UC_Cn for unassigned and out-of-range values). */
int cb_ucat(uint32_t cp);
/* White_Space (the \s of Oniguruma / Rust regex). */
int cb_uspace(uint32_t cp);
/* Script=Han (\p{Han}): radicals, ideographs, U+3005, numerals U+3007 / U+3021..U+3029, ... */
int cb_uhan(uint32_t cp);
/* Canonical combining class. */
int cb_uccc(uint32_t cp);
/* Full canonical decomposition of cp (Hangul excluded): *n code points at *out, or 0. */
int cb_udecomp(uint32_t cp, const uint32_t **out, uint32_t *n);
/* Primary composite of (a, b), or 0 if none (Hangul excluded). */
uint32_t cb_ucomp(uint32_t a, uint32_t b);

#endif
