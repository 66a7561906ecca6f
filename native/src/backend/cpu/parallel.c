/*
 * parallel.c — the CPU backend's parallel sections (core/threadpool.h): the matmuls, the FFN
 * jobs and the combine of the stages (stages.c, gqa.c, mla.c; the attention chunks are
 * gqa.c's and mla.c's own). Each splits OUTPUT rows or columns into chunks that the threads
 * claim, so every thread streams its own part of the weights once and every output element
 * is computed by exactly one chunk, in the same order whatever the chunking (the kernels
 * guarantee it), so results do not depend on num_threads.
 */
#define _GNU_SOURCE
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu.h"

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

int64_t cb_cpu_chunk_len(const colibri_ctx *ctx, int64_t n, int64_t align, int64_t lo) {
    int64_t parts = (int64_t)cb_pool_threads(ctx->pool) * CB_CHUNKS_PER_THREAD;
    int64_t per = (n + parts - 1) / parts;
    if (per < lo) per = lo;
    return (per + align - 1) / align * align;
}



static void mm_chunk(void *arg, int64_t c, int tid) {
    (void)tid;
    const cb_mm_task *m = (const cb_mm_task *)arg;
    int j = 0;
    while (c >= m->jobs[j].nch) c -= m->jobs[j++].nch;
    const cb_mm_job *b = &m->jobs[j];
    int64_t n0 = c * b->len, n1 = n0 + b->len < b->N ? n0 + b->len : b->N;
    b->w.op->rows(m, b, n0, n1);
}

/* Rows per chunk of cb_cpu_quant_rows. */
#define QUANT_ROWS 16
typedef struct {
    const cb_fast_kernels *fast;
    int8_t *q;
    cb_fast_ablk *a;
    const float *x;
    int64_t T, K;
} quant_rows_task;
static void quant_rows_chunk(void *arg, int64_t c, int tid) {
    (void)tid;
    const quant_rows_task *m = (const quant_rows_task *)arg;
    int64_t t0 = c * QUANT_ROWS, n = m->T - t0 < QUANT_ROWS ? m->T - t0 : QUANT_ROWS;
    m->fast->quant_rows(m->q + t0 * m->K, m->a + t0 * (m->K / 32), m->x + t0 * m->K, n, m->K);
}
void cb_cpu_quant_rows(colibri_ctx *ctx, int8_t *q, cb_fast_ablk *a, const float *x, int64_t T, int64_t K) {
    quant_rows_task m = {ctx->fast, q, a, x, T, K};
    cb_pool_run(T > QUANT_ROWS ? ctx->pool : NULL, quant_rows_chunk, &m, (T + QUANT_ROWS - 1) / QUANT_ROWS);
}

/* The jobs whose matrices take fast mode's int8 path on the first such job's input x: x
 * quantized once (the scratch's x_q) for every chunk of them, instead of once a chunk. */
static void quantize_input(colibri_ctx *ctx, cb_mm_task *m) {
    cb_scratch *s = &ctx->s;
    const float *x = NULL;
    int64_t K = 0;
    for (int j = 0; j < m->n_jobs; j++) {
        cb_mm_job *b = &m->jobs[j];
        b->xq = (cb_fast_qrows){0};
        if (!b->w.op->q8 || !cb_fast_int8_type(b->w.dt) || b->K > s->x_q_cols) continue; /* q8: fast mode's ops */
        if (!x) {
            x = b->x, K = b->K;
            cb_cpu_quant_rows(ctx, s->x_q, s->x_qa, x, m->T, K);
        }
        if (b->x == x && b->K == K) b->xq = (cb_fast_qrows){s->x_q, s->x_qa};
    }
}

