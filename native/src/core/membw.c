/*
 * membw.c — colibri_read_bandwidth: how fast this machine streams memory into the cores,
 * measured the way STREAM or likwid-bench `load` do, on the engine's own thread pool.
 *
 * Decode reads every active weight once per token and writes almost nothing, so its
 * ceiling is a streaming READ, not a copy (a copy also writes, and a write to a line not
 * in cache costs a read for ownership as well: its bytes per second are not what a
 * read-only stream gets). The buffer is allocated 2 MiB-aligned with MADV_HUGEPAGE (the
 * weights mapping asks for the same), touched by the pool's threads, read once
 * untimed, then `reps` times timed by the wall clock (CLOCK_MONOTONIC around one parallel
 * section). A section has one chunk per thread, a contiguous slice of the buffer (the pool
 * hands chunks out dynamically, so a thread that starts late can leave its slice to
 * another: the figure is then lower, never higher). Each slice is read with the widest vector
 * loads the CPU has (AVX-512, AVX2, or a portable C loop), summed into a few integer
 * accumulators whose total is stored, so the compiler cannot drop the loads.
 *
 * Flags choose the variant: COLIBRI_MEMBW_NT_PREFETCH adds a prefetchnta a few lines ahead
 * of the loads, COLIBRI_MEMBW_NT_LOAD uses (V)MOVNTDQA loads (_mm*_stream_load_*), and
 * COLIBRI_MEMBW_PORTABLE / COLIBRI_MEMBW_AVX2 cap the instruction set. The SIMD loops are
 * compiled with target attributes and entered only after the CPU probe (cpu/features.h), so the
 * library stays a baseline x86-64 build. Which variant reads fastest depends on the machine
 * (on some, the portable loop's 16-byte SSE2 loads beat the 64-byte ones, and the
 * non-temporal variants read less; docs/performance.md), so the benchmark measures each and
 * keeps the best. This is a measurement call, not the forward pass:
 * it allocates (and frees) its buffer and a pool of its own.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "colibri.h"
#include "core/error.h"
#include "core/threadpool.h"
#include "cpu/features.h"

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define CB_MEMBW_X86 1
#include <immintrin.h>
#endif

#define MEMBW_UNIT 512           /* bytes per loop iteration of every variant */
#define MEMBW_MIN_BYTES (1 << 20)
#define MEMBW_MAX_BYTES ((int64_t)1 << 40)
#define MEMBW_MAX_REPS 1000
#define MEMBW_MAX_THREADS 1024
#define MEMBW_NTA_AHEAD 1024     /* prefetchnta distance in bytes (16 lines) */
#define MEMBW_KNOWN_FLAGS \
    (COLIBRI_MEMBW_NT_PREFETCH | COLIBRI_MEMBW_NT_LOAD | COLIBRI_MEMBW_PORTABLE | COLIBRI_MEMBW_AVX2)

/* a slice's sum of 64-bit words, over n bytes (a multiple of MEMBW_UNIT) at p (64-aligned) */
typedef uint64_t (*membw_fn)(const uint8_t *p, size_t n);

/* ---- portable C: eight 64-bit loads per 64 bytes into four accumulators ---- */

static uint64_t read_c(const uint8_t *p, size_t n) {
    const uint64_t *w = (const uint64_t *)(const void *)p;
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    for (size_t i = 0; i < n / 8; i += 8) {
        a0 += w[i] + w[i + 4];
        a1 += w[i + 1] + w[i + 5];
        a2 += w[i + 2] + w[i + 6];
        a3 += w[i + 3] + w[i + 7];
    }
    return a0 + a1 + a2 + a3;
}

#ifdef CB_MEMBW_X86
/* ---- AVX2: 16 x 32-byte loads per 512 bytes, four accumulators ---- */

