"""Chat formats with tools (native/tools/colibri_server/chat.c) and the output parser
(tools.c) against the templates the checkpoints ship and transformers.

The template texts are the real ones: llama.cpp's models/templates/*.jinja in the
llama-cpp-python sdist (downloaded with pip and cached as tests/test_gguf_import.py does).
Each is recognised by name; with tools, tool calls, tool results, reasoning and the thinking
switch, the ids of cs_chat_tokenize_ex equal transformers' apply_chat_template on the same
template and a tokenizer that has the family's special tokens. The parser reads back the tool
calls of what transformers renders for an assistant turn; the constraint for a required call
(prefix + call object + suffix) is that same text. Templates not rendered are refused with
a message naming the known formats.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from colibri_lab.bench.common import default_cache_dir  # noqa: E402
from colibri_lab.bench.llama_cpp import _find_llama_src  # noqa: E402
from colibri_lab.bench.models import byte_level_bpe  # noqa: E402
from test_chat_template import _bpe_folder, _corpus, answer, driver, hx, qwen_bpe, qwen_tok, run  # noqa: E402,F401

SHIPPED = {  # file -> the name chat.c gives it
    "Qwen-Qwen3-0.6B.jinja": "qwen3-initial",
    "Qwen-Qwen2.5-7B-Instruct.jinja": "qwen2.5",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": "mistral-v3-tekken",
    "deepseek-ai-DeepSeek-V3.1.jinja": "deepseek-v3.1",
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": "mistral-small-3.2",
    "unsloth-mistral-Devstral-Small-2507.jinja": "devstral",
    "openai-gpt-oss-120b.jinja": "gpt-oss",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja": "deepseek-r1",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": "deepseek-r1-distill-qwen",
    "moonshotai-Kimi-K2.jinja": "kimi-k2",
    "Kimi-K2-Instruct.jinja": "kimi-k2-instruct",
    "Kimi-K2-Thinking.jinja": "kimi-k2-thinking",
}
# other families, and DeepSeek's DSML tool-call format (V3.2, V4), which chat.c does not render
NOT_RENDERED = ["deepseek-ai-DeepSeek-V3.2.jinja", "deepseek-ai-DeepSeek-V4.jinja",
                "deepseek-ai-DeepSeek-V4-Flash-0731.jinja"]


def templates_folder() -> Path:
    """llama.cpp's models/templates (the sdist is downloaded and unpacked when missing)."""
    root = default_cache_dir() / "llama.cpp"
    root.mkdir(parents=True, exist_ok=True)
    src = _find_llama_src(root)
    if src is None:
        sdists = sorted(root.glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                                "--no-build-isolation", "llama-cpp-python", "-d", str(root)],
                               capture_output=True, text=True)
            sdists = sorted(root.glob("llama_cpp_python-*.tar.gz"))
            if r.returncode != 0 or not sdists:
                pytest.skip("could not download the llama-cpp-python sdist (llama.cpp's chat templates)")
        with tarfile.open(sdists[-1]) as tf:
            tf.extractall(root)
        src = _find_llama_src(root)
    d = src / "models" / "templates"
    assert d.is_dir(), d
    return d


@pytest.fixture(scope="module")
def templates() -> Path:
    return templates_folder()


def template(templates: Path, name: str) -> str:
    s = (templates / name).read_text("utf-8")
    return s[:-1] if s.endswith("\n") else s  # as transformers reads a chat_template.jinja


# ---------------------------------------------------------------------------------------
# Tokenizers with each family's special tokens.

TEKKEN_SPECIAL = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                  "[CALL_ID]", "[ARGS]", "[TOOL_CONTENT]"]
DEEPSEEK_SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                    "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
                    "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"]


@pytest.fixture(scope="module")
def tekken_tok(tmp_path_factory):
    tok = byte_level_bpe(_corpus(), 1500, TEKKEN_SPECIAL)
    return _bpe_folder(tmp_path_factory.mktemp("tekken-tok"), tok,
                       {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                        "tokenizer_class": "PreTrainedTokenizerFast"})


KIMI_SPECIAL = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
                "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>"]


@pytest.fixture(scope="module")
def kimi_tok(tmp_path_factory):
    tok = byte_level_bpe(_corpus(), 1500, KIMI_SPECIAL)
    tok.add_tokens(["<think>", "</think>"])
    return _bpe_folder(tmp_path_factory.mktemp("kimi-tok"), tok,
                       {"bos_token": "[BOS]", "eos_token": "[EOS]", "tokenizer_class": "PreTrainedTokenizerFast"})


@pytest.fixture(scope="module")
def deepseek_tok(tmp_path_factory):
    tok = byte_level_bpe(_corpus(), 1500, DEEPSEEK_SPECIAL)
    tok.add_tokens(["<think>", "</think>"])
    return _bpe_folder(tmp_path_factory.mktemp("deepseek-tok"), tok,
                       {"bos_token": DEEPSEEK_SPECIAL[0], "eos_token": DEEPSEEK_SPECIAL[1],
                        "tokenizer_class": "PreTrainedTokenizerFast"})