void cb_cpu_par_matmul(colibri_ctx *ctx, cb_mm_task *m) {
    int64_t rows = 0, total = 0;
    quantize_input(ctx, m);
    for (int j = 0; j < m->n_jobs; j++) rows += m->jobs[j].N;
    for (int j = 0; j < m->n_jobs; j++) {
        cb_mm_job *b = &m->jobs[j];
        int64_t align = b->w.op->panel_groups ? m->pan->rows : 8;
        b->len = rows < CB_PAR_MIN_ROWS ? b->N : cb_cpu_chunk_len(ctx, b->N, align, 16);
        int64_t cap = CB_CHUNK_MAX_BYTES / cb_row_bytes(b->w.dt, (uint64_t)b->K) / align * align;
        if (b->len > cap && cap > 0) b->len = cap;
        b->nch = (b->N + b->len - 1) / b->len;
        total += b->nch;
    }
    if (rows < CB_PAR_MIN_ROWS) cb_pool_run(NULL, mm_chunk, m, total);
    else cb_pool_run(ctx->pool, mm_chunk, m, total);
}


void cb_matmul_par(colibri_ctx *ctx, float *y, const float *x, cb_mat w, int64_t T, int64_t N, int64_t K) {
    cb_mm_task m = {ctx->kern, ctx->fast, ctx->pan, T, 1, {{.y = y, .x = x, .w = w, .N = N, .K = K}}};
    cb_cpu_par_matmul(ctx, &m);
}

void cb_matmul_par2(colibri_ctx *ctx, const float *x, int64_t T, int64_t K, float *y1, cb_mat w1, int64_t N1,
                    float *y2, cb_mat w2, int64_t N2) {
    cb_mm_task m = {ctx->kern, ctx->fast, ctx->pan, T, 2,
                    {{.y = y1, .x = x, .w = w1, .N = N1, .K = K}, {.y = y2, .x = x, .w = w2, .N = N2, .K = K}}};
    cb_cpu_par_matmul(ctx, &m);
}




/* Every non-empty expert group of a layer (or one dense/shared FFN). Section 0: every
 * job's gate/up chunks (by intermediate columns), then the split jobs' down blocks, then
 * their sums, row by row; section 1: the down projections of the jobs not split (by output
 * columns). A split job's gate/up chunk c computes the h columns of its down block c, and
 * flags (core/threadpool.h cb_pool_await) hand h to the block's down chunk and the blocks'
 * sums to the row sums, so a decode step's FFN is one section that ends on short chunks. */
struct cb_ffn_task {
    const cb_kernels *kern;
    const cb_fast_kernels *fast; /* fast mode's table, or NULL */
    const cb_panel_kernels *pan; /* the panel copies' kernels (f->pan set), or NULL */
    int64_t H, B;
    int n_jobs;
    int phase;         /* section 0 or 1 */
    int64_t n_gateup, n_blocks; /* section 0's gate/up chunks, then its down-block chunks */
    uint32_t stamp;    /* this call's value of the split jobs' ready flags */
    const cb_ffn_job *jobs;
    float limit, alpha; /* clamped_swiglu's (jobs with u) */
};
typedef struct cb_ffn_task ffn_task;

/* ---- the FFN operations (cb_ffn_op): one per layout and table, chosen by cb_cpu_ffn_op ---- */

/* Expert e's gate (or up) rows lo.. of a split FFN. */
static const uint8_t *split_rows(const cb_ffn_job *b, const void *m, int64_t lo, int64_t H) {
    return (const uint8_t *)m + (size_t)b->e * b->f->gu_stride + (size_t)lo * (size_t)cb_row_bytes(b->f->dt, (uint64_t)H);
}

/* A bound FFN's h, rounded to bf16 where its down projection takes bf16 in fast mode and the
 * gate/up kernel has not rounded it (cb_ffn.round_h, set with the op). */
static void round_h(const cb_ffn_job *b, int64_t lo, int64_t hi) {
    if (b->f->round_h) cb_round_bf16_cols(b->h, b->R, b->I, lo, hi);
}

/* Expert e's rows lo.. of an interleaved copy (cpu/qpanel.h) of a split FFN's [E n, K]
 * matrix of dt (lo a multiple of 8). */
