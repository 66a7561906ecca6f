/*
 * colibri.c — the public API (colibri.h): init/free, accessors, forward entry points and
 * verification. The work is done in format/ (reading and validating the file), model/
 * (the arena plan and the forward pass), cpu/ (the kernels) and sampler.c; this file
 * checks arguments and owns the lifetime of the mapping, the arena, the thread pool and
 * the tokenizer. Errors are reported through core/error.h.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/context.h"
#include "core/error.h"
#include "core/trace.h"
#include "cpu/registry.h"
#include "tokenizer/tokenizer.h"

/* "colibri 0.1.0 (format F, abi A)", F and A taken from colibri.h */
#define CB_STR_(x) #x
#define CB_STR(x) CB_STR_(x)
#define COLIBRI_VERSION_STRING \
    "colibri 0.1.0 (format " CB_STR(COLIBRI_FORMAT_VERSION) ", abi " CB_STR(COLIBRI_ABI_VERSION) ")"

int colibri_abi_version(void) { return COLIBRI_ABI_VERSION; }

const char *colibri_version_string(void) { return COLIBRI_VERSION_STRING; }

void colibri_options_init(colibri_options *opt) {
    if (!opt) return;
    memset(opt, 0, sizeof *opt);
    opt->struct_size = (uint32_t)sizeof *opt;
    opt->num_threads = 0;
    opt->max_seq_len = 0;
    opt->max_batch = 0;
    opt->populate = COLIBRI_POPULATE_AUTO;
    opt->expert_cache_policy = COLIBRI_CACHE_LRU;
    opt->expert_cache_mb = 0;
    opt->group_pad = 1;
    opt->verify_checksums = 0;
    opt->precision = COLIBRI_PRECISION_EXACT;
    opt->prefix_cache = 1;
}

colibri_status colibri_init(const char *path, colibri_ctx **out) {
    return colibri_init_ex(path, NULL, out, NULL, 0);
}

void colibri_free(colibri_ctx *ctx) {
    if (!ctx) return;
    if (ctx->trace) ctx->trace->owner = NULL; /* the trace outlives its context */
    cb_iv_free(ctx);
    if (ctx->be && ctx->be->free) ctx->be->free(ctx); /* before the arena and the mapping it reads */
    cb_pool_free(ctx->pool);
    cb_ecache_free(ctx->ecache); /* before the mapping and the file it reads */
    if (ctx->tok) {
        if (ctx->tok_loaded) cb_tokenizer_unload(ctx->tok);
        free(ctx->tok);
    }
    free(ctx->chat_template);
    free(ctx->arena);
    free(ctx->w.layers);
    cb_file_free(&ctx->file);
    if (ctx->panels) munmap(ctx->panels, ctx->panels_size);
    if (ctx->map) munmap((void *)ctx->map, (size_t)ctx->map_size);
    if (ctx->fd >= 0) close(ctx->fd);
    free(ctx);
}

static colibri_status init_fail(colibri_ctx *ctx, colibri_status st, char *err, size_t err_len) {
    colibri_free(ctx);
    (void)err;
    (void)err_len;
    return st;
}

/* What this process's memory cgroup still lets it hold (limit - usage; v2 memory.max /
 * memory.current, or v1 memory.limit_in_bytes / memory.usage_in_bytes), or UINT64_MAX when
 * it sets no limit or none can be read. A container's page cache counts against its limit,
 * so a file under half of the host's memory can still be larger than the container's. */
static int read_u64_file(const char *dir, const char *name, uint64_t *out) {
    char path[640];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "re");
    if (!f) return 0;
    unsigned long long v = 0;
    int ok = fscanf(f, "%llu", &v) == 1;
    fclose(f);
    if (ok) *out = (uint64_t)v;
    return ok;
}

static uint64_t cgroup_room(void) {
    FILE *f = fopen("/proc/self/cgroup", "re");
    if (!f) return UINT64_MAX;
    char line[512], dir[600];
    uint64_t room = UINT64_MAX;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        char *path = NULL;
        const char *base = NULL, *lim = NULL, *use = NULL;
        if (strncmp(line, "0::", 3) == 0) { /* v2 */
            path = line + 3;
            base = "/sys/fs/cgroup";
            lim = "memory.max";
            use = "memory.current";
        } else {
            char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
            if (!c2) continue;
            *c2 = 0;
            if (!strstr(c1 + 1, "memory")) continue; /* v1: the memory controller's line */
            path = c2 + 1;
            base = "/sys/fs/cgroup/memory";
            lim = "memory.limit_in_bytes";
            use = "memory.usage_in_bytes";
        }
        uint64_t l = 0, u = 0;
        snprintf(dir, sizeof dir, "%s%s", base, path);
        if (read_u64_file(dir, lim, &l) && read_u64_file(dir, use, &u) && l < ((uint64_t)1 << 62)) {
            uint64_t r = l > u ? l - u : 0;
            if (r < room) room = r;
        }
    }
    fclose(f);
    return room;
}

/* populate = COLIBRI_POPULATE_AUTO: pre-fault a file smaller than half of the memory the
 * kernel says is available (MemAvailable in /proc/meminfo; elsewhere the free pages; less
 * when the memory cgroup leaves less), so a plain load takes the benchmark's path, while a
 * model larger than that is faulted in on demand (MAP_POPULATE of a file larger than RAM would only evict its own first pages). */
