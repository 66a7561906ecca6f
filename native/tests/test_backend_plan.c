/*
 * test_backend_plan.c — the host-side logic of a device backend (backend/plan.h), with no
 * device: the memory plan (regions aligned, disjoint and inside the one allocation, within
 * the budget; everything resident when it fits), the experts' placement under a memory
 * fraction (the dense part first; as many experts as fit, spread evenly over the MoE layers,
 * none in dense layers, by priority inside a layer, slots dense and in order), the refusal
 * when the dense part does not fit (naming the least fraction that would), bad fractions,
 * and the captured-graph table (lookup, insert, LRU eviction, eligibility, counters).
 * Random shapes from a fixed seed. Exit 0 when every check passes.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/plan.h" /* internal header */

static int fails = 0;
static long checks = 0;
#define CHECK(cond, ...)                                          \
    do {                                                          \
        checks++;                                                 \
        if (!(cond)) {                                            \
            fails++;                                              \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                         \
            fprintf(stderr, "\n");                                \
        }                                                         \
    } while (0)

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t next(void) {
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return rng * 2685821657736338717ull;
}
static uint64_t urange(uint64_t lo, uint64_t hi) { return lo + next() % (hi - lo + 1); }

#define GiB 1073741824ull
#define MAXL 64
#define MAXE 64

/* Check one plan against its input: alignment, regions, budget, placement. */
static void check_plan(const cb_plan_input *in, const cb_plan *p, const int32_t *res) {
    CHECK(p->activation_off % CB_PLAN_ALIGN == 0 && p->kv_off % CB_PLAN_ALIGN == 0 &&
              p->experts_off % CB_PLAN_ALIGN == 0, "regions aligned");
    CHECK(p->dense_off == 0 && p->activation_off >= in->dense_bytes &&
              p->kv_off >= p->activation_off + in->activation_bytes && p->experts_off >= p->kv_off + in->kv_bytes,
          "regions disjoint, in order");
    uint64_t ex = cb_plan_align(in->expert_bytes);
    CHECK(p->total_bytes == p->experts_off + (uint64_t)p->experts_resident * ex, "total = fixed + slots");
    CHECK(p->total_bytes <= p->budget, "total %llu within budget %llu", (unsigned long long)p->total_bytes,
          (unsigned long long)p->budget);
    int64_t moe = 0, resident = 0, lo = INT64_MAX, hi = 0;
    int32_t expect_slot = 0;
    for (uint32_t l = 0; l < in->n_layers; l++) {
        int is_moe = !in->moe || in->moe[l];
        moe += is_moe;
        int64_t n = 0;
        for (uint32_t e = 0; e < in->n_experts; e++) {
            int32_t s = res[l * in->n_experts + e];
            if (!is_moe) CHECK(s == -1, "dense layer %u has no resident expert", l);
            if (s >= 0) {
                CHECK(s == expect_slot, "slot %d of layer %u expert %u in order (expected %d)", s, l, e, expect_slot);
                expect_slot++;
                n++;
            }
        }
        if (is_moe) {
            lo = n < lo ? n : lo;
            hi = n > hi ? n : hi;
            /* by priority: no kept expert ranks below a dropped one */
            for (uint32_t e = 0; e < in->n_experts; e++)
                for (uint32_t f = 0; f < in->n_experts; f++) {
                    if (res[l * in->n_experts + e] < 0 || res[l * in->n_experts + f] >= 0) continue;
                    int64_t pe = in->priority ? in->priority[l * in->n_experts + e] : 0;
                    int64_t pf = in->priority ? in->priority[l * in->n_experts + f] : 0;
                    CHECK(pe > pf || (pe == pf && e < f), "layer %u keeps %u over %u by priority", l, e, f);
                }
        }
        resident += n;
    }
    CHECK(resident == p->experts_resident, "resident count");
    CHECK(p->experts_resident + p->experts_host == moe * (int64_t)in->n_experts, "resident + host = all");
    CHECK(p->moe_layers == moe, "moe layers");
    if (moe) CHECK(hi - lo <= 1, "spread evenly (%lld..%lld per layer)", (long long)lo, (long long)hi);
    /* as many as fit: one more expert would pass the budget, unless all are resident */
    if (p->experts_host > 0) CHECK(p->total_bytes + ex > p->budget, "one more expert would not fit");
}

