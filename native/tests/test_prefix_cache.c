/*
 * test_prefix_cache.c — the prefix cache of the paged KV cache (model/kv.h) on a small pool
 * built here: the chain hash, registration of full written blocks only, reuse by reference
 * (whole blocks, never the last token, only along the same chain), blocks staying cached
 * after their sequences let go and evicted least recently used (a prefix's tail first) when
 * a sequence needs room, copy-on-write when a cached block is written into, one copy kept of
 * a prefix computed twice, and the counters. Exit 0 when every check passes.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/kv.h" /* internal header */

static int failures = 0;
#define CHECK(cond, ...)                                                     \
    do {                                                                     \
        if (!(cond)) {                                                       \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);             \
            fprintf(stderr, __VA_ARGS__);                                    \
            fprintf(stderr, "\n");                                           \
            failures++;                                                      \
        }                                                                    \
    } while (0)

enum { NB = 6, BL = 4, NS = 4, MB = 6, D = 2 };

/* A pool of NB blocks of BL positions, one layer, one head of D floats, NS sequences. */
static cb_kv make_pool(void) {
    cb_kv kv;
    memset(&kv, 0, sizeof kv);
    kv.n_blocks = NB;
    kv.block_len = BL;
    kv.max_blocks = MB;
    kv.max_seqs = NS;
    kv.head_dim = D;
    kv.head_stride = BL * D;
    kv.layer_stride = kv.head_stride;
    kv.block_stride = kv.layer_stride;
    kv.k = calloc(NB * BL * D, sizeof(float));
    kv.v = calloc(NB * BL * D, sizeof(float));
    kv.table = malloc(NS * MB * sizeof(int32_t));
    kv.len = malloc(NS * sizeof(int64_t));
    kv.ref = malloc(NB * sizeof(int32_t));
    kv.free_ids = malloc(NB * sizeof(int32_t));
    kv.prefix = 1;
    kv.tok = malloc(NB * BL * sizeof(int32_t));
    kv.hash = malloc(NB * sizeof(uint64_t));
    kv.parent = malloc(NB * sizeof(int32_t));
    kv.parent_gen = malloc(NB * sizeof(uint32_t));
    kv.gen = malloc(NB * sizeof(uint32_t));
    kv.reg = malloc(NB);
    kv.lru_prev = malloc(NB * sizeof(int32_t));
    kv.lru_next = malloc(NB * sizeof(int32_t));
    kv.n_slots = 16;
    kv.slots = malloc(16 * sizeof(int32_t));
    kv.valid = malloc(NS * sizeof(int64_t));
    kv.n_reg = malloc(NS * sizeof(int64_t));
    cb_kv_reset(&kv);
    return kv;
}

static void free_pool(cb_kv *kv) {
    free(kv->k), free(kv->v), free(kv->table), free(kv->len), free(kv->ref), free(kv->free_ids);
    free(kv->tok), free(kv->hash), free(kv->parent), free(kv->parent_gen), free(kv->gen), free(kv->reg);
    free(kv->lru_prev), free(kv->lru_next), free(kv->slots), free(kv->valid), free(kv->n_reg);
}

/* What "the model" writes at a position: a function of the tokens up to it. */
static float key_of(const int32_t *ids, int64_t pos) {
    float h = 0.0f;
    for (int64_t i = 0; i <= pos; i++) h = h * 0.5f + (float)ids[i];
    return h;
}

/* Append ids[len..n) to seq as a batch would: room, grow, tokens, compute, written. */
static int run(cb_kv *kv, int32_t seq, const int32_t *ids, int64_t n) {
    int64_t len = kv->len[seq];
    if (cb_kv_blocks_needed(kv, seq, len, n) > cb_kv_available(kv)) return 0;
    cb_kv_grow(kv, seq, n);
    for (int64_t p = len; p < n; p++) cb_kv_set_token(kv, seq, p, ids[p]);
    for (int64_t p = len; p < n; p++) {
        int64_t off = cb_kv_offset(kv, seq, 0, 0, p);
        kv->k[off] = key_of(ids, p);
        kv->v[off] = -key_of(ids, p);
    }
    for (int64_t p = len; p < n; p++) cb_kv_written(kv, seq, p);
    return 1;
}

/* Every position of seq holds what the model computes for ids. */
static int holds(const cb_kv *kv, int32_t seq, const int32_t *ids) {
    for (int64_t p = 0; p < kv->len[seq]; p++) {
        int64_t off = cb_kv_offset(kv, seq, 0, 0, p);
        if (kv->k[off] != key_of(ids, p) || kv->v[off] != -key_of(ids, p)) return 0;
    }
    return 1;
}

static int32_t blk(const cb_kv *kv, int32_t seq, int64_t i) { return kv->table[seq * kv->max_blocks + i]; }

