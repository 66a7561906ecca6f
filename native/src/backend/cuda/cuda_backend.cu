/*
 * cuda_backend.cu — the CUDA backend (backend/backend.h, docs/backends.md): the seven stages
 * of a forward chunk on one NVIDIA GPU, one non-blocking stream, with the CPU backend's
 * semantics (backend/cpu/stages.c): f32 activations, f32 accumulation, weights widened in the
 * kernels (cuda_kernels.cuh).
 *
 * Memory: one cudaMalloc at init, carved by the plan (backend/plan.h): the dense weights
 * (everything but the routed experts, and the per-layer expert pointer tables), the device
 * scratch (cb_scratch's widths at max_batch), the KV pool (the host pool's geometry) and as
 * many routed experts as the memory fraction allows; the others are computed by the CPU
 * (cb_cpu_expert_rows) with a host round trip. Packed (v1) down projections w2^T [I, H] are
 * transposed at upload into [H, I], the split (v2) layout, so one down kernel reads both.
 * Nothing is allocated on the device after init.
 *
 * A step: begin_chunk copies the chunk's row arrays and the KV block tables to the device;
 * the stages launch kernels whose shapes depend only on T (and the LM head's rows), reading
 * every per-step value from device memory, so decode steps are captured once per shape as
 * CUDA graphs and replayed (run_chunk). The LM head's logits come back with one copy and one
 * stream synchronisation, the only host sync of a step (but with experts on the host).
 *
 * Refused at init (COLIBRI_E_UNSUPPORTED, the cpu backend runs them): MLA attention, routing
 * other than softmax_topk / topk_softmax, grouped routing, routed scaling, router biases,
 * clamped SwiGLU, attention sinks, expert biases, the expert cache, int8 routers, weight
 * dtypes other than f32 / f16 / bf16 / q8_0, head_dim > 256 or odd, top_k > 32.
 *
 * Fast precision (colibri_options.precision FAST): every product with bf16 weights (K a
 * multiple of 8) runs on the tensor cores from activations rounded to bf16, f32 accumulation
 * (cuda_mma.cuh); the router and the shared-expert gate stay exact (routing decisions as the
 * exact mode's, up to their inputs), as does everything but the products; f32 / f16 / q8_0
 * weights take the exact kernels.
 *
 * Errors inside a step (stages return nothing): the first CUDA error is kept; every later
 * LM head gives NaN logits, which the orchestration reports as COLIBRI_E_NUMERIC.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "backend/backend.h"
#include "backend/plan.h"
#include "core/context.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cpu/fast.h"
}

#include "cuda_kernels.cuh"
#include "cuda_mma.cuh"

namespace {

struct dmat {
    const uint8_t *w;
    uint32_t dt;
};

/* An FFN (one or E experts) on the device: tab [E*3] device pointers (gate, up, down per
 * expert; gate NULL: not resident), htab its host copy. */
struct dffn {
    int packed;
    uint32_t dt, down_dt;
    int64_t I, B, E;
    const void **tab;
    const void **htab;
};

struct dlayer {
    const float *attn_norm, *ffn_norm, *bq, *bk, *bv, *bo, *q_norm, *k_norm;
    dmat wq, wk, wv, wo, router, shared_gate;
    dffn experts, dense, shared;
    int moe, has_shared, n_host;
    int64_t window;
};

struct cu_state {
    int dev;
    cudaStream_t stream;
    int have_stream;
    uint8_t *base;
    cb_plan plan;
    int32_t *resident;
    dlayer *L;
    dmat tok_embd, lm_head;
    const float *out_norm;
    /* device scratch */
    float *x, *xn, *q, *k, *v, *att, *delta, *rl, *rp, *tw, *row_weight, *ex_in, *ex_h, *ex_out, *ffn_h, *sh_out,
        *sh_gate, *logits, *inv_freq, *rope_cos, *rope_sin;
    int32_t *tk_ids, *row_token, *tok_row;
    int64_t *ecount, *eoff;
    uint8_t *tmp;
    uint64_t tmp_bytes;
    /* fast precision (cuda_mma.cuh): bf16 copies of the products' inputs */
    int fast;
    __nv_bfloat16 *xb, *exb, *hb;
    /* the chunk's upload: device block d_up and its pinned host twin h_up, same offsets */
    uint8_t *d_up, *h_up;
    uint64_t up_bytes, o_ids, o_seq, o_head, o_pos, o_table, o_len, o_tiles;
    float *kvk, *kvv;
    float *h_logits;
    int64_t B, R;
    cb_graph_table g;
    cudaGraphExec_t exec[CB_GRAPH_SLOTS];
    cudaError_t err;
    uint64_t weight_bytes;
    char device[160];
};

/* A bump allocator over one region; measure mode (upload 0) only counts. */
struct bump {
    uint8_t *base;
    uint64_t off;
    int upload;
};

static uint8_t *take(bump *b, uint64_t bytes) {
    uint8_t *p = b->base + b->off;
    b->off += cb_plan_align(bytes);
    return p;
}

static cu_state *S(const colibri_ctx *ctx) { return (cu_state *)ctx->be_state; }

static void ck(cu_state *st, cudaError_t e) {
    if (e != cudaSuccess && st->err == cudaSuccess) st->err = e;
}

static void launched(cu_state *st) { ck(st, cudaGetLastError()); }

/* The CUDA runtime's current device is a property of the calling thread: every entry point
 * that touches the device makes this context's device current first (a server may call an
 * engine from another thread than the one that opened it; cheap when it is current already). */
static void use_device(cu_state *st) { ck(st, cudaSetDevice(st->dev)); }

static int dt_ok(uint32_t dt) {
    return dt == COLIBRI_DTYPE_F32 || dt == COLIBRI_DTYPE_F16 || dt == COLIBRI_DTYPE_BF16 ||
           dt == COLIBRI_DTYPE_Q8_0;
}

static int ckdt(uint32_t dt) {
    switch (dt) {
    case COLIBRI_DTYPE_F16: return CK_F16;
    case COLIBRI_DTYPE_BF16: return CK_BF16;
    case COLIBRI_DTYPE_Q8_0: return CK_Q8;
    default: return CK_F32;
    }
}

static unsigned blocks(int64_t n, int64_t per) { return (unsigned)((n + per - 1) / per); }

/* ---- launches --------------------------------------------------------------------------- */

static void mv(cu_state *st, float *y, int64_t ldy, const float *x, int64_t ldx, dmat w, int64_t N, int64_t K,
               int64_t T) {
    if (T <= 0 || N <= 0) return;
    uint64_t rb = cb_row_bytes(w.dt, (uint64_t)K);
    /* token ranges in grid y when W's rows alone give fewer than about 2 blocks a multiprocessor */
    int64_t bx = blocks(N, CK_WPB), tiles = blocks(T, CK_TILE), ny = bx >= 264 ? 1 : (264 + bx - 1) / bx;
    if (ny > tiles) ny = tiles;
    int64_t tpb = (tiles + ny - 1) / ny;
    ny = (tiles + tpb - 1) / tpb;
    dim3 g((unsigned)bx, (unsigned)ny), b(CK_WPB * 32);
    switch (ckdt(w.dt)) {
    case CK_F16: k_matvec<CK_F16><<<g, b, 0, st->stream>>>(y, ldy, x, ldx, w.w, rb, N, K, T, tpb); break;
    case CK_BF16: k_matvec<CK_BF16><<<g, b, 0, st->stream>>>(y, ldy, x, ldx, w.w, rb, N, K, T, tpb); break;
    case CK_Q8: k_matvec<CK_Q8><<<g, b, 0, st->stream>>>(y, ldy, x, ldx, w.w, rb, N, K, T, tpb); break;
    default: k_matvec<CK_F32><<<g, b, 0, st->stream>>>(y, ldy, x, ldx, w.w, rb, N, K, T, tpb); break;
    }
    launched(st);
}

/* An FFN over groups: h = silu(x G^T) * (x U^T), y = h D^T; n_groups = E with off, or one
 * group of `rows` rows without. */
