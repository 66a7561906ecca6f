/*
 * fast_neon_dotprod.c — the fast mode's "neon-dotprod" table (fast.h): fast_neon.inc with the integer dot
 * products by SDOT (FEAT_DotProd; compiled with -march=armv8.2-a+dotprod).
 * Entered only after cb_fast_by_name() has checked the CPU (HWCAP).
 */
#include "cpu/fast.h"

#if defined(__aarch64__) && defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD) && !defined(COLIBRI_NO_SIMD_TABLES)
#define FAST_NEON_DOTPROD 1
#define FS(name) name##_fast_neon_dotprod
#define FS_NAME "neon-dotprod"
#include "cpu/arm/fast_neon.inc"
const cb_fast_kernels *cb_fast_neon_dotprod(void) { return &FS(table); }
#else
const cb_fast_kernels *cb_fast_neon_dotprod(void) { return NULL; }
#endif
