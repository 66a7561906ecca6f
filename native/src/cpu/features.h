/*
 * features.h — what this CPU (and its OS) lets the engine run: the one place that asks
 * (features.c: CPUID and XGETBV on x86, HWCAP on AArch64 Linux). Every probe of the kernel
 * registry (cpu/registry.c) and the memory-bandwidth probe read it; no other file asks the
 * CPU. A feature bit is set only when the instructions exist AND the OS saves the registers
 * they use, so a table entered on its bits never faults.
 */
#ifndef COLIBRI_CPU_FEATURES_H
#define COLIBRI_CPU_FEATURES_H

enum {
    CB_CPU_AVX2 = 1u << 0,       /* AVX2 + FMA + F16C */
    CB_CPU_AVX512F = 1u << 1,    /* AVX-512F, with the ZMM and opmask state saved by the OS (XCR0) */
    CB_CPU_AVX512VNNI = 1u << 2, /* AVX-512F + BW + VL + VNNI (state saved) */
    CB_CPU_AVXVNNI = 1u << 3,    /* AVX-VNNI (the 256-bit encoding) */
    CB_CPU_AVX512BF16 = 1u << 4, /* AVX512_BF16 (vdpbf16ps; state saved) */
    CB_CPU_NEON = 1u << 5,       /* AArch64 Advanced SIMD (every AArch64 CPU) */
    CB_CPU_DOTPROD = 1u << 6,    /* AArch64 SDOT/UDOT (HWCAP ASIMDDP) */
    CB_CPU_I8MM = 1u << 7,       /* AArch64 SMMLA/USDOT (HWCAP2 I8MM) */
    CB_CPU_ARM_BF16 = 1u << 8,   /* AArch64 BFDOT/BFMMLA (HWCAP2 BF16) */
    /* a tuning fact, not an instruction set: weights streamed once are best prefetched with
     * prefetchnta rather than into L2 — AMD family 0x1A (Zen 5), where fast mode's decode
     * measured 1.08-1.12x faster with it; the other CPUs keep the L2 hint they were tuned with */
    CB_CPU_STREAM_NTA = 1u << 9,
};

/* The CB_CPU_* bits of this CPU, found once per process. */
unsigned cb_cpu_features(void);
/* CB_CPU_STREAM_NTA, for the kernels' streaming prefetches (a hint: it changes no result):
 * 1 once cb_cpu_features() has found it, which the kernel registry asks before a table runs. */
extern unsigned char cb_cpu_stream_nta_flag;
static inline int cb_cpu_stream_nta(void) { return __atomic_load_n(&cb_cpu_stream_nta_flag, __ATOMIC_RELAXED); }
/* 1 when every bit of `want` is set. */
static inline int cb_cpu_has(unsigned want) { return (cb_cpu_features() & want) == want; }
/* 1 when AMX-TILE and AMX-BF16 can run: the CPU has them, the OS saves the AVX-512 state,
 * and Linux granted this process the tile data state (arch_prctl, asked once). */
int cb_cpu_amx(void);

#endif
