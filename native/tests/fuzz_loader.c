/*
 * fuzz_loader.c — libFuzzer target over the file loader and what a loaded model offers: the
 * whole input is a .colibri file, written to a memfd and opened with colibri_init_ex
 * (max_seq_len 16, small batch, group_pad and verify_checksums chosen by the size); if it
 * opens: getters, forward of a few ids (in- and out-of-range), forward_at, sample (greedy and
 * top-k/top-p), the model's tokenizer when it has one, colibri_verify, colibri_verify_router,
 * colibri_free (fuzz_common.c, fuzz_file). A custom mutator mutates mostly inside one of
 * the header / metadata / tensor directory / tokenizer regions and recomputes the CRCs.
 *
 * Seeds: native/tests/fuzz_corpus/loader/ (tiny models, bf16 / q8_0, SentencePiece and
 * byte-level BPE tokenizers); crash inputs found: native/tests/fuzz_corpus/loader/regressions/.
 * Build and run: tools/fuzz.sh loader (FUZZ_SECONDS=600), or by hand
 *   build/fuzz/bin/fuzz_loader CORPUS native/tests/fuzz_corpus/loader -max_len=70000 \
 *       -rss_limit_mb=3072 -max_total_time=600 -print_final_stats=1
 *   build/fuzz/bin/fuzz_loader crash-<sha1>        # reproduce
 */
#include "fuzz_common.c"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    fuzz_file(data, size);
    return 0;
}

#ifdef COLIBRI_FUZZ_LIBFUZZER
size_t LLVMFuzzerCustomMutator(uint8_t *data, size_t size, size_t max_size, unsigned int seed);

size_t LLVMFuzzerCustomMutator(uint8_t *data, size_t size, size_t max_size, unsigned int seed) {
    return colibri_mutate(data, size, max_size, seed);
}
#endif
