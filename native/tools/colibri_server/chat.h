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

typedef struct cs_message {
    const char *role;     /* "system", "user", "assistant", "tool", ... */
    const char *content;  /* UTF-8; NULL is read as "" */
} cs_message;

/* Token ids of `msgs` rendered with `template_src` (the model's chat template) followed by the
 * generation prompt; *ids is malloc'd (caller frees). Returns 0, or -1 with a message in err
 * (an unknown template, a role the template does not allow, a tokenizer failure). */
int cs_chat_tokenize(colibri_tokenizer *tok, const char *template_src, const cs_message *msgs,
                     size_t n_msgs, int32_t **ids, int64_t *n_ids, char *err, size_t err_len);

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
