"""colibri_server's tool calling and reasoning (tools.c, api.c), driven with the official
`openai` client on 127.0.0.1.

The model is a tiny Qwen3-MoE with Qwen3's shipped chat template and a byte-level BPE
tokenizer that has Qwen's special and added tokens. Its weights are set so that greedy
decoding writes a chosen text: every attention output and expert projection is zero, so the
last hidden state is the current token's embedding and the next token depends on it alone;
lm_head then maps each token of a chain of distinct ids to the next one. The chain's text
is a Qwen3 answer with reasoning, content and a tool call — what a real model writes — so the
server's parser, streaming and finish_reason are checked end to end (<tool_call> and
</tool_call> are special tokens here, which decoding drops: the server puts them back); with thinking switched
off the prompt ends in another token and a second chain writes plain text.

Bad input (malformed tools, an unknown function in tool_choice, a required call without
constrained decoding, a template the server does not render) gets a 400 in OpenAI's shape and
the server stays up.
"""

from __future__ import annotations

import http.client
import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

import colibri_lab  # noqa: E402
from colibri_lab.bench.models import FamilyShape, build_model, byte_level_bpe, save_checkpoint  # noqa: E402
from test_chat_template import ADDED, SPECIAL, _corpus  # noqa: E402
from test_chat_tools import templates_folder  # noqa: E402
from test_server import Server, server_path  # noqa: E402,F401

REASONING = "Let me look it up."
CONTENT = "Sure."
ARGS = {"city": "Paris", "days": 2}
ANSWER = (f"<think>\n{REASONING}\n</think>\n\n{CONTENT}\n<tool_call>\n"
          f'{{"name": "get_weather", "arguments": {json.dumps(ARGS)}}}\n</tool_call>')
PLAIN = "Fine weather today"   # the thinking-off chain
MARKERS = ["<tool_call>", "</tool_call>"]
# added tokens for the stretches whose characters repeat too often for a chain of distinct ids
FRAGMENTS = [f"\n{REASONING}\n", f"\n\n{CONTENT}\n", '\n{"name": "get_weather", "arguments": ',
             json.dumps(ARGS) + "}\n"]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "description": "a + b",
                                      "parameters": {"type": "object", "properties": {
                                          "a": {"type": "number"}, "b": {"type": "number"}}}}},
]
USER = [{"role": "user", "content": "Weather in Paris?"}]


def _segment(text: str, pieces: dict[int, str], used: set[int], forced: dict[str, int]) -> list[int]:
    """Distinct ids (none in `used`) whose pieces spell `text`: longest first, backtracking."""
    by_start: dict[str, list[tuple[str, int]]] = {}
    for i, p in pieces.items():
        if p:
            by_start.setdefault(p[0], []).append((p, i))
    for v in by_start.values():
        v.sort(key=lambda x: -len(x[0]))

    out: list[int] = []

    def go(at: int) -> bool:
        if at == len(text):
            return True
        for f, i in forced.items():
            if text.startswith(f, at):
                if i in used:
                    return False
                used.add(i)
                out.append(i)
                if go(at + len(f)):
                    return True
                used.discard(i)
                out.pop()
                return False
        for p, i in by_start.get(text[at], []):
            if i not in used and text.startswith(p, at):
                used.add(i)
                out.append(i)
                if go(at + len(p)):
                    return True
                used.discard(i)
                out.pop()
        return False

    assert go(0), f"no chain of distinct tokens spells {text!r}"
    return out


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory, templates_dir) -> tuple[Path, Path]:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tools-model")
    tok = byte_level_bpe(_corpus(), 1500, SPECIAL)
    # <tool_call> and </tool_call> special (decoding drops them: the server writes them back
    # into the text it parses), <think> and </think> plain added tokens as Qwen has them
    tok.add_special_tokens(MARKERS)
    tok.add_tokens([t for t in ADDED if t not in MARKERS] + FRAGMENTS)
    hf_dir = root / "hf"
    tpl = (templates_dir / "Qwen-Qwen3-0.6B.jinja").read_text("utf-8")
    vocab = tok.get_vocab_size()
    shape = FamilyShape("qwen3_moe", vocab=vocab, hidden=64, inter=32, layers=2, heads=4, kv_heads=2, head_dim=16,
                        experts=4, top_k=2, seed=7)
    model = build_model(shape)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            if layer.self_attn.o_proj.bias is not None:
                layer.self_attn.o_proj.bias.zero_()
            layer.mlp.experts.down_proj.zero_()
    save_checkpoint(model, hf_dir, tokenizer="none")
    tok.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": tpl}))
    hf = AutoTokenizer.from_pretrained(str(hf_dir))

    # the chains: prompt's last id -> ids spelling the text -> <|im_end|>
    specials = {hf.convert_tokens_to_ids(t) for t in SPECIAL + MARKERS}
    pieces = {i: hf.decode([i]) for i in range(vocab) if i not in specials}
    pieces = {i: p for i, p in pieces.items() if "\ufffd" not in p}
    forced = {t: hf.convert_tokens_to_ids(t) for t in ADDED + FRAGMENTS}
    for t in forced:  # the added tokens only where forced
        pieces.pop(forced[t], None)
    end = hf.convert_tokens_to_ids("<|im_end|>")
    nxt: dict[int, int] = {}
    used: set[int] = set()
    for kw, text in (({}, ANSWER), ({"enable_thinking": False}, PLAIN)):
        prompt = hf.apply_chat_template(USER, tools=TOOLS, tokenize=True, add_generation_prompt=True,
                                        return_dict=False, **kw)
        last = int(prompt[-1])
        assert last not in used and last not in nxt
        used.add(last)
        chain = _segment(text, pieces, used, forced)
        assert hf.decode(chain, skip_special_tokens=False) == text
        for a, b in zip([last, *chain], [*chain, end]):
            nxt[a] = b
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        head = model.lm_head.weight
        head.mul_(0.01)
        for b in set(nxt.values()):
            head[b] = 0
        for a, b in nxt.items():   # <|im_end|> follows both chains: the sum of two directions
            e = emb[a] / emb[a].pow(2).mean().sqrt()   # what the final RMSNorm gives (weight 1)
            head[b] += 4.0 * e / e.norm()
    model.save_pretrained(hf_dir)
    out = root / "qwen3-tools.colibri"
    colibri_lab.convert(hf_dir, out, dtype="f32", progress=False)
    # the same model with gpt-oss's template (rendered without tools) and with one of a family
    # the server does not render
    outs = [out]
    for name, file in (("gpt-oss", "openai-gpt-oss-120b.jinja"), ("other", "deepseek-ai-DeepSeek-V3.2.jinja")):
        cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
        cfg["chat_template"] = (templates_dir / file).read_text("utf-8")
        other = root / f"hf-{name}"
        shutil.copytree(hf_dir, other)
        (other / "tokenizer_config.json").write_text(json.dumps(cfg))
        outs.append(root / f"{name}.colibri")
        colibri_lab.convert(other, outs[-1], dtype="f32", progress=False)
    return tuple(outs)