static int populate_auto(uint64_t size) {
    uint64_t avail = 0;
    FILE *f = fopen("/proc/meminfo", "re");
    if (f) {
        char line[128];
        unsigned long long kb;
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) {
                avail = (uint64_t)kb * 1024;
                break;
            }
        fclose(f);
    }
#if defined(_SC_AVPHYS_PAGES) && defined(_SC_PAGESIZE)
    if (avail == 0) {
        long pages = sysconf(_SC_AVPHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
        if (pages > 0 && psz > 0) avail = (uint64_t)pages * (uint64_t)psz;
    }
#endif
    uint64_t room = cgroup_room();
    if (room < avail) avail = room;
    return size < avail / 2;
}

/* Fault in [p, p + n) of the mapping (MADV_POPULATE_READ; older kernels: touch each page). */
static void prefault(const void *p, size_t n) {
    int done = 0;
#ifdef MADV_POPULATE_READ
    done = madvise((void *)p, n, MADV_POPULATE_READ) == 0;
#endif
    if (!done) {
        volatile const uint8_t *b = (const uint8_t *)p;
        uint8_t sink = 0;
        for (size_t i = 0; i < n; i += 4096) sink ^= b[i];
        (void)sink;
    }
}

/* The file's bytes outside the expert cache's ranges (all of it without a cache). */
static uint64_t dense_bytes(const colibri_ctx *ctx) {
    uint64_t e = ctx->ecache ? cb_ecache_expert_bytes(ctx->ecache) : 0;
    return ctx->map_size > e ? ctx->map_size - e : 0;
}

static int range_cmp(const void *a, const void *b) {
    const uint64_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0];
}

/* Pre-fault the mapping but for the cached experts' ranges (whole pages strictly inside a
 * range are left out), a range of pages at a time. */
static void populate_dense(colibri_ctx *ctx) {
    int n = cb_ecache_ranges(ctx->ecache, NULL, 0);
    uint64_t (*r)[2] = malloc((size_t)(n + 1) * sizeof *r);
    if (!r) return; /* advisory: pages then fault in on first use */
    n = cb_ecache_ranges(ctx->ecache, r, n);
    qsort(r, (size_t)n, sizeof *r, range_cmp);
    long pg = sysconf(_SC_PAGESIZE);
    uint64_t page = pg > 0 ? (uint64_t)pg : 4096, at = 0;
    for (int i = 0; i <= n; i++) {
        uint64_t end = i < n ? (r[i][0] + page - 1) / page * page : ctx->map_size;
        if (end > at) prefault(ctx->map + at, (size_t)(end - at));
        if (i < n) {
            uint64_t next = (r[i][0] + r[i][1]) / page * page;
            if (next > at) at = next;
        }
    }
    free(r);
}

/* Map the whole file read-only at a 2 MiB-aligned address, and ask for transparent huge
 * pages. Decode streams about half a gigabyte of weights per token from this mapping: with
 * 4 KiB pages every 4 KiB costs a TLB miss (a two-level page walk under a hypervisor), a
 * measurable share of decode time (docs/performance.md, "Load path and knobs"). The kernel
 * maps a page-cache folio of 2 MiB with one PMD entry when the virtual address is 2 MiB-aligned
 * with its file offset, and with MADV_HUGEPAGE it reads uncached parts of the file in 2 MiB
 * folios. Both requests are advisory: where they fail, the mapping works with small pages.
 * populate pre-faults the whole file (after the advice, so that the faults already use huge
 * folios). */
static void *map_weights(int fd, size_t size, int populate) {
    const size_t huge = (size_t)2 << 20;
    void *m = MAP_FAILED;
    if (size <= SIZE_MAX - huge) {
        uint8_t *r = mmap(NULL, size + huge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (r != MAP_FAILED) {
            uint8_t *a = (uint8_t *)(((uintptr_t)r + huge - 1) & ~(uintptr_t)(huge - 1));
            m = mmap(a, size, PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0);
            if (m == MAP_FAILED) {
                munmap(r, size + huge);
            } else { /* return the unused head and tail of the reservation */
                size_t tail_off = ((size_t)(a - r) + size + 4095) & ~(size_t)4095;
                if (a > r) munmap(r, (size_t)(a - r));
                if (tail_off < size + huge) munmap(r + tail_off, size + huge - tail_off);
            }
        }
    }
    if (m == MAP_FAILED) m = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) return m;
#ifdef MADV_HUGEPAGE
    (void)madvise(m, size, MADV_HUGEPAGE);
#endif
    if (populate) prefault(m, size);
    return m;
}

