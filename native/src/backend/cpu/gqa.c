/*
 * gqa.c — grouped-query attention (model.attention "gqa": every family but DeepSeek's), the
 * attention stage of the layers of a GQA file: the q/k/v projections (one parallel section),
 * the family's biases, q/k RMSNorm and clipping, RoPE, each row's keys and values into its
 * sequence's cache blocks, the attention of each segment (rows of one sequence) over its own
 * cache by chunks of query heads (the layer's heads kernel: fast mode's or the exact
 * table's), then o_proj. Its two operations (cb_att_op), bound per layer by bind.c, differ
 * only in the heads kernel; multi-head latent attention is mla.c's.
 */
#define _GNU_SOURCE
#include <string.h>

#include "backend/cpu/cpu.h"

/* Clamp to [-c, c] as torch.clamp_ (NaN stays NaN). */
static void clamp_inplace(float *x, int64_t n, float c) {
    for (int64_t i = 0; i < n; i++) {
        if (x[i] < -c) x[i] = -c;
        else if (x[i] > c) x[i] = c;
    }
}

/* Attention chunks of one segment (rows of one sequence at consecutive positions):
 * CB_ATT_HEADS query heads of one KV group per chunk (fewer at the end of a group), so the
 * kernel shares each key and value load between them; the running thread's own score rows. */
static int64_t att_chunks(const cb_config *c) {
    int64_t group = c->n_heads / c->n_kv_heads;
    return c->n_kv_heads * ((group + CB_ATT_HEADS - 1) / CB_ATT_HEADS);
}

static void heads_fast(const cb_att_task *a, const cb_kv_view *kv, int64_t r0, int64_t T, int64_t h0, int64_t h1,
                       int tid) {
    const colibri_ctx *ctx = a->ctx;
    const cb_config *c = &ctx->cfg;
    const cb_scratch *s = &ctx->s;
    int64_t Nq = (int64_t)c->n_heads * c->head_dim;
    ctx->fast->attention_heads(s->att + r0 * Nq, s->q + r0 * Nq, kv, s->att_work + (size_t)tid * s->att_work_bytes, T,
                               s->row_pos[r0], c->n_heads, c->n_kv_heads, c->head_dim, a->window,
                               ctx->w.layers[a->layer].sinks, h0, h1);
}

static void heads_exact(const cb_att_task *a, const cb_kv_view *kv, int64_t r0, int64_t T, int64_t h0,
                        int64_t h1, int tid) {
    const colibri_ctx *ctx = a->ctx;
    const cb_config *c = &ctx->cfg;
    const cb_scratch *s = &ctx->s;
    int64_t Nq = (int64_t)c->n_heads * c->head_dim;
    ctx->kern->attention_heads(s->att + r0 * Nq, s->q + r0 * Nq, kv,
                               s->att_scores + (int64_t)tid * ctx->max_seq_len * CB_ATT_HEADS, T, s->row_pos[r0],
                               c->n_heads, c->n_kv_heads, c->head_dim, a->window, ctx->w.layers[a->layer].sinks, h0,
                               h1);
}

/* Chunk ch = (segment, head range): the segment's queries over its own sequence's cache. */
static void att_chunk(void *arg, int64_t ch, int tid) {
    const cb_att_task *a = (const cb_att_task *)arg;
    colibri_ctx *ctx = a->ctx;
    const cb_config *c = &ctx->cfg;
    const cb_scratch *s = &ctx->s;
    int64_t nch = att_chunks(c), seg = ch / nch;
    ch %= nch;
    int64_t group = c->n_heads / c->n_kv_heads, per = (group + CB_ATT_HEADS - 1) / CB_ATT_HEADS;
    int64_t h0 = ch / per * group + ch % per * CB_ATT_HEADS;
    int64_t h1 = h0 + CB_ATT_HEADS < (ch / per + 1) * group ? h0 + CB_ATT_HEADS : (ch / per + 1) * group;
    int64_t r0 = s->seg_row[seg], T = s->seg_row[seg + 1] - r0;
    cb_kv_view kv = cb_kv_layer_view(&ctx->sess.kv, s->row_seq[r0], a->layer);
    ctx->w.layers[a->layer].att_op->heads(a, &kv, r0, T, h0, h1, tid);
}

/* The attention stage of a grouped-query layer (cb_att_op.stage): x += o_proj(attention(norm(x)));
 * then xn = ffn_norm(x), the input of the FFN stages. */
static void gqa_stage(colibri_ctx *ctx, uint32_t l) {
    const cb_config *c = &ctx->cfg;
    const cb_kernels *K = ctx->kern;
    const cb_layer *L = &ctx->w.layers[l];
    cb_scratch *s = &ctx->s;
    int64_t T = ctx->run.T;
    int64_t H = c->hidden, hd = c->head_dim;
    int64_t Nq = (int64_t)c->n_heads * hd, Nkv = (int64_t)c->n_kv_heads * hd;
    float eps = (float)c->rms_norm_eps;
    cb_kv *kv = &ctx->sess.kv;

    K->rmsnorm(s->xn, s->x, L->attn_norm, T, H, eps);
    {
        cb_cpu_fast_round(ctx, s->xn, T * H, L->wq.dt == COLIBRI_DTYPE_BF16 || L->wk.dt == COLIBRI_DTYPE_BF16 ||
                                          L->wv.dt == COLIBRI_DTYPE_BF16);
        cb_mm_task m = {K, ctx->fast, ctx->pan, T, 3, {{.y = s->q, .x = s->xn, .w = L->wq, .N = Nq, .K = H},
                               {.y = s->k, .x = s->xn, .w = L->wk, .N = Nkv, .K = H},
                               {.y = s->v, .x = s->xn, .w = L->wv, .N = Nkv, .K = H}}};
        cb_cpu_par_matmul(ctx, &m);
    }
    if (L->bq) {
        cb_cpu_add_bias(s->q, L->bq, T, Nq);
        cb_cpu_add_bias(s->k, L->bk, T, Nkv);
        cb_cpu_add_bias(s->v, L->bv, T, Nkv);
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
        cb_att_task a = {ctx, l, L->window};
        int64_t work = 0; /* query-key pairs of the chunk */
        for (int64_t g = 0; g < ctx->run.n_seg; g++) {
            int64_t r0 = s->seg_row[g], n = s->seg_row[g + 1] - r0;
            work += n * (s->row_pos[r0] + n);
        }
        /* a decode step over a short cache is a few microseconds: not worth a section */
        cb_pool_run(work * c->n_heads * hd < CB_PAR_MIN_WORK ? NULL : ctx->pool, att_chunk, &a,
                    ctx->run.n_seg * att_chunks(c));
    }
    cb_cpu_fast_round(ctx, s->att, T * Nq, L->wo.dt == COLIBRI_DTYPE_BF16);
    cb_matmul_par(ctx, s->delta, s->att, L->wo, T, H, Nq);
    if (L->bo) cb_cpu_add_bias(s->delta, L->bo, T, H);
    if (ctx->iv) cb_cpu_iv_patch(ctx, COLIBRI_POINT_ATTN_OUT, l, s->delta);
    cb_cpu_add_inplace(s->x, s->delta, T * H);
    K->rmsnorm(s->xn, s->x, L->ffn_norm, T, H, eps);
}

/* fast mode's heads kernel where the scratch carved its work area (cpu/fast.h, model/scratch.c),
 * else the exact table's */
const cb_att_op cb_cpu_att_gqa_fast = {gqa_stage, heads_fast};
const cb_att_op cb_cpu_att_gqa_exact = {gqa_stage, heads_exact};
