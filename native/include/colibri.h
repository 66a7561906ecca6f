/*
 * colibri.h — public C API of the Colibri MoE inference engine.
 *
 * The engine memory-maps one `.colibri` file (docs/format.md), carves every buffer it
 * will ever need from one arena at init (some CPU kernel tables also copy the BF16 weights
 * into a panel layout there: docs/kernels.md), and then runs `colibri_forward` with no heap
 * allocation. The library never prints, exits or aborts: every function returns a
 * `colibri_status`, and a context keeps a message saying what went wrong and what to do.
 *
 * Objects are opaque; read them through accessor functions (no struct layouts to copy
 * into other languages). Thread-safety: one context is used by one thread at a time;
 * distinct contexts are independent.
 */
#ifndef COLIBRI_H
#define COLIBRI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define COLIBRI_API __declspec(dllexport)
#else
#define COLIBRI_API __attribute__((visibility("default")))
#endif

/* Bumped whenever a signature or the meaning of an argument changes; bindings check it. */
#define COLIBRI_ABI_VERSION 11
/* The newest .colibri format version this build reads (it reads every older one too, from 1). */
#define COLIBRI_FORMAT_VERSION 2

typedef enum colibri_status {
    COLIBRI_OK = 0,
    COLIBRI_E_INVALID_ARG = 1,   /* a NULL pointer, a negative count, a bad option value */
    COLIBRI_E_IO = 2,            /* open/stat/mmap failed, missing file, a directory */
    COLIBRI_E_FORMAT = 3,        /* not a .colibri file, truncated, bad offsets or sizes */
    COLIBRI_E_VERSION = 4,       /* a format version this build does not read */
    COLIBRI_E_CHECKSUM = 5,      /* a CRC-32 or stored norm does not match */
    COLIBRI_E_UNSUPPORTED = 6,   /* valid file, but a family/dtype/option this build lacks */
    COLIBRI_E_NOMEM = 7,         /* the arena could not be allocated */
    COLIBRI_E_TOKEN_RANGE = 8,   /* a token id < 0 or >= vocab_size */
    COLIBRI_E_SEQ_TOO_LONG = 9,  /* start_pos + n_tokens > max_seq_len */
    COLIBRI_E_BUFFER_TOO_SMALL = 10, /* caller's output buffer too small; *_needed says the size */
    COLIBRI_E_NUMERIC = 11,      /* NaN or Inf in the logits */
    COLIBRI_E_INTERNAL = 12
} colibri_status;

typedef struct colibri_ctx colibri_ctx;
typedef struct colibri_tokenizer colibri_tokenizer;

/* Options for colibri_init_ex. Fill with colibri_options_init, then change fields.
 * `struct_size` lets the library reject a struct from a different ABI. */
typedef struct colibri_options {
    uint32_t struct_size;     /* = sizeof(colibri_options), set by colibri_options_init */
    int32_t num_threads;      /* threads of the forward pass, the caller included; 0: default (physical cores) */
    int64_t max_seq_len;      /* 0: min(file's max_seq_len, 4096); else ≤ file's max_seq_len */
    int64_t max_batch;        /* tokens per internal forward chunk; 0: min(max_seq_len, 512) */
    int32_t populate;         /* pre-fault the whole file at init (MADV_POPULATE_READ): 1 on, 0 off
                               * (pages fault in on first use), COLIBRI_POPULATE_AUTO (-1, the
                               * default): on when the file is under half of MemAvailable */
    int32_t group_pad;        /* pad each expert's token group to a multiple of this (1 = none) */
    int32_t verify_checksums; /* 1: also verify weight-section and per-tensor CRCs at init */
    int32_t max_seqs;         /* sequences held at once, ids 0 .. max_seqs-1 (colibri_batch); 0: 1 */
    int32_t kv_block_tokens;  /* positions per KV-cache block; 0: 32 */
    int64_t kv_tokens;        /* positions in the shared paged KV cache (all sequences together),
                               * rounded up to whole blocks; 0: max_seq_len × max_seqs */
    int32_t precision;        /* COLIBRI_PRECISION_EXACT (0, the default) or COLIBRI_PRECISION_FAST */
    int32_t expert_cache_policy; /* COLIBRI_CACHE_* (with expert_cache_mb > 0); 0: LRU */
    int64_t expert_cache_mb;  /* > 0: routed experts live in this many MiB of cache slots, read from
                               * the file on a miss (models larger than memory; docs/expert_cache.md);
                               * 0 (the default): every expert stays mapped */
    int32_t expert_cache_slots; /* > 0: the cache as this many slots per MoE layer instead (at most
                               * n_experts; not with expert_cache_mb); 0: from expert_cache_mb */
    int32_t backend;          /* COLIBRI_BACKEND_CPU (0, the default) or COLIBRI_BACKEND_CUDA (docs/backends.md) */
    int32_t gpu_device;       /* CUDA: the device ordinal (0) */
    double gpu_memory_fraction; /* CUDA: share of the device's memory the engine may take, (0, 1];
                               * 0: 0.9. The dense weights, activations and KV cache must fit; then
                               * as many routed experts as fit, the rest computed on the CPU */
    int32_t prefix_cache;     /* 1 (the default): full KV blocks stay cached after their sequence lets
                               * them go, for colibri_seq_reuse_prefix; 0: off (blocks are freed at
                               * once and reuse finds nothing). Results are bitwise the same either way */
} colibri_options;

/* Backends (colibri_options.backend; docs/backends.md). CPU: the stages on this machine's
 * cores. CUDA: the stages on an NVIDIA GPU (a build with -DCOLIBRI_CUDA=ON and a device);
 * otherwise colibri_init_ex returns COLIBRI_E_UNSUPPORTED saying which is missing.
 * colibri_get_string(ctx, "backend") / "backend_device" say what runs. */
#define COLIBRI_BACKEND_CPU 0
#define COLIBRI_BACKEND_CUDA 1

/* Expert-cache policies (colibri_options.expert_cache_policy; docs/expert_cache.md). LRU:
 * evict the least recently used expert of the layer. LFU: the least used one (counts halve
 * every 128 steps of the layer; ties: LRU). PINNED: LRU around a pinned set per layer
 * (colibri_expert_cache_pin; none until pinned). PREDICT: LRU, and while layer l runs,
 * layer l+1's router applied to layer l's FFN input picks the experts read ahead for l+1. */
#define COLIBRI_CACHE_LRU 0
#define COLIBRI_CACHE_LFU 1
#define COLIBRI_CACHE_PINNED 2
#define COLIBRI_CACHE_PREDICT 3