static const uint8_t *copy_rows(const void *q, uint32_t dt, int64_t e, int64_t n, int64_t lo, int64_t K) {
    return (const uint8_t *)q + (size_t)(e * n + lo) * (size_t)cb_qpanel_row_bytes(dt, (uint64_t)K);
}

/* Which kernels read a split FFN's gate/up or down (the op table's index). */
enum { SPLIT_EXACT, SPLIT_FAST, SPLIT_COPY };

/* clamped_swiglu (gpt-oss, transformers' GptOssExperts._apply_gate) for intermediate
 * columns lo..hi of a split FFN job: g = x Wg^T + bg, u = x Wu^T + bu (plain matmuls by the
 * kernels `by` names, then the biases), g = min(g, limit), u = clamp(u, -limit, limit),
 * h = (u + 1) * (g * sigmoid(g * alpha)). */
static void gateup_clamped(const ffn_task *f, const cb_ffn_job *b, int64_t lo, int64_t hi, int by) {
    const cb_ffn *w = b->f;
    int64_t H = f->H, I = b->I;
    const uint8_t *g = split_rows(b, w->gate, lo, H), *u = split_rows(b, w->up, lo, H);
    if (by != SPLIT_EXACT && b->xq.q) {
        int il = by == SPLIT_COPY;
        const void *gm = il ? copy_rows(w->gate_q, w->dt, b->e, I, lo, H) : g;
        const void *um = il ? copy_rows(w->up_q, w->dt, b->e, I, lo, H) : u;
        f->fast->matmul_q8(b->h + lo, I, &b->xq, gm, il, w->dt, b->R, hi - lo, H);
        f->fast->matmul_q8(b->u + lo, I, &b->xq, um, il, w->dt, b->R, hi - lo, H);
    } else if (by == SPLIT_COPY) {
        f->fast->qpanels->matmul(b->h + lo, I, b->x, copy_rows(w->gate_q, w->dt, b->e, I, lo, H), w->dt, b->R, hi - lo, H);
        f->fast->qpanels->matmul(b->u + lo, I, b->x, copy_rows(w->up_q, w->dt, b->e, I, lo, H), w->dt, b->R, hi - lo, H);
    } else if (by == SPLIT_FAST) {
        f->fast->matmul_ld(b->h + lo, I, b->x, g, w->dt, b->R, hi - lo, H);
        f->fast->matmul_ld(b->u + lo, I, b->x, u, w->dt, b->R, hi - lo, H);
    } else {
        f->kern->matmul_ld(b->h + lo, I, b->x, g, w->dt, b->R, hi - lo, H);
        f->kern->matmul_ld(b->u + lo, I, b->x, u, w->dt, b->R, hi - lo, H);
    }
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
    round_h(b, lo, hi);
}
static void gu_clamped_copy(const ffn_task *f, const cb_ffn_job *b, int64_t lo, int64_t hi) {
    gateup_clamped(f, b, lo, hi, SPLIT_COPY);
}
static void gu_clamped_fast(const ffn_task *f, const cb_ffn_job *b, int64_t lo, int64_t hi) {
    gateup_clamped(f, b, lo, hi, SPLIT_FAST);
}
static void gu_clamped_exact(const ffn_task *f, const cb_ffn_job *b, int64_t lo, int64_t hi) {
    gateup_clamped(f, b, lo, hi, SPLIT_EXACT);
}

