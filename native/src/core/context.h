/*
 * context.h — what a colibri_ctx holds, grouped by lifetime: the mapped file; the parsed
 * model (model/model.h: config, metadata, tensor directory, weight pointers into the map);
 * the run settings and the kernel table; the arena and what is carved from it
 * (model/forward.h: scratch, session, the current chunk); the attached trace; the
 * tokenizer; the last error. Every pointer says its shape; heap allocations happen at
 * init only (colibri_init_ex) and in the intervention setters (core/interv.c), outside any
 * forward, and are freed by colibri_free.
 */
#ifndef COLIBRI_CORE_CONTEXT_H
#define COLIBRI_CORE_CONTEXT_H

#include <stdint.h>

#include "colibri.h"
#include "backend/backend.h"
#include "core/error.h"
#include "core/interv.h"
#include "core/threadpool.h"
#include "cpu/fast.h"
#include "cpu/kernels.h"
#include "format/container.h"
#include "model/expert_cache.h"
#include "model/forward.h"
#include "model/model.h"

struct colibri_ctx {
    /* file */
    int fd;
    const uint8_t *map;      /* [file_size] read-only mapping */
    uint64_t map_size;
    void *panels;            /* the panel copies of the BF16 weights and the interleaved copies of the
                              * int8 ones (backend/cpu/panels.c), or NULL */
    size_t panels_size;      /* the whole anonymous mapping holding them */
    int panels_bf16, panels_int8; /* 1: it holds copies of that kind */
    /* parsed */
    cb_file file;            /* the container read (format/container.h): metadata, tensor directory */
    cb_config cfg;
    cb_weights w;
    /* run settings */
    int64_t max_seq_len, max_batch;
    int32_t num_threads, group_pad, populate;
    int32_t max_seqs, kv_block_tokens;  /* sequences held at once; positions per KV block */
    int64_t kv_tokens;                  /* positions of the KV pool (before rounding to blocks) */
    int32_t prefix_cache;               /* 1: full KV blocks are registered for reuse (model/kv.h) */
    const cb_kernels *kern;
    int32_t precision;       /* COLIBRI_PRECISION_EXACT / _FAST */
    const cb_fast_kernels *fast; /* fast mode's table (cpu/fast.h); NULL in exact mode */
    const cb_panel_kernels *pan; /* the running table's panel kernels (cpu/panel.h), or NULL */
    const cb_qpanel_kernels *qpan; /* fast mode's kernels on interleaved int8 copies (cpu/qpanel.h), or NULL */
    char kernels_desc[96];   /* colibri_get_string "kernels": the table, and in fast mode its fast paths */
    cb_pool *pool;           /* num_threads threads (the caller is thread 0), heap (init-time) */
    cb_ecache *ecache;       /* the expert cache (model/expert_cache.h), or NULL: experts mapped */
    const cb_backend *be;    /* where the stages run (backend/backend.h): &cb_backend_cpu or the CUDA table */
    void *be_state;          /* the backend's own state (NULL for the CPU) */
    char backend_device[160]; /* colibri_get_string "backend_device", from the backend's facts at init */
    /* arena */
    void *arena;             /* [arena_bytes], 2 MiB aligned, the one run-time allocation */
    uint64_t arena_bytes;
    cb_scratch s;
    cb_session sess;
    cb_run run;
    colibri_trace *trace;    /* attached trace, or NULL (no tracing work at all) */
    struct cb_interv *iv;    /* interventions (core/interv.h), heap, set by colibri_iv_*; NULL: none */
    /* tokenizer */
    colibri_tokenizer *tok;  /* cb_tokenizer_struct_size() bytes, heap; NULL when the model has none */
    int tok_loaded;
    char *chat_template;     /* NUL-terminated copy of the metadata's chat template ("" if none), heap */
    /* last error; mutable even through a const ctx (accessors report unknown names) */
    char err[CB_ERR_LEN];
};

#endif
