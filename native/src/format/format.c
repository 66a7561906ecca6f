/*
 * format.c — reads and validates a mapped .colibri file (docs/format.md: format versions 1
 * and 2, both read).
 *
 * Nothing in the file is trusted: every read is bounds-checked with overflow-safe 64-bit
 * arithmetic before it happens, in this order: header (magic, version, header_size, CRC,
 * file_size, value constraints), sections (bounds, order, overlap, alignment), section
 * CRCs (metadata, tensor directory, tokenizer), metadata records, required keys and their
 * agreement with the header, tensor directory records, then every tensor the model uses,
 * looked up by name and checked for dtype, layout, shape and section together.
 * A failure returns a status and a message that names the field and says what to do.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>

#include "core/checked.h"
#include "core/context.h"
#include "core/dtype.h"
#include "model/family.h"

#define RECONVERT "re-convert the model with colibri-convert"

static uint32_t rd_u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static uint64_t rd_u64(const uint8_t *p) { return (uint64_t)rd_u32(p) | ((uint64_t)rd_u32(p + 4) << 32); }
static double rd_f64(const uint8_t *p) {
    uint64_t u = rd_u64(p);
    double d;
    memcpy(&d, &u, 8);
    return d;
}

/* A printable, NUL-terminated copy of file bytes for messages: bytes outside printable
 * ASCII become '?', so a damaged file cannot put invalid UTF-8 into an error message. */
static const char *printable(char *dst, size_t cap, const uint8_t *s, uint64_t n) {
    size_t k = 0;
    for (uint64_t i = 0; i < n && k + 1 < cap; i++) dst[k++] = (s[i] >= 0x20 && s[i] < 0x7f) ? (char)s[i] : '?';
    if (n > cap - 1 && cap > 4) memcpy(dst + cap - 4, "...", 3), k = cap - 1;
    dst[k] = 0;
    return dst;
}

/* A bounds-checked cursor over one section. */
typedef struct cb_reader {
    const uint8_t *p; /* [len] */
    uint64_t len;
    uint64_t pos;
} cb_reader;

static int rd_has(const cb_reader *r, uint64_t n) { return r->pos <= r->len && n <= r->len - r->pos; }

static const char *sec_name(int k) {
    static const char *names[CB_N_SECTIONS] = {"metadata", "tensor directory", "tokenizer",
                                               "dense weights", "router", "experts"};
    return names[k];
}

static size_t meta_type_size(uint32_t t) {
    switch (t) {
    case CB_MT_U32: case CB_MT_I32: case CB_MT_F32: return 4;
    case CB_MT_BOOL: return 1;
    case CB_MT_U64: case CB_MT_I64: case CB_MT_F64: return 8;
    default: return 0;
    }
}

static const char *meta_type_name(uint32_t t) {
    static const char *n[] = {"U32", "I32", "F32", "BOOL", "STRING", "U64", "I64", "F64", "ARRAY"};
    return t <= CB_MT_ARRAY ? n[t] : "unknown";
}

/* ---- name hashing for uniqueness checks ---- */

static uint64_t fnv1a(const uint8_t *s, uint64_t n) {
    uint64_t h = 1469598103934665603ull;
    for (uint64_t i = 0; i < n; i++) {
        h ^= s[i];
        h *= 1099511628211ull;
    }
    return h;
}

/* Checks that n records at `base` (each `stride` bytes, holding a `const uint8_t *` name at
 * `name_off` and its uint32_t length at `len_off`) have distinct names, with one hash
 * table allocated at init time. Returns 1, 0 with the duplicate's index in *dup, or -1
 * when the table cannot be allocated. */
static int names_unique(const void *base, size_t stride, size_t name_off, size_t len_off,
                        uint64_t n, uint64_t *dup) {
    const char *b = (const char *)base;
    uint64_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    uint64_t *slots = calloc(cap, sizeof(uint64_t));
    if (!slots) return -1;
    int ok = 1;
    for (uint64_t i = 0; i < n && ok; i++) {
        const uint8_t *name;
        uint32_t nlen;
        memcpy(&name, b + i * stride + name_off, sizeof name);
        memcpy(&nlen, b + i * stride + len_off, sizeof nlen);
        uint64_t h = fnv1a(name, nlen) & (cap - 1);
        for (;;) {
            uint64_t s = slots[h];
            if (s == 0) {
                slots[h] = i + 1;
                break;
            }
            const uint8_t *other;
            uint32_t olen;
            memcpy(&other, b + (s - 1) * stride + name_off, sizeof other);
            memcpy(&olen, b + (s - 1) * stride + len_off, sizeof olen);
            if (olen == nlen && memcmp(other, name, nlen) == 0) {
                *dup = i;
                ok = 0;
                break;
            }
            h = (h + 1) & (cap - 1);
        }
    }
    free(slots);
    return ok;
}

/* ---- metadata ---- */

#define PK(p, n) printable(pk_buf, sizeof pk_buf, (p), (n))

static colibri_status parse_metadata(colibri_ctx *ctx, char *err, size_t len) {
    char pk_buf[160];
    const cb_section *sec = &ctx->cfg.sections[CB_SEC_META];
    cb_reader r = {ctx->map + sec->offset, sec->size, 0};
    if (!rd_has(&r, 8)) {
        cb_set_err(err, len, "metadata section is %llu bytes, too small for its entry count; " RECONVERT,
                   (unsigned long long)sec->size);
        return COLIBRI_E_FORMAT;
    }
    uint64_t n = rd_u64(r.p);
    r.pos = 8;
    /* the smallest entry is 4 (key_len) + 1 (key) + 4 (type) + 1 (BOOL) = 10 bytes */
    if (n > (sec->size - 8) / 10) {
        cb_set_err(err, len, "metadata says %llu entries but the section holds at most %llu; " RECONVERT,
                   (unsigned long long)n, (unsigned long long)((sec->size - 8) / 10));
        return COLIBRI_E_FORMAT;
    }
    ctx->meta = calloc(n ? n : 1, sizeof(cb_meta_entry));
    if (!ctx->meta) {
        cb_set_err(err, len, "out of memory reading %llu metadata entries", (unsigned long long)n);
        return COLIBRI_E_NOMEM;
    }
    ctx->n_meta = n;
    for (uint64_t i = 0; i < n; i++) {
        cb_meta_entry *e = &ctx->meta[i];
        if (!rd_has(&r, 4)) goto truncated;
        uint32_t kl = rd_u32(r.p + r.pos);
        r.pos += 4;
        if (kl < 1 || kl > 1024) {
            cb_set_err(err, len, "metadata entry %llu has key length %u (allowed 1..1024); " RECONVERT,
                       (unsigned long long)i, kl);
            return COLIBRI_E_FORMAT;
        }
        if (!rd_has(&r, (uint64_t)kl + 4)) goto truncated;
        e->key = r.p + r.pos;
        e->key_len = kl;
        r.pos += kl;
        e->type = rd_u32(r.p + r.pos);
        r.pos += 4;
        if (e->type == CB_MT_STRING) {
            if (!rd_has(&r, 8)) goto truncated;
            uint64_t sl = rd_u64(r.p + r.pos);
            r.pos += 8;
            if (!rd_has(&r, sl)) goto truncated;
            e->count = sl;
            e->value = r.p + r.pos;
            e->value_len = sl;
            r.pos += sl;
        } else if (e->type == CB_MT_ARRAY) {
            if (!rd_has(&r, 12)) goto truncated;
            e->elem_type = rd_u32(r.p + r.pos);
            uint64_t cnt = rd_u64(r.p + r.pos + 4);
            r.pos += 12;
            size_t es = meta_type_size(e->elem_type);
            if (es == 0) {
                cb_set_err(err, len, "metadata key '%s' is an ARRAY of type %u (%s), which arrays may "
                           "not hold; " RECONVERT, PK(e->key, kl), e->elem_type,
                           meta_type_name(e->elem_type));
                return COLIBRI_E_FORMAT;
            }
            uint64_t bytes;
            if (!cb_mul_u64(cnt, es, &bytes) || !rd_has(&r, bytes)) goto truncated;
            e->count = cnt;
            e->value = r.p + r.pos;
            e->value_len = bytes;
            r.pos += bytes;
        } else {
            size_t es = meta_type_size(e->type);
            if (es == 0) {
                cb_set_err(err, len, "metadata key '%s' has unknown value type %u; " RECONVERT,
                           PK(e->key, kl), e->type);
                return COLIBRI_E_FORMAT;
            }
            if (!rd_has(&r, es)) goto truncated;
            e->value = r.p + r.pos;
            e->value_len = es;
            e->count = 1;
            r.pos += es;
            if (e->type == CB_MT_BOOL && e->value[0] > 1) {
                cb_set_err(err, len, "metadata key '%s' is a BOOL with value %u (must be 0 or 1); " RECONVERT,
                           PK(e->key, kl), e->value[0]);
                return COLIBRI_E_FORMAT;
            }
        }
    }
    /* trailing bytes are tolerated only if they are zero padding */
    for (uint64_t i = r.pos; i < r.len; i++) {
        if (r.p[i] != 0) {
            cb_set_err(err, len, "metadata section has %llu unexpected bytes after its %llu entries; " RECONVERT,
                       (unsigned long long)(r.len - r.pos), (unsigned long long)n);
            return COLIBRI_E_FORMAT;
        }
    }
    {
        uint64_t dup = 0;
        int u = names_unique(ctx->meta, sizeof *ctx->meta, offsetof(cb_meta_entry, key),
                             offsetof(cb_meta_entry, key_len), n, &dup);
        if (u < 0) {
            cb_set_err(err, len, "out of memory checking metadata keys");
            return COLIBRI_E_NOMEM;
        }
        if (u == 0) {
            cb_set_err(err, len, "metadata key '%s' appears more than once; " RECONVERT,
                       PK(ctx->meta[dup].key, ctx->meta[dup].key_len));
            return COLIBRI_E_FORMAT;
        }
    }
    return COLIBRI_OK;
truncated:
    cb_set_err(err, len, "metadata section is cut short (an entry at byte %llu of %llu entries runs past its %llu bytes); " RECONVERT,
               (unsigned long long)(r.pos), (unsigned long long)n, (unsigned long long)sec->size);
    return COLIBRI_E_FORMAT;
}

