/*
 * fast_neon_i8mm.c — the fast mode's "neon-i8mm" table (fast.h): fast_neon.inc with the integer dot
 * products by USDOT (FEAT_I8MM; compiled with -march=armv8.2-a+dotprod+i8mm).
 * Entered only after cb_fast_by_name() has checked the CPU (HWCAP).
 */
#include "cpu/fast.h"

#if defined(__aarch64__) && defined(__ARM_NEON) && defined(__ARM_FEATURE_MATMUL_INT8) && !defined(COLIBRI_NO_SIMD_TABLES)
#define FAST_NEON_I8MM 1
#define FS(name) name##_fast_neon_i8mm
#define FS_NAME "neon-i8mm"
#include "cpu/arm/fast_neon.inc"
const cb_fast_kernels *cb_fast_neon_i8mm(void) { return &FS(table); }
#else
const cb_fast_kernels *cb_fast_neon_i8mm(void) { return NULL; }
#endif