# ---------------------------------------------------------------------------------------
# Tools and conversations (arguments as objects: the server parses the client's strings).

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city, in °C \"now\"",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. Zürich"},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two numbers",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                         "b": {"type": "number", "default": 0.5}},
                       "required": ["a", "b"]}}},
]
SYS = {"role": "system", "content": "You are a terse assistant."}
U1 = {"role": "user", "content": "What is the weather in Paris?"}
U2 = {"role": "user", "content": "And add 2 and 3.5 please."}


def call(i, name, args):
    return {"id": f"call{i:05d}", "type": "function", "function": {"name": name, "arguments": args}}


CALL1 = call(1, "get_weather", {"city": "Paris", "days": 2})
CALL2 = call(2, "add", {"a": 2, "b": 3.5})
A_CALL = {"role": "assistant", "content": "", "tool_calls": [CALL1]}
A_TEXT_CALL = {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL1]}
A_TWO = {"role": "assistant", "content": "", "tool_calls": [CALL1, CALL2]}
R1 = {"role": "tool", "tool_call_id": "call00001", "content": '{"temp": 21, "sky": "clear"}'}
R2 = {"role": "tool", "tool_call_id": "call00002", "content": "5.5"}
A_END = {"role": "assistant", "content": "It is 21 °C and clear; 2 + 3.5 = 5.5."}

CONVS = {  # label -> (messages, with tools)
    "tools": ([U1], True),
    "system and tools": ([SYS, U1], True),
    "call": ([U1, A_CALL], True),
    "call and result": ([SYS, U1, A_CALL, R1], True),
    "text and call": ([U1, A_TEXT_CALL, R1], True),
    "parallel calls": ([U1, A_TWO, R1, R2, A_END, U2], True),
    "history without tools": ([U1, A_CALL, R1, A_END, U2], False),
    "plain": ([SYS, U1, A_END, U2], False),
}
QWEN3_EXTRA = {
    "reasoning_content": ([U1, {"role": "assistant", "content": "", "reasoning_content": "Paris: call the tool.",
                                "tool_calls": [CALL1]}, R1], True),
    "think in content": ([U1, {"role": "assistant", "content": "<think>\nweather\n</think>\n\nChecking.",
                               "tool_calls": [CALL1]}, R1], True),
}

