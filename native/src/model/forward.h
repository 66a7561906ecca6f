/*
 * forward.h — the forward pass: its run-time buffers (cb_scratch, carved from the one arena
 * at init by scratch.c), the sequence state between calls (cb_session: the KV cache and its
 * length), the chunk being run stage by stage (cb_run), and the entry points that the
 * public API (core/colibri.c, core/trace.c) calls. forward.c orchestrates; the backend
 * (backend/backend.h; the CPU's is backend/cpu/stages.c) runs the stages, on the CPU through the
 * kernel table (cpu/kernels.h) on the context's thread pool (core/threadpool.h).
 */
#ifndef COLIBRI_FORWARD_H
#define COLIBRI_FORWARD_H

#include <stddef.h>
#include <stdint.h>

#include "colibri.h"
#include "model/kv.h"
#include "model/model.h"

/* Groups of at most this many rows split their down projection by blocks of intermediate
 * rows (expert_down_part, then a sum of the parts) rather than by output columns: each
 * chunk then streams whole w2T rows, where a column range of a row is a short strided
 * read; more rows re-use each column panel enough that the column split wins. */
#define CB_SPLIT_MAX_ROWS 5
/* Expert groups handed to one pair of parallel sections (a stack array of this size). */
#define CB_FFN_BATCH 32

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
    float *att_scores;   /* [num_threads, CB_ATT_HEADS, S]: each thread's score rows, one per query head it runs at once */
    uint8_t *att_work;   /* [num_threads, att_work_bytes]: each thread's work area of fast mode's attention
                          * (cpu/fast.h attention_heads), or NULL where the exact kernels' runs */
    size_t att_work_bytes;
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
    /* fast mode's int8 kernels (cpu/fast.h cb_fast_qrows): a matmul's input quantized once
     * for all its chunks [B, x_q_cols] (then the chunk's xn for the experts), xn's rows
     * gathered like ex_in [R, H], and ex_h's rows quantized once [R, I], with their blocks of
     * 32: carved in fast mode (where the int8 kernels run), so that each matrix, expert and
     * chunk reads them instead of quantizing its own */
    int64_t x_q_cols;
    int8_t *x_q, *ex_in_q, *ex_h_q, *ffn_h_q; /* ffn_h_q: ffn_h's rows quantized once [B, F] */
    struct cb_fast_ablk *x_qa, *ex_in_qa, *ex_h_qa, *ffn_h_qa;
    float *ex_h;         /* [R, I] silu(gate)*up */
    float *ex_up;        /* [R, I] the up projection (clamped_swiglu only; else NULL) */
    float *sink_share;   /* [B, Hq] attention sinks' share of the softmax, filled on request
                          * by colibri_stage_tensor("sink_share") (attn_sinks only) */
    float *ex_out;       /* [R, H] expert outputs */
    float *ffn_h;        /* [B, max(Id, Is)] silu(gate)*up of the dense MLP / shared expert */
    float *sh_out;       /* [B, H] shared-expert output */
    float *sh_gate;      /* [B] shared-expert gate logits */
    float *sample_p;     /* [V] sampler probabilities */
    int32_t *sample_idx; /* [V] sampler candidate ids */
    int32_t *run_ids;    /* [B] the token ids of the chunk being run (stage-by-stage runs keep them) */
    int32_t *row_seq;    /* [B] the sequence of each row of the chunk */
    int64_t *row_pos;    /* [B] the position of each row in its sequence */
    int32_t *head_idx;   /* [B] rows whose logits the LM head computes, ascending */
    int64_t *seg_row;    /* [B+1] first row of each attention segment (a run of rows of one
                          * sequence at consecutive positions); seg_row[n_seg] = T */
    int64_t *seq_next;   /* [max_seqs] next position of each sequence while a batch is checked */
    /* DeepSeek (mla.c, route_group.c); NULL/unused in other files */
    float *mla_qa;       /* [B, q_lora_rank] the q LoRA's inner activations */
    float *mla_qlat;     /* [B, n_heads, r+dr] latent queries [q_nope W_UK, RoPE'd q_pe] */
    float *mla_olat;     /* [n_heads, B, r] latent outputs sum_j p_j c_j, head-major */
    float *mla_row;      /* [num_threads, r] a dequantized W_UK row per thread */
    float *route_choice; /* [E] the values a grouped router ranks */
    float *route_group;  /* [E] group scores (n_group <= E) */
    uint8_t *route_skip; /* [2E] expert mask, then a group/in-group mask */
    float *down_part;    /* [down_part_rows, H] per-block partial sums of few-row down projections */
    uint32_t *split_ready; /* [2 * down_part_rows] those blocks' h-ready and sums-ready flags
                            * (backend/cpu/parallel.c cb_cpu_par_ffn; core/threadpool.h cb_pool_await) */
    uint32_t split_stamp;  /* par_ffn's last stamp in split_ready */
    /* the expert predictor (backend/cpu/stages.c predict_next): layer l+1's router on layer l's FFN input */
    float *pred_xn;      /* [B, H] */
    float *pred_logits;  /* [B, E] */
    int32_t *pred_ids;   /* [B, top_k] the experts expected at the next layer, best first */
    float *pred_w;       /* [B, top_k] */
    int64_t down_part_rows;
    int64_t max_rows;    /* R */
    /* colibri_batch_logprobs (logprob.c): the logits of up to lp_rows rows of a chunk, each
     * reduced to its target's log-probability */
    float *lp_logits;    /* [lp_rows, V] */
    int64_t lp_rows;
} cb_scratch;

