/*
 * kv.c — the block pool of the paged KV cache (kv.h): a free stack, reference counts,
 * copy-on-write of a shared last block, truncation and fork.
 */
#include <string.h>

#include "model/kv.h"

static int64_t blocks_for(const cb_kv *kv, int64_t len) { return (len + kv->block_len - 1) / kv->block_len; }

static int32_t *seq_table(const cb_kv *kv, int32_t seq) { return kv->table + (int64_t)seq * kv->max_blocks; }

static int32_t take_block(cb_kv *kv) {
    int32_t b = kv->free_ids[--kv->n_free];
    kv->ref[b] = 1;
    return b;
}

static void drop_block(cb_kv *kv, int32_t b) {
    if (--kv->ref[b] == 0) kv->free_ids[kv->n_free++] = b;
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
}

int64_t cb_kv_blocks_needed(const cb_kv *kv, int32_t seq, int64_t keep, int64_t new_len) {
    if (new_len <= keep) return 0;
    int64_t need = blocks_for(kv, new_len) - blocks_for(kv, keep);
    if (keep % kv->block_len != 0 && kv->ref[seq_table(kv, seq)[keep / kv->block_len]] > 1) need++;
    return need;
}

void cb_kv_grow(cb_kv *kv, int32_t seq, int64_t new_len) {
    int32_t *t = seq_table(kv, seq);
    int64_t len = kv->len[seq];
    if (new_len <= len) return;
    if (len % kv->block_len != 0) { /* copy-on-write of a shared, partly filled last block */
        int64_t i = len / kv->block_len;
        int32_t old = t[i];
        if (kv->ref[old] > 1) {
            int32_t b = take_block(kv);
            if (kv->copy_block) kv->copy_block(kv->copy_u, b, old); /* the device's pool */
            else memcpy(kv->k + (int64_t)b * kv->block_stride, kv->k + (int64_t)old * kv->block_stride,
                   (size_t)kv->block_stride * sizeof(float));
            if (kv->v && !kv->copy_block) /* NULL for a latent cache (model/mla.c): keys only */
                memcpy(kv->v + (int64_t)b * kv->block_stride, kv->v + (int64_t)old * kv->block_stride,
                       (size_t)kv->block_stride * sizeof(float));
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
    for (int64_t i = blocks_for(kv, len); i < blocks_for(kv, kv->len[seq]); i++) {
        drop_block(kv, t[i]);
        t[i] = -1;
    }
    kv->len[seq] = len;
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
}
