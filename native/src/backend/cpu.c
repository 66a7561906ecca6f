/*
 * cpu.c — the CPU backend (backend/backend.h): the seven stages of a forward chunk over the
 * host arena (model/forward.h, cb_scratch) and the mapped weights, one decoder for every
 * supported family, parameterised by the options read from the file's metadata at load
 * (cb_config, cb_layer): q/k/v and output biases, q/k RMSNorm per head or over the whole
 * projection, q/k/v clipping, per-layer attention windows, dense MLP layers among MoE layers
 * and a (gated) shared expert. Nothing here tests the family.
 *
 * Inside a chunk each stage runs on the whole batch [T, width] through the kernel table
 * (cpu/kernels.h), and the large steps are split between the context's threads
 * (core/threadpool.h) by OUTPUT rows or columns: every output element is computed by one
 * thread, in the same order whatever the thread count, so results do not depend on
 * num_threads (docs/kernels.md). The MoE block groups (token, slot) pairs by expert with a
 * counting sort and a prefix sum (no qsort, no allocation), gathers each group's rows, runs
 * the expert FFN once per non-empty expert, and scatter-adds weight * output into each
 * token's residual delta, in expert order as transformers does. Multi-head latent attention
 * (model/mla.c) and grouped routing (model/route_group.c) are this backend's too.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/context.h"

/* The K largest of v[0..E), highest first, into ids (and their values into w): strict >
 * keeps the lower id on ties; NaN never wins unless all are NaN. */
static void topk_desc(const float *v, int64_t E, int64_t K, int32_t *ids, float *w) {
    for (int64_t k = 0; k < K; k++) {
        int32_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t j = 0; j < k; j++) taken |= ids[j] == (int32_t)e;
            if (taken) continue;
            if (best < 0 || v[e] > v[best]) best = (int32_t)e;
        }
        ids[k] = best;
        w[k] = v[best];
    }
}

/* Route T tokens: softmax over experts, top-k (highest first, lower id wins ties),
 * optional renormalisation. logits: [T, E] -> probs [T, E], ids/w [T, K]. */
static void route(colibri_ctx *ctx, int64_t T) {
    const cb_config *c = &ctx->cfg;
    cb_scratch *s = &ctx->s;
    int64_t E = c->n_experts, K = c->top_k;
    memcpy(s->router_probs, s->router_logits, (size_t)(T * E) * sizeof(float));
    for (int64_t t = 0; t < T; t++) {
        float *p = s->router_probs + t * E;
        ctx->kern->softmax(p, E);
        int32_t *ids = s->topk_ids + t * K;
        float *w = s->topk_w + t * K;
        topk_desc(p, E, K, ids, w);
        if (c->norm_topk_prob) {
            float sum = 0.0f;
            for (int64_t k = 0; k < K; k++) sum += w[k];
            for (int64_t k = 0; k < K; k++) w[k] /= sum;
        }
    }
}

/* Route T tokens as transformers' GptOssTopKRouter (model.routing topk_softmax): top-k of
 * the logits (highest first, lower id wins ties), then softmax over the k selected logits.
 * router_probs gets the softmax over all experts, for observation only. */
static void route_topk_softmax(colibri_ctx *ctx, int64_t T) {
    const cb_config *c = &ctx->cfg;
    cb_scratch *s = &ctx->s;
    int64_t E = c->n_experts, K = c->top_k;
    memcpy(s->router_probs, s->router_logits, (size_t)(T * E) * sizeof(float));
    for (int64_t t = 0; t < T; t++) {
        const float *lg = s->router_logits + t * E;
        int32_t *ids = s->topk_ids + t * K;
        float *w = s->topk_w + t * K;
        topk_desc(lg, E, K, ids, w);
        ctx->kern->softmax(w, K);
        ctx->kern->softmax(s->router_probs + t * E, E);
    }
}

/* Group (token, slot) pairs by expert: counting sort + prefix sum into the row map.
 * Each group is padded with zero rows (token -1, weight 0) to a multiple of group_pad. */
static void group_tokens(colibri_ctx *ctx, int64_t T) {
    const cb_config *c = &ctx->cfg;
    cb_scratch *s = &ctx->s;
    int64_t E = c->n_experts, K = c->top_k, pad = ctx->group_pad;
    for (int64_t e = 0; e < E; e++) s->expert_count[e] = 0;
    for (int64_t i = 0; i < T * K; i++) s->expert_count[s->topk_ids[i]]++;
    s->expert_offset[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        int64_t n = s->expert_count[e];
        int64_t padded = (n + pad - 1) / pad * pad;
        s->expert_offset[e + 1] = s->expert_offset[e] + padded;
        s->expert_fill[e] = s->expert_offset[e];
    }
    for (int64_t t = 0; t < T; t++) {
        for (int64_t k = 0; k < K; k++) {
            int32_t e = s->topk_ids[t * K + k];
            int64_t r = s->expert_fill[e]++;
            s->row_token[r] = (int32_t)t;
            s->row_weight[r] = s->topk_w[t * K + k];
        }
    }
    for (int64_t e = 0; e < E; e++) {
        for (int64_t r = s->expert_fill[e]; r < s->expert_offset[e + 1]; r++) {
            s->row_token[r] = -1;
            s->row_weight[r] = 0.0f;
        }
    }
}

/* x[t, :] += b for t < T. x: [T, n]; b: [n]. */
static void add_bias(float *x, const float *b, int64_t T, int64_t n) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < n; i++) x[t * n + i] += b[i];
}

/* Clamp to [-c, c] as torch.clamp_ (NaN stays NaN). */
static void clamp_inplace(float *x, int64_t n, float c) {
    for (int64_t i = 0; i < n; i++) {
        if (x[i] < -c) x[i] = -c;
        else if (x[i] > c) x[i] = c;
    }
}

static void add_inplace(float *x, const float *d, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = x[i] + d[i];
}

/* ---- parallel sections (threadpool.h): each splits OUTPUT rows or columns into chunks
 * that the threads claim, so every thread streams its own part of the weights once and
 * every output element is computed by exactly one chunk, in the same order whatever the
 * chunking (the kernels guarantee it), so results do not depend on num_threads ---------- */

