/*
 * container.c — reads and validates the .colibri container (docs/format.md: format versions
 * 1 and 2, both read): header, sections, metadata records, tensor directory, checksums. It
 * knows no model: what the metadata and tensors mean is model/config.c's and model/weights.c's.
 *
 * Nothing in the file is trusted: every read is bounds-checked with overflow-safe 64-bit
 * arithmetic before it happens, in this order: header (magic, version, header_size, CRC,
 * file_size, value constraints), sections (bounds, order, overlap, alignment), section
 * CRCs (metadata, tensor directory, tokenizer) in cb_file_open; metadata records in
 * cb_file_metadata; tensor directory records in cb_file_tensors.
 * A failure returns a status and a message that names the field and says what to do.
 */
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>

#include "core/checked.h"
#include "core/dtype.h"
#include "core/error.h"
#include "format/container.h"

#define RECONVERT CB_RECONVERT

/* A printable, NUL-terminated copy of file bytes for messages: bytes outside printable
 * ASCII become '?', so a damaged file cannot put invalid UTF-8 into an error message. */
const char *cb_printable(char *dst, size_t cap, const uint8_t *s, uint64_t n) {
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

const char *cb_section_name(int k) {
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

const char *cb_meta_type_name(uint32_t t) {
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

#define PK(p, n) cb_printable(pk_buf, sizeof pk_buf, (p), (n))

colibri_status cb_file_metadata(cb_file *f, char *err, size_t len) {
    char pk_buf[160];
    const cb_section *sec = &f->h.sections[CB_SEC_META];
    cb_reader r = {f->map + sec->offset, sec->size, 0};
    if (!rd_has(&r, 8)) {
        cb_set_err(err, len, "metadata section is %llu bytes, too small for its entry count; " RECONVERT,
                   (unsigned long long)sec->size);
        return COLIBRI_E_FORMAT;
    }
    uint64_t n = cb_rd_u64(r.p);
    r.pos = 8;
    /* the smallest entry is 4 (key_len) + 1 (key) + 4 (type) + 1 (BOOL) = 10 bytes */
    if (n > (sec->size - 8) / 10) {
        cb_set_err(err, len, "metadata says %llu entries but the section holds at most %llu; " RECONVERT,
                   (unsigned long long)n, (unsigned long long)((sec->size - 8) / 10));
        return COLIBRI_E_FORMAT;
    }
    f->meta = calloc(n ? n : 1, sizeof(cb_meta_entry));
    if (!f->meta) {
        cb_set_err(err, len, "out of memory reading %llu metadata entries", (unsigned long long)n);
        return COLIBRI_E_NOMEM;
    }
    f->n_meta = n;
    for (uint64_t i = 0; i < n; i++) {
        cb_meta_entry *e = &f->meta[i];
        if (!rd_has(&r, 4)) goto truncated;
        uint32_t kl = cb_rd_u32(r.p + r.pos);
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
        e->type = cb_rd_u32(r.p + r.pos);
        r.pos += 4;
        if (e->type == CB_MT_STRING) {
            if (!rd_has(&r, 8)) goto truncated;
            uint64_t sl = cb_rd_u64(r.p + r.pos);
            r.pos += 8;
            if (!rd_has(&r, sl)) goto truncated;
            e->count = sl;
            e->value = r.p + r.pos;
            e->value_len = sl;
            r.pos += sl;
        } else if (e->type == CB_MT_ARRAY) {
            if (!rd_has(&r, 12)) goto truncated;
            e->elem_type = cb_rd_u32(r.p + r.pos);
            uint64_t cnt = cb_rd_u64(r.p + r.pos + 4);
            r.pos += 12;
            size_t es = meta_type_size(e->elem_type);
            if (es == 0) {
                cb_set_err(err, len, "metadata key '%s' is an ARRAY of type %u (%s), which arrays may "
                           "not hold; " RECONVERT, PK(e->key, kl), e->elem_type,
                           cb_meta_type_name(e->elem_type));
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
        int u = names_unique(f->meta, sizeof *f->meta, offsetof(cb_meta_entry, key),
                             offsetof(cb_meta_entry, key_len), n, &dup);
        if (u < 0) {
            cb_set_err(err, len, "out of memory checking metadata keys");
            return COLIBRI_E_NOMEM;
        }
        if (u == 0) {
            cb_set_err(err, len, "metadata key '%s' appears more than once; " RECONVERT,
                       PK(f->meta[dup].key, f->meta[dup].key_len));
            return COLIBRI_E_FORMAT;
        }
    }
    return COLIBRI_OK;
truncated:
    cb_set_err(err, len, "metadata section is cut short (an entry at byte %llu of %llu entries runs past its %llu bytes); " RECONVERT,
               (unsigned long long)(r.pos), (unsigned long long)n, (unsigned long long)sec->size);
    return COLIBRI_E_FORMAT;
}

const cb_meta_entry *cb_meta_find(const cb_file *f, const char *key) {
    size_t kl = strlen(key);
    for (uint64_t i = 0; i < f->n_meta; i++) {
        const cb_meta_entry *e = &f->meta[i];
        if (e->key_len == kl && memcmp(e->key, key, kl) == 0) return e;
    }
    return NULL;
}

/* Look up a required key of an exact type. */
colibri_status cb_meta_req(const cb_file *f, const char *key, uint32_t type,
                               const cb_meta_entry **out, char *err, size_t len) {
    const cb_meta_entry *e = cb_meta_find(f, key);
    if (!e) {
        cb_set_err(err, len, "metadata key '%s' is missing; " RECONVERT, key);
        return COLIBRI_E_FORMAT;
    }
    if (e->type != type) {
        cb_set_err(err, len, "metadata key '%s' has type %s, expected %s; " RECONVERT, key,
                   cb_meta_type_name(e->type), cb_meta_type_name(type));
        return COLIBRI_E_FORMAT;
    }
    *out = e;
    return COLIBRI_OK;
}

/* Look up an optional key: OK with *out = NULL when absent, an error when of another type. */
colibri_status cb_meta_opt(const cb_file *f, const char *key, uint32_t type, uint32_t elem_type,
                               const cb_meta_entry **out, char *err, size_t len) {
    const cb_meta_entry *e = cb_meta_find(f, key);
    *out = NULL;
    if (!e) return COLIBRI_OK;
    if (e->type != type || (type == CB_MT_ARRAY && e->elem_type != elem_type)) {
        char have[48], want[48];
        snprintf(have, sizeof have, "%s%s%s", cb_meta_type_name(e->type), e->type == CB_MT_ARRAY ? " of " : "",
                 e->type == CB_MT_ARRAY ? cb_meta_type_name(e->elem_type) : "");
        snprintf(want, sizeof want, "%s%s%s", cb_meta_type_name(type), type == CB_MT_ARRAY ? " of " : "",
                 type == CB_MT_ARRAY ? cb_meta_type_name(elem_type) : "");
        cb_set_err(err, len, "metadata key '%s' has type %s, expected %s; " RECONVERT, key, have, want);
        return COLIBRI_E_FORMAT;
    }
    *out = e;
    return COLIBRI_OK;
}

/* ---- tensor directory ---- */

/* The grid types' codebooks (core/quant_grid.c): a file holding a tensor of such a type carries
 * its codebook as the int8 tensor "codebook.<type>" [entries, width]; installed (process-wide)
 * once its size and CRC-32 are ggml's grid's. */
static colibri_status install_codebooks(const cb_file *f, char *err, size_t len) {
    for (int book = 0; book < CB_N_CODEBOOKS; book++) {
        const cb_tensor *user = NULL;
        for (uint64_t i = 0; i < f->n_tensors && !user; i++)
            if (cb_dtype_codebook(f->tensors[i].dtype) == book) user = &f->tensors[i];
        if (!user) continue;
        char name[32], why[192];
        snprintf(name, sizeof name, "codebook.%s", cb_codebook_name(book));
        const cb_tensor *t = cb_file_tensor(f, name);
        if (!t || t->dtype != COLIBRI_DTYPE_I8) {
            cb_set_err(err, len, "tensor '%.*s' has dtype %s, whose codebook (the int8 tensor '%s') the file %s; "
                       RECONVERT, (int)user->name_len, (const char *)user->name, cb_dtype_name(user->dtype), name,
                       t ? "stores with another dtype" : "lacks");
            return COLIBRI_E_FORMAT;
        }
        colibri_status st = cb_codebook_install(book, f->map + t->offset, t->nbytes, why, sizeof why);
        if (st != COLIBRI_OK) {
            cb_set_err(err, len, "tensor '%s': %s; " RECONVERT, name, why);
            return st;
        }
    }
    return COLIBRI_OK;
}

colibri_status cb_file_tensors(cb_file *f, char *err, size_t len) {
    const cb_header *c = &f->h;
    const cb_section *sec = &c->sections[CB_SEC_TDIR];
    cb_reader r = {f->map + sec->offset, sec->size, 0};
    if (!rd_has(&r, 8)) {
        cb_set_err(err, len, "tensor directory is %llu bytes, too small for its count; " RECONVERT,
                   (unsigned long long)sec->size);
        return COLIBRI_E_FORMAT;
    }
    uint64_t n = cb_rd_u64(r.p);
    r.pos = 8;
    const uint64_t min_rec = 4 + 1 + 16 + 32 + 24; /* 77 bytes with a 1-byte name */
    if (n > (sec->size - 8) / min_rec) {
        cb_set_err(err, len, "tensor directory says %llu tensors but holds at most %llu; " RECONVERT,
                   (unsigned long long)n, (unsigned long long)((sec->size - 8) / min_rec));
        return COLIBRI_E_FORMAT;
    }
    f->tensors = calloc(n ? n : 1, sizeof(cb_tensor));
    if (!f->tensors) {
        cb_set_err(err, len, "out of memory reading %llu tensor records", (unsigned long long)n);
        return COLIBRI_E_NOMEM;
    }
    f->n_tensors = n;
    for (uint64_t i = 0; i < n; i++) {
        cb_tensor *t = &f->tensors[i];
        if (!rd_has(&r, 4)) goto truncated;
        uint32_t nl = cb_rd_u32(r.p + r.pos);
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
        t->dtype = cb_rd_u32(p);
        t->layout = cb_rd_u32(p + 4);
        t->n_dims = cb_rd_u32(p + 8);
        t->crc32 = cb_rd_u32(p + 12);
        for (int d = 0; d < 4; d++) t->dims[d] = cb_rd_u64(p + 16 + 8 * d);
        t->offset = cb_rd_u64(p + 48);
        t->nbytes = cb_rd_u64(p + 56);
        t->l2norm = cb_rd_f64(p + 64);
        r.pos += (uint64_t)nl + 72;
        const int NL = (int)nl;
        const char *NM = (const char *)t->name;
        if (!cb_dtype_in_file(t->dtype)) {
            cb_set_err(err, len, "tensor '%.*s' has dtype %u, which this build does not know "
                       "(known: 0 f32, 1 f16, 2 bf16, 3 i8, 7 q8_0, 8 q4_k, 9 q5_k, 10 q6_k, 11 mxfp4, "
                       "12 q4_0, 13 q4_1, 14 q5_0, 15 q5_1, 16 q2_k, 17 q3_k, 18 iq4_nl, 19 iq4_xs, 20 iq2_xxs, "
                       "21 iq2_xs, 22 iq2_s, 23 iq3_xxs, 24 iq3_s, 25 iq1_s, 26 iq1_m); use a newer "
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
        int u = names_unique(f->tensors, sizeof *f->tensors, offsetof(cb_tensor, name),
                             offsetof(cb_tensor, name_len), n, &dup);
        if (u < 0) {
            cb_set_err(err, len, "out of memory checking tensor names");
            return COLIBRI_E_NOMEM;
        }
        if (u == 0) {
            cb_set_err(err, len, "tensor '%.*s' appears more than once in the tensor directory; " RECONVERT,
                       (int)f->tensors[dup].name_len, (const char *)f->tensors[dup].name);
            return COLIBRI_E_FORMAT;
        }
    }
    return install_codebooks(f, err, len);
truncated:
    cb_set_err(err, len, "tensor directory is cut short (a record runs past its %llu bytes); " RECONVERT,
               (unsigned long long)sec->size);
    return COLIBRI_E_FORMAT;
}

const cb_tensor *cb_file_tensor(const cb_file *f, const char *name) {
    size_t nl = strlen(name);
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const cb_tensor *t = &f->tensors[i];
        if (t->name_len == nl && memcmp(t->name, name, nl) == 0) return t;
    }
    return NULL;
}

/* ---- top level ---- */

colibri_status cb_file_open(cb_file *f, const uint8_t *map, uint64_t size, const char *path, char *err, size_t len) {
    const uint8_t *m = map;
    uint64_t fs = size;
    cb_header *c = &f->h;
    f->map = map;
    f->size = size;
    static const uint8_t magic[8] = {'C', 'O', 'L', 'I', 'B', 'R', 'I', 0};

    if (fs >= 4 && memcmp(m, "GGUF", 4) == 0) {
        cb_set_err(err, len, "'%s' is a llama.cpp GGUF, not a .colibri file; import it once (its weights are "
                   "copied, not requantized): colibri-convert --model_name_or_path '%s' --output_path "
                   "MODEL.colibri", path, path);
        return COLIBRI_E_FORMAT;
    }
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
    c->version = cb_rd_u32(m + 8);
    if (c->version < 1 || c->version > COLIBRI_FORMAT_VERSION) {
        cb_set_err(err, len, "'%s' is file format version %u; this build reads versions 1 to %d; "
                   "re-convert with colibri-convert%s", path, c->version, COLIBRI_FORMAT_VERSION,
                   c->version > COLIBRI_FORMAT_VERSION ? " (or use a newer Colibri)" : "");
        return COLIBRI_E_VERSION;
    }
    uint32_t hs = cb_rd_u32(m + 12);
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
    uint32_t hcrc = cb_rd_u32(m + 252), calc = cb_crc32(0, m, 252);
    if (hcrc != calc) {
        cb_set_err(err, len, "'%s' header CRC-32 mismatch (stored 0x%08x, computed 0x%08x): the file is "
                   "damaged; re-download or " RECONVERT, path, hcrc, calc);
        return COLIBRI_E_CHECKSUM;
    }
    c->file_size = cb_rd_u64(m + 16);
    if (c->file_size != fs) {
        if (c->file_size > fs)
            cb_set_err(err, len, "'%s' is truncated: the header expects %llu bytes but the file has %llu; "
                       "re-download or " RECONVERT, path, (unsigned long long)c->file_size, (unsigned long long)fs);
        else
            cb_set_err(err, len, "'%s' is longer than its header says: expected %llu bytes, the file has %llu; "
                       "re-download or " RECONVERT, path, (unsigned long long)c->file_size, (unsigned long long)fs);
        return COLIBRI_E_FORMAT;
    }
    c->n_experts = cb_rd_u32(m + 24);
    c->top_k = cb_rd_u32(m + 28);
    c->hidden = cb_rd_u32(m + 32);
    c->inter = cb_rd_u32(m + 36);
    c->vocab = cb_rd_u32(m + 40);
    c->max_seq_len = cb_rd_u32(m + 44);
    c->n_layers = cb_rd_u32(m + 48);
    c->flags = cb_rd_u32(m + 52);
    c->alignment = cb_rd_u32(m + 200);
    c->block_size = cb_rd_u32(m + 204);
    struct { const char *name; uint64_t v; } nonzero[] = {
        {"n_experts", c->n_experts}, {"hidden_size", c->hidden}, {"intermediate_size", c->inter},
        {"vocab_size", c->vocab}, {"max_seq_len", c->max_seq_len}, {"n_layers", c->n_layers},
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
        sec->offset = cb_rd_u64(s);
        sec->size = cb_rd_u64(s + 8);
        sec->crc32 = cb_rd_u32(s + 16);
        uint64_t end;
        if (cb_rd_u32(s + 20) != 0) {
            cb_set_err(err, len, "%s section entry has a non-zero reserved field; " RECONVERT, cb_section_name(k));
            return COLIBRI_E_FORMAT;
        }
        if (!cb_add_u64(sec->offset, sec->size, &end) || end > fs) {
            cb_set_err(err, len, "%s section (offset %llu, %llu bytes) runs past the end of the file "
                       "(%llu bytes); the file is damaged or truncated: re-download or " RECONVERT, cb_section_name(k),
                       (unsigned long long)sec->offset, (unsigned long long)sec->size, (unsigned long long)fs);
            return COLIBRI_E_FORMAT;
        }
        if (sec->offset < prev_end) {
            cb_set_err(err, len, "%s section starts at %llu, before the end (%llu) of what precedes it: "
                       "sections overlap or are out of order; " RECONVERT, cb_section_name(k),
                       (unsigned long long)sec->offset, (unsigned long long)prev_end);
            return COLIBRI_E_FORMAT;
        }
        uint64_t align = k >= CB_SEC_DENSE ? 4096 : 64;
        if (sec->offset % align != 0) {
            cb_set_err(err, len, "%s section starts at %llu, not a multiple of %llu; " RECONVERT, cb_section_name(k),
                       (unsigned long long)sec->offset, (unsigned long long)align);
            return COLIBRI_E_FORMAT;
        }
        if (sec->size == 0 && k != CB_SEC_TOK) {
            cb_set_err(err, len, "%s section is empty; " RECONVERT, cb_section_name(k));
            return COLIBRI_E_FORMAT;
        }
        prev_end = end;
    }
    for (int k = 0; k <= CB_SEC_TOK; k++) {
        const cb_section *sec = &c->sections[k];
        uint32_t got = cb_crc32(0, m + sec->offset, sec->size);
        if (got != sec->crc32) {
            cb_set_err(err, len, "%s section CRC-32 mismatch (stored 0x%08x, computed 0x%08x): the file is "
                       "damaged; re-download or " RECONVERT, cb_section_name(k), sec->crc32, got);
            return COLIBRI_E_CHECKSUM;
        }
    }
    return COLIBRI_OK;
}

/* ---- verification on request ---- */

colibri_status cb_file_verify(const cb_file *f, char *err, size_t len) {
    const cb_header *c = &f->h;
    for (int k = 0; k < CB_N_SECTIONS; k++) {
        const cb_section *sec = &c->sections[k];
        uint32_t got = cb_crc32(0, f->map + sec->offset, sec->size);
        if (got != sec->crc32) {
            cb_set_err(err, len, "%s section CRC-32 mismatch (stored 0x%08x, computed 0x%08x): "
                       "the file is damaged; re-download or " RECONVERT, cb_section_name(k), sec->crc32, got);
            return COLIBRI_E_CHECKSUM;
        }
    }
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const cb_tensor *t = &f->tensors[i];
        uint32_t got = cb_crc32(0, f->map + t->offset, t->nbytes);
        if (got != t->crc32) {
            cb_set_err(err, len, "tensor '%.*s' CRC-32 mismatch (stored 0x%08x, computed 0x%08x): "
                       "the file is damaged; re-download or " RECONVERT, (int)t->name_len,
                       (const char *)t->name, t->crc32, got);
            return COLIBRI_E_CHECKSUM;
        }
    }
    return COLIBRI_OK;
}

void cb_file_free(cb_file *f) {
    free(f->tensors);
    free(f->meta);
    f->tensors = NULL;
    f->meta = NULL;
    f->n_tensors = f->n_meta = 0;
}
