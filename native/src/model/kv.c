/*
 * kv.c — the block pool of the paged KV cache (kv.h): a free stack, reference counts,
 * copy-on-write of a shared last block, truncation and fork; and the prefix cache over it:
 * the table of registered full blocks, their least-recently-used list, reuse and eviction.
 */
#include <string.h>

#include "model/kv.h"

static int64_t blocks_for(const cb_kv *kv, int64_t len) { return (len + kv->block_len - 1) / kv->block_len; }

static int32_t *seq_table(const cb_kv *kv, int32_t seq) { return kv->table + (int64_t)seq * kv->max_blocks; }

/* ---- the prefix table: open addressing, linear probing, backward-shift deletion -------- */

uint64_t cb_kv_chain_hash(uint64_t parent, const int32_t *tokens, int64_t n) {
    uint64_t h = parent ^ 0x9e3779b97f4a7c15ull;
    for (int64_t i = 0; i < n; i++) {
        h = (h ^ (uint64_t)(uint32_t)tokens[i]) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
    }
    h ^= h >> 33; /* murmur3's finalizer */
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
    return h;
}

static int64_t home_slot(const cb_kv *kv, uint64_t h) { return (int64_t)(h & (uint64_t)(kv->n_slots - 1)); }

static void slot_insert(cb_kv *kv, int32_t b) {
    int64_t j = home_slot(kv, kv->hash[b]), mask = kv->n_slots - 1;
    while (kv->slots[j] >= 0) j = (j + 1) & mask;
    kv->slots[j] = b;
}

static void slot_remove(cb_kv *kv, int32_t b) {
    int64_t mask = kv->n_slots - 1, i = home_slot(kv, kv->hash[b]);
    while (kv->slots[i] != b) i = (i + 1) & mask; /* b is in the table */
    for (int64_t j = i;;) {
        j = (j + 1) & mask;
        if (kv->slots[j] < 0) break;
        int64_t k = home_slot(kv, kv->hash[kv->slots[j]]);
        /* the entry at j may move back to i only if its home is not cyclically in (i, j] */
        if (i <= j ? (i < k && k <= j) : (i < k || k <= j)) continue;
        kv->slots[i] = kv->slots[j];
        i = j;
    }
    kv->slots[i] = -1;
}

/* The registered block of hash h after block p (-1: first) holding tokens, or -1. */
static int32_t find_block(const cb_kv *kv, uint64_t h, int32_t p, const int32_t *tokens) {
    int64_t mask = kv->n_slots - 1;
    for (int64_t j = home_slot(kv, h); kv->slots[j] >= 0; j = (j + 1) & mask) {
        int32_t x = kv->slots[j];
        if (kv->hash[x] != h || kv->parent[x] != p) continue;
        if (p >= 0 && kv->parent_gen[x] != kv->gen[p]) continue;
        if (memcmp(kv->tok + (int64_t)x * kv->block_len, tokens, (size_t)kv->block_len * sizeof(int32_t)) == 0)
            return x;
    }
    return -1;
}

/* ---- the least-recently-used list of cached blocks no sequence holds ------------------- */

static void lru_push(cb_kv *kv, int32_t b) {
    kv->lru_prev[b] = kv->lru_tail;
    kv->lru_next[b] = -1;
    if (kv->lru_tail >= 0) kv->lru_next[kv->lru_tail] = b;
    else kv->lru_head = b;
    kv->lru_tail = b;
    kv->n_cached++;
}

static void lru_remove(cb_kv *kv, int32_t b) {
    int32_t p = kv->lru_prev[b], n = kv->lru_next[b];
    if (p >= 0) kv->lru_next[p] = n;
    else kv->lru_head = n;
    if (n >= 0) kv->lru_prev[n] = p;
    else kv->lru_tail = p;
    kv->n_cached--;
}

/* Forget a registered block: out of the table, and its generation moves on so that no
 * registered child can name it as a parent any more. */
static void unregister(cb_kv *kv, int32_t b) {
    slot_remove(kv, b);
    kv->reg[b] = 0;
    kv->gen[b]++;
}

/* ---- blocks ---------------------------------------------------------------------------- */

