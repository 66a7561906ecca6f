/*
 * features.c — the CPU feature probe (features.h): CPUID leaves 1 and 7 (sub-leaves 0 and
 * 1) and XCR0 on x86, HWCAP/HWCAP2 on AArch64 Linux, read once. Compiled without
 * instruction-set flags: it only asks.
 *
 * x86 bits: F16C CPUID.1:ECX 29, the family CPUID.1:EAX 8..11 (+ 20..27 when 15) and the
 * vendor (leaf 0) for the one tuning bit, OSXSAVE CPUID.1:ECX 27; leaf 7 sub-leaf 0: AVX2 EBX 5,
 * AVX512F EBX 16, AVX512BW EBX 30, AVX512VL EBX 31, AVX512_VNNI ECX 11, AMX-BF16 EDX 22,
 * AMX-TILE EDX 24; sub-leaf 1: AVX-VNNI EAX 4, AVX512_BF16 EAX 5; FMA CPUID.1:ECX 12; AVX
 * CPUID.1:ECX 28. The OS saves YMM when XCR0 bits 1, 2 are set, ZMM and opmask with bits 5,
 * 6, 7 too, the tile state with bits 17, 18 (after arch_prctl(ARCH_REQ_XCOMP_PERM)).
 */
#include "cpu/features.h"

#include <pthread.h>

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <cpuid.h>
#define CB_FEAT_X86 1
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
/* Linux's AArch64 HWCAP bits (asm/hwcap.h): ASIMDDP (SDOT/UDOT) in AT_HWCAP, I8MM and BF16
 * in AT_HWCAP2; the kernel sets them only for what the CPU has and the OS enables. */
#define CB_HWCAP_ASIMDDP (1ul << 20)
#define CB_HWCAP2_I8MM (1ul << 13)
#define CB_HWCAP2_BF16 (1ul << 14)
#endif

#ifdef CB_FEAT_X86
static unsigned xcr0(void) {
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return lo;
}

static int leaf7(unsigned sub, unsigned *a, unsigned *b, unsigned *c, unsigned *d) {
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, sub, *a, *b, *c, *d);
    return 1;
}
#endif

static unsigned probe(void) {
    unsigned f = 0;
#ifdef CB_FEAT_X86
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    int fma = (c >> 12) & 1u, f16c = (c >> 29) & 1u, osxsave = (c >> 27) & 1u, avx = (c >> 28) & 1u;
    unsigned x = osxsave ? xcr0() : 0;
    int os_ymm = (x & 0x6u) == 0x6u, os_zmm = (x & 0xe6u) == 0xe6u;
    unsigned b0 = 0, c0 = 0, a1 = 0, t;
    if (leaf7(0, &t, &b0, &c0, &d)) leaf7(1, &a1, &t, &t, &t);
    if (avx && os_ymm && fma && f16c && ((b0 >> 5) & 1u)) f |= CB_CPU_AVX2;
    if (os_zmm && ((b0 >> 16) & 1u)) f |= CB_CPU_AVX512F;
    if ((f & CB_CPU_AVX512F) && ((b0 >> 30) & 1u) && ((b0 >> 31) & 1u) && ((c0 >> 11) & 1u))
        f |= CB_CPU_AVX512VNNI;
    if ((f & CB_CPU_AVX2) && ((a1 >> 4) & 1u)) f |= CB_CPU_AVXVNNI;
    if ((f & CB_CPU_AVX512VNNI) && ((a1 >> 5) & 1u)) f |= CB_CPU_AVX512BF16;
    unsigned vendor[4] = {0}, fam = (a >> 8) & 0xFu;
    if (fam == 0xF) fam += (a >> 20) & 0xFFu; /* the extended family */
    __get_cpuid(0, &t, &vendor[0], &vendor[2], &vendor[1]);
    if (vendor[0] == 0x68747541u && vendor[1] == 0x69746E65u && vendor[2] == 0x444D4163u && fam >= 0x1A)
        f |= CB_CPU_STREAM_NTA; /* "AuthenticAMD", Zen 5 and later */
#endif
#if defined(__aarch64__)
    f |= CB_CPU_NEON;
#if defined(__linux__)
    unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    if (hw & CB_HWCAP_ASIMDDP) f |= CB_CPU_DOTPROD;
    if ((f & CB_CPU_DOTPROD) && (hw2 & CB_HWCAP2_I8MM)) f |= CB_CPU_I8MM;
    if ((f & CB_CPU_I8MM) && (hw2 & CB_HWCAP2_BF16)) f |= CB_CPU_ARM_BF16;
#endif
#endif
    return f;
}

static pthread_once_t feat_once = PTHREAD_ONCE_INIT;
static unsigned feat;
unsigned char cb_cpu_stream_nta_flag;
static void feat_init(void) {
    feat = probe();
    __atomic_store_n(&cb_cpu_stream_nta_flag, (feat & CB_CPU_STREAM_NTA) != 0, __ATOMIC_RELAXED);
}

unsigned cb_cpu_features(void) {
    pthread_once(&feat_once, feat_init);
    return feat;
}

#if defined(CB_FEAT_X86) && defined(__linux__)
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
static int amx_probe(void) {
    unsigned a, b, c, d;
    if (!cb_cpu_has(CB_CPU_AVX512F) || __get_cpuid_max(0, NULL) < 0xd) return 0;
    if (!leaf7(0, &a, &b, &c, &d) || !((b >> 30) & 1u)) return 0; /* AVX512BW */
    if (!((d >> 24) & 1u) || !((d >> 22) & 1u)) return 0;        /* AMX-TILE, AMX-BF16 */
    /* the tile data state: the kernel enables it per process on request (Linux 5.16+) */
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 0;
    return ((xcr0() >> 17) & 3u) == 3u; /* XTILECFG, XTILEDATA */
}
#else
static int amx_probe(void) { return 0; }
#endif

static pthread_once_t amx_once = PTHREAD_ONCE_INIT;
static int amx_ok;
static void amx_init(void) { amx_ok = amx_probe(); }

int cb_cpu_amx(void) {
    pthread_once(&amx_once, amx_init);
    return amx_ok;
}
