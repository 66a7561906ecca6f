/*
 * schema.c — colibri_grammar_compile: a JSON schema (text) parsed by a small JSON parser of
 * its own (the library depends on libc only), compiled into grammar nodes (grammar.h), and
 * the tokenizer's tokens laid out for the matcher: each token's bytes and a byte trie of
 * them. Every keyword is either compiled, accepted as an annotation, or refused by name.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "grammar/grammar.h"
#include "tokenizer/tokenizer.h"

/* ---- a JSON tree ---- */
enum { JV_NULL, JV_FALSE, JV_TRUE, JV_NUM, JV_STR, JV_ARR, JV_OBJ };

typedef struct jv {
    int type;
    double num;
    const char *numtext; /* the number's text in the source */
    int32_t numlen;
    char *str;           /* JV_STR: the decoded UTF-8 string */
    int32_t slen;
    int32_t n;           /* JV_ARR / JV_OBJ: element count */
    struct jv *items;    /* [n] */
    char **keys;         /* JV_OBJ: [n] decoded keys */
    int32_t *klens;
} jv;

typedef struct {
    const char *s;
    size_t len, pos;
    int depth;
    char *err;
    size_t err_len;
    int failed;
    void **allocs; /* every allocation, freed at the end */
    size_t n_allocs, cap_allocs;
} jparser;

#define JSON_MAX_DEPTH 64

static void *jalloc(jparser *p, size_t n) {
    if (p->n_allocs == p->cap_allocs) {
        size_t nc = p->cap_allocs ? p->cap_allocs * 2 : 64;
        void **na = realloc(p->allocs, nc * sizeof *na);
        if (!na) return NULL;
        p->allocs = na;
        p->cap_allocs = nc;
    }
    void *r = calloc(1, n ? n : 1);
    if (r) p->allocs[p->n_allocs++] = r;
    return r;
}

static void jfree_all(jparser *p) {
    for (size_t i = 0; i < p->n_allocs; i++) free(p->allocs[i]);
    free(p->allocs);
}

static int jfail(jparser *p, const char *fmt, ...) CB_PRINTF(2, 3);
static int jfail(jparser *p, const char *fmt, ...) {
    if (!p->failed) {
        char msg[256];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof msg, fmt, ap);
        va_end(ap);
        cb_set_err(p->err, p->err_len, "json_schema is not valid JSON: %s at byte %zu", msg, p->pos);
    }
    p->failed = 1;
    return -1;
}

static void jws(jparser *p) {
    while (p->pos < p->len && (p->s[p->pos] == ' ' || p->s[p->pos] == '\t' || p->s[p->pos] == '\n' || p->s[p->pos] == '\r'))
        p->pos++;
}

