/*
 * test_tools.c — the output parser of colibri_server (native/tools/colibri_server/tools.c):
 * reasoning, content and tool calls of each syntax, streams that only grow, text that looks
 * like a call but is not one, and the constraint of a required call. tests/test_chat_tools.py
 * checks the same functions against what the real templates render.
 */
#include "../tools/colibri_server/chat.c"
#include "../tools/colibri_server/tools.c"

static int n_fail = 0;

#define CHECK(cond, ...)                                                                   \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                           \
            fprintf(stderr, __VA_ARGS__);                                                  \
            fprintf(stderr, "\n");                                                         \
            n_fail++;                                                                      \
        }                                                                                  \
    } while (0)

static const cs_chat_format HERMES = {.name = "qwen3", .tools = CS_TOOLS_HERMES, .think_open = "<think>",
                                      .think_close = "</think>"};
static const cs_chat_format MISTRAL = {.name = "mistral-v3-tekken", .tools = CS_TOOLS_MISTRAL};
static const cs_chat_format DEEPSEEK = {.name = "deepseek-v3.1", .tools = CS_TOOLS_DEEPSEEK, .think_open = "<think>",
                                        .think_close = "</think>", .starts_thinking = 1};
static const char *const NAMES[] = {"get_weather", "add"};

static int eq(const char *p, size_t n, const char *want) {
    return want ? p && n == strlen(want) && !memcmp(p, want, n) : p == NULL;
}

/* Parse a finished output and compare: content (NULL: null), reasoning, calls "name args|..." */
static void expect(const cs_chat_format *f, int thinking, const char *text, const char *content,
                   const char *reasoning, const char *calls) {
    cs_parsed p;
    int rc = cs_output_parse(f, thinking, 1, NAMES, 2, text, strlen(text), 1, &p);
    CHECK(rc == 0, "rc %d", rc);
    char got[1024] = "";
    for (int k = 0; k < p.n_calls; k++) {
        size_t at = strlen(got);
        snprintf(got + at, sizeof got - at, "%s%s %s", k ? "|" : "", p.calls[k].name, p.calls[k].arguments);
    }
    CHECK(content ? p.has_content && eq(p.content, p.content_len, content) : !p.has_content,
          "%s: content \"%.*s\" (want %s)", text, (int)p.content_len, p.content, content ? content : "null");
    CHECK(eq(p.reasoning, p.reasoning_len, reasoning), "%s: reasoning \"%.*s\"", text, (int)p.reasoning_len,
          p.reasoning ? p.reasoning : "");
    CHECK(!strcmp(got, calls), "%s: calls \"%s\" (want \"%s\")", text, got, calls);
    cs_parsed_free(&p);
}

/* Every prefix of text as a stream: content and reasoning only grow; the end equals the final. */
static void stream(const cs_chat_format *f, int thinking, const char *text) {
    size_t n = strlen(text), pr = 0, pc = 0;
    char *r = calloc(1, n + 1), *c = calloc(1, n + 1);
    for (size_t k = 0; k <= n; k++) {
        cs_parsed p;
        cs_output_parse(f, thinking, 1, NAMES, 2, text, k, 0, &p);
        CHECK(p.reasoning_len >= pr && !memcmp(p.reasoning ? p.reasoning : "", r, pr), "%s[%zu]: reasoning shrank",
              text, k);
        CHECK(p.content_len >= pc && !memcmp(p.content, c, pc), "%s[%zu]: content shrank", text, k);
        memcpy(r, p.reasoning ? p.reasoning : "", p.reasoning_len);
        memcpy(c, p.content, p.content_len);
        pr = p.reasoning_len;
        pc = p.content_len;
        cs_parsed_free(&p);
    }
    cs_parsed p;
    cs_output_parse(f, thinking, 1, NAMES, 2, text, n, 1, &p);
    /* the end sends the rest (a block that was not calls is content after all) */
    CHECK(p.reasoning_len == pr && p.content_len >= pc && !memcmp(p.content, c, pc), "%s: stream %zu/%zu, final %zu/%zu",
          text, pr, pc, p.reasoning_len, p.content_len);
    cs_parsed_free(&p);
    free(r);
    free(c);
}

