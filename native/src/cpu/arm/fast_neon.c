/*
 * fast_neon.c — the fast mode's "neon" table (fast.h): fast_neon.inc with the integer dot
 * products by plain Advanced SIMD (no flags: every AArch64 CPU has it).
 * Entered only after cb_fast_by_name() has checked the CPU (HWCAP).
 */
#include "cpu/fast.h"

#if defined(__aarch64__) && defined(__ARM_NEON) && !defined(COLIBRI_NO_SIMD_TABLES)
#define FS(name) name##_fast_neon
#define FS_NAME "neon"
#include "cpu/arm/fast_neon.inc"
const cb_fast_kernels *cb_fast_neon(void) { return &FS(table); }
#else
const cb_fast_kernels *cb_fast_neon(void) { return NULL; }
#endif