static void ffn(cu_state *st, const dffn *f, float *y, float *h, const float *x, const int64_t *off, int64_t rows,
                int64_t n_groups, int64_t H) {
    if (n_groups <= 0 || (!off && rows <= 0)) return;
    uint64_t rb = cb_row_bytes(f->dt, (uint64_t)H), rbd = cb_row_bytes(f->down_dt, (uint64_t)f->I);
    const void *const *tab = f->tab;
    dim3 b(CK_WPB * 32), g1(blocks(f->I, CK_WPB), (unsigned)n_groups), g2(blocks(H, CK_WPB), (unsigned)n_groups);
    switch (ckdt(f->dt)) {
    case CK_F16: k_gateup<CK_F16><<<g1, b, 0, st->stream>>>(h, x, tab, f->packed, f->B, off, rows, H, f->I, rb); break;
    case CK_BF16: k_gateup<CK_BF16><<<g1, b, 0, st->stream>>>(h, x, tab, f->packed, f->B, off, rows, H, f->I, rb); break;
    case CK_Q8: k_gateup<CK_Q8><<<g1, b, 0, st->stream>>>(h, x, tab, f->packed, f->B, off, rows, H, f->I, rb); break;
    default: k_gateup<CK_F32><<<g1, b, 0, st->stream>>>(h, x, tab, f->packed, f->B, off, rows, H, f->I, rb); break;
    }
    launched(st);
    switch (ckdt(f->down_dt)) {
    case CK_F16: k_down<CK_F16><<<g2, b, 0, st->stream>>>(y, H, h, tab, off, rows, H, f->I, rbd); break;
    case CK_BF16: k_down<CK_BF16><<<g2, b, 0, st->stream>>>(y, H, h, tab, off, rows, H, f->I, rbd); break;
    case CK_Q8: k_down<CK_Q8><<<g2, b, 0, st->stream>>>(y, H, h, tab, off, rows, H, f->I, rbd); break;
    default: k_down<CK_F32><<<g2, b, 0, st->stream>>>(y, H, h, tab, off, rows, H, f->I, rbd); break;
    }
    launched(st);
}

/* ---- fast precision: the tensor-core products (cuda_mma.cuh) ----------------------------- */

/* The two tile shapes: a few rows a group (decode; long k tiles keep enough bytes in flight)
 * and many (prefill). Both give the same bits (cuda_mma.cuh). */
#define CM_SMALL 16, 32, 128, 16, 16, 4
#define CM_SMALL_SMEM CM_SMEM(16, 32, 128, 4)
/* the large shapes: the fastest of tools/mma_bench.cu on an H200 for each form (docs/backends.md) */
#define CM_LARGE_GU 128, 128, 64, 64, 64, 3
#define CM_LARGE_GU_SMEM CM_SMEM(128, 128, 64, 3)
#define CM_LARGE_GU_ROWS 128
#define CM_LARGE 64, 128, 64, 32, 64, 3
#define CM_LARGE_SMEM CM_SMEM(64, 128, 64, 3)
#define CM_LARGE_ROWS 64
#define CM_SMALL_ROWS 32

static cudaError_t mm_attributes(void) {
    const cudaFuncAttribute at = cudaFuncAttributeMaxDynamicSharedMemorySize;
    cudaError_t e;
    if ((e = cudaFuncSetAttribute(k_mma<CM_SMALL, 0>, at, (int)CM_SMALL_SMEM)) != cudaSuccess) return e;
    if ((e = cudaFuncSetAttribute(k_mma<CM_SMALL, 1>, at, (int)CM_SMALL_SMEM)) != cudaSuccess) return e;
    if ((e = cudaFuncSetAttribute(k_mma<CM_LARGE, 0>, at, (int)CM_LARGE_SMEM)) != cudaSuccess) return e;
    return cudaFuncSetAttribute(k_mma<CM_LARGE_GU, 1>, at, (int)CM_LARGE_GU_SMEM);
}

/* rows_bound: the most rows a group can have (its row tiles in grid x). */
template <int GU> static void mm_launch(cu_state *st, const cm_args &a, int64_t rows_bound, int64_t groups) {
    if (rows_bound <= 0 || groups <= 0 || a.N <= 0) return;
    if (rows_bound <= CM_SMALL_ROWS) {
        dim3 g(blocks(rows_bound, 16), blocks(a.N, GU ? 16 : 32), (unsigned)groups);
        k_mma<CM_SMALL, GU><<<g, 64, CM_SMALL_SMEM, st->stream>>>(a);
    } else if (GU) {
        dim3 g(blocks(rows_bound, CM_LARGE_GU_ROWS), blocks(a.N, 64), (unsigned)groups);
        k_mma<CM_LARGE_GU, 1><<<g, 128, CM_LARGE_GU_SMEM, st->stream>>>(a);
    } else {
        dim3 g(blocks(rows_bound, CM_LARGE_ROWS), blocks(a.N, 128), (unsigned)groups);
        k_mma<CM_LARGE, 0><<<g, 128, CM_LARGE_SMEM, st->stream>>>(a);
    }
    launched(st);
}

static int fast_w(const cu_state *st, uint32_t dt, int64_t K) {
    return st->fast && dt == COLIBRI_DTYPE_BF16 && K % 8 == 0;
}

static int fast_ffn(const cu_state *st, const dffn *f, int64_t H) {
    return fast_w(st, f->dt, H) && fast_w(st, f->down_dt, f->I);
}

/* dst [T, n] (ld ldd) = src rounded to bf16, in fast precision only. */
static void to_bf16(cu_state *st, __nv_bfloat16 *dst, int64_t ldd, const float *src, int64_t lds, int64_t n,
                    int64_t T) {
    if (!st->fast || T <= 0 || n <= 0) return;
    k_to_bf16<<<blocks(T * n, 256), 256, 0, st->stream>>>(dst, ldd, src, lds, n, T);
    launched(st);
}

/* y [T, N] = x W^T: the tensor cores from xb (x rounded to bf16, ld K) when the weight takes
 * them in this precision, else the exact kernel from x. */
static void proj(cu_state *st, float *y, int64_t ldy, const float *x, int64_t ldx, const __nv_bfloat16 *xb, dmat w,
                 int64_t N, int64_t K, int64_t T) {
    if (!fast_w(st, w.dt, K)) {
        mv(st, y, ldy, x, ldx, w, N, K, T);
        return;
    }
    cm_args a;
    memset(&a, 0, sizeof a);
    a.x = xb;
    a.ldx = K;
    a.w = w.w;
    a.rows = T;
    a.N = N;
    a.K = K;
    a.rb = cb_row_bytes(w.dt, (uint64_t)K);
    a.y = y;
    a.ldy = ldy;
    mm_launch<0>(st, a, T, 1);
}

/* q, k and v (or any three weights over the same rows) in one launch when all three take the
 * tensor cores, else one by one. */
static void proj3(cu_state *st, const float *x, int64_t ldx, const __nv_bfloat16 *xb, const dmat *w, float *const *y,
                  const int64_t *N, int64_t K, int64_t T) {
    if (!fast_w(st, w[0].dt, K) || !fast_w(st, w[1].dt, K) || !fast_w(st, w[2].dt, K)) {
        for (int i = 0; i < 3; i++) proj(st, y[i], N[i], x, ldx, xb, w[i], N[i], K, T);
        return;
    }
    cm_args a;
    memset(&a, 0, sizeof a);
    a.x = xb;
    a.ldx = K;
    a.rows = T;
    a.K = K;
    a.rb = cb_row_bytes(w[0].dt, (uint64_t)K);
    a.nmat = 3;
    a.N = 0;
    for (int i = 0; i < 3; i++) {
        a.wm[i] = w[i].w;
        a.Nm[i] = N[i];
        a.ym[i] = y[i];
        a.ldym[i] = N[i];
        if (N[i] > a.N) a.N = N[i]; /* the grid's columns */
    }
    mm_launch<0>(st, a, T, 3);
}

/* The FFN f over groups on the tensor cores: h (f32) and st->hb (bf16) = silu(x G^T) * (x U^T)
 * from xb [rows, H]; y = hb D^T. off NULL: one group of `rows` rows. */
static void ffn_fast(cu_state *st, const dffn *f, float *y, float *h, const __nv_bfloat16 *xb, const int64_t *off,
                     int64_t rows, int64_t rows_bound, int64_t n_groups, int64_t H) {
    cm_args a;
    memset(&a, 0, sizeof a);
    a.x = xb;
    a.ldx = H;
    a.tab = f->tab;
    a.which = 0;
    a.packed = f->packed;
    a.B = f->B;
    a.off = off;
    a.rows = rows;
    a.N = f->I;
    a.K = H;
    a.rb = cb_row_bytes(f->dt, (uint64_t)H);
    a.y = h;
    a.ldy = f->I;
    a.yb = st->hb;
    a.ldyb = f->I;
    mm_launch<1>(st, a, rows_bound, n_groups);
    cm_args d;
    memset(&d, 0, sizeof d);
    d.x = st->hb;
    d.ldx = f->I;
    d.tab = f->tab;
    d.which = 2;
    d.off = off;
    d.rows = rows;
    d.N = H;
    d.K = f->I;
    d.rb = cb_row_bytes(f->down_dt, (uint64_t)f->I);
    d.y = y;
    d.ldy = H;
    mm_launch<0>(st, d, rows_bound, n_groups);
}

static void rmsnorm(cu_state *st, float *y, const float *x, const float *w, const int32_t *map, int64_t rows,
                    int64_t H, float eps) {
    if (rows <= 0) return;
    k_rmsnorm<<<(unsigned)rows, 256, 0, st->stream>>>(y, x, w, map, H, eps);
    launched(st);
}

