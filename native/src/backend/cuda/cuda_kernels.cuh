/*
 * cuda_kernels.cuh — the CUDA backend's kernels (backend/cuda/cuda_backend.cu includes it;
 * one translation unit). f32 activations and f32 accumulation everywhere; weights are
 * widened from bf16 / f16 (or dequantized from Q8_0) in the kernel.
 *
 * Determinism and batch invariance: every output element is produced by one warp (or one
 * thread) with a reduction order fixed by the reduction length alone: in a weight dot
 * product lane l takes the chunks l, l+32, ... of the row in ascending order (a chunk: 4
 * f32, 8 f16/bf16 or one Q8_0 block of 32, the elements of a chunk in order) and the 32
 * lane sums meet in a fixed xor butterfly. Row tiles of the activations (8 rows) only
 * decide how many rows share one weight load, never the order of a sum, so a row's result
 * is the same for any T, any batch composition and any group size. No float atomics.
 */
#ifndef COLIBRI_CUDA_KERNELS_CUH
#define COLIBRI_CUDA_KERNELS_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define CK_WPB 8          /* warps per block of the weight kernels (one output row per warp) */
#define CK_TILE 8         /* activation rows per pass over a weight row */
#define CK_ATT_WARPS 8    /* warps of an attention block (one query head of a KV group each) */
#define CK_MAX_HD 256     /* head_dim bound of the attention kernel */
#define CK_MAX_TOPK 32

enum { CK_F32 = 0, CK_F16 = 1, CK_BF16 = 2, CK_Q8 = 3 };

__device__ __forceinline__ float ck_bf16(uint32_t b) { return __uint_as_float(b << 16); }
__device__ __forceinline__ float ck_f16(uint16_t b) { return __half2float(__ushort_as_half(b)); }

/* elements per lane chunk */
template <int DT> struct ck_chunk { static const int n = DT == CK_F32 ? 4 : DT == CK_Q8 ? 32 : 8; };

/* One element k of a weight row (the scalar path and the embedding gather). */
template <int DT> __device__ __forceinline__ float ck_elem(const uint8_t *row, int64_t k) {
    if (DT == CK_F32) return ((const float *)row)[k];
    if (DT == CK_F16) return ck_f16(((const uint16_t *)row)[k]);
    if (DT == CK_BF16) return ck_bf16(((const uint16_t *)row)[k]);
    const uint8_t *b = row + (k / 32) * 34;
    float d = ck_f16((uint16_t)(b[0] | (b[1] << 8)));
    return (float)(int8_t)b[2 + k % 32] * d;
}

/* Chunk c of a weight row widened into w[0..n). */
template <int DT> __device__ __forceinline__ void ck_load(const uint8_t *row, int64_t c, float *w) {
    if (DT == CK_F32) {
        float4 v = __ldg((const float4 *)row + c);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    } else if (DT == CK_F16 || DT == CK_BF16) {
        uint4 v = __ldg((const uint4 *)row + c);
        uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (DT == CK_BF16) {
                w[2 * i] = ck_bf16(u[i] & 0xffffu);
                w[2 * i + 1] = ck_bf16(u[i] >> 16);
            } else {
                w[2 * i] = ck_f16((uint16_t)(u[i] & 0xffffu));
                w[2 * i + 1] = ck_f16((uint16_t)(u[i] >> 16));
            }
        }
    } else { /* Q8_0: f16 d then 32 int8; blocks are 34 bytes, so 2-byte loads */
        const uint16_t *b = (const uint16_t *)(row + c * 34);
        float d = ck_f16(__ldg(b));
#pragma unroll
        for (int i = 0; i < 16; i++) {
            uint16_t q = __ldg(b + 1 + i);
            w[2 * i] = (float)(int8_t)(q & 0xff) * d;
            w[2 * i + 1] = (float)(int8_t)(q >> 8) * d;
        }
    }
}

/* acc[r][j] = dot(weight row r (NW rows), x row j) for j < nr (<= CK_TILE); rows of x at
 * stride ldx. Every lane ends with the full sums. */
