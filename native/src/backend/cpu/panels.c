/*
 * panels.c — the panel copies of the BF16 weights (cpu/panel.h) and the interleaved copies of
 * the block-type ones (cpu/qpanel.h).
 *
 * A table whose kernels read a panel layout (its cb_panel_kernels: fast mode's avx512bf16
 * table, exact mode's avx512 table) gets, at load, a copy of every BF16 matrix and packed
 * expert it runs in that layout: the attention projections (not MLA's), the LM head and the
 * packed FFNs (routed experts, dense MLPs, shared experts). Decode then loads 16 rows' pair of
 * columns as one vector and streams each matrix once, where the row-major kernels transpose
 * 16 x 16 in registers per 16 rows and 32 columns (fast mode: the transposes, not memory,
 * bound a core's decode) or read 8 rows' streams at once (exact mode: slower than one
 * sequential stream of the same bytes). Measured by tools/kernel_bench.c; figures in
 * docs/kernels.md, "Panel copies" and "Exact panel copies". Same bits as the row-major kernels
 * (test_kernels), so results do not depend on whether the copy was made.
 *
 * A fast table whose int8 kernels read interleaved copies (cb_fast_kernels.qpanels: the
 * x86 tables) gets one of every matrix of a block type it multiplies whole (the
 * attention projections, MLA's but wkv_b, the LM head) and of the split FFNs' gate, up and
 * down ([E I, H], [E H, I]), where the rows come in whole groups of 8: a group's same four
 * bytes are one vector load, where the row-major kernels load 8 rows and transpose them
 * (docs/kernels.md, "Interleaved int8 copies").
 *
 * The copy is one anonymous mapping (2 MiB-aligned, transparent huge pages asked for), made by
 * the thread pool; the mapping's pages of what was copied are then dropped (MADV_DONTNEED:
 * they stay in the page cache, reclaimable, and fault back in if read). Like populate it reads
 * the whole file at load, so colibri.c makes it only when the weights are populated, and
 * never with an expert cache (a model larger than memory) or off the CPU. Everything here is
 * advisory: where the memory is refused, the engine runs the row-major kernels.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backend/cpu/cpu.h"
#include "core/threadpool.h"
#include "cpu/fast.h"
#include "model/family.h"

typedef struct pan_job {
    const cb_panel_kernels *pk; /* BF16 panels; NULL: an interleaved int8 copy (cpu/qpanel.h) */
    const void *src;
    uint8_t *dst;
    int64_t N, K;  /* a matrix [N, K]; N == 0: one packed expert of hidden K, intermediate I */
    int64_t I, B;
    uint32_t dt;   /* the int8 copy's block type */
} pan_job;

typedef struct pan_plan {
    colibri_ctx *ctx;
    pan_job *jobs;   /* NULL: count only */
    int64_t n_jobs;
    uint64_t bytes;
    int bf16, int8;  /* copies of each kind planned */
} pan_plan;

#define PAN_ALIGN 4096u

/* A job's place: its bytes (rounded to whole pages) reserved, and its job where the plan has a
 * destination. */
static uint8_t *plan_job(pan_plan *p, pan_job j, uint64_t n, uint8_t *base) {
    uint8_t *dst = base ? base + p->bytes : NULL;
    if (base) {
        j.dst = dst;
        p->jobs[p->n_jobs] = j;
    }
    p->n_jobs++;
    p->bytes += (n + PAN_ALIGN - 1) / PAN_ALIGN * PAN_ALIGN;
    return dst;
}

/* An int8 matrix [N, K] of dt (src: its row-major blocks): its interleaved copy, or NULL where
 * the fast table reads none or the matrix has no copy. */
static const void *plan_int8(pan_plan *p, const void *src, uint32_t dt, int64_t N, int64_t K, uint8_t *base) {
    if (!src || !p->ctx->qpan || !cb_qpanel_takes(dt, N, K)) return NULL;
    p->int8 = 1;
    return plan_job(p, (pan_job){NULL, src, NULL, N, K, 0, 0, dt}, (uint64_t)N * cb_qpanel_row_bytes(dt, (uint64_t)K),
                    base);
}