/* Numeric modes (docs/kernels.md, "Numeric modes"). EXACT: float32 activations into every
 * matmul (parity with transformers float32). FAST: the activations entering a weight matmul
 * are rounded to bfloat16 for BF16 weights and quantized to int8 blocks of 32 for the block
 * types (Q8_0/Q4_K/Q5_K/Q6_K), with integer (VNNI) or bf16 dot products and float32
 * accumulation; norms, attention, softmax, the router and the residual stay float32.
 * Deterministic and batch-invariant like EXACT; colibri_get_string(ctx, "precision") and
 * "kernels" say which mode and which instructions run. */
#define COLIBRI_PRECISION_EXACT 0
#define COLIBRI_PRECISION_FAST 1

COLIBRI_API int colibri_abi_version(void);
COLIBRI_API const char *colibri_version_string(void);
COLIBRI_API const char *colibri_status_string(colibri_status s);

COLIBRI_API void colibri_options_init(colibri_options *opt);

/* Open `path`, validate it fully (header, sections, metadata, tensor directory, tokenizer),
 * allocate the arena. On failure *out is NULL and the message is in `err` (if non-NULL). */
COLIBRI_API colibri_status colibri_init(const char *path, colibri_ctx **out);
COLIBRI_API colibri_status colibri_init_ex(const char *path, const colibri_options *opt,
                                           colibri_ctx **out, char *err, size_t err_len);
COLIBRI_API void colibri_free(colibri_ctx *ctx);

/* Pin experts ids[0..n) of MoE layer `layer` in the expert cache (replacing the layer's pinned
 * set; n = 0 unpins): read now if not resident, never evicted. n must leave one slot of the
 * layer free (n < colibri_get_int "expert_cache_slots"). COLIBRI_E_UNSUPPORTED without a cache. */
COLIBRI_API colibri_status colibri_expert_cache_pin(colibri_ctx *ctx, int32_t layer, const int32_t *ids,
                                                    int32_t n);

/* The message of the last failed call on this context ("" if none). */
COLIBRI_API const char *colibri_last_error(const colibri_ctx *ctx);

/* Run the model on `n_tokens` ids starting a new sequence (position 0).
 * logits: caller's buffer of n_tokens × vocab_size floats, row t = logits after token t. */
COLIBRI_API colibri_status colibri_forward(colibri_ctx *ctx, const int32_t *input_ids,
                                           int64_t n_tokens, float *logits);
/* Same, continuing a sequence: positions 0..start_pos-1 must already be in the KV cache
 * (start_pos ≤ the current cached length). start_pos 0 starts a new sequence. */
COLIBRI_API colibri_status colibri_forward_at(colibri_ctx *ctx, const int32_t *input_ids,
                                              int64_t n_tokens, int64_t start_pos, float *logits);
/* Same as colibri_forward_at, but only the last token's logits are computed (the LM head
 * runs on one row, as generation needs): logits is a buffer of vocab_size floats. */
COLIBRI_API colibri_status colibri_forward_last(colibri_ctx *ctx, const int32_t *input_ids,
                                                int64_t n_tokens, int64_t start_pos, float *logits);
/* Number of positions currently in the KV cache of sequence 0. */
COLIBRI_API int64_t colibri_cached_len(const colibri_ctx *ctx);

/* ---- Sequences and batches ---------------------------------------------------------
 *
 * A context holds up to max_seqs sequences (ids 0 .. max_seqs-1), each a list of positions
 * in a KV cache of fixed-size blocks shared by all of them: a sequence takes a block when it
 * grows into one and gives its blocks back when it is cleared or truncated, so memory goes
 * to the positions that exist. The single-sequence calls above work on sequence 0.
 *
 * colibri_batch runs one forward over entries of any sequences: decode steps of some and
 * prompt chunks of others together. Attention is per sequence; the router, the grouping
 * and the expert FFN run over all entries at once, so each expert's weights are read once
 * per step for every token routed to it. A sequence's results are bitwise the same
 * whatever else is in the batch, however its prompt is split into calls, and with any
 * thread count. */
typedef struct colibri_batch_entry {
    int32_t token;   /* token id in [0, vocab_size) */
    int32_t seq;     /* sequence id in [0, max_seqs) */
    int64_t pos;     /* its position: the sequence's length for its first entry in the batch,
                      * one more for each later entry of the same sequence (entries of different
                      * sequences may interleave) */
    int32_t logits;  /* 1: compute this entry's logits */
    int32_t reserved; /* 0 */
} colibri_batch_entry;

/* Run `n` entries (in chunks of at most max_batch). logits: a buffer of (number of entries
 * with logits = 1) × vocab_size floats, filled in entry order; may be NULL when no entry
 * asks for logits. Every entry is checked (token and sequence ranges, positions, the room
 * in the sequence and in the KV cache) before anything runs: a refused batch changes
 * nothing. A KV cache without enough free blocks gives COLIBRI_E_NOMEM; a sequence that
 * would pass max_seq_len gives COLIBRI_E_SEQ_TOO_LONG. */
COLIBRI_API colibri_status colibri_batch(colibri_ctx *ctx, const colibri_batch_entry *entries,
                                         int64_t n, float *logits);
/* colibri_batch, but each entry with logits = 1 gives one number instead of its logits row:
 * logprobs[j] = log softmax(logits)[targets[j]], the natural-log probability of token
 * targets[j] (j counts those entries in entry order; e.g. the next token, so that -logprobs
 * is the loss). Computed by the engine from the float32 logits the LM head computes, as
 * (logit[target] - max) - log(sum_i exp(logit[i] - max)) with the kernel table's float32
 * softmax sum (docs/workbench.md, "Readouts"); no logits row leaves the engine. The logit rows
 * go to a buffer of the arena (colibri_get_int "logprob_rows" rows: an internal chunk holds at
 * most that many entries with logits = 1). A sequence's values are bitwise the same whatever
 * else is in the batch and however the calls are split. Checks as colibri_batch, and every
 * target in [0, vocab_size) (COLIBRI_E_TOKEN_RANGE); targets must not be NULL, logprobs
 * only when no entry asks for logits. */
COLIBRI_API colibri_status colibri_batch_logprobs(colibri_ctx *ctx, const colibri_batch_entry *entries, int64_t n,
                                                  const int32_t *targets, float *logprobs);