static ck_kvgeo kvgeo(const colibri_ctx *ctx, cu_state *st) {
    const cb_kv *kv = &ctx->sess.kv;
    ck_kvgeo g;
    g.k = st->kvk;
    g.v = st->kvv;
    g.table = (const int32_t *)(st->d_up + st->o_table);
    g.max_blocks = kv->max_blocks;
    g.block_len = kv->block_len;
    g.block_stride = kv->block_stride;
    g.layer_stride = kv->layer_stride;
    g.head_stride = kv->head_stride;
    g.D = kv->head_dim;
    return g;
}

/* ---- the stages (enqueue only: no host sync, so they are captured as they are) ------------- */

static void st_embedding(colibri_ctx *ctx) {
    cu_state *st = S(ctx);
    const cb_config *c = &ctx->cfg;
    int64_t T = ctx->run.T, H = c->hidden, half = c->head_dim / 2;
    if (T <= 0) return;
    const int32_t *ids = (const int32_t *)(st->d_up + st->o_ids);
    const int64_t *pos = (const int64_t *)(st->d_up + st->o_pos);
    uint64_t rb = cb_row_bytes(st->tok_embd.dt, (uint64_t)H);
    switch (ckdt(st->tok_embd.dt)) {
    case CK_F16: k_embed<CK_F16><<<(unsigned)T, 256, 0, st->stream>>>(st->x, ids, st->tok_embd.w, rb, H); break;
    case CK_BF16: k_embed<CK_BF16><<<(unsigned)T, 256, 0, st->stream>>>(st->x, ids, st->tok_embd.w, rb, H); break;
    case CK_Q8: k_embed<CK_Q8><<<(unsigned)T, 256, 0, st->stream>>>(st->x, ids, st->tok_embd.w, rb, H); break;
    default: k_embed<CK_F32><<<(unsigned)T, 256, 0, st->stream>>>(st->x, ids, st->tok_embd.w, rb, H); break;
    }
    launched(st);
    if (half > 0) {
        k_rope_tab<<<blocks(T * half, 256), 256, 0, st->stream>>>(st->rope_cos, st->rope_sin, pos, st->inv_freq, half,
                                                                   c->rope_attention_factor, T);
        launched(st);
    }
}

static void st_attention(colibri_ctx *ctx, uint32_t l) {
    cu_state *st = S(ctx);
    const cb_config *c = &ctx->cfg;
    const dlayer *L = &st->L[l];
    int64_t T = ctx->run.T, H = c->hidden, hd = c->head_dim, Hq = c->n_heads, Hkv = c->n_kv_heads;
    int64_t Nq = Hq * hd, Nkv = Hkv * hd;
    float eps = (float)c->rms_norm_eps;
    ctx->run.att_layer = (int32_t)l;
    if (T <= 0) return;
    const int32_t *seq = (const int32_t *)(st->d_up + st->o_seq);
    const int64_t *pos = (const int64_t *)(st->d_up + st->o_pos);
    rmsnorm(st, st->xn, st->x, L->attn_norm, NULL, T, H, eps);
    to_bf16(st, st->xb, H, st->xn, H, H, T);
    const dmat wqkv[3] = {L->wq, L->wk, L->wv};
    float *const yqkv[3] = {st->q, st->k, st->v};
    const int64_t nqkv[3] = {Nq, Nkv, Nkv};
    proj3(st, st->xn, H, st->xb, wqkv, yqkv, nqkv, H, T);
    if (L->bq) {
        k_add_bias<<<blocks(T * Nq, 256), 256, 0, st->stream>>>(st->q, L->bq, T, Nq);
        k_add_bias<<<blocks(T * Nkv, 256), 256, 0, st->stream>>>(st->k, L->bk, T, Nkv);
        k_add_bias<<<blocks(T * Nkv, 256), 256, 0, st->stream>>>(st->v, L->bv, T, Nkv);
        launched(st);
    }
    if (c->qk_norm == CB_QKNORM_HEAD) {
        rmsnorm(st, st->q, st->q, L->q_norm, NULL, T * Hq, hd, eps);
        rmsnorm(st, st->k, st->k, L->k_norm, NULL, T * Hkv, hd, eps);
    } else if (c->qk_norm == CB_QKNORM_FULL) {
        rmsnorm(st, st->q, st->q, L->q_norm, NULL, T, Nq, eps);
        rmsnorm(st, st->k, st->k, L->k_norm, NULL, T, Nkv, eps);
    }
    if (c->clip_qkv > 0.0f) {
        k_clamp<<<blocks(T * Nq, 256), 256, 0, st->stream>>>(st->q, T * Nq, c->clip_qkv);
        k_clamp<<<blocks(T * Nkv, 256), 256, 0, st->stream>>>(st->k, T * Nkv, c->clip_qkv);
        k_clamp<<<blocks(T * Nkv, 256), 256, 0, st->stream>>>(st->v, T * Nkv, c->clip_qkv);
        launched(st);
    }
    k_rope<<<(unsigned)T, 256, 0, st->stream>>>(st->q, st->k, st->rope_cos, st->rope_sin, Hq, Hkv, hd);
    launched(st);
    ck_kvgeo g = kvgeo(ctx, st);
    k_kv_store<<<(unsigned)T, 256, 0, st->stream>>>(g, st->k, st->v, seq, pos, l, Hkv);
    launched(st);
    float scale = (float)(1.0 / sqrt((double)hd));
    k_attention<<<dim3((unsigned)T, (unsigned)Hkv, blocks(Hq / Hkv, CK_ATT_WARPS)), CK_ATT_WARPS * 32, CK_ATT_SMEM(hd),
                  st->stream>>>(st->att, st->q, g, seq, pos, (const int32_t *)(st->d_up + st->o_tiles), l, Hq, Hkv,
                                L->window, scale);
    launched(st);
    to_bf16(st, st->xb, Nq, st->att, Nq, Nq, T);
    proj(st, st->delta, H, st->att, Nq, st->xb, L->wo, H, Nq, T);
    if (L->bo) {
        k_add_bias<<<blocks(T * H, 256), 256, 0, st->stream>>>(st->delta, L->bo, T, H);
        launched(st);
    }
    k_add<<<blocks(T * H, 256), 256, 0, st->stream>>>(st->x, st->delta, T * H);
    launched(st);
    rmsnorm(st, st->xn, st->x, L->ffn_norm, NULL, T, H, eps);
}

static void st_router(colibri_ctx *ctx, uint32_t l) {
    cu_state *st = S(ctx);
    const cb_config *c = &ctx->cfg;
    const dlayer *L = &st->L[l];
    int64_t T = ctx->run.T, E = c->n_experts;
    if (!L->moe || T <= 0) return;
    mv(st, st->rl, E, st->xn, c->hidden, L->router, E, c->hidden, T);
    k_route<<<blocks(T, 64), 64, 0, st->stream>>>(st->rl, st->rp, st->tk_ids, st->tw, T, E, c->top_k,
                                                  c->routing == CB_ROUTE_TOPK_SOFTMAX, c->norm_topk_prob);
    launched(st);
}

static int64_t max_rows_for(const colibri_ctx *ctx, int64_t T) {
    return T * ctx->cfg.top_k + (int64_t)ctx->cfg.n_experts * (ctx->group_pad - 1);
}

static void st_grouping(colibri_ctx *ctx, uint32_t l) {
    cu_state *st = S(ctx);
    const cb_config *c = &ctx->cfg;
    int64_t T = ctx->run.T, E = c->n_experts, H = c->hidden;
    if (!st->L[l].moe || T <= 0) return;
    k_group<<<1, CK_GROUP_THREADS, 0, st->stream>>>(st->tk_ids, st->tw, st->ecount, st->eoff, st->row_token, st->row_weight,
                                       st->tok_row, T, E, c->top_k, ctx->group_pad);
    launched(st);
    k_gather<<<(unsigned)max_rows_for(ctx, T), 256, 0, st->stream>>>(st->ex_in, st->fast ? st->exb : NULL, st->xn,
                                                                      st->row_token, st->eoff + E, H);
    launched(st);
}

static void d2h(cu_state *st, void *dst, const void *src, uint64_t bytes) {
    if (bytes) ck(st, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, st->stream));
}

static void h2d(cu_state *st, void *dst, const void *src, uint64_t bytes) {
    if (bytes) ck(st, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, st->stream));
}

static void sync(cu_state *st) { ck(st, cudaStreamSynchronize(st->stream)); }

