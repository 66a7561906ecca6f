/*
 * fast.c — the reference kernels of the fast numeric mode (fast.h: the definition they
 * implement in plain C, one (row, token) at a time), cb_round_bf16, and the run-time choice
 * of the fast table.
 */
#include "cpu/fast.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* Columns per pass of the reference (a multiple of every block size). */
#define REF_KC 2048

/* Branch-free, so that the compiler vectorizes it (it runs on every activation entering a
 * BF16 matmul in fast mode); the magnitude compare is signed-safe (both sides < 2^31). */
void cb_round_bf16(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], 4);
        uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
        u = (int32_t)(u & 0x7fffffffu) > (int32_t)0x7f800000 ? u : r; /* nan stays nan */
        memcpy(&x[i], &u, 4);
    }
}

void cb_round_bf16_cols(float *h, int64_t R, int64_t I, int64_t i0, int64_t i1) {
    for (int64_t r = 0; r < R; r++) cb_round_bf16(h + r * I + i0, i1 - i0);
}

/* One (row, token) dot over columns k0 .. k0 + kc, continuing the chain acc. */
static float ref_chain(float acc, const uint8_t *u, const float *ws, const float *wm, const int8_t *q,
                       const cb_fast_ablk *a, int64_t kc, int64_t G) {
    for (int64_t g = 0; g < kc / G; g++) {
        int32_t isum = 0;
        for (int64_t i = 0; i < G; i++) isum += (int32_t)u[g * G + i] * (int32_t)q[g * G + i];
        const cb_fast_ablk *b = &a[g * G / 32];
        float ds = G == 32 ? b->ds32 : b->ds16[g & 1];
        acc = cb_fast_step(acc, isum, ws[g], wm[g], b->d, ds);
    }
    return acc;
}

static void matmul_ld_ref(float *y, int64_t ldy, const float *x, const void *w, uint32_t dt, int64_t T,
                          int64_t N, int64_t K) {
    size_t rb = (size_t)cb_row_bytes(dt, (uint64_t)K);
    int64_t G = cb_fast_group(dt);
    uint8_t u[REF_KC];
    float ws[REF_KC / 16], wm[REF_KC / 16];
    int8_t q[REF_KC];
    cb_fast_ablk a[REF_KC / 32];
    for (int64_t t = 0; t < T; t++)
        for (int64_t n = 0; n < N; n++) y[t * ldy + n] = 0.0f;
    for (int64_t k0 = 0; k0 < K; k0 += REF_KC) {
        int64_t kc = K - k0 < REF_KC ? K - k0 : REF_KC;
        for (int64_t t = 0; t < T; t++) {
            cb_fast_quant_act(x + t * K + k0, kc, q, a);
            for (int64_t n = 0; n < N; n++) {
                cb_fast_unpack((const uint8_t *)w + (size_t)n * rb, dt, k0, kc, u, ws, wm);
                y[t * ldy + n] = ref_chain(y[t * ldy + n], u, ws, wm, q, a, kc, G);
            }
        }
    }
}

/* Intermediate columns per pass of the gate/up reference. */
#define REF_GU_COLS 16

static void gateup_ref(float *h, const float *x, const void *gate, const void *up, uint32_t dt, int64_t R,
                       int64_t H, int64_t I, int64_t i0, int64_t i1) {
    size_t rb = (size_t)cb_row_bytes(dt, (uint64_t)H);
    float g[REF_GU_COLS], v[REF_GU_COLS];
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = i0; c < i1; c += REF_GU_COLS) {
            int64_t n = i1 - c < REF_GU_COLS ? i1 - c : REF_GU_COLS;
            matmul_ld_ref(g, n, x + r * H, (const uint8_t *)gate + (size_t)c * rb, dt, 1, n, H);
            matmul_ld_ref(v, n, x + r * H, (const uint8_t *)up + (size_t)c * rb, dt, 1, n, H);
            for (int64_t i = 0; i < n; i++) h[r * I + c + i] = cb_fast_silu_mul(g[i], v[i]);
        }
}

static const cb_fast_kernels fast_ref = {
    .name = "reference",
    .bf16 = "f32",
    .native_bf16 = 0,
    .matmul_ld = matmul_ld_ref,
    .gateup = gateup_ref,
};

const cb_fast_kernels *cb_fast_ref(void) { return &fast_ref; }

/* ---- run-time dispatch ---- */

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <cpuid.h>
#define CB_FAST_X86 1
/* CPUID leaf 7 sub-leaf 0 (EBX, ECX) and sub-leaf 1 (EAX): AVX512_VNNI is ECX bit 11,
 * AVX512BW EBX bit 30, AVX512VL EBX bit 31, AVX-VNNI sub-leaf 1 EAX bit 4, AVX512_BF16
 * sub-leaf 1 EAX bit 5 (older compilers' __builtin_cpu_supports know none of the last). */
