/*
 * arena.h — one allocation, then carve (the engine's only run-time memory).
 *
 * A caller describes its buffers as a size table (cb_arena_item: where the pointer goes,
 * how many elements of what size); cb_arena_layout places them one after another, each
 * CB_ARENA_CARVE-aligned, with overflow-checked 64-bit arithmetic; cb_arena_alloc takes
 * one 2 MiB-aligned block (huge pages advised where the kernel has them) and
 * cb_arena_assign points every item into it. Nothing is allocated after that: the forward
 * pass, the sampler and every stage work inside these buffers. Bounds: an item's bytes and
 * the running total must fit 64 bits, and the block must fit size_t.
 */
#ifndef COLIBRI_CORE_ARENA_H
#define COLIBRI_CORE_ARENA_H

#include <stddef.h>
#include <stdint.h>

#define CB_ARENA_ALIGN ((size_t)2 << 20) /* 2 MiB: huge-page friendly */
#define CB_ARENA_CARVE 64u               /* every buffer starts on a cache line */

/* One row of a size table. */
typedef struct cb_arena_item {
    void **ptr;       /* set by cb_arena_assign */
    uint64_t count;   /* elements (0 is allowed: the pointer still points into the block) */
    uint64_t elem;    /* bytes per element */
    const char *what; /* name, for messages */
} cb_arena_item;

/* offs[i] = offset of item i; *total = bytes of the whole table. Returns 1, or 0 when an
 * item's size or the total overflows 64 bits (then *bad = the index of that item). */
int cb_arena_layout(const cb_arena_item *items, size_t n, uint64_t *offs, uint64_t *total, size_t *bad);

/* Allocate `total` bytes rounded up to CB_ARENA_ALIGN (*alloc_bytes = that size), aligned to
 * it, with MADV_HUGEPAGE advised. Returns NULL when the size cannot be addressed
 * (*alloc_bytes = 0) or the allocation fails. Free the block with free(). */
void *cb_arena_alloc(uint64_t total, uint64_t *alloc_bytes);

/* *items[i].ptr = mem + offs[i] for every item. */
void cb_arena_assign(const cb_arena_item *items, size_t n, const uint64_t *offs, void *mem);

#endif
