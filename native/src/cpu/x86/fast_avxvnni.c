/*
 * fast_avxvnni.c — the fast mode's "avxvnni" table (fast.h): fast_x86_256.inc with the
 * 256-bit vpdpbusd of AVX-VNNI (CPUs with VNNI but no AVX-512). Compiled with -mavx2 -mfma
 * -mf16c -mavxvnni; entered only after cb_fast_by_name() has checked the CPU.
 */
#include "cpu/fast.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVXVNNI__) && \
    !defined(COLIBRI_NO_SIMD_TABLES)
#define FAST_AVXVNNI 1
#define FS(name) name##_avxvnni
#define FS_NAME "avxvnni"
#include "cpu/x86/fast_x86_256.inc"
const cb_fast_kernels *cb_fast_avxvnni(void) { return &FS(table); }
#else
const cb_fast_kernels *cb_fast_avxvnni(void) { return NULL; }
#endif
