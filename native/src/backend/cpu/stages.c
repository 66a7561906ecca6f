/*
 * stages.c — the CPU backend (backend/backend.h): the seven stages of a forward chunk over the
 * host arena (model/forward.h, cb_scratch) and the mapped weights, one decoder for every
 * supported family, parameterised by the options read from the file's metadata at load
 * (cb_config, cb_layer): per-layer attention of the file's kind (grouped-query, gqa.c: q/k/v
 * and output biases, q/k RMSNorm per head or over the whole projection, q/k/v clipping,
 * attention windows and sinks; or multi-head latent, mla.c), dense MLP layers among MoE
 * layers and a (gated) shared expert. Nothing here tests the family: what differs is bound
 * once per layer (bind.c) and called without asking.
 *
 * Inside a chunk each stage runs on the whole batch [T, width] through the kernel table
 * (cpu/kernels.h), and the large steps are split between the context's threads
 * (core/threadpool.h) by OUTPUT rows or columns: every output element is computed by one
 * thread, in the same order whatever the thread count, so results do not depend on
 * num_threads (docs/kernels.md). The MoE block groups (token, slot) pairs by expert with a
 * counting sort and a prefix sum (no qsort, no allocation), gathers each group's rows, runs
 * the expert FFN once per non-empty expert, and scatter-adds weight * output into each
 * token's residual delta, in expert order as transformers does. The attention stages (gqa.c,
 * mla.c) and the routers (router.c, route_group.c) are this backend's too, its parallel
 * sections are parallel.c's (backend/cpu/cpu.h).
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cpu/cpu.h"

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

/* The layer's attention (its residual patch first): the stage of the layer's kind, grouped-query
 * (gqa.c) or multi-head latent (mla.c), bound once (cb_layer.att_op, bind.c). Each adds
 * o_proj(attention(norm(x))) to x and leaves xn = ffn_norm(x), the input of the FFN stages. */
static void stage_attention(colibri_ctx *ctx, uint32_t l) {
    ctx->run.att_layer = (int32_t)l;
    if (ctx->iv) cb_cpu_iv_patch(ctx, COLIBRI_POINT_RESID, l, ctx->s.x);
    ctx->w.layers[l].att_op->stage(ctx, l);
}

/* Router logits, softmax and top-k (MoE layers), by the layer's router op (bound once). */
static void stage_router(colibri_ctx *ctx, uint32_t l) {
    const cb_config *c = &ctx->cfg;
    const cb_layer *L = &ctx->w.layers[l];
    cb_scratch *s = &ctx->s;
    int64_t T = ctx->run.T;
    if (!L->moe) return;
    L->router_op->logits(ctx, L, s->router_logits, s->xn, T);
    if (L->router_b) cb_cpu_add_bias(s->router_logits, L->router_b, T, c->n_experts); /* gpt-oss's logit bias */
    if (ctx->iv) cb_cpu_iv_router_logits(ctx, l); /* router bias, excluded experts (interv.c) */
    L->router_op->route(ctx, l, T);
    if (ctx->iv) cb_cpu_iv_force(ctx, l);
}

/* Group the (token, slot) pairs by expert and gather each group's input rows. */
static void stage_grouping(colibri_ctx *ctx, uint32_t l) {
    cb_scratch *s = &ctx->s;
    int64_t H = ctx->cfg.hidden, E = ctx->cfg.n_experts;
    const cb_layer *L = &ctx->w.layers[l];
    if (!L->moe) return;
    if (cb_cpu_moe_input_bf16(ctx, l)) cb_round_bf16(s->xn, ctx->run.T * H);
    group_tokens(ctx, ctx->run.T);
    if (ctx->iv) cb_cpu_iv_zero(ctx, l); /* zeroed experts' rows weigh 0 (interv.c) */
    int64_t rows = s->expert_offset[E];
    for (int64_t r = 0; r < rows; r++) {
        int32_t t = s->row_token[r];
        if (t >= 0) memcpy(s->ex_in + r * H, s->xn + (int64_t)t * H, (size_t)H * sizeof(float));
        else memset(s->ex_in + r * H, 0, (size_t)H * sizeof(float));
    }
    if (!L->experts.q8_in) return; /* set in fast mode only (cb_cpu_bind_ffn) */
    /* fast mode's int8 experts: each token's row quantized once, gathered as ex_in (a zero
     * row's bytes and blocks are all zero, as its quantization gives) */
    int64_t nb = H / 32;
    cb_cpu_quant_rows(ctx, s->x_q, s->x_qa, s->xn, ctx->run.T, H);
    for (int64_t r = 0; r < rows; r++) {
        int32_t t = s->row_token[r];
        if (t >= 0) {
            memcpy(s->ex_in_q + r * H, s->x_q + (int64_t)t * H, (size_t)H);
            memcpy(s->ex_in_qa + r * nb, s->x_qa + (int64_t)t * nb, (size_t)nb * sizeof(cb_fast_ablk));
        } else {
            memset(s->ex_in_q + r * H, 0, (size_t)H);
            memset(s->ex_in_qa + r * nb, 0, (size_t)nb * sizeof(cb_fast_ablk));
        }
    }
}

