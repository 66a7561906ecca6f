/*
 * expert_cache.h — routed experts in a fixed budget of cache slots, for models larger than
 * memory (colibri_options.expert_cache_mb; docs/expert_cache.md). The dense weights stay
 * mapped; each MoE layer owns S slots, filled by I/O threads that read an expert's
 * bytes from the file (O_DIRECT where the file system takes it, else buffered reads whose
 * pages are dropped after the copy) while the forward computes. A slot holds an expert's
 * bytes exactly as the file does (the same alignment modulo 4 KiB), so the kernels compute
 * the same bits as on the mapping.
 *
 * The accounting, which colibri_lab.analysis.cachesim simulates exactly, per layer and step (one
 * forward chunk): (1) policy PREDICT only, while the layer before computes: the predicted
 * experts not resident are loaded, victims by LRU among slots holding no other predicted
 * expert of the step; (2) every needed expert that is resident (or being read) is a hit,
 * touched; (3) the misses, in ascending id, each take a victim: an empty slot first, else by
 * the policy among slots that are not pinned and hold no needed expert of the step that has
 * not run yet (resident ones run first; a loaded miss runs at once). An expert used by R rows
 * of a chunk counts R uses: R hits, or 1 miss and R - 1 hits.
 *
 * Only the forward's thread (the context's caller) changes the logical state; the I/O threads
 * only read requests and mark slots loaded, under one mutex. No allocation after init.
 */
#ifndef COLIBRI_MODEL_EXPERT_CACHE_H
#define COLIBRI_MODEL_EXPERT_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "colibri.h"
#include "model/model.h"

typedef struct cb_ecache cb_ecache;
struct colibri_ctx;

/* Per-layer counters (colibri_get_layer_int "cache_*", the trace's "cache_stats"). */
enum { CB_EC_HITS, CB_EC_MISSES, CB_EC_PREFETCHES, CB_EC_PREFETCH_HITS, CB_EC_WASTED, CB_EC_N_STATS };

/* The cache for ctx's model in budget_mb MiB, or of `slots` slots per MoE layer (one of
 * them > 0), policy COLIBRI_CACHE_*; *out NULL on failure with the reason in err. Opens the
 * file a second time (path). */
colibri_status cb_ecache_init(struct colibri_ctx *ctx, const char *path, int64_t budget_mb, int32_t slots,
                              int32_t policy, cb_ecache **out, char *err, size_t err_len);
void cb_ecache_free(cb_ecache *ec);

int32_t cb_ecache_slots(const cb_ecache *ec);         /* S, slots per MoE layer */
int32_t cb_ecache_policy(const cb_ecache *ec);
uint64_t cb_ecache_slot_bytes(const cb_ecache *ec);
int cb_ecache_direct(const cb_ecache *ec);            /* 1: O_DIRECT reads */
/* Counter `stat` (CB_EC_*) of layer l, or of every layer with l < 0. */
int64_t cb_ecache_stat(const cb_ecache *ec, int32_t l, int stat);
uint64_t cb_ecache_bytes_read(const cb_ecache *ec);
/* The experts are read from these ranges of the file, never through the mapping:
 * n ranges [off, off + len) written to ranges (up to cap); returns n. */
int cb_ecache_ranges(const cb_ecache *ec, uint64_t (*ranges)[2], int cap);

/* Bytes of the file in those ranges. */
uint64_t cb_ecache_expert_bytes(const cb_ecache *ec);

/* Pin experts ids[0..n) of layer l (replacing its pinned set; n < S; ids distinct, in
 * [0, E)): they are loaded now and never evicted. */
colibri_status cb_ecache_pin(cb_ecache *ec, int32_t l, const int32_t *ids, int32_t n, char *err, size_t err_len);

/* The step's buffers of n_experts entries each, for the forward's loop: order, ready, done. */
void cb_ecache_buffers(cb_ecache *ec, int32_t **order, int32_t **ready, uint8_t **done);

/* Step (1): prefetch the predicted experts ids[0..n) of layer l (PREDICT policy only). */
void cb_ecache_prefetch(cb_ecache *ec, uint32_t l, const int32_t *ids, int n);

/* Steps (2) and (3) for layer l: count[e] rows need expert e. Writes the needed experts in
 * the order they may run to order[], returns how many; starts the reads it can. */
int cb_ecache_plan(cb_ecache *ec, uint32_t l, const int64_t *count, int32_t *order);
/* Wait until at least one of order[i] with !done[i] is loaded; writes their indexes i
 * (ascending) to ready[] and returns how many. */
int cb_ecache_wait(cb_ecache *ec, uint32_t l, const int32_t *order, const uint8_t *done, int n, int32_t *ready);
/* The FFN of expert e of layer l as it lies in its slot: a view of src whose expert 0 is e. */
void cb_ecache_view(const cb_ecache *ec, uint32_t l, int32_t e, const cb_ffn *src, uint32_t H, cb_ffn *view);
/* Expert e of layer l has run this step: loads waiting for its slot start. */
void cb_ecache_ran(cb_ecache *ec, uint32_t l, int32_t e);

#endif