static const cb_meta_entry *meta_find(const colibri_ctx *ctx, const char *key) {
    size_t kl = strlen(key);
    for (uint64_t i = 0; i < ctx->n_meta; i++) {
        const cb_meta_entry *e = &ctx->meta[i];
        if (e->key_len == kl && memcmp(e->key, key, kl) == 0) return e;
    }
    return NULL;
}

/* Look up a required key of an exact type. */
static colibri_status meta_req(const colibri_ctx *ctx, const char *key, uint32_t type,
                               const cb_meta_entry **out, char *err, size_t len) {
    const cb_meta_entry *e = meta_find(ctx, key);
    if (!e) {
        cb_set_err(err, len, "metadata key '%s' is missing; " RECONVERT, key);
        return COLIBRI_E_FORMAT;
    }
    if (e->type != type) {
        cb_set_err(err, len, "metadata key '%s' has type %s, expected %s; " RECONVERT, key,
                   meta_type_name(e->type), meta_type_name(type));
        return COLIBRI_E_FORMAT;
    }
    *out = e;
    return COLIBRI_OK;
}

#define REQ(key, type)                                                       \
    do {                                                                     \
        st = meta_req(ctx, key, type, &e, err, len);                         \
        if (st != COLIBRI_OK) return st;                                     \
    } while (0)

static int str_is(const cb_meta_entry *e, const char *s) {
    size_t n = strlen(s);
    return e->count == n && memcmp(e->value, s, n) == 0;
}

/* Copy a STRING value: free text (general.name) keeps its UTF-8 bytes (a NUL inside
 * becomes '?'); identifiers that may appear in messages are made printable ASCII. */
static void str_copy(char *dst, size_t cap, const cb_meta_entry *e) {
    printable(dst, cap, e->value, e->count);
}
static void text_copy(char *dst, size_t cap, const cb_meta_entry *e) {
    uint64_t n = e->count < cap - 1 ? e->count : cap - 1;
    memcpy(dst, e->value, (size_t)n);
    dst[n] = 0;
    for (uint64_t i = 0; i < n; i++)
        if (dst[i] == 0) dst[i] = '?'; /* a NUL inside would truncate silently */
}

static int parse_dtype_str(const cb_meta_entry *e, uint32_t *dt) {
    if (str_is(e, "f32")) *dt = COLIBRI_DTYPE_F32;
    else if (str_is(e, "f16")) *dt = COLIBRI_DTYPE_F16;
    else if (str_is(e, "bf16")) *dt = COLIBRI_DTYPE_BF16;
    else if (str_is(e, "int8")) *dt = COLIBRI_DTYPE_I8;
    else return 0;
    return 1;
}

/* Check that a U32 metadata key equals the header value. */
static colibri_status agree_u32(const colibri_ctx *ctx, const char *key, uint64_t header_val,
                                const char *header_field, char *err, size_t len) {
    const cb_meta_entry *e = meta_find(ctx, key);
    if (!e) {
        cb_set_err(err, len, "metadata key '%s' is missing; " RECONVERT, key);
        return COLIBRI_E_FORMAT;
    }
    uint64_t v;
    if (e->type == CB_MT_U32) v = rd_u32(e->value);
    else if (e->type == CB_MT_U64) v = rd_u64(e->value);
    else {
        cb_set_err(err, len, "metadata key '%s' has type %s, expected %s; " RECONVERT, key,
                   meta_type_name(e->type), strcmp(key, "model.max_seq_len") == 0 ? "U64" : "U32");
        return COLIBRI_E_FORMAT;
    }
    if (v != header_val) {
        cb_set_err(err, len, "metadata key '%s' = %llu disagrees with header field %s = %llu; " RECONVERT,
                   key, (unsigned long long)v, header_field, (unsigned long long)header_val);
        return COLIBRI_E_FORMAT;
    }
    return COLIBRI_OK;
}

/* Look up an optional key: OK with *out = NULL when absent, an error when of another type. */
static colibri_status meta_opt(const colibri_ctx *ctx, const char *key, uint32_t type, uint32_t elem_type,
                               const cb_meta_entry **out, char *err, size_t len) {
    const cb_meta_entry *e = meta_find(ctx, key);
    *out = NULL;
    if (!e) return COLIBRI_OK;
    if (e->type != type || (type == CB_MT_ARRAY && e->elem_type != elem_type)) {
        char have[48], want[48];
        snprintf(have, sizeof have, "%s%s%s", meta_type_name(e->type), e->type == CB_MT_ARRAY ? " of " : "",
                 e->type == CB_MT_ARRAY ? meta_type_name(e->elem_type) : "");
        snprintf(want, sizeof want, "%s%s%s", meta_type_name(type), type == CB_MT_ARRAY ? " of " : "",
                 type == CB_MT_ARRAY ? meta_type_name(elem_type) : "");
        cb_set_err(err, len, "metadata key '%s' has type %s, expected %s; " RECONVERT, key, have, want);
        return COLIBRI_E_FORMAT;
    }
    *out = e;
    return COLIBRI_OK;
}

#define OPT(key, type, elem)                                                 \
    do {                                                                     \
        st = meta_opt(ctx, key, type, elem, &e, err, len);                   \
        if (st != COLIBRI_OK) return st;                                     \
    } while (0)
/* An optional BOOL key into dst (false when absent). */
#define OPT_BOOL(key, dst)                                                   \
    do {                                                                     \
        OPT(key, CB_MT_BOOL, 0);                                             \
        (dst) = e ? e->value[0] : 0;                                         \
    } while (0)

/* Grouped routing, a choice bias and scaling (docs/format.md, "Family options";
 * model/route_group.c): model.n_group, model.topk_group, model.router_bias,
 * model.routed_scaling_factor. Defaults: no groups, no bias, scale 1. */
static colibri_status read_router_options(colibri_ctx *ctx, char *err, size_t len) {
    cb_config *c = &ctx->cfg;
    const cb_meta_entry *e;
    colibri_status st;
    OPT("model.n_group", CB_MT_U32, 0);
    c->n_group = e ? rd_u32(e->value) : 1;
    OPT("model.topk_group", CB_MT_U32, 0);
    c->topk_group = e ? rd_u32(e->value) : c->n_group;
    if (c->n_group == 0 || c->n_experts % c->n_group != 0 || c->topk_group == 0 || c->topk_group > c->n_group) {
        cb_set_err(err, len, "model.n_group = %u must be >= 1 and divide n_experts = %u, and model.topk_group = %u "
                   "must be in [1, n_group]; " RECONVERT, c->n_group, c->n_experts, c->topk_group);
        return COLIBRI_E_FORMAT;
    }
    if (c->n_group > 1) {
        uint32_t per = c->n_experts / c->n_group;
        if (c->routing != CB_ROUTE_SOFTMAX_TOPK && c->routing != CB_ROUTE_SIGMOID_TOPK) {
            cb_set_err(err, len, "model.n_group = %u: expert groups need model.routing softmax_topk or "
                       "sigmoid_topk; " RECONVERT, c->n_group);
            return COLIBRI_E_FORMAT;
        }
        if ((uint64_t)c->topk_group * per < c->top_k || (c->routing == CB_ROUTE_SIGMOID_TOPK && per < 2)) {
            cb_set_err(err, len, "model.topk_group = %u groups of %u experts cannot hold top_k = %u choices "
                       "(sigmoid_topk groups also need 2 experts each); " RECONVERT, c->topk_group, per, c->top_k);
            return COLIBRI_E_FORMAT;
        }
    }
    OPT_BOOL("model.router_bias", c->router_bias);
    if (c->router_bias && c->routing != CB_ROUTE_SIGMOID_TOPK) {
        cb_set_err(err, len, "model.router_bias is true but model.routing is not sigmoid_topk; " RECONVERT);
        return COLIBRI_E_FORMAT;
    }
    OPT("model.routed_scaling_factor", CB_MT_F64, 0);
    c->routed_scale = 1.0f;
    if (e) {
        double v = rd_f64(e->value);
        if (!isfinite(v) || v <= 0 || v > 1e6) {
            cb_set_err(err, len, "model.routed_scaling_factor = %g must be finite and in (0, 1e6]; " RECONVERT, v);
            return COLIBRI_E_FORMAT;
        }
        c->routed_scale = (float)v;
    }
    return COLIBRI_OK;
}

/* Multi-head latent attention (model.attention "mla", model/mla.c): its widths and
 * softmax scale, required in an MLA file; model.head_dim is the RoPE width. */
static colibri_status read_mla_options(colibri_ctx *ctx, char *err, size_t len) {
    cb_config *c = &ctx->cfg;
    const cb_meta_entry *e;
    colibri_status st;
    if (c->attention != CB_ATTN_MLA) return COLIBRI_OK;
    struct { const char *key; uint32_t *v; uint32_t lo; } w[] = {
        {"model.q_lora_rank", &c->q_lora_rank, 0}, {"model.kv_lora_rank", &c->kv_lora_rank, 1},
        {"model.qk_nope_head_dim", &c->qk_nope_dim, 1}, {"model.v_head_dim", &c->v_head_dim, 1}};
    for (size_t i = 0; i < sizeof w / sizeof w[0]; i++) {
        if ((st = meta_req(ctx, w[i].key, CB_MT_U32, &e, err, len))) return st;
        *w[i].v = rd_u32(e->value);
        if (*w[i].v < w[i].lo || *w[i].v > (1u << 16)) {
            cb_set_err(err, len, "%s = %u must be in [%u, 65536]; " RECONVERT, w[i].key, *w[i].v, w[i].lo);
            return COLIBRI_E_FORMAT;
        }
    }
    uint64_t nh = c->n_heads, dq = (uint64_t)c->qk_nope_dim + c->head_dim;
    if (nh * dq > (1u << 24) || nh * ((uint64_t)c->qk_nope_dim + c->v_head_dim) > (1u << 24) ||
        nh * ((uint64_t)c->kv_lora_rank + c->head_dim) > (1u << 26)) {
        cb_set_err(err, len, "MLA widths are implausible (n_heads = %u, qk_nope_head_dim = %u, head_dim = %u, "
                   "v_head_dim = %u, kv_lora_rank = %u); " RECONVERT, c->n_heads, c->qk_nope_dim, c->head_dim,
                   c->v_head_dim, c->kv_lora_rank);
        return COLIBRI_E_FORMAT;
    }
    if (c->n_kv_heads != c->n_heads) {
        cb_set_err(err, len, "model.n_kv_heads = %u must equal model.n_heads = %u in an MLA file (every head "
                   "reads the one latent); " RECONVERT, c->n_kv_heads, c->n_heads);
        return COLIBRI_E_FORMAT;
    }
    if ((st = meta_req(ctx, "model.attn_scale", CB_MT_F64, &e, err, len))) return st;
    double v = rd_f64(e->value);
    if (!isfinite(v) || v <= 0 || v > 1e6) {
        cb_set_err(err, len, "model.attn_scale = %g must be finite and in (0, 1e6]; " RECONVERT, v);
        return COLIBRI_E_FORMAT;
    }
    c->attn_scale = (float)v;
    if (c->sliding_window != 0 || c->layer_window) {
        cb_set_err(err, len, "an MLA file has no attention window (model.sliding_window must be 0); " RECONVERT);
        return COLIBRI_E_FORMAT;
    }
    return COLIBRI_OK;
}