/* Chunks per thread and section: enough that a descheduled thread leaves its share to
 * the others, few enough that claiming costs nothing measurable. */
#define CB_CHUNKS_PER_THREAD 4
/* Matmuls with fewer output rows than this run on the calling thread alone. */
#define CB_PAR_MIN_ROWS 64
/* A down projection over more rows than this takes chunks of at least 256 columns: the fast
 * BF16 table converts the rows' h once per block for all the columns of a chunk (measured by
 * alternating colibri_bench runs: no kernel table is slower with it). */
#define CB_DOWN_FEW_ROWS 8
/* A matmul chunk streams at most about this many weight bytes: the LM head of a 32000-word
 * vocabulary would otherwise take chunks of 8 MB, and the thread that finishes first waits
 * for the other's last one (a decode step's LM head is one such section). */
#define CB_CHUNK_MAX_BYTES (1 << 20)
/* Element-wise / attention work (multiply-adds) below which a stage stays on one thread. */
#define CB_PAR_MIN_WORK 65536

/* Chunk length for n items: about n / (threads * CB_CHUNKS_PER_THREAD), at least lo,
 * a multiple of align (8 rows: the decode tile; 32 columns: the widest down panel). */
static int64_t chunk_len(const colibri_ctx *ctx, int64_t n, int64_t align, int64_t lo) {
    int64_t parts = (int64_t)cb_pool_threads(ctx->pool) * CB_CHUNKS_PER_THREAD;
    int64_t per = (n + parts - 1) / parts;
    if (per < lo) per = lo;
    return (per + align - 1) / align * align;
}

typedef struct mm_job {
    float *y;          /* [T, N] */
    const float *x;    /* [T, K] */
    cb_mat w;          /* [N, K] in w.dt, and its panel copy in fast mode */
    int64_t N, K;
    int64_t len, nch;  /* rows per chunk, chunks */
} mm_job;

typedef struct mm_task {
    const cb_kernels *kern;
    const cb_fast_kernels *fast; /* fast mode's table, or NULL */
    const cb_panel_kernels *pan; /* the panel copies' kernels (w.pan set), or NULL */
    int64_t T;
    int n_jobs;
    mm_job jobs[3];
} mm_task;

static void mm_chunk(void *arg, int64_t c, int tid) {
    (void)tid;
    const mm_task *m = (const mm_task *)arg;
    int j = 0;
    while (c >= m->jobs[j].nch) c -= m->jobs[j++].nch;
    const mm_job *b = &m->jobs[j];
    int64_t n0 = c * b->len, n1 = n0 + b->len < b->N ? n0 + b->len : b->N;
    size_t row = (size_t)cb_row_bytes(b->w.dt, (uint64_t)b->K);
    const void *w = (const uint8_t *)b->w.w + (size_t)n0 * row;
    if (b->w.pan) /* the panel copy (model/panels.c): chunks of whole groups */
        m->pan->matmul_panels(b->y + n0, b->N, b->x, b->w.pan, m->T, b->N, b->K, n0, n1);
    else if (cb_fast_takes(m->fast, b->w.dt, b->K))
        m->fast->matmul_ld(b->y + n0, b->N, b->x, w, b->w.dt, m->T, n1 - n0, b->K);
    else
        m->kern->matmul_ld(b->y + n0, b->N, b->x, w, b->w.dt, m->T, n1 - n0, b->K);
}

/* y = x W^T for up to three matmuls over the same T tokens, in one parallel section. */
static void par_matmul(colibri_ctx *ctx, mm_task *m) {
    int64_t rows = 0, total = 0;
    for (int j = 0; j < m->n_jobs; j++) rows += m->jobs[j].N;
    for (int j = 0; j < m->n_jobs; j++) {
        mm_job *b = &m->jobs[j];
        int64_t align = b->w.pan ? m->pan->rows : 8;
        b->len = rows < CB_PAR_MIN_ROWS ? b->N : chunk_len(ctx, b->N, align, 16);
        int64_t cap = CB_CHUNK_MAX_BYTES / cb_row_bytes(b->w.dt, (uint64_t)b->K) / align * align;
        if (b->len > cap && cap > 0) b->len = cap;
        b->nch = (b->N + b->len - 1) / b->len;
        total += b->nch;
    }
    if (rows < CB_PAR_MIN_ROWS) cb_pool_run(NULL, mm_chunk, m, total);
    else cb_pool_run(ctx->pool, mm_chunk, m, total);
}

static void par_matmul1(colibri_ctx *ctx, float *y, const float *x, cb_mat w, int64_t T, int64_t N,
                        int64_t K) {
    mm_task m = {ctx->kern, ctx->fast, ctx->pan, T, 1, {{y, x, w, N, K, 0, 0}}};
    par_matmul(ctx, &m);
}

void cb_matmul_par(colibri_ctx *ctx, float *y, const float *x, cb_mat w, int64_t T, int64_t N, int64_t K) {
    par_matmul1(ctx, y, x, w, T, N, K);
}

void cb_matmul_par2(colibri_ctx *ctx, const float *x, int64_t T, int64_t K, float *y1, cb_mat w1, int64_t N1,
                    float *y2, cb_mat w2, int64_t N2) {
    mm_task m = {ctx->kern, ctx->fast, ctx->pan, T, 2, {{y1, x, w1, N1, K, 0, 0}, {y2, x, w2, N2, K, 0, 0}}};
    par_matmul(ctx, &m);
}

/* Fast mode (cpu/fast.h): the n activations about to enter a BF16 weight matmul, rounded to
 * bf16 in place (the router has already read them). Exact mode: nothing. */
static void fast_round(const colibri_ctx *ctx, float *x, int64_t n, int bf16) {
    if (ctx->fast && bf16) cb_round_bf16(x, n);
}

/* 1 when an FFN's gate/up weights are BF16 (their input is rounded in fast mode). */
static int ffn_bf16(const cb_ffn *f) { return f->dt == COLIBRI_DTYPE_BF16; }

typedef struct att_task {
    colibri_ctx *ctx;
    uint32_t layer;
    int64_t window;
} att_task;

/* Attention chunks of one segment (rows of one sequence at consecutive positions):
 * CB_ATT_HEADS query heads of one KV group per chunk (fewer at the end of a group), so the
 * kernel shares each key and value load between them; the running thread's own score rows. */