KIMI_EXTRA = {
    "result without an id": ([U1, A_CALL, {"role": "tool", "content": "21"}], True),
    "calls without content": ([SYS, U1, {"role": "assistant", "content": None, "tool_calls": [CALL2, CALL1]}, R2, R1],
                              True),
    # the later templates: calls numbered across turns, results matched in order (one too many
    # here), roles named by `name`, arguments given as a string, reasoning before answers
    "two rounds": ([U1, A_TWO, R1, R2, {"role": "assistant", "content": "", "reasoning_content": "more",
                                         "tool_calls": [CALL1]}, R1, {"role": "tool", "name": "add", "content": "x"}],
                   True),
    "names": ([{"role": "system", "name": "rules", "content": "Be brief."}, {"role": "user", "name": "bob", "content": "hi"},
               {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"}, U2], False),
    "string arguments": ([U1, {"role": "assistant", "content": "", "tool_calls": [call(3, "add", '{"a": 1, "b": 2}')]},
                          {"role": "tool", "tool_call_id": "call00003", "content": "3"}], True),
    "reasoning later": ([U1, {"role": "assistant", "content": "First.", "reasoning_content": "a"}, U2,
                         {"role": "assistant", "content": "Second.", "reasoning_content": "b"}, U1,
                         {"role": "assistant", "content": "Third.", "reasoning_content": None}, U2], False),
}


def chatj(conv, tools, **kw) -> str:
    o = {"messages": conv}
    if tools:
        o["tools"] = TOOLS
    o.update(kw)
    return f"chatj {hx(json.dumps(o))}"


@contextlib.contextmanager
def kimi_lists_mutable(tpl: str):
    """The later Kimi-K2 templates number calls and match results with list.append, which
    transformers' sandboxed Jinja refuses (llama.cpp's Jinja runs them): their reference is
    transformers' rendering with that one ban lifted (a plain SandboxedEnvironment's rules)."""
    if "tool_response_queue.ids.append" not in tpl:
        yield
        return
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment

    orig = ImmutableSandboxedEnvironment.is_safe_attribute
    ImmutableSandboxedEnvironment.is_safe_attribute = SandboxedEnvironment.is_safe_attribute
    try:
        yield
    finally:
        ImmutableSandboxedEnvironment.is_safe_attribute = orig


def theirs(hf, tpl, conv, tools, **kw):
    try:
        with kimi_lists_mutable(tpl):
            ids = hf.apply_chat_template(conv, tools=TOOLS if tools else None, chat_template=tpl, tokenize=True,
                                         add_generation_prompt=True, return_dict=False, **kw)
    except Exception as e:  # raise_exception(...) in the template, or a Jinja error
        return e
    return [int(i) for i in ids]


FAMILIES = {  # file -> tokenizer fixture, extra conversations, template kwargs to try
    "Qwen-Qwen2.5-7B-Instruct.jinja": ("qwen_tok", {}, [{}]),
    "Qwen-Qwen3-0.6B.jinja": ("qwen_tok", QWEN3_EXTRA, [{}, {"enable_thinking": False},
                                                        {"enable_thinking": True}]),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("tekken_tok", {}, [{}]),
    "deepseek-ai-DeepSeek-V3.1.jinja": ("deepseek_tok", {}, [{}, {"enable_thinking": True}]),
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": ("tekken_tok", {}, [{}]),
    "unsloth-mistral-Devstral-Small-2507.jinja": ("tekken_tok", {}, [{}]),
    "moonshotai-Kimi-K2.jinja": ("kimi_tok", KIMI_EXTRA, [{}]),
    "Kimi-K2-Instruct.jinja": ("kimi_tok", KIMI_EXTRA, [{}]),
    "Kimi-K2-Thinking.jinja": ("kimi_tok", KIMI_EXTRA, [{}]),
}
DROPS_CONTENT = ("Nemo", "Small-3.2")   # templates that drop an assistant's text beside its calls
WRITES_IDS = ("Nemo", "Small-3.2")      # ... that write the call ids into the output
NAME_OUTSIDE = ("deepseek", "Small-3.2", "Devstral", "Kimi")   # ... whose calls name the function outside the JSON


def written_id(fname: str, k: int, c: dict):
    """The id the parser gives the k-th call of a turn the template rendered."""
    if "Kimi" in fname:   # the template numbers a message's calls: functions.NAME:k
        return f"functions.{c['function']['name']}:{k}"
    return c["id"] if any(w in fname for w in WRITES_IDS) else None


def test_shipped_templates_are_recognised(driver, tmp_path, templates):
    cmds = []
    for f in list(SHIPPED) + NOT_RENDERED:
        cmds += [f"tpl {hx(template(templates, f))}", "name"]
    names = [x.split(" ", 1)[1] for x in run(driver, tmp_path, cmds)]
    assert names == list(SHIPPED.values()) + ["-"] * len(NOT_RENDERED)


def test_templates_not_rendered_are_refused_by_name(driver, tmp_path, templates, qwen_tok):
    _, section = qwen_tok
    cmds = [f"tok {hx(str(section))}"]
    for f in NOT_RENDERED:
        cmds += [f"tpl {hx(template(templates, f))}", chatj([U1], True)]
    out = run(driver, tmp_path, cmds)
    assert out[0] == "ok"
    for msg in out[1:]:
        err = answer(msg)
        assert isinstance(err, str) and "not recognised" in err
        for known in ("qwen3", "qwen2.5", "mistral-v3-tekken", "mistral-small-3.2", "devstral", "deepseek-v3.1",
                      "gpt-oss", "chatml", "tulu3"):
            assert known in err, err


@pytest.mark.parametrize("fname", list(FAMILIES))
def test_tools_render_as_transformers(driver, tmp_path, templates, fname, request):
    tok_fixture, extra, kwargs = FAMILIES[fname]
    hf, section = request.getfixturevalue(tok_fixture)
    tpl = template(templates, fname)
    convs = {**CONVS, **extra}
    cmds = [f"tok {hx(str(section))}", f"tpl {hx(tpl)}"]
    cases = []
    for kw in kwargs:
        for label, (conv, tools) in convs.items():
            cmds.append(chatj(conv, tools, **kw))
            cases.append((label, kw, conv, tools))
    out = run(driver, tmp_path, cmds)
    assert out[0] == "ok", answer(out[0])
    bad, rendered = [], 0
    for (label, kw, conv, tools), line in zip(cases, out[1:]):
        got, want = answer(line), theirs(hf, tpl, conv, tools, **kw)
        if isinstance(want, Exception):
            ok = isinstance(got, str)
        else:
            ok = got == want
            rendered += 1
        if not ok:
            bad.append(f"{label} {kw}: chat.c {got!r}\n    transformers {want!r}\n    text "
                       f"{hf.decode(want) if isinstance(want, list) else ''!r}")
    assert not bad, "\n".join(bad)
    assert rendered >= len(cases) - 1   # the templates render these (Nemo: one raises)


# ---------------------------------------------------------------------------------------
# The parser reads back what the templates render for tool calls.


def _assistant_text(hf, tpl, msgs, **kw) -> str:
    """The text of the last assistant turn: render with and without it."""
    with kimi_lists_mutable(tpl):
        full = hf.apply_chat_template(msgs, tools=TOOLS, chat_template=tpl, tokenize=False, **kw)
        head = hf.apply_chat_template(msgs[:-1], tools=TOOLS, chat_template=tpl, tokenize=False,
                                      add_generation_prompt=True, **kw)
    assert full.startswith(head), (full, head)
    return full[len(head):]


END = {"qwen_tok": "<|im_end|>\n", "tekken_tok": "</s>", "deepseek_tok": "<｜end▁of▁sentence｜>", "kimi_tok": "<|im_end|>"}


def parse(driver, tmp_path, tpl, reqs):
    out = run(driver, tmp_path, [f"tpl {hx(tpl)}"] + [f"parse {hx(json.dumps(r))}" for r in reqs])
    return [json.loads(bytes.fromhex(x.split(" ", 1)[1])) for x in out]


@pytest.mark.parametrize("fname", list(FAMILIES))
def test_parser_reads_the_rendered_calls(driver, tmp_path, templates, fname, request):
    tok_fixture = FAMILIES[fname][0]
    hf, _ = request.getfixturevalue(tok_fixture)
    tpl = template(templates, fname)
    texts = []
    for msg in (A_CALL, A_TWO, A_TEXT_CALL):
        t = _assistant_text(hf, tpl, [U1, msg])
        if "deepseek" in fname:  # the generation prompt <think></think> is the prompt's
            assert t.startswith("<think></think>") or not t.startswith("<think>")
        assert t.endswith(END[tok_fixture]), t
        texts.append((msg, t[:-len(END[tok_fixture])]))
    reqs = [{"text": t, "final": True, "names": ["get_weather", "add"]} for _, t in texts]
    reqs += [{"text": t, "final": True, "names": ["add"]} for _, t in texts[:1]]  # not offered
    reqs += [{"text": t, "final": True, "tools": False} for _, t in texts[:1]]  # tool_choice none
    reqs += [{"text": t[:k], "final": False} for _, t in texts[2:] for k in range(len(t) + 1)]
    got = parse(driver, tmp_path, tpl, reqs)
    for (msg, text), g in zip(texts, got):
        assert g["rc"] == 0
        want = [[c["function"]["name"], json.dumps(c["function"]["arguments"], ensure_ascii=False),
                 written_id(fname, k, c)] for k, c in enumerate(msg["tool_calls"])]
        assert g["calls"] == want, (text, g)
        dropped = any(w in fname for w in DROPS_CONTENT)
        assert g["content"] == (None if dropped else msg["content"] or None), (text, g)
    after_think = texts[0][1].split("</think>")[-1].lstrip()
    for g in got[3:5]:  # a function that was not offered, or tools off: all of it is content
        assert g["calls"] == [] and g["content"] == after_think
    # a stream: content only grows, never shows the block, and ends as the final content
    prev = ""
    for g in got[5:]:
        c = g["content"] or ""
        assert c.startswith(prev) and "call" not in c.lower().replace("check", ""), (prev, c)
        prev = c
    assert prev == ("" if any(w in fname for w in DROPS_CONTENT) else "Let me check.")


QWEN3_OUT = "<think>\nThe user wants Paris.\n\n</think>\n\nLet me check.\n<tool_call>\n" \
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_reasoning_and_streaming_splits(driver, tmp_path, templates):
    tpl = template(templates, "Qwen-Qwen3-0.6B.jinja")
    reqs = [{"text": QWEN3_OUT, "final": True, "names": ["get_weather"]}]
    reqs += [{"text": QWEN3_OUT[:k], "final": False} for k in range(len(QWEN3_OUT) + 1)]
    bad_json = QWEN3_OUT.replace('"Paris"}}', '"Paris"}')
    reqs += [{"text": bad_json, "final": True}, {"text": "no thinking here", "final": True},
             {"text": "<think>cut off", "final": True}]
    got = parse(driver, tmp_path, tpl, reqs)
    g = got[0]
    assert g["reasoning"] == "The user wants Paris." and g["content"] == "Let me check."
    assert g["calls"] == [["get_weather", '{"city": "Paris"}', None]]
    pr, pc = "", ""
    for s in got[1:len(QWEN3_OUT) + 2]:
        r, c = s["reasoning"] or "", s["content"] or ""
        assert r.startswith(pr) and c.startswith(pc) and "<" not in r + c, (s, pr, pc)
        pr, pc = r, c
    assert pr == g["reasoning"] and pc == g["content"]
    bj, plain, cut = got[len(QWEN3_OUT) + 2:]
    assert bj["calls"] == [] and bj["content"].startswith("Let me check.\n<tool_call>")  # stays content
    assert plain["content"] == "no thinking here" and plain["reasoning"] is None
    assert cut["reasoning"] == "cut off" and cut["content"] is None


def test_deepseek_thinking_starts_in_the_prompt(driver, tmp_path, templates):
    tpl = template(templates, "deepseek-ai-DeepSeek-V3.1.jinja")
    text = "weigh it</think>Sunny.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\": 1, \"b\": 2}" \
           "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    g, off = parse(driver, tmp_path, tpl, [{"text": text, "final": True, "thinking": True},
                                           {"text": "plain answer", "final": True}])
    assert g["reasoning"] == "weigh it" and g["content"] == "Sunny."
    assert g["calls"] == [["add", '{"a": 1, "b": 2}', None]]
    assert off["reasoning"] is None and off["content"] == "plain answer"


@pytest.mark.parametrize("fname", list(FAMILIES))
def test_required_call_constraint_is_the_rendered_call(driver, tmp_path, templates, fname, request):
    """prefix + a call object that satisfies the schema + suffix is what the template renders
    for that call (for DeepSeek the schema is the arguments': the name is in the prefix)."""
    hf, _ = request.getfixturevalue(FAMILIES[fname][0])
    tpl = template(templates, fname)
    one = call(1, "add", {"a": 2, "b": 3.5})
    text = _assistant_text(hf, tpl, [U1, {"role": "assistant", "content": "", "tool_calls": [one]}])
    out = run(driver, tmp_path, [f"tpl {hx(tpl)}",
                                 f"constraint {hx(json.dumps({'tools': TOOLS, 'only': 'add', 'call_id': 'call00001'}))}",
                                 f"constraint {hx(json.dumps({'tools': TOOLS, 'call_id': 'call00001'}))}"])
    named = json.loads(bytes.fromhex(out[0].split(" ", 1)[1]))
    schema = json.loads(named["schema"])
    if any(w in fname for w in NAME_OUTSIDE):
        obj = one["function"]["arguments"]
        assert schema == TOOLS[1]["function"]["parameters"]
        assert out[1].startswith("err ")   # several functions: the name cannot be chosen by a schema
    else:
        obj = {"name": "add", "arguments": one["function"]["arguments"]}
        assert schema["properties"]["name"] == {"const": "add"}
        assert schema["properties"]["arguments"] == TOOLS[1]["function"]["parameters"]
        anyof = json.loads(json.loads(bytes.fromhex(out[1].split(" ", 1)[1]))["schema"])["anyOf"]
        assert [a["properties"]["name"]["const"] for a in anyof] == ["get_weather", "add"]
    body = json.dumps(obj, ensure_ascii=False)
    if "Nemo" in fname:   # the template adds the id inside the object
        body = body[:-1] + ', "id": "call00001"}'
    if "Small-3.2" in fname:   # the call id, the server's to choose (9 of [a-zA-Z0-9]), is written by the prefix
        assert named["prefix"] == "[TOOL_CALLS]add[CALL_ID]call00001[ARGS]"
        bad = run(driver, tmp_path, [f"tpl {hx(tpl)}",
                                     f"constraint {hx(json.dumps({'tools': TOOLS, 'only': 'add', 'call_id': 'call_0001'}))}"])
        assert bad[0].startswith("err ") and "9 letters and digits" in answer(bad[0])
    assert named["prefix"] + body + named["suffix"] in text, (named, text)


# ---------------------------------------------------------------------------------------
# gpt-oss (harmony), without tools.

HARMONY_SPECIAL = ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                   "<|constrain|>", "<|return|>", "<|call|>"]


