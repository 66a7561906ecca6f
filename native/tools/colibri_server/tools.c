/*
 * tools.c — reasoning, content and tool calls out of a chat model's text; see tools.h.
 *
 * The syntaxes (what each family's template renders for an assistant turn with tool calls):
 *   hermes    <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>, one block a call,
 *             whitespace between them (Qwen2.5, Qwen3)
 *   mistral   [TOOL_CALLS][{"name": "f", "arguments": {...}, "id": "abcdefghi"}, ...] (Nemo)
 *   mistral-v11  [TOOL_CALLS]f[CALL_ID]abcdefghi[ARGS]{...} (Mistral-Small-3.2) or
 *             [TOOL_CALLS]f[ARGS]{...} (Devstral), one a call
 *   deepseek  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...
 *             <｜tool▁calls▁end｜> (DeepSeek-V3.1)
 *   deepseek-r1  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{...}\n```
 *             <｜tool▁call▁end｜>, "\n" between calls, <｜tool▁calls▁end｜> (DeepSeek-R1)
 *   kimi      <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{...}
 *             <|tool_call_end|>...<|tool_calls_section_end|>; the id written (functions.f:0) is the
 *             call's id (Kimi-K2)
 * Reasoning: the text between the format's think markers at the start of the output (or from
 * the start, when the prompt opened the block), leading newlines and trailing whitespace
 * dropped; the content after it starts at its first non-whitespace character.
 */
#include "tools.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DS_BEGIN "<｜tool▁calls▁begin｜>"
#define DS_CALL "<｜tool▁call▁begin｜>"
#define DS_SEP "<｜tool▁sep｜>"
#define DS_CALL_END "<｜tool▁call▁end｜>"
#define DS_END "<｜tool▁calls▁end｜>"
#define KM_BEGIN "<|tool_calls_section_begin|>"
#define KM_CALL "<|tool_call_begin|>"
#define KM_ARGS "<|tool_call_argument_begin|>"
#define KM_CALL_END "<|tool_call_end|>"
#define KM_END "<|tool_calls_section_end|>"

typedef struct syntax {
    const char *open;          /* the first marker of a tool-call block */
    const char *markers[6];    /* all its markers */
} syntax;

static const syntax SYNTAX[] = {
    [CS_TOOLS_NONE] = {NULL, {NULL}},
    [CS_TOOLS_HERMES] = {"<tool_call>", {"<tool_call>", "</tool_call>", NULL}},
    [CS_TOOLS_MISTRAL] = {"[TOOL_CALLS]", {"[TOOL_CALLS]", NULL}},
    [CS_TOOLS_DEEPSEEK] = {DS_BEGIN, {DS_BEGIN, DS_CALL, DS_SEP, DS_CALL_END, DS_END, NULL}},
    [CS_TOOLS_MISTRAL_V11] = {"[TOOL_CALLS]", {"[TOOL_CALLS]", "[CALL_ID]", "[ARGS]", NULL}},
    [CS_TOOLS_HARMONY] = {"to=functions.", {NULL}},
    [CS_TOOLS_DEEPSEEK_R1] = {DS_BEGIN, {DS_BEGIN, DS_CALL, DS_SEP, DS_CALL_END, DS_END, NULL}},
    [CS_TOOLS_KIMI] = {KM_BEGIN, {KM_BEGIN, KM_CALL, KM_ARGS, KM_CALL_END, KM_END, NULL}},
};