/* A positive finite F64 option as f32 (0 when absent). */
static colibri_status opt_positive(const cb_meta_entry *e, const char *key, float *out, char *err, size_t len) {
    *out = 0.0f;
    if (!e) return COLIBRI_OK;
    double v = rd_f64(e->value);
    if (!isfinite(v) || v <= 0 || v > 3.0e38) {
        cb_set_err(err, len, "%s = %g must be a positive finite number; " RECONVERT, key, v);
        return COLIBRI_E_FORMAT;
    }
    *out = (float)v;
    if (*out == 0.0f) *out = 1e-45f;
    return COLIBRI_OK;
}

/* gpt-oss's options (docs/format.md, "Family options of gpt-oss"): the clamped SwiGLU's
 * limit and alpha (model.activation clamped_swiglu, read with the other choices), the
 * router's logit bias, attention sinks and expert biases. */
static colibri_status read_gptoss_options(colibri_ctx *ctx, char *err, size_t len) {
    cb_config *c = &ctx->cfg;
    const cb_meta_entry *e;
    colibri_status st;
    OPT("model.swiglu_limit", CB_MT_F64, 0);
    st = opt_positive(e, "model.swiglu_limit", &c->swiglu_limit, err, len);
    if (st != COLIBRI_OK) return st;
    OPT("model.swiglu_alpha", CB_MT_F64, 0);
    st = opt_positive(e, "model.swiglu_alpha", &c->swiglu_alpha, err, len);
    if (st != COLIBRI_OK) return st;
    if (c->activation == CB_ACT_CLAMPED_SWIGLU) {
        if (c->swiglu_limit == 0.0f || c->swiglu_alpha == 0.0f) {
            cb_set_err(err, len, "model.activation clamped_swiglu needs model.swiglu_limit and "
                       "model.swiglu_alpha; " RECONVERT);
            return COLIBRI_E_FORMAT;
        }
        int any_dense = 0;
        for (uint32_t l = 0; c->layer_ffn && l < c->n_layers; l++)
            any_dense |= rd_u32(c->layer_ffn + 4 * (uint64_t)l) == 0;
        if (any_dense || c->shared_inter > 0) {
            cb_set_err(err, len, "model.activation clamped_swiglu applies to the routed experts only; this build "
                       "runs it without dense layers or a shared expert; " RECONVERT);
            return COLIBRI_E_UNSUPPORTED;
        }
    }
    OPT_BOOL("model.router_logit_bias", c->router_logit_bias);
    OPT_BOOL("model.attn_sinks", c->attn_sinks);
    OPT_BOOL("model.expert_bias", c->expert_bias);
    if (c->attn_sinks && c->attention != CB_ATTN_GQA) {
        cb_set_err(err, len, "model.attn_sinks needs model.attention gqa; " RECONVERT);
        return COLIBRI_E_FORMAT;
    }
    return COLIBRI_OK;
}

/* The family options (docs/format.md, "Family options"): all optional, Mixtral's
 * behaviour by default. Read once here; the forward pass only sees cb_config/cb_layer. */
static colibri_status read_family_options(colibri_ctx *ctx, char *err, size_t len) {
    cb_config *c = &ctx->cfg;
    const cb_meta_entry *e;
    colibri_status st;
    uint32_t n_dense = 0;

    OPT("model.layer_ffn", CB_MT_ARRAY, CB_MT_U32);
    if (e) {
        if (e->count != c->n_layers) {
            cb_set_err(err, len, "model.layer_ffn has %llu entries but the model has %u layers; " RECONVERT,
                       (unsigned long long)e->count, c->n_layers);
            return COLIBRI_E_FORMAT;
        }
        for (uint32_t l = 0; l < c->n_layers; l++) {
            uint32_t v = rd_u32(e->value + 4 * (uint64_t)l);
            if (v > 1) {
                cb_set_err(err, len, "model.layer_ffn[%u] = %u (must be 1 for an MoE block or 0 for a dense "
                           "MLP); " RECONVERT, l, v);
                return COLIBRI_E_FORMAT;
            }
            n_dense += v == 0;
        }
        /* At least one MoE layer: its ffn_experts tensor then bounds n_experts and top_k by
         * the file's size; without one nothing would, and the arena is sized by them. */
        if (n_dense == c->n_layers) {
            cb_set_err(err, len, "model.layer_ffn marks all %u layers dense: this is not a Mixture-of-Experts "
                       "model; " RECONVERT, c->n_layers);
            return COLIBRI_E_FORMAT;
        }
        c->layer_ffn = e->value;
    }
    OPT("model.dense_intermediate_size", CB_MT_U32, 0);
    c->dense_inter = e ? rd_u32(e->value) : 0;
    if (n_dense > 0 && c->dense_inter == 0) {
        cb_set_err(err, len, "model.layer_ffn has %u dense layers but model.dense_intermediate_size is %s; "
                   RECONVERT, n_dense, e ? "0" : "missing");
        return COLIBRI_E_FORMAT;
    }
    OPT("model.shared_expert_intermediate_size", CB_MT_U32, 0);
    c->shared_inter = e ? rd_u32(e->value) : 0;
    if (c->dense_inter > (1u << 26) || c->shared_inter > (1u << 26)) {
        cb_set_err(err, len, "model widths are implausible (dense_intermediate_size = %u, "
                   "shared_expert_intermediate_size = %u); " RECONVERT, c->dense_inter, c->shared_inter);
        return COLIBRI_E_FORMAT;
    }
    OPT_BOOL("model.shared_expert_gate", c->shared_gate);
    if (c->shared_gate && c->shared_inter == 0) {
        cb_set_err(err, len, "model.shared_expert_gate is true but the model has no shared expert "
                   "(model.shared_expert_intermediate_size is 0); " RECONVERT);
        return COLIBRI_E_FORMAT;
    }
    OPT_BOOL("model.attn_qkv_bias", c->attn_qkv_bias);
    OPT_BOOL("model.attn_output_bias", c->attn_output_bias);
    OPT("model.attn_qk_norm", CB_MT_STRING, 0);
    c->qk_norm = CB_QKNORM_NONE;
    if (e) {
        if (str_is(e, "none")) c->qk_norm = CB_QKNORM_NONE;
        else if (str_is(e, "head")) c->qk_norm = CB_QKNORM_HEAD;
        else if (str_is(e, "full")) c->qk_norm = CB_QKNORM_FULL;
        else {
            char tmp[64];
            str_copy(tmp, sizeof tmp, e);
            cb_set_err(err, len, "model.attn_qk_norm '%s' is not supported by this build (supported: none, "
                       "head, full); use a newer Colibri or " RECONVERT, tmp);
            return COLIBRI_E_UNSUPPORTED;
        }
    }
    OPT("model.clip_qkv", CB_MT_F64, 0);
    c->clip_qkv = 0.0f;
    if (e) {
        double v = rd_f64(e->value);
        if (!isfinite(v) || v < 0 || v > 3.0e38) {
            cb_set_err(err, len, "model.clip_qkv = %g must be finite and >= 0 (0 = no clipping); " RECONVERT, v);
            return COLIBRI_E_FORMAT;
        }
        c->clip_qkv = (float)v;
        if (v > 0 && c->clip_qkv == 0.0f) c->clip_qkv = 1e-45f; /* a positive clip stays positive */
    }
    OPT("model.layer_sliding_window", CB_MT_ARRAY, CB_MT_U64);
    if (e) {
        if (e->count != c->n_layers) {
            cb_set_err(err, len, "model.layer_sliding_window has %llu entries but the model has %u layers; "
                       RECONVERT, (unsigned long long)e->count, c->n_layers);
            return COLIBRI_E_FORMAT;
        }
        c->layer_window = e->value;
    }
    if ((st = read_router_options(ctx, err, len))) return st;
    if ((st = read_mla_options(ctx, err, len))) return st;
    if ((st = read_gptoss_options(ctx, err, len))) return st;
    /* the chat template (a Jinja source, as tokenizer_config.json has it); applied by
     * colibri_server, never by the engine */
    OPT("tokenizer.chat_template", CB_MT_STRING, 0);
    if (e) {
        c->chat_template = e->value;
        c->chat_template_len = e->count;
    }
    return COLIBRI_OK;
}
#undef OPT_BOOL
#undef OPT

/* The family's choices (model/family.h): model.attention, model.routing, model.activation
 * (absent: Mixtral's) and model.rope_type (required), each parsed by its axis's table and
 * checked against the family's entry; YaRN's frequencies and attention factor. */
