/*
 * colibri_bench — latency and throughput of a .colibri model, prefill and decode measured
 * separately, using only colibri.h.
 *
 *   colibri_bench --model m.colibri --seq_len 512 --max_new_tokens 128 --num_requests 10
 *   colibri_bench --model m.colibri --json          one JSON object on stdout
 *
 * One request = --sequential_sequences independent sequences, run ONE AFTER ANOTHER. Each
 * sequence is a prefill of --seq_len token ids followed by --max_new_tokens single-token
 * decode steps, on one sequence of the context; this multiplies the work of a request, it
 * does not batch tokens of different sequences into one matrix product. (Tokens of one
 * sequence are batched in the prefill.) --batch_size, the name of real batching across
 * sequences, is refused with a message: this tool does not measure it (the engine batches
 * sequences with colibri_batch; the serving benchmark measures that, docs/serving.md).
 *
 * Token ids are drawn from a seeded PRNG (splitmix64) over the whole vocabulary, fresh for
 * every sequence and every decode step, so routing varies from token to token the way it
 * does on real text. A benchmark that repeats one token keeps hitting the same experts and
 * keeps their weights in cache, which flatters a MoE engine.
 *
 * Reported, after --warmup requests that are not counted:
 *   prefill  latency of a request's prefills (ms): mean ± std, P50, P99, P99/P50, min, max;
 *            tokens/s = prefilled tokens / prefill time; requests/s.
 *   decode   latency of one decode step (one token of one sequence): the same statistics;
 *            tokens/s = decoded tokens / decode time.
 *   request  end-to-end latency of a request (prefills + decodes): the same statistics.
 *   backend  --backend's name and device (docs/backends.md); a device backend's memory,
 *            routed experts resident / on the host, and graphs captured / replayed.
 *   expert cache (with --expert_cache_mb or --expert_cache_slots): its slots, policy, slot
 *            bytes and read mode, and what it did over the measured requests only (the
 *            warmup fills it): hits, misses, hit rate = hits / (hits + misses), prefetches,
 *            prefetch hits, wasted prefetches, bytes read.
 * Percentiles interpolate linearly between order statistics (numpy's default), so with
 * fewer than 100 samples P99 lies between the two largest.
 *
 * Exit status: 0 success, 1 an engine error (the engine's message on stderr), 2 a usage
 * error (an unknown flag or a bad value, with a message on stderr).
 */
#define _POSIX_C_SOURCE 200809L
#define TOOL_NAME "colibri_bench"
#include "tool_common.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>


typedef struct args {
    const char *model;
    int64_t n_seq;         /* --sequential_sequences */
    int64_t seq_len;
    int64_t num_requests;
    int64_t warmup;
    int64_t num_threads;
    int64_t max_new_tokens;
    int64_t group_pad;
    int64_t max_batch;
    uint64_t seed;
    int32_t precision;
    engine_flags ef;          /* the expert cache and the backend (tool_common.h) */
    int json;
    int all_logits; /* prefill computes every row's logits (default: the last row only) */
} args;