/* Positions held by sequence `seq` (-1 when seq is out of range). */
COLIBRI_API int64_t colibri_seq_len(const colibri_ctx *ctx, int32_t seq);
/* Forget every position of `seq`; its blocks go back to the cache. */
COLIBRI_API colibri_status colibri_seq_clear(colibri_ctx *ctx, int32_t seq);
/* Keep positions 0 .. len-1 of `seq` (len ≤ its length); whole blocks past them go back. */
COLIBRI_API colibri_status colibri_seq_truncate(colibri_ctx *ctx, int32_t seq, int64_t len);
/* Make `dst` a copy of `src` (dst's own positions are cleared first) that shares src's
 * blocks: no KV data is copied until one of them writes into a shared block, which then
 * gets a private copy (copy-on-write). For parallel sampling of one prompt. */
COLIBRI_API colibri_status colibri_seq_fork(colibri_ctx *ctx, int32_t src, int32_t dst);

/* The prefix cache (colibri_options.prefix_cache, on by default). Every KV block whose
 * positions are all computed is registered under its tokens and everything before them (a
 * chain of block hashes, checked token by token, so a match is exact); when no sequence holds
 * it any more it stays cached, and the least recently used cached block is evicted only when
 * a sequence needs a block and none is free, so cached blocks never make a batch fail.
 *
 * colibri_seq_reuse_prefix continues `seq` with the cached blocks that hold ids[0..n) after
 * its end: the sequence takes them by reference (a later write into one is copy-on-write) and
 * *n_reused (a multiple of kv_block_tokens, at most n - 1, so the last id is always computed)
 * says how many of the ids are now in it; run ids[*n_reused..n) next, at positions from
 * colibri_seq_len. A position's keys and values depend only on the tokens up to it, so every
 * logit after a reuse is bitwise the one a full computation gives. Only a sequence whose
 * length is a whole number of computed blocks can be continued (an empty one always can);
 * otherwise, or with the cache off, *n_reused is 0. Gives COLIBRI_E_SEQ_TOO_LONG when its
 * length + n passes max_seq_len. colibri_get_int "prefix_cache_hit_tokens" and
 * "prefix_cache_query_tokens" count the positions reused and asked for, "kv_blocks_cached"
 * the cached blocks no sequence holds; an attached trace counts "prefix_cached" positions. */
COLIBRI_API colibri_status colibri_seq_reuse_prefix(colibri_ctx *ctx, int32_t seq, const int32_t *ids, int64_t n,
                                                    int64_t *n_reused);

/* Integer and float facts about the loaded model and run settings, by name:
 * ints: "n_layers" "hidden_size" "intermediate_size" "vocab_size" "n_heads" "n_kv_heads"
 *       "head_dim" "n_experts" "top_k" "max_seq_len" (effective) "file_max_seq_len"
 *       "max_batch" "logprob_rows" (colibri_batch_logprobs) "num_threads" (requested) "threads_used" (by the forward) "group_pad" "sliding_window" "bos_id" "eos_id"
 *       "arena_bytes" "file_size" "format_version" "router_int8" "tie_word_embeddings"
 *       "norm_topk_prob" "max_seqs" "kv_block_tokens" "kv_blocks_total" "kv_blocks_used" (held by
 *       sequences) "kv_blocks_cached" (prefix cache, held by none; as good as free) "prefix_cache"
 *       (1 on) "prefix_cache_hit_tokens" "prefix_cache_query_tokens"
 *       "kv_bytes_per_token" (cache bytes per position of a sequence, all layers: keys and
 *       values, or the latent rows of multi-head latent attention)
 * floats: "rope_theta" "rms_norm_eps"
 * Unknown names give COLIBRI_E_INVALID_ARG. */
COLIBRI_API colibri_status colibri_get_int(const colibri_ctx *ctx, const char *name, int64_t *out);
COLIBRI_API colibri_status colibri_get_float(const colibri_ctx *ctx, const char *name, double *out);
/* Per-layer facts: "moe" (1 MoE block, 0 dense MLP), "window" (attention window in
 * tokens, 0 = full), "shared_expert" (1 if the layer has one), "shared_gate" (1 if it is
 * gated). A layer out of range or an unknown name gives COLIBRI_E_INVALID_ARG. */
COLIBRI_API colibri_status colibri_get_layer_int(const colibri_ctx *ctx, int32_t layer, const char *name,
                                                 int64_t *out);
/* "architecture", "name", "weight_dtype", "router_dtype", "kernels" (the kernel table in
 * use: "reference", "avx2" or "avx512", and in fast mode " fast(...)" naming the instructions of
 * its int8 and bf16 paths; docs/kernels.md), "precision" ("exact" or "fast"), "chat_template" (the Jinja source
 * of tokenizer_config.json's chat template, metadata key tokenizer.chat_template; "" when
 * the file has none): a NUL-terminated string owned by the context. */
COLIBRI_API colibri_status colibri_get_string(const colibri_ctx *ctx, const char *name, const char **out);
/* The ids after which a generation ends: the EOS id first (when the file has one), then the
 * file's tokenizer.end_ids (what its checkpoint's generation_config.json or its GGUF names
 * besides EOS, e.g. Qwen's <|im_end|> and <|endoftext|>, gpt-oss's <|return|>, <|call|> and
 * <|endoftext|>), at most COLIBRI_MAX_END_IDS + 1 of them, no id twice. *ids is owned by the
 * context; pass them to colibri_sampler_set_end_ids. */
#define COLIBRI_MAX_END_IDS 64
COLIBRI_API colibri_status colibri_get_end_ids(const colibri_ctx *ctx, const int32_t **ids, int32_t *n);

/* Verify every per-tensor CRC-32 and the weight-section CRCs (reads the whole file). */
COLIBRI_API colibri_status colibri_verify(colibri_ctx *ctx);
/* Recompute each router tensor's L2 norm and compare with the stored one
 * (relative tolerance 1e-5). */
COLIBRI_API colibri_status colibri_verify_router(colibri_ctx *ctx);

/* Sample one token from a row of logits (vocab_size floats). temperature 0 = greedy
 * (lowest id wins ties); top_k 0 = off; top_p 1 = off. *rng is a xorshift64* state,
 * advanced by the call (a zero state is replaced by a fixed non-zero one). Uses scratch
 * from the context's arena: no allocation. */
COLIBRI_API colibri_status colibri_sample(colibri_ctx *ctx, const float *logits, float temperature,
                                          int32_t top_k, float top_p, uint64_t *rng,
                                          int32_t *out_id);

