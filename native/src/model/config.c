/*
 * config.c — the model's facts (cb_config, model/model.h) from a container's header and
 * metadata (format/container.h): the required keys and their agreement with the header, the
 * family and its choices (model/family.h), and the family options (docs/format.md, "Family
 * options"). Every value is checked before the forward pass may rely on it; a failure
 * returns a status and a message that names the key and says what to do.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core/error.h"
#include "model/family.h"
#include "model/model.h"

#define RECONVERT CB_RECONVERT

#define REQ(key, type)                                                       \
    do {                                                                     \
        st = cb_meta_req(f, key, type, &e, err, len);                         \
        if (st != COLIBRI_OK) return st;                                     \
    } while (0)

static int str_is(const cb_meta_entry *e, const char *s) {
    size_t n = strlen(s);
    return e->count == n && memcmp(e->value, s, n) == 0;
}

/* Copy a STRING value: free text (general.name) keeps its UTF-8 bytes (a NUL inside
 * becomes '?'); identifiers that may appear in messages are made printable ASCII. */
static void str_copy(char *dst, size_t cap, const cb_meta_entry *e) {
    cb_printable(dst, cap, e->value, e->count);
}
static void text_copy(char *dst, size_t cap, const cb_meta_entry *e) {
    uint64_t n = e->count < cap - 1 ? e->count : cap - 1;
    memcpy(dst, e->value, (size_t)n);
    dst[n] = 0;
    for (uint64_t i = 0; i < n; i++)
        if (dst[i] == 0) dst[i] = '?'; /* a NUL inside would truncate silently */
}

static int parse_dtype_str(const cb_meta_entry *e, uint32_t *dt) {
    if (str_is(e, "f32")) *dt = COLIBRI_DTYPE_F32;
    else if (str_is(e, "f16")) *dt = COLIBRI_DTYPE_F16;
    else if (str_is(e, "bf16")) *dt = COLIBRI_DTYPE_BF16;
    else if (str_is(e, "int8")) *dt = COLIBRI_DTYPE_I8;
    else return 0;
    return 1;
}

/* Check that a U32 metadata key equals the header value. */
static colibri_status agree_u32(const cb_file *f, const char *key, uint64_t header_val,
                                const char *header_field, char *err, size_t len) {
    const cb_meta_entry *e = cb_meta_find(f, key);
    if (!e) {
        cb_set_err(err, len, "metadata key '%s' is missing; " RECONVERT, key);
        return COLIBRI_E_FORMAT;
    }
    uint64_t v;
    if (e->type == CB_MT_U32) v = cb_rd_u32(e->value);
    else if (e->type == CB_MT_U64) v = cb_rd_u64(e->value);
    else {
        cb_set_err(err, len, "metadata key '%s' has type %s, expected %s; " RECONVERT, key,
                   cb_meta_type_name(e->type), strcmp(key, "model.max_seq_len") == 0 ? "U64" : "U32");
        return COLIBRI_E_FORMAT;
    }
    if (v != header_val) {
        cb_set_err(err, len, "metadata key '%s' = %llu disagrees with header field %s = %llu; " RECONVERT,
                   key, (unsigned long long)v, header_field, (unsigned long long)header_val);
        return COLIBRI_E_FORMAT;
    }
    return COLIBRI_OK;
}

#define OPT(key, type, elem)                                                 \
    do {                                                                     \
        st = cb_meta_opt(f, key, type, elem, &e, err, len);                   \
        if (st != COLIBRI_OK) return st;                                     \
    } while (0)
/* An optional BOOL key into dst (false when absent). */
#define OPT_BOOL(key, dst)                                                   \
    do {                                                                     \
        OPT(key, CB_MT_BOOL, 0);                                             \
        (dst) = e ? e->value[0] : 0;                                         \
    } while (0)

/* Grouped routing, a choice bias and scaling (docs/format.md, "Family options";
 * backend/cpu/route_group.c): model.n_group, model.topk_group, model.router_bias,
 * model.routed_scaling_factor. Defaults: no groups, no bias, scale 1. */