static int64_t att_chunks(const cb_config *c) {
    int64_t group = c->n_heads / c->n_kv_heads;
    return c->n_kv_heads * ((group + CB_ATT_HEADS - 1) / CB_ATT_HEADS);
}

/* Chunk ch = (segment, head range): the segment's queries over its own sequence's cache. */
static void att_chunk(void *arg, int64_t ch, int tid) {
    const att_task *a = (const att_task *)arg;
    colibri_ctx *ctx = a->ctx;
    const cb_config *c = &ctx->cfg;
    const cb_scratch *s = &ctx->s;
    int64_t nch = att_chunks(c), seg = ch / nch;
    ch %= nch;
    int64_t group = c->n_heads / c->n_kv_heads, per = (group + CB_ATT_HEADS - 1) / CB_ATT_HEADS;
    int64_t h0 = ch / per * group + ch % per * CB_ATT_HEADS;
    int64_t h1 = h0 + CB_ATT_HEADS < (ch / per + 1) * group ? h0 + CB_ATT_HEADS : (ch / per + 1) * group;
    int64_t r0 = s->seg_row[seg], T = s->seg_row[seg + 1] - r0, Nq = (int64_t)c->n_heads * c->head_dim;
    cb_kv_view kv = cb_kv_layer_view(&ctx->sess.kv, s->row_seq[r0], a->layer);
    const float *sinks = ctx->w.layers[a->layer].sinks;
    if (s->att_work_bytes) /* fast mode's (cpu/fast.h) */
        ctx->fast->attention_heads(s->att + r0 * Nq, s->q + r0 * Nq, &kv, s->att_work + (size_t)tid * s->att_work_bytes,
                                   T, s->row_pos[r0], c->n_heads, c->n_kv_heads, c->head_dim, a->window, sinks, h0,
                                   h1);
    else
        ctx->kern->attention_heads(s->att + r0 * Nq, s->q + r0 * Nq, &kv,
                                   s->att_scores + (int64_t)tid * ctx->max_seq_len * CB_ATT_HEADS, T,
                                   s->row_pos[r0], c->n_heads, c->n_kv_heads, c->head_dim, a->window, sinks, h0,
                                   h1);
}

/* One FFN job: a group of rows through one expert's weights (cb_ffn, packed or split). */
typedef struct ffn_job {
    float *y;          /* [R, H] */
    float *h;          /* [R, I] */
    const float *x;    /* [R, H] */
    const cb_ffn *f;
    int64_t e;         /* the expert */
    int64_t R, I;
    float *u;           /* NULL: silu_glu; else clamped_swiglu (split FFN) with this [R, I]
                         * scratch for the up projection */
    /* set by par_ffn */
    int64_t len0, nch0; /* gate/up: intermediate columns per chunk, chunks (split: blocks) */
    int64_t len1, nch1; /* down, jobs not split: output columns per chunk, chunks */
    float *part;        /* NULL, or the split down projection's [nch0, R, H] block sums */
    uint32_t *ready;    /* split: [2, nch0] flags, block b's h ready, its sums ready */
} ffn_job;

static ffn_job ffn_job_of(float *y, float *h, const float *x, const cb_ffn *f, int64_t e, int64_t R, int64_t I,
                          float *u) {
    return (ffn_job){.y = y, .h = h, .x = x, .f = f, .e = e, .R = R, .I = I, .u = u};
}


/* Every non-empty expert group of a layer (or one dense/shared FFN). Section 0: every
 * job's gate/up chunks (by intermediate columns), then the split jobs' down blocks, then
 * their sums, row by row; section 1: the down projections of the jobs not split (by output
 * columns). A split job's gate/up chunk c computes the h columns of its down block c, and
 * flags (core/threadpool.h cb_pool_await) hand h to the block's down chunk and the blocks'
 * sums to the row sums, so a decode step's FFN is one section that ends on short chunks. */
typedef struct ffn_task {
    const cb_kernels *kern;
    const cb_fast_kernels *fast; /* fast mode's table, or NULL */
    const cb_panel_kernels *pan; /* the panel copies' kernels (f->pan set), or NULL */
    int64_t H, B;
    int n_jobs;
    int phase;         /* section 0 or 1 */
    int64_t n_gateup, n_blocks; /* section 0's gate/up chunks, then its down-block chunks */
    uint32_t stamp;    /* this call's value of the split jobs' ready flags */
    const ffn_job *jobs;
    float limit, alpha; /* clamped_swiglu's (jobs with u) */
} ffn_task;

/* y[:, 0..N) (row stride ldy) = x W^T on the fast table when it takes W, else the kernels'. */
static void ffn_matmul(const ffn_task *f, float *y, int64_t ldy, const float *x, const void *w, uint32_t dt,
                       int64_t R, int64_t N, int64_t K) {
    if (cb_fast_takes(f->fast, dt, K)) f->fast->matmul_ld(y, ldy, x, w, dt, R, N, K);
    else f->kern->matmul_ld(y, ldy, x, w, dt, R, N, K);
}

/* clamped_swiglu (gpt-oss, transformers' GptOssExperts._apply_gate) for intermediate
 * columns lo..hi of a split FFN job: g = x Wg^T + bg, u = x Wu^T + bu (plain matmuls, then
 * the biases), g = min(g, limit), u = clamp(u, -limit, limit),
 * h = (u + 1) * (g * sigmoid(g * alpha)). */