/* The experts of layer l that are not on the device: their rows through the CPU. */
static void host_experts(colibri_ctx *ctx, uint32_t l) {
    cu_state *st = S(ctx);
    cb_scratch *s = &ctx->s;
    const dlayer *L = &st->L[l];
    int64_t E = ctx->cfg.n_experts, H = ctx->cfg.hidden, I = L->experts.I;
    const int round_in = cb_cpu_moe_input_bf16(ctx, l);
    d2h(st, s->expert_offset, st->eoff, (uint64_t)(E + 1) * sizeof(int64_t));
    sync(st);
    if (st->err != cudaSuccess) return;
    for (int64_t e = 0; e < E; e++) {
        if (L->experts.htab[3 * e]) continue;
        int64_t r0 = s->expert_offset[e], R = s->expert_offset[e + 1] - r0;
        if (R <= 0) continue;
        d2h(st, s->ex_in + r0 * H, st->ex_in + r0 * H, (uint64_t)(R * H) * sizeof(float));
        sync(st);
        if (st->err != cudaSuccess) return;
        if (round_in) /* the CPU's fast mode takes these rows rounded to bf16 (stage_grouping) */
            cb_round_bf16(s->ex_in + r0 * H, R * H);
        cb_cpu_expert_rows(ctx, l, e, s->ex_in + r0 * H, s->ex_h + r0 * I, s->ex_up ? s->ex_up + r0 * I : NULL,
                           s->ex_out + r0 * H, R);
        h2d(st, st->ex_out + r0 * H, s->ex_out + r0 * H, (uint64_t)(R * H) * sizeof(float));
        h2d(st, st->ex_h + r0 * I, s->ex_h + r0 * I, (uint64_t)(R * I) * sizeof(float));
        sync(st);
    }
}

static void st_expert_ffn(colibri_ctx *ctx, uint32_t l) {
    cu_state *st = S(ctx);
    const cb_config *c = &ctx->cfg;
    const dlayer *L = &st->L[l];
    int64_t T = ctx->run.T, H = c->hidden, E = c->n_experts;
    if (T <= 0) return;
    if (!L->moe) {
        if (fast_ffn(st, &L->dense, H)) {
            to_bf16(st, st->xb, H, st->xn, H, H, T);
            ffn_fast(st, &L->dense, st->delta, st->ffn_h, st->xb, NULL, T, T, 1, H);
        } else {
            ffn(st, &L->dense, st->delta, st->ffn_h, st->xn, NULL, T, 1, H);
        }
        return;
    }
    if (fast_ffn(st, &L->experts, H)) { /* a group holds at most T tokens and its padding */
        int64_t bound = T + ctx->group_pad - 1;
        ffn_fast(st, &L->experts, st->ex_out, st->ex_h, st->exb, st->eoff, 0, bound < st->R ? bound : st->R, E, H);
    } else {
        ffn(st, &L->experts, st->ex_out, st->ex_h, st->ex_in, st->eoff, 0, E, H);
    }
    if (L->n_host > 0) host_experts(ctx, l);
    if (L->has_shared) {
        if (fast_ffn(st, &L->shared, H)) {
            to_bf16(st, st->xb, H, st->xn, H, H, T);
            ffn_fast(st, &L->shared, st->sh_out, st->ffn_h, st->xb, NULL, T, T, 1, H);
        } else {
            ffn(st, &L->shared, st->sh_out, st->ffn_h, st->xn, NULL, T, 1, H);
        }
        if (L->shared_gate.w) {
            mv(st, st->sh_gate, 1, st->xn, H, L->shared_gate, 1, H, T);
            k_sigmoid<<<blocks(T, 256), 256, 0, st->stream>>>(st->sh_gate, T);
            launched(st);
        }
    }
}

static void st_combine(colibri_ctx *ctx, uint32_t l) {
    cu_state *st = S(ctx);
    const dlayer *L = &st->L[l];
    int64_t T = ctx->run.T, H = ctx->cfg.hidden;
    if (T <= 0) return;
    if (L->moe) {
        k_combine<<<(unsigned)T, 256, 0, st->stream>>>(st->x, st->delta, st->ex_out, st->row_weight, st->tok_row,
                                                       L->has_shared ? st->sh_out : NULL,
                                                       L->has_shared && L->shared_gate.w ? st->sh_gate : NULL, H,
                                                       ctx->cfg.top_k);
    } else {
        k_add<<<blocks(T * H, 256), 256, 0, st->stream>>>(st->x, st->delta, T * H);
    }
    launched(st);
}

static void enqueue_lm_head(colibri_ctx *ctx) {
    cu_state *st = S(ctx);
    const cb_config *c = &ctx->cfg;
    int64_t R = ctx->run.head_rows, H = c->hidden;
    if (R <= 0) return;
    rmsnorm(st, st->xn, st->x, st->out_norm, (const int32_t *)(st->d_up + st->o_head), R, H, (float)c->rms_norm_eps);
    to_bf16(st, st->xb, H, st->xn, H, H, R);
    proj(st, st->logits, c->vocab, st->xn, H, st->xb, st->lm_head, c->vocab, H, R);
}

static void nan_fill(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = NAN;
}

/* The logits to the caller: one copy into the pinned buffer, one sync. */
static void finish_logits(colibri_ctx *ctx, float *logits) {
    cu_state *st = S(ctx);
    int64_t n = ctx->run.head_rows * (int64_t)ctx->cfg.vocab;
    if (n <= 0) return;
    if (st->err == cudaSuccess) {
        d2h(st, st->h_logits, st->logits, (uint64_t)n * sizeof(float));
        sync(st);
    }
    if (st->err != cudaSuccess) nan_fill(logits, n);
    else memcpy(logits, st->h_logits, (size_t)n * sizeof(float));
}

static void st_lm_head(colibri_ctx *ctx, float *logits) {
    enqueue_lm_head(ctx);
    finish_logits(ctx, logits);
}

static void cu_begin_chunk(colibri_ctx *ctx) {
    cu_state *st = S(ctx);
    const cb_scratch *s = &ctx->s;
    const cb_kv *kv = &ctx->sess.kv;
    int64_t T = ctx->run.T;
    use_device(st);
    sync(st); /* the previous chunk's upload has been read before h_up is rewritten */
    memcpy(st->h_up + st->o_ids, s->run_ids, (size_t)T * sizeof(int32_t));
    memcpy(st->h_up + st->o_seq, s->row_seq, (size_t)T * sizeof(int32_t));
    memcpy(st->h_up + st->o_head, s->head_idx, (size_t)T * sizeof(int32_t));
    memcpy(st->h_up + st->o_pos, s->row_pos, (size_t)T * sizeof(int64_t));
    memcpy(st->h_up + st->o_table, kv->table, (size_t)(kv->max_seqs * kv->max_blocks) * sizeof(int32_t));
    memcpy(st->h_up + st->o_len, kv->len, (size_t)kv->max_seqs * sizeof(int64_t));
    /* the attention's tiles: runs of at most CK_ATT_PAIRS / hb rows of one sequence */
    int64_t rep = ctx->cfg.n_heads / ctx->cfg.n_kv_heads, hb = rep < CK_ATT_WARPS ? rep : CK_ATT_WARPS;
    int64_t tr = CK_ATT_PAIRS / hb;
    int32_t *tl = (int32_t *)(st->h_up + st->o_tiles), nt = 0;
    for (int64_t t = 0; t < T;) {
        int64_t t0 = t;
        while (t < T && s->row_seq[t] == s->row_seq[t0] && t - t0 < tr) t++;
        tl[1 + 2 * nt] = (int32_t)t0;
        tl[2 + 2 * nt] = (int32_t)(t - t0);
        nt++;
    }
    tl[0] = nt;
    h2d(st, st->d_up, st->h_up, st->up_bytes);
}

static void enqueue_all(colibri_ctx *ctx) {
    st_embedding(ctx);
    for (uint32_t l = 0; l < ctx->cfg.n_layers; l++) {
        st_attention(ctx, l);
        st_router(ctx, l);
        st_grouping(ctx, l);
        st_expert_ffn(ctx, l);
        st_combine(ctx, l);
    }
    enqueue_lm_head(ctx);
}

static int cu_run_chunk(colibri_ctx *ctx, float *logits) {
    cu_state *st = S(ctx);
    cb_graph_key key = {ctx->run.T, ctx->run.head_rows};
    if (st->err != cudaSuccess) {
        nan_fill(logits, ctx->run.head_rows * (int64_t)ctx->cfg.vocab);
        return 1;
    }
    if (st->plan.experts_host > 0 || !cb_graph_eligible(&st->g, key)) return 0;
    int slot = cb_graph_lookup(&st->g, key);
    if (slot < 0) {
        cudaGraph_t graph = NULL;
        ck(st, cudaStreamBeginCapture(st->stream, cudaStreamCaptureModeThreadLocal));
        if (st->err == cudaSuccess) {
            enqueue_all(ctx);
            cudaError_t e = cudaStreamEndCapture(st->stream, &graph);
            ck(st, e);
        }
        cudaGraphExec_t exec = NULL;
        if (st->err == cudaSuccess) ck(st, cudaGraphInstantiate(&exec, graph, 0));
        if (graph) cudaGraphDestroy(graph);
        if (st->err != cudaSuccess) {
            if (exec) cudaGraphExecDestroy(exec);
            (void)cudaGetLastError();
            nan_fill(logits, ctx->run.head_rows * (int64_t)ctx->cfg.vocab);
            return 1;
        }
        cb_graph_key evicted;
        slot = cb_graph_insert(&st->g, key, &evicted);
        if (st->exec[slot]) cudaGraphExecDestroy(st->exec[slot]);
        st->exec[slot] = exec;
    }
    ck(st, cudaGraphLaunch(st->exec[slot], st->stream));
    finish_logits(ctx, logits);
    return 1;
}

