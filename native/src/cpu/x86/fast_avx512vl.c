/*
 * fast_avx512vl.c — fast_x86_256.inc with the 256-bit vpdpbusd of AVX512_VNNI + AVX512VL:
 * the avx512vnni table's kernels for calls of up to 4 tokens on interleaved copies (a decode:
 * a group's four bytes per vector load, multiplied where they are loaded), and the unpack of
 * one group that its 16-row panels are made of (fast_avx512.c). Not a table of its own in
 * the registry. Compiled with fast_avx512.c's flags; entered only through that table.
 */
#include "cpu/fast.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(COLIBRI_NO_SIMD_TABLES)
#define FAST_VNNI_EVEX 1
#define FS(name) name##_avx512vl
#define FS_NAME "avx512vnni"
#include "cpu/x86/fast_x86_256.inc"
_Static_assert(sizeof(FS(panel)) == CB_FAST_IL8_PANEL_BYTES(FKC), "the panel fast_avx512.c fills from");
const cb_fast_kernels *cb_fast_avx512vl(void) { return &FS(table); }
void cb_fast_avx512vl_pack_il(void *panel, const uint8_t *g, size_t ahead, uint32_t dt, int64_t k0, int64_t kc) {
    pack_il_ahead(panel, g, ahead, dt, k0, kc);
}
#else
const cb_fast_kernels *cb_fast_avx512vl(void) { return NULL; }
void cb_fast_avx512vl_pack_il(void *panel, const uint8_t *g, size_t ahead, uint32_t dt, int64_t k0, int64_t kc) {
    (void)panel, (void)g, (void)ahead, (void)dt, (void)k0, (void)kc;
}
#endif