@pytest.fixture(scope="module")
def harmony_tok(tmp_path_factory):
    tok = byte_level_bpe(_corpus(), 1500, HARMONY_SPECIAL)
    return _bpe_folder(tmp_path_factory.mktemp("harmony-tok"), tok,
                       {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
                        "tokenizer_class": "PreTrainedTokenizerFast"})


DEV = {"role": "developer", "content": "Answer in French."}


def test_harmony_renders_as_transformers(driver, tmp_path, templates, harmony_tok):
    """gpt-oss with and without tools: the TypeScript namespace, calls on the commentary
    channel (the first of a message; its text as analysis unless a final answer follows),
    results from functions.NAME, developer instructions, reasoning_effort."""
    hf, section = harmony_tok
    tpl = template(templates, "openai-gpt-oss-120b.jinja")
    convs = {**CONVS,
             "developer": ([DEV, U1, A_END, U2], False),
             "developer and tools": ([DEV, U1, A_TEXT_CALL, R1], True),
             "empty system": ([{"role": "system", "content": ""}, U1], False),
             "tool without a call": ([U1, {"role": "tool", "content": "x"}], False),
             "channel tags": ([U1, {"role": "assistant", "content": "<|channel|>final<|message|>x"}], False)}
    cmds = [f"tok {hx(str(section))}", f"tpl {hx(tpl)}"]
    cases = []
    for kw in ({}, {"reasoning_effort": "high"}):
        for label, (conv, tools) in convs.items():
            cmds.append(chatj(conv, tools, **kw))
            cases.append((label, kw, conv, tools))
    # an enum item that is a list: Jinja's join writes Python's repr of it, which chat.c does not
    odd = [{"type": "function", "function": {"name": "pick", "description": "d", "parameters": {
        "type": "object", "properties": {"o": {"type": "string", "enum": ["a", ["b", 1]]}}}}}]
    cmds.append(f"chatj {hx(json.dumps({'messages': [U1], 'tools': odd}))}")
    out = run(driver, tmp_path, cmds)
    assert out[0] == "ok"
    rendered, bad = 0, []
    for (label, kw, conv, tools), line in zip(cases, out[1:]):
        got, want = answer(line), theirs(hf, tpl, conv, tools, **kw)
        if isinstance(want, Exception):
            ok = isinstance(got, str)
        else:
            ok = got == want
            rendered += 1
        if not ok:
            bad.append(f"{label} {kw}: chat.c {hf.decode(got) if isinstance(got, list) else got!r}\n"
                       f"    transformers {hf.decode(want) if isinstance(want, list) else want!r}")
    assert not bad, "\n".join(bad)
    assert rendered >= 2 * (len(convs) - 2)
    err = answer(out[-1])
    assert isinstance(err, str) and "function pick" in err and "enum" in err, err
    assert isinstance(theirs(hf, tpl, [U1], False), list)