/* h[:, lo..hi) of job b: gate/up and the activation, by layout and table. */
static void gu_panels(const ffn_task *f, const cb_ffn_job *b, int64_t lo, int64_t hi) {
    const cb_ffn *w = b->f; /* the panel copy (backend/cpu/panels.c); its kernels round h */
    f->pan->gateup_panels(b->h, b->x, (const uint8_t *)w->pan + (size_t)b->e * w->stride, b->R, f->H, b->I, lo, hi);
}
static void gu_packed_fast(const ffn_task *f, const cb_ffn_job *b, int64_t lo, int64_t hi) {
    const cb_ffn *w = b->f; /* rounds h itself */
    f->fast->gateup_packed(b->h, b->x, (const uint8_t *)w->packed + (size_t)b->e * w->stride, b->R, f->H, b->I, f->B,
                           lo, hi);
}
static void gu_packed_exact(const ffn_task *f, const cb_ffn_job *b, int64_t lo, int64_t hi) {
    const cb_ffn *w = b->f;
    f->kern->expert_gateup(b->h, b->x, (const uint8_t *)w->packed + (size_t)b->e * w->stride, NULL, w->dt, b->R, f->H,
                           b->I, f->B, lo, hi);
    round_h(b, lo, hi);
}
static void gu_split_fast(const ffn_task *f, const cb_ffn_job *b, int64_t lo, int64_t hi) {
    const cb_ffn *w = b->f;
    const void *g = split_rows(b, w->gate, 0, f->H), *u = split_rows(b, w->up, 0, f->H);
    if (b->xq.q) f->fast->gateup_q8(b->h, &b->xq, g, u, 0, w->dt, b->R, f->H, b->I, lo, hi);
    else f->fast->gateup(b->h, b->x, g, u, w->dt, b->R, f->H, b->I, lo, hi);
    round_h(b, lo, hi);
}
static void gu_split_copy(const ffn_task *f, const cb_ffn_job *b, int64_t lo, int64_t hi) {
    const cb_ffn *w = b->f;
    const void *g = copy_rows(w->gate_q, w->dt, b->e, b->I, 0, f->H);
    const void *u = copy_rows(w->up_q, w->dt, b->e, b->I, 0, f->H);
    if (b->xq.q) f->fast->gateup_q8(b->h, &b->xq, g, u, 1, w->dt, b->R, f->H, b->I, lo, hi);
    else f->fast->qpanels->gateup(b->h, b->x, g, u, w->dt, b->R, f->H, b->I, lo, hi);
    round_h(b, lo, hi);
}
static void gu_split_exact(const ffn_task *f, const cb_ffn_job *b, int64_t lo, int64_t hi) {
    const cb_ffn *w = b->f;
    f->kern->expert_gateup(b->h, b->x, split_rows(b, w->gate, 0, f->H), split_rows(b, w->up, 0, f->H), w->dt, b->R,
                           f->H, b->I, 0, lo, hi);
    round_h(b, lo, hi);
}

/* Block blk's sums of a split job's down projection: part[blk] = h[:, block] W2[:, block]^T. */
static const void *packed_expert(const cb_ffn_job *b) {
    return (const uint8_t *)(b->f->pan ? b->f->pan : b->f->packed) + (size_t)b->e * b->f->stride;
}
static void db_panels(const ffn_task *f, const cb_ffn_job *b, int64_t blk) {
    f->pan->down_part_panels(b->part + blk * b->R * f->H, b->h, packed_expert(b), b->R, f->H, b->I, blk);
}
static void db_fast(const ffn_task *f, const cb_ffn_job *b, int64_t blk) {
    f->fast->down_part(b->part + blk * b->R * f->H, b->h, packed_expert(b), b->R, f->H, b->I, blk);
}
static void db_exact(const ffn_task *f, const cb_ffn_job *b, int64_t blk) {
    f->kern->expert_down_part(b->part + blk * b->R * f->H, b->h, packed_expert(b), b->f->dt, b->R, f->H, b->I, blk);
}

/* The down projection of a job not split, output columns lo..hi. */
static void dc_panels(const ffn_task *f, const cb_ffn_job *b, int64_t lo, int64_t hi) {
    f->pan->down_panels(b->y, b->h, packed_expert(b), b->R, f->H, b->I, lo, hi);
}
static void dc_packed_fast(const ffn_task *f, const cb_ffn_job *b, int64_t lo, int64_t hi) {
    f->fast->down_packed(b->y, b->h, packed_expert(b), b->R, f->H, b->I, lo, hi);
}
static void dc_packed_exact(const ffn_task *f, const cb_ffn_job *b, int64_t lo, int64_t hi) {
    f->kern->expert_down(b->y, b->h, packed_expert(b), b->f->dt, b->R, f->H, b->I, lo, hi);
}
/* split FFN: output rows lo..hi of the down matrix [H, I] by the kernels `by` names, then
 * its bias */