/* ---- to_host / device tensors ------------------------------------------------------------ */

static void cu_to_host(colibri_ctx *ctx, int32_t stage, uint32_t l) {
    cu_state *st = S(ctx);
    cb_scratch *s = &ctx->s;
    const cb_config *c = &ctx->cfg;
    int64_t T = ctx->run.T, H = c->hidden, E = c->n_experts, K = c->top_k, I = c->inter;
    int64_t Nq = (int64_t)c->n_heads * c->head_dim, Nkv = (int64_t)c->n_kv_heads * c->head_dim;
    const uint64_t f = sizeof(float);
    int moe = l < c->n_layers && st->L[l].moe;
    use_device(st);
    switch (stage) {
    case COLIBRI_STAGE_EMBEDDING:
        d2h(st, s->x, st->x, (uint64_t)(T * H) * f);
        d2h(st, s->rope_cos, st->rope_cos, (uint64_t)(T * (c->head_dim / 2)) * f);
        d2h(st, s->rope_sin, st->rope_sin, (uint64_t)(T * (c->head_dim / 2)) * f);
        break;
    case COLIBRI_STAGE_ATTENTION:
        d2h(st, s->xn, st->xn, (uint64_t)(T * H) * f);
        d2h(st, s->q, st->q, (uint64_t)(T * Nq) * f);
        d2h(st, s->k, st->k, (uint64_t)(T * Nkv) * f);
        d2h(st, s->v, st->v, (uint64_t)(T * Nkv) * f);
        d2h(st, s->att, st->att, (uint64_t)(T * Nq) * f);
        d2h(st, s->delta, st->delta, (uint64_t)(T * H) * f);
        d2h(st, s->x, st->x, (uint64_t)(T * H) * f);
        break;
    case COLIBRI_STAGE_ROUTER:
        if (!moe) break;
        d2h(st, s->router_logits, st->rl, (uint64_t)(T * E) * f);
        d2h(st, s->router_probs, st->rp, (uint64_t)(T * E) * f);
        d2h(st, s->topk_ids, st->tk_ids, (uint64_t)(T * K) * sizeof(int32_t));
        d2h(st, s->topk_w, st->tw, (uint64_t)(T * K) * f);
        break;
    case COLIBRI_STAGE_GROUPING: {
        if (!moe) break;
        d2h(st, s->expert_count, st->ecount, (uint64_t)E * sizeof(int64_t));
        d2h(st, s->expert_offset, st->eoff, (uint64_t)(E + 1) * sizeof(int64_t));
        sync(st);
        if (st->err != cudaSuccess) break;
        int64_t rows = s->expert_offset[E];
        d2h(st, s->row_token, st->row_token, (uint64_t)rows * sizeof(int32_t));
        d2h(st, s->row_weight, st->row_weight, (uint64_t)rows * f);
        d2h(st, s->ex_in, st->ex_in, (uint64_t)(rows * H) * f);
        break;
    }
    case COLIBRI_STAGE_EXPERT_FFN: {
        const dlayer *L = &st->L[l];
        if (!moe) {
            d2h(st, s->delta, st->delta, (uint64_t)(T * H) * f);
            d2h(st, s->ffn_h, st->ffn_h, (uint64_t)(T * L->dense.I) * f);
            break;
        }
        d2h(st, s->expert_offset, st->eoff, (uint64_t)(E + 1) * sizeof(int64_t));
        sync(st);
        if (st->err != cudaSuccess) break;
        int64_t rows = s->expert_offset[E];
        d2h(st, s->ex_h, st->ex_h, (uint64_t)(rows * I) * f);
        d2h(st, s->ex_out, st->ex_out, (uint64_t)(rows * H) * f);
        if (L->has_shared) {
            d2h(st, s->sh_out, st->sh_out, (uint64_t)(T * H) * f);
            d2h(st, s->ffn_h, st->ffn_h, (uint64_t)(T * L->shared.I) * f);
            if (L->shared_gate.w) d2h(st, s->sh_gate, st->sh_gate, (uint64_t)T * f);
        }
        break;
    }
    case COLIBRI_STAGE_COMBINE:
        d2h(st, s->x, st->x, (uint64_t)(T * H) * f);
        d2h(st, s->delta, st->delta, (uint64_t)(T * H) * f);
        break;
    default:
        d2h(st, s->xn, st->xn, (uint64_t)(ctx->run.head_rows * H) * f);
        break;
    }
    sync(st);
}

static const void *cu_device_tensor(colibri_ctx *ctx, const char *name) {
    cu_state *st = S(ctx);
    if (!st) return NULL;
    use_device(st);
    struct {
        const char *n;
        const void *p;
    } tab[] = {
        {"x", st->x}, {"xn", st->xn}, {"q", st->q}, {"k", st->k}, {"v", st->v}, {"att", st->att},
        {"delta", st->delta}, {"router_logits", st->rl}, {"router_probs", st->rp}, {"topk_ids", st->tk_ids},
        {"topk_weights", st->tw}, {"expert_count", st->ecount}, {"expert_offset", st->eoff},
        {"row_token", st->row_token}, {"row_weight", st->row_weight}, {"ex_in", st->ex_in}, {"ex_h", st->ex_h},
        {"ex_out", st->ex_out}, {"shared_out", st->sh_out}, {"shared_gate", st->sh_gate}, {"ffn_h", st->ffn_h},
    };
    for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++)
        if (strcmp(tab[i].n, name) == 0) return tab[i].p;
    return NULL;
}

static void cu_kv_copy_block(colibri_ctx *ctx, int64_t dst, int64_t src) {
    cu_state *st = S(ctx);
    const cb_kv *kv = &ctx->sess.kv;
    uint64_t bytes = (uint64_t)kv->block_stride * sizeof(float);
    use_device(st);
    ck(st, cudaMemcpyAsync(st->kvk + dst * kv->block_stride, st->kvk + src * kv->block_stride, bytes,
                           cudaMemcpyDeviceToDevice, st->stream));
    ck(st, cudaMemcpyAsync(st->kvv + dst * kv->block_stride, st->kvv + src * kv->block_stride, bytes,
                           cudaMemcpyDeviceToDevice, st->stream));
}

static void kv_copy_hook(void *u, int64_t dst, int64_t src) { cu_kv_copy_block((colibri_ctx *)u, dst, src); }

/* The first CUDA error of this context, kept: the device state after it is unknown. */
static colibri_status cu_status(colibri_ctx *ctx) {
    cu_state *st = S(ctx);
    if (st->err == cudaSuccess) return COLIBRI_OK;
    return cb_fail(ctx, COLIBRI_E_INTERNAL, "the CUDA backend failed: %s (%s); the device state of this context is "
                   "lost: free it and open a new one (or use the cpu backend)", cudaGetErrorName(st->err),
                   cudaGetErrorString(st->err));
}

static void cu_facts(const colibri_ctx *ctx, cb_backend_facts *out) {
    memset(out, 0, sizeof *out);
    const cu_state *st = S(ctx);
    if (!st) {
        snprintf(out->device, sizeof out->device, "cuda (not initialised)");
        return;
    }
    snprintf(out->device, sizeof out->device, "%s", st->device);
    out->device_bytes = st->plan.total_bytes;
    out->weight_bytes = st->weight_bytes;
    out->experts_resident = st->plan.experts_resident;
    out->experts_host = st->plan.experts_host;
    out->graphs_captured = st->g.captures;
    out->graph_replays = st->g.replays;
}

static void cu_free(colibri_ctx *ctx) {
    cu_state *st = S(ctx);
    if (!st) return;
    (void)cudaSetDevice(st->dev); /* the frees below act on the current device */
    for (int i = 0; i < CB_GRAPH_SLOTS; i++)
        if (st->exec[i]) cudaGraphExecDestroy(st->exec[i]);
    if (st->have_stream) {
        cudaStreamSynchronize(st->stream);
        cudaStreamDestroy(st->stream);
    }
    if (st->base) cudaFree(st->base);
    if (st->h_up) cudaFreeHost(st->h_up);
    if (st->h_logits) cudaFreeHost(st->h_logits);
    if (st->L) {
        for (uint32_t l = 0; l < ctx->cfg.n_layers; l++) {
            free(st->L[l].experts.htab);
            free(st->L[l].dense.htab);
            free(st->L[l].shared.htab);
        }
        free(st->L);
    }
    free(st->resident);
    if (ctx->sess.kv.copy_u == ctx) {
        ctx->sess.kv.copy_block = NULL;
        ctx->sess.kv.copy_u = NULL;
    }
    (void)cudaGetLastError();
    free(st);
    ctx->be_state = NULL;
}

/* ---- init -------------------------------------------------------------------------------- */

