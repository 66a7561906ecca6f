/*
 * test_chat.c — colibri_server's chat templates (native/tools/colibri_server/chat.c).
 *
 *   test_chat            checks that need no tokenizer (ctest): every built-in template is
 *                        recognised as itself, reformatted templates still are, changed ones
 *                        are not, refusals and stop strings; prints OK
 *   test_chat CMDFILE    runs the commands of CMDFILE, one a line, and prints one answer a
 *                        line (tests/test_chat_template.py compares them with transformers).
 *                        Strings are hex-encoded UTF-8 ("-" for NULL, "=" for ""):
 *     tok HEXPATH              load a tokenizer section (docs/format.md) -> "ok" | "err HEX"
 *     model HEXPATH            open a .colibri file: its tokenizer, and its chat template
 *                              (colibri_get_string "chat_template") as the template -> "ok" | "err HEX"
 *     tpl HEX                  the chat template of the commands that follow
 *     chat N ROLE CONTENT ...  cs_chat_tokenize -> "ids ID ID ..." | "err HEX"
 *     name                     cs_chat_template_name -> "name NAME" | "name -"
 *     stop                     cs_chat_stop_strings -> "stop HEX HEX ..."
 *     list                     the built-in templates -> "variant NAME HEXSOURCE" each
 *     chatj HEXJSON            cs_chat_tokenize_ex of {"messages": [...], "tools": [...],
 *                              "enable_thinking": bool} -> "ids ..." | "err HEX"
 *     parse HEXJSON            cs_output_parse with the template's format of {"text", "final",
 *                              "thinking", "tools": bool, "names": [...]} -> "parsed HEXJSON"
 *                              ({"reasoning", "content", "in_tools", "calls": [[name, args, id]]})
 *     constraint HEXJSON       cs_tool_call_constraint of {"tools", "only", "call_id"} -> "constraint
 *                              HEXJSON" ({"prefix", "suffix", "schema"}) | "err HEX"
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

static int same(const char *a, const char *b) { return a && b && !strcmp(a, b); }

/* s with every `from` replaced by `to` (malloc'd); `from` must be there. */
static char *replace(const char *s, const char *from, const char *to) {
    sbuf b = {0};
    CHECK(*from && strstr(s, from), "replace: \"%s\" is not in the template", from);
    size_t fl = strlen(from);
    for (const char *p = s; *p;) {
        if (!strncmp(p, from, fl)) {
            sb_adds(&b, to);
            p += fl;
        } else {
            sb_addc(&b, *p++);
        }
    }
    return b.p;
}