template <int DT, int NW>
__device__ __forceinline__ void ck_dot_tile(const uint8_t *const *rows, int64_t K, const float *x, int64_t ldx,
                                            int nr, float (*acc)[CK_TILE], int lane) {
    const int CH = ck_chunk<DT>::n;
#pragma unroll
    for (int r = 0; r < NW; r++)
#pragma unroll
        for (int j = 0; j < CK_TILE; j++) acc[r][j] = 0.0f;
    if (K % CH == 0) {
        int64_t nch = K / CH;
#pragma unroll(CH == 8 ? 2 : 1)
        for (int64_t c = lane; c < nch; c += 32) {
            float w[NW][CH];
#pragma unroll
            for (int r = 0; r < NW; r++) ck_load<DT>(rows[r], c, w[r]);
#pragma unroll
            for (int j = 0; j < CK_TILE; j++) {
                if (j < nr) {
                    const float4 *xp = (const float4 *)(x + j * ldx + c * CH);
#pragma unroll
                    for (int q = 0; q < CH / 4; q++) {
                        float4 xv = xp[q];
#pragma unroll
                        for (int r = 0; r < NW; r++) {
                            acc[r][j] = fmaf(w[r][4 * q], xv.x, acc[r][j]);
                            acc[r][j] = fmaf(w[r][4 * q + 1], xv.y, acc[r][j]);
                            acc[r][j] = fmaf(w[r][4 * q + 2], xv.z, acc[r][j]);
                            acc[r][j] = fmaf(w[r][4 * q + 3], xv.w, acc[r][j]);
                        }
                    }
                }
            }
        }
    } else { /* K not a whole number of chunks (never Q8_0): element by element */
        for (int64_t k = lane; k < K; k += 32) {
            float w[NW];
#pragma unroll
            for (int r = 0; r < NW; r++) w[r] = ck_elem<DT>(rows[r], k);
#pragma unroll
            for (int j = 0; j < CK_TILE; j++)
                if (j < nr) {
                    float xv = x[j * ldx + k];
#pragma unroll
                    for (int r = 0; r < NW; r++) acc[r][j] = fmaf(w[r], xv, acc[r][j]);
                }
        }
    }
#pragma unroll
    for (int r = 0; r < NW; r++)
#pragma unroll
        for (int j = 0; j < CK_TILE; j++)
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) acc[r][j] += __shfl_xor_sync(0xffffffffu, acc[r][j], o);
}

/* y[t, n] (stride ldy) = x[t, :] . W[n, :] for t < T, n < N; W rows of rb bytes. Grid: x the
 * blocks of CK_WPB rows of W, y the token ranges (tpb tiles of CK_TILE tokens each), so a
 * small W (the router) still fills the device; an output's sum is the same either way. */
template <int DT>
__global__ void __launch_bounds__(CK_WPB * 32) k_matvec(float *y, int64_t ldy, const float *x, int64_t ldx,
                                                        const uint8_t *w, uint64_t rb, int64_t N, int64_t K,
                                                        int64_t T, int64_t tpb) {
    int lane = threadIdx.x & 31;
    int64_t n = (int64_t)blockIdx.x * CK_WPB + (threadIdx.x >> 5);
    if (n >= N) return;
    const uint8_t *rows[1] = {w + (uint64_t)n * rb};
    int64_t tend = ((int64_t)blockIdx.y + 1) * tpb * CK_TILE;
    if (tend > T) tend = T;
    for (int64_t t0 = (int64_t)blockIdx.y * tpb * CK_TILE; t0 < tend; t0 += CK_TILE) {
        int nr = tend - t0 < CK_TILE ? (int)(tend - t0) : CK_TILE;
        float acc[1][CK_TILE];
        ck_dot_tile<DT, 1>(rows, K, x + t0 * ldx, ldx, nr, acc, lane);
#pragma unroll
        for (int j = 0; j < CK_TILE; j++)
            if (j < nr && lane == j) y[(t0 + j) * ldy + n] = acc[0][j];
    }
}

/* The FFN tables: per expert e, tab[3e] the gate (packed: the interleaved gate/up rows
 * [2I, H]), tab[3e+1] the up (split; NULL when packed), tab[3e+2] the down [H, I]; a NULL
 * gate: the expert is not on the device. Group e's rows: [off[e], off[e+1]), or [0, rows)
 * when off is NULL. */