/* A weight upload (measure mode: the bytes only). */
static const uint8_t *put(cu_state *st, bump *b, const void *src, uint64_t bytes) {
    if (!src || !bytes) return NULL;
    uint8_t *p = take(b, bytes);
    if (b->upload) {
        ck(st, cudaMemcpyAsync(p, src, bytes, cudaMemcpyHostToDevice, st->stream));
        st->weight_bytes += bytes;
    }
    return p;
}

static dmat put_mat(cu_state *st, bump *b, cb_mat m, int64_t N, int64_t K) {
    dmat d = {NULL, m.dt};
    d.w = put(st, b, m.w, cb_row_bytes(m.dt, (uint64_t)K) * (uint64_t)N);
    return d;
}

static const float *put_f32(cu_state *st, bump *b, const float *p, int64_t n) {
    return (const float *)put(st, b, p, (uint64_t)n * sizeof(float));
}

/* w2^T [I, H] (host, element size es) into dst [H, I], slab by slab through st->tmp. */
static void put_transposed(cu_state *st, uint8_t *dst, const uint8_t *src, int64_t I, int64_t H, uint64_t es) {
    int64_t slab = (int64_t)(st->tmp_bytes / ((uint64_t)H * es));
    if (slab > I) slab = I;
    if (slab < 1) {
        ck(st, cudaErrorInvalidValue);
        return;
    }
    for (int64_t i0 = 0; i0 < I && st->err == cudaSuccess; i0 += slab) {
        int64_t rows = I - i0 < slab ? I - i0 : slab;
        ck(st, cudaMemcpyAsync(st->tmp, src + (uint64_t)i0 * H * es, (uint64_t)(rows * H) * es,
                               cudaMemcpyHostToDevice, st->stream));
        dim3 g(blocks(H, 32), blocks(rows, 32)), bl(32, 8);
        if (es == 2)
            k_transpose<uint16_t><<<g, bl, 0, st->stream>>>((uint16_t *)dst, (const uint16_t *)st->tmp, rows, H, I, i0);
        else
            k_transpose<uint32_t><<<g, bl, 0, st->stream>>>((uint32_t *)dst, (const uint32_t *)st->tmp, rows, H, I, i0);
        launched(st);
        sync(st); /* tmp is rewritten by the next slab */
    }
}

/* Expert e of f (or the one FFN of a dense/shared block) into b; its three pointers to out. */
static void put_ffn(cu_state *st, bump *b, const cb_ffn *f, int64_t e, int64_t I, int64_t H, const void **out) {
    if (f->packed) {
        uint64_t rb = cb_row_bytes(f->dt, (uint64_t)H), es = cb_dtype_size(f->dt);
        const uint8_t *src = (const uint8_t *)f->packed + (uint64_t)e * f->stride;
        out[0] = put(st, b, src, (uint64_t)(2 * I) * rb);
        out[1] = NULL;
        uint8_t *dn = take(b, (uint64_t)(H * I) * es);
        if (b->upload) {
            put_transposed(st, dn, src + (uint64_t)(2 * I) * rb, I, H, es);
            st->weight_bytes += (uint64_t)(H * I) * es;
        }
        out[2] = dn;
    } else {
        uint64_t rb = cb_row_bytes(f->dt, (uint64_t)H), rbd = cb_row_bytes(f->down_dt, (uint64_t)I);
        out[0] = put(st, b, (const uint8_t *)f->gate + (uint64_t)e * f->gu_stride, (uint64_t)I * rb);
        out[1] = put(st, b, (const uint8_t *)f->up + (uint64_t)e * f->gu_stride, (uint64_t)I * rb);
        out[2] = put(st, b, (const uint8_t *)f->down + (uint64_t)e * f->down_stride, (uint64_t)H * rbd);
    }
}

static void ffn_meta(dffn *d, const cb_ffn *f, int64_t I, int64_t E, int64_t B) {
    d->packed = f->packed != NULL;
    d->dt = f->dt;
    d->down_dt = f->packed ? f->dt : f->down_dt;
    d->I = I;
    d->B = B;
    d->E = E;
}

/* Every weight but the routed experts, and the FFN pointer tables (filled later). */
static void walk_dense(colibri_ctx *ctx, cu_state *st, bump *b) {
    const cb_config *c = &ctx->cfg;
    const cb_weights *w = &ctx->w;
    int64_t H = c->hidden, V = c->vocab, hd = c->head_dim, E = c->n_experts;
    int64_t Nq = (int64_t)c->n_heads * hd, Nkv = (int64_t)c->n_kv_heads * hd;
    st->tok_embd = put_mat(st, b, w->tok_embd, V, H);
    if (w->lm_head.w == w->tok_embd.w && w->lm_head.dt == w->tok_embd.dt) st->lm_head = st->tok_embd;
    else st->lm_head = put_mat(st, b, w->lm_head, V, H);
    st->out_norm = put_f32(st, b, w->out_norm, H);
    for (uint32_t l = 0; l < c->n_layers; l++) {
        const cb_layer *L = &w->layers[l];
        dlayer *D = &st->L[l];
        D->moe = L->moe;
        D->has_shared = L->has_shared;
        D->window = L->window;
        D->attn_norm = put_f32(st, b, L->attn_norm, H);
        D->ffn_norm = put_f32(st, b, L->ffn_norm, H);
        D->wq = put_mat(st, b, L->wq, Nq, H);
        D->wk = put_mat(st, b, L->wk, Nkv, H);
        D->wv = put_mat(st, b, L->wv, Nkv, H);
        D->wo = put_mat(st, b, L->wo, H, Nq);
        D->bq = put_f32(st, b, L->bq, Nq);
        D->bk = put_f32(st, b, L->bk, Nkv);
        D->bv = put_f32(st, b, L->bv, Nkv);
        D->bo = put_f32(st, b, L->bo, H);
        int64_t qn = c->qk_norm == CB_QKNORM_FULL ? Nq : hd, kn = c->qk_norm == CB_QKNORM_FULL ? Nkv : hd;
        D->q_norm = c->qk_norm ? put_f32(st, b, L->q_norm, qn) : NULL;
        D->k_norm = c->qk_norm ? put_f32(st, b, L->k_norm, kn) : NULL;
        if (L->moe) {
            cb_mat r = {};
            r.w = L->router;
            r.dt = c->router_dtype;
            r.cols = (int64_t)H;
            D->router = put_mat(st, b, r, E, H);
            ffn_meta(&D->experts, &L->experts, c->inter, E, c->block_size);
            D->experts.tab = (const void **)take(b, (uint64_t)(3 * E) * sizeof(void *));
        } else {
            ffn_meta(&D->dense, &L->dense, c->dense_inter, 1, c->block_size);
            D->dense.tab = (const void **)take(b, 3 * sizeof(void *));
            put_ffn(st, b, &L->dense, 0, c->dense_inter, H, D->dense.htab);
        }
        if (L->moe && L->has_shared) {
            ffn_meta(&D->shared, &L->shared, c->shared_inter, 1, c->block_size);
            D->shared.tab = (const void **)take(b, 3 * sizeof(void *));
            put_ffn(st, b, &L->shared, 0, c->shared_inter, H, D->shared.htab);
            D->shared_gate = put_mat(st, b, L->shared_gate, 1, H);
        }
    }
}

static colibri_status fail(cu_state *st, colibri_ctx *ctx, colibri_status code, char *err, size_t len,
                           const char *what, cudaError_t e) {
    cb_set_err(err, len, "CUDA backend: %s: %s", what, cudaGetErrorString(e));
    (void)st;
    cu_free(ctx);
    return code;
}

