/*
 * colibri_cli — run a .colibri model from the command line, using only colibri.h.
 *
 *   colibri_cli --model m.colibri --prompt "Hello" --max_new_tokens 24   stream text
 *   colibri_cli --model m.colibri --prompt "Hello" --max_new_tokens 1    top-5 table
 *
 * Before running, the router tensors' L2 norms are re-computed and compared with the
 * ones stored in the file (colibri_verify_router); --verify also checks every CRC-32.
 * Generation is: one prefill forward over the prompt, then one forward per generated
 * token, sampling with the library's per-sequence sampler, colibri_sampler_sample (the same
 * calls the Python Engine.generate makes, so both produce the same tokens for the same seed
 * and settings: penalties, logit bias, min-p, stop ids, a JSON schema).
 *
 * Exit status: 0 success, 1 an engine error (the engine's message on stderr), 2 a usage
 * error. Generated text goes to stdout, everything else to stderr.
 */
#define _POSIX_C_SOURCE 200809L
#define TOOL_NAME "colibri_cli"
#include "tool_common.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TOP_N 5

typedef struct args {
    const char *model;
    const char *prompt;
    int64_t max_new_tokens;
    double temperature;
    int64_t top_k;
    double top_p;
    uint64_t seed;
    int64_t num_threads;
    int64_t max_seq_len;
    int32_t precision;
    engine_flags ef;          /* the expert cache and the backend (tool_common.h) */
    int verbose;
    int verify;
    double min_p, presence_penalty, frequency_penalty, repetition_penalty;
    int64_t repetition_last_n;
    int ignore_eos;
    const char *logit_bias;   /* "ID:BIAS,ID:BIAS" */
    const char *stop_ids;     /* "ID,ID" */
    const char *json_schema;  /* schema text; "{}"-less --json: any object */
    int json_any;
} args;

static void usage(FILE *f) {
    fprintf(f,
            "usage: colibri_cli --model PATH --prompt TEXT [options]\n"
            "\n"
            "Runs a .colibri model. With --max_new_tokens 1 prints the 5 most likely next\n"
            "tokens and their probabilities; otherwise streams the generated text.\n"
            "\n"
            "options:\n"
            "  --model PATH           .colibri file (required)\n"
            "  --prompt TEXT          prompt text, encoded with BOS (required)\n"
            "  --max_new_tokens N     tokens to generate, >= 1 (default 24)\n"
            "  --temperature T        0 = greedy (default 0)\n"
            "  --top_k K              keep the K most likely tokens, 0 = off (default 0)\n"
            "  --top_p P              nucleus sampling, 0 < P <= 1, 1 = off (default 1)\n"
            "  --seed S               sampler seed, an unsigned 64-bit integer (default 0)\n"
            "  --min_p P              keep tokens with probability >= P x the best's, 0 = off\n"
            "  --presence_penalty X   OpenAI presence penalty over generated tokens, -2..2 (0)\n"
            "  --frequency_penalty X  OpenAI frequency penalty over generated tokens, -2..2 (0)\n"
            "  --repetition_penalty X HF repetition penalty over prompt + generated, > 0 (1 = off)\n"
            "  --repetition_last_n N  its window: the last N tokens, 0 = all (default 0)\n"
            "  --logit_bias LIST      ID:BIAS,... added to the logits (+-100 forces / bans)\n"
            "  --stop_ids LIST        ID,... token ids that end generation\n"
            "  --ignore_eos           EOS and the other end ids do not end the output\n"
            "  --json_schema TEXT     constrain the output to JSON valid for this JSON schema\n"
            "  --json                 constrain the output to any JSON object\n"
            "  --num_threads N        0 = the engine's default (default 0)\n"
            "  --max_seq_len N        0 = the engine's default (default 0)\n"
            "  --precision MODE       exact (float32 activations into every matmul) or fast\n"
            "                         (int8 / bf16 activations into the weight matmuls;\n"
            "                         docs/quantization.md, \"Fast mode accuracy\") (default exact)\n"
            "  --expert_cache_mb N    keep the routed experts in N MiB of cache slots, read from\n"
            "                         the file on a miss (models larger than memory;\n"
            "                         docs/expert_cache.md); 0 = every expert mapped (default 0)\n"
            "  --expert_cache_slots N the cache as N slots per MoE layer instead (more than\n"
            "                         n_experts: n_experts; not with --expert_cache_mb) (default 0)\n"
            "  --expert_cache_policy P\n"
            "                         which expert a full layer evicts: lru, lfu, pinned (LRU\n"
            "                         around experts pinned through the API; this tool pins\n"
            "                         none) or predict (LRU, and the next layer's experts read\n"
            "                         ahead) (default lru; needs a cache)\n"
            "  --backend B            where the stages run: cpu or cuda (an NVIDIA GPU; a build\n"
            "                         with -DCOLIBRI_CUDA=ON; docs/backends.md) (default cpu)\n"
            "  --gpu_memory_fraction F\n"
            "                         cuda: share of the device's memory the engine may take,\n"
            "                         0 < F <= 1; experts that do not fit run on the CPU\n"
            "                         (default 0.9)\n"
            "  --gpu_device N         cuda: the device ordinal (default 0)\n"
            "  --verify               check every CRC-32 in the file before running\n"
            "  --verbose              print load and timing figures (the backend and its device,\n"
            "                         the expert cache's settings and counters) to stderr\n"
            "  --help                 print this help and exit\n");
}

