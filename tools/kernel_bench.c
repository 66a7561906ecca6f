/*
 * kernel_bench.c — the weight kernels alone, one thread, on the 791 M Mixtral's shapes
 * (hidden 1024, intermediate 3584): GFLOP/s of the prefill kernels (a packed bf16 expert's
 * gate/up and down, row-major and as fast mode's panel copy; a 3584 x 1024 matmul) at 1 ..
 * 512 tokens, and GB/s of the one-token decode streaming 72 to 256 MiB of bf16, Q8_0, Q4_K
 * and Q6_K weights from memory, for the exact table (cb_kernels_best) beside a fast table
 * (cb_fast_by_name, default: cb_fast_best's); G weights/s of the one-token decode of every
 * int8-path type: the fast table's, row-major and on its interleaved copy (cpu/qpanel.h),
 * and the exact table's; and G multiply-adds/s of the fast table's prefill of those types
 * on the copy (weights in cache). Best of a few runs; the prefill's weights are reused
 * (they sit in L2/L3), the decode's are not.
 * Numbers for docs/kernels.md; the engine's own figures come from colibri_bench.
 *
 *   cmake -S native -B build/bench -DCMAKE_BUILD_TYPE=Release && cmake --build build/bench -j
 *   gcc -O2 -Inative/src -Inative/include tools/kernel_bench.c build/bench/libcolibri.a \
 *       -lm -lpthread -o /tmp/kernel_bench && /tmp/kernel_bench [FAST_TABLE]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/dtype.h"
#include "cpu/fast.h"
#include "cpu/kernels.h"
#include "cpu/registry.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t next(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}
static void *alloc(size_t n) { return aligned_alloc(1 << 21, (n + (1 << 21) - 1) >> 21 << 21); }
/* bf16 weights in [-0.05, 0.05], activations in [-1, 1] rounded to bf16 (as fast mode's) */
static uint16_t *bf16_weights(size_t n) {
    uint16_t *w = alloc(n * 2);
    for (size_t i = 0; i < n; i++) w[i] = cb_f32_to_bf16(((float)(next() % 2001) - 1000.0f) * 5e-5f);
    return w;
}
static float *acts(size_t n) {
    float *x = alloc(n * 4);
    for (size_t i = 0; i < n; i++) x[i] = ((float)(next() % 2001) - 1000.0f) * 1e-3f;
    cb_round_bf16(x, (int64_t)n);
    return x;
}

#define BEST(reps, best, call)                      \
    do {                                            \
        best = 1e30;                                \
        for (int r_ = 0; r_ < (reps); r_++) {       \
            double t_ = now();                      \
            call;                                   \
            t_ = now() - t_;                        \
            if (t_ < best) best = t_;               \
        }                                           \
    } while (0)

