/*
 * backend.h — a backend: where the seven stages of a forward chunk run and where their
 * memory lives. The orchestration (model/forward.c: checks, chunking, the batch and stage
 * APIs, tracing) is the same for every backend; it calls the stages of ctx->be, one
 * described thing per device:
 *
 *   - the CPU backend (backend/cpu/, its stages in stages.c): the stages over the host arena and the mapped
 *     weights, through the kernel tables (cpu/kernels.h, cpu/fast.h) on the thread pool;
 *   - the CUDA backend (backend/cuda/, built with -DCOLIBRI_CUDA=ON): weights uploaded
 *     once, device memory taken once by a plan (backend/plan.h), one stream, decode steps
 *     replayed from CUDA graphs.
 *
 * Every stage works on the chunk in ctx->run (T rows: token s->run_ids[t] of sequence
 * s->row_seq[t] at position s->row_pos[t]; the attention segments s->seg_row; the LM head's
 * rows s->head_idx) and leaves its outputs in the backend's own copy of the scratch
 * (model/forward.h, cb_scratch). A backend whose memory is not the host's copies a stage's
 * outputs into the host scratch only when asked (to_host: a trace is attached or a stage
 * run is active), so colibri_stage_tensor and the trace read host memory for every backend.
 */
#ifndef COLIBRI_BACKEND_H
#define COLIBRI_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "colibri.h"

/* What a backend says of itself (colibri_get_string "backend" / "backend_device",
 * colibri_get_int "backend_*"). */
typedef struct cb_backend_facts {
    char device[160];           /* "cpu: avx512 (2 threads)", "NVIDIA H200 (sm_90, 139.8 GiB)" */
    uint64_t device_bytes;      /* memory the backend took on its device (0: the host arena only) */
    uint64_t weight_bytes;      /* weight bytes resident on the device (0 for the CPU: mapped) */
    int64_t experts_resident;   /* routed experts resident on the device, all MoE layers */
    int64_t experts_host;       /* routed experts computed by the CPU (a memory fraction) */
    int64_t graphs_captured;    /* CUDA graphs captured / replayed so far (0 without graphs) */
    int64_t graph_replays;
} cb_backend_facts;

/* The backend's requested settings (colibri_options.backend, .gpu_memory_fraction, .gpu_device). */
typedef struct cb_backend_request {
    double memory_fraction;     /* (0, 1]: share of the device's memory the plan may take */
    int32_t device;             /* device ordinal */
} cb_backend_request;

struct colibri_ctx;

typedef struct cb_backend {
    const char *name;           /* "cpu", "cuda" */
    /* After the arena is carved (cb_scratch_init), the thread pool started and the panel
     * copies made: make the memory plan, take the device's memory and upload what it keeps
     * there (the state goes to ctx->be_state), or bind each weight to the operations that
     * read it (the CPU: backend/cpu/bind.c). NULL: nothing to do. Failure: a status and a
     * message, nothing left taken. */
    colibri_status (*init)(struct colibri_ctx *ctx, const cb_backend_request *req, char *err, size_t err_len);
    void (*free)(struct colibri_ctx *ctx);
    /* The stages (colibri.h, colibri_stage), over ctx->run's chunk. */
    void (*embedding)(struct colibri_ctx *ctx);
    void (*attention)(struct colibri_ctx *ctx, uint32_t l);
    void (*router)(struct colibri_ctx *ctx, uint32_t l);
    void (*grouping)(struct colibri_ctx *ctx, uint32_t l);
    void (*expert_ffn)(struct colibri_ctx *ctx, uint32_t l);
    void (*combine)(struct colibri_ctx *ctx, uint32_t l);
    void (*lm_head)(struct colibri_ctx *ctx, float *logits); /* logits: host [head_rows, V] */
    /* Optional (NULL: none). A chunk is set up (ctx->run and the host scratch's row arrays,
     * the KV block tables grown): upload what the stages read. Called before EMBEDDING. */
    void (*begin_chunk)(struct colibri_ctx *ctx);
    /* Optional: run the whole chunk at once (a captured graph); returns 0 when it did not
     * (the orchestration then runs the stages). Only called with no trace and no stage run. */
    int (*run_chunk)(struct colibri_ctx *ctx, float *logits);
    /* Optional: copy what `stage` of layer l produced into the host scratch. */
    void (*to_host)(struct colibri_ctx *ctx, int32_t stage, uint32_t l);
    /* Optional: the device address of a stage tensor named as colibri_stage_tensor names
     * it (NULL: this backend keeps it on the host, or has no such tensor). */
    const void *(*device_tensor)(struct colibri_ctx *ctx, const char *name);
    /* Optional: a device error kept since it happened (the stages return nothing): OK, or
     * a status with the message set on ctx (cb_fail). Checked after every chunk and stage,
     * before the logits are. A backend whose KV pool is its own sets ctx->sess.kv.copy_block
     * at init (model/kv.h), so a forked sequence's copy-on-write copies its blocks. */
    colibri_status (*status)(struct colibri_ctx *ctx);
    void (*facts)(const struct colibri_ctx *ctx, cb_backend_facts *out);
    /* 1: the stages apply the context's interventions (core/interv.h); 0: the setters refuse
     * them with COLIBRI_E_UNSUPPORTED. */
    int interventions;
} cb_backend;

/* backend/cpu/stages.c */
extern const cb_backend cb_backend_cpu;
/* The CPU's routed-expert FFN on `rows` host rows: y [rows, H] = expert e of MoE layer l on
 * x [rows, H] (h [rows, I] scratch; u [rows, I] scratch for clamped_swiglu, else unused),
 * with the CPU backend's kernels and bits (its threads, its numeric mode). For a device
 * backend's experts that did not fit on the device; that backend's init runs
 * cb_backend_cpu.init first (it binds the operations these rows are computed with). */
void cb_cpu_expert_rows(struct colibri_ctx *ctx, uint32_t l, int64_t e, const float *x, float *h, float *u,
                        float *y, int64_t rows);
/* 1 when the CPU's fast mode rounds MoE layer l's FFN input to bf16 before its experts see
 * it (bf16 routed or shared experts), else 0 (and always 0 in exact mode): a device backend
 * rounds the rows it hands to cb_cpu_expert_rows the same way. */
int cb_cpu_moe_input_bf16(const struct colibri_ctx *ctx, uint32_t l);
/* backend/cpu/panels.c: the bytes of the panel copies of the BF16 weights for this context
 * (0: none to make), and making them (advisory: on failure the weights stay as mapped). */
uint64_t cb_panels_bytes(struct colibri_ctx *ctx);
void cb_panels_make(struct colibri_ctx *ctx, uint64_t bytes);
/* backend/cuda/cuda_backend.cu when built with COLIBRI_CUDA, else NULL (backend/select.c). */
const cb_backend *cb_backend_cuda(void);
/* By name ("cpu", "cuda"): the table, or NULL with a message saying why (unknown name, or a
 * backend this build lacks). */
const cb_backend *cb_backend_find(const char *name, char *err, size_t err_len);

#endif
