/*
 * expert_cache.c — the expert cache (expert_cache.h): slots, the policies' victim choice,
 * the per-step plan, and the I/O threads that fill slots from the file.
 */
#define _GNU_SOURCE
#include "model/expert_cache.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/context.h"
#include "core/error.h"

#define EC_ALIGN 4096u          /* O_DIRECT's alignment of buffers, offsets and lengths */
#define EC_LFU_HALF_LIFE 128u   /* LFU counts halve every this many steps of a layer */
#define EC_MAX_REGIONS 3        /* packed: one; split: gate, up, down */
/* Reads in flight at once (one per I/O thread): a virtual or NVMe disk serves several
 * large reads faster than one at a time (docs/expert_cache.md has the measurement). */
#define EC_IO_THREADS 4

typedef struct ec_slot {
    int32_t expert;     /* logical occupant, -1 empty (forward thread only) */
    int32_t loaded;     /* expert whose bytes lie in mem, -1 none or being read (mutex) */
    uint32_t gen;       /* requests for this slot issued (mutex); a stale request is skipped */
    uint64_t last_use;  /* the layer's touch counter at the last touch */
    uint8_t pinned, prefetched;
    uint8_t reading;    /* an I/O thread is writing mem (mutex) */
    uint8_t *mem;
} ec_slot;

typedef struct ec_defer {  /* a load that waits until expert `after` of the step has run */
    int32_t slot, expert, after;
    uint8_t started;
} ec_defer;

typedef struct ec_layer {
    const cb_ffn *ffn;  /* NULL: a dense layer (no slots) */
    ec_slot *slots;     /* [S] */
    int32_t *where;     /* [E] logical slot of each expert, -1 */
    int64_t *lfu;       /* [E] use counts, halved every EC_LFU_HALF_LIFE steps */
    int32_t *step_slot; /* [E] the slot each needed expert of the current step runs from */
    uint8_t *pending;   /* [E] needed this step and not run yet (logically) */
    ec_defer *defer;    /* [E] */
    int32_t n_defer;
    uint64_t steps, touch;
    int64_t stats[CB_EC_N_STATS];
    /* the expert's regions in the file: expert e's k-th at off[k] + e * stride[k] */
    uint64_t off[EC_MAX_REGIONS], stride[EC_MAX_REGIONS], len[EC_MAX_REGIONS];
    int n_regions;
} ec_layer;

typedef struct ec_req {
    int32_t layer, slot, expert;
    uint32_t gen;
} ec_req;

typedef struct ec_queue {  /* requests in FIFO order, at most one per slot */
    ec_req *q;
    int64_t cap, n;
} ec_queue;

struct cb_ecache {
    const uint8_t *map;
    uint64_t file_size;
    int fd;              /* buffered (the context's) */
    int fd_direct;       /* O_DIRECT, or -1 */
    int32_t policy, S, n_layers, E;
    uint64_t slot_bytes, region_base[EC_MAX_REGIONS];
    uint8_t *mem;        /* [n_moe * S * slot_bytes] */
    uint64_t mem_bytes;
    ec_layer *layers;    /* [n_layers] */
    int32_t *order, *ready; /* [E] the forward's step buffers */
    uint8_t *done;       /* [E] */
    uint64_t bytes_read; /* mutex */
    /* the I/O threads */
    pthread_t threads[EC_IO_THREADS];
    int n_threads, stop;
    pthread_mutex_t mu;
    pthread_cond_t work_cv, ready_cv;
    ec_queue demand, prefetch; /* demand reads go first */
};

static uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* ---- the I/O thread ------------------------------------------------------------------ */

/* Read [off, off + len) of the file into dst + (off % EC_ALIGN) (dst aligned). O_DIRECT
 * first; buffered reads (pages dropped after) where it is refused; the mapping last. */
