/*
 * kv.h — the paged KV cache: one pool of fixed-size blocks, carved from the arena at init,
 * shared by every sequence of a context. A block holds block_len positions of every layer
 * and KV head, keys and values apart ([n_blocks, L, Hkv, block_len, D] each); a sequence
 * holds a block table (its positions p live in block table[p / block_len]) and takes a
 * block from the free stack when it grows into a new one, so memory goes to positions that
 * exist. Blocks are reference-counted: a forked sequence shares its source's blocks and a
 * write into a shared block first gives the writer a private copy (copy-on-write).
 *
 * Nothing here allocates: the pool, the tables, the counts and the free stack are arena
 * buffers (model/scratch.c). Callers check room with cb_kv_blocks_needed before cb_kv_grow,
 * so a refused request changes nothing.
 */
#ifndef COLIBRI_MODEL_KV_H
#define COLIBRI_MODEL_KV_H

#include <stdint.h>

#include "cpu/kernels.h"

typedef struct cb_kv {
    float *k;                /* [n_blocks, L, Hkv, block_len, D] keys */
    float *v;                /* the same layout, values; NULL for a latent cache (MLA: Hkv = 1,
                              * D = kv_lora_rank + qk_rope_head_dim, model/mla.c) */
    int32_t *table;          /* [max_seqs, max_blocks] block ids of each sequence (-1 past its end) */
    int64_t *len;            /* [max_seqs] positions each sequence holds */
    int32_t *ref;            /* [n_blocks] sequences using each block; 0 = free */
    int32_t *free_ids;       /* [n_blocks] stack of free block ids, n_free on it */
    int64_t n_free;
    int64_t n_blocks, block_len, max_blocks, max_seqs;
    int64_t block_stride;    /* floats per block: L * Hkv * block_len * D */
    int64_t layer_stride;    /* floats per layer inside a block: Hkv * block_len * D */
    int64_t head_stride;     /* floats per KV head inside a layer: block_len * D */
    int64_t head_dim;
    /* a device backend's copy of block src into dst (its own pool; backend/backend.h
     * kv_copy_block), or NULL: the host pool above is copied */
    void (*copy_block)(void *u, int64_t dst, int64_t src);
    void *copy_u;
} cb_kv;

/* Empty every sequence; every block free. */
void cb_kv_reset(cb_kv *kv);
/* Blocks sequence `seq` would take to keep its first `keep` positions (<= its length) and
 * grow to new_len: the new blocks, plus one when the block holding position `keep` is shared
 * and partly filled (the copy). */
int64_t cb_kv_blocks_needed(const cb_kv *kv, int32_t seq, int64_t keep, int64_t new_len);
/* Grow `seq` to new_len positions (the caller checked cb_kv_blocks_needed <= n_free):
 * a shared partly filled last block is copied first, then new blocks are taken. The new
 * positions' contents are for the caller to write. */
void cb_kv_grow(cb_kv *kv, int32_t seq, int64_t new_len);
/* Blocks that truncating `seq` to len would give back to the free stack. */
int64_t cb_kv_blocks_freed(const cb_kv *kv, int32_t seq, int64_t len);
/* Keep positions [0, len) of `seq` (len <= its length); whole blocks past them go back. */
void cb_kv_truncate(cb_kv *kv, int32_t seq, int64_t len);
/* dst = a copy of src sharing its blocks (dst is cleared first; dst != src). */
void cb_kv_fork(cb_kv *kv, int32_t src, int32_t dst);
/* Where position pos of `seq`, layer l, KV head g is (keys; values at the same offset in v). */
static inline int64_t cb_kv_offset(const cb_kv *kv, int32_t seq, uint32_t l, int64_t g, int64_t pos) {
    int64_t b = kv->table[(int64_t)seq * kv->max_blocks + pos / kv->block_len];
    return b * kv->block_stride + (int64_t)l * kv->layer_stride + g * kv->head_stride +
           (pos % kv->block_len) * kv->head_dim;
}
/* The attention kernels' view of `seq` at layer l (cpu/kernels.h). */
static inline cb_kv_view cb_kv_layer_view(const cb_kv *kv, int32_t seq, uint32_t l) {
    cb_kv_view v = {kv->k + (int64_t)l * kv->layer_stride, kv->v + (int64_t)l * kv->layer_stride,
                    kv->table + (int64_t)seq * kv->max_blocks, kv->block_len, kv->block_stride,
                    kv->head_stride};
    return v;
}

#endif
