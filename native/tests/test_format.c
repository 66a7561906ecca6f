/*
 * test_format.c — the loader accepts a good .colibri file (argv[1]) and refuses damaged
 * copies of it with the right status and a message that says what is wrong.
 *
 * Each damaged copy is written to a temporary file and opened in this process (the
 * loader must never crash; run under a sanitizer to make that strict). Without argv[1]
 * only the file-system errors are checked.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "colibri.h"

static int n_fail = 0;

#define CHECK(cond, ...)                                         \
    do {                                                         \
        if (!(cond)) {                                           \
            n_fail++;                                            \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);          \
            printf(__VA_ARGS__);                                 \
            printf("\n");                                        \
        }                                                        \
    } while (0)

/* zlib CRC-32, bitwise: independent of the library's table version */
static uint32_t crc32_bitwise(const uint8_t *p, size_t n) {
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c & 1u) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
    }
    return ~c;
}

static uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static void wr32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void wr64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

/* recompute the header CRC (and, if asked, the small sections' CRCs) */
static void fix_crcs(uint8_t *b, size_t n, int sections_too) {
    if (n < 256) return;
    if (sections_too) {
        for (int k = 0; k < 3; k++) {
            uint64_t off = rd64(b + 56 + 24 * k), size = rd64(b + 64 + 24 * k);
            if (off <= n && size <= n - off) wr32(b + 72 + 24 * k, crc32_bitwise(b + off, (size_t)size));
        }
    }
    wr32(b + 252, crc32_bitwise(b, 252));
}

static char tmp_path[256];

static colibri_status open_bytes(const uint8_t *b, size_t n, char *err, size_t err_len) {
    FILE *f = fopen(tmp_path, "wb");
    if (!f) return COLIBRI_E_IO;
    if (n) fwrite(b, 1, n, f);
    fclose(f);
    colibri_ctx *ctx = NULL;
    colibri_status st = colibri_init_ex(tmp_path, NULL, &ctx, err, err_len);
    if (st == COLIBRI_OK) {
        int64_t V = 0;
        colibri_get_int(ctx, "vocab_size", &V);
        float *lg = malloc((size_t)V * 3 * sizeof(float));
        int32_t ids[3] = {0, (int32_t)(1 % V), (int32_t)(2 % V)};
        if (lg) (void)colibri_forward(ctx, ids, 3, lg);
        free(lg);
        colibri_free(ctx);
    }
    return st;
}

