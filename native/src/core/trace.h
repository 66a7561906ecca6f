/*
 * trace.h — what a trace holds (colibri.h, "Observation"). trace.c creates it and answers
 * the public calls; model/forward.c fills it while it is attached to a context.
 */
#ifndef COLIBRI_CORE_TRACE_H
#define COLIBRI_CORE_TRACE_H

#include <stdint.h>

#include "colibri.h"

/* A trace (colibri.h): every buffer carved from `mem`, allocated once at create.
 * C = capacity, L = n_layers, E = n_experts, K = top_k. */
struct colibri_trace {
    int64_t capacity, n_tokens, dropped, n_forwards;
    int64_t prefix_cached;      /* positions taken from the prefix cache while attached */
    uint32_t n_layers, n_experts, top_k;
    const colibri_ctx *owner;   /* the context it is attached to, or NULL */
    int64_t chunk_base;         /* token row of the current chunk's first token */
    int32_t *token_ids;         /* [C] */
    int32_t *seq_ids;           /* [C] the sequence of each traced token */
    int64_t *positions;         /* [C] */
    float *router_probs;        /* [L, C, E] */
    int32_t *topk_ids;          /* [L, C, K] */
    float *topk_w;              /* [L, C, K] */
    float *shared_gate;         /* [L, C] */
    float *margins;             /* [L, C, 2] routing margins: k-th minus (k+1)-th router logit, probability */
    int64_t *group_sizes;       /* [L, E] */
    int64_t *padded_sizes;      /* [L, E] */
    uint64_t *layer_ns;         /* [L, 5] ATTENTION..COMBINE */
    int32_t *pred_ids;          /* [L, C, K] the predictor's experts for each layer (-1: none) */
    int64_t *cache_stats;       /* [L, CB_EC_N_STATS] the expert cache's counters while attached */
    uint64_t stage_ns[COLIBRI_N_STAGES];
    void *mem;
};

#endif