static colibri_status read_choices(colibri_ctx *ctx, char *err, size_t len) {
    cb_config *c = &ctx->cfg;
    int *choice[CB_N_AXES] = {&c->attention, &c->routing, &c->activation, &c->rope_type};
    const cb_meta_entry *e;
    colibri_status st;
    for (int a = 0; a < CB_N_AXES; a++) {
        const char *key = cb_axis_key(a);
        if ((st = meta_opt(ctx, key, CB_MT_STRING, 0, &e, err, len))) return st;
        *choice[a] = cb_axis_default(a);
        if (!e) continue;
        char tmp[64], have[160];
        str_copy(tmp, sizeof tmp, e);
        cb_axis_choices(a, have, sizeof have);
        int v = cb_axis_parse(a, e->value, e->count);
        if (v < 0 || !cb_axis_implemented(a, v)) {
            cb_set_err(err, len, "%s '%s' is not supported by this build (supported: %s); use a newer "
                       "Colibri or a model of a supported family", key, tmp, have);
            return COLIBRI_E_UNSUPPORTED;
        }
        if (!(c->family->allowed[a] >> v & 1u)) {
            cb_set_err(err, len, "%s '%s' is not a choice of the %s family; " RECONVERT, key, tmp,
                       c->family->name);
            return COLIBRI_E_FORMAT;
        }
        *choice[a] = v;
    }
    /* RoPE, for YaRN: the converter's [head_dim / 2] inverse frequencies (head_dim is the
     * rotated width, MLA's qk_rope_head_dim too) and its cos/sin factor */
    c->rope_inv_freq = NULL;
    c->rope_attention_factor = 1.0f;
    if ((st = meta_opt(ctx, "model.rope_inv_freq", CB_MT_ARRAY, CB_MT_F64, &e, err, len))) return st;
    if (e) {
        if (e->count != c->head_dim / 2) {
            cb_set_err(err, len, "model.rope_inv_freq has %llu entries, expected %u (rotated dims / 2); " RECONVERT,
                       (unsigned long long)e->count, c->head_dim / 2);
            return COLIBRI_E_FORMAT;
        }
        for (uint64_t i = 0; i < e->count; i++) {
            double f = rd_f64(e->value + 8 * i);
            if (!isfinite(f) || f <= 0) {
                cb_set_err(err, len, "model.rope_inv_freq[%llu] = %g must be finite and > 0; " RECONVERT,
                           (unsigned long long)i, f);
                return COLIBRI_E_FORMAT;
            }
        }
        c->rope_inv_freq = e->value;
    }
    if ((st = meta_opt(ctx, "model.rope_attention_factor", CB_MT_F64, 0, &e, err, len))) return st;
    if (e) {
        double f = rd_f64(e->value);
        if (!isfinite(f) || f <= 0 || f > 1e6) {
            cb_set_err(err, len, "model.rope_attention_factor = %g must be finite and in (0, 1e6]; " RECONVERT, f);
            return COLIBRI_E_FORMAT;
        }
        c->rope_attention_factor = (float)f;
    }
    if (c->rope_type == CB_ROPE_YARN && !c->rope_inv_freq) {
        cb_set_err(err, len, "model.rope_type is yarn but model.rope_inv_freq is missing; " RECONVERT);
        return COLIBRI_E_FORMAT;
    }
    if (c->rope_type == CB_ROPE_DEFAULT && (c->rope_inv_freq || c->rope_attention_factor != 1.0f)) {
        cb_set_err(err, len, "model.rope_type is default but the file has YaRN's model.rope_inv_freq or "
                   "model.rope_attention_factor; " RECONVERT);
        return COLIBRI_E_FORMAT;
    }
    return COLIBRI_OK;
}

static colibri_status read_config(colibri_ctx *ctx, char *err, size_t len) {
    cb_config *c = &ctx->cfg;
    const cb_meta_entry *e;
    colibri_status st;

    /* the family first: a file of another family must say "unsupported", not "bad shape" */
    REQ("general.architecture", CB_MT_STRING);
    str_copy(c->architecture, sizeof c->architecture, e);
    /* the architecture selects nothing in the forward pass: its entry in the family table
     * (model/family.c) says which choices its files may make, and the choices do */
    c->family = cb_family_find(e->value, e->count);
    if (!c->family) {
        char names[256];
        cb_family_names(names, sizeof names);
        cb_set_err(err, len, "architecture '%s' is not supported by this build (supported: %s); "
                   "use a newer Colibri or a model of a supported family", c->architecture, names);
        return COLIBRI_E_UNSUPPORTED;
    }
    REQ("general.name", CB_MT_STRING);
    text_copy(c->name, sizeof c->name, e);

    if ((st = agree_u32(ctx, "model.n_layers", c->n_layers, "n_layers", err, len))) return st;
    if ((st = agree_u32(ctx, "model.hidden_size", c->hidden, "hidden_size", err, len))) return st;
    if ((st = agree_u32(ctx, "model.intermediate_size", c->inter, "intermediate_size", err, len))) return st;
    if ((st = agree_u32(ctx, "model.vocab_size", c->vocab, "vocab_size", err, len))) return st;
    if ((st = agree_u32(ctx, "model.n_experts", c->n_experts, "n_experts", err, len))) return st;
    if ((st = agree_u32(ctx, "model.top_k", c->top_k, "top_k", err, len))) return st;
    if ((st = agree_u32(ctx, "model.max_seq_len", c->file_max_seq_len, "max_seq_len", err, len))) return st;
    if ((st = agree_u32(ctx, "convert.block_size", c->block_size, "block_size", err, len))) return st;

    REQ("model.n_heads", CB_MT_U32);
    c->n_heads = rd_u32(e->value);
    REQ("model.n_kv_heads", CB_MT_U32);
    c->n_kv_heads = rd_u32(e->value);
    REQ("model.head_dim", CB_MT_U32);
    c->head_dim = rd_u32(e->value);
    if (c->n_heads == 0) {
        cb_set_err(err, len, "model.n_heads is 0 (must be >= 1); " RECONVERT);
        return COLIBRI_E_FORMAT;
    }
    if (c->n_kv_heads == 0 || c->n_heads % c->n_kv_heads != 0) {
        cb_set_err(err, len, "model.n_kv_heads = %u must be >= 1 and divide model.n_heads = %u; " RECONVERT,
                   c->n_kv_heads, c->n_heads);
        return COLIBRI_E_FORMAT;
    }
    if (c->head_dim == 0 || c->head_dim % 2 != 0) {
        cb_set_err(err, len, "model.head_dim = %u must be even and >= 2 (RoPE rotates pairs); " RECONVERT,
                   c->head_dim);
        return COLIBRI_E_FORMAT;
    }
    /* widths must stay far from overflow in every size computed from them */
    if ((uint64_t)c->n_heads * c->head_dim > (1u << 24) || (uint64_t)c->hidden > (1u << 24) ||
        (uint64_t)c->inter > (1u << 26)) {
        cb_set_err(err, len, "model widths are implausible (n_heads*head_dim = %llu, hidden_size = %u, "
                   "intermediate_size = %u); " RECONVERT,
                   (unsigned long long)c->n_heads * c->head_dim, c->hidden, c->inter);
        return COLIBRI_E_FORMAT;
    }

    REQ("model.norm_topk_prob", CB_MT_BOOL);
    c->norm_topk_prob = e->value[0];
    REQ("model.rms_norm_eps", CB_MT_F64);
    c->rms_norm_eps = rd_f64(e->value);
    if (!isfinite(c->rms_norm_eps) || c->rms_norm_eps < 0) {
        cb_set_err(err, len, "model.rms_norm_eps = %g must be finite and >= 0; " RECONVERT, c->rms_norm_eps);
        return COLIBRI_E_FORMAT;
    }
    REQ("model.rope_theta", CB_MT_F64);
    c->rope_theta = rd_f64(e->value);
    if (!isfinite(c->rope_theta) || c->rope_theta <= 0) {
        cb_set_err(err, len, "model.rope_theta = %g must be finite and > 0; " RECONVERT, c->rope_theta);
        return COLIBRI_E_FORMAT;
    }
    REQ("model.rope_type", CB_MT_STRING);
    if ((st = read_choices(ctx, err, len))) return st;
    REQ("model.max_position_embeddings", CB_MT_U64);
    c->max_position_embeddings = rd_u64(e->value);
    REQ("model.sliding_window", CB_MT_U64);
    c->sliding_window = rd_u64(e->value);
    REQ("model.tie_word_embeddings", CB_MT_BOOL);
    c->tie_word_embeddings = e->value[0];
    if (c->tie_word_embeddings != (int)((c->flags >> 1) & 1u)) {
        cb_set_err(err, len, "model.tie_word_embeddings = %d disagrees with header flags bit 1 = %u; " RECONVERT,
                   c->tie_word_embeddings, (c->flags >> 1) & 1u);
        return COLIBRI_E_FORMAT;
    }
    REQ("model.router_dtype", CB_MT_STRING);
    str_copy(c->router_dtype_str, sizeof c->router_dtype_str, e);
    if (!parse_dtype_str(e, &c->router_dtype)) {
        cb_set_err(err, len, "model.router_dtype '%s' is not one of f32, f16, bf16, int8; " RECONVERT,
                   c->router_dtype_str);
        return COLIBRI_E_UNSUPPORTED;
    }
    c->router_int8 = c->router_dtype == COLIBRI_DTYPE_I8;
    if (c->router_int8 != (int)(c->flags & 1u)) {
        cb_set_err(err, len, "model.router_dtype '%s' disagrees with header flags bit 0 (routers int8) = %u; " RECONVERT,
                   c->router_dtype_str, c->flags & 1u);
        return COLIBRI_E_FORMAT;
    }
    /* informative since version 2 (the file's mix, e.g. q4_k_m): every tensor has its dtype */
    REQ("model.weight_dtype", CB_MT_STRING);
    str_copy(c->weight_dtype_str, sizeof c->weight_dtype_str, e);
    if (c->version < 2 && (!parse_dtype_str(e, &c->weight_dtype) || c->weight_dtype == COLIBRI_DTYPE_I8)) {
        cb_set_err(err, len, "model.weight_dtype '%s' is not one of f32, f16, bf16; " RECONVERT,
                   c->weight_dtype_str);
        return COLIBRI_E_UNSUPPORTED;
    }
    REQ("tokenizer.type", CB_MT_STRING);
    {
        int none = str_is(e, "none");
        int has = ctx->cfg.sections[CB_SEC_TOK].size > 0;
        if (none && has) {
            cb_set_err(err, len, "tokenizer.type is 'none' but the tokenizer section holds %llu bytes; " RECONVERT,
                       (unsigned long long)ctx->cfg.sections[CB_SEC_TOK].size);
            return COLIBRI_E_FORMAT;
        }
        if (!none && !has) {
            char tmp[64];
            str_copy(tmp, sizeof tmp, e);
            cb_set_err(err, len, "tokenizer.type is '%s' but the tokenizer section is empty; " RECONVERT, tmp);
            return COLIBRI_E_FORMAT;
        }
    }
    REQ("tokenizer.bos_id", CB_MT_I32);
    c->bos_id = (int32_t)rd_u32(e->value);
    REQ("tokenizer.eos_id", CB_MT_I32);
    c->eos_id = (int32_t)rd_u32(e->value);
    REQ("tokenizer.unk_id", CB_MT_I32);
    c->unk_id = (int32_t)rd_u32(e->value);
    REQ("tokenizer.pad_id", CB_MT_I32);
    c->pad_id = (int32_t)rd_u32(e->value);
    REQ("convert.source", CB_MT_STRING);
    return read_family_options(ctx, err, len);
}