int main(int argc, char **argv) {
    const cb_kernels *E = cb_kernels_best();
    const cb_fast_kernels *F = argc > 1 ? cb_fast_by_name(argv[1]) : cb_fast_best();
    if (!F) {
        fprintf(stderr, "kernel_bench: fast table %s not usable on this CPU\n", argv[1]);
        return 2;
    }
    printf("exact table %s, fast table %s (int8) / %s (bf16)\n", E->name, F->name, F->bf16);
    const uint32_t BF = COLIBRI_DTYPE_BF16;
    const int64_t H = 1024, I = 3584, B = 32;
    uint16_t *ex = bf16_weights((size_t)3 * I * H);
    int fast_packed = cb_fast_takes_packed(F, BF, H, I);
    /* the expert's panel copies (cpu/panel.h), where a table reads one */
    const cb_panel_kernels *FP = F->panels, *EP = E->panels;
    void *fpan = NULL, *epan = NULL;
    if (FP) cb_panel_pack_expert(FP, fpan = alloc((size_t)3 * I * H * 2), ex, H, I, B);
    if (EP) cb_panel_pack_expert(EP, epan = alloc((size_t)3 * I * H * 2), ex, H, I, B);
    printf("\nprefill, a packed bf16 expert (H %lld, I %lld), GFLOP/s (fast | exact; each on its panel copy)\n",
           (long long)H, (long long)I);
    const int64_t Rs[] = {1, 4, 16, 64, 68, 128, 130, 136, 256}; /* and sizes that leave a partial vector */
    for (int ri = 0; ri < (int)(sizeof Rs / sizeof Rs[0]); ri++) {
        int64_t R = Rs[ri];
        float *x = acts((size_t)(R * H)), *h = acts((size_t)(R * I)), *y = acts((size_t)(R * H));
        int reps = R <= 4 ? 20 : 4;
        double fg = 0, fd = 0, eg, ed;
        if (fast_packed) {
            BEST(reps, fg, F->gateup_packed(h, x, ex, R, H, I, B, 0, I));
            BEST(reps, fd, F->down_packed(y, h, ex, R, H, I, 0, H));
        }
        double pg = 0, pd = 0, qg = 0, qd = 0;
        if (fpan) {
            BEST(reps, pg, FP->gateup_panels(h, x, fpan, R, H, I, 0, I));
            BEST(reps, pd, FP->down_panels(y, h, fpan, R, H, I, 0, H));
        }
        if (epan) {
            BEST(reps, qg, EP->gateup_panels(h, x, epan, R, H, I, 0, I));
            BEST(reps, qd, EP->down_panels(y, h, epan, R, H, I, 0, H));
        }
        BEST(reps, eg, E->expert_gateup(h, x, ex, NULL, BF, R, H, I, B, 0, I));
        BEST(reps, ed, E->expert_down(y, h, ex, BF, R, H, I, 0, H));
        double gu = 2.0 * R * H * 2 * I, dn = 2.0 * R * H * I;
        printf("R %4lld  gate/up %6.1f | %6.1f; %6.1f | %6.1f   down %6.1f | %6.1f; %6.1f | %6.1f\n", (long long)R,
               fg ? gu / fg / 1e9 : 0.0, gu / eg / 1e9, pg ? gu / pg / 1e9 : 0.0, qg ? gu / qg / 1e9 : 0.0,
               fd ? dn / fd / 1e9 : 0.0, dn / ed / 1e9, pd ? dn / pd / 1e9 : 0.0, qd ? dn / qd / 1e9 : 0.0);
        free(x), free(h), free(y);
    }
    printf("\nprefill, a %lld x %lld bf16 matmul, GFLOP/s (fast | exact; exact on its panel copy)\n", (long long)I,
           (long long)H);
    void *mpan = EP ? alloc((size_t)I * H * 2) : NULL;
    if (mpan) cb_panel_pack_matrix(EP, mpan, ex, I, H);
    const int64_t Ts[] = {1, 4, 5, 16, 64, 130, 512};
    for (int ti = 0; ti < (int)(sizeof Ts / sizeof Ts[0]); ti++) {
        int64_t T = Ts[ti];
        float *x = acts((size_t)(T * H)), *y = acts((size_t)(T * I));
        double tf = 0, te, tp = 0;
        if (cb_fast_takes(F, BF, H)) BEST(T <= 16 ? 20 : 3, tf, F->matmul_ld(y, I, x, ex, BF, T, I, H));
        BEST(T <= 16 ? 20 : 3, te, E->matmul_ld(y, I, x, ex, BF, T, I, H));
        if (mpan) BEST(T <= 16 ? 20 : 3, tp, EP->matmul_panels(y, I, x, mpan, T, I, H, 0, I));
        double fl = 2.0 * T * I * H;
        printf("T %4lld  %6.1f | %6.1f; %6.1f\n", (long long)T, tf ? fl / tf / 1e9 : 0.0, fl / te / 1e9,
               tp ? fl / tp / 1e9 : 0.0);
        free(x), free(y);
    }
    /* decode: one token through matrices of 128 Ki rows (more than any cache), once per run */
    printf("\ndecode, one token, weights streamed from memory, GB/s (fast | exact; bf16: each on its panel copy)\n");
    const uint32_t dts[] = {COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_Q8_0, COLIBRI_DTYPE_Q4_K, COLIBRI_DTYPE_Q6_K};
    const int64_t K = 1024, N = 131072;
    float *x = acts((size_t)K), *y = alloc((size_t)N * 4);
    for (int di = 0; di < 4; di++) {
        uint32_t dt = dts[di];
        size_t rb = (size_t)cb_row_bytes(dt, (uint64_t)K), n = (size_t)N * rb;
        uint8_t *w = alloc(n);
        if (dt == COLIBRI_DTYPE_BF16) {
            for (size_t i = 0; i < n / 2; i++) ((uint16_t *)w)[i] = cb_f32_to_bf16(((float)(next() % 2001) - 1000.0f) * 5e-5f);
        } else { /* random bytes; every block's f16 scales (d, and Q4_K's dmin) set to 2^-7 */
            size_t bs = dt == COLIBRI_DTYPE_Q8_0 ? 34 : dt == COLIBRI_DTYPE_Q4_K ? 144 : 210;
            size_t d = dt == COLIBRI_DTYPE_Q6_K ? 208 : 0; /* Q6_K's d is last */
            for (size_t i = 0; i < n; i++) w[i] = (uint8_t)next();
            for (size_t b = 0; b < n; b += bs) {
                w[b + d] = 0x00, w[b + d + 1] = 0x20;
                if (bs == 144) w[b + 2] = 0x00, w[b + 3] = 0x20;
            }
        }
        double tf = 0, te, pf = 0, pe = 0;
        if (cb_fast_takes(F, dt, K)) BEST(4, tf, F->matmul_ld(y, N, x, w, dt, 1, N, K));
        BEST(4, te, E->matmul_ld(y, N, x, w, dt, 1, N, K));
        printf("%-5s %6.1f | %6.1f", cb_dtype_name(dt), tf ? n / tf / 1e9 : 0.0, n / te / 1e9);
        if (dt == COLIBRI_DTYPE_BF16 && (FP || EP)) {
            void *p = alloc(n);
            if (FP) cb_panel_pack_matrix(FP, p, w, N, K);
            if (FP) BEST(4, pf, FP->matmul_panels(y, N, x, p, 1, N, K, 0, N));
            if (EP) cb_panel_pack_matrix(EP, p, w, N, K);
            if (EP) BEST(4, pe, EP->matmul_panels(y, N, x, p, 1, N, K, 0, N));
            printf("; %6.1f | %6.1f", pf ? n / pf / 1e9 : 0.0, pe ? n / pe / 1e9 : 0.0);
            free(p);
        }
        printf("\n");
        free(w);
    }
    free(x), free(y);
    /* the int8 types: one token through 32 Ki rows of 2048, the fast table's row-major kernel
     * and, where it has them, its kernels on the interleaved copy (cpu/qpanel.h), alternating */
    const uint32_t qts[] = {COLIBRI_DTYPE_Q8_0, COLIBRI_DTYPE_Q4_K, COLIBRI_DTYPE_Q5_K, COLIBRI_DTYPE_Q6_K,
                            COLIBRI_DTYPE_Q4_0, COLIBRI_DTYPE_Q4_1, COLIBRI_DTYPE_Q5_0, COLIBRI_DTYPE_Q5_1,
                            COLIBRI_DTYPE_Q2_K, COLIBRI_DTYPE_Q3_K, COLIBRI_DTYPE_IQ4_NL, COLIBRI_DTYPE_IQ4_XS};
    const int64_t K8 = 2048, N8 = 32768;
    printf("\ndecode, one token, %lld x %lld int8-path weights from memory, G weights/s (fast row-major | on "
           "the interleaved copy | exact)\n", (long long)N8, (long long)K8);
    x = acts((size_t)K8), y = alloc((size_t)N8 * 4);
    for (size_t qi = 0; qi < sizeof qts / sizeof qts[0]; qi++) {
        uint32_t dt = qts[qi];
        size_t n = (size_t)N8 * (size_t)cb_row_bytes(dt, (uint64_t)K8);
        uint8_t *w = alloc(n), *c = F->qpanels ? alloc((size_t)N8 * cb_qpanel_row_bytes(dt, (uint64_t)K8)) : NULL;
        for (size_t i = 0; i < n; i++) w[i] = (uint8_t)(next() & 0x3f); /* every f16 scale finite, below 2 */
        if (c) cb_qpanel_pack(c, w, dt, N8, K8);
        double tr = 1e30, tc = 1e30, te = 1e30;
        for (int r = 0; r < 5; r++) {
            double t = now();
            F->matmul_ld(y, N8, x, w, dt, 1, N8, K8);
            t = now() - t;
            if (t < tr) tr = t;
            t = now();
            E->matmul_ld(y, N8, x, w, dt, 1, N8, K8);
            t = now() - t;
            if (t < te) te = t;
            if (!c) continue;
            t = now();
            F->qpanels->matmul(y, N8, x, c, dt, 1, N8, K8);
            t = now() - t;
            if (t < tc) tc = t;
        }
        printf("%-6s %6.1f | %6.1f | %6.1f\n", cb_dtype_name(dt), (double)(N8 * K8) / tr / 1e9,
               c ? (double)(N8 * K8) / tc / 1e9 : 0.0, (double)(N8 * K8) / te / 1e9);
        free(w), free(c);
    }
    free(x), free(y);
    /* the int8 types' prefill: 64 tokens through a 256 x 1024 interleaved copy (in L2), the
     * fast table's micro-kernel and its panel unpacking, G multiply-adds/s */
    if (F->qpanels) {
        const int64_t Np = 256, Kp = 1024, Tp = 64;
        printf("\nprefill, %lld tokens, a %lld x %lld interleaved copy in cache, G multiply-adds/s\n", (long long)Tp,
               (long long)Np, (long long)Kp);
        x = acts((size_t)(Tp * Kp)), y = alloc((size_t)(Tp * Np) * 4);
        for (size_t qi = 0; qi < sizeof qts / sizeof qts[0]; qi++) {
            uint32_t dt = qts[qi];
            size_t n = (size_t)Np * (size_t)cb_row_bytes(dt, (uint64_t)Kp);
            uint8_t *w = alloc(n), *c = alloc((size_t)Np * cb_qpanel_row_bytes(dt, (uint64_t)Kp));
            for (size_t i = 0; i < n; i++) w[i] = (uint8_t)(next() & 0x3f);
            cb_qpanel_pack(c, w, dt, Np, Kp);
            double t;
            BEST(9, t, F->qpanels->matmul(y, Np, x, c, dt, Tp, Np, Kp));
            printf("%-6s %6.1f\n", cb_dtype_name(dt), (double)(Tp * Np * Kp) / t / 1e9);
            free(w), free(c);
        }
        free(x), free(y);
    }
    return 0;
}
