/*
 * fuzz_common.c — the code the libFuzzer harnesses share; #included by fuzz_loader.c,
 * fuzz_tokenizer.c, never compiled on its own.
 *
 *   fuzz_file()        a whole .colibri file: memfd, colibri_init_ex, forward, sample,
 *                      getters, the model's tokenizer, verify, free
 *   fuzz_tokenizer()   a tokenizer section (SentencePiece-BPE or byte-level BPE) given to
 *                      colibri_tokenizer_from_memory, then text encoded and ids decoded
 *   colibri_mutate()   the .colibri-aware mutation step (mutate inside one region, fix CRCs)
 *   main()             without libFuzzer (COLIBRI_FUZZ_LIBFUZZER undefined): run the harness
 *                      once over every file named on the command line
 *
 * The library must never crash, abort, leak, print, read out of bounds or hit undefined
 * behaviour on any input; it must return a status and a message.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "colibri.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FUZZ_MAYBE_UNUSED __attribute__((unused))

FUZZ_MAYBE_UNUSED static int open_memfd(const uint8_t *data, size_t size) {
    int fd = memfd_create("fuzz.colibri", MFD_CLOEXEC);
    if (fd < 0) return -1;
    size_t done = 0;
    while (done < size) {
        ssize_t w = write(fd, data + done, size - done);
        if (w <= 0) {
            close(fd);
            return -1;
        }
        done += (size_t)w;
    }
    return fd;
}

static const char *const k_texts[] = {
    "",
    "Hello world",
    " leading  spaces\n\ttabs\r\n",
    "caf\xc3\xa9 e\xcc\x81 \xef\xac\x81 \xe4\xbd\xa0\xe5\xa5\xbd \xf0\x9f\x99\x82 123456",
    "<|im_start|>user\nhi<|im_end|><s></s><unk>",
    "\xff\xfe\xc3\x28\xe2\x82\xf0\x90\x80\xed\xa0\x80\xc0\xaf\x00zero",
};

static void exercise_tokenizer(colibri_tokenizer *tok, const uint8_t *extra, size_t extra_len) {
    int32_t ids[256];
    char text[1024];
    int64_t n = 0;
    uint64_t len = 0;
    int32_t vocab = colibri_tokenizer_vocab_size(tok);
    (void)colibri_tokenizer_bos_id(tok);
    (void)colibri_tokenizer_eos_id(tok);
    (void)colibri_tokenizer_last_error(tok);
    size_t nt = sizeof k_texts / sizeof k_texts[0];
    for (size_t i = 0; i <= nt; i++) {
        const char *t = i < nt ? k_texts[i] : (const char *)extra;
        uint64_t tl = i < nt ? (i == nt - 1 ? 19 : strlen(k_texts[i])) : extra_len;
        if (i == nt && extra == NULL) break;
        colibri_status st = colibri_tokenize(tok, t, tl, (int)(i & 1), ids, 256, &n);
        if (st == COLIBRI_E_BUFFER_TOO_SMALL) n = 256;
        else if (st != COLIBRI_OK) continue;
        if (n > 256) n = 256;
        /* small cap first (partial output), then the full buffer */
        (void)colibri_detokenize(tok, ids, n, text, 3, &len);
        (void)colibri_detokenize(tok, ids, n, text, sizeof text, &len);
        (void)colibri_tokenize(tok, t, tl, 0, ids, 1, &n);
    }
    int32_t odd[] = {-1, 0, 1, 2, 3, vocab - 1, vocab, INT32_MAX, INT32_MIN};
    for (size_t i = 0; i < sizeof odd / sizeof odd[0]; i++) {
        const char *piece = NULL;
        uint64_t pl = 0;
        (void)colibri_token_piece(tok, odd[i], &piece, &pl);
        if (piece && pl) {
            volatile char c = piece[pl - 1]; /* the piece must be readable */
            (void)c;
        }
        (void)colibri_detokenize(tok, &odd[i], 1, text, sizeof text, &len);
    }
    (void)colibri_detokenize(tok, odd, (int64_t)(sizeof odd / sizeof odd[0]), text, sizeof text,
                             &len);
    /* every id decodes */
    if (vocab > 0) {
        int32_t step = vocab / 97 + 1;
        for (int32_t id = 0; id < vocab; id += step)
            (void)colibri_detokenize(tok, &id, 1, text, sizeof text, &len);
    }
}

