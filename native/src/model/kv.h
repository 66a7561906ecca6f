/*
 * kv.h — the paged KV cache: one pool of fixed-size blocks, carved from the arena at init,
 * shared by every sequence of a context. A block holds block_len positions of every layer
 * and KV head, keys and values apart ([n_blocks, L, Hkv, block_len, D] each); a sequence
 * holds a block table (its positions p live in block table[p / block_len]) and takes a
 * block from the free stack when it grows into a new one, so memory goes to positions that
 * exist. Blocks are reference-counted: a forked sequence shares its source's blocks and a
 * write into a shared block first gives the writer a private copy (copy-on-write).
 *
 * The prefix cache (kv->prefix): a block whose positions are all written is registered under
 * a chain hash of its tokens and of the hash of the block before it (as vLLM's block hashes),
 * in an open-addressing table. A sequence that starts (or continues) with the same tokens
 * takes the registered blocks by reference instead of computing them (cb_kv_reuse_prefix).
 * A registered block no sequence holds stays cached on a least-recently-used list and is
 * evicted only when a sequence needs a block and none is free. A match is exact, not
 * probabilistic: besides the hash, the block's tokens are compared and its parent must be the
 * very block matched before it (a block id and a generation that eviction bumps), so a hash
 * collision can never hand out another prefix's keys. Reuse is bitwise safe because a
 * position's keys and values depend only on the tokens up to it (batching, chunking and
 * thread count do not change them).
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
                              * D = kv_lora_rank + qk_rope_head_dim, backend/cpu/mla.c) */
    int32_t *table;          /* [max_seqs, max_blocks] block ids of each sequence (-1 past its end) */
    int64_t *len;            /* [max_seqs] positions each sequence holds */
    int32_t *ref;            /* [n_blocks] sequences using each block; 0 = free or cached */
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
    /* ---- the prefix cache (all NULL / 0 when off; the arrays are arena buffers) */
    int prefix;              /* 1: full blocks are registered and can be reused */
    int32_t *tok;            /* [n_blocks, block_len] the token id at each position of a block */
    uint64_t *hash;          /* [n_blocks] chain hash of a registered block (its tokens and its parent's hash) */
    int32_t *parent;         /* [n_blocks] the registered block before it (-1: the first block), */
    uint32_t *parent_gen;    /* [n_blocks]   and that block's generation when this one was registered */
    uint32_t *gen;           /* [n_blocks] bumped when a block stops being registered (evicted) */
    uint8_t *reg;            /* [n_blocks] 1: registered (in the table) */
    int32_t *lru_prev, *lru_next; /* [n_blocks] registered blocks no sequence holds, oldest first */
    int32_t lru_head, lru_tail;
    int64_t n_cached;        /* blocks on that list: evictable, so as good as free */
    int32_t *slots;          /* [n_slots] open-addressing table of registered block ids (-1 empty) */
    int64_t n_slots;         /* a power of two >= 2 n_blocks */
    int64_t *valid;          /* [max_seqs] leading positions whose keys/values are written */
    int64_t *n_reg;          /* [max_seqs] leading full blocks already registered (or found registered) */
    int64_t hit_tokens, query_tokens; /* positions reused / asked for by cb_kv_reuse_prefix */
} cb_kv;

/* Empty every sequence; every block free (the prefix cache too; its counters stay). */
void cb_kv_reset(cb_kv *kv);
/* Blocks a sequence could take now: free ones and cached ones no sequence holds (evicted,
 * least recently used first, when taken). */
static inline int64_t cb_kv_available(const cb_kv *kv) { return kv->n_free + kv->n_cached; }
/* Blocks sequence `seq` would take to keep its first `keep` positions (<= its length) and
 * grow to new_len: the new blocks, plus one when the block holding position `keep` is partly
 * kept and shared or registered in the prefix cache (the copy). */
int64_t cb_kv_blocks_needed(const cb_kv *kv, int32_t seq, int64_t keep, int64_t new_len);
/* Grow `seq` to new_len positions (the caller checked cb_kv_blocks_needed <= available):
 * a shared or registered partly filled last block is copied first, then new blocks are taken.
 * The new positions' contents are for the caller to write. */
void cb_kv_grow(cb_kv *kv, int32_t seq, int64_t new_len);
/* Blocks that truncating `seq` to len would make available again. */
int64_t cb_kv_blocks_freed(const cb_kv *kv, int32_t seq, int64_t len);
/* Keep positions [0, len) of `seq` (len <= its length); whole blocks past them are given
 * back (registered ones stay cached until evicted). */
void cb_kv_truncate(cb_kv *kv, int32_t seq, int64_t len);
/* dst = a copy of src sharing its blocks (dst is cleared first; dst != src). */
void cb_kv_fork(cb_kv *kv, int32_t src, int32_t dst);
/* The prefix cache. Positions are recorded in two steps: cb_kv_set_token when a batch is set
 * up (the token at position pos of seq, after cb_kv_grow), cb_kv_written once its keys and
 * values are computed (rows of a sequence in position order); a block is registered when its
 * last position is written, so an abandoned or failed run never registers a block it did not
 * fill. No-ops when the prefix cache is off. */
static inline void cb_kv_set_token(cb_kv *kv, int32_t seq, int64_t pos, int32_t token) {
    if (!kv->prefix) return;
    int64_t b = kv->table[(int64_t)seq * kv->max_blocks + pos / kv->block_len];
    kv->tok[b * kv->block_len + pos % kv->block_len] = token;
}
void cb_kv_written(cb_kv *kv, int32_t seq, int64_t pos);
/* Continue `seq` with the registered blocks that hold ids[0..n) after its end: whole blocks,
 * at most n - 1 positions (the last id is always left to compute). Only a sequence whose
 * length is a whole number of registered blocks can be continued. Returns the positions taken
 * (0 when the prefix cache is off). */
int64_t cb_kv_reuse_prefix(cb_kv *kv, int32_t seq, const int32_t *ids, int64_t n);
/* The chain hash of a block of tokens after a block of hash `parent` (0: the first block). */
uint64_t cb_kv_chain_hash(uint64_t parent, const int32_t *tokens, int64_t n);
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