const char *const *cs_output_markers(const cs_chat_format *fmt) {
    static const char *const THINK[] = {"<think>", "</think>", NULL};
    static const char *const NONE[] = {NULL};
    static const char *const HERMES_THINK[] = {"<tool_call>", "</tool_call>", "<think>", "</think>", NULL};
    static const char *const DS_THINK[] = {DS_BEGIN, DS_CALL, DS_SEP, DS_CALL_END, DS_END, "<think>", "</think>", NULL};
    if (!fmt) return NONE;
    if (fmt->markers) return fmt->markers;
    int think = fmt->think_open && !strcmp(fmt->think_open, "<think>") && fmt->think_close &&
                !strcmp(fmt->think_close, "</think>");
    switch (fmt->tools) {
    case CS_TOOLS_HERMES: return think ? HERMES_THINK : SYNTAX[CS_TOOLS_HERMES].markers;
    case CS_TOOLS_MISTRAL: return SYNTAX[CS_TOOLS_MISTRAL].markers;
    case CS_TOOLS_DEEPSEEK:
    case CS_TOOLS_DEEPSEEK_R1: return think ? DS_THINK : SYNTAX[CS_TOOLS_DEEPSEEK].markers;
    case CS_TOOLS_MISTRAL_V11: return SYNTAX[CS_TOOLS_MISTRAL_V11].markers;
    case CS_TOOLS_KIMI: return SYNTAX[CS_TOOLS_KIMI].markers;
    default: return think ? THINK : NONE;
    }
}

static char *dup_n(const char *s, size_t n) {
    char *p = malloc(n + 1);
    if (p) {
        memcpy(p, s, n);
        p[n] = 0;
    }
    return p;
}
static char *dup_s(const char *s) { return dup_n(s, strlen(s)); }

static int ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* The longest suffix of s[0..n) that is a proper prefix of m (a marker still arriving). */
static size_t partial_suffix(const char *s, size_t n, const char *m) {
    size_t ml = strlen(m);
    for (size_t l = ml - 1 < n ? ml - 1 : n; l > 0; l--)
        if (!memcmp(s + n - l, m, l)) return l;
    return 0;
}

static const char *find(const char *s, size_t n, const char *m) {
    size_t ml = strlen(m);
    for (size_t k = 0; k + ml <= n; k++)
        if (s[k] == m[0] && !memcmp(s + k, m, ml)) return s + k;
    return NULL;
}

static int starts(const char *s, size_t n, const char *m) {
    size_t ml = strlen(m);
    return n >= ml && !memcmp(s, m, ml);
}

void cs_parsed_free(cs_parsed *p) {
    for (int k = 0; k < p->n_calls; k++) {
        free(p->calls[k].name);
        free(p->calls[k].arguments);
        free(p->calls[k].id);
    }
    p->n_calls = 0;
}

static int offered(const char *name, const char *const *names, int n_names) {
    if (!names) return 1;
    for (int k = 0; k < n_names; k++)
        if (names[k] && !strcmp(names[k], name)) return 1;
    return 0;
}

/* Add a call; 0, -1 out of memory, 1 not a call (no such function, bad arguments, too many). */
static int add_call(cs_parsed *p, const char *name, size_t name_len, const json_t *args, const char *id,
                    const char *const *names, int n_names) {
    if (p->n_calls >= CS_MAX_TOOL_CALLS || name_len == 0 || memchr(name, 0, name_len)) return 1;
    if (!json_is_object(args)) return 1;
    char *nm = dup_n(name, name_len);
    if (!nm) return -1;
    if (!offered(nm, names, n_names)) {
        free(nm);
        return 1;
    }
    char *a = cs_json_py_dumps(args);
    char *i = id ? dup_s(id) : NULL;
    if (!a || (id && !i)) {
        free(nm);
        free(a);
        free(i);
        return -1;
    }
    cs_parsed_call *c = &p->calls[p->n_calls++];
    c->name = nm;
    c->arguments = a;
    c->id = i;
    return 0;
}

/* The value of a JSON text (an object, or a string holding one), or NULL. */
static json_t *load(const char *s, size_t n) {
    json_t *v = json_loadb(s, n, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, NULL);
    if (json_is_string(v)) {
        json_t *inner = json_loadb(json_string_value(v), json_string_length(v), JSON_REJECT_DUPLICATES, NULL);
        json_decref(v);
        v = inner;
    }
    return v;
}