static int leaf7(unsigned sub, unsigned *a, unsigned *b, unsigned *c, unsigned *d) {
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, sub, *a, *b, *c, *d);
    return 1;
}
/* The OS saves the ZMM (and opmask) state: XCR0 bits 1, 2, 5, 6, 7. */
static int os_zmm(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1u)) return 0; /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo & 0xe6u) == 0xe6u;
}
#endif

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
/* Linux's AArch64 HWCAP bits (asm/hwcap.h): ASIMDDP (SDOT/UDOT) in AT_HWCAP, I8MM in
 * AT_HWCAP2; the kernel sets them only for what the CPU has and the OS enables. */
#define CB_HWCAP_ASIMDDP (1ul << 20)
#define CB_HWCAP2_I8MM (1ul << 13)
#define CB_HWCAP2_BF16 (1ul << 14)
static int cpu_dotprod(void) { return (getauxval(AT_HWCAP) & CB_HWCAP_ASIMDDP) != 0; }
static int cpu_i8mm(void) { return cpu_dotprod() && (getauxval(AT_HWCAP2) & CB_HWCAP2_I8MM) != 0; }
static int cpu_arm_bf16(void) { return cpu_i8mm() && (getauxval(AT_HWCAP2) & CB_HWCAP2_BF16) != 0; }
#else
static int cpu_dotprod(void) { return 0; }
static int cpu_i8mm(void) { return 0; }
static int cpu_arm_bf16(void) { return 0; }
#endif

static int cpu_avx2(void) {
#ifdef CB_FAST_X86
    __builtin_cpu_init();
    unsigned a, b, c, d;
    int f16c = __get_cpuid(1, &a, &b, &c, &d) && ((c >> 29) & 1u);
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
#else
    return 0;
#endif
}

static int cpu_avxvnni(void) {
#ifdef CB_FAST_X86
    unsigned a, b, c, d;
    return cpu_avx2() && leaf7(1, &a, &b, &c, &d) && ((a >> 4) & 1u);
#else
    return 0;
#endif
}

static int cpu_avx512vnni(void) {
#ifdef CB_FAST_X86
    unsigned a, b, c, d;
    if (!cpu_avx2() || !os_zmm() || !__builtin_cpu_supports("avx512f") || !leaf7(0, &a, &b, &c, &d)) return 0;
    return ((b >> 30) & 1u) && ((b >> 31) & 1u) && ((c >> 11) & 1u);
#else
    return 0;
#endif
}

static int cb_fast_cpu_bf16(void) {
#ifdef CB_FAST_X86
    unsigned a, b, c, d;
    return cpu_avx512vnni() && leaf7(1, &a, &b, &c, &d) && ((a >> 5) & 1u);
#else
    return 0;
#endif
}

/* An int8 table's kernels with native BF16 ones (cb_fast_kernels.native_bf16): the
 * avx512vnni table with "avx512vnni-amx" on AMX tiles (fast_amx.c) or "avx512bf16" on
 * vdpbf16ps (fast_bf16dp.c); the neon-i8mm table with "neon-bf16" on BFDOT
 * (fast_neon_bf16.c). One definition of the table and its two dispatching entries per BF16
 * back end. */
#define CB_FAST_BF16_TABLE(TAB, INT8, NAME, BF16NAME, P, PART, ATT, ATT_BYTES, PANELS)                                \
    static void TAB##_matmul_ld(float *y, int64_t ldy, const float *x, const void *w, uint32_t dt, int64_t T,   \
                                int64_t N, int64_t K) {                                                         \
        if (dt == COLIBRI_DTYPE_BF16) P##_matmul_ld(y, ldy, x, w, T, N, K);                                     \
        else INT8()->matmul_ld(y, ldy, x, w, dt, T, N, K);                                                      \
    }                                                                                                            \
    static void TAB##_gateup(float *h, const float *x, const void *gate, const void *up, uint32_t dt, int64_t R, \
                             int64_t H, int64_t I, int64_t i0, int64_t i1) {                                    \
        if (dt == COLIBRI_DTYPE_BF16) P##_gateup_split(h, x, gate, up, R, H, I, i0, i1);                       \
        else INT8()->gateup(h, x, gate, up, dt, R, H, I, i0, i1);                                               \
    }                                                                                                            \
    static const cb_fast_kernels TAB = {.name = NAME,                                                           \
                                        .bf16 = BF16NAME,                                                       \
                                        .native_bf16 = 1,                                                       \
                                        .matmul_ld = TAB##_matmul_ld,                                           \
                                        .gateup = TAB##_gateup,                                                 \
                                        .gateup_packed = P##_gateup_packed,                                     \
                                        .down_packed = P##_down_packed,                                         \
                                        .down_part = PART,                                                      \
                                        .attention_heads = ATT,                                                 \
                                        .att_work_bytes = ATT_BYTES,                                            \
                                        .panels = PANELS}