static void gateup_clamped(const ffn_task *f, const ffn_job *b, int64_t lo, int64_t hi) {
    const cb_ffn *w = b->f;
    int64_t H = f->H, I = b->I;
    size_t rb = (size_t)cb_row_bytes(w->dt, (uint64_t)H);
    const uint8_t *g = (const uint8_t *)w->gate + (size_t)b->e * w->gu_stride + (size_t)lo * rb;
    const uint8_t *u = (const uint8_t *)w->up + (size_t)b->e * w->gu_stride + (size_t)lo * rb;
    ffn_matmul(f, b->h + lo, I, b->x, g, w->dt, b->R, hi - lo, H);
    ffn_matmul(f, b->u + lo, I, b->x, u, w->dt, b->R, hi - lo, H);
    const float *gb = w->gate_bias ? w->gate_bias + b->e * I : NULL;
    const float *ub = w->up_bias ? w->up_bias + b->e * I : NULL;
    const float lim = f->limit, alpha = f->alpha;
    for (int64_t r = 0; r < b->R; r++) {
        float *hr = b->h + r * I;
        const float *ur = b->u + r * I;
        for (int64_t i = lo; i < hi; i++) {
            float gv = gb ? hr[i] + gb[i] : hr[i], uv = ub ? ur[i] + ub[i] : ur[i];
            if (gv > lim) gv = lim; /* torch.clamp: NaN stays NaN */
            if (uv < -lim) uv = -lim;
            else if (uv > lim) uv = lim;
            float sg = 1.0f / (1.0f + expf(-(gv * alpha)));
            hr[i] = (uv + 1.0f) * (gv * sg);
        }
    }
}

/* h[:, lo..hi) of job b: gate/up, the activation, and in fast mode h rounded to bf16 when
 * the down projection takes bf16 (a fast table's packed gate/up rounds h itself). */
static void gateup_cols(const ffn_task *f, const ffn_job *b, int64_t lo, int64_t hi) {
    const cb_ffn *w = b->f;
    int rounded = 0;
    if (b->u) {
        gateup_clamped(f, b, lo, hi);
    } else if (w->pan) { /* the panel copy (model/panels.c) */
        f->pan->gateup_panels(b->h, b->x, (const uint8_t *)w->pan + (size_t)b->e * w->stride, b->R, f->H, b->I, lo,
                              hi);
        rounded = 1; /* a fast table's rounds h itself */
    } else if (w->packed && cb_fast_takes_packed(f->fast, w->dt, f->H, b->I)) {
        f->fast->gateup_packed(b->h, b->x, (const uint8_t *)w->packed + (size_t)b->e * w->stride, b->R, f->H, b->I,
                               f->B, lo, hi);
        rounded = 1;
    } else if (w->packed) {
        f->kern->expert_gateup(b->h, b->x, (const uint8_t *)w->packed + (size_t)b->e * w->stride, NULL, w->dt, b->R,
                               f->H, b->I, f->B, lo, hi);
    } else if (cb_fast_takes(f->fast, w->dt, f->H)) {
        f->fast->gateup(b->h, b->x, (const uint8_t *)w->gate + (size_t)b->e * w->gu_stride,
                        (const uint8_t *)w->up + (size_t)b->e * w->gu_stride, w->dt, b->R, f->H, b->I, lo, hi);
    } else {
        f->kern->expert_gateup(b->h, b->x, (const uint8_t *)w->gate + (size_t)b->e * w->gu_stride,
                               (const uint8_t *)w->up + (size_t)b->e * w->gu_stride, w->dt, b->R, f->H, b->I, 0, lo,
                               hi);
    }
    if (f->fast && w->down_dt == COLIBRI_DTYPE_BF16 && !rounded) /* the down projection's input */
        cb_round_bf16_cols(b->h, b->R, b->I, lo, hi);
}

/* Block blk's sums of a split job's down projection: part[blk] = h[:, block] W2[:, block]^T
 * (the fast table's own when it takes the expert). */
static void down_block(const ffn_task *f, const ffn_job *b, int64_t blk) {
    const cb_ffn *w = b->f;
    float *part = b->part + blk * b->R * f->H;
    const void *ew = (const uint8_t *)(w->pan ? w->pan : w->packed) + (size_t)b->e * w->stride;
    if (w->pan) f->pan->down_part_panels(part, b->h, ew, b->R, f->H, b->I, blk);
    else if (cb_fast_takes_packed(f->fast, w->dt, f->H, b->I)) f->fast->down_part(part, b->h, ew, b->R, f->H, b->I, blk);
    else f->kern->expert_down_part(part, b->h, ew, w->dt, b->R, f->H, b->I, blk);
}

/* The down projection of a job not split, output columns lo..hi. */
static void down_cols(const ffn_task *f, const ffn_job *b, int64_t lo, int64_t hi) {
    const cb_ffn *w = b->f;
    if (!w->packed) { /* split FFN: output rows lo..hi of the down matrix [H, I] */
        size_t rb = (size_t)cb_row_bytes(w->down_dt, (uint64_t)b->I);
        const uint8_t *wd = (const uint8_t *)w->down + (size_t)b->e * w->down_stride + (size_t)lo * rb;
        if (cb_fast_takes(f->fast, w->down_dt, b->I))
            f->fast->matmul_ld(b->y + lo, f->H, b->h, wd, w->down_dt, b->R, hi - lo, b->I);
        else
            f->kern->matmul_ld(b->y + lo, f->H, b->h, wd, w->down_dt, b->R, hi - lo, b->I);
        if (w->down_bias) {
            const float *db = w->down_bias + b->e * f->H;
            for (int64_t r = 0; r < b->R; r++)
                for (int64_t k = lo; k < hi; k++) b->y[r * f->H + k] += db[k];
        }
        return;
    }
    const void *ew = (const uint8_t *)(w->pan ? w->pan : w->packed) + (size_t)b->e * w->stride;
    if (w->pan) f->pan->down_panels(b->y, b->h, ew, b->R, f->H, b->I, lo, hi);
    else if (cb_fast_takes_packed(f->fast, w->dt, f->H, b->I))
        f->fast->down_packed(b->y, b->h, ew, b->R, f->H, b->I, lo, hi);
    else f->kern->expert_down(b->y, b->h, ew, w->dt, b->R, f->H, b->I, lo, hi);
}

/* Row r of a split job: y = p0 + p1 + ... in block order, the order expert_down adds them. */
static void sum_row(const ffn_task *f, const ffn_job *b, int64_t r) {
    int64_t H = f->H, n = b->R * H;
    float *y = b->y + r * H;
    const float *p = b->part + r * H;
    for (int64_t k = 0; k < H; k++) y[k] = p[k];
    for (int64_t blk = 1; blk < b->nch0; blk++)
        for (int64_t k = 0; k < H; k++) y[k] = y[k] + p[blk * n + k];
}

