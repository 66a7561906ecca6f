/*
 * chat.h — chat templates of colibri_server, rendered natively (no Jinja interpreter).
 *
 * The model's chat template (metadata key tokenizer.chat_template, colibri_get_string(ctx,
 * "chat_template")) is recognised by its canonical form — the Jinja source with the
 * whitespace that Jinja itself ignores removed (HF's trim_blocks / lstrip_blocks and the
 * `-` markers applied, spaces inside tags dropped, string literals and `a.b` / `a['b']`
 * written one way, `'x' + y` split into its parts) — compared with the templates of the
 * families below, and rendered in C:
 *
 *   mistral  Mixtral-8x7B-Instruct-v0.1 / Mistral-Instruct `[INST] ... [/INST]`: BOS first,
 *            user/assistant alternation, assistant turns end with EOS, an optional first
 *            system message put before the first user message ("system\n\nuser") as the
 *            current Mixtral template does; older variants without system support too
 *   chatml   Qwen1.5-MoE / Qwen2-MoE (`<|im_start|>role\n...<|im_end|>\n`, the template's
 *            default system prompt when the first message is not a system message) and
 *            plain ChatML
 *   qwen3    Qwen3-MoE without tools (assistant `<think>` blocks as the template renders
 *            them; `tool` messages as `<tool_response>`; thinking left on)
 *   tulu     OLMoE-1B-7B-0924-Instruct / Tulu (`<|user|>\n...`, `<|assistant|>\n...`,
 *            BOS first where the template has it, e.g. OLMoE's `<|endoftext|>`)
 *   qwen2.5  Qwen2.5-Instruct: default system prompt, tools in <tools>, <tool_call> blocks
 *   mistral-v3-tekken  Mistral-Nemo-Instruct-2407: [AVAILABLE_TOOLS] before the last user
 *            message, [TOOL_CALLS] / [TOOL_RESULTS], no generation prompt
 *   mistral-small-3.2, devstral  Mistral-Small-3.2-24B-Instruct-2506 and Devstral-Small-2507:
 *            [SYSTEM_PROMPT] (a default one, Small 3.2's with today's date), [AVAILABLE_TOOLS],
 *            [TOOL_CALLS]name([CALL_ID]id)[ARGS]{...}, no generation prompt
 *   gpt-oss  gpt-oss (harmony): the system message (date, reasoning effort), a first system /
 *            developer message as the developer's instructions, user turns and final-channel
 *            answers, tools as its TypeScript namespace (render_typescript_type: nested objects,
 *            arrays, oneOf, enums, descriptions, defaults), calls on the commentary channel and
 *            their results
 *   deepseek-v3.1  DeepSeek-V3.1: system prompts joined first, <｜User｜> / <｜Assistant｜>,
 *            tool calls in its tool tokens, the thinking switch
 *   deepseek-v2  DeepSeek-V2-Chat / V2-Lite-Chat: "User: ...", "Assistant: ..." + EOS, no tools
 *   deepseek-r1, deepseek-r1-distill-qwen  DeepSeek-R1 as first released and the
 *            R1-Distill-Qwen form llama.cpp ships: the last system message first, <｜User｜> /
 *            <｜Assistant｜>, calls as TYPE<｜tool▁sep｜>NAME and a ```json block, tool outputs,
 *            the prompt opening <think> (the second: closing it unless thinking is on)
 * Qwen3, Qwen2.5, the three Mistral tool formats and DeepSeek-V3.1 / R1 take tools (cs_chat_opts), assistant
 * tool_calls and tool results (cs_message.json); the others refuse tools.
 *
 * Any other template, an edited one included (the default system prompt of the Qwen template
 * is the one part that may differ), is refused, never rendered approximately. Correct means: the ids equal
 * transformers' apply_chat_template(messages, tokenize=True, add_generation_prompt=True) with
 * the same template and tokenizer (tests/test_chat_template.py); where transformers raises
 * (roles that do not alternate, a role the template refuses) cs_chat_tokenize fails, and
 * where a template would silently drop a message of a role it does not know (Qwen3: not
 * system/user/assistant/tool; Tulu: not system/user/assistant) it fails too. A NULL content
 * is read as "" (transformers would fail on most templates).
 *
 * BOS / EOS are inserted as ids; text between them is tokenized piece by piece with
 * add_bos = 0, so SentencePiece adds its dummy prefix per piece as transformers' legacy
 * Llama tokenizer does; BOS / EOS / <unk> written inside message text are read as those
 * tokens (transformers does the same; byte-level BPE tokenizers match their added tokens
 * themselves).
 */
#ifndef COLIBRI_SERVER_CHAT_H
#define COLIBRI_SERVER_CHAT_H

#include <stddef.h>
#include <stdint.h>

#include "colibri.h"

