/*
 * cpu.h — inside the CPU backend (backend/cpu/; its table is cb_backend_cpu, backend/backend.h):
 * what its files share. stages.c runs the seven stages of a forward chunk; parallel.c holds
 * their parallel sections (matmuls, the FFN jobs, the combine), split by output rows or
 * columns so that results do not depend on the thread count; bind.c binds the operations
 * that read each weight and each layer's attention; gqa.c is grouped-query attention's
 * stage (with its attention chunks), mla.c multi-head latent attention's,
 * router.c a MoE layer's router (its logits and the plain routings), route_group.c the
 * grouped routers, panels.c the panel copies of the BF16 weights. Every file here sees the whole context (core/context.h); no
 * file outside backend/ includes this header.
 */
#ifndef COLIBRI_BACKEND_CPU_H
#define COLIBRI_BACKEND_CPU_H

#include <stdint.h>

#include "core/context.h"

/* Element-wise / attention work (multiply-adds) below which a stage stays on one thread. */
#define CB_PAR_MIN_WORK 65536

/* ---- parallel.c ---------------------------------------------------------------------- */

/* Chunk length for n items: about n / (threads * chunks per thread), at least lo, a
 * multiple of align (8 rows: the decode tile; 32 columns: the widest down panel). */
int64_t cb_cpu_chunk_len(const colibri_ctx *ctx, int64_t n, int64_t align, int64_t lo);

/* Up to three matmuls y = x W^T over the same T tokens, in one parallel section. */
typedef struct cb_mm_job {
    float *y;          /* [T, N] */
    const float *x;    /* [T, K] */
    cb_mat w;          /* [N, K] in w.dt, and its panel copy in fast mode */
    int64_t N, K;
    int64_t len, nch;  /* rows per chunk, chunks */
    cb_fast_qrows xq;  /* set by cb_cpu_par_matmul: x quantized once (fast mode's int8 path), or q NULL */
} cb_mm_job;

typedef struct cb_mm_task {
    const cb_kernels *kern;
    const cb_fast_kernels *fast; /* fast mode's table, or NULL */
    const cb_panel_kernels *pan; /* the panel copies' kernels (w.pan set), or NULL */
    int64_t T;
    int n_jobs;
    cb_mm_job jobs[3];
} cb_mm_task;
void cb_cpu_par_matmul(colibri_ctx *ctx, cb_mm_task *m);
/* x [T, K] quantized for fast mode's int8 kernels (cpu/fast.h quant_rows) into q, a, by the
 * context's threads. */
void cb_cpu_quant_rows(colibri_ctx *ctx, int8_t *q, cb_fast_ablk *a, const float *x, int64_t T, int64_t K);

/* ---- interv.c: the interventions (core/interv.h), applied where the stages compute what
 * they change; each is called only when ctx->iv is set ---------------------------------- */

/* Router bias and COLIBRI_MASK_EXCLUDE on the chunk's router logits of MoE layer l. */
void cb_cpu_iv_router_logits(colibri_ctx *ctx, uint32_t l);
/* Forced routing: the chunk's topk_ids / topk_w of MoE layer l replaced where forced. */
void cb_cpu_iv_force(colibri_ctx *ctx, uint32_t l);
/* COLIBRI_MASK_ZERO: the grouped rows of zeroed experts get weight 0 (after grouping). */
void cb_cpu_iv_zero(colibri_ctx *ctx, uint32_t l);
/* Activation patches of `point` at layer l on buf: [T, H] rows of the chunk (RESID, ATTN_OUT)
 * or the grouped expert rows (EXPERT_OUT: s->ex_out). */
void cb_cpu_iv_patch(colibri_ctx *ctx, int32_t point, uint32_t l, float *buf);
/* COLIBRI_POINT_SHARED_OUT patches of MoE layer l (with a shared expert), before COMBINE adds
 * the shared expert: a patched row of s->sh_out becomes its gated value (and its gate 1). */
void cb_cpu_iv_shared(colibri_ctx *ctx, uint32_t l);

/* ---- bind.c: the operations that read a weight, chosen once per weight at start-up ---- */