#define AVX2_BODY(LOAD, PREFETCH)                                                        \
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;                      \
    for (size_t i = 0; i < n; i += MEMBW_UNIT) {                                         \
        const uint8_t *q = p + i;                                                        \
        PREFETCH;                                                                        \
        for (int k = 0; k < 16; k += 4) {                                                \
            a0 = _mm256_add_epi64(a0, LOAD((const void *)(q + 32 * k)));                 \
            a1 = _mm256_add_epi64(a1, LOAD((const void *)(q + 32 * k + 32)));            \
            a2 = _mm256_add_epi64(a2, LOAD((const void *)(q + 32 * k + 64)));            \
            a3 = _mm256_add_epi64(a3, LOAD((const void *)(q + 32 * k + 96)));            \
        }                                                                                \
    }                                                                                    \
    __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));    \
    uint64_t out[4];                                                                     \
    _mm256_storeu_si256((__m256i *)(void *)out, s);                                      \
    return out[0] + out[1] + out[2] + out[3];

#define NTA8(q)                                                                          \
    for (int l = 0; l < MEMBW_UNIT; l += 64)                                             \
        _mm_prefetch((const char *)(q) + MEMBW_NTA_AHEAD + l, _MM_HINT_NTA)

#define LOAD256(a) _mm256_load_si256((const __m256i *)(a))
#define STREAM256(a) _mm256_stream_load_si256((const __m256i *)(a))

__attribute__((target("avx2"))) static uint64_t read_avx2(const uint8_t *p, size_t n) {
    AVX2_BODY(LOAD256, (void)0)
}
__attribute__((target("avx2"))) static uint64_t read_avx2_nta(const uint8_t *p, size_t n) {
    AVX2_BODY(LOAD256, NTA8(q))
}
__attribute__((target("avx2"))) static uint64_t read_avx2_ntl(const uint8_t *p, size_t n) {
    AVX2_BODY(STREAM256, (void)0)
}
__attribute__((target("avx2"))) static uint64_t read_avx2_nt(const uint8_t *p, size_t n) {
    AVX2_BODY(STREAM256, NTA8(q))
}

/* ---- AVX-512: 8 x 64-byte loads per 512 bytes, four accumulators ---- */

#define AVX512_BODY(LOAD, PREFETCH)                                                      \
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;                      \
    for (size_t i = 0; i < n; i += MEMBW_UNIT) {                                         \
        const uint8_t *q = p + i;                                                        \
        PREFETCH;                                                                        \
        a0 = _mm512_add_epi64(a0, LOAD((const void *)(q)));                              \
        a1 = _mm512_add_epi64(a1, LOAD((const void *)(q + 64)));                         \
        a2 = _mm512_add_epi64(a2, LOAD((const void *)(q + 128)));                        \
        a3 = _mm512_add_epi64(a3, LOAD((const void *)(q + 192)));                        \
        a0 = _mm512_add_epi64(a0, LOAD((const void *)(q + 256)));                        \
        a1 = _mm512_add_epi64(a1, LOAD((const void *)(q + 320)));                        \
        a2 = _mm512_add_epi64(a2, LOAD((const void *)(q + 384)));                        \
        a3 = _mm512_add_epi64(a3, LOAD((const void *)(q + 448)));                        \
    }                                                                                    \
    return (uint64_t)_mm512_reduce_add_epi64(                                            \
        _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));

#define LOAD512(a) _mm512_load_si512((const void *)(a))
#define STREAM512(a) _mm512_stream_load_si512((void *)(uintptr_t)(a))

__attribute__((target("avx512f"))) static uint64_t read_avx512(const uint8_t *p, size_t n) {
    AVX512_BODY(LOAD512, (void)0)
}
__attribute__((target("avx512f"))) static uint64_t read_avx512_nta(const uint8_t *p, size_t n) {
    AVX512_BODY(LOAD512, NTA8(q))
}
__attribute__((target("avx512f"))) static uint64_t read_avx512_ntl(const uint8_t *p, size_t n) {
    AVX512_BODY(STREAM512, (void)0)
}
__attribute__((target("avx512f"))) static uint64_t read_avx512_nt(const uint8_t *p, size_t n) {
    AVX512_BODY(STREAM512, NTA8(q))
}
#endif