static uint64_t read_region(cb_ecache *ec, uint8_t *dst, uint64_t off, uint64_t len) {
    uint64_t a0 = off / EC_ALIGN * EC_ALIGN, need = off + len - a0;
    uint64_t want = round_up(need, EC_ALIGN);
    for (int pass = 0; pass < 2; pass++) {
        int fd = pass == 0 ? ec->fd_direct : ec->fd;
        if (fd < 0) continue;
        uint64_t got = 0;
        while (got < need) {
            ssize_t r = pread(fd, dst + got, (size_t)(pass == 0 ? want - got : need - got), (off_t)(a0 + got));
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) break;
            got += (uint64_t)r;
        }
        if (got >= need) {
            if (pass == 1) (void)posix_fadvise(fd, (off_t)a0, (off_t)need, POSIX_FADV_DONTNEED);
            return got;
        }
    }
    memcpy(dst + (off - a0), ec->map + off, (size_t)len); /* both reads failed: the mapping */
    return len;
}

/* Remove entry i of a queue, keeping the order. */
static void queue_remove(ec_queue *qu, int64_t i) {
    memmove(qu->q + i, qu->q + i + 1, (size_t)(qu->n - i - 1) * sizeof *qu->q);
    qu->n--;
}

/* The first request, demand reads first, whose slot no other thread is writing; -1 none. */
static int64_t pick(cb_ecache *ec, ec_queue **from) {
    ec_queue *qs[2] = {&ec->demand, &ec->prefetch};
    for (int k = 0; k < 2; k++)
        for (int64_t i = 0; i < qs[k]->n; i++) {
            const ec_req *r = &qs[k]->q[i];
            if (!ec->layers[r->layer].slots[r->slot].reading) {
                *from = qs[k];
                return i;
            }
        }
    return -1;
}

static void *io_main(void *arg) {
    cb_ecache *ec = (cb_ecache *)arg;
    pthread_mutex_lock(&ec->mu);
    for (;;) {
        ec_queue *qu = NULL;
        int64_t i = -1;
        while (!ec->stop && (i = pick(ec, &qu)) < 0) pthread_cond_wait(&ec->work_cv, &ec->mu);
        if (ec->stop) break;
        ec_req rq = qu->q[i];
        queue_remove(qu, i);
        ec_layer *L = &ec->layers[rq.layer];
        ec_slot *sl = &L->slots[rq.slot];
        sl->reading = 1;
        pthread_mutex_unlock(&ec->mu);
        uint64_t bytes = 0;
        for (int k = 0; k < L->n_regions; k++) {
            uint64_t off = L->off[k] + (uint64_t)rq.expert * L->stride[k];
            bytes += read_region(ec, sl->mem + ec->region_base[k], off, L->len[k]);
        }
        pthread_mutex_lock(&ec->mu);
        sl->reading = 0;
        ec->bytes_read += bytes;
        if (rq.gen == sl->gen) sl->loaded = rq.expert;
        pthread_cond_broadcast(&ec->ready_cv);
        pthread_cond_broadcast(&ec->work_cv); /* a request may wait for this slot */
    }
    pthread_mutex_unlock(&ec->mu);
    return NULL;
}

/* Issue a read of expert e into slot s of layer l (its bytes are no longer needed); an
 * earlier request for the slot still queued is dropped, one being read finishes first. */
static void start_load(cb_ecache *ec, int32_t l, int32_t s, int32_t e, int demand) {
    ec_slot *sl = &ec->layers[l].slots[s];
    pthread_mutex_lock(&ec->mu);
    sl->gen++;
    sl->loaded = -1;
    ec_queue *qs[2] = {&ec->demand, &ec->prefetch};
    for (int k = 0; k < 2; k++)
        for (int64_t i = qs[k]->n - 1; i >= 0; i--)
            if (qs[k]->q[i].layer == l && qs[k]->q[i].slot == s) queue_remove(qs[k], i);
    ec_queue *qu = demand ? &ec->demand : &ec->prefetch;
    qu->q[qu->n++] = (ec_req){l, s, e, sl->gen}; /* one entry per slot: cap is enough */
    pthread_cond_signal(&ec->work_cv);
    pthread_mutex_unlock(&ec->mu);
}

/* ---- victims ------------------------------------------------------------------------- */

static void touch(ec_layer *L, int32_t s, int64_t uses) {
    ec_slot *sl = &L->slots[s];
    sl->last_use = ++L->touch;
    L->lfu[sl->expert] += uses;
}