static void split_down(const ffn_task *f, const cb_ffn_job *b, int64_t lo, int64_t hi, int by) {
    const cb_ffn *w = b->f;
    size_t rb = (size_t)cb_row_bytes(w->down_dt, (uint64_t)b->I);
    const uint8_t *wd = (const uint8_t *)w->down + (size_t)b->e * w->down_stride + (size_t)lo * rb;
    if (by != SPLIT_EXACT && b->hq.q) {
        const void *m = by == SPLIT_COPY ? copy_rows(w->down_q, w->down_dt, b->e, f->H, lo, b->I) : wd;
        f->fast->matmul_q8(b->y + lo, f->H, &b->hq, m, by == SPLIT_COPY, w->down_dt, b->R, hi - lo, b->I);
    }
    else if (by == SPLIT_COPY)
        f->fast->qpanels->matmul(b->y + lo, f->H, b->h, copy_rows(w->down_q, w->down_dt, b->e, f->H, lo, b->I),
                                 w->down_dt, b->R, hi - lo, b->I);
    else if (by == SPLIT_FAST) f->fast->matmul_ld(b->y + lo, f->H, b->h, wd, w->down_dt, b->R, hi - lo, b->I);
    else f->kern->matmul_ld(b->y + lo, f->H, b->h, wd, w->down_dt, b->R, hi - lo, b->I);
    if (w->down_bias) {
        const float *db = w->down_bias + b->e * f->H;
        for (int64_t r = 0; r < b->R; r++)
            for (int64_t k = lo; k < hi; k++) b->y[r * f->H + k] += db[k];
    }
}
static void dc_split_copy(const ffn_task *f, const cb_ffn_job *b, int64_t lo, int64_t hi) {
    split_down(f, b, lo, hi, SPLIT_COPY);
}
static void dc_split_fast(const ffn_task *f, const cb_ffn_job *b, int64_t lo, int64_t hi) {
    split_down(f, b, lo, hi, SPLIT_FAST);
}
static void dc_split_exact(const ffn_task *f, const cb_ffn_job *b, int64_t lo, int64_t hi) {
    split_down(f, b, lo, hi, SPLIT_EXACT);
}

/* The operations: packed FFNs (a panel copy, the fast table's packed kernels with or without
 * its down blocks, the exact table's), then split FFNs by [clamped][gate/up by][down by]
 * (SPLIT_EXACT, SPLIT_FAST, SPLIT_COPY). */
