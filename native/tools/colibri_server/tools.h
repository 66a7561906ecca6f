/*
 * tools.h — what a chat model wrote, taken apart: reasoning, content and tool calls, in the
 * syntax of the model's chat template (cs_chat_format of chat.h), as vLLM and llama-server
 * return them (message.reasoning_content, message.content, message.tool_calls).
 *
 * The same function serves a finished output (final = 1) and a stream (final = 0: the
 * text so far). For a stream, content and reasoning only grow from one call to the next
 * (the caller sends what is new): what could still change is held back — the beginning of
 * a marker at the end, trailing whitespace, and everything from the first tool-call marker
 * on, which is parsed when the output ends. A tool-call block that does not parse (bad
 * JSON, no name, a function the request did not offer, text after it) is content, all of it.
 *
 * Also here: what constrains the output when tool_choice requires a call — per family, the
 * literal text a call starts and ends with and the JSON schema of the call object.
 */
#ifndef COLIBRI_SERVER_TOOLS_H
#define COLIBRI_SERVER_TOOLS_H

#include <stddef.h>

#include "chat.h"

#ifdef __cplusplus
extern "C" {
#endif

#define CS_MAX_TOOL_CALLS 32

typedef struct cs_parsed_call {
    char *name;       /* malloc'd */
    char *arguments;  /* the arguments object as JSON text (json.dumps' spacing), malloc'd */
    char *id;         /* the id the model wrote (Mistral), or NULL */
} cs_parsed_call;

typedef struct cs_parsed {
    const char *reasoning;  /* into the text: reasoning_len bytes (NULL: none) */
    size_t reasoning_len;
    const char *content;    /* into the text: content_len bytes */
    size_t content_len;
    int has_content;        /* 0: content is null (only tool calls, or nothing) */
    int in_tools;           /* a tool-call block has begun (held back until final) */
    int n_calls;
    cs_parsed_call calls[CS_MAX_TOOL_CALLS];
} cs_parsed;

/* Take text[0..n) apart. A call id the template would refuse (cs_valid_call_id) is dropped
 * (NULL: the caller gives the call one). fmt: the template's output syntax (NULL: all content).
 * thinking: the output begins inside the reasoning block (the prompt opened it).
 * tool_names / n_names: the functions offered (calls of others are not calls); parse_tools 0:
 * no tool calls are looked for (tool_choice "none", or no tools). Returns 0, -1 when out of
 * memory. out->calls are malloc'd: cs_parsed_free. */
int cs_output_parse(const cs_chat_format *fmt, int thinking, int parse_tools, const char *const *tool_names,
                    int n_names, const char *text, size_t n, int final, cs_parsed *out);
void cs_parsed_free(cs_parsed *p);

/* Every marker string of a format's output (think markers, the tool-call syntax's tokens),
 * NULL-terminated (static). A tokenizer may hold one as a special token, which decoding
 * drops: the server writes those back into the text it parses. */
const char *const *cs_output_markers(const cs_chat_format *fmt);

/* What constrained decoding needs so that the output is one call of one of the given tools:
 * the text before the call object, the text after it, and the JSON schema of the call object
 * ({"name": {"const": f}, "arguments": <f's parameters>}, anyOf over the functions; `only`:
 * just that function). Each malloc'd. Where the syntax writes a call id outside the JSON
 * (Mistral-Small-3.2's [CALL_ID]), `call_id` is the id the prefix writes: fmt->call_id_len
 * characters of [a-zA-Z0-9] (cs_valid_call_id), chosen by the caller; for Kimi's syntax
 * (functions.NAME:INDEX) it is the INDEX, in digits (anything else writes 0). Returns 0, or -1 with a
 * message (a family without tool calls, a tool without a name, a missing or invalid call id,
 * out of memory). */
int cs_tool_call_constraint(const cs_chat_format *fmt, const struct json_t *tools, const char *only,
                            const char *call_id, char **prefix, char **suffix, char **schema, char *err,
                            size_t err_len);

/* An id the template takes: fmt->call_id_len characters of [a-zA-Z0-9] (any non-empty id
 * when the template has no rule). */
int cs_valid_call_id(const cs_chat_format *fmt, const char *id);

#ifdef __cplusplus
}
#endif
#endif /* COLIBRI_SERVER_TOOLS_H */