colibri_status colibri_init_ex(const char *path, const colibri_options *opt_in,
                               colibri_ctx **out, char *err, size_t err_len) {
    if (err && err_len) err[0] = 0;
    if (out) *out = NULL;
    if (!path || !out) {
        cb_set_err(err, err_len, "colibri_init: path and out must not be NULL");
        return COLIBRI_E_INVALID_ARG;
    }
    {
        const uint16_t one = 1;
        if (*(const uint8_t *)&one != 1) {
            cb_set_err(err, err_len, "this host is big-endian; .colibri files are little-endian and this "
                       "build reads them only on little-endian hosts");
            return COLIBRI_E_UNSUPPORTED;
        }
    }
    colibri_options opt;
    colibri_options_init(&opt);
    if (opt_in) {
        if (opt_in->struct_size != sizeof(colibri_options)) {
            cb_set_err(err, err_len, "colibri_options.struct_size is %u but this library expects %u; "
                       "fill the options with colibri_options_init from the same colibri.h",
                       opt_in->struct_size, (unsigned)sizeof(colibri_options));
            return COLIBRI_E_INVALID_ARG;
        }
        opt = *opt_in;
    }
    if (opt.precision != COLIBRI_PRECISION_EXACT && opt.precision != COLIBRI_PRECISION_FAST) {
        cb_set_err(err, err_len, "invalid options: precision %d is neither COLIBRI_PRECISION_EXACT (0) nor "
                   "COLIBRI_PRECISION_FAST (1)", opt.precision);
        return COLIBRI_E_INVALID_ARG;
    }
    if (opt.prefix_cache != 0 && opt.prefix_cache != 1) {
        cb_set_err(err, err_len, "invalid options: prefix_cache %d must be 1 (on) or 0 (off)", opt.prefix_cache);
        return COLIBRI_E_INVALID_ARG;
    }
    if (opt.backend != COLIBRI_BACKEND_CPU && opt.backend != COLIBRI_BACKEND_CUDA) {
        cb_set_err(err, err_len, "invalid options: backend %d is neither COLIBRI_BACKEND_CPU (0) nor "
                   "COLIBRI_BACKEND_CUDA (1)", opt.backend);
        return COLIBRI_E_INVALID_ARG;
    }
    if (!(opt.gpu_memory_fraction >= 0.0 && opt.gpu_memory_fraction <= 1.0) || opt.gpu_device < 0) {
        cb_set_err(err, err_len, "invalid options: gpu_memory_fraction %g must be in (0, 1] (0: the default, 0.9) "
                   "and gpu_device %d >= 0", opt.gpu_memory_fraction, opt.gpu_device);
        return COLIBRI_E_INVALID_ARG;
    }
    const cb_backend *be = cb_backend_find(opt.backend == COLIBRI_BACKEND_CUDA ? "cuda" : "cpu", err, err_len);
    if (!be) return COLIBRI_E_UNSUPPORTED;
    if (opt.populate < COLIBRI_POPULATE_AUTO || opt.populate > 1) {
        cb_set_err(err, err_len, "invalid options: populate %d is none of COLIBRI_POPULATE_AUTO (-1, the "
                   "default), 0 (off) and 1 (on)", opt.populate);
        return COLIBRI_E_INVALID_ARG;
    }
    if (opt.num_threads < 0 || opt.max_seq_len < 0 || opt.max_batch < 0 || opt.group_pad < 0 ||
        opt.group_pad > 4096) {
        cb_set_err(err, err_len, "invalid options: num_threads %d, max_seq_len %lld, max_batch %lld and "
                   "group_pad %d must be >= 0 (group_pad <= 4096); 0 means the default",
                   opt.num_threads, (long long)opt.max_seq_len, (long long)opt.max_batch, opt.group_pad);
        return COLIBRI_E_INVALID_ARG;
    }

    colibri_ctx *ctx = calloc(1, sizeof *ctx);
    if (!ctx) {
        cb_set_err(err, err_len, "out of memory allocating the context");
        return COLIBRI_E_NOMEM;
    }
    ctx->fd = -1;
    ctx->be = be;
    ctx->kern = cb_kernels_best();
    ctx->precision = opt.precision;
    ctx->fast = opt.precision == COLIBRI_PRECISION_FAST ? cb_fast_best() : NULL;
    ctx->pan = ctx->fast ? ctx->fast->panels : ctx->kern->panels;
    ctx->qpan = ctx->fast ? ctx->fast->qpanels : NULL;

    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        cb_set_err(err, err_len, "cannot open '%s': %s", path, strerror(errno));
        return init_fail(ctx, COLIBRI_E_IO, err, err_len);
    }
    ctx->fd = fd;
    struct stat stt;
    if (fstat(fd, &stt) != 0) {
        cb_set_err(err, err_len, "cannot stat '%s': %s", path, strerror(errno));
        return init_fail(ctx, COLIBRI_E_IO, err, err_len);
    }
    if (S_ISDIR(stt.st_mode)) {
        cb_set_err(err, err_len, "'%s' is a directory, not a .colibri file; pass the path of the file", path);
        return init_fail(ctx, COLIBRI_E_IO, err, err_len);
    }
    if (!S_ISREG(stt.st_mode)) {
        cb_set_err(err, err_len, "'%s' is not a regular file; pass the path of a .colibri file", path);
        return init_fail(ctx, COLIBRI_E_IO, err, err_len);
    }
    if (stt.st_size <= 0) {
        cb_set_err(err, err_len, "'%s' is empty (0 bytes), not a .colibri file; re-convert the model "
                   "with colibri-convert", path);
        return init_fail(ctx, COLIBRI_E_FORMAT, err, err_len);
    }
    if ((uint64_t)stt.st_size > (uint64_t)SIZE_MAX) {
        cb_set_err(err, err_len, "'%s' is too large to map on this machine", path);
        return init_fail(ctx, COLIBRI_E_IO, err, err_len);
    }
    if (opt.expert_cache_mb < 0 || opt.expert_cache_slots < 0 || (opt.expert_cache_mb > 0 && opt.expert_cache_slots > 0)) {
        cb_set_err(err, err_len, "invalid options: expert_cache_mb %lld and expert_cache_slots %d must be >= 0 and "
                   "not both set (0 and 0: no expert cache)", (long long)opt.expert_cache_mb, opt.expert_cache_slots);
        return init_fail(ctx, COLIBRI_E_INVALID_ARG, err, err_len);
    }
    int cache = opt.expert_cache_mb > 0 || opt.expert_cache_slots > 0;
    /* with an expert cache the routed experts are read, never faulted in: the dense part is
     * pre-faulted after the load, when the populate choice is known to be about it */
    int populate_all = cache ? 0
                       : opt.populate == COLIBRI_POPULATE_AUTO ? populate_auto((uint64_t)stt.st_size)
                                                               : opt.populate;
    void *m = map_weights(fd, (size_t)stt.st_size, populate_all);
    if (m == MAP_FAILED) {
        cb_set_err(err, err_len, "cannot map '%s' (%lld bytes): %s", path, (long long)stt.st_size,
                   strerror(errno));
        return init_fail(ctx, COLIBRI_E_IO, err, err_len);
    }
    ctx->map = m;
    ctx->map_size = (uint64_t)stt.st_size;

    colibri_status st = cb_model_load(&ctx->file, &ctx->cfg, &ctx->w, ctx->map, ctx->map_size, path, err,
                                     err_len);
    if (st != COLIBRI_OK) return init_fail(ctx, st, err, err_len);

    /* run settings */
    const cb_config *c = &ctx->cfg;
    int64_t file_max = (int64_t)c->file_max_seq_len;
    if (opt.max_seq_len == 0) {
        ctx->max_seq_len = file_max < 4096 ? file_max : 4096;
    } else if (opt.max_seq_len > file_max) {
        cb_set_err(err, err_len, "max_seq_len %lld exceeds the %lld positions '%s' was converted for; "
                   "use at most %lld or re-convert with a larger --max-seq-len",
                   (long long)opt.max_seq_len, (long long)file_max, path, (long long)file_max);
        return init_fail(ctx, COLIBRI_E_INVALID_ARG, err, err_len);
    } else {
        ctx->max_seq_len = opt.max_seq_len;
    }
    if (opt.max_batch == 0) ctx->max_batch = ctx->max_seq_len < 512 ? ctx->max_seq_len : 512;
    else ctx->max_batch = opt.max_batch < ctx->max_seq_len ? opt.max_batch : ctx->max_seq_len;
    ctx->group_pad = opt.group_pad == 0 ? 1 : opt.group_pad;
    if (opt.max_seqs < 0 || opt.max_seqs > 4096 || opt.kv_block_tokens < 0 || opt.kv_block_tokens > 4096 ||
        opt.kv_tokens < 0) {
        cb_set_err(err, err_len, "invalid options: max_seqs %d and kv_block_tokens %d must be in [0, 4096] and "
                   "kv_tokens %lld >= 0; 0 means the default", opt.max_seqs, opt.kv_block_tokens,
                   (long long)opt.kv_tokens);
        return init_fail(ctx, COLIBRI_E_INVALID_ARG, err, err_len);
    }
    ctx->max_seqs = opt.max_seqs == 0 ? 1 : opt.max_seqs;
    ctx->kv_block_tokens = opt.kv_block_tokens == 0 ? 32 : opt.kv_block_tokens;
    /* every sequence can reach max_seq_len unless the caller budgets the pool smaller */
    ctx->kv_tokens = opt.kv_tokens == 0 ? ctx->max_seq_len * ctx->max_seqs : opt.kv_tokens;
    ctx->prefix_cache = opt.prefix_cache;
    if (cache) {
        st = cb_ecache_init(ctx, path, opt.expert_cache_mb, opt.expert_cache_slots, opt.expert_cache_policy,
                            &ctx->ecache, err, err_len);
        if (st != COLIBRI_OK) return init_fail(ctx, st, err, err_len);
        if (opt.populate == COLIBRI_POPULATE_AUTO) opt.populate = populate_auto(dense_bytes(ctx));
        if (opt.populate) populate_dense(ctx);
    } else {
        opt.populate = populate_all;
    }
    ctx->populate = opt.populate;
    if (opt.num_threads == 0) ctx->num_threads = cb_physical_cores(); /* core/threadpool.c */
    else ctx->num_threads = opt.num_threads > 1024 ? 1024 : opt.num_threads;

    st = cb_scratch_init(ctx, err, err_len);
    if (st != COLIBRI_OK) return init_fail(ctx, st, err, err_len);
    int prc = cb_pool_create(&ctx->pool, ctx->num_threads);
    if (prc != 0) {
        cb_set_err(err, err_len, "cannot start %d threads: %s; pass a smaller num_threads",
                   (int)ctx->num_threads, strerror(prc));
        return init_fail(ctx, COLIBRI_E_NOMEM, err, err_len);
    }
    if (be == &cb_backend_cpu && ctx->populate) { /* read at load anyway: the panel copies (backend/cpu/panels.c) */
        uint64_t pb = cb_panels_bytes(ctx);
        if (pb > 0 && populate_auto(pb)) cb_panels_make(ctx, pb);
    }
    if (!ctx->fast) /* the tables, and in fast mode which of its paths run */
        snprintf(ctx->kernels_desc, sizeof ctx->kernels_desc, "%s%s", ctx->kern->name, ctx->panels ? " panels" : "");
    else
        snprintf(ctx->kernels_desc, sizeof ctx->kernels_desc, "%s fast(int8 %s%s, bf16 %s%s%s)", ctx->kern->name,
                 ctx->fast->name, ctx->panels_int8 ? " panels" : "", ctx->fast->bf16, ctx->panels_bf16 ? " panels" : "",
                 ctx->s.att_work_bytes ? ", attention avx512" : "");
    ctx->run.stage = -1; /* no stage run active */
    ctx->run.layer = -1;
    if (be->init) {
        cb_backend_request req = {opt.gpu_memory_fraction > 0.0 ? opt.gpu_memory_fraction : 0.9, opt.gpu_device};
        st = be->init(ctx, &req, err, err_len);
        if (st != COLIBRI_OK) return init_fail(ctx, st, err, err_len);
    }
    {
        cb_backend_facts f;
        be->facts(ctx, &f);
        snprintf(ctx->backend_device, sizeof ctx->backend_device, "%s", f.device);
    }

    const cb_section *ts = &c->sections[CB_SEC_TOK];
    if (ts->size > 0) {
        ctx->tok = calloc(1, cb_tokenizer_struct_size());
        if (!ctx->tok) {
            cb_set_err(err, err_len, "out of memory allocating the tokenizer");
            return init_fail(ctx, COLIBRI_E_NOMEM, err, err_len);
        }
        char terr[CB_ERR_LEN] = {0};
        st = cb_tokenizer_load(ctx->tok, ctx->map + ts->offset, ts->size, 1, terr, sizeof terr);
        if (st != COLIBRI_OK) {
            cb_set_err(err, err_len, "'%s': %s", path, terr);
            return init_fail(ctx, st, err, err_len);
        }
        ctx->tok_loaded = 1;
    }
    /* a NUL-terminated copy of the chat template, for colibri_get_string */
    ctx->chat_template = malloc((size_t)c->chat_template_len + 1);
    if (!ctx->chat_template) {
        cb_set_err(err, err_len, "out of memory copying the chat template");
        return init_fail(ctx, COLIBRI_E_NOMEM, err, err_len);
    }
    if (c->chat_template_len) memcpy(ctx->chat_template, c->chat_template, (size_t)c->chat_template_len);
    ctx->chat_template[c->chat_template_len] = 0;
    if (opt.verify_checksums) {
        st = cb_file_verify(&ctx->file, ctx->err, sizeof ctx->err);
        if (st != COLIBRI_OK) {
            cb_set_err(err, err_len, "%s", ctx->err);
            return init_fail(ctx, st, err, err_len);
        }
    }
    *out = ctx;
    return COLIBRI_OK;
}

