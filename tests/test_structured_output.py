"""Constrained decoding: a JSON schema compiled into a grammar (colibri_grammar_compile) masks
every token that cannot continue it, so a random model's output parses and validates.

Schemas: tests/data/json_schemas.json (not written for these tests: OpenAI's and Anthropic's
docs, the JSON Schema Test Suite; each names its origin) and a few written here from the
supported features. The model is data/tiny-mixtral (random weights, SentencePiece 32k). Its
strings would run for hundreds of tokens (few tokens contain a closing quote), so the
generation loops add a logit bias toward tokens that start with a quote or close a bracket:
the output's validity comes from the grammar alone (the bias only shortens it), and one
check runs without any bias on a bounded schema. Python (Engine.generate), colibri_server
through the official `openai` client (response_format json_object / json_schema, streamed and
not) and the 400s for schemas the grammar refuses. Every loop is bounded; 127.0.0.1 only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_server import chat_model  # noqa: F401  (a fixture)

import colibri_lab
from colibri_lab import Engine

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[1]
SCHEMAS = json.loads((REPO / "tests" / "data" / "json_schemas.json").read_text())["schemas"]
MAX_TOKENS = 160
MODEL = "tiny-chat"  # the server's model id: its file's name

# written from the supported features (colibri.h, colibri_grammar_compile)
FEATURE_SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 18, "maximum": 99},
                                      "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                                      "ok": {"type": "boolean"}, "none": {"type": "null"}},
     "required": ["name", "age", "score"]},
    {"type": "array", "items": {"enum": ["red", "green", 3, None]}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"kind": {"const": "point"}, "xy": {
        "type": "array", "items": {"type": "integer", "minimum": -10, "maximum": 10}, "minItems": 2, "maxItems": 2}},
     "required": ["kind", "xy"], "additionalProperties": False},
    {"$defs": {"t": {"type": "object", "properties": {"v": {"type": "integer"},
                                                      "kids": {"type": "array", "items": {"$ref": "#/$defs/t"},
                                                               "maxItems": 2}},
                     "required": ["v"]}}, "$ref": "#/$defs/t"},
    {"oneOf": [{"type": "string", "maxLength": 3}, {"type": "integer", "minimum": 5, "maximum": 7}]},
]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("structured") / "tiny-mixtral.colibri"
    colibri_lab.convert(REPO / "data" / "tiny-mixtral", out, dtype="f32", progress=False)
    return out


@pytest.fixture(scope="module")
def engine(model):
    with Engine(model) as eng:
        yield eng


@pytest.fixture(scope="module")
def closing_bias(engine) -> dict[int, float]:
    """+8 on the tokens that start with a quote or close an array / object (random-model
    strings end within a few tokens; the grammar still decides what may come)."""
    tok = engine.tokenizer
    return {i: 8.0 for i in range(tok.vocab_size) if tok.piece(i)[:1] in ('"', "]", "}")}


def _generate(engine, schema, seed: int, bias=None, max_tokens: int = MAX_TOKENS):
    toks = list(engine.generate("[INST] Give me JSON [/INST]", max_tokens, temperature=1.0, seed=seed,
                                json_schema=schema, logit_bias=bias))
    ids = [t.id for t in toks]
    ended = ids[-1] == engine.tokenizer.eos_id
    return engine.tokenizer.decode(ids[:-1] if ended else ids), ended


@pytest.mark.parametrize("i", range(len(SCHEMAS)), ids=[s["origin"][:48] for s in SCHEMAS])
def test_engine_output_validates_realistic(engine, closing_bias, i):
    schema = SCHEMAS[i]["schema"]
    ended = 0
    for seed in range(2):
        text, done = _generate(engine, schema, seed, closing_bias)
        if done:
            ended += 1
            jsonschema.validate(json.loads(text), schema)
    assert ended >= 1, f"no run of {SCHEMAS[i]['origin']} completed in {MAX_TOKENS} tokens"


@pytest.mark.parametrize("i", range(len(FEATURE_SCHEMAS)))
def test_engine_output_validates_features(engine, closing_bias, i):
    schema = FEATURE_SCHEMAS[i]
    for seed in range(3):
        text, done = _generate(engine, schema, 10 + seed, closing_bias)
        assert done, text
        jsonschema.validate(json.loads(text), schema)


def test_any_object_and_no_bias(engine, closing_bias):
    """json_schema=True (any object); a bounded schema with no bias at all: still valid JSON."""
    text, done = _generate(engine, True, 3, closing_bias)
    assert done and isinstance(json.loads(text), dict)
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3},
                                               "b": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
              "required": ["a", "b"]}
    for seed in range(2):
        text, done = _generate(engine, schema, seed, max_tokens=400)
        assert done, text
        jsonschema.validate(json.loads(text), schema)


def test_mask_allows_only_continuations(engine):
    """The mask at a few states: the opening brace only; then a quote; under a string cap of
    2 characters, only tokens that start with the closing quote once they are written."""
    s = engine.sampler(json_schema={"type": "object", "properties": {"k": {"type": "string", "maxLength": 2}},
                                    "required": ["k"]})
    tok = engine.tokenizer
    byte_id = {tok.piece(i): i for i in range(tok.vocab_size) if tok.piece(i).startswith("<0x")}
    allowed = {tok.piece(i) for i, a in enumerate(s.grammar_mask()) if a}
    assert {"{", '{"', "<0x7B>"} <= allowed and all(p.startswith("{") or p == "<0x7B>" for p in allowed)
    assert all(p in ("{", "<0x7B>") or p.startswith('{"') for p in allowed)  # only a key may follow
    for ch in '{"k":"ab':
        s.accept(byte_id[f"<0x{ord(ch):02X}>"])
    ok = [tok.piece(i) for i, a in enumerate(s.grammar_mask()) if a]
    assert '"}' in ok and all(p.startswith('"') or p == "<0x22>" for p in ok)
    assert not s.grammar_complete
    s.accept(byte_id["<0x22>"])
    assert {tok.piece(i) for i, a in enumerate(s.grammar_mask()) if a} == {"}", "<0x7D>"}


def test_unsupported_keyword_raises(engine):
    with pytest.raises(colibri_lab.ColibriUnsupportedError, match="unsupported schema keyword: patternProperties"):
        list(engine.generate("x", 4, json_schema={"type": "object", "patternProperties": {"^a": {}}}))
    with pytest.raises(colibri_lab.ColibriInvalidArgError, match="not valid JSON"):
        list(engine.generate("x", 4, json_schema='{"type": '))


# ---- the server -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory):
    """colibri_server over tiny-mixtral with Mixtral-Instruct's chat template (the same weights)."""
    from conftest import find_tool
    from test_server import Server

    exe = find_tool("colibri_server", "COLIBRI_SERVER", "install libmicrohttpd-dev and libjansson-dev, "
                    "then `pip install -e .`")
    srv = Server(exe, chat_model, tmp_path_factory.mktemp("log") / "server.log", "--max_seq_len", "512",
                 "--parallel", "4")
    yield srv
    srv.stop()


