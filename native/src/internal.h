/*
 * internal.h — the engine's private structs and the functions the engine's files share.
 *
 * Structs are split by lifetime (docs/STYLE habits):
 *   cb_config   — read-only facts about the model, from the header and metadata;
 *   cb_weights  — pointers borrowed from the mmap (never copied, never freed);
 *   cb_scratch  — every buffer the forward pass and the sampler need, carved from ONE
 *                 arena at init (see model.c, cb_arena_plan);
 *   cb_session  — what changes between calls: the KV cache contents and its length.
 * Every pointer field says its shape. Sizes and offsets are 64-bit.
 */
#ifndef COLIBRI_INTERNAL_H
#define COLIBRI_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "colibri.h"
#include "kernels.h"
#include "threadpool.h"

#define CB_HEADER_SIZE 256u
#define CB_N_SECTIONS 6
#define CB_ERR_LEN 512

enum { CB_SEC_META = 0, CB_SEC_TDIR = 1, CB_SEC_TOK = 2, CB_SEC_DENSE = 3, CB_SEC_ROUTER = 4,
       CB_SEC_EXPERTS = 5 };

/* Metadata value types (docs/format.md, "Metadata section"). */
enum { CB_MT_U32 = 0, CB_MT_I32 = 1, CB_MT_F32 = 2, CB_MT_BOOL = 3, CB_MT_STRING = 4,
       CB_MT_U64 = 5, CB_MT_I64 = 6, CB_MT_F64 = 7, CB_MT_ARRAY = 8 };

/* Tensor layouts. (dtypes are CB_DT_* in kernels.h) */
enum { CB_LAYOUT_ROW_MAJOR = 0, CB_LAYOUT_EXPERTS_PACKED = 1 };

/* model.attn_qk_norm (docs/format.md, "Family options"). */
enum { CB_QKNORM_NONE = 0, CB_QKNORM_HEAD = 1, CB_QKNORM_FULL = 2 };

typedef struct cb_section {
    uint64_t offset;
    uint64_t size;
    uint32_t crc32;
} cb_section;

/* One metadata entry, pointing into the mapped metadata section. */
typedef struct cb_meta_entry {
    const uint8_t *key;   /* (key_len) bytes, not NUL-terminated */
    uint32_t key_len;
    uint32_t type;        /* CB_MT_* */
    const uint8_t *value; /* (value_len) bytes: the encoded value (for STRING: the bytes after the u64 length) */
    uint64_t value_len;
    uint32_t elem_type;   /* ARRAY only */
    uint64_t count;       /* ARRAY: element count; STRING: byte length */
} cb_meta_entry;

/* One tensor directory record, decoded. */
typedef struct cb_tensor {
    const uint8_t *name; /* (name_len) ASCII bytes inside the mapped directory */
    uint32_t name_len;
    uint32_t dtype;      /* CB_DT_* */
    uint32_t layout;     /* CB_LAYOUT_* */
    uint32_t n_dims;
    uint32_t crc32;
    uint64_t dims[4];
    uint64_t offset;     /* absolute, aligned */
    uint64_t nbytes;
    double l2norm;
} cb_tensor;

/* Read-only model facts. */
typedef struct cb_config {
    uint32_t version;
    uint64_t file_size;
    uint32_t n_layers, hidden, inter, vocab, n_heads, n_kv_heads, head_dim;
    uint32_t n_experts, top_k, block_size, alignment, flags;
    uint64_t file_max_seq_len;
    uint64_t max_position_embeddings;
    uint64_t sliding_window;   /* 0 = none */
    int norm_topk_prob;
    int tie_word_embeddings;
    int router_int8;
    double rms_norm_eps;
    double rope_theta;
    uint32_t weight_dtype;     /* CB_DT_F32/F16/BF16 */
    uint32_t router_dtype;     /* CB_DT_F32/F16/BF16/I8 */
    int32_t bos_id, eos_id, unk_id, pad_id;
    /* family options (docs/format.md, "Family options"); defaults are Mixtral's */
    uint32_t dense_inter;      /* width of the dense-MLP layers; 0 when every layer is MoE */
    uint32_t shared_inter;     /* shared-expert width; 0 = no shared expert */
    int shared_gate;           /* shared expert scaled by sigmoid(g . x) */
    int attn_qkv_bias;         /* q/k/v projections have biases */
    int attn_output_bias;      /* o projection has a bias */
    int qk_norm;               /* CB_QKNORM_* */
    float clip_qkv;            /* > 0: clamp q, k, v to [-clip, clip] after the q/k norm */
    const uint8_t *layer_ffn;  /* [n_layers] u32 in the mapped metadata (1 MoE, 0 dense), or NULL = all MoE */
    const uint8_t *layer_window; /* [n_layers] u64 in the mapped metadata, or NULL = all sliding_window */
    char architecture[64];
    char name[256];
    char weight_dtype_str[8];
    char router_dtype_str[8];
    cb_section sections[CB_N_SECTIONS];
} cb_config;