static colibri_status read_router_options(const cb_file *f, cb_config *c, char *err, size_t len) {
    const cb_meta_entry *e;
    colibri_status st;
    OPT("model.n_group", CB_MT_U32, 0);
    c->n_group = e ? cb_rd_u32(e->value) : 1;
    OPT("model.topk_group", CB_MT_U32, 0);
    c->topk_group = e ? cb_rd_u32(e->value) : c->n_group;
    if (c->n_group == 0 || c->n_experts % c->n_group != 0 || c->topk_group == 0 || c->topk_group > c->n_group) {
        cb_set_err(err, len, "model.n_group = %u must be >= 1 and divide n_experts = %u, and model.topk_group = %u "
                   "must be in [1, n_group]; " RECONVERT, c->n_group, c->n_experts, c->topk_group);
        return COLIBRI_E_FORMAT;
    }
    if (c->n_group > 1) {
        uint32_t per = c->n_experts / c->n_group;
        if (c->routing != CB_ROUTE_SOFTMAX_TOPK && c->routing != CB_ROUTE_SIGMOID_TOPK) {
            cb_set_err(err, len, "model.n_group = %u: expert groups need model.routing softmax_topk or "
                       "sigmoid_topk; " RECONVERT, c->n_group);
            return COLIBRI_E_FORMAT;
        }
        if ((uint64_t)c->topk_group * per < c->top_k || (c->routing == CB_ROUTE_SIGMOID_TOPK && per < 2)) {
            cb_set_err(err, len, "model.topk_group = %u groups of %u experts cannot hold top_k = %u choices "
                       "(sigmoid_topk groups also need 2 experts each); " RECONVERT, c->topk_group, per, c->top_k);
            return COLIBRI_E_FORMAT;
        }
    }
    OPT_BOOL("model.router_bias", c->router_bias);
    if (c->router_bias && c->routing != CB_ROUTE_SIGMOID_TOPK) {
        cb_set_err(err, len, "model.router_bias is true but model.routing is not sigmoid_topk; " RECONVERT);
        return COLIBRI_E_FORMAT;
    }
    OPT("model.routed_scaling_factor", CB_MT_F64, 0);
    c->routed_scale = 1.0f;
    if (e) {
        double v = cb_rd_f64(e->value);
        if (!isfinite(v) || v <= 0 || v > 1e6) {
            cb_set_err(err, len, "model.routed_scaling_factor = %g must be finite and in (0, 1e6]; " RECONVERT, v);
            return COLIBRI_E_FORMAT;
        }
        c->routed_scale = (float)v;
    }
    return COLIBRI_OK;
}

/* Multi-head latent attention (model.attention "mla", backend/cpu/mla.c): its widths and
 * softmax scale, required in an MLA file; model.head_dim is the RoPE width. */
