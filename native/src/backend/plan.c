/*
 * plan.c — the device memory plan, the experts' placement under a memory fraction and the
 * captured graphs' table (backend/plan.h). Nothing here touches a device.
 */
#include "backend/plan.h"

#include <string.h>

#include "core/checked.h"
#include "core/error.h"

uint64_t cb_plan_align(uint64_t n) {
    if (n > UINT64_MAX - (CB_PLAN_ALIGN - 1)) return 0;
    return (n + CB_PLAN_ALIGN - 1) / CB_PLAN_ALIGN * CB_PLAN_ALIGN;
}

static int is_moe(const cb_plan_input *in, uint32_t l) { return !in->moe || in->moe[l]; }

/* Expert e of layer l goes before expert f of the same layer: higher priority first, then
 * the lower id. */
static int before(const cb_plan_input *in, uint32_t l, uint32_t e, uint32_t f) {
    if (!in->priority) return e < f;
    int64_t pe = in->priority[(uint64_t)l * in->n_experts + e], pf = in->priority[(uint64_t)l * in->n_experts + f];
    return pe != pf ? pe > pf : e < f;
}

colibri_status cb_plan_make(const cb_plan_input *in, cb_plan *out, int32_t *resident, char *err, size_t err_len) {
    memset(out, 0, sizeof *out);
    if (!(in->fraction > 0.0 && in->fraction <= 1.0)) {
        cb_set_err(err, err_len, "gpu_memory_fraction %g is not in (0, 1]", in->fraction);
        return COLIBRI_E_INVALID_ARG;
    }
    uint64_t dense = cb_plan_align(in->dense_bytes), act = cb_plan_align(in->activation_bytes);
    uint64_t kv = cb_plan_align(in->kv_bytes), ex = cb_plan_align(in->expert_bytes);
    uint64_t fixed = 0, need = 0;
    int ok = (dense || !in->dense_bytes) && (act || !in->activation_bytes) && (kv || !in->kv_bytes) &&
             (ex || !in->expert_bytes);
    ok = ok && cb_add_u64(dense, act, &fixed) && cb_add_u64(fixed, kv, &fixed) && cb_add_u64(fixed, in->reserve, &need);
    if (!ok) {
        cb_set_err(err, err_len, "the device memory plan overflows 64 bits");
        return COLIBRI_E_INVALID_ARG;
    }
    uint64_t cap = (uint64_t)(in->fraction * (double)in->device_total);
    if (cap > in->device_free) cap = in->device_free;
    uint64_t budget = cap > in->reserve ? cap - in->reserve : 0;
    out->budget = budget;
    if (fixed > budget) {
        /* the least fraction that would hold them, rounded up to 0.01 */
        double least = in->device_total ? (double)need / (double)in->device_total : 2.0;
        double least_r = (double)(uint64_t)(least * 100.0 + 0.999999) / 100.0;
        char how[96];
        if (least_r <= 1.0 && need <= in->device_free)
            cb_set_err(how, sizeof how, "raise gpu_memory_fraction to at least %.2f", least_r);
        else
            cb_set_err(how, sizeof how, "use a device with more free memory");
        cb_set_err(err, err_len, "the device has %.2f GiB (%.2f GiB free) and the plan may take %.2f GiB "
                   "(gpu_memory_fraction %.2f, less %.2f GiB kept for the runtime), but the dense weights "
                   "(%.2f GiB), the activations (%.2f GiB) and the KV cache (%.2f GiB) alone need %.2f GiB; "
                   "%s, or lower max_batch, max_seq_len or kv_tokens",
                   (double)in->device_total / 1073741824.0, (double)in->device_free / 1073741824.0,
                   (double)budget / 1073741824.0, in->fraction, (double)in->reserve / 1073741824.0,
                   (double)dense / 1073741824.0, (double)act / 1073741824.0, (double)kv / 1073741824.0,
                   (double)fixed / 1073741824.0, how);
        return COLIBRI_E_NOMEM;
    }
    int64_t moe_layers = 0;
    for (uint32_t l = 0; l < in->n_layers; l++) moe_layers += is_moe(in, l);
    uint64_t total_experts = (uint64_t)moe_layers * in->n_experts;
    uint64_t fit = ex ? (budget - fixed) / ex : total_experts;
    if (fit > total_experts) fit = total_experts;
    /* spread evenly: every MoE layer gets fit / moe_layers, the first fit % moe_layers one more */
    uint64_t per = moe_layers ? fit / (uint64_t)moe_layers : 0, extra = moe_layers ? fit % (uint64_t)moe_layers : 0;
    int64_t slot = 0, seen = 0;
    for (uint32_t l = 0; l < in->n_layers; l++) {
        int32_t *r = resident + (uint64_t)l * in->n_experts;
        for (uint32_t e = 0; e < in->n_experts; e++) r[e] = -1;
        if (!is_moe(in, l)) continue;
        uint64_t keep = per + ((uint64_t)seen < extra ? 1 : 0);
        seen++;
        /* the keep best by priority: expert e is kept when fewer than `keep` go before it */
        for (uint32_t e = 0; e < in->n_experts; e++) {
            uint64_t ahead = 0;
            for (uint32_t f = 0; f < in->n_experts && ahead < keep; f++) ahead += f != e && before(in, l, f, e);
            r[e] = ahead < keep ? 0 : -1;
        }
        for (uint32_t e = 0; e < in->n_experts; e++)
            if (r[e] == 0) r[e] = (int32_t)slot++;
    }
    out->dense_off = 0;
    out->activation_off = dense;
    out->kv_off = dense + act;
    out->experts_off = fixed;
    out->total_bytes = fixed + (uint64_t)slot * ex;
    out->experts_resident = slot;
    out->experts_host = (int64_t)total_experts - slot;
    out->moe_layers = moe_layers;
    return COLIBRI_OK;
}

/* ---- captured graphs ------------------------------------------------------------------ */

void cb_graph_init(cb_graph_table *g, int64_t max_rows) {
    memset(g, 0, sizeof *g);
    g->max_rows = max_rows;
}

int cb_graph_eligible(const cb_graph_table *g, cb_graph_key k) {
    return k.rows >= 1 && k.rows <= g->max_rows && k.head_rows >= 0 && k.head_rows <= k.rows;
}

int cb_graph_lookup(cb_graph_table *g, cb_graph_key k) {
    for (int i = 0; i < CB_GRAPH_SLOTS; i++)
        if (g->used[i] && g->key[i].rows == k.rows && g->key[i].head_rows == k.head_rows) {
            g->used[i] = ++g->tick;
            g->replays++;
            return i;
        }
    return -1;
}

int cb_graph_insert(cb_graph_table *g, cb_graph_key k, cb_graph_key *evicted) {
    int pick = 0;
    for (int i = 0; i < CB_GRAPH_SLOTS; i++) {
        if (!g->used[i]) { pick = i; break; }
        if (g->used[i] < g->used[pick]) pick = i;
    }
    evicted->rows = -1;
    evicted->head_rows = -1;
    if (g->used[pick]) {
        *evicted = g->key[pick];
        g->evictions++;
    }
    g->key[pick] = k;
    g->used[pick] = ++g->tick;
    g->captures++;
    return pick;
}

void cb_graph_clear(cb_graph_table *g) {
    memset(g->used, 0, sizeof g->used);
    memset(g->key, 0, sizeof g->key);
}