static int parse_f64(const char *s, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v)) return 0;
    *out = v;
    return 1;
}

/* Parse argv into *a. Returns -1 to go on, or an exit status (0 for --help). */
static int parse_args(int argc, char **argv, args *a) {
    memset(a, 0, sizeof *a);
    a->max_new_tokens = 24;
    a->top_p = 1.0;
    a->repetition_penalty = 1.0;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(arg, "--verbose")) { a->verbose = 1; continue; }
        if (!strcmp(arg, "--verify")) { a->verify = 1; continue; }
        if (!strcmp(arg, "--ignore_eos")) { a->ignore_eos = 1; continue; }
        if (!strcmp(arg, "--json")) { a->json_any = 1; continue; }
        if (strncmp(arg, "--", 2) != 0) return usage_error("unexpected argument '%s'", arg);

        /* --name VALUE or --name=VALUE */
        static const char *const known[] = {"--model", "--prompt", "--max_new_tokens",
                                            "--temperature", "--top_k", "--top_p", "--seed",
                                            "--num_threads", "--max_seq_len", "--precision",
                                            "--expert_cache_mb", "--expert_cache_slots",
                                            "--expert_cache_policy", "--backend",
                                            "--gpu_memory_fraction", "--gpu_device", "--min_p",
                                            "--presence_penalty", "--frequency_penalty",
                                            "--repetition_penalty", "--repetition_last_n",
                                            "--logit_bias", "--stop_ids", "--json_schema"};
        char name[64];
        const char *val = NULL;
        int bad = split_option(argc, argv, &i, known, sizeof known / sizeof known[0], name, &val);
        if (bad >= 0) return bad;

        if (!strcmp(name, "--model")) {
            if (!*val) return usage_error("--model needs a path");
            a->model = val;
        } else if (!strcmp(name, "--prompt")) {
            a->prompt = val;
        } else if (!strcmp(name, "--max_new_tokens")) {
            if (!parse_i64(val, 1, INT32_MAX, &a->max_new_tokens))
                return usage_error("--max_new_tokens must be an integer >= 1, got '%s'", val);
        } else if (!strcmp(name, "--temperature")) {
            if (!parse_f64(val, &a->temperature) || a->temperature < 0)
                return usage_error("--temperature must be a number >= 0, got '%s'", val);
        } else if (!strcmp(name, "--top_k")) {
            if (!parse_i64(val, 0, INT32_MAX, &a->top_k))
                return usage_error("--top_k must be an integer >= 0, got '%s'", val);
        } else if (!strcmp(name, "--top_p")) {
            if (!parse_f64(val, &a->top_p) || !(a->top_p > 0 && a->top_p <= 1))
                return usage_error("--top_p must be a number in (0, 1], got '%s'", val);
        } else if (!strcmp(name, "--seed")) {
            if (!parse_u64(val, &a->seed))
                return usage_error("--seed must be an unsigned integer, got '%s'", val);
        } else if (!strcmp(name, "--min_p")) {
            if (!parse_f64(val, &a->min_p)) return usage_error("--min_p must be a number, got '%s'", val);
        } else if (!strcmp(name, "--presence_penalty")) {
            if (!parse_f64(val, &a->presence_penalty))
                return usage_error("--presence_penalty must be a number, got '%s'", val);
        } else if (!strcmp(name, "--frequency_penalty")) {
            if (!parse_f64(val, &a->frequency_penalty))
                return usage_error("--frequency_penalty must be a number, got '%s'", val);
        } else if (!strcmp(name, "--repetition_penalty")) {
            if (!parse_f64(val, &a->repetition_penalty))
                return usage_error("--repetition_penalty must be a number, got '%s'", val);
        } else if (!strcmp(name, "--repetition_last_n")) {
            if (!parse_i64(val, 0, INT32_MAX, &a->repetition_last_n))
                return usage_error("--repetition_last_n must be an integer >= 0, got '%s'", val);
        } else if (!strcmp(name, "--logit_bias")) {
            a->logit_bias = val;
        } else if (!strcmp(name, "--stop_ids")) {
            a->stop_ids = val;
        } else if (!strcmp(name, "--json_schema")) {
            a->json_schema = val;
        } else if (!strcmp(name, "--num_threads")) {
            if (!parse_i64(val, 0, 4096, &a->num_threads))
                return usage_error("--num_threads must be an integer in 0..4096, got '%s'", val);
        } else if (!strcmp(name, "--max_seq_len")) {
            if (!parse_i64(val, 0, INT64_MAX, &a->max_seq_len))
                return usage_error("--max_seq_len must be an integer >= 0, got '%s'", val);
        } else if (!strcmp(name, "--precision")) {
            if (!parse_precision(val, &a->precision)) return usage_error(PRECISION_USAGE, val);
        } else {
            int rc = parse_engine_flag(name, val, &a->ef);
            if (rc >= 0) return rc;
        }
    }
    if (!a->model) return usage_error("--model is required");
    if (!a->prompt) return usage_error("--prompt is required");
    int bad = check_engine_flags(&a->ef);
    if (bad >= 0) return bad;
    return -1;
}