static colibri_status read_mla_options(const cb_file *f, cb_config *c, char *err, size_t len) {
    const cb_meta_entry *e;
    colibri_status st;
    if (c->attention != CB_ATTN_MLA) return COLIBRI_OK;
    struct { const char *key; uint32_t *v; uint32_t lo; } w[] = {
        {"model.q_lora_rank", &c->q_lora_rank, 0}, {"model.kv_lora_rank", &c->kv_lora_rank, 1},
        {"model.qk_nope_head_dim", &c->qk_nope_dim, 1}, {"model.v_head_dim", &c->v_head_dim, 1}};
    for (size_t i = 0; i < sizeof w / sizeof w[0]; i++) {
        if ((st = cb_meta_req(f, w[i].key, CB_MT_U32, &e, err, len))) return st;
        *w[i].v = cb_rd_u32(e->value);
        if (*w[i].v < w[i].lo || *w[i].v > (1u << 16)) {
            cb_set_err(err, len, "%s = %u must be in [%u, 65536]; " RECONVERT, w[i].key, *w[i].v, w[i].lo);
            return COLIBRI_E_FORMAT;
        }
    }
    uint64_t nh = c->n_heads, dq = (uint64_t)c->qk_nope_dim + c->head_dim;
    if (nh * dq > (1u << 24) || nh * ((uint64_t)c->qk_nope_dim + c->v_head_dim) > (1u << 24) ||
        nh * ((uint64_t)c->kv_lora_rank + c->head_dim) > (1u << 26)) {
        cb_set_err(err, len, "MLA widths are implausible (n_heads = %u, qk_nope_head_dim = %u, head_dim = %u, "
                   "v_head_dim = %u, kv_lora_rank = %u); " RECONVERT, c->n_heads, c->qk_nope_dim, c->head_dim,
                   c->v_head_dim, c->kv_lora_rank);
        return COLIBRI_E_FORMAT;
    }
    if (c->n_kv_heads != c->n_heads) {
        cb_set_err(err, len, "model.n_kv_heads = %u must equal model.n_heads = %u in an MLA file (every head "
                   "reads the one latent); " RECONVERT, c->n_kv_heads, c->n_heads);
        return COLIBRI_E_FORMAT;
    }
    if ((st = cb_meta_req(f, "model.attn_scale", CB_MT_F64, &e, err, len))) return st;
    double v = cb_rd_f64(e->value);
    if (!isfinite(v) || v <= 0 || v > 1e6) {
        cb_set_err(err, len, "model.attn_scale = %g must be finite and in (0, 1e6]; " RECONVERT, v);
        return COLIBRI_E_FORMAT;
    }
    c->attn_scale = (float)v;
    if (c->sliding_window != 0 || c->layer_window) {
        cb_set_err(err, len, "an MLA file has no attention window (model.sliding_window must be 0); " RECONVERT);
        return COLIBRI_E_FORMAT;
    }
    return COLIBRI_OK;
}

/* A positive finite F64 option as f32 (0 when absent). */
static colibri_status opt_positive(const cb_meta_entry *e, const char *key, float *out, char *err, size_t len) {
    *out = 0.0f;
    if (!e) return COLIBRI_OK;
    double v = cb_rd_f64(e->value);
    if (!isfinite(v) || v <= 0 || v > 3.0e38) {
        cb_set_err(err, len, "%s = %g must be a positive finite number; " RECONVERT, key, v);
        return COLIBRI_E_FORMAT;
    }
    *out = (float)v;
    if (*out == 0.0f) *out = 1e-45f;
    return COLIBRI_OK;
}

/* gpt-oss's options (docs/format.md, "Family options of gpt-oss"): the clamped SwiGLU's
 * limit and alpha (model.activation clamped_swiglu, read with the other choices), the
 * router's logit bias, attention sinks and expert biases. */
static colibri_status read_gptoss_options(const cb_file *f, cb_config *c, char *err, size_t len) {
    const cb_meta_entry *e;
    colibri_status st;
    OPT("model.swiglu_limit", CB_MT_F64, 0);
    st = opt_positive(e, "model.swiglu_limit", &c->swiglu_limit, err, len);
    if (st != COLIBRI_OK) return st;
    OPT("model.swiglu_alpha", CB_MT_F64, 0);
    st = opt_positive(e, "model.swiglu_alpha", &c->swiglu_alpha, err, len);
    if (st != COLIBRI_OK) return st;
    if (c->activation == CB_ACT_CLAMPED_SWIGLU) {
        if (c->swiglu_limit == 0.0f || c->swiglu_alpha == 0.0f) {
            cb_set_err(err, len, "model.activation clamped_swiglu needs model.swiglu_limit and "
                       "model.swiglu_alpha; " RECONVERT);
            return COLIBRI_E_FORMAT;
        }
        int any_dense = 0;
        for (uint32_t l = 0; c->layer_ffn && l < c->n_layers; l++)
            any_dense |= cb_rd_u32(c->layer_ffn + 4 * (uint64_t)l) == 0;
        if (any_dense || c->shared_inter > 0) {
            cb_set_err(err, len, "model.activation clamped_swiglu applies to the routed experts only; this build "
                       "runs it without dense layers or a shared expert; " RECONVERT);
            return COLIBRI_E_UNSUPPORTED;
        }
    }
    OPT_BOOL("model.router_logit_bias", c->router_logit_bias);
    OPT_BOOL("model.attn_sinks", c->attn_sinks);
    OPT_BOOL("model.expert_bias", c->expert_bias);
    if (c->attn_sinks && c->attention != CB_ATTN_GQA) {
        cb_set_err(err, len, "model.attn_sinks needs model.attention gqa; " RECONVERT);
        return COLIBRI_E_FORMAT;
    }
    return COLIBRI_OK;
}

