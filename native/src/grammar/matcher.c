/*
 * matcher.c — walking a compiled grammar (grammar.h) byte by byte, and the token mask.
 *
 * The state of a sequence is a set of at most MAX_STACKS stacks of frames (several while
 * an anyOf is undecided). Frames are immutable and live in one pool: a step makes new top
 * frames that point to their unchanged parents, so a state is copied by copying a few
 * indices. The mask walks the grammar's byte trie of the tokens depth first, stepping the
 * state along each edge and pruning a subtree as soon as no stack survives; the frames a
 * subtree makes are dropped when the walk leaves it (the pool is a stack). Accepting a
 * token steps its bytes and copies the surviving stacks to the committed part of the pool.
 * Special tokens (control / special pieces) are stepped with their text, and only the
 * literal prefix and suffix take them. Nothing is allocated after cb_matcher_create.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar.h"

#define MAX_STACKS 16
#define MAX_DEPTH 64
#define COMMIT_FRAMES (MAX_STACKS * MAX_DEPTH)
#define END_BYTE 256 /* the end of the output */

/* integers and numbers: the digits the grammar generates at most */
#define INT_MAX_DIGITS 18
#define NUM_MAX_INT_DIGITS 12
#define NUM_MAX_FRAC_DIGITS 6

typedef struct gframe {
    int32_t parent, node, phase, depth;
    int64_t i, a, b;
} gframe;

struct cb_matcher {
    const colibri_grammar *g;
    gframe *pool;
    int32_t pool_cap, pool_top;
    int32_t commit_base;      /* 0 or COMMIT_FRAMES: where the committed state lives */
    int32_t tops[MAX_STACKS]; /* the committed state */
    int32_t n_tops;
    int32_t *dfs_tops;        /* [(max_tok_len + 1) * MAX_STACKS] states along the trie walk */
};

/* ---- frames ---- */
static int32_t newf(cb_matcher *m, int32_t parent, int32_t node, int32_t phase, int64_t i, int64_t a, int64_t b) {
    if (m->pool_top >= m->pool_cap) return -1;
    int32_t k = m->pool_top++;
    gframe *f = &m->pool[k];
    f->parent = parent;
    f->node = node;
    f->phase = phase;
    f->depth = parent >= 0 ? m->pool[parent].depth + 1 : 0;
    f->i = i;
    f->a = a;
    f->b = b;
    return k;
}

/* a copy of frame k with another phase / counters */
static int32_t modf_(cb_matcher *m, int32_t k, int32_t phase, int64_t i, int64_t a, int64_t b) {
    gframe f = m->pool[k];
    return newf(m, f.parent, f.node, phase, i, a, b);
}

typedef struct {
    int32_t *v;
    int n;
} outs;

static void emit(outs *o, int32_t k) {
    if (k >= 0 && o->n < MAX_STACKS) o->v[o->n++] = k;
}

static void feed(cb_matcher *m, int32_t k, int c, int special, outs *o);

/* ---- phases ---- */
enum { R_PREFIX, R_VALUE, R_SUFFIX, R_DONE };
enum { S_START, S_BODY, S_ESC, S_HEX, S_UTF8 };
enum { I_START, I_MINUS, I_ZERO, I_DIGITS };
enum { N_START, N_MINUS, N_INT, N_DOT, N_FRAC };
enum { A_START, A_OPEN, A_ITEM, A_AFTER, A_COMMA };
enum { O_START, O_OPEN, O_KEY, O_COLON, O_VALSTART, O_VALUE, O_AFTER, O_COMMA };
enum { M_START, M_OPEN, M_KEY, M_COLON, M_VALSTART, M_VALUE, M_AFTER, M_COMMA };

/* The parent frame after its child value completed. */
static int32_t child_done(cb_matcher *m, int32_t pk) {
    const gframe *p = &m->pool[pk];
    const cb_gnode *n = &m->g->nodes[p->node];
    switch (n->kind) {
    case GK_ROOT:
        return modf_(m, pk, m->g->suffix_len ? R_SUFFIX : R_DONE, 0, 0, 0);
    case GK_ARRAY:
        return modf_(m, pk, A_AFTER, p->i + 1, 0, 0);
    case GK_OBJECT:
        return modf_(m, pk, O_AFTER, p->a + 1, 0, 0);
    case GK_MAP:
        return modf_(m, pk, p->phase == M_KEY ? M_COLON : M_AFTER, 0, 0, 0);
    default:
        return -1;
    }
}