static void usage(FILE *f) {
    fprintf(f,
            "usage: colibri_bench --model PATH [options]\n"
            "\n"
            "Measures prefill and decode latency and throughput of a .colibri model on\n"
            "token ids drawn from a seeded PRNG over the vocabulary (routing varies).\n"
            "\n"
            "A request is --sequential_sequences independent sequences, run one after\n"
            "another; each is a prefill of --seq_len tokens then --max_new_tokens\n"
            "single-token decode steps. The engine keeps one KV cache per context, so this\n"
            "scales the work of a request; it does not batch sequences together (this build\n"
            "has no --batch_size). Prefill latency is per request, decode latency per token step.\n"
            "\n"
            "options:\n"
            "  --model PATH           .colibri file (required)\n"
            "  --sequential_sequences N  sequences per request, run one after another,\n"
            "                         >= 1 (default 1)\n"
            "  --seq_len N            prefill tokens per sequence, >= 1 (default 128)\n"
            "  --max_new_tokens N     decode steps per sequence, >= 0 (default 32);\n"
            "                         also --decode_steps\n"
            "  --num_requests N       measured requests, >= 1 (default 10)\n"
            "  --warmup N             requests run first and not counted, >= 0 (default 1)\n"
            "  --num_threads N        0 = the engine's default (default 0)\n"
            "  --group_pad N          pad each expert's token group to a multiple of N,\n"
            "                         1..4096 (default 1 = no padding)\n"
            "  --max_batch N          tokens per internal forward chunk, 0 = engine default\n"
            "  --seed S               PRNG seed for the token ids, unsigned 64-bit (default 0)\n"
            "  --precision MODE       exact or fast (int8 / bf16 activations into the weight\n"
            "                         matmuls; docs/quantization.md) (default exact)\n"
            "  --expert_cache_mb N    keep the routed experts in N MiB of cache slots, read from\n"
            "                         the file on a miss (models larger than memory;\n"
            "                         docs/expert_cache.md); 0 = every expert mapped (default 0)\n"
            "  --expert_cache_slots N the cache as N slots per MoE layer instead (more than\n"
            "                         n_experts: n_experts; not with --expert_cache_mb) (default 0)\n"
            "  --expert_cache_policy P\n"
            "                         which expert a full layer evicts: lru, lfu, pinned (LRU\n"
            "                         around experts pinned through the API; this tool pins\n"
            "                         none) or predict (LRU, and the next layer's experts read\n"
            "                         ahead) (default lru; needs a cache). The report gives the\n"
            "                         cache's counters over the measured requests\n"
            "  --backend B            where the stages run: cpu or cuda (an NVIDIA GPU; a build\n"
            "                         with -DCOLIBRI_CUDA=ON; docs/backends.md) (default cpu)\n"
            "  --gpu_memory_fraction F\n"
            "                         cuda: share of the device's memory the engine may take,\n"
            "                         0 < F <= 1; experts that do not fit run on the CPU\n"
            "                         (default 0.9)\n"
            "  --gpu_device N         cuda: the device ordinal (default 0)\n"
            "  --json                 print one JSON object on stdout instead of the table\n"
            "  --all_logits           prefill computes the logits of every prompt token (default: the\n"
            "                         last one only, as generation and the peer engines do)\n"
            "  --help                 print this help and exit\n"
            "\n"
            "Percentiles interpolate linearly (numpy's default). Exit status: 0 success,\n"
            "1 engine error, 2 usage error.\n");
}

