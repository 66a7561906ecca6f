/*
 * mla.c — multi-head latent attention (model.attention "mla": DeepSeek-V2/V3), the
 * attention stage of the layers of an MLA file, with the up-projections absorbed.
 *
 * Per token: q = W_q x (or W_qb rmsnorm(W_qa x)), split per head into q_nope [dn] and
 * q_pe [dr]; kv_a = W_kva x, split into the latent c [r] (RMSNorm'd by kv_a_norm) and
 * k_pe [dr] (RoPE'd), one k_pe shared by every head. The KV cache holds only [c, k_pe]:
 * r + dr floats per position and layer (not per head). transformers expands the cache
 * per head (k = [W_UK c, k_pe], v = W_UV c); here the product is regrouped instead:
 *   q_nope . (W_UK c) = (q_nope W_UK) . c  -> a latent query q_lat = [q_nope W_UK, q_pe],
 *   score_j = scale * q_lat . [c_j, k_pe_j],  o_lat = sum_j p_j c_j,  v_out = W_UV o_lat,
 * then o_proj. W_UK [dn, r] and W_UV [dv, r] of head h are rows of kv_b [nh*(dn+dv), r]
 * in the mapping (views, no copies; any weight dtype through the kernel table's
 * dequant_row and matmul_ld). The sums are regrouped, so results match transformers to
 * float rounding (docs/format.md, "Family options").
 *
 * Every buffer is the arena's (scratch.c): q [B, nh*(dn+dr)], k [B, r+dr] (the latent
 * rows), mla_qa [B, q_lora_rank], mla_qlat [B, nh, r+dr], mla_olat [nh, B, r], att
 * [B, nh*dv], mla_row [threads, r] and the threads' att_scores rows. Parallel sections
 * split by head (and by row and group of heads for the attention): each output element
 * is computed by one chunk, in one order, whatever the thread count.
 */
#define _GNU_SOURCE
#include <string.h>

#include "backend/cpu/cpu.h"

/* transformers builds q_a_layernorm and kv_a_layernorm without an eps: the RMSNorm
 * default, not config.rms_norm_eps */
#define CB_MLA_NORM_EPS 1e-6f
/* work (multiply-adds) below which a section stays on the calling thread */
#define CB_PAR_MIN_WORK_MLA 65536


typedef struct mla_task {
    colibri_ctx *ctx;
    uint32_t layer;
    int64_t T;
} mla_task;

/* Chunk h: q_lat[t, h, :r] = sum_j q_nope[t, h, j] * W_UK_h[j, :] (j ascending). */
static void absorb_chunk(void *arg, int64_t h, int tid) {
    const mla_task *a = (const mla_task *)arg;
    colibri_ctx *ctx = a->ctx;
    const cb_config *c = &ctx->cfg;
    const cb_layer *L = &ctx->w.layers[a->layer];
    cb_scratch *s = &ctx->s;
    int64_t nh = c->n_heads, r = c->kv_lora_rank, dr = c->head_dim, dn = c->qk_nope_dim, dv = c->v_head_dim;
    int64_t Dc = r + dr, Dq = dn + dr, T = a->T;
    float *w = s->mla_row + (int64_t)tid * r;
    size_t rb = (size_t)cb_row_bytes(L->wkv_b.dt, (uint64_t)r);
    const uint8_t *wk = (const uint8_t *)L->wkv_b.w + (size_t)(h * (dn + dv)) * rb;
    for (int64_t t = 0; t < T; t++) memset(s->mla_qlat + (t * nh + h) * Dc, 0, (size_t)r * sizeof(float));
    for (int64_t j = 0; j < dn; j++) {
        ctx->kern->dequant_row(w, wk + (size_t)j * rb, L->wkv_b.dt, r);
        for (int64_t t = 0; t < T; t++) {
            float qj = s->q[t * nh * Dq + h * Dq + j];
            float *y = s->mla_qlat + (t * nh + h) * Dc;
            for (int64_t i = 0; i < r; i++) y[i] += qj * w[i];
        }
    }
}