/* {"name": ..., "arguments": {...}} (hermes, mistral) */
static int add_object_call(cs_parsed *p, const json_t *o, const char *const *names, int n_names, int with_id) {
    if (!json_is_object(o)) return 1;
    const json_t *nm = json_object_get(o, "name");
    const json_t *args = json_object_get(o, "arguments");
    const json_t *id = with_id ? json_object_get(o, "id") : NULL;
    if (!json_is_string(nm)) return 1;
    json_t *parsed = NULL;
    if (json_is_string(args)) args = parsed = load(json_string_value(args), json_string_length(args));
    int rc = add_call(p, json_string_value(nm), json_string_length(nm), args,
                      json_is_string(id) ? json_string_value(id) : NULL, names, n_names);
    json_decref(parsed);
    return rc;
}

/* The tool calls of the block s[0..n) (it starts with the open marker): 0, 1 not calls, -1 */
static int parse_hermes(cs_parsed *p, const char *s, size_t n, const char *const *names, int n_names) {
    size_t at = 0;
    while (at < n) {
        while (at < n && ws(s[at])) at++;
        if (at == n) break;
        if (!starts(s + at, n - at, "<tool_call>")) return 1;
        at += strlen("<tool_call>");
        const char *end = find(s + at, n - at, "</tool_call>");
        size_t len = end ? (size_t)(end - (s + at)) : n - at;
        json_t *o = json_loadb(s + at, len, JSON_REJECT_DUPLICATES, NULL);
        int rc = o ? add_object_call(p, o, names, n_names, 0) : 1;
        json_decref(o);
        if (rc) return rc;
        at += len + (end ? strlen("</tool_call>") : 0);
    }
    return p->n_calls ? 0 : 1;
}

static int parse_mistral(cs_parsed *p, const char *s, size_t n, const char *const *names, int n_names) {
    size_t at = strlen("[TOOL_CALLS]");
    json_t *v = json_loadb(s + at, n - at, JSON_REJECT_DUPLICATES, NULL);
    int rc = v ? 0 : 1;
    if (json_is_object(v)) {
        rc = add_object_call(p, v, names, n_names, 1);
    } else if (json_is_array(v) && json_array_size(v)) {
        for (size_t k = 0; k < json_array_size(v) && !rc; k++)
            rc = add_object_call(p, json_array_get(v, k), names, n_names, 1);
    } else {
        rc = 1;
    }
    json_decref(v);
    return rc;
}

/* A section of calls: BEGIN, then CALL head SEP {...} CALL_END per call (whitespace between),
 * then END and nothing else. DeepSeek-V3.1's head is the name; Kimi's is an id,
 * functions.NAME:INDEX (the name is what lies between the "functions." and the last ':'; an id
 * without them is the name), kept as the call's id, as the template numbers them. */
typedef struct section_syntax {
    const char *begin, *call, *sep, *call_end, *end;
    int head_is_id;
} section_syntax;
static const section_syntax DS_SECTION = {DS_BEGIN, DS_CALL, DS_SEP, DS_CALL_END, DS_END, 0};
static const section_syntax KM_SECTION = {KM_BEGIN, KM_CALL, KM_ARGS, KM_CALL_END, KM_END, 1};

static int parse_section(const section_syntax *x, cs_parsed *p, const char *s, size_t n, const char *const *names,
                         int n_names) {
    size_t at = strlen(x->begin);
    for (;;) {
        while (at < n && ws(s[at])) at++;
        if (at == n || starts(s + at, n - at, x->end)) break;
        if (!starts(s + at, n - at, x->call)) return 1;
        at += strlen(x->call);
        const char *sep = find(s + at, n - at, x->sep);
        if (!sep) return 1;
        const char *name = s + at;
        size_t name_len = (size_t)(sep - name);
        char id[256];
        if (x->head_is_id) {
            if (name_len >= sizeof id) return 1;
            memcpy(id, name, name_len);
            id[name_len] = 0;
            if (starts(name, name_len, "functions.")) {
                name += strlen("functions.");
                name_len -= strlen("functions.");
            }
            for (size_t k = name_len; k > 0; k--)
                if (name[k - 1] == ':') {
                    name_len = k - 1;
                    break;
                }
        }
        at = (size_t)(sep - s) + strlen(x->sep);
        const char *end = find(s + at, n - at, x->call_end);
        size_t len = end ? (size_t)(end - (s + at)) : n - at;
        json_t *args = load(s + at, len);
        int rc = add_call(p, name, name_len, args, x->head_is_id ? id : NULL, names, n_names);
        json_decref(args);
        if (rc) return rc;
        at += len + (end ? strlen(x->call_end) : 0);
    }
    if (at < n) { /* the END marker, then nothing but whitespace */
        at += strlen(x->end);
        while (at < n && ws(s[at])) at++;
        if (at < n) return 1;
    }
    return p->n_calls ? 0 : 1;
}
static int parse_deepseek(cs_parsed *p, const char *s, size_t n, const char *const *names, int n_names) {
    return parse_section(&DS_SECTION, p, s, n, names, n_names);
}
static int parse_kimi(cs_parsed *p, const char *s, size_t n, const char *const *names, int n_names) {
    return parse_section(&KM_SECTION, p, s, n, names, n_names);
}