static void self_test(void) {
    char err[1024];
    int32_t *ids = (int32_t *)1;
    int64_t n = 7;
    cs_message msg = {"user", "hi", NULL};

    /* each built-in template is itself; no two share a canonical form */
    for (size_t v = 0; v < N_VARIANTS; v++) {
        char *src = strstr(VARIANTS[v].src, WILDCARD)
                        ? replace(VARIANTS[v].src, WILDCARD, "You are a helpful assistant.")
                        : strdup(VARIANTS[v].src);
        CHECK(same(cs_chat_template_name(src), VARIANTS[v].name), "%s recognised as %s",
              VARIANTS[v].name, cs_chat_template_name(src));
        char *c = canonicalize(src);
        CHECK(c && !strstr(c, "\n!\n") && strncmp(c, "!\n", 2), "%s: canonical form %s",
              VARIANTS[v].name, c);
        free(c);
        free(src);
    }
    /* Jinja drops one trailing newline and reads \r\n as \n */
    {
        sbuf b = {0};
        sb_adds(&b, T_CHATML);
        sb_adds(&b, "\n");
        CHECK(same(cs_chat_template_name(b.p), "chatml"), "trailing newline");
        sb_adds(&b, "\n");
        CHECK(same(cs_chat_template_name(b.p), "chatml"), "two: trim_blocks eats the other");
        sb_adds(&b, "\n");
        CHECK(cs_chat_template_name(b.p) == NULL, "three trailing newlines print one");
        sb_free(&b);
        char *crlf = replace(T_MIXTRAL_8X7B_INSTRUCT, "\n", "\r\n");
        CHECK(same(cs_chat_template_name(crlf), "mistral-instruct"), "CRLF");
        free(crlf);
    }
    /* reformatting that Jinja ignores: spaces in tags, quotes, a.b for a['b'], split literals */
    {
        const char *qwen2 =
            "{%- for message in messages -%}\n"
            "  {%- if loop.first and messages[0].role != \"system\" -%}\n"
            "    {{- \"<|im_start|>system\\n\" + 'You are Qwen.' + \"<|im_end|>\\n\" -}}\n"
            "  {%- endif -%}\n"
            "  {{- '<|im_start|>' + message.role + '\\n' }}{{ message.content + '<|im_end|>\\n' -}}\n"
            "{%- endfor -%}\n"
            "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        char *system = NULL;
        int oom = 0;
        const variant *v = recognise(qwen2, &system, &oom);
        CHECK(v && same(v->name, "chatml-qwen2") && same(system, "You are Qwen."),
              "reformatted Qwen2: %s / %s", v ? v->name : "-", system ? system : "-");
        free(system);
        /* a changed template is not the same template */
        char *other = replace(T_CHATML, "'<|im_end|>' + '\\n'", "'<|im_end|>'");
        CHECK(cs_chat_template_name(other) == NULL, "a changed ChatML is refused");
        free(other);
        other = replace(T_MIXTRAL_8X7B_INSTRUCT, "' [INST] '", "'[INST] '");
        CHECK(cs_chat_template_name(other) == NULL, "a changed Mixtral is refused");
        free(other);
        other = replace(T_OLMOE_INSTRUCT, "{% if loop.last and add_generation_prompt %}", "{% if add_generation_prompt %}");
        CHECK(cs_chat_template_name(other) == NULL, "a changed Tulu is refused");
        free(other);
        CHECK(cs_chat_template_name("{% raw %}{{ bos_token }}{% endraw %}") == NULL, "raw");
        CHECK(cs_chat_template_name("{{ bos_token ") == NULL, "unterminated");
        CHECK(cs_chat_template_name(NULL) == NULL && cs_chat_template_name("") == NULL, "empty");
    }
    /* refusals name what is supported and /v1/completions */
    CHECK(cs_chat_tokenize(NULL, "", &msg, 1, &ids, &n, err, sizeof err) == -1 && !ids && n == 0 &&
              strstr(err, "no chat template") && strstr(err, "/v1/completions"), "empty: %s", err);
    CHECK(cs_chat_tokenize(NULL, "{{ messages }}", &msg, 1, &ids, &n, err, sizeof err) == -1 &&
              strstr(err, "not recognised") && strstr(err, "mistral-instruct") && strstr(err, "deepseek-v3.1") &&
                  strstr(err, "/v1/completions"),
          "unknown: %s", err);
    CHECK(cs_chat_tokenize(NULL, T_CHATML, &msg, 1, &ids, &n, err, sizeof err) == -1 &&
              strstr(err, "no tokenizer"), "no tokenizer: %s", err);
    CHECK(cs_chat_tokenize(NULL, T_CHATML, &msg, 1, &ids, &n, err, 8) == -1 && strlen(err) == 7,
          "short err buffer");
    /* stop strings */
    const char *const *s = cs_chat_stop_strings(T_QWEN3);
    CHECK(s && same(s[0], "<|im_end|>"), "qwen3 stops at <|im_end|>");
    s = cs_chat_stop_strings(T_MIXTRAL_8X7B_INSTRUCT);
    CHECK(s && s[0] == NULL, "mistral: EOS only");
    s = cs_chat_stop_strings(T_OLMOE_INSTRUCT);
    CHECK(s && s[0] == NULL, "tulu: EOS only");
    s = cs_chat_stop_strings("nonsense");
    CHECK(s && s[0] == NULL, "unknown: none");
}

/* ------------------------------------------------------------------ command mode */

static int unhex(const char *h, sbuf *out) {
    if (!h) h = "";
    if (!strcmp(h, "=")) h = "";
    size_t n = strlen(h);
    if (n % 2) return -1;
    sb_add(out, "", 0);
    for (size_t k = 0; k < n; k += 2) {
        int a = hexval(h[k]), b = hexval(h[k + 1]);
        if (a < 0 || b < 0) return -1;
        sb_addc(out, (char)(a * 16 + b));
    }
    return 0;
}

static void put_hex(const char *s, size_t n) {
    for (size_t k = 0; k < n; k++) printf("%02x", (unsigned char)s[k]);
}

static char *next_field(char **p) {
    while (**p == ' ') (*p)++;
    if (!**p) return NULL;
    char *f = *p;
    while (**p && **p != ' ') (*p)++;
    if (**p) *(*p)++ = 0;
    return f;
}

