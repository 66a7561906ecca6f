/*
 * colibri_dump — every output of a model on fixed inputs, written to one file, for bitwise
 * comparisons of two builds (tools/compare_builds.py --aarch64 runs it under qemu, where the
 * Python package cannot run).
 *
 *   colibri_dump MODEL OUT THREADS N_TOKENS PRECISION
 *
 * With N_TOKENS ids drawn from a fixed xorshift64* stream (3 .. vocab-1) it records: the
 * logits of a full forward ("full") and every trace array of it ("trace.*"), the last row
 * alone ("last_only"), the logits of decode steps after a prefill of 3/4 of the ids
 * ("decode"), every tensor of a stage-by-stage run over the first min(N, 37) ids
 * ("stage.*", the tensors each stage produces, as colibri_lab's StageRun returns them), and a
 * greedy and a seeded sampled generation of 24 tokens after the first 12 ids ("greedy",
 * "sampled", with colibri_sample). The kernel tables are the engine's choice or those of
 * COLIBRI_KERNELS / COLIBRI_FAST_KERNELS; the line the engine reports as "kernels" goes to
 * stdout. PRECISION is exact or fast.
 *
 * OUT holds records, in this order: u32 name length, the name, i32 dtype (COLIBRI_DTYPE_*),
 * u64 byte count, the bytes (the host's byte order). It uses only calls colibri.h has had
 * since ABI version 7, so it builds against an older tree's header and library as well.
 *
 * Exit status: 0 success, 1 an engine error (its message on stderr), 2 a usage error.
 */
#define _POSIX_C_SOURCE 200809L
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"

static FILE *out_file;
static colibri_ctx *ctx;

static int fail(const char *what, colibri_status st) {
    fprintf(stderr, "colibri_dump: %s: %s: %s\n", what, colibri_status_string(st),
            ctx ? colibri_last_error(ctx) : "");
    return 1;
}

static int put(const char *name, int32_t dtype, const void *data, uint64_t nbytes) {
    uint32_t len = (uint32_t)strlen(name);
    if (fwrite(&len, sizeof len, 1, out_file) != 1 || fwrite(name, 1, len, out_file) != len ||
        fwrite(&dtype, sizeof dtype, 1, out_file) != 1 || fwrite(&nbytes, sizeof nbytes, 1, out_file) != 1 ||
        (nbytes && fwrite(data, 1, nbytes, out_file) != nbytes)) {
        fprintf(stderr, "colibri_dump: cannot write %s\n", name);
        return 1;
    }
    return 0;
}

static uint64_t elem_size(int32_t dtype) {
    switch (dtype) {
    case COLIBRI_DTYPE_F16: case COLIBRI_DTYPE_BF16: return 2;
    case COLIBRI_DTYPE_I8: return 1;
    case COLIBRI_DTYPE_I64: case COLIBRI_DTYPE_U64: return 8;
    default: return 4;
    }
}

static uint64_t numel(int32_t ndim, const int64_t shape[4]) {
    uint64_t n = 1;
    for (int32_t i = 0; i < ndim; i++) n *= (uint64_t)shape[i];
    return n;
}

/* A stage tensor by name, copied out. Missing names are skipped (as StageRun's _has). */
static int put_stage(const char *prefix, const char *name) {
    const void *data;
    int32_t dtype, ndim;
    int64_t shape[4];
    if (colibri_stage_tensor(ctx, name, &data, &dtype, &ndim, shape) != COLIBRI_OK) return 0;
    char full[128];
    snprintf(full, sizeof full, "%s.%s", prefix, name);
    return put(full, dtype, data, numel(ndim, shape) * elem_size(dtype));
}

static const char *const STAGE_NAMES[] = {"embedding", "attention", "router", "grouping",
                                          "expert_ffn", "combine", "lm_head"};