/* ---- Per-sequence sampler: penalties, logit bias, min-p, stop ids, a grammar ---------
 *
 * A colibri_sampler is the sampling state of one sequence (one choice of a request). It is
 * allocated once by colibri_sampler_create (scratch included); colibri_sampler_sample then
 * allocates nothing. Each step, on a copy of the raw logits, in this order:
 *   1. logit_bias: logit[id] += bias (±100 effectively forces / bans a token);
 *   2. repetition_penalty (HF / llama.cpp): over the last repetition_last_n tokens of
 *      prompt + generated (0: all of them), each such token's logit is divided by the
 *      penalty when positive and multiplied by it when negative;
 *   3. presence_penalty and frequency_penalty (OpenAI), over the generated tokens only:
 *      logit[id] -= count[id] * frequency_penalty + (count[id] > 0) * presence_penalty;
 *   4. the grammar's mask: tokens that cannot continue it get -inf; once the grammar is
 *      complete the EOS id and the stop ids are allowed too (and nothing else when the
 *      value cannot go on, e.g. after a closing brace);
 *   5. temperature (0: greedy, the highest logit, lowest id on ties), top-k, top-p, min-p
 *      (keep the candidates whose probability is at least min_p times the largest).
 * Without penalties, bias, min-p and grammar the token is bit for bit colibri_sample's for
 * the same logits and rng state. colibri_sampler_sample accepts the token it returns
 * (counts, repetition window, grammar state advance); colibri_sampler_accept records a token
 * chosen elsewhere (a forced one); colibri_sampler_add_prompt the prompt's tokens. */
typedef struct colibri_sampler colibri_sampler;
/* A grammar compiled for one tokenizer (read-only once made; may be shared by samplers and
 * threads). It must outlive every sampler it is attached to. */
typedef struct colibri_grammar colibri_grammar;

typedef struct colibri_sampling_params {
    uint32_t struct_size;       /* = sizeof(colibri_sampling_params), set by _init */
    float temperature;          /* >= 0; 0 = greedy (default 1) */
    int32_t top_k;              /* >= 0; 0 = off (default) */
    float top_p;                /* (0, 1]; 1 = off (default) */
    float min_p;                /* [0, 1]; 0 = off (default) */
    float presence_penalty;     /* [-2, 2]; 0 = off (default) */
    float frequency_penalty;    /* [-2, 2]; 0 = off (default) */
    float repetition_penalty;   /* > 0; 1 = off (default) */
    int32_t repetition_last_n;  /* >= 0; window of the repetition penalty; 0 = all (default) */
    int32_t ignore_eos;         /* 1: EOS (and every end id) is sampled like any token and does not
                                 * end the sequence (vLLM's meaning), except when it ends a complete
                                 * grammar */
} colibri_sampling_params;

/* Why colibri_sampler_finished says the sequence ends after the last sampled token. */
#define COLIBRI_FINISH_NONE 0
#define COLIBRI_FINISH_EOS 1      /* the token was the EOS id or an end id (ignore_eos off, or it ended a
                                   * complete grammar) */
#define COLIBRI_FINISH_STOP_ID 2  /* the token was one of the stop ids */
#define COLIBRI_FINISH_GRAMMAR 3  /* the grammar is complete and there is no EOS or stop id to end it */

COLIBRI_API void colibri_sampling_params_init(colibri_sampling_params *p);
/* A sampler for a vocabulary of n_vocab logits; eos_id -1 if none. Validates the params
 * (COLIBRI_E_INVALID_ARG with a message in err naming the field and its range). */
COLIBRI_API colibri_status colibri_sampler_create(int32_t n_vocab, int32_t eos_id,
                                                  const colibri_sampling_params *p,
                                                  colibri_sampler **out, char *err, size_t err_len);
COLIBRI_API void colibri_sampler_free(colibri_sampler *s); /* NULL: no-op */
COLIBRI_API const char *colibri_sampler_last_error(const colibri_sampler *s);
/* Replace the logit bias: n pairs (ids[i], bias[i]); ids in range, biases finite. */
COLIBRI_API colibri_status colibri_sampler_set_logit_bias(colibri_sampler *s, const int32_t *ids,
                                                          const float *bias, int32_t n);
/* Replace the stop ids (the sequence ends when one is sampled; allowed to end a grammar). */
COLIBRI_API colibri_status colibri_sampler_set_stop_ids(colibri_sampler *s, const int32_t *ids, int32_t n);
/* Replace the end ids: ids that end the sequence as EOS does (COLIBRI_FINISH_EOS; ignore_eos
 * samples them like any token; a complete grammar may end with them), besides the eos_id given
 * to colibri_sampler_create, which stays one (colibri_get_end_ids lists a model's). */
COLIBRI_API colibri_status colibri_sampler_set_end_ids(colibri_sampler *s, const int32_t *ids, int32_t n);
/* Attach a grammar (NULL detaches); its state starts at the beginning of the grammar. The
 * grammar's vocabulary must be n_vocab or smaller (ids past it are masked). */
COLIBRI_API colibri_status colibri_sampler_set_grammar(colibri_sampler *s, const colibri_grammar *g);
/* The prompt's tokens (for the repetition penalty's window; not counted as generated). */
COLIBRI_API colibri_status colibri_sampler_add_prompt(colibri_sampler *s, const int32_t *ids, int64_t n);
/* Record a token as generated (counts, window, grammar). A token the grammar cannot take
 * gives COLIBRI_E_INVALID_ARG and leaves the state as it was. */
COLIBRI_API colibri_status colibri_sampler_accept(colibri_sampler *s, int32_t id);
/* Choose the next token from a row of n_vocab logits (steps 1-5 above) and accept it. *rng
 * is colibri_sample's xorshift64* state. COLIBRI_E_NUMERIC for a NaN logit;
 * COLIBRI_E_INVALID_ARG when the mask leaves no token (e.g. a grammar that cannot go on). */
COLIBRI_API colibri_status colibri_sampler_sample(colibri_sampler *s, const float *logits,
                                                  uint64_t *rng, int32_t *out_id);
/* COLIBRI_FINISH_* for the last accepted token. */
COLIBRI_API int32_t colibri_sampler_finished(const colibri_sampler *s);
/* 1 when an attached grammar has matched completely (its value and suffix), else 0. */
COLIBRI_API int32_t colibri_sampler_grammar_complete(const colibri_sampler *s);
/* The allowed-token mask of the current grammar state: out[id] = 1 allowed, 0 not, for
 * n_vocab ids (the grammar part of step 4 only). For tests and tools. */
COLIBRI_API colibri_status colibri_sampler_grammar_mask(colibri_sampler *s, uint8_t *out);

