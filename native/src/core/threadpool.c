/*
 * threadpool.c — persistent workers that claim chunks of a section from an atomic counter
 * (see threadpool.h for the contract).
 *
 * Start: the caller publishes fn/arg/n_chunks, resets `done`, sets `next` to (generation
 * << 32 | chunk 0) and bumps `gen`. Every thread (workers and caller) then claims chunks by
 * compare-and-swap on `next`; a claim succeeds only while next's generation tag is its own,
 * so a worker that wakes late, after the caller has moved on, can never run a chunk of a
 * newer section with an older fn/arg. Finish: each completed chunk increments `done`; the
 * thread completing the last one stores the generation in `done_gen` and wakes the caller
 * if it sleeps. The caller does not wait for workers that never claimed anything. Waiting
 * spins CB_SPIN times, then sleeps on a futex; wake-up syscalls are made only when the
 * other side is asleep (`sleepers` / `caller_sleeps`, sequentially consistent so that a
 * sleeper and a waker cannot both miss each other). Linux futexes; elsewhere the sleeps
 * become sched_yield.
 */
#define _GNU_SOURCE
#include "core/threadpool.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield") /* the spin-wait hint, as x86's pause */
#else
#define cpu_relax() ((void)0)
#endif

#define CB_SPIN 4096 /* spins (pause ~ 10-60 ns each) before sleeping: ~50-200 us */

/* What a worker is started with; kept in the pool, so a worker that starts late (on a loaded
 * machine, after the first forward has begun) frees nothing. */
typedef struct worker_arg {
    cb_pool *p;
    int tid;
} worker_arg;

struct cb_pool {
    int n;                          /* threads in all, the caller included */
    pthread_t *workers;             /* [n - 1] */
    worker_arg *args;               /* [n - 1] */
    int started;                    /* workers created so far */
    uint32_t last_gen;              /* the caller's copy of gen */
    _Atomic(cb_pool_fn) fn;         /* the current section (published before gen) */
    _Atomic(void *) arg;
    _Atomic int64_t n_chunks;
    _Atomic uint64_t next;          /* generation << 32 | next unclaimed chunk */
    _Atomic int64_t done;           /* chunks of the current section completed */
    _Atomic uint32_t gen;           /* start signal: bumped once per section */
    _Atomic uint32_t done_gen;      /* finish signal: the last section completed */
    _Atomic int32_t sleepers;       /* workers asleep on gen */
    _Atomic int32_t caller_sleeps;  /* the caller is asleep on done_gen */
    _Atomic int32_t stop;
};

static void futex_wait(_Atomic uint32_t *addr, uint32_t val) {
#if defined(__linux__)
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
#else
    (void)addr;
    (void)val;
    sched_yield();
#endif
}

static void futex_wake(_Atomic uint32_t *addr, int n) {
#if defined(__linux__)
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
#else
    (void)addr;
    (void)n;
#endif
}