/* [TOOL_CALLS]name[CALL_ID]id[ARGS]{...}, repeated (the [CALL_ID] part optional) */
static int parse_mistral_v11(cs_parsed *p, const char *s, size_t n, const char *const *names, int n_names) {
    size_t at = 0;
    while (at < n) {
        while (at < n && ws(s[at])) at++;
        if (at == n) break;
        if (!starts(s + at, n - at, "[TOOL_CALLS]")) return 1;
        at += strlen("[TOOL_CALLS]");
        const char *args = find(s + at, n - at, "[ARGS]");
        if (!args) return 1;
        const char *name = s + at, *cid = find(name, (size_t)(args - name), "[CALL_ID]");
        size_t name_len = (size_t)((cid ? cid : args) - name);
        char id[64] = "";
        if (cid) {
            size_t il = (size_t)(args - cid) - strlen("[CALL_ID]");
            if (il >= sizeof id) return 1;
            memcpy(id, cid + strlen("[CALL_ID]"), il);
            id[il] = 0;
        }
        at = (size_t)(args - s) + strlen("[ARGS]");
        const char *next = find(s + at, n - at, "[TOOL_CALLS]");
        size_t len = next ? (size_t)(next - (s + at)) : n - at;
        json_t *a = load(s + at, len);
        int rc = add_call(p, name, name_len, a, cid ? id : NULL, names, n_names);
        json_decref(a);
        if (rc) return rc;
        at += len;
    }
    return p->n_calls ? 0 : 1;
}

/* gpt-oss: to=functions.NAME<|channel|>commentary json<|message|>{...} (the <|call|> that ends
 * it is a stop token); `<|constrain|>json` and the order `<|channel|>commentary to=...` too */
static int parse_harmony(cs_parsed *p, const char *s, size_t n, const char *const *names, int n_names) {
    size_t at = strlen("to=functions.");
    size_t e = at;
    while (e < n && s[e] != '<' && s[e] != ' ') e++;
    const char *msg = find(s + e, n - e, "<|message|>");
    if (!msg || e == at) return 1;
    const char *a = msg + strlen("<|message|>");
    const char *end = find(a, (size_t)(s + n - a), "<|call|>");
    size_t len = end ? (size_t)(end - a) : (size_t)(s + n - a);
    json_t *args = load(a, len);
    int rc = add_call(p, s + at, e - at, args, NULL, names, n_names);
    json_decref(args);
    if (rc) return rc;
    if (end) { /* nothing but whitespace after */
        for (const char *q = end + strlen("<|call|>"); q < s + n; q++)
            if (!ws(*q)) return 1;
    }
    return 0;
}

/* DeepSeek-R1: <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>,
 * whitespace between calls, then <｜tool▁calls▁end｜> (optional: the first release writes it only
 * after a second call) and nothing else */