@pytest.fixture(scope="module")
def templates_dir() -> Path:
    return templates_folder()


@pytest.fixture(scope="module")
def srv(server_path, tool_model, tmp_path_factory):
    s = Server(server_path, tool_model[0], tmp_path_factory.mktemp("logs") / "tools.log", "--max_seq_len", "1024")
    yield s
    assert s.stop() == 0, s.text()


def post(port: int, body: dict) -> tuple[int, dict]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = json.loads(r.read())
    c.close()
    return r.status, data


def test_tool_call_and_reasoning(srv):
    r = srv.client().chat.completions.create(model="qwen3-tools", messages=USER, tools=TOOLS, temperature=0,
                                             max_tokens=80)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", repr(ch.message.content)
    assert ch.message.content == CONTENT
    assert ch.message.model_extra.get("reasoning_content") == REASONING
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGS


def test_streamed_tool_call(srv):
    stream = srv.client().chat.completions.create(model="qwen3-tools", messages=USER, tools=TOOLS, temperature=0,
                                                  max_tokens=80, stream=True)
    reasoning, content, calls, finish, name_first = "", "", {}, None, True
    for chunk in stream:
        d = chunk.choices[0].delta
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.index not in calls:
                name_first &= bool(tc.id and tc.function and tc.function.name)
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            calls[tc.index]["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert reasoning == REASONING and content == CONTENT and finish == "tool_calls" and name_first
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == ARGS


def test_tool_choice_none_and_functions_not_offered_leave_content(srv):
    c = srv.client()
    for kw in ({"tools": TOOLS, "tool_choice": "none"}, {"tools": TOOLS[1:]}):
        ch = c.chat.completions.create(model="qwen3-tools", messages=USER, temperature=0, max_tokens=80,
                                       **kw).choices[0]
        assert ch.finish_reason == "stop" and not ch.message.tool_calls
        assert ch.message.content.startswith(CONTENT + "\n<tool_call>") and '"get_weather"' in ch.message.content
        assert ch.message.model_extra.get("reasoning_content") == REASONING


# bounded parameters: a model that does not want to stop still ends a string or a number
BOUNDED = [
    {"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": -99, "maximum": 99},
            "b": {"enum": [1, 2, 3]}}, "required": ["a", "b"]}}},
]