/* Parse argv into *a. Returns -1 to go on, or an exit status (0 for --help). */
static int parse_args(int argc, char **argv, args *a) {
    memset(a, 0, sizeof *a);
    a->n_seq = 1;
    a->seq_len = 128;
    a->num_requests = 10;
    a->warmup = 1;
    a->max_new_tokens = 32;
    a->group_pad = 1;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(arg, "--json")) { a->json = 1; continue; }
        if (!strcmp(arg, "--all_logits")) { a->all_logits = 1; continue; }
        if (strncmp(arg, "--", 2) != 0) return usage_error("unexpected argument '%s'", arg);

        /* --name VALUE or --name=VALUE */
        static const char *const known[] = {"--model", "--sequential_sequences", "--batch_size", "--seq_len",
                                            "--num_requests", "--warmup", "--num_threads",
                                            "--max_new_tokens", "--decode_steps", "--group_pad",
                                            "--max_batch", "--seed", "--precision", "--expert_cache_mb",
                                            "--expert_cache_slots", "--expert_cache_policy", "--backend",
                                            "--gpu_memory_fraction", "--gpu_device"};
        char name[64];
        const char *val = NULL;
        int bad = split_option(argc, argv, &i, known, sizeof known / sizeof known[0], name, &val);
        if (bad >= 0) return bad;

        if (!strcmp(name, "--model")) {
            if (!*val) return usage_error("--model needs a path");
            a->model = val;
        } else if (!strcmp(name, "--sequential_sequences")) {
            if (!parse_i64(val, 1, 1 << 20, &a->n_seq))
                return usage_error("--sequential_sequences must be an integer in 1..1048576, got '%s'", val);
        } else if (!strcmp(name, "--batch_size")) {
            return usage_error("--batch_size (sequences batched into one forward) is not in this build: "
                               "the engine runs one sequence per context; use --sequential_sequences %s "
                               "to run %s sequences per request one after another", val, val);
        } else if (!strcmp(name, "--seq_len")) {
            if (!parse_i64(val, 1, INT32_MAX, &a->seq_len))
                return usage_error("--seq_len must be an integer >= 1, got '%s'", val);
        } else if (!strcmp(name, "--num_requests")) {
            if (!parse_i64(val, 1, 1 << 24, &a->num_requests))
                return usage_error("--num_requests must be an integer in 1..16777216, got '%s'", val);
        } else if (!strcmp(name, "--warmup")) {
            if (!parse_i64(val, 0, 1 << 24, &a->warmup))
                return usage_error("--warmup must be an integer in 0..16777216, got '%s'", val);
        } else if (!strcmp(name, "--num_threads")) {
            if (!parse_i64(val, 0, 4096, &a->num_threads))
                return usage_error("--num_threads must be an integer in 0..4096, got '%s'", val);
        } else if (!strcmp(name, "--max_new_tokens") || !strcmp(name, "--decode_steps")) {
            if (!parse_i64(val, 0, INT32_MAX, &a->max_new_tokens))
                return usage_error("%s must be an integer >= 0, got '%s'", name, val);
        } else if (!strcmp(name, "--group_pad")) {
            if (!parse_i64(val, 1, 4096, &a->group_pad))
                return usage_error("--group_pad must be an integer in 1..4096, got '%s'", val);
        } else if (!strcmp(name, "--max_batch")) {
            if (!parse_i64(val, 0, INT32_MAX, &a->max_batch))
                return usage_error("--max_batch must be an integer >= 0, got '%s'", val);
        } else if (!strcmp(name, "--seed")) {
            if (!parse_u64(val, &a->seed))
                return usage_error("--seed must be an unsigned integer, got '%s'", val);
        } else if (!strcmp(name, "--precision")) {
            if (!parse_precision(val, &a->precision)) return usage_error(PRECISION_USAGE, val);
        } else {
            int rc = parse_engine_flag(name, val, &a->ef);
            if (rc >= 0) return rc;
        }
    }
    if (!a->model) return usage_error("--model is required");
    int bad = check_engine_flags(&a->ef);
    if (bad >= 0) return bad;
    /* One latency sample is kept per decode step: bound their count (in double, so the
     * product of three large values cannot overflow). */
    if ((double)a->num_requests * (double)a->n_seq * (double)a->max_new_tokens >
        (double)((int64_t)1 << 28))
        return usage_error("--num_requests x --sequential_sequences x --max_new_tokens must be at most "
                           "2^28 decode steps");
    return -1;
}

/* splitmix64: a seeded stream of 64-bit values for the token ids. */
static uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* A token id uniform over [0, vocab) (rejection sampling, no modulo bias). */
static int32_t random_id(uint64_t *state, int64_t vocab) {
    uint64_t v = (uint64_t)vocab;
    uint64_t limit = UINT64_MAX - UINT64_MAX % v;
    uint64_t r;
    do r = splitmix64(state);
    while (r >= limit);
    return (int32_t)(r % v);
}

