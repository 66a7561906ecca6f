/*
 * weights.c — binds a model's weights (cb_weights, model/model.h) to the tensors of its
 * container (format/container.h): every tensor the model uses, looked up by name and checked
 * for dtype, layout, shape and section together; and the whole load in its order (container
 * header, metadata, the model's config, tensor directory, binding), and the router check on
 * request.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"
#include "core/error.h"
#include "model/family.h"
#include "model/model.h"

#define RECONVERT CB_RECONVERT

static void fmt_shape(char *buf, size_t cap, uint32_t n_dims, const uint64_t *dims) {
    size_t o = 0;
    o += (size_t)snprintf(buf + o, cap - o, "[");
    for (uint32_t d = 0; d < n_dims && o < cap; d++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%llu", d ? ", " : "", (unsigned long long)dims[d]);
    if (o < cap) snprintf(buf + o, cap - o, "]");
}

/* Look a tensor up by name and check dtype, layout, shape and section together. */
static colibri_status want_tensor(const cb_file *f, const char *name, uint32_t dtype,
                                  uint32_t layout, uint32_t n_dims, uint64_t d0, uint64_t d1,
                                  uint64_t d2, int section, const void **out, char *err,
                                  size_t len) {
    const cb_tensor *t = cb_file_tensor(f, name);
    if (!t) {
        cb_set_err(err, len, "tensor '%s' is missing from the tensor directory; " RECONVERT, name);
        return COLIBRI_E_FORMAT;
    }
    uint64_t wd[4] = {d0, d1, d2, 1};
    int ok = t->dtype == dtype && t->layout == layout && t->n_dims == n_dims;
    for (uint32_t d = 0; ok && d < n_dims; d++) ok = t->dims[d] == wd[d];
    if (!ok) {
        char have[128], exp[128];
        fmt_shape(have, sizeof have, t->n_dims, t->dims);
        fmt_shape(exp, sizeof exp, n_dims, wd);
        cb_set_err(err, len, "tensor '%s' is %s %s %s, expected %s %s %s; " RECONVERT, name,
                   cb_dtype_name(t->dtype), have, t->layout ? "experts-packed" : "row-major",
                   cb_dtype_name(dtype), exp, layout ? "experts-packed" : "row-major");
        return COLIBRI_E_FORMAT;
    }
    const cb_section *s = &f->h.sections[section];
    if (t->offset < s->offset || t->offset + t->nbytes > s->offset + s->size) {
        cb_set_err(err, len, "tensor '%s' lies outside the %s section; " RECONVERT, name, cb_section_name(section));
        return COLIBRI_E_FORMAT;
    }
    *out = f->map + t->offset;
    return COLIBRI_OK;
}

/* A weight matrix [rows, cols]: row-major, any weight dtype (the tensor's own). */
static colibri_status want_mat(const cb_file *f, const char *name, uint64_t rows, uint64_t cols,
                               int section, cb_mat *out, char *err, size_t len) {
    const cb_tensor *t = cb_file_tensor(f, name);
    if (t && !cb_dtype_is_weight(t->dtype)) {
        cb_set_err(err, len, "tensor '%s' has dtype %s, which a weight matrix cannot have (f32, f16, bf16, "
                   "q8_0, q4_k, q5_k, q6_k, mxfp4, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, iq4_nl, iq4_xs); " RECONVERT,
                   name, cb_dtype_name(t->dtype));
        return COLIBRI_E_FORMAT;
    }
    const void *p = NULL;
    colibri_status st = want_tensor(f, name, t ? t->dtype : COLIBRI_DTYPE_F32, CB_LAYOUT_ROW_MAJOR, 2, rows,
                                    cols, 1, section, &p, err, len);
    if (st != COLIBRI_OK) return st;
    out->w = p;
    out->dt = t->dtype;
    out->cols = (int64_t)cols;
    return COLIBRI_OK;
}

/* One SwiGLU FFN of E experts (E = 1 with 2-D split tensors for a dense MLP or a shared
 * expert) of width I: the packed tensor `packed_name`, or the split tensors
 * blk.l.<gate>, <up>, <down> (docs/format.md, "Version 2"). */