static int tok_error(colibri_tokenizer *tok, colibri_status st, const char *what) {
    const char *msg = colibri_tokenizer_last_error(tok);
    fprintf(stderr, "colibri_cli: error: %s: %s\n", what,
            (msg && *msg) ? msg : colibri_status_string(st));
    return EXIT_ENGINE;
}

/* Print a piece between quotes with control characters, quotes and backslashes escaped;
 * other bytes (UTF-8 included) as they are. */
static void print_escaped(FILE *f, const char *s, uint64_t n) {
    fputc('"', f);
    for (uint64_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        switch (c) {
        case '\n': fputs("\\n", f); break;
        case '\t': fputs("\\t", f); break;
        case '\r': fputs("\\r", f); break;
        case '"': fputs("\\\"", f); break;
        case '\\': fputs("\\\\", f); break;
        default:
            if (c < 0x20 || c == 0x7f) fprintf(f, "\\x%02x", c);
            else fputc(c, f);
        }
    }
    fputc('"', f);
}

/* The top-5 table for the last row of logits: softmax in double, ties to the lower id. */
static int print_top(colibri_ctx *ctx, colibri_tokenizer *tok, const float *row, int64_t vocab,
                     int64_t n_prompt) {
    double maxv = -INFINITY;
    for (int64_t v = 0; v < vocab; v++)
        if (row[v] > maxv) maxv = row[v];
    double sum = 0;
    for (int64_t v = 0; v < vocab; v++) sum += exp((double)row[v] - maxv);

    int64_t best[TOP_N];
    int nbest = 0;
    for (int64_t v = 0; v < vocab; v++) {
        /* insert v if it beats the current last (strictly: earlier ids win ties) */
        int pos = nbest;
        while (pos > 0 && row[v] > row[best[pos - 1]]) pos--;
        if (pos >= TOP_N) continue;
        int last = nbest < TOP_N ? nbest : TOP_N - 1;
        for (int j = last; j > pos; j--) best[j] = best[j - 1];
        best[pos] = v;
        if (nbest < TOP_N) nbest++;
    }

    printf("top-%d next tokens after %" PRId64 " prompt tokens:\n", nbest, n_prompt);
    for (int r = 0; r < nbest; r++) {
        const char *piece = NULL;
        uint64_t plen = 0;
        colibri_status st = colibri_token_piece(tok, (int32_t)best[r], &piece, &plen);
        double p = exp((double)row[best[r]] - maxv) / sum;
        printf("%2d  id=%-7" PRId64 " p=%.6f  piece=", r + 1, best[r], p);
        if (st == COLIBRI_OK) print_escaped(stdout, piece, plen);
        else fputs("(none)", stdout); /* an id the tokenizer lacks (padded embedding) */
        fputc('\n', stdout);
    }
    (void)ctx;
    return 0;
}

