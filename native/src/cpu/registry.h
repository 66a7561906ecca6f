/*
 * registry.h — every kernel table of the engine, in one list (registry.c): the exact tables
 * (cpu/kernels.h) and the fast mode's (cpu/fast.h), each with its name, the CPU features it
 * needs (cpu/features.h) and its priority. The choice at start-up (cb_kernels_best,
 * cb_fast_best), the environment overrides (COLIBRI_KERNELS, COLIBRI_FAST_KERNELS), the
 * names config.kernels reports and the tables native/tests/test_kernels.c checks all read
 * this list; a new table is one row here.
 */
#ifndef COLIBRI_CPU_REGISTRY_H
#define COLIBRI_CPU_REGISTRY_H

#include <stddef.h>

#include "cpu/fast.h"
#include "cpu/kernels.h"

typedef struct cb_table_entry {
    const char *name;      /* its name in COLIBRI_KERNELS / COLIBRI_FAST_KERNELS */
    const char *alias;     /* another name it answers to, or NULL */
    int priority;          /* among the usable tables of a kind, the highest runs */
    unsigned needs;        /* the CB_CPU_* bits it needs */
    int (*probe)(void);    /* NULL, or a further check (after the table is known built) */
    /* exactly one of the two: the table's kernels, or NULL when this build lacks it */
    const cb_kernels *(*exact)(void);
    const cb_fast_kernels *(*fast)(void);
} cb_table_entry;

/* The list (n entries): exact tables, then fast tables. */
const cb_table_entry *cb_registry(size_t *n);
/* 1 when this build has the entry's table and this CPU can run it. */
int cb_table_usable(const cb_table_entry *e);

/* An exact table by name ("ref"/"reference", "avx2", "avx512", "neon") if built AND usable,
 * else NULL; COLIBRI_KERNELS if set and usable, else the usable one of highest priority. */
const cb_kernels *cb_kernels_by_name(const char *name);
const cb_kernels *cb_kernels_best(void);
/* The same for the fast tables ("ref"/"reference", "avx2", "avxvnni", "avx512vnni",
 * "avx512vnni-amx", "avx512bf16", "neon", "neon-dotprod", "neon-i8mm", "neon-bf16") and
 * COLIBRI_FAST_KERNELS. */
const cb_fast_kernels *cb_fast_by_name(const char *name);
const cb_fast_kernels *cb_fast_best(void);

#endif