def _fn(name, params, desc="A function."):
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": params}}


# parameter schemas as agents send them: nested objects, arrays of objects, oneOf / anyOf,
# enums, descriptions, defaults, nullable, type lists, $ref
HARMONY_TOOLS = [
    _fn("create_event", {"type": "object", "properties": {
        "title": {"type": "string", "description": "The event's title"},
        "when": {"type": "object", "description": "Start and end", "properties": {
            "start": {"type": "string", "description": "ISO 8601"}, "end": {"type": "string"},
            "all_day": {"type": "boolean", "default": False}}, "required": ["start"]},
        "attendees": {"type": "array", "items": {"type": "object", "properties": {
            "email": {"type": "string"}, "optional": {"type": "boolean"}}, "required": ["email"]}},
        "tags": {"type": "array", "items": {"type": "string"}, "nullable": True},
        "priority": {"type": "string", "enum": ["low", "normal", "high"], "default": "normal"},
        "reminder": {"oneOf": [{"type": "integer", "description": "minutes before"},
                               {"type": "string", "enum": ["none", "default"], "default": "default"}]},
        "location": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "repeat": {"oneOf": [{"type": "object", "properties": {"every": {"type": "integer"}}},
                             {"type": "object", "properties": {"cron": {"type": "string"}}}], "default": "none"},
        "ratio": {"type": "number", "default": 0.25, "minimum": 0},
        "grid": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
        "kind": {"type": ["string", "null"]},
        "meta": {"type": "object", "additionalProperties": {"type": "string"}},
        "ref": {"$ref": "#/$defs/x"},
        "levels": {"type": "integer", "enum": [1, 2, 3]},
        "note": {"type": "string", "nullable": True, "description": "Free text"},
    }, "required": ["title", "when"]}),
    _fn("no_params", {"type": "object", "properties": {}}),
    _fn("deep", {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
        "type": "object", "properties": {"c": {"type": "array", "items": {"type": "object", "properties": {
            "d": {"type": "string", "enum": ["x", "y"]}}}}}, "required": ["c"]}}}}}),
    _fn("short_objects", {"type": "object", "properties": {
        "pairs": {"type": "array", "items": {"type": ["object", "object"]}},
        "ids": {"type": "array", "items": {"oneOf": [{"type": "string"}, {"type": "integer"}]}},
        "any_items": {"type": "array", "items": {}},
        "untyped": {"description": "anything"}}}),
]