/* The loop for `flags` on this CPU, and its name; NULL if the CPU lacks what flags ask. */
static membw_fn pick(int32_t flags, const char **isa) {
    int nt = flags & (COLIBRI_MEMBW_NT_PREFETCH | COLIBRI_MEMBW_NT_LOAD);
    if (flags & COLIBRI_MEMBW_PORTABLE) {
        *isa = "portable C";
        return nt ? NULL : read_c; /* non-temporal hints need the SIMD loops */
    }
#ifdef CB_MEMBW_X86
    int ntp = (flags & COLIBRI_MEMBW_NT_PREFETCH) != 0, ntl = (flags & COLIBRI_MEMBW_NT_LOAD) != 0;
    if (!(flags & COLIBRI_MEMBW_AVX2) && cb_cpu_has(CB_CPU_AVX512F)) {
        *isa = "avx512";
        return ntl ? (ntp ? read_avx512_nt : read_avx512_ntl) : (ntp ? read_avx512_nta : read_avx512);
    }
    if (cb_cpu_has(CB_CPU_AVX2)) {
        *isa = "avx2";
        return ntl ? (ntp ? read_avx2_nt : read_avx2_ntl) : (ntp ? read_avx2_nta : read_avx2);
    }
    *isa = "avx2";
    return NULL;
#else
    *isa = (flags & COLIBRI_MEMBW_AVX2) ? "avx2" : "portable C";
    return (nt || (flags & COLIBRI_MEMBW_AVX2)) ? NULL : read_c;
#endif
}

typedef struct membw_job {
    uint8_t *buf;
    size_t slice;       /* bytes per chunk, a multiple of MEMBW_UNIT */
    membw_fn fn;
    int touch;          /* 1: write the pattern instead of reading */
    uint64_t sums[MEMBW_MAX_THREADS];
} membw_job;