int main(void) {
    static int32_t res[MAXL * MAXE];
    static int64_t prio[MAXL * MAXE];
    static uint8_t moe[MAXL];
    char err[512];

    /* everything fits: every expert resident, nothing on the host */
    {
        cb_plan_input in = {141 * GiB, 140 * GiB, 0.9, GiB / 2, 2 * GiB, GiB / 4, GiB, 32, 8, NULL,
                            352321536ull, NULL};
        cb_plan p;
        CHECK(cb_plan_make(&in, &p, res, err, sizeof err) == COLIBRI_OK, "fits: %s", err);
        CHECK(p.experts_resident == 256 && p.experts_host == 0, "all 256 resident (%lld)",
              (long long)p.experts_resident);
        check_plan(&in, &p, res);
    }
    /* a fraction: some experts on the host, spread over the layers */
    {
        cb_plan_input in = {80 * GiB, 80 * GiB, 0.5, GiB / 2, 2 * GiB, GiB / 4, GiB, 32, 8, NULL,
                            352321536ull, NULL};
        cb_plan p;
        CHECK(cb_plan_make(&in, &p, res, err, sizeof err) == COLIBRI_OK, "fraction: %s", err);
        CHECK(p.experts_host > 0 && p.experts_resident > 0, "split %lld / %lld", (long long)p.experts_resident,
              (long long)p.experts_host);
        check_plan(&in, &p, res);
    }
    /* free memory below the fraction caps the budget */
    {
        cb_plan_input in = {80 * GiB, 10 * GiB, 0.9, GiB / 2, 2 * GiB, GiB / 4, GiB, 32, 8, NULL,
                            352321536ull, NULL};
        cb_plan p;
        CHECK(cb_plan_make(&in, &p, res, err, sizeof err) == COLIBRI_OK, "free cap: %s", err);
        CHECK(p.budget == 10 * GiB - GiB / 2, "budget = free - reserve");
        check_plan(&in, &p, res);
    }
    /* the dense part does not fit: NOMEM naming the least fraction */
    {
        cb_plan_input in = {80 * GiB, 80 * GiB, 0.05, GiB / 2, 6 * GiB, GiB / 4, GiB, 32, 8, NULL,
                            352321536ull, NULL};
        cb_plan p;
        err[0] = 0;
        CHECK(cb_plan_make(&in, &p, res, err, sizeof err) == COLIBRI_E_NOMEM, "too small");
        CHECK(strstr(err, "gpu_memory_fraction to at least 0.10") != NULL, "names the least fraction: %s", err);
        /* and that fraction does fit */
        in.fraction = 0.10;
        CHECK(cb_plan_make(&in, &p, res, err, sizeof err) == COLIBRI_OK, "least fraction fits: %s", err);
        check_plan(&in, &p, res);
    }
    /* more than the device has: another device, not another fraction */
    {
        cb_plan_input in = {8 * GiB, 8 * GiB, 1.0, GiB / 2, 16 * GiB, GiB / 4, GiB, 4, 8, NULL, GiB, NULL};
        cb_plan p;
        CHECK(cb_plan_make(&in, &p, res, err, sizeof err) == COLIBRI_E_NOMEM, "too large for the device");
        CHECK(strstr(err, "more free memory") != NULL, "says a larger device: %s", err);
    }
    /* bad fractions */
    {
        double bad[] = {0.0, -0.5, 1.5, 0.0 / 0.0};
        for (int i = 0; i < 4; i++) {
            cb_plan_input in = {8 * GiB, 8 * GiB, bad[i], 0, GiB, 0, 0, 2, 2, NULL, 1024, NULL};
            cb_plan p;
            CHECK(cb_plan_make(&in, &p, res, err, sizeof err) == COLIBRI_E_INVALID_ARG, "fraction %g refused",
                  bad[i]);
        }
    }
    /* overflow */
    {
        cb_plan_input in = {8 * GiB, 8 * GiB, 1.0, 0, UINT64_MAX - 10, 1000, 0, 2, 2, NULL, 1024, NULL};
        cb_plan p;
        CHECK(cb_plan_make(&in, &p, res, err, sizeof err) == COLIBRI_E_INVALID_ARG, "overflow refused");
    }
    /* random shapes: dense layers among MoE layers, priorities, odd sizes */
    for (int it = 0; it < 2000; it++) {
        uint32_t L = (uint32_t)urange(1, MAXL), E = (uint32_t)urange(1, MAXE);
        int with_moe_mask = (int)(next() & 1), with_prio = (int)(next() & 1);
        for (uint32_t l = 0; l < L; l++) moe[l] = (uint8_t)(next() % 4 != 0);
        for (uint32_t i = 0; i < L * E; i++) prio[i] = (int64_t)(next() % 5);
        uint64_t total = urange(GiB, 200 * GiB);
        cb_plan_input in = {total, urange(total / 2, total), (double)urange(1, 100) / 100.0, urange(0, GiB),
                            urange(1, 8 * GiB), urange(1, GiB), urange(0, 4 * GiB), L, E,
                            with_moe_mask ? moe : NULL, urange(1, GiB), with_prio ? prio : NULL};
        cb_plan p;
        colibri_status st = cb_plan_make(&in, &p, res, err, sizeof err);
        CHECK(st == COLIBRI_OK || st == COLIBRI_E_NOMEM, "ok or nomem (%d)", st);
        if (st == COLIBRI_OK) check_plan(&in, &p, res);
        else CHECK(strstr(err, "gpu_memory_fraction") != NULL, "message: %s", err);
    }

    /* graphs */
    {
        cb_graph_table g;
        cb_graph_init(&g, 16);
        cb_graph_key k1 = {1, 1}, k16 = {16, 16}, big = {17, 1}, bad = {4, 5};
        CHECK(cb_graph_eligible(&g, k1) && cb_graph_eligible(&g, k16), "decode shapes eligible");
        CHECK(!cb_graph_eligible(&g, big) && !cb_graph_eligible(&g, bad), "prefill / bad shapes not");
        CHECK(cb_graph_lookup(&g, k1) == -1, "empty table misses");
        cb_graph_key ev;
        int s1 = cb_graph_insert(&g, k1, &ev);
        CHECK(ev.rows == -1, "first insert evicts nothing");
        CHECK(cb_graph_lookup(&g, k1) == s1 && g.replays == 1, "hit after insert");
        /* fill every slot, then one more evicts the least recently used */
        int slot_of[CB_GRAPH_SLOTS + 1];
        slot_of[0] = s1;
        for (int i = 1; i < CB_GRAPH_SLOTS; i++) {
            cb_graph_key k = {i + 1, 1};
            slot_of[i] = cb_graph_insert(&g, k, &ev);
            CHECK(ev.rows == -1, "slot %d was free", i);
        }
        for (int i = 0; i < CB_GRAPH_SLOTS; i++)
            for (int j = i + 1; j < CB_GRAPH_SLOTS; j++) CHECK(slot_of[i] != slot_of[j], "distinct slots");
        cb_graph_lookup(&g, k1); /* k1 is now the most recent; {2, 1} the least */
        cb_graph_key k_new = {1, 0};
        int s = cb_graph_insert(&g, k_new, &ev);
        CHECK(ev.rows == 2 && ev.head_rows == 1 && s == slot_of[1], "LRU evicted {%lld, %lld}",
              (long long)ev.rows, (long long)ev.head_rows);
        CHECK(cb_graph_lookup(&g, (cb_graph_key){2, 1}) == -1, "evicted key misses");
        CHECK(cb_graph_lookup(&g, k1) == s1, "recent key kept");
        CHECK(g.captures == CB_GRAPH_SLOTS + 1 && g.evictions == 1, "counters %lld %lld", (long long)g.captures,
              (long long)g.evictions);
        cb_graph_clear(&g);
        CHECK(cb_graph_lookup(&g, k1) == -1, "cleared");
    }

    printf("test_backend_plan: %ld checks, %d failed\n", checks, fails);
    return fails ? 1 : 0;
}
