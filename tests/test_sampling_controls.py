"""The sampling controls of the library's per-sequence sampler (colibri_sampler): logit bias,
presence / frequency / repetition penalties, min-p, stop ids, ignore_eos, and that the same
settings give the same tokens through Python (Engine.generate), colibri_cli and colibri_server
(alone, under concurrent load, and per choice with n > 1), plus the server's 400s for
out-of-range values and best_of. Distributions are checked on small synthetic vocabularies;
the model is data/tiny-mixtral (random weights). 127.0.0.1 only; every loop is bounded.
"""

from __future__ import annotations

import ctypes
import math
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
from test_server import chat_model  # noqa: F401  (a fixture)

from colibri_lab import Engine
from colibri_lab.runtime.sampling import FINISH_STOP_ID, Sampler

openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-chat"
PROMPT = "[INST] Tell me a story [/INST]"
SETTINGS = dict(temperature=0.9, top_k=60, top_p=0.95, min_p=0.02, presence_penalty=0.5, frequency_penalty=0.4,
                repetition_penalty=1.3)


@pytest.fixture(scope="module")
def engine(chat_model):
    with Engine(chat_model) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory):
    from conftest import find_tool
    from test_server import Server

    exe = find_tool("colibri_server", "COLIBRI_SERVER", "install libmicrohttpd-dev and libjansson-dev, "
                    "then `pip install -e .`")
    srv = Server(exe, chat_model, tmp_path_factory.mktemp("log") / "server.log", "--max_seq_len", "256",
                 "--parallel", "4")
    yield srv
    srv.stop()


def _draws(n_vocab: int, logits, history=(), prompt=(), n: int = 3000, **kw) -> np.ndarray:
    """Token frequencies of n draws, each by a fresh sampler that generated `history` first."""
    row = np.asarray(logits, dtype=np.float32)
    counts = np.zeros(n_vocab)
    for i in range(n):
        s = Sampler(n_vocab, -1, temperature=1.0, **kw)
        if prompt:
            s.add_prompt(prompt)
        for t in history:
            s.accept(t)
        counts[s.sample(row, ctypes.c_uint64(i + 1))] += 1
        s.close()
    return counts / n


def _softmax(x):
    e = np.exp(np.asarray(x, dtype=np.float64) - max(x))
    return e / e.sum()


def test_penalties_lower_a_repeated_token():
    logits = [0.0, 0.0, 0.0, 0.0]
    base = _draws(4, logits, history=[0, 0])
    assert abs(base[0] - 0.25) < 0.03
    # OpenAI: logit -= count * frequency + presence
    f = _draws(4, logits, history=[0, 0], frequency_penalty=1.0)
    assert abs(f[0] - _softmax([-2.0, 0, 0, 0])[0]) < 0.02
    p = _draws(4, logits, history=[0, 0], presence_penalty=1.0)
    assert abs(p[0] - _softmax([-1.0, 0, 0, 0])[0]) < 0.02
    # HF: a positive logit divided, a negative one multiplied; the prompt counts too
    up = [2.0, 1.0, 0.0, -1.0]
    r = _draws(4, up, prompt=[0, 3], repetition_penalty=2.0)
    want = _softmax([1.0, 1.0, 0.0, -2.0])
    assert np.abs(r - want).max() < 0.03
    # a window of the last token only: 0 falls out of it
    w = _draws(4, up, prompt=[0, 3], repetition_penalty=2.0, repetition_last_n=1)
    assert np.abs(w - _softmax([2.0, 1.0, 0.0, -2.0])).max() < 0.03


def test_min_p_cuts_the_tail():
    logits = [3.0, 2.6, 2.0, 0.0]  # p / p_max: 1, 0.67, 0.37, 0.05
    m = _draws(4, logits, min_p=0.5, n=1500)
    assert m[2] == 0 and m[3] == 0 and m[1] > 0.3
    assert abs(m[0] - _softmax([3.0, 2.6])[0]) < 0.04


def test_logit_bias_forces_and_bans(engine):
    forced = [t.id for t in engine.generate(PROMPT, 8, temperature=1.0, seed=3, logit_bias={1234: 100.0})]
    assert forced == [1234] * 8
    greedy = [t.id for t in engine.generate(PROMPT, 4)]
    banned = [t.id for t in engine.generate(PROMPT, 4, logit_bias={greedy[0]: -100.0})]
    assert banned[0] != greedy[0]