/* ---- tensor directory ---- */

static colibri_status parse_tensors(colibri_ctx *ctx, char *err, size_t len) {
    const cb_config *c = &ctx->cfg;
    const cb_section *sec = &c->sections[CB_SEC_TDIR];
    cb_reader r = {ctx->map + sec->offset, sec->size, 0};
    if (!rd_has(&r, 8)) {
        cb_set_err(err, len, "tensor directory is %llu bytes, too small for its count; " RECONVERT,
                   (unsigned long long)sec->size);
        return COLIBRI_E_FORMAT;
    }
    uint64_t n = rd_u64(r.p);
    r.pos = 8;
    const uint64_t min_rec = 4 + 1 + 16 + 32 + 24; /* 77 bytes with a 1-byte name */
    if (n > (sec->size - 8) / min_rec) {
        cb_set_err(err, len, "tensor directory says %llu tensors but holds at most %llu; " RECONVERT,
                   (unsigned long long)n, (unsigned long long)((sec->size - 8) / min_rec));
        return COLIBRI_E_FORMAT;
    }
    ctx->tensors = calloc(n ? n : 1, sizeof(cb_tensor));
    if (!ctx->tensors) {
        cb_set_err(err, len, "out of memory reading %llu tensor records", (unsigned long long)n);
        return COLIBRI_E_NOMEM;
    }
    ctx->n_tensors = n;
    for (uint64_t i = 0; i < n; i++) {
        cb_tensor *t = &ctx->tensors[i];
        if (!rd_has(&r, 4)) goto truncated;
        uint32_t nl = rd_u32(r.p + r.pos);
        r.pos += 4;
        if (nl < 1 || nl > 256) {
            cb_set_err(err, len, "tensor record %llu has name length %u (allowed 1..256); " RECONVERT,
                       (unsigned long long)i, nl);
            return COLIBRI_E_FORMAT;
        }
        if (!rd_has(&r, (uint64_t)nl + 72)) goto truncated;
        t->name = r.p + r.pos;
        t->name_len = nl;
        for (uint32_t k = 0; k < nl; k++) {
            if (t->name[k] < 0x21 || t->name[k] > 0x7e) {
                cb_set_err(err, len, "tensor record %llu has a name that is not printable ASCII; " RECONVERT,
                           (unsigned long long)i);
                return COLIBRI_E_FORMAT;
            }
        }
        const uint8_t *p = r.p + r.pos + nl;
        t->dtype = rd_u32(p);
        t->layout = rd_u32(p + 4);
        t->n_dims = rd_u32(p + 8);
        t->crc32 = rd_u32(p + 12);
        for (int d = 0; d < 4; d++) t->dims[d] = rd_u64(p + 16 + 8 * d);
        t->offset = rd_u64(p + 48);
        t->nbytes = rd_u64(p + 56);
        t->l2norm = rd_f64(p + 64);
        r.pos += (uint64_t)nl + 72;
        const int NL = (int)nl;
        const char *NM = (const char *)t->name;
        if (!cb_dtype_in_file(t->dtype)) {
            cb_set_err(err, len, "tensor '%.*s' has dtype %u, which this build does not know "
                       "(known: 0 f32, 1 f16, 2 bf16, 3 i8, 7 q8_0, 8 q4_k, 9 q5_k, 10 q6_k, 11 mxfp4); use a newer "
                       "Colibri or " RECONVERT, NL, NM, t->dtype);
            return COLIBRI_E_UNSUPPORTED;
        }
        if (cb_dtype_is_quant(t->dtype) && c->version < 2) {
            cb_set_err(err, len, "tensor '%.*s' has the quantized dtype %s, which version %u files cannot hold; "
                       RECONVERT, NL, NM, cb_dtype_name(t->dtype), c->version);
            return COLIBRI_E_FORMAT;
        }
        if (t->layout > CB_LAYOUT_EXPERTS_PACKED) {
            cb_set_err(err, len, "tensor '%.*s' has layout %u, which this build does not know "
                       "(known: 0 row-major, 1 experts-packed); use a newer Colibri or " RECONVERT, NL, NM, t->layout);
            return COLIBRI_E_UNSUPPORTED;
        }
        if (t->n_dims < 1 || t->n_dims > 4) {
            cb_set_err(err, len, "tensor '%.*s' has %u dims (allowed 1..4); " RECONVERT, NL, NM, t->n_dims);
            return COLIBRI_E_FORMAT;
        }
        uint64_t prod = 1;
        for (uint32_t d = 0; d < 4; d++) {
            if (d >= t->n_dims && t->dims[d] != 1) {
                cb_set_err(err, len, "tensor '%.*s' has n_dims %u but unused dim %u is %llu (must be 1); " RECONVERT,
                           NL, NM, t->n_dims, d, (unsigned long long)t->dims[d]);
                return COLIBRI_E_FORMAT;
            }
            if (!cb_mul_u64(prod, t->dims[d], &prod)) {
                cb_set_err(err, len, "tensor '%.*s' has dims whose product overflows 64 bits; " RECONVERT, NL, NM);
                return COLIBRI_E_FORMAT;
            }
        }
        /* rows (every dim but the last) x bytes of a row, which holds whole blocks */
        uint64_t cols = t->dims[t->n_dims - 1], rows = cols ? prod / cols : 0;
        uint64_t rb = cb_row_bytes(t->dtype, cols), want;
        if (cols > 0 && rb == 0) {
            cb_set_err(err, len, "tensor '%.*s' has rows of %llu elements, not a whole number of %s blocks "
                       "(%u elements); " RECONVERT, NL, NM, (unsigned long long)cols, cb_dtype_name(t->dtype),
                       cb_dtype_block(t->dtype));
            return COLIBRI_E_FORMAT;
        }
        int fits = cb_mul_u64(rows, rb, &want);
        if (!fits || want != t->nbytes) {
            cb_set_err(err, len, "tensor '%.*s' says %llu bytes but its dims and dtype make %s%llu; " RECONVERT,
                       NL, NM, (unsigned long long)t->nbytes, fits ? "" : "more than ",
                       (unsigned long long)(fits ? want : UINT64_MAX));
            return COLIBRI_E_FORMAT;
        }
        if (t->offset % c->alignment != 0) {
            cb_set_err(err, len, "tensor '%.*s' starts at offset %llu, not a multiple of the alignment %u; " RECONVERT,
                       NL, NM, (unsigned long long)t->offset, c->alignment);
            return COLIBRI_E_FORMAT;
        }
        uint64_t end;
        if (!cb_add_u64(t->offset, t->nbytes, &end) || end > c->file_size) {
            cb_set_err(err, len, "tensor '%.*s' (offset %llu, %llu bytes) runs past the end of the file "
                       "(%llu bytes); the file is damaged or truncated: re-download or " RECONVERT,
                       NL, NM, (unsigned long long)t->offset, (unsigned long long)t->nbytes,
                       (unsigned long long)c->file_size);
            return COLIBRI_E_FORMAT;
        }
        int inside = 0;
        for (int k = CB_SEC_DENSE; k <= CB_SEC_EXPERTS; k++) {
            const cb_section *s = &c->sections[k];
            if (t->offset >= s->offset && end <= s->offset + s->size) inside = 1;
        }
        if (!inside) {
            cb_set_err(err, len, "tensor '%.*s' (offset %llu, %llu bytes) lies outside the weight sections; " RECONVERT,
                       NL, NM, (unsigned long long)t->offset, (unsigned long long)t->nbytes);
            return COLIBRI_E_FORMAT;
        }
    }
    for (uint64_t i = r.pos; i < r.len; i++) {
        if (r.p[i] != 0) {
            cb_set_err(err, len, "tensor directory has %llu unexpected bytes after its %llu records; " RECONVERT,
                       (unsigned long long)(r.len - r.pos), (unsigned long long)n);
            return COLIBRI_E_FORMAT;
        }
    }
    {
        uint64_t dup = 0;
        int u = names_unique(ctx->tensors, sizeof *ctx->tensors, offsetof(cb_tensor, name),
                             offsetof(cb_tensor, name_len), n, &dup);
        if (u < 0) {
            cb_set_err(err, len, "out of memory checking tensor names");
            return COLIBRI_E_NOMEM;
        }
        if (u == 0) {
            cb_set_err(err, len, "tensor '%.*s' appears more than once in the tensor directory; " RECONVERT,
                       (int)ctx->tensors[dup].name_len, (const char *)ctx->tensors[dup].name);
            return COLIBRI_E_FORMAT;
        }
    }
    return COLIBRI_OK;
truncated:
    cb_set_err(err, len, "tensor directory is cut short (a record runs past its %llu bytes); " RECONVERT,
               (unsigned long long)sec->size);
    return COLIBRI_E_FORMAT;
}

const cb_tensor *cb_find_tensor(const colibri_ctx *ctx, const char *name) {
    size_t nl = strlen(name);
    for (uint64_t i = 0; i < ctx->n_tensors; i++) {
        const cb_tensor *t = &ctx->tensors[i];
        if (t->name_len == nl && memcmp(t->name, name, nl) == 0) return t;
    }
    return NULL;
}

