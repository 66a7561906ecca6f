/*
 * fuzz_tokenizer.c — libFuzzer target over both tokenizers, the SentencePiece-BPE one
 * (native/src/tokenizer/tokenizer.c, section type 1) and the byte-level BPE one (bpe.c,
 * type 2, patterns GPT-2 / Qwen2 / Llama-3 / tekken / o200k / DeepSeek-V3 / Kimi /
 * llama.cpp's default, NFC): the section is loaded with colibri_tokenizer_from_memory and,
 * if it loads, text is encoded
 * (fixed strings and the input's own) and decoded, ids valid and not decoded, pieces read
 * (fuzz_common.c).
 *
 * Input: byte 0 is a length L, bytes 1..L are text, the rest is a tokenizer section
 * (docs/format.md, "Tokenizer section encoding"); text and section mutate independently.
 * Section and text are copied to exact-size heap blocks, so ASan sees any read past them.
 *
 * Seeds: native/tests/fuzz_corpus/tokenizer/ (a 400-piece cut of the Mistral v1
 * SentencePiece model; small byte-level BPE vocabularies with each pattern); crash inputs
 * found: native/tests/fuzz_corpus/tokenizer/regressions/. Build and run: tools/fuzz.sh tokenizer.
 */
#include "fuzz_common.c"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    size_t tl = data[0];
    if (tl > size - 1) tl = size - 1;
    fuzz_tokenizer(data + 1 + tl, size - 1 - tl, data + 1, tl);
    return 0;
}