static int parse_deepseek_r1(cs_parsed *p, const char *s, size_t n, const char *const *names, int n_names) {
    size_t at = strlen(DS_BEGIN);
    for (;;) {
        while (at < n && ws(s[at])) at++;
        if (at == n || starts(s + at, n - at, DS_END)) break;
        if (!starts(s + at, n - at, DS_CALL)) return 1;
        at += strlen(DS_CALL);
        const char *sep = find(s + at, n - at, DS_SEP);
        if (!sep || (size_t)(sep - (s + at)) != strlen("function") || !starts(s + at, n - at, "function")) return 1;
        at = (size_t)(sep - s) + strlen(DS_SEP);
        const char *nl = find(s + at, n - at, "\n");
        if (!nl) return 1;
        const char *name = s + at;
        size_t name_len = (size_t)(nl - name);
        at = (size_t)(nl - s) + 1;
        if (!starts(s + at, n - at, "```json\n")) return 1;
        at += strlen("```json\n");
        const char *end = find(s + at, n - at, DS_CALL_END);
        if (!end) return 1;
        size_t len = (size_t)(end - (s + at));
        while (len > 0 && ws(s[at + len - 1])) len--;
        if (len < 3 || memcmp(s + at + len - 3, "```", 3)) return 1;
        json_t *args = load(s + at, len - 3);
        int rc = add_call(p, name, name_len, args, NULL, names, n_names);
        json_decref(args);
        if (rc) return rc;
        at = (size_t)(end - s) + strlen(DS_CALL_END);
    }
    if (at < n) {
        at += strlen(DS_END);
        while (at < n && ws(s[at])) at++;
        if (at < n) return 1;
    }
    return p->n_calls ? 0 : 1;
}

typedef int (*parse_fn)(cs_parsed *p, const char *s, size_t n, const char *const *names, int n_names);
static const parse_fn PARSE[] = {
    [CS_TOOLS_NONE] = NULL,
    [CS_TOOLS_HERMES] = parse_hermes,
    [CS_TOOLS_MISTRAL] = parse_mistral,
    [CS_TOOLS_DEEPSEEK] = parse_deepseek,
    [CS_TOOLS_MISTRAL_V11] = parse_mistral_v11,
    [CS_TOOLS_HARMONY] = parse_harmony,
    [CS_TOOLS_DEEPSEEK_R1] = parse_deepseek_r1,
    [CS_TOOLS_KIMI] = parse_kimi,
};

int cs_valid_call_id(const cs_chat_format *fmt, const char *id) {
    if (!id || !*id) return 0;
    if (!fmt || !fmt->call_id_len) return 1;
    size_t k = 0;
    for (; id[k]; k++)
        if (!((id[k] >= 'a' && id[k] <= 'z') || (id[k] >= 'A' && id[k] <= 'Z') || (id[k] >= '0' && id[k] <= '9')))
            return 0;
    return k == (size_t)fmt->call_id_len;
}