static void ffn_chunk(void *arg, int64_t c, int tid) {
    (void)tid;
    const ffn_task *f = (const ffn_task *)arg;
    int j = 0;
    if (f->phase == 1) { /* the down projections of the jobs not split */
        while (c >= f->jobs[j].nch1) c -= f->jobs[j++].nch1;
        const ffn_job *b = &f->jobs[j];
        int64_t lo = c * b->len1, hi = lo + b->len1 < f->H ? lo + b->len1 : f->H;
        down_cols(f, b, lo, hi);
    } else if (c < f->n_gateup) {
        while (c >= f->jobs[j].nch0) c -= f->jobs[j++].nch0;
        const ffn_job *b = &f->jobs[j];
        int64_t lo = c * b->len0, hi = lo + b->len0 < b->I ? lo + b->len0 : b->I;
        gateup_cols(f, b, lo, hi);
        if (b->part) cb_pool_signal(&b->ready[c], f->stamp); /* block c's h */
    } else if ((c -= f->n_gateup) < f->n_blocks) { /* a split job's down block */
        for (;; j++) { /* the split jobs' blocks, in job order */
            if (!f->jobs[j].part) continue;
            if (c < f->jobs[j].nch0) break;
            c -= f->jobs[j].nch0;
        }
        const ffn_job *b = &f->jobs[j];
        cb_pool_await(&b->ready[c], f->stamp);
        down_block(f, b, c);
        cb_pool_signal(&b->ready[b->nch0 + c], f->stamp);
    } else { /* a row of a split job: the sum of its blocks */
        c -= f->n_blocks;
        for (;; j++) { /* the split jobs' rows, in job order */
            if (!f->jobs[j].part) continue;
            if (c < f->jobs[j].R) break;
            c -= f->jobs[j].R;
        }
        const ffn_job *b = &f->jobs[j];
        for (int64_t blk = 0; blk < b->nch0; blk++) cb_pool_await(&b->ready[b->nch0 + blk], f->stamp);
        sum_row(f, b, c);
    }
}

_Static_assert(CB_SPLIT_MAX_ROWS <= CB_FAST_PART_MAX_ROWS, "a fast table's down_part takes the split groups");
_Static_assert(CB_DOWN_BLOCK % CB_PANEL_UNITS == 0 && CB_DOWN_BLOCK % 8 == 0,
               "a split job's gate/up chunks (one down block each) keep the gate/up kernels' alignment");

static void par_ffn(colibri_ctx *ctx, ffn_job *jobs, int n_jobs) {
    cb_scratch *s = &ctx->s;
    int64_t H = ctx->cfg.hidden, n_gateup = 0, n_blocks = 0, n_rows = 0, n1 = 0;
    float *part = s->down_part;
    uint32_t *ready = s->split_ready;
    int64_t part_left = s->down_part_rows;
    if (++s->split_stamp <= 1) { /* first use, or the stamp wrapped: no flag may hold it */
        memset(s->split_ready, 0, 2 * (size_t)s->down_part_rows * sizeof *s->split_ready);
        s->split_stamp = 1;
    }
    for (int j = 0; j < n_jobs; j++) {
        ffn_job *b = &jobs[j];
        int64_t nblk = (b->I + CB_DOWN_BLOCK - 1) / CB_DOWN_BLOCK;
        b->part = NULL;
        b->ready = NULL;
        if (b->f->packed && b->R <= CB_SPLIT_MAX_ROWS && nblk * b->R <= part_left &&
            (!cb_fast_takes_packed(ctx->fast, b->f->dt, H, b->I) || ctx->fast->down_part)) {
            /* split: gate/up chunk c = the h columns of down block c */
            b->part = part;
            b->ready = ready;
            part += nblk * b->R * H;
            ready += 2 * nblk; /* nblk <= nblk * R: within 2 * down_part_rows */
            part_left -= nblk * b->R;
            b->len0 = CB_DOWN_BLOCK;
            b->nch0 = nblk;
            b->len1 = 0;
            b->nch1 = 0;
            n_blocks += nblk;
            n_rows += b->R;
        } else {
            b->len0 = chunk_len(ctx, b->I, b->f->pan ? ctx->pan->units : 8, 64);
            b->nch0 = (b->I + b->len0 - 1) / b->len0;
            b->len1 = chunk_len(ctx, H, b->f->pan ? ctx->pan->down_cols : 32, b->R > CB_DOWN_FEW_ROWS ? 256 : 64);
            b->nch1 = (H + b->len1 - 1) / b->len1;
        }
        n_gateup += b->nch0;
        n1 += b->nch1;
    }
    ffn_task f = {ctx->kern, ctx->fast, ctx->pan, H, ctx->cfg.block_size, n_jobs, 0, n_gateup, n_blocks,
                  s->split_stamp, jobs, ctx->cfg.swiglu_limit, ctx->cfg.swiglu_alpha};
    cb_pool_run(ctx->pool, ffn_chunk, &f, n_gateup + n_blocks + n_rows);
    if (n1 > 0) {
        f.phase = 1;
        cb_pool_run(ctx->pool, ffn_chunk, &f, n1);
    }
}

/* delta[t, cols] = sum over t's rows r (expert order) of weight_r * ex_out[r, cols]. */
typedef struct combine_task {
    colibri_ctx *ctx;
    int64_t rows, len;
} combine_task;

static void combine_chunk(void *arg, int64_t c, int tid) {
    (void)tid;
    const combine_task *m = (const combine_task *)arg;
    cb_scratch *s = &m->ctx->s;
    int64_t T = m->ctx->run.T, H = m->ctx->cfg.hidden;
    int64_t c0 = c * m->len, c1 = c0 + m->len < H ? c0 + m->len : H;
    for (int64_t t = 0; t < T; t++) memset(s->delta + t * H + c0, 0, (size_t)(c1 - c0) * sizeof(float));
    for (int64_t r = 0; r < m->rows; r++) { /* rows are in expert order, as HF's index_add_ */
        int32_t t = s->row_token[r];
        if (t < 0) continue;
        float w = s->row_weight[r];
        float *d = s->delta + (int64_t)t * H;
        const float *y = s->ex_out + r * H;
        for (int64_t i = c0; i < c1; i++) d[i] += y[i] * w;
    }
}

