/*
 * scratch.c — the forward pass's memory plan: one size table of every run-time buffer
 * (model/forward.h, cb_scratch and the KV cache of cb_session) computed from the model and
 * the context's options, handed to the arena (core/arena.h) for one allocation at init.
 * Every size is overflow-checked; a plan that does not fit says which option to lower.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "core/arena.h"
#include "core/checked.h"
#include "core/context.h"
#include "cpu/fast.h"

/* 1 when fast mode's own attention runs for this model: the fast table has one for its
 * head size, and every layer's q projection is a matrix fast mode computes (BF16 or a block
 * type), so that F32 and F16 files still give the same bits in both modes. */
static int fast_attention(const colibri_ctx *ctx) {
    const cb_config *c = &ctx->cfg;
    if (c->attention == CB_ATTN_MLA || !cb_fast_takes_att(ctx->fast, c->head_dim)) return 0;
    for (uint32_t l = 0; l < c->n_layers; l++) {
        uint32_t dt = ctx->w.layers[l].wq.dt;
        if (dt == COLIBRI_DTYPE_F32 || dt == COLIBRI_DTYPE_F16) return 0;
    }
    return 1;
}

colibri_status cb_scratch_init(colibri_ctx *ctx, char *err, size_t err_len) {
    const cb_config *c = &ctx->cfg;
    cb_scratch *s = &ctx->s;
    cb_session *ss = &ctx->sess;
    uint64_t B = (uint64_t)ctx->max_batch, S = (uint64_t)ctx->max_seq_len;
    uint64_t H = c->hidden, I = c->inter, V = c->vocab, E = c->n_experts, K = c->top_k;
    uint64_t Nq = (uint64_t)c->n_heads * c->head_dim, Nkv = (uint64_t)c->n_kv_heads * c->head_dim;
    uint64_t half = c->head_dim / 2, L = c->n_layers; /* RoPE tables: rotated dims / 2 */
    uint64_t F = c->dense_inter > c->shared_inter ? c->dense_inter : c->shared_inter;
    uint64_t R = 0, tmp = 0, kv = 0;
    cb_kv *kc = &ss->kv;
    uint64_t P = (uint64_t)ctx->kv_block_tokens, NS = (uint64_t)ctx->max_seqs;
    uint64_t n_blocks = ((uint64_t)ctx->kv_tokens + P - 1) / P, max_blocks = (S + P - 1) / P;
    uint64_t tables = 0;
    int ok = 1;
    if (n_blocks > (uint64_t)INT32_MAX / 2) { /* block ids are int32 (model/kv.h) */
        cb_set_err(err, err_len, "the KV cache would have %llu blocks, more than %d; lower kv_tokens or raise "
                   "kv_block_tokens", (unsigned long long)n_blocks, INT32_MAX / 2);
        return COLIBRI_E_INVALID_ARG;
    }
    /* the prefix cache (model/kv.h): per block its tokens and table fields, per sequence its
     * written and registered lengths, and an open-addressing table of at least 2 n_blocks slots */
    uint64_t PB = ctx->prefix_cache ? n_blocks : 0, PS = ctx->prefix_cache ? NS : 0, n_slots = 0, ptok = 0;
    if (ctx->prefix_cache)
        for (n_slots = 1; n_slots < 2 * n_blocks; n_slots *= 2) {}
    ok &= cb_mul_u64(PB, P, &ptok);
    /* multi-head latent attention (mla.c): the cache holds one latent row per position and
     * layer, [c (r), k_pe (dr)], no values; q, k and att take the MLA widths */
    int mla = c->attention == CB_ATTN_MLA;
    uint64_t r = c->kv_lora_rank, Dc = mla ? r + c->head_dim : 0, QL = mla ? c->q_lora_rank : 0;
    uint64_t Hkv = mla ? 1 : c->n_kv_heads, Dkv = mla ? Dc : c->head_dim;
    uint64_t Nq_buf = Nq, Nk_buf = Nkv, Nv_buf = Nkv, Natt_buf = Nq;
    if (mla) {
        Nq_buf = (uint64_t)c->n_heads * (c->qk_nope_dim + c->head_dim);
        Nk_buf = Dc;
        Nv_buf = 0;
        Natt_buf = (uint64_t)c->n_heads * c->v_head_dim;
    }
    uint64_t NH = mla ? c->n_heads : 0, NT = (uint64_t)ctx->num_threads;
    /* fast mode's attention (cpu/fast.h): a work area per thread for the keys it transposes
     * and its score rows (the exact kernels' attention, and MLA's, need none) */
    s->att_work_bytes = fast_attention(ctx) ? ctx->fast->att_work_bytes((int64_t)S, c->head_dim) : 0;
    uint64_t att_work = 0;
    /* R = B*K + E*(group_pad-1): each non-empty group gains at most group_pad-1 zero rows */
    ok &= cb_mul_u64(B, K, &R);
    ok &= cb_mul_u64(E, (uint64_t)(ctx->group_pad - 1), &tmp);
    ok &= cb_add_u64(R, tmp, &R);
    /* the KV pool: n_blocks blocks of P positions of every layer's Nkv values, K and V apart */
    ok &= cb_mul_u64(n_blocks, P, &kv);
    ok &= cb_mul_u64(kv, L, &kv);
    ok &= cb_mul_u64(kv, Hkv * Dkv, &kv);
    ok &= cb_mul_u64(NS, max_blocks, &tables);
    ok &= cb_mul_u64(NT, (uint64_t)s->att_work_bytes, &att_work);
    uint64_t qlat = 0, olat = 0; /* MLA: B * NH * Dc and B * NH * r (model/config.c bounds the widths) */
    ok &= cb_mul_u64(B, NH, &qlat);
    ok &= cb_mul_u64(qlat, r * (uint64_t)mla, &olat);
    ok &= cb_mul_u64(qlat, Dc, &qlat);
    if (!ok) {
        cb_set_err(err, err_len, "the run-time buffers for these options overflow 64 bits; "
                   "lower max_seq_len, max_batch or group_pad");
        return COLIBRI_E_NOMEM;
    }
    s->max_rows = (int64_t)R;
    /* few-row down projections are split by blocks (par_ffn): room for every group of at most
     * CB_SPLIT_MAX_ROWS rows that one par_ffn call can hold (CB_FFN_BATCH groups, at most R rows
     * in all) and for the dense/shared FFN, which covers decode steps of many sequences */
    uint64_t nblk_i = (I + CB_DOWN_BLOCK - 1) / CB_DOWN_BLOCK, nblk_f = (F + CB_DOWN_BLOCK - 1) / CB_DOWN_BLOCK;
    uint64_t split_rows = (E < CB_FFN_BATCH ? E : CB_FFN_BATCH) * CB_SPLIT_MAX_ROWS;
    if (split_rows > R) split_rows = R;
    s->down_part_rows = (int64_t)(split_rows * nblk_i + CB_SPLIT_MAX_ROWS * nblk_f);
    /* colibri_batch_logprobs' logit rows: about 8 MiB of them (at least 16 rows, at most B),
     * a multiple of 8 rows when more than 8 */
    uint64_t LB = (8u << 20) / (4 * (V ? V : 1));
    if (LB < 16) LB = 16;
    if (LB > 8) LB = LB / 8 * 8;
    if (LB > B) LB = B;
    s->lp_rows = (int64_t)LB;
    uint64_t BH = B * H;
    /* the rows quantized once for fast mode's int8 kernels (forward.h x_q; only matrices of a
     * block type read them, whose rows are whole blocks of 32 or 256) */
    uint64_t q8 = ctx->fast != NULL, XQ = H > Natt_buf ? H : Natt_buf;
    s->x_q_cols = (int64_t)XQ; /* B <= 2^32 and H <= 2^24: cannot overflow */
    cb_arena_item items[] = {
        {(void **)&kc->k, kv, 4, "K cache"},
        {(void **)&kc->v, mla ? 0 : kv, 4, "V cache"},
        {(void **)&kc->table, tables, 4, "KV block tables"},
        {(void **)&kc->len, NS, 8, "sequence lengths"},
        {(void **)&kc->ref, n_blocks, 4, "KV block counts"},
        {(void **)&kc->free_ids, n_blocks, 4, "KV free blocks"},
        {(void **)&kc->tok, ptok, 4, "prefix-cache tokens"},
        {(void **)&kc->hash, PB, 8, "prefix-cache hashes"},
        {(void **)&kc->parent, PB, 4, "prefix-cache parents"},
        {(void **)&kc->parent_gen, PB, 4, "prefix-cache parent generations"},
        {(void **)&kc->gen, PB, 4, "prefix-cache generations"},
        {(void **)&kc->reg, PB, 1, "prefix-cache registered"},
        {(void **)&kc->lru_prev, PB, 4, "prefix-cache LRU"},
        {(void **)&kc->lru_next, PB, 4, "prefix-cache LRU"},
        {(void **)&kc->slots, n_slots, 4, "prefix-cache table"},
        {(void **)&kc->valid, PS, 8, "prefix-cache written lengths"},
        {(void **)&kc->n_reg, PS, 8, "prefix-cache registered lengths"},
        {(void **)&s->x, BH, 4, "x"},
        {(void **)&s->xn, BH, 4, "xn"},
        {(void **)&s->q, B * Nq_buf, 4, "q"},
        {(void **)&s->k, B * Nk_buf, 4, "k"},
        {(void **)&s->v, B * Nv_buf, 4, "v"},
        {(void **)&s->att, B * Natt_buf, 4, "att"},
        {(void **)&s->mla_qa, B * QL, 4, "mla_qa"},
        {(void **)&s->mla_qlat, qlat, 4, "mla_qlat"},
        {(void **)&s->mla_olat, olat, 4, "mla_olat"},
        {(void **)&s->mla_row, NT * r * (uint64_t)mla, 4, "mla_row"},
        {(void **)&s->route_choice, E, 4, "route_choice"},
        {(void **)&s->route_group, E, 4, "route_group"},
        {(void **)&s->route_skip, 2 * E, 1, "route_skip"},
        {(void **)&s->delta, BH, 4, "delta"},
        {(void **)&s->att_scores, S * (uint64_t)ctx->num_threads * CB_ATT_HEADS, 4, "att_scores"},
        {(void **)&s->att_work, att_work, 1, "att_work"},
        {(void **)&s->rope_cos, B * half, 4, "rope_cos"},
        {(void **)&s->rope_sin, B * half, 4, "rope_sin"},
        {(void **)&s->inv_freq, half, 4, "inv_freq"},
        {(void **)&s->router_logits, B * E, 4, "router_logits"},
        {(void **)&s->router_probs, B * E, 4, "router_probs"},
        {(void **)&s->topk_ids, B * K, 4, "topk_ids"},
        {(void **)&s->topk_w, B * K, 4, "topk_w"},
        {(void **)&s->expert_count, E, 8, "expert_count"},
        {(void **)&s->expert_offset, E + 1, 8, "expert_offset"},
        {(void **)&s->expert_fill, E, 8, "expert_fill"},
        {(void **)&s->row_token, R, 4, "row_token"},
        {(void **)&s->row_weight, R, 4, "row_weight"},
        {(void **)&s->ex_in, R * H, 4, "ex_in"},
        {(void **)&s->x_q, q8 * B * XQ, 1, "x_q"},
        {(void **)&s->x_qa, q8 * B * (XQ / 32), sizeof(cb_fast_ablk), "x_qa"},
        {(void **)&s->ex_in_q, q8 * R * H, 1, "ex_in_q"},
        {(void **)&s->ex_in_qa, q8 * R * (H / 32), sizeof(cb_fast_ablk), "ex_in_qa"},
        {(void **)&s->ex_h_q, q8 * R * I, 1, "ex_h_q"},
        {(void **)&s->ex_h_qa, q8 * R * (I / 32), sizeof(cb_fast_ablk), "ex_h_qa"},
        {(void **)&s->ffn_h_q, q8 * B * F, 1, "ffn_h_q"},
        {(void **)&s->ffn_h_qa, q8 * B * (F / 32), sizeof(cb_fast_ablk), "ffn_h_qa"},
        {(void **)&s->ex_h, R * I, 4, "ex_h"},
        {(void **)&s->sink_share, c->attn_sinks ? B * (uint64_t)c->n_heads : 0, 4, "sink_share"},
        {(void **)&s->ex_up, c->activation == CB_ACT_CLAMPED_SWIGLU ? R * I : 0, 4, "ex_up"},
        {(void **)&s->ex_out, R * H, 4, "ex_out"},
        {(void **)&s->ffn_h, B * F, 4, "ffn_h"},
        {(void **)&s->sh_out, c->shared_inter ? BH : 0, 4, "sh_out"},
        {(void **)&s->sh_gate, c->shared_gate ? B : 0, 4, "sh_gate"},
        {(void **)&s->sample_p, V, 4, "sample_p"},
        {(void **)&s->sample_idx, V, 4, "sample_idx"},
        {(void **)&s->run_ids, B, 4, "run_ids"},
        {(void **)&s->row_seq, B, 4, "row_seq"},
        {(void **)&s->row_pos, B, 8, "row_pos"},
        {(void **)&s->head_idx, B, 4, "head_idx"},
        {(void **)&s->seg_row, B + 1, 8, "seg_row"},
        {(void **)&s->seq_next, NS, 8, "seq_next"},
        {(void **)&s->down_part, (uint64_t)s->down_part_rows * H, 4, "down_part"},
        {(void **)&s->split_ready, 2 * (uint64_t)s->down_part_rows, 4, "split_ready"},
        {(void **)&s->pred_xn, BH, 4, "pred_xn"},
        {(void **)&s->pred_logits, B * E, 4, "pred_logits"},
        {(void **)&s->pred_ids, B * K, 4, "pred_ids"},
        {(void **)&s->pred_w, B * K, 4, "pred_w"},
        {(void **)&s->lp_logits, LB * V, 4, "logprob logits"},
    };
    const size_t n_items = sizeof items / sizeof items[0];
    uint64_t offs[sizeof items / sizeof items[0]];
    uint64_t total = 0;
    size_t bad = 0;
    if (!cb_arena_layout(items, n_items, offs, &total, &bad)) {
        cb_set_err(err, err_len, "the %s buffer for these options overflows 64 bits; "
                   "lower max_seq_len, max_batch or group_pad", items[bad].what);
        return COLIBRI_E_NOMEM;
    }
    uint64_t alloc = 0;
    void *mem = cb_arena_alloc(total, &alloc);
    if (!mem && alloc == 0) {
        cb_set_err(err, err_len, "the arena would need %llu bytes, more than this machine can address; "
                   "lower max_seq_len or max_batch", (unsigned long long)total);
        return COLIBRI_E_NOMEM;
    }
    if (!mem) {
        cb_set_err(err, err_len, "cannot allocate the %.1f MiB arena (KV cache %.1f MiB for %lld positions); "
                   "lower kv_tokens, max_seq_len or max_batch", (double)alloc / 1048576.0,
                   (mla ? 1.0 : 2.0) * (double)kv * 4 / 1048576.0, (long long)(n_blocks * P));
        return COLIBRI_E_NOMEM;
    }
    ctx->arena = mem;
    ctx->arena_bytes = alloc;
    cb_arena_assign(items, n_items, offs, mem);

    /* RoPE inverse frequencies: YaRN's from the file (the converter computed them as
     * transformers does, float32 values stored as f64); the default as transformers computes
     * them, in float32: 1.0 / (base ** (arange(0, dim, 2).float() / dim)) */
    for (uint64_t i = 0; i < half; i++) {
        if (c->rope_inv_freq) {
            double f;
            memcpy(&f, c->rope_inv_freq + 8 * i, 8);
            s->inv_freq[i] = (float)f;
            continue;
        }
        float expo = (float)(2 * i) / (float)c->head_dim;
        s->inv_freq[i] = 1.0f / powf((float)c->rope_theta, expo);
    }
    kc->n_blocks = (int64_t)n_blocks;
    kc->block_len = (int64_t)P;
    kc->max_blocks = (int64_t)max_blocks;
    kc->max_seqs = (int64_t)NS;
    if (mla) kc->v = NULL; /* no values: the latent rows are keys and values */
    kc->head_dim = (int64_t)Dkv;
    kc->head_stride = (int64_t)P * (int64_t)Dkv;
    kc->layer_stride = (int64_t)Hkv * kc->head_stride;
    kc->block_stride = (int64_t)L * kc->layer_stride;
    kc->prefix = ctx->prefix_cache;
    kc->n_slots = (int64_t)n_slots;
    cb_kv_reset(kc);
    return COLIBRI_OK;
}