/* The family options (docs/format.md, "Family options"): all optional, Mixtral's
 * behaviour by default. Read once here; the forward pass only sees cb_config/cb_layer. */
static colibri_status read_family_options(const cb_file *f, cb_config *c, char *err, size_t len) {
    const cb_meta_entry *e;
    colibri_status st;
    uint32_t n_dense = 0;

    OPT("model.layer_ffn", CB_MT_ARRAY, CB_MT_U32);
    if (e) {
        if (e->count != c->n_layers) {
            cb_set_err(err, len, "model.layer_ffn has %llu entries but the model has %u layers; " RECONVERT,
                       (unsigned long long)e->count, c->n_layers);
            return COLIBRI_E_FORMAT;
        }
        for (uint32_t l = 0; l < c->n_layers; l++) {
            uint32_t v = cb_rd_u32(e->value + 4 * (uint64_t)l);
            if (v > 1) {
                cb_set_err(err, len, "model.layer_ffn[%u] = %u (must be 1 for an MoE block or 0 for a dense "
                           "MLP); " RECONVERT, l, v);
                return COLIBRI_E_FORMAT;
            }
            n_dense += v == 0;
        }
        /* At least one MoE layer: its ffn_experts tensor then bounds n_experts and top_k by
         * the file's size; without one nothing would, and the arena is sized by them. */
        if (n_dense == c->n_layers) {
            cb_set_err(err, len, "model.layer_ffn marks all %u layers dense: this is not a Mixture-of-Experts "
                       "model; " RECONVERT, c->n_layers);
            return COLIBRI_E_FORMAT;
        }
        c->layer_ffn = e->value;
    }
    OPT("model.dense_intermediate_size", CB_MT_U32, 0);
    c->dense_inter = e ? cb_rd_u32(e->value) : 0;
    if (n_dense > 0 && c->dense_inter == 0) {
        cb_set_err(err, len, "model.layer_ffn has %u dense layers but model.dense_intermediate_size is %s; "
                   RECONVERT, n_dense, e ? "0" : "missing");
        return COLIBRI_E_FORMAT;
    }
    OPT("model.shared_expert_intermediate_size", CB_MT_U32, 0);
    c->shared_inter = e ? cb_rd_u32(e->value) : 0;
    if (c->dense_inter > (1u << 26) || c->shared_inter > (1u << 26)) {
        cb_set_err(err, len, "model widths are implausible (dense_intermediate_size = %u, "
                   "shared_expert_intermediate_size = %u); " RECONVERT, c->dense_inter, c->shared_inter);
        return COLIBRI_E_FORMAT;
    }
    OPT_BOOL("model.shared_expert_gate", c->shared_gate);
    if (c->shared_gate && c->shared_inter == 0) {
        cb_set_err(err, len, "model.shared_expert_gate is true but the model has no shared expert "
                   "(model.shared_expert_intermediate_size is 0); " RECONVERT);
        return COLIBRI_E_FORMAT;
    }
    OPT_BOOL("model.attn_qkv_bias", c->attn_qkv_bias);
    OPT_BOOL("model.attn_output_bias", c->attn_output_bias);
    OPT("model.attn_qk_norm", CB_MT_STRING, 0);
    c->qk_norm = CB_QKNORM_NONE;
    if (e) {
        if (str_is(e, "none")) c->qk_norm = CB_QKNORM_NONE;
        else if (str_is(e, "head")) c->qk_norm = CB_QKNORM_HEAD;
        else if (str_is(e, "full")) c->qk_norm = CB_QKNORM_FULL;
        else {
            char tmp[64];
            str_copy(tmp, sizeof tmp, e);
            cb_set_err(err, len, "model.attn_qk_norm '%s' is not supported by this build (supported: none, "
                       "head, full); use a newer Colibri or " RECONVERT, tmp);
            return COLIBRI_E_UNSUPPORTED;
        }
    }
    OPT("model.clip_qkv", CB_MT_F64, 0);
    c->clip_qkv = 0.0f;
    if (e) {
        double v = cb_rd_f64(e->value);
        if (!isfinite(v) || v < 0 || v > 3.0e38) {
            cb_set_err(err, len, "model.clip_qkv = %g must be finite and >= 0 (0 = no clipping); " RECONVERT, v);
            return COLIBRI_E_FORMAT;
        }
        c->clip_qkv = (float)v;
        if (v > 0 && c->clip_qkv == 0.0f) c->clip_qkv = 1e-45f; /* a positive clip stays positive */
    }
    OPT("model.layer_sliding_window", CB_MT_ARRAY, CB_MT_U64);
    if (e) {
        if (e->count != c->n_layers) {
            cb_set_err(err, len, "model.layer_sliding_window has %llu entries but the model has %u layers; "
                       RECONVERT, (unsigned long long)e->count, c->n_layers);
            return COLIBRI_E_FORMAT;
        }
        c->layer_window = e->value;
    }
    if ((st = read_router_options(f, c, err, len))) return st;
    if ((st = read_mla_options(f, c, err, len))) return st;
    if ((st = read_gptoss_options(f, c, err, len))) return st;
    /* the chat template (a Jinja source, as tokenizer_config.json has it); applied by
     * colibri_server, never by the engine */
    OPT("tokenizer.chat_template", CB_MT_STRING, 0);
    if (e) {
        c->chat_template = e->value;
        c->chat_template_len = e->count;
    }
    return COLIBRI_OK;
}
#undef OPT_BOOL
#undef OPT

