/*
 * tools/mma_bench.cu — the fast-precision tensor-core products (native/src/backend/cuda/
 * cuda_mma.cuh) alone, over tile shapes, on Mixtral-8x7B's expert and projection sizes:
 * time (CUDA events, median of 10 after 3 warm-ups), TFLOP/s and weight GB/s, and whether
 * every shape gives the same bits as the first (the header's claim). Build (tools/README.md):
 *
 *   nvcc -O3 -std=c++17 -arch=sm_90 -Inative/src -o build/mma_bench tools/mma_bench.cu
 *   build/mma_bench
 */
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "backend/cuda/cuda_mma.cuh"

#define CK(x)                                                                                                         \
    do {                                                                                                              \
        cudaError_t e_ = (x);                                                                                         \
        if (e_ != cudaSuccess) {                                                                                      \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));                      \
            exit(1);                                                                                                  \
        }                                                                                                             \
    } while (0)

struct Shape {
    const char *name;
    int gu;            /* gate/up form */
    int64_t groups;    /* experts (tab) or 0 (one dense weight) */
    int64_t rows;      /* rows in all (grouped: split over the groups as a router would) */
    int64_t N, K;
};

typedef void (*launch_fn)(const cm_args &, int64_t rows_bound, int64_t groups, cudaStream_t);

template <int BM, int BN, int BK, int WM, int WN, int ST, int GU>
static void launch(const cm_args &a, int64_t rows_bound, int64_t groups, cudaStream_t s) {
    constexpr int NT = (BM / WM) * (BN / WN) * 32;
    static bool set = false;
    size_t smem = CM_SMEM(BM, BN, BK, ST);
    if (!set) {
        CK(cudaFuncSetAttribute(k_mma<BM, BN, BK, WM, WN, ST, GU>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)smem));
        set = true;
    }
    dim3 g((unsigned)((rows_bound + BM - 1) / BM), (unsigned)((a.N + (GU ? BN / 2 : BN) - 1) / (GU ? BN / 2 : BN)),
           (unsigned)groups);
    k_mma<BM, BN, BK, WM, WN, ST, GU><<<g, NT, smem, s>>>(a);
}

struct Cfg {
    const char *name;
    launch_fn f[2];
    int small;
};