FUZZ_MAYBE_UNUSED static void fuzz_file(const uint8_t *data, size_t size) {
    int fd = open_memfd(data, size);
    if (fd < 0) return;
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);

    colibri_options opt;
    colibri_options_init(&opt);
    opt.max_seq_len = 16;
    opt.max_batch = 3;
    opt.num_threads = 1;
    opt.group_pad = (size & 1) ? 2 : 1;
    opt.verify_checksums = (size & 2) ? 1 : 0;
    colibri_ctx *ctx = NULL;
    char err[256];
    colibri_status st = colibri_init_ex(path, &opt, &ctx, err, sizeof err);
    if (st != COLIBRI_OK || !ctx) {
        close(fd);
        return;
    }
    int64_t vocab = 0, v = 0;
    double d;
    const char *s;
    (void)colibri_get_int(ctx, "vocab_size", &vocab);
    static const char *const ints[] = {"n_layers", "hidden_size", "n_heads", "n_kv_heads",
                                       "head_dim", "n_experts", "top_k", "max_seq_len",
                                       "sliding_window", "bos_id", "eos_id", "arena_bytes",
                                       "router_int8", "no_such_key"};
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) (void)colibri_get_int(ctx, ints[i], &v);
    (void)colibri_get_float(ctx, "rope_theta", &d);
    (void)colibri_get_float(ctx, "rms_norm_eps", &d);
    static const char *const strs[] = {"architecture", "name", "weight_dtype", "router_dtype"};
    for (size_t i = 0; i < 4; i++)
        if (colibri_get_string(ctx, strs[i], &s) == COLIBRI_OK && s) (void)strlen(s);

    if (vocab > 0 && vocab <= (1 << 20)) {
        float *logits = malloc(sizeof(float) * (size_t)vocab * 5);
        if (logits) {
            int32_t good[5] = {0, (int32_t)(vocab - 1), (int32_t)(vocab / 2), 1 % vocab, 0};
            int32_t bad[3] = {0, (int32_t)vocab, -1};
            (void)colibri_forward(ctx, bad, 3, logits);
            st = colibri_forward(ctx, good, 5, logits);
            if (st == COLIBRI_OK) {
                uint64_t rng = size;
                int32_t id = -1;
                (void)colibri_sample(ctx, logits, 0.0f, 0, 1.0f, &rng, &id);
                (void)colibri_sample(ctx, logits + vocab, 0.8f, 5, 0.9f, &rng, &id);
                (void)colibri_sample(ctx, logits, 1.0f, -1, 2.0f, &rng, &id);
                (void)colibri_forward_at(ctx, good, 2, 5, logits);
                (void)colibri_forward_at(ctx, good, 1, 7, logits); /* beyond cached */
                (void)colibri_forward_at(ctx, good, 5, 14, logits); /* too long */
            }
            (void)colibri_cached_len(ctx);
            free(logits);
        }
    }
    colibri_tokenizer *tok = colibri_get_tokenizer(ctx);
    if (tok) exercise_tokenizer(tok, NULL, 0);
    (void)colibri_verify(ctx);
    (void)colibri_verify_router(ctx);
    (void)colibri_last_error(ctx);
    colibri_free(ctx);
    close(fd);
}

/* text == NULL: the text is the last up-to-64 bytes of the section. */
FUZZ_MAYBE_UNUSED static void fuzz_tokenizer(const uint8_t *data, size_t size, const uint8_t *text, size_t text_len) {
    /* Copy section and text to exact-size heap blocks so that ASan sees any read past them. */
    uint8_t *buf = malloc(size ? size : 1);
    uint8_t *tbuf = malloc(text_len ? text_len : 1);
    if (!buf || !tbuf) {
        free(buf);
        free(tbuf);
        return;
    }
    if (size) memcpy(buf, data, size);
    if (text && text_len) memcpy(tbuf, text, text_len);
    colibri_tokenizer *tok = NULL;
    char err[256];
    if (colibri_tokenizer_from_memory(buf, size, &tok, err, sizeof err) == COLIBRI_OK && tok) {
        if (text) {
            exercise_tokenizer(tok, tbuf, text_len);
        } else {
            size_t tl = size < 64 ? size : 64;
            exercise_tokenizer(tok, buf + size - tl, tl);
        }
        colibri_tokenizer_free(tok);
    }
    free(tbuf);
    free(buf);
}