static void membw_chunk(void *arg, int64_t chunk, int tid) {
    (void)tid;
    membw_job *j = (membw_job *)arg;
    uint8_t *p = j->buf + (size_t)chunk * j->slice;
    if (j->touch) memset(p, (int)(chunk & 0x7f) + 1, j->slice);
    else j->sums[chunk] = j->fn(p, j->slice);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* the sum of every slice, kept so that no load is dead code */
static volatile uint64_t membw_sink;

colibri_status colibri_read_bandwidth(int32_t num_threads, int64_t bytes, int32_t reps, int32_t flags,
                                      double *gb_per_s, double *samples, char *err, size_t err_len) {
    if (err && err_len) err[0] = 0;
    if (!gb_per_s) {
        cb_set_err(err, err_len, "colibri_read_bandwidth: gb_per_s must not be NULL");
        return COLIBRI_E_INVALID_ARG;
    }
    *gb_per_s = 0;
    if (num_threads < 0 || num_threads > MEMBW_MAX_THREADS) {
        cb_set_err(err, err_len, "colibri_read_bandwidth: num_threads %d must be in [0, %d] (0: one per "
                   "physical core, as the engine's default)", (int)num_threads, MEMBW_MAX_THREADS);
        return COLIBRI_E_INVALID_ARG;
    }
    if (bytes < MEMBW_MIN_BYTES || bytes > MEMBW_MAX_BYTES || (uint64_t)bytes > (uint64_t)(SIZE_MAX / 2)) {
        cb_set_err(err, err_len, "colibri_read_bandwidth: bytes %lld must be in [1 MiB, 1 TiB]; use a buffer "
                   "several times the last-level cache to measure memory, not cache", (long long)bytes);
        return COLIBRI_E_INVALID_ARG;
    }
    if (reps < 1 || reps > MEMBW_MAX_REPS) {
        cb_set_err(err, err_len, "colibri_read_bandwidth: reps %d must be in [1, %d]", (int)reps,
                   MEMBW_MAX_REPS);
        return COLIBRI_E_INVALID_ARG;
    }
    if ((flags & ~MEMBW_KNOWN_FLAGS) ||
        ((flags & COLIBRI_MEMBW_PORTABLE) && (flags & COLIBRI_MEMBW_AVX2))) {
        cb_set_err(err, err_len, "colibri_read_bandwidth: flags 0x%x: known flags are COLIBRI_MEMBW_NT_PREFETCH, "
                   "_NT_LOAD, _PORTABLE and _AVX2 (not both of the last two)", (unsigned)flags);
        return COLIBRI_E_INVALID_ARG;
    }
    const char *isa = "";
    membw_fn fn = pick(flags, &isa);
    if (!fn) {
        if (flags & COLIBRI_MEMBW_PORTABLE)
            cb_set_err(err, err_len, "colibri_read_bandwidth: flags 0x%x: the non-temporal variants are SIMD "
                       "only; drop COLIBRI_MEMBW_PORTABLE or the _NT_ flags", (unsigned)flags);
        else
            cb_set_err(err, err_len, "colibri_read_bandwidth: flags 0x%x need %s loads, which this CPU or build "
                       "lacks; use flags 0 (the widest loads it has)", (unsigned)flags, isa);
        return COLIBRI_E_UNSUPPORTED;
    }
    int nt = num_threads == 0 ? cb_physical_cores() : (int)num_threads;
    if (nt > MEMBW_MAX_THREADS) nt = MEMBW_MAX_THREADS;

    const size_t huge = (size_t)2 << 20;
    size_t slice = ((size_t)bytes / (size_t)nt) & ~(size_t)(MEMBW_UNIT - 1);
    if (slice == 0) {
        cb_set_err(err, err_len, "colibri_read_bandwidth: %lld bytes over %d threads is under %d bytes per "
                   "thread; use a larger buffer", (long long)bytes, nt, MEMBW_UNIT);
        return COLIBRI_E_INVALID_ARG;
    }
    size_t total = slice * (size_t)nt;
    size_t alloc = (total + huge - 1) & ~(huge - 1);
    uint8_t *buf = aligned_alloc(huge, alloc);
    membw_job *job = calloc(1, sizeof *job);
    cb_pool *pool = NULL;
    int prc = (buf && job) ? cb_pool_create(&pool, nt) : ENOMEM;
    if (!buf || !job || prc != 0) {
        free(buf);
        free(job);
        cb_set_err(err, err_len, "colibri_read_bandwidth: cannot allocate %lld bytes and %d threads: %s; use "
                   "a smaller buffer or fewer threads", (long long)alloc, nt, strerror(prc ? prc : ENOMEM));
        return COLIBRI_E_NOMEM;
    }
#ifdef MADV_HUGEPAGE
    (void)madvise(buf, alloc, MADV_HUGEPAGE); /* advisory, as for the weights mapping */
#endif
    job->buf = buf;
    job->slice = slice;
    job->fn = fn;
    job->touch = 1; /* every page faulted in (by the pool's threads), not timed */
    cb_pool_run(pool, membw_chunk, job, nt);
    job->touch = 0;
    cb_pool_run(pool, membw_chunk, job, nt); /* one untimed read: the workers are awake */
    double best = 0;
    uint64_t sink = 0;
    for (int32_t r = 0; r < reps; r++) {
        double t0 = now_s();
        cb_pool_run(pool, membw_chunk, job, nt);
        double dt = now_s() - t0;
        double gbs = dt > 0 ? (double)total / dt / 1e9 : 0;
        if (samples) samples[r] = gbs;
        if (gbs > best) best = gbs;
        for (int c = 0; c < nt; c++) sink += job->sums[c];
    }
    membw_sink = sink;
    cb_pool_free(pool);
    free(job);
    free(buf);
    *gb_per_s = best;
    return COLIBRI_OK;
}