int main(int argc, char **argv) {
    char err[512];
    colibri_ctx *ctx = NULL;
    colibri_status st = colibri_init_ex("/nonexistent/x.colibri", NULL, &ctx, err, sizeof err);
    CHECK(st == COLIBRI_E_IO && ctx == NULL && strstr(err, "x.colibri") && strstr(err, "No such file"),
          "missing file: %d '%s'", st, err);
    st = colibri_init_ex("/tmp", NULL, &ctx, err, sizeof err);
    CHECK(st == COLIBRI_E_IO && strstr(err, "directory"), "directory: %d '%s'", st, err);
    CHECK(colibri_init_ex(NULL, NULL, &ctx, err, sizeof err) == COLIBRI_E_INVALID_ARG, "NULL path");
    CHECK(colibri_status_string(COLIBRI_E_FORMAT)[0] != 0, "status string");
    CHECK(colibri_abi_version() == COLIBRI_ABI_VERSION, "abi version");

    if (argc < 2) {
        printf("test_format: %s (file checks skipped: no model file given as argv[1])\n",
               n_fail ? "FAILED" : "OK");
        return n_fail ? 1 : 0;
    }
    snprintf(tmp_path, sizeof tmp_path, "/tmp/colibri_test_format_%d.colibri", (int)getpid());

    /* the good file */
    st = colibri_init_ex(argv[1], NULL, &ctx, err, sizeof err);
    CHECK(st == COLIBRI_OK, "good file: %d '%s'", st, err);
    if (st != COLIBRI_OK) return 1;
    int64_t v = 0;
    double d = 0;
    const char *s = NULL;
    CHECK(colibri_get_int(ctx, "format_version", &v) == COLIBRI_OK && v == 1, "format_version");
    CHECK(colibri_get_int(ctx, "num_threads", &v) == COLIBRI_OK && v >= 1, "num_threads");
    CHECK(colibri_get_int(ctx, "no_such_name", &v) == COLIBRI_E_INVALID_ARG &&
              strstr(colibri_last_error(ctx), "no_such_name"), "unknown int name");
    CHECK(colibri_get_float(ctx, "rope_theta", &d) == COLIBRI_OK && d > 0, "rope_theta");
    CHECK(colibri_get_string(ctx, "architecture", &s) == COLIBRI_OK &&
              (strcmp(s, "mixtral") == 0 || strcmp(s, "qwen2_moe") == 0 || strcmp(s, "qwen3_moe") == 0 ||
               strcmp(s, "olmoe") == 0), "architecture '%s'", s ? s : "(null)");
    CHECK(colibri_verify(ctx) == COLIBRI_OK, "verify: %s", colibri_last_error(ctx));
    CHECK(colibri_verify_router(ctx) == COLIBRI_OK, "verify_router: %s", colibri_last_error(ctx));
    int64_t fsize = 0;
    colibri_get_int(ctx, "file_size", &fsize);
    colibri_free(ctx);

    FILE *f = fopen(argv[1], "rb");
    if (!f) return 1;
    uint8_t *good = malloc((size_t)fsize), *b = malloc((size_t)fsize);
    if (!good || !b || fread(good, 1, (size_t)fsize, f) != (size_t)fsize) return 1;
    fclose(f);
    size_t n = (size_t)fsize;

    memcpy(b, good, n);
    memcpy(b, "GGUF", 4);
    st = open_bytes(b, n, err, sizeof err);
    CHECK(st == COLIBRI_E_FORMAT, "bad magic: %d '%s'", st, err);

    memcpy(b, good, n);
    wr32(b + 8, 7);
    fix_crcs(b, n, 0);
    st = open_bytes(b, n, err, sizeof err);
    CHECK(st == COLIBRI_E_VERSION && strstr(err, "version 7") && strstr(err, "versions 1 to 2"), "version: %d '%s'",
          st, err);

    memcpy(b, good, n);
    wr32(b + 8, 0);
    fix_crcs(b, n, 0);
    st = open_bytes(b, n, err, sizeof err);
    CHECK(st == COLIBRI_E_VERSION && strstr(err, "version 0"), "version 0: %d '%s'", st, err);

    memcpy(b, good, n);
    b[30] ^= 0xff;
    st = open_bytes(b, n, err, sizeof err);
    CHECK(st == COLIBRI_E_CHECKSUM, "header crc: %d '%s'", st, err);

    const struct { int off; uint32_t val; const char *needle; } fields[] = {
        {24, 0, "n_experts"}, {48, 0, "n_layers"}, {28, 1000, "top_k"}, {32, 0, "hidden_size"},
        {204, 0, "block_size"}, {200, 48, "alignment"},
    };
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        memcpy(b, good, n);
        wr32(b + fields[i].off, fields[i].val);
        fix_crcs(b, n, 0);
        st = open_bytes(b, n, err, sizeof err);
        CHECK(st == COLIBRI_E_FORMAT && strstr(err, fields[i].needle), "header %s: %d '%s'", fields[i].needle, st, err);
    }
    for (int k = 0; k < 6; k++) {
        memcpy(b, good, n);
        wr64(b + 56 + 24 * k, (uint64_t)n + 64);
        fix_crcs(b, n, 0);
        st = open_bytes(b, n, err, sizeof err);
        CHECK(st == COLIBRI_E_FORMAT, "section %d offset past end: %d '%s'", k, st, err);
        memcpy(b, good, n);
        wr64(b + 64 + 24 * k, UINT64_MAX - 15);
        fix_crcs(b, n, 0);
        st = open_bytes(b, n, err, sizeof err);
        CHECK(st == COLIBRI_E_FORMAT, "section %d size overflow: %d '%s'", k, st, err);
    }
    /* truncations: never opens; past the header the message says truncated */
    size_t cuts[] = {0, 1, 7, 8, 12, 100, 255, 256, 257, 1000, n / 3, n / 2, n - 1};
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        if (cuts[i] >= n) continue;
        st = open_bytes(good, cuts[i], err, sizeof err);
        CHECK(st != COLIBRI_OK && err[0], "cut at %zu opened", cuts[i]);
        if (cuts[i] >= 256) CHECK(strstr(err, "truncated") != NULL, "cut at %zu: '%s'", cuts[i], err);
    }
    /* every single-byte change in the metadata and tensor directory, CRCs fixed */
    uint64_t m_off = rd64(good + 56), t_off = rd64(good + 80), t_size = rd64(good + 88);
    int opened = 0, total = 0;
    for (uint64_t p = m_off; p < t_off + t_size; p += 3) {
        memcpy(b, good, n);
        b[p] ^= (uint8_t)(0x5a + p);
        fix_crcs(b, n, 1);
        st = open_bytes(b, n, err, sizeof err);
        total++;
        if (st == COLIBRI_OK) opened++;
        else CHECK(err[0] != 0, "mutation at %llu: empty message", (unsigned long long)p);
    }
    unlink(tmp_path);
    free(good);
    free(b);
    printf("test_format: %s (%d of %d mutated copies were refused)\n", n_fail ? "FAILED" : "OK",
           total - opened, total);
    return n_fail ? 1 : 0;
}