typedef struct stats {
    int64_t n;
    double mean, std, p50, p99, min, max, total;
} stats;

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Percentile q in [0, 100] of sorted x[0..n), linear interpolation (numpy's default). */
static double percentile(const double *x, int64_t n, double q) {
    if (n == 1) return x[0];
    double pos = q / 100.0 * (double)(n - 1);
    int64_t lo = (int64_t)floor(pos);
    if (lo >= n - 1) return x[n - 1];
    double frac = pos - (double)lo;
    return x[lo] + (x[lo + 1] - x[lo]) * frac;
}

/* Statistics of x[0..n) (sorts x in place). std is the sample standard deviation. */
static stats summarize(double *x, int64_t n) {
    stats s;
    memset(&s, 0, sizeof s);
    s.n = n;
    if (n <= 0) return s;
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += x[i];
    s.total = sum;
    s.mean = sum / (double)n;
    double ss = 0;
    for (int64_t i = 0; i < n; i++) ss += (x[i] - s.mean) * (x[i] - s.mean);
    s.std = n > 1 ? sqrt(ss / (double)(n - 1)) : 0.0;
    qsort(x, (size_t)n, sizeof *x, cmp_double);
    s.min = x[0];
    s.max = x[n - 1];
    s.p50 = percentile(x, n, 50);
    s.p99 = percentile(x, n, 99);
    return s;
}

static void print_stats_text(const char *label, const stats *s, double tokens) {
    printf("%-8s mean %10.3f ± %8.3f ms  P50 %10.3f  P99 %10.3f  P99/P50 %6.3f  min %10.3f  max %10.3f",
           label, s->mean, s->std, s->p50, s->p99, s->p50 > 0 ? s->p99 / s->p50 : 0.0, s->min,
           s->max);
    if (tokens > 0 && s->total > 0) printf("  %10.2f tok/s", tokens / s->total * 1e3);
    putchar('\n');
}

static void print_stats_json(const char *name, const stats *s, double tokens, double requests,
                             int last) {
    printf("  \"%s\": {\"n\": %" PRId64 ", \"mean_ms\": %.6f, \"std_ms\": %.6f, \"p50_ms\": %.6f, "
           "\"p99_ms\": %.6f, \"p99_over_p50\": %.6f, \"min_ms\": %.6f, \"max_ms\": %.6f, "
           "\"total_ms\": %.6f, \"tokens\": %.0f, \"tokens_per_s\": %.6f",
           name, s->n, s->mean, s->std, s->p50, s->p99, s->p50 > 0 ? s->p99 / s->p50 : 0.0,
           s->min, s->max, s->total, tokens, s->total > 0 ? tokens / s->total * 1e3 : 0.0);
    if (requests > 0)
        printf(", \"requests_per_s\": %.6f", s->total > 0 ? requests / s->total * 1e3 : 0.0);
    printf("}%s\n", last ? "" : ",");
}

/* Print a JSON string (the model path, engine strings) with the needed escapes. */
static void print_json_string(const char *s) {
    putchar('"');
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') printf("\\%c", c);
        else if (c < 0x20) printf("\\u%04x", c);
        else putchar(c);
    }
    putchar('"');
}