static int64_t used(const cb_kv *kv) { return kv->n_blocks - kv->n_free - kv->n_cached; }

int main(void) {
    const int32_t a[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20};
    int32_t b[20], c[20];
    memcpy(b, a, sizeof a);
    b[5] = 99; /* a's first block, another second block */
    memcpy(c, a, sizeof a);
    c[0] = 98; /* another first block, a's second block's tokens */

    /* the chain hash: a function of the parent and every token */
    {
        uint64_t h = cb_kv_chain_hash(0, a, BL);
        CHECK(h == cb_kv_chain_hash(0, a, BL), "hash is deterministic");
        CHECK(h != cb_kv_chain_hash(1, a, BL), "hash depends on the parent");
        CHECK(h != cb_kv_chain_hash(0, c, BL), "hash depends on the tokens");
        CHECK(cb_kv_chain_hash(h, a + BL, BL) != cb_kv_chain_hash(cb_kv_chain_hash(0, c, BL), a + BL, BL),
              "the same block after different parents hashes differently");
    }

    cb_kv kv = make_pool();
    /* sequence 0 computes 9 positions: blocks 0 and 1 are full and registered, block 2 not */
    CHECK(run(&kv, 0, a, 9), "run a");
    CHECK(kv.reg[blk(&kv, 0, 0)] && kv.reg[blk(&kv, 0, 1)] && !kv.reg[blk(&kv, 0, 2)], "full blocks registered");
    CHECK(kv.n_reg[0] == 2 && kv.valid[0] == 9, "registered %lld, valid %lld", (long long)kv.n_reg[0],
          (long long)kv.valid[0]);

    /* sequence 1 with the same prompt takes both blocks by reference and computes the rest */
    CHECK(cb_kv_reuse_prefix(&kv, 1, a, 9) == 8, "reuse of 9 tokens takes 8");
    CHECK(blk(&kv, 1, 0) == blk(&kv, 0, 0) && blk(&kv, 1, 1) == blk(&kv, 0, 1), "the same blocks");
    CHECK(kv.ref[blk(&kv, 0, 0)] == 2 && kv.ref[blk(&kv, 0, 1)] == 2, "shared by reference");
    CHECK(run(&kv, 1, a, 12) && holds(&kv, 1, a), "sequence 1 continues and holds a");
    CHECK(kv.reg[blk(&kv, 1, 2)], "sequence 1's third block registered");
    CHECK(kv.hit_tokens == 8 && kv.query_tokens == 9, "counters %lld/%lld", (long long)kv.hit_tokens,
          (long long)kv.query_tokens);

    /* never the last token; only whole blocks; only along the same chain */
    CHECK(cb_kv_reuse_prefix(&kv, 2, a, 8) == 4, "8 tokens: one block (the last token is computed)");
    cb_kv_truncate(&kv, 2, 0);
    CHECK(cb_kv_reuse_prefix(&kv, 2, a, 4) == 0, "4 tokens: nothing");
    CHECK(cb_kv_reuse_prefix(&kv, 2, b, 9) == 4, "another second block: the first only");
    cb_kv_truncate(&kv, 2, 0);
    CHECK(cb_kv_reuse_prefix(&kv, 2, c, 9) == 0, "the second block's tokens after another first: nothing");
    /* a sequence whose end is not a registered block boundary is not continued */
    CHECK(cb_kv_reuse_prefix(&kv, 0, a + 9, 8) == 0, "continuing mid-block: nothing");

    /* released blocks stay cached, then come back from the cache */
    cb_kv_truncate(&kv, 0, 0);
    cb_kv_truncate(&kv, 1, 0);
    CHECK(used(&kv) == 0, "no block held, %lld used", (long long)used(&kv));
    CHECK(kv.n_cached == 3, "three registered blocks cached, got %lld", (long long)kv.n_cached);
    CHECK(cb_kv_available(&kv) == NB, "cached blocks count as available");
    CHECK(cb_kv_reuse_prefix(&kv, 0, a, 13) == 12 && kv.n_cached == 0 && holds(&kv, 0, a), "all three back");
    cb_kv_truncate(&kv, 0, 0);

    /* a sequence needing the whole pool evicts the cached blocks, a prefix's tail first */
    {
        int32_t first = kv.lru_head, last = kv.lru_tail;
        CHECK(first >= 0 && last >= 0 && kv.parent[first] >= 0 && kv.parent[last] == -1,
              "the tail block is evicted first, the first block last");
        int32_t x[24];
        for (int i = 0; i < 24; i++) x[i] = 100 + i;
        CHECK(run(&kv, 3, x, 4 * BL + 1), "17 positions: 5 blocks, 3 free and 2 evicted");
        CHECK(kv.n_cached == 1 && kv.lru_head == last && kv.gen[first] == 1, "a's first block outlives its tail");
        cb_kv_truncate(&kv, 3, 0);
        CHECK(cb_kv_reuse_prefix(&kv, 0, a, 13) == 4, "only a's first block is left");
        cb_kv_truncate(&kv, 0, 0);
        /* the full pool: six blocks for 24 positions, every cached block gone */
        CHECK(run(&kv, 3, x, 24) && kv.n_free == 0, "the whole pool");
        cb_kv_truncate(&kv, 3, 0);
        CHECK(kv.n_cached == 6 && used(&kv) == 0, "registered x blocks cached: %lld", (long long)kv.n_cached);
        CHECK(cb_kv_reuse_prefix(&kv, 0, a, 13) == 0, "a's blocks were all evicted");
    }

    /* copy-on-write when a cached block is written into */
    cb_kv_reset(&kv);
    CHECK(run(&kv, 0, a, 5), "run a[0..5)");
    int32_t a0 = blk(&kv, 0, 0);
    CHECK(cb_kv_reuse_prefix(&kv, 1, a, 5) == 4, "sequence 1 shares block 0");
    cb_kv_truncate(&kv, 1, 2);
    CHECK(cb_kv_blocks_needed(&kv, 1, 2, 3) == 1, "writing into a shared block needs the copy");
    const int32_t d[3] = {1, 2, 55};
    CHECK(run(&kv, 1, d, 3), "sequence 1 writes position 2");
    CHECK(blk(&kv, 1, 0) != a0 && holds(&kv, 0, a) && holds(&kv, 1, d), "a private copy; block 0 untouched");
    cb_kv_truncate(&kv, 0, 0);
    cb_kv_truncate(&kv, 1, 0);
    /* held by one sequence only but registered: still copied, and the cache keeps the original */
    CHECK(cb_kv_reuse_prefix(&kv, 2, a, 5) == 4 && blk(&kv, 2, 0) == a0 && kv.ref[a0] == 1, "block 0 again");
    cb_kv_truncate(&kv, 2, 3);
    CHECK(cb_kv_blocks_needed(&kv, 2, 3, 4) == 1, "writing into a registered block needs the copy");
    int32_t c3[4] = {1, 2, 3, 77};
    CHECK(run(&kv, 2, c3, 4) && blk(&kv, 2, 0) != a0 && kv.ref[a0] == 0 && kv.reg[a0], "copied; a0 cached");
    CHECK(kv.reg[blk(&kv, 2, 0)], "the copy, now full with other tokens, is registered too");
    CHECK(cb_kv_reuse_prefix(&kv, 3, a, 5) == 4 && blk(&kv, 3, 0) == a0 && holds(&kv, 3, a), "a0 still serves a");
    cb_kv_reset(&kv);

    /* a prefix computed twice at once: one copy is kept */
    CHECK(run(&kv, 0, a, 6) && run(&kv, 1, a, 6), "two sequences compute a[0..6)");
    CHECK(blk(&kv, 0, 0) == blk(&kv, 1, 0) && kv.ref[blk(&kv, 0, 0)] == 2, "the second one took the first's block");
    CHECK(blk(&kv, 0, 1) != blk(&kv, 1, 1), "the partial blocks stay private");
    CHECK(used(&kv) == 3 && kv.n_free == NB - 3, "the duplicate went back: %lld used", (long long)used(&kv));
    CHECK(run(&kv, 1, a, 9) && kv.reg[blk(&kv, 1, 1)] && holds(&kv, 1, a), "the chain goes on after the swap");
    cb_kv_reset(&kv);

    /* a block is registered only once every position of it is written, in order */
    {
        cb_kv_grow(&kv, 0, 4);
        for (int p = 0; p < 4; p++) cb_kv_set_token(&kv, 0, p, a[p]);
        cb_kv_written(&kv, 0, 0);
        cb_kv_written(&kv, 0, 2); /* position 1 not written: out of order */
        cb_kv_written(&kv, 0, 3);
        CHECK(!kv.reg[blk(&kv, 0, 0)] && kv.valid[0] == 1, "no registration past a gap");
        CHECK(cb_kv_reuse_prefix(&kv, 1, a, 5) == 0, "nothing to reuse");
    }
    cb_kv_reset(&kv);

    /* with the prefix cache off nothing is registered, kept or reused */
    {
        kv.prefix = 0;
        CHECK(run(&kv, 0, a, 9), "run without the cache");
        cb_kv_truncate(&kv, 0, 0);
        CHECK(kv.n_cached == 0 && kv.n_free == NB, "blocks freed at once");
        CHECK(cb_kv_reuse_prefix(&kv, 1, a, 9) == 0, "no reuse");
    }
    free_pool(&kv);
    if (failures) {
        fprintf(stderr, "%d failure(s)\n", failures);
        return 1;
    }
    printf("prefix cache: all checks passed\n");
    return 0;
}