/* A block for a sequence: a free one, else the least recently used cached one. */
static int32_t take_block(cb_kv *kv) {
    int32_t b;
    if (kv->n_free > 0) {
        b = kv->free_ids[--kv->n_free];
    } else { /* the caller checked cb_kv_available */
        b = kv->lru_head;
        lru_remove(kv, b);
        unregister(kv, b);
    }
    kv->ref[b] = 1;
    return b;
}

/* A sequence takes a block it found registered. */
static void hold_block(cb_kv *kv, int32_t b) {
    if (kv->ref[b]++ == 0) lru_remove(kv, b);
}

static void drop_block(cb_kv *kv, int32_t b) {
    if (--kv->ref[b] != 0) return;
    if (kv->prefix && kv->reg[b]) lru_push(kv, b); /* stays cached until evicted */
    else kv->free_ids[kv->n_free++] = b;
}

void cb_kv_reset(cb_kv *kv) {
    for (int64_t i = 0; i < kv->max_seqs * kv->max_blocks; i++) kv->table[i] = -1;
    for (int64_t s = 0; s < kv->max_seqs; s++) kv->len[s] = 0;
    /* the stack pops block 0 first, so a lone sequence's blocks are in address order */
    for (int64_t b = 0; b < kv->n_blocks; b++) {
        kv->ref[b] = 0;
        kv->free_ids[b] = (int32_t)(kv->n_blocks - 1 - b);
    }
    kv->n_free = kv->n_blocks;
    kv->lru_head = kv->lru_tail = -1;
    kv->n_cached = 0;
    if (!kv->prefix) return;
    for (int64_t b = 0; b < kv->n_blocks; b++) {
        kv->reg[b] = 0;
        kv->gen[b] = 0;
    }
    for (int64_t j = 0; j < kv->n_slots; j++) kv->slots[j] = -1;
    for (int64_t s = 0; s < kv->max_seqs; s++) kv->valid[s] = kv->n_reg[s] = 0;
}

/* Whether writing into block b (partly kept by a sequence) must first copy it. */
static int must_copy(const cb_kv *kv, int32_t b) { return kv->ref[b] > 1 || (kv->prefix && kv->reg[b]); }

int64_t cb_kv_blocks_needed(const cb_kv *kv, int32_t seq, int64_t keep, int64_t new_len) {
    if (new_len <= keep) return 0;
    int64_t need = blocks_for(kv, new_len) - blocks_for(kv, keep);
    if (keep % kv->block_len != 0 && must_copy(kv, seq_table(kv, seq)[keep / kv->block_len])) need++;
    return need;
}

void cb_kv_grow(cb_kv *kv, int32_t seq, int64_t new_len) {
    int32_t *t = seq_table(kv, seq);
    int64_t len = kv->len[seq];
    if (new_len <= len) return;
    if (len % kv->block_len != 0) { /* copy-on-write of a shared or registered, partly kept last block */
        int64_t i = len / kv->block_len;
        int32_t old = t[i];
        if (must_copy(kv, old)) {
            int32_t b = take_block(kv);
            if (kv->copy_block) kv->copy_block(kv->copy_u, b, old); /* the device's pool */
            else memcpy(kv->k + (int64_t)b * kv->block_stride, kv->k + (int64_t)old * kv->block_stride,
                   (size_t)kv->block_stride * sizeof(float));
            if (kv->v && !kv->copy_block) /* NULL for a latent cache (backend/cpu/mla.c): keys only */
                memcpy(kv->v + (int64_t)b * kv->block_stride, kv->v + (int64_t)old * kv->block_stride,
                       (size_t)kv->block_stride * sizeof(float));
            if (kv->prefix)
                memcpy(kv->tok + (int64_t)b * kv->block_len, kv->tok + (int64_t)old * kv->block_len,
                       (size_t)kv->block_len * sizeof(int32_t));
            drop_block(kv, old);
            t[i] = b;
        }
    }
    for (int64_t i = blocks_for(kv, len); i < blocks_for(kv, new_len); i++) t[i] = take_block(kv);
    kv->len[seq] = new_len;
}

int64_t cb_kv_blocks_freed(const cb_kv *kv, int32_t seq, int64_t len) {
    const int32_t *t = seq_table(kv, seq);
    int64_t n = 0;
    for (int64_t i = blocks_for(kv, len); i < blocks_for(kv, kv->len[seq]); i++) n += kv->ref[t[i]] == 1;
    return n;
}