/* The job of expert e's group (its rows of ex_in / ex_h / ex_out) through the FFN f. */
static cb_ffn_job expert_job(const colibri_ctx *ctx, const cb_ffn *f, int64_t e) {
    const cb_scratch *s = &ctx->s;
    int64_t H = ctx->cfg.hidden, I = ctx->cfg.inter;
    int64_t r0 = s->expert_offset[e], R = s->expert_offset[e + 1] - r0;
    cb_ffn_job j = cb_cpu_ffn_job(s->ex_out + r0 * H, s->ex_h + r0 * I, s->ex_in + r0 * H, f, e, R, I,
                                  ctx->cfg.activation == CB_ACT_CLAMPED_SWIGLU ? s->ex_up + r0 * I : NULL);
    if (f->q8_in) j.xq = (cb_fast_qrows){s->ex_in_q + r0 * H, s->ex_in_qa + r0 * (H / 32)};
    if (f->q8_h) j.hq = (cb_fast_qrows){s->ex_h_q + r0 * I, s->ex_h_qa + r0 * (I / 32)};
    return j;
}

/* The job of a dense MLP or shared expert f (intermediate I) over the chunk's rows of xn into
 * y; for fast mode's int8 kernels xn quantized once into x_q (the routed experts' jobs of
 * the same section read ex_in_q) and the room for h's rows. */
static cb_ffn_job rows_job(colibri_ctx *ctx, float *y, const cb_ffn *f, int64_t I) {
    cb_scratch *s = &ctx->s;
    int64_t T = ctx->run.T, H = ctx->cfg.hidden;
    cb_ffn_job j = cb_cpu_ffn_job(y, s->ffn_h, s->xn, f, 0, T, I, NULL);
    if (f->q8_in) {
        cb_cpu_quant_rows(ctx, s->x_q, s->x_qa, s->xn, T, H);
        j.xq = (cb_fast_qrows){s->x_q, s->x_qa};
    }
    if (f->q8_h) j.hq = (cb_fast_qrows){s->ffn_h_q, s->ffn_h_qa};
    return j;
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
    N->router_op->logits(ctx, N, s->pred_logits, s->pred_xn, T);
    for (int64_t t = 0; t < T; t++) {
        float *row = s->pred_logits + t * E;
        for (int64_t e = 0; e < E; e++)
            row[e] += (N->router_b ? N->router_b[e] : 0.0f) + (N->router_bias ? N->router_bias[e] : 0.0f);
        cb_cpu_topk_desc(row, E, K, s->pred_ids + t * K, s->pred_w + t * K);
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
    cb_ffn_job jobs[CB_FFN_BATCH];
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
            cb_cpu_par_ffn(ctx, jobs, nb);
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
    cb_ffn_job jobs[CB_FFN_BATCH]; /* non-empty groups, run CB_FFN_BATCH at a time */
    int n_jobs = 0;
    if (!L->moe) {
        predict_next(ctx, l);
        cb_cpu_fast_round(ctx, s->xn, T * H, cb_cpu_ffn_bf16(&L->dense));
        jobs[0] = rows_job(ctx, s->delta, &L->dense, c->dense_inter);
        cb_cpu_par_ffn(ctx, jobs, 1);
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
                cb_cpu_par_ffn(ctx, jobs, n_jobs);
                n_jobs = 0;
            }
        }
        predict_next(ctx, l);
    }
    /* routed sum + sigmoid(g . x) * shared(x), as transformers' Qwen2-MoE */
    if (L->has_shared) jobs[n_jobs++] = rows_job(ctx, s->sh_out, &L->shared, c->shared_inter);
    if (n_jobs > 0) cb_cpu_par_ffn(ctx, jobs, n_jobs);
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
        if (ctx->iv) cb_cpu_iv_patch(ctx, COLIBRI_POINT_EXPERT_OUT, l, s->ex_out);
        cb_combine_task m = {ctx, s->expert_offset[E], H};
        if (m.rows * H < CB_PAR_MIN_WORK) {
            cb_cpu_combine_chunk(&m, 0, 0);
        } else {
            m.len = cb_cpu_chunk_len(ctx, H, 16, 64);
            cb_pool_run(ctx->pool, cb_cpu_combine_chunk, &m, (H + m.len - 1) / m.len);
        }
        if (L->has_shared) {
            if (ctx->iv) cb_cpu_iv_shared(ctx, l);
            for (int64_t t = 0; t < T; t++) {
                float g = L->shared_gate.w ? s->sh_gate[t] : 1.0f;
                ctx->kern->add_scaled(s->delta + t * H, s->sh_out + t * H, g, H); /* g * y, as y * g */
            }
        }
    }
    cb_cpu_add_inplace(s->x, s->delta, T * H);
}

