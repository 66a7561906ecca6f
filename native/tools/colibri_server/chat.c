/*
 * chat.c — the chat templates of colibri_server, rendered natively; see chat.h.
 *
 * How a template is recognised. Both the model's template and each template below are put
 * in a canonical form, one item a line:
 *   T'text'   output text: text between tags after Jinja's whitespace control as
 *             transformers configures it (trim_blocks, lstrip_blocks, `{%-` / `-%}`), and
 *             string literals printed by {{ }}; adjacent pieces merged
 *   Ecode     any other {{ }} expression, e.g. `Emessage['content']`, `Eeos_token`
 *   Scode     a {% %} statement, e.g. `Sif loop['first'] and messages[0]['role']!='system'`
 * where code has no spaces but the ones between two words or two operator characters,
 * string literals are written '...' with one set of escapes, `a.b` is written `a['b']` (as
 * Jinja reads both), `{{ x + y }}` of literals and names becomes the items of x and y, a
 * trailing newline of the source is dropped (as Jinja does) and comments vanish. Two
 * templates with the same canonical form produce the same text for every conversation, so a
 * match means the renderer below is the template; anything else is refused rather than
 * rendered approximately. The one hole is @@SYSTEM_PROMPT@@ in the ChatML-with-default-
 * system template: it matches any literal text, which is then the default system prompt
 * (Qwen1.5 and Qwen2 differ there).
 *
 * How it is tokenized. Rendering produces text and token ids (BOS / EOS where the template
 * writes bos_token / eos_token). Each maximal run of text is tokenized with add_bos = 0:
 * SentencePiece then adds its dummy prefix to each run, which is what transformers' legacy
 * Llama tokenizer does to each piece between special tokens; byte-level BPE splits at added
 * tokens itself. Inside a run, the BOS / EOS / <unk> strings ("<s>", "</s>", "<unk>") are
 * cut out and become their ids where the tokenizer would not read them so (SentencePiece),
 * as transformers matches them in the rendered text.
 */
#include "chat.h"

#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------------ the known templates */

#include "chat_templates.h" /* T_QWEN25_INSTRUCT, T_MISTRAL_NEMO, T_DEEPSEEK_V31 */

/* The sources as their tokenizer_config.json files hold them, newlines inside string
 * literals written \n (the same template to Jinja); tests/test_chat_template.py renders each
 * with transformers and compares the ids. */

/* Qwen3-MoE: the shared beginning (the tools branch, the last-query scan) and end. */
#define QWEN3_HEAD \
    "{%- if tools %}\n" \
    "    {{- '<|im_start|>system\\n' }}\n" \
    "    {%- if messages[0].role == 'system' %}\n" \
    "        {{- messages[0].content + '\\n\\n' }}\n" \
    "    {%- endif %}\n" \
    "    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou " \
    "are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n" \
    "    {%- for tool in tools %}\n" \
    "        {{- \"\\n\" }}\n" \
    "        {{- tool | tojson }}\n" \
    "    {%- endfor %}\n" \
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name " \
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, " \
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n" \
    "{%- else %}\n" \
    "    {%- if messages[0].role == 'system' %}\n" \
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n" \
    "    {%- endif %}\n" \
    "{%- endif %}\n" \
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n" \
    "{%- for message in messages[::-1] %}\n" \
    "    {%- set index = (messages|length - 1) - loop.index0 %}\n"
#define QWEN3_TAIL_A \
    "        {%- if message.tool_calls %}\n" \
    "            {%- for tool_call in message.tool_calls %}\n" \
    "                {%- if (loop.first and content) or (not loop.first) %}\n" \
    "                    {{- '\\n' }}\n" \
    "                {%- endif %}\n" \
    "                {%- if tool_call.function %}\n" \
    "                    {%- set tool_call = tool_call.function %}\n" \
    "                {%- endif %}\n" \
    "                {{- '<tool_call>\\n{\"name\": \"' }}\n" \
    "                {{- tool_call.name }}\n" \
    "                {{- '\", \"arguments\": ' }}\n" \
    "                {%- if tool_call.arguments is string %}\n" \
    "                    {{- tool_call.arguments }}\n" \
    "                {%- else %}\n" \
    "                    {{- tool_call.arguments | tojson }}\n" \
    "                {%- endif %}\n" \
    "                {{- '}\\n</tool_call>' }}\n" \
    "            {%- endfor %}\n" \
    "        {%- endif %}\n" \
    "        {{- '<|im_end|>\\n' }}\n" \
    "    {%- elif message.role == \"tool\" %}\n" \
    "        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}\n" \
    "            {{- '<|im_start|>user' }}\n" \
    "        {%- endif %}\n" \
    "        {{- '\\n<tool_response>\\n' }}\n" \
    "        {{- "
#define QWEN3_TAIL_B \
    " }}\n" \
    "        {{- '\\n</tool_response>' }}\n" \
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n" \
    "            {{- '<|im_end|>\\n' }}\n" \
    "        {%- endif %}\n" \
    "    {%- endif %}\n" \
    "{%- endfor %}\n" \
    "{%- if add_generation_prompt %}\n" \
    "    {{- '<|im_start|>assistant\\n' }}\n" \
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n" \
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n" \
    "    {%- endif %}\n" \
    "{%- endif %}"

/* Qwen3-30B-A3B / Qwen3-235B-A22B as released */
static const char T_QWEN3_INITIAL[] = QWEN3_HEAD
    "    {%- if ns.multi_step_tool and message.role == \"user\" and not(message.content.startswith('<tool_response>') "
    "and message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n"
    "        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' "
    "}}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {%- set content = message.content %}\n"
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is defined and message.reasoning_content is not none "
    "%}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n"
    "        {%- else %}\n"
    "            {%- if '</think>' in message.content %}\n"
    "                {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}\n"
    "                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') "
    "%}\n"
    "            {%- endif %}\n"
    "        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') "
    "+ '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "            {%- endif %}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "        {%- endif %}\n"
    QWEN3_TAIL_A "message.content" QWEN3_TAIL_B;

/* the later revision (`content is string` checks) */
static const char T_QWEN3[] = QWEN3_HEAD
    "    {%- if ns.multi_step_tool and message.role == \"user\" and message.content is string and "
    "not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) "
    "%}\n"
    "        {%- set ns.multi_step_tool = false %}\n"
    "        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n"
    "    {%- else %}\n"
    "        {%- set content = '' %}\n"
    "    {%- endif %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n"
    "        {%- else %}\n"
    "            {%- if '</think>' in content %}\n"
    "                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') "
    "%}\n"
    "                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "            {%- endif %}\n"
    "        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') "
    "+ '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "            {%- endif %}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "        {%- endif %}\n"
    QWEN3_TAIL_A "content" QWEN3_TAIL_B;

#define TULU3_BODY \
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ '<|system|>\\n' + message['content'] " \
    "+ '\\n' }}{% elif message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '\\n' " \
    "}}{% elif message['role'] == 'assistant' %}{% if not loop.last %}{{ '<|assistant|>\\n'  + message['content'] " \
    "+ eos_token + '\\n' }}{% else %}{{ '<|assistant|>\\n'  + message['content'] + eos_token }}{% " \
    "endif %}{% endif %}{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif " \
    "%}{% endfor %}"
static const char T_OLMOE_INSTRUCT[] = "{{ bos_token }}" TULU3_BODY;
static const char T_TULU3[] = TULU3_BODY;

#define TULU2_BODY \
    "{% for message in messages %}\n" \
    "{% if message['role'] == 'system' %}\n" \
    "{{ '<|system|>\\n' + message['content'] }}\n" \
    "{% elif message['role'] == 'user' %}\n" \
    "{{ '<|user|>\\n' + message['content'] }}\n" \
    "{% elif message['role'] == 'assistant' %}\n" \
    "{{ '<|assistant|>\\n'  + message['content'] + eos_token }}\n" \
    "{% endif %}\n" \
    "{% if loop.last and add_generation_prompt %}\n" \
    "{{ '<|assistant|>' }}\n" \
    "{% endif %}\n" \
    "{% endfor %}"
static const char T_TULU2[] = TULU2_BODY;
static const char T_TULU2_BOS[] = "{{ bos_token }}" TULU2_BODY;

static const char T_MIXTRAL_8X7B_INSTRUCT[] =
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {%- if loop.first and system_message is defined %}\n"
    "            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}\n"
    "        {%- else %}\n"
    "            {{- ' [INST] ' + message['content'] + ' [/INST]' }}\n"
    "        {%- endif %}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {{- ' ' + message['content'] + eos_token}}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('Only user and assistant roles are supported, with the exception "
    "of an initial optional system message!') }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n";

static const char T_MISTRAL_V1_ORIGINAL[] =
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 "
    "% 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') "
    "}}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' "
    "}}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ "
    "raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}";

static const char T_MISTRAL_V1_SPACED[] =
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 "
    "% 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') "
    "}}{% endif %}{% if message['role'] == 'user' %}{{ ' [INST] ' + message['content'] + ' [/INST]' "
    "}}{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token}}{% else "
    "%}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor "
    "%}";

static const char T_QWEN2_INSTRUCT[] =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n@@SYSTEM_PROMPT@@<|im_end|>\\n' "
    "}}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' "
    "+ '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif "
    "%}";

static const char T_CHATML[] =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' "
    "}}{% endif %}";

static const char T_OLMO2_INSTRUCT[] =
    "{{ bos_token }}{% for message in messages %}\n"
    "{% if message['role'] == 'system' %}\n"
    "{{ '<|system|>\\n' + message['content'] }}\n"
    "{% elif message['role'] == 'user' %}\n"
    "{{ '<|user|>\\n' + message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}\n"
    "{% if not loop.last %}\n"
    "{{ '<|assistant|>\\n'  + message['content'] + eos_token }}\n"
    "{% else %}\n"
    "{{ '<|assistant|>\\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n"
    "{% endif %}\n"
    "{% if loop.last and add_generation_prompt %}\n"
    "{{ '<|assistant|>\\n' }}\n"
    "{% endif %}\n"
    "{% endfor %}";

enum { FAM_MISTRAL, FAM_CHATML, FAM_QWEN3, FAM_TULU, FAM_QWEN25, FAM_MISTRAL_TEKKEN, FAM_DEEPSEEK3, FAM_MISTRAL_SMALL32, FAM_DEVSTRAL, FAM_HARMONY, FAM_DEEPSEEK_R1, FAM_KIMI, N_FAMILIES };

typedef struct variant {
    const char *name;
    int family;
    const char *src;
    /* FAM_MISTRAL */
    int system_first;          /* a first system message goes before the first user message */
    const char *user_prefix;   /* " [INST] " or "[INST] " */
    const char *asst_prefix;   /* " " or "" */
    const char *alternate_err; /* the template's raise_exception texts */
    const char *role_err;
    /* FAM_CHATML */
    int default_system;        /* the template's literal at @@SYSTEM_PROMPT@@ */
    /* FAM_TULU (user_prefix / asst_prefix too; NULL: Tulu's "<|user|>\n", "<|assistant|>\n") */
    int bos;                   /* starts with {{ bos_token }} */
    const char *system_prefix; /* NULL: "<|system|>\n" */
    const char *system_end, *user_end;     /* after the content */
    const char *asst_end, *asst_end_last;  /* after EOS: not the last message / the last */
    const char *generation;                /* the generation prompt */
    /* FAM_DEEPSEEK_R1: tool calls when tool_calls is truthy, arguments | tojson, a `tool▁calls▁end`
     * after each calling message and the thinking switch (else: when content is none,
     * arguments as text, the end only after a second call, the prompt always thinking) */
    int r1_tojson;
    /* FAM_KIMI: 0 the first release's template, 1 Kimi-K2-Instruct's, 2 Kimi-K2-Thinking's */
    int kimi_rev;
    /* FAM_QWEN25, FAM_DEVSTRAL: the default system prompt; FAM_MISTRAL_SMALL32: its text
     * before the date, and system_default_b after it */
    const char *system_default, *system_default_b;
    /* what the model writes: tool calls, reasoning (tools.c parses it) */
    cs_chat_format fmt;
} variant;

static const char *const HARMONY_MARKERS[] = {"<|start|>", "<|end|>", "<|channel|>", "<|message|>",
                                              "<|return|>", "<|call|>", "<|constrain|>", NULL};
#define FMT_NONE(n) {.name = n}
#define FMT_HERMES(n) {.name = n, .tools = CS_TOOLS_HERMES}
#define FMT_QWEN3(n) {.name = n, .tools = CS_TOOLS_HERMES, .think_open = "<think>", .think_close = "</think>"}

#define ALTERNATE_V1 "Conversation roles must alternate user/assistant/user/assistant/..."
#define ROLES_V1 "Only user and assistant roles are supported!"