/* ---- the stages of a forward (colibri.h, "Observation"); each works on the chunk in
 * ctx->run: T rows, row t = token s->run_ids[t] of sequence s->row_seq[t] at position
 * s->row_pos[t] ------------------------------------------------------------------------ */

/* Widen the chunk's embedding rows into x; the chunk's RoPE tables. */
static void stage_embedding(colibri_ctx *ctx) {
    const cb_config *c = &ctx->cfg;
    cb_scratch *s = &ctx->s;
    int64_t T = ctx->run.T, H = c->hidden, half = c->head_dim / 2;
    float af = c->rope_attention_factor; /* 1 but for YaRN: cos * af, sin * af as transformers */
    cb_mat E = ctx->w.tok_embd;
    size_t rb = (size_t)cb_row_bytes(E.dt, (uint64_t)H);
    for (int64_t t = 0; t < T; t++)
        ctx->kern->dequant_row(s->x + t * H, (const uint8_t *)E.w + (size_t)s->run_ids[t] * rb, E.dt, H);
    for (int64_t t = 0; t < T; t++) {
        float p = (float)s->row_pos[t];
        for (int64_t i = 0; i < half; i++) {
            float f = p * s->inv_freq[i];
            s->rope_cos[t * half + i] = cosf(f) * af;
            s->rope_sin[t * half + i] = sinf(f) * af;
        }
    }
}

/* x += o_proj(attention(norm(x))); then xn = ffn_norm(x), the input of the FFN stages. */
static void stage_attention(colibri_ctx *ctx, uint32_t l) {
    const cb_config *c = &ctx->cfg;
    const cb_kernels *K = ctx->kern;
    const cb_layer *L = &ctx->w.layers[l];
    cb_scratch *s = &ctx->s;
    int64_t T = ctx->run.T;
    int64_t H = c->hidden, hd = c->head_dim;
    int64_t Nq = (int64_t)c->n_heads * hd, Nkv = (int64_t)c->n_kv_heads * hd;
    float eps = (float)c->rms_norm_eps;
    cb_kv *kv = &ctx->sess.kv;

    ctx->run.att_layer = (int32_t)l;
    if (c->attention == CB_ATTN_MLA) { /* multi-head latent attention (mla.c) */
        cb_mla_attention(ctx, l);
        return;
    }
    K->rmsnorm(s->xn, s->x, L->attn_norm, T, H, eps);
    {
        fast_round(ctx, s->xn, T * H, L->wq.dt == COLIBRI_DTYPE_BF16 || L->wk.dt == COLIBRI_DTYPE_BF16 ||
                                          L->wv.dt == COLIBRI_DTYPE_BF16);
        mm_task m = {K, ctx->fast, ctx->pan, T, 3, {{s->q, s->xn, L->wq, Nq, H, 0, 0},
                               {s->k, s->xn, L->wk, Nkv, H, 0, 0},
                               {s->v, s->xn, L->wv, Nkv, H, 0, 0}}};
        par_matmul(ctx, &m);
    }
    if (L->bq) {
        add_bias(s->q, L->bq, T, Nq);
        add_bias(s->k, L->bk, T, Nkv);
        add_bias(s->v, L->bv, T, Nkv);
    }
    if (c->qk_norm == CB_QKNORM_HEAD) { /* RMSNorm over each head's head_dim values */
        K->rmsnorm(s->q, s->q, L->q_norm, T * c->n_heads, hd, eps);
        K->rmsnorm(s->k, s->k, L->k_norm, T * c->n_kv_heads, hd, eps);
    } else if (c->qk_norm == CB_QKNORM_FULL) { /* RMSNorm over the whole projection */
        K->rmsnorm(s->q, s->q, L->q_norm, T, Nq, eps);
        K->rmsnorm(s->k, s->k, L->k_norm, T, Nkv, eps);
    }
    if (c->clip_qkv > 0.0f) {
        clamp_inplace(s->q, T * Nq, c->clip_qkv);
        clamp_inplace(s->k, T * Nkv, c->clip_qkv);
        clamp_inplace(s->v, T * Nkv, c->clip_qkv);
    }
    K->rope(s->q, T, c->n_heads, hd, s->rope_cos, s->rope_sin);
    K->rope(s->k, T, c->n_kv_heads, hd, s->rope_cos, s->rope_sin);
    /* each row's keys and values into its sequence's blocks (a KV head's positions are
     * contiguous inside a block: [Hkv, block_len, hd] per layer) */
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < c->n_kv_heads; g++) {
            int64_t off = cb_kv_offset(kv, s->row_seq[t], l, g, s->row_pos[t]);
            memcpy(kv->k + off, s->k + t * Nkv + g * hd, (size_t)hd * sizeof(float));
            memcpy(kv->v + off, s->v + t * Nkv + g * hd, (size_t)hd * sizeof(float));
        }
    {
        att_task a = {ctx, l, L->window};
        int64_t work = 0; /* query-key pairs of the chunk */
        for (int64_t g = 0; g < ctx->run.n_seg; g++) {
            int64_t r0 = s->seg_row[g], n = s->seg_row[g + 1] - r0;
            work += n * (s->row_pos[r0] + n);
        }
        /* a decode step over a short cache is a few microseconds: not worth a section */
        cb_pool_run(work * c->n_heads * hd < CB_PAR_MIN_WORK ? NULL : ctx->pool, att_chunk, &a,
                    ctx->run.n_seg * att_chunks(c));
    }
    fast_round(ctx, s->att, T * Nq, L->wo.dt == COLIBRI_DTYPE_BF16);
    par_matmul1(ctx, s->delta, s->att, L->wo, T, H, Nq);
    if (L->bo) add_bias(s->delta, L->bo, T, H);
    add_inplace(s->x, s->delta, T * H);
    K->rmsnorm(s->xn, s->x, L->ffn_norm, T, H, eps);
}