/* The slot for a new expert: an empty one first (lowest index), else by the policy among
 * slots that are not pinned and whose expert is not excluded (excl[e] != 0); -1 if none. */
static int32_t victim(const cb_ecache *ec, const ec_layer *L, const uint8_t *excl, int lru_only) {
    int32_t best = -1;
    for (int32_t s = 0; s < ec->S; s++) {
        const ec_slot *sl = &L->slots[s];
        if (sl->expert < 0) return s;
        if (sl->pinned || (excl && excl[sl->expert])) continue;
        if (best < 0) {
            best = s;
            continue;
        }
        const ec_slot *b = &L->slots[best];
        if (!lru_only && ec->policy == COLIBRI_CACHE_LFU) {
            int64_t fs = L->lfu[sl->expert], fb = L->lfu[b->expert];
            if (fs < fb || (fs == fb && sl->last_use < b->last_use)) best = s;
        } else if (sl->last_use < b->last_use) {
            best = s;
        }
    }
    return best;
}

/* Slot s now holds expert e logically; its old expert leaves (a wasted prefetch if unused). */
static void assign(ec_layer *L, int32_t s, int32_t e, int prefetched) {
    ec_slot *sl = &L->slots[s];
    if (sl->expert >= 0) {
        if (sl->prefetched) L->stats[CB_EC_WASTED]++;
        L->where[sl->expert] = -1;
    }
    sl->expert = e;
    sl->prefetched = (uint8_t)prefetched;
    L->where[e] = s;
}

/* Loads of an abandoned step (a stage run not finished) start now: nothing waits for them. */
static void flush_deferred(cb_ecache *ec, uint32_t l) {
    ec_layer *L = &ec->layers[l];
    for (int32_t i = 0; i < L->n_defer; i++)
        if (!L->defer[i].started) {
            L->defer[i].started = 1;
            start_load(ec, (int32_t)l, L->defer[i].slot, L->defer[i].expert, 1);
        }
    L->n_defer = 0;
    memset(L->pending, 0, (size_t)ec->E);
}

/* ---- the step ------------------------------------------------------------------------ */

void cb_ecache_prefetch(cb_ecache *ec, uint32_t l, const int32_t *ids, int n) {
    ec_layer *L = &ec->layers[l];
    if (!L->ffn || ec->policy != COLIBRI_CACHE_PREDICT) return;
    flush_deferred(ec, l);
    uint8_t *pred = L->pending; /* borrowed: the predicted set of this step */
    int m = 0;
    for (int i = 0; i < n; i++)
        if (ids[i] >= 0 && ids[i] < ec->E && !pred[ids[i]]) pred[ids[i]] = 1;
    for (int32_t e = 0; e < ec->E && m < ec->S; e++) {
        if (!pred[e]) continue;
        m++;
        if (L->where[e] >= 0) continue;
        int32_t s = victim(ec, L, pred, 1);
        if (s < 0) break;
        assign(L, s, e, 1);
        touch(L, s, 0);
        L->stats[CB_EC_PREFETCHES]++;
        start_load(ec, (int32_t)l, s, e, 0);
    }
    memset(pred, 0, (size_t)ec->E);
}