def test_stop_ids_and_plain_equality(engine):
    """Without extras the per-sequence sampler picks colibri_sample's tokens; a stop id ends."""
    ids = [t.id for t in engine.generate(PROMPT, 12, temperature=0.8, top_k=40, top_p=0.9, seed=5)]
    rng = ctypes.c_uint64(5)
    prompt = engine.tokenizer.encode(PROMPT)
    row = engine.forward(prompt, 0, last_only=True)[0]
    ref = []
    for i in range(len(ids)):
        ref.append(engine._sample(row, 0.8, 40, 0.9, rng))
        row = engine.forward([ref[-1]], len(prompt) + i)[0]
    assert ids == ref
    stop = [t.id for t in engine.generate(PROMPT, 12, temperature=0.8, top_k=40, top_p=0.9, seed=5,
                                          stop_ids=[ids[3]])]
    assert stop == ids[: ids.index(ids[3]) + 1]
    s = engine.sampler(stop_ids=[7])
    s.accept(7)
    assert s.finished == FINISH_STOP_ID


def test_seeded_runs_repeat(engine):
    a = [t.id for t in engine.generate(PROMPT, 16, seed=11, **SETTINGS)]
    b = [t.id for t in engine.generate(PROMPT, 16, seed=11, **SETTINGS)]
    c = [t.id for t in engine.generate(PROMPT, 16, seed=12, **SETTINGS)]
    assert a == b and a != c


def _python_text(engine, seed, n=24, **kw):
    toks = [t.id for t in engine.generate(PROMPT, n, seed=seed, **{**SETTINGS, **kw})]
    if toks and toks[-1] == engine.tokenizer.eos_id:
        toks = toks[:-1]
    return engine.tokenizer.decode(toks)


def _server_body(seed, n=24, **kw):
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=n, seed=seed, temperature=SETTINGS["temperature"],
                top_p=SETTINGS["top_p"], presence_penalty=SETTINGS["presence_penalty"],
                frequency_penalty=SETTINGS["frequency_penalty"])
    extra = {"top_k": SETTINGS["top_k"], "min_p": SETTINGS["min_p"],
             "repetition_penalty": SETTINGS["repetition_penalty"], **kw}
    return body, extra


def test_python_server_cli_agree(engine, server, chat_model):
    from conftest import find_tool

    bias = {500: 2.0, 600: -3.0}
    want = _python_text(engine, 21, logit_bias=bias)
    body, extra = _server_body(21)
    got = server.client().completions.create(**body, logit_bias={str(k): v for k, v in bias.items()},
                                             extra_body=extra).choices[0].text
    assert got == want
    cli = find_tool("colibri_cli", "COLIBRI_CLI", "`pip install -e .`")
    out = subprocess.run([cli, "--model", str(chat_model), "--prompt", PROMPT, "--max_new_tokens", "24",
                          "--seed", "21", "--temperature", "0.9", "--top_k", "60", "--top_p", "0.95",
                          "--min_p", "0.02", "--presence_penalty", "0.5", "--frequency_penalty", "0.4",
                          "--repetition_penalty", "1.3", "--logit_bias", "500:2,600:-3", "--num_threads", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout[:-1] == want


def test_server_seeded_alone_under_load_and_per_choice(engine, server):
    client = server.client()
    body, extra = _server_body(31, n=16)
    alone = client.completions.create(**body, extra_body=extra).choices[0].text
    assert alone == _python_text(engine, 31, n=16)
    results, errors = [], []

    def worker(i):
        try:
            b, e = _server_body(31 if i % 2 == 0 else 40 + i, n=16)
            results.append((i, client.completions.create(**b, extra_body=e).choices[0].text))
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 6
    assert all(text == alone for i, text in results if i % 2 == 0)
    # n = 2: choice i samples with seed + i
    r = client.completions.create(**{**body, "n": 2}, extra_body=extra)
    texts = sorted((c.index, c.text) for c in r.choices)
    assert texts[0][1] == alone and texts[1][1] == _python_text(engine, 32, n=16)


def test_server_stop_token_ids(engine, server):
    ids = [t.id for t in engine.generate(PROMPT, 10, seed=2, **SETTINGS)]
    body, extra = _server_body(2, n=10, stop_token_ids=[ids[4]])
    r = server.client().completions.create(**body, extra_body=extra).choices[0]
    assert r.finish_reason == "stop"
    assert r.text == engine.tokenizer.decode(ids[: ids.index(ids[4])])


@pytest.mark.parametrize("extra,param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"best_of": 3}, "best_of"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop": [1, "x", 10 ** 9]}, "stop"),
])
def test_server_refuses_out_of_range(server, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=extra)
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"


def test_server_best_of_equal_to_n_and_max_completion_tokens(server):
    client = server.client()
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=3, n=2, best_of=2, temperature=0)
    assert len(r.choices) == 2
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert c.usage.completion_tokens == 3 and math.isfinite(c.usage.total_tokens)