def _bias_body(closing_bias):
    return {str(k): v for k, v in closing_bias.items()}


@pytest.mark.parametrize("i", [0, 2, 5, 6, 10, 12])
def test_server_json_schema_validates(server, closing_bias, i):
    schema = SCHEMAS[i]["schema"]
    client = server.client()
    done = 0
    for seed in range(2):
        r = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=MAX_TOKENS, temperature=1.0,
                                      seed=seed, logit_bias=_bias_body(closing_bias),
                                      extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                          "name": "s", "schema": schema, "strict": True}}})
        if r.choices[0].finish_reason == "stop":
            done += 1
            jsonschema.validate(json.loads(r.choices[0].text), schema)
    assert done >= 1


def test_server_streamed_equals_unstreamed_and_python(server, engine, closing_bias):
    schema = FEATURE_SCHEMAS[0]
    client = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    kw = dict(model=MODEL, prompt="[INST] Give me JSON [/INST]", max_tokens=MAX_TOKENS, temperature=1.0,
              seed=7, logit_bias=_bias_body(closing_bias), extra_body={"response_format": fmt})
    full = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert full == streamed
    jsonschema.validate(json.loads(full), schema)
    # Python with the same settings: the server's prompt is encoded with BOS, as generate's
    text, done = _generate(engine, schema, 7, closing_bias)
    assert done and text == full


def test_server_chat_json_object(server):
    client = server.client()
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=200, temperature=0.5, seed=1,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # a random model may run out of tokens: what it wrote is still an object's prefix
        assert r.choices[0].message.content.startswith("{")


def test_server_refuses_bad_schemas(server):
    client = server.client()
    bad = [({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "a+"}}},
            "unsupported schema keyword: pattern"),
           ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                            "patternProperties": {}}}},
            "patternProperties"),
           ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "https://x/y"}}}, "$ref"),
           ({"type": "xml"}, "not supported"),
           ({"type": "json_schema"}, "json_schema")]
    for fmt, needle in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                      extra_body={"response_format": fmt})
        assert needle in e.value.body["message"] and e.value.body["param"] == "response_format"
    # the server is still up and answers
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text is not None