#ifdef __cplusplus
extern "C" {
#endif

struct json_t; /* jansson */

typedef struct cs_message {
    const char *role;     /* "system", "user", "assistant", "tool", ... */
    const char *content;  /* UTF-8; NULL is read as "" */
    /* the whole message object (jansson), or NULL: its "tool_calls" ([{id, type, function:
     * {name, arguments}}], arguments a JSON value: an object where the client's string
     * parsed as one), "tool_call_id" and "reasoning_content" are rendered where the
     * template renders them */
    const struct json_t *json;
} cs_message;

/* What a template takes besides the messages. */
typedef struct cs_chat_opts {
    const struct json_t *tools; /* [{"type": "function", "function": {...}}, ...] or NULL */
    int enable_thinking;        /* chat_template_kwargs.enable_thinking: -1 undefined, 0, 1 */
    const char *reasoning_effort; /* gpt-oss: "low" / "medium" / "high"; NULL: the default */
} cs_chat_opts;

/* How a family writes tool calls and reasoning in the model's output (the row of its
 * template; the parser of tools.c reads it). */
typedef enum cs_tool_syntax {
    CS_TOOLS_NONE = 0,  /* the template has no tool calls */
    CS_TOOLS_HERMES,    /* <tool_call>\n{"name": N, "arguments": {...}}\n</tool_call> (Qwen) */
    CS_TOOLS_MISTRAL,   /* [TOOL_CALLS][{"name": N, "arguments": {...}, "id": "..."}] (Nemo) */
    CS_TOOLS_DEEPSEEK,  /* <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}<｜tool▁call▁end｜>... */
    CS_TOOLS_MISTRAL_V11, /* [TOOL_CALLS]N[CALL_ID]id[ARGS]{...} or [TOOL_CALLS]N[ARGS]{...}
                           * (Mistral-Small-3.2, Devstral) */
    CS_TOOLS_HARMONY,   /* to=functions.N<|channel|>commentary json<|message|>{...} (gpt-oss) */
    CS_TOOLS_DEEPSEEK_R1, /* <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N\n```json\n{...}\n```
                           * <｜tool▁call▁end｜>... (DeepSeek-R1) */
    CS_TOOLS_KIMI,      /* <|tool_calls_section_begin|><|tool_call_begin|>functions.N:0<|tool_call_argument_begin|>{...}
                         * <|tool_call_end|>...<|tool_calls_section_end|> (Kimi-K2) */
} cs_tool_syntax;

typedef struct cs_chat_format {
    const char *name;        /* the template's name */
    cs_tool_syntax tools;
    const char *think_open;  /* the reasoning block's markers ("<think>", "</think>"), or NULL */
    const char *think_close;
    int starts_thinking;     /* the generation prompt opens the reasoning block itself: 1 when
                              * thinking is on, 2 always */
    const char *content_open; /* the content starts after this (harmony's final channel), or NULL */
    const char *const *markers; /* the format's marker tokens, when they are not the ones of its
                                 * tool syntax and think markers (tools.c cs_output_markers) */
    int call_id_len;          /* the template's tool call ids are this many [a-zA-Z0-9] (its
                               * raise_exception otherwise), or 0: any id */
    int calls_numbered;       /* Kimi: the template numbers tool calls across the conversation
                               * (functions.NAME:INDEX), not within a message */
} cs_chat_format;

/* Token ids of `msgs` rendered with `template_src` (the model's chat template) followed by the
 * generation prompt; *ids is malloc'd (caller frees). Returns 0, or -1 with a message in err
 * (an unknown template, a role the template does not allow, a tokenizer failure). */
int cs_chat_tokenize(colibri_tokenizer *tok, const char *template_src, const cs_message *msgs,
                     size_t n_msgs, int32_t **ids, int64_t *n_ids, char *err, size_t err_len);
/* The same with tools and template options (opts NULL: none). A template without tools
 * refuses opts->tools and tool messages. */
int cs_chat_tokenize_ex(colibri_tokenizer *tok, const char *template_src, const cs_message *msgs,
                        size_t n_msgs, const cs_chat_opts *opts, int32_t **ids, int64_t *n_ids,
                        char *err, size_t err_len);

/* The output syntax of a recognised template (static), or NULL. */
const cs_chat_format *cs_chat_template_format(const char *template_src);

/* json.dumps(x, ensure_ascii=False) as Python writes it (transformers' `tojson`); malloc'd,
 * NULL when out of memory. */
char *cs_json_py_dumps(const struct json_t *x);

/* The names of the templates rendered, for messages ("mistral-instruct, chatml, ..."). */
const char *cs_chat_known_templates(void);

/* The stop strings a template implies (e.g. "<|im_end|>"), NULL-terminated static array
 * (an empty list for templates whose end of turn is the EOS token). */
const char *const *cs_chat_stop_strings(const char *template_src);

/* The name of the recognised template ("mistral-instruct", "chatml-qwen2", "qwen3",
 * "tulu", ...; static), or NULL for a template this file does not render (then
 * cs_chat_tokenize fails). For a start-up log line or an early refusal. */
const char *cs_chat_template_name(const char *template_src);

#ifdef __cplusplus
}
#endif
#endif /* COLIBRI_SERVER_CHAT_H */