/* Final norm and logits of the rows s->head_idx[0 .. head_rows) (every row, the last one,
 * or those a batch asked for). Each row is normed into xn's first rows, in order, so the
 * LM head reads them contiguously. logits: [head_rows, V]. */
static void stage_lm_head(colibri_ctx *ctx, float *logits) {
    const cb_config *c = &ctx->cfg;
    cb_scratch *s = &ctx->s;
    int64_t R = ctx->run.head_rows, H = c->hidden;
    if (ctx->iv) cb_cpu_iv_patch(ctx, COLIBRI_POINT_RESID, c->n_layers, s->x); /* the final residual */
    if (R <= 0) return;
    for (int64_t i = 0; i < R; i++) /* head_idx ascends, so row i is written after it is read */
        ctx->kern->rmsnorm(s->xn + i * H, s->x + (int64_t)s->head_idx[i] * H, ctx->w.out_norm, 1, H,
                           (float)c->rms_norm_eps);
    cb_cpu_fast_round(ctx, s->xn, R * H, ctx->w.lm_head.dt == COLIBRI_DTYPE_BF16);
    cb_matmul_par(ctx, logits, s->xn, ctx->w.lm_head, R, c->vocab, H);
}

int cb_cpu_moe_input_bf16(const colibri_ctx *ctx, uint32_t l) {
    const cb_layer *L = &ctx->w.layers[l];
    return ctx->fast && (cb_cpu_ffn_bf16(&L->experts) || (L->has_shared && cb_cpu_ffn_bf16(&L->shared)));
}

void cb_cpu_expert_rows(colibri_ctx *ctx, uint32_t l, int64_t e, const float *x, float *h, float *u, float *y,
                        int64_t rows) {
    const cb_ffn *f = &ctx->w.layers[l].experts;
    cb_ffn_job job = cb_cpu_ffn_job(y, h, x, f, e, rows, ctx->cfg.inter, ctx->cfg.activation == CB_ACT_CLAMPED_SWIGLU ? u : NULL);
    if (rows > 0) cb_cpu_par_ffn(ctx, &job, 1);
}

static void cpu_facts(const colibri_ctx *ctx, cb_backend_facts *f) {
    memset(f, 0, sizeof *f);
    snprintf(f->device, sizeof f->device, "cpu: %s (%d threads)", ctx->kernels_desc, (int)ctx->num_threads);
}

const cb_backend cb_backend_cpu = {
    .name = "cpu",
    .init = cb_cpu_bind,
    .embedding = stage_embedding,
    .attention = stage_attention,
    .router = stage_router,
    .grouping = stage_grouping,
    .expert_ffn = stage_expert_ffn,
    .combine = stage_combine,
    .lm_head = stage_lm_head,
    .facts = cpu_facts,
    .interventions = 1,
};
