/*
 * cuda_mma.cuh — the CUDA backend's fast-precision weight products (docs/backends.md, "Fast
 * precision"): bf16 weights times activations rounded to bf16 on the tensor cores
 * (mma.sync m16n8k16, f32 accumulation), for the dense projections, the LM head and the
 * grouped expert FFN (every non-empty group of a layer in one launch; the group offsets are
 * read on the device, so the launches are captured in the decode graphs as they are).
 *
 * The definition: output element (r, n) is one chain of m16n8k16 products over k16 steps in
 * ascending k, starting from zero; rows and columns past the ends are zeros. A tensor core
 * computes an output element from its own A row and B column alone, so the tile shapes below
 * (BM x BN x BK) only decide how many rows and columns share the loads: every shape gives the
 * same bits for a row, whatever else is in its tile, its group or its batch.
 *
 * Layouts: A is bf16 rows (ldx elements apart, 16-byte aligned); B is the weight's rows
 * [N, K] (K contiguous, the mapping's layout); K % 8 == 0 (16-byte chunks). Tiles go through
 * shared memory with cp.async (zero-filled past the ends) in an ST-stage ring; fragments are
 * read with ldmatrix from rows padded by 8 elements (no bank conflicts).
 *
 * The gate/up form (GU) puts the gate rows and the up rows of the same 8 intermediate columns
 * in adjacent n8 tiles, so one thread holds g and u of an output and writes silu(g) * u: as
 * f32 (the stage tensor ex_h / ffn_h) and rounded to bf16 (the down product's A).
 */
#ifndef COLIBRI_CUDA_MMA_CUH
#define COLIBRI_CUDA_MMA_CUH

#include <cuda_bf16.h>
#include <stdint.h>

struct cm_args {
    const __nv_bfloat16 *x; /* A: bf16 rows */
    int64_t ldx;
    const uint8_t *w;        /* B without groups: the weight [N, K] */
    const void *const *tab;  /* B with groups: tab[3e + which] (dffn tables; tab[3e] NULL: not resident) */
    int which;
    int packed;              /* GU: the packed layout (blocks of B gate rows then B up rows) */
    int64_t B;
    const int64_t *off;      /* group e's rows [off[e], off[e+1]); NULL: one group [0, rows) */
    int64_t rows;
    int64_t N, K;            /* output columns (GU: the intermediate size), reduction length */
    uint64_t rb;             /* bytes per weight row */
    float *y;                /* f32 output [rows, ldy] */
    int64_t ldy;
    __nv_bfloat16 *yb;       /* GU: h rounded to bf16 [rows, ldyb] (NULL: none) */
    int64_t ldyb;
    /* several weights over the same rows in one launch (no groups): blockIdx.z picks weight z
     * of nmat, its N, output and ld; w, N, y and ldy above are then unused */
    int nmat;
    const uint8_t *wm[3];
    int64_t Nm[3];
    float *ym[3];
    int64_t ldym[3];
};

__device__ __forceinline__ void cm_cp16(void *smem, const void *g, int bytes) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(g), "r"(bytes));
}
__device__ __forceinline__ void cm_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cm_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void cm_ldm4(const void *smem, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(s));
}

