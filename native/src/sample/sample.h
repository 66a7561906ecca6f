/*
 * sample.h — the sampling core shared by colibri_sample (core/sampler.c) and the
 * per-sequence sampler (sample/sampler.c).
 */
#ifndef COLIBRI_SAMPLE_SAMPLE_H
#define COLIBRI_SAMPLE_SAMPLE_H

#include <stdint.h>

/* Sample one id from logits[0..V): the candidates are the ids whose logit is above -inf, in
 * id order; temperature (0: greedy, lowest id on ties), top-k (0 off), top-p (1 off), min-p
 * (0 off). idx and p are [V] scratch; *rng a xorshift64* state (0 is replaced). Returns 0,
 * or -1 when every logit is -inf. */
int cb_sample_row(const float *logits, int64_t V, float temperature, int32_t top_k, float top_p, float min_p,
                  int32_t *idx, float *p, uint64_t *rng, int32_t *out_id);

#endif