/* Length of the run of U+FFFD (EF BF BD) at the end of s[0..n): bytes that may still turn
 * into a character when the next byte-fallback token arrives. */
static uint64_t replacement_tail(const char *s, uint64_t n) {
    uint64_t k = n;
    while (k >= 3 && (unsigned char)s[k - 3] == 0xEF && (unsigned char)s[k - 2] == 0xBF &&
           (unsigned char)s[k - 1] == 0xBD)
        k -= 3;
    return n - k;
}

/* Decode ids[0..n) into *buf (grown as needed); *len gets the byte length. */
/* The trace's time per stage (all layers summed), in ns per token and as a share. */
static void print_stages(const colibri_trace *tr, const char *what, int64_t n_tokens) {
    static const char *const names[COLIBRI_N_STAGES] = {"embedding", "attention", "router", "grouping",
                                                        "expert_ffn", "combine", "lm_head"};
    const void *data;
    int32_t dtype, ndim;
    int64_t shape[4];
    if (colibri_trace_array(tr, "stage_ns", &data, &dtype, &ndim, shape) != COLIBRI_OK) return;
    const uint64_t *ns = data;
    uint64_t total = 0;
    for (int i = 0; i < COLIBRI_N_STAGES; i++) total += ns[i];
    fprintf(stderr, "%s stages (ns per token, all layers):", what);
    for (int i = 0; i < COLIBRI_N_STAGES; i++)
        fprintf(stderr, " %s %.0f (%.1f%%)%s", names[i], (double)ns[i] / (double)n_tokens,
                total ? 100.0 * (double)ns[i] / (double)total : 0.0, i + 1 < COLIBRI_N_STAGES ? "," : "\n");
}

static colibri_status decode_all(colibri_tokenizer *tok, const int32_t *ids, int64_t n,
                                 char **buf, uint64_t *cap, uint64_t *len) {
    for (;;) {
        colibri_status st = colibri_detokenize(tok, ids, n, *buf, *cap, len);
        if (st != COLIBRI_E_BUFFER_TOO_SMALL) return st;
        uint64_t want = *len + *len / 2 + 64;
        char *nb = realloc(*buf, want);
        if (!nb) return COLIBRI_E_NOMEM;
        *buf = nb;
        *cap = want;
    }
}

/* --verbose, after the run: what the expert cache did since the load. */
static void print_cache_counts(colibri_ctx *ctx) {
    cache_counts c;
    if (read_cache_counts(ctx, &c) != COLIBRI_OK) return;
    int64_t uses = c.hits + c.misses;
    fprintf(stderr, "expert cache: %" PRId64 " hits, %" PRId64 " misses (hit rate %.1f%%), %" PRId64
                    " prefetches, %" PRId64 " prefetch hits, %" PRId64 " wasted prefetches, %" PRId64
                    " bytes read (%.1f MiB)\n",
            c.hits, c.misses, uses > 0 ? 100.0 * (double)c.hits / (double)uses : 0.0, c.prefetches,
            c.prefetch_hits, c.wasted, c.bytes_read, (double)c.bytes_read / 1048576.0);
}

/* "A:B,C:D" pairs or "A,B" ids; returns the count, -1 on a malformed list. */
static int32_t parse_list(const char *s, int pairs, int32_t *ids, float *vals, int32_t cap) {
    int32_t n = 0;
    while (s && *s) {
        char *end;
        errno = 0;
        long id = strtol(s, &end, 10);
        if (errno || end == s || id < INT32_MIN || id > INT32_MAX || n >= cap) return -1;
        s = end;
        if (pairs) {
            if (*s != ':') return -1;
            double v = strtod(s + 1, &end);
            if (end == s + 1) return -1;
            vals[n] = (float)v;
            s = end;
        }
        ids[n++] = (int32_t)id;
        if (*s == ',') s++;
        else if (*s) return -1;
    }
    return n;
}