/* The frame k is complete without consuming c: its parent goes on with c. */
static void pop_refeed(cb_matcher *m, int32_t k, int c, int special, outs *o) {
    int32_t p = child_done(m, m->pool[k].parent);
    if (p >= 0) feed(m, p, c, special, o);
}

/* The frame k consumed its last byte: the state is its parent, advanced. */
static void pop_done(cb_matcher *m, int32_t k, outs *o) { emit(o, child_done(m, m->pool[k].parent)); }

/* Start a value of `node` under parent frame pk (already in its waiting phase) and feed c. */
static void push_alt(cb_matcher *m, int32_t pk, int32_t node, int c, int special, outs *o, int hops) {
    if (m->pool[pk].depth + 1 >= MAX_DEPTH) return;
    const cb_gnode *n = &m->g->nodes[node];
    if (n->kind == GK_ANYOF) {
        /* a $ref cycle that never reaches a value (a refers to a) ends here */
        if (hops >= MAX_DEPTH) return;
        for (int32_t j = 0; j < n->b; j++) push_alt(m, pk, m->g->alts[n->a + j], c, special, o, hops + 1);
        return;
    }
    int32_t k;
    if (n->kind == GK_LITERALS) k = newf(m, pk, node, 0, n->a, (int64_t)n->a + n->b, 0);
    else k = newf(m, pk, node, 0, 0, 0, 0);
    if (k >= 0) feed(m, k, c, special, o);
}

static void push_value(cb_matcher *m, int32_t pk, int32_t node, int c, int special, outs *o) {
    push_alt(m, pk, node, c, special, o, 0);
}

/* ---- integers: can a prefix still reach a value within [lo, hi]? ---- */
static const int64_t POW10[19] = {1LL, 10LL, 100LL, 1000LL, 10000LL, 100000LL, 1000000LL, 10000000LL, 100000000LL,
                                  1000000000LL, 10000000000LL, 100000000000LL, 1000000000000LL, 10000000000000LL,
                                  100000000000000LL, 1000000000000000LL, 10000000000000000LL,
                                  100000000000000000LL, 1000000000000000000LL};

static int mag_range_ok(const cb_gnode *n, int neg, int64_t mlo, int64_t mhi) {
    int64_t lo = neg ? -mhi : mlo, hi = neg ? -mlo : mhi;
    return hi >= n->lo && lo <= n->hi;
}

/* digits: how many digits the magnitude mag has (0: none yet). */
static int int_feasible(const cb_gnode *n, int neg, int64_t mag, int digits) {
    if (digits == 0) {
        if (mag_range_ok(n, neg, 0, 0)) return 1;
        for (int k = 1; k <= INT_MAX_DIGITS; k++)
            if (mag_range_ok(n, neg, POW10[k - 1], POW10[k] - 1)) return 1;
        return 0;
    }
    if (mag_range_ok(n, neg, mag, mag)) return 1;
    if (mag == 0) return 0;
    for (int k = 1; digits + k <= INT_MAX_DIGITS; k++)
        if (mag_range_ok(n, neg, mag * POW10[k], mag * POW10[k] + POW10[k] - 1)) return 1;
    return 0;
}

static int int_accept(const cb_gnode *n, int neg, int64_t mag) {
    int64_t v = neg ? -mag : mag;
    return v >= n->lo && v <= n->hi;
}

/* ---- numbers ---- */
static int num_interval_ok(const cb_gnode *n, double lo, double hi) {
    if (n->has_lo && (hi < n->dlo || (n->lo_ex && hi <= n->dlo))) return 0;
    if (n->has_hi && (lo > n->dhi || (n->hi_ex && lo >= n->dhi))) return 0;
    return 1;
}

static int num_range_ok(const cb_gnode *n, int neg, double mlo, double mhi) {
    return neg ? num_interval_ok(n, -mhi, -mlo) : num_interval_ok(n, mlo, mhi);
}