def _check_args(name: str, arguments: str):
    """The arguments parse and satisfy the function's parameters."""
    args = json.loads(arguments)
    params = next(t["function"]["parameters"] for t in BOUNDED if t["function"]["name"] == name)
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(args, params)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_required_call_is_a_valid_call(srv, choice):
    """tool_choice required / named: decoding is constrained to one call whose arguments
    satisfy the function's schema, whatever the weights want (seeded sampling here)."""
    c = srv.client()
    for seed in range(3):
        ch = c.chat.completions.create(model="qwen3-tools", messages=USER, tools=BOUNDED, tool_choice=choice,
                                       temperature=1.0, seed=seed, max_tokens=200).choices[0]
        assert ch.finish_reason == "tool_calls", ch
        (call,) = ch.message.tool_calls
        assert call.function.name in ("get_weather", "add")
        if isinstance(choice, dict):
            assert call.function.name == "add"
        _check_args(call.function.name, call.function.arguments)
    # streamed
    stream = c.chat.completions.create(model="qwen3-tools", messages=USER, tools=BOUNDED, tool_choice=choice,
                                       temperature=0, max_tokens=200, stream=True)
    name, args, finish = None, "", None
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or []:
            name = name or (tc.function.name if tc.function else None)
            args += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and name
    _check_args(name, args)


def test_thinking_switch_and_a_result_round_trip(srv):
    c = srv.client()
    ch = c.chat.completions.create(model="qwen3-tools", messages=USER, tools=TOOLS, temperature=0, max_tokens=40,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0]
    assert ch.message.content == PLAIN and ch.finish_reason == "stop"
    assert ch.message.model_extra.get("reasoning_content") is None
    # a conversation that sends a call and its result back renders (arguments as a JSON string)
    first = c.chat.completions.create(model="qwen3-tools", messages=USER, tools=TOOLS, temperature=0,
                                      max_tokens=80).choices[0].message
    msgs = USER + [{"role": "assistant", "content": first.content, "tool_calls": [
        {"id": t.id, "type": "function", "function": {"name": t.function.name, "arguments": t.function.arguments}}
        for t in first.tool_calls]}, {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "21 C"}]
    r = c.chat.completions.create(model="qwen3-tools", messages=msgs, tools=TOOLS, temperature=0, max_tokens=3)
    assert r.usage.prompt_tokens > 0


@pytest.mark.parametrize("body, param, words", [
    ({"tools": {"type": "function"}}, "tools", "must be an array"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools", "name"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "\"function\""),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools", "parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "auto"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "patternProperties": {}}}}],
      "tool_choice": "required"}, "tools", "patternProperties"),
    ({"messages": USER + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]}, "messages",
     "not valid JSON"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs", "true or false"),
])
def test_bad_tool_requests_are_400(srv, body, param, words):
    status, data = post(srv.port, {"messages": USER, **body})
    assert status == 400, data
    err = data["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and words in err["message"], err
    assert post(srv.port, {"messages": USER, "max_tokens": 1})[0] == 200   # still up


def test_gpt_oss_template(server_path, tool_model, tmp_path):
    s = Server(server_path, tool_model[1], tmp_path / "gpt-oss.log")
    try:
        status, data = post(s.port, {"messages": [{"role": "developer", "content": "Be brief."}] + USER,
                                     "reasoning_effort": "high", "max_tokens": 2})
        assert status == 200 and data["choices"][0]["message"]["role"] == "assistant", data
        assert "chat template gpt-oss" in s.text()
        status, data = post(s.port, {"messages": USER, "tools": TOOLS, "max_tokens": 2})
        assert status == 200, data
        nested = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {
            "type": "object", "properties": {"o": {"type": "object", "properties": {"x": {"type": "string"}}}}}}}]
        status, data = post(s.port, {"messages": USER, "tools": nested, "max_tokens": 2})
        assert status == 200, data   # rendered as the template's TypeScript type
        # an enum item that is a list: the template writes Python's repr of it, chat.c refuses it by name
        odd = [{"type": "function", "function": {"name": "pick", "description": "d", "parameters": {
            "type": "object", "properties": {"o": {"type": "string", "enum": ["a", ["b"]]}}}}}]
        status, data = post(s.port, {"messages": USER, "tools": odd, "max_tokens": 2})
        assert status == 400 and "function pick" in data["error"]["message"], data
        assert post(s.port, {"messages": USER, "max_tokens": 1})[0] == 200   # still up
    finally:
        assert s.stop() == 0


def test_unrendered_template_is_400_naming_the_formats(server_path, tool_model, tmp_path):
    s = Server(server_path, tool_model[2], tmp_path / "other.log")
    try:
        status, data = post(s.port, {"messages": USER, "max_tokens": 2})
        assert status == 400 and data["error"]["param"] == "messages"
        msg = data["error"]["message"]
        assert "not recognised" in msg and "qwen3" in msg and "deepseek-v3.1" in msg, msg
        assert "chat template" in s.text()   # the start-up log line
        assert post(s.port, {"messages": USER, "max_tokens": 1})[0] == 400   # still up
    finally:
        assert s.stop() == 0
