/*
 * parallel.c — the CPU backend's parallel sections (core/threadpool.h): the matmuls, the
 * attention chunks, the FFN jobs and the combine of the stages (stages.c, mla.c). Each
 * splits OUTPUT rows or columns into chunks that the threads claim, so every thread streams
 * its own part of the weights once and every output element is computed by exactly one
 * chunk, in the same order whatever the chunking (the kernels guarantee it), so results do
 * not depend on num_threads.
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

void cb_cpu_par_matmul(colibri_ctx *ctx, cb_mm_task *m) {
    int64_t rows = 0, total = 0;
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
    cb_mm_task m = {ctx->kern, ctx->fast, ctx->pan, T, 1, {{y, x, w, N, K, 0, 0}}};
    cb_cpu_par_matmul(ctx, &m);
}

void cb_matmul_par2(colibri_ctx *ctx, const float *x, int64_t T, int64_t K, float *y1, cb_mat w1, int64_t N1,
                    float *y2, cb_mat w2, int64_t N2) {
    cb_mm_task m = {ctx->kern, ctx->fast, ctx->pan, T, 2, {{y1, x, w1, N1, K, 0, 0}, {y2, x, w2, N2, K, 0, 0}}};
    cb_cpu_par_matmul(ctx, &m);
}




/* Attention chunks of one segment (rows of one sequence at consecutive positions):
 * CB_ATT_HEADS query heads of one KV group per chunk (fewer at the end of a group), so the
 * kernel shares each key and value load between them; the running thread's own score rows. */
int64_t cb_cpu_att_chunks(const cb_config *c) {
    int64_t group = c->n_heads / c->n_kv_heads;
    return c->n_kv_heads * ((group + CB_ATT_HEADS - 1) / CB_ATT_HEADS);
}

/* Chunk ch = (segment, head range): the segment's queries over its own sequence's cache. */
void cb_cpu_att_chunk(void *arg, int64_t ch, int tid) {
    const cb_att_task *a = (const cb_att_task *)arg;
    colibri_ctx *ctx = a->ctx;
    const cb_config *c = &ctx->cfg;
    const cb_scratch *s = &ctx->s;
    int64_t nch = cb_cpu_att_chunks(c), seg = ch / nch;
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
    const cb_ffn_job *jobs;
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
static void gateup_clamped(const ffn_task *f, const cb_ffn_job *b, int64_t lo, int64_t hi) {
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
static void gateup_cols(const ffn_task *f, const cb_ffn_job *b, int64_t lo, int64_t hi) {
    const cb_ffn *w = b->f;
    int rounded = 0;
    if (b->u) {
        gateup_clamped(f, b, lo, hi);
    } else if (w->pan) { /* the panel copy (backend/cpu/panels.c) */
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
static void down_block(const ffn_task *f, const cb_ffn_job *b, int64_t blk) {
    const cb_ffn *w = b->f;
    float *part = b->part + blk * b->R * f->H;
    const void *ew = (const uint8_t *)(w->pan ? w->pan : w->packed) + (size_t)b->e * w->stride;
    if (w->pan) f->pan->down_part_panels(part, b->h, ew, b->R, f->H, b->I, blk);
    else if (cb_fast_takes_packed(f->fast, w->dt, f->H, b->I)) f->fast->down_part(part, b->h, ew, b->R, f->H, b->I, blk);
    else f->kern->expert_down_part(part, b->h, ew, w->dt, b->R, f->H, b->I, blk);
}

/* The down projection of a job not split, output columns lo..hi. */
static void down_cols(const ffn_task *f, const cb_ffn_job *b, int64_t lo, int64_t hi) {
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
        down_cols(f, b, lo, hi);
    } else if (c < f->n_gateup) {
        while (c >= f->jobs[j].nch0) c -= f->jobs[j++].nch0;
        const cb_ffn_job *b = &f->jobs[j];
        int64_t lo = c * b->len0, hi = lo + b->len0 < b->I ? lo + b->len0 : b->I;
        gateup_cols(f, b, lo, hi);
        if (b->part) cb_pool_signal(&b->ready[c], f->stamp); /* block c's h */
    } else if ((c -= f->n_gateup) < f->n_blocks) { /* a split job's down block */
        for (;; j++) { /* the split jobs' blocks, in job order */
            if (!f->jobs[j].part) continue;
            if (c < f->jobs[j].nch0) break;
            c -= f->jobs[j].nch0;
        }
        const cb_ffn_job *b = &f->jobs[j];
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
        const cb_ffn_job *b = &f->jobs[j];
        for (int64_t blk = 0; blk < b->nch0; blk++) cb_pool_await(&b->ready[b->nch0 + blk], f->stamp);
        sum_row(f, b, c);
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
        float w = s->row_weight[r];
        float *d = s->delta + (int64_t)t * H;
        const float *y = s->ex_out + r * H;
        for (int64_t i = c0; i < c1; i++) d[i] += y[i] * w;
    }
}
