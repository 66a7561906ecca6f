/*
 * model.h — what a model is, as the forward pass sees it: read-only facts from the file's
 * header and metadata (cb_config), and per layer the pointers to its weights, borrowed from
 * the mapping and never copied or freed (cb_layer, cb_weights). model/config.c fills the
 * first from the container's header and metadata, model/weights.c the second from its tensors,
 * at load; nothing here changes after colibri_init_ex. The family's differences (biases,
 * q/k norms, dense layers, shared experts, windows) are options here, read from metadata
 * (docs/format.md, "Family options"), so the forward pass never tests a family's name.
 */
#ifndef COLIBRI_MODEL_H
#define COLIBRI_MODEL_H

#include <stdint.h>

#include "format/container.h"
#include "model/family.h"

/* model.attn_qk_norm (docs/format.md, "Family options"). */
enum { CB_QKNORM_NONE = 0, CB_QKNORM_HEAD = 1, CB_QKNORM_FULL = 2 };

/* Read-only model facts (and the facts of the file they came from). */
typedef struct cb_config {
    uint32_t version;
    uint64_t file_size;
    uint32_t n_layers, hidden, inter, vocab, n_heads, n_kv_heads;
    uint32_t head_dim;         /* the dims RoPE rotates per head (MLA: qk_rope_head_dim) */
    uint32_t n_experts, top_k, block_size, alignment, flags;
    uint64_t file_max_seq_len;
    uint64_t max_position_embeddings;
    uint64_t sliding_window;   /* 0 = none */
    int norm_topk_prob;
    int tie_word_embeddings;
    int router_int8;
    double rms_norm_eps;
    double rope_theta;
    uint32_t weight_dtype;     /* the experts' dtype (the bulk of the file); every matrix has its own */
    uint32_t router_dtype;     /* COLIBRI_DTYPE_F32/F16/BF16/I8 */
    int32_t bos_id, eos_id, unk_id, pad_id;
    /* the ids after which a generation ends (colibri_get_end_ids): EOS first when there is
     * one, then tokenizer.end_ids, each once */
    int32_t end_ids[COLIBRI_MAX_END_IDS + 1];
    int32_t n_end_ids;
    /* the family's entry and choices (model/family.h); defaults are Mixtral's */
    const cb_family *family;
    int attention;             /* CB_ATTN_* */
    int routing;               /* CB_ROUTE_* */
    int activation;            /* CB_ACT_* */
    int rope_type;             /* CB_ROPE_* */
    const uint8_t *rope_inv_freq; /* [head_dim / 2] f64 in the mapped metadata (YaRN), or NULL */
    float rope_attention_factor;  /* multiplies cos and sin (YaRN's mscale); 1 otherwise */
    /* family options (docs/format.md, "Family options"); defaults are Mixtral's */
    uint32_t dense_inter;      /* width of the dense-MLP layers; 0 when every layer is MoE */
    uint32_t shared_inter;     /* shared-expert width; 0 = no shared expert */
    int shared_gate;           /* shared expert scaled by sigmoid(g . x) */
    int attn_qkv_bias;         /* q/k/v projections have biases */
    int attn_output_bias;      /* o projection has a bias */
    int qk_norm;               /* CB_QKNORM_* */
    float clip_qkv;            /* > 0: clamp q, k, v to [-clip, clip] after the q/k norm */
    /* grouped routing (model.n_group, model.topk_group; route_group.c): the experts in
     * n_group groups, the top topk_group groups kept (1, 1 = no grouping); a group's score
     * is its best probability (softmax_topk, DeepSeek-V2) or the sum of its two best biased
     * scores (sigmoid_topk, DeepSeek-V3) */
    uint32_t n_group, topk_group;
    float routed_scale;        /* model.routed_scaling_factor: the routed weights times this (1) */
    int router_bias;           /* model.router_bias: a per-expert bias added for the choice only */
    /* multi-head latent attention (model.attention "mla"; DeepSeek-V2/V3): head_dim is the
     * RoPE width qk_rope_head_dim, as transformers' config.head_dim */
    uint32_t q_lora_rank;      /* 0: q = W_q x; else q = W_qb rmsnorm(W_qa x) */
    uint32_t kv_lora_rank;     /* r: the latent c per position (the KV cache holds c and k_pe) */
    uint32_t qk_nope_dim;      /* per-head query/key width without RoPE */
    uint32_t v_head_dim;       /* per-head value width */
    float attn_scale;          /* MLA softmax scale (qk_head_dim^-0.5, times YaRN's mscale^2) */
    /* gpt-oss (docs/format.md, "Family options of gpt-oss") */
    float swiglu_limit;        /* activation clamped_swiglu: the clamp bound (f32) */
    float swiglu_alpha;        /* activation clamped_swiglu: the sigmoid's gain (f32) */
    int router_logit_bias;     /* model.router_logit_bias: the router logits add blk.N.ffn_gate_inp.bias */
    int attn_sinks;            /* one learned sink logit per query head (blk.N.attn_sinks) */
    int expert_bias;           /* the routed experts' gate/up/down have biases (blk.N.ffn_*_exps.bias) */
    const uint8_t *layer_ffn;  /* [n_layers] u32 in the mapped metadata (1 MoE, 0 dense), or NULL = all MoE */
    const uint8_t *layer_window; /* [n_layers] u64 in the mapped metadata, or NULL = all sliding_window */
    const uint8_t *chat_template; /* [chat_template_len] UTF-8 in the mapped metadata, or NULL */
    uint64_t chat_template_len;
    char architecture[64];
    char name[256];
    char weight_dtype_str[32];
    char router_dtype_str[8];
    cb_section sections[CB_N_SECTIONS];
} cb_config;