/* The exact value of the number text (as a JSON reader parses it) against the bounds. */
static int num_accept(const cb_gnode *n, int neg, int64_t mant, int fd) {
    if (!n->has_lo && !n->has_hi) return 1;
    char buf[96];
    if (fd > NUM_MAX_FRAC_DIGITS) fd = NUM_MAX_FRAC_DIGITS;
    if (fd > 0)
        snprintf(buf, sizeof buf, "%s%lld.%0*lld", neg ? "-" : "", (long long)(mant / POW10[fd]), fd,
                 (long long)(mant % POW10[fd]));
    else snprintf(buf, sizeof buf, "%s%lld", neg ? "-" : "", (long long)mant);
    double v = strtod(buf, NULL);
    if (n->has_lo && (v < n->dlo || (n->lo_ex && v <= n->dlo))) return 0;
    if (n->has_hi && (v > n->dhi || (n->hi_ex && v >= n->dhi))) return 0;
    return 1;
}

/* Feasible completions of a number prefix: int digits id (mantissa mant), frac digits fd,
 * phase N_INT / N_DOT / N_FRAC; zero: the integer part is a leading 0. */
static int num_feasible(const cb_gnode *n, int neg, int64_t mant, int id, int fd, int phase, int zero) {
    if (!n->has_lo && !n->has_hi) return 1;
    const double fmax = 1.0 - 1e-6;
    if (phase == N_INT) {
        double v = (double)mant;
        if (num_range_ok(n, neg, v, v + fmax)) return 1;
        if (!zero)
            for (int k = 1; id + k <= NUM_MAX_INT_DIGITS; k++)
                if (num_range_ok(n, neg, v * (double)POW10[k], (v + 1) * (double)POW10[k])) return 1;
        return 0;
    }
    if (phase == N_DOT) return num_range_ok(n, neg, (double)mant + 1e-6, (double)mant + fmax);
    double scale = (double)POW10[fd], v = (double)mant / scale;
    if (fd >= NUM_MAX_FRAC_DIGITS) return num_accept(n, neg, mant, fd);
    return num_range_ok(n, neg, v, v + 1.0 / scale - 1e-6);
}