/* The family's choices (model/family.h): model.attention, model.routing, model.activation
 * (absent: Mixtral's) and model.rope_type (required), each parsed by its axis's table and
 * checked against the family's entry; YaRN's frequencies and attention factor. */
static colibri_status read_choices(const cb_file *f, cb_config *c, char *err, size_t len) {
    int *choice[CB_N_AXES] = {&c->attention, &c->routing, &c->activation, &c->rope_type};
    const cb_meta_entry *e;
    colibri_status st;
    for (int a = 0; a < CB_N_AXES; a++) {
        const char *key = cb_axis_key(a);
        if ((st = cb_meta_opt(f, key, CB_MT_STRING, 0, &e, err, len))) return st;
        *choice[a] = cb_axis_default(a);
        if (!e) continue;
        char tmp[64], have[160];
        str_copy(tmp, sizeof tmp, e);
        cb_axis_choices(a, have, sizeof have);
        int v = cb_axis_parse(a, e->value, e->count);
        if (v < 0 || !cb_axis_implemented(a, v)) {
            cb_set_err(err, len, "%s '%s' is not supported by this build (supported: %s); use a newer "
                       "Colibri or a model of a supported family", key, tmp, have);
            return COLIBRI_E_UNSUPPORTED;
        }
        if (!(c->family->allowed[a] >> v & 1u)) {
            cb_set_err(err, len, "%s '%s' is not a choice of the %s family; " RECONVERT, key, tmp,
                       c->family->name);
            return COLIBRI_E_FORMAT;
        }
        *choice[a] = v;
    }
    /* RoPE, for YaRN: the converter's [head_dim / 2] inverse frequencies (head_dim is the
     * rotated width, MLA's qk_rope_head_dim too) and its cos/sin factor */
    c->rope_inv_freq = NULL;
    c->rope_attention_factor = 1.0f;
    if ((st = cb_meta_opt(f, "model.rope_inv_freq", CB_MT_ARRAY, CB_MT_F64, &e, err, len))) return st;
    if (e) {
        if (e->count != c->head_dim / 2) {
            cb_set_err(err, len, "model.rope_inv_freq has %llu entries, expected %u (rotated dims / 2); " RECONVERT,
                       (unsigned long long)e->count, c->head_dim / 2);
            return COLIBRI_E_FORMAT;
        }
        for (uint64_t i = 0; i < e->count; i++) {
            double f = cb_rd_f64(e->value + 8 * i);
            if (!isfinite(f) || f <= 0) {
                cb_set_err(err, len, "model.rope_inv_freq[%llu] = %g must be finite and > 0; " RECONVERT,
                           (unsigned long long)i, f);
                return COLIBRI_E_FORMAT;
            }
        }
        c->rope_inv_freq = e->value;
    }
    if ((st = cb_meta_opt(f, "model.rope_attention_factor", CB_MT_F64, 0, &e, err, len))) return st;
    if (e) {
        double f = cb_rd_f64(e->value);
        if (!isfinite(f) || f <= 0 || f > 1e6) {
            cb_set_err(err, len, "model.rope_attention_factor = %g must be finite and in (0, 1e6]; " RECONVERT, f);
            return COLIBRI_E_FORMAT;
        }
        c->rope_attention_factor = (float)f;
    }
    if (c->rope_type == CB_ROPE_YARN && !c->rope_inv_freq) {
        cb_set_err(err, len, "model.rope_type is yarn but model.rope_inv_freq is missing; " RECONVERT);
        return COLIBRI_E_FORMAT;
    }
    if (c->rope_type == CB_ROPE_DEFAULT && (c->rope_inv_freq || c->rope_attention_factor != 1.0f)) {
        cb_set_err(err, len, "model.rope_type is default but the file has YaRN's model.rope_inv_freq or "
                   "model.rope_attention_factor; " RECONVERT);
        return COLIBRI_E_FORMAT;
    }
    return COLIBRI_OK;
}