static void fmt_shape(char *buf, size_t cap, uint32_t n_dims, const uint64_t *dims) {
    size_t o = 0;
    o += (size_t)snprintf(buf + o, cap - o, "[");
    for (uint32_t d = 0; d < n_dims && o < cap; d++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%llu", d ? ", " : "", (unsigned long long)dims[d]);
    if (o < cap) snprintf(buf + o, cap - o, "]");
}

/* Look a tensor up by name and check dtype, layout, shape and section together. */
static colibri_status want_tensor(const colibri_ctx *ctx, const char *name, uint32_t dtype,
                                  uint32_t layout, uint32_t n_dims, uint64_t d0, uint64_t d1,
                                  uint64_t d2, int section, const void **out, char *err,
                                  size_t len) {
    const cb_tensor *t = cb_find_tensor(ctx, name);
    if (!t) {
        cb_set_err(err, len, "tensor '%s' is missing from the tensor directory; " RECONVERT, name);
        return COLIBRI_E_FORMAT;
    }
    uint64_t wd[4] = {d0, d1, d2, 1};
    int ok = t->dtype == dtype && t->layout == layout && t->n_dims == n_dims;
    for (uint32_t d = 0; ok && d < n_dims; d++) ok = t->dims[d] == wd[d];
    if (!ok) {
        char have[128], exp[128];
        fmt_shape(have, sizeof have, t->n_dims, t->dims);
        fmt_shape(exp, sizeof exp, n_dims, wd);
        cb_set_err(err, len, "tensor '%s' is %s %s %s, expected %s %s %s; " RECONVERT, name,
                   cb_dtype_name(t->dtype), have, t->layout ? "experts-packed" : "row-major",
                   cb_dtype_name(dtype), exp, layout ? "experts-packed" : "row-major");
        return COLIBRI_E_FORMAT;
    }
    const cb_section *s = &ctx->cfg.sections[section];
    if (t->offset < s->offset || t->offset + t->nbytes > s->offset + s->size) {
        cb_set_err(err, len, "tensor '%s' lies outside the %s section; " RECONVERT, name, sec_name(section));
        return COLIBRI_E_FORMAT;
    }
    *out = ctx->map + t->offset;
    return COLIBRI_OK;
}

/* A weight matrix [rows, cols]: row-major, any weight dtype (the tensor's own). */
static colibri_status want_mat(const colibri_ctx *ctx, const char *name, uint64_t rows, uint64_t cols,
                               int section, cb_mat *out, char *err, size_t len) {
    const cb_tensor *t = cb_find_tensor(ctx, name);
    if (t && !cb_dtype_is_weight(t->dtype)) {
        cb_set_err(err, len, "tensor '%s' has dtype %s, which a weight matrix cannot have (f32, f16, bf16, "
                   "q8_0, q4_k, q5_k, q6_k, mxfp4); " RECONVERT, name, cb_dtype_name(t->dtype));
        return COLIBRI_E_FORMAT;
    }
    const void *p = NULL;
    colibri_status st = want_tensor(ctx, name, t ? t->dtype : COLIBRI_DTYPE_F32, CB_LAYOUT_ROW_MAJOR, 2, rows,
                                    cols, 1, section, &p, err, len);
    if (st != COLIBRI_OK) return st;
    out->w = p;
    out->dt = t->dtype;
    return COLIBRI_OK;
}

/* One SwiGLU FFN of E experts (E = 1 with 2-D split tensors for a dense MLP or a shared
 * expert) of width I: the packed tensor `packed_name`, or the split tensors
 * blk.l.<gate>, <up>, <down> (docs/format.md, "Version 2"). */
static colibri_status want_ffn(const colibri_ctx *ctx, uint32_t l, const char *packed_name, const char *split_suffix,
                               int experts_3d, uint64_t E, uint64_t I, cb_ffn *f, char *err, size_t len) {
    uint64_t H = ctx->cfg.hidden;
    char name[96], gname[96], uname[96], dname[96];
    colibri_status st;
    const void *p;
    snprintf(name, sizeof name, "blk.%u.%s", l, packed_name);
    snprintf(gname, sizeof gname, "blk.%u.ffn_gate%s", l, split_suffix);
    snprintf(uname, sizeof uname, "blk.%u.ffn_up%s", l, split_suffix);
    snprintf(dname, sizeof dname, "blk.%u.ffn_down%s", l, split_suffix);
    memset(f, 0, sizeof *f);
    f->inter = (uint32_t)I;
    const cb_tensor *t = cb_find_tensor(ctx, name);
    if (t || !cb_find_tensor(ctx, gname)) { /* packed (or neither: the error names the packed tensor) */
        uint32_t dt = t ? t->dtype : COLIBRI_DTYPE_BF16;
        if (t && dt != COLIBRI_DTYPE_F32 && dt != COLIBRI_DTYPE_F16 && dt != COLIBRI_DTYPE_BF16) {
            cb_set_err(err, len, "tensor '%s' is experts-packed in %s; the packed layout holds f32, f16 or bf16 "
                       "(quantized FFNs are stored split); " RECONVERT, name, cb_dtype_name(dt));
            return COLIBRI_E_FORMAT;
        }
        st = want_tensor(ctx, name, dt, CB_LAYOUT_EXPERTS_PACKED, 3, E, 3 * I, H, CB_SEC_EXPERTS, &p, err, len);
        if (st != COLIBRI_OK) return st;
        f->packed = p;
        f->stride = t->nbytes / E;
        f->dt = f->down_dt = dt;
        return COLIBRI_OK;
    }
    if (ctx->cfg.version < 2) {
        cb_set_err(err, len, "tensor '%s' is a split FFN, which version %u files cannot hold; " RECONVERT, gname,
                   ctx->cfg.version);
        return COLIBRI_E_FORMAT;
    }
    const cb_tensor *tg = cb_find_tensor(ctx, gname), *tu = cb_find_tensor(ctx, uname), *td = cb_find_tensor(ctx, dname);
    const cb_tensor *ts[3] = {tg, tu, td};
    const char *ns[3] = {gname, uname, dname};
    for (int i = 0; i < 3; i++)
        if (ts[i] && !cb_dtype_is_weight(ts[i]->dtype)) {
            cb_set_err(err, len, "tensor '%s' has dtype %s, which a weight matrix cannot have; " RECONVERT, ns[i],
                       cb_dtype_name(ts[i]->dtype));
            return COLIBRI_E_FORMAT;
        }
    if (tu && tu->dtype != tg->dtype) {
        cb_set_err(err, len, "tensors '%s' (%s) and '%s' (%s) differ in dtype; a split FFN's gate and up "
                   "projections share one; " RECONVERT, gname, cb_dtype_name(tg->dtype), uname,
                   cb_dtype_name(tu->dtype));
        return COLIBRI_E_FORMAT;
    }
    uint32_t nd = experts_3d ? 3 : 2;
    uint64_t a0 = experts_3d ? E : I, a1 = experts_3d ? I : H, a2 = experts_3d ? H : 1;
    st = want_tensor(ctx, gname, tg->dtype, CB_LAYOUT_ROW_MAJOR, nd, a0, a1, a2, CB_SEC_EXPERTS, &p, err, len);
    if (st != COLIBRI_OK) return st;
    f->gate = p;
    st = want_tensor(ctx, uname, tg->dtype, CB_LAYOUT_ROW_MAJOR, nd, a0, a1, a2, CB_SEC_EXPERTS, &p, err, len);
    if (st != COLIBRI_OK) return st;
    f->up = p;
    uint64_t b0 = experts_3d ? E : H, b1 = experts_3d ? H : I, b2 = experts_3d ? I : 1;
    st = want_tensor(ctx, dname, td ? td->dtype : tg->dtype, CB_LAYOUT_ROW_MAJOR, nd, b0, b1, b2, CB_SEC_EXPERTS,
                     &p, err, len);
    if (st != COLIBRI_OK) return st;
    f->down = p;
    f->dt = tg->dtype;
    f->down_dt = td->dtype;
    f->gu_stride = tg->nbytes / E;
    f->down_stride = td->nbytes / E;
    return COLIBRI_OK;
}

/* The attention tensors of layer l of an MLA file (docs/format.md, "Family options"):
 * q (or the q LoRA and its norm), kv_a with its norm, kv_b and the output projection. */
static colibri_status bind_mla_attention(const colibri_ctx *ctx, uint32_t l, cb_layer *L, char *err,
                                         size_t len) {
    const cb_config *c = &ctx->cfg;
    uint64_t H = c->hidden, nh = c->n_heads, r = c->kv_lora_rank, dr = c->head_dim;
    uint64_t Nq = nh * (c->qk_nope_dim + dr), ql = c->q_lora_rank;
    colibri_status st;
    const void *p;
    char name[96];
    if (ql) {
        snprintf(name, sizeof name, "blk.%u.attn_q_a.weight", l);
        if ((st = want_mat(ctx, name, ql, H, CB_SEC_DENSE, &L->wq_a, err, len))) return st;
        snprintf(name, sizeof name, "blk.%u.attn_q_a_norm.weight", l);
        if ((st = want_tensor(ctx, name, COLIBRI_DTYPE_F32, 0, 1, ql, 1, 1, CB_SEC_DENSE, &p, err, len))) return st;
        L->q_a_norm = p;
        snprintf(name, sizeof name, "blk.%u.attn_q_b.weight", l);
        if ((st = want_mat(ctx, name, Nq, ql, CB_SEC_DENSE, &L->wq_b, err, len))) return st;
    } else {
        snprintf(name, sizeof name, "blk.%u.attn_q.weight", l);
        if ((st = want_mat(ctx, name, Nq, H, CB_SEC_DENSE, &L->wq, err, len))) return st;
    }
    snprintf(name, sizeof name, "blk.%u.attn_kv_a_mqa.weight", l);
    if ((st = want_mat(ctx, name, r + dr, H, CB_SEC_DENSE, &L->wkv_a, err, len))) return st;
    snprintf(name, sizeof name, "blk.%u.attn_kv_a_norm.weight", l);
    if ((st = want_tensor(ctx, name, COLIBRI_DTYPE_F32, 0, 1, r, 1, 1, CB_SEC_DENSE, &p, err, len))) return st;
    L->kv_a_norm = p;
    snprintf(name, sizeof name, "blk.%u.attn_kv_b.weight", l);
    if ((st = want_mat(ctx, name, nh * (c->qk_nope_dim + c->v_head_dim), r, CB_SEC_DENSE, &L->wkv_b, err, len)))
        return st;
    snprintf(name, sizeof name, "blk.%u.attn_output.weight", l);
    return want_mat(ctx, name, H, nh * c->v_head_dim, CB_SEC_DENSE, &L->wo, err, len);
}

static colibri_status bind_weights(colibri_ctx *ctx, char *err, size_t len) {
    cb_config *c = &ctx->cfg;
    uint64_t H = c->hidden, I = c->inter, V = c->vocab, E = c->n_experts;
    uint64_t Nq = (uint64_t)c->n_heads * c->head_dim, Nkv = (uint64_t)c->n_kv_heads * c->head_dim;
    colibri_status st;
    const void *p;
    char name[96];
    int first_ffn = 1;
    ctx->w.layers = calloc(c->n_layers, sizeof(cb_layer));
    if (!ctx->w.layers) {
        cb_set_err(err, len, "out of memory for %u layer records", c->n_layers);
        return COLIBRI_E_NOMEM;
    }
#define WANT(nm, dt, lay, nd, a, b, cc, sec)                                                \
    do {                                                                                    \
        st = want_tensor(ctx, nm, dt, lay, nd, a, b, cc, sec, &p, err, len);                \
        if (st != COLIBRI_OK) return st;                                                    \
    } while (0)
#define MAT(nm, rows, cols, sec, out)                                                       \
    do {                                                                                    \
        st = want_mat(ctx, nm, rows, cols, sec, out, err, len);                             \
        if (st != COLIBRI_OK) return st;                                                    \
    } while (0)
#define FFN(packed, suffix, e3, e, width, out)                                              \
    do {                                                                                    \
        st = want_ffn(ctx, l, packed, suffix, e3, e, width, out, err, len);                 \
        if (st != COLIBRI_OK) return st;                                                    \
        if (first_ffn) c->weight_dtype = (out)->dt;                                         \
        first_ffn = 0;                                                                      \
    } while (0)
    MAT("token_embd.weight", V, H, CB_SEC_DENSE, &ctx->w.tok_embd);
    WANT("output_norm.weight", COLIBRI_DTYPE_F32, 0, 1, H, 1, 1, CB_SEC_DENSE);
    ctx->w.out_norm = p;
    if (c->tie_word_embeddings) ctx->w.lm_head = ctx->w.tok_embd;
    else MAT("output.weight", V, H, CB_SEC_DENSE, &ctx->w.lm_head);
    for (uint32_t l = 0; l < c->n_layers; l++) {
        cb_layer *L = &ctx->w.layers[l];
        snprintf(name, sizeof name, "blk.%u.attn_norm.weight", l);
        WANT(name, COLIBRI_DTYPE_F32, 0, 1, H, 1, 1, CB_SEC_DENSE);
        L->attn_norm = p;
        if (c->attention == CB_ATTN_MLA) { /* model/mla.c */
            if ((st = bind_mla_attention(ctx, l, L, err, len))) return st;
        } else {
            snprintf(name, sizeof name, "blk.%u.attn_q.weight", l);
            MAT(name, Nq, H, CB_SEC_DENSE, &L->wq);
            snprintf(name, sizeof name, "blk.%u.attn_k.weight", l);
            MAT(name, Nkv, H, CB_SEC_DENSE, &L->wk);
            snprintf(name, sizeof name, "blk.%u.attn_v.weight", l);
            MAT(name, Nkv, H, CB_SEC_DENSE, &L->wv);
            snprintf(name, sizeof name, "blk.%u.attn_output.weight", l);
            MAT(name, H, Nq, CB_SEC_DENSE, &L->wo);
        }
        snprintf(name, sizeof name, "blk.%u.ffn_norm.weight", l);
        WANT(name, COLIBRI_DTYPE_F32, 0, 1, H, 1, 1, CB_SEC_DENSE);
        L->ffn_norm = p;
        if (c->attn_qkv_bias) {
            snprintf(name, sizeof name, "blk.%u.attn_q.bias", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 1, Nq, 1, 1, CB_SEC_DENSE);
            L->bq = p;
            snprintf(name, sizeof name, "blk.%u.attn_k.bias", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 1, Nkv, 1, 1, CB_SEC_DENSE);
            L->bk = p;
            snprintf(name, sizeof name, "blk.%u.attn_v.bias", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 1, Nkv, 1, 1, CB_SEC_DENSE);
            L->bv = p;
        }
        if (c->attn_output_bias) {
            snprintf(name, sizeof name, "blk.%u.attn_output.bias", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 1, H, 1, 1, CB_SEC_DENSE);
            L->bo = p;
        }
        if (c->qk_norm != CB_QKNORM_NONE) {
            int head = c->qk_norm == CB_QKNORM_HEAD;
            snprintf(name, sizeof name, "blk.%u.attn_q_norm.weight", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 1, head ? c->head_dim : Nq, 1, 1, CB_SEC_DENSE);
            L->q_norm = p;
            snprintf(name, sizeof name, "blk.%u.attn_k_norm.weight", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 1, head ? c->head_dim : Nkv, 1, 1, CB_SEC_DENSE);
            L->k_norm = p;
        }
        if (c->attn_sinks) {
            snprintf(name, sizeof name, "blk.%u.attn_sinks", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 1, c->n_heads, 1, 1, CB_SEC_DENSE);
            L->sinks = p;
        }
        L->moe = c->layer_ffn ? (int)rd_u32(c->layer_ffn + 4 * (uint64_t)l) : 1;
        {
            uint64_t w = c->layer_window ? rd_u64(c->layer_window + 8 * (uint64_t)l) : c->sliding_window;
            L->window = w > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)w;
        }
        if (!L->moe) {
            FFN("ffn_dense", "", 0, 1, c->dense_inter, &L->dense);
            continue;
        }
        snprintf(name, sizeof name, "blk.%u.ffn_gate_inp.weight", l);
        WANT(name, c->router_dtype, 0, 2, E, H, 1, CB_SEC_ROUTER);
        L->router = p;
        if (c->router_int8) {
            snprintf(name, sizeof name, "blk.%u.ffn_gate_inp.scale", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 1, E, 1, 1, CB_SEC_ROUTER);
            L->router_scale = p;
            snprintf(name, sizeof name, "blk.%u.ffn_gate_inp.zero", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 1, E, 1, 1, CB_SEC_ROUTER);
            L->router_zero = p;
        }
        if (c->router_bias) { /* the choice-only correction bias (model/route_group.c) */
            snprintf(name, sizeof name, "blk.%u.exp_probs_b.bias", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 1, E, 1, 1, CB_SEC_ROUTER);
            L->router_bias = p;
        }
        if (c->router_logit_bias) {
            snprintf(name, sizeof name, "blk.%u.ffn_gate_inp.bias", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 1, E, 1, 1, CB_SEC_ROUTER);
            L->router_b = p;
        }
        FFN("ffn_experts", "_exps", 1, E, I, &L->experts);
        if (c->activation == CB_ACT_CLAMPED_SWIGLU && L->experts.packed) {
            cb_set_err(err, len, "layer %u's experts are packed; model.activation clamped_swiglu runs on the split "
                       "FFN (version 2); " RECONVERT, l);
            return COLIBRI_E_FORMAT;
        }
        if (c->expert_bias) {
            snprintf(name, sizeof name, "blk.%u.ffn_gate_exps.bias", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 2, E, I, 1, CB_SEC_DENSE);
            L->experts.gate_bias = p;
            snprintf(name, sizeof name, "blk.%u.ffn_up_exps.bias", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 2, E, I, 1, CB_SEC_DENSE);
            L->experts.up_bias = p;
            snprintf(name, sizeof name, "blk.%u.ffn_down_exps.bias", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 2, E, H, 1, CB_SEC_DENSE);
            L->experts.down_bias = p;
        }
        if (c->shared_inter > 0) {
            FFN("ffn_shared", "_shexp", 0, 1, c->shared_inter, &L->shared);
            L->has_shared = 1;
            if (c->shared_gate) {
                snprintf(name, sizeof name, "blk.%u.ffn_shared_gate.weight", l);
                MAT(name, 1, H, CB_SEC_ROUTER, &L->shared_gate);
            }
        }
    }
#undef WANT
#undef MAT
#undef FFN
    return COLIBRI_OK;
}

