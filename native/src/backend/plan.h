/*
 * plan.h — the host-side logic of a device backend, plain C so that it is tested on any
 * machine (native/tests/test_backend_plan.c): the device memory plan (what is resident,
 * how many bytes each part takes, in one allocation), the placement of routed experts under
 * a memory fraction (the dense part first, then as many experts as fit, spread evenly over
 * the MoE layers; the rest computed by the CPU), and the bookkeeping of captured decode
 * graphs (a small table keyed by the chunk's shape, least recently used out).
 */
#ifndef COLIBRI_BACKEND_PLAN_H
#define COLIBRI_BACKEND_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "colibri.h"

/* Every region of the plan starts at a multiple of this (bytes). */
#define CB_PLAN_ALIGN 256u

/* What the plan is made from. Byte counts are what the device copy of each part takes. */
typedef struct cb_plan_input {
    uint64_t device_total;     /* the device's memory (cudaMemGetInfo's total) */
    uint64_t device_free;      /* free now (cudaMemGetInfo's free) */
    double fraction;           /* (0, 1]: share of device_total the plan may take */
    uint64_t reserve;          /* left free for the CUDA runtime: its context, the loaded kernels,
                                * the captured graphs (the CUDA backend: 512 MiB, at most 1/8 of
                                * the device) */
    uint64_t dense_bytes;      /* every weight but the routed experts: embeddings, attention,
                                * norms, routers, dense and shared FFNs, the LM head */
    uint64_t activation_bytes; /* the device scratch (cb_scratch's widths at max_batch) */
    uint64_t kv_bytes;         /* the KV pool */
    uint32_t n_layers;
    uint32_t n_experts;        /* E per MoE layer */
    const uint8_t *moe;        /* [n_layers] 1: MoE layer; NULL: every layer */
    uint64_t expert_bytes;     /* one routed expert's weights (gate, up, down; biases) */
    /* optional: [n_layers * n_experts] the order to keep experts in, per layer (higher
     * first; e.g. the routing counts of a trace); NULL: ascending id */
    const int64_t *priority;
} cb_plan_input;

typedef struct cb_plan {
    uint64_t dense_off, activation_off, kv_off, experts_off; /* region offsets in the one allocation */
    uint64_t total_bytes;      /* the one allocation */
    uint64_t budget;           /* what the plan was allowed: min(fraction * total - reserve, free - reserve) */
    int64_t experts_resident;  /* over all MoE layers */
    int64_t experts_host;
    int64_t moe_layers;
} cb_plan;

/* Make the plan. resident: [n_layers * n_experts] out, slot index of each resident expert
 * in the expert region (layer-major, ascending id inside a layer), or -1 for one the CPU
 * computes (and for every expert of a dense layer). COLIBRI_E_NOMEM (with a message naming
 * the least fraction that would fit) when not even the dense part, the activations and the
 * KV pool fit; COLIBRI_E_INVALID_ARG for a fraction outside (0, 1] or overflowing sizes. */
colibri_status cb_plan_make(const cb_plan_input *in, cb_plan *out, int32_t *resident, char *err, size_t err_len);

/* Round up to CB_PLAN_ALIGN; 0 on overflow. */
uint64_t cb_plan_align(uint64_t n);

/* ---- captured graphs ----------------------------------------------------------------
 * A decode step's kernels read every per-step value (positions, KV tables and lengths,
 * routing, group offsets) from device buffers, and their launch shapes depend only on the
 * chunk's row count T and the LM head's rows, so one graph serves every step of that
 * shape. The table holds up to CB_GRAPH_SLOTS of them; the backend keeps the executable
 * graphs in a parallel array indexed by slot. */
#define CB_GRAPH_SLOTS 16

typedef struct cb_graph_key {
    int64_t rows;              /* T */
    int64_t head_rows;         /* rows of the LM head */
} cb_graph_key;

typedef struct cb_graph_table {
    cb_graph_key key[CB_GRAPH_SLOTS];
    uint64_t used[CB_GRAPH_SLOTS]; /* last use (tick); 0: the slot is empty */
    uint64_t tick;
    int64_t max_rows;          /* chunks of more rows run eagerly (prefill) */
    int64_t captures, replays, evictions;
} cb_graph_table;

void cb_graph_init(cb_graph_table *g, int64_t max_rows);
/* Whether a chunk of this shape is captured at all (rows <= max_rows, head_rows <= rows). */
int cb_graph_eligible(const cb_graph_table *g, cb_graph_key k);
/* The slot holding k (marked used, replays counted), or -1. */
int cb_graph_lookup(cb_graph_table *g, cb_graph_key k);
/* A slot for a new capture of k: an empty one, else the least recently used, whose
 * previous key goes to *evicted (rows -1 when the slot was empty) so the backend destroys
 * that graph first. Captures (and evictions) counted. */
int cb_graph_insert(cb_graph_table *g, cb_graph_key k, cb_graph_key *evicted);
/* Forget every graph (a slot's device pointers changed): all slots empty. */
void cb_graph_clear(cb_graph_table *g);

#endif
