"""A model's end ids (metadata tokenizer.end_ids, colibri_get_end_ids): the tokens its
checkpoint's generation_config.json (eos_token_id, an id or a list) or its GGUF (llama.cpp's
end-of-generation set) name besides EOS end a generation as EOS does — in Engine.generate and
generate_many, colibri_cli and colibri_server — and ignore_eos goes on past them. The model is
data/tiny-mixtral (random weights) with one of its greedy tokens named an end id; a file whose
end id lies outside the vocabulary is refused at load. 127.0.0.1 only; every loop is bounded."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

import colibri_lab
from colibri_lab import Engine
from colibri_lab.format import reader as fmt_reader

REPO = Path(__file__).resolve().parents[1]
PROMPT = "The router sends each token"
N = 8


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(the plain file, its greedy tokens, the file whose generation_config.json names one of
    them an end id (plus EOS and an id past the tokenizer), the index of that token)."""
    work = tmp_path_factory.mktemp("end-ids")
    plain = work / "plain.colibri"
    colibri_lab.convert(REPO / "data" / "tiny-mixtral", plain, dtype="f32", progress=False)
    with Engine(plain) as eng:
        greedy = [t.id for t in eng.generate(PROMPT, max_new_tokens=N, stop_at_eos=False)]
        eos, vocab = eng.tokenizer.eos_id, eng.tokenizer.vocab_size
    # the first token not seen before it, after the first: generation then stops there
    k = next(i for i in range(2, N) if greedy[i] not in greedy[:i] and greedy[i] != eos)
    src = work / "src"
    shutil.copytree(REPO / "data" / "tiny-mixtral", src)
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, greedy[k], vocab + 7]}))
    ended = work / "ended.colibri"
    colibri_lab.convert(src, ended, dtype="f32", progress=False)
    return plain, greedy, ended, k


def test_the_file_names_its_end_ids(files):
    plain, _, ended, k = files
    meta = fmt_reader.inspect(ended).metadata
    assert "tokenizer.end_ids" not in fmt_reader.inspect(plain).metadata
    with Engine(ended) as eng:
        end = files[1][k]
        assert meta["tokenizer.end_ids"] == [end]   # EOS and the id past the tokenizer left out
        assert eng.end_ids == (eng.tokenizer.eos_id, end)
    with Engine(plain) as eng:
        assert eng.end_ids == (eng.tokenizer.eos_id,)


def test_generation_stops_at_an_end_id(files):
    _, greedy, ended, k = files
    with Engine(ended, max_seqs=2) as eng:
        assert [t.id for t in eng.generate(PROMPT, max_new_tokens=N)] == greedy[:k + 1]
        assert [t.id for t in eng.generate(PROMPT, max_new_tokens=N, stop_at_eos=False)] == greedy
        assert [t.id for t in eng.generate(PROMPT, max_new_tokens=N, ignore_eos=True)] == greedy
        ids = eng.tokenizer.encode(PROMPT)
        many = eng.generate_many([ids, ids[:-1]], max_new_tokens=N)
        assert many[0] == greedy[:k + 1]
        assert len(many[1]) == N or many[1][-1] in eng.end_ids


def test_cli_stops_at_an_end_id(files):
    from conftest import find_tool

    plain, greedy, ended, k = files
    exe = find_tool("colibri_cli", "COLIBRI_CLI", "pip install -e .")
    out = {}
    for name, path in (("plain", plain), ("ended", ended)):
        r = subprocess.run([exe, "--model", str(path), "--prompt", PROMPT, "--max_new_tokens", str(N),
                            "--temperature", "0"], capture_output=True, timeout=120, check=False)
        assert r.returncode == 0, r.stderr.decode(errors="replace")
        out[name] = r.stdout
    with Engine(plain) as eng:
        want = eng.tokenizer.decode(greedy[:k]).encode()
    # the plain file's text goes on past the text of the first k tokens; the other ends there
    assert out["ended"].rstrip(b"\n").endswith(want.strip()) and len(out["plain"]) > len(out["ended"])


def test_server_stops_at_an_end_id(files, tmp_path):
    from conftest import find_tool
    from test_server import Server, post

    _, greedy, ended, k = files
    exe = find_tool("colibri_server", "COLIBRI_SERVER", "install libmicrohttpd-dev and libjansson-dev, "
                    "then `pip install -e .`")
    srv = Server(exe, ended, tmp_path / "server.log", "--max_seq_len", "128")
    try:
        for extra, tokens, finish in (({}, k + 1, "stop"), ({"ignore_eos": True}, N, "length"),
                                      ({"presence_penalty": 0.0, "logit_bias": {"0": 0.0}}, k + 1, "stop")):
            st, body = post(srv.port, "/v1/completions", {"prompt": PROMPT, "max_tokens": N, "temperature": 0,
                                                          **extra})
            assert st == 200, body
            assert body["choices"][0]["finish_reason"] == finish, (extra, body)
            assert body["usage"]["completion_tokens"] == tokens, (extra, body)
    finally:
        srv.stop()


def test_an_end_id_outside_the_vocabulary_is_refused(files, tmp_path):
    from helpers import patch_metadata

    _, greedy, ended, k = files
    buf = ended.read_bytes()
    off, size = struct.unpack_from("<QQ", buf, 56)
    meta = buf[off:off + size]
    key = meta.index(b"tokenizer.end_ids") + len(b"tokenizer.end_ids")
    # after the key: the value's type (array), its element type (i32), its count, the ids
    head = meta[key:key + 16]
    assert struct.unpack_from("<Q", head, 8)[0] == 1
    old = meta[key - 17:key + 20]
    new = old[:-4] + struct.pack("<i", 1 << 20)
    bad = patch_metadata(ended, tmp_path / "bad.colibri", old, new)
    with pytest.raises(colibri_lab.ColibriError, match=r"tokenizer\.end_ids\[0\] = 1048576 is outside"):
        Engine(bad)