__device__ __forceinline__ void cm_mma(float *c, const uint32_t *a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Shared memory of a shape (bytes). */
#define CM_SMEM(BM, BN, BK, ST) ((size_t)(ST) * ((BM) + (BN)) * ((BK) + 8) * 2)

/* Y = X W^T over groups. Grid: x the row tile within a group, y the column tile, z the group
 * or the weight (nmat); blocks past their group's rows or their weight's columns return. */
template <int BM, int BN, int BK, int WM, int WN, int ST, int GU>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32) k_mma(cm_args a) {
    constexpr int NT = (BM / WM) * (BN / WN) * 32;
    constexpr int LDS = BK + 8;
    constexpr int CPR = BK / 8;
    constexpr int AC = (BM * CPR + NT - 1) / NT, BC = (BN * CPR + NT - 1) / NT;
    constexpr int MT = WM / 16, NJ = WN / 8;
    static_assert(WN % 16 == 0 && WM % 16 == 0 && BK % 16 == 0, "tile shape");
    extern __shared__ __align__(16) uint8_t cm_smem[];
    __nv_bfloat16 *As = (__nv_bfloat16 *)cm_smem;
    __nv_bfloat16 *Bs = As + ST * BM * LDS;

    const int64_t e = blockIdx.z;
    int64_t r0, r1;
    if (a.off) {
        r0 = a.off[e];
        r1 = a.off[e + 1];
    } else {
        r0 = 0;
        r1 = a.rows;
    }
    r0 += (int64_t)blockIdx.x * BM;
    if (r0 >= r1) return;
    const uint8_t *wb, *ub = NULL;
    int64_t N = a.N, ldy = a.ldy;
    float *Y = a.y;
    if (a.tab) {
        if (!a.tab[3 * e]) return;
        wb = (const uint8_t *)a.tab[3 * e + a.which];
        if (GU && !a.packed) ub = (const uint8_t *)a.tab[3 * e + 1];
    } else if (a.nmat) {
        wb = a.wm[e];
        N = a.Nm[e];
        Y = a.ym[e];
        ldy = a.ldym[e];
    } else {
        wb = a.w;
    }
    const int64_t n0 = (int64_t)blockIdx.y * (GU ? BN / 2 : BN);
    if (n0 >= N) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    /* each thread's chunks: source row pointers (NULL: zeros) and shared offsets */
    const __nv_bfloat16 *ap[AC];
    int aso[AC];
#pragma unroll
    for (int i = 0; i < AC; i++) {
        int c = tid + i * NT;
        ap[i] = NULL;
        aso[i] = -1;
        if (c < BM * CPR) {
            int row = c / CPR, kc = c % CPR;
            aso[i] = row * LDS + kc * 8;
            if (r0 + row < r1) ap[i] = a.x + (r0 + row) * a.ldx + kc * 8;
        }
    }
    const __nv_bfloat16 *bp[BC];
    int bso[BC];
#pragma unroll
    for (int i = 0; i < BC; i++) {
        int c = tid + i * NT;
        bp[i] = NULL;
        bso[i] = -1;
        if (c < BN * CPR) {
            int b = c / CPR, kc = c % CPR;
            bso[i] = b * LDS + kc * 8;
            const uint8_t *row = NULL;
            if (GU) {
                int jt = b / 8;
                int64_t col = n0 + (jt / 2) * 8 + b % 8;
                int up = jt & 1;
                if (col < N) {
                    if (a.packed) {
                        int64_t b0 = col / a.B * a.B, j = col - b0, nb = N - b0 < a.B ? N - b0 : a.B;
                        row = wb + (uint64_t)(up ? 2 * b0 + nb + j : 2 * b0 + j) * a.rb;
                    } else {
                        row = (up ? ub : wb) + (uint64_t)col * a.rb;
                    }
                }
            } else if (n0 + b < N) {
                row = wb + (uint64_t)(n0 + b) * a.rb;
            }
            if (row) bp[i] = (const __nv_bfloat16 *)row + kc * 8;
        }
    }

    const int64_t nk = (a.K + BK - 1) / BK;
    auto load = [&](int stage, int64_t kt) {
        int64_t k0 = kt * BK;
        __nv_bfloat16 *as = As + stage * BM * LDS, *bs = Bs + stage * BN * LDS;
#pragma unroll
        for (int i = 0; i < AC; i++)
            if (aso[i] >= 0) {
                int kc = (aso[i] % LDS);
                bool ok = ap[i] && k0 + kc < a.K;
                cm_cp16(as + aso[i], ok ? (const void *)(ap[i] + k0) : (const void *)a.x, ok ? 16 : 0);
            }
#pragma unroll
        for (int i = 0; i < BC; i++)
            if (bso[i] >= 0) {
                int kc = (bso[i] % LDS);
                bool ok = bp[i] && k0 + kc < a.K;
                cm_cp16(bs + bso[i], ok ? (const void *)(bp[i] + k0) : (const void *)wb, ok ? 16 : 0);
            }
    };

    float acc[MT][NJ][4];
#pragma unroll
    for (int mi = 0; mi < MT; mi++)
#pragma unroll
        for (int nj = 0; nj < NJ; nj++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[mi][nj][q] = 0.0f;

#pragma unroll
    for (int s = 0; s < ST - 1; s++) {
        if (s < nk) load(s, s);
        cm_commit();
    }
    const int wm = warp / (BN / WN), wn = warp % (BN / WN);
    const int q8 = lane >> 3, r8 = lane & 7;
    for (int64_t kt = 0; kt < nk; kt++) {
        cm_wait<ST - 2>();
        __syncthreads();
        if (kt + ST - 1 < nk) load((int)((kt + ST - 1) % ST), kt + ST - 1);
        cm_commit();
        const __nv_bfloat16 *as = As + (kt % ST) * BM * LDS, *bs = Bs + (kt % ST) * BN * LDS;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            uint32_t af[MT][4], bf[NJ][2];
#pragma unroll
            for (int mi = 0; mi < MT; mi++)
                cm_ldm4(as + (wm * WM + mi * 16 + (q8 & 1) * 8 + r8) * LDS + kk + (q8 >> 1) * 8, af[mi][0], af[mi][1],
                        af[mi][2], af[mi][3]);
#pragma unroll
            for (int nj = 0; nj < NJ; nj += 2)
                cm_ldm4(bs + (wn * WN + nj * 8 + (q8 >> 1) * 8 + r8) * LDS + kk + (q8 & 1) * 8, bf[nj][0], bf[nj][1],
                        bf[nj + 1][0], bf[nj + 1][1]);
#pragma unroll
            for (int mi = 0; mi < MT; mi++)
#pragma unroll
                for (int nj = 0; nj < NJ; nj++) cm_mma(acc[mi][nj], af[mi], bf[nj][0], bf[nj][1]);
        }
    }
    cm_wait<0>();

    /* the epilogue: c0,c1 at (lane/4, 2(lane%4) + {0,1}), c2,c3 eight rows down */
#pragma unroll
    for (int mi = 0; mi < MT; mi++)
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            int64_t row = r0 + wm * WM + mi * 16 + (lane >> 2) + hr * 8;
            if (row >= r1) continue;
            if (GU) {
#pragma unroll
                for (int nj = 0; nj < NJ; nj += 2)
#pragma unroll
                    for (int cc = 0; cc < 2; cc++) {
                        int b = wn * WN + nj * 8 + (lane & 3) * 2 + cc;
                        int64_t col = n0 + (b / 16) * 8 + b % 8;
                        if (col >= N) continue;
                        float g = acc[mi][nj][2 * hr + cc], u = acc[mi][nj + 1][2 * hr + cc];
                        float hv = g / (1.0f + expf(-g)) * u;
                        Y[row * ldy + col] = hv;
                        if (a.yb) a.yb[row * a.ldyb + col] = __float2bfloat16_rn(hv);
                    }
            } else {
#pragma unroll
                for (int nj = 0; nj < NJ; nj++)
#pragma unroll
                    for (int cc = 0; cc < 2; cc++) {
                        int64_t col = n0 + wn * WN + nj * 8 + (lane & 3) * 2 + cc;
                        if (col < N) Y[row * ldy + col] = acc[mi][nj][2 * hr + cc];
                    }
            }
        }
}

/* f32 rows into bf16 rows (round to nearest even): dst[r, :n] = src[r, :n], rows r < T. */
__global__ void k_to_bf16(__nv_bfloat16 *dst, int64_t ldd, const float *src, int64_t lds, int64_t n, int64_t T) {
    int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= T * n) return;
    int64_t r = idx / n, c = idx % n;
    dst[r * ldd + c] = __float2bfloat16_rn(src[r * lds + c]);
}

#endif
