/*
 * threadpool.h — the engine's persistent worker threads.
 *
 * One pool per context, created in colibri_init_ex and freed in colibri_free. A parallel
 * section is a function and a number of chunks (cb_pool_run): every thread, the calling
 * thread included, claims chunks from a shared atomic counter until none is left, and the
 * section ends when every chunk has completed. A thread that is descheduled (a machine
 * shared with other work) therefore delays a section by at most the chunk it is running,
 * never by the work it has not claimed. Workers are created once, never per forward, and
 * cb_pool_run allocates nothing. Between sections workers spin briefly (a decode step runs
 * dozens of short sections back to back) and then sleep on a futex, so an idle context
 * costs no CPU.
 */
#ifndef COLIBRI_THREADPOOL_H
#define COLIBRI_THREADPOOL_H

#include <stdint.h>

typedef struct cb_pool cb_pool;

/* The work of one chunk of a parallel section: fn(arg, chunk, tid) with chunk in
 * [0, n_chunks) and tid in [0, threads) the thread running it (for per-thread scratch). */
typedef void (*cb_pool_fn)(void *arg, int64_t chunk, int tid);

/* Create a pool of n_threads >= 1 threads in all (n_threads - 1 workers; 1 = no workers).
 * Returns 0, or an errno value (nothing is left allocated on failure). */
int cb_pool_create(cb_pool **out, int n_threads);

/* Run fn once for every chunk 0..n_chunks-1, spread over the pool's threads, and return
 * when all have completed. Which thread runs which chunk is not fixed, so a chunk's result
 * must not depend on it. p == NULL (or one thread, or one chunk) runs them in order on the
 * caller. Not reentrant: fn must not call cb_pool_run on the same pool. */
void cb_pool_run(cb_pool *p, cb_pool_fn fn, void *arg, int64_t n_chunks);

/* Chunks that hand results to later chunks of the same section. Chunks are claimed in
 * ascending order, so a chunk that waits only for chunks of LOWER index waits for work that
 * a running thread has already claimed: it cannot deadlock, and with one thread (chunks run
 * in order) it never waits. A flag holds a section's stamp once the work it stands for is
 * done: cb_pool_signal publishes everything the chunk wrote before it (release),
 * cb_pool_await waits (spins, then yields) until *flag == stamp and then sees those writes
 * (acquire). Stamps change from section to section, so flags need no reset while a stamp
 * is not reused. */
void cb_pool_signal(uint32_t *flag, uint32_t stamp);
void cb_pool_await(const uint32_t *flag, uint32_t stamp);

/* Threads of the pool (1 for NULL). */
int cb_pool_threads(const cb_pool *p);

/* Stop and join the workers and free the pool (NULL is fine). */
void cb_pool_free(cb_pool *p);

/* Physical cores this process may run on: distinct (package, core) pairs among the CPUs in
 * its affinity mask, from /sys/devices/system/cpu/cpuN/topology; falls back to the CPUs in
 * the mask, then to online CPUs. Always >= 1. */
int cb_physical_cores(void);

#endif