colibri_status colibri_expert_cache_pin(colibri_ctx *ctx, int32_t layer, const int32_t *ids, int32_t n) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    if (!ctx->ecache)
        return cb_fail(ctx, COLIBRI_E_UNSUPPORTED, "colibri_expert_cache_pin: this context has no expert cache "
                       "(open it with expert_cache_mb > 0)");
    char err[CB_ERR_LEN];
    colibri_status st = cb_ecache_pin(ctx->ecache, layer, ids, n, err, sizeof err);
    if (st != COLIBRI_OK) return cb_fail(ctx, st, "colibri_expert_cache_pin: %s", err);
    ctx->run.stage = -1; /* a stage run in progress is abandoned */
    return COLIBRI_OK;
}

const char *colibri_last_error(const colibri_ctx *ctx) {
    if (!ctx) return "no context (NULL)";
    return ctx->err;
}

colibri_status colibri_forward_at(colibri_ctx *ctx, const int32_t *input_ids, int64_t n_tokens,
                                  int64_t start_pos, float *logits) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    if (!input_ids || !logits)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_forward: input_ids and logits must not be NULL");
    if (n_tokens <= 0)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_forward: n_tokens is %lld; pass at least one token",
                       (long long)n_tokens);
    if (start_pos < 0)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_forward_at: start_pos %lld is negative",
                       (long long)start_pos);
    ctx->run.stage = -1; /* a forward abandons any unfinished stage run */
    return cb_forward(ctx, input_ids, n_tokens, start_pos, logits, 0);
}