int cs_output_parse(const cs_chat_format *fmt, int thinking, int parse_tools, const char *const *tool_names,
                    int n_names, const char *text, size_t n, int final, cs_parsed *out) {
    memset(out, 0, sizeof *out);
    if (!text) text = "";
    size_t at = 0;
    out->content = text;
    if (fmt && fmt->think_open && fmt->think_close) {
        int inside = thinking && fmt->starts_thinking;
        if (!inside) {
            size_t k = 0;
            while (k < n && ws(text[k])) k++;
            if (starts(text + k, n - k, fmt->think_open)) {
                inside = 1;
                at = k + strlen(fmt->think_open);
            } else if (!final && (k == n || partial_suffix(text + k, n - k, fmt->think_open) == n - k)) {
                out->content = text + n; /* `<thi`: not yet known which */
                return 0;
            }
        }
        if (inside) {
            const char *close = find(text + at, n - at, fmt->think_close);
            size_t r0 = at, r1 = close ? (size_t)(close - text) : n;
            if (!close && !final) r1 -= partial_suffix(text + r0, r1 - r0, fmt->think_close);
            while (r0 < r1 && text[r0] == '\n') r0++;
            while (r1 > r0 && ws(text[r1 - 1])) r1--;
            out->reasoning = text + r0;
            out->reasoning_len = r1 - r0;
            if (!close) {
                out->content = text + n;
                return 0;
            }
            at = (size_t)(close - text) + strlen(fmt->think_close);
            while (at < n && ws(text[at])) at++;
        }
    }
    if (fmt && fmt->content_open) { /* the content is what follows the final channel's header */
        const char *h = find(text + at, n - at, fmt->content_open);
        const char *callp = parse_tools && SYNTAX[fmt->tools].open ? find(text + at, n - at, SYNTAX[fmt->tools].open)
                                                                   : NULL;
        if (callp && (!h || callp < h)) {
            /* a tool call instead of an answer: only the final channel is content, so the
             * region starts at the call (parsed below) */
            at = (size_t)(callp - text);
        } else if (h) {
            at = (size_t)(h - text) + strlen(fmt->content_open);
        } else if (!final) {
            out->content = text + n;
            return 0;
        }
    }
    const char *c = text + at;
    size_t cn = n - at, hold = 0;
    const char *open = fmt && parse_tools && fmt->tools != CS_TOOLS_NONE ? SYNTAX[fmt->tools].open : NULL;
    const char *block = open ? find(c, cn, open) : NULL;
    out->content = c;
    if (!block) {
        if (!final) {
            if (open) hold = partial_suffix(c, cn, open);
            while (hold < cn && ws(c[cn - hold - 1])) hold++;
        }
        out->content_len = cn - hold;
        out->has_content = cn > 0;
        return 0;
    }
    size_t before = (size_t)(block - c);
    while (before > 0 && ws(c[before - 1])) before--;
    if (!final) {
        out->in_tools = 1;
        out->content_len = before;
        out->has_content = before > 0;
        return 0;
    }
    int rc = PARSE[fmt->tools](out, block, cn - (size_t)(block - c), tool_names, n_names);
    if (rc < 0) {
        cs_parsed_free(out);
        return -1;
    }
    if (rc > 0) { /* not tool calls: it all stays content */
        cs_parsed_free(out);
        out->content_len = cn;
        out->has_content = cn > 0;
        return 0;
    }
    for (int k = 0; k < out->n_calls; k++)
        if (out->calls[k].id && !cs_valid_call_id(fmt, out->calls[k].id)) {
            free(out->calls[k].id);
            out->calls[k].id = NULL;
        }
    out->content_len = before;
    out->has_content = before > 0;
    return 0;
}

/* ---- constrained calls ----------------------------------------------------------------- */

static int set_err(char *err, size_t len, const char *msg) {
    if (err && len) snprintf(err, len, "%s", msg);
    return -1;
}