static int hexv(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static int put_utf8(char *o, uint32_t cp) {
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    if (cp < 0x800) { o[0] = (char)(0xC0 | (cp >> 6)); o[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12)); o[1] = (char)(0x80 | ((cp >> 6) & 0x3F)); o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (cp >> 18)); o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* A string starting at the opening quote; the decoded bytes (at most as long as the source). */
static int jstring(jparser *p, char **out, int32_t *olen) {
    p->pos++; /* '"' */
    size_t start = p->pos;
    size_t end = start;
    while (end < p->len && p->s[end] != '"') end += (p->s[end] == '\\') ? 2 : 1;
    if (end >= p->len) return jfail(p, "unterminated string");
    if (end - start > (size_t)INT32_MAX / 2) return jfail(p, "string too long");
    char *o = jalloc(p, end - start + 1);
    if (!o) return jfail(p, "out of memory");
    int32_t n = 0;
    while (p->pos < end) {
        unsigned char c = (unsigned char)p->s[p->pos];
        if (c < 0x20) return jfail(p, "control character in a string");
        if (c != '\\') {
            o[n++] = (char)c;
            p->pos++;
            continue;
        }
        char e = p->s[p->pos + 1];
        p->pos += 2;
        switch (e) {
        case '"': o[n++] = '"'; break;
        case '\\': o[n++] = '\\'; break;
        case '/': o[n++] = '/'; break;
        case 'b': o[n++] = '\b'; break;
        case 'f': o[n++] = '\f'; break;
        case 'n': o[n++] = '\n'; break;
        case 'r': o[n++] = '\r'; break;
        case 't': o[n++] = '\t'; break;
        case 'u': {
            uint32_t cp = 0;
            for (int k = 0; k < 4; k++) {
                int h = p->pos < end ? hexv(p->s[p->pos]) : -1;
                if (h < 0) return jfail(p, "bad \\u escape");
                cp = cp * 16 + (uint32_t)h;
                p->pos++;
            }
            if (cp >= 0xD800 && cp < 0xDC00 && p->pos + 6 <= end && p->s[p->pos] == '\\' && p->s[p->pos + 1] == 'u') {
                uint32_t lo = 0;
                int ok = 1;
                for (int k = 0; k < 4; k++) {
                    int h = hexv(p->s[p->pos + 2 + k]);
                    if (h < 0) ok = 0;
                    lo = lo * 16 + (uint32_t)(h < 0 ? 0 : h);
                }
                if (ok && lo >= 0xDC00 && lo < 0xE000) {
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    p->pos += 6;
                }
            }
            if (cp >= 0xD800 && cp < 0xE000) cp = 0xFFFD;
            n += put_utf8(o + n, cp);
            break;
        }
        default: return jfail(p, "bad escape");
        }
    }
    p->pos = end + 1;
    o[n] = 0;
    *out = o;
    *olen = n;
    return 0;
}

static int jvalue(jparser *p, jv *v);

static int jvalue(jparser *p, jv *v) {
    jws(p);
    if (p->pos >= p->len) return jfail(p, "unexpected end");
    if (++p->depth > JSON_MAX_DEPTH) return jfail(p, "nested deeper than %d", JSON_MAX_DEPTH);
    char c = p->s[p->pos];
    int r = 0;
    memset(v, 0, sizeof *v);
    if (c == '{' || c == '[') {
        int obj = c == '{';
        char close = obj ? '}' : ']';
        v->type = obj ? JV_OBJ : JV_ARR;
        p->pos++;
        int32_t cap = 0;
        jws(p);
        if (p->pos < p->len && p->s[p->pos] == close) {
            p->pos++;
        } else {
            for (;;) {
                jws(p);
                if (v->n == cap) {
                    int32_t nc = cap ? cap * 2 : 8;
                    jv *ni = jalloc(p, (size_t)nc * sizeof(jv));
                    char **nk = obj ? jalloc(p, (size_t)nc * sizeof(char *)) : NULL;
                    int32_t *nl = obj ? jalloc(p, (size_t)nc * sizeof(int32_t)) : NULL;
                    if (!ni || (obj && (!nk || !nl))) return jfail(p, "out of memory");
                    if (v->n) {
                        memcpy(ni, v->items, (size_t)v->n * sizeof(jv));
                        if (obj) {
                            memcpy(nk, v->keys, (size_t)v->n * sizeof(char *));
                            memcpy(nl, v->klens, (size_t)v->n * sizeof(int32_t));
                        }
                    }
                    v->items = ni;
                    v->keys = nk;
                    v->klens = nl;
                    cap = nc;
                }
                if (obj) {
                    if (p->pos >= p->len || p->s[p->pos] != '"') return jfail(p, "expected a key");
                    if (jstring(p, &v->keys[v->n], &v->klens[v->n])) return -1;
                    jws(p);
                    if (p->pos >= p->len || p->s[p->pos] != ':') return jfail(p, "expected ':'");
                    p->pos++;
                }
                if (jvalue(p, &v->items[v->n])) return -1;
                v->n++;
                jws(p);
                if (p->pos < p->len && p->s[p->pos] == ',') {
                    p->pos++;
                    continue;
                }
                if (p->pos < p->len && p->s[p->pos] == close) {
                    p->pos++;
                    break;
                }
                return jfail(p, "expected ',' or '%c'", close);
            }
        }
    } else if (c == '"') {
        v->type = JV_STR;
        r = jstring(p, &v->str, &v->slen);
    } else if (c == 't' && p->len - p->pos >= 4 && !memcmp(p->s + p->pos, "true", 4)) {
        v->type = JV_TRUE;
        p->pos += 4;
    } else if (c == 'f' && p->len - p->pos >= 5 && !memcmp(p->s + p->pos, "false", 5)) {
        v->type = JV_FALSE;
        p->pos += 5;
    } else if (c == 'n' && p->len - p->pos >= 4 && !memcmp(p->s + p->pos, "null", 4)) {
        v->type = JV_NULL;
        p->pos += 4;
    } else if (c == '-' || (c >= '0' && c <= '9')) {
        size_t st = p->pos;
        if (p->s[p->pos] == '-') p->pos++;
        size_t d0 = p->pos;
        while (p->pos < p->len && p->s[p->pos] >= '0' && p->s[p->pos] <= '9') p->pos++;
        if (p->pos == d0) return jfail(p, "bad number");
        if (p->s[d0] == '0' && p->pos - d0 > 1) return jfail(p, "leading zero in a number");
        if (p->pos < p->len && p->s[p->pos] == '.') {
            p->pos++;
            size_t f0 = p->pos;
            while (p->pos < p->len && p->s[p->pos] >= '0' && p->s[p->pos] <= '9') p->pos++;
            if (p->pos == f0) return jfail(p, "bad number");
        }
        if (p->pos < p->len && (p->s[p->pos] == 'e' || p->s[p->pos] == 'E')) {
            p->pos++;
            if (p->pos < p->len && (p->s[p->pos] == '+' || p->s[p->pos] == '-')) p->pos++;
            size_t e0 = p->pos;
            while (p->pos < p->len && p->s[p->pos] >= '0' && p->s[p->pos] <= '9') p->pos++;
            if (p->pos == e0) return jfail(p, "bad number");
        }
        char buf[64];
        size_t nl = p->pos - st;
        if (nl >= sizeof buf) return jfail(p, "number too long");
        memcpy(buf, p->s + st, nl);
        buf[nl] = 0;
        v->type = JV_NUM;
        v->num = strtod(buf, NULL);
        v->numtext = p->s + st;
        v->numlen = (int32_t)nl;
    } else {
        return jfail(p, "unexpected character");
    }
    p->depth--;
    return r;
}

/* ---- building the grammar ---- */
typedef struct {
    colibri_grammar *g;
    const jv *root;
    char *err;
    size_t err_len;
    int failed;
    colibri_status st;
    /* $ref targets compiled so far: the schema object and its node */
    const jv **ref_src;
    int32_t *ref_node;
    int32_t n_refs, cap_refs;
    int32_t any_node, key_node;
    int depth;
} compiler;

static int cfail(compiler *c, colibri_status st, const char *fmt, ...) CB_PRINTF(3, 4);
static int cfail(compiler *c, colibri_status st, const char *fmt, ...) {
    if (!c->failed) {
        va_list ap;
        va_start(ap, fmt);
        char msg[400];
        vsnprintf(msg, sizeof msg, fmt, ap);
        va_end(ap);
        cb_set_err(c->err, c->err_len, "%s", msg);
        c->st = st;
    }
    c->failed = 1;
    return -1;
}

#define GROW(arr, n, cap, extra)                                                      \
    do {                                                                              \
        if ((n) + (extra) > (cap)) {                                                  \
            int64_t nc_ = (cap) ? (int64_t)(cap) * 2 : 16;                            \
            while (nc_ < (int64_t)(n) + (extra)) nc_ *= 2;                            \
            void *np_ = realloc((arr), (size_t)nc_ * sizeof(*(arr)));                 \
            if (!np_) return cfail(c, COLIBRI_E_NOMEM, "out of memory compiling the schema"); \
            (arr) = np_;                                                              \
            (cap) = nc_;                                                              \
        }                                                                             \
    } while (0)

static int new_node(compiler *c, int kind) {
    colibri_grammar *g = c->g;
    if (g->n_nodes >= 1 << 20) return cfail(c, COLIBRI_E_UNSUPPORTED, "the schema is too large (over 2^20 grammar nodes)");
    GROW(g->nodes, g->n_nodes, g->cap_nodes, 1);
    cb_gnode *n = &g->nodes[g->n_nodes];
    memset(n, 0, sizeof *n);
    n->kind = kind;
    n->hi = -1;
    return g->n_nodes++;
}

static int add_text(compiler *c, const char *s, int64_t n, int32_t *off) {
    colibri_grammar *g = c->g;
    if (g->text_len + n > INT32_MAX / 2) return cfail(c, COLIBRI_E_UNSUPPORTED, "the schema is too large");
    GROW(g->text, g->text_len, g->text_cap, n + 1);
    memcpy(g->text + g->text_len, s, (size_t)n);
    *off = (int32_t)g->text_len;
    g->text_len += n;
    g->text[g->text_len] = 0;
    return 0;
}

/* A growable byte buffer for serialising literals. */
typedef struct {
    char *b;
    int64_t n, cap;
    int oom;
} sbuf;

static void sb_put(sbuf *s, const char *p, int64_t n) {
    if (s->oom) return;
    if (s->n + n > s->cap) {
        int64_t nc = s->cap ? s->cap * 2 : 64;
        while (nc < s->n + n) nc *= 2;
        char *nb = realloc(s->b, (size_t)nc);
        if (!nb) {
            s->oom = 1;
            return;
        }
        s->b = nb;
        s->cap = nc;
    }
    memcpy(s->b + s->n, p, (size_t)n);
    s->n += n;
}

/* The JSON text of a string, as the grammar generates it: quotes, \" \\ and control
 * characters escaped, everything else as is. */
static void sb_json_string(sbuf *s, const char *str, int32_t len) {
    sb_put(s, "\"", 1);
    for (int32_t i = 0; i < len; i++) {
        unsigned char ch = (unsigned char)str[i];
        if (ch == '"') sb_put(s, "\\\"", 2);
        else if (ch == '\\') sb_put(s, "\\\\", 2);
        else if (ch < 0x20) {
            char e[8];
            snprintf(e, sizeof e, "\\u%04x", ch);
            sb_put(s, e, 6);
        } else sb_put(s, (const char *)&str[i], 1);
    }
    sb_put(s, "\"", 1);
}

/* Compact JSON of a value (enum / const literals): what the model must write, byte for byte. */
static void sb_json(sbuf *s, const jv *v) {
    switch (v->type) {
    case JV_NULL: sb_put(s, "null", 4); break;
    case JV_TRUE: sb_put(s, "true", 4); break;
    case JV_FALSE: sb_put(s, "false", 5); break;
    case JV_NUM: sb_put(s, v->numtext, v->numlen); break;
    case JV_STR: sb_json_string(s, v->str, v->slen); break;
    case JV_ARR:
        sb_put(s, "[", 1);
        for (int32_t i = 0; i < v->n; i++) {
            if (i) sb_put(s, ",", 1);
            sb_json(s, &v->items[i]);
        }
        sb_put(s, "]", 1);
        break;
    case JV_OBJ:
        sb_put(s, "{", 1);
        for (int32_t i = 0; i < v->n; i++) {
            if (i) sb_put(s, ",", 1);
            sb_json_string(s, v->keys[i], v->klens[i]);
            sb_put(s, ":", 1);
            sb_json(s, &v->items[i]);
        }
        sb_put(s, "}", 1);
        break;
    }
}

static const jv *jget(const jv *o, const char *key) {
    if (!o || o->type != JV_OBJ) return NULL;
    size_t kl = strlen(key);
    for (int32_t i = 0; i < o->n; i++)
        if ((size_t)o->klens[i] == kl && !memcmp(o->keys[i], key, kl)) return &o->items[i];
    return NULL;
}

static int lit_cmp_r(const cb_glit *a, const cb_glit *b, const char *text) {
    int32_t n = a->len < b->len ? a->len : b->len;
    int r = memcmp(text + a->off, text + b->off, (size_t)n);
    if (r) return r;
    return (a->len > b->len) - (a->len < b->len);
}

/* insertion sort: literal sets are small, and qsort has no context argument in C11 */
static void lits_sort(cb_glit *l, int32_t n, const char *text) {
    for (int32_t i = 1; i < n; i++) {
        cb_glit x = l[i];
        int32_t j = i - 1;
        while (j >= 0 && lit_cmp_r(&l[j], &x, text) > 0) {
            l[j + 1] = l[j];
            j--;
        }
        l[j + 1] = x;
    }
}

/* A literal-set node from values vals[0..n). */
static int literal_node(compiler *c, const jv *vals, int32_t n) {
    if (n <= 0) return cfail(c, COLIBRI_E_INVALID_ARG, "enum must not be empty");
    int id = new_node(c, GK_LITERALS);
    if (id < 0) return -1;
    colibri_grammar *g = c->g;
    GROW(g->lits, g->n_lits, g->cap_lits, n);
    int32_t first = g->n_lits;
    for (int32_t i = 0; i < n; i++) {
        sbuf sb = {0};
        sb_json(&sb, &vals[i]);
        if (sb.oom) {
            free(sb.b);
            return cfail(c, COLIBRI_E_NOMEM, "out of memory compiling the schema");
        }
        int32_t off;
        int r = add_text(c, sb.b ? sb.b : "", sb.n, &off);
        int32_t len = (int32_t)sb.n;
        free(sb.b);
        if (r) return -1;
        /* duplicates are dropped */
        int dup = 0;
        for (int32_t k = first; k < g->n_lits; k++)
            if (g->lits[k].len == len && !memcmp(g->text + g->lits[k].off, g->text + off, (size_t)len)) dup = 1;
        if (!dup) g->lits[g->n_lits++] = (cb_glit){off, len};
    }
    lits_sort(g->lits + first, g->n_lits - first, g->text);
    g->nodes[id].a = first;
    g->nodes[id].b = g->n_lits - first;
    return id;
}

static int compile_schema(compiler *c, const jv *s);

static int is_annotation(const char *k) {
    static const char *const ann[] = {"title", "description", "default", "examples", "$schema", "$id", "$comment",
                                      "format", "strict", "name", "$defs", "definitions", "deprecated", "readOnly",
                                      "writeOnly", "contentMediaType", "contentEncoding", NULL};
    for (int i = 0; ann[i]; i++)
        if (!strcmp(k, ann[i])) return 1;
    return 0;
}

static int type_bit(const char *t) {
    static const char *const names[] = {"string", "number", "integer", "boolean", "null", "object", "array", NULL};
    for (int i = 0; names[i]; i++)
        if (!strcmp(t, names[i])) return 1 << i;
    return 0;
}
enum { T_STRING = 1, T_NUMBER = 2, T_INTEGER = 4, T_BOOLEAN = 8, T_NULL = 16, T_OBJECT = 32, T_ARRAY = 64 };

static int get_count(compiler *c, const jv *s, const char *k, int64_t *out) {
    const jv *v = jget(s, k);
    if (!v) return 0;
    if (v->type != JV_NUM || v->num < 0 || v->num != floor(v->num) || v->num > 1e15)
        return cfail(c, COLIBRI_E_INVALID_ARG, "%s must be a non-negative integer", k);
    *out = (int64_t)v->num;
    return 1;
}

static int get_num(compiler *c, const jv *s, const char *k, double *out) {
    const jv *v = jget(s, k);
    if (!v) return 0;
    if (v->type == JV_TRUE || v->type == JV_FALSE) /* draft-4 boolean exclusiveMinimum */
        return cfail(c, COLIBRI_E_UNSUPPORTED, "unsupported schema keyword: %s as a boolean (draft 4); give the bound as a number", k);
    if (v->type != JV_NUM) return cfail(c, COLIBRI_E_INVALID_ARG, "%s must be a number", k);
    *out = v->num;
    return 1;
}

static int compile_typed(compiler *c, const jv *s, int type);

/* One node for schema s restricted to one type bit. */
static int compile_one_type(compiler *c, const jv *s, int t) {
    colibri_grammar *g = c->g;
    if (t == T_NULL) {
        jv v = {.type = JV_NULL};
        return literal_node(c, &v, 1);
    }
    if (t == T_BOOLEAN) {
        jv v[2] = {{.type = JV_TRUE}, {.type = JV_FALSE}};
        return literal_node(c, v, 2);
    }
    if (t == T_STRING) {
        int64_t mn = 0, mx = -1;
        if (get_count(c, s, "minLength", &mn) < 0 || get_count(c, s, "maxLength", &mx) < 0) return -1;
        if (mx >= 0 && mn > mx) return cfail(c, COLIBRI_E_INVALID_ARG, "minLength %lld > maxLength %lld", (long long)mn, (long long)mx);
        int id = new_node(c, GK_STRING);
        if (id < 0) return -1;
        g->nodes[id].lo = mn;
        g->nodes[id].hi = mx;
        return id;
    }
    if (t == T_INTEGER || t == T_NUMBER) {
        double mn = 0, mx = 0, emn = 0, emx = 0;
        int hmn = get_num(c, s, "minimum", &mn), hmx = get_num(c, s, "maximum", &mx);
        int hemn = get_num(c, s, "exclusiveMinimum", &emn), hemx = get_num(c, s, "exclusiveMaximum", &emx);
        if (hmn < 0 || hmx < 0 || hemn < 0 || hemx < 0) return -1;
        int id = new_node(c, t == T_INTEGER ? GK_INTEGER : GK_NUMBER);
        if (id < 0) return -1;
        cb_gnode *n = &g->nodes[id];
        if (t == T_INTEGER) {
            /* exact integer bounds, within ±(10^18 - 1) (the digits the grammar generates) */
            const double lim = 999999999999999999.0;
            double lo = -lim, hi = lim;
            if (hmn && ceil(mn) > lo) lo = ceil(mn);
            if (hemn && floor(emn) + 1 > lo) lo = floor(emn) + 1;
            if (hmx && floor(mx) < hi) hi = floor(mx);
            if (hemx && ceil(emx) - 1 < hi) hi = ceil(emx) - 1;
            if (lo > hi) return cfail(c, COLIBRI_E_INVALID_ARG, "no integer satisfies the bounds of an integer schema");
            n->lo = (int64_t)lo;
            n->hi = (int64_t)hi;
        } else {
            n->has_lo = hmn || hemn;
            n->has_hi = hmx || hemx;
            n->dlo = hmn ? mn : emn;
            n->lo_ex = !hmn && hemn;
            if (hmn && hemn && emn >= mn) { n->dlo = emn; n->lo_ex = 1; }
            n->dhi = hmx ? mx : emx;
            n->hi_ex = !hmx && hemx;
            if (hmx && hemx && emx <= mx) { n->dhi = emx; n->hi_ex = 1; }
            if (n->has_lo && n->has_hi && (n->dlo > n->dhi || (n->dlo == n->dhi && (n->lo_ex || n->hi_ex))))
                return cfail(c, COLIBRI_E_INVALID_ARG, "no number satisfies the bounds of a number schema");
            if ((n->has_lo && fabs(n->dlo) >= 1e12) || (n->has_hi && fabs(n->dhi) >= 1e12))
                return cfail(c, COLIBRI_E_UNSUPPORTED, "number bounds beyond ±1e12 are not supported");
        }
        return id;
    }
    if (t == T_ARRAY) {
        const jv *items = jget(s, "items");
        int64_t mn = 0, mx = -1;
        if (get_count(c, s, "minItems", &mn) < 0 || get_count(c, s, "maxItems", &mx) < 0) return -1;
        if (mx >= 0 && mn > mx) return cfail(c, COLIBRI_E_INVALID_ARG, "minItems > maxItems");
        if (items && items->type == JV_ARR)
            return cfail(c, COLIBRI_E_UNSUPPORTED, "unsupported schema keyword: items as an array (tuple validation)");
        int id = new_node(c, GK_ARRAY);
        if (id < 0) return -1;
        int item = items ? compile_schema(c, items) : c->any_node;
        if (item < 0) return -1;
        g->nodes[id].a = item;
        g->nodes[id].lo = mn;
        g->nodes[id].hi = mx;
        return id;
    }
    /* object */
    const jv *props = jget(s, "properties"), *req = jget(s, "required"), *addl = jget(s, "additionalProperties");
    if (props && props->type != JV_OBJ) return cfail(c, COLIBRI_E_INVALID_ARG, "properties must be an object");
    if (req && req->type != JV_ARR) return cfail(c, COLIBRI_E_INVALID_ARG, "required must be an array");
    if (req)
        for (int32_t i = 0; i < req->n; i++) {
            if (req->items[i].type != JV_STR) return cfail(c, COLIBRI_E_INVALID_ARG, "required must list strings");
            if (!props || !jget(props, req->items[i].str))
                return cfail(c, COLIBRI_E_UNSUPPORTED,
                             "required property \"%.100s\" is not in properties (additional properties are not generated)",
                             req->items[i].str);
        }
    if (!props || props->n == 0) {
        if (addl && addl->type == JV_FALSE) { /* the empty object */
            int id = new_node(c, GK_OBJECT);
            return id;
        }
        int id = new_node(c, GK_MAP);
        if (id < 0) return -1;
        int val = (addl && addl->type == JV_OBJ) ? compile_schema(c, addl) : c->any_node;
        if (val < 0) return -1;
        g->nodes[id].a = val;
        g->nodes[id].b = c->key_node;
        return id;
    }
    int id = new_node(c, GK_OBJECT);
    if (id < 0) return -1;
    GROW(g->props, g->n_props, g->cap_props, props->n);
    int32_t first = g->n_props;
    g->n_props += props->n;
    for (int32_t i = 0; i < props->n; i++) {
        sbuf sb = {0};
        sb_json_string(&sb, props->keys[i], props->klens[i]);
        if (sb.oom) {
            free(sb.b);
            return cfail(c, COLIBRI_E_NOMEM, "out of memory compiling the schema");
        }
        int32_t off;
        int r = add_text(c, sb.b, sb.n, &off);
        int32_t kl = (int32_t)sb.n;
        free(sb.b);
        if (r) return -1;
        int required = 0;
        if (req)
            for (int32_t k = 0; k < req->n; k++)
                if (req->items[k].slen == props->klens[i] && !memcmp(req->items[k].str, props->keys[i], (size_t)props->klens[i]))
                    required = 1;
        int val = compile_schema(c, &props->items[i]);
        if (val < 0) return -1;
        g->props[first + i] = (cb_gprop){off, kl, val, required};
    }
    g->nodes[id].a = first;
    g->nodes[id].b = props->n;
    return id;
}

/* s restricted to the types in mask (several: an anyOf of one node per type). */
static int compile_typed(compiler *c, const jv *s, int mask) {
    int ids[7], n = 0;
    for (int t = 1; t <= T_ARRAY; t <<= 1) {
        if (!(mask & t)) continue;
        if (t == T_INTEGER && (mask & T_NUMBER)) continue; /* number covers integer */
        int id = compile_one_type(c, s, t);
        if (id < 0) return -1;
        ids[n++] = id;
    }
    if (n == 1) return ids[0];
    int id = new_node(c, GK_ANYOF);
    if (id < 0) return -1;
    colibri_grammar *g = c->g;
    GROW(g->alts, g->n_alts, g->cap_alts, n);
    g->nodes[id].a = g->n_alts;
    g->nodes[id].b = n;
    for (int i = 0; i < n; i++) g->alts[g->n_alts++] = ids[i];
    return id;
}

static int resolve_ref(compiler *c, const jv *ref, const jv **out) {
    if (ref->type != JV_STR) return cfail(c, COLIBRI_E_INVALID_ARG, "$ref must be a string");
    const char *r = ref->str;
    if (!strcmp(r, "#")) {
        *out = c->root;
        return 0;
    }
    const char *name = NULL;
    const jv *defs = NULL;
    if (!strncmp(r, "#/$defs/", 8)) {
        defs = jget(c->root, "$defs");
        name = r + 8;
    } else if (!strncmp(r, "#/definitions/", 14)) {
        defs = jget(c->root, "definitions");
        name = r + 14;
    } else {
        return cfail(c, COLIBRI_E_UNSUPPORTED,
                     "unsupported $ref \"%.100s\" (only #, #/$defs/NAME and #/definitions/NAME)", r);
    }
    if (strchr(name, '/') || strchr(name, '~'))
        return cfail(c, COLIBRI_E_UNSUPPORTED, "unsupported $ref \"%.100s\" (a nested pointer)", r);
    const jv *t = jget(defs, name);
    if (!t) return cfail(c, COLIBRI_E_INVALID_ARG, "$ref \"%.100s\" names no definition", r);
    *out = t;
    return 0;
}

static int compile_schema(compiler *c, const jv *s) {
    colibri_grammar *g = c->g;
    if (s->type == JV_TRUE) return c->any_node;
    if (s->type == JV_FALSE) return cfail(c, COLIBRI_E_UNSUPPORTED, "unsupported schema: false (nothing validates)");
    if (s->type != JV_OBJ) return cfail(c, COLIBRI_E_INVALID_ARG, "a schema must be an object or a boolean");
    if (++c->depth > 48) return cfail(c, COLIBRI_E_UNSUPPORTED, "the schema nests deeper than 48 levels");
    /* keywords: known ones are compiled below, annotations ignored, the rest refused by name */
    static const char *const known[] = {"type", "properties", "required", "additionalProperties", "items",
                                        "minItems", "maxItems", "enum", "const", "minLength", "maxLength",
                                        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "anyOf",
                                        "oneOf", "allOf", "$ref", NULL};
    for (int32_t i = 0; i < s->n; i++) {
        const char *k = s->keys[i];
        int ok = is_annotation(k);
        for (int j = 0; !ok && known[j]; j++) ok = !strcmp(k, known[j]);
        if (!strcmp(k, "uniqueItems") && s->items[i].type == JV_FALSE) ok = 1;
        if (!ok) return cfail(c, COLIBRI_E_UNSUPPORTED, "unsupported schema keyword: %.100s", k);
    }
    int result;
    const jv *ref = jget(s, "$ref"), *any = jget(s, "anyOf"), *one = jget(s, "oneOf"), *all = jget(s, "allOf");
    const jv *en = jget(s, "enum"), *cn = jget(s, "const"), *ty = jget(s, "type");
    int n_comb = (ref != NULL) + (any != NULL) + (one != NULL) + (all != NULL);
    if (n_comb > 1) {
        result = cfail(c, COLIBRI_E_UNSUPPORTED, "unsupported schema: more than one of $ref, anyOf, oneOf, allOf in one schema");
    } else if (ref) {
        const jv *t = NULL;
        if (resolve_ref(c, ref, &t)) {
            result = -1;
        } else {
            result = -2;
            for (int32_t i = 0; i < c->n_refs; i++)
                if (c->ref_src[i] == t) result = c->ref_node[i];
            if (result == -2) {
                /* a forwarding node (an anyOf of one), filled after compiling: recursion sees it */
                int id = new_node(c, GK_ANYOF);
                if (id < 0) return -1;
                if (c->n_refs == c->cap_refs) {
                    int32_t nc = c->cap_refs ? c->cap_refs * 2 : 16;
                    const jv **ns = realloc(c->ref_src, (size_t)nc * sizeof *ns);
                    if (!ns) return cfail(c, COLIBRI_E_NOMEM, "out of memory compiling the schema");
                    c->ref_src = ns;
                    int32_t *nn = realloc(c->ref_node, (size_t)nc * sizeof *nn);
                    if (!nn) return cfail(c, COLIBRI_E_NOMEM, "out of memory compiling the schema");
                    c->ref_node = nn;
                    c->cap_refs = nc;
                }
                c->ref_src[c->n_refs] = t;
                c->ref_node[c->n_refs++] = id;
                int target = compile_schema(c, t);
                if (target < 0) return -1;
                GROW(g->alts, g->n_alts, g->cap_alts, 1);
                g->nodes[id].a = g->n_alts;
                g->nodes[id].b = 1;
                g->alts[g->n_alts++] = target;
                result = id;
            }
        }
    } else if (any || one) {
        const jv *l = any ? any : one;
        if (l->type != JV_ARR || l->n == 0)
            return cfail(c, COLIBRI_E_INVALID_ARG, "%s must be a non-empty array", any ? "anyOf" : "oneOf");
        int id = new_node(c, GK_ANYOF);
        if (id < 0) return -1;
        int32_t *tmp = malloc((size_t)l->n * sizeof(int32_t));
        if (!tmp) return cfail(c, COLIBRI_E_NOMEM, "out of memory compiling the schema");
        for (int32_t i = 0; i < l->n; i++) {
            int a = compile_schema(c, &l->items[i]);
            if (a < 0) {
                free(tmp);
                return -1;
            }
            tmp[i] = a;
        }
        if (g->n_alts + l->n > g->cap_alts) {
            int64_t nc = g->cap_alts ? g->cap_alts : 16;
            while (nc < g->n_alts + l->n) nc *= 2;
            int32_t *na = realloc(g->alts, (size_t)nc * sizeof(int32_t));
            if (!na) {
                free(tmp);
                return cfail(c, COLIBRI_E_NOMEM, "out of memory compiling the schema");
            }
            g->alts = na;
            g->cap_alts = (int32_t)nc;
        }
        g->nodes[id].a = g->n_alts;
        g->nodes[id].b = l->n;
        memcpy(g->alts + g->n_alts, tmp, (size_t)l->n * sizeof(int32_t));
        g->n_alts += l->n;
        free(tmp);
        result = id;
    } else if (all) {
        if (all->type != JV_ARR || all->n != 1)
            return cfail(c, COLIBRI_E_UNSUPPORTED, "unsupported schema keyword: allOf with more than one schema");
        result = compile_schema(c, &all->items[0]);
    } else if (cn) {
        result = literal_node(c, cn, 1);
    } else if (en) {
        if (en->type != JV_ARR) return cfail(c, COLIBRI_E_INVALID_ARG, "enum must be an array");
        result = literal_node(c, en->items, en->n);
    } else {
        int mask = 0;
        if (ty) {
            if (ty->type == JV_STR) {
                mask = type_bit(ty->str);
                if (!mask) return cfail(c, COLIBRI_E_INVALID_ARG, "unknown type \"%.50s\"", ty->str);
            } else if (ty->type == JV_ARR && ty->n > 0) {
                for (int32_t i = 0; i < ty->n; i++) {
                    int b = ty->items[i].type == JV_STR ? type_bit(ty->items[i].str) : 0;
                    if (!b) return cfail(c, COLIBRI_E_INVALID_ARG, "type lists an unknown type");
                    mask |= b;
                }
            } else {
                return cfail(c, COLIBRI_E_INVALID_ARG, "type must be a string or a non-empty array of strings");
            }
        } else if (jget(s, "properties") || jget(s, "required") || jget(s, "additionalProperties")) {
            mask = T_OBJECT;
        } else if (jget(s, "items") || jget(s, "minItems") || jget(s, "maxItems")) {
            mask = T_ARRAY;
        } else if (jget(s, "minLength") || jget(s, "maxLength")) {
            mask = T_STRING;
        } else if (jget(s, "minimum") || jget(s, "maximum") || jget(s, "exclusiveMinimum") || jget(s, "exclusiveMaximum")) {
            mask = T_NUMBER;
        } else {
            c->depth--;
            return c->any_node;
        }
        result = compile_typed(c, s, mask);
    }
    c->depth--;
    return result;
}

/* The nodes of "any JSON value": an anyOf of a map of any values, an array of any values,
 * a string, a number and the literals true / false / null. */
static int build_any(compiler *c) {
    colibri_grammar *g = c->g;
    int any = new_node(c, GK_ANYOF);
    int key = new_node(c, GK_STRING);
    if (any < 0 || key < 0) return -1;
    c->any_node = any;
    c->key_node = key;
    int map = new_node(c, GK_MAP);
    if (map < 0) return -1;
    g->nodes[map].a = any;
    g->nodes[map].b = key;
    int arr = new_node(c, GK_ARRAY);
    if (arr < 0) return -1;
    g->nodes[arr].a = any;
    int str = new_node(c, GK_STRING);
    int num = new_node(c, GK_NUMBER);
    jv v[3] = {{.type = JV_TRUE}, {.type = JV_FALSE}, {.type = JV_NULL}};
    int lit = literal_node(c, v, 3);
    if (str < 0 || num < 0 || lit < 0) return -1;
    GROW(g->alts, g->n_alts, g->cap_alts, 5);
    g->nodes[any].a = g->n_alts;
    g->nodes[any].b = 5;
    g->alts[g->n_alts++] = map;
    g->alts[g->n_alts++] = arr;
    g->alts[g->n_alts++] = str;
    g->alts[g->n_alts++] = num;
    g->alts[g->n_alts++] = lit;
    return 0;
}

/* ---- the tokens ---- */
static const cb_gtokens *sort_g;
static int tok_cmp(const void *pa, const void *pb) {
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    const cb_gtokens *g = sort_g;
    int32_t la = g->tok_len[a], lb = g->tok_len[b], n = la < lb ? la : lb;
    int r = memcmp(g->tok_bytes + g->tok_off[a], g->tok_bytes + g->tok_off[b], (size_t)n);
    if (r) return r;
    if (la != lb) return la < lb ? -1 : 1;
    return (a > b) - (a < b);
}

#include <pthread.h>
static pthread_mutex_t sort_lock = PTHREAD_MUTEX_INITIALIZER;

/* Whole UTF-8 characters, none of them a quote, a backslash or a control character. */
static int inside_token(const cb_gtokens *g, int32_t id) {
    const uint8_t *b = g->tok_bytes + g->tok_off[id];
    int32_t n = g->tok_len[id], i = 0;
    while (i < n) {
        uint8_t c = b[i];
        int k;
        if (c < 0x80) {
            if (c < 0x20 || c == '"' || c == '\\') return 0;
            i++;
            continue;
        }
        if (c >= 0xC2 && c <= 0xDF) k = 1;
        else if (c >= 0xE0 && c <= 0xEF) k = 2;
        else if (c >= 0xF0 && c <= 0xF4) k = 3;
        else return 0;
        if (i + k >= n) return 0; /* the character does not end in the token */
        uint8_t lo = 0x80, hi = 0xBF;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
        if (b[i + 1] < lo || b[i + 1] > hi) return 0;
        for (int j = 2; j <= k; j++)
            if ((b[i + j] & 0xC0) != 0x80) return 0;
        i += k + 1;
    }
    return n > 0;
}

static void trie_free(cb_trie *t) {
    free(t->child);
    free(t->next);
    free(t->tok);
    free(t->byte);
    free(t->tok_next);
}

/* The trie of the sorted tokens order[0..n) (skip_inside: without the inside tokens). */
static colibri_status build_trie(cb_gtokens *g, cb_trie *t, const int32_t *order, int32_t n, int skip_inside) {
    int64_t max_nodes = 1;
    for (int32_t i = 0; i < n; i++)
        if (!(skip_inside && g->tok_inside[order[i]])) max_nodes += g->tok_len[order[i]];
    if (max_nodes > INT32_MAX) return COLIBRI_E_NOMEM;
    t->child = malloc((size_t)max_nodes * sizeof(int32_t));
    t->next = malloc((size_t)max_nodes * sizeof(int32_t));
    t->tok = malloc((size_t)max_nodes * sizeof(int32_t));
    t->byte = malloc((size_t)max_nodes);
    t->tok_next = malloc((size_t)g->V * sizeof(int32_t));
    int32_t *path = malloc(((size_t)g->max_tok_len + 1) * sizeof(int32_t));
    int32_t *last = malloc((size_t)max_nodes * sizeof(int32_t)); /* last child of each node */
    if (!t->child || !t->next || !t->tok || !t->byte || !t->tok_next || !path || !last) {
        free(path);
        free(last);
        return COLIBRI_E_NOMEM;
    }
    for (int32_t i = 0; i < g->V; i++) t->tok_next[i] = -1;
    t->n = 1;
    t->child[0] = t->next[0] = t->tok[0] = last[0] = -1;
    t->byte[0] = 0;
    path[0] = 0;
    int32_t prev = -1;
    for (int32_t i = 0; i < n; i++) {
        int32_t id = order[i];
        if (skip_inside && g->tok_inside[id]) continue;
        const uint8_t *b = g->tok_bytes + g->tok_off[id];
        int32_t len = g->tok_len[id], common = 0;
        if (prev >= 0) {
            const uint8_t *pb = g->tok_bytes + g->tok_off[prev];
            int32_t pl = g->tok_len[prev];
            while (common < len && common < pl && pb[common] == b[common]) common++;
        }
        for (int32_t d = common; d < len; d++) {
            int32_t nn = t->n++, parent = path[d];
            t->child[nn] = t->next[nn] = t->tok[nn] = last[nn] = -1;
            t->byte[nn] = b[d];
            if (last[parent] < 0) t->child[parent] = nn;
            else t->next[last[parent]] = nn;
            last[parent] = nn;
            path[d + 1] = nn;
        }
        int32_t node = path[len];
        t->tok_next[id] = t->tok[node];
        t->tok[node] = id;
        prev = id;
    }
    free(path);
    free(last);
    return COLIBRI_OK;
}

static colibri_status build_tokens(cb_gtokens *g, colibri_tokenizer *tok, char *err, size_t err_len) {
    int32_t V = colibri_tokenizer_vocab_size(tok);
    if (V <= 0) {
        cb_set_err(err, err_len, "colibri_grammar_compile: the tokenizer has no vocabulary");
        return COLIBRI_E_INVALID_ARG;
    }
    g->V = V;
    g->tok_off = malloc((size_t)V * sizeof(int64_t));
    g->tok_len = malloc((size_t)V * sizeof(int32_t));
    g->tok_special = malloc((size_t)V);
    int64_t cap = (int64_t)V * 8 + 1024, used = 0;
    g->tok_bytes = malloc((size_t)cap);
    int32_t *order = malloc((size_t)V * sizeof(int32_t));
    if (!g->tok_off || !g->tok_len || !g->tok_special || !g->tok_bytes || !order) {
        free(order);
        goto nomem;
    }
    int32_t n_norm = 0, n_spec = 0;
    uint8_t buf[4096];
    for (int32_t id = 0; id < V; id++) {
        uint32_t len = 0;
        int special = 0;
        if (cb_token_bytes(tok, id, buf, sizeof buf, &len, &special) != 0) len = 0, special = 1; /* too long: never */
        if (used + len > cap) {
            while (used + len > cap) cap *= 2;
            uint8_t *nb = realloc(g->tok_bytes, (size_t)cap);
            if (!nb) {
                free(order);
                goto nomem;
            }
            g->tok_bytes = nb;
        }
        memcpy(g->tok_bytes + used, buf, len);
        g->tok_off[id] = used;
        g->tok_len[id] = (int32_t)len;
        used += len;
        g->tok_special[id] = (uint8_t)special;
        if ((int32_t)len > g->max_tok_len) g->max_tok_len = (int32_t)len;
        if (len == 0) continue; /* an empty token never advances the grammar: masked */
        if (special) n_spec++;
        else order[n_norm++] = id;
    }
    g->special_ids = malloc((size_t)(n_spec ? n_spec : 1) * sizeof(int32_t));
    if (!g->special_ids) {
        free(order);
        goto nomem;
    }
    for (int32_t id = 0; id < V; id++)
        if (g->tok_special[id] && g->tok_len[id] > 0) g->special_ids[g->n_special++] = id;
    pthread_mutex_lock(&sort_lock);
    sort_g = g;
    qsort(order, (size_t)n_norm, sizeof(int32_t), tok_cmp);
    pthread_mutex_unlock(&sort_lock);
    g->tok_inside = calloc((size_t)V, 1);
    if (!g->tok_inside) {
        free(order);
        goto nomem;
    }
    for (int32_t i = 0; i < n_norm; i++) g->tok_inside[order[i]] = (uint8_t)inside_token(g, order[i]);
    colibri_status st = build_trie(g, &g->all, order, n_norm, 0);
    if (st == COLIBRI_OK) st = build_trie(g, &g->edge, order, n_norm, 1);
    free(order);
    if (st != COLIBRI_OK) goto nomem;
    return COLIBRI_OK;
nomem:
    cb_set_err(err, err_len, "colibri_grammar_compile: out of memory for the token tables");
    return COLIBRI_E_NOMEM;
}

static void tokens_free(void *p) {
    cb_gtokens *g = p;
    if (!g) return;
    free(g->tok_bytes);
    free(g->tok_off);
    free(g->tok_len);
    free(g->tok_special);
    free(g->special_ids);
    trie_free(&g->all);
    trie_free(&g->edge);
    free(g->tok_inside);
    free(g);
}

/* The token tables of tok (cb_tokenizer_cache builds them once per tokenizer). */
static void *tokens_build(colibri_tokenizer *tok) {
    cb_gtokens *g = calloc(1, sizeof *g);
    if (!g) return NULL;
    char err[8];
    if (build_tokens(g, tok, err, sizeof err) != COLIBRI_OK) {
        tokens_free(g);
        return NULL;
    }
    return g;
}

void colibri_grammar_free(colibri_grammar *g) {
    if (!g) return;
    free(g->nodes);
    free(g->props);
    free(g->lits);
    free(g->alts);
    free(g->text);
    free(g);
}

int32_t cb_grammar_vocab(const colibri_grammar *g) { return g->tk->V; }

colibri_status colibri_grammar_compile(colibri_tokenizer *tok, const char *json_schema, const char *prefix,
                                       const char *suffix, colibri_grammar **out, char *err, size_t err_len) {
    if (out) *out = NULL;
    if (!tok || !out) {
        cb_set_err(err, err_len, "colibri_grammar_compile: tok and out must not be NULL");
        return COLIBRI_E_INVALID_ARG;
    }
    if (colibri_tokenizer_vocab_size(tok) <= 0) {
        cb_set_err(err, err_len, "colibri_grammar_compile: this model has no tokenizer");
        return COLIBRI_E_UNSUPPORTED;
    }
    colibri_grammar *g = calloc(1, sizeof *g);
    if (!g) {
        cb_set_err(err, err_len, "colibri_grammar_compile: out of memory");
        return COLIBRI_E_NOMEM;
    }
    jparser jp = {0};
    jp.err = err;
    jp.err_len = err_len;
    compiler c = {0};
    c.g = g;
    c.err = err;
    c.err_len = err_len;
    c.st = COLIBRI_E_INVALID_ARG;
    colibri_status st = COLIBRI_OK;
    jv root;
    memset(&root, 0, sizeof root);
    if (json_schema) {
        jp.s = json_schema;
        jp.len = strlen(json_schema);
        if (jvalue(&jp, &root) == 0) {
            jws(&jp);
            if (jp.pos != jp.len) jfail(&jp, "trailing characters");
        }
        if (jp.failed) {
            st = COLIBRI_E_INVALID_ARG;
            goto done;
        }
    }
    c.root = &root;
    int r = build_any(&c);
    int value = -1;
    if (r == 0) {
        if (!json_schema) {
            /* any JSON object */
            value = new_node(&c, GK_MAP);
            if (value >= 0) {
                g->nodes[value].a = c.any_node;
                g->nodes[value].b = c.key_node;
            }
        } else {
            value = compile_schema(&c, &root);
        }
    }
    int rootn = value >= 0 ? new_node(&c, GK_ROOT) : -1;
    if (rootn >= 0) {
        g->nodes[rootn].a = value;
        g->root = rootn;
        const char *pf = prefix ? prefix : "", *sf = suffix ? suffix : "";
        if (add_text(&c, pf, (int64_t)strlen(pf), &g->prefix_off) == 0 &&
            add_text(&c, sf, (int64_t)strlen(sf), &g->suffix_off) == 0) {
            g->prefix_len = (int32_t)strlen(pf);
            g->suffix_len = (int32_t)strlen(sf);
        }
    }
    if (c.failed) {
        st = c.st;
        goto done;
    }
    g->tk = cb_tokenizer_cache(tok, tokens_build, tokens_free);
    if (!g->tk) {
        cb_set_err(err, err_len, "colibri_grammar_compile: out of memory for the token tables");
        st = COLIBRI_E_NOMEM;
    }
done:
    free(c.ref_src);
    free(c.ref_node);
    jfree_all(&jp);
    if (st != COLIBRI_OK) {
        colibri_grammar_free(g);
        return st;
    }
    *out = g;
    return COLIBRI_OK;
}
