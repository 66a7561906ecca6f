/*
 * format.h — the .colibri file reader (docs/format.md; versions 1 and 2): the file's sections,
 * its metadata records and tensor directory as the engine sees them once validated, and
 * the calls that validate a mapped file and bind the model's weights to it.
 *
 * Nothing in a file is trusted: format.c bounds-checks every read with overflow-safe
 * arithmetic (core/checked.h) before it happens. The records below point into the mapping;
 * they are valid while the context keeps the file mapped.
 */
#ifndef COLIBRI_FORMAT_H
#define COLIBRI_FORMAT_H

#include <stddef.h>
#include <stdint.h>

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

/* Validate the mapped file and fill ctx's config, metadata, tensor directory and weights
 * (model/model.h). Caller guarantees ctx->map/map_size are set. Messages go to err. */
colibri_status cb_format_load(colibri_ctx *ctx, const char *path, char *err, size_t err_len);
/* Find a tensor by name (NULL if absent). */
const cb_tensor *cb_find_tensor(const colibri_ctx *ctx, const char *name);
/* Check every section CRC and every tensor CRC (message in ctx). */
colibri_status cb_verify_all(colibri_ctx *ctx);
/* Recompute the router tensors' L2 norms and compare them with the stored ones. */
colibri_status cb_verify_router(colibri_ctx *ctx);

/* crc32.c: CRC-32 as zlib.crc32; cb_crc32(0, p, n) == zlib.crc32(p[:n]). */
uint32_t cb_crc32(uint32_t crc, const void *data, uint64_t n);

#endif