int main(void) {
    /* hermes (Qwen) */
    expect(&HERMES, 0, "Hello.", "Hello.", NULL, "");
    expect(&HERMES, 0, "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2.5}}\n</tool_call>", NULL,
           NULL, "add {\"a\": 1, \"b\": 2.5}");
    expect(&HERMES, 0,
           "<think>\nsum\n</think>\n\nSure.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n</tool_call>\n"
           "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}\n</tool_call>",
           "Sure.", "sum", "add {}|get_weather {\"city\": \"Zürich\"}");
    /* arguments given as a string holding an object */
    expect(&HERMES, 0, "<tool_call>{\"name\": \"add\", \"arguments\": \"{\\\"a\\\":1}\"}</tool_call>", NULL, NULL,
           "add {\"a\": 1}");
    /* not calls: bad JSON, a function not offered, no name, arguments not an object, text after */
    expect(&HERMES, 0, "x <tool_call>{\"name\": \"add\", \"arguments\": {}</tool_call>",
           "x <tool_call>{\"name\": \"add\", \"arguments\": {}</tool_call>", NULL, "");
    expect(&HERMES, 0, "<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>",
           "<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>", NULL, "");
    expect(&HERMES, 0, "<tool_call>{\"arguments\": {}}</tool_call>", "<tool_call>{\"arguments\": {}}</tool_call>",
           NULL, "");
    expect(&HERMES, 0, "<tool_call>{\"name\": \"add\", \"arguments\": [1]}</tool_call>",
           "<tool_call>{\"name\": \"add\", \"arguments\": [1]}</tool_call>", NULL, "");
    expect(&HERMES, 0, "<tool_call>{\"name\": \"add\", \"arguments\": {}}</tool_call> and more",
           "<tool_call>{\"name\": \"add\", \"arguments\": {}}</tool_call> and more", NULL, "");
    /* reasoning cut off, empty, and a think tag later in the text (not reasoning) */
    expect(&HERMES, 0, "<think>still thinking", NULL, "still thinking", "");
    expect(&HERMES, 0, "<think>\n\n</think>\n\nHi", "Hi", "", "");
    expect(&HERMES, 0, "Hi <think>x</think>", "Hi <think>x</think>", NULL, "");
    stream(&HERMES, 0, "<think>\nsum it\n</think>\n\nSure.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n"
                       "</tool_call>");
    stream(&HERMES, 0, "Plain <tool answer> with < and <think");
    stream(&HERMES, 0, "<tool_call>{\"broken\"</tool_call>");

    /* mistral (Nemo) */
    expect(&MISTRAL, 0, "[TOOL_CALLS][{\"name\": \"add\", \"arguments\": {\"a\": 1}, \"id\": \"abcdefghi\"}]", NULL,
           NULL, "add {\"a\": 1}");
    expect(&MISTRAL, 0, "[TOOL_CALLS][{\"name\": \"add\", \"arguments\": {\"a\": 1}}, {\"name\": \"get_weather\", "
                        "\"arguments\": {}}]", NULL, NULL, "add {\"a\": 1}|get_weather {}");
    expect(&MISTRAL, 0, "[TOOL_CALLS][{\"name\": \"add\"", "[TOOL_CALLS][{\"name\": \"add\"", NULL, "");
    stream(&MISTRAL, 0, "Sure. [TOOL_CALLS][{\"name\": \"add\", \"arguments\": {}}]");

    /* deepseek */
    expect(&DEEPSEEK, 1, "ponder</think>ok<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\": 2}"
                         "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "ok", "ponder", "add {\"a\": 2}");
    expect(&DEEPSEEK, 0, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
                         "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"x\"}<｜tool▁call▁end｜>"
                         "<｜tool▁calls▁end｜>", NULL, NULL, "add {}|get_weather {\"city\": \"x\"}");
    expect(&DEEPSEEK, 0, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add{}", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add{}",
           NULL, "");
    stream(&DEEPSEEK, 1, "a</think>b<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{}<｜tool▁call▁end｜>");

    /* tools off: nothing is a call */
    {
        const char *t = "<tool_call>{\"name\": \"add\", \"arguments\": {}}</tool_call>";
        cs_parsed p;
        cs_output_parse(&HERMES, 0, 0, NAMES, 2, t, strlen(t), 1, &p);
        CHECK(p.n_calls == 0 && eq(p.content, p.content_len, t), "tools off");
        cs_parsed_free(&p);
    }

    /* the constraint of a required call */
    {
        json_t *tools = json_loads("[{\"type\": \"function\", \"function\": {\"name\": \"add\", \"parameters\": "
                                   "{\"type\": \"object\"}}}, {\"type\": \"function\", \"function\": {\"name\": "
                                   "\"get_weather\"}}]", 0, NULL);
        char *pre, *suf, *sch, err[256];
        CHECK(cs_tool_call_constraint(&HERMES, tools, NULL, NULL, &pre, &suf, &sch, err, sizeof err) == 0, "%s", err);
        CHECK(!strcmp(pre, "<tool_call>\n") && !strcmp(suf, "\n</tool_call>") && strstr(sch, "\"anyOf\""), "%s %s %s",
              pre, suf, sch);
        free(pre), free(suf), free(sch);
        CHECK(cs_tool_call_constraint(&DEEPSEEK, tools, NULL, NULL, &pre, &suf, &sch, err, sizeof err) == -1 &&
                  strstr(err, "one function"), "deepseek, two functions: %s", err);
        CHECK(cs_tool_call_constraint(&DEEPSEEK, tools, "get_weather", NULL, &pre, &suf, &sch, err, sizeof err) == 0 &&
                  strstr(pre, "get_weather<｜tool▁sep｜>") && !strcmp(sch, "{\"type\":\"object\"}"), "%s", sch);
        free(pre), free(suf), free(sch);
        /* Mistral-Small-3.2: the caller's call id is written by the prefix; ids are 9 of [a-zA-Z0-9] */
        static const cs_chat_format SMALL = {.name = "mistral-small-3.2", .tools = CS_TOOLS_MISTRAL_V11,
                                             .call_id_len = 9};
        CHECK(cs_tool_call_constraint(&SMALL, tools, "add", "abcDEF123", &pre, &suf, &sch, err, sizeof err) == 0 &&
                  !strcmp(pre, "[TOOL_CALLS]add[CALL_ID]abcDEF123[ARGS]") && !strcmp(suf, ""), "%s", pre);
        free(pre), free(suf), free(sch);
        CHECK(cs_tool_call_constraint(&SMALL, tools, "add", "call_1234", &pre, &suf, &sch, err, sizeof err) == -1 &&
                  strstr(err, "9 letters and digits"), "a bad id: %s", err);
        CHECK(cs_tool_call_constraint(&SMALL, tools, "add", NULL, &pre, &suf, &sch, err, sizeof err) == -1, "no id");
        CHECK(cs_valid_call_id(&SMALL, "Z9z9Z9z9Z") && !cs_valid_call_id(&SMALL, "Z9z9Z9z9") &&
                  !cs_valid_call_id(&SMALL, "Z9z9Z9z9Z9") && !cs_valid_call_id(&SMALL, "Z9z9Z9z9-") &&
                  cs_valid_call_id(&HERMES, "call_x") && !cs_valid_call_id(&HERMES, ""), "cs_valid_call_id");
        {
            const char *out = "[TOOL_CALLS]add[CALL_ID]abcDEF123[ARGS]{\"a\": 1}[TOOL_CALLS]add[CALL_ID]bad-id[ARGS]{}";
            cs_parsed pp;
            CHECK(cs_output_parse(&SMALL, 0, 1, NULL, 0, out, strlen(out), 1, &pp) == 0 && pp.n_calls == 2 &&
                      pp.calls[0].id && !strcmp(pp.calls[0].id, "abcDEF123") && !pp.calls[1].id,
                  "the ids parsed: a valid one kept, an invalid one dropped");
            cs_parsed_free(&pp);
        }
        static const cs_chat_format NONE = {.name = "chatml"};
        CHECK(cs_tool_call_constraint(&NONE, tools, NULL, NULL, &pre, &suf, &sch, err, sizeof err) == -1, "no tools");
        json_decref(tools);
    }

    /* tojson as Python writes it */
    {
        const char *cases[][2] = {
            {"{\"a\": 1.0, \"b\": [0.1, 1e-05, 1e16, 123456789012345678, -2.5e-7], \"c\": \"é\\n\\u0001\\\"\"}",
             "{\"a\": 1.0, \"b\": [0.1, 1e-05, 1e+16, 123456789012345678, -2.5e-07], \"c\": \"é\\n\\u0001\\\"\"}"},
            {"[true, false, null, {}, []]", "[true, false, null, {}, []]"},
            {"{\"z\": 1, \"a\": 2}", "{\"z\": 1, \"a\": 2}"},
            {"[100.0, 1234567.5, 0.0001, 1e22]", "[100.0, 1234567.5, 0.0001, 1e+22]"},
        };
        for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
            json_t *v = json_loads(cases[k][0], JSON_DECODE_ANY, NULL);
            char *d = cs_json_py_dumps(v);
            CHECK(d && !strcmp(d, cases[k][1]), "tojson %s -> %s", cases[k][0], d);
            free(d);
            json_decref(v);
        }
    }

    if (n_fail) {
        printf("FAIL (%d)\n", n_fail);
        return 1;
    }
    printf("OK\n");
    return 0;
}