/* Compile a grammar for `tok`'s tokens: the output must be `prefix` (literal text; NULL =
 * ""), then one JSON value, then `suffix` (literal; NULL = ""). json_schema is a JSON schema
 * (text, UTF-8) or NULL for any JSON object. JSON is generated compact: no whitespace
 * outside strings. Supported: type (string, number, integer, boolean, null, object, array,
 * or a list of them), properties / required / additionalProperties (objects with
 * properties are closed; properties come in the schema's order, optional ones may be
 * left out), items / minItems / maxItems, enum, const, minLength / maxLength,
 * minimum / maximum / exclusiveMinimum / exclusiveMaximum, anyOf, oneOf (as anyOf), allOf
 * with one member, $ref to #/$defs/... or #/definitions/... (recursion allowed), and the
 * annotations title, description, default, examples, $schema, $id, $comment, format,
 * strict, name. Any other keyword gives COLIBRI_E_UNSUPPORTED with
 * "unsupported schema keyword: NAME" in err; a malformed schema COLIBRI_E_INVALID_ARG.
 * Special tokens are allowed only inside prefix and suffix, where their text matches. */
COLIBRI_API colibri_status colibri_grammar_compile(colibri_tokenizer *tok, const char *json_schema,
                                                   const char *prefix, const char *suffix,
                                                   colibri_grammar **out, char *err, size_t err_len);
COLIBRI_API void colibri_grammar_free(colibri_grammar *g); /* NULL: no-op */

/* ---- Observation: tracing and stage-by-stage execution ------------------------------
 *
 * The stages of one forward, in order: EMBEDDING, then for each layer ATTENTION (norm,
 * q/k/v, RoPE, attention over the KV cache, output projection, residual, then the FFN
 * norm), ROUTER (router matmul, softmax, top-k), GROUPING (counting sort of the (token,
 * slot) pairs by expert, padding, gather), EXPERT_FFN (the routed groups, the shared
 * expert and its gate; a dense layer's MLP), COMBINE (weighted scatter-add, residual),
 * and last LM_HEAD (final norm, logits). In a dense layer ROUTER and GROUPING do nothing. */
typedef enum colibri_stage {
    COLIBRI_STAGE_EMBEDDING = 0,
    COLIBRI_STAGE_ATTENTION = 1,
    COLIBRI_STAGE_ROUTER = 2,
    COLIBRI_STAGE_GROUPING = 3,
    COLIBRI_STAGE_EXPERT_FFN = 4,
    COLIBRI_STAGE_COMBINE = 5,
    COLIBRI_STAGE_LM_HEAD = 6,
    COLIBRI_N_STAGES = 7
} colibri_stage;

/* Element types, one name space for all of them: the dtypes of the tensors in a .colibri
 * file (F32, F16, BF16, I8 — the values are the file's dtype codes, docs/format.md) and the
 * element types of the arrays handed out by colibri_trace_array / colibri_stage_tensor
 * (F32, I32, I64, U64). I32, I64 and U64 are never file tensor types. */
typedef enum colibri_dtype {
    COLIBRI_DTYPE_F32 = 0,
    COLIBRI_DTYPE_F16 = 1,
    COLIBRI_DTYPE_BF16 = 2,
    COLIBRI_DTYPE_I8 = 3,
    COLIBRI_DTYPE_I32 = 4,
    COLIBRI_DTYPE_I64 = 5,
    COLIBRI_DTYPE_U64 = 6,
    /* block-quantized weight types, byte for byte ggml's blocks (docs/format.md, "Version
     * 2"): file tensor types only */
    COLIBRI_DTYPE_Q8_0 = 7,
    COLIBRI_DTYPE_Q4_K = 8,
    COLIBRI_DTYPE_Q5_K = 9,
    COLIBRI_DTYPE_Q6_K = 10,
    /* OCP MXFP4: blocks of 32 e2m1 values sharing one e8m0 scale byte, ggml's block_mxfp4
     * (17 bytes: the scale byte e, then 16 bytes of nibbles; docs/format.md) */
    COLIBRI_DTYPE_MXFP4 = 11,
    /* ggml's legacy blocks of 32 (f16 d [, f16 m] [, 32 high bits] then 16 bytes of nibbles):
     * Q4_0 d * (q - 8) (18 bytes), Q4_1 d * q + m (20), Q5_0 d * (q - 16) (22), Q5_1
     * d * q + m (24) */
    COLIBRI_DTYPE_Q4_0 = 12,
    COLIBRI_DTYPE_Q4_1 = 13,
    COLIBRI_DTYPE_Q5_0 = 14,
    COLIBRI_DTYPE_Q5_1 = 15,
    /* ggml's Q2_K (84 bytes) and Q3_K (110 bytes) super-blocks of 256, sub-blocks of 16 */
    COLIBRI_DTYPE_Q2_K = 16,
    COLIBRI_DTYPE_Q3_K = 17,
    /* ggml's non-linear 4-bit blocks (the kvalues_iq4nl table times a scale): IQ4_NL blocks
     * of 32 (18 bytes), IQ4_XS super-blocks of 256 with 6-bit sub-block scales (136 bytes) */
    COLIBRI_DTYPE_IQ4_NL = 18,
    COLIBRI_DTYPE_IQ4_XS = 19,
    /* ggml's grid ("i-quant") super-blocks of 256, read only: each 8 (IQ3: 4) weights the
     * index of an entry of a fixed codebook (ggml's grid), with signs and scales. A file
     * holding one carries its codebook (colibri_install_codebook). Bytes per block: IQ2_XXS
     * 66, IQ2_XS 74, IQ2_S 82, IQ3_XXS 98, IQ3_S 110, IQ1_S 50, IQ1_M 56. */
    COLIBRI_DTYPE_IQ2_XXS = 20,
    COLIBRI_DTYPE_IQ2_XS = 21,
    COLIBRI_DTYPE_IQ2_S = 22,
    COLIBRI_DTYPE_IQ3_XXS = 23,
    COLIBRI_DTYPE_IQ3_S = 24,
    COLIBRI_DTYPE_IQ1_S = 25,
    COLIBRI_DTYPE_IQ1_M = 26
} colibri_dtype;

/* Dequantize (or widen) n elements of a weight row of dtype dt (F32, F16, BF16 or a block
 * type) from src into dst, as the engine's reference kernels see them, bit for bit the `gguf`
 * package's gguf.quants.dequantize. n must be a whole number of the dtype's blocks (32 for
 * Q8_0, MXFP4, Q4_0, Q4_1, Q5_0, Q5_1 and IQ4_NL, 256 for the K types and IQ4_XS). Returns
 * COLIBRI_E_INVALID_ARG (and writes nothing) otherwise or for another dtype.
 * MXFP4 gives ggml's dequantize_row_mxfp4 bits: element j of a block is
 * (float)k2[code] * 2^(e - 128) with k2 = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, ..., -12} (the
 * e2m1 values doubled, so the product is e2m1 * 2^(e - 127)); code 8 (-0) gives +0, and
 * e = 255 (NaN in OCP) is read as the scale 2^127, as ggml reads it. */
