"""colibri_server's tool calling in the Mistral tekken forms (Mistral-Nemo, Mistral-Small-3.2,
Devstral), DeepSeek's (V3.1, R1) and Kimi-K2's, driven with the official `openai` client on
127.0.0.1.

One tiny random Qwen3-MoE, converted once per shipped template (llama.cpp's
models/templates) with a byte-level BPE tokenizer that has that family's special tokens. The
weights are random, so the checks are the ones that hold whatever they are: a required or
named tool_choice gives a call of an offered function whose arguments validate against its
schema (jsonschema), streamed and not; the call (Mistral-Small-3.2: with its 9-character
[CALL_ID], chosen by the server and written by the constraint; Kimi-K2: the functions.NAME:0 id
the model writes) and a `role: "tool"` result sent
back render, as many prompt tokens as transformers' apply_chat_template gives that
conversation.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

import colibri_lab  # noqa: E402
from colibri_lab.bench.models import FamilyShape, build_model, byte_level_bpe, save_checkpoint  # noqa: E402
from test_chat_template import _corpus  # noqa: E402
from test_chat_tools import DEEPSEEK_SPECIAL, KIMI_SPECIAL, TEKKEN_SPECIAL, kimi_lists_mutable, templates_folder  # noqa: E402
from test_server import Server, server_path  # noqa: E402,F401

FORMS = {  # name -> (template file, tokenizer, several functions in one constraint)
    "nemo": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "tekken", True),
    "small-3.2": ("Mistral-Small-3.2-24B-Instruct-2506.jinja", "tekken", False),
    "devstral": ("unsloth-mistral-Devstral-Small-2507.jinja", "tekken", False),
    "deepseek-v3.1": ("deepseek-ai-DeepSeek-V3.1.jinja", "deepseek", False),
    "deepseek-r1": ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "deepseek", False),
    "kimi-k2": ("moonshotai-Kimi-K2.jinja", "kimi", False),
    "kimi-k2-thinking": ("Kimi-K2-Thinking.jinja", "kimi", False),
}
TOOLS = [  # bounded: a model that does not want to stop still ends a string or a number
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "a + b", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                             "b": {"enum": [1, 2, 3]}}, "required": ["a", "b"]}}},
]
USER = [{"role": "user", "content": "Weather in Paris?"}]


def _check(name: str, arguments: str):
    params = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
    jsonschema.validate(json.loads(arguments), params)


@pytest.fixture(scope="module")
def family_files(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (the .colibri file, the Hugging Face folder with its tokenizer and template)"""
    templates = templates_folder()
    root = tmp_path_factory.mktemp("tool-forms")
    toks = {}
    for kind, special, cfg in (
            ("tekken", TEKKEN_SPECIAL, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
            ("deepseek", DEEPSEEK_SPECIAL, {"bos_token": DEEPSEEK_SPECIAL[0], "eos_token": DEEPSEEK_SPECIAL[1]}),
            ("kimi", KIMI_SPECIAL, {"bos_token": "[BOS]", "eos_token": "[EOS]"})):
        tok = byte_level_bpe(_corpus(), 600, special)
        if kind in ("deepseek", "kimi"):
            tok.add_tokens(["<think>", "</think>"])
        toks[kind] = (tok, cfg)
    vocab = max(t.get_vocab_size() for t, _ in toks.values())
    shape = FamilyShape("qwen3_moe", vocab=vocab, hidden=32, inter=16, layers=1, heads=2, kv_heads=1, head_dim=16,
                        experts=4, top_k=2, max_pos=4096, seed=11)
    model = build_model(shape)
    out = {}
    for name, (file, kind, _) in FORMS.items():
        d = root / name
        save_checkpoint(model, d, tokenizer="none")
        tok, cfg = toks[kind]
        tok.save(str(d / "tokenizer.json"))
        tpl = (templates / file).read_text("utf-8")
        (d / "tokenizer_config.json").write_text(json.dumps({
            **cfg, "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": tpl.removesuffix("\n")}))
        out[name] = (root / f"{name}.colibri", d)
        colibri_lab.convert(d, out[name][0], dtype="f32", progress=False)
    return out


@pytest.fixture(scope="module", params=list(FORMS))
def form(request, server_path, family_files, tmp_path_factory):
    name = request.param
    path, hf_dir = family_files[name]
    s = Server(server_path, path, tmp_path_factory.mktemp("logs") / f"{name}.log", "--max_seq_len", "4096")
    yield name, s, hf_dir
    assert s.stop() == 0, s.text()


def _choices(name: str):
    """(tools, tool_choice) pairs: a named function, and `required` (of one function where the
    syntax writes the name outside the JSON, of both where the name is in the call object)"""
    several = FORMS[name][2]
    return [(TOOLS, {"type": "function", "function": {"name": "add"}}),
            (TOOLS if several else TOOLS[:1], "required")]


def _stream(client, **kw):
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for tc in chunk.choices[0].delta.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            c["id"] = c["id"] or tc.id
            if tc.function:
                c["name"] = c["name"] or tc.function.name
                c["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return list(calls.values()), finish


def test_required_and_named_calls_are_valid(form):
    name, s, _ = form
    c = s.client()
    for tools, choice in _choices(name):
        offered = [t["function"]["name"] for t in tools]
        for seed in range(2):
            ch = c.chat.completions.create(model=name, messages=USER, tools=tools, tool_choice=choice,
                                           temperature=1.0, seed=seed, max_tokens=160).choices[0]
            assert ch.finish_reason == "tool_calls", (name, ch)
            (call,) = ch.message.tool_calls
            assert call.function.name in offered and call.id
            if isinstance(choice, dict):
                assert call.function.name == "add"
            _check(call.function.name, call.function.arguments)
            if name in ("nemo", "small-3.2"):   # the templates' rule for ids
                assert re.fullmatch(r"[a-zA-Z0-9]{9}", call.id), call.id
            if name.startswith("kimi"):   # the id the model wrote, as the template numbers calls
                assert call.id == f"functions.{call.function.name}:0", call.id
        calls, finish = _stream(c, model=name, messages=USER, tools=tools, tool_choice=choice, temperature=1.0,
                                seed=5, max_tokens=160)
        assert finish == "tool_calls" and len(calls) == 1 and calls[0]["name"] in offered and calls[0]["id"]
        _check(calls[0]["name"], calls[0]["arguments"])


def test_call_and_result_render_back(form):
    """The call the server returned and a tool result, sent back: the prompt is what
    transformers renders for that conversation (its token count)."""
    from transformers import AutoTokenizer

    name, s, hf_dir = form
    c = s.client()
    tools, choice = _choices(name)[0]
    msg = c.chat.completions.create(model=name, messages=USER, tools=tools, tool_choice=choice, temperature=0,
                                    max_tokens=160).choices[0].message
    (call,) = msg.tool_calls
    convo = USER + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sum": 3}'}]
    r = c.chat.completions.create(model=name, messages=convo, tools=tools, temperature=0, max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")
    hf = AutoTokenizer.from_pretrained(str(hf_dir))
    ref = [dict(m) for m in convo]
    ref[1] = {**ref[1], "tool_calls": [{**ref[1]["tool_calls"][0], "function": {
        "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]}
    with kimi_lists_mutable(hf.chat_template):
        want = hf.apply_chat_template(ref, tools=tools, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert r.usage.prompt_tokens == len(want), (name, r.usage.prompt_tokens, len(want))
    if name == "small-3.2":   # the id goes back in [TOOL_RESULTS]id[TOOL_CONTENT]
        assert f"[TOOL_RESULTS]{call.id}[TOOL_CONTENT]" in hf.decode(want)
    if name.startswith("kimi"):   # the id the model wrote goes back in the result's heading
        assert f"## Return of {call.id}" in hf.decode(want)
        # the next required call is numbered as the template numbers it: the first of its
        # message (the first release), or after the conversation's calls (the later ones)
        nxt = c.chat.completions.create(model=name, messages=convo, tools=tools, tool_choice=choice, temperature=0,
                                        max_tokens=160).choices[0].message.tool_calls[0]
        assert nxt.id == f"functions.add:{0 if name == 'kimi-k2' else 1}", nxt.id