colibri_status colibri_forward_last(colibri_ctx *ctx, const int32_t *input_ids, int64_t n_tokens,
                                    int64_t start_pos, float *logits) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    if (!input_ids || !logits)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_forward_last: input_ids and logits must not be NULL");
    if (n_tokens <= 0 || start_pos < 0)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_forward_last: n_tokens %lld must be >= 1 and "
                       "start_pos %lld >= 0", (long long)n_tokens, (long long)start_pos);
    ctx->run.stage = -1;
    return cb_forward(ctx, input_ids, n_tokens, start_pos, logits, 1);
}

colibri_status colibri_forward(colibri_ctx *ctx, const int32_t *input_ids, int64_t n_tokens,
                               float *logits) {
    return colibri_forward_at(ctx, input_ids, n_tokens, 0, logits);
}

int64_t colibri_cached_len(const colibri_ctx *ctx) { return ctx ? ctx->sess.kv.len[0] : 0; }

colibri_status colibri_batch(colibri_ctx *ctx, const colibri_batch_entry *entries, int64_t n, float *logits) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    ctx->run.stage = -1; /* a forward abandons any unfinished stage run */
    return cb_batch(ctx, entries, n, logits);
}

colibri_status colibri_batch_logprobs(colibri_ctx *ctx, const colibri_batch_entry *entries, int64_t n,
                                      const int32_t *targets, float *logprobs) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    ctx->run.stage = -1; /* a forward abandons any unfinished stage run */
    return cb_batch_logprobs(ctx, entries, n, targets, logprobs);
}

int64_t colibri_seq_len(const colibri_ctx *ctx, int32_t seq) {
    if (!ctx || seq < 0 || seq >= ctx->max_seqs) return -1;
    return ctx->sess.kv.len[seq];
}