/* Pointers of one decoder layer, all into the mmap. */
typedef struct cb_layer {
    const float *attn_norm;    /* [H] f32 */
    const void *wq;            /* [n_heads*head_dim, H] weight dtype */
    const void *wk;            /* [n_kv_heads*head_dim, H] weight dtype */
    const void *wv;            /* [n_kv_heads*head_dim, H] weight dtype */
    const void *wo;            /* [H, n_heads*head_dim] weight dtype */
    const float *ffn_norm;     /* [H] f32 */
    const void *router;        /* [E, H] router dtype (f32/f16/bf16/i8) */
    const float *router_scale; /* [E] f32, int8 routers only, else NULL */
    const float *router_zero;  /* [E] f32, int8 routers only, else NULL */
    const void *experts;       /* [E, 3I, H] weight dtype, EXPERTS_PACKED (MoE layers) */
    uint64_t expert_stride;    /* bytes between experts = 3*I*H*dtype size */
    /* family options; NULL when the file has none */
    const float *bq, *bk, *bv; /* [Nq], [Nkv], [Nkv] f32 q/k/v biases */
    const float *bo;           /* [H] f32 output-projection bias */
    const float *q_norm;       /* [head_dim] (qk_norm head) or [Nq] (full) f32 */
    const float *k_norm;       /* [head_dim] (qk_norm head) or [Nkv] (full) f32 */
    const void *dense;         /* [1, 3*Id, H] weight dtype, EXPERTS_PACKED: dense-MLP layers */
    const void *shared;        /* [1, 3*Is, H] weight dtype, EXPERTS_PACKED: shared expert */
    const void *shared_gate;   /* [1, H] weight dtype: shared-expert gate */
    /* per-layer options, from the metadata at load */
    int moe;                   /* 1: MoE block (router, experts); 0: dense MLP (`dense`) */
    int64_t window;            /* attention window in tokens, 0 = full */
} cb_layer;

typedef struct cb_weights {
    const void *tok_embd;     /* [V, H] weight dtype */
    const float *out_norm;    /* [H] f32 */
    const void *lm_head;      /* [V, H] weight dtype (= tok_embd when tied) */
    cb_layer *layers;         /* [n_layers], heap (init-time) */
} cb_weights;

/* Every run-time buffer, carved from the arena. B = max_batch, S = max_seq_len,
 * Nq = n_heads*head_dim, Nkv = n_kv_heads*head_dim, R = max_rows (B*top_k + E*(group_pad-1)),
 * Id = dense_inter, Is = shared_inter. */
typedef struct cb_scratch {
    float *x;            /* [B, H] residual stream */
    float *xn;           /* [B, H] normed input of a sub-block */
    float *q;            /* [B, Nq] */
    float *k;            /* [B, Nkv] */
    float *v;            /* [B, Nkv] */
    float *att;          /* [B, Nq] attention output (before o_proj) */
    float *delta;        /* [B, H] sub-block output added to x */
    float *att_scores;   /* [num_threads, S] per (token, head) score row, one per thread */
    float *rope_cos;     /* [B, head_dim/2] */
    float *rope_sin;     /* [B, head_dim/2] */
    float *inv_freq;     /* [head_dim/2] computed at init */
    float *router_logits;/* [B, E] */
    float *router_probs; /* [B, E] */
    int32_t *topk_ids;   /* [B, top_k] */
    float *topk_w;       /* [B, top_k] */
    int64_t *expert_count;  /* [E] tokens routed to each expert in this chunk */
    int64_t *expert_offset; /* [E+1] first row of each expert's (padded) group; [E] = total rows */
    int64_t *expert_fill;   /* [E] fill cursor while building the row map */
    int32_t *row_token;  /* [R] token index in chunk of each grouped row, -1 for padding */
    float *row_weight;   /* [R] routing weight of each grouped row, 0 for padding */
    float *ex_in;        /* [R, H] gathered expert inputs */
    float *ex_h;         /* [R, I] silu(gate)*up */
    float *ex_out;       /* [R, H] expert outputs */
    float *ffn_h;        /* [B, max(Id, Is)] silu(gate)*up of the dense MLP / shared expert */
    float *sh_out;       /* [B, H] shared-expert output */
    float *sh_gate;      /* [B] shared-expert gate logits */
    float *sample_p;     /* [V] sampler probabilities */
    int32_t *sample_idx; /* [V] sampler candidate ids */
    int32_t *run_ids;    /* [B] the token ids of the chunk being run (stage-by-stage runs keep them) */
    float *down_part;    /* [down_part_rows, H] per-block partial sums of few-row down projections */
    int64_t down_part_rows;
    int64_t max_rows;    /* R */
} cb_scratch;

/* The chunk being run, stage by stage: the fused forward and colibri_stage_* share it. */
typedef struct cb_run {
    int64_t T;          /* tokens in the chunk */
    int64_t pos0;       /* position of its first token */
    int32_t stage;      /* next stage (COLIBRI_STAGE_*), -1 when no stage run is active */
    int32_t layer;      /* layer of the next stage, -1 outside the layers */
    int64_t head_rows;  /* LM_HEAD computes logits for the last head_rows tokens (0..T) */
} cb_run;