_Static_assert(CB_PANEL_ROWS <= CB_PANEL_MAX_ROWS && 2 * CB_PANEL_UNITS <= CB_PANEL_MAX_ROWS, "the packers' row pointers");
const cb_panel_kernels cb_bf16dp_panels = {.name = "avx512bf16",
                                          .rows = CB_PANEL_ROWS,
                                          .units = CB_PANEL_UNITS,
                                          .gu_rows = 2 * CB_PANEL_UNITS,
                                          .down_cols = CB_PANEL_DOWN_COLS,
                                          .down_layout = CB_PANEL_DOWN_PAIRS,
                                          .matmul_panels = cb_bf16dp_matmul_panels,
                                          .gateup_panels = cb_bf16dp_gateup_panels,
                                          .down_panels = cb_bf16dp_down_panels,
                                          .down_part_panels = cb_bf16dp_down_part_panels};
CB_FAST_BF16_TABLE(fast_amx, cb_fast_avx512vnni, "avx512vnni", "amx", cb_amx, NULL, cb_fast_att_avx512,
                   cb_fast_att_avx512_bytes, NULL);
CB_FAST_BF16_TABLE(fast_bf16dp, cb_fast_avx512vnni, "avx512vnni", "avx512bf16", cb_bf16dp, cb_bf16dp_down_part,
                   cb_fast_att_avx512, cb_fast_att_avx512_bytes, &cb_bf16dp_panels);
CB_FAST_BF16_TABLE(fast_neonbf16, cb_fast_neon_i8mm, "neon-i8mm", "bfdot", cb_neonbf16, NULL, NULL, NULL, NULL);

static pthread_once_t amx_once = PTHREAD_ONCE_INIT;
static int amx_ok;
static void amx_probe(void) { amx_ok = cpu_avx512vnni() && cb_fast_avx512vnni() && cb_amx_usable(); }

const cb_fast_kernels *cb_fast_by_name(const char *name) {
    if (!name) return NULL;
    if (strcmp(name, "ref") == 0 || strcmp(name, "reference") == 0) return &fast_ref;
    if (strcmp(name, "avx2") == 0) return cpu_avx2() ? cb_fast_avx2() : NULL;
    if (strcmp(name, "neon") == 0) return cb_fast_neon(); /* NULL off AArch64 */
    if (strcmp(name, "neon-dotprod") == 0) return cpu_dotprod() ? cb_fast_neon_dotprod() : NULL;
    if (strcmp(name, "neon-i8mm") == 0) return cpu_i8mm() ? cb_fast_neon_i8mm() : NULL;
    if (strcmp(name, "neon-bf16") == 0)
        return cpu_arm_bf16() && cb_fast_neon_i8mm() && cb_neonbf16_built() ? &fast_neonbf16 : NULL;
    if (strcmp(name, "avxvnni") == 0) return cpu_avxvnni() ? cb_fast_avxvnni() : NULL;
    if (strcmp(name, "avx512vnni") == 0) return cpu_avx512vnni() ? cb_fast_avx512vnni() : NULL;
    if (strcmp(name, "avx512bf16") == 0) return cb_fast_cpu_bf16() && cb_fast_avx512vnni() && cb_bf16dp_built() ? &fast_bf16dp : NULL;
    if (strcmp(name, "avx512vnni-amx") == 0) {
        pthread_once(&amx_once, amx_probe);
        return amx_ok ? &fast_amx : NULL;
    }
    return NULL;
}

const cb_fast_kernels *cb_fast_best(void) {
    const cb_fast_kernels *f = cb_fast_by_name(getenv("COLIBRI_FAST_KERNELS"));
    if (f) return f;
    /* avx512vnni-amx first: its BF16 prefill is several times the f32 kernels', its decode
     * slower (docs/performance.md, the Xeon figures; COLIBRI_FAST_KERNELS=avx512vnni keeps BF16
     * on the f32 kernels) */
    if ((f = cb_fast_by_name("avx512vnni-amx")) != NULL) return f;
    /* then avx512bf16 (AVX512_BF16 without AMX: AMD Zen 4/5): vdpbf16ps does twice the
     * multiply-adds of an f32 FMA there (the Zen 4 figures: docs/performance.md) */
    if ((f = cb_fast_by_name("avx512bf16")) != NULL) return f;
    if ((f = cb_fast_by_name("avx512vnni")) != NULL) return f;
    if ((f = cb_fast_by_name("avxvnni")) != NULL) return f;
    if ((f = cb_fast_by_name("avx2")) != NULL) return f;
    /* BFDOT does twice the multiply-adds of an FMLA per instruction (on Neoverse V1/N2/V2
     * and Cortex-A710/X2 alike, per Arm's optimization guides; not measured here: no ARM
     * hardware, only qemu) */
    if ((f = cb_fast_by_name("neon-bf16")) != NULL) return f;
    if ((f = cb_fast_by_name("neon-i8mm")) != NULL) return f;
    if ((f = cb_fast_by_name("neon-dotprod")) != NULL) return f;
    if ((f = cb_fast_by_name("neon")) != NULL) return f;
    return &fast_ref;
}