/* The per-sequence sampler of the run, with its bias, stop ids and grammar. 0 or an exit status. */
static int make_sampler(const args *a, colibri_ctx *ctx, colibri_tokenizer *tok, int32_t vocab, const int32_t *prompt,
                        int64_t n_prompt, colibri_sampler **out, colibri_grammar **gout) {
    colibri_sampling_params p;
    colibri_sampling_params_init(&p);
    p.temperature = (float)a->temperature;
    p.top_k = (int32_t)a->top_k;
    p.top_p = (float)a->top_p;
    p.min_p = (float)a->min_p;
    p.presence_penalty = (float)a->presence_penalty;
    p.frequency_penalty = (float)a->frequency_penalty;
    p.repetition_penalty = (float)a->repetition_penalty;
    p.repetition_last_n = (int32_t)a->repetition_last_n;
    p.ignore_eos = a->ignore_eos;
    char err[512] = "";
    colibri_status st = colibri_sampler_create(vocab, colibri_tokenizer_eos_id(tok), &p, out, err, sizeof err);
    if (st != COLIBRI_OK) return usage_error("%s", err);
    const int32_t *end_ids;
    int32_t n_end;
    if ((st = colibri_get_end_ids(ctx, &end_ids, &n_end)) != COLIBRI_OK ||
        (st = colibri_sampler_set_end_ids(*out, end_ids, n_end)) != COLIBRI_OK)
        return engine_error(ctx, st, "the model's end ids");
    int32_t ids[1024];
    float vals[1024];
    int32_t n;
    if (a->logit_bias) {
        if ((n = parse_list(a->logit_bias, 1, ids, vals, 1024)) < 0)
            return usage_error("--logit_bias must be ID:BIAS,... (at most 1024), got '%s'", a->logit_bias);
        if (colibri_sampler_set_logit_bias(*out, ids, vals, n) != COLIBRI_OK)
            return usage_error("--logit_bias: %s", colibri_sampler_last_error(*out));
    }
    if (a->stop_ids) {
        if ((n = parse_list(a->stop_ids, 0, ids, vals, 1024)) < 0)
            return usage_error("--stop_ids must be ID,... (at most 1024), got '%s'", a->stop_ids);
        if (colibri_sampler_set_stop_ids(*out, ids, n) != COLIBRI_OK)
            return usage_error("--stop_ids: %s", colibri_sampler_last_error(*out));
    }
    if (a->json_schema || a->json_any) {
        st = colibri_grammar_compile(tok, a->json_schema, NULL, NULL, gout, err, sizeof err);
        if (st != COLIBRI_OK) return usage_error("--json_schema: %s", err);
        if (colibri_sampler_set_grammar(*out, *gout) != COLIBRI_OK)
            return usage_error("--json_schema: %s", colibri_sampler_last_error(*out));
    }
    if (colibri_sampler_add_prompt(*out, prompt, n_prompt) != COLIBRI_OK) {
        fprintf(stderr, "colibri_cli: error: %s\n", colibri_sampler_last_error(*out));
        return EXIT_ENGINE;
    }
    return 0;
}