/* The chunk being run, stage by stage: the fused forward and colibri_stage_* share it. */
typedef struct cb_run {
    int64_t T;          /* tokens (rows) in the chunk */
    int64_t n_seg;      /* attention segments (s->seg_row) */
    int32_t stage;      /* next stage (COLIBRI_STAGE_*), -1 when no stage run is active */
    int32_t layer;      /* layer of the next stage, -1 outside the layers */
    int64_t head_rows;  /* LM_HEAD computes logits for rows s->head_idx[0 .. head_rows) */
    int32_t att_layer;  /* the layer whose ATTENTION stage ran last in this chunk, -1 none */
    int32_t pred_layer; /* the layer s->pred_ids were predicted for, -1 none */
} cb_run;

/* What lasts between calls: the sequences and their paged KV cache (model/kv.h). */
typedef struct cb_session {
    cb_kv kv;
} cb_session;

/* scratch.c: size the arena from the context's options, allocate it once and carve every
 * buffer above from it (and compute the RoPE inverse frequencies). */
colibri_status cb_scratch_init(colibri_ctx *ctx, char *err, size_t err_len);
/* forward.c */
colibri_status cb_forward(colibri_ctx *ctx, const int32_t *ids, int64_t n, int64_t start_pos,
                          float *logits, int last_only);
/* colibri_batch (arguments not yet checked beyond ctx != NULL). */
colibri_status cb_batch(colibri_ctx *ctx, const colibri_batch_entry *entries, int64_t n, float *logits);
/* colibri_batch_logprobs (ctx != NULL): colibri_batch whose entries with logits = 1 give
 * logprobs[j] = log softmax(their logits)[targets[j]] instead of their logits. */
colibri_status cb_batch_logprobs(colibri_ctx *ctx, const colibri_batch_entry *entries, int64_t n,
                                 const int32_t *targets, float *logprobs);
/* logprob.c: out[i] = log softmax(logits[i])[targets[i]] of R rows [R, V] (the rows are
 * overwritten: the softmax is computed in place). */
void cb_logprob_rows(colibri_ctx *ctx, float *logits, int64_t R, const int32_t *targets, float *out);
/* Checks shared by colibri_forward_at and colibri_stage_begin (nothing is changed). */
colibri_status cb_check_input(colibri_ctx *ctx, const int32_t *ids, int64_t n, int64_t start_pos);
/* Stage-by-stage execution (colibri_stage_*). */
colibri_status cb_stage_begin(colibri_ctx *ctx, const int32_t *ids, int64_t n, int64_t start_pos);
colibri_status cb_stage_run(colibri_ctx *ctx, int32_t stage, float *logits);
colibri_status cb_stage_tensor(colibri_ctx *ctx, const char *name, const void **data,
                               int32_t *dtype, int32_t *ndim, int64_t shape[4]);
/* colibri_lens (ctx != NULL). */
colibri_status cb_lens(colibri_ctx *ctx, const float *resid, int64_t n, float *logits);

#endif