static colibri_status want_ffn(const cb_file *file, const cb_config *c, uint32_t l, const char *packed_name,
                               const char *split_suffix, int experts_3d, uint64_t E, uint64_t I, cb_ffn *f,
                               char *err, size_t len) {
    uint64_t H = c->hidden;
    char name[96], gname[96], uname[96], dname[96];
    colibri_status st;
    const void *p;
    snprintf(name, sizeof name, "blk.%u.%s", l, packed_name);
    snprintf(gname, sizeof gname, "blk.%u.ffn_gate%s", l, split_suffix);
    snprintf(uname, sizeof uname, "blk.%u.ffn_up%s", l, split_suffix);
    snprintf(dname, sizeof dname, "blk.%u.ffn_down%s", l, split_suffix);
    memset(f, 0, sizeof *f);
    f->inter = (uint32_t)I;
    const cb_tensor *t = cb_file_tensor(file, name);
    if (t || !cb_file_tensor(file, gname)) { /* packed (or neither: the error names the packed tensor) */
        uint32_t dt = t ? t->dtype : COLIBRI_DTYPE_BF16;
        if (t && dt != COLIBRI_DTYPE_F32 && dt != COLIBRI_DTYPE_F16 && dt != COLIBRI_DTYPE_BF16) {
            cb_set_err(err, len, "tensor '%s' is experts-packed in %s; the packed layout holds f32, f16 or bf16 "
                       "(quantized FFNs are stored split); " RECONVERT, name, cb_dtype_name(dt));
            return COLIBRI_E_FORMAT;
        }
        st = want_tensor(file, name, dt, CB_LAYOUT_EXPERTS_PACKED, 3, E, 3 * I, H, CB_SEC_EXPERTS, &p, err, len);
        if (st != COLIBRI_OK) return st;
        f->packed = p;
        f->stride = t->nbytes / E;
        f->dt = f->down_dt = dt;
        return COLIBRI_OK;
    }
    if (c->version < 2) {
        cb_set_err(err, len, "tensor '%s' is a split FFN, which version %u files cannot hold; " RECONVERT, gname,
                   c->version);
        return COLIBRI_E_FORMAT;
    }
    const cb_tensor *tg = cb_file_tensor(file, gname), *tu = cb_file_tensor(file, uname), *td = cb_file_tensor(file, dname);
    const cb_tensor *ts[3] = {tg, tu, td};
    const char *ns[3] = {gname, uname, dname};
    for (int i = 0; i < 3; i++)
        if (ts[i] && !cb_dtype_is_weight(ts[i]->dtype)) {
            cb_set_err(err, len, "tensor '%s' has dtype %s, which a weight matrix cannot have; " RECONVERT, ns[i],
                       cb_dtype_name(ts[i]->dtype));
            return COLIBRI_E_FORMAT;
        }
    if (tu && tu->dtype != tg->dtype) {
        cb_set_err(err, len, "tensors '%s' (%s) and '%s' (%s) differ in dtype; a split FFN's gate and up "
                   "projections share one; " RECONVERT, gname, cb_dtype_name(tg->dtype), uname,
                   cb_dtype_name(tu->dtype));
        return COLIBRI_E_FORMAT;
    }
    uint32_t nd = experts_3d ? 3 : 2;
    uint64_t a0 = experts_3d ? E : I, a1 = experts_3d ? I : H, a2 = experts_3d ? H : 1;
    st = want_tensor(file, gname, tg->dtype, CB_LAYOUT_ROW_MAJOR, nd, a0, a1, a2, CB_SEC_EXPERTS, &p, err, len);
    if (st != COLIBRI_OK) return st;
    f->gate = p;
    st = want_tensor(file, uname, tg->dtype, CB_LAYOUT_ROW_MAJOR, nd, a0, a1, a2, CB_SEC_EXPERTS, &p, err, len);
    if (st != COLIBRI_OK) return st;
    f->up = p;
    uint64_t b0 = experts_3d ? E : H, b1 = experts_3d ? H : I, b2 = experts_3d ? I : 1;
    st = want_tensor(file, dname, td ? td->dtype : tg->dtype, CB_LAYOUT_ROW_MAJOR, nd, b0, b1, b2, CB_SEC_EXPERTS,
                     &p, err, len);
    if (st != COLIBRI_OK) return st;
    f->down = p;
    f->dt = tg->dtype;
    f->down_dt = td->dtype;
    f->gu_stride = tg->nbytes / E;
    f->down_stride = td->nbytes / E;
    return COLIBRI_OK;
}

/* The attention tensors of layer l of an MLA file (docs/format.md, "Family options"):
 * q (or the q LoRA and its norm), kv_a with its norm, kv_b and the output projection. */
