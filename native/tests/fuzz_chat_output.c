/*
 * fuzz_chat_output.c — libFuzzer harness over colibri_server's tool-call parser and the
 * constraint of a required call (native/tools/colibri_server/tools.c). Byte 0 chooses the
 * syntax (bits 0-1: hermes, mistral, deepseek, none), whether the output starts inside the
 * reasoning block (bit 2), whether tools are parsed (bit 3) and whether the rest is also
 * read as a `tools` JSON array for cs_tool_call_constraint (bit 4); the rest is the model's
 * text. Every prefix length the stream would see at a token boundary is parsed as a stream
 * (final = 0: what is released must only grow), then the whole text as the end. Nothing may
 * crash, leak, read out of bounds or hit undefined behaviour. Seeds:
 * native/tests/fuzz_corpus/chat/ (crash inputs found: its regressions/). Build and run:
 * tools/fuzz.sh chat; tests/test_fuzz.py runs it for a few seconds from a copy of the seeds.
 */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *const HARMONY[] = {"<|start|>", "<|end|>", "<|channel|>", "<|message|>", NULL};
static const cs_chat_format FORMATS[8] = {
    {.name = "hermes", .tools = CS_TOOLS_HERMES, .think_open = "<think>", .think_close = "</think>"},
    {.name = "mistral", .tools = CS_TOOLS_MISTRAL},
    {.name = "deepseek", .tools = CS_TOOLS_DEEPSEEK, .think_open = "<think>", .think_close = "</think>",
     .starts_thinking = 1},
    {.name = "none"},
    {.name = "mistral-v11", .tools = CS_TOOLS_MISTRAL_V11},
    {.name = "harmony", .tools = CS_TOOLS_HARMONY, .think_open = "<|channel|>analysis<|message|>",
     .think_close = "<|end|>", .content_open = "<|channel|>final<|message|>", .markers = HARMONY},
    {.name = "deepseek-r1", .tools = CS_TOOLS_DEEPSEEK_R1, .think_open = "<think>", .think_close = "</think>",
     .starts_thinking = 2},
    {.name = "mistral-small-3.2", .tools = CS_TOOLS_MISTRAL_V11, .call_id_len = 9},
};
static const char *const NAMES[] = {"get_weather", "add", "f"};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const cs_chat_format *f = &FORMATS[(data[0] & 3) | (((data[0] >> 5) & 1) << 2)];
    int thinking = (data[0] >> 2) & 1, tools = (data[0] >> 3) & 1;
    const char *text = (const char *)data + 1;
    size_t n = size - 1;
    size_t last_r = 0, last_c = 0;
    for (size_t k = 0; k <= n; k += 1 + k / 16) {
        cs_parsed p;
        if (cs_output_parse(f, thinking, tools, NAMES, 3, text, k, 0, &p) != 0) continue;
        /* a stream only grows */
        if (p.reasoning_len < last_r || p.content_len < last_c) abort();
        last_r = p.reasoning_len;
        last_c = p.content_len;
        cs_parsed_free(&p);
    }
    cs_parsed p;
    if (cs_output_parse(f, thinking, tools, NAMES, 3, text, n, 1, &p) == 0) {
        if (p.content + p.content_len > text + n || (p.reasoning && p.reasoning + p.reasoning_len > text + n)) abort();
        for (int k = 0; k < p.n_calls; k++)
            if (!p.calls[k].name || !p.calls[k].arguments) abort();
        cs_parsed_free(&p);
    }
    if ((data[0] >> 4) & 1) {
        json_t *t = json_loadb(text, n, 0, NULL);
        if (json_is_array(t)) {
            char *pre = NULL, *suf = NULL, *sch = NULL, err[256];
            if (cs_tool_call_constraint(f, t, NULL, "abcDEF123", &pre, &suf, &sch, err, sizeof err) == 0) {
                free(pre);
                free(suf);
                free(sch);
            }
        }
        json_decref(t);
    }
    return 0;
}