/* Router logits, softmax and top-k (MoE layers). */
static void stage_router(colibri_ctx *ctx, uint32_t l) {
    const cb_config *c = &ctx->cfg;
    const cb_layer *L = &ctx->w.layers[l];
    cb_scratch *s = &ctx->s;
    int64_t T = ctx->run.T;
    if (!L->moe) return;
    if (c->router_int8)
        ctx->kern->matmul_i8(s->router_logits, s->xn, (const int8_t *)L->router, L->router_scale,
                             L->router_zero, T, c->n_experts, c->hidden);
    else
        ctx->kern->matmul(s->router_logits, s->xn, L->router, c->router_dtype, T, c->n_experts, c->hidden);
    if (L->router_b) add_bias(s->router_logits, L->router_b, T, c->n_experts); /* gpt-oss's logit bias */
    if (c->routing == CB_ROUTE_TOPK_SOFTMAX) route_topk_softmax(ctx, T);
    else if (c->routing == CB_ROUTE_SIGMOID_TOPK || c->n_group > 1 || c->routed_scale != 1.0f)
        cb_route_grouped(ctx, l, T); /* route_group.c */
    else route(ctx, T);
}

/* Group the (token, slot) pairs by expert and gather each group's input rows. */
static void stage_grouping(colibri_ctx *ctx, uint32_t l) {
    cb_scratch *s = &ctx->s;
    int64_t H = ctx->cfg.hidden, E = ctx->cfg.n_experts;
    const cb_layer *L = &ctx->w.layers[l];
    if (!L->moe) return;
    if (cb_cpu_moe_input_bf16(ctx, l)) cb_round_bf16(s->xn, ctx->run.T * H);
    group_tokens(ctx, ctx->run.T);
    int64_t rows = s->expert_offset[E];
    for (int64_t r = 0; r < rows; r++) {
        int32_t t = s->row_token[r];
        if (t >= 0) memcpy(s->ex_in + r * H, s->xn + (int64_t)t * H, (size_t)H * sizeof(float));
        else memset(s->ex_in + r * H, 0, (size_t)H * sizeof(float));
    }
}

/* The job of expert e's group (its rows of ex_in / ex_h / ex_out) through the FFN f. */
static ffn_job expert_job(const colibri_ctx *ctx, const cb_ffn *f, int64_t e) {
    const cb_scratch *s = &ctx->s;
    int64_t H = ctx->cfg.hidden, I = ctx->cfg.inter;
    int64_t r0 = s->expert_offset[e], R = s->expert_offset[e + 1] - r0;
    return ffn_job_of(s->ex_out + r0 * H, s->ex_h + r0 * I, s->ex_in + r0 * H, f, e, R, I,
                      ctx->cfg.activation == CB_ACT_CLAMPED_SWIGLU ? s->ex_up + r0 * I : NULL);
}

/* The expert predictor: layer l+1's router applied to layer l's FFN input (the residual
 * after layer l's attention, normed with layer l+1's ffn_norm), top-k of its logits plus its
 * choice bias (group limits ignored) into s->pred_ids, for a trace and for the cache's
 * PREDICT policy (which reads those experts ahead). Run where layer l's FFN input is still
 * in s->x (with a cache: after layer l's plan, so its reads go first). Nothing it computes
 * reaches the logits. */
static void predict_next(colibri_ctx *ctx, uint32_t l) {
    const cb_config *c = &ctx->cfg;
    cb_scratch *s = &ctx->s;
    ctx->run.pred_layer = -1;
    if (l + 1 >= c->n_layers || !ctx->w.layers[l + 1].moe) return;
    int prefetch = ctx->ecache && cb_ecache_policy(ctx->ecache) == COLIBRI_CACHE_PREDICT;
    if (!ctx->trace && !prefetch) return;
    const cb_layer *N = &ctx->w.layers[l + 1];
    int64_t T = ctx->run.T, H = c->hidden, E = c->n_experts, K = c->top_k;
    ctx->kern->rmsnorm(s->pred_xn, s->x, N->ffn_norm, T, H, (float)c->rms_norm_eps);
    if (c->router_int8)
        ctx->kern->matmul_i8(s->pred_logits, s->pred_xn, (const int8_t *)N->router, N->router_scale,
                             N->router_zero, T, E, H);
    else
        ctx->kern->matmul(s->pred_logits, s->pred_xn, N->router, c->router_dtype, T, E, H);
    for (int64_t t = 0; t < T; t++) {
        float *row = s->pred_logits + t * E;
        for (int64_t e = 0; e < E; e++)
            row[e] += (N->router_b ? N->router_b[e] : 0.0f) + (N->router_bias ? N->router_bias[e] : 0.0f);
        topk_desc(row, E, K, s->pred_ids + t * K, s->pred_w + t * K);
    }
    ctx->run.pred_layer = (int32_t)(l + 1);
    if (prefetch) cb_ecache_prefetch(ctx->ecache, l + 1, s->pred_ids, (int)(T * K));
}

/* The routed experts of MoE layer l through the expert cache (model/expert_cache.h): the
 * plan starts the reads of the misses, the predictor reads ahead for layer l+1, and each
 * batch of loaded experts runs from its slot while the other reads go on. The same jobs as
 * without a cache, in other batches: every group's rows are its own, so the bits agree. */
static void expert_ffn_cached(colibri_ctx *ctx, uint32_t l) {
    cb_scratch *s = &ctx->s;
    const cb_ffn *f = &ctx->w.layers[l].experts;
    int32_t *order, *ready;
    uint8_t *done;
    cb_ecache_buffers(ctx->ecache, &order, &ready, &done);
    cb_ffn views[CB_FFN_BATCH];
    ffn_job jobs[CB_FFN_BATCH];
    int n = cb_ecache_plan(ctx->ecache, l, s->expert_count, order), left = n;
    memset(done, 0, (size_t)n);
    predict_next(ctx, l);
    while (left > 0) {
        int m = cb_ecache_wait(ctx->ecache, l, order, done, n, ready);
        for (int i0 = 0; i0 < m; i0 += CB_FFN_BATCH) {
            int nb = m - i0 < CB_FFN_BATCH ? m - i0 : CB_FFN_BATCH;
            for (int j = 0; j < nb; j++) {
                int32_t e = order[ready[i0 + j]];
                cb_ecache_view(ctx->ecache, l, e, f, ctx->cfg.hidden, &views[j]);
                jobs[j] = expert_job(ctx, &views[j], e);
                jobs[j].e = 0; /* the view's expert 0 is e */
            }
            par_ffn(ctx, jobs, nb);
            for (int j = 0; j < nb; j++) {
                done[ready[i0 + j]] = 1;
                cb_ecache_ran(ctx->ecache, l, order[ready[i0 + j]]);
            }
        }
        left -= m;
    }
}