static const char *refusal(const colibri_ctx *ctx) {
    const cb_config *c = &ctx->cfg;
    static char buf[256];
    if (c->attention == CB_ATTN_MLA) return "multi-head latent attention (model.attention mla)";
    if (c->routing != CB_ROUTE_SOFTMAX_TOPK && c->routing != CB_ROUTE_TOPK_SOFTMAX)
        return "sigmoid_topk routing";
    if (c->n_group > 1) return "grouped routing (model.n_group > 1)";
    if (c->routed_scale != 1.0f) return "a routed scaling factor other than 1";
    if (c->router_bias) return "a router choice bias (model.router_bias)";
    if (c->router_logit_bias) return "router logit biases (model.router_logit_bias)";
    if (c->activation == CB_ACT_CLAMPED_SWIGLU) return "the clamped SwiGLU activation (gpt-oss)";
    if (c->attn_sinks) return "attention sinks";
    if (c->expert_bias) return "expert biases";
    if (ctx->ecache) return "the expert cache";
    if (c->router_int8) return "int8 routers";
    if (c->head_dim > CK_MAX_HD || c->head_dim % 2) return "a head_dim above 256 or odd";
    if (c->top_k > CK_MAX_TOPK) return "top_k above 32";
    if (c->n_experts > 65535) return "more than 65535 experts";
    if (c->n_kv_heads == 0 || c->n_heads % c->n_kv_heads) return "n_heads not a multiple of n_kv_heads";
    const cb_weights *w = &ctx->w;
    uint32_t bad = UINT32_MAX;
    if (!dt_ok(w->tok_embd.dt)) bad = w->tok_embd.dt;
    if (!dt_ok(w->lm_head.dt)) bad = w->lm_head.dt;
    if (c->router_dtype != COLIBRI_DTYPE_F32 && c->router_dtype != COLIBRI_DTYPE_F16 &&
        c->router_dtype != COLIBRI_DTYPE_BF16)
        bad = c->router_dtype;
    for (uint32_t l = 0; l < c->n_layers && bad == UINT32_MAX; l++) {
        const cb_layer *L = &w->layers[l];
        const cb_ffn *fs[3] = {L->moe ? &L->experts : &L->dense, L->moe && L->has_shared ? &L->shared : NULL, NULL};
        uint32_t m[4] = {L->wq.dt, L->wk.dt, L->wv.dt, L->wo.dt};
        for (int i = 0; i < 4; i++)
            if (!dt_ok(m[i])) bad = m[i];
        if (L->moe && L->has_shared && L->shared_gate.w && !dt_ok(L->shared_gate.dt)) bad = L->shared_gate.dt;
        for (int i = 0; i < 2; i++) {
            if (!fs[i]) continue;
            if (fs[i]->packed) {
                if (fs[i]->dt != COLIBRI_DTYPE_F32 && fs[i]->dt != COLIBRI_DTYPE_F16 && fs[i]->dt != COLIBRI_DTYPE_BF16)
                    bad = fs[i]->dt;
            } else {
                if (!dt_ok(fs[i]->dt)) bad = fs[i]->dt;
                if (!dt_ok(fs[i]->down_dt)) bad = fs[i]->down_dt;
            }
        }
    }
    if (bad != UINT32_MAX) {
        snprintf(buf, sizeof buf, "%s weights", cb_dtype_name(bad));
        return buf;
    }
    return NULL;
}

/* The device scratch (measure mode with b->upload 0). */
static void walk_act(colibri_ctx *ctx, cu_state *st, bump *b) {
    const cb_config *c = &ctx->cfg;
    const cb_kv *kv = &ctx->sess.kv;
    int64_t B = st->B, R = st->R, H = c->hidden, E = c->n_experts ? c->n_experts : 1, K = c->top_k ? c->top_k : 1;
    int64_t Nq = (int64_t)c->n_heads * c->head_dim, Nkv = (int64_t)c->n_kv_heads * c->head_dim;
    int64_t I = c->inter, F = c->dense_inter > c->shared_inter ? c->dense_inter : c->shared_inter;
    int64_t half = c->head_dim / 2, V = c->vocab;
    const uint64_t f = sizeof(float);
    uint64_t start = b->off;
    st->x = (float *)take(b, (uint64_t)(B * H) * f);
    st->xn = (float *)take(b, (uint64_t)(B * H) * f);
    st->q = (float *)take(b, (uint64_t)(B * Nq) * f);
    st->k = (float *)take(b, (uint64_t)(B * Nkv) * f);
    st->v = (float *)take(b, (uint64_t)(B * Nkv) * f);
    st->att = (float *)take(b, (uint64_t)(B * Nq) * f);
    st->delta = (float *)take(b, (uint64_t)(B * H) * f);
    st->rope_cos = (float *)take(b, (uint64_t)(B * (half ? half : 1)) * f);
    st->rope_sin = (float *)take(b, (uint64_t)(B * (half ? half : 1)) * f);
    st->inv_freq = (float *)take(b, (uint64_t)(half ? half : 1) * f);
    st->rl = (float *)take(b, (uint64_t)(B * E) * f);
    st->rp = (float *)take(b, (uint64_t)(B * E) * f);
    st->tk_ids = (int32_t *)take(b, (uint64_t)(B * K) * sizeof(int32_t));
    st->tw = (float *)take(b, (uint64_t)(B * K) * f);
    st->ecount = (int64_t *)take(b, (uint64_t)E * sizeof(int64_t));
    st->eoff = (int64_t *)take(b, (uint64_t)(E + 1) * sizeof(int64_t));
    st->row_token = (int32_t *)take(b, (uint64_t)R * sizeof(int32_t));
    st->row_weight = (float *)take(b, (uint64_t)R * f);
    st->tok_row = (int32_t *)take(b, (uint64_t)(B * K) * sizeof(int32_t));
    st->ex_in = (float *)take(b, (uint64_t)(R * H) * f);
    st->ex_h = (float *)take(b, (uint64_t)(R * (I ? I : 1)) * f);
    st->ex_out = (float *)take(b, (uint64_t)(R * H) * f);
    st->ffn_h = (float *)take(b, (uint64_t)(B * (F ? F : 1)) * f);
    st->sh_out = (float *)take(b, (uint64_t)(B * H) * f);
    st->sh_gate = (float *)take(b, (uint64_t)B * f);
    st->logits = (float *)take(b, (uint64_t)(B * V) * f);
    if (st->fast) { /* bf16 inputs of the tensor-core products */
        const uint64_t bh = 2;
        int64_t wx = H > Nq ? H : Nq, hr = R * (I ? I : 1) > B * F ? R * (I ? I : 1) : B * F;
        st->xb = (__nv_bfloat16 *)take(b, (uint64_t)(B * wx) * bh);
        st->exb = (__nv_bfloat16 *)take(b, (uint64_t)(R * H) * bh);
        st->hb = (__nv_bfloat16 *)take(b, (uint64_t)(hr > 0 ? hr : 1) * bh);
    }
    /* the chunk's upload block */
    st->d_up = b->base + b->off;
    uint64_t u0 = b->off;
    st->o_ids = b->off - u0; take(b, (uint64_t)B * sizeof(int32_t));
    st->o_seq = b->off - u0; take(b, (uint64_t)B * sizeof(int32_t));
    st->o_head = b->off - u0; take(b, (uint64_t)B * sizeof(int32_t));
    st->o_pos = b->off - u0; take(b, (uint64_t)B * sizeof(int64_t));
    st->o_table = b->off - u0; take(b, (uint64_t)(kv->max_seqs * kv->max_blocks) * sizeof(int32_t));
    st->o_len = b->off - u0; take(b, (uint64_t)kv->max_seqs * sizeof(int64_t));
    st->o_tiles = b->off - u0; take(b, (uint64_t)(2 * B + 1) * sizeof(int32_t));
    st->up_bytes = b->off - u0;
    /* room for the packed down projections' transposes at upload (the scratch is idle then) */
    uint64_t need = (uint64_t)256 * H * f;
    if (b->off - start < need) b->off = start + need;
    st->tmp = b->base + start;
    st->tmp_bytes = b->off - start;
}

