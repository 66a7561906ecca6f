/*
 * test_threadpool.c — the thread pool runs every chunk of every section exactly once and
 * returns only when all are done, for many short sections in a row (the decode pattern),
 * with 1 to 4 threads, including sections of one chunk and sections with more chunks
 * than threads; chunks that wait for lower chunks of their section (cb_pool_await) see what
 * those wrote and never deadlock; plus cb_physical_cores() >= 1. Exit 0 when every check
 * passes.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/threadpool.h" /* internal header */

#define MAX_CHUNKS 97

typedef struct task {
    _Atomic int hits[MAX_CHUNKS];
    _Atomic int bad_tid;
    int n_threads;
    int64_t n_chunks;
    uint64_t seq;           /* the section number: every chunk adds it into sum */
    _Atomic uint64_t sum;
} task;

static void chunk_fn(void *arg, int64_t c, int tid) {
    task *t = (task *)arg;
    if (c < 0 || c >= t->n_chunks) return;
    if (tid < 0 || tid >= t->n_threads) atomic_store(&t->bad_tid, 1);
    atomic_fetch_add(&t->hits[c], 1);
    atomic_fetch_add(&t->sum, t->seq);
}

/* Chunk c > 0 waits for chunk (c - 1) / 2 (a lower index), reads its plain (non-atomic)
 * depth, writes its own, then flags it: a tree of hand-offs across threads. */
typedef struct handoff {
    uint32_t flag[MAX_CHUNKS];
    int depth[MAX_CHUNKS];
    uint32_t stamp;
} handoff;

static void handoff_fn(void *arg, int64_t c, int tid) {
    (void)tid;
    handoff *h = (handoff *)arg;
    int d = 0;
    if (c > 0) {
        cb_pool_await(&h->flag[(c - 1) / 2], h->stamp);
        d = h->depth[(c - 1) / 2] + 1;
    }
    h->depth[c] = d;
    cb_pool_signal(&h->flag[c], h->stamp);
}

static int tree_depth(int64_t c) {
    int d = 0;
    for (; c > 0; c = (c - 1) / 2) d++;
    return d;
}

int main(void) {
    int fails = 0;
    long checks = 0;
    static task t;
    for (int n = 1; n <= 4; n++) {
        cb_pool *p = NULL;
        if (cb_pool_create(&p, n) != 0 || cb_pool_threads(p) != n) {
            printf("FAIL: cannot create a pool of %d threads\n", n);
            return 1;
        }
        t.n_threads = n;
        for (uint64_t s = 1; s <= 20000; s++) {
            int64_t nc = (int64_t)(s * 7919u % MAX_CHUNKS) + 1; /* 1 .. MAX_CHUNKS */
            for (int64_t c = 0; c < MAX_CHUNKS; c++) atomic_store(&t.hits[c], 0);
            atomic_store(&t.sum, 0);
            t.n_chunks = nc;
            t.seq = s;
            cb_pool_run(p, chunk_fn, &t, nc);
            /* everything must be done when cb_pool_run returns */
            checks++;
            int ok = atomic_load(&t.sum) == s * (uint64_t)nc;
            for (int64_t c = 0; c < MAX_CHUNKS; c++) ok &= atomic_load(&t.hits[c]) == (c < nc ? 1 : 0);
            if (!ok && fails++ < 10) printf("FAIL: %d threads, section %llu of %lld chunks: a chunk ran 0 or 2+ times\n",
                                           n, (unsigned long long)s, (long long)nc);
        }
        static handoff h; /* flags start at 0; stamps count from 1 */
        for (uint32_t s = 1; s <= 5000; s++) {
            int64_t nc = (int64_t)(s * 7919u % MAX_CHUNKS) + 1;
            h.stamp = s + (uint32_t)n * 5000u;
            for (int64_t c = 0; c < MAX_CHUNKS; c++) h.depth[c] = -1;
            cb_pool_run(p, handoff_fn, &h, nc);
            checks++;
            int ok = 1;
            for (int64_t c = 0; c < nc; c++) ok &= h.depth[c] == tree_depth(c);
            if (!ok && fails++ < 10) printf("FAIL: %d threads, hand-off section %u of %lld chunks: a chunk read "
                                            "a depth before its writer flagged it\n", n, s, (long long)nc);
        }
        cb_pool_free(p);
    }
    checks++;
    if (atomic_load(&t.bad_tid)) {
        printf("FAIL: a chunk saw a thread id outside [0, threads)\n");
        fails++;
    }
    checks++;
    if (cb_physical_cores() < 1) {
        printf("FAIL: cb_physical_cores() < 1\n");
        fails++;
    }
    cb_pool_run(NULL, chunk_fn, &t, 0); /* no chunks: nothing happens */
    if (fails) {
        printf("test_threadpool: %d of %ld checks FAILED\n", fails, checks);
        return 1;
    }
    printf("test_threadpool: OK (%ld sections; %d physical cores here)\n", checks, cb_physical_cores());
    return 0;
}