/* h[r, i] = silu(x_r . gate_i) * (x_r . up_i), i < I; one warp per i, blockIdx.y the expert. */
template <int DT>
__global__ void __launch_bounds__(CK_WPB * 32) k_gateup(float *h, const float *x, const void *const *tab, int packed,
                                                        int64_t B, const int64_t *off, int64_t rows, int64_t H,
                                                        int64_t I, uint64_t rb) {
    int lane = threadIdx.x & 31;
    int64_t e = blockIdx.y;
    const uint8_t *base = (const uint8_t *)tab[3 * e];
    if (!base) return;
    int64_t i = (int64_t)blockIdx.x * CK_WPB + (threadIdx.x >> 5);
    if (i >= I) return;
    int64_t r0 = off ? off[e] : 0, r1 = off ? off[e + 1] : rows;
    const uint8_t *rw[2];
    if (packed) { /* block b = packed rows 2bB .. 2bB + 2nb - 1: nb gate rows, then nb up rows */
        int64_t b0 = i / B * B, j = i - b0, nb = I - b0 < B ? I - b0 : B;
        rw[0] = base + (uint64_t)(2 * b0 + j) * rb;
        rw[1] = base + (uint64_t)(2 * b0 + nb + j) * rb;
    } else {
        rw[0] = base + (uint64_t)i * rb;
        rw[1] = (const uint8_t *)tab[3 * e + 1] + (uint64_t)i * rb;
    }
    for (int64_t t0 = r0; t0 < r1; t0 += CK_TILE) {
        int nr = r1 - t0 < CK_TILE ? (int)(r1 - t0) : CK_TILE;
        float acc[2][CK_TILE];
        ck_dot_tile<DT, 2>(rw, H, x + t0 * H, H, nr, acc, lane);
#pragma unroll
        for (int j = 0; j < CK_TILE; j++)
            if (j < nr && lane == j) {
                float g = acc[0][j], u = acc[1][j];
                float s = g / (1.0f + expf(-g)); /* silu, as torch */
                h[(t0 + j) * I + i] = s * u;
            }
    }
}

/* y[r, c] (stride ldy) = h[r, :] . down_c, c < H; one warp per c, blockIdx.y the expert. */
template <int DT>
__global__ void __launch_bounds__(CK_WPB * 32) k_down(float *y, int64_t ldy, const float *h, const void *const *tab,
                                                      const int64_t *off, int64_t rows, int64_t H, int64_t I,
                                                      uint64_t rb) {
    int lane = threadIdx.x & 31;
    int64_t e = blockIdx.y;
    if (!tab[3 * e]) return;
    const uint8_t *base = (const uint8_t *)tab[3 * e + 2];
    int64_t c = (int64_t)blockIdx.x * CK_WPB + (threadIdx.x >> 5);
    if (c >= H) return;
    int64_t r0 = off ? off[e] : 0, r1 = off ? off[e + 1] : rows;
    const uint8_t *rw[1] = {base + (uint64_t)c * rb};
    for (int64_t t0 = r0; t0 < r1; t0 += CK_TILE) {
        int nr = r1 - t0 < CK_TILE ? (int)(r1 - t0) : CK_TILE;
        float acc[1][CK_TILE];
        ck_dot_tile<DT, 1>(rw, I, h + t0 * I, I, nr, acc, lane);
#pragma unroll
        for (int j = 0; j < CK_TILE; j++)
            if (j < nr && lane == j) y[(t0 + j) * ldy + c] = acc[0][j];
    }
}

/* ---- element-wise and small kernels --------------------------------------------------- */

/* x[t, :] = embedding row ids[t] widened. */
template <int DT> __global__ void k_embed(float *x, const int32_t *ids, const uint8_t *emb, uint64_t rb, int64_t H) {
    int64_t t = blockIdx.x;
    const uint8_t *row = emb + (uint64_t)ids[t] * rb;
    for (int64_t i = threadIdx.x; i < H; i += blockDim.x) x[t * H + i] = ck_elem<DT>(row, i);
}

/* The chunk's RoPE tables: cos/sin of pos * inv_freq[i], times the attention factor. */
__global__ void k_rope_tab(float *cs, float *sn, const int64_t *pos, const float *inv_freq, int64_t half, float af,
                           int64_t T) {
    int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= T * half) return;
    int64_t t = idx / half, i = idx % half;
    float f = (float)pos[t] * inv_freq[i];
    cs[idx] = cosf(f) * af;
    sn[idx] = sinf(f) * af;
}