/* ---- the .colibri mutator: mutate mostly inside the parsed regions, then fix the CRCs ---- */

FUZZ_MAYBE_UNUSED static uint64_t rd64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* zlib/IEEE CRC-32, independent of the library's own. */
FUZZ_MAYBE_UNUSED static uint32_t crc32_ieee(const uint8_t *p, size_t n) {
    static uint32_t table[256];
    static int ready = 0;
    if (!ready) {
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            table[i] = c;
        }
        ready = 1;
    }
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

FUZZ_MAYBE_UNUSED static void fix_crcs(uint8_t *data, size_t size) {
    if (size < 256 || memcmp(data, "COLIBRI", 7) != 0) return;
    for (int s = 0; s < 3; s++) {
        uint8_t *e = data + 56 + 24 * s;
        uint64_t off = rd64(e), sz = rd64(e + 8);
        if (off <= size && sz <= size - off) {
            uint32_t c = crc32_ieee(data + off, (size_t)sz);
            memcpy(e + 16, &c, 4);
        }
    }
    uint32_t h = crc32_ieee(data, 252);
    memcpy(data + 252, &h, 4);
}


#ifdef COLIBRI_FUZZ_LIBFUZZER
size_t LLVMFuzzerMutate(uint8_t *data, size_t size, size_t max_size);

/* Most mutations of a .colibri input stay inside one of the header / metadata / tensor
 * directory / tokenizer regions (keeping the file's length), and the header CRC (bytes
 * 0..251 -> u32 at 252) and the CRCs of sections 0..2 are recomputed afterwards, so that
 * mutations reach the parsers instead of dying at the checksum checks (1 in 16 keeps a
 * broken CRC; FUZZ_NO_CRC_FIX turns the fixing off). */
FUZZ_MAYBE_UNUSED static size_t colibri_mutate(uint8_t *data, size_t size, size_t max_size,
                                               unsigned int seed) {
    uint32_t r = seed * 2654435761u;
    if (size >= 256 && data[0] == 'C' && (r & 7) != 0) {
        int which = (int)((r >> 3) % 4);
        uint64_t off = 0, len = 252;
        if (which > 0) {
            const uint8_t *e = data + 56 + 24 * (which - 1);
            off = rd64(e);
            len = rd64(e + 8);
            if (off > size || len > size - off || len == 0) off = 0, len = 252;
        }
        uint8_t *tmp = malloc((size_t)len);
        if (tmp) {
            memcpy(tmp, data + off, (size_t)len);
            size_t n = LLVMFuzzerMutate(tmp, (size_t)len, (size_t)len);
            memcpy(data + off, tmp, n);
            if (n < len) memset(data + off + n, 0, (size_t)len - n);
            free(tmp);
        }
    } else {
        size = LLVMFuzzerMutate(data, size, max_size);
    }
#ifndef FUZZ_NO_CRC_FIX
    if ((r >> 8) % 16 != 0) fix_crcs(data, size);
#endif
    return size;
}
#else
/* Plain build: run the harness once over every file named on the command line. */
int main(int argc, char **argv) {
    int failed = 0;
    for (int i = 1; i < argc; i++) {
        FILE *f = fopen(argv[i], "rb");
        if (!f) {
            fprintf(stderr, "%s: cannot open %s\n", argv[0], argv[i]);
            failed = 1;
            continue;
        }
        uint8_t *buf = NULL;
        size_t n = 0, cap = 0;
        for (;;) {
            if (n == cap) {
                cap = cap ? cap * 2 : 65536;
                uint8_t *nb = realloc(buf, cap);
                if (!nb) break;
                buf = nb;
            }
            size_t got = fread(buf + n, 1, cap - n, f);
            if (got == 0) break;
            n += got;
        }
        fclose(f);
        LLVMFuzzerTestOneInput(buf ? buf : (const uint8_t *)"", n);
        free(buf);
        printf("%s: ran %s (%zu bytes)\n", argv[0], argv[i], n);
    }
    return failed;
}
#endif