def test_harmony_tool_types_render_as_transformers(driver, tmp_path, templates, harmony_tok):
    """The TypeScript namespace of gpt-oss for nested parameter schemas, ids equal."""
    hf, section = harmony_tok
    tpl = template(templates, "openai-gpt-oss-120b.jinja")
    cases = [[t] for t in HARMONY_TOOLS] + [HARMONY_TOOLS]
    cmds = [f"tok {hx(str(section))}", f"tpl {hx(tpl)}"]
    cmds += [f"chatj {hx(json.dumps({'messages': [U1], 'tools': tools}))}" for tools in cases]
    out = run(driver, tmp_path, cmds)
    assert out[0] == "ok"
    for tools, line in zip(cases, out[1:]):
        want = hf.apply_chat_template([U1], tools=tools, chat_template=tpl, tokenize=True,
                                      add_generation_prompt=True, return_dict=False)
        got = answer(line)
        assert got == want, (tools[0]["function"]["name"], got if isinstance(got, str) else hf.decode(got),
                             hf.decode(want))
    text = hf.decode(answer(out[-1]))
    assert "when: {\nstart: \n                string, end?: \n                string" in text


def test_harmony_call_parse_and_constraint(driver, tmp_path, templates, harmony_tok):
    hf, _ = harmony_tok
    tpl = template(templates, "openai-gpt-oss-120b.jinja")
    one = call(1, "add", {"a": 2, "b": 3.5})
    text = _assistant_text(hf, tpl, [U1, {"role": "assistant", "content": "", "tool_calls": [one]}])
    assert text.endswith("<|call|>")
    analysed = "<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant" + text[:-len("<|call|>")]
    got = parse(driver, tmp_path, tpl, [{"text": text[:-len("<|call|>")], "final": True},
                                        {"text": analysed, "final": True},
                                        {"text": analysed, "final": True, "names": ["get_weather"]}])
    assert got[0]["calls"] == [["add", '{"a": 2, "b": 3.5}', None]] and got[0]["content"] is None
    assert got[1]["calls"] == got[0]["calls"] and got[1]["reasoning"] == "Add them." and got[1]["content"] is None
    assert got[2]["calls"] == []   # not offered: content
    out = run(driver, tmp_path, [f"tpl {hx(tpl)}", f"constraint {hx(json.dumps({'tools': TOOLS, 'only': 'add'}))}"])
    named = json.loads(bytes.fromhex(out[0].split(" ", 1)[1]))
    assert named["prefix"] + json.dumps(one["function"]["arguments"]) + named["suffix"] == text