static colibri_status check_seq(colibri_ctx *ctx, const char *fn, int32_t seq) {
    if (seq < 0 || seq >= ctx->max_seqs)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "%s: sequence %d is not in [0, %d); open the context with a "
                       "larger colibri_options.max_seqs", fn, seq, ctx->max_seqs);
    return COLIBRI_OK;
}

colibri_status colibri_seq_clear(colibri_ctx *ctx, int32_t seq) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    colibri_status st = check_seq(ctx, "colibri_seq_clear", seq);
    if (st != COLIBRI_OK) return st;
    ctx->run.stage = -1;
    cb_kv_truncate(&ctx->sess.kv, seq, 0);
    return COLIBRI_OK;
}

colibri_status colibri_seq_truncate(colibri_ctx *ctx, int32_t seq, int64_t len) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    colibri_status st = check_seq(ctx, "colibri_seq_truncate", seq);
    if (st != COLIBRI_OK) return st;
    if (len < 0 || len > ctx->sess.kv.len[seq])
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_seq_truncate: length %lld is not in [0, %lld] "
                       "(sequence %d's length)", (long long)len, (long long)ctx->sess.kv.len[seq], seq);
    ctx->run.stage = -1;
    cb_kv_truncate(&ctx->sess.kv, seq, len);
    return COLIBRI_OK;
}

colibri_status colibri_seq_fork(colibri_ctx *ctx, int32_t src, int32_t dst) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    colibri_status st = check_seq(ctx, "colibri_seq_fork", src);
    if (st == COLIBRI_OK) st = check_seq(ctx, "colibri_seq_fork", dst);
    if (st != COLIBRI_OK) return st;
    if (src == dst)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_seq_fork: source and destination are both "
                       "sequence %d", src);
    ctx->run.stage = -1;
    cb_kv_fork(&ctx->sess.kv, src, dst);
    return COLIBRI_OK;
}

colibri_status colibri_seq_reuse_prefix(colibri_ctx *ctx, int32_t seq, const int32_t *ids, int64_t n,
                                        int64_t *n_reused) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    if (n_reused) *n_reused = 0;
    colibri_status st = check_seq(ctx, "colibri_seq_reuse_prefix", seq);
    if (st != COLIBRI_OK) return st;
    if (!ids || !n_reused || n < 0)
        return cb_fail(ctx, COLIBRI_E_INVALID_ARG, "colibri_seq_reuse_prefix: ids and n_reused must not be NULL "
                       "and n (%lld) must be >= 0", (long long)n);
    cb_kv *kv = &ctx->sess.kv;
    if (n > ctx->max_seq_len - kv->len[seq])
        return cb_fail(ctx, COLIBRI_E_SEQ_TOO_LONG, "colibri_seq_reuse_prefix: sequence %d holds %lld positions and "
                       "%lld more would pass max_seq_len %lld", seq, (long long)kv->len[seq], (long long)n,
                       (long long)ctx->max_seq_len);
    ctx->run.stage = -1;
    if (cb_iv_seq_active(ctx, seq)) return COLIBRI_OK; /* its positions are computed under interventions */
    *n_reused = cb_kv_reuse_prefix(kv, seq, ids, n);
    if (ctx->trace) ctx->trace->prefix_cached += *n_reused;
    return COLIBRI_OK;
}

/* Accessors report unknown names through the context's message; the message buffer is
 * mutable state of a logically const context, so the cast is deliberate. */
static colibri_status unknown_name(const colibri_ctx *ctx, const char *what, const char *name) {
    return cb_fail((colibri_ctx *)ctx, COLIBRI_E_INVALID_ARG, "%s: unknown name '%s'; see colibri.h for the list",
                   what, name);
}