/* y[r] = w * (x[map ? map[r] : r] * rsqrt(mean(x^2) + eps)); the mean of squares in double,
 * in a fixed order (thread strides, a xor butterfly in each warp, the warps' sums in warp
 * order). In place (y = x) is safe. 256 threads. */
__global__ void __launch_bounds__(256) k_rmsnorm(float *y, const float *x, const float *w, const int32_t *map,
                                                 int64_t H, float eps) {
    __shared__ double red[8];
    __shared__ float rs_s;
    int64_t r = blockIdx.x;
    const float *xr = x + (map ? (int64_t)map[r] : r) * H;
    float *yr = y + r * H;
    double ss = 0.0;
    for (int64_t i = threadIdx.x; i < H; i += 256) ss += (double)xr[i] * (double)xr[i];
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x == 0) {
        double tot = red[0];
        for (int i = 1; i < 8; i++) tot += red[i];
        float var = (float)(tot / (double)H);
        rs_s = 1.0f / sqrtf(var + eps);
    }
    __syncthreads();
    const float rs = rs_s;
    for (int64_t i = threadIdx.x; i < H; i += 256) yr[i] = w[i] * (xr[i] * rs);
}

__global__ void k_add_bias(float *x, const float *b, int64_t T, int64_t n) {
    int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < T * n) x[idx] += b[idx % n];
}

__global__ void k_add(float *x, const float *d, int64_t n) {
    int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < n) x[idx] = x[idx] + d[idx];
}

/* torch.clamp_: NaN stays NaN */
__global__ void k_clamp(float *x, int64_t n, float c) {
    int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n) return;
    float v = x[idx];
    if (v < -c) v = -c;
    else if (v > c) v = c;
    x[idx] = v;
}

__global__ void k_sigmoid(float *x, int64_t n) {
    int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < n) x[idx] = 1.0f / (1.0f + expf(-x[idx]));
}

/* RoPE of q [T, Hq, D] and k [T, Hkv, D] in place (HF: q*cos + rotate_half(q)*sin). */
__global__ void k_rope(float *q, float *k, const float *cs, const float *sn, int64_t Hq, int64_t Hkv, int64_t D) {
    int64_t t = blockIdx.x, half = D / 2;
    const float *c = cs + t * half, *s = sn + t * half;
    for (int64_t idx = threadIdx.x; idx < (Hq + Hkv) * half; idx += blockDim.x) {
        int64_t hh = idx / half, i = idx % half;
        float *v = hh < Hq ? q + (t * Hq + hh) * D : k + (t * Hkv + (hh - Hq)) * D;
        float a = v[i], b = v[i + half];
        v[i] = a * c[i] + (-b) * s[i];
        v[i + half] = b * c[i] + a * s[i];
    }
}

/* The geometry of the device KV pool (the host pool's: [n_blocks, L, Hkv, block_len, D]). */
struct ck_kvgeo {
    float *k, *v;
    const int32_t *table;  /* [max_seqs, max_blocks] */
    int64_t max_blocks, block_len, block_stride, layer_stride, head_stride, D;
};

__device__ __forceinline__ int64_t ck_kv_off(const ck_kvgeo &g, int32_t seq, int64_t l, int64_t h, int64_t pos) {
    int64_t b = g.table[(int64_t)seq * g.max_blocks + pos / g.block_len];
    return b * g.block_stride + l * g.layer_stride + h * g.head_stride + (pos % g.block_len) * g.D;
}

/* Each row's keys and values into its sequence's blocks. */
__global__ void k_kv_store(ck_kvgeo g, const float *k, const float *v, const int32_t *seq, const int64_t *pos,
                           int64_t l, int64_t Hkv) {
    int64_t t = blockIdx.x, D = g.D;
    for (int64_t idx = threadIdx.x; idx < Hkv * D; idx += blockDim.x) {
        int64_t h = idx / D, d = idx % D;
        int64_t o = ck_kv_off(g, seq[t], l, h, pos[t]) + d;
        g.k[o] = k[t * Hkv * D + idx];
        g.v[o] = v[t * Hkv * D + idx];
    }
}