int cb_ecache_plan(cb_ecache *ec, uint32_t l, const int64_t *count, int32_t *order) {
    ec_layer *L = &ec->layers[l];
    flush_deferred(ec, l);
    int n = 0;
    if (++L->steps % EC_LFU_HALF_LIFE == 0)
        for (int32_t e = 0; e < ec->E; e++) L->lfu[e] >>= 1;
    /* hits: resident (or being read) experts, which run first */
    for (int32_t e = 0; e < ec->E; e++) {
        if (count[e] <= 0 || L->where[e] < 0) continue;
        int32_t s = L->where[e];
        ec_slot *sl = &L->slots[s];
        L->stats[CB_EC_HITS] += count[e];
        if (sl->prefetched) {
            L->stats[CB_EC_PREFETCH_HITS]++;
            sl->prefetched = 0;
        }
        touch(L, s, count[e]);
        L->step_slot[e] = s;
        order[n++] = e;
    }
    for (int32_t e = 0; e < ec->E; e++)
        if (count[e] > 0 && L->where[e] < 0) L->pending[e] = 1;
    /* misses in ascending id: each takes a victim holding no pending expert */
    for (int32_t e = 0; e < ec->E; e++) {
        if (!L->pending[e]) continue;
        int32_t s = victim(ec, L, L->pending, 0);
        /* S >= 1 and the pinned sets leave a slot free, and only pending experts are
         * excluded, e itself among them: s < 0 cannot happen */
        if (s < 0) s = 0;
        int32_t old = L->slots[s].expert;
        int needs_old = old >= 0 && L->step_slot[old] == s && count[old] > 0;
        assign(L, s, e, 0);
        L->pending[e] = 0;
        L->stats[CB_EC_MISSES]++;
        L->stats[CB_EC_HITS] += count[e] - 1;
        touch(L, s, count[e]);
        L->step_slot[e] = s;
        order[n++] = e;
        if (needs_old) { /* the old expert runs this step: read after it has */
            L->defer[L->n_defer++] = (ec_defer){s, e, old, 0};
        } else {
            start_load(ec, (int32_t)l, s, e, 1);
        }
    }
    /* step_slot of experts not needed this step must not look needed next time */
    return n;
}

int cb_ecache_wait(cb_ecache *ec, uint32_t l, const int32_t *order, const uint8_t *done, int n, int32_t *ready) {
    ec_layer *L = &ec->layers[l];
    int m = 0;
    pthread_mutex_lock(&ec->mu);
    for (;;) {
        for (int i = 0; i < n; i++)
            if (!done[i] && L->slots[L->step_slot[order[i]]].loaded == order[i]) ready[m++] = i;
        if (m > 0) break;
        pthread_cond_wait(&ec->ready_cv, &ec->mu);
    }
    pthread_mutex_unlock(&ec->mu);
    return m;
}

void cb_ecache_ran(cb_ecache *ec, uint32_t l, int32_t e) {
    ec_layer *L = &ec->layers[l];
    for (int32_t i = 0; i < L->n_defer; i++) {
        ec_defer *d = &L->defer[i];
        if (!d->started && d->after == e) {
            d->started = 1;
            start_load(ec, (int32_t)l, d->slot, d->expert, 1);
        }
    }
    L->step_slot[e] = -1;
}

void cb_ecache_view(const cb_ecache *ec, uint32_t l, int32_t e, const cb_ffn *src, uint32_t H, cb_ffn *view) {
    const ec_layer *L = &ec->layers[l];
    const uint8_t *mem = L->slots[L->step_slot[e]].mem;
    const uint8_t *p[EC_MAX_REGIONS];
    for (int k = 0; k < L->n_regions; k++) {
        uint64_t off = L->off[k] + (uint64_t)e * L->stride[k];
        p[k] = mem + ec->region_base[k] + off % EC_ALIGN;
    }
    *view = *src;
    if (src->packed) {
        view->packed = p[0];
    } else {
        view->gate = p[0];
        view->up = p[1];
        view->down = p[2];
    }
    if (src->gate_bias) view->gate_bias = src->gate_bias + (size_t)e * src->inter;
    if (src->up_bias) view->up_bias = src->up_bias + (size_t)e * src->inter;
    if (src->down_bias) view->down_bias = src->down_bias + (size_t)e * H;
}

colibri_status cb_ecache_pin(cb_ecache *ec, int32_t l, const int32_t *ids, int32_t n, char *err, size_t err_len) {
    if (l < 0 || l >= ec->n_layers || !ec->layers[l].ffn) {
        cb_set_err(err, err_len, "layer %d is not a MoE layer of this model", l);
        return COLIBRI_E_INVALID_ARG;
    }
    if (n < 0 || n >= ec->S || (n > 0 && !ids)) {
        cb_set_err(err, err_len, "%d pinned experts: a pinned set must leave at least one of the %d slots of a "
                   "layer free (at most %d)", n, ec->S, ec->S - 1);
        return COLIBRI_E_INVALID_ARG;
    }
    ec_layer *L = &ec->layers[l];
    for (int32_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= ec->E) {
            cb_set_err(err, err_len, "pinned expert %d of layer %d is not in [0, %d)", ids[i], l, ec->E);
            return COLIBRI_E_INVALID_ARG;
        }
        for (int32_t j = 0; j < i; j++)
            if (ids[j] == ids[i]) {
                cb_set_err(err, err_len, "pinned expert %d of layer %d is listed twice", ids[i], l);
                return COLIBRI_E_INVALID_ARG;
            }
    }
    flush_deferred(ec, (uint32_t)l);
    for (int32_t s = 0; s < ec->S; s++) L->slots[s].pinned = 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t e = ids[i], s = L->where[e];
        if (s < 0) {
            s = victim(ec, L, NULL, 0);
            assign(L, s, e, 0);
            touch(L, s, 0);
            start_load(ec, l, s, e, 1);
        }
        L->slots[s].pinned = 1;
    }
    return COLIBRI_OK;
}