COLIBRI_API colibri_status colibri_dequantize(int dt, const void *src, int64_t n, float *dst);

/* The codebook of a grid type (IQ2_XXS ... IQ1_M; IQ1_M shares IQ1_S's): ggml's grid, its
 * entries' values as bytes (int8 for the IQ1 types: -1, 0, 1), `bytes` long (IQ2_XXS 256 x 8,
 * IQ2_XS 512 x 8, IQ2_S 1024 x 8, IQ3_XXS 256 x 4, IQ3_S 512 x 4, IQ1_S 2048 x 8). The engine
 * installs a file's own when it opens it; a caller dequantizing blocks without a model
 * installs it here first (the `gguf` package's grids: colibri_lab does). Refused
 * (COLIBRI_E_FORMAT, nothing installed) when its size or its CRC-32 is not ggml's grid's, or
 * when the process installed another before; COLIBRI_E_INVALID_ARG for a dtype without one.
 * Process-wide and thread-safe. Until a type's codebook is installed colibri_dequantize
 * refuses that type (COLIBRI_E_UNSUPPORTED). */
COLIBRI_API colibri_status colibri_install_codebook(int dt, const void *data, int64_t bytes);

/* The sum of the squares of the n values colibri_dequantize gives for src, accumulated in
 * double (element j into the j % 8th of eight sums, then those added pairwise): the square of
 * the L2 norm a converter stores for a tensor, without its values in memory. The same
 * arguments and refusals as colibri_dequantize; *sumsq is written only on COLIBRI_OK. */
COLIBRI_API colibri_status colibri_dequantize_sumsq(int dt, const void *src, int64_t n, double *sumsq);

/* colibri_options.populate's default: pre-fault the file when it is under half of the memory
 * available (MemAvailable in /proc/meminfo), else fault it in on demand. */
#define COLIBRI_POPULATE_AUTO (-1)

/* Streaming-READ memory bandwidth of this machine, in GB/s (1e9 bytes read per second), on
 * num_threads threads (0: one per physical core, the engine's default), as STREAM or
 * likwid-bench `load` measure it: a buffer of `bytes` (>= 1 MiB; choose several times the
 * last-level cache) is allocated 2 MiB-aligned, touched, read once untimed, then read `reps`
 * times, each thread streaming one contiguous slice with vector loads. *gb_per_s is the best
 * repetition; samples (NULL, or `reps` doubles) receives every one, in order. flags: 0 for
 * plain loads with the widest SIMD the CPU has, or any of COLIBRI_MEMBW_NT_PREFETCH
 * (prefetchnta ahead of the loads) and COLIBRI_MEMBW_NT_LOAD ((V)MOVNTDQA loads), capped by
 * COLIBRI_MEMBW_AVX2 or COLIBRI_MEMBW_PORTABLE (a plain C loop; no non-temporal variants).
 * This call allocates and frees its buffer and threads (it is a measurement, not the forward
 * pass). Returns COLIBRI_E_INVALID_ARG (bad arguments), COLIBRI_E_UNSUPPORTED (flags this
 * CPU cannot run) or COLIBRI_E_NOMEM, with a message in err[err_len] (NULL/0: none). */
#define COLIBRI_MEMBW_NT_PREFETCH 1
#define COLIBRI_MEMBW_NT_LOAD 2
#define COLIBRI_MEMBW_PORTABLE 4
#define COLIBRI_MEMBW_AVX2 8
COLIBRI_API colibri_status colibri_read_bandwidth(int32_t num_threads, int64_t bytes, int32_t reps,
                                                  int32_t flags, double *gb_per_s, double *samples,
                                                  char *err, size_t err_len);

/* A trace: buffers, owned by the trace and allocated once by colibri_trace_create, that
 * the forward pass fills while the trace is attached to a context. Off by default; a
 * context without a trace does no tracing work. Per traced token (appended in the order
 * the engine sees them, across forwards, up to `capacity`; later tokens are counted as
 * dropped) and per layer it records the router probabilities, the top-k ids and weights
 * and the shared-expert gate; per layer the group sizes per expert before and after
 * padding; per layer and stage the time in nanoseconds (CLOCK_MONOTONIC). */
typedef struct colibri_trace colibri_trace;

/* A trace sized for `ctx`'s model and up to `capacity` tokens (> 0). */
COLIBRI_API colibri_status colibri_trace_create(const colibri_ctx *ctx, int64_t capacity,
                                                colibri_trace **out, char *err, size_t err_len);
/* Frees a trace; detach it first (or free its context first). NULL is a no-op. */
COLIBRI_API void colibri_trace_free(colibri_trace *tr);
/* Attach `tr` to `ctx` (NULL detaches). A trace made for another model shape is refused.
 * One trace per context; a trace may be attached to one context at a time. */
COLIBRI_API colibri_status colibri_trace_attach(colibri_ctx *ctx, colibri_trace *tr);
/* Forget everything recorded (sizes stay). */
COLIBRI_API void colibri_trace_reset(colibri_trace *tr);
/* "tokens" (recorded), "dropped" (seen past capacity), "capacity", "forwards",
 * "n_layers", "n_experts", "top_k", "prefix_cached" (positions colibri_seq_reuse_prefix took
 * from the prefix cache instead of computing them: never traced as tokens). Unknown names give COLIBRI_E_INVALID_ARG. */
COLIBRI_API colibri_status colibri_trace_get_int(const colibri_trace *tr, const char *name,
                                                 int64_t *out);
/* A trace buffer by name (C = capacity, L layers, E experts, K = top_k):
 *   "token_ids" I32 [C]  "seq_ids" I32 [C]  "positions" I64 [C]  "router_probs" F32 [L, C, E] (NaN in dense layers)
 *   "topk_ids" I32 [L, C, K] (-1 in dense layers)  "topk_weights" F32 [L, C, K]
 *   "shared_gate" F32 [L, C] (sigmoid(g . x); 1 for an ungated shared expert; NaN: none)
 *   "routing_margins" F32 [L, C, 2]: the k-th minus the (k+1)-th largest router logit (after
 *   interventions) and router probability of each token (NaN in dense layers and when
 *   top_k = n_experts): how close the token was to being routed otherwise
 *   "group_sizes" I64 [L, E]  "padded_group_sizes" I64 [L, E]  (summed over chunks)
 *   "layer_ns" U64 [L, 5] (ATTENTION..COMBINE)  "stage_ns" U64 [7] (every stage, all layers)
 *   "predicted_ids" I32 [L, C, K]: the expert predictor's top-k for each MoE layer l >= 1 (layer
 *   l's router applied to layer l-1's FFN input; -1 for layer 0 and dense layers), recorded
 *   while traced whatever the cache
 *   "cache_stats" I64 [L, 5]: the expert cache's hits, misses, prefetches, prefetch hits and
 *   wasted prefetches per layer while attached (zeros without a cache)
 * Only the first "tokens" entries along a C axis are valid. The pointer stays valid until
 * colibri_trace_free. */
