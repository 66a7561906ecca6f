/*
 * container.h — the .colibri container reader (docs/format.md; versions 1 and 2): the file's
 * header, sections, metadata records and tensor directory as the engine sees them once
 * validated, and their checksums. It knows no model: model/config.c reads the model's facts
 * from the metadata and model/weights.c binds its weights to the tensors.
 *
 * Nothing in a file is trusted: container.c bounds-checks every read with overflow-safe
 * arithmetic (core/checked.h) before it happens. The records below point into the mapping;
 * they are valid while the file stays mapped.
 */
#ifndef COLIBRI_FORMAT_CONTAINER_H
#define COLIBRI_FORMAT_CONTAINER_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "colibri.h"

#define CB_HEADER_SIZE 256u
#define CB_N_SECTIONS 6

enum { CB_SEC_META = 0, CB_SEC_TDIR = 1, CB_SEC_TOK = 2, CB_SEC_DENSE = 3, CB_SEC_ROUTER = 4,
       CB_SEC_EXPERTS = 5 };

/* Metadata value types (docs/format.md, "Metadata section"). */
enum { CB_MT_U32 = 0, CB_MT_I32 = 1, CB_MT_F32 = 2, CB_MT_BOOL = 3, CB_MT_STRING = 4,
       CB_MT_U64 = 5, CB_MT_I64 = 6, CB_MT_F64 = 7, CB_MT_ARRAY = 8 };

/* Tensor layouts (docs/format.md, "Tensor layouts"). Tensor dtypes are colibri_dtype values
 * for which cb_dtype_in_file holds (core/dtype.h). */
enum { CB_LAYOUT_ROW_MAJOR = 0, CB_LAYOUT_EXPERTS_PACKED = 1 };

typedef struct cb_section {
    uint64_t offset;
    uint64_t size;
    uint32_t crc32;
} cb_section;

/* One metadata entry, pointing into the mapped metadata section. */
typedef struct cb_meta_entry {
    const uint8_t *key;   /* (key_len) bytes, not NUL-terminated */
    uint32_t key_len;
    uint32_t type;        /* CB_MT_* */
    const uint8_t *value; /* (value_len) bytes: the encoded value (for STRING: the bytes after the u64 length) */
    uint64_t value_len;
    uint32_t elem_type;   /* ARRAY only */
    uint64_t count;       /* ARRAY: element count; STRING: byte length */
} cb_meta_entry;

/* One tensor directory record, decoded. */
typedef struct cb_tensor {
    const uint8_t *name; /* (name_len) ASCII bytes inside the mapped directory */
    uint32_t name_len;
    uint32_t dtype;      /* colibri_dtype, one a file may hold */
    uint32_t layout;     /* CB_LAYOUT_* */
    uint32_t n_dims;
    uint32_t crc32;
    uint64_t dims[4];
    uint64_t offset;     /* absolute, aligned */
    uint64_t nbytes;
    double l2norm;
} cb_tensor;

/* The header's fields (docs/format.md, "Header"), validated by cb_file_open. */
typedef struct cb_header {
    uint32_t version;
    uint64_t file_size;
    uint32_t n_experts, top_k, hidden, inter, vocab, n_layers, flags, alignment, block_size;
    uint64_t max_seq_len;
    cb_section sections[CB_N_SECTIONS];
} cb_header;

/* A mapped .colibri file as read so far: the header after cb_file_open, the metadata after
 * cb_file_metadata, the tensor directory after cb_file_tensors. The two arrays are heap
 * (init-time; cb_file_free); every pointer in them points into map. */
typedef struct cb_file {
    const uint8_t *map; /* [size] */
    uint64_t size;
    cb_header h;
    cb_meta_entry *meta; /* [n_meta] */
    uint64_t n_meta;
    cb_tensor *tensors;  /* [n_tensors] */
    uint64_t n_tensors;
} cb_file;

/* The advice every message about a malformed file ends with. */
#define CB_RECONVERT "re-convert the model with colibri-convert"

/* Validate the header, the sections and the CRCs of the metadata, tensor directory and
 * tokenizer sections of map[size] (path names the file in messages); then read the
 * metadata records, then the tensor directory records. Messages go to err. */
colibri_status cb_file_open(cb_file *f, const uint8_t *map, uint64_t size, const char *path, char *err,
                            size_t len);
colibri_status cb_file_metadata(cb_file *f, char *err, size_t len);
colibri_status cb_file_tensors(cb_file *f, char *err, size_t len);
void cb_file_free(cb_file *f);
/* Check every section CRC and every tensor CRC. */
colibri_status cb_file_verify(const cb_file *f, char *err, size_t len);

/* A tensor by name (NULL if absent). */
const cb_tensor *cb_file_tensor(const cb_file *f, const char *name);
/* A metadata entry by key (NULL if absent); a required key of an exact type (an error
 * when absent or of another type); an optional one (OK with *out = NULL when absent, an
 * error when of another type; elem_type for arrays). */
const cb_meta_entry *cb_meta_find(const cb_file *f, const char *key);
colibri_status cb_meta_req(const cb_file *f, const char *key, uint32_t type, const cb_meta_entry **out,
                           char *err, size_t len);
colibri_status cb_meta_opt(const cb_file *f, const char *key, uint32_t type, uint32_t elem_type,
                           const cb_meta_entry **out, char *err, size_t len);
/* "U32", ... for a CB_MT_* type; "metadata", ... for a CB_SEC_* section. */
const char *cb_meta_type_name(uint32_t t);
const char *cb_section_name(int k);
/* A printable, NUL-terminated copy of n file bytes in dst[cap], for messages: bytes outside
 * printable ASCII become '?', so a damaged file cannot put invalid UTF-8 into a message. */
const char *cb_printable(char *dst, size_t cap, const uint8_t *s, uint64_t n);

/* Little-endian reads of file bytes (the caller has bounds-checked them). */
static inline uint32_t cb_rd_u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint64_t cb_rd_u64(const uint8_t *p) { return (uint64_t)cb_rd_u32(p) | ((uint64_t)cb_rd_u32(p + 4) << 32); }
static inline double cb_rd_f64(const uint8_t *p) {
    uint64_t u = cb_rd_u64(p);
    double d;
    memcpy(&d, &u, 8);
    return d;
}

/* crc32.c: CRC-32 as zlib.crc32; cb_crc32(0, p, n) == zlib.crc32(p[:n]). */
uint32_t cb_crc32(uint32_t crc, const void *data, uint64_t n);

#endif