colibri_status colibri_get_int(const colibri_ctx *ctx, const char *name, int64_t *out) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    if (!name || !out) return cb_fail((colibri_ctx *)ctx, COLIBRI_E_INVALID_ARG, "colibri_get_int: NULL argument");
    const cb_config *c = &ctx->cfg;
    cb_backend_facts bf;
    ctx->be->facts(ctx, &bf);
    struct { const char *n; int64_t v; } tab[] = {
        {"backend_device_bytes", (int64_t)bf.device_bytes},
        {"backend_weight_bytes", (int64_t)bf.weight_bytes},
        {"backend_experts_resident", bf.experts_resident},
        {"backend_experts_host", bf.experts_host},
        {"backend_graphs_captured", bf.graphs_captured},
        {"backend_graph_replays", bf.graph_replays},
        {"n_layers", c->n_layers},
        {"hidden_size", c->hidden},
        {"intermediate_size", c->inter},
        {"vocab_size", c->vocab},
        {"n_heads", c->n_heads},
        {"n_kv_heads", c->n_kv_heads},
        {"head_dim", c->head_dim},
        {"n_experts", c->n_experts},
        {"top_k", c->top_k},
        {"max_seq_len", ctx->max_seq_len},
        {"file_max_seq_len", (int64_t)c->file_max_seq_len},
        {"max_batch", ctx->max_batch},
        {"logprob_rows", ctx->s.lp_rows},
        {"num_threads", ctx->num_threads},
        {"threads_used", cb_pool_threads(ctx->pool)},
        {"group_pad", ctx->group_pad},
        {"sliding_window", c->sliding_window > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)c->sliding_window},
        {"bos_id", c->bos_id},
        {"eos_id", c->eos_id},
        {"arena_bytes", (int64_t)ctx->arena_bytes},
        {"max_seqs", ctx->max_seqs},
        {"kv_block_tokens", ctx->sess.kv.block_len},
        {"kv_blocks_total", ctx->sess.kv.n_blocks},
        {"kv_blocks_used", ctx->sess.kv.n_blocks - ctx->sess.kv.n_free - ctx->sess.kv.n_cached},
        {"kv_blocks_cached", ctx->sess.kv.n_cached},
        {"prefix_cache", ctx->sess.kv.prefix},
        {"prefix_cache_hit_tokens", ctx->sess.kv.hit_tokens},
        {"prefix_cache_query_tokens", ctx->sess.kv.query_tokens},
        /* bytes of cache per position of a sequence, every layer: keys and values, or one
         * latent row for multi-head latent attention (backend/cpu/mla.c) */
        {"kv_bytes_per_token", ctx->sess.kv.block_len ? ctx->sess.kv.layer_stride / ctx->sess.kv.block_len *
                                   (int64_t)c->n_layers * (int64_t)sizeof(float) * (ctx->sess.kv.v ? 2 : 1) : 0},
        {"file_size", (int64_t)c->file_size},
        {"format_version", c->version},
        {"router_int8", c->router_int8},
        {"tie_word_embeddings", c->tie_word_embeddings},
        {"norm_topk_prob", c->norm_topk_prob},
        {"block_size", c->block_size},
        {"unk_id", c->unk_id},
        {"pad_id", c->pad_id},
        {"expert_cache_slots", ctx->ecache ? cb_ecache_slots(ctx->ecache) : 0},
        {"expert_cache_policy", ctx->ecache ? cb_ecache_policy(ctx->ecache) : -1},
        {"expert_cache_slot_bytes", ctx->ecache ? (int64_t)cb_ecache_slot_bytes(ctx->ecache) : 0},
        {"expert_cache_direct", ctx->ecache ? cb_ecache_direct(ctx->ecache) : 0},
        {"expert_cache_bytes_read", ctx->ecache ? (int64_t)cb_ecache_bytes_read(ctx->ecache) : 0},
        {"expert_cache_hits", ctx->ecache ? cb_ecache_stat(ctx->ecache, -1, CB_EC_HITS) : 0},
        {"expert_cache_misses", ctx->ecache ? cb_ecache_stat(ctx->ecache, -1, CB_EC_MISSES) : 0},
        {"expert_cache_prefetches", ctx->ecache ? cb_ecache_stat(ctx->ecache, -1, CB_EC_PREFETCHES) : 0},
        {"expert_cache_prefetch_hits", ctx->ecache ? cb_ecache_stat(ctx->ecache, -1, CB_EC_PREFETCH_HITS) : 0},
        {"expert_cache_wasted_prefetches", ctx->ecache ? cb_ecache_stat(ctx->ecache, -1, CB_EC_WASTED) : 0},
    };
    for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++) {
        if (strcmp(tab[i].n, name) == 0) {
            *out = tab[i].v;
            return COLIBRI_OK;
        }
    }
    return unknown_name(ctx, "colibri_get_int", name);
}

colibri_status colibri_get_layer_int(const colibri_ctx *ctx, int32_t layer, const char *name, int64_t *out) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    if (!name || !out) return cb_fail((colibri_ctx *)ctx, COLIBRI_E_INVALID_ARG, "colibri_get_layer_int: NULL argument");
    if (layer < 0 || (uint32_t)layer >= ctx->cfg.n_layers)
        return cb_fail((colibri_ctx *)ctx, COLIBRI_E_INVALID_ARG, "colibri_get_layer_int: layer %d is not in [0, %u)",
                       layer, ctx->cfg.n_layers);
    const cb_layer *L = &ctx->w.layers[layer];
    if (strcmp(name, "moe") == 0) *out = L->moe;
    else if (strcmp(name, "window") == 0) *out = L->window;
    else if (strcmp(name, "shared_expert") == 0) *out = L->moe && L->has_shared;
    else if (strcmp(name, "shared_gate") == 0) *out = L->moe && L->shared_gate.w != NULL;
    else if (strcmp(name, "cache_hits") == 0) *out = ctx->ecache ? cb_ecache_stat(ctx->ecache, layer, CB_EC_HITS) : 0;
    else if (strcmp(name, "cache_misses") == 0) *out = ctx->ecache ? cb_ecache_stat(ctx->ecache, layer, CB_EC_MISSES) : 0;
    else if (strcmp(name, "cache_prefetches") == 0)
        *out = ctx->ecache ? cb_ecache_stat(ctx->ecache, layer, CB_EC_PREFETCHES) : 0;
    else if (strcmp(name, "cache_prefetch_hits") == 0)
        *out = ctx->ecache ? cb_ecache_stat(ctx->ecache, layer, CB_EC_PREFETCH_HITS) : 0;
    else if (strcmp(name, "cache_wasted_prefetches") == 0)
        *out = ctx->ecache ? cb_ecache_stat(ctx->ecache, layer, CB_EC_WASTED) : 0;
    else return unknown_name(ctx, "colibri_get_layer_int", name);
    return COLIBRI_OK;
}