/* Each non-empty expert group as one packed FFN over its rows; the shared expert and its
 * gate (sh_gate ends as sigmoid values); or a dense layer's MLP straight into delta. */
static void stage_expert_ffn(colibri_ctx *ctx, uint32_t l) {
    const cb_config *c = &ctx->cfg;
    const cb_kernels *K = ctx->kern;
    const cb_layer *L = &ctx->w.layers[l];
    cb_scratch *s = &ctx->s;
    int64_t T = ctx->run.T, H = c->hidden, E = c->n_experts;
    ffn_job jobs[CB_FFN_BATCH]; /* non-empty groups, run CB_FFN_BATCH at a time */
    int n_jobs = 0;
    if (!L->moe) {
        predict_next(ctx, l);
        fast_round(ctx, s->xn, T * H, ffn_bf16(&L->dense));
        jobs[0] = ffn_job_of(s->delta, s->ffn_h, s->xn, &L->dense, 0, T, c->dense_inter, NULL);
        par_ffn(ctx, jobs, 1);
        return;
    }
    if (ctx->ecache) {
        expert_ffn_cached(ctx, l);
    } else {
        for (int64_t e = 0; e < E; e++) {
            int64_t r0 = s->expert_offset[e], R = s->expert_offset[e + 1] - r0;
            if (R == 0) continue;
            jobs[n_jobs++] = expert_job(ctx, &L->experts, e);
            if (n_jobs == CB_FFN_BATCH) {
                par_ffn(ctx, jobs, n_jobs);
                n_jobs = 0;
            }
        }
        predict_next(ctx, l);
    }
    /* routed sum + sigmoid(g . x) * shared(x), as transformers' Qwen2-MoE */
    if (L->has_shared)
        jobs[n_jobs++] = ffn_job_of(s->sh_out, s->ffn_h, s->xn, &L->shared, 0, T, c->shared_inter, NULL);
    if (n_jobs > 0) par_ffn(ctx, jobs, n_jobs);
    if (L->has_shared) {
        if (L->shared_gate.w) {
            K->matmul(s->sh_gate, s->xn, L->shared_gate.w, L->shared_gate.dt, T, 1, H);
            for (int64_t t = 0; t < T; t++) s->sh_gate[t] = 1.0f / (1.0f + expf(-s->sh_gate[t]));
        }
    }
}

/* delta = sum of weight * expert output per token, in expert order as HF's index_add_,
 * plus the (gated) shared expert; then the residual x += delta. */
static void stage_combine(colibri_ctx *ctx, uint32_t l) {
    const cb_config *c = &ctx->cfg;
    const cb_layer *L = &ctx->w.layers[l];
    cb_scratch *s = &ctx->s;
    int64_t T = ctx->run.T, H = c->hidden, E = c->n_experts;
    if (L->moe) {
        combine_task m = {ctx, s->expert_offset[E], H};
        if (m.rows * H < CB_PAR_MIN_WORK) {
            combine_chunk(&m, 0, 0);
        } else {
            m.len = chunk_len(ctx, H, 16, 64);
            cb_pool_run(ctx->pool, combine_chunk, &m, (H + m.len - 1) / m.len);
        }
        if (L->has_shared) {
            for (int64_t t = 0; t < T; t++) {
                float g = L->shared_gate.w ? s->sh_gate[t] : 1.0f;
                float *d = s->delta + t * H;
                const float *y = s->sh_out + t * H;
                for (int64_t i = 0; i < H; i++) d[i] += g * y[i];
            }
        }
    }
    add_inplace(s->x, s->delta, T * H);
}

/* Final norm and logits of the rows s->head_idx[0 .. head_rows) (every row, the last one,
 * or those a batch asked for). Each row is normed into xn's first rows, in order, so the
 * LM head reads them contiguously. logits: [head_rows, V]. */
static void stage_lm_head(colibri_ctx *ctx, float *logits) {
    const cb_config *c = &ctx->cfg;
    cb_scratch *s = &ctx->s;
    int64_t R = ctx->run.head_rows, H = c->hidden;
    if (R <= 0) return;
    for (int64_t i = 0; i < R; i++) /* head_idx ascends, so row i is written after it is read */
        ctx->kern->rmsnorm(s->xn + i * H, s->x + (int64_t)s->head_idx[i] * H, ctx->w.out_norm, 1, H,
                           (float)c->rms_norm_eps);
    fast_round(ctx, s->xn, R * H, ctx->w.lm_head.dt == COLIBRI_DTYPE_BF16);
    par_matmul1(ctx, logits, s->xn, ctx->w.lm_head, R, c->vocab, H);
}

int cb_cpu_moe_input_bf16(const colibri_ctx *ctx, uint32_t l) {
    const cb_layer *L = &ctx->w.layers[l];
    return ctx->fast && (ffn_bf16(&L->experts) || (L->has_shared && ffn_bf16(&L->shared)));
}

void cb_cpu_expert_rows(colibri_ctx *ctx, uint32_t l, int64_t e, const float *x, float *h, float *u, float *y,
                        int64_t rows) {
    const cb_ffn *f = &ctx->w.layers[l].experts;
    ffn_job job = ffn_job_of(y, h, x, f, e, rows, ctx->cfg.inter, ctx->cfg.activation == CB_ACT_CLAMPED_SWIGLU ? u : NULL);
    if (rows > 0) par_ffn(ctx, &job, 1);
}

static void cpu_facts(const colibri_ctx *ctx, cb_backend_facts *f) {
    memset(f, 0, sizeof *f);
    snprintf(f->device, sizeof f->device, "cpu: %s (%d threads)", ctx->kernels_desc, (int)ctx->num_threads);
}

const cb_backend cb_backend_cpu = {
    .name = "cpu",
    .embedding = stage_embedding,
    .attention = stage_attention,
    .router = stage_router,
    .grouping = stage_grouping,
    .expert_ffn = stage_expert_ffn,
    .combine = stage_combine,
    .lm_head = stage_lm_head,
    .facts = cpu_facts,
};