/* How a matrix is multiplied (cb_mat.op): rows n0 .. n1 of job b's y = x W^T with the
 * task's tables, and how its chunks of rows align (1: whole groups of the panel layout,
 * m->pan->rows; 0: the decode tile, 8 rows). */
typedef struct cb_matmul_op {
    void (*rows)(const cb_mm_task *m, const cb_mm_job *b, int64_t n0, int64_t n1);
    int panel_groups;
    int q8; /* 1: fast mode's int8 kernels, which read x quantized once (cb_mm_job.xq) for a block type */
} cb_matmul_op;
/* cb_backend_cpu.init: every weight matrix's op, from the running tables (ctx->kern,
 * ctx->fast, ctx->pan) and the panel copies made (or not) at load. */
colibri_status cb_cpu_bind(colibri_ctx *ctx, const cb_backend_request *req, char *err, size_t err_len);
/* y = x W^T over the context's threads. */
void cb_matmul_par(colibri_ctx *ctx, float *y, const float *x, cb_mat w, int64_t T, int64_t N, int64_t K);
/* Two such matmuls over the same input x [T, K] in one parallel section: y1 = x W1^T
 * [T, N1] and y2 = x W2^T [T, N2] (the bits of two cb_matmul_par calls). */
void cb_matmul_par2(colibri_ctx *ctx, const float *x, int64_t T, int64_t K, float *y1, cb_mat w1, int64_t N1,
                    float *y2, cb_mat w2, int64_t N2);

/* Fast mode (cpu/fast.h): the n activations about to enter a BF16 weight matmul, rounded to
 * bf16 in place (the router has already read them). Exact mode: nothing. */
static inline void cb_cpu_fast_round(const colibri_ctx *ctx, float *x, int64_t n, int bf16) {
    if (ctx->fast && bf16) cb_round_bf16(x, n);
}

/* x[t, :] += b for t < T. x: [T, n]; b: [n]. */
static inline void cb_cpu_add_bias(float *x, const float *b, int64_t T, int64_t n) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < n; i++) x[t * n + i] += b[i];
}

/* x[i] += d[i] for i < n. */
static inline void cb_cpu_add_inplace(float *x, const float *d, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = x[i] + d[i];
}

/* 1 when an FFN's gate/up weights are BF16 (their input is rounded in fast mode). */
static inline int cb_cpu_ffn_bf16(const cb_ffn *f) { return f->dt == COLIBRI_DTYPE_BF16; }

/* The attention of one layer's chunk, as a grouped-query layer's chunks see it (gqa.c). */
typedef struct cb_att_task {
    colibri_ctx *ctx;
    uint32_t layer;
    int64_t window;
} cb_att_task;

/* How a layer's attention is computed (cb_layer.att_op), bound once per layer (bind.c): the
 * stage of the layer's kind, grouped-query (gqa.c) or multi-head latent (mla.c), which adds
 * o_proj(attention(norm(x))) to the chunk's x and leaves xn = ffn_norm(x); and, for a GQA
 * layer, its heads kernel: query heads h0 .. h1 of the segment whose rows start at r0 (T
 * rows) over its sequence's cache, on thread tid's own work rows, by fast mode's kernel (its
 * work area, cpu/fast.h) or the exact table's (NULL for MLA, whose stage has its own). */
typedef struct cb_att_op {
    void (*stage)(colibri_ctx *ctx, uint32_t l);
    void (*heads)(const cb_att_task *a, const cb_kv_view *kv, int64_t r0, int64_t T, int64_t h0, int64_t h1,
                  int tid);
} cb_att_op;
/* gqa.c: fast mode's heads kernel (where the scratch carved its work area: model/scratch.c)
 * or the exact table's; mla.c: multi-head latent attention. */
extern const cb_att_op cb_cpu_att_gqa_fast, cb_cpu_att_gqa_exact;
extern const cb_att_op cb_cpu_att_mla;