colibri_status colibri_get_float(const colibri_ctx *ctx, const char *name, double *out) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    if (!name || !out) return cb_fail((colibri_ctx *)ctx, COLIBRI_E_INVALID_ARG, "colibri_get_float: NULL argument");
    if (strcmp(name, "rope_theta") == 0) *out = ctx->cfg.rope_theta;
    else if (strcmp(name, "rms_norm_eps") == 0) *out = ctx->cfg.rms_norm_eps;
    else return unknown_name(ctx, "colibri_get_float", name);
    return COLIBRI_OK;
}

colibri_status colibri_get_end_ids(const colibri_ctx *ctx, const int32_t **ids, int32_t *n) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    if (!ids || !n) return cb_fail((colibri_ctx *)ctx, COLIBRI_E_INVALID_ARG, "colibri_get_end_ids: NULL argument");
    *ids = ctx->cfg.end_ids;
    *n = ctx->cfg.n_end_ids;
    return COLIBRI_OK;
}

colibri_status colibri_get_string(const colibri_ctx *ctx, const char *name, const char **out) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    if (!name || !out) return cb_fail((colibri_ctx *)ctx, COLIBRI_E_INVALID_ARG, "colibri_get_string: NULL argument");
    if (strcmp(name, "architecture") == 0) *out = ctx->cfg.architecture;
    else if (strcmp(name, "name") == 0) *out = ctx->cfg.name;
    else if (strcmp(name, "weight_dtype") == 0) *out = ctx->cfg.weight_dtype_str;
    else if (strcmp(name, "router_dtype") == 0) *out = ctx->cfg.router_dtype_str;
    else if (strcmp(name, "kernels") == 0) *out = ctx->kernels_desc;
    else if (strcmp(name, "precision") == 0) *out = ctx->precision == COLIBRI_PRECISION_FAST ? "fast" : "exact";
    else if (strcmp(name, "chat_template") == 0) *out = ctx->chat_template;
    else if (strcmp(name, "backend") == 0) *out = ctx->be->name;
    else if (strcmp(name, "backend_device") == 0) *out = ctx->backend_device;
    else return unknown_name(ctx, "colibri_get_string", name);
    return COLIBRI_OK;
}

colibri_status colibri_verify(colibri_ctx *ctx) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    return cb_file_verify(&ctx->file, ctx->err, sizeof ctx->err);
}

colibri_status colibri_verify_router(colibri_ctx *ctx) {
    if (!ctx) return COLIBRI_E_INVALID_ARG;
    return cb_model_verify_router(&ctx->w, &ctx->cfg, &ctx->file, ctx->err, sizeof ctx->err);
}

colibri_tokenizer *colibri_get_tokenizer(colibri_ctx *ctx) {
    if (!ctx) return NULL;
    if (!ctx->tok || !ctx->tok_loaded) {
        cb_fail(ctx, COLIBRI_E_INVALID_ARG, "this model file has no tokenizer; pass token ids, or re-convert "
                "the model with its tokenizer");
        return NULL;
    }
    return ctx->tok;
}

colibri_status colibri_dequantize(int dt, const void *src, int64_t n, float *dst) {
    if (!src || !dst || n < 0 || dt < 0 || !cb_dtype_is_weight((uint32_t)dt) ||
        (n > 0 && cb_row_bytes((uint32_t)dt, (uint64_t)n) == 0))
        return COLIBRI_E_INVALID_ARG;
    if (!cb_dtype_ready((uint32_t)dt)) return COLIBRI_E_UNSUPPORTED; /* its codebook is not installed */
    cb_dtype_dequant((uint32_t)dt)(dst, src, n);
    return COLIBRI_OK;
}

colibri_status colibri_dequantize_sumsq(int dt, const void *src, int64_t n, double *sumsq) {
    if (!src || !sumsq || n < 0 || dt < 0 || !cb_dtype_is_weight((uint32_t)dt) ||
        (n > 0 && cb_row_bytes((uint32_t)dt, (uint64_t)n) == 0))
        return COLIBRI_E_INVALID_ARG;
    if (!cb_dtype_ready((uint32_t)dt)) return COLIBRI_E_UNSUPPORTED;
    enum { CHUNK = 4096 }; /* a whole number of every dtype's blocks */
    float buf[CHUNK];
    const uint8_t *p = (const uint8_t *)src;
    const size_t chunk_bytes = (size_t)cb_row_bytes((uint32_t)dt, CHUNK);
    const cb_kernels *k = cb_kernels_best(); /* its dequant_row gives the reference's values */
    double ss[8] = {0}; /* eight chains: element j into chain j % 8 */
    for (int64_t i = 0; i < n; i += CHUNK, p += chunk_bytes) {
        const int64_t m = n - i < CHUNK ? n - i : CHUNK;
        k->dequant_row(buf, p, (uint32_t)dt, m);
        int64_t j = 0;
        for (; j + 8 <= m; j += 8)
            for (int c = 0; c < 8; c++) ss[c] += (double)buf[j + c] * (double)buf[j + c];
        for (; j < m; j++) ss[j % 8] += (double)buf[j] * (double)buf[j]; /* a float row's tail */
    }
    *sumsq = ((ss[0] + ss[1]) + (ss[2] + ss[3])) + ((ss[4] + ss[5]) + (ss[6] + ss[7]));
    return COLIBRI_OK;
}

colibri_status colibri_install_codebook(int dt, const void *data, int64_t bytes) {
    const int book = dt < 0 ? -1 : cb_dtype_codebook((uint32_t)dt);
    if (book < 0 || !data || bytes < 0) return COLIBRI_E_INVALID_ARG;
    return cb_codebook_install(book, data, (uint64_t)bytes, NULL, 0);
}