/* ---- top level ---- */

colibri_status cb_format_load(colibri_ctx *ctx, const char *path, char *err, size_t len) {
    const uint8_t *m = ctx->map;
    uint64_t fs = ctx->map_size;
    cb_config *c = &ctx->cfg;
    static const uint8_t magic[8] = {'C', 'O', 'L', 'I', 'B', 'R', 'I', 0};

    if (fs < 8 || memcmp(m, magic, 8) != 0) {
        cb_set_err(err, len, "'%s' is not a .colibri file (it does not start with the COLIBRI magic); "
                   "convert the model with colibri-convert", path);
        return COLIBRI_E_FORMAT;
    }
    if (fs < 16) {
        cb_set_err(err, len, "'%s' is truncated: %llu bytes, shorter than the %u-byte header; "
                   "re-download or " RECONVERT, path, (unsigned long long)fs, CB_HEADER_SIZE);
        return COLIBRI_E_FORMAT;
    }
    c->version = rd_u32(m + 8);
    if (c->version < 1 || c->version > COLIBRI_FORMAT_VERSION) {
        cb_set_err(err, len, "'%s' is file format version %u; this build reads versions 1 to %d; "
                   "re-convert with colibri-convert%s", path, c->version, COLIBRI_FORMAT_VERSION,
                   c->version > COLIBRI_FORMAT_VERSION ? " (or use a newer Colibri)" : "");
        return COLIBRI_E_VERSION;
    }
    uint32_t hs = rd_u32(m + 12);
    if (hs != CB_HEADER_SIZE) {
        cb_set_err(err, len, "'%s' has header_size %u; headers are %u bytes in every version; " RECONVERT,
                   path, hs, CB_HEADER_SIZE);
        return COLIBRI_E_FORMAT;
    }
    if (fs < CB_HEADER_SIZE) {
        cb_set_err(err, len, "'%s' is truncated: %llu bytes, shorter than the %u-byte header; "
                   "re-download or " RECONVERT, path, (unsigned long long)fs, CB_HEADER_SIZE);
        return COLIBRI_E_FORMAT;
    }
    uint32_t hcrc = rd_u32(m + 252), calc = cb_crc32(0, m, 252);
    if (hcrc != calc) {
        cb_set_err(err, len, "'%s' header CRC-32 mismatch (stored 0x%08x, computed 0x%08x): the file is "
                   "damaged; re-download or " RECONVERT, path, hcrc, calc);
        return COLIBRI_E_CHECKSUM;
    }
    c->file_size = rd_u64(m + 16);
    if (c->file_size != fs) {
        if (c->file_size > fs)
            cb_set_err(err, len, "'%s' is truncated: the header expects %llu bytes but the file has %llu; "
                       "re-download or " RECONVERT, path, (unsigned long long)c->file_size, (unsigned long long)fs);
        else
            cb_set_err(err, len, "'%s' is longer than its header says: expected %llu bytes, the file has %llu; "
                       "re-download or " RECONVERT, path, (unsigned long long)c->file_size, (unsigned long long)fs);
        return COLIBRI_E_FORMAT;
    }
    c->n_experts = rd_u32(m + 24);
    c->top_k = rd_u32(m + 28);
    c->hidden = rd_u32(m + 32);
    c->inter = rd_u32(m + 36);
    c->vocab = rd_u32(m + 40);
    c->file_max_seq_len = rd_u32(m + 44);
    c->n_layers = rd_u32(m + 48);
    c->flags = rd_u32(m + 52);
    c->alignment = rd_u32(m + 200);
    c->block_size = rd_u32(m + 204);
    struct { const char *name; uint64_t v; } nonzero[] = {
        {"n_experts", c->n_experts}, {"hidden_size", c->hidden}, {"intermediate_size", c->inter},
        {"vocab_size", c->vocab}, {"max_seq_len", c->file_max_seq_len}, {"n_layers", c->n_layers},
        {"block_size", c->block_size}, {"top_k", c->top_k}};
    for (size_t i = 0; i < sizeof nonzero / sizeof nonzero[0]; i++) {
        if (nonzero[i].v == 0) {
            cb_set_err(err, len, "header field %s is 0 (must be >= 1); " RECONVERT, nonzero[i].name);
            return COLIBRI_E_FORMAT;
        }
    }
    if (c->top_k > c->n_experts) {
        cb_set_err(err, len, "header field top_k = %u exceeds n_experts = %u; " RECONVERT, c->top_k, c->n_experts);
        return COLIBRI_E_FORMAT;
    }
    if (c->flags & ~3u) {
        cb_set_err(err, len, "header flags 0x%x has unknown bits set (known: bit 0 int8 routers, bit 1 tied LM head); "
                   "use a newer Colibri or " RECONVERT, c->flags);
        return COLIBRI_E_FORMAT;
    }
    if (c->alignment < 64 || (c->alignment & (c->alignment - 1)) != 0) {
        cb_set_err(err, len, "header field alignment = %u must be a power of two >= 64; " RECONVERT, c->alignment);
        return COLIBRI_E_FORMAT;
    }
    for (int i = 208; i < 252; i++) {
        if (m[i] != 0) {
            cb_set_err(err, len, "header reserved byte %d is not zero; use a newer Colibri or " RECONVERT, i);
            return COLIBRI_E_FORMAT;
        }
    }
    /* sections: inside the file, in order, not overlapping, aligned */
    uint64_t prev_end = CB_HEADER_SIZE;
    for (int k = 0; k < CB_N_SECTIONS; k++) {
        const uint8_t *s = m + 56 + 24 * k;
        cb_section *sec = &c->sections[k];
        sec->offset = rd_u64(s);
        sec->size = rd_u64(s + 8);
        sec->crc32 = rd_u32(s + 16);
        uint64_t end;
        if (rd_u32(s + 20) != 0) {
            cb_set_err(err, len, "%s section entry has a non-zero reserved field; " RECONVERT, sec_name(k));
            return COLIBRI_E_FORMAT;
        }
        if (!cb_add_u64(sec->offset, sec->size, &end) || end > fs) {
            cb_set_err(err, len, "%s section (offset %llu, %llu bytes) runs past the end of the file "
                       "(%llu bytes); the file is damaged or truncated: re-download or " RECONVERT, sec_name(k),
                       (unsigned long long)sec->offset, (unsigned long long)sec->size, (unsigned long long)fs);
            return COLIBRI_E_FORMAT;
        }
        if (sec->offset < prev_end) {
            cb_set_err(err, len, "%s section starts at %llu, before the end (%llu) of what precedes it: "
                       "sections overlap or are out of order; " RECONVERT, sec_name(k),
                       (unsigned long long)sec->offset, (unsigned long long)prev_end);
            return COLIBRI_E_FORMAT;
        }
        uint64_t align = k >= CB_SEC_DENSE ? 4096 : 64;
        if (sec->offset % align != 0) {
            cb_set_err(err, len, "%s section starts at %llu, not a multiple of %llu; " RECONVERT, sec_name(k),
                       (unsigned long long)sec->offset, (unsigned long long)align);
            return COLIBRI_E_FORMAT;
        }
        if (sec->size == 0 && k != CB_SEC_TOK) {
            cb_set_err(err, len, "%s section is empty; " RECONVERT, sec_name(k));
            return COLIBRI_E_FORMAT;
        }
        prev_end = end;
    }
    for (int k = 0; k <= CB_SEC_TOK; k++) {
        const cb_section *sec = &c->sections[k];
        uint32_t got = cb_crc32(0, m + sec->offset, sec->size);
        if (got != sec->crc32) {
            cb_set_err(err, len, "%s section CRC-32 mismatch (stored 0x%08x, computed 0x%08x): the file is "
                       "damaged; re-download or " RECONVERT, sec_name(k), sec->crc32, got);
            return COLIBRI_E_CHECKSUM;
        }
    }
    colibri_status st;
    if ((st = parse_metadata(ctx, err, len))) return st;
    if ((st = read_config(ctx, err, len))) return st;
    if ((st = parse_tensors(ctx, err, len))) return st;
    if ((st = bind_weights(ctx, err, len))) return st;
    return COLIBRI_OK;
}

