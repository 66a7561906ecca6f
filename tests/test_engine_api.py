"""The Python API over the engine: Engine lifecycle, config, forward, generate, the
tokenizer, and errors mapped to ColibriError subclasses with the engine's message.

Numerical parity with transformers is tested in test_parity_mixtral.py; here the
reference is the engine itself (a continued forward equals one full forward, generate
equals argmax/sampling over forward) plus the model's config.json and sentencepiece.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import colibri_lab
from colibri_lab import (
    ColibriClosedError,
    ColibriError,
    ColibriFormatError,
    ColibriIOError,
    ColibriSeqTooLongError,
    ColibriTokenRangeError,
    Engine,
    EngineConfig,
    Token,
    Tokenizer,
)
from colibri_lab.runtime import _native  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def model(make_model):
    return make_model()


@pytest.fixture(scope="module")
def engine(model):
    with Engine(model[1]) as eng:
        yield eng


def test_abi_and_version():
    assert _native.lib.colibri_abi_version() == _native.ABI_VERSION == 11
    assert isinstance(colibri_lab.native_version(), str) and colibri_lab.native_version()
    assert _native.lib_path.name == "libcolibri.so"


def test_status_to_exception_mapping():
    for status, cls in _native.ERRORS.items():
        err = _native.error_for(status, "what went wrong")
        assert type(err) is cls and isinstance(err, ColibriError) and isinstance(err, RuntimeError)
        assert err.status == status and err.message == "what went wrong" == str(err)
    assert isinstance(_native.error_for(_native.E_IO), OSError)
    assert isinstance(_native.error_for(_native.E_TOKEN_RANGE), ValueError)
    # no message: the library's name for the status
    assert _native.error_for(_native.E_FORMAT).message == _native.status_string(_native.E_FORMAT)


def test_lifecycle(model):
    eng = Engine(model[1])
    assert not eng.closed and "closed" not in repr(eng)
    eng.close()
    eng.close()  # idempotent
    assert eng.closed and "closed" in repr(eng)
    with pytest.raises(ColibriClosedError):
        eng.forward([1, 2])
    with pytest.raises(ColibriError):
        _ = eng.config
    with Engine(model[1]) as eng2:
        tok = eng2.tokenizer
        assert tok.encode("Hello") == [1, 22557]
    assert eng2.closed
    with pytest.raises(ColibriClosedError):  # the tokenizer dies with its engine
        tok.encode("Hello")
    Engine(model[1]).__del__()  # explicit __del__ then GC: no double free
    import gc

    gc.collect()


def test_config_matches_checkpoint(engine, model):
    hf = json.loads((model[0] / "config.json").read_text())
    c = engine.config
    assert isinstance(c, EngineConfig)
    with pytest.raises(AttributeError):
        c.vocab_size = 1  # frozen
    assert c.family == "mixtral"
    assert c.vocab_size == hf["vocab_size"] == engine.vocab_size
    assert c.hidden_size == hf["hidden_size"]
    assert c.intermediate_size == hf["intermediate_size"]
    assert c.n_layers == hf["num_hidden_layers"]
    assert c.n_heads == hf["num_attention_heads"]
    assert c.n_kv_heads == hf["num_key_value_heads"]
    assert c.head_dim == hf["hidden_size"] // hf["num_attention_heads"]
    assert c.n_experts == hf["num_local_experts"]
    assert c.top_k == hf["num_experts_per_tok"]
    assert c.rms_norm_eps == pytest.approx(hf["rms_norm_eps"])
    theta = hf.get("rope_theta") or hf["rope_parameters"]["rope_theta"]
    assert c.rope_theta == pytest.approx(theta)
    assert c.weight_dtype == "f32" and c.router_dtype == "f32"
    assert (c.bos_id, c.eos_id) == (1, 2)
    assert 1 <= c.max_seq_len <= c.file_max_seq_len
    assert c.num_threads >= 1
    assert c.file_size == os.path.getsize(model[1])
    assert c.format_version == 1
    assert repr(engine).startswith("Engine(") and "mixtral" in repr(engine)


def test_engine_options(model):
    with Engine(model[1], num_threads=1, max_seq_len=16, max_batch=4) as eng:
        assert eng.config.num_threads == 1
        assert eng.config.max_seq_len == 16
        assert eng.config.max_batch == 4


def test_forward_shapes_and_dtypes(engine):
    V = engine.config.vocab_size
    ids = engine.tokenizer.encode(PROMPT)
    for arg in (ids, np.array(ids, dtype=np.int64), np.array(ids, dtype=np.int32), tuple(ids)):
        out = engine.forward(arg)
        assert out.shape == (len(ids), V) and out.dtype == np.float32
        assert np.isfinite(out).all()
    assert engine.cached_len == len(ids)
    one = engine.forward([ids[0]])
    assert one.shape == (1, V)
    np.testing.assert_array_equal(one[0], engine.forward(ids)[0])  # row 0 sees only token 0


def test_continuation_equals_full_forward(engine):
    ids = engine.tokenizer.encode(PROMPT)
    full = engine.forward(ids)
    k = 5
    head = engine.forward(ids[:k])
    assert engine.cached_len == k
    tail = engine.forward(ids[k:], start_pos=k)
    assert engine.cached_len == len(ids)
    np.testing.assert_allclose(head, full[:k], rtol=0, atol=1e-5)
    np.testing.assert_allclose(tail, full[k:], rtol=0, atol=1e-4)
    # one token at a time, as generate does
    engine.forward(ids[:1])
    rows = [engine.forward([t], start_pos=i)[0] for i, t in enumerate(ids[1:], start=1)]
    np.testing.assert_allclose(np.stack(rows), full[1:], rtol=0, atol=1e-4)
    # start_pos 0 restarts the sequence
    np.testing.assert_array_equal(engine.forward(ids[:3]), engine.forward(ids[:3], start_pos=0))


def test_forward_last_only(model):
    """last_only computes the last token's logits only: equal to the full forward's last row,
    across chunks and continuations, with the same cache and the same refusals."""
    with Engine(model[1], max_batch=4) as eng:  # several chunks: the head runs on the last
        ids = eng.tokenizer.encode(PROMPT + " " + PROMPT)
        assert len(ids) > 9
        full = eng.forward(ids)
        last = eng.forward(ids, last_only=True)
        assert last.shape == (1, eng.vocab_size)
        np.testing.assert_array_equal(last[0], full[-1])
        assert eng.cached_len == len(ids)
        eng.forward(ids[:5], last_only=True)
        np.testing.assert_array_equal(eng.forward(ids[5:], start_pos=5, last_only=True)[0], full[-1])
        with pytest.raises(ColibriTokenRangeError):
            eng.forward([1, eng.vocab_size], last_only=True)
        with pytest.raises(ColibriSeqTooLongError):
            eng.forward([1] * (eng.config.max_seq_len + 1), last_only=True)


def test_generate_yields_tokens_greedy(engine):
    out = list(engine.generate(PROMPT, max_new_tokens=8))
    assert 1 <= len(out) <= 8 and all(isinstance(t, Token) for t in out)
    assert all(isinstance(t.id, int) and isinstance(t.text, str) for t in out)
    # greedy = argmax (lowest id on ties) of the logits, step by step
    ids = engine.tokenizer.encode(PROMPT)
    for t in out:
        row = engine.forward(ids)[-1]
        assert t.id == int(np.argmax(row))
        ids.append(t.id)
    # deterministic, and the text deltas add up to the decoded continuation
    again = list(engine.generate(PROMPT, max_new_tokens=8))
    assert again == out
    tok = engine.tokenizer
    prompt_ids = tok.encode(PROMPT)
    full = tok.decode(prompt_ids + [t.id for t in out])
    assert full == tok.decode(prompt_ids) + "".join(t.text for t in out)
    # a list of ids is accepted as the prompt
    assert list(engine.generate(prompt_ids, max_new_tokens=8)) == out
    assert list(engine.generate(PROMPT, max_new_tokens=0)) == []


def test_generate_sampling_seeded(engine):
    kw = dict(max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.95, stop_at_eos=False)
    a = [t.id for t in engine.generate(PROMPT, seed=123, **kw)]
    b = [t.id for t in engine.generate(PROMPT, seed=123, **kw)]
    c = [t.id for t in engine.generate(PROMPT, seed=124, **kw)]
    assert a == b and len(a) == 12
    assert a != c
    # the same sampler, called directly
    row = engine.forward(engine.tokenizer.encode(PROMPT))[-1]
    assert engine.sample(row) == int(np.argmax(row))


def test_tokenizer_matches_sentencepiece(engine, tokenizer_model):
    spm = pytest.importorskip("sentencepiece")
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    tok = engine.tokenizer
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == len(tok) == sp.get_piece_size() == 32000
    assert (tok.bos_id, tok.eos_id) == (sp.bos_id(), sp.eos_id()) == (1, 2)
    texts = ["Hello", PROMPT, "  two  spaces\nand a newline\t tab", "naïve café 日本語",
             "🦜" * 40, ""]  # the parrots go through byte fallback and grow the buffer
    for text in texts:
        ids = tok.encode(text, add_bos=False)
        assert ids == sp.encode(text), text
        assert tok.encode(text) == [1] + ids
        assert tok.decode(ids) == sp.decode(ids)
    assert tok.piece(22557) == "▁Hello" == sp.id_to_piece(22557)
    assert tok.piece(1) == "<s>" and tok.piece(13) == "<0x0A>"
    with pytest.raises(ColibriTokenRangeError):
        tok.piece(32000)


def test_tokenizer_from_section_bytes(engine, model):
    from colibri_lab.format.spec import SECTION_TOKENIZER
    from colibri_lab.format.reader import inspect

    info = inspect(model[1])
    sec = info.sections[SECTION_TOKENIZER]
    with open(model[1], "rb") as f:
        f.seek(sec.offset)
        data = f.read(sec.size)
    with Tokenizer.from_section_bytes(data) as tok:
        del data  # the tokenizer keeps its own copy
        assert tok.vocab_size == 32000
        assert tok.encode(PROMPT) == engine.tokenizer.encode(PROMPT)
        assert tok.decode(tok.encode(PROMPT, add_bos=False)) == PROMPT
    assert tok.closed
    with pytest.raises(ColibriClosedError):
        tok.encode("x")
    with pytest.raises(ColibriError) as ei:
        Tokenizer.from_section_bytes(b"\x00garbage\x00" * 3)
    assert ei.value.message


def test_bad_token_ids(engine):
    V = engine.config.vocab_size
    for bad in (V, -1):
        with pytest.raises(ColibriTokenRangeError) as ei:
            engine.forward([1, bad, 5])
        err = ei.value
        assert isinstance(err, ValueError) and err.status == _native.E_TOKEN_RANGE
        assert err.message == _native.lib.colibri_last_error(engine._ctx).decode()
        assert str(bad) in err.message
    with pytest.raises(ColibriTokenRangeError):
        engine.forward([2**40])  # does not fit in int32: refused before the C call
    with pytest.raises(ColibriError):
        engine.forward([1.5, 2.0])
    # the engine still works after an error
    assert engine.forward([1, 2]).shape == (2, V)


def test_sequence_too_long(model):
    with Engine(model[1], max_seq_len=8) as eng:
        ids = list(range(3, 12))  # 9 tokens
        with pytest.raises(ColibriSeqTooLongError) as ei:
            eng.forward(ids)
        assert ei.value.status == _native.E_SEQ_TOO_LONG and ei.value.message
        eng.forward(ids[:8])
        with pytest.raises(ColibriSeqTooLongError):
            eng.forward([5], start_pos=8)
        with pytest.raises(ColibriSeqTooLongError):
            list(eng.generate(ids[:6], max_new_tokens=10, stop_at_eos=False))


def test_start_pos_beyond_cache(engine):
    engine.forward([1, 2, 3])
    with pytest.raises(ColibriError) as ei:
        engine.forward([4], start_pos=10)
    assert ei.value.message


def test_missing_and_bad_files(tmp_path):
    missing = tmp_path / "nope.colibri"
    with pytest.raises(ColibriIOError) as ei:
        Engine(missing)
    assert isinstance(ei.value, OSError) and ei.value.status == _native.E_IO
    assert "nope.colibri" in ei.value.message
    junk = tmp_path / "junk.colibri"
    junk.write_bytes(b"this is not a model" * 100)
    with pytest.raises(ColibriFormatError) as ei:
        Engine(junk)
    assert ei.value.status == _native.E_FORMAT and ei.value.message


def test_verify(engine):
    engine.verify()
    engine.verify_router()


def _import_native(env_extra):
    import subprocess
    import sys

    env = {**os.environ, **env_extra}
    code = "import colibri_lab.runtime._native as n; print(n.lib_path)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


def test_library_search_order(tmp_path):
    installed = _native.lib_path
    r = _import_native({"COLIBRI_LIB": ""})
    assert r.returncode == 0 and r.stdout.strip() == str(installed), r.stderr
    # $COLIBRI_LIB first: a file, or a folder holding libcolibri.so
    r = _import_native({"COLIBRI_LIB": str(installed.parent)})
    assert r.returncode == 0 and r.stdout.strip() == str(installed), r.stderr
    # a wrong $COLIBRI_LIB is an error, not a silent fall-back
    r = _import_native({"COLIBRI_LIB": str(tmp_path / "missing.so")})
    assert r.returncode != 0 and "COLIBRI_LIB" in r.stderr and "ImportError" in r.stderr


def test_text_deltas_hold_back_split_characters(engine):
    """A character whose UTF-8 bytes come as byte-fallback tokens appears once complete."""
    from colibri_lab.runtime.engine import _TextStream

    tok = engine.tokenizer
    parrot = [3 + b for b in "🦜".encode()]  # <0xF0> <0x9F> <0xA6> <0x9C>
    assert [tok.piece(i) for i in parrot] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x9C>"]
    ts = _TextStream(tok, tok.encode("Hello"))
    assert [ts.push(i) for i in parrot] == ["", "", "", "🦜"]
    assert ts.push(22557) == " Hello"
    ts = _TextStream(tok, tok.encode("Hello"))
    assert ts.push(parrot[0]) == "" and ts.push(parrot[1], final=True) == "\ufffd\ufffd"