colibri_status cb_model_config(const cb_file *f, cb_config *c, char *err, size_t len) {
    const cb_meta_entry *e;
    colibri_status st;
    /* the facts of the file, from its header */
    const cb_header *h = &f->h;
    c->version = h->version;
    c->file_size = h->file_size;
    c->n_experts = h->n_experts;
    c->top_k = h->top_k;
    c->hidden = h->hidden;
    c->inter = h->inter;
    c->vocab = h->vocab;
    c->file_max_seq_len = h->max_seq_len;
    c->n_layers = h->n_layers;
    c->flags = h->flags;
    c->alignment = h->alignment;
    c->block_size = h->block_size;
    memcpy(c->sections, h->sections, sizeof c->sections);

    /* the family first: a file of another family must say "unsupported", not "bad shape" */
    REQ("general.architecture", CB_MT_STRING);
    str_copy(c->architecture, sizeof c->architecture, e);
    /* the architecture selects nothing in the forward pass: its entry in the family table
     * (model/family.c) says which choices its files may make, and the choices do */
    c->family = cb_family_find(e->value, e->count);
    if (!c->family) {
        char names[256];
        cb_family_names(names, sizeof names);
        cb_set_err(err, len, "architecture '%s' is not supported by this build (supported: %s); "
                   "use a newer Colibri or a model of a supported family", c->architecture, names);
        return COLIBRI_E_UNSUPPORTED;
    }
    REQ("general.name", CB_MT_STRING);
    text_copy(c->name, sizeof c->name, e);

    if ((st = agree_u32(f, "model.n_layers", c->n_layers, "n_layers", err, len))) return st;
    if ((st = agree_u32(f, "model.hidden_size", c->hidden, "hidden_size", err, len))) return st;
    if ((st = agree_u32(f, "model.intermediate_size", c->inter, "intermediate_size", err, len))) return st;
    if ((st = agree_u32(f, "model.vocab_size", c->vocab, "vocab_size", err, len))) return st;
    if ((st = agree_u32(f, "model.n_experts", c->n_experts, "n_experts", err, len))) return st;
    if ((st = agree_u32(f, "model.top_k", c->top_k, "top_k", err, len))) return st;
    if ((st = agree_u32(f, "model.max_seq_len", c->file_max_seq_len, "max_seq_len", err, len))) return st;
    if ((st = agree_u32(f, "convert.block_size", c->block_size, "block_size", err, len))) return st;

    REQ("model.n_heads", CB_MT_U32);
    c->n_heads = cb_rd_u32(e->value);
    REQ("model.n_kv_heads", CB_MT_U32);
    c->n_kv_heads = cb_rd_u32(e->value);
    REQ("model.head_dim", CB_MT_U32);
    c->head_dim = cb_rd_u32(e->value);
    if (c->n_heads == 0) {
        cb_set_err(err, len, "model.n_heads is 0 (must be >= 1); " RECONVERT);
        return COLIBRI_E_FORMAT;
    }
    if (c->n_kv_heads == 0 || c->n_heads % c->n_kv_heads != 0) {
        cb_set_err(err, len, "model.n_kv_heads = %u must be >= 1 and divide model.n_heads = %u; " RECONVERT,
                   c->n_kv_heads, c->n_heads);
        return COLIBRI_E_FORMAT;
    }
    if (c->head_dim == 0 || c->head_dim % 2 != 0) {
        cb_set_err(err, len, "model.head_dim = %u must be even and >= 2 (RoPE rotates pairs); " RECONVERT,
                   c->head_dim);
        return COLIBRI_E_FORMAT;
    }
    /* widths must stay far from overflow in every size computed from them */
    if ((uint64_t)c->n_heads * c->head_dim > (1u << 24) || (uint64_t)c->hidden > (1u << 24) ||
        (uint64_t)c->inter > (1u << 26)) {
        cb_set_err(err, len, "model widths are implausible (n_heads*head_dim = %llu, hidden_size = %u, "
                   "intermediate_size = %u); " RECONVERT,
                   (unsigned long long)c->n_heads * c->head_dim, c->hidden, c->inter);
        return COLIBRI_E_FORMAT;
    }

    REQ("model.norm_topk_prob", CB_MT_BOOL);
    c->norm_topk_prob = e->value[0];
    REQ("model.rms_norm_eps", CB_MT_F64);
    c->rms_norm_eps = cb_rd_f64(e->value);
    if (!isfinite(c->rms_norm_eps) || c->rms_norm_eps < 0) {
        cb_set_err(err, len, "model.rms_norm_eps = %g must be finite and >= 0; " RECONVERT, c->rms_norm_eps);
        return COLIBRI_E_FORMAT;
    }
    REQ("model.rope_theta", CB_MT_F64);
    c->rope_theta = cb_rd_f64(e->value);
    if (!isfinite(c->rope_theta) || c->rope_theta <= 0) {
        cb_set_err(err, len, "model.rope_theta = %g must be finite and > 0; " RECONVERT, c->rope_theta);
        return COLIBRI_E_FORMAT;
    }
    REQ("model.rope_type", CB_MT_STRING);
    if ((st = read_choices(f, c, err, len))) return st;
    REQ("model.max_position_embeddings", CB_MT_U64);
    c->max_position_embeddings = cb_rd_u64(e->value);
    REQ("model.sliding_window", CB_MT_U64);
    c->sliding_window = cb_rd_u64(e->value);
    REQ("model.tie_word_embeddings", CB_MT_BOOL);
    c->tie_word_embeddings = e->value[0];
    if (c->tie_word_embeddings != (int)((c->flags >> 1) & 1u)) {
        cb_set_err(err, len, "model.tie_word_embeddings = %d disagrees with header flags bit 1 = %u; " RECONVERT,
                   c->tie_word_embeddings, (c->flags >> 1) & 1u);
        return COLIBRI_E_FORMAT;
    }
    REQ("model.router_dtype", CB_MT_STRING);
    str_copy(c->router_dtype_str, sizeof c->router_dtype_str, e);
    if (!parse_dtype_str(e, &c->router_dtype)) {
        cb_set_err(err, len, "model.router_dtype '%s' is not one of f32, f16, bf16, int8; " RECONVERT,
                   c->router_dtype_str);
        return COLIBRI_E_UNSUPPORTED;
    }
    c->router_int8 = c->router_dtype == COLIBRI_DTYPE_I8;
    if (c->router_int8 != (int)(c->flags & 1u)) {
        cb_set_err(err, len, "model.router_dtype '%s' disagrees with header flags bit 0 (routers int8) = %u; " RECONVERT,
                   c->router_dtype_str, c->flags & 1u);
        return COLIBRI_E_FORMAT;
    }
    /* informative since version 2 (the file's mix, e.g. q4_k_m): every tensor has its dtype */
    REQ("model.weight_dtype", CB_MT_STRING);
    str_copy(c->weight_dtype_str, sizeof c->weight_dtype_str, e);
    if (c->version < 2 && (!parse_dtype_str(e, &c->weight_dtype) || c->weight_dtype == COLIBRI_DTYPE_I8)) {
        cb_set_err(err, len, "model.weight_dtype '%s' is not one of f32, f16, bf16; " RECONVERT,
                   c->weight_dtype_str);
        return COLIBRI_E_UNSUPPORTED;
    }
    REQ("tokenizer.type", CB_MT_STRING);
    {
        int none = str_is(e, "none");
        int has = c->sections[CB_SEC_TOK].size > 0;
        if (none && has) {
            cb_set_err(err, len, "tokenizer.type is 'none' but the tokenizer section holds %llu bytes; " RECONVERT,
                       (unsigned long long)c->sections[CB_SEC_TOK].size);
            return COLIBRI_E_FORMAT;
        }
        if (!none && !has) {
            char tmp[64];
            str_copy(tmp, sizeof tmp, e);
            cb_set_err(err, len, "tokenizer.type is '%s' but the tokenizer section is empty; " RECONVERT, tmp);
            return COLIBRI_E_FORMAT;
        }
    }
    REQ("tokenizer.bos_id", CB_MT_I32);
    c->bos_id = (int32_t)cb_rd_u32(e->value);
    REQ("tokenizer.eos_id", CB_MT_I32);
    c->eos_id = (int32_t)cb_rd_u32(e->value);
    REQ("tokenizer.unk_id", CB_MT_I32);
    c->unk_id = (int32_t)cb_rd_u32(e->value);
    REQ("tokenizer.pad_id", CB_MT_I32);
    c->pad_id = (int32_t)cb_rd_u32(e->value);
    if ((st = cb_meta_opt(f, "tokenizer.end_ids", CB_MT_ARRAY, CB_MT_I32, &e, err, len))) return st;
    c->n_end_ids = 0;
    if (c->eos_id >= 0) c->end_ids[c->n_end_ids++] = c->eos_id;
    if (e) {
        if (e->count > COLIBRI_MAX_END_IDS) {
            cb_set_err(err, len, "tokenizer.end_ids has %llu ids, more than the %d this build keeps; " RECONVERT,
                       (unsigned long long)e->count, COLIBRI_MAX_END_IDS);
            return COLIBRI_E_FORMAT;
        }
        for (uint64_t i = 0; i < e->count; i++) {
            int32_t id = (int32_t)cb_rd_u32(e->value + 4 * i);
            if (id < 0 || (uint32_t)id >= c->vocab) {
                cb_set_err(err, len, "tokenizer.end_ids[%llu] = %d is outside the vocabulary 0..%u; " RECONVERT,
                           (unsigned long long)i, id, c->vocab - 1);
                return COLIBRI_E_FORMAT;
            }
            int seen = 0;
            for (int32_t k = 0; k < c->n_end_ids; k++) seen |= c->end_ids[k] == id;
            if (!seen) c->end_ids[c->n_end_ids++] = id;
        }
    }
    REQ("convert.source", CB_MT_STRING);
    return read_family_options(f, c, err, len);
}
