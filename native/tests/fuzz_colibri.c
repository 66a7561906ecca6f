/*
 * fuzz_colibri.c — the older combined harness, kept only while native/CMakeLists.txt's
 * COLIBRI_FUZZ block still builds it (fuzz_colibri, fuzz_colibri_replay): the per-target
 * harnesses are fuzz_loader.c (the file loader and forward pass), fuzz_tokenizer.c (both
 * tokenizers) and fuzz_server_api.c (colibri_server's request handling), built and run by
 * tools/fuzz.sh and tests/test_fuzz.py. Remove this file with the CMake block's switch.
 *
 * Input modes (the first byte): 'C' (the "COLIBRI\0" magic): a whole .colibri file, as
 * fuzz_loader; 'U': byte 1 is a length L, bytes 2..2+L text, the rest a tokenizer section,
 * as fuzz_tokenizer; anything else: the rest is a tokenizer section, the text its last
 * up-to-64 bytes.
 */
#include "fuzz_common.c"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    if (data[0] == 'C') {
        fuzz_file(data, size);
    } else if (data[0] == 'U' && size >= 2) {
        size_t tl = data[1];
        if (tl > size - 2) tl = size - 2;
        fuzz_tokenizer(data + 2 + tl, size - 2 - tl, data + 2, tl);
    } else {
        fuzz_tokenizer(data + 1, size - 1, NULL, 0);
    }
    return 0;
}

#ifdef COLIBRI_FUZZ_LIBFUZZER
size_t LLVMFuzzerCustomMutator(uint8_t *data, size_t size, size_t max_size, unsigned int seed);

size_t LLVMFuzzerCustomMutator(uint8_t *data, size_t size, size_t max_size, unsigned int seed) {
    return colibri_mutate(data, size, max_size, seed);
}
#endif