int main(int argc, char **argv) {
    args a;
    int rc = parse_args(argc, argv, &a);
    if (rc >= 0) return rc;
    if (colibri_abi_version() != COLIBRI_ABI_VERSION) {
        fprintf(stderr, "colibri_bench: error: library ABI %d, tool built for %d\n",
                colibri_abi_version(), COLIBRI_ABI_VERSION);
        return EXIT_ENGINE;
    }

    /* The context holds exactly one sequence of seq_len + max_new_tokens positions. */
    colibri_options opt;
    colibri_options_init(&opt);
    opt.num_threads = (int32_t)a.num_threads;
    opt.max_seq_len = a.seq_len + a.max_new_tokens;
    opt.max_batch = a.max_batch;
    opt.group_pad = (int32_t)a.group_pad;
    opt.precision = a.precision;
    engine_flags_apply(&a.ef, &opt);

    double t0 = now_ms();
    colibri_ctx *ctx = NULL;
    char err[1024] = "";
    colibri_status st = colibri_init_ex(a.model, &opt, &ctx, err, sizeof err);
    if (st != COLIBRI_OK) {
        fprintf(stderr, "colibri_bench: error: cannot open model: %s\n",
                *err ? err : colibri_status_string(st));
        if (st == COLIBRI_E_INVALID_ARG && strstr(err, "max_seq_len"))
            fprintf(stderr, "colibri_bench: --seq_len + --max_new_tokens must fit the model's "
                            "max_seq_len; lower them\n");
        return EXIT_ENGINE;
    }
    double t_load = now_ms() - t0;

    int32_t *ids = NULL;
    float *logits = NULL;
    double *pre = NULL, *dec = NULL, *req = NULL;
    rc = EXIT_ENGINE;

    int64_t vocab = 0, threads_req = 0, threads_used = 0, n_layers = 0, n_experts = 0, top_k = 0,
            hidden = 0, max_batch = 0, group_pad = 0, ec_slots = 0, ec_policy = -1, ec_slot_bytes = 0,
            ec_direct = 0;
    const char *arch = "", *wdtype = "", *precision = "", *kernels = "";
    backend_facts bf;
    if ((st = read_backend_facts(ctx, &bf)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "vocab_size", &vocab)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "num_threads", &threads_req)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "threads_used", &threads_used)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "n_layers", &n_layers)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "n_experts", &n_experts)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "top_k", &top_k)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "hidden_size", &hidden)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "max_batch", &max_batch)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "group_pad", &group_pad)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "expert_cache_slots", &ec_slots)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "expert_cache_policy", &ec_policy)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "expert_cache_slot_bytes", &ec_slot_bytes)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "expert_cache_direct", &ec_direct)) != COLIBRI_OK ||
        (st = colibri_get_string(ctx, "architecture", &arch)) != COLIBRI_OK ||
        (st = colibri_get_string(ctx, "weight_dtype", &wdtype)) != COLIBRI_OK ||
        (st = colibri_get_string(ctx, "precision", &precision)) != COLIBRI_OK ||
        (st = colibri_get_string(ctx, "kernels", &kernels)) != COLIBRI_OK) {
        rc = engine_error(ctx, st, "reading the model's settings");
        goto done;
    }

    /* Every row of the prefill's logits is written (the API computes them all). */
    ids = malloc((size_t)a.seq_len * sizeof *ids);
    logits = malloc((size_t)a.seq_len * (size_t)vocab * sizeof *logits);
    int64_t n_req = a.num_requests;
    int64_t n_dec = n_req * a.n_seq * a.max_new_tokens;
    pre = malloc((size_t)n_req * sizeof *pre);
    req = malloc((size_t)n_req * sizeof *req);
    dec = malloc((size_t)(n_dec > 0 ? n_dec : 1) * sizeof *dec);
    if (!ids || !logits || !pre || !req || !dec) {
        fprintf(stderr, "colibri_bench: error: out of memory for %" PRId64 " x %" PRId64
                        " logits; lower --seq_len\n", a.seq_len, vocab);
        goto done;
    }

    uint64_t rng = a.seed;
    int64_t di = 0;
    cache_counts ec0 = {0}, ec = {0}; /* the cache's counters before the first measured request, after the last */
    for (int64_t r = -a.warmup; r < n_req; r++) {
        int counted = r >= 0;
        if (r == 0 && ec_slots > 0 && (st = read_cache_counts(ctx, &ec0)) != COLIBRI_OK) {
            rc = engine_error(ctx, st, "reading the expert cache's counters");
            goto done;
        }
        double t_pre = 0, t_req0 = now_ms();
        for (int64_t b = 0; b < a.n_seq; b++) {
            for (int64_t t = 0; t < a.seq_len; t++) ids[t] = random_id(&rng, vocab);
            double tp = now_ms();
            st = a.all_logits ? colibri_forward_at(ctx, ids, a.seq_len, 0, logits)
                              : colibri_forward_last(ctx, ids, a.seq_len, 0, logits);
            t_pre += now_ms() - tp;
            if (st != COLIBRI_OK) { rc = engine_error(ctx, st, "prefill"); goto done; }
            for (int64_t s = 0; s < a.max_new_tokens; s++) {
                int32_t id = random_id(&rng, vocab);
                double td = now_ms();
                st = colibri_forward_at(ctx, &id, 1, a.seq_len + s, logits);
                double el = now_ms() - td;
                if (st != COLIBRI_OK) { rc = engine_error(ctx, st, "decode"); goto done; }
                if (counted) dec[di++] = el;
            }
        }
        if (counted) {
            pre[r] = t_pre;
            req[r] = now_ms() - t_req0;
        }
    }

    backend_facts bf2; /* after the run: the graphs captured and replayed */
    if ((st = read_backend_facts(ctx, &bf2)) != COLIBRI_OK) {
        rc = engine_error(ctx, st, "reading the backend's facts");
        goto done;
    }
    if (ec_slots > 0) {
        if ((st = read_cache_counts(ctx, &ec)) != COLIBRI_OK) {
            rc = engine_error(ctx, st, "reading the expert cache's counters");
            goto done;
        }
        ec = cache_counts_sub(ec, ec0);
    }
    int64_t ec_uses = ec.hits + ec.misses;

    double pre_tokens = (double)(n_req * a.n_seq * a.seq_len);
    double dec_tokens = (double)n_dec;
    stats sp = summarize(pre, n_req);
    stats sd = summarize(dec, n_dec);
    stats sr = summarize(req, n_req);

    if (a.json) {
        printf("{\n  \"tool\": \"colibri_bench\",\n  \"engine_version\": ");
        print_json_string(colibri_version_string());
        printf(",\n  \"model\": ");
        print_json_string(a.model);
        printf(",\n  \"architecture\": ");
        print_json_string(arch);
        printf(",\n  \"weight_dtype\": ");
        print_json_string(wdtype);
        printf(",\n  \"precision\": ");
        print_json_string(precision);
        printf(",\n  \"kernels\": ");
        print_json_string(kernels);
        printf(",\n  \"backend\": ");
        print_json_string(bf.name);
        printf(",\n  \"backend_device\": ");
        print_json_string(bf.device);
        printf(",\n  \"backend_memory\": {\"device_bytes\": %" PRId64 ", \"weight_bytes\": %" PRId64
               ", \"experts_resident\": %" PRId64 ", \"experts_host\": %" PRId64 ", \"graphs_captured\": %" PRId64
               ", \"graph_replays\": %" PRId64 "}",
               bf.device_bytes, bf.weight_bytes, bf.experts_resident, bf.experts_host, bf2.graphs_captured,
               bf2.graph_replays);
        printf(",\n  \"vocab_size\": %" PRId64 ", \"n_layers\": %" PRId64 ", \"hidden_size\": %" PRId64
               ", \"n_experts\": %" PRId64 ", \"top_k\": %" PRId64 ",\n",
               vocab, n_layers, hidden, n_experts, top_k);
        printf("  \"sequential_sequences\": %" PRId64 ", \"seq_len\": %" PRId64
               ", \"max_new_tokens\": %" PRId64 ", \"num_requests\": %" PRId64 ", \"warmup\": %" PRId64
               ",\n  \"num_threads\": %" PRId64 ", \"threads_used\": %" PRId64 ", \"group_pad\": %" PRId64
               ", \"max_batch\": %" PRId64 ", \"seed\": %" PRIu64 ", \"token_ids\": \"splitmix64 uniform over the vocabulary\",\n"
               "  \"prefill_logits\": \"%s\",\n"
               "  \"load_ms\": %.6f,\n",
               a.n_seq, a.seq_len, a.max_new_tokens, n_req, a.warmup, threads_req,
               threads_used, group_pad, max_batch, a.seed, a.all_logits ? "all" : "last", t_load);
        /* null without a cache; the counters cover the measured requests */
        if (ec_slots > 0) {
            printf("  \"expert_cache\": {\"slots_per_layer\": %" PRId64 ", \"policy\": \"%s\", \"slot_bytes\": %" PRId64
                   ", \"direct\": %s,\n    \"hits\": %" PRId64 ", \"misses\": %" PRId64 ", \"hit_rate\": ",
                   ec_slots, cache_policy_name(ec_policy), ec_slot_bytes, ec_direct ? "true" : "false", ec.hits,
                   ec.misses);
            if (ec_uses > 0) printf("%.6f", (double)ec.hits / (double)ec_uses);
            else printf("null"); /* no expert was used: no rate */
            printf(", \"prefetches\": %" PRId64 ", \"prefetch_hits\": %" PRId64 ", \"wasted_prefetches\": %" PRId64
                   ", \"bytes_read\": %" PRId64 "},\n",
                   ec.prefetches, ec.prefetch_hits, ec.wasted, ec.bytes_read);
        } else {
            printf("  \"expert_cache\": null,\n");
        }
        print_stats_json("prefill", &sp, pre_tokens, (double)n_req, 0);
        print_stats_json("decode", &sd, dec_tokens, 0, 0);
        print_stats_json("request", &sr, pre_tokens + dec_tokens, (double)n_req, 1);
        printf("}\n");
    } else {
        printf("colibri_bench %s: %s (%s, %s, %" PRId64 " layers, %" PRId64 " experts top-%" PRId64
               ", vocab %" PRId64 "), loaded in %.1f ms\n",
               colibri_version_string(), a.model, arch, wdtype, n_layers, n_experts, top_k, vocab,
               t_load);
        printf("settings: sequential_sequences %" PRId64 " (sequences per request, run one after another), "
               "seq_len %" PRId64 ", max_new_tokens %" PRId64 ", %" PRId64 " requests after %" PRId64
               " warmup, threads %" PRId64 " requested / %" PRId64 " used, group_pad %" PRId64
               ", max_batch %" PRId64 ", seed %" PRIu64 ", precision %s (kernels %s)\n",
               a.n_seq, a.seq_len, a.max_new_tokens, n_req, a.warmup, threads_req,
               threads_used, group_pad, max_batch, a.seed, precision, kernels);
        printf("backend: %s (%s)", bf.name, bf.device);
        if (bf.device_bytes > 0)
            printf(", %.1f MiB on the device (%.1f MiB of weights), %" PRId64 " routed experts resident, %" PRId64
                   " on the host, %" PRId64 " graphs captured, %" PRId64 " replays",
                   (double)bf.device_bytes / 1048576.0, (double)bf.weight_bytes / 1048576.0, bf.experts_resident,
                   bf.experts_host, bf2.graphs_captured, bf2.graph_replays);
        printf("\n");
        if (ec_slots > 0)
            printf("expert cache: %" PRId64 " slot(s) per MoE layer, policy %s, %" PRId64 " bytes per slot, %s\n",
                   ec_slots, cache_policy_name(ec_policy), ec_slot_bytes,
                   ec_direct ? "O_DIRECT reads" : "buffered reads (no O_DIRECT here)");
        printf("prefill: latency per request (%" PRId64 " x %" PRId64 " tokens); decode: latency per token step\n",
               a.n_seq, a.seq_len);
        print_stats_text("prefill", &sp, pre_tokens);
        if (n_dec > 0) print_stats_text("decode", &sd, dec_tokens);
        print_stats_text("request", &sr, pre_tokens + dec_tokens);
        printf("throughput: %.3f requests/s\n", sr.total > 0 ? (double)n_req / sr.total * 1e3 : 0.0);
        if (ec_slots > 0)
            printf("expert cache (measured requests): %" PRId64 " hits, %" PRId64 " misses (hit rate %.1f%%), %" PRId64
                   " prefetches, %" PRId64 " prefetch hits, %" PRId64 " wasted prefetches, %" PRId64
                   " bytes read (%.1f MiB)\n",
                   ec.hits, ec.misses, ec_uses > 0 ? 100.0 * (double)ec.hits / (double)ec_uses : 0.0, ec.prefetches,
                   ec.prefetch_hits, ec.wasted, ec.bytes_read, (double)ec.bytes_read / 1048576.0);
    }
    rc = 0;

done:
    free(req);
    free(dec);
    free(pre);
    free(logits);
    free(ids);
    colibri_free(ctx);
    return rc;
}