/* A weight matrix [rows, cols], row-major, in the mapping: its dtype is the tensor's own
 * (any weight dtype, core/dtype.h), so every matrix of a mixed file runs by its type. */
typedef struct cb_mat {
    const void *w;
    uint32_t dt;
    const void *pan; /* the panel copy of w (BF16; backend/cpu/panels.c), or NULL */
    const void *qpan; /* the interleaved copy of w (an int8 type; cpu/qpanel.h), or NULL */
    int64_t cols;    /* K: the length of a row */
    /* how the CPU backend multiplies by it (backend/cpu/bind.c: its layout and kernels),
     * chosen once when the backend starts; NULL before */
    const struct cb_matmul_op *op;
} cb_mat;

/* A SwiGLU FFN of one or E experts (docs/format.md): packed (version 1: one tensor, rows
 * gate/up interleaved by blocks then w2^T; F32/F16/BF16) or split (version 2: gate, up
 * [E, I, H] and down [E, H, I], any weight dtypes, gate and up the same). */
typedef struct cb_ffn {
    const void *packed;        /* packed: [E, 3I, H], expert e at packed + e * stride; else NULL */
    const void *pan;           /* packed BF16: the panel copy (backend/cpu/panels.c), or NULL */
    uint64_t stride;           /* packed: bytes per expert */
    const void *gate, *up, *down; /* split */
    /* split, int8 types: the interleaved copies (cpu/qpanel.h) of gate, up [E I, H] and down
     * [E H, I] (backend/cpu/panels.c), or NULL (gate_q and up_q are set together) */
    const void *gate_q, *up_q, *down_q;
    uint64_t gu_stride, down_stride; /* split: bytes per expert of gate (= up) and of down */
    uint32_t dt;               /* packed: its dtype; split: the gate's and up's */
    uint32_t down_dt;          /* split: the down projection's dtype */
    uint32_t inter;            /* I */
    /* split only, optional (NULL = none): f32 biases, expert e's at + e * I (gate, up) or
     * + e * H (down), added after each projection */
    const float *gate_bias, *up_bias, *down_bias;
    /* how the CPU backend computes it (backend/cpu/parallel.c: its layout and kernels), chosen
     * once when the backend starts (NULL before), and whether h is rounded to bf16 for the
     * down projection after gate/up (fast mode, a BF16 down matrix, a kernel that does not) */
    const struct cb_ffn_op *op;
    int round_h;
    /* fast mode's int8 kernels read its gate/up input (q8_in) and its down input h (q8_h) as
     * rows quantized once (cpu/fast.h cb_fast_qrows) where a job carries them */
    int q8_in, q8_h;
} cb_ffn;