COLIBRI_API colibri_status colibri_trace_array(const colibri_trace *tr, const char *name,
                                               const void **data, int32_t *dtype, int32_t *ndim,
                                               int64_t shape[4]);

/* Stage-by-stage execution of one chunk of n ≤ max_batch tokens at start_pos (the same
 * checks as colibri_forward_at), on sequence 0. Nothing runs until colibri_stage_run.
 * Positions from start_pos on are overwritten: sequence 0 holds start_pos + n positions from
 * the begin on (each layer's are filled by its ATTENTION stage). colibri_forward,
 * colibri_batch, a colibri_seq_* call or a new begin abandons an unfinished stage run. */
COLIBRI_API colibri_status colibri_stage_begin(colibri_ctx *ctx, const int32_t *input_ids,
                                               int64_t n_tokens, int64_t start_pos);
/* The stage that runs next and its layer (-1 outside the layers); *stage = -1 when no stage
 * run is active or the last one finished. */
COLIBRI_API colibri_status colibri_stage_next(const colibri_ctx *ctx, int32_t *stage,
                                              int32_t *layer);
/* Run `stage`, which must be the next one. logits: n_tokens × vocab floats for LM_HEAD,
 * otherwise ignored (may be NULL). Running every stage in order computes exactly what
 * colibri_forward_at computes. */
COLIBRI_API colibri_status colibri_stage_run(colibri_ctx *ctx, int32_t stage, float *logits);
/* An intermediate tensor of the current stage run, by name, pointing into the context's
 * arena (valid until the next stage or forward): "x" [T, H] (residual stream), "xn" [T, H]
 * (normed input of the sub-block), "q" [T, Hq*D], "k", "v" [T, Hkv*D] (after RoPE), "att"
 * [T, Hq*D] (attention output before o_proj), "delta" [T, H] (sub-block output),
 * "router_logits", "router_probs" [T, E], "topk_ids" I32 [T, K], "topk_weights" [T, K],
 * "expert_count" I64 [E], "expert_offset" I64 [E+1], "row_token" I32 [rows] (-1 padding),
 * "row_weight" [rows], "ex_in" [rows, H], "ex_h" [rows, I], "ex_out" [rows, H],
 * "shared_out" [T, H], "shared_gate" [T] (sigmoid values), "ffn_h" [T, Id or Is],
 * "sink_share" [T, Hq] (models with attention sinks: each query head's sink share of its
 * softmax at the layer whose attention ran last, recomputed when asked; NaN before any).
 * rows = expert_offset[E] of the current layer. Multi-head latent attention (model.attention
 * "mla"): "q" [T, Hq*(dn+dr)] (q_pe before RoPE), "k" [T, r+dr] (the cached latent rows,
 * normed and RoPE'd), "v" [T, 0], "att" [T, Hq*dv]; "router_probs" holds the sigmoid scores of
 * a sigmoid_topk router, and the softmax over all experts of a topk_softmax router
 * (observation only; its weights are "topk_weights"). */
COLIBRI_API colibri_status colibri_stage_tensor(colibri_ctx *ctx, const char *name,
                                                const void **data, int32_t *dtype,
                                                int32_t *ndim, int64_t shape[4]);
/* The same tensor's address on the backend's device (a CUDA backend's device pointer, for
 * cupy's zero-copy arrays), valid until the next stage or forward; dtype and shape are
 * colibri_stage_tensor's. COLIBRI_E_UNSUPPORTED for a backend that keeps its stage tensors
 * on the host (the CPU: use colibri_stage_tensor) or one that has none of that name. */
COLIBRI_API colibri_status colibri_stage_tensor_device(colibri_ctx *ctx, const char *name, const void **data);

/* ---- Interventions: change what the forward computes, for experiments ----------------
 *
 * Set on a context for every sequence (seq = COLIBRI_IV_ALL_SEQS) or for one sequence; a
 * sequence with settings of its own uses those and not the context-wide ones. They apply
 * in colibri_forward*, colibri_batch (each row by its own sequence, so a sequence's results
 * stay independent of what else is batched with it) and stage runs, until cleared. The
 * setters take the memory they need (outside any forward: the forward allocates nothing);
 * with none set the forward does what it does without this API, bit for bit. The KV
 * positions a sequence computes under interventions are never offered to the prefix cache.
 * Only the CPU backend applies them: on another the setters return COLIBRI_E_UNSUPPORTED.
 *
 * Expert masks, per MoE layer and expert, in one of two meanings:
 *   COLIBRI_MASK_EXCLUDE: the router may not choose the expert: its router logit is -inf
 *     before the top-k (and, for a sigmoid router, its choice value too: masks apply before
 *     the group selection), then the family's own weights and renormalisation; at least
 *     top_k experts of a layer must stay choosable.
 *   COLIBRI_MASK_ZERO: the router chooses as usual (the weights keep their values and their
 *     renormalisation), but the expert's output is zeroed for the tokens that chose it.
 * Router bias: an additive bias per expert on a MoE layer's router logits (after the
 * model's own logit bias, before the softmax / sigmoid / top-k).
 * Forced routing: at (layer, pos) (pos: the position in the sequence) use exactly these
 * top_k distinct expert ids and weights instead of the router's choice (the router still
 * runs and is traced; the trace's topk_ids / topk_weights show the forced ones).
 * Activation patches, per (point, layer, pos) and for EXPERT_OUT an expert id:
 *   COLIBRI_POINT_RESID: the residual stream entering layer `layer` (layer = n_layers: the
 *     residual entering the final norm and LM head), [hidden];
 *   COLIBRI_POINT_ATTN_OUT: layer `layer`'s attention output after the output projection,
 *     before it is added to the residual, [hidden];
 *   COLIBRI_POINT_EXPERT_OUT: expert `expert`'s output for the token (before its routing
 *     weight), applied when the token chose that expert, [hidden];
 *   COLIBRI_POINT_SHARED_OUT: the shared expert's output of MoE layer `layer` as it is added
 *     to the routed sum (Qwen2-MoE: after its sigmoid gate, sigmoid(g . x) * shared(x);
 *     DeepSeek: the shared experts' output), [hidden]; a layer without one is refused;
 * in mode COLIBRI_PATCH_RECORD (the value is copied into vec, the caller's hidden floats,
 * which must stay valid until the patch is cleared; the last forward that saw that position
 * wins), COLIBRI_PATCH_REPLACE (the value becomes vec) or COLIBRI_PATCH_ADD (vec is added:
 * steering); REPLACE and ADD copy vec at the call. Setters check everything and change
 * nothing when they refuse. */