/* Attention over tiles of rows of one sequence (the chunk's tile list, made by the host:
 * tiles[0] the count, then (first row, rows) pairs; at most CK_ATT_PAIRS / hb rows a tile, hb
 * = min(rep, CK_ATT_WARPS) query heads of KV head blockIdx.y from head blockIdx.z *
 * CK_ATT_WARPS on). Block x takes tile x (blocks past the count return). Its (row, head) pairs
 * go to the warps round robin, CK_ATT_PW each. The positions are walked in chunks of
 * CK_ATT_CHUNK at absolute multiples of the chunk: a chunk's keys and values go to shared
 * memory once for every pair of the tile (rows padded by 4 floats). For each pair whose range
 * [lo, pos] meets the chunk, lane j scores position c0 + j (four chains over d = 0, 1, 2, 3 mod 4
 * ascending, added as (c0 + c1) + (c2 + c3)) and an online
 * softmax takes the chunk: the chunk max over the warp, then the exp sum (lanes' terms in a
 * fixed xor butterfly) and each lane's output dims (lane + 32u; the pair's positions in the
 * chunk ascending), rescaled by exp(m_old - m_new). A pair's order depends only on its lo and
 * pos: a row's result is the same in any tile, batch or T. Dynamic shared memory:
 * CK_ATT_SMEM(D). */