void cb_ecache_buffers(cb_ecache *ec, int32_t **order, int32_t **ready, uint8_t **done) {
    *order = ec->order;
    *ready = ec->ready;
    *done = ec->done;
}

/* ---- facts --------------------------------------------------------------------------- */

int32_t cb_ecache_slots(const cb_ecache *ec) { return ec->S; }
int32_t cb_ecache_policy(const cb_ecache *ec) { return ec->policy; }
uint64_t cb_ecache_slot_bytes(const cb_ecache *ec) { return ec->slot_bytes; }
int cb_ecache_direct(const cb_ecache *ec) { return ec->fd_direct >= 0; }

int64_t cb_ecache_stat(const cb_ecache *ec, int32_t l, int stat) {
    if (stat < 0 || stat >= CB_EC_N_STATS) return 0;
    if (l >= 0) return l < ec->n_layers ? ec->layers[l].stats[stat] : 0;
    int64_t t = 0;
    for (int32_t i = 0; i < ec->n_layers; i++) t += ec->layers[i].stats[stat];
    return t;
}

uint64_t cb_ecache_bytes_read(const cb_ecache *ec) {
    pthread_mutex_lock((pthread_mutex_t *)&ec->mu);
    uint64_t b = ec->bytes_read;
    pthread_mutex_unlock((pthread_mutex_t *)&ec->mu);
    return b;
}

int cb_ecache_ranges(const cb_ecache *ec, uint64_t (*ranges)[2], int cap) {
    int n = 0;
    for (int32_t l = 0; l < ec->n_layers; l++) {
        const ec_layer *L = &ec->layers[l];
        if (!L->ffn) continue;
        for (int k = 0; k < L->n_regions; k++) {
            if (n < cap) {
                ranges[n][0] = L->off[k];
                ranges[n][1] = L->stride[k] * (uint64_t)ec->E;
            }
            n++;
        }
    }
    return n;
}

uint64_t cb_ecache_expert_bytes(const cb_ecache *ec) {
    uint64_t t = 0;
    for (int32_t l = 0; l < ec->n_layers; l++)
        for (int k = 0; k < ec->layers[l].n_regions; k++) t += ec->layers[l].stride[k] * (uint64_t)ec->E;
    return t;
}

/* ---- lifetime ------------------------------------------------------------------------ */

void cb_ecache_free(cb_ecache *ec) {
    if (!ec) return;
    if (ec->n_threads > 0) {
        pthread_mutex_lock(&ec->mu);
        ec->stop = 1;
        pthread_cond_broadcast(&ec->work_cv);
        pthread_mutex_unlock(&ec->mu);
        for (int i = 0; i < ec->n_threads; i++) pthread_join(ec->threads[i], NULL);
        pthread_cond_destroy(&ec->work_cv);
        pthread_cond_destroy(&ec->ready_cv);
        pthread_mutex_destroy(&ec->mu);
    }
    if (ec->layers)
        for (int32_t l = 0; l < ec->n_layers; l++) {
            ec_layer *L = &ec->layers[l];
            free(L->slots);
            free(L->where);
            free(L->lfu);
            free(L->step_slot);
            free(L->pending);
            free(L->defer);
        }
    free(ec->layers);
    free(ec->order);
    free(ec->ready);
    free(ec->done);
    free(ec->demand.q);
    free(ec->prefetch.q);
    if (ec->mem) munmap(ec->mem, (size_t)ec->mem_bytes);
    if (ec->fd_direct >= 0) close(ec->fd_direct);
    free(ec);
}