static int stage_run(const int32_t *ids, int64_t n, int64_t vocab, float *logits) {
    colibri_status st = colibri_stage_begin(ctx, ids, n, 0);
    if (st != COLIBRI_OK) return fail("stage_begin", st);
    for (;;) {
        int32_t stage, layer;
        st = colibri_stage_next(ctx, &stage, &layer);
        if (st != COLIBRI_OK) return fail("stage_next", st);
        if (stage < 0) break;
        st = colibri_stage_run(ctx, stage, stage == COLIBRI_STAGE_LM_HEAD ? logits : NULL);
        if (st != COLIBRI_OK) return fail("stage_run", st);
        char prefix[64];
        if (layer >= 0) snprintf(prefix, sizeof prefix, "stage.%d.%s", layer, STAGE_NAMES[stage]);
        else snprintf(prefix, sizeof prefix, "stage.%s", STAGE_NAMES[stage]);
        int64_t moe = 1;
        if (layer >= 0 && colibri_get_layer_int(ctx, layer, "moe", &moe) != COLIBRI_OK) moe = 1;
        static const char *const embedding[] = {"x", NULL};
        static const char *const attention[] = {"q", "k", "v", "att", "x", "xn", "sink_share", NULL};
        static const char *const router[] = {"router_logits", "router_probs", "topk_ids", "topk_weights", NULL};
        static const char *const grouping[] = {"expert_count", "expert_offset", "row_token", "row_weight",
                                               "ex_in", NULL};
        static const char *const ffn_moe[] = {"ex_h", "ex_out", "shared_out", "shared_gate", NULL};
        static const char *const ffn_dense[] = {"delta", "ffn_h", NULL};
        static const char *const combine[] = {"delta", "x", NULL};
        const char *const *names = NULL;
        switch (stage) {
        case COLIBRI_STAGE_EMBEDDING: names = embedding; break;
        case COLIBRI_STAGE_ATTENTION: names = attention; break;
        case COLIBRI_STAGE_ROUTER: names = moe ? router : NULL; break;
        case COLIBRI_STAGE_GROUPING: names = moe ? grouping : NULL; break;
        case COLIBRI_STAGE_EXPERT_FFN: names = moe ? ffn_moe : ffn_dense; break;
        case COLIBRI_STAGE_COMBINE: names = combine; break;
        default: break;
        }
        for (int i = 0; names && names[i]; i++)
            if (put_stage(prefix, names[i])) return 1;
    }
    return put("stage.logits", COLIBRI_DTYPE_F32, logits, (uint64_t)n * (uint64_t)vocab * sizeof(float));
}