#define CK_ATT_CHUNK 32
#define CK_ATT_PW 4
#define CK_ATT_PAIRS (CK_ATT_WARPS * CK_ATT_PW)
#define CK_ATT_SMEM(D) ((size_t)(2 * CK_ATT_CHUNK * ((D) + 4) + CK_ATT_PAIRS * (D)) * sizeof(float))
__global__ void __launch_bounds__(CK_ATT_WARPS * 32) k_attention(float *out, const float *q, ck_kvgeo g,
                                                                 const int32_t *seq, const int64_t *pos,
                                                                 const int32_t *tiles, int64_t l, int64_t Hq,
                                                                 int64_t Hkv, int64_t window, float scale) {
    extern __shared__ __align__(16) float ck_att_smem[];
    __shared__ int64_t pbase[CK_ATT_CHUNK]; /* the chunk's positions' offsets in the pool */
    if ((int64_t)blockIdx.x >= tiles[0]) return;
    const int64_t t0 = tiles[1 + 2 * blockIdx.x], nrows = tiles[2 + 2 * blockIdx.x];
    const int64_t D = g.D, LD = D + 4, kvh = blockIdx.y, rep = Hq / Hkv;
    const int64_t h0 = (int64_t)blockIdx.z * CK_ATT_WARPS, hb = rep - h0 < CK_ATT_WARPS ? rep - h0 : CK_ATT_WARPS;
    float *Ks = ck_att_smem, *Vs = Ks + CK_ATT_CHUNK * LD, *qs = Vs + CK_ATT_CHUNK * LD;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int32_t sq = seq[t0];
    const int64_t npairs = nrows * hb;
    /* the tile's range, and the queries */
    int64_t lo_min = INT64_MAX, p_max = -1;
    for (int64_t r = 0; r < nrows; r++) {
        int64_t p = pos[t0 + r], lo = (window > 0 && p >= window) ? p - window + 1 : 0;
        lo_min = lo < lo_min ? lo : lo_min;
        p_max = p > p_max ? p : p_max;
    }
    for (int pr = w; pr < (int)npairs; pr += CK_ATT_WARPS) { /* warp w: pairs w, w + warps, ... */
        int64_t t = t0 + pr / hb, h = kvh * rep + h0 + pr % hb;
        for (int d = lane; d < (int)D; d += 32) qs[pr * D + d] = q[(t * Hq + h) * D + d];
    }
    int64_t plo[CK_ATT_PW], phi[CK_ATT_PW];
    float m[CK_ATT_PW], lsum[CK_ATT_PW], o_acc[CK_ATT_PW][CK_MAX_HD / 32];
#pragma unroll
    for (int i = 0; i < CK_ATT_PW; i++) {
        int64_t pr = w + (int64_t)i * CK_ATT_WARPS;
        plo[i] = 0;
        phi[i] = -1; /* an empty range: no pair */
        if (pr < npairs) {
            int64_t p = pos[t0 + pr / hb];
            phi[i] = p;
            plo[i] = (window > 0 && p >= window) ? p - window + 1 : 0;
        }
        m[i] = -INFINITY;
        lsum[i] = 0.0f;
#pragma unroll
        for (int u = 0; u < CK_MAX_HD / 32; u++) o_acc[i][u] = 0.0f;
    }
    for (int64_t c0 = lo_min / CK_ATT_CHUNK * CK_ATT_CHUNK; c0 <= p_max; c0 += CK_ATT_CHUNK) {
        const int n = p_max - c0 + 1 < CK_ATT_CHUNK ? (int)(p_max - c0 + 1) : CK_ATT_CHUNK;
        const int j0 = lo_min > c0 ? (int)(lo_min - c0) : 0;
        __syncthreads(); /* the previous chunk is consumed (and qs written, the first time) */
        if ((int)threadIdx.x >= j0 && (int)threadIdx.x < n) pbase[threadIdx.x] = ck_kv_off(g, sq, l, kvh, c0 + threadIdx.x);
        __syncthreads();
        /* warp w stages positions j0 + w, j0 + w + warps, ...; lanes along d (no divisions) */
        const int dl = (int)D, ld = (int)LD;
        for (int j = j0 + w; j < n; j += CK_ATT_WARPS) {
            const float *ks = g.k + pbase[j], *vs = g.v + pbase[j];
            float *kd = Ks + j * ld, *vd = Vs + j * ld;
            if (dl % 4 == 0) {
                for (int d = lane * 4; d < dl; d += 128) {
                    *(float4 *)(kd + d) = *(const float4 *)(ks + d);
                    *(float4 *)(vd + d) = *(const float4 *)(vs + d);
                }
            } else {
                for (int d = lane; d < dl; d += 32) {
                    kd[d] = ks[d];
                    vd[d] = vs[d];
                }
            }
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < CK_ATT_PW; i++) {
            /* this pair's positions in the chunk: [ja, jb] */
            int64_t ja64 = plo[i] - c0, jb64 = phi[i] - c0;
            if (jb64 < 0 || ja64 >= n || phi[i] < plo[i]) continue;
            const int ja = ja64 > 0 ? (int)ja64 : 0, jb = jb64 < n - 1 ? (int)jb64 : n - 1;
            const float *qr = qs + (w + (int64_t)i * CK_ATT_WARPS) * D;
            float s = -INFINITY;
            if (lane >= ja && lane <= jb) { /* four chains (d mod 4), then (a0 + a1) + (a2 + a3) */
                const float *kr = Ks + lane * LD;
                float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
                const int dl = (int)D;
                if (dl % 4 == 0) {
                    for (int d = 0; d < dl; d += 4) {
                        float4 k4 = *(const float4 *)(kr + d), q4 = *(const float4 *)(qr + d);
                        a0 = fmaf(q4.x, k4.x, a0);
                        a1 = fmaf(q4.y, k4.y, a1);
                        a2 = fmaf(q4.z, k4.z, a2);
                        a3 = fmaf(q4.w, k4.w, a3);
                    }
                } else { /* D even (the backend refuses odd head dims): whole fours, then a pair */
                    int d = 0;
                    for (; d + 3 < dl; d += 4) {
                        a0 = fmaf(qr[d], kr[d], a0);
                        a1 = fmaf(qr[d + 1], kr[d + 1], a1);
                        a2 = fmaf(qr[d + 2], kr[d + 2], a2);
                        a3 = fmaf(qr[d + 3], kr[d + 3], a3);
                    }
                    for (; d < dl; d += 2) {
                        a0 = fmaf(qr[d], kr[d], a0);
                        a1 = fmaf(qr[d + 1], kr[d + 1], a1);
                    }
                }
                s = ((a0 + a1) + (a2 + a3)) * scale;
            }
            float cm = s;
            for (int o = 16; o > 0; o >>= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, o));
            const float mn = fmaxf(m[i], cm);
            const float alpha = expf(m[i] - mn); /* 0 for the pair's first chunk */
            const float pj = (lane >= ja && lane <= jb) ? expf(s - mn) : 0.0f;
            float ps = pj;
            for (int o = 16; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
            lsum[i] = lsum[i] * alpha + ps;
#pragma unroll
            for (int u = 0; u < CK_MAX_HD / 32; u++) o_acc[i][u] *= alpha;
            for (int j = ja; j <= jb; j++) {
                const float pb = __shfl_sync(0xffffffffu, pj, j);
                const float *vr = Vs + j * LD;
#pragma unroll
                for (int u = 0; u < CK_MAX_HD / 32; u++) {
                    int64_t d = lane + 32 * u;
                    if (d < D) o_acc[i][u] = fmaf(pb, vr[d], o_acc[i][u]);
                }
            }
            m[i] = mn;
        }
    }
#pragma unroll
    for (int i = 0; i < CK_ATT_PW; i++) {
        int64_t pr = w + (int64_t)i * CK_ATT_WARPS;
        if (pr >= npairs) continue;
        int64_t t = t0 + pr / hb, h = kvh * rep + h0 + pr % hb;
        const float inv = 1.0f / lsum[i];
#pragma unroll
        for (int u = 0; u < CK_MAX_HD / 32; u++) {
            int64_t d = lane + 32 * u;
            if (d < D) out[(t * Hq + h) * D + d] = o_acc[i][u] * inv;
        }
    }
}

