/*
 * sampler.c — colibri_sample: greedy, temperature, top-k, top-p (nucleus) and min-p sampling
 * over one row of logits, using only the caller's scratch (no allocation). The per-sequence
 * sampler (sample/sampler.c) applies its penalties, bias and mask, then calls the same core.
 *
 * Candidate order is (logit descending, id ascending), so results are deterministic for
 * a given rng state. Top-k selection is a bounded min-heap over candidate ids; a full
 * ordering (needed by top-p without top-k) is an in-place heap sort.
 */
#include <math.h>

#include "core/context.h"
#include "sample/sample.h"

/* xorshift64* (Vigna); returns a float uniform in [0, 1) from the top 24 bits. */
static float rng_uniform(uint64_t *state) {
    uint64_t x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    uint64_t r = x * 0x2545F4914F6CDD1Dull;
    return (float)(r >> 40) * (1.0f / 16777216.0f);
}

/* "a ranks before b": higher logit first, lower id on ties. */
static int before(const float *lg, int32_t a, int32_t b) {
    return lg[a] > lg[b] || (lg[a] == lg[b] && a < b);
}

/* Sift down in a heap where the root is the candidate that ranks LAST (a min-heap by rank). */
static void sift_down(int32_t *h, int64_t n, int64_t i, const float *lg) {
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && before(lg, h[m], h[l])) m = l;
        if (r < n && before(lg, h[m], h[r])) m = r;
        if (m == i) return;
        int32_t t = h[i];
        h[i] = h[m];
        h[m] = t;
        i = m;
    }
}

/* Keep the k best of ids[0..n) in ids[0..k), sorted best first. Caller: 1 <= k <= n. */
static void select_sorted(int32_t *ids, int64_t n, int64_t k, const float *lg) {
    for (int64_t i = k / 2 - 1; i >= 0; i--) sift_down(ids, k, i, lg);
    for (int64_t i = k; i < n; i++) {
        if (before(lg, ids[i], ids[0])) { /* better than the worst kept */
            ids[0] = ids[i];
            sift_down(ids, k, 0, lg);
        }
    }
    /* heap sort: repeatedly move the worst to the end -> best first */
    for (int64_t end = k - 1; end > 0; end--) {
        int32_t t = ids[0];
        ids[0] = ids[end];
        ids[end] = t;
        sift_down(ids, end, 0, lg);
    }
}

/* The sampling core shared by colibri_sample and colibri_sampler_sample (sample/sampler.c):
 * the candidates are the ids with a logit above -inf, in id order; temperature, top-k,
 * top-p, then min-p. idx and p are [V] scratch. Returns 0, or -1 when no logit is above -inf. */
int cb_sample_row(const float *logits, int64_t V, float temperature, int32_t top_k, float top_p, float min_p,
                  int32_t *idx, float *p, uint64_t *rng, int32_t *out_id) {
    if (*rng == 0) *rng = 0x9E3779B97F4A7C15ull;

    if (temperature == 0.0f || top_k == 1) {
        int32_t best = 0;
        for (int32_t i = 1; i < (int32_t)V; i++)
            if (logits[i] > logits[best]) best = i;
        if (logits[best] == -INFINITY) return -1;
        *out_id = best;
        return 0;
    }

    int64_t n = 0;
    int sorted = 0;
    for (int32_t i = 0; i < (int32_t)V; i++)
        if (logits[i] != -INFINITY) idx[n++] = i;
    if (n == 0) return -1;
    if (top_k > 0 && top_k < n) {
        select_sorted(idx, n, top_k, logits);
        n = top_k;
        sorted = 1;
    } else if (top_p < 1.0f || min_p > 0.0f) {
        select_sorted(idx, n, n, logits);
        sorted = 1;
    }
    /* softmax with temperature over the candidates (max first when sorted) */
    float m = logits[idx[0]];
    if (!sorted)
        for (int64_t i = 1; i < n; i++)
            if (logits[idx[i]] > m) m = logits[idx[i]];
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        float v = expf((logits[idx[i]] - m) / temperature);
        p[i] = v;
        sum += v;
    }
    if (top_p < 1.0f) {
        /* nucleus: the smallest prefix (best first) whose mass reaches top_p */
        double cum = 0.0, target = (double)top_p * sum;
        int64_t keep = n;
        for (int64_t i = 0; i < n; i++) {
            cum += p[i];
            if (cum >= target) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
        sum = 0.0;
        for (int64_t i = 0; i < n; i++) sum += p[i];
    }
    if (min_p > 0.0f) {
        /* min-p: the candidates (best first) whose probability is at least min_p × the best's */
        float cut = min_p * p[0];
        int64_t keep = 1;
        while (keep < n && p[keep] >= cut) keep++;
        n = keep;
        sum = 0.0;
        for (int64_t i = 0; i < n; i++) sum += p[i];
    }
    double r = (double)rng_uniform(rng) * sum;
    double acc = 0.0;
    for (int64_t i = 0; i < n; i++) {
        acc += p[i];
        if (r < acc) {
            *out_id = idx[i];
            return 0;
        }
    }
    /* rounding left r at the very top: the last candidate with non-zero mass */
    for (int64_t i = n - 1; i >= 0; i--) {
        if (p[i] > 0.0f) {
            *out_id = idx[i];
            return 0;
        }
    }
    *out_id = idx[0];
    return 0;
}

colibri_status colibri_sample(colibri_ctx *ctx, const float *logits, float temperature,
                              int32_t top_k, float top_p, uint64_t *rng, int32_t *out_id) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    if (!logits || !rng || !out_id)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_sample: logits, rng and out_id must not be NULL");
    if (!(temperature >= 0.0f) || isinf(temperature))
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_sample: temperature %g must be finite and >= 0 "
                       "(0 = greedy)", (double)temperature);
    if (top_k < 0)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_sample: top_k %d must be >= 0 (0 = off)", top_k);
    if (!(top_p > 0.0f && top_p <= 1.0f))
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_sample: top_p %g must be in (0, 1] (1 = off)",
                       (double)top_p);
    const int64_t V = ctx->cfg.vocab;
    for (int64_t i = 0; i < V; i++) {
        if (isnan(logits[i]))
            return cb_fail(ctx, COLIBRI_E_NUMERIC, "colibri_sample: logit %lld is NaN", (long long)i);
    }
    if (cb_sample_row(logits, V, temperature, top_k, top_p, 0.0f, ctx->s.sample_idx, ctx->s.sample_p, rng,
                      out_id) != 0)
        return cb_fail(ctx, COLIBRI_E_NUMERIC, "colibri_sample: every logit is -inf");
    return COLIBRI_OK;
}