static colibri_status cu_init(colibri_ctx *ctx, const cb_backend_request *req, char *err, size_t err_len) {
    const cb_config *c = &ctx->cfg;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count <= 0) {
        cb_set_err(err, err_len, "no CUDA device: %s; use the cpu backend",
                   e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found none");
        (void)cudaGetLastError();
        return COLIBRI_E_UNSUPPORTED;
    }
    if (req->device < 0 || req->device >= count) {
        cb_set_err(err, err_len, "gpu_device %d: this machine has %d CUDA device%s (0..%d)", req->device, count,
                   count == 1 ? "" : "s", count - 1);
        return COLIBRI_E_INVALID_ARG;
    }
    const char *no = refusal(ctx);
    if (no) {
        cb_set_err(err, err_len, "the CUDA backend does not implement %s; the cpu backend runs this model", no);
        return COLIBRI_E_UNSUPPORTED;
    }
    /* the CPU backend's operations for the experts left on the host (cb_cpu_expert_rows) */
    colibri_status bound = cb_backend_cpu.init(ctx, req, err, err_len);
    if (bound != COLIBRI_OK) return bound;
    cu_state *st = (cu_state *)calloc(1, sizeof *st);
    if (!st) {
        cb_set_err(err, err_len, "out of memory allocating the CUDA backend's state");
        return COLIBRI_E_NOMEM;
    }
    ctx->be_state = st;
    st->dev = req->device;
    st->B = ctx->max_batch;
    st->fast = ctx->precision == COLIBRI_PRECISION_FAST;
    st->R = ctx->s.max_rows > 0 ? ctx->s.max_rows : 1;
    cb_graph_init(&st->g, 16);
    uint32_t nl = c->n_layers;
    int64_t E = c->n_experts, H = c->hidden;
    st->L = (dlayer *)calloc(nl ? nl : 1, sizeof(dlayer));
    st->resident = (int32_t *)calloc((size_t)(nl ? nl : 1) * (E ? E : 1), sizeof(int32_t));
    uint8_t *moe = (uint8_t *)calloc(nl ? nl : 1, 1);
    int alloc_ok = st->L && st->resident && moe;
    for (uint32_t l = 0; l < nl && alloc_ok; l++) {
        st->L[l].experts.htab = (const void **)calloc((size_t)(3 * (E ? E : 1)), sizeof(void *));
        st->L[l].dense.htab = (const void **)calloc(3, sizeof(void *));
        st->L[l].shared.htab = (const void **)calloc(3, sizeof(void *));
        alloc_ok = st->L[l].experts.htab && st->L[l].dense.htab && st->L[l].shared.htab;
        moe[l] = (uint8_t)ctx->w.layers[l].moe;
    }
    if (!alloc_ok) {
        free(moe);
        cu_free(ctx);
        cb_set_err(err, err_len, "out of memory allocating the CUDA backend's state");
        return COLIBRI_E_NOMEM;
    }
    e = cudaSetDevice(st->dev);
    if (e != cudaSuccess) {
        free(moe);
        return fail(st, ctx, COLIBRI_E_UNSUPPORTED, err, err_len, "cudaSetDevice", e);
    }
    cudaDeviceProp prop;
    memset(&prop, 0, sizeof prop);
    size_t dfree = 0, dtotal = 0;
    if ((e = cudaGetDeviceProperties(&prop, st->dev)) != cudaSuccess ||
        (e = cudaMemGetInfo(&dfree, &dtotal)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&st->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        free(moe);
        return fail(st, ctx, COLIBRI_E_UNSUPPORTED, err, err_len, "opening the device", e);
    }
    st->have_stream = 1;
    /* k_attention's dynamic shared memory limit is a property of the function on the device,
     * shared by every engine of the process: it is set to the same value by every engine (the
     * most any head_dim needs, within what the device grants), so an engine with a smaller
     * head_dim never lowers what another one launches with. */
    size_t att_smem = CK_ATT_SMEM(CK_MAX_HD);
    if (prop.sharedMemPerBlockOptin > 0 && att_smem > prop.sharedMemPerBlockOptin)
        att_smem = prop.sharedMemPerBlockOptin;
    if (CK_ATT_SMEM(c->head_dim) > att_smem) {
        free(moe);
        cu_free(ctx);
        cb_set_err(err, err_len, "the CUDA attention kernel needs %zu bytes of shared memory for head_dim %u; "
                   "this device grants %zu", (size_t)CK_ATT_SMEM(c->head_dim), c->head_dim, att_smem);
        return COLIBRI_E_UNSUPPORTED;
    }
    if ((e = mm_attributes()) != cudaSuccess ||
        (e = cudaFuncSetAttribute(k_attention, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)att_smem)) !=
            cudaSuccess) {
        free(moe);
        return fail(st, ctx, COLIBRI_E_UNSUPPORTED, err, err_len, "setting the kernels' shared memory", e);
    }

    /* measure */
    bump mb = {NULL, 0, 0};
    walk_dense(ctx, st, &mb);
    uint64_t dense_bytes = mb.off;
    bump ma = {NULL, 0, 0};
    walk_act(ctx, st, &ma);
    uint64_t act_bytes = ma.off;
    const cb_kv *kv = &ctx->sess.kv;
    uint64_t kv_half = cb_plan_align((uint64_t)(kv->n_blocks * kv->block_stride) * sizeof(float));
    uint64_t kv_bytes = 2 * kv_half;
    /* an expert slot holds the largest expert of any MoE layer (a file may store layers'
     * experts in different dtypes) */
    uint64_t expert_bytes = 0;
    for (uint32_t l = 0; l < nl; l++)
        if (ctx->w.layers[l].moe) {
            bump me = {NULL, 0, 0};
            const void *tmp3[3];
            put_ffn(st, &me, &ctx->w.layers[l].experts, 0, c->inter, H, tmp3);
            if (me.off > expert_bytes) expert_bytes = me.off;
        }
    cb_plan_input in;
    memset(&in, 0, sizeof in);
    in.device_total = dtotal;
    in.device_free = dfree;
    in.fraction = req->memory_fraction;
    in.reserve = (uint64_t)512 << 20;
    if (in.reserve > dtotal / 8) in.reserve = dtotal / 8;
    in.dense_bytes = dense_bytes;
    in.activation_bytes = act_bytes;
    in.kv_bytes = kv_bytes;
    in.n_layers = nl;
    in.n_experts = (uint32_t)E;
    in.moe = moe;
    in.expert_bytes = expert_bytes;
    colibri_status ps = cb_plan_make(&in, &st->plan, st->resident, err, err_len);
    free(moe);
    if (ps != COLIBRI_OK) {
        cu_free(ctx);
        return ps;
    }
    e = cudaMalloc((void **)&st->base, st->plan.total_bytes);
    if (e != cudaSuccess) {
        st->base = NULL;
        return fail(st, ctx, COLIBRI_E_NOMEM, err, err_len, "cudaMalloc of the plan", e);
    }
    /* carve: the scratch first (the transposes stage through it), then the weights */
    bump ba = {st->base + st->plan.activation_off, 0, 1};
    walk_act(ctx, st, &ba);
    st->kvk = (float *)(st->base + st->plan.kv_off);
    st->kvv = (float *)(st->base + st->plan.kv_off + kv_half);
    bump bd = {st->base + st->plan.dense_off, 0, 1};
    walk_dense(ctx, st, &bd);
    uint64_t ex_stride = cb_plan_align(expert_bytes);
    for (uint32_t l = 0; l < nl && st->err == cudaSuccess; l++) {
        dlayer *D = &st->L[l];
        if (!D->moe) continue;
        for (int64_t x = 0; x < E; x++) {
            int32_t slot = st->resident[(int64_t)l * E + x];
            if (slot < 0) {
                D->n_host++;
                D->experts.htab[3 * x] = D->experts.htab[3 * x + 1] = D->experts.htab[3 * x + 2] = NULL;
                continue;
            }
            bump be = {st->base + st->plan.experts_off + (uint64_t)slot * ex_stride, 0, 1};
            put_ffn(st, &be, &ctx->w.layers[l].experts, x, c->inter, H, D->experts.htab + 3 * x);
        }
    }
    for (uint32_t l = 0; l < nl; l++) { /* the pointer tables */
        dlayer *D = &st->L[l];
        if (D->moe) h2d(st, D->experts.tab, D->experts.htab, (uint64_t)(3 * E) * sizeof(void *));
        else h2d(st, D->dense.tab, D->dense.htab, 3 * sizeof(void *));
        if (D->moe && D->has_shared) h2d(st, D->shared.tab, D->shared.htab, 3 * sizeof(void *));
    }
    /* the scratch (the transposes' staging) and the KV pool start as zeros */
    ck(st, cudaMemsetAsync(st->base + st->plan.activation_off, 0, act_bytes, st->stream));
    ck(st, cudaMemsetAsync(st->base + st->plan.kv_off, 0, kv_bytes, st->stream));
    h2d(st, st->inv_freq, ctx->s.inv_freq, (uint64_t)(c->head_dim / 2) * sizeof(float));
    sync(st);
    if (st->err != cudaSuccess)
        return fail(st, ctx, COLIBRI_E_NOMEM, err, err_len, "uploading the weights", st->err);
    if ((e = cudaMallocHost((void **)&st->h_up, st->up_bytes)) != cudaSuccess) {
        st->h_up = NULL;
        return fail(st, ctx, COLIBRI_E_NOMEM, err, err_len, "cudaMallocHost", e);
    }
    if ((e = cudaMallocHost((void **)&st->h_logits, (uint64_t)(st->B * c->vocab) * sizeof(float))) != cudaSuccess) {
        st->h_logits = NULL;
        return fail(st, ctx, COLIBRI_E_NOMEM, err, err_len, "cudaMallocHost", e);
    }
    memset(st->h_up, 0, st->up_bytes);
    ctx->sess.kv.copy_block = kv_copy_hook;
    ctx->sess.kv.copy_u = ctx;
    char res[64] = "";
    if (st->plan.experts_host > 0)
        snprintf(res, sizeof res, ", %lld of %lld experts resident", (long long)st->plan.experts_resident,
                 (long long)(st->plan.experts_resident + st->plan.experts_host));
    snprintf(st->device, sizeof st->device, "%.64s (sm_%d%d, %.1f GiB, %.16s weights resident%s%s)", prop.name,
             prop.major, prop.minor, (double)dtotal / 1073741824.0, c->weight_dtype_str, res,
             st->fast ? ", fast: bf16 tensor cores" : "");
    return COLIBRI_OK;
}

const cb_backend cuda_table = {
    "cuda",
    cu_init,
    cu_free,
    st_embedding,
    st_attention,
    st_router,
    st_grouping,
    st_expert_ffn,
    st_combine,
    st_lm_head,
    cu_begin_chunk,
    cu_run_chunk,
    cu_to_host,
    cu_device_tensor,
    cu_status,
    cu_facts,
    0, /* interventions: not applied here; the setters return COLIBRI_E_UNSUPPORTED */
};

} // namespace

extern "C" const cb_backend *cb_backend_cuda(void) { return &cuda_table; }