/* One FFN job: a group of rows through one expert's weights (cb_ffn, packed or split). */
typedef struct cb_ffn_job {
    float *y;          /* [R, H] */
    float *h;          /* [R, I] */
    const float *x;    /* [R, H] */
    const cb_ffn *f;
    int64_t e;         /* the expert */
    int64_t R, I;
    float *u;           /* NULL: silu_glu; else clamped_swiglu (split FFN) with this [R, I]
                         * scratch for the up projection */
    /* x's rows quantized for fast mode's int8 kernels (f->q8_in), and the room for h's
     * (f->q8_h; quantized between gate/up and down); q NULL: the kernels quantize their own */
    cb_fast_qrows xq, hq;
    /* set by cb_cpu_par_ffn */
    int64_t len0, nch0; /* gate/up: intermediate columns per chunk, chunks (split: blocks) */
    int64_t len1, nch1; /* down, jobs not split: output columns per chunk, chunks */
    float *part;        /* NULL, or the split down projection's [nch0, R, H] block sums */
    uint32_t *ready;    /* split: [2, nch0] flags, block b's h ready, its sums ready */
} cb_ffn_job;

static inline cb_ffn_job cb_cpu_ffn_job(float *y, float *h, const float *x, const cb_ffn *f, int64_t e, int64_t R,
                                        int64_t I, float *u) {
    return (cb_ffn_job){.y = y, .h = h, .x = x, .f = f, .e = e, .R = R, .I = I, .u = u};
}
/* Every job's FFN, in one or two parallel sections. */
void cb_cpu_par_ffn(colibri_ctx *ctx, cb_ffn_job *jobs, int n_jobs);

/* How an FFN is computed (cb_ffn.op), by its layout and the running tables: a job's h
 * columns lo..hi (gate/up, the activation, h rounded where cb_ffn.round_h says), a split
 * job's down block blk (NULL: this FFN's jobs are never split into blocks) and the down
 * projection's output columns lo..hi of a job not split. */
struct cb_ffn_task;
typedef struct cb_ffn_op {
    void (*gateup)(const struct cb_ffn_task *f, const cb_ffn_job *b, int64_t lo, int64_t hi);
    void (*down_block)(const struct cb_ffn_task *f, const cb_ffn_job *b, int64_t blk);
    void (*down_cols)(const struct cb_ffn_task *f, const cb_ffn_job *b, int64_t lo, int64_t hi);
} cb_ffn_op;
/* Sets w->op and w->round_h from the context's tables (cb_cpu_bind); clamped: the jobs of w
 * carry clamped_swiglu's u scratch (a split FFN of a clamped_swiglu family's experts). */
void cb_cpu_bind_ffn(const colibri_ctx *ctx, cb_ffn *w, int clamped);

/* delta[t, cols] = sum over t's rows r (expert order) of weight_r * ex_out[r, cols]. */
typedef struct cb_combine_task {
    colibri_ctx *ctx;
    int64_t rows, len;
} cb_combine_task;
void cb_cpu_combine_chunk(void *arg, int64_t c, int tid);

/* ---- route_group.c: softmax/sigmoid routers with groups, bias and scaling ------------- */
void cb_route_grouped(colibri_ctx *ctx, uint32_t l, int64_t T);

/* ---- router.c: the router of a MoE layer ---------------------------------------------- */

/* The K largest of v[0..E), highest first, into ids (and their values into w): strict >
 * keeps the lower id on ties; NaN never wins unless all are NaN. */
void cb_cpu_topk_desc(const float *v, int64_t E, int64_t K, int32_t *ids, float *w);

/* How a MoE layer's router runs (cb_layer.router_op): its logits y [T, E] from the normed
 * input x [T, H] (the router's dtype: an int8 row-quantised router or a float one), and the
 * routing of the chunk's logits into probabilities, top-k ids and weights (the family's:
 * softmax then top-k, top-k then softmax, or the grouped / sigmoid / scaled routers of
 * route_group.c). */
typedef struct cb_router_op {
    void (*logits)(const colibri_ctx *ctx, const cb_layer *L, float *y, const float *x, int64_t T);
    void (*route)(colibri_ctx *ctx, uint32_t l, int64_t T);
} cb_router_op;
/* Sets L->router_op from the model's config (router dtype, routing, groups, scaling). */
void cb_cpu_bind_router(const colibri_ctx *ctx, cb_layer *L);

#endif