/* softmax over x[0..n) as the CPU reference (max from x[0], exp, sum, times 1/sum). */
__device__ void ck_softmax(float *x, int64_t n) {
    float m = x[0];
    for (int64_t i = 0; i < n; i++)
        if (x[i] > m) m = x[i];
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        x[i] = expf(x[i] - m);
        sum += x[i];
    }
    float inv = 1.0f / sum;
    for (int64_t i = 0; i < n; i++) x[i] *= inv;
}

/* The K largest of v[0..E), highest first (strict >: the lower id wins ties; NaN never wins
 * unless all are NaN), as backend/cpu/stages.c's topk_desc. */
__device__ void ck_topk(const float *v, int64_t E, int64_t K, int32_t *ids, float *w) {
    for (int64_t k = 0; k < K; k++) {
        int32_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t j = 0; j < k; j++) taken |= ids[j] == (int32_t)e;
            if (taken) continue;
            if (best < 0 || v[e] > v[best]) best = (int32_t)e;
        }
        ids[k] = best;
        w[k] = best >= 0 ? v[best] : 0.0f;
    }
}

/* Route each token (one thread per token): mode 0 softmax_topk (renormalised when norm),
 * mode 1 topk_softmax. */
__global__ void k_route(const float *logits, float *probs, int32_t *ids, float *tw, int64_t T, int64_t E, int64_t K,
                        int mode, int norm) {
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const float *lg = logits + t * E;
    float *p = probs + t * E;
    int32_t *id = ids + t * K;
    float *w = tw + t * K;
    for (int64_t e = 0; e < E; e++) p[e] = lg[e];
    if (mode == 0) {
        ck_softmax(p, E);
        ck_topk(p, E, K, id, w);
        if (norm) {
            float sum = 0.0f;
            for (int64_t k = 0; k < K; k++) sum += w[k];
            for (int64_t k = 0; k < K; k++) w[k] /= sum;
        }
    } else {
        ck_topk(lg, E, K, id, w);
        ck_softmax(w, K);
        ck_softmax(p, E);
    }
}

/* Group the (token, slot) pairs by expert (one block of CK_GROUP_THREADS): counts, padded
 * prefix sum, then each expert's rows in ascending (token, slot) order, as backend/cpu/stages.c's
 * group_tokens; tok_row [T*K] the row of each pair. Warp w owns experts w, w + warps, ...: it
 * walks the pairs 32 at a time with a ballot (a pair's rank among its expert's is the count of
 * hits below its lane), so no atomics and the order is fixed. */
