"""colibri_server's prefix cache and KV blocks on demand, as a subprocess on 127.0.0.1 over
data/tiny-mixtral: a repeated prompt reports its cached tokens as OpenAI does
(usage.prompt_tokens_details.cached_tokens) and answers exactly as without the cache
(cache_prompt false, or a server started with --prefix_cache 0); /metrics counts prefix-cache
hits and queries, cached blocks and preemptions; and eight long requests on a KV cache of a
third of their worst cases all run at once, are preempted and recomputed, and each ends with
the tokens it gets alone.

Only the loopback address is used; every request loop is bounded in count and time.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from test_server import Server, chat_model, post, wait_idle  # noqa: F401  (chat_model: a fixture)

import colibri_lab
from colibri_lab import Engine

pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[1]
BLOCK = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("server-prefix") / "tiny-mixtral.colibri"
    colibri_lab.convert(REPO / "data" / "tiny-mixtral", out, dtype="f32", progress=False)
    return out


@pytest.fixture(scope="module")
def server_path():
    from conftest import find_tool

    return find_tool("colibri_server", "COLIBRI_SERVER", "install libmicrohttpd-dev and libjansson-dev, "
                     "then `pip install -e .` (make test does both)")


def _ids(n, seed):
    import numpy as np

    return [int(x) for x in np.random.default_rng(seed).integers(3, 1000, size=n)]


def _complete(port, prompt, max_tokens, **kw):
    status, body = post(port, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                  "ignore_eos": True, **kw}, timeout=120)
    assert status == 200, body
    return body


def test_cached_tokens_usage_metrics_and_same_answers(server_path, model, tmp_path):
    system = _ids(70, 1)  # 4 full blocks and 6 positions
    on = Server(server_path, model, tmp_path / "on.log", "--parallel", "2", "--max_seq_len", "256",
                "--kv_block_tokens", str(BLOCK))
    off = Server(server_path, model, tmp_path / "off.log", "--parallel", "2", "--max_seq_len", "256",
                 "--kv_block_tokens", str(BLOCK), "--prefix_cache", "0")
    try:
        first = _complete(on.port, system + _ids(5, 2), 8)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        wait_idle(on)
        # a second conversation with the same system prompt: its 4 full blocks come from the cache
        second = _complete(on.port, system + _ids(9, 3), 8)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BLOCK
        m = wait_idle(on)
        assert m["colibri_prefix_cache_hits_total"] == 4 * BLOCK
        assert m["colibri_prefix_cache_queries_total"] == 75 + 79
        assert m["colibri_kv_blocks_cached"] >= 4 and m["colibri_preemptions_total"] == 0
        # cache_prompt false computes everything; the server without a cache too; same answers
        plain = _complete(on.port, system + _ids(9, 3), 8, cache_prompt=False)
        assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        ref = _complete(off.port, system + _ids(9, 3), 8)
        assert ref["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["choices"][0]["text"] == plain["choices"][0]["text"] == ref["choices"][0]["text"]
        assert wait_idle(off)["colibri_kv_blocks_cached"] == 0
    finally:
        assert on.stop() == 0 and off.stop() == 0


def test_preemption_on_a_third_of_the_worst_cases(server_path, model, tmp_path):
    """8 requests of 40 prompt + 200 generated tokens (240 positions: 15 blocks each, 120 in
    all) on a cache of 40 blocks: admission on worst cases would run 2 at once; on demand all 8
    start, the newest are preempted as the cache fills, and every answer equals the one the
    engine gives alone."""
    prompts = [_ids(40, 10 + i) for i in range(8)]
    max_tokens = 200
    kv_tokens = 40 * BLOCK
    with Engine(model, num_threads=2, max_seq_len=256) as eng:
        want = ["".join(t.text for t in eng.generate(p, max_tokens, stop_at_eos=False)) for p in prompts]
    srv = Server(server_path, model, tmp_path / "pre.log", "--parallel", "8", "--max_seq_len", "256",
                 "--kv_block_tokens", str(BLOCK), "--kv_tokens", str(kv_tokens), "--max_batch_tokens", "64")
    try:
        got, errors = [None] * 8, []
        peak = [0]
        stop = threading.Event()

        def watch():
            t_end = time.monotonic() + 300
            while not stop.is_set() and time.monotonic() < t_end:
                peak[0] = max(peak[0], srv.metrics()["colibri_requests_running"])
                time.sleep(0.02)

        def one(i):
            try:
                status, body = post(srv.port, "/v1/completions", {
                    "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "logprobs": 0}, timeout=300)
                assert status == 200, body
                got[i] = body["choices"][0]
            except Exception as e:  # noqa: BLE001  (reported below)
                errors.append(repr(e))

        w = threading.Thread(target=watch)
        w.start()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        stop.set()
        w.join(timeout=10)
        assert not errors, errors
        m = wait_idle(srv)
        for i in range(8):
            assert got[i]["text"] == want[i], f"request {i}: preempted answer differs from alone"
            assert len(got[i]["logprobs"]["tokens"]) == max_tokens
        assert m["colibri_preemptions_total"] > 0
        # about one preemption per squeeze (9-10 here): a request readmitted only to be
        # preempted again at the next step would show as hundreds (one per decode step)
        assert m["colibri_preemptions_total"] <= 2 * 8, m["colibri_preemptions_total"]
        assert peak[0] >= 6, f"at most {peak[0]} requests ran at once"
        assert m["colibri_requests_finished_total"] == 8
    finally:
        assert srv.stop() == 0


# ---- serving API pieces: a list of prompts, token-id prompts, /tokenize and /detokenize -----


@pytest.fixture(scope="module")
def api_server(server_path, model, tmp_path_factory):
    srv = Server(server_path, model, tmp_path_factory.mktemp("logs") / "api.log", "--parallel", "4",
                 "--max_seq_len", "256")
    yield srv
    assert srv.stop() == 0


def test_completions_with_a_list_of_prompts(api_server):
    """OpenAI's shape: prompt i's choices are indices i*n .. i*n + n-1, usage summed; strings
    and token-id lists alike, each answer the one it gets alone; streamed alike."""
    client = api_server.client()
    texts = ["def main", "import os\n", "class Foo:"]
    alone = [client.completions.create(model="tiny-mixtral", prompt=p, max_tokens=6, temperature=0) for p in texts]
    r = client.completions.create(model="tiny-mixtral", prompt=texts, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    # token-id prompts in a list, two choices each (seeded)
    ids = [_ids(12, 40), _ids(7, 41)]
    r2 = client.completions.create(model="tiny-mixtral", prompt=ids, max_tokens=5, temperature=0.8, seed=3, n=2)
    assert [c.index for c in r2.choices] == [0, 1, 2, 3]
    one = client.completions.create(model="tiny-mixtral", prompt=ids[1], max_tokens=5, temperature=0.8, seed=3, n=2)
    assert [c.text for c in r2.choices[2:]] == [c.text for c in one.choices]
    # streamed: the prompts' events interleaved, each choice's text the same, one id, the
    # usage summed in the last event, then one [DONE]
    stream = client.completions.create(model="tiny-mixtral", prompt=ids, max_tokens=5, temperature=0.8, seed=3,
                                       n=2, stream=True)
    got, ids_seen, usage = {}, set(), None
    for ev in stream:
        ids_seen.add(ev.id)
        for c in ev.choices:
            got[c.index] = got.get(c.index, "") + c.text
        if ev.usage is not None:
            assert usage is None and not ev.choices, "one usage event, the last, with no choices"
            usage = ev.usage
    assert len(ids_seen) == 1
    assert [got[i] for i in range(4)] == [c.text for c in r2.choices]
    assert usage.prompt_tokens == r2.usage.prompt_tokens
    assert usage.completion_tokens == r2.usage.completion_tokens
    status, body = post(api_server.port, "/v1/completions", {"prompt": ["a", 5], "max_tokens": 2})
    assert status == 400 and "element 1" in body["error"]["message"]


def test_tokenize_and_detokenize(api_server, model):
    with Engine(model, num_threads=1) as eng:
        tok = eng.tokenizer
        text = "Hello world, def main():"
        want = tok.encode(text, add_bos=False)
        status, body = post(api_server.port, "/tokenize", {"content": text})
        assert status == 200 and body == {"tokens": want}
        status, body = post(api_server.port, "/tokenize", {"content": text, "add_special": True})
        assert body["tokens"] == tok.encode(text, add_bos=True)
        status, body = post(api_server.port, "/tokenize", {"content": text, "with_pieces": True})
        assert [t["id"] for t in body["tokens"]] == want
        assert "".join(t["piece"] for t in body["tokens"]).strip() == text
        status, body = post(api_server.port, "/detokenize", {"tokens": want})
        assert status == 200 and body == {"content": tok.decode(want)}
    for path, bad, needle in (("/tokenize", {"content": 5}, "content"), ("/detokenize", {"tokens": [-1]}, "element 0"),
                              ("/detokenize", {"tokens": "x"}, "array")):
        status, body = post(api_server.port, path, bad)
        assert status == 400 and needle in body["error"]["message"], body


def test_chat_conversation_reports_cached_tokens(server_path, chat_model, tmp_path):
    """With the openai client: a chat conversation's second turn (the first turn's messages and
    answer resent, then a new message) reports the history's blocks as cached_tokens and
    answers as a server without the cache does."""
    on = Server(server_path, chat_model, tmp_path / "chat-on.log", "--parallel", "2", "--max_seq_len", "512",
                "--kv_block_tokens", str(BLOCK))
    off = Server(server_path, chat_model, tmp_path / "chat-off.log", "--parallel", "2", "--max_seq_len", "512",
                 "--kv_block_tokens", str(BLOCK), "--prefix_cache", "0")
    try:
        answers = {}
        for name, srv in (("on", on), ("off", off)):
            client = srv.client()
            msgs = [{"role": "user", "content": "def main(): " * 12 + "explain"}]
            first = client.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=8, temperature=0)
            msgs += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "and again"}]
            second = client.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=8, temperature=0)
            answers[name] = (first.choices[0].message.content, second.choices[0].message.content,
                             first.usage.prompt_tokens_details.cached_tokens,
                             second.usage.prompt_tokens_details.cached_tokens, first.usage.prompt_tokens)
        assert answers["on"][:2] == answers["off"][:2]
        assert answers["on"][2] == 0 and answers["off"][3] == 0
        # the first turn's prompt and answer start the second's: their full blocks come back
        assert answers["on"][3] % BLOCK == 0 and answers["on"][3] >= answers["on"][4] // BLOCK * BLOCK > 0
    finally:
        assert on.stop() == 0 and off.stop() == 0
