/*
 * interv.h — the interventions a context holds (colibri.h, "Interventions"): expert masks,
 * router biases, forced routing and activation patches, per sequence or for all of them.
 * The setters (core/interv.c) take the memory; the forward only reads it, through the
 * backend's hooks (the CPU's: backend/cpu/interv.c), after one test of ctx->iv, which is
 * NULL whenever nothing is set.
 */
#ifndef COLIBRI_CORE_INTERV_H
#define COLIBRI_CORE_INTERV_H

#include <stdint.h>

#include "colibri.h"

typedef struct cb_iv_force {
    int32_t layer;
    int64_t pos;
} cb_iv_force;

typedef struct cb_iv_patch {
    int32_t point, layer, expert, mode;
    int64_t pos;
    float *vec;   /* [hidden]: the caller's (RECORD) or our copy (REPLACE, ADD) */
} cb_iv_patch;

/* One set of settings (all sequences', or one sequence's). */
typedef struct cb_iv_set {
    int used;                 /* anything set */
    float *bias;              /* [L, E] added to the router logits, or NULL */
    uint8_t *mask;            /* [L, E] 0, COLIBRI_MASK_EXCLUDE or COLIBRI_MASK_ZERO, or NULL */
    int64_t n_force, cap_force;
    cb_iv_force *force;       /* [cap_force] */
    int32_t *force_ids;       /* [cap_force, K] */
    float *force_w;           /* [cap_force, K] */
    int64_t n_patch, cap_patch;
    cb_iv_patch *patch;       /* [cap_patch] */
} cb_iv_set;

typedef struct cb_interv {
    int32_t n_sets;           /* 1 + max_seqs: sets[0] all sequences', sets[1 + q] sequence q's */
    cb_iv_set *sets;
} cb_interv;

struct colibri_ctx;

/* The settings that apply to rows of sequence q (its own, else all sequences'), or NULL. */
static inline const cb_iv_set *cb_iv_for(const cb_interv *iv, int32_t q) {
    const cb_iv_set *s = &iv->sets[1 + q];
    if (s->used) return s;
    return iv->sets[0].used ? &iv->sets[0] : NULL;
}

/* The forced routing of (layer, pos) in set s: its index, or -1. */
int64_t cb_iv_find_force(const cb_iv_set *s, int32_t layer, int64_t pos);
/* 1 when sequence q computes under interventions. */
int cb_iv_seq_active(const struct colibri_ctx *ctx, int32_t q);
/* Free everything (colibri_free). */
void cb_iv_free(struct colibri_ctx *ctx);

#endif