/* ---- verification on request ---- */

colibri_status cb_verify_all(colibri_ctx *ctx) {
    const cb_config *c = &ctx->cfg;
    for (int k = 0; k < CB_N_SECTIONS; k++) {
        const cb_section *sec = &c->sections[k];
        uint32_t got = cb_crc32(0, ctx->map + sec->offset, sec->size);
        if (got != sec->crc32)
            return cb_fail(ctx, COLIBRI_E_CHECKSUM, "%s section CRC-32 mismatch (stored 0x%08x, computed 0x%08x): "
                           "the file is damaged; re-download or " RECONVERT, sec_name(k), sec->crc32, got);
    }
    for (uint64_t i = 0; i < ctx->n_tensors; i++) {
        const cb_tensor *t = &ctx->tensors[i];
        uint32_t got = cb_crc32(0, ctx->map + t->offset, t->nbytes);
        if (got != t->crc32)
            return cb_fail(ctx, COLIBRI_E_CHECKSUM, "tensor '%.*s' CRC-32 mismatch (stored 0x%08x, computed 0x%08x): "
                           "the file is damaged; re-download or " RECONVERT, (int)t->name_len,
                           (const char *)t->name, t->crc32, got);
    }
    return COLIBRI_OK;
}

static double tensor_l2(const cb_tensor *t, const uint8_t *data, const float *scale, const float *zero) {
    double ss = 0;
    if (t->dtype == COLIBRI_DTYPE_I8) {
        uint64_t n = t->nbytes;
        uint64_t cols = t->n_dims >= 2 ? t->dims[1] : n;
        for (uint64_t i = 0; i < n; i++) {
            uint64_t r = cols ? i / cols : 0;
            double v = ((double)(int8_t)data[i] - (double)zero[r]) * (double)scale[r];
            ss += v * v;
        }
    } else { /* any weight dtype: its rows dequantized a chunk at a time */
        cb_dequant_fn deq = cb_dtype_dequant(t->dtype);
        uint64_t cols = t->dims[t->n_dims - 1], rb = cb_row_bytes(t->dtype, cols);
        uint64_t rows = rb ? t->nbytes / rb : 0, cb = cb_row_bytes(t->dtype, 256);
        float buf[256];
        for (uint64_t r = 0; r < rows; r++)
            for (uint64_t k0 = 0; k0 < cols; k0 += 256) {
                uint64_t m = cols - k0 < 256 ? cols - k0 : 256;
                deq(buf, data + r * rb + k0 / 256 * cb, (int64_t)m);
                for (uint64_t i = 0; i < m; i++) ss += (double)buf[i] * (double)buf[i];
            }
    }
    return sqrt(ss);
}

colibri_status cb_verify_router(colibri_ctx *ctx) {
    const cb_config *c = &ctx->cfg;
    char name[96];
    for (uint32_t l = 0; l < c->n_layers; l++) {
        const cb_layer *L = &ctx->w.layers[l];
        if (!L->moe) continue; /* a dense layer has no router */
        const char *suffix[3] = {"weight", "scale", "zero"};
        int n_check = c->router_int8 ? 3 : 1;
        for (int s = 0; s < n_check + (L->shared_gate.w != NULL); s++) {
            if (s < n_check) snprintf(name, sizeof name, "blk.%u.ffn_gate_inp.%s", l, suffix[s]);
            else snprintf(name, sizeof name, "blk.%u.ffn_shared_gate.weight", l);
            const cb_tensor *t = cb_find_tensor(ctx, name);
            if (!t) return cb_fail(ctx, COLIBRI_E_INTERNAL, "tensor '%s' vanished", name);
            double got = tensor_l2(t, ctx->map + t->offset, L->router_scale, L->router_zero);
            double want = t->l2norm;
            double tol = 1e-5 * fabs(want);
            if (!(fabs(got - want) <= tol) && !(want == 0 && got == 0))
                return cb_fail(ctx, COLIBRI_E_CHECKSUM, "router of layer %u: tensor '%s' has L2 norm %.9g but the "
                               "directory stores %.9g (relative tolerance 1e-5): the router weights are damaged "
                               "or were written wrongly; " RECONVERT, l, name, got, want);
        }
    }
    return COLIBRI_OK;
}
