/*
 * fuzz_server_api.c — libFuzzer harness over colibri_server's request handling: the body of
 * a POST /v1/completions or /v1/chat/completions (byte 0's bit 0 chooses which, the rest is
 * the body; bits 1-2 send it instead to /tokenize (1), /detokenize (2), or through the split
 * of a list of prompts, each piece then parsed (3)) goes through cs_api_parse exactly as
 * http.c hands it over: UTF-8 check, JSON
 * parsing, every field's type and range checks, prompt tokenization or the chat template,
 * stop strings, n, logprobs. The handler must never crash, leak, read out of bounds or hit
 * undefined behaviour: every body becomes a job or an OpenAI-style error (whose JSON is built
 * too). The job is not run: the engine has its own harness (fuzz_loader.c).
 *
 * The model (a .colibri file with a tokenizer and, to reach the chat code, a chat template)
 * is $COLIBRI_FUZZ_MODEL (tools/fuzz.sh makes one from data/tiny-mixtral). Seeds:
 * native/tests/fuzz_corpus/server/ (byte 0 then a JSON body); crash inputs found:
 * native/tests/fuzz_corpus/server/regressions/. Build and run: tools/fuzz.sh server
 * (`make fuzz`, 600 s), or by hand after `tools/fuzz.sh build`:
 *   COLIBRI_FUZZ_MODEL=tiny.colibri build/fuzz/bin/fuzz_server_api CORPUS \
 *       native/tests/fuzz_corpus/server -max_len=4096 -max_total_time=600
 * tests/test_fuzz.py runs it for a few seconds from a copy of the seeds.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"
#include "server.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static cs_server srv;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    const char *path = getenv("COLIBRI_FUZZ_MODEL");
    if (!path) {
        fprintf(stderr, "fuzz_server_api: set COLIBRI_FUZZ_MODEL to a .colibri file with a tokenizer\n");
        exit(2);
    }
    colibri_options opt;
    colibri_options_init(&opt);
    opt.max_seq_len = 256;
    opt.max_seqs = 4;
    opt.num_threads = 1;
    char err[512];
    colibri_ctx *ctx = NULL;
    if (colibri_init_ex(path, &opt, &ctx, err, sizeof err) != COLIBRI_OK) {
        fprintf(stderr, "fuzz_server_api: %s\n", err);
        exit(2);
    }
    int64_t v = 0, s = 0;
    colibri_get_int(ctx, "vocab_size", &v);
    colibri_get_int(ctx, "max_seq_len", &s);
    srv.model_path = path;
    snprintf(srv.model_id, sizeof srv.model_id, "fuzz");
    srv.max_body_bytes = 1 << 20;
    srv.default_completion_tokens = 16;
    srv.ctx = ctx;
    srv.tok = colibri_get_tokenizer(ctx);
    if (!srv.tok) {
        fprintf(stderr, "fuzz_server_api: %s has no tokenizer\n", path);
        exit(2);
    }
    pthread_mutex_init(&srv.tok_mu, NULL);
    srv.vocab = v;
    srv.ctx_len = s;
    srv.bos_id = colibri_tokenizer_bos_id(srv.tok);
    srv.eos_id = colibri_tokenizer_eos_id(srv.tok);
    srv.max_seqs = 4;
    colibri_get_string(ctx, "chat_template", &srv.chat_template);
    /* the scheduler checks each parsed request against its limits (it runs nothing here) */
    static cs_engine eng;
    if (cs_colibri_init(&srv.engine, ctx, 64, &eng, err, sizeof err)) {
        fprintf(stderr, "fuzz_server_api: %s\n", err);
        exit(2);
    }
    int64_t block_tokens = 0;
    colibri_get_int(ctx, "kv_block_tokens", &block_tokens);
    cs_sched_config cfg = {4, 4, 64, 8, s, block_tokens, v, srv.eos_id, 32, NULL, 0};
    srv.sched = cs_sched_create(&cfg, &eng, err, sizeof err);
    if (!srv.sched) {
        fprintf(stderr, "fuzz_server_api: %s\n", err);
        exit(2);
    }
    atomic_store(&srv.state, CS_STATE_READY);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    cs_api_kind kind = (data[0] & 1) ? CS_API_CHAT : CS_API_COMPLETIONS;
    int mode = (data[0] >> 1) & 3;
    cs_job *job = NULL;
    cs_api_error e;
    memset(&e, 0, sizeof e);
    if (mode == 1 || mode == 2) { /* /tokenize, /detokenize: an answer or an error */
        size_t len = 0;
        char *out = (mode == 1 ? cs_api_tokenize : cs_api_detokenize)(&srv, (const char *)data + 1, size - 1, &len, &e);
        if (!out && (e.status < 400 || e.status > 599)) abort();
        free(out);
        return 0;
    }
    if (mode == 3) { /* a list of prompts: its pieces are parsed as http.c parses them */
        char **bodies = NULL;
        size_t *lens = NULL;
        int n = cs_api_split_prompts(&srv, (const char *)data + 1, size - 1, &bodies, &lens, &e);
        if (n < 0 && (e.status < 400 || e.status > 599)) abort();
        for (int i = 0; i < n; i++) {
            cs_api_error pe;
            memset(&pe, 0, sizeof pe);
            if (cs_api_parse(&srv, CS_API_COMPLETIONS, bodies[i], lens[i], &job, &pe) == 0) cs_job_unref(job);
            free(bodies[i]);
        }
        free(bodies);
        free(lens);
        return 0;
    }
    if (cs_api_parse(&srv, kind, (const char *)data + 1, size - 1, &job, &e) == 0) {
        cs_job_unref(job);
    } else {
        if (e.status < 400 || e.status > 599) abort(); /* an error is always a 4xx/5xx */
        size_t len = 0;
        char *js = cs_api_error_json(&e, &len);
        free(js);
    }
    return 0;
}