def test_harmony_channels_split(driver, tmp_path, templates):
    tpl = template(templates, "openai-gpt-oss-120b.jinja")
    text = "<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>final<|message|>Bonjour."
    reqs = [{"text": text, "final": True}] + [{"text": text[:k], "final": False} for k in range(len(text) + 1)]
    reqs.append({"text": "<|channel|>final<|message|>Direct.", "final": True})
    got = parse(driver, tmp_path, tpl, reqs)
    assert got[0]["reasoning"] == "The user greets." and got[0]["content"] == "Bonjour."
    pr, pc = "", ""
    for g in got[1:-1]:
        r, c = g["reasoning"] or "", g["content"] or ""
        assert r.startswith(pr) and c.startswith(pc) and "<|" not in r + c, g
        pr, pc = r, c
    assert (pr, pc) == ("The user greets.", "Bonjour.")
    assert got[-1]["reasoning"] is None and got[-1]["content"] == "Direct."


# ---------------------------------------------------------------------------------------
# DeepSeek-V2 and DeepSeek-R1.


def llama_cpp_test_template(templates: Path, name: str) -> str:
    """A template string of llama.cpp's tests/test-chat-template.cpp (the hub models' texts)."""
    import ast
    import re

    src = (templates.parent.parent / "tests" / "test-chat-template.cpp").read_text("utf-8")
    m = re.search(r'/\* \.name= \*/ "' + re.escape(name) + r'",\s*/\* \.template_str= \*/ (?:U8C\()?("(?:[^"\\]|\\.)*")',
                  src)
    assert m, name
    return ast.literal_eval(m.group(1))


def test_deepseek_v2_renders_as_transformers(driver, tmp_path, templates, deepseek_tok):
    from test_chat_template import BPE_SPECIALS, COMMON, compare

    hf, section = deepseek_tok
    tpl = llama_cpp_test_template(templates, "DeepSeek-V2")
    assert run(driver, tmp_path, [f"tpl {hx(tpl)}", "name", "stop"]) == ["name deepseek-v2", "stop"]
    got = compare(driver, tmp_path, hf, section, "deepseek-v2", tpl, {**COMMON, **BPE_SPECIALS})
    assert hf.decode(got[list(COMMON).index("system+multi-turn")]) == (
        "<｜begin▁of▁sentence｜>You are a terse assistant. Answer in one line.\n\nUser: What is 2 + 2?\n\n"
        "Assistant: 4.<｜end▁of▁sentence｜>User: And 3 + 3? Explain it step by step.\n\nAssistant:")
    err = answer(run(driver, tmp_path, [f"tok {hx(str(section))}", f"tpl {hx(tpl)}", chatj([U1], True)])[1])
    assert isinstance(err, str) and "deepseek-v2 has no tools" in err


R1_FILES = {  # file -> arguments | tojson (else concatenated as text)
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja": False,
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": True,
}
A_CALL_NONE = {"role": "assistant", "content": None, "tool_calls": [CALL1]}
A_TWO_NONE = {"role": "assistant", "content": None, "tool_calls": [CALL1, CALL2]}


def text_args(conv):
    """The calls' arguments as JSON text (what OpenAI clients send; the first R1 template
    concatenates them)."""
    out = []
    for m in conv:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": a if isinstance(
                a := c["function"]["arguments"], str) else json.dumps(a, ensure_ascii=False)}} for c in m["tool_calls"]]}
        out.append(m)
    return out


R1_CONVS = {
    "call, content none": ([U1, A_CALL_NONE, R1], True),
    "parallel, content none": ([SYS, U1, A_TWO_NONE, R1, R2, A_END, U2], True),
    "two calling turns": ([U1, A_CALL_NONE, R1, A_END, U2, A_TWO_NONE, R1, R2], True),
    "arguments as text": (text_args([U1, A_TWO_NONE, R1, R2, A_END]), True),
    "two systems, think": ([SYS, U1, {"role": "assistant", "content": "<think>a</think>b</think>c"},
                            {"role": "system", "content": "Later system."}, U2], False),
    "result then text": ([U1, A_CALL_NONE, R1, {"role": "assistant", "content": "<think>x</think>done"}], True),
}


