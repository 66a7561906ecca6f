/*
 * logprob.c — the target log-probability readout of colibri_batch_logprobs: each logit row
 * of a chunk (host memory, [R, V], as the LM head wrote it) reduced to one number,
 *
 *     logprob = (logit[target] - m) + log(1 / s),   m = max_i logit[i],
 *     s = sum_i exp(logit[i] - m)
 *
 * with s and 1/s as the kernel table's softmax computes them (ctx->kern->softmax, float32,
 * max-subtracted: the reference table's plain loop or the SIMD one; the row is overwritten by
 * its probabilities, and 1/s is read back at the row's first maximum, where the softmax wrote
 * exp(0) / s) and the sum in double. Rows are independent (the same bits whatever else is in
 * the chunk) and split over the thread pool by rows; nothing is allocated.
 */
#include <math.h>

#include "core/context.h"
#include "core/threadpool.h"

typedef struct {
    colibri_ctx *ctx;
    float *logits;
    const int32_t *targets;
    float *out;
    int64_t R, len;
} lp_task;

/* The maximum of x[0..n) and the index of its first occurrence. */
static float row_max(const float *x, int64_t n, int64_t *at) {
    float m[8];
    int64_t i = 0;
    for (int j = 0; j < 8; j++) m[j] = x[0];
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) m[j] = x[i + j] > m[j] ? x[i + j] : m[j];
    float best = m[0];
    for (int j = 1; j < 8; j++) best = m[j] > best ? m[j] : best;
    for (; i < n; i++) best = x[i] > best ? x[i] : best;
    for (i = 0; i < n && x[i] != best; i++) {}
    *at = i;
    return best;
}

static void lp_chunk(void *arg, int64_t ch, int tid) {
    (void)tid;
    const lp_task *a = (const lp_task *)arg;
    const int64_t V = a->ctx->cfg.vocab;
    int64_t r1 = (ch + 1) * a->len < a->R ? (ch + 1) * a->len : a->R;
    for (int64_t r = ch * a->len; r < r1; r++) {
        float *row = a->logits + r * V;
        int64_t at = 0;
        float m = row_max(row, V, &at);
        float d = row[a->targets[r]] - m;
        a->ctx->kern->softmax(row, V);
        a->out[r] = (float)((double)d + log((double)row[at]));
    }
}

void cb_logprob_rows(colibri_ctx *ctx, float *logits, int64_t R, const int32_t *targets, float *out) {
    lp_task a = {ctx, logits, targets, out, R, 4};
    int64_t n = (R + a.len - 1) / a.len;
    cb_pool_run(n > 1 ? ctx->pool : NULL, lp_chunk, &a, n);
}
