/*
 * read_jitter.c — the machine's own jitter, for comparison with colibri_bench's P99/P50:
 * one thread reads a 460 MB buffer (the bytes one bf16 decode token of the 791 M Mixtral
 * reads) 200 times with AVX2 loads and prints min, P50, P90, P99 of the pass times. No
 * engine, no threads, no synchronisation: whatever spread it shows is the memory system's
 * (and the hypervisor's), and no decode step that streams the same bytes can be steadier.
 *
 *   gcc -O2 -mavx2 tools/read_jitter.c -o /tmp/read_jitter && /tmp/read_jitter
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(void) {
    const size_t n = (size_t)460 << 20;
    enum { REPS = 200 };
    char *b = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (b == MAP_FAILED) return 1;
    madvise(b, n, MADV_HUGEPAGE);
    memset(b, 1, n);
    double t[REPS];
    __m256i s = _mm256_setzero_si256();
    for (int it = 0; it < REPS; it++) {
        double t0 = now_ms();
        for (size_t i = 0; i < n; i += 128) {
            s = _mm256_add_epi32(s, _mm256_load_si256((const __m256i *)(b + i)));
            s = _mm256_add_epi32(s, _mm256_load_si256((const __m256i *)(b + i + 32)));
            s = _mm256_add_epi32(s, _mm256_load_si256((const __m256i *)(b + i + 64)));
            s = _mm256_add_epi32(s, _mm256_load_si256((const __m256i *)(b + i + 96)));
        }
        t[it] = now_ms() - t0;
    }
    int o[8];
    _mm256_storeu_si256((__m256i *)o, s);
    qsort(t, REPS, sizeof t[0], cmp);
    printf("1 thread, read 460 MB x %d: min %.2f  P50 %.2f  P90 %.2f  P99 %.2f ms  "
           "P99/P50 %.3f  (%.1f GB/s at P50; checksum %d)\n",
           REPS, t[0], t[REPS / 2], t[REPS * 9 / 10], t[REPS * 99 / 100], t[REPS * 99 / 100] / t[REPS / 2],
           n / t[REPS / 2] / 1e6, o[0]);
    return 0;
}