#define COLIBRI_IV_ALL_SEQS (-1)
#define COLIBRI_MASK_EXCLUDE 1
#define COLIBRI_MASK_ZERO 2
#define COLIBRI_POINT_RESID 0
#define COLIBRI_POINT_ATTN_OUT 1
#define COLIBRI_POINT_EXPERT_OUT 2
#define COLIBRI_POINT_SHARED_OUT 3
#define COLIBRI_PATCH_RECORD 0
#define COLIBRI_PATCH_REPLACE 1
#define COLIBRI_PATCH_ADD 2
/* Mask experts[0..n) of MoE layer `layer` with mode COLIBRI_MASK_EXCLUDE or _ZERO (an
 * expert masked again takes the new mode). */
COLIBRI_API colibri_status colibri_iv_mask(colibri_ctx *ctx, int32_t seq, int32_t layer, const int32_t *experts,
                                           int32_t n, int32_t mode);
/* bias: n_experts floats added to MoE layer `layer`'s router logits (replaces an earlier bias). */
COLIBRI_API colibri_status colibri_iv_router_bias(colibri_ctx *ctx, int32_t seq, int32_t layer, const float *bias);
/* Force the routing of position pos at MoE layer `layer`: k = top_k distinct ids and their
 * weights (finite); replaces an earlier forcing of the same (layer, pos). */
COLIBRI_API colibri_status colibri_iv_force(colibri_ctx *ctx, int32_t seq, int32_t layer, int64_t pos,
                                            const int32_t *ids, const float *weights, int32_t k);
/* An activation patch (see above); expert is ignored (pass -1) but for EXPERT_OUT. */
COLIBRI_API colibri_status colibri_iv_patch(colibri_ctx *ctx, int32_t seq, int32_t point, int32_t layer,
                                            int32_t expert, int64_t pos, int32_t mode, float *vec);
/* Forget the settings of one sequence, or with COLIBRI_IV_ALL_SEQS every setting. */
COLIBRI_API colibri_status colibri_iv_clear(colibri_ctx *ctx, int32_t seq);
/* Final norm and LM head on n caller rows of the residual (resid [n, hidden], as recorded at
 * COLIBRI_POINT_RESID): logits [n, vocab] (the logit lens). Uses the context's kernels and
 * scratch (n <= max_batch; not during a stage run). */
COLIBRI_API colibri_status colibri_lens(colibri_ctx *ctx, const float *resid, int64_t n, float *logits);
/* The unembedding direction of a token: out [hidden] = final-norm weight * LM-head row of
 * `token` (as the engine reads it), so that the token's logit is out . x / rms(x) for a final
 * residual x (direct logit attribution). */
COLIBRI_API colibri_status colibri_unembedding(colibri_ctx *ctx, int32_t token, float *out);

/* ---- Tokenizer, usable with or without an engine: SentencePiece-BPE (tokenizer section
 * type 1) or byte-level BPE from a Hugging Face tokenizer.json (type 2, GPT-2 / Qwen2 /
 * Llama-3 style); docs/format.md, "Tokenizer section encoding" ---- */

/* The tokenizer of a context (owned by it; valid until colibri_free). */
COLIBRI_API colibri_tokenizer *colibri_get_tokenizer(colibri_ctx *ctx);
/* A tokenizer over the bytes of a tokenizer section (docs/format.md). `data` must stay
 * valid while the tokenizer lives; it is not copied. */
COLIBRI_API colibri_status colibri_tokenizer_from_memory(const void *data, uint64_t size,
                                                         colibri_tokenizer **out, char *err,
                                                         size_t err_len);
COLIBRI_API void colibri_tokenizer_free(colibri_tokenizer *tok); /* no-op for a context's own */
COLIBRI_API const char *colibri_tokenizer_last_error(const colibri_tokenizer *tok);
COLIBRI_API int32_t colibri_tokenizer_vocab_size(const colibri_tokenizer *tok);
COLIBRI_API int32_t colibri_tokenizer_bos_id(const colibri_tokenizer *tok); /* -1 if none */
COLIBRI_API int32_t colibri_tokenizer_eos_id(const colibri_tokenizer *tok); /* -1 if none */

/* Encode `len` bytes of UTF-8. SentencePiece: as sentencepiece does (each malformed byte is
 * first replaced by U+FFFD, so invalid input does not round-trip; characters missing from
 * the vocabulary go through byte fallback). Byte-level BPE: as `tokenizers`'
 * encode(text, add_special_tokens=False) (added / special tokens in the text are matched
 * first; each maximal malformed UTF-8 subpart is first replaced by U+FFFD).
 * add_bos = 1 prepends the BOS id; it is a no-op for a tokenizer without BOS (bos_id -1).
 * Writes at most `cap` ids; *n_out is the full count.
 * If *n_out > cap the status is COLIBRI_E_BUFFER_TOO_SMALL and the call can be repeated. */
COLIBRI_API colibri_status colibri_tokenize(colibri_tokenizer *tok, const char *text, uint64_t len,
                                            int add_bos, int32_t *out, int64_t cap, int64_t *n_out);
/* Decode ids to UTF-8 text. SentencePiece: as sentencepiece does (control ids produce
 * nothing, the leading space of the first piece is dropped, byte pieces are joined and
 * invalid UTF-8 becomes U+FFFD). Byte-level BPE: as `tokenizers`' decode(ids,
 * skip_special_tokens=True) with the ByteLevel decoder (special tokens produce nothing,
 * token bytes are joined, each maximal malformed UTF-8 subpart becomes U+FFFD).
 * Writes at most `cap` bytes (no NUL); *len_out is the full length. */
COLIBRI_API colibri_status colibri_detokenize(colibri_tokenizer *tok, const int32_t *ids, int64_t n,
                                              char *out, uint64_t cap, uint64_t *len_out);
/* The raw piece of one id (e.g. "▁Hello", "<0x0A>", "<s>"; byte-level BPE: the
 * tokenizer.json string, e.g. "Ġhello", "<|im_end|>"), not NUL-terminated. */
COLIBRI_API colibri_status colibri_token_piece(colibri_tokenizer *tok, int32_t id,
                                               const char **piece, uint64_t *len);

#ifdef __cplusplus
}
#endif
#endif /* COLIBRI_H */