/* Claim and run chunks of section g until none is left (or the section is not g any more). */
static void run_chunks(cb_pool *p, uint32_t g, int tid) {
    cb_pool_fn fn = atomic_load_explicit(&p->fn, memory_order_acquire);
    void *arg = atomic_load_explicit(&p->arg, memory_order_acquire);
    int64_t n = atomic_load_explicit(&p->n_chunks, memory_order_acquire);
    uint64_t v = atomic_load_explicit(&p->next, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(v >> 32) != g) return;
        int64_t idx = (int64_t)(v & 0xffffffffu);
        if (idx >= n) return;
        if (!atomic_compare_exchange_weak_explicit(&p->next, &v, v + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue; /* v now holds the current value */
        fn(arg, idx, tid);
        if (atomic_fetch_add_explicit(&p->done, 1, memory_order_acq_rel) + 1 == n) {
            atomic_store(&p->done_gen, g);
            if (atomic_load(&p->caller_sleeps)) futex_wake(&p->done_gen, 1);
        }
        v = atomic_load_explicit(&p->next, memory_order_acquire);
    }
}

static void *worker_main(void *argp) {
    worker_arg wa = *(const worker_arg *)argp;
    cb_pool *p = wa.p;
    uint32_t seen = 0;
    for (;;) {
        uint32_t g = atomic_load_explicit(&p->gen, memory_order_acquire);
        for (int i = 0; i < CB_SPIN && g == seen; i++) {
            cpu_relax();
            g = atomic_load_explicit(&p->gen, memory_order_acquire);
        }
        while (g == seen) {
            atomic_fetch_add(&p->sleepers, 1);
            if (atomic_load(&p->gen) == seen) futex_wait(&p->gen, seen);
            atomic_fetch_sub(&p->sleepers, 1);
            g = atomic_load_explicit(&p->gen, memory_order_acquire);
        }
        seen = g;
        if (atomic_load_explicit(&p->stop, memory_order_acquire)) break;
        run_chunks(p, g, wa.tid);
    }
    return NULL;
}

static void stop_workers(cb_pool *p) {
    atomic_store_explicit(&p->stop, 1, memory_order_release);
    atomic_fetch_add(&p->gen, 1);
    futex_wake(&p->gen, INT_MAX);
    for (int i = 0; i < p->started; i++) pthread_join(p->workers[i], NULL);
    p->started = 0;
}

int cb_pool_create(cb_pool **out, int n_threads) {
    *out = NULL;
    if (n_threads < 1) return EINVAL;
    cb_pool *p = calloc(1, sizeof *p);
    if (!p) return ENOMEM;
    p->n = n_threads;
    if (n_threads > 1) {
        p->workers = calloc((size_t)(n_threads - 1), sizeof(pthread_t));
        p->args = calloc((size_t)(n_threads - 1), sizeof(worker_arg));
        if (!p->workers || !p->args) {
            free(p->workers);
            free(p->args);
            free(p);
            return ENOMEM;
        }
    }
    for (int i = 0; i < n_threads - 1; i++) {
        p->args[i].p = p;
        p->args[i].tid = i + 1;
        int rc = pthread_create(&p->workers[i], NULL, worker_main, &p->args[i]);
        if (rc != 0) {
            stop_workers(p);
            free(p->workers);
            free(p->args);
            free(p);
            return rc;
        }
        p->started++;
    }
    *out = p;
    return 0;
}

void cb_pool_run(cb_pool *p, cb_pool_fn fn, void *arg, int64_t n_chunks) {
    if (n_chunks <= 0) return;
    if (!p || p->n == 1 || n_chunks == 1) {
        for (int64_t c = 0; c < n_chunks; c++) fn(arg, c, 0);
        return;
    }
    uint32_t g = p->last_gen + 1;
    if (g == 0) g = 1; /* 0 is the workers' initial "seen" */
    p->last_gen = g;
    /* The claim counter first: a worker still inside the last section (it claims with that
     * section's generation) can then no longer claim a chunk. Were fn or n_chunks published
     * before it, such a straggler could read the new fn and n_chunks with the old counter, claim
     * "chunk n_old" of the new section, and that chunk would run twice (and another never).
     * The release stores make the reset visible to any worker that sees one of the new values. */
    atomic_store_explicit(&p->next, (uint64_t)g << 32, memory_order_relaxed);
    atomic_store_explicit(&p->fn, fn, memory_order_release);
    atomic_store_explicit(&p->arg, arg, memory_order_release);
    atomic_store_explicit(&p->n_chunks, n_chunks, memory_order_release);
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    atomic_store(&p->gen, g); /* seq_cst: publishes everything above */
    if (atomic_load(&p->sleepers) > 0) futex_wake(&p->gen, INT_MAX);
    run_chunks(p, g, 0);
    for (int i = 0; i < CB_SPIN; i++) {
        if (atomic_load_explicit(&p->done, memory_order_acquire) == n_chunks) return;
        cpu_relax();
    }
    atomic_store(&p->caller_sleeps, 1);
    for (;;) {
        uint32_t d = atomic_load(&p->done_gen);
        if (d == g || atomic_load(&p->done) == n_chunks) break;
        futex_wait(&p->done_gen, d);
    }
    atomic_store(&p->caller_sleeps, 0);
    atomic_thread_fence(memory_order_acquire);
}

/* GCC/Clang atomic builtins on plain uint32_t: the flags live in the arena's scratch
 * (model/forward.h), which C++ (the CUDA backend) includes too. */
void cb_pool_signal(uint32_t *flag, uint32_t stamp) { __atomic_store_n(flag, stamp, __ATOMIC_RELEASE); }

void cb_pool_await(const uint32_t *flag, uint32_t stamp) {
    /* the awaited chunk is short, but its thread may be descheduled (a machine with more
     * runnable threads than CPUs): spin, then yield the CPU to it */
    for (int i = 0; __atomic_load_n(flag, __ATOMIC_ACQUIRE) != stamp; i++) {
        if (i < CB_SPIN) cpu_relax();
        else sched_yield();
    }
}

int cb_pool_threads(const cb_pool *p) { return p ? p->n : 1; }

void cb_pool_free(cb_pool *p) {
    if (!p) return;
    stop_workers(p);
    free(p->workers);
    free(p->args);
    free(p);
}

/* ---- topology ---- */

static int read_int_file(const char *path, long *out) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    int ok = fscanf(f, "%ld", out) == 1;
    fclose(f);
    return ok;
}

int cb_physical_cores(void) {
    int fallback = 1;
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    if (online > 0) fallback = online > 4096 ? 4096 : (int)online;
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0) return fallback;
    int in_mask = CPU_COUNT(&set);
    if (in_mask > 0) fallback = in_mask;
    /* distinct (package, core) pairs; at most CPU_SETSIZE CPUs, kept in a small table */
    long pairs[2 * 256];
    int n_pairs = 0;
    for (int cpu = 0; cpu < CPU_SETSIZE; cpu++) {
        if (!CPU_ISSET(cpu, &set)) continue;
        char path[128];
        long core = -1, pkg = -1;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/core_id", cpu);
        if (!read_int_file(path, &core)) return fallback;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/physical_package_id", cpu);
        if (!read_int_file(path, &pkg)) return fallback;
        int seen = 0;
        for (int i = 0; i < n_pairs && !seen; i++) seen = pairs[2 * i] == pkg && pairs[2 * i + 1] == core;
        if (seen) continue;
        if (n_pairs == 256) return fallback; /* a machine this large: trust the mask */
        pairs[2 * n_pairs] = pkg;
        pairs[2 * n_pairs + 1] = core;
        n_pairs++;
    }
    return n_pairs > 0 ? n_pairs : fallback;
#else
    return fallback;
#endif
}