static colibri_status bind_mla_attention(const cb_file *f, const cb_config *c, uint32_t l, cb_layer *L, char *err,
                                         size_t len) {
    uint64_t H = c->hidden, nh = c->n_heads, r = c->kv_lora_rank, dr = c->head_dim;
    uint64_t Nq = nh * (c->qk_nope_dim + dr), ql = c->q_lora_rank;
    colibri_status st;
    const void *p;
    char name[96];
    if (ql) {
        snprintf(name, sizeof name, "blk.%u.attn_q_a.weight", l);
        if ((st = want_mat(f, name, ql, H, CB_SEC_DENSE, &L->wq_a, err, len))) return st;
        snprintf(name, sizeof name, "blk.%u.attn_q_a_norm.weight", l);
        if ((st = want_tensor(f, name, COLIBRI_DTYPE_F32, 0, 1, ql, 1, 1, CB_SEC_DENSE, &p, err, len))) return st;
        L->q_a_norm = p;
        snprintf(name, sizeof name, "blk.%u.attn_q_b.weight", l);
        if ((st = want_mat(f, name, Nq, ql, CB_SEC_DENSE, &L->wq_b, err, len))) return st;
    } else {
        snprintf(name, sizeof name, "blk.%u.attn_q.weight", l);
        if ((st = want_mat(f, name, Nq, H, CB_SEC_DENSE, &L->wq, err, len))) return st;
    }
    snprintf(name, sizeof name, "blk.%u.attn_kv_a_mqa.weight", l);
    if ((st = want_mat(f, name, r + dr, H, CB_SEC_DENSE, &L->wkv_a, err, len))) return st;
    snprintf(name, sizeof name, "blk.%u.attn_kv_a_norm.weight", l);
    if ((st = want_tensor(f, name, COLIBRI_DTYPE_F32, 0, 1, r, 1, 1, CB_SEC_DENSE, &p, err, len))) return st;
    L->kv_a_norm = p;
    snprintf(name, sizeof name, "blk.%u.attn_kv_b.weight", l);
    if ((st = want_mat(f, name, nh * (c->qk_nope_dim + c->v_head_dim), r, CB_SEC_DENSE, &L->wkv_b, err, len)))
        return st;
    snprintf(name, sizeof name, "blk.%u.attn_output.weight", l);
    return want_mat(f, name, H, nh * c->v_head_dim, CB_SEC_DENSE, &L->wo, err, len);
}