void cb_kv_truncate(cb_kv *kv, int32_t seq, int64_t len) {
    int32_t *t = seq_table(kv, seq);
    if (len >= kv->len[seq]) return;
    /* the last block first: a prefix's later blocks are evicted before its earlier ones */
    for (int64_t i = blocks_for(kv, kv->len[seq]) - 1; i >= blocks_for(kv, len); i--) {
        drop_block(kv, t[i]);
        t[i] = -1;
    }
    kv->len[seq] = len;
    if (kv->prefix) {
        if (kv->valid[seq] > len) kv->valid[seq] = len;
        if (kv->n_reg[seq] > len / kv->block_len) kv->n_reg[seq] = len / kv->block_len;
    }
}

void cb_kv_fork(cb_kv *kv, int32_t src, int32_t dst) {
    cb_kv_truncate(kv, dst, 0);
    const int32_t *s = seq_table(kv, src);
    int32_t *d = seq_table(kv, dst);
    for (int64_t i = 0; i < blocks_for(kv, kv->len[src]); i++) {
        d[i] = s[i];
        kv->ref[s[i]]++;
    }
    kv->len[dst] = kv->len[src];
    if (kv->prefix) {
        kv->valid[dst] = kv->valid[src];
        kv->n_reg[dst] = kv->n_reg[src];
    }
}

/* ---- the prefix cache ------------------------------------------------------------------ */

/* Register block i of seq (full, written; blocks 0..i-1 registered). When an equal block is
 * registered already (the same prefix computed twice), the sequence takes that one instead
 * and its own goes back: the two hold the same bits, so one copy is kept. */
static void register_block(cb_kv *kv, int32_t seq, int64_t i) {
    int32_t *t = seq_table(kv, seq);
    int32_t b = t[i], p = i > 0 ? t[i - 1] : -1;
    if (kv->reg[b]) return;
    const int32_t *tokens = kv->tok + (int64_t)b * kv->block_len;
    uint64_t h = cb_kv_chain_hash(p >= 0 ? kv->hash[p] : 0, tokens, kv->block_len);
    int32_t x = find_block(kv, h, p, tokens);
    if (x >= 0) {
        hold_block(kv, x);
        t[i] = x;
        drop_block(kv, b);
        return;
    }
    kv->hash[b] = h;
    kv->parent[b] = p;
    kv->parent_gen[b] = p >= 0 ? kv->gen[p] : 0;
    kv->reg[b] = 1;
    slot_insert(kv, b);
}

void cb_kv_written(cb_kv *kv, int32_t seq, int64_t pos) {
    if (!kv->prefix || pos != kv->valid[seq]) return;
    int64_t v = ++kv->valid[seq];
    if (v % kv->block_len != 0) return;
    int64_t i = v / kv->block_len - 1;
    if (kv->n_reg[seq] != i) return; /* an earlier block is not registered: no chain to hang it on */
    register_block(kv, seq, i);
    kv->n_reg[seq]++;
}

int64_t cb_kv_reuse_prefix(cb_kv *kv, int32_t seq, const int32_t *ids, int64_t n) {
    if (!kv->prefix || n <= 0) return 0;
    kv->query_tokens += n;
    int64_t len = kv->len[seq], B = kv->block_len;
    if (len % B != 0 || kv->valid[seq] != len || kv->n_reg[seq] != len / B) return 0;
    int32_t *t = seq_table(kv, seq);
    int64_t i = len / B, taken = 0;
    int32_t p = i > 0 ? t[i - 1] : -1;
    while (taken + B <= n - 1 && i < kv->max_blocks) {
        const int32_t *tokens = ids + taken;
        int32_t x = find_block(kv, cb_kv_chain_hash(p >= 0 ? kv->hash[p] : 0, tokens, B), p, tokens);
        if (x < 0) break;
        hold_block(kv, x);
        t[i++] = x;
        p = x;
        taken += B;
    }
    kv->len[seq] += taken;
    kv->valid[seq] += taken;
    kv->n_reg[seq] += taken / B;
    kv->hit_tokens += taken;
    return taken;
}
