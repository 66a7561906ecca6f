/*
 * bind.c — the operations that read each weight matrix, chosen once when the CPU backend
 * starts (cb_cpu_bind, its cb_backend.init) rather than at every call: a matrix with a panel
 * copy (panels.c) is read by the panel kernels of the running table, one with an interleaved
 * int8 copy (cpu/qpanel.h) by the fast table's kernels on it, one the fast table takes
 * (cpu/fast.h: a block type, or BF16 where it has native BF16 kernels) by the fast table, any
 * other by the exact table; and each FFN's (experts, dense MLP, shared expert) the same way
 * (cb_cpu_bind_ffn, parallel.c); each layer's attention (bind_attention: the stage of its
 * kind, grouped-query gqa.c or multi-head latent mla.c, and for GQA fast mode's heads kernel
 * where the scratch has its work area, else the exact table's) and each MoE layer's router
 * (cb_cpu_bind_router, router.c: its logits by the router's dtype, its routing by the
 * family's). The stages and their parallel sections then call the weight's or the layer's
 * own operation without asking (cb_mat.op, cb_ffn.op, cb_layer.att_op, cb_layer.router_op).
 */
#include "backend/cpu/cpu.h"

static void rows_panels(const cb_mm_task *m, const cb_mm_job *b, int64_t n0, int64_t n1) {
    m->pan->matmul_panels(b->y + n0, b->N, b->x, b->w.pan, m->T, b->N, b->K, n0, n1);
}

static void rows_qpanels(const cb_mm_task *m, const cb_mm_job *b, int64_t n0, int64_t n1) {
    size_t row = (size_t)cb_qpanel_row_bytes(b->w.dt, (uint64_t)b->K); /* n0: a multiple of 8 (the decode tile) */
    const uint8_t *w = (const uint8_t *)b->w.qpan + (size_t)n0 * row;
    if (b->xq.q) m->fast->matmul_q8(b->y + n0, b->N, &b->xq, w, 1, b->w.dt, m->T, n1 - n0, b->K);
    else m->fast->qpanels->matmul(b->y + n0, b->N, b->x, w, b->w.dt, m->T, n1 - n0, b->K);
}

static void rows_fast(const cb_mm_task *m, const cb_mm_job *b, int64_t n0, int64_t n1) {
    size_t row = (size_t)cb_row_bytes(b->w.dt, (uint64_t)b->K);
    const uint8_t *w = (const uint8_t *)b->w.w + (size_t)n0 * row;
    if (b->xq.q) m->fast->matmul_q8(b->y + n0, b->N, &b->xq, w, 0, b->w.dt, m->T, n1 - n0, b->K);
    else m->fast->matmul_ld(b->y + n0, b->N, b->x, w, b->w.dt, m->T, n1 - n0, b->K);
}

static void rows_exact(const cb_mm_task *m, const cb_mm_job *b, int64_t n0, int64_t n1) {
    size_t row = (size_t)cb_row_bytes(b->w.dt, (uint64_t)b->K);
    m->kern->matmul_ld(b->y + n0, b->N, b->x, (const uint8_t *)b->w.w + (size_t)n0 * row, b->w.dt, m->T, n1 - n0,
                       b->K);
}

static const cb_matmul_op op_panels = {rows_panels, 1, 0};
static const cb_matmul_op op_qpanels = {rows_qpanels, 0, 1};
static const cb_matmul_op op_fast = {rows_fast, 0, 1};
static const cb_matmul_op op_exact = {rows_exact, 0, 0};

static void bind_mat(const colibri_ctx *ctx, cb_mat *m) {
    if (!m->w) return;
    m->op = m->pan                                  ? &op_panels
            : m->qpan                                 ? &op_qpanels
            : cb_fast_takes(ctx->fast, m->dt, m->cols) ? &op_fast
                                                      : &op_exact;
}

/* A layer's attention: its kind's stage (the file's model.attention), and for GQA fast mode's
 * heads kernel where the scratch carved its work area (cpu/fast.h), else the exact table's. */
static void bind_attention(const colibri_ctx *ctx, cb_layer *L) {
    L->att_op = ctx->cfg.attention == CB_ATTN_MLA ? &cb_cpu_att_mla
                : ctx->s.att_work_bytes           ? &cb_cpu_att_gqa_fast
                                                  : &cb_cpu_att_gqa_exact;
}

colibri_status cb_cpu_bind(colibri_ctx *ctx, const cb_backend_request *req, char *err, size_t err_len) {
    (void)req, (void)err, (void)err_len;
    cb_weights *w = &ctx->w;
    bind_mat(ctx, &w->tok_embd);
    bind_mat(ctx, &w->lm_head);
    for (uint32_t l = 0; l < ctx->cfg.n_layers; l++) {
        cb_layer *L = &w->layers[l];
        cb_mat *mats[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->shared_gate, &L->wq_a, &L->wq_b, &L->wkv_a,
                          &L->wkv_b};
        for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++) bind_mat(ctx, mats[i]);
        bind_attention(ctx, L);
        if (L->moe) cb_cpu_bind_router(ctx, L);
        if (L->moe) cb_cpu_bind_ffn(ctx, &L->experts, ctx->cfg.activation == CB_ACT_CLAMPED_SWIGLU);
        else cb_cpu_bind_ffn(ctx, &L->dense, 0);
        if (L->has_shared) cb_cpu_bind_ffn(ctx, &L->shared, 0);
    }
    return COLIBRI_OK;
}