static colibri_status bind_weights(const cb_file *f, cb_config *c, cb_weights *w, char *err, size_t len) {
    uint64_t H = c->hidden, I = c->inter, V = c->vocab, E = c->n_experts;
    uint64_t Nq = (uint64_t)c->n_heads * c->head_dim, Nkv = (uint64_t)c->n_kv_heads * c->head_dim;
    colibri_status st;
    const void *p;
    char name[96];
    int first_ffn = 1;
    w->layers = calloc(c->n_layers, sizeof(cb_layer));
    if (!w->layers) {
        cb_set_err(err, len, "out of memory for %u layer records", c->n_layers);
        return COLIBRI_E_NOMEM;
    }
#define WANT(nm, dt, lay, nd, a, b, cc, sec)                                                \
    do {                                                                                    \
        st = want_tensor(f, nm, dt, lay, nd, a, b, cc, sec, &p, err, len);                \
        if (st != COLIBRI_OK) return st;                                                    \
    } while (0)
#define MAT(nm, rows, cols, sec, out)                                                       \
    do {                                                                                    \
        st = want_mat(f, nm, rows, cols, sec, out, err, len);                             \
        if (st != COLIBRI_OK) return st;                                                    \
    } while (0)
#define FFN(packed, suffix, e3, e, width, out)                                              \
    do {                                                                                    \
        st = want_ffn(f, c, l, packed, suffix, e3, e, width, out, err, len);                 \
        if (st != COLIBRI_OK) return st;                                                    \
        if (first_ffn) c->weight_dtype = (out)->dt;                                         \
        first_ffn = 0;                                                                      \
    } while (0)
    MAT("token_embd.weight", V, H, CB_SEC_DENSE, &w->tok_embd);
    WANT("output_norm.weight", COLIBRI_DTYPE_F32, 0, 1, H, 1, 1, CB_SEC_DENSE);
    w->out_norm = p;
    if (c->tie_word_embeddings) w->lm_head = w->tok_embd;
    else MAT("output.weight", V, H, CB_SEC_DENSE, &w->lm_head);
    for (uint32_t l = 0; l < c->n_layers; l++) {
        cb_layer *L = &w->layers[l];
        snprintf(name, sizeof name, "blk.%u.attn_norm.weight", l);
        WANT(name, COLIBRI_DTYPE_F32, 0, 1, H, 1, 1, CB_SEC_DENSE);
        L->attn_norm = p;
        if (c->attention == CB_ATTN_MLA) { /* backend/cpu/mla.c */
            if ((st = bind_mla_attention(f, c, l, L, err, len))) return st;
        } else {
            snprintf(name, sizeof name, "blk.%u.attn_q.weight", l);
            MAT(name, Nq, H, CB_SEC_DENSE, &L->wq);
            snprintf(name, sizeof name, "blk.%u.attn_k.weight", l);
            MAT(name, Nkv, H, CB_SEC_DENSE, &L->wk);
            snprintf(name, sizeof name, "blk.%u.attn_v.weight", l);
            MAT(name, Nkv, H, CB_SEC_DENSE, &L->wv);
            snprintf(name, sizeof name, "blk.%u.attn_output.weight", l);
            MAT(name, H, Nq, CB_SEC_DENSE, &L->wo);
        }
        snprintf(name, sizeof name, "blk.%u.ffn_norm.weight", l);
        WANT(name, COLIBRI_DTYPE_F32, 0, 1, H, 1, 1, CB_SEC_DENSE);
        L->ffn_norm = p;
        if (c->attn_qkv_bias) {
            snprintf(name, sizeof name, "blk.%u.attn_q.bias", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 1, Nq, 1, 1, CB_SEC_DENSE);
            L->bq = p;
            snprintf(name, sizeof name, "blk.%u.attn_k.bias", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 1, Nkv, 1, 1, CB_SEC_DENSE);
            L->bk = p;
            snprintf(name, sizeof name, "blk.%u.attn_v.bias", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 1, Nkv, 1, 1, CB_SEC_DENSE);
            L->bv = p;
        }
        if (c->attn_output_bias) {
            snprintf(name, sizeof name, "blk.%u.attn_output.bias", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 1, H, 1, 1, CB_SEC_DENSE);
            L->bo = p;
        }
        if (c->qk_norm != CB_QKNORM_NONE) {
            int head = c->qk_norm == CB_QKNORM_HEAD;
            snprintf(name, sizeof name, "blk.%u.attn_q_norm.weight", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 1, head ? c->head_dim : Nq, 1, 1, CB_SEC_DENSE);
            L->q_norm = p;
            snprintf(name, sizeof name, "blk.%u.attn_k_norm.weight", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 1, head ? c->head_dim : Nkv, 1, 1, CB_SEC_DENSE);
            L->k_norm = p;
        }
        if (c->attn_sinks) {
            snprintf(name, sizeof name, "blk.%u.attn_sinks", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 1, c->n_heads, 1, 1, CB_SEC_DENSE);
            L->sinks = p;
        }
        L->moe = c->layer_ffn ? (int)cb_rd_u32(c->layer_ffn + 4 * (uint64_t)l) : 1;
        {
            uint64_t w = c->layer_window ? cb_rd_u64(c->layer_window + 8 * (uint64_t)l) : c->sliding_window;
            L->window = w > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)w;
        }
        if (!L->moe) {
            FFN("ffn_dense", "", 0, 1, c->dense_inter, &L->dense);
            continue;
        }
        snprintf(name, sizeof name, "blk.%u.ffn_gate_inp.weight", l);
        WANT(name, c->router_dtype, 0, 2, E, H, 1, CB_SEC_ROUTER);
        L->router = p;
        if (c->router_int8) {
            snprintf(name, sizeof name, "blk.%u.ffn_gate_inp.scale", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 1, E, 1, 1, CB_SEC_ROUTER);
            L->router_scale = p;
            snprintf(name, sizeof name, "blk.%u.ffn_gate_inp.zero", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 1, E, 1, 1, CB_SEC_ROUTER);
            L->router_zero = p;
        }
        if (c->router_bias) { /* the choice-only correction bias (backend/cpu/route_group.c) */
            snprintf(name, sizeof name, "blk.%u.exp_probs_b.bias", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 1, E, 1, 1, CB_SEC_ROUTER);
            L->router_bias = p;
        }
        if (c->router_logit_bias) {
            snprintf(name, sizeof name, "blk.%u.ffn_gate_inp.bias", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 1, E, 1, 1, CB_SEC_ROUTER);
            L->router_b = p;
        }
        FFN("ffn_experts", "_exps", 1, E, I, &L->experts);
        if (c->activation == CB_ACT_CLAMPED_SWIGLU && L->experts.packed) {
            cb_set_err(err, len, "layer %u's experts are packed; model.activation clamped_swiglu runs on the split "
                       "FFN (version 2); " RECONVERT, l);
            return COLIBRI_E_FORMAT;
        }
        if (c->expert_bias) {
            snprintf(name, sizeof name, "blk.%u.ffn_gate_exps.bias", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 2, E, I, 1, CB_SEC_DENSE);
            L->experts.gate_bias = p;
            snprintf(name, sizeof name, "blk.%u.ffn_up_exps.bias", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 2, E, I, 1, CB_SEC_DENSE);
            L->experts.up_bias = p;
            snprintf(name, sizeof name, "blk.%u.ffn_down_exps.bias", l);
            WANT(name, COLIBRI_DTYPE_F32, 0, 2, E, H, 1, CB_SEC_DENSE);
            L->experts.down_bias = p;
        }
        if (c->shared_inter > 0) {
            FFN("ffn_shared", "_shexp", 0, 1, c->shared_inter, &L->shared);
            L->has_shared = 1;
            if (c->shared_gate) {
                snprintf(name, sizeof name, "blk.%u.ffn_shared_gate.weight", l);
                MAT(name, 1, H, CB_SEC_ROUTER, &L->shared_gate);
            }
        }
    }