/* ---- one byte into frame k ---- */
static void feed_string(cb_matcher *m, int32_t k, const cb_gnode *n, int c, outs *o) {
    const gframe f = m->pool[k];
    int can_add = n->hi < 0 || f.i < n->hi;
    switch (f.phase) {
    case S_START:
        if (c == '"') emit(o, modf_(m, k, S_BODY, 0, 0, 0));
        return;
    case S_BODY:
        if (c == '"') {
            if (f.i >= n->lo) pop_done(m, k, o);
            return;
        }
        if (c == END_BYTE || c < 0x20 || !can_add) return;
        if (c == '\\') emit(o, modf_(m, k, S_ESC, f.i + 1, 0, 0));
        else if (c < 0x80) emit(o, modf_(m, k, S_BODY, f.i + 1, 0, 0));
        else if (c >= 0xC2 && c <= 0xDF) emit(o, modf_(m, k, S_UTF8, f.i + 1, 0, 1));
        else if (c == 0xE0) emit(o, modf_(m, k, S_UTF8, f.i + 1, 1, 2));
        else if (c == 0xED) emit(o, modf_(m, k, S_UTF8, f.i + 1, 2, 2));
        else if (c >= 0xE1 && c <= 0xEF) emit(o, modf_(m, k, S_UTF8, f.i + 1, 0, 2));
        else if (c == 0xF0) emit(o, modf_(m, k, S_UTF8, f.i + 1, 3, 3));
        else if (c >= 0xF1 && c <= 0xF3) emit(o, modf_(m, k, S_UTF8, f.i + 1, 0, 3));
        else if (c == 0xF4) emit(o, modf_(m, k, S_UTF8, f.i + 1, 4, 3));
        return;
    case S_UTF8: {
        static const uint8_t rlo[5] = {0x80, 0xA0, 0x80, 0x90, 0x80}, rhi[5] = {0xBF, 0xBF, 0x9F, 0xBF, 0x8F};
        if (c == END_BYTE || c < rlo[f.a] || c > rhi[f.a]) return;
        if (f.b == 1) emit(o, modf_(m, k, S_BODY, f.i, 0, 0));
        else emit(o, modf_(m, k, S_UTF8, f.i, 0, f.b - 1));
        return;
    }
    case S_ESC:
        if (c == 'u') emit(o, modf_(m, k, S_HEX, f.i, 0, 0));
        else if (c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' || c == 'r' || c == 't')
            emit(o, modf_(m, k, S_BODY, f.i, 0, 0));
        return;
    case S_HEX: {
        int h = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
        if (!h) return;
        /* no surrogate code points (\ud800-\udfff): a lone one is not valid text */
        if (f.b == 1 && f.a == 1 && !(c >= '0' && c <= '7')) return;
        int64_t sur = (f.b == 0) ? (c == 'd' || c == 'D') : f.a;
        if (f.b == 3) emit(o, modf_(m, k, S_BODY, f.i, 0, 0));
        else emit(o, modf_(m, k, S_HEX, f.i, sur, f.b + 1));
        return;
    }
    }
}

static void feed_integer(cb_matcher *m, int32_t k, const cb_gnode *n, int c, int special, outs *o) {
    const gframe f = m->pool[k];
    int neg = (int)f.b, digit = c >= '0' && c <= '9';
    switch (f.phase) {
    case I_START:
        if (c == '-') {
            /* "-0" is not generated: a minus needs a value <= -1 */
            if (n->lo < 0 && int_feasible(n, 1, 0, 0)) emit(o, modf_(m, k, I_MINUS, 0, 0, 1));
            return;
        }
        /* fall through */
    case I_MINUS:
        if (!digit) return;
        if (c == '0') {
            if (!neg && int_accept(n, 0, 0)) emit(o, modf_(m, k, I_ZERO, 1, 0, neg));
        } else if (int_feasible(n, neg, c - '0', 1)) {
            emit(o, modf_(m, k, I_DIGITS, 1, c - '0', neg));
        }
        return;
    case I_ZERO:
        pop_refeed(m, k, c, special, o);
        return;
    case I_DIGITS:
        if (digit && f.i < INT_MAX_DIGITS && int_feasible(n, neg, f.a * 10 + (c - '0'), (int)f.i + 1)) {
            emit(o, modf_(m, k, I_DIGITS, f.i + 1, f.a * 10 + (c - '0'), neg));
            return;
        }
        if (!digit && int_accept(n, neg, f.a)) pop_refeed(m, k, c, special, o);
        return;
    }
}

/* number frames: i = int digits | frac digits << 8; a = mantissa; b = neg | zero << 1 */
static void feed_number(cb_matcher *m, int32_t k, const cb_gnode *n, int c, int special, outs *o) {
    const gframe f = m->pool[k];
    int neg = (int)(f.b & 1), zero = (int)((f.b >> 1) & 1), digit = c >= '0' && c <= '9';
    int id = (int)(f.i & 0xFF), fd = (int)(f.i >> 8);
    switch (f.phase) {
    case N_START:
        if (c == '-') {
            if (num_range_ok(n, 1, 0.0, 1e13)) emit(o, modf_(m, k, N_MINUS, 0, 0, 1));
            return;
        }
        /* fall through */
    case N_MINUS:
        if (!digit) return;
        if (num_feasible(n, neg, c - '0', 1, 0, N_INT, c == '0'))
            emit(o, modf_(m, k, N_INT, 1, c - '0', neg | (c == '0') << 1));
        return;
    case N_INT:
        if (digit && !zero && id < NUM_MAX_INT_DIGITS) {
            int64_t nm = f.a * 10 + (c - '0');
            if (num_feasible(n, neg, nm, id + 1, 0, N_INT, 0)) emit(o, modf_(m, k, N_INT, id + 1, nm, f.b));
            return;
        }
        if (c == '.') {
            if (num_feasible(n, neg, f.a, id, 0, N_DOT, zero)) emit(o, modf_(m, k, N_DOT, f.i, f.a, f.b));
            return;
        }
        if (!digit && num_accept(n, neg, f.a, 0)) pop_refeed(m, k, c, special, o);
        return;
    case N_DOT:
        if (digit) {
            int64_t nm = f.a * 10 + (c - '0');
            if (num_feasible(n, neg, nm, id, 1, N_FRAC, zero)) emit(o, modf_(m, k, N_FRAC, id | 1 << 8, nm, f.b));
        }
        return;
    case N_FRAC:
        if (digit && fd < NUM_MAX_FRAC_DIGITS) {
            int64_t nm = f.a * 10 + (c - '0');
            if (num_feasible(n, neg, nm, id, fd + 1, N_FRAC, zero))
                emit(o, modf_(m, k, N_FRAC, id | (int64_t)(fd + 1) << 8, nm, f.b));
            return;
        }
        if (!digit && num_accept(n, neg, f.a, fd)) pop_refeed(m, k, c, special, o);
        return;
    }
}

/* literal sets: i..a the candidate range in lits[], b the bytes matched */
static void feed_literals(cb_matcher *m, int32_t k, int c, int special, outs *o) {
    const gframe f = m->pool[k];
    const colibri_grammar *g = m->g;
    int64_t lo = f.i, hi = f.a, pos = f.b, nlo = -1, nhi = -1;
    if (c != END_BYTE) {
        for (int64_t j = lo; j < hi; j++) {
            const cb_glit *l = &g->lits[j];
            if (l->len > pos && (uint8_t)g->text[l->off + pos] == c) {
                if (nlo < 0) nlo = j;
                nhi = j + 1;
            }
        }
    }
    if (nlo >= 0) {
        /* one candidate left and it is whole: the value ends here */
        if (nhi - nlo == 1 && g->lits[nlo].len == pos + 1) {
            pop_done(m, k, o);
            return;
        }
        emit(o, modf_(m, k, 0, nlo, nhi, pos + 1));
        return;
    }
    for (int64_t j = lo; j < hi; j++)
        if (g->lits[j].len == pos) {
            pop_refeed(m, k, c, special, o);
            return;
        }
}

static void feed_array(cb_matcher *m, int32_t k, const cb_gnode *n, int c, int special, outs *o) {
    const gframe f = m->pool[k];
    switch (f.phase) {
    case A_START:
        if (c == '[') emit(o, modf_(m, k, A_OPEN, 0, 0, 0));
        return;
    case A_OPEN:
        if (c == ']') {
            if (n->lo == 0) pop_done(m, k, o);
            return;
        }
        /* fall through */
    case A_COMMA:
        if (n->hi != 0) {
            int32_t p = modf_(m, k, A_ITEM, f.i, 0, 0);
            if (p >= 0) push_value(m, p, n->a, c, special, o);
        }
        return;
    case A_AFTER:
        if (c == ',' && (n->hi < 0 || f.i < n->hi)) emit(o, modf_(m, k, A_COMMA, f.i, 0, 0));
        else if (c == ']' && f.i >= n->lo) pop_done(m, k, o);
        return;
    }
}

/* closed objects: properties in the schema's order; an optional one may be skipped */
static int obj_can_close(const colibri_grammar *g, const cb_gnode *n, int64_t i) {
    for (int64_t j = i; j < n->b; j++)
        if (g->props[n->a + j].required) return 0;
    return 1;
}

/* candidates for the next key from property i: up to and including the next required one */
static uint64_t obj_window(const colibri_grammar *g, const cb_gnode *n, int64_t i) {
    uint64_t mask = 0;
    for (int64_t j = i; j < n->b && j - i < 64; j++) {
        mask |= 1ull << (j - i);
        if (g->props[n->a + j].required) break;
    }
    return mask;
}

static void key_step(cb_matcher *m, int32_t k, const cb_gnode *n, int64_t base, uint64_t mask, int64_t pos, int c,
                     outs *o) {
    const colibri_grammar *g = m->g;
    uint64_t nm = 0;
    int64_t done = -1;
    for (uint64_t w = mask; w; w &= w - 1) {
        int j = __builtin_ctzll(w);
        const cb_gprop *p = &g->props[n->a + base + j];
        if (p->key_len > pos && (uint8_t)g->text[p->key_off + pos] == c) {
            nm |= 1ull << j;
            if (p->key_len == pos + 1) done = base + j;
        }
    }
    if (!nm) return;
    if (done >= 0) emit(o, modf_(m, k, O_COLON, base, done, 0));
    else emit(o, modf_(m, k, O_KEY, base, (int64_t)nm, pos + 1));
}

static void feed_object(cb_matcher *m, int32_t k, const cb_gnode *n, int c, int special, outs *o) {
    const gframe f = m->pool[k];
    const colibri_grammar *g = m->g;
    switch (f.phase) {
    case O_START:
        if (c == '{') emit(o, modf_(m, k, O_OPEN, 0, 0, 0));
        return;
    case O_OPEN:
        if (c == '}') {
            if (obj_can_close(g, n, 0)) pop_done(m, k, o);
            return;
        }
        if (n->b > 0) key_step(m, k, n, 0, obj_window(g, n, 0), 0, c, o);
        return;
    case O_KEY: /* i: window base, a: candidates, b: bytes matched */
        key_step(m, k, n, f.i, (uint64_t)f.a, f.b, c, o);
        return;
    case O_COLON: /* a: the property */
        if (c == ':') emit(o, modf_(m, k, O_VALSTART, f.i, f.a, 0));
        return;
    case O_VALSTART: {
        int32_t p = modf_(m, k, O_VALUE, f.i, f.a, 0);
        if (p >= 0) push_value(m, p, g->props[n->a + f.a].value, c, special, o);
        return;
    }
    case O_AFTER: /* i: the next property */
        if (c == ',' && f.i < n->b) emit(o, modf_(m, k, O_COMMA, f.i, 0, 0));
        else if (c == '}' && obj_can_close(g, n, f.i)) pop_done(m, k, o);
        return;
    case O_COMMA:
        key_step(m, k, n, f.i, obj_window(g, n, f.i), 0, c, o);
        return;
    }
}

static void feed_map(cb_matcher *m, int32_t k, const cb_gnode *n, int c, int special, outs *o) {
    const gframe f = m->pool[k];
    switch (f.phase) {
    case M_START:
        if (c == '{') emit(o, modf_(m, k, M_OPEN, 0, 0, 0));
        return;
    case M_OPEN:
        if (c == '}') {
            pop_done(m, k, o);
            return;
        }
        /* fall through */
    case M_COMMA: {
        int32_t p = modf_(m, k, M_KEY, 0, 0, 0);
        if (p >= 0) push_value(m, p, n->b, c, special, o);
        return;
    }
    case M_COLON:
        if (c == ':') emit(o, modf_(m, k, M_VALSTART, 0, 0, 0));
        return;
    case M_VALSTART: {
        int32_t p = modf_(m, k, M_VALUE, 0, 0, 0);
        if (p >= 0) push_value(m, p, n->a, c, special, o);
        return;
    }
    case M_AFTER:
        if (c == ',') emit(o, modf_(m, k, M_COMMA, 0, 0, 0));
        else if (c == '}') pop_done(m, k, o);
        return;
    }
}

static void feed_root(cb_matcher *m, int32_t k, const cb_gnode *n, int c, int special, outs *o) {
    const gframe f = m->pool[k];
    const colibri_grammar *g = m->g;
    switch (f.phase) {
    case R_PREFIX:
        if (f.i < g->prefix_len) {
            if (c != END_BYTE && (uint8_t)g->text[g->prefix_off + f.i] == c) emit(o, modf_(m, k, R_PREFIX, f.i + 1, 0, 0));
            return;
        }
        if (special || c == END_BYTE) return;
        {
            int32_t p = modf_(m, k, R_VALUE, 0, 0, 0);
            if (p >= 0) push_value(m, p, n->a, c, special, o);
        }
        return;
    case R_SUFFIX:
        if (c != END_BYTE && f.i < g->suffix_len && (uint8_t)g->text[g->suffix_off + f.i] == c)
            emit(o, modf_(m, k, f.i + 1 == g->suffix_len ? R_DONE : R_SUFFIX, f.i + 1, 0, 0));
        return;
    case R_DONE:
        if (c == END_BYTE) emit(o, k);
        return;
    }
}

/* A number or literal set that is complete where it stands (it ends when the next byte cannot continue it). */
static int pending_complete(const cb_matcher *m, const gframe *f, const cb_gnode *n) {
    switch (n->kind) {
    case GK_INTEGER:
        return f->phase == I_ZERO || (f->phase == I_DIGITS && int_accept(n, (int)f->b, f->a));
    case GK_NUMBER:
        return (f->phase == N_INT && num_accept(n, (int)(f->b & 1), f->a, 0)) ||
               (f->phase == N_FRAC && num_accept(n, (int)(f->b & 1), f->a, (int)(f->i >> 8)));
    case GK_LITERALS:
        for (int64_t j = f->i; j < f->a; j++)
            if (m->g->lits[j].len == f->b) return 1;
        return 0;
    default:
        return 0;
    }
}

static void feed(cb_matcher *m, int32_t k, int c, int special, outs *o) {
    const cb_gnode *n = &m->g->nodes[m->pool[k].node];
    if (n->kind == GK_ROOT) {
        feed_root(m, k, n, c, special, o);
        return;
    }
    /* inside the value: special tokens never; a pending number or literal may end before one */
    if (special) {
        const gframe *f = &m->pool[k];
        if (pending_complete(m, f, n)) pop_refeed(m, k, c, special, o);
        return;
    }
    switch (n->kind) {
    case GK_STRING: feed_string(m, k, n, c, o); return;
    case GK_INTEGER: feed_integer(m, k, n, c, special, o); return;
    case GK_NUMBER: feed_number(m, k, n, c, special, o); return;
    case GK_LITERALS: feed_literals(m, k, c, special, o); return;
    case GK_ARRAY: feed_array(m, k, n, c, special, o); return;
    case GK_OBJECT: feed_object(m, k, n, c, special, o); return;
    case GK_MAP: feed_map(m, k, n, c, special, o); return;
    default: return;
    }
}

/* ---- sets of stacks ---- */
static int same_stack(const cb_matcher *m, int32_t a, int32_t b) {
    while (a != b) {
        if (a < 0 || b < 0) return 0;
        const gframe *x = &m->pool[a], *y = &m->pool[b];
        if (x->node != y->node || x->phase != y->phase || x->i != y->i || x->a != y->a || x->b != y->b) return 0;
        a = x->parent;
        b = y->parent;
    }
    return 1;
}

/* Step every stack of tops[0..n) by byte c into out; returns the number of distinct stacks. */
static int step_set(cb_matcher *m, const int32_t *tops, int n, int c, int special, int32_t *out) {
    int32_t buf[MAX_STACKS];
    int total = 0;
    for (int s = 0; s < n; s++) {
        outs o = {buf, 0};
        feed(m, tops[s], c, special, &o);
        for (int j = 0; j < o.n; j++) {
            int dup = 0;
            for (int q = 0; q < total && !dup; q++) dup = same_stack(m, out[q], buf[j]);
            if (!dup && total < MAX_STACKS) out[total++] = buf[j];
        }
    }
    return total;
}

/* ---- the matcher ---- */
colibri_status cb_matcher_create(const colibri_grammar *g, cb_matcher **out) {
    *out = NULL;
    cb_matcher *m = calloc(1, sizeof *m);
    if (!m) return COLIBRI_E_NOMEM;
    m->g = g;
    /* two committed regions, then the walk's frames: a few per stack per byte of a token */
    int64_t cap = 2 * (int64_t)COMMIT_FRAMES + ((int64_t)g->tk->max_tok_len + 2) * MAX_STACKS * 8 + 65536;
    if (cap > (1 << 24)) cap = 1 << 24;
    m->pool_cap = (int32_t)cap;
    m->pool = malloc((size_t)cap * sizeof(gframe));
    m->dfs_tops = malloc(((size_t)g->tk->max_tok_len + 2) * MAX_STACKS * sizeof(int32_t));
    if (!m->pool || !m->dfs_tops) {
        cb_matcher_free(m);
        return COLIBRI_E_NOMEM;
    }
    cb_matcher_reset(m);
    *out = m;
    return COLIBRI_OK;
}

void cb_matcher_free(cb_matcher *m) {
    if (!m) return;
    free(m->pool);
    free(m->dfs_tops);
    free(m);
}

void cb_matcher_reset(cb_matcher *m) {
    m->commit_base = 0;
    m->pool_top = 0;
    m->tops[0] = newf(m, -1, m->g->root, R_PREFIX, 0, 0, 0);
    m->n_tops = 1;
    m->pool_top = 2 * COMMIT_FRAMES;
}

/* Copy the stacks tops[0..n) into the other committed region and make them the state. */
static void commit(cb_matcher *m, const int32_t *tops, int n) {
    int32_t base = m->commit_base ? 0 : COMMIT_FRAMES, w = base;
    int32_t chain[MAX_DEPTH + 1];
    int32_t nt[MAX_STACKS];
    for (int s = 0; s < n; s++) {
        int d = 0;
        for (int32_t k = tops[s]; k >= 0 && d <= MAX_DEPTH; k = m->pool[k].parent) chain[d++] = k;
        int32_t parent = -1;
        for (int j = d - 1; j >= 0; j--) {
            gframe f = m->pool[chain[j]];
            f.parent = parent;
            m->pool[w] = f;
            parent = w++;
        }
        nt[s] = parent;
    }
    memcpy(m->tops, nt, (size_t)n * sizeof(int32_t));
    m->n_tops = n;
    m->commit_base = base;
    m->pool_top = 2 * COMMIT_FRAMES;
}

/* Step the committed state through bytes[0..len); the surviving stacks in out (scratch). */
static int step_bytes(cb_matcher *m, const uint8_t *bytes, int32_t len, int special, int32_t *out) {
    int32_t cur[MAX_STACKS], nxt[MAX_STACKS];
    int n = m->n_tops;
    memcpy(cur, m->tops, (size_t)n * sizeof(int32_t));
    for (int32_t j = 0; j < len && n > 0; j++) {
        n = step_set(m, cur, n, bytes[j], special, nxt);
        memcpy(cur, nxt, (size_t)n * sizeof(int32_t));
    }
    memcpy(out, cur, (size_t)n * sizeof(int32_t));
    return n;
}

int cb_matcher_accept(cb_matcher *m, int32_t id) {
    const colibri_grammar *g = m->g;
    if (id < 0 || id >= g->tk->V || g->tk->tok_len[id] == 0) return -1;
    int32_t out[MAX_STACKS];
    int n = step_bytes(m, g->tk->tok_bytes + g->tk->tok_off[id], g->tk->tok_len[id], g->tk->tok_special[id], out);
    if (n == 0) {
        m->pool_top = 2 * COMMIT_FRAMES;
        return -1;
    }
    commit(m, out, n);
    return 0;
}

int cb_matcher_complete(cb_matcher *m) {
    int32_t out[MAX_STACKS];
    int32_t save = m->pool_top;
    int n = step_set(m, m->tops, m->n_tops, END_BYTE, 0, out);
    m->pool_top = save;
    return n > 0;
}

/* The trie walk, depth first with an explicit stack of (next child to try, state, pool mark). */
static void walk(cb_matcher *m, const cb_trie *t, uint8_t *allowed, int32_t nv) {
    const colibri_grammar *g = m->g;
    int32_t max_d = g->tk->max_tok_len + 1;
    typedef struct {
        int32_t child, pool_mark, n;
    } lvl;
    lvl st[512];
    int32_t *tops = m->dfs_tops;
    memcpy(tops, m->tops, (size_t)m->n_tops * sizeof(int32_t));
    int d = 0;
    st[0].child = t->child[0];
    st[0].n = m->n_tops;
    st[0].pool_mark = m->pool_top;
    while (d >= 0) {
        int32_t ch = st[d].child;
        if (ch < 0) {
            d--;
            if (d >= 0) m->pool_top = st[d].pool_mark;
            continue;
        }
        st[d].child = t->next[ch];
        m->pool_top = st[d].pool_mark;
        int32_t *next = tops + (size_t)(d + 1) * MAX_STACKS;
        int n = step_set(m, tops + (size_t)d * MAX_STACKS, st[d].n, t->byte[ch], 0, next);
        if (n == 0) continue;
        for (int32_t k = t->tok[ch]; k >= 0; k = t->tok_next[k])
            if (k < nv) allowed[k] = 1;
        if (t->child[ch] >= 0 && d + 1 < (int)(sizeof st / sizeof st[0]) && d + 1 < max_d) {
            d++;
            st[d].child = t->child[ch];
            st[d].n = n;
            st[d].pool_mark = m->pool_top;
        }
    }
}

/* Every stack is inside a string, between characters, with room for any token's characters:
 * then every "inside" token is allowed as it is, and only the others need the walk. */
static int in_free_string(const cb_matcher *m) {
    for (int s = 0; s < m->n_tops; s++) {
        const gframe *f = &m->pool[m->tops[s]];
        const cb_gnode *n = &m->g->nodes[f->node];
        if (n->kind != GK_STRING || f->phase != S_BODY) return 0;
        if (n->hi >= 0 && n->hi - f->i < m->g->tk->max_tok_len) return 0;
    }
    return m->n_tops > 0;
}

int cb_matcher_mask(cb_matcher *m, uint8_t *allowed, int32_t n) {
    const colibri_grammar *g = m->g;
    int32_t save = m->pool_top;
    if (in_free_string(m)) {
        memcpy(allowed, g->tk->tok_inside, (size_t)(n < g->tk->V ? n : g->tk->V));
        if (n > g->tk->V) memset(allowed + g->tk->V, 0, (size_t)(n - g->tk->V));
        walk(m, &g->tk->edge, allowed, n);
    } else {
        memset(allowed, 0, (size_t)n);
        walk(m, &g->tk->all, allowed, n);
    }
    m->pool_top = save;
    int32_t out[MAX_STACKS];
    for (int32_t s = 0; s < g->tk->n_special; s++) {
        int32_t id = g->tk->special_ids[s];
        if (id >= n) continue;
        if (step_bytes(m, g->tk->tok_bytes + g->tk->tok_off[id], g->tk->tok_len[id], 1, out) > 0) allowed[id] = 1;
        m->pool_top = save;
    }
    return cb_matcher_complete(m);
}