static colibri_status init_fail(cb_ecache *ec, colibri_status st) {
    cb_ecache_free(ec);
    return st;
}

colibri_status cb_ecache_init(colibri_ctx *ctx, const char *path, int64_t budget_mb, int32_t slots,
                              int32_t policy, cb_ecache **out, char *err, size_t err_len) {
    const cb_config *c = &ctx->cfg;
    *out = NULL;
    if (policy < COLIBRI_CACHE_LRU || policy > COLIBRI_CACHE_PREDICT) {
        cb_set_err(err, err_len, "invalid options: expert_cache_policy %d is none of COLIBRI_CACHE_LRU (0), _LFU "
                   "(1), _PINNED (2) and _PREDICT (3)", policy);
        return COLIBRI_E_INVALID_ARG;
    }
    cb_ecache *ec = calloc(1, sizeof *ec);
    if (!ec) {
        cb_set_err(err, err_len, "out of memory allocating the expert cache");
        return COLIBRI_E_NOMEM;
    }
    ec->map = ctx->map;
    ec->file_size = ctx->map_size;
    ec->fd = ctx->fd;
    ec->fd_direct = -1;
    ec->policy = policy;
    ec->n_layers = (int32_t)c->n_layers;
    ec->E = (int32_t)c->n_experts;
    ec->layers = calloc(c->n_layers ? c->n_layers : 1, sizeof *ec->layers);
    if (!ec->layers) {
        cb_set_err(err, err_len, "out of memory allocating the expert cache");
        return init_fail(ec, COLIBRI_E_NOMEM);
    }
    /* each MoE layer's expert regions; a slot fits the largest expert, each region from
     * an aligned base with room for its offset's misalignment */
    uint64_t cap[EC_MAX_REGIONS] = {0};
    int32_t n_moe = 0;
    for (uint32_t l = 0; l < c->n_layers; l++) {
        const cb_layer *W = &ctx->w.layers[l];
        ec_layer *L = &ec->layers[l];
        if (!W->moe) continue;
        const cb_ffn *f = &W->experts;
        L->ffn = f;
        n_moe++;
        if (f->packed) {
            L->n_regions = 1;
            L->off[0] = (uint64_t)((const uint8_t *)f->packed - ctx->map);
            L->stride[0] = L->len[0] = f->stride;
        } else {
            L->n_regions = 3;
            L->off[0] = (uint64_t)((const uint8_t *)f->gate - ctx->map);
            L->off[1] = (uint64_t)((const uint8_t *)f->up - ctx->map);
            L->off[2] = (uint64_t)((const uint8_t *)f->down - ctx->map);
            L->stride[0] = L->len[0] = L->stride[1] = L->len[1] = f->gu_stride;
            L->stride[2] = L->len[2] = f->down_stride;
        }
        for (int k = 0; k < L->n_regions; k++)
            if (round_up(L->len[k], EC_ALIGN) + EC_ALIGN > cap[k]) cap[k] = round_up(L->len[k], EC_ALIGN) + EC_ALIGN;
    }
    if (n_moe == 0) {
        cb_set_err(err, err_len, "expert_cache_mb: this model has no MoE layer, so no routed experts to cache");
        return init_fail(ec, COLIBRI_E_INVALID_ARG);
    }
    for (int k = 0; k < EC_MAX_REGIONS; k++) {
        ec->region_base[k] = ec->slot_bytes;
        ec->slot_bytes += cap[k];
    }
    uint64_t budget = (uint64_t)budget_mb << 20;
    uint64_t per_layer = slots > 0 ? (uint64_t)slots : budget / (uint64_t)n_moe / ec->slot_bytes;
    if (per_layer < 1) {
        uint64_t need = ((uint64_t)n_moe * ec->slot_bytes + (1u << 20) - 1) >> 20;
        cb_set_err(err, err_len, "expert_cache_mb %lld holds less than one expert per MoE layer: one slot is %.2f "
                   "MiB and the model has %d MoE layers; give at least %llu MiB (or 0 for no cache)",
                   (long long)budget_mb, (double)ec->slot_bytes / 1048576.0, n_moe, (unsigned long long)need);
        return init_fail(ec, COLIBRI_E_INVALID_ARG);
    }
    ec->S = per_layer > (uint64_t)ec->E ? ec->E : (int32_t)per_layer;
    ec->mem_bytes = (uint64_t)n_moe * (uint64_t)ec->S * ec->slot_bytes;
    void *m = mmap(NULL, (size_t)ec->mem_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                   -1, 0);
    if (m == MAP_FAILED) {
        cb_set_err(err, err_len, "cannot allocate the %.1f MiB expert cache: %s; lower expert_cache_mb",
                   (double)ec->mem_bytes / 1048576.0, strerror(errno));
        return init_fail(ec, COLIBRI_E_NOMEM);
    }
    ec->mem = m;
    (void)madvise(m, (size_t)ec->mem_bytes, MADV_HUGEPAGE);
    uint8_t *p = ec->mem;
    size_t E = (size_t)ec->E;
    for (int32_t l = 0; l < ec->n_layers; l++) {
        ec_layer *L = &ec->layers[l];
        if (!L->ffn) continue;
        L->slots = calloc((size_t)ec->S, sizeof *L->slots);
        L->where = malloc(E * sizeof *L->where);
        L->lfu = calloc(E, sizeof *L->lfu);
        L->step_slot = malloc(E * sizeof *L->step_slot);
        L->pending = calloc(E, 1);
        L->defer = calloc(E, sizeof *L->defer);
        if (!L->slots || !L->where || !L->lfu || !L->step_slot || !L->pending || !L->defer) {
            cb_set_err(err, err_len, "out of memory allocating the expert cache");
            return init_fail(ec, COLIBRI_E_NOMEM);
        }
        for (size_t e = 0; e < E; e++) L->where[e] = L->step_slot[e] = -1;
        for (int32_t s = 0; s < ec->S; s++) {
            L->slots[s] = (ec_slot){-1, -1, 0, 0, 0, 0, 0, p};
            p += ec->slot_bytes;
        }
    }
    int64_t qcap = (int64_t)n_moe * ec->S;
    ec->demand.q = malloc((size_t)qcap * sizeof(ec_req));
    ec->prefetch.q = malloc((size_t)qcap * sizeof(ec_req));
    if (!ec->demand.q || !ec->prefetch.q) {
        cb_set_err(err, err_len, "out of memory allocating the expert cache");
        return init_fail(ec, COLIBRI_E_NOMEM);
    }
    ec->demand.cap = ec->prefetch.cap = qcap;
    ec->order = malloc(E * sizeof *ec->order);
    ec->ready = malloc(E * sizeof *ec->ready);
    ec->done = calloc(E, 1);
    if (!ec->order || !ec->ready || !ec->done) {
        cb_set_err(err, err_len, "out of memory allocating the expert cache");
        return init_fail(ec, COLIBRI_E_NOMEM);
    }
    ec->fd_direct = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC); /* -1 where refused (tmpfs) */
    if (pthread_mutex_init(&ec->mu, NULL) != 0 || pthread_cond_init(&ec->work_cv, NULL) != 0 ||
        pthread_cond_init(&ec->ready_cv, NULL) != 0) {
        cb_set_err(err, err_len, "cannot create the expert cache's locks");
        return init_fail(ec, COLIBRI_E_NOMEM);
    }
    for (int i = 0; i < EC_IO_THREADS; i++) {
        int rc = pthread_create(&ec->threads[i], NULL, io_main, ec);
        if (rc != 0) {
            cb_set_err(err, err_len, "cannot start the expert cache's I/O threads: %s", strerror(rc));
            if (ec->n_threads == 0) {
                pthread_cond_destroy(&ec->work_cv);
                pthread_cond_destroy(&ec->ready_cv);
                pthread_mutex_destroy(&ec->mu);
            }
            return init_fail(ec, COLIBRI_E_NOMEM);
        }
        ec->n_threads++;
    }
    *out = ec;
    return COLIBRI_OK;
}
