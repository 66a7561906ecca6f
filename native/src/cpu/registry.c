/*
 * registry.c — the one list of kernel tables (registry.h). Priorities: exact, avx512 >
 * avx2 > neon > reference. Fast: avx512vnni-amx first (its BF16 prefill is several times
 * the f32 kernels', its decode slower: docs/performance.md, the Xeon figures;
 * COLIBRI_FAST_KERNELS=avx512vnni keeps BF16 on the f32 kernels), then avx512bf16 (AVX512_BF16
 * without AMX, AMD Zen 4/5: vdpbf16ps does twice the multiply-adds of an f32 FMA there), then
 * avx512vnni > avxvnni > avx2; on AArch64 neon-bf16 (BFDOT does twice the multiply-adds of an
 * FMLA per instruction on Neoverse V1/N2/V2 and Cortex-A710/X2, per Arm's optimization
 * guides; not measured here: no ARM hardware, only qemu) > neon-i8mm > neon-dotprod > neon;
 * the reference last.
 */
#include "cpu/registry.h"

#include <stdlib.h>
#include <string.h>

#include "cpu/features.h"

static const cb_table_entry registry[] = {
    /* exact tables (cpu/kernels.h) */
    {"ref", "reference", 0, 0, NULL, cb_kernels_ref, NULL},
    {"avx2", NULL, 20, CB_CPU_AVX2, NULL, cb_kernels_avx2, NULL},
    /* kernels_avx512.c is compiled with -mavx2 -mfma -mf16c as well as -mavx512f */
    {"avx512", NULL, 30, CB_CPU_AVX2 | CB_CPU_AVX512F, NULL, cb_kernels_avx512, NULL},
    {"neon", NULL, 10, CB_CPU_NEON, NULL, cb_kernels_neon, NULL},
    /* fast mode's tables (cpu/fast.h) */
    {"reference", "ref", 0, 0, NULL, NULL, cb_fast_ref},
    {"avx2", NULL, 60, CB_CPU_AVX2, NULL, NULL, cb_fast_avx2},
    {"avxvnni", NULL, 70, CB_CPU_AVX2 | CB_CPU_AVXVNNI, NULL, NULL, cb_fast_avxvnni},
    {"avx512vnni", NULL, 80, CB_CPU_AVX2 | CB_CPU_AVX512VNNI, NULL, NULL, cb_fast_avx512vnni},
    {"avx512vnni-amx", NULL, 100, CB_CPU_AVX2 | CB_CPU_AVX512VNNI, cb_cpu_amx, NULL, cb_fast_avx512vnni_amx},
    {"avx512bf16", NULL, 90, CB_CPU_AVX2 | CB_CPU_AVX512VNNI | CB_CPU_AVX512BF16, NULL, NULL, cb_fast_avx512bf16},
    {"neon", NULL, 20, CB_CPU_NEON, NULL, NULL, cb_fast_neon},
    {"neon-dotprod", NULL, 30, CB_CPU_NEON | CB_CPU_DOTPROD, NULL, NULL, cb_fast_neon_dotprod},
    {"neon-i8mm", NULL, 40, CB_CPU_NEON | CB_CPU_I8MM, NULL, NULL, cb_fast_neon_i8mm},
    {"neon-bf16", NULL, 50, CB_CPU_NEON | CB_CPU_I8MM | CB_CPU_ARM_BF16, NULL, NULL, cb_fast_neon_bf16},
};

const cb_table_entry *cb_registry(size_t *n) {
    *n = sizeof registry / sizeof registry[0];
    return registry;
}

int cb_table_usable(const cb_table_entry *e) {
    if (!cb_cpu_has(e->needs)) return 0;
    if (e->exact ? !e->exact() : !e->fast()) return 0; /* not in this build */
    return !e->probe || e->probe();
}

/* The usable entry of a kind (fast 0/1) named `name` (NULL: none), or else, when best is
 * set, the usable one of highest priority. */
static const cb_table_entry *pick(int fast, const char *name, int best) {
    const cb_table_entry *top = NULL;
    for (size_t i = 0; i < sizeof registry / sizeof registry[0]; i++) {
        const cb_table_entry *e = &registry[i];
        if ((e->fast != NULL) != fast) continue;
        if (name && (strcmp(name, e->name) == 0 || (e->alias && strcmp(name, e->alias) == 0)))
            return cb_table_usable(e) ? e : NULL;
        if (best && (!top || e->priority > top->priority) && cb_table_usable(e)) top = e;
    }
    return name ? NULL : top;
}

const cb_kernels *cb_kernels_by_name(const char *name) {
    const cb_table_entry *e = name ? pick(0, name, 0) : NULL;
    return e ? e->exact() : NULL;
}

const cb_kernels *cb_kernels_best(void) {
    const cb_kernels *k = cb_kernels_by_name(getenv("COLIBRI_KERNELS"));
    return k ? k : pick(0, NULL, 1)->exact();
}

const cb_fast_kernels *cb_fast_by_name(const char *name) {
    const cb_table_entry *e = name ? pick(1, name, 0) : NULL;
    return e ? e->fast() : NULL;
}

const cb_fast_kernels *cb_fast_best(void) {
    const cb_fast_kernels *f = cb_fast_by_name(getenv("COLIBRI_FAST_KERNELS"));
    return f ? f : pick(1, NULL, 1)->fast();
}