def theirs_none_kept(hf, tpl, conv, tools, **kw):
    """The reference for messages whose content is None: transformers now drops None keys, and
    the R1 templates then fail on the missing content; before, it passed None through, and
    `content is none` is where the templates render tool calls. So: the template rendered in
    transformers' own Jinja environment with None kept, the text tokenized as it tokenizes."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    text = _compile_jinja_template(tpl).render(messages=conv, tools=TOOLS if tools else None, bos_token=hf.bos_token,
                                               eos_token=hf.eos_token, add_generation_prompt=True, **kw)
    return hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("fname", list(R1_FILES))
def test_deepseek_r1_renders_as_transformers(driver, tmp_path, templates, deepseek_tok, fname):
    """Both R1 forms on every conversation; where the first release concatenates the
    arguments, arguments given as an object render as their json.dumps text does."""
    hf, section = deepseek_tok
    tpl, tojson = template(templates, fname), R1_FILES[fname]
    cmds, cases = [f"tok {hx(str(section))}", f"tpl {hx(tpl)}"], []
    for kw in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
        for label, (conv, tools) in {**CONVS, **R1_CONVS}.items():
            cmds.append(chatj(conv, tools, **kw))
            cases.append((label, kw, conv if tojson else text_args(conv), tools))
    out = run(driver, tmp_path, cmds)
    assert out[0] == "ok", answer(out[0])
    bad, calls = [], 0
    for (label, kw, ref, tools), line in zip(cases, out[1:]):
        none = any(m.get("content", "") is None for m in ref)
        got, want = answer(line), (theirs_none_kept if none else theirs)(hf, tpl, ref, tools, **kw)
        assert not isinstance(want, Exception), (label, want)
        calls += "<｜tool▁call▁begin｜>" in hf.decode(want)
        if got != want:
            bad.append(f"{label} {kw}: chat.c {hf.decode(got) if isinstance(got, list) else got!r}\n"
                       f"    transformers {hf.decode(want)!r}")
    assert not bad, "\n".join(bad)
    assert calls >= 3 * 5
    err = answer(run(driver, tmp_path, [f"tok {hx(str(section))}", f"tpl {hx(tpl)}",
                                        chatj([U1, {"role": "robot", "content": "x"}], False)])[1])
    assert isinstance(err, str) and '"robot"' in err   # the template would drop it


def _r1_output(hf, tpl, msg) -> str:
    """What the model writes for `msg` after <｜Assistant｜> (the block, without the EOS)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    t = _compile_jinja_template(tpl)
    head = t.render(messages=[U1], bos_token=hf.bos_token, eos_token=hf.eos_token)
    full = t.render(messages=[U1, msg], bos_token=hf.bos_token, eos_token=hf.eos_token)
    assert full.startswith(head + "<｜Assistant｜>"), full
    t = full[len(head + "<｜Assistant｜>"):]
    return t.removesuffix("<｜end▁of▁sentence｜>")


@pytest.mark.parametrize("fname", list(R1_FILES))
def test_deepseek_r1_parse_and_constraint(driver, tmp_path, templates, deepseek_tok, fname):
    hf, _ = deepseek_tok
    tpl, tojson = template(templates, fname), R1_FILES[fname]
    texts = []
    for msg in (A_CALL_NONE, A_TWO_NONE):
        t = _r1_output(hf, tpl, msg if tojson else text_args([msg])[0])
        assert t.startswith("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"), t
        texts.append((msg, t))
    reqs = [{"text": t, "final": True, "names": ["get_weather", "add"]} for _, t in texts]
    reqs.append({"text": "Paris, then.</think>\n\n" + texts[1][1], "final": True, "thinking": True})
    reqs.append({"text": texts[0][1], "final": True, "names": ["add"]})   # not offered: content
    reqs.append({"text": texts[0][1].replace("function<", "method<"), "final": True})   # not a function call
    got = parse(driver, tmp_path, tpl, reqs)
    for (msg, _), g in zip(texts, got):
        want = [[c["function"]["name"], json.dumps(c["function"]["arguments"]), None] for c in msg["tool_calls"]]
        assert g["calls"] == want and g["content"] is None, g
    th = got[2]
    assert th["reasoning"] == "Paris, then." and th["content"] is None and len(th["calls"]) == 2, th
    assert got[3]["calls"] == [] and got[3]["content"] == texts[0][1]
    assert got[4]["calls"] == []
    # the constraint of a named call is the rendered call
    out = run(driver, tmp_path, [f"tpl {hx(tpl)}", f"constraint {hx(json.dumps({'tools': TOOLS, 'only': 'add'}))}",
                                 f"constraint {hx(json.dumps({'tools': TOOLS}))}"])
    named = json.loads(bytes.fromhex(out[0].split(" ", 1)[1]))
    assert json.loads(named["schema"]) == TOOLS[1]["function"]["parameters"]
    assert out[1].startswith("err ")   # the name is outside the JSON: one function
    one = call(1, "add", {"a": 2, "b": 3.5})
    msg = {"role": "assistant", "content": None, "tool_calls": [one]}
    rendered = _r1_output(hf, tpl, msg if tojson else text_args([msg])[0])
    body = json.dumps(one["function"]["arguments"])
    if tojson:
        assert named["prefix"] + body + named["suffix"] == rendered
    else:   # the first release ends the block only after a second call
        assert named["prefix"] + body + named["suffix"] == rendered + "<｜tool▁calls▁end｜>"
    parsed = parse(driver, tmp_path, tpl, [{"text": named["prefix"] + body + named["suffix"], "final": True}])[0]
    assert parsed["calls"] == [["add", body, None]]