/* Chunk (row t, CB_ATT_HEADS heads from h0): softmax(scale * q_lat . [c_j, k_pe_j]) over
 * the row's own sequence's positions 0..pos, and o_lat = sum_j p_j c_j (j ascending). The
 * scores of a block of cached rows are one kernel matmul: the heads' latent queries times
 * the block's rows (contiguous, one latent row per position), each row loaded once for
 * every head of the chunk. */
static void latent_att_chunk(void *arg, int64_t ch, int tid) {
    const mla_task *a = (const mla_task *)arg;
    colibri_ctx *ctx = a->ctx;
    const cb_config *c = &ctx->cfg;
    const cb_scratch *s = &ctx->s;
    const cb_kv *kv = &ctx->sess.kv;
    int64_t nh = c->n_heads, r = c->kv_lora_rank, Dc = r + c->head_dim, T = a->T, S = ctx->max_seq_len;
    int64_t per = (nh + CB_ATT_HEADS - 1) / CB_ATT_HEADS;
    int64_t t = ch / per, h0 = ch % per * CB_ATT_HEADS, hn = nh - h0 < CB_ATT_HEADS ? nh - h0 : CB_ATT_HEADS;
    int32_t seq = s->row_seq[t];
    int64_t pos = s->row_pos[t], P = kv->block_len;
    float *p = s->att_scores + (int64_t)tid * S * CB_ATT_HEADS; /* [hn, S] */
    const float *q = s->mla_qlat + (t * nh + h0) * Dc;
    for (int64_t j0 = 0; j0 <= pos; j0 += P) {
        int64_t n = pos + 1 - j0 < P ? pos + 1 - j0 : P;
        const float *rows = kv->k + cb_kv_offset(kv, seq, a->layer, 0, j0);
        ctx->kern->matmul_ld(p + j0, S, q, rows, COLIBRI_DTYPE_F32, hn, n, Dc);
    }
    for (int64_t h = 0; h < hn; h++) {
        float *ph = p + h * S;
        for (int64_t j = 0; j <= pos; j++) ph[j] *= c->attn_scale;
        ctx->kern->softmax(ph, pos + 1);
        memset(s->mla_olat + ((h0 + h) * T + t) * r, 0, (size_t)r * sizeof(float));
    }
    /* o_h += p_h[j] * c_j, j ascending, block by block of the cache (the kernel table's
     * rows_combine: each row c_j loaded once for the chunk's heads) */
    for (int64_t j0 = 0; j0 <= pos; j0 += P) {
        int64_t n = pos + 1 - j0 < P ? pos + 1 - j0 : P;
        const float *rows = kv->k + cb_kv_offset(kv, seq, a->layer, 0, j0);
        ctx->kern->rows_combine(s->mla_olat + (h0 * T + t) * r, T * r, p + j0, S, rows, Dc, hn, n, r);
    }
}

/* Chunk h: att[t, h*dv ..] = W_UV_h o_lat[h, t] for every row t. */
static void value_chunk(void *arg, int64_t h, int tid) {
    (void)tid;
    const mla_task *a = (const mla_task *)arg;
    colibri_ctx *ctx = a->ctx;
    const cb_config *c = &ctx->cfg;
    const cb_layer *L = &ctx->w.layers[a->layer];
    cb_scratch *s = &ctx->s;
    int64_t nh = c->n_heads, r = c->kv_lora_rank, dn = c->qk_nope_dim, dv = c->v_head_dim, T = a->T;
    size_t rb = (size_t)cb_row_bytes(L->wkv_b.dt, (uint64_t)r);
    const uint8_t *wv = (const uint8_t *)L->wkv_b.w + (size_t)(h * (dn + dv) + dn) * rb;
    ctx->kern->matmul_ld(s->att + h * dv, nh * dv, s->mla_olat + h * T * r, wv, L->wkv_b.dt, T, dv, r);
}