/* n_new tokens after `prompt`, one forward_last per step, sampled with colibri_sample. */
static int generate(const char *name, const int32_t *prompt, int64_t n_prompt, int n_new, float temperature,
                    int32_t top_k, float top_p, uint64_t seed, float *row) {
    int32_t toks[64];
    uint64_t rng = seed;
    colibri_status st = colibri_forward_last(ctx, prompt, n_prompt, 0, row);
    for (int i = 0; st == COLIBRI_OK && i < n_new; i++) {
        st = colibri_sample(ctx, row, temperature, top_k, top_p, &rng, &toks[i]);
        if (st == COLIBRI_OK && i + 1 < n_new) st = colibri_forward_last(ctx, &toks[i], 1, n_prompt + i, row);
    }
    if (st != COLIBRI_OK) return fail(name, st);
    return put(name, COLIBRI_DTYPE_I32, toks, (uint64_t)n_new * sizeof(int32_t));
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: colibri_dump MODEL OUT THREADS N_TOKENS exact|fast\n");
        return 2;
    }
    int64_t threads = strtoll(argv[3], NULL, 10), n = strtoll(argv[4], NULL, 10);
    if (threads < 0 || n < 16 || n > 4096 || (strcmp(argv[5], "exact") && strcmp(argv[5], "fast"))) {
        fprintf(stderr, "colibri_dump: THREADS >= 0, 16 <= N_TOKENS <= 4096, exact or fast\n");
        return 2;
    }
    colibri_options opt;
    colibri_options_init(&opt);
    opt.num_threads = (int32_t)threads;
    opt.precision = strcmp(argv[5], "fast") ? COLIBRI_PRECISION_EXACT : COLIBRI_PRECISION_FAST;
    char err[512] = "";
    colibri_status st = colibri_init_ex(argv[1], &opt, &ctx, err, sizeof err);
    if (st != COLIBRI_OK) {
        fprintf(stderr, "colibri_dump: cannot open %s: %s\n", argv[1], err);
        return 1;
    }
    out_file = fopen(argv[2], "wb");
    if (!out_file) {
        fprintf(stderr, "colibri_dump: cannot create %s\n", argv[2]);
        colibri_free(ctx);
        return 1;
    }
    int64_t vocab = 0, max_batch = 0;
    colibri_get_int(ctx, "vocab_size", &vocab);
    colibri_get_int(ctx, "max_batch", &max_batch);
    int32_t *ids = malloc((size_t)n * sizeof *ids);
    float *logits = malloc((size_t)n * (size_t)vocab * sizeof *logits);
    colibri_trace *tr = NULL;
    int rc = 1;
    if (!ids || !logits) {
        fprintf(stderr, "colibri_dump: out of memory\n");
        goto done;
    }
    uint64_t s = 0x9E3779B97F4A7C15ull;
    for (int64_t i = 0; i < n; i++) { /* xorshift64*: the same ids on every machine */
        s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
        ids[i] = (int32_t)(3 + (s * 0x2545F4914F6CDD1Dull >> 33) % (uint64_t)(vocab - 3));
    }

    /* full forward, traced */
    st = colibri_trace_create(ctx, n, &tr, err, sizeof err);
    if (st != COLIBRI_OK) {
        fprintf(stderr, "colibri_dump: trace: %s\n", err);
        goto done;
    }
    if ((st = colibri_trace_attach(ctx, tr)) != COLIBRI_OK) { rc = fail("trace_attach", st); goto done; }
    if ((st = colibri_forward(ctx, ids, n, logits)) != COLIBRI_OK) { rc = fail("forward", st); goto done; }
    if ((st = colibri_trace_attach(ctx, NULL)) != COLIBRI_OK) { rc = fail("trace_attach", st); goto done; }
    if (put("full", COLIBRI_DTYPE_F32, logits, (uint64_t)n * (uint64_t)vocab * sizeof(float))) goto done;
    static const char *const traced[] = {"token_ids", "positions", "router_probs", "topk_ids", "topk_weights",
                                         "shared_gate", "group_sizes", "padded_group_sizes"};
    for (size_t i = 0; i < sizeof traced / sizeof traced[0]; i++) {
        const void *data;
        int32_t dtype, ndim;
        int64_t shape[4];
        if (colibri_trace_array(tr, traced[i], &data, &dtype, &ndim, shape) != COLIBRI_OK) continue;
        char name[64];
        snprintf(name, sizeof name, "trace.%s", traced[i]);
        if (put(name, dtype, data, numel(ndim, shape) * elem_size(dtype))) goto done;
    }

    /* the last row alone */
    if ((st = colibri_forward_last(ctx, ids, n, 0, logits)) != COLIBRI_OK) { rc = fail("forward_last", st); goto done; }
    if (put("last_only", COLIBRI_DTYPE_F32, logits, (uint64_t)vocab * sizeof(float))) goto done;

    /* decode steps after a prefill */
    int64_t m = n * 3 / 4;
    if ((st = colibri_forward(ctx, ids, m, logits)) != COLIBRI_OK) { rc = fail("prefill", st); goto done; }
    for (int64_t i = m; i < n; i++)
        if ((st = colibri_forward_at(ctx, &ids[i], 1, i, logits + (i - m) * vocab)) != COLIBRI_OK) {
            rc = fail("decode", st);
            goto done;
        }
    if (put("decode", COLIBRI_DTYPE_F32, logits, (uint64_t)(n - m) * (uint64_t)vocab * sizeof(float))) goto done;

    /* a stage-by-stage run */
    int64_t ns = n < 37 ? n : 37;
    if (max_batch > 0 && ns > max_batch) ns = max_batch;
    if (stage_run(ids, ns, vocab, logits)) goto done;

    /* generations */
    if (generate("greedy", ids, 12, 24, 0.0f, 0, 1.0f, 0, logits)) goto done;
    if (generate("sampled", ids, 12, 24, 0.8f, 40, 0.9f, 7, logits)) goto done;

    const char *kernels = "";
    colibri_get_string(ctx, "kernels", &kernels);
    printf("%s\n", kernels);
    rc = 0;
done:
    if (out_file && fclose(out_file) != 0 && rc == 0) {
        fprintf(stderr, "colibri_dump: cannot write %s\n", argv[2]);
        rc = 1;
    }
    colibri_free(ctx);
    colibri_trace_free(tr);
    free(ids);
    free(logits);
    return rc;
}