static const variant VARIANTS[] = {
    /* Mixtral-8x7B-Instruct-v0.1 now (Mistral-7B-Instruct-v0.1/v0.2 have it too) */
    {.name = "mistral-instruct", .fmt = FMT_NONE("mistral-instruct"), .family = FAM_MISTRAL, .src = T_MIXTRAL_8X7B_INSTRUCT,
     .system_first = 1, .user_prefix = " [INST] ", .asst_prefix = " ",
     .alternate_err = "After the optional system message, conversation roles must alternate "
                      "user/assistant/user/assistant/...",
     .role_err = "Only user and assistant roles are supported, with the exception of an initial "
                 "optional system message!"},
    /* as Mixtral-8x7B-Instruct-v0.1 and Mistral-7B-Instruct-v0.1 were first released */
    {.name = "mistral-instruct-v0.1", .fmt = FMT_NONE("mistral-instruct-v0.1"), .family = FAM_MISTRAL, .src = T_MISTRAL_V1_ORIGINAL,
     .user_prefix = "[INST] ", .asst_prefix = "", .alternate_err = ALTERNATE_V1,
     .role_err = ROLES_V1},
    /* the v1 template with Mistral's spaces (mistralai/cookbook, chat_templates.md) */
    {.name = "mistral-instruct-v0.1-spaced", .fmt = FMT_NONE("mistral-instruct-v0.1-spaced"), .family = FAM_MISTRAL, .src = T_MISTRAL_V1_SPACED,
     .user_prefix = " [INST] ", .asst_prefix = " ", .alternate_err = ALTERNATE_V1,
     .role_err = ROLES_V1},
    /* Qwen1.5-MoE-A2.7B-Chat, Qwen2-57B-A14B-Instruct (their default system prompts differ) */
    {.name = "chatml-qwen2", .fmt = FMT_NONE("chatml-qwen2"), .family = FAM_CHATML, .src = T_QWEN2_INSTRUCT, .default_system = 1},
    /* plain ChatML */
    {.name = "chatml", .fmt = FMT_NONE("chatml"), .family = FAM_CHATML, .src = T_CHATML},
    /* Qwen3-30B-A3B, Qwen3-235B-A22B: the current revision and the first */
    {.name = "qwen3", .fmt = FMT_QWEN3("qwen3"), .family = FAM_QWEN3, .src = T_QWEN3},
    {.name = "qwen3-initial", .fmt = FMT_QWEN3("qwen3-initial"), .family = FAM_QWEN3, .src = T_QWEN3_INITIAL},
    /* OLMoE-1B-7B-0924-Instruct (BOS = <|endoftext|>), OLMo-2 SFT: {{ bos_token }} + Tulu 3 */
    {.name = "olmoe-instruct", .fmt = FMT_NONE("olmoe-instruct"), .family = FAM_TULU, .src = T_OLMOE_INSTRUCT, .bos = 1,
     .system_end = "\n", .user_end = "\n", .asst_end = "\n", .asst_end_last = "",
     .generation = "<|assistant|>\n"},
    /* Tulu 3 (open-instruct's "tulu", Llama-3.1-Tulu-3) */
    {.name = "tulu3", .fmt = FMT_NONE("tulu3"), .family = FAM_TULU, .src = T_TULU3, .bos = 0,
     .system_end = "\n", .user_end = "\n", .asst_end = "\n", .asst_end_last = "",
     .generation = "<|assistant|>\n"},
    /* Tulu 2, one tag a line (the newlines after {{ }} are output), with and without BOS */
    {.name = "tulu2", .fmt = FMT_NONE("tulu2"), .family = FAM_TULU, .src = T_TULU2, .bos = 0,
     .system_end = "\n", .user_end = "\n", .asst_end = "\n", .asst_end_last = "\n",
     .generation = "<|assistant|>\n"},
    {.name = "tulu2-bos", .fmt = FMT_NONE("tulu2-bos"), .family = FAM_TULU, .src = T_TULU2_BOS, .bos = 1,
     .system_end = "\n", .user_end = "\n", .asst_end = "\n", .asst_end_last = "\n",
     .generation = "<|assistant|>\n"},
    /* the one-tag-a-line Tulu 3 form with BOS (OLMo-2 Instruct style) */
    {.name = "olmo2-instruct", .fmt = FMT_NONE("olmo2-instruct"), .family = FAM_TULU, .src = T_OLMO2_INSTRUCT, .bos = 1,
     .system_end = "\n", .user_end = "\n", .asst_end = "\n", .asst_end_last = "\n",
     .generation = "<|assistant|>\n\n"},
    /* Qwen2.5-Instruct (Qwen2.5 MoE): default system prompt, tools in <tools>, calls in <tool_call> */
    {.name = "qwen2.5", .family = FAM_QWEN25, .fmt = FMT_HERMES("qwen2.5"), .src = T_QWEN25_INSTRUCT,
     .system_default = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."},
    /* Mistral-Nemo-Instruct-2407 (v3-tekken, [AVAILABLE_TOOLS] / [TOOL_CALLS] / [TOOL_RESULTS]) */
    {.name = "mistral-v3-tekken", .family = FAM_MISTRAL_TEKKEN, .src = T_MISTRAL_NEMO,
     .fmt = {.name = "mistral-v3-tekken", .tools = CS_TOOLS_MISTRAL, .call_id_len = 9}},
    /* DeepSeek-V3.1 (thinking switch, tool calls in <｜tool▁calls▁begin｜> ...) */
    {.name = "deepseek-v3.1", .family = FAM_DEEPSEEK3, .src = T_DEEPSEEK_V31,
     .fmt = {.name = "deepseek-v3.1", .tools = CS_TOOLS_DEEPSEEK, .think_open = "<think>",
             .think_close = "</think>", .starts_thinking = 1}},
    /* Mistral-Small-3.2-24B-Instruct-2506 ([SYSTEM_PROMPT] with today's date, [CALL_ID]) */
    {.name = "mistral-small-3.2", .family = FAM_MISTRAL_SMALL32, .src = T_MISTRAL_SMALL_32,
     .system_default = T_MISTRAL_SMALL_32_SYS_A, .system_default_b = T_MISTRAL_SMALL_32_SYS_B,
     .fmt = {.name = "mistral-small-3.2", .tools = CS_TOOLS_MISTRAL_V11, .call_id_len = 9}},
    /* gpt-oss (harmony): reasoning on the analysis channel, the answer on the final one */
    {.name = "gpt-oss", .family = FAM_HARMONY, .src = T_GPT_OSS,
     .fmt = {.name = "gpt-oss", .tools = CS_TOOLS_HARMONY, .think_open = "<|channel|>analysis<|message|>",
             .think_close = "<|end|>",
             .content_open = "<|channel|>final<|message|>", .markers = HARMONY_MARKERS}},
    /* DeepSeek-V2-Chat / V2-Lite-Chat: "User: ...\n\n", "Assistant: ..." + EOS, no tools */
    {.name = "deepseek-v2", .fmt = FMT_NONE("deepseek-v2"), .family = FAM_TULU, .src = T_DEEPSEEK_V2, .bos = 1,
     .system_prefix = "", .user_prefix = "User: ", .asst_prefix = "Assistant: ", .system_end = "\n\n",
     .user_end = "\n\n", .asst_end = "", .asst_end_last = "", .generation = "Assistant:"},
    /* DeepSeek-R1 as first released (R1-Distill-Llama-8B): the prompt always opens <think> */
    {.name = "deepseek-r1", .family = FAM_DEEPSEEK_R1, .src = T_DEEPSEEK_R1,
     .fmt = {.name = "deepseek-r1", .tools = CS_TOOLS_DEEPSEEK_R1, .think_open = "<think>",
             .think_close = "</think>", .starts_thinking = 2}},
    /* DeepSeek-R1-Distill-Qwen-32B as llama.cpp ships it (arguments | tojson, thinking switch) */
    {.name = "deepseek-r1-distill-qwen", .family = FAM_DEEPSEEK_R1, .src = T_DEEPSEEK_R1_TOJSON, .r1_tojson = 1,
     .fmt = {.name = "deepseek-r1-distill-qwen", .tools = CS_TOOLS_DEEPSEEK_R1, .think_open = "<think>",
             .think_close = "</think>", .starts_thinking = 1}},
    /* Kimi-K2-Instruct as first released: tools declared as JSON, calls functions.NAME:INDEX */
    {.name = "kimi-k2", .family = FAM_KIMI, .src = T_KIMI_K2, .kimi_rev = 0,
     .fmt = {.name = "kimi-k2", .tools = CS_TOOLS_KIMI}},
    /* Kimi-K2-Instruct now: calls numbered across the conversation, roles named by `name` */
    {.name = "kimi-k2-instruct", .family = FAM_KIMI, .src = T_KIMI_K2_INSTRUCT, .kimi_rev = 1,
     .fmt = {.name = "kimi-k2-instruct", .tools = CS_TOOLS_KIMI, .calls_numbered = 1}},
    /* Kimi-K2-Thinking: the same turns, reasoning in <think> before every answer */
    {.name = "kimi-k2-thinking", .family = FAM_KIMI, .src = T_KIMI_K2_THINKING, .kimi_rev = 2,
     .fmt = {.name = "kimi-k2-thinking", .tools = CS_TOOLS_KIMI, .think_open = "<think>", .think_close = "</think>",
             .calls_numbered = 1}},
    /* Devstral-Small-2507 (Unsloth's template: [TOOL_CALLS]name[ARGS]) */
    {.name = "devstral", .family = FAM_DEVSTRAL, .src = T_DEVSTRAL_UNSLOTH, .system_default = T_DEVSTRAL_SYS,
     .fmt = {.name = "devstral", .tools = CS_TOOLS_MISTRAL_V11}},
};
#define N_VARIANTS (sizeof VARIANTS / sizeof VARIANTS[0])
#define WILDCARD "@@SYSTEM_PROMPT@@"

#define SUPPORTED                                                                            \
    "colibri_server renders the chat templates of Mixtral/Mistral-Instruct, Mistral-Nemo, "  \
    "Mistral-Small-3.2, Devstral, ChatML/Qwen2, Qwen2.5, Qwen3, DeepSeek-V2, DeepSeek-R1, DeepSeek-V3.1, "  \
    "gpt-oss, Kimi-K2 and OLMoE/Tulu: "
#define USE_COMPLETIONS "; format the prompt yourself and send it to /v1/completions instead"

/* ------------------------------------------------------------------ small buffers */

typedef struct sbuf {
    char *p;
    size_t n, cap;
    int oom;
} sbuf;

static void sb_add(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}
static void sb_addc(sbuf *b, char c) { sb_add(b, &c, 1); }
static void sb_adds(sbuf *b, const char *s) { sb_add(b, s, strlen(s)); }
static void sb_free(sbuf *b) {
    free(b->p);
    memset(b, 0, sizeof *b);
}

static int is_space(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}
static int is_word(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}
static int is_op(char c) { return c && strchr("=!<>*/+-%~|&^.:", c) != NULL; }
static int is_ident_start(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}
static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}
static void put_utf8(sbuf *b, unsigned long cp) {
    char u[4];
    if (cp < 0x80) {
        sb_addc(b, (char)cp);
    } else if (cp < 0x800) {
        u[0] = (char)(0xC0 | (cp >> 6)); u[1] = (char)(0x80 | (cp & 0x3F));
        sb_add(b, u, 2);
    } else if (cp < 0x10000) {
        u[0] = (char)(0xE0 | (cp >> 12)); u[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        u[2] = (char)(0x80 | (cp & 0x3F));
        sb_add(b, u, 3);
    } else {
        u[0] = (char)(0xF0 | (cp >> 18)); u[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        u[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); u[3] = (char)(0x80 | (cp & 0x3F));
        sb_add(b, u, 4);
    }
}

/* ------------------------------------------------------------------ canonical form */

/* The value of the Jinja string literal at s[*i] (a quote), escapes decoded as Python's
 * unicode-escape does (what Jinja's lexer applies); *i moves past the closing quote.
 * -1: not terminated. */
static int read_literal(const char *s, size_t n, size_t *i, sbuf *out) {
    char q = s[*i];
    size_t k = *i + 1;
    while (k < n && s[k] != q) {
        if (s[k] != '\\' || k + 1 >= n) {
            sb_addc(out, s[k++]);
            continue;
        }
        char e = s[k + 1];
        k += 2;
        switch (e) {
        case 'n': sb_addc(out, '\n'); break;
        case 't': sb_addc(out, '\t'); break;
        case 'r': sb_addc(out, '\r'); break;
        case 'a': sb_addc(out, '\a'); break;
        case 'b': sb_addc(out, '\b'); break;
        case 'f': sb_addc(out, '\f'); break;
        case 'v': sb_addc(out, '\v'); break;
        case '\\': case '\'': case '"': sb_addc(out, e); break;
        case '\n': break; /* a continued line */
        case 'x': case 'u': case 'U': {
            int nd = e == 'x' ? 2 : e == 'u' ? 4 : 8, d;
            unsigned long cp = 0;
            for (d = 0; d < nd && k + (size_t)d < n && hexval(s[k + d]) >= 0; d++)
                cp = cp * 16 + (unsigned long)hexval(s[k + d]);
            if (d == nd && cp <= 0x10FFFF) {
                put_utf8(out, cp);
                k += (size_t)nd;
            } else { /* Python refuses it; keep it as written so that nothing matches */
                sb_addc(out, '\\');
                sb_addc(out, e);
            }
            break;
        }
        default:
            if (e >= '0' && e <= '7') {
                unsigned long cp = (unsigned long)(e - '0');
                for (int d = 0; d < 2 && k < n && s[k] >= '0' && s[k] <= '7'; d++, k++)
                    cp = cp * 8 + (unsigned long)(s[k] - '0');
                put_utf8(out, cp);
            } else {
                sb_addc(out, '\\');
                sb_addc(out, e);
            }
        }
    }
    if (k >= n) return -1;
    *i = k + 1;
    return 0;
}

/* A literal in the canonical form: '...' with \\ \' \n \xHH (other control bytes). */
static void put_literal(sbuf *out, const char *v, size_t n) {
    sb_addc(out, '\'');
    for (size_t k = 0; k < n; k++) {
        unsigned char c = (unsigned char)v[k];
        char hex[8];
        if (c == '\\') sb_adds(out, "\\\\");
        else if (c == '\'') sb_adds(out, "\\'");
        else if (c == '\n') sb_adds(out, "\\n");
        else if (c < 0x20 || c == 0x7F) {
            snprintf(hex, sizeof hex, "\\x%02x", c);
            sb_adds(out, hex);
        } else sb_addc(out, (char)c);
    }
    sb_addc(out, '\'');
}

/* The value of a canonical literal s[0..n) (quotes included). */
static void unquote(const char *s, size_t n, sbuf *out) {
    for (size_t k = 1; k + 1 < n; k++) {
        if (s[k] != '\\' || k + 2 >= n) {
            sb_addc(out, s[k]);
            continue;
        }
        char e = s[++k];
        if (e == 'n') sb_addc(out, '\n');
        else if (e == 'x' && k + 2 < n - 1) {
            sb_addc(out, (char)(hexval(s[k + 1]) * 16 + hexval(s[k + 2])));
            k += 2;
        } else sb_addc(out, e); /* \\ or \' */
    }
}

/* The code of one tag in the canonical form (see the top of the file). */
static int norm_code(const char *c, size_t n, sbuf *out) {
    int space = 0;
    size_t k = 0;
    while (k < n) {
        char ch = c[k];
        char last = out->n ? out->p[out->n - 1] : 0;
        if (is_space(ch)) {
            space = 1;
            k++;
            continue;
        }
        if (ch == '\'' || ch == '"') {
            sbuf v = {0};
            size_t e = k;
            if (read_literal(c, n, &e, &v) != 0) {
                sb_free(&v);
                return -1;
            }
            put_literal(out, v.p ? v.p : "", v.n);
            if (v.oom) out->oom = 1;
            sb_free(&v);
            k = e;
            space = 0;
            continue;
        }
        if (ch == '.' && (is_word(last) || last == ']' || last == ')') && k + 1 < n &&
            is_ident_start(c[k + 1])) {
            size_t e = k + 1, a;
            while (e < n && is_word(c[e])) e++;
            for (a = e; a < n && is_space(c[a]); a++) {}
            if (a < n && c[a] == '(') { /* a method call stays one */
                sb_add(out, c + k, e - k);
            } else {
                sb_adds(out, "['");
                sb_add(out, c + k + 1, e - k - 1);
                sb_adds(out, "']");
            }
            k = e;
            space = 0;
            continue;
        }
        /* a space stays where it separates two words or two operator characters
         * (`not x`, `= =`: two tokens for Jinja) */
        if (space && ((is_word(ch) && is_word(last)) || (is_op(ch) && is_op(last)))) sb_addc(out, ' ');
        sb_addc(out, ch);
        space = 0;
        k++;
    }
    return 0;
}

/* End of the canonical literal starting at s[k] (a quote): the index after it. */
static size_t skip_literal(const char *s, size_t n, size_t k) {
    for (k++; k < n && s[k] != '\''; k++)
        if (s[k] == '\\') k++;
    return k < n ? k + 1 : n;
}

/* A name path: ident, then [literal] or [digits] subscripts. */
static int is_path(const char *s, size_t n) {
    size_t k = 0;
    if (!n || !is_ident_start(s[0])) return 0;
    while (k < n && is_word(s[k])) k++;
    while (k < n) {
        if (s[k] != '[' || k + 1 >= n) return 0;
        k++;
        if (s[k] == '\'') k = skip_literal(s, n, k);
        else {
            size_t d = k;
            while (k < n && s[k] >= '0' && s[k] <= '9') k++;
            if (k == d) return 0;
        }
        if (k >= n || s[k] != ']') return 0;
        k++;
    }
    return 1;
}

static void flush_text(sbuf *out, sbuf *text) {
    if (text->n) {
        sb_addc(out, 'T');
        put_literal(out, text->p, text->n);
        sb_addc(out, '\n');
    }
    if (text->oom) out->oom = 1;
    text->n = 0;
}

/* {{ code }}: literals join the output text; `a + b + ...` of literals and names is split. */
static void emit_expr(sbuf *out, sbuf *text, const char *c, size_t n) {
    size_t starts[64], ends[64];
    int m = 0, depth = 0, simple = 1;
    size_t k = 0, s0 = 0;
    while (k <= n) {
        if (k == n || (depth == 0 && c[k] == '+')) {
            if (m == 64) {
                simple = 0;
                break;
            }
            starts[m] = s0;
            ends[m++] = k;
            s0 = k + 1;
            k++;
            continue;
        }
        if (c[k] == '\'') {
            k = skip_literal(c, n, k);
            continue;
        }
        if (c[k] == '(' || c[k] == '[' || c[k] == '{') depth++;
        else if (c[k] == ')' || c[k] == ']' || c[k] == '}') depth--;
        k++;
    }
    for (int i = 0; simple && i < m; i++) {
        const char *o = c + starts[i];
        size_t len = ends[i] - starts[i];
        int lit = len >= 2 && o[0] == '\'' && skip_literal(o, len, 0) == len;
        if (!lit && !is_path(o, len)) simple = 0;
    }
    if (!simple || n == 0) {
        flush_text(out, text);
        sb_addc(out, 'E');
        sb_add(out, c, n);
        sb_addc(out, '\n');
        return;
    }
    for (int i = 0; i < m; i++) {
        const char *o = c + starts[i];
        size_t len = ends[i] - starts[i];
        if (o[0] == '\'') {
            unquote(o, len, text);
        } else {
            flush_text(out, text);
            sb_addc(out, 'E');
            sb_add(out, o, len);
            sb_addc(out, '\n');
        }
    }
}

/* The canonical form of a template (malloc'd), or NULL when out of memory. A template
 * Jinja would not read (an unterminated tag or literal, {% raw %}) gets a form that ends
 * in "!" and matches nothing. */
static char *canonicalize(const char *src) {
    size_t n0 = strlen(src), n = 0, i = 0;
    char *s = malloc(n0 + 1);
    if (!s) return NULL;
    for (size_t k = 0; k < n0; k++) { /* Jinja: \r\n and \r are \n; one trailing \n is dropped */
        if (src[k] == '\r') {
            s[n++] = '\n';
            if (k + 1 < n0 && src[k + 1] == '\n') k++;
        } else {
            s[n++] = src[k];
        }
    }
    if (n && s[n - 1] == '\n') n--;
    s[n] = 0;

    sbuf out = {0}, text = {0};
    int line_starting = 1, bad = 0;
    while (i < n && !bad) {
        size_t j = i;
        while (j + 1 < n && !(s[j] == '{' && (s[j + 1] == '{' || s[j + 1] == '%' || s[j + 1] == '#')))
            j++;
        if (j + 1 >= n) {
            sb_add(&text, s + i, n - i);
            break;
        }
        char kind = s[j + 1], sign = 0;
        size_t p = j + 2, te = j;
        if (p < n && (s[p] == '-' || s[p] == '+')) sign = s[p++];
        if (sign == '-') { /* {%- strips all whitespace before */
            while (te > i && is_space(s[te - 1])) te--;
        } else if (sign != '+' && kind != '{') { /* lstrip_blocks */
            size_t lp = te, k;
            while (lp > i && s[lp - 1] != '\n') lp--;
            if (lp > i || line_starting) {
                for (k = lp; k < te && (s[k] == ' ' || s[k] == '\t'); k++) {}
                if (k == te) te = lp;
            }
        }
        sb_add(&text, s + i, te - i);

        char e0 = kind == '{' ? '}' : kind, e1 = '}';
        size_t k = p, ce = 0;
        int found = 0;
        while (k + 1 < n) {
            if (kind != '#' && (s[k] == '\'' || s[k] == '"')) {
                char q = s[k++];
                while (k < n && s[k] != q) k += s[k] == '\\' ? 2 : 1;
                k++;
                continue;
            }
            if (s[k] == e0 && s[k + 1] == e1) {
                ce = k;
                found = 1;
                break;
            }
            k++;
        }
        if (!found) {
            bad = 1;
            break;
        }
        size_t cend = ce, e = ce + 2;
        char esign = 0;
        if (cend > p && (s[cend - 1] == '-' || (s[cend - 1] == '+' && kind != '{'))) esign = s[--cend];
        if (esign == '-') { /* -%} strips all whitespace after */
            while (e < n && is_space(s[e])) e++;
        } else if (kind != '{' && esign != '+' && e < n && s[e] == '\n') { /* trim_blocks */
            e++;
        }
        line_starting = s[e - 1] == '\n';
        if (kind != '#') {
            sbuf code = {0};
            if (norm_code(s + p, cend - p, &code) != 0) {
                bad = 1;
            } else if (kind == '%') {
                flush_text(&out, &text);
                sb_addc(&out, 'S');
                sb_add(&out, code.p ? code.p : "", code.n);
                sb_addc(&out, '\n');
                if (code.n >= 3 && !memcmp(code.p, "raw", 3) && (code.n == 3 || !is_word(code.p[3])))
                    bad = 1;
            } else {
                emit_expr(&out, &text, code.p ? code.p : "", code.n);
            }
            if (code.oom) out.oom = 1;
            sb_free(&code);
        }
        i = e;
    }
    flush_text(&out, &text);
    if (bad) sb_adds(&out, "!\n");
    if (text.oom) out.oom = 1;
    sb_free(&text);
    free(s);
    if (!out.oom && !out.p) sb_add(&out, "", 0);
    if (out.oom) {
        sb_free(&out);
        return NULL;
    }
    return out.p;
}

/* The variant whose canonical form equals the template's (*system: the text at the
 * wildcard, malloc'd, for the template that has one). *oom set when memory ran out. */
static const variant *recognise(const char *src, char **system, int *oom) {
    *system = NULL;
    *oom = 0;
    if (!src || !*src) return NULL;
    char *cand = canonicalize(src);
    if (!cand) {
        *oom = 1;
        return NULL;
    }
    const variant *hit = NULL;
    size_t cl = strlen(cand), wl = strlen(WILDCARD);
    for (size_t v = 0; v < N_VARIANTS && !hit; v++) {
        char *pat = canonicalize(VARIANTS[v].src);
        if (!pat) {
            *oom = 1;
            break;
        }
        const char *w = strstr(pat, WILDCARD);
        if (!w) {
            if (!strcmp(cand, pat)) hit = &VARIANTS[v];
        } else {
            size_t pre = (size_t)(w - pat), suf = strlen(w + wl);
            if (cl >= pre + suf && !memcmp(cand, pat, pre) && !memcmp(cand + cl - suf, w + wl, suf)) {
                /* the text in between stays inside the one literal */
                int inside = 1;
                for (size_t k = pre; k < cl - suf && inside; k++) {
                    if (cand[k] == '\\') k++;
                    else if (cand[k] == '\'' || cand[k] == '\n') inside = 0;
                }
                if (inside) {
                    sbuf t = {0};
                    /* unquote() skips a first and a last character: give it the quotes' places */
                    unquote(cand + pre - 1, cl - suf - pre + 2, &t);
                    if (t.oom) {
                        *oom = 1;
                        sb_free(&t);
                    } else {
                        *system = t.p ? t.p : calloc(1, 1);
                        if (!*system) *oom = 1;
                        else hit = &VARIANTS[v];
                    }
                }
            }
        }
        free(pat);
    }
    free(cand);
    return hit;
}

/* ------------------------------------------------------------------ rendering */

typedef struct special {
    const char *s; /* the token's string, as colibri_token_piece gives it */
    size_t n;
    int32_t id;
} special;

typedef struct render {
    colibri_tokenizer *tok;
    int32_t bos, eos;
    sbuf text;          /* text since the last id */
    int32_t *ids;
    int64_t n, cap;
    special sp[3];      /* strings cut out of the text as their ids */
    int n_sp;
    char *err;
    size_t err_len;
    int failed;
} render;

static void fail(render *r, const char *fmt, ...) {
    if (r->failed) return;
    r->failed = 1;
    if (r->err && r->err_len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(r->err, r->err_len, fmt, ap);
        va_end(ap);
    }
}

static int reserve_ids(render *r, int64_t more) {
    if (r->n + more <= r->cap) return 0;
    int64_t cap = r->cap ? r->cap : 256;
    while (cap < r->n + more) cap *= 2;
    int32_t *p = realloc(r->ids, (size_t)cap * sizeof *p);
    if (!p) {
        fail(r, "out of memory");
        return -1;
    }
    r->ids = p;
    r->cap = cap;
    return 0;
}

static void push_id(render *r, int32_t id) {
    if (r->failed || reserve_ids(r, 1)) return;
    r->ids[r->n++] = id;
}

static void tokenize_run(render *r, const char *s, size_t n) {
    if (r->failed || n == 0) return;
    int64_t got = 0;
    if (reserve_ids(r, (int64_t)n + 8)) return;
    colibri_status st = colibri_tokenize(r->tok, s, n, 0, r->ids + r->n, r->cap - r->n, &got);
    if (st == COLIBRI_E_BUFFER_TOO_SMALL) {
        if (reserve_ids(r, got)) return;
        st = colibri_tokenize(r->tok, s, n, 0, r->ids + r->n, r->cap - r->n, &got);
    }
    if (st != COLIBRI_OK) {
        const char *m = colibri_tokenizer_last_error(r->tok);
        fail(r, "tokenizer: %s", m && *m ? m : colibri_status_string(st));
        return;
    }
    r->n += got;
}

/* Tokenize the pending text, cutting out the special strings. */
static void flush(render *r) {
    const char *s = r->text.p ? r->text.p : "";
    size_t n = r->text.n, at = 0;
    if (r->text.oom) fail(r, "out of memory");
    while (!r->failed && at < n) {
        size_t best = n;
        int which = -1;
        for (size_t k = at; k < n && which < 0; k++)
            for (int q = 0; q < r->n_sp; q++)
                if (r->sp[q].n <= n - k && !memcmp(s + k, r->sp[q].s, r->sp[q].n) &&
                    (which < 0 || r->sp[q].n > r->sp[which].n)) {
                    best = k;
                    which = q;
                }
        tokenize_run(r, s + at, best - at);
        if (which < 0) break;
        push_id(r, r->sp[which].id);
        at = best + r->sp[which].n;
    }
    r->text.n = 0;
}

static void emit(render *r, const char *s) { sb_adds(&r->text, s ? s : ""); }
static void emit_n(render *r, const char *s, size_t n) { sb_add(&r->text, s, n); }
static void emit_id(render *r, int32_t id) {
    if (id < 0) return; /* bos_token / eos_token of a tokenizer without one render as "" */
    flush(r);
    push_id(r, id);
}

/* A special token's string to cut out of text: unless the tokenizer reads it as that token
 * itself (byte-level BPE matches its added tokens). `want`: only if the string is that. */
static void add_special(render *r, int32_t id, const char *want) {
    const char *piece = NULL;
    uint64_t len = 0;
    int32_t one[4];
    int64_t got = 0;
    if (id < 0 || r->n_sp >= 3) return;
    if (colibri_token_piece(r->tok, id, &piece, &len) != COLIBRI_OK || !piece || len == 0) return;
    if (want && (len != strlen(want) || memcmp(piece, want, (size_t)len))) return;
    for (int q = 0; q < r->n_sp; q++)
        if (r->sp[q].id == id) return;
    if (colibri_tokenize(r->tok, piece, len, 0, one, 4, &got) == COLIBRI_OK && got == 1 && one[0] == id)
        return;
    r->sp[r->n_sp].s = piece;
    r->sp[r->n_sp].n = (size_t)len;
    r->sp[r->n_sp++].id = id;
}

static int is(const char *a, const char *b) { return a && !strcmp(a, b); }
static const char *content_of(const cs_message *m) { return m->content ? m->content : ""; }

/* ------------------------------------------------------------------ tojson */

/* A real as Python's repr writes it: the shortest digits that read back, fixed notation for
 * decimal exponents -4..15 (with ".0" when integral), else d.ddde+XX. */
static void py_real(sbuf *b, double x) {
    char buf[64], digits[32];
    if (x != x) { sb_adds(b, "NaN"); return; }
    if (x > 1.7976931348623157e308) { sb_adds(b, "Infinity"); return; }
    if (x < -1.7976931348623157e308) { sb_adds(b, "-Infinity"); return; }
    int prec = 1;
    for (; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*e", prec - 1, x);
        if (strtod(buf, NULL) == x) break;
    }
    /* buf: [-]d[.ddd]e[+-]XX */
    const char *q = buf;
    int neg = *q == '-', nd = 0;
    if (neg) q++;
    for (; *q && *q != 'e'; q++)
        if (*q != '.') digits[nd++] = *q;
    digits[nd] = 0;
    int e10 = atoi(q + 1);
    while (nd > 1 && digits[nd - 1] == '0') digits[--nd] = 0;
    if (neg) sb_addc(b, '-');
    if (e10 >= -4 && e10 < 16) {
        if (e10 < 0) {
            sb_adds(b, "0.");
            for (int k = 0; k < -e10 - 1; k++) sb_addc(b, '0');
            sb_adds(b, digits);
        } else {
            for (int k = 0; k <= e10; k++) sb_addc(b, k < nd ? digits[k] : '0');
            sb_addc(b, '.');
            if (nd > e10 + 1) sb_adds(b, digits + e10 + 1);
            else sb_addc(b, '0');
        }
    } else {
        sb_addc(b, digits[0]);
        if (nd > 1) {
            sb_addc(b, '.');
            sb_adds(b, digits + 1);
        }
        snprintf(buf, sizeof buf, "e%c%02d", e10 < 0 ? '-' : '+', e10 < 0 ? -e10 : e10);
        sb_adds(b, buf);
    }
}

static void py_string(sbuf *b, const char *s, size_t n) {
    sb_addc(b, '"');
    for (size_t k = 0; k < n; k++) {
        unsigned char c = (unsigned char)s[k];
        char hex[8];
        switch (c) {
        case '"': sb_adds(b, "\\\""); break;
        case '\\': sb_adds(b, "\\\\"); break;
        case '\n': sb_adds(b, "\\n"); break;
        case '\r': sb_adds(b, "\\r"); break;
        case '\t': sb_adds(b, "\\t"); break;
        case '\b': sb_adds(b, "\\b"); break;
        case '\f': sb_adds(b, "\\f"); break;
        default:
            if (c < 0x20) {
                snprintf(hex, sizeof hex, "\\u%04x", c);
                sb_adds(b, hex);
            } else {
                sb_addc(b, (char)c);
            }
        }
    }
    sb_addc(b, '"');
}

/* `x | tojson` as transformers defines it: json.dumps(x, ensure_ascii=False) (", " and ": "
 * separators, keys in their order). */
static void cs_py_tojson(sbuf *b, const json_t *x) {
    char num[32];
    switch (json_typeof(x)) {
    case JSON_OBJECT: {
        const char *key;
        json_t *val;
        int first = 1;
        sb_addc(b, '{');
        json_object_foreach((json_t *)x, key, val) {
            if (!first) sb_adds(b, ", ");
            first = 0;
            py_string(b, key, strlen(key));
            sb_adds(b, ": ");
            cs_py_tojson(b, val);
        }
        sb_addc(b, '}');
        break;
    }
    case JSON_ARRAY:
        sb_addc(b, '[');
        for (size_t k = 0; k < json_array_size(x); k++) {
            if (k) sb_adds(b, ", ");
            cs_py_tojson(b, json_array_get(x, k));
        }
        sb_addc(b, ']');
        break;
    case JSON_STRING: py_string(b, json_string_value(x), json_string_length(x)); break;
    case JSON_INTEGER:
        snprintf(num, sizeof num, "%" JSON_INTEGER_FORMAT, json_integer_value(x));
        sb_adds(b, num);
        break;
    case JSON_REAL: py_real(b, json_real_value(x)); break;
    case JSON_TRUE: sb_adds(b, "true"); break;
    case JSON_FALSE: sb_adds(b, "false"); break;
    default: sb_adds(b, "null"); break;
    }
}

static void emit_json(render *r, const json_t *x) { cs_py_tojson(&r->text, x); }

/* ------------------------------------------------------------------ message fields */

static const json_t *mget(const cs_message *m, const char *key) {
    return m->json && json_is_object(m->json) ? json_object_get(m->json, key) : NULL;
}
/* message.tool_calls when truthy (a non-empty array) */
static const json_t *tool_calls_of(const cs_message *m) {
    const json_t *t = mget(m, "tool_calls");
    return json_is_array(t) && json_array_size(t) ? t : NULL;
}
/* tool_call.function when it has one, else the call itself (the templates' `set tool_call =
 * tool_call.function`) */
static const json_t *call_function(const json_t *tc) {
    const json_t *f = json_is_object(tc) ? json_object_get(tc, "function") : NULL;
    return json_is_object(f) ? f : tc;
}
static const char *call_name(render *r, const json_t *fn, size_t i, size_t k) {
    const json_t *nm = json_is_object(fn) ? json_object_get(fn, "name") : NULL;
    if (!json_is_string(nm)) {
        fail(r, "messages[%zu].tool_calls[%zu] has no function name", i, k);
        return "";
    }
    return json_string_value(nm);
}
static const json_t *call_arguments(const json_t *fn) {
    const json_t *a = json_is_object(fn) ? json_object_get(fn, "arguments") : NULL;
    return a ? a : json_null();
}
static int tools_truthy(const cs_chat_opts *o) {
    return o && o->tools && json_is_array(o->tools) && json_array_size(o->tools) > 0;
}
/* A template without tools refuses them rather than dropping them. */
static int refuse_tools(render *r, const variant *v, const cs_message *m, size_t n, const cs_chat_opts *o) {
    if (tools_truthy(o)) {
        fail(r, "chat template %s has no tools; 'tools' cannot be used with this model", v->name);
        return 1;
    }
    for (size_t i = 0; i < n; i++)
        if (tool_calls_of(&m[i])) {
            fail(r, "chat template %s has no tool calls (messages[%zu].tool_calls)", v->name, i);
            return 1;
        }
    return 0;
}

/* ------------------------------------------------------------------ more families */

#define HERMES_TOOLS_INTRO                                                                          \
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "      \
    "provided with function signatures within <tools></tools> XML tags:\n<tools>"
#define HERMES_TOOLS_OUTRO                                                                          \
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments " \
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "          \
    "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"

static void emit_hermes_tools(render *r, const cs_chat_opts *o) {
    emit(r, HERMES_TOOLS_INTRO);
    for (size_t k = 0; k < json_array_size(o->tools); k++) {
        emit(r, "\n");
        emit_json(r, json_array_get(o->tools, k));
    }
    emit(r, HERMES_TOOLS_OUTRO);
}

/* role "tool" of the Qwen templates: consecutive results share one user turn */
static void emit_hermes_tool_result(render *r, const cs_message *m, size_t n, size_t i) {
    if (i == 0 || !is(m[i - 1].role, "tool")) emit(r, "<|im_start|>user");
    emit(r, "\n<tool_response>\n");
    emit(r, content_of(&m[i]));
    emit(r, "\n</tool_response>");
    if (i == n - 1 || !is(m[i + 1].role, "tool")) emit(r, "<|im_end|>\n");
}

static void render_qwen25(render *r, const variant *v, const cs_message *m, size_t n, const cs_chat_opts *o) {
    int sys0 = is(m[0].role, "system");
    if (tools_truthy(o)) {
        emit(r, "<|im_start|>system\n");
        emit(r, sys0 ? content_of(&m[0]) : v->system_default);
        emit(r, "\n\n");
        emit_hermes_tools(r, o);
    } else {
        emit(r, "<|im_start|>system\n");
        emit(r, sys0 ? content_of(&m[0]) : v->system_default);
        emit(r, "<|im_end|>\n");
    }
    for (size_t i = 0; i < n && !r->failed; i++) {
        const char *c = content_of(&m[i]);
        const json_t *calls = tool_calls_of(&m[i]);
        if (is(m[i].role, "user") || (is(m[i].role, "system") && i > 0) || (is(m[i].role, "assistant") && !calls)) {
            emit(r, "<|im_start|>");
            emit(r, m[i].role);
            emit(r, "\n");
            emit(r, c);
            emit(r, "<|im_end|>\n");
        } else if (is(m[i].role, "assistant")) {
            emit(r, "<|im_start|>assistant");
            if (*c) {
                emit(r, "\n");
                emit(r, c);
            }
            for (size_t k = 0; k < json_array_size(calls); k++) {
                const json_t *fn = call_function(json_array_get(calls, k));
                emit(r, "\n<tool_call>\n{\"name\": \"");
                emit(r, call_name(r, fn, i, k));
                emit(r, "\", \"arguments\": ");
                emit_json(r, call_arguments(fn));
                emit(r, "}\n</tool_call>");
            }
            emit(r, "<|im_end|>\n");
        } else if (is(m[i].role, "tool")) {
            emit_hermes_tool_result(r, m, n, i);
        } else if (!(is(m[i].role, "system") && i == 0)) {
            fail(r, "chat template %s: messages[%zu] has role \"%s\"; the template renders only "
                    "system, user, assistant and tool messages", v->name, i, m[i].role);
        }
    }
    emit(r, "<|im_start|>assistant\n");
}

/* A tool call id of the Mistral templates: `id|length != 9` raises (length in characters). */
static int mistral_id_ok(const json_t *id) {
    if (!json_is_string(id)) return 0;
    size_t chars = 0;
    for (const unsigned char *p = (const unsigned char *)json_string_value(id); *p; p++)
        chars += (*p & 0xC0) != 0x80;
    return chars == 9;
}
#define MISTRAL_ID_ERR "Tool call IDs should be alphanumeric strings with length 9!"

/* Mistral-Nemo-Instruct-2407 (v3-tekken). No generation prompt: the turn ends with [/INST]. */
static void render_mistral_tekken(render *r, const variant *v, const cs_message *m, size_t n,
                                  const cs_chat_opts *o) {
    const char *system = NULL;
    size_t first = 0, last_user = (size_t)-1, idx = 0;
    (void)v;
    if (is(m[0].role, "system")) {
        system = content_of(&m[0]);
        first = 1;
    }
    for (size_t i = first; i < n && !r->failed; i++) {
        const json_t *tc = mget(&m[i], "tool_calls");
        if (is(m[i].role, "user")) last_user = i;
        if (!(is(m[i].role, "tool") || is(m[i].role, "tool_results") || (tc && !json_is_null(tc)))) {
            if (is(m[i].role, "user") != (idx % 2 == 0))
                fail(r, "chat template %s: messages[%zu] (role \"%s\"): After the optional system "
                        "message, conversation roles must alternate user/assistant/user/assistant/...",
                     v->name, i, m[i].role);
            idx++;
        }
    }
    emit_id(r, r->bos);
    for (size_t i = first; i < n && !r->failed; i++) {
        const char *c = content_of(&m[i]);
        const json_t *tc = mget(&m[i], "tool_calls");
        if (is(m[i].role, "user")) {
            /* `message == user_messages[-1]`: equal to the last user message */
            int is_last = i == last_user ||
                          (m[i].json && m[last_user].json ? json_equal((json_t *)m[i].json, (json_t *)m[last_user].json)
                                                          : !strcmp(c, content_of(&m[last_user])));
            if (o && o->tools && is_last) {
                emit(r, "[AVAILABLE_TOOLS][");
                for (size_t k = 0; k < json_array_size(o->tools); k++) {
                    const json_t *fn = json_object_get(json_array_get(o->tools, k), "function");
                    const char *key;
                    json_t *val;
                    size_t left = 0;
                    json_object_foreach((json_t *)fn, key, val) left += strcmp(key, "return") != 0;
                    emit(r, "{\"type\": \"function\", \"function\": {");
                    json_object_foreach((json_t *)fn, key, val) {
                        if (!strcmp(key, "return")) continue;
                        emit(r, "\"");
                        emit(r, key);
                        if (json_is_string(val)) {
                            emit(r, "\": \"");
                            emit_n(r, json_string_value(val), json_string_length(val));
                            emit(r, "\"");
                        } else {
                            emit(r, "\": ");
                            emit_json(r, val);
                        }
                        if (--left) emit(r, ", ");
                    }
                    emit(r, "}}");
                    emit(r, k + 1 < json_array_size(o->tools) ? ", " : "]");
                }
                emit(r, "[/AVAILABLE_TOOLS]");
            }
            emit(r, "[INST]");
            if (i == n - 1 && system) {
                emit(r, system);
                emit(r, "\n\n");
            }
            emit(r, c);
            emit(r, "[/INST]");
        } else if (tc && !json_is_null(tc)) {
            emit(r, "[TOOL_CALLS][");
            for (size_t k = 0; k < json_array_size(tc) && !r->failed; k++) {
                const json_t *call = json_array_get(tc, k);
                sbuf out = {0};
                cs_py_tojson(&out, json_object_get(call, "function") ? json_object_get(call, "function") : json_null());
                if (out.n) emit_n(r, out.p, out.n - 1); /* out[:-1] */
                sb_free(&out);
                const json_t *id = json_object_get(call, "id");
                if (!mistral_id_ok(id)) {
                    fail(r, "chat template %s: messages[%zu].tool_calls[%zu]: " MISTRAL_ID_ERR, v->name, i, k);
                    break;
                }
                emit(r, ", \"id\": \"");
                emit(r, json_string_value(id));
                emit(r, "\"}");
                if (k + 1 < json_array_size(tc)) {
                    emit(r, ", ");
                } else {
                    emit(r, "]");
                    emit_id(r, r->eos);
                }
            }
        } else if (is(m[i].role, "assistant")) {
            emit(r, c);
            emit_id(r, r->eos);
        } else if (is(m[i].role, "tool") || is(m[i].role, "tool_results")) {
            const json_t *id = mget(&m[i], "tool_call_id");
            emit(r, "[TOOL_RESULTS]{\"content\": ");
            emit(r, c);
            emit(r, ", ");
            if (!mistral_id_ok(id)) {
                fail(r, "chat template %s: messages[%zu].tool_call_id: " MISTRAL_ID_ERR, v->name, i);
                break;
            }
            emit(r, "\"call_id\": \"");
            emit(r, json_string_value(id));
            emit(r, "\"}[/TOOL_RESULTS]");
        } else {
            fail(r, "chat template %s: messages[%zu] (role \"%s\"): Only user and assistant roles are "
                    "supported, with the exception of an initial optional system message!", v->name, i, m[i].role);
        }
    }
}

/* Mistral-Small-3.2 and Devstral: [SYSTEM_PROMPT] first (the template's default when the first
 * message is not a system message), [AVAILABLE_TOOLS] with the tools' JSON, no generation
 * prompt. Small 3.2: the tools before the last user message, calls as
 * [TOOL_CALLS]name[CALL_ID]id[ARGS]{...}, roles must alternate; Devstral: the tools once after
 * the system prompt, calls as [TOOL_CALLS]name[ARGS]{...} after the assistant's text. */
static void render_mistral_v11(render *r, const variant *v, const cs_message *m, size_t n, const cs_chat_opts *o) {
    int small = v->family == FAM_MISTRAL_SMALL32;
    size_t first = is(m[0].role, "system") ? 1 : 0, last_user = (size_t)-1, idx = 0;
    emit_id(r, r->bos);
    for (size_t i = first; i < n; i++) {
        if (is(m[i].role, "user")) last_user = i;
        if (small && !(is(m[i].role, "tool") || tool_calls_of(&m[i]))) {
            if (is(m[i].role, "user") != (idx % 2 == 0))
                fail(r, "chat template %s: messages[%zu] (role \"%s\"): After the optional system message, "
                        "conversation roles must alternate user/assistant/user/assistant/...", v->name, i, m[i].role);
            idx++;
        }
    }
    emit(r, "[SYSTEM_PROMPT]");
    if (first) {
        emit(r, content_of(&m[0]));
    } else if (small) { /* strftime_now("%Y-%m-%d"): the local date, as transformers renders it */
        char today[32];
        time_t now = time(NULL);
        struct tm tmv;
        localtime_r(&now, &tmv);
        strftime(today, sizeof today, "%Y-%m-%d", &tmv);
        emit(r, v->system_default);
        emit(r, today);
        emit(r, v->system_default_b);
    } else {
        emit(r, v->system_default);
    }
    emit(r, "[/SYSTEM_PROMPT]");
    if (!small && tools_truthy(o)) {
        emit(r, "[AVAILABLE_TOOLS]");
        emit_json(r, o->tools);
        emit(r, "[/AVAILABLE_TOOLS]");
    }
    for (size_t i = first; i < n && !r->failed; i++) {
        const char *c = content_of(&m[i]);
        const json_t *tc = mget(&m[i], "tool_calls");
        if (is(m[i].role, "system")) {
            emit(r, "[SYSTEM_PROMPT]");
            emit(r, c);
            emit(r, "[/SYSTEM_PROMPT]");
        } else if (is(m[i].role, "user")) {
            int is_last = i == last_user || (m[i].json && m[last_user].json &&
                                             json_equal((json_t *)m[i].json, (json_t *)m[last_user].json));
            if (small && o && o->tools && is_last) {
                emit(r, "[AVAILABLE_TOOLS]");
                emit_json(r, o->tools);
                emit(r, "[/AVAILABLE_TOOLS]");
            }
            emit(r, "[INST]");
            emit(r, c);
            emit(r, "[/INST]");
        } else if (is(m[i].role, "assistant")) {
            if (small) {
                const json_t *calls = tool_calls_of(&m[i]);
                for (size_t k = 0; k < json_array_size(calls) && !r->failed; k++) {
                    const json_t *call = json_array_get(calls, k);
                    const json_t *fn = json_object_get(call, "function");
                    emit(r, "[TOOL_CALLS]");
                    emit(r, call_name(r, fn, i, k));
                    const json_t *id = json_object_get(call, "id");
                    if (!mistral_id_ok(id)) {
                        fail(r, "chat template %s: messages[%zu].tool_calls[%zu]: " MISTRAL_ID_ERR, v->name, i, k);
                        break;
                    }
                    emit(r, "[CALL_ID]");
                    emit(r, json_string_value(id));
                    emit(r, "[ARGS]");
                    emit_json(r, call_arguments(fn));
                }
                if (!calls) emit(r, c);
            } else {
                emit(r, c);
                for (size_t k = 0; tc && !json_is_null(tc) && k < json_array_size(tc); k++) {
                    const json_t *fn = json_object_get(json_array_get(tc, k), "function");
                    const json_t *args = call_arguments(fn);
                    emit(r, "[TOOL_CALLS]");
                    emit(r, call_name(r, fn, i, k));
                    emit(r, "[ARGS]");
                    if (json_is_string(args)) emit_n(r, json_string_value(args), json_string_length(args));
                    else emit_json(r, args);
                }
            }
            emit_id(r, r->eos);
        } else if (is(m[i].role, "tool") || is(m[i].role, "tool_results")) {
            emit(r, "[TOOL_RESULTS]");
            if (small) {
                const json_t *id = mget(&m[i], "tool_call_id");
                if (!mistral_id_ok(id)) {
                    fail(r, "chat template %s: messages[%zu].tool_call_id: " MISTRAL_ID_ERR, v->name, i);
                    break;
                }
                emit(r, json_string_value(id));
                emit(r, "[TOOL_CONTENT]");
            }
            emit(r, c);
            emit(r, "[/TOOL_RESULTS]");
        } else {
            fail(r, "chat template %s: messages[%zu] (role \"%s\"): %s", v->name, i, m[i].role,
                 small ? "Only system, user, assistant, and tool roles are supported!"
                       : "Only user, systemm assistant and tool roles are supported in the custom template made by "
                         "Unsloth!");
        }
    }
}

/* Jinja's truth of a JSON value (NULL: undefined) */
static int truthy(const json_t *x) {
    switch (x ? json_typeof(x) : JSON_NULL) {
    case JSON_OBJECT: return json_object_size(x) > 0;
    case JSON_ARRAY: return json_array_size(x) > 0;
    case JSON_STRING: return json_string_length(x) > 0;
    case JSON_INTEGER: return json_integer_value(x) != 0;
    case JSON_REAL: return json_real_value(x) != 0;
    case JSON_TRUE: return 1;
    default: return 0;
    }
}

/* str(x) as Python writes a JSON scalar (what Jinja's join and {{ }} print); 0: not a scalar */
static int py_str(sbuf *b, const json_t *x) {
    char num[32];
    switch (json_typeof(x)) {
    case JSON_STRING: sb_add(b, json_string_value(x), json_string_length(x)); return 1;
    case JSON_INTEGER:
        snprintf(num, sizeof num, "%" JSON_INTEGER_FORMAT, json_integer_value(x));
        sb_adds(b, num);
        return 1;
    case JSON_REAL: py_real(b, json_real_value(x)); return 1;
    case JSON_TRUE: sb_adds(b, "True"); return 1;
    case JSON_FALSE: sb_adds(b, "False"); return 1;
    case JSON_NULL: sb_adds(b, "None"); return 1;
    default: return 0;
    }
}

/* `name in required` (a list: an element equal to it; a string: a substring, as Python's `in`) */
static int in_required(const json_t *req, const char *name) {
    if (json_is_string(req)) return strstr(json_string_value(req), name) != NULL;
    for (size_t k = 0; k < json_array_size(req); k++)
        if (json_is_string(json_array_get(req, k)) && !strcmp(json_string_value(json_array_get(req, k)), name))
            return 1;
    return 0;
}

/* Characters (code points) of UTF-8 text: Jinja's |length of a string. */
static size_t utf8_chars(const char *s, size_t n) {
    size_t c = 0;
    for (size_t k = 0; k < n; k++) c += ((unsigned char)s[k] & 0xC0) != 0x80;
    return c;
}

/* render_typescript_type of the gpt-oss template, whitespace as its tags leave it: arrays (of
 * scalars; of other types as `inner[]`, or any[] when that is longer than 50 characters or
 * "object | object"), type lists joined by " | ", oneOf (each variant, its "// description",
 * its default on a new indented line, " | \n" between: the template's `set` inside the loop
 * never reaches the check for object variants), strings (an enum as "a" | "b"), numbers,
 * booleans, objects with properties as "{\nname?: \n                type, ...}", and "any".
 * What Jinja would refuse (a description or an enum item that is not text) fails. */
static void ts_type(render *r, const variant *v, const json_t *spec, const char *fname, sbuf *o, int depth) {
    if (depth > 32) {
        fail(r, "chat template %s: function %s: parameter types nested deeper than 32 levels", v->name, fname);
        return;
    }
    if (!json_is_object(spec)) {
        sb_adds(o, "any");
        return;
    }
    const json_t *type = json_object_get(spec, "type");
    const char *t = json_is_string(type) ? json_string_value(type) : NULL;
    const json_t *one_of = json_object_get(spec, "oneOf");
    if (is(t, "array")) {
        const json_t *items = json_object_get(spec, "items");
        if (truthy(items)) {
            const char *it = json_is_object(items) ? json_string_value(json_object_get(items, "type")) : NULL;
            if (is(it, "string")) sb_adds(o, "string[]");
            else if (is(it, "number") || is(it, "integer")) sb_adds(o, "number[]");
            else if (is(it, "boolean")) sb_adds(o, "boolean[]");
            else {
                sbuf inner = {0};
                ts_type(r, v, items, fname, &inner, depth + 1);
                const char *in = inner.p ? inner.p : "";
                if (!strcmp(in, "object | object") || utf8_chars(in, inner.n) > 50) sb_adds(o, "any[]");
                else {
                    sb_add(o, in, inner.n);
                    sb_adds(o, "[]");
                }
                if (inner.oom) o->oom = 1;
                sb_free(&inner);
            }
        } else {
            sb_adds(o, "any[]");
        }
        if (truthy(json_object_get(spec, "nullable"))) sb_adds(o, " | null");
    } else if (json_is_array(type) && json_array_size(type) > 0) {
        for (size_t k = 0; k < json_array_size(type); k++) {
            if (k) sb_adds(o, " | ");
            if (!py_str(o, json_array_get(type, k))) {
                fail(r, "chat template %s: function %s: a type list holds a list or an object", v->name, fname);
                return;
            }
        }
    } else if (truthy(one_of)) {
        if (!json_is_array(one_of)) {
            fail(r, "chat template %s: function %s: oneOf must be a list", v->name, fname);
            return;
        }
        for (size_t k = 0; k < json_array_size(one_of) && !r->failed; k++) {
            const json_t *var = json_array_get(one_of, k);
            const json_t *d = json_is_object(var) ? json_object_get(var, "description") : NULL;
            const json_t *def = json_is_object(var) ? json_object_get(var, "default") : NULL;
            ts_type(r, v, var, fname, o, depth + 1);
            if (truthy(d)) {
                if (!json_is_string(d)) {
                    fail(r, "chat template %s: function %s: a oneOf description must be text", v->name, fname);
                    return;
                }
                sb_adds(o, "// ");
                sb_add(o, json_string_value(d), json_string_length(d));
            }
            if (def) {
                sb_adds(o, "                    // default: ");
                cs_py_tojson(o, def);
            }
            if (k + 1 < json_array_size(one_of)) sb_adds(o, " | \n");
        }
    } else if (is(t, "string")) {
        const json_t *en = json_object_get(spec, "enum");
        if (truthy(en)) {
            if (!json_is_array(en)) {
                fail(r, "chat template %s: function %s: enum must be a list", v->name, fname);
                return;
            }
            sb_addc(o, '"');
            for (size_t k = 0; k < json_array_size(en); k++) {
                if (k) sb_adds(o, "\" | \"");
                if (!py_str(o, json_array_get(en, k))) {
                    fail(r, "chat template %s: function %s: an enum holds a list or an object", v->name, fname);
                    return;
                }
            }
            sb_addc(o, '"');
        } else {
            sb_adds(o, "string");
            if (truthy(json_object_get(spec, "nullable"))) sb_adds(o, " | null");
        }
    } else if (is(t, "number") || is(t, "integer")) {
        sb_adds(o, "number");
    } else if (is(t, "boolean")) {
        sb_adds(o, "boolean");
    } else if (is(t, "object")) {
        const json_t *props = json_object_get(spec, "properties");
        if (truthy(props)) {
            const json_t *req = json_object_get(spec, "required");
            const char *pname;
            json_t *pspec;
            size_t left = json_object_size(props);
            if (!json_is_object(props)) {
                fail(r, "chat template %s: function %s: properties must be an object", v->name, fname);
                return;
            }
            sb_adds(o, "{\n");
            json_object_foreach((json_t *)props, pname, pspec) {
                sb_adds(o, pname);
                if (!in_required(req, pname)) sb_addc(o, '?');
                sb_adds(o, ": \n                ");
                ts_type(r, v, pspec, fname, o, depth + 1);
                if (--left) sb_adds(o, ", ");
            }
            sb_addc(o, '}');
        } else {
            sb_adds(o, "object");
        }
    } else {
        sb_adds(o, "any");
    }
}

static void harmony_type(render *r, const variant *v, const json_t *spec, const char *fname) {
    ts_type(r, v, spec, fname, &r->text, 0);
}

/* render_tool_namespace("functions", tools) of the gpt-oss template */
static void harmony_tools(render *r, const variant *v, const json_t *tools) {
    emit(r, "## functions\n\nnamespace functions {\n\n");
    for (size_t k = 0; k < json_array_size(tools) && !r->failed; k++) {
        const json_t *fn = json_object_get(json_array_get(tools, k), "function");
        const char *name = json_string_value(json_object_get(fn, "name"));
        const json_t *desc = json_object_get(fn, "description");
        if (!name || !json_is_string(desc)) {
            fail(r, "chat template %s: tools[%zu] needs a name and a description (the template writes both)", v->name, k);
            return;
        }
        emit(r, "// ");
        emit(r, json_string_value(desc));
        emit(r, "\ntype ");
        emit(r, name);
        emit(r, " = ");
        const json_t *params = json_object_get(fn, "parameters");
        const json_t *props = json_object_get(params, "properties");
        const json_t *req = json_object_get(params, "required");
        if (json_is_object(props) && json_object_size(props)) {
            const char *pname;
            json_t *pspec;
            emit(r, "(_: {\n");
            json_object_foreach((json_t *)props, pname, pspec) {
                const json_t *pd = json_object_get(pspec, "description");
                if (truthy(pd) && !json_is_string(pd)) {
                    fail(r, "chat template %s: function %s: a parameter description must be text", v->name, name);
                    return;
                }
                if (truthy(pd)) {
                    emit(r, "// ");
                    emit(r, json_string_value(pd));
                    emit(r, "\n");
                }
                emit(r, pname);
                if (!in_required(req, pname)) emit(r, "?");
                emit(r, ": ");
                harmony_type(r, v, pspec, name);
                const json_t *def = json_is_object(pspec) ? json_object_get(pspec, "default") : NULL;
                if (def) {
                    int en = truthy(json_object_get(pspec, "enum")), one = !en && truthy(json_object_get(pspec, "oneOf"));
                    if (en || one) { /* the template concatenates the default as text */
                        if (!json_is_string(def)) {
                            fail(r, "chat template %s: function %s: the default of a parameter with %s must be a "
                                    "string (the template writes it as text)", v->name, name, en ? "enum" : "oneOf");
                            return;
                        }
                        emit(r, en ? ", // default: " : "// default: ");
                        emit(r, json_string_value(def));
                    } else {
                        emit(r, ", // default: ");
                        emit_json(r, def);
                    }
                }
                emit(r, ",\n");
            }
            emit(r, "}) => any;\n\n");
        } else {
            emit(r, "() => any;\n\n");
        }
    }
    emit(r, "} // namespace functions");
}

/* gpt-oss (harmony): the system message (identity, knowledge cutoff, today's date, reasoning
 * effort, the valid channels), a first system / developer message as the developer's
 * instructions and the tools' TypeScript namespace, user turns, earlier answers on the final
 * channel, tool calls on the commentary channel (`to=functions.NAME`, the first call of a
 * message, its text as the analysis before it unless a final answer follows later), tool
 * results from `functions.NAME`, then <|start|>assistant. */
static void render_harmony(render *r, const variant *v, const cs_message *m, size_t n, const cs_chat_opts *o) {
    char today[32];
    time_t now = time(NULL);
    struct tm tmv;
    int tools = tools_truthy(o);
    localtime_r(&now, &tmv);
    strftime(today, sizeof today, "%Y-%m-%d", &tmv);
    emit(r, "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
            "Knowledge cutoff: 2024-06\nCurrent date: ");
    emit(r, today);
    emit(r, "\n\nReasoning: ");
    emit(r, o && o->reasoning_effort ? o->reasoning_effort : "medium");
    emit(r, "\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.");
    if (tools) emit(r, "\nCalls to these tools must go to the commentary channel: 'functions'.");
    emit(r, "<|end|>");
    size_t first = 0;
    const char *dev = "";
    if (is(m[0].role, "developer") || is(m[0].role, "system")) {
        first = 1;
        dev = content_of(&m[0]);
    }
    if (*dev || tools) {
        emit(r, "<|start|>developer<|message|>");
        if (*dev) {
            emit(r, "# Instructions\n\n");
            emit(r, dev);
            emit(r, "\n\n");
        }
        if (tools) {
            emit(r, "# Tools\n\n");
            harmony_tools(r, v, o->tools);
        }
        emit(r, "<|end|>");
    }
    const char *last_call = NULL;
    for (size_t i = first; i < n && !r->failed; i++) {
        const char *c = content_of(&m[i]);
        if (is(m[i].role, "assistant")) {
            const json_t *th = mget(&m[i], "thinking");
            const char *thinking = json_is_string(th) ? json_string_value(th) : NULL;
            const json_t *calls = m[i].json ? json_object_get(m[i].json, "tool_calls") : NULL;
            if (strstr(c, "<|channel|>analysis<|message|>") || strstr(c, "<|channel|>final<|message|>") ||
                (thinking && (strstr(thinking, "<|channel|>analysis<|message|>") ||
                              strstr(thinking, "<|channel|>final<|message|>")))) {
                fail(r, "chat template %s: messages[%zu]: You have passed a message containing <|channel|> tags in "
                        "the content field", v->name, i);
            } else if (calls) {
                if (!json_is_array(calls) || json_array_size(calls) == 0) {
                    fail(r, "chat template %s: messages[%zu].tool_calls must hold a call", v->name, i);
                    break;
                }
                int later_final = 0;
                for (size_t k = i + 1; k < n; k++)
                    if (is(m[k].role, "assistant") && !(m[k].json && json_object_get(m[k].json, "tool_calls")))
                        later_final = 1;
                const json_t *fn = call_function(json_array_get(calls, 0));
                if (*c && thinking && *thinking) {
                    fail(r, "chat template %s: messages[%zu]: Cannot pass both content and thinking in an assistant "
                            "message with tool calls!", v->name, i);
                    break;
                } else if (*c && !later_final) {
                    emit(r, "<|start|>assistant<|channel|>analysis<|message|>");
                    emit(r, c);
                    emit(r, "<|end|>");
                } else if (thinking && *thinking && !later_final) {
                    emit(r, "<|start|>assistant<|channel|>analysis<|message|>");
                    emit(r, thinking);
                    emit(r, "<|end|>");
                }
                last_call = call_name(r, fn, i, 0);
                const json_t *ct = json_object_get(fn, "content_type");
                emit(r, "<|start|>assistant to=functions.");
                emit(r, last_call);
                emit(r, "<|channel|>commentary ");
                emit(r, json_is_string(ct) ? json_string_value(ct) : "json");
                emit(r, "<|message|>");
                emit_json(r, call_arguments(fn));
                emit(r, "<|call|>");
            } else {
                emit(r, "<|start|>assistant<|channel|>final<|message|>");
                emit(r, c);
                emit(r, "<|end|>");
                last_call = NULL;
            }
        } else if (is(m[i].role, "user")) {
            emit(r, "<|start|>user<|message|>");
            emit(r, c);
            emit(r, "<|end|>");
        } else if (is(m[i].role, "tool")) {
            if (!last_call) {
                fail(r, "chat template %s: messages[%zu]: Message has tool role, but there was no previous assistant "
                        "message with a tool call!", v->name, i);
                break;
            }
            emit(r, "<|start|>functions.");
            emit(r, last_call);
            emit(r, " to=assistant<|channel|>commentary<|message|>");
            const json_t *cj = mget(&m[i], "content");
            if (cj && !json_is_null(cj)) emit_json(r, cj);
            else emit(r, "\"\"");
            emit(r, "<|end|>");
        } else {
            fail(r, "chat template %s: messages[%zu] has role \"%s\"; the template renders only a first system or "
                    "developer message, then user, assistant and tool messages", v->name, i, m[i].role);
        }
    }
    emit(r, "<|start|>assistant");
}

/* DeepSeek-V3.1: thinking from chat_template_kwargs (thinking / enable_thinking), off by default. */
static void render_deepseek3(render *r, const variant *v, const cs_message *m, size_t n, const cs_chat_opts *o) {
    int thinking = o && o->enable_thinking == 1;
    int first_sp = 1, is_tool = 0, last_user = 0;
    emit_id(r, r->bos);
    for (size_t i = 0; i < n; i++)
        if (is(m[i].role, "system")) {
            if (!first_sp) emit(r, "\n\n");
            emit(r, content_of(&m[i]));
            first_sp = 0;
        }
    for (size_t i = 0; i < n && !r->failed; i++) {
        const char *c = content_of(&m[i]);
        const json_t *calls = tool_calls_of(&m[i]);
        if (is(m[i].role, "user")) {
            is_tool = 0;
            last_user = 1;
            emit(r, "<｜User｜>");
            emit(r, c);
        } else if (is(m[i].role, "assistant") && calls) {
            if (last_user) emit(r, "<｜Assistant｜><think></think>");
            last_user = 0;
            is_tool = 0;
            for (size_t k = 0; k < json_array_size(calls); k++) {
                const json_t *call = json_array_get(calls, k);
                const json_t *fn = json_is_object(call) ? json_object_get(call, "function") : NULL;
                if (k == 0) {
                    emit(r, c);
                    emit(r, "<｜tool▁calls▁begin｜>");
                }
                emit(r, "<｜tool▁call▁begin｜>");
                emit(r, call_name(r, fn, i, k));
                emit(r, "<｜tool▁sep｜>");
                emit_json(r, call_arguments(fn));
                emit(r, "<｜tool▁call▁end｜>");
            }
            emit(r, "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>");
        } else if (is(m[i].role, "assistant")) {
            if (last_user) {
                const json_t *prefix = mget(&m[i], "prefix");
                int pre = prefix && json_is_true(prefix);
                emit(r, "<｜Assistant｜>");
                emit(r, pre && thinking ? "<think>" : "<think></think>");
            }
            last_user = 0;
            if (is_tool) {
                emit(r, c);
                is_tool = 0;
            } else {
                const char *end = strstr(c, "</think>");
                emit(r, end ? end + strlen("</think>") : c);
            }
            emit(r, "<｜end▁of▁sentence｜>");
        } else if (is(m[i].role, "tool")) {
            last_user = 0;
            is_tool = 1;
            emit(r, "<｜tool▁output▁begin｜>");
            emit(r, c);
            emit(r, "<｜tool▁output▁end｜>");
        } else if (!is(m[i].role, "system")) {
            fail(r, "chat template %s: messages[%zu] has role \"%s\"; the template renders only "
                    "system, user, assistant and tool messages", v->name, i, m[i].role);
        }
    }
    if (last_user && !is_tool) {
        emit(r, "<｜Assistant｜>");
        emit(r, thinking ? "<think>" : "<think></think>");
    }
}

/* Kimi-K2's templates (T_KIMI_K2, the first release: kimi_rev 0; T_KIMI_K2_INSTRUCT: 1;
 * T_KIMI_K2_THINKING: 2). All: the tools as one JSON list in a tool_declare turn, turns
 * <|im_ROLE|>NAME<|im_middle|>...<|im_end|>, an assistant's calls in a tool-call section as
 * functions.NAME:INDEX with their arguments, a tool result "## Return of ID" and its content.
 * Rev 0: fixed role names (no header for other roles), INDEX counting the message's calls,
 * arguments | tojson, the result's id its tool_call_id followed by the two characters \n (the
 * template writes them outside an expression). Revs 1 and 2: a message's `name` names its
 * role, INDEX counting the conversation's calls, string arguments as they are, each result
 * taking the oldest call id not yet answered (else functions.NAME:COUNT, NAME the message's
 * name or "unknown") and a newline. Rev 2: the default system turn before the messages, and
 * every assistant answer after <think></think>, or after <think>reasoning_content</think> from
 * the first assistant message without calls on (the template's "last" such message is the
 * first: its loop runs backwards). */
typedef struct kimi_call { const char *name; size_t index; } kimi_call;
static void kimi_header(render *r, const variant *v, const cs_message *m) {
    if (v->kimi_rev == 0) {
        if (is(m->role, "system")) emit(r, "<|im_system|>system<|im_middle|>");
        else if (is(m->role, "user")) emit(r, "<|im_user|>user<|im_middle|>");
        else if (is(m->role, "assistant")) emit(r, "<|im_assistant|>assistant<|im_middle|>");
        else if (is(m->role, "tool")) emit(r, "<|im_system|>tool<|im_middle|>");
        return;
    }
    const json_t *nm = mget(m, "name");
    const char *name = json_is_string(nm) && json_string_length(nm) ? json_string_value(nm) : m->role;
    emit(r, is(m->role, "user") ? "<|im_user|>" : is(m->role, "assistant") ? "<|im_assistant|>" : "<|im_system|>");
    emit(r, name);
    emit(r, "<|im_middle|>");
}
static void kimi_id(render *r, const char *name, size_t index) {
    char idx[32];
    snprintf(idx, sizeof idx, ":%zu", index);
    emit(r, "functions.");
    emit(r, name);
    emit(r, idx);
}
static void render_kimi(render *r, const variant *v, const cs_message *m, size_t n, const cs_chat_opts *o) {
    const int rev = v->kimi_rev;
    const char *const KIMI_SYS = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>";
    size_t total = 0, counter = 0, q_head = 0, q_tail = 0, first_answer = n;
    for (size_t i = 0; i < n; i++) {
        const json_t *calls = tool_calls_of(&m[i]);
        total += calls ? json_array_size(calls) : 0;
        if (is(m[i].role, "assistant") && !calls && first_answer == n) first_answer = i;
    }
    kimi_call *queue = total ? malloc(total * sizeof *queue) : NULL;
    if (total && !queue) {
        fail(r, "out of memory");
        return;
    }
    if (tools_truthy(o)) {
        emit(r, "<|im_system|>tool_declare<|im_middle|>");
        emit_json(r, o->tools);
        emit(r, "<|im_end|>");
    }
    if (rev == 2 && (n == 0 || !is(m[0].role, "system"))) emit(r, KIMI_SYS);
    for (size_t i = 0; i < n && !r->failed; i++) {
        const json_t *calls = tool_calls_of(&m[i]);
        if (i == 0 && !is(m[0].role, "system")) {
            if (rev == 0) emit(r, "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>");
            if (rev == 1) {
                emit(r, KIMI_SYS);
                emit(r, "\n");
            }
        }
        kimi_header(r, v, &m[i]);
        if (rev == 2 && is(m[i].role, "assistant")) {
            emit(r, "<think>");
            if (first_answer == n || i > first_answer) { /* the template's suffix: its reasoning */
                const json_t *rc = mget(&m[i], "reasoning_content"); /* null: none (transformers drops None keys) */
                if (json_is_string(rc)) emit(r, json_string_value(rc));
            }
            emit(r, "</think>");
        }
        if (is(m[i].role, "assistant") && (calls || rev == 2)) {
            emit(r, m[i].content);
            if (calls) emit(r, "<|tool_calls_section_begin|>");
            for (size_t k = 0; calls && k < json_array_size(calls) && !r->failed; k++) {
                const json_t *fn = call_function(json_array_get(calls, k));
                const json_t *args = call_arguments(fn);
                const char *name = call_name(r, fn, i, k);
                size_t index = rev == 0 ? k : counter++;
                if (rev > 0) queue[q_tail++] = (kimi_call){name, index};
                emit(r, "<|tool_call_begin|>");
                kimi_id(r, name, index);
                emit(r, "<|tool_call_argument_begin|>");
                if (rev > 0 && json_is_string(args)) emit(r, json_string_value(args));
                else emit_json(r, args);
                emit(r, "<|tool_call_end|>");
            }
            if (calls) emit(r, "<|tool_calls_section_end|>");
        } else if (is(m[i].role, "tool")) {
            emit(r, "## Return of ");
            if (rev == 0) {
                const json_t *id = mget(&m[i], "tool_call_id");
                emit(r, json_is_string(id) ? json_string_value(id) : "");
                emit(r, "\\n");
            } else {
                if (q_head < q_tail) {
                    kimi_id(r, queue[q_head].name, queue[q_head].index);
                    q_head++;
                } else {
                    const json_t *nm = mget(&m[i], "name");
                    kimi_id(r, json_is_string(nm) ? json_string_value(nm) : "unknown", counter);
                }
                emit(r, "\n");
            }
            emit(r, m[i].content);
        } else {
            emit(r, m[i].content);
        }
        emit(r, "<|im_end|>");
    }
    free(queue);
    emit(r, "<|im_assistant|>assistant<|im_middle|>");
}

static void render_mistral(render *r, const variant *v, const cs_message *m, size_t n) {
    const char *system = NULL;
    size_t first = 0;
    if (v->system_first && is(m[0].role, "system")) {
        system = content_of(&m[0]);
        first = 1;
    }
    emit_id(r, r->bos);
    for (size_t i = first; i < n && !r->failed; i++) {
        size_t li = i - first;
        int user = is(m[i].role, "user");
        if (user != (li % 2 == 0)) {
            fail(r, "chat template %s: messages[%zu] (role \"%s\"): %s", v->name, i, m[i].role,
                 v->alternate_err);
        } else if (user) {
            emit(r, v->user_prefix);
            if (li == 0 && system) {
                emit(r, system);
                emit(r, "\n\n");
            }
            emit(r, content_of(&m[i]));
            emit(r, " [/INST]");
        } else if (is(m[i].role, "assistant")) {
            emit(r, v->asst_prefix);
            emit(r, content_of(&m[i]));
            emit_id(r, r->eos);
        } else {
            fail(r, "chat template %s: messages[%zu] (role \"%s\"): %s", v->name, i, m[i].role,
                 v->role_err);
        }
    }
}

static void render_chatml(render *r, const variant *v, const char *system, const cs_message *m,
                          size_t n) {
    if (v->default_system && !is(m[0].role, "system")) {
        emit(r, "<|im_start|>system\n");
        emit(r, system);
        emit(r, "<|im_end|>\n");
    }
    for (size_t i = 0; i < n; i++) {
        emit(r, "<|im_start|>");
        emit(r, m[i].role);
        emit(r, "\n");
        emit(r, content_of(&m[i]));
        emit(r, "<|im_end|>\n");
    }
    emit(r, "<|im_start|>assistant\n");
}

static const char *find_first(const char *s, const char *what) { return strstr(s, what); }
static const char *find_last(const char *s, size_t n, const char *what) {
    size_t w = strlen(what);
    if (w > n) return NULL;
    for (size_t k = n - w + 1; k-- > 0;)
        if (!memcmp(s + k, what, w)) return s + k;
    return NULL;
}
static int starts_with(const char *s, const char *p) { return !strncmp(s, p, strlen(p)); }
static int ends_with(const char *s, const char *p) {
    size_t a = strlen(s), b = strlen(p);
    return a >= b && !memcmp(s + a - b, p, b);
}

/* Qwen3-MoE without tools, as its template renders it (enable_thinking left undefined). */
static void render_qwen3(render *r, const variant *v, const cs_message *m, size_t n, const cs_chat_opts *o) {
    size_t last_query = n - 1;
    if (tools_truthy(o)) {
        emit(r, "<|im_start|>system\n");
        if (is(m[0].role, "system")) {
            emit(r, content_of(&m[0]));
            emit(r, "\n\n");
        }
        emit_hermes_tools(r, o);
    } else if (is(m[0].role, "system")) {
        emit(r, "<|im_start|>system\n");
        emit(r, content_of(&m[0]));
        emit(r, "<|im_end|>\n");
    }
    for (size_t k = n; k-- > 0;) {
        const char *c = content_of(&m[k]);
        if (is(m[k].role, "user") &&
            !(starts_with(c, "<tool_response>") && ends_with(c, "</tool_response>"))) {
            last_query = k;
            break;
        }
    }
    for (size_t i = 0; i < n && !r->failed; i++) {
        const char *c = content_of(&m[i]);
        if (is(m[i].role, "user") || (is(m[i].role, "system") && i > 0)) {
            emit(r, "<|im_start|>");
            emit(r, m[i].role);
            emit(r, "\n");
            emit(r, c);
            emit(r, "<|im_end|>\n");
        } else if (is(m[i].role, "assistant")) {
            const char *body = c, *reason = "";
            size_t body_n = strlen(c), reason_n = 0;
            const char *end = find_first(c, "</think>");
            const json_t *rc = mget(&m[i], "reasoning_content");
            if (json_is_string(rc)) { /* given apart: content is left as it is */
                reason = json_string_value(rc);
                reason_n = json_string_length(rc);
                end = NULL;
            }
            if (end) {
                /* content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') */
                size_t before = (size_t)(end - c);
                while (before > 0 && c[before - 1] == '\n') before--;
                const char *open = find_last(c, before, "<think>");
                reason = open ? open + strlen("<think>") : c;
                reason_n = (size_t)(c + before - reason);
                while (reason_n > 0 && *reason == '\n') reason++, reason_n--;
                /* content.split('</think>')[-1].lstrip('\n') */
                body = find_last(c, strlen(c), "</think>") + strlen("</think>");
                while (*body == '\n') body++;
                body_n = strlen(body);
            }
            size_t content_n = body_n; /* the template's `content`, for the tool calls */
            if (i > last_query && (i == n - 1 || reason_n > 0)) {
                while (reason_n > 0 && reason[reason_n - 1] == '\n') reason_n--; /* .strip('\n') */
                while (body_n > 0 && *body == '\n') body++, body_n--;            /* .lstrip('\n') */
                emit(r, "<|im_start|>assistant\n<think>\n");
                emit_n(r, reason, reason_n);
                emit(r, "\n</think>\n\n");
                emit_n(r, body, body_n);
            } else {
                emit(r, "<|im_start|>assistant\n");
                emit_n(r, body, body_n);
            }
            /* `content` of the template: the text after </think> (before the lstrip) */
            const json_t *calls = tool_calls_of(&m[i]);
            for (size_t k = 0; k < json_array_size(calls); k++) {
                const json_t *fn = call_function(json_array_get(calls, k));
                const json_t *args = call_arguments(fn);
                if (k > 0 || content_n > 0) emit(r, "\n");
                emit(r, "<tool_call>\n{\"name\": \"");
                emit(r, call_name(r, fn, i, k));
                emit(r, "\", \"arguments\": ");
                if (json_is_string(args)) emit_n(r, json_string_value(args), json_string_length(args));
                else emit_json(r, args);
                emit(r, "}\n</tool_call>");
            }
            emit(r, "<|im_end|>\n");
        } else if (is(m[i].role, "tool")) {
            emit_hermes_tool_result(r, m, n, i);
        } else if (!(is(m[i].role, "system") && i == 0)) {
            /* the template would drop the message without a word */
            fail(r, "chat template %s: messages[%zu] has role \"%s\"; the template renders only "
                    "system, user, assistant and tool messages", v->name, i, m[i].role);
        }
    }
    emit(r, "<|im_start|>assistant\n");
    if (o && o->enable_thinking == 0) emit(r, "<think>\n\n</think>\n\n");
}

static void render_tulu(render *r, const variant *v, const cs_message *m, size_t n) {
    if (v->bos) emit_id(r, r->bos);
    for (size_t i = 0; i < n && !r->failed; i++) {
        if (is(m[i].role, "system")) {
            emit(r, v->system_prefix ? v->system_prefix : "<|system|>\n");
            emit(r, content_of(&m[i]));
            emit(r, v->system_end);
        } else if (is(m[i].role, "user")) {
            emit(r, v->user_prefix ? v->user_prefix : "<|user|>\n");
            emit(r, content_of(&m[i]));
            emit(r, v->user_end);
        } else if (is(m[i].role, "assistant")) {
            emit(r, v->asst_prefix ? v->asst_prefix : "<|assistant|>\n");
            emit(r, content_of(&m[i]));
            emit_id(r, r->eos);
            emit(r, i == n - 1 ? v->asst_end_last : v->asst_end);
        } else {
            fail(r, "chat template %s: messages[%zu] has role \"%s\"; the template renders only "
                    "system, user and assistant messages", v->name, i, m[i].role);
        }
    }
    emit(r, v->generation);
}

/* content is none: null, or no "content" at all (OpenAI clients leave it out beside tool_calls) */
static int content_is_none(const cs_message *m) {
    if (!m->json) return m->content == NULL;
    const json_t *c = mget(m, "content");
    return !c || json_is_null(c);
}

#define R1_CALLS "<｜tool▁calls▁begin｜>"
#define R1_CALL "<｜tool▁call▁begin｜>"
#define R1_CALL_END "<｜tool▁call▁end｜>"
#define R1_CALLS_END "<｜tool▁calls▁end｜>"
#define R1_EOS "<｜end▁of▁sentence｜>"

/* DeepSeek-R1 and its distills: the last system message first, <｜User｜> turns, calls as
 * <｜tool▁call▁begin｜>TYPE<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>, tool results in
 * <｜tool▁outputs▁begin｜> ... <｜tool▁outputs▁end｜>, the generation prompt opening <think>. The
 * template's own quirks are kept: its `is_first` / `is_output_first` are set once a
 * conversation (a later calling message starts with "\n", later results too), the first
 * release renders calls only when content is none and ends the block only after a second
 * call, and the tools are not shown to the model (the template does not render them).
 * Arguments given as an object where the first release concatenates text are written as
 * json.dumps writes them (the client's string, parsed by the server). */
static void render_deepseek_r1(render *r, const variant *v, const cs_message *m, size_t n, const cs_chat_opts *o) {
    int is_first = 0, is_tool = 0, output_first = 1;
    const char *system = "";
    for (size_t i = 0; i < n; i++)
        if (is(m[i].role, "system")) system = content_of(&m[i]);
    emit_id(r, r->bos);
    emit(r, system);
    for (size_t i = 0; i < n && !r->failed; i++) {
        const char *c = content_of(&m[i]);
        if (is(m[i].role, "user")) {
            is_tool = 0;
            emit(r, "<｜User｜>");
            emit(r, c);
        } else if (is(m[i].role, "assistant")) {
            int none = content_is_none(&m[i]);
            const json_t *calls = NULL;
            if (v->r1_tojson) {
                calls = tool_calls_of(&m[i]);
            } else if (none) {
                calls = mget(&m[i], "tool_calls");
                if (calls && !json_is_array(calls)) {
                    fail(r, "chat template %s: messages[%zu].tool_calls must be a list (the template iterates it)",
                         v->name, i);
                    break;
                }
            }
            if (calls) {
                is_tool = 0;
                for (size_t k = 0; k < json_array_size(calls) && !r->failed; k++) {
                    const json_t *call = json_array_get(calls, k);
                    const json_t *fn = json_is_object(call) ? json_object_get(call, "function") : NULL;
                    const json_t *type = json_is_object(call) ? json_object_get(call, "type") : NULL;
                    const json_t *args = call_arguments(fn);
                    const char *name = call_name(r, fn, i, k);
                    if (!json_is_string(type)) {
                        fail(r, "chat template %s: messages[%zu].tool_calls[%zu] has no type (the template writes it)",
                             v->name, i, k);
                        break;
                    }
                    emit(r, is_first ? "\n" R1_CALL : "<｜Assistant｜>" R1_CALLS R1_CALL);
                    emit(r, json_string_value(type));
                    emit(r, "<｜tool▁sep｜>");
                    emit(r, name);
                    emit(r, "\n```json\n");
                    if (!v->r1_tojson && json_is_string(args)) emit_n(r, json_string_value(args), json_string_length(args));
                    else emit_json(r, args);
                    emit(r, "\n```" R1_CALL_END);
                    if (is_first && !v->r1_tojson) emit(r, R1_CALLS_END R1_EOS);
                    is_first = 1;
                }
                if (v->r1_tojson) emit(r, R1_CALLS_END R1_EOS);
            }
            if (!none) {
                if (is_tool) {
                    emit(r, "<｜tool▁outputs▁end｜>");
                    emit(r, c);
                    is_tool = 0;
                } else {
                    const char *end = find_last(c, strlen(c), "</think>");
                    emit(r, "<｜Assistant｜>");
                    emit(r, end ? end + strlen("</think>") : c);
                }
                emit(r, R1_EOS);
            }
        } else if (is(m[i].role, "tool")) {
            is_tool = 1;
            emit(r, output_first ? "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>" : "\n<｜tool▁output▁begin｜>");
            output_first = 0;
            emit(r, c);
            emit(r, "<｜tool▁output▁end｜>");
        } else if (!is(m[i].role, "system")) {
            fail(r, "chat template %s: messages[%zu] has role \"%s\"; the template renders only "
                    "system, user, assistant and tool messages", v->name, i, m[i].role);
        }
    }
    if (is_tool) {
        emit(r, "<｜tool▁outputs▁end｜>");
    } else {
        emit(r, "<｜Assistant｜><think>\n");
        if (v->r1_tojson && !(o && o->enable_thinking == 1)) emit(r, "</think>");
    }
}

/* One renderer a family (the variant rows above name their family). Families without tools
 * refuse them. */
typedef void (*render_fn)(render *r, const variant *v, const char *system, const cs_message *m, size_t n,
                          const cs_chat_opts *o);
static void r_mistral(render *r, const variant *v, const char *s, const cs_message *m, size_t n, const cs_chat_opts *o) {
    (void)s;
    if (!refuse_tools(r, v, m, n, o)) render_mistral(r, v, m, n);
}
static void r_chatml(render *r, const variant *v, const char *s, const cs_message *m, size_t n, const cs_chat_opts *o) {
    if (!refuse_tools(r, v, m, n, o)) render_chatml(r, v, s, m, n);
}
static void r_qwen3(render *r, const variant *v, const char *s, const cs_message *m, size_t n, const cs_chat_opts *o) {
    (void)s;
    render_qwen3(r, v, m, n, o);
}
static void r_tulu(render *r, const variant *v, const char *s, const cs_message *m, size_t n, const cs_chat_opts *o) {
    (void)s;
    if (!refuse_tools(r, v, m, n, o)) render_tulu(r, v, m, n);
}
static void r_qwen25(render *r, const variant *v, const char *s, const cs_message *m, size_t n, const cs_chat_opts *o) {
    (void)s;
    render_qwen25(r, v, m, n, o);
}
static void r_tekken(render *r, const variant *v, const char *s, const cs_message *m, size_t n, const cs_chat_opts *o) {
    (void)s;
    render_mistral_tekken(r, v, m, n, o);
}
static void r_deepseek3(render *r, const variant *v, const char *s, const cs_message *m, size_t n, const cs_chat_opts *o) {
    (void)s;
    render_deepseek3(r, v, m, n, o);
}
static void r_mistral_v11(render *r, const variant *v, const char *s, const cs_message *m, size_t n,
                          const cs_chat_opts *o) {
    (void)s;
    render_mistral_v11(r, v, m, n, o);
}
static void r_harmony(render *r, const variant *v, const char *s, const cs_message *m, size_t n,
                      const cs_chat_opts *o) {
    (void)s;
    render_harmony(r, v, m, n, o);
}
static void r_deepseek_r1(render *r, const variant *v, const char *s, const cs_message *m, size_t n,
                          const cs_chat_opts *o) {
    (void)s;
    render_deepseek_r1(r, v, m, n, o);
}
static void r_kimi(render *r, const variant *v, const char *s, const cs_message *m, size_t n, const cs_chat_opts *o) {
    (void)s;
    render_kimi(r, v, m, n, o);
}
static const render_fn RENDER[N_FAMILIES] = {
    [FAM_MISTRAL] = r_mistral, [FAM_CHATML] = r_chatml, [FAM_QWEN3] = r_qwen3, [FAM_TULU] = r_tulu,
    [FAM_QWEN25] = r_qwen25, [FAM_MISTRAL_TEKKEN] = r_tekken, [FAM_DEEPSEEK3] = r_deepseek3,
    [FAM_MISTRAL_SMALL32] = r_mistral_v11, [FAM_DEVSTRAL] = r_mistral_v11, [FAM_HARMONY] = r_harmony,
    [FAM_DEEPSEEK_R1] = r_deepseek_r1, [FAM_KIMI] = r_kimi,
};

/* ------------------------------------------------------------------ the interface */

/* A short, printable beginning of a template for a message. */
static void excerpt(const char *src, char *out, size_t cap) {
    size_t k = 0, o = 0;
    for (; src[k] && o + 4 < cap && k < 48; k++)
        out[o++] = (unsigned char)src[k] < 0x20 ? ' ' : src[k];
    if (src[k] && o + 4 < cap) {
        memcpy(out + o, "...", 3);
        o += 3;
    }
    out[o] = 0;
}

int cs_chat_tokenize(colibri_tokenizer *tok, const char *template_src, const cs_message *msgs,
                     size_t n_msgs, int32_t **ids, int64_t *n_ids, char *err, size_t err_len) {
    return cs_chat_tokenize_ex(tok, template_src, msgs, n_msgs, NULL, ids, n_ids, err, err_len);
}

int cs_chat_tokenize_ex(colibri_tokenizer *tok, const char *template_src, const cs_message *msgs,
                        size_t n_msgs, const cs_chat_opts *opts, int32_t **ids, int64_t *n_ids,
                        char *err, size_t err_len) {
    render r;
    memset(&r, 0, sizeof r);
    r.err = err;
    r.err_len = err_len;
    if (err && err_len) err[0] = 0;
    if (ids) *ids = NULL;
    if (n_ids) *n_ids = 0;
    if (!ids || !n_ids || (!msgs && n_msgs)) {
        fail(&r, "cs_chat_tokenize: NULL argument");
        return -1;
    }
    if (!template_src || !*template_src) {
        fail(&r, "the model has no chat template (metadata key tokenizer.chat_template: convert a "
                 "checkpoint whose tokenizer_config.json or chat_template.jinja has one); " SUPPORTED
                 "%s" USE_COMPLETIONS, cs_chat_known_templates());
        return -1;
    }
    char *system = NULL;
    int oom = 0;
    const variant *v = recognise(template_src, &system, &oom);
    if (!v) {
        char ex[64];
        excerpt(template_src, ex, sizeof ex);
        if (oom) fail(&r, "out of memory");
        else
            fail(&r, "chat template not recognised (%zu characters: \"%s\"); " SUPPORTED
                     "%s" USE_COMPLETIONS, strlen(template_src), ex, cs_chat_known_templates());
        return -1;
    }
    if (!tok) {
        free(system);
        fail(&r, "the model file has no tokenizer, which chat needs; send token ids to "
                 "/v1/completions instead");
        return -1;
    }
    if (n_msgs == 0) {
        free(system);
        fail(&r, "no messages");
        return -1;
    }
    for (size_t i = 0; i < n_msgs; i++)
        if (!msgs[i].role) {
            free(system);
            fail(&r, "messages[%zu] has no role", i);
            return -1;
        }
    r.tok = tok;
    r.bos = colibri_tokenizer_bos_id(tok);
    r.eos = colibri_tokenizer_eos_id(tok);
    add_special(&r, r.bos, NULL);
    add_special(&r, r.eos, NULL);
    add_special(&r, 0, "<unk>");
    RENDER[v->family](&r, v, system ? system : "", msgs, n_msgs, opts);
    flush(&r);
    free(system);
    sb_free(&r.text);
    if (r.failed) {
        free(r.ids);
        return -1;
    }
    if (!r.ids) { /* nothing rendered: a valid, empty, freeable array */
        r.ids = malloc(sizeof *r.ids);
        if (!r.ids) {
            fail(&r, "out of memory");
            return -1;
        }
    }
    *ids = r.ids;
    *n_ids = r.n;
    return 0;
}

static const char *const STOP_NONE[] = {NULL};
static const char *const STOP_CHATML[] = {"<|im_end|>", "<|endoftext|>", NULL};
static const char *const STOP_HARMONY[] = {"<|return|>", "<|call|>", NULL};
static const char *const STOP_KIMI[] = {"<|im_end|>", NULL};

const char *const *cs_chat_stop_strings(const char *template_src) {
    char *system = NULL;
    int oom = 0;
    const variant *v = recognise(template_src, &system, &oom);
    free(system);
    /* a family's end-of-turn strings besides EOS (Mistral, Tulu, DeepSeek: EOS only) */
    static const char *const *const STOPS[N_FAMILIES] = {
        [FAM_CHATML] = STOP_CHATML, [FAM_QWEN3] = STOP_CHATML, [FAM_QWEN25] = STOP_CHATML,
        [FAM_HARMONY] = STOP_HARMONY, [FAM_KIMI] = STOP_KIMI,
    };
    return v && STOPS[v->family] ? STOPS[v->family] : STOP_NONE;
}

const char *cs_chat_template_name(const char *template_src) {
    char *system = NULL;
    int oom = 0;
    const variant *v = recognise(template_src, &system, &oom);
    free(system);
    return v ? v->name : NULL;
}

const cs_chat_format *cs_chat_template_format(const char *template_src) {
    char *system = NULL;
    int oom = 0;
    const variant *v = recognise(template_src, &system, &oom);
    free(system);
    return v ? &v->fmt : NULL;
}

const char *cs_chat_known_templates(void) {
    static char names[1024];
    if (!names[0]) {
        size_t at = 0;
        for (size_t v = 0; v < N_VARIANTS && at + 64 < sizeof names; v++)
            at += (size_t)snprintf(names + at, sizeof names - at, "%s%s", v ? ", " : "", VARIANTS[v].name);
    }
    return names;
}

char *cs_json_py_dumps(const struct json_t *x) {
    sbuf b = {0};
    cs_py_tojson(&b, x ? x : json_null());
    if (b.oom) {
        sb_free(&b);
        return NULL;
    }
    return b.p;
}