/* Pointers of one decoder layer, all into the mmap. */
typedef struct cb_layer {
    const float *attn_norm;    /* [H] f32 */
    cb_mat wq;                 /* [n_heads*head_dim, H] */
    cb_mat wk;                 /* [n_kv_heads*head_dim, H] */
    cb_mat wv;                 /* [n_kv_heads*head_dim, H] */
    cb_mat wo;                 /* [H, n_heads*head_dim] */
    const float *ffn_norm;     /* [H] f32 */
    const void *router;        /* [E, H] router dtype (f32/f16/bf16/i8) */
    const float *router_scale; /* [E] f32, int8 routers only, else NULL */
    const float *router_zero;  /* [E] f32, int8 routers only, else NULL */
    cb_ffn experts;            /* the routed experts (MoE layers) */
    /* family options; NULL when the file has none */
    const float *bq, *bk, *bv; /* [Nq], [Nkv], [Nkv] f32 q/k/v biases */
    const float *bo;           /* [H] f32 output-projection bias */
    const float *q_norm;       /* [head_dim] (qk_norm head) or [Nq] (full) f32 */
    const float *k_norm;       /* [head_dim] (qk_norm head) or [Nkv] (full) f32 */
    const float *sinks;        /* [n_heads] f32 attention sink logits, or NULL */
    const float *router_b;     /* [E] f32 router logit bias (router_logit_bias), or NULL */
    cb_ffn dense;              /* dense-MLP layers: one expert of width Id */
    cb_ffn shared;             /* the shared expert (width Is), when the family has one */
    int has_shared;
    cb_mat shared_gate;        /* [1, H]: shared-expert gate; .w NULL when none */
    const float *router_bias;  /* [E] f32 choice-only correction bias (model.router_bias), or NULL */
    /* multi-head latent attention (CB_ATTN_MLA): wq is W_q [n_heads*(dn+dr), H] when
     * q_lora_rank is 0; wo is [H, n_heads*dv] */
    cb_mat wq_a;               /* [q_lora_rank, H] */
    const float *q_a_norm;     /* [q_lora_rank] f32 */
    cb_mat wq_b;               /* [n_heads*(dn+dr), q_lora_rank] */
    cb_mat wkv_a;              /* [r+dr, H]: the latent c then the shared k_pe */
    const float *kv_a_norm;    /* [r] f32 */
    cb_mat wkv_b;              /* [n_heads*(dn+dv), r]: per head W_UK [dn, r] then W_UV [dv, r] */
    /* per-layer options, from the metadata at load */
    int moe;                   /* 1: MoE block (router, experts); 0: dense MLP (`dense`) */
    int64_t window;            /* attention window in tokens, 0 = full */
    /* how the CPU backend computes this layer's router (its logits from the router's dtype,
     * the family's routing; MoE layers) and its attention (the exact or the fast table's),
     * chosen once when the backend starts (backend/cpu/bind.c); NULL before */
    const struct cb_router_op *router_op;
    const struct cb_att_op *att_op;
} cb_layer;

typedef struct cb_weights {
    cb_mat tok_embd;          /* [V, H] */
    const float *out_norm;    /* [H] f32 */
    cb_mat lm_head;           /* [V, H] (= tok_embd when tied) */
    cb_layer *layers;         /* [n_layers], heap (init-time) */
} cb_weights;

/* Load a mapped file: the container's header and metadata (format/container.h), the model's
 * config from them (config.c: cb_model_config), the tensor directory, then the weights bound
 * to it (weights.c). f's arrays and w->layers are heap (init-time); messages go to err. */
colibri_status cb_model_load(cb_file *f, cb_config *c, cb_weights *w, const uint8_t *map, uint64_t size,
                             const char *path, char *err, size_t len);
colibri_status cb_model_config(const cb_file *f, cb_config *c, char *err, size_t len);
/* Recompute the router tensors' L2 norms and compare them with the stored ones. */
colibri_status cb_model_verify_router(const cb_weights *w, const cb_config *c, const cb_file *f, char *err,
                                      size_t len);

#endif