int main(int argc, char **argv) {
    args a;
    int rc = parse_args(argc, argv, &a);
    if (rc >= 0) return rc;
    if (colibri_abi_version() != COLIBRI_ABI_VERSION) {
        fprintf(stderr, "colibri_cli: error: library ABI %d, tool built for %d\n",
                colibri_abi_version(), COLIBRI_ABI_VERSION);
        return EXIT_ENGINE;
    }

    colibri_options opt;
    colibri_options_init(&opt);
    opt.num_threads = (int32_t)a.num_threads;
    opt.max_seq_len = a.max_seq_len;
    opt.precision = a.precision;
    engine_flags_apply(&a.ef, &opt);

    double t0 = now_ms();
    colibri_ctx *ctx = NULL;
    char err[1024] = "";
    colibri_status st = colibri_init_ex(a.model, &opt, &ctx, err, sizeof err);
    if (st != COLIBRI_OK) {
        fprintf(stderr, "colibri_cli: error: cannot open model: %s\n",
                *err ? err : colibri_status_string(st));
        return EXIT_ENGINE;
    }
    double t_load = now_ms() - t0;

    int32_t *ids = NULL;
    float *logits = NULL;
    char *text = NULL;
    colibri_trace *trace = NULL;
    colibri_sampler *sampler = NULL;
    colibri_grammar *grammar = NULL;
    rc = EXIT_ENGINE;

    if (a.verify) {
        double tv = now_ms();
        st = colibri_verify(ctx);
        if (st != COLIBRI_OK) { rc = engine_error(ctx, st, "checksum verification failed"); goto done; }
        if (a.verbose) fprintf(stderr, "verify: all CRC-32 match (%.1f ms)\n", now_ms() - tv);
    }
    st = colibri_verify_router(ctx);
    if (st != COLIBRI_OK) { rc = engine_error(ctx, st, "router weights do not match their stored norms"); goto done; }

    int64_t vocab = 0, max_seq = 0, threads = 0, ec_slots = 0, ec_policy = -1, ec_slot_bytes = 0, ec_direct = 0;
    const char *precision = "", *kernels = "";
    backend_facts bf;
    if ((st = read_backend_facts(ctx, &bf)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "vocab_size", &vocab)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "max_seq_len", &max_seq)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "threads_used", &threads)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "expert_cache_slots", &ec_slots)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "expert_cache_policy", &ec_policy)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "expert_cache_slot_bytes", &ec_slot_bytes)) != COLIBRI_OK ||
        (st = colibri_get_int(ctx, "expert_cache_direct", &ec_direct)) != COLIBRI_OK ||
        (st = colibri_get_string(ctx, "precision", &precision)) != COLIBRI_OK ||
        (st = colibri_get_string(ctx, "kernels", &kernels)) != COLIBRI_OK) {
        rc = engine_error(ctx, st, "reading the model's settings");
        goto done;
    }
    colibri_tokenizer *tok = colibri_get_tokenizer(ctx);
    if (!tok) {
        fprintf(stderr, "colibri_cli: error: the model has no tokenizer\n");
        goto done;
    }

    /* Encode the prompt with BOS, then make room for the generated ids. */
    uint64_t plen = strlen(a.prompt);
    int64_t cap = (int64_t)plen + 2, n_prompt = 0;
    ids = malloc((size_t)cap * sizeof *ids);
    if (!ids) goto oom;
    st = colibri_tokenize(tok, a.prompt, plen, 1, ids, cap, &n_prompt);
    if (st == COLIBRI_E_BUFFER_TOO_SMALL) {
        cap = n_prompt;
        int32_t *ni = realloc(ids, (size_t)cap * sizeof *ids);
        if (!ni) goto oom;
        ids = ni;
        st = colibri_tokenize(tok, a.prompt, plen, 1, ids, cap, &n_prompt);
    }
    if (st != COLIBRI_OK) { rc = tok_error(tok, st, "encoding the prompt"); goto done; }
    {
        int32_t *ni = realloc(ids, (size_t)(n_prompt + a.max_new_tokens) * sizeof *ids);
        if (!ni) goto oom;
        ids = ni;
    }
    if (a.verbose)
        fprintf(stderr, "load: %.1f ms (%s, vocab %" PRId64 ", max_seq_len %" PRId64
                        ", %" PRId64 " thread(s) used)\nprecision: %s (kernels %s)\nprompt: %" PRId64 " tokens\n",
                t_load, a.model, vocab, max_seq, threads, precision, kernels, n_prompt);
    if (a.verbose) {
        fprintf(stderr, "backend: %s (%s)\n", bf.name, bf.device);
        if (bf.device_bytes > 0)
            fprintf(stderr, "backend memory: %.1f MiB on the device (%.1f MiB of weights), %" PRId64
                            " routed experts resident, %" PRId64 " on the host\n",
                    (double)bf.device_bytes / 1048576.0, (double)bf.weight_bytes / 1048576.0, bf.experts_resident,
                    bf.experts_host);
    }
    if (a.verbose && ec_slots > 0)
        fprintf(stderr, "expert cache: %" PRId64 " slot(s) per MoE layer, policy %s, %" PRId64 " bytes per slot, %s\n",
                ec_slots, cache_policy_name(ec_policy), ec_slot_bytes,
                ec_direct ? "O_DIRECT reads" : "buffered reads (no O_DIRECT here)");

    /* --verbose: a trace times every stage (colibri.h, "Observation") */
    if (a.verbose) {
        char terr[256] = "";
        st = colibri_trace_create(ctx, n_prompt + a.max_new_tokens, &trace, terr, sizeof terr);
        if (st == COLIBRI_OK) st = colibri_trace_attach(ctx, trace);
        if (st != COLIBRI_OK) {
            fprintf(stderr, "colibri_cli: error: cannot trace: %s\n", *terr ? terr : colibri_last_error(ctx));
            goto done;
        }
    }

    /* Prefill: all prompt rows are computed; only the last one is used. */
    logits = malloc((size_t)n_prompt * (size_t)vocab * sizeof *logits);
    if (!logits) goto oom;
    double tp = now_ms();
    st = colibri_forward_last(ctx, ids, n_prompt, 0, logits); /* only the last row is used */
    double t_prefill = now_ms() - tp;
    if (st != COLIBRI_OK) { rc = engine_error(ctx, st, "prefill"); goto done; }
    if (a.verbose)
        fprintf(stderr, "prefill: %" PRId64 " tokens in %.2f ms (%.1f tok/s)\n", n_prompt,
                t_prefill, t_prefill > 0 ? (double)n_prompt / t_prefill * 1e3 : 0.0);
    if (trace) {
        print_stages(trace, "prefill", n_prompt);
        colibri_trace_reset(trace);
    }
    const float *row = logits;

    if (a.max_new_tokens == 1) {
        rc = print_top(ctx, tok, row, vocab, n_prompt);
        if (a.verbose && ec_slots > 0) print_cache_counts(ctx);
        goto done;
    }

    /* Decode loop. Text is streamed by decoding prompt + generated ids and printing what
     * is new, holding back a trailing U+FFFD that the next byte token may complete. */
    uint64_t tcap = 256, tlen = 0, printed = 0;
    text = malloc(tcap);
    if (!text) goto oom;
    if ((st = decode_all(tok, ids, n_prompt, &text, &tcap, &tlen)) != COLIBRI_OK) {
        rc = tok_error(tok, st, "decoding");
        goto done;
    }
    printed = tlen - replacement_tail(text, tlen);

    uint64_t rng = a.seed;
    int64_t n = n_prompt, n_gen = 0;
    if ((rc = make_sampler(&a, ctx, tok, (int32_t)vocab, ids, n_prompt, &sampler, &grammar)) != 0) goto done;
    double td = now_ms();
    for (;;) {
        int32_t next;
        st = colibri_sampler_sample(sampler, row, &rng, &next);
        if (st != COLIBRI_OK) {
            fprintf(stderr, "colibri_cli: error: sampling: %s\n", colibri_sampler_last_error(sampler));
            rc = EXIT_ENGINE;
            goto done;
        }
        int32_t fin = colibri_sampler_finished(sampler);
        if (fin == COLIBRI_FINISH_EOS || fin == COLIBRI_FINISH_STOP_ID) break;
        ids[n++] = next;
        n_gen++;

        if ((st = decode_all(tok, ids, n, &text, &tcap, &tlen)) != COLIBRI_OK) {
            rc = tok_error(tok, st, "decoding");
            goto done;
        }
        uint64_t upto = tlen - replacement_tail(text, tlen);
        if (upto > printed) {
            fwrite(text + printed, 1, upto - printed, stdout);
            fflush(stdout);
            printed = upto;
        }
        if (n_gen >= a.max_new_tokens || fin == COLIBRI_FINISH_GRAMMAR) break;

        st = colibri_forward_at(ctx, &ids[n - 1], 1, n - 1, logits);
        if (st != COLIBRI_OK) { rc = engine_error(ctx, st, "decode"); goto done; }
        row = logits;
    }
    double t_decode = now_ms() - td;
    if (tlen > printed) fwrite(text + printed, 1, tlen - printed, stdout);
    fputc('\n', stdout);
    fflush(stdout);
    if (a.verbose)
        fprintf(stderr, "decode: %" PRId64 " tokens in %.2f ms (%.1f tok/s)\n", n_gen, t_decode,
                t_decode > 0 ? (double)n_gen / t_decode * 1e3 : 0.0);
    if (trace) {
        int64_t fed = 0;
        colibri_trace_get_int(trace, "tokens", &fed);
        if (fed > 0) print_stages(trace, "decode", fed);
    }
    if (a.verbose && ec_slots > 0) print_cache_counts(ctx);
    rc = 0;
    goto done;

oom:
    fprintf(stderr, "colibri_cli: error: out of memory\n");
    rc = EXIT_ENGINE;
done:
    colibri_sampler_free(sampler);
    colibri_grammar_free(grammar);
    free(text);
    free(logits);
    free(ids);
    colibri_trace_free(trace);
    colibri_free(ctx);
    return rc;
}