/* Reserve a matrix's copy: a BF16 panel copy or an int8 interleaved one. */
static void plan_mat(pan_plan *p, cb_mat *m, int64_t N, int64_t K, uint8_t *base) {
    if (!m->w) return;
    if (m->dt != COLIBRI_DTYPE_BF16) {
        const void *q = plan_int8(p, m->w, m->dt, N, K, base);
        if (base) m->qpan = q;
        return;
    }
    if (!p->ctx->pan || !cb_panel_takes(N, K)) return;
    p->bf16 = 1;
    uint8_t *d = plan_job(p, (pan_job){p->ctx->pan, m->w, NULL, N, K, 0, 0, 0}, (uint64_t)N * (uint64_t)K * 2u, base);
    if (base) m->pan = d;
}

/* A packed BF16 FFN of E experts: one job per expert, the copy's experts at the same stride;
 * a split int8 FFN: its gate, up [E I, H] and down [E H, I] as matrices. */
static void plan_ffn(pan_plan *p, cb_ffn *f, int64_t E, uint8_t *base) {
    int64_t H = p->ctx->cfg.hidden, I = f->inter;
    if (f->gate && !f->packed) {
        int ok = f->gu_stride == cb_row_bytes(f->dt, (uint64_t)H) * (uint64_t)I &&
                 f->down_stride == cb_row_bytes(f->down_dt, (uint64_t)I) * (uint64_t)H;
        const void *g = ok ? plan_int8(p, f->gate, f->dt, E * I, H, base) : NULL;
        const void *u = ok ? plan_int8(p, f->up, f->dt, E * I, H, base) : NULL; /* with gate's, as both */
        const void *d = ok ? plan_int8(p, f->down, f->down_dt, E * H, I, base) : NULL;
        if (base) f->gate_q = g, f->up_q = u, f->down_q = d;
        return;
    }
    if (!p->ctx->pan || !f->packed || f->dt != COLIBRI_DTYPE_BF16 || !cb_panel_takes_expert(p->ctx->pan, H, I) ||
        f->stride != (uint64_t)(3 * I * H * 2))
        return;
    p->bf16 = 1;
    uint8_t *first = NULL;
    for (int64_t e = 0; e < E; e++) { /* the experts' pages rounded up together: one reservation */
        pan_job j = {p->ctx->pan, (const uint8_t *)f->packed + (size_t)e * f->stride, NULL, 0, H, I, p->ctx->cfg.block_size, 0};
        if (base) {
            j.dst = base + p->bytes + (size_t)e * f->stride;
            p->jobs[p->n_jobs] = j;
            if (e == 0) first = j.dst;
        }
        p->n_jobs++;
    }
    p->bytes += ((uint64_t)E * f->stride + PAN_ALIGN - 1) / PAN_ALIGN * PAN_ALIGN;
    if (base) f->pan = first;
}

/* Every copy, in one order for the count (base NULL) and the assignment. */
static void plan_all(pan_plan *p, uint8_t *base) {
    colibri_ctx *ctx = p->ctx;
    const cb_config *c = &ctx->cfg;
    int64_t H = c->hidden, Nq = (int64_t)c->n_heads * c->head_dim, Nkv = (int64_t)c->n_kv_heads * c->head_dim;
    for (uint32_t l = 0; l < c->n_layers; l++) {
        cb_layer *L = &ctx->w.layers[l];
        if (c->attention != CB_ATTN_MLA) {
            plan_mat(p, &L->wq, Nq, H, base);
            plan_mat(p, &L->wk, Nkv, H, base);
            plan_mat(p, &L->wv, Nkv, H, base);
            plan_mat(p, &L->wo, H, Nq, base);
        } else { /* the projections MLA multiplies as whole matrices (not wkv_b: mla.c reads its rows) */
            int64_t ql = c->q_lora_rank, Dq = (int64_t)c->qk_nope_dim + c->head_dim;
            int64_t Dc = (int64_t)c->kv_lora_rank + c->head_dim;
            if (ql) {
                plan_mat(p, &L->wq_a, ql, H, base);
                plan_mat(p, &L->wq_b, (int64_t)c->n_heads * Dq, ql, base);
            } else {
                plan_mat(p, &L->wq, (int64_t)c->n_heads * Dq, H, base);
            }
            plan_mat(p, &L->wkv_a, Dc, H, base);
            plan_mat(p, &L->wo, H, (int64_t)c->n_heads * c->v_head_dim, base);
        }
        if (L->moe) plan_ffn(p, &L->experts, c->n_experts, base);
        else plan_ffn(p, &L->dense, 1, base);
        if (L->has_shared) plan_ffn(p, &L->shared, 1, base);
    }
    plan_mat(p, &ctx->w.lm_head, c->vocab, H, base);
}