#define CFG(BM, BN, BK, WM, WN, ST, SMALL)                                                                            \
    {#BM "x" #BN "x" #BK " w" #WM "x" #WN " s" #ST, {launch<BM, BN, BK, WM, WN, ST, 0>, launch<BM, BN, BK, WM, WN, ST, 1>}, SMALL}

static const Cfg cfgs[] = {
    CFG(16, 32, 128, 16, 16, 4, 1),   CFG(16, 64, 128, 16, 16, 4, 1), CFG(16, 32, 64, 16, 16, 6, 1),
    CFG(16, 16, 128, 16, 16, 4, 1),   CFG(128, 128, 32, 64, 32, 4, 0), CFG(64, 128, 64, 32, 64, 3, 0),
    CFG(128, 128, 64, 64, 64, 3, 0),  CFG(128, 256, 32, 64, 64, 3, 0), CFG(64, 128, 32, 32, 64, 4, 0),
    CFG(64, 256, 32, 64, 64, 4, 0),   CFG(128, 128, 32, 32, 64, 4, 0), CFG(64, 64, 64, 32, 32, 4, 0),
};

static uint16_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 10;
    const int64_t H = 4096, I = 14336, E = 8;
    const Shape shapes[] = {
        {"experts gate/up, 1024 rows / 8 groups", 1, E, 1024, I, H},
        {"experts down,    1024 rows / 8 groups", 0, E, 1024, H, I},
        {"q projection,     512 rows", 0, 0, 512, 4096, H},
        {"experts gate/up, 1 row x 2 groups", 1, E, 2, I, H},
        {"experts down,    1 row x 2 groups", 0, E, 2, H, I},
        {"q projection,     1 row", 0, 0, 1, 4096, H},
        {"k projection,     1 row", 0, 0, 1, 1024, H},
        {"lm head,          1 row", 0, 0, 1, 32000, H},
        {"experts gate/up, 32 rows / 8 groups", 1, E, 32, I, H},
    };
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    /* weights: E experts of gate [I, H], up [I, H], down [H, I]; the dense weight [32000, H] */
    const size_t wexp = (size_t)3 * I * H;
    std::vector<uint16_t> hw(wexp);
    srand(1);
    for (size_t i = 0; i < wexp; i++) hw[i] = bf16_bits(((rand() & 0xffff) / 65536.0f - 0.5f) * 0.04f);
    uint16_t *dw;
    CK(cudaMalloc(&dw, wexp * 2 * E));
    for (int64_t e = 0; e < E; e++) CK(cudaMemcpy(dw + e * wexp, hw.data(), wexp * 2, cudaMemcpyHostToDevice));
    std::vector<const void *> htab(3 * E);
    for (int64_t e = 0; e < E; e++) {
        htab[3 * e] = dw + e * wexp;
        htab[3 * e + 1] = dw + e * wexp + (size_t)I * H;
        htab[3 * e + 2] = dw + e * wexp + (size_t)2 * I * H;
    }
    const void **dtab;
    CK(cudaMalloc(&dtab, 3 * E * sizeof(void *)));
    CK(cudaMemcpy(dtab, htab.data(), 3 * E * sizeof(void *), cudaMemcpyHostToDevice));
    const int64_t maxrows = 1024, maxk = I;
    std::vector<uint16_t> hx((size_t)maxrows * maxk);
    for (auto &v : hx) v = bf16_bits(((rand() & 0xffff) / 65536.0f - 0.5f) * 2.0f);
    __nv_bfloat16 *dx, *dyb;
    float *dy, *dy0;
    CK(cudaMalloc(&dx, hx.size() * 2));
    CK(cudaMemcpy(dx, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&dy, (size_t)maxrows * 32000 * 4));
    CK(cudaMalloc(&dy0, (size_t)maxrows * 32000 * 4));
    CK(cudaMalloc(&dyb, (size_t)maxrows * I * 2));
    int64_t *doff;
    CK(cudaMalloc(&doff, (E + 1) * sizeof(int64_t)));
    int dev;
    cudaDeviceProp prop;
    CK(cudaGetDevice(&dev));
    CK(cudaGetDeviceProperties(&prop, dev));
    printf("%s, %d SMs; median of %d; bits: every shape against the first of its kind\n", prop.name,
           prop.multiProcessorCount, reps);
    for (const Shape &sh : shapes) {
        /* groups: rows spread as a random top-2 router would (decode: 2 groups of 1 row) */
        std::vector<int64_t> off(E + 1, 0);
        int64_t bound = sh.rows, groups = 1;
        if (sh.groups) {
            groups = E;
            std::vector<int64_t> cnt(E, 0);
            if (sh.rows == 2) {
                cnt[1] = cnt[5] = 1;
            } else {
                for (int64_t t = 0; t < sh.rows / 2; t++) {
                    int a = rand() % E, b = (a + 1 + rand() % (E - 1)) % E;
                    cnt[a]++;
                    cnt[b]++;
                }
            }
            bound = 0;
            for (int64_t e = 0; e < E; e++) {
                off[e + 1] = off[e] + cnt[e];
                bound = std::max(bound, cnt[e]);
            }
            bound = std::min<int64_t>(bound == 1 ? 1 : sh.rows / 2, sh.rows);
            CK(cudaMemcpy(doff, off.data(), (E + 1) * sizeof(int64_t), cudaMemcpyHostToDevice));
        }
        cm_args a;
        memset(&a, 0, sizeof a);
        a.x = dx;
        a.ldx = sh.K;
        a.tab = sh.groups ? dtab : NULL;
        a.which = sh.gu ? 0 : 2;
        a.w = sh.groups ? NULL : (const uint8_t *)dw;
        a.off = sh.groups ? doff : NULL;
        a.rows = sh.rows;
        a.N = sh.N;
        a.K = sh.K;
        a.rb = (uint64_t)sh.K * 2;
        a.y = dy;
        a.ldy = sh.N;
        a.yb = sh.gu ? dyb : NULL;
        a.ldyb = sh.N;
        int64_t real_rows = sh.groups ? off[E] : sh.rows;
        int64_t used_groups = 0;
        for (int64_t e = 0; e < E; e++) used_groups += sh.groups ? off[e + 1] > off[e] : 0;
        double flop = 2.0 * real_rows * sh.N * sh.K * (sh.gu ? 2 : 1);
        double wbytes = (double)(sh.groups ? used_groups : 1) * sh.N * sh.K * 2 * (sh.gu ? 2 : 1);
        printf("\n%s (N %lld, K %lld; %.1f GFLOP, %.0f MB of weights)\n", sh.name, (long long)sh.N,
               (long long)sh.K, flop / 1e9, wbytes / 1e6);
        size_t ybytes = (size_t)real_rows * sh.N * 4;
        int first = 1;
        for (const Cfg &c : cfgs) {
            if (c.small != (bound <= 32)) continue;
            CK(cudaMemset(dy, 0xff, ybytes));
            c.f[sh.gu](a, bound, groups, st);
            CK(cudaGetLastError());
            CK(cudaStreamSynchronize(st));
            if (first) CK(cudaMemcpy(dy0, dy, ybytes, cudaMemcpyDeviceToDevice));
            std::vector<float> t(reps);
            for (int i = 0; i < 3; i++) c.f[sh.gu](a, bound, groups, st);
            for (int i = 0; i < reps; i++) {
                CK(cudaEventRecord(e0, st));
                c.f[sh.gu](a, bound, groups, st);
                CK(cudaEventRecord(e1, st));
                CK(cudaEventSynchronize(e1));
                CK(cudaEventElapsedTime(&t[i], e0, e1));
            }
            std::sort(t.begin(), t.end());
            double ms = t[reps / 2];
            std::vector<uint32_t> y0(ybytes / 4), y1(ybytes / 4);
            CK(cudaMemcpy(y0.data(), dy0, ybytes, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(y1.data(), dy, ybytes, cudaMemcpyDeviceToHost));
            size_t diff = 0;
            for (size_t i = 0; i < y0.size(); i++) diff += y0[i] != y1[i];
            printf("  %-28s %9.1f us  %7.1f TFLOP/s  %7.0f GB/s  %s\n", c.name, ms * 1e3, flop / ms / 1e9,
                   wbytes / ms / 1e6, diff ? "BITS DIFFER" : (first ? "(reference)" : "same bits"));
            if (diff) printf("    %zu of %zu outputs differ\n", diff, y0.size());
            first = 0;
        }
    }
    return 0;
}