static int run_commands(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "cannot open %s\n", path);
        return 2;
    }
    colibri_tokenizer *tok = NULL;
    colibri_ctx *ctx = NULL;
    void *section = NULL;
    sbuf tpl = {0}, line = {0};
    sb_add(&tpl, "", 0);
    int ch;
    for (;;) {
        line.n = 0;
        while ((ch = fgetc(f)) != EOF && ch != '\n') sb_addc(&line, (char)ch);
        if (ch == EOF && line.n == 0) break;
        sb_add(&line, "", 0);
        char *p = line.p, *cmd = next_field(&p);
        if (!cmd) continue;
        if (!strcmp(cmd, "tok")) {
            sbuf file = {0};
            char err[512] = "";
            unhex(next_field(&p), &file);
            if (tok) colibri_tokenizer_free(tok);
            free(section);
            tok = NULL;
            section = NULL;
            FILE *t = fopen(file.p, "rb");
            long size = -1;
            if (t && fseek(t, 0, SEEK_END) == 0) size = ftell(t);
            if (size > 0 && fseek(t, 0, SEEK_SET) == 0 && (section = malloc((size_t)size)) &&
                fread(section, 1, (size_t)size, t) == (size_t)size &&
                colibri_tokenizer_from_memory(section, (uint64_t)size, &tok, err, sizeof err) == COLIBRI_OK) {
                printf("ok\n");
            } else {
                if (!err[0]) snprintf(err, sizeof err, "cannot read %s", file.p);
                printf("err ");
                put_hex(err, strlen(err));
                printf("\n");
            }
            if (t) fclose(t);
            sb_free(&file);
        } else if (!strcmp(cmd, "model")) {
            sbuf file = {0};
            const char *t = NULL;
            unhex(next_field(&p), &file);
            if (tok) colibri_tokenizer_free(tok);
            free(section);
            tok = NULL;
            section = NULL;
            if (ctx) colibri_free(ctx);
            ctx = NULL;
            colibri_status st = colibri_init(file.p, &ctx);
            if (st == COLIBRI_OK && colibri_get_string(ctx, "chat_template", &t) == COLIBRI_OK) {
                tok = colibri_get_tokenizer(ctx);
                tpl.n = 0;
                sb_adds(&tpl, t ? t : "");
                printf("ok\n");
            } else {
                const char *m = ctx ? colibri_last_error(ctx) : colibri_status_string(st);
                printf("err ");
                put_hex(m, strlen(m));
                printf("\n");
            }
            sb_free(&file);
        } else if (!strcmp(cmd, "tpl")) {
            tpl.n = 0;
            unhex(next_field(&p), &tpl);
        } else if (!strcmp(cmd, "chat")) {
            long n = strtol(next_field(&p), NULL, 10);
            cs_message *m = calloc((size_t)(n > 0 ? n : 1), sizeof *m);
            sbuf *bufs = calloc((size_t)(n > 0 ? n : 1) * 2, sizeof *bufs);
            for (long i = 0; i < n; i++) {
                for (int w = 0; w < 2; w++) {
                    char *h = next_field(&p);
                    if (h && strcmp(h, "-")) {
                        unhex(h, &bufs[2 * i + w]);
                        if (w == 0) m[i].role = bufs[2 * i].p;
                        else m[i].content = bufs[2 * i + 1].p;
                    }
                }
            }
            int32_t *ids = NULL;
            int64_t n_ids = 0;
            char err[1024];
            if (cs_chat_tokenize(tok, tpl.p, m, (size_t)n, &ids, &n_ids, err, sizeof err) == 0) {
                printf("ids");
                for (int64_t k = 0; k < n_ids; k++) printf(" %d", ids[k]);
                printf("\n");
            } else {
                printf("err ");
                put_hex(err, strlen(err));
                printf("\n");
            }
            free(ids);
            for (long i = 0; i < 2 * n; i++) sb_free(&bufs[i]);
            free(bufs);
            free(m);
        } else if (!strcmp(cmd, "chatj")) {
            sbuf js = {0};
            unhex(next_field(&p), &js);
            json_t *root = json_loads(js.p ? js.p : "", 0, NULL);
            json_t *jm = json_object_get(root, "messages");
            size_t n = json_array_size(jm);
            cs_message *m = calloc(n ? n : 1, sizeof *m);
            for (size_t i = 0; i < n; i++) {
                json_t *o = json_array_get(jm, i);
                m[i].role = json_string_value(json_object_get(o, "role"));
                m[i].content = json_string_value(json_object_get(o, "content"));
                m[i].json = o;
            }
            cs_chat_opts opts = {.tools = json_object_get(root, "tools"), .enable_thinking = -1};
            opts.reasoning_effort = json_string_value(json_object_get(root, "reasoning_effort"));
            json_t *et = json_object_get(root, "enable_thinking");
            if (json_is_boolean(et)) opts.enable_thinking = json_is_true(et);
            int32_t *ids = NULL;
            int64_t n_ids = 0;
            char err[1024];
            if (cs_chat_tokenize_ex(tok, tpl.p, m, n, &opts, &ids, &n_ids, err, sizeof err) == 0) {
                printf("ids");
                for (int64_t k = 0; k < n_ids; k++) printf(" %d", ids[k]);
                printf("\n");
            } else {
                printf("err ");
                put_hex(err, strlen(err));
                printf("\n");
            }
            free(ids);
            free(m);
            json_decref(root);
            sb_free(&js);
        } else if (!strcmp(cmd, "parse")) {
            sbuf js = {0};
            unhex(next_field(&p), &js);
            json_t *root = json_loads(js.p ? js.p : "", 0, NULL);
            json_t *jn = json_object_get(root, "names");
            const char *names[64];
            int n_names = 0;
            for (size_t k = 0; k < json_array_size(jn) && k < 64; k++)
                names[n_names++] = json_string_value(json_array_get(jn, k));
            json_t *text = json_object_get(root, "text");
            cs_parsed out;
            int rc = cs_output_parse(cs_chat_template_format(tpl.p), json_is_true(json_object_get(root, "thinking")),
                                     !json_is_false(json_object_get(root, "tools")), jn ? names : NULL, n_names,
                                     json_string_value(text), json_string_length(text),
                                     json_is_true(json_object_get(root, "final")), &out);
            json_t *calls = json_array();
            for (int k = 0; k < out.n_calls; k++)
                json_array_append_new(calls, json_pack("[s, s, s?]", out.calls[k].name, out.calls[k].arguments,
                                                       out.calls[k].id));
            json_t *res = json_pack("{s:i, s:s%, s:o, s:b, s:o}", "rc", rc, "content", out.content,
                                    out.content_len, "reasoning",
                                    out.reasoning ? json_stringn(out.reasoning, out.reasoning_len) : json_null(),
                                    "in_tools", out.in_tools, "calls", calls);
            if (res && !out.has_content) json_object_set_new(res, "content", json_null());
            char *dumped = json_dumps(res, JSON_COMPACT);
            printf("parsed ");
            put_hex(dumped, strlen(dumped));
            printf("\n");
            free(dumped);
            json_decref(res);
            cs_parsed_free(&out);
            json_decref(root);
            sb_free(&js);
        } else if (!strcmp(cmd, "constraint")) {
            sbuf js = {0};
            unhex(next_field(&p), &js);
            json_t *root = json_loads(js.p ? js.p : "", 0, NULL);
            char *pre = NULL, *suf = NULL, *sch = NULL, err[512];
            if (cs_tool_call_constraint(cs_chat_template_format(tpl.p), json_object_get(root, "tools"),
                                        json_string_value(json_object_get(root, "only")),
                                        json_string_value(json_object_get(root, "call_id")), &pre, &suf, &sch, err,
                                        sizeof err) == 0) {
                json_t *res = json_pack("{s:s, s:s, s:s}", "prefix", pre, "suffix", suf, "schema", sch);
                char *dumped = json_dumps(res, JSON_COMPACT);
                printf("constraint ");
                put_hex(dumped, strlen(dumped));
                printf("\n");
                free(dumped);
                json_decref(res);
            } else {
                printf("err ");
                put_hex(err, strlen(err));
                printf("\n");
            }
            free(pre);
            free(suf);
            free(sch);
            json_decref(root);
            sb_free(&js);
        } else if (!strcmp(cmd, "name")) {
            const char *name = cs_chat_template_name(tpl.p);
            printf("name %s\n", name ? name : "-");
        } else if (!strcmp(cmd, "stop")) {
            printf("stop");
            for (const char *const *s = cs_chat_stop_strings(tpl.p); *s; s++) {
                printf(" ");
                put_hex(*s, strlen(*s));
            }
            printf("\n");
        } else if (!strcmp(cmd, "list")) {
            for (size_t v = 0; v < N_VARIANTS; v++) {
                printf("variant %s ", VARIANTS[v].name);
                put_hex(VARIANTS[v].src, strlen(VARIANTS[v].src));
                printf("\n");
            }
        } else {
            printf("err ");
            put_hex("unknown command", 15);
            printf("\n");
        }
        fflush(stdout);
    }
    fclose(f);
    if (tok) colibri_tokenizer_free(tok);
    if (ctx) colibri_free(ctx);
    free(section);
    sb_free(&tpl);
    sb_free(&line);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1) return run_commands(argv[1]);
    self_test();
    if (n_fail) {
        printf("FAIL (%d)\n", n_fail);
        return 1;
    }
    printf("OK\n");
    return 0;
}