/* The attention stage of an MLA layer (cb_att_op.stage). */
static void mla_stage(colibri_ctx *ctx, uint32_t l) {
    const cb_config *c = &ctx->cfg;
    const cb_kernels *K = ctx->kern;
    const cb_layer *L = &ctx->w.layers[l];
    cb_scratch *s = &ctx->s;
    cb_kv *kv = &ctx->sess.kv;
    int64_t T = ctx->run.T, H = c->hidden, nh = c->n_heads;
    int64_t r = c->kv_lora_rank, dr = c->head_dim, dn = c->qk_nope_dim, dv = c->v_head_dim;
    int64_t Dc = r + dr, Dq = dn + dr, half = dr / 2, ql = c->q_lora_rank;
    float eps = (float)c->rms_norm_eps;
    mla_task a = {ctx, l, T};

    K->rmsnorm(s->xn, s->x, L->attn_norm, T, H, eps);
    cb_cpu_fast_round(ctx, s->xn, T * H, (ql ? L->wq_a.dt : L->wq.dt) == COLIBRI_DTYPE_BF16 ||
                                          L->wkv_a.dt == COLIBRI_DTYPE_BF16);
    /* the two projections of x (q's first, kv_a) in one parallel section */
    if (ql) {
        cb_matmul_par2(ctx, s->xn, T, H, s->mla_qa, L->wq_a, ql, s->k, L->wkv_a, Dc);
        K->rmsnorm(s->mla_qa, s->mla_qa, L->q_a_norm, T, ql, CB_MLA_NORM_EPS);
        cb_cpu_fast_round(ctx, s->mla_qa, T * ql, L->wq_b.dt == COLIBRI_DTYPE_BF16);
        cb_matmul_par(ctx, s->q, s->mla_qa, L->wq_b, T, nh * Dq, ql);
    } else {
        cb_matmul_par2(ctx, s->xn, T, H, s->q, L->wq, nh * Dq, s->k, L->wkv_a, Dc);
    }
    for (int64_t t = 0; t < T; t++) {
        float *row = s->k + t * Dc;
        K->rmsnorm(row, row, L->kv_a_norm, 1, r, CB_MLA_NORM_EPS);
        K->rope(row + r, 1, 1, dr, s->rope_cos + t * half, s->rope_sin + t * half);
        memcpy(kv->k + cb_kv_offset(kv, s->row_seq[t], l, 0, s->row_pos[t]), row, (size_t)Dc * sizeof(float));
        for (int64_t h = 0; h < nh; h++) { /* q_pe, RoPE'd, behind the latent query */
            float *qp = s->mla_qlat + (t * nh + h) * Dc + r;
            memcpy(qp, s->q + t * nh * Dq + h * Dq + dn, (size_t)dr * sizeof(float));
            K->rope(qp, 1, 1, dr, s->rope_cos + t * half, s->rope_sin + t * half);
        }
    }
    int64_t work = T * nh * dn * r;
    cb_pool_run(work < CB_PAR_MIN_WORK_MLA ? NULL : ctx->pool, absorb_chunk, &a, nh);
    work = 0; /* query-key pairs of the chunk */
    for (int64_t g = 0; g < ctx->run.n_seg; g++) {
        int64_t r0 = s->seg_row[g], n = s->seg_row[g + 1] - r0;
        work += n * (s->row_pos[r0] + n);
    }
    cb_pool_run(work * nh * Dc < CB_PAR_MIN_WORK_MLA ? NULL : ctx->pool, latent_att_chunk, &a,
                T * ((nh + CB_ATT_HEADS - 1) / CB_ATT_HEADS));
    cb_pool_run(T * nh * dv * r < CB_PAR_MIN_WORK_MLA ? NULL : ctx->pool, value_chunk, &a, nh);
    cb_cpu_fast_round(ctx, s->att, T * nh * dv, L->wo.dt == COLIBRI_DTYPE_BF16);
    cb_matmul_par(ctx, s->delta, s->att, L->wo, T, H, nh * dv);
    if (ctx->iv) cb_cpu_iv_patch(ctx, COLIBRI_POINT_ATTN_OUT, l, s->delta);
    for (int64_t i = 0; i < T * H; i++) s->x[i] = s->x[i] + s->delta[i];
    K->rmsnorm(s->xn, s->x, L->ffn_norm, T, H, eps);
}

/* MLA's stage computes its own latent attention (latent_att_chunk): no heads kernel. */
const cb_att_op cb_cpu_att_mla = {mla_stage, NULL};
