/*
 * fast_avx2.c — the fast mode's "avx2" table (fast.h) for CPUs without VNNI: fast_x86_256.inc
 * with the integer dot products from vpmaddubsw + vpmaddwd. Compiled with -mavx2 -mfma
 * -mf16c; entered only after cb_fast_by_name() has checked the CPU.
 */
#include "cpu/fast.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(COLIBRI_NO_SIMD_TABLES)
#define FS(name) name##_fast_avx2
#define FS_NAME "avx2"
#include "cpu/x86/fast_x86_256.inc"
const cb_fast_kernels *cb_fast_avx2(void) { return &FS(table); }
#else
const cb_fast_kernels *cb_fast_avx2(void) { return NULL; }
#endif