static const cb_ffn_op op_panels = {gu_panels, db_panels, dc_panels};
static const cb_ffn_op op_packed_fast = {gu_packed_fast, db_fast, dc_packed_fast};
static const cb_ffn_op op_packed_fast_whole = {gu_packed_fast, NULL, dc_packed_fast};
static const cb_ffn_op op_packed_exact = {gu_packed_exact, db_exact, dc_packed_exact};
#define SPLIT_DOWNS(CL, GU)                                                                  \
    {{CL##GU, NULL, dc_split_exact}, {CL##GU, NULL, dc_split_fast}, {CL##GU, NULL, dc_split_copy}}
static const cb_ffn_op op_split[2][3][3] = {
    {SPLIT_DOWNS(gu_split_, exact), SPLIT_DOWNS(gu_split_, fast), SPLIT_DOWNS(gu_split_, copy)},
    {SPLIT_DOWNS(gu_clamped_, exact), SPLIT_DOWNS(gu_clamped_, fast), SPLIT_DOWNS(gu_clamped_, copy)},
};
#undef SPLIT_DOWNS

/* The kernels of a split FFN's matrix of dt, rows of K: its copy's, the fast table's, or
 * the exact table's. */
static int split_by(const colibri_ctx *ctx, const void *copy, uint32_t dt, int64_t K) {
    return copy ? SPLIT_COPY : cb_fast_takes(ctx->fast, dt, K) ? SPLIT_FAST : SPLIT_EXACT;
}

void cb_cpu_bind_ffn(const colibri_ctx *ctx, cb_ffn *w, int clamped) {
    const cb_fast_kernels *fast = ctx->fast;
    int64_t H = ctx->cfg.hidden, I = w->inter;
    int gu_rounds = 0; /* the gate/up kernel rounds h itself */
    w->q8_in = w->q8_h = 0;
    if (w->pan) {
        w->op = &op_panels;
        gu_rounds = 1;
    } else if (w->packed && cb_fast_takes_packed(fast, w->dt, H, I)) {
        w->op = fast->down_part ? &op_packed_fast : &op_packed_fast_whole;
        gu_rounds = 1;
    } else if (w->packed) {
        w->op = &op_packed_exact;
    } else {
        int gu = split_by(ctx, w->gate_q, w->dt, H), dn = split_by(ctx, w->down_q, w->down_dt, I);
        w->op = &op_split[clamped != 0][gu][dn];
        /* the int8 path of a block type (not fast mode's BF16 kernels) on rows quantized once */
        w->q8_in = gu != SPLIT_EXACT && cb_fast_int8_type(w->dt);
        w->q8_h = dn != SPLIT_EXACT && cb_fast_int8_type(w->down_dt);
    }
    w->round_h = fast && w->down_dt == COLIBRI_DTYPE_BF16 && !gu_rounds;
}

/* Row r of a split job: y = p0 + p1 + ... in block order, the order expert_down adds them. */
static void sum_row(const ffn_task *f, const cb_ffn_job *b, int64_t r) {
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
        const cb_ffn_job *b = &f->jobs[j];
        int64_t lo = c * b->len1, hi = lo + b->len1 < f->H ? lo + b->len1 : f->H;
        b->f->op->down_cols(f, b, lo, hi);
    } else if (c < f->n_gateup) {
        while (c >= f->jobs[j].nch0) c -= f->jobs[j++].nch0;
        const cb_ffn_job *b = &f->jobs[j];
        int64_t lo = c * b->len0, hi = lo + b->len0 < b->I ? lo + b->len0 : b->I;
        b->f->op->gateup(f, b, lo, hi);
        if (b->part) cb_pool_signal(&b->ready[c], f->stamp); /* block c's h */
    } else if ((c -= f->n_gateup) < f->n_blocks) { /* a split job's down block */
        for (;; j++) { /* the split jobs' blocks, in job order */
            if (!f->jobs[j].part) continue;
            if (c < f->jobs[j].nch0) break;
            c -= f->jobs[j].nch0;
        }
        const cb_ffn_job *b = &f->jobs[j];
        cb_pool_await(&b->ready[c], f->stamp);
        b->f->op->down_block(f, b, c);
        cb_pool_signal(&b->ready[b->nch0 + c], f->stamp);
    } else { /* a row of a split job: the sum of its blocks */
        c -= f->n_blocks;
        for (;; j++) { /* the split jobs' rows, in job order */
            if (!f->jobs[j].part) continue;
            if (c < f->jobs[j].R) break;
            c -= f->jobs[j].R;
        }
        const cb_ffn_job *b = &f->jobs[j];
        for (int64_t blk = 0; blk < b->nch0; blk++) cb_pool_await(&b->ready[b->nch0 + blk], f->stamp);
        sum_row(f, b, c);
    }
}

/* The jobs' h rows (those with hq) quantized for their down projections, QUANT_H_ROWS rows a
 * chunk (every job's rows in job order). */
#define QUANT_H_ROWS 16
typedef struct {
    const cb_fast_kernels *fast;
    const cb_ffn_job *jobs;
    int n_jobs;
} quant_h_task;
static void quant_h_chunk(void *arg, int64_t c, int tid) {
    (void)tid;
    const quant_h_task *m = (const quant_h_task *)arg;
    int64_t r0 = c * QUANT_H_ROWS, r1 = r0 + QUANT_H_ROWS;
    int64_t base = 0;
    for (int j = 0; j < m->n_jobs && base < r1; j++) {
        const cb_ffn_job *b = &m->jobs[j];
        if (!b->nch1 || !b->hq.q) continue;
        int64_t lo = r0 > base ? r0 - base : 0, hi = r1 - base < b->R ? r1 - base : b->R;
        if (lo < hi)
            m->fast->quant_rows((int8_t *)b->hq.q + lo * b->I, (cb_fast_ablk *)b->hq.a + lo * (b->I / 32),
                                b->h + lo * b->I, hi - lo, b->I);
        base += b->R;
    }
}

_Static_assert(CB_SPLIT_MAX_ROWS <= CB_FAST_PART_MAX_ROWS, "a fast table's down_part takes the split groups");
_Static_assert(CB_DOWN_BLOCK % CB_PANEL_UNITS == 0 && CB_DOWN_BLOCK % 8 == 0,
               "a split job's gate/up chunks (one down block each) keep the gate/up kernels' alignment");

void cb_cpu_par_ffn(colibri_ctx *ctx, cb_ffn_job *jobs, int n_jobs) {
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
        cb_ffn_job *b = &jobs[j];
        int64_t nblk = (b->I + CB_DOWN_BLOCK - 1) / CB_DOWN_BLOCK;
        b->part = NULL;
        b->ready = NULL;
        if (b->f->op->down_block && b->R <= CB_SPLIT_MAX_ROWS && nblk * b->R <= part_left) {
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
            b->len0 = cb_cpu_chunk_len(ctx, b->I, b->f->pan ? ctx->pan->units : 8, 64);
            b->nch0 = (b->I + b->len0 - 1) / b->len0;
            b->len1 = cb_cpu_chunk_len(ctx, H, b->f->pan ? ctx->pan->down_cols : 32, b->R > CB_DOWN_FEW_ROWS ? 256 : 64);
            b->nch1 = (H + b->len1 - 1) / b->len1;
        }
        n_gateup += b->nch0;
        n1 += b->nch1;
    }
    ffn_task f = {ctx->kern, ctx->fast, ctx->pan, H, ctx->cfg.block_size, n_jobs, 0, n_gateup, n_blocks,
                  s->split_stamp, jobs, ctx->cfg.swiglu_limit, ctx->cfg.swiglu_alpha};
    cb_pool_run(ctx->pool, ffn_chunk, &f, n_gateup + n_blocks + n_rows);
    int64_t hq_rows = 0;
    for (int j = 0; j < n_jobs; j++) hq_rows += jobs[j].nch1 && jobs[j].hq.q ? jobs[j].R : 0;
    if (hq_rows > 0) { /* h's rows quantized once for every down chunk */
        quant_h_task qh = {ctx->fast, jobs, n_jobs};
        cb_pool_run(hq_rows > QUANT_H_ROWS ? ctx->pool : NULL, quant_h_chunk, &qh,
                    (hq_rows + QUANT_H_ROWS - 1) / QUANT_H_ROWS);
    }
    if (n1 > 0) {
        f.phase = 1;
        cb_pool_run(ctx->pool, ffn_chunk, &f, n1);
    }
}

void cb_cpu_combine_chunk(void *arg, int64_t c, int tid) {
    (void)tid;
    const cb_combine_task *m = (const cb_combine_task *)arg;
    cb_scratch *s = &m->ctx->s;
    int64_t T = m->ctx->run.T, H = m->ctx->cfg.hidden;
    int64_t c0 = c * m->len, c1 = c0 + m->len < H ? c0 + m->len : H;
    for (int64_t t = 0; t < T; t++) memset(s->delta + t * H + c0, 0, (size_t)(c1 - c0) * sizeof(float));
    for (int64_t r = 0; r < m->rows; r++) { /* rows are in expert order, as HF's index_add_ */
        int32_t t = s->row_token[r];
        if (t < 0) continue;
        m->ctx->kern->add_scaled(s->delta + (int64_t)t * H + c0, s->ex_out + r * H + c0, s->row_weight[r], c1 - c0);
    }
}