#undef WANT
#undef MAT
#undef FFN
    return COLIBRI_OK;
}

colibri_status cb_model_load(cb_file *f, cb_config *c, cb_weights *w, const uint8_t *map, uint64_t size,
                             const char *path, char *err, size_t len) {
    colibri_status st;
    if ((st = cb_file_open(f, map, size, path, err, len))) return st;
    if ((st = cb_file_metadata(f, err, len))) return st;
    if ((st = cb_model_config(f, c, err, len))) return st;
    if ((st = cb_file_tensors(f, err, len))) return st;
    if ((st = bind_weights(f, c, w, err, len))) return st;
    return COLIBRI_OK;
}

static double tensor_l2(const cb_tensor *t, const uint8_t *data, const float *scale, const float *zero) {
    double ss = 0;
    if (t->dtype == COLIBRI_DTYPE_I8) {
        uint64_t n = t->nbytes;
        uint64_t cols = t->n_dims >= 2 ? t->dims[1] : n;
        for (uint64_t i = 0; i < n; i++) {
            uint64_t r = cols ? i / cols : 0;
            double v = ((double)(int8_t)data[i] - (double)zero[r]) * (double)scale[r];
            ss += v * v;
        }
    } else { /* any weight dtype: its rows dequantized a chunk at a time */
        cb_dequant_fn deq = cb_dtype_dequant(t->dtype);
        uint64_t cols = t->dims[t->n_dims - 1], rb = cb_row_bytes(t->dtype, cols);
        uint64_t rows = rb ? t->nbytes / rb : 0, cb = cb_row_bytes(t->dtype, 256);
        float buf[256];
        for (uint64_t r = 0; r < rows; r++)
            for (uint64_t k0 = 0; k0 < cols; k0 += 256) {
                uint64_t m = cols - k0 < 256 ? cols - k0 : 256;
                deq(buf, data + r * rb + k0 / 256 * cb, (int64_t)m);
                for (uint64_t i = 0; i < m; i++) ss += (double)buf[i] * (double)buf[i];
            }
    }
    return sqrt(ss);
}

colibri_status cb_model_verify_router(const cb_weights *w, const cb_config *c, const cb_file *f, char *err,
                                      size_t len) {
    char name[96];
    for (uint32_t l = 0; l < c->n_layers; l++) {
        const cb_layer *L = &w->layers[l];
        if (!L->moe) continue; /* a dense layer has no router */
        const char *suffix[3] = {"weight", "scale", "zero"};
        int n_check = c->router_int8 ? 3 : 1;
        for (int s = 0; s < n_check + (L->shared_gate.w != NULL); s++) {
            if (s < n_check) snprintf(name, sizeof name, "blk.%u.ffn_gate_inp.%s", l, suffix[s]);
            else snprintf(name, sizeof name, "blk.%u.ffn_shared_gate.weight", l);
            const cb_tensor *t = cb_file_tensor(f, name);
            if (!t) {
                cb_set_err(err, len, "tensor '%s' vanished", name);
                return COLIBRI_E_INTERNAL;
            }
            double got = tensor_l2(t, f->map + t->offset, L->router_scale, L->router_zero);
            double want = t->l2norm;
            double tol = 1e-5 * fabs(want);
            if (!(fabs(got - want) <= tol) && !(want == 0 && got == 0)) {
                cb_set_err(err, len, "router of layer %u: tensor '%s' has L2 norm %.9g but the "
                           "directory stores %.9g (relative tolerance 1e-5): the router weights are damaged "
                           "or were written wrongly; " RECONVERT, l, name, got, want);
                return COLIBRI_E_CHECKSUM;
            }
        }
    }
    return COLIBRI_OK;
}