/* A trace (colibri.h): every buffer carved from `mem`, allocated once at create.
 * C = capacity, L = n_layers, E = n_experts, K = top_k. */
struct colibri_trace {
    int64_t capacity, n_tokens, dropped, n_forwards;
    uint32_t n_layers, n_experts, top_k;
    const colibri_ctx *owner;   /* the context it is attached to, or NULL */
    int64_t chunk_base;         /* token row of the current chunk's first token */
    int32_t *token_ids;         /* [C] */
    int64_t *positions;         /* [C] */
    float *router_probs;        /* [L, C, E] */
    int32_t *topk_ids;          /* [L, C, K] */
    float *topk_w;              /* [L, C, K] */
    float *shared_gate;         /* [L, C] */
    int64_t *group_sizes;       /* [L, E] */
    int64_t *padded_sizes;      /* [L, E] */
    uint64_t *layer_ns;         /* [L, 5] ATTENTION..COMBINE */
    uint64_t stage_ns[COLIBRI_N_STAGES];
    void *mem;
};

typedef struct cb_session {
    float *k_cache;      /* [n_layers, n_kv_heads, S, head_dim]: each head's positions contiguous */
    float *v_cache;      /* the same layout */
    int64_t cached_len;  /* positions 0..cached_len-1 are valid */
} cb_session;

struct colibri_ctx {
    /* file */
    int fd;
    const uint8_t *map;      /* [file_size] read-only mapping */
    uint64_t map_size;
    /* parsed */
    cb_config cfg;
    cb_meta_entry *meta;     /* [n_meta], heap (init-time) */
    uint64_t n_meta;
    cb_tensor *tensors;      /* [n_tensors], heap (init-time) */
    uint64_t n_tensors;
    cb_weights w;
    /* run settings */
    int64_t max_seq_len, max_batch;
    int32_t num_threads, group_pad, populate;
    const cb_kernels *kern;
    cb_pool *pool;           /* num_threads threads (the caller is thread 0), heap (init-time) */
    /* arena */
    void *arena;             /* [arena_bytes], 2 MiB aligned, the one run-time allocation */
    uint64_t arena_bytes;
    cb_scratch s;
    cb_session sess;
    cb_run run;
    colibri_trace *trace;    /* attached trace, or NULL (no tracing work at all) */
    /* tokenizer */
    colibri_tokenizer *tok;  /* cb_tokenizer_struct_size() bytes, heap; NULL when the model has none */
    int tok_loaded;
    /* last error; mutable even through a const ctx (accessors report unknown names) */
    char err[CB_ERR_LEN];
};

/* crc32.c */
uint32_t cb_crc32(uint32_t crc, const void *data, uint64_t n);

/* colibri.c */
void cb_set_err(char *buf, size_t len, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
colibri_status cb_fail(colibri_ctx *ctx, colibri_status st, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* format.c: validate the mapped file and fill cfg, meta, tensors and weights.
 * Caller guarantees ctx->map/map_size are set. Messages go to err. */
colibri_status cb_format_load(colibri_ctx *ctx, const char *path, char *err, size_t err_len);
/* Find a tensor by name (NULL if absent). */
const cb_tensor *cb_find_tensor(const colibri_ctx *ctx, const char *name);
/* Check every section CRC and every tensor CRC. */
colibri_status cb_verify_all(colibri_ctx *ctx);
colibri_status cb_verify_router(colibri_ctx *ctx);

/* model.c */
colibri_status cb_arena_init(colibri_ctx *ctx, char *err, size_t err_len);
colibri_status cb_forward(colibri_ctx *ctx, const int32_t *ids, int64_t n, int64_t start_pos,
                          float *logits, int last_only);
/* Checks shared by colibri_forward_at and colibri_stage_begin (nothing is changed). */
colibri_status cb_check_input(colibri_ctx *ctx, const int32_t *ids, int64_t n, int64_t start_pos);
/* Stage-by-stage execution (colibri_stage_*). */
colibri_status cb_stage_begin(colibri_ctx *ctx, const int32_t *ids, int64_t n, int64_t start_pos);
colibri_status cb_stage_run(colibri_ctx *ctx, int32_t stage, float *logits);
colibri_status cb_stage_tensor(colibri_ctx *ctx, const char *name, const void **data,
                               int32_t *dtype, int32_t *ndim, int64_t shape[4]);

/* overflow-safe helpers */
static inline int cb_mul_u64(uint64_t a, uint64_t b, uint64_t *out) {
    if (a != 0 && b > UINT64_MAX / a) return 0;
    *out = a * b;
    return 1;
}
static inline int cb_add_u64(uint64_t a, uint64_t b, uint64_t *out) {
    if (b > UINT64_MAX - a) return 0;
    *out = a + b;
    return 1;
}

#endif