int cs_tool_call_constraint(const cs_chat_format *fmt, const json_t *tools, const char *only, const char *call_id,
                            char **prefix, char **suffix, char **schema, char *err, size_t err_len) {
    *prefix = *suffix = *schema = NULL;
    if (!fmt || fmt->tools == CS_TOOLS_NONE)
        return set_err(err, err_len, "the model's chat template has no tool calls");
    json_t *any = json_array();
    const char *single = NULL;
    json_t *single_params = NULL;
    size_t count = 0;
    for (size_t k = 0; k < json_array_size(tools); k++) {
        json_t *fn = json_object_get(json_array_get(tools, k), "function");
        json_t *nm = json_object_get(fn, "name");
        if (!json_is_string(nm)) {
            json_decref(any);
            return set_err(err, err_len, "a tool has no function name");
        }
        if (only && strcmp(only, json_string_value(nm))) continue;
        json_t *params = json_object_get(fn, "parameters");
        if (!params) params = json_pack("{s:s}", "type", "object");
        else json_incref(params);
        single = json_string_value(nm);
        single_params = params;
        json_array_append_new(any, json_pack("{s:s, s:{s:{s:s}, s:o}, s:[s, s], s:b}", "type", "object", "properties",
                                             "name", "const", single, "arguments", json_incref(params), "required",
                                             "name", "arguments", "additionalProperties", 0));
        json_decref(params);
        count++;
    }
    if (count == 0) {
        json_decref(any);
        return set_err(err, err_len, "no tool to call");
    }
    const char *pre = NULL, *suf = NULL;
    json_t *sch = NULL;
    char ds_pre[1024];
    switch (fmt->tools) {
    case CS_TOOLS_HERMES:
        pre = "<tool_call>\n";
        suf = "\n</tool_call>";
        break;
    case CS_TOOLS_MISTRAL:
        pre = "[TOOL_CALLS][";
        suf = "]";
        break;
    case CS_TOOLS_DEEPSEEK:
        if (count != 1) {
            json_decref(any);
            return set_err(err, err_len, "DeepSeek's tool-call syntax writes the function name outside the "
                                         "JSON: a required call needs one function (name it in tool_choice)");
        }
        snprintf(ds_pre, sizeof ds_pre, DS_BEGIN DS_CALL "%s" DS_SEP, single);
        pre = ds_pre;
        suf = DS_CALL_END DS_END;
        sch = json_incref(single_params);
        break;
    case CS_TOOLS_DEEPSEEK_R1:
        if (count != 1) {
            json_decref(any);
            return set_err(err, err_len, "DeepSeek-R1's tool-call syntax writes the function name outside the "
                                         "JSON: a required call needs one function (name it in tool_choice)");
        }
        snprintf(ds_pre, sizeof ds_pre, DS_BEGIN DS_CALL "function" DS_SEP "%s\n```json\n", single);
        pre = ds_pre;
        suf = "\n```" DS_CALL_END DS_END;
        sch = json_incref(single_params);
        break;
    case CS_TOOLS_KIMI: /* call_id: the call's index (digits; else 0, the first of its message) */
        if (count != 1) {
            json_decref(any);
            return set_err(err, err_len, "Kimi's tool-call syntax writes the function name outside the JSON: "
                                         "a required call needs one function (name it in tool_choice)");
        }
        snprintf(ds_pre, sizeof ds_pre, KM_BEGIN KM_CALL "functions.%s:%s" KM_ARGS, single,
                 call_id && *call_id && strspn(call_id, "0123456789") == strlen(call_id) && strlen(call_id) < 12 ? call_id
                                                                                                                : "0");
        pre = ds_pre;
        suf = KM_CALL_END KM_END;
        sch = json_incref(single_params);
        break;
    case CS_TOOLS_HARMONY:
        if (count != 1) {
            json_decref(any);
            return set_err(err, err_len, "gpt-oss's tool-call syntax writes the function name outside the JSON: "
                                         "a required call needs one function (name it in tool_choice)");
        }
        snprintf(ds_pre, sizeof ds_pre, " to=functions.%s<|channel|>commentary json<|message|>", single);
        pre = ds_pre;
        suf = "<|call|>";
        sch = json_incref(single_params);
        break;
    case CS_TOOLS_MISTRAL_V11:
        if (count != 1) {
            json_decref(any);
            return set_err(err, err_len, "this Mistral tool-call syntax writes the function name outside the JSON: "
                                         "a required call needs one function (name it in tool_choice)");
        }
        /* Mistral-Small-3.2 writes [CALL_ID]id: the id is the caller's, written by the prefix */
        if (fmt->call_id_len && !cs_valid_call_id(fmt, call_id)) {
            json_decref(any);
            return set_err(err, err_len, "this Mistral tool-call syntax needs a call id of 9 letters and digits");
        }
        if (fmt->call_id_len)
            snprintf(ds_pre, sizeof ds_pre, "[TOOL_CALLS]%s[CALL_ID]%s[ARGS]", single, call_id);
        else
            snprintf(ds_pre, sizeof ds_pre, "[TOOL_CALLS]%s[ARGS]", single);
        pre = ds_pre;
        suf = "";
        sch = json_incref(single_params);
        break;
    default: break;
    }
    if (!sch) sch = count == 1 ? json_incref(json_array_get(any, 0)) : json_pack("{s:O}", "anyOf", any);
    json_decref(any);
    *prefix = dup_s(pre);
    *suffix = dup_s(suf);
    *schema = sch ? json_dumps(sch, JSON_COMPACT) : NULL;
    json_decref(sch);
    if (!*prefix || !*suffix || !*schema) {
        free(*prefix);
        free(*suffix);
        free(*schema);
        *prefix = *suffix = *schema = NULL;
        return set_err(err, err_len, "out of memory");
    }
    return 0;
}