#define CK_GROUP_THREADS 1024
__global__ void __launch_bounds__(CK_GROUP_THREADS) k_group(const int32_t *ids, const float *tw, int64_t *count,
                                                            int64_t *off, int32_t *row_token, float *row_weight,
                                                            int32_t *tok_row, int64_t T, int64_t E, int64_t K,
                                                            int64_t pad) {
    const int64_t n = T * K;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) tok_row[i] = -1;
    for (int64_t e = w; e < E; e += nw) {
        int64_t c = 0;
        for (int64_t i0 = 0; i0 < n; i0 += 32) {
            int64_t i = i0 + lane;
            c += __popc(__ballot_sync(0xffffffffu, i < n && ids[i] == (int32_t)e));
        }
        if (lane == 0) count[e] = c;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        off[0] = 0;
        for (int64_t e = 0; e < E; e++) off[e + 1] = off[e] + (count[e] + pad - 1) / pad * pad;
    }
    __syncthreads();
    for (int64_t e = w; e < E; e += nw) {
        int64_t r = off[e];
        for (int64_t i0 = 0; i0 < n; i0 += 32) {
            int64_t i = i0 + lane;
            bool hit = i < n && ids[i] == (int32_t)e;
            unsigned b = __ballot_sync(0xffffffffu, hit);
            if (hit) {
                int64_t rr = r + __popc(b & ((1u << lane) - 1u));
                row_token[rr] = (int32_t)(i / K);
                row_weight[rr] = tw[i];
                tok_row[i] = (int32_t)rr;
            }
            r += __popc(b);
        }
        for (int64_t rr = r + lane; rr < off[e + 1]; rr += 32) {
            row_token[rr] = -1;
            row_weight[rr] = 0.0f;
        }
    }
}

/* ex_in[r] = xn[row_token[r]] (zeros for padding), r < off[E]; one block per row. exb (fast
 * precision; NULL: none): the same rounded to bf16. */
__global__ void k_gather(float *ex_in, __nv_bfloat16 *exb, const float *xn, const int32_t *row_token,
                         const int64_t *off_end, int64_t H) {
    int64_t r = blockIdx.x;
    if (r >= *off_end) return;
    int32_t t = row_token[r];
    for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
        float v = t >= 0 ? xn[(int64_t)t * H + c] : 0.0f;
        ex_in[r * H + c] = v;
        if (exb) exb[r * H + c] = __float2bfloat16_rn(v);
    }
}

/* delta[t] = sum of weight * ex_out over t's rows in ascending row (= expert) order, plus
 * g * sh_out[t] (g = sh_gate[t], or 1 without a gate); x[t] += delta[t]. Thread 0 sorts the
 * row's expert rows into shared memory; every thread then takes columns. */
__global__ void k_combine(float *x, float *delta, const float *ex_out, const float *row_weight,
                          const int32_t *tok_row, const float *sh_out, const float *sh_gate, int64_t H, int64_t K) {
    __shared__ int32_t rr[CK_MAX_TOPK];
    __shared__ float rw[CK_MAX_TOPK];
    __shared__ int nrr;
    const int64_t t = blockIdx.x;
    if (threadIdx.x == 0) {
        int n = 0;
        for (int64_t k = 0; k < K && k < CK_MAX_TOPK; k++) {
            int32_t r = tok_row[t * K + k];
            if (r < 0) continue;
            int j = n++;
            while (j > 0 && rr[j - 1] > r) { /* insertion sort: ascending rows */
                rr[j] = rr[j - 1];
                j--;
            }
            rr[j] = r;
        }
        for (int i = 0; i < n; i++) rw[i] = row_weight[rr[i]];
        nrr = n;
    }
    __syncthreads();
    const int n = nrr;
    const float g = sh_gate ? sh_gate[t] : 1.0f;
    for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
        float acc = 0.0f;
        for (int i = 0; i < n; i++) acc += ex_out[(int64_t)rr[i] * H + c] * rw[i];
        if (sh_out) acc += g * sh_out[t * H + c];
        delta[t * H + c] = acc;
        x[t * H + c] = x[t * H + c] + acc;
    }
}

/* dst [H, I] columns i0 .. i0+rows of src [rows, H] (a packed down projection w2^T, slab by
 * slab, into the [H, I] layout the down kernel reads). 32x32 tiles through shared memory. */
template <typename E>
__global__ void k_transpose(E *dst, const E *src, int64_t rows, int64_t H, int64_t I, int64_t i0) {
    __shared__ E tile[32][33];
    int64_t c0 = (int64_t)blockIdx.x * 32, r0 = (int64_t)blockIdx.y * 32;
    for (int j = threadIdx.y; j < 32; j += blockDim.y) {
        int64_t r = r0 + j, c = c0 + threadIdx.x;
        if (r < rows && c < H) tile[j][threadIdx.x] = src[r * H + c];
    }
    __syncthreads();
    for (int j = threadIdx.y; j < 32; j += blockDim.y) {
        int64_t c = c0 + j, r = r0 + threadIdx.x;
        if (r < rows && c < H) dst[c * I + i0 + r] = tile[threadIdx.x][j];
    }
}

#endif
