/*
 * arena.c — sizing, allocating and carving the one arena (arena.h).
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <sys/mman.h>

#include "core/arena.h"
#include "core/checked.h"

int cb_arena_layout(const cb_arena_item *items, size_t n, uint64_t *offs, uint64_t *total, size_t *bad) {
    uint64_t t = 0, tmp;
    for (size_t i = 0; i < n; i++) {
        uint64_t bytes;
        if (!cb_mul_u64(items[i].count, items[i].elem, &bytes) ||
            !cb_add_u64(bytes, CB_ARENA_CARVE, &bytes) || !cb_add_u64(t, bytes, &tmp)) {
            *bad = i;
            return 0;
        }
        offs[i] = t;
        t += (items[i].count * items[i].elem + CB_ARENA_CARVE - 1) / CB_ARENA_CARVE * CB_ARENA_CARVE;
    }
    *total = t;
    return 1;
}

void *cb_arena_alloc(uint64_t total, uint64_t *alloc_bytes) {
    uint64_t alloc = (total + CB_ARENA_ALIGN - 1) / CB_ARENA_ALIGN * CB_ARENA_ALIGN;
    *alloc_bytes = 0;
    if (alloc > (uint64_t)SIZE_MAX || alloc < total) return NULL;
    *alloc_bytes = alloc;
    void *mem = NULL;
    if (posix_memalign(&mem, CB_ARENA_ALIGN, (size_t)alloc) != 0 || !mem) return NULL;
#ifdef MADV_HUGEPAGE
    (void)madvise(mem, (size_t)alloc, MADV_HUGEPAGE); /* advisory: failure is harmless */
#endif
    return mem;
}

void cb_arena_assign(const cb_arena_item *items, size_t n, const uint64_t *offs, void *mem) {
    for (size_t i = 0; i < n; i++) *items[i].ptr = (uint8_t *)mem + offs[i];
}