uint64_t cb_panels_bytes(colibri_ctx *ctx) {
    if ((!ctx->pan && !ctx->qpan) || ctx->ecache) return 0;
    pan_plan p = {ctx, NULL, 0, 0, 0, 0};
    plan_all(&p, NULL);
    return p.bytes;
}

static void pack_chunk(void *arg, int64_t c, int tid) {
    (void)tid;
    const pan_job *j = &((const pan_job *)arg)[c];
    if (!j->pk) cb_qpanel_pack(j->dst, j->src, j->dt, j->N, j->K);
    else if (j->N) cb_panel_pack_matrix(j->pk, j->dst, j->src, j->N, j->K);
    else cb_panel_pack_expert(j->pk, j->dst, j->src, j->K, j->I, j->B);
}

/* The mapping's whole pages inside [p, p + n): no longer read (the copy is). */
static void drop_pages(const void *p, uint64_t n) {
    long pg = sysconf(_SC_PAGESIZE);
    uintptr_t page = pg > 0 ? (uintptr_t)pg : 4096u;
    uintptr_t a = ((uintptr_t)p + page - 1) & ~(page - 1), e = ((uintptr_t)p + n) & ~(page - 1);
    if (e > a) (void)madvise((void *)a, e - a, MADV_DONTNEED);
}

void cb_panels_make(colibri_ctx *ctx, uint64_t bytes) {
    const size_t huge = (size_t)2 << 20;
    size_t size = (size_t)bytes + huge;
    uint8_t *r = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (r == MAP_FAILED) return;
    uint8_t *base = (uint8_t *)(((uintptr_t)r + huge - 1) & ~(uintptr_t)(huge - 1));
#ifdef MADV_HUGEPAGE
    (void)madvise(base, (size_t)bytes, MADV_HUGEPAGE);
#endif
    pan_plan count = {ctx, NULL, 0, 0, 0, 0};
    plan_all(&count, NULL);
    pan_job *jobs = malloc((size_t)count.n_jobs * sizeof *jobs);
    if (!jobs) {
        munmap(r, size);
        return;
    }
    pan_plan p = {ctx, jobs, 0, 0, 0, 0};
    plan_all(&p, base); /* sets the pointers: the copies are made before any forward runs */
    cb_pool_run(ctx->pool, pack_chunk, jobs, p.n_jobs);
    for (int64_t i = 0; i < p.n_jobs; i++) {
        const pan_job *j = &jobs[i];
        if (j->src == ctx->w.tok_embd.w) continue; /* a tied LM head: the embedding lookups read it */
        drop_pages(j->src, !j->pk ? (uint64_t)j->N * cb_row_bytes(j->dt, (uint64_t)j->K)
                           : j->N ? (uint64_t)j->N * (uint64_t)j->K * 2u
                                  : (uint64_t)3 * (uint64_t)j->I * (uint64_t)j->K * 2u);
    }
    free(jobs);
    (void)mprotect(base, (size_t)bytes, PROT_READ);
    ctx->panels = r;
    ctx->panels_size = size;
    ctx->panels_bf16 = p.bf16;
    ctx->panels_int8 = p.int8;
}
