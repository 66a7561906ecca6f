"""colibri_server, run as a subprocess on 127.0.0.1 over a model converted from
data/tiny-mixtral, driven with the official `openai` client and, for the error cases,
with plain http.client: completions and chat, streaming, greedy output equal to
Engine.generate, seeded sampling equal alone and under load, n > 1, stop strings,
logprobs, echo, usage, every error status, the API key, a full queue, /metrics, a client
that leaves mid-stream (its KV blocks come back), a bounded load test, a bounded fuzz of
the request bodies, a server in fast numeric mode (--precision fast), one with an expert cache
(the same answers; its /metrics counters), and the command line (exit 0 / 1 / 2).

Only the loopback address is used; every request loop is bounded in count and time.
"""

from __future__ import annotations

import http.client
import json
import math
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import colibri_lab
from colibri_lab import Engine
from colibri_lab.runtime.serving import wait_healthy

openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[1]
MODEL_ID = "tiny-mixtral"
CTX = 256  # --max_seq_len of the main server
PROMPTS = ["def main", "import os\n", "class Foo:\n    def", "for i in range(10):"]

# Mixtral-8x7B-Instruct-v0.1's chat template (tokenizer_config.json of that checkpoint)
MIXTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}"
)


# ---- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def server_path() -> str:
    """colibri_server: $COLIBRI_SERVER, else beside this Python (pip puts it in the venv's bin/
    when libmicrohttpd and jansson are there), else on PATH."""
    from conftest import find_tool

    return find_tool("colibri_server", "COLIBRI_SERVER", "install libmicrohttpd-dev and libjansson-dev, "
                     "then `pip install -e .` (make test does both)")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("server") / f"{MODEL_ID}.colibri"
    colibri_lab.convert(REPO / "data" / "tiny-mixtral", out, dtype="f32", progress=False)
    return out


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """tiny-mixtral with Mixtral-Instruct's chat template (the checkpoint has none)."""
    d = tmp_path_factory.mktemp("chat-src") / "tiny-mixtral-chat"
    shutil.copytree(REPO / "data" / "tiny-mixtral", d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = MIXTRAL_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    out = d.parent / "tiny-chat.colibri"
    colibri_lab.convert(d, out, dtype="f32", progress=False)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A colibri_server on 127.0.0.1; its stderr goes to a log file shown on failure."""

    def __init__(self, exe: str, model: Path, log: Path, *args: str):
        self.port = free_port()
        self.log_path = log
        self.log = open(log, "wb")
        argv = [exe, "--model", str(model), "--host", f"127.0.0.1:{self.port}", "--num_threads", "2",
                *args]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.proc, self.port, 60)
        except RuntimeError as e:
            raise RuntimeError(f"{e}: {self.text()}") from None

    def text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def client(self, **kw):
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=kw.pop("api_key", "none"),
                             max_retries=0, timeout=60, **kw)

    def metrics(self) -> dict:
        status, body = get(self.port, "/metrics")
        assert status == 200
        return parse_metrics(body.decode())

    def rss_kb(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(server_path, model, tmp_path_factory):
    """The main server: 4 sequences of 256 positions, steps of at most 64 tokens."""
    log = tmp_path_factory.mktemp("logs") / "server.log"
    srv = Server(server_path, model, log, "--parallel", "4", "--max_seq_len", str(CTX),
                 "--max_batch_tokens", "64", "--max_body_bytes", "65536", "--max_queue", "64")
    yield srv
    rc = srv.stop()
    assert rc == 0, srv.text()


@pytest.fixture(scope="module")
def slow_server(server_path, model, tmp_path_factory):
    """One sequence, a queue of one, a long context: requests that run for seconds."""
    log = tmp_path_factory.mktemp("logs") / "slow.log"
    srv = Server(server_path, model, log, "--parallel", "1", "--max_queue", "1", "--max_seq_len", "4096",
                 "--api-key", "sekrit")
    yield srv
    assert srv.stop() == 0, srv.text()


@pytest.fixture(scope="module")
def engine(model):
    with Engine(model, num_threads=2) as eng:
        yield eng


def get(port: int, path: str, headers: dict | None = None, timeout: float = 30) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("GET", path, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def post(port: int, path: str, body, headers: dict | None = None, method: str = "POST",
         timeout: float = 60) -> tuple[int, dict]:
    """Send body (bytes, or an object turned into JSON); (status, parsed JSON answer)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        raw = r.read()
        return r.status, json.loads(raw) if raw else {}
    finally:
        c.close()


from colibri_lab.runtime.serving import parse_metrics  # noqa: E402  (the one parser of /metrics)


def wait_idle(srv: Server, timeout: float = 10) -> dict:
    """Poll /metrics until nothing runs or waits and every KV block is free."""
    t_end = time.monotonic() + timeout
    while True:
        m = srv.metrics()
        if m["colibri_kv_blocks_used"] == 0 and m["colibri_requests_running"] == 0 and \
                m["colibri_requests_waiting"] == 0:  # fmt: skip
            return m
        if time.monotonic() > t_end:
            raise AssertionError(f"server not idle after {timeout} s: {m}")
        time.sleep(0.05)


def reference(engine, prompt, max_tokens: int, **kw) -> tuple[str, list[int]]:
    """Engine.generate's text (EOS gives none) and ids."""
    toks = list(engine.generate(prompt, max_tokens, **kw))
    return "".join(t.text for t in toks), [t.id for t in toks]


def assert_error(status: int, body: dict, want_status: int, needle: str | None = None):
    assert status == want_status, body
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if needle:
        assert needle in err["message"], err["message"]


def sse_events(resp) -> list:
    """The data payloads of a server-sent-event response, [DONE] included as the string."""
    out = []
    for raw in resp:
        line = raw.strip()
        if line.startswith(b"data: "):
            data = line[6:]
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
            if data == b"[DONE]":
                break
    return out


# ---- completions ---------------------------------------------------------------------------


def test_health_and_models(server):
    status, body = get(server.port, "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    status, body = get(server.port, "/v1/models")
    m = json.loads(body)["data"][0]
    assert m["precision"] == "exact" and m["kernels"] and "fast(" not in m["kernels"], m


def test_fast_precision_server(server_path, tmp_path):
    """--precision fast on a q8_0 file: /v1/models says so, and a greedy completion is
    Engine(precision="fast")'s text (one small server, one request)."""
    q8 = colibri_lab.convert(REPO / "data" / "tiny-mixtral", tmp_path / f"{MODEL_ID}.colibri", dtype="q8_0",
                             progress=False)
    srv = Server(server_path, q8, tmp_path / "fast.log", "--parallel", "1", "--max_seq_len", "128",
                 "--precision", "fast")
    try:
        m = json.loads(get(srv.port, "/v1/models")[1])["data"][0]
        assert m["precision"] == "fast" and " fast(int8 " in m["kernels"], m
        assert "precision fast" in srv.text()
        status, ans = post(srv.port, "/v1/completions", {"prompt": "def main", "max_tokens": 12, "temperature": 0})
        assert status == 200, ans
        with Engine(q8, num_threads=2, precision="fast") as eng:
            want, _ = reference(eng, "def main", 12)
        assert ans["choices"][0]["text"] == want
    finally:
        assert srv.stop() == 0, srv.text()


def test_greedy_equals_engine_generate(server, engine):
    client = server.client()
    for prompt in PROMPTS:
        want_text, want_ids = reference(engine, prompt, 24)
        r = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0)
        ch = r.choices[0]
        assert ch.text == want_text, prompt
        assert r.usage.completion_tokens == len(want_ids)
        assert r.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        eos = want_ids[-1] == engine.tokenizer.eos_id
        assert ch.finish_reason == ("stop" if eos else "length")


def test_token_id_prompt(server, engine):
    ids = engine.tokenizer.encode("def main")
    want_text, want_ids = reference(engine, ids, 16)
    r = server.client().completions.create(model=MODEL_ID, prompt=ids, max_tokens=16, temperature=0)
    assert r.choices[0].text == want_text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want_ids)


def test_stream_equals_non_stream(server):
    client = server.client()
    full = client.completions.create(model=MODEL_ID, prompt=PROMPTS[2], max_tokens=40, temperature=0)
    chunks = list(client.completions.create(model=MODEL_ID, prompt=PROMPTS[2], max_tokens=40, temperature=0,
                                            stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # the wire format: data: {json}\n\n events ending with data: [DONE]
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    c.request("POST", "/v1/completions", json.dumps({"prompt": "def", "max_tokens": 5, "stream": True}))
    r = c.getresponse()
    assert r.status == 200 and r.getheader("Content-Type").startswith("text/event-stream")
    events = sse_events(r)
    c.close()
    assert events[-1] == "[DONE]" and all(isinstance(e, dict) for e in events[:-1])
    assert events[-2]["usage"]["completion_tokens"] <= 5


def test_seeded_sampling_alone_and_under_load(server):
    client = server.client()
    kw = dict(model=MODEL_ID, prompt="def parse(", max_tokens=32, temperature=0.9, top_p=0.95, seed=1234,
              extra_body={"top_k": 40})
    alone = client.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw).choices[0].text == alone
    results, errors = {}, []

    def worker(i):
        try:
            if i == 3:
                results[i] = client.completions.create(**kw).choices[0].text
            else:
                results[i] = client.completions.create(model=MODEL_ID, prompt=PROMPTS[i % 4] * (1 + i % 3),
                                                       max_tokens=20 + i, temperature=0.8, seed=i).choices[0].text
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(results) == 8
    assert results[3] == alone
    # a streamed seeded request gives the same text as well
    stream = client.completions.create(**kw, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == alone


def test_n_choices_fork(server):
    client = server.client()
    kw = dict(model=MODEL_ID, prompt="import", max_tokens=20, temperature=1.0, seed=77)
    one = client.completions.create(**kw)
    many = client.completions.create(**kw, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.choices[0].text == one.choices[0].text
    assert len({c.text for c in many.choices}) > 1
    assert many.usage.prompt_tokens == one.usage.prompt_tokens
    assert many.usage.completion_tokens >= 3  # summed over the choices
    greedy = client.completions.create(model=MODEL_ID, prompt="import", max_tokens=12, temperature=0, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text
    assert greedy.usage.completion_tokens == 2 * client.completions.create(
        model=MODEL_ID, prompt="import", max_tokens=12, temperature=0).usage.completion_tokens
    # streamed: events of every choice, each ending once
    chunks = list(client.completions.create(**kw, n=3, stream=True))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert texts == [c.text for c in many.choices]
    wait_idle(server)


def test_stop_strings(server, engine):
    client = server.client()
    prompt = PROMPTS[2]
    full = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=40, temperature=0).choices[0].text
    assert len(full) > 12
    # a stop string across token boundaries: 3 characters from the middle of the text
    stop = full[6:9]
    want = full[: full.index(stop)]
    r = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "@@@"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=40, temperature=0,
                                              stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want
    assert [c.choices[0].finish_reason for c in streamed if c.choices and c.choices[0].finish_reason] == ["stop"]
    # a stop string that never occurs changes nothing
    r = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=40, temperature=0, stop="\x01never")
    assert r.choices[0].text == full


def test_logprobs(server, engine):
    client = server.client()
    prompt = "def main"
    r = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens).strip() == r.choices[0].text.strip()
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(val, abs=1e-6)  # greedy: the best one
    # the first one is the log-softmax of the engine's own logits
    ids = engine.tokenizer.encode(prompt)
    row = engine.forward(ids, last_only=True)[0].astype(np.float64)
    lse = row.max() + math.log(np.exp(row - row.max()).sum())
    assert lp.token_logprobs[0] == pytest.approx(row.max() - lse, abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # streamed: one logprobs entry per token
    chunks = list(client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=6, temperature=0,
                                            logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    got = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert got == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_echo(server):
    client = server.client()
    r = client.completions.create(model=MODEL_ID, prompt="def main", max_tokens=8, temperature=0, echo=True)
    plain = client.completions.create(model=MODEL_ID, prompt="def main", max_tokens=8, temperature=0)
    assert r.choices[0].text == "def main" + plain.choices[0].text


def test_context_full_finishes_with_length(server, engine):
    ids = engine.tokenizer.encode("x " * 400)[: CTX - 4]
    r = server.client().completions.create(model=MODEL_ID, prompt=ids, max_tokens=50, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4 and r.usage.total_tokens == CTX


# ---- chat ----------------------------------------------------------------------------------


def test_chat(server_path, chat_model, tmp_path):
    with Engine(chat_model, num_threads=2) as eng:
        template = eng.chat_template if hasattr(eng, "chat_template") else None
        msgs = [{"role": "user", "content": "Write a function."}]
        try:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(REPO / "data" / "tiny-mixtral")
            ids = hf.apply_chat_template(msgs, chat_template=MIXTRAL_TEMPLATE, tokenize=True,
                                         add_generation_prompt=True)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            ids = [int(i) for i in ids]
        except Exception as e:  # pragma: no cover - transformers is a test dependency
            pytest.skip(f"transformers cannot render the template: {e}")
        want_text, want_ids = reference(eng, ids, 20)
    del template
    srv = Server(server_path, chat_model, tmp_path / "chat.log", "--parallel", "2", "--max_seq_len", "512")
    try:
        client = srv.client()
        r = client.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=20, temperature=0)
        assert r.object == "chat.completion"
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == want_text
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want_ids)
        chunks = list(client.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=20,
                                                     temperature=0, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_text
        assert chunks[-1].usage.completion_tokens == len(want_ids)
        r = client.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=4, temperature=0,
                                           logprobs=True, top_logprobs=2)
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens or content  # EOS has no entry
        assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in content)
        # a role the template does not allow: 400 from the template, the server stays up
        status, body = post(srv.port, "/v1/chat/completions",
                            {"model": "tiny-chat", "messages": [{"role": "robot", "content": "hi"}]})
        assert_error(status, body, 400)
        status, body = post(srv.port, "/v1/chat/completions", {"model": "tiny-chat", "messages": "hi"})
        assert_error(status, body, 400, "messages")
        assert get(srv.port, "/health")[0] == 200
    finally:
        assert srv.stop() == 0, srv.text()


def test_chat_without_template_is_a_clear_400(server):
    status, body = post(server.port, "/v1/chat/completions",
                        {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}]})
    assert_error(status, body, 400)


# ---- errors ----------------------------------------------------------------------------------

BAD_BODIES = [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"prompt": "a", "max_tokens": 4', 400, "not valid JSON"),
    (b'{"prompt": "\xff\xfe", "max_tokens": 4}', 400, "UTF-8"),
    ({"max_tokens": 4}, 400, "'prompt' is required"),
    ({"prompt": 12}, 400, "prompt"),
    ({"prompt": {"a": 1}}, 400, "prompt"),
    ({"prompt": []}, 400, "empty"),
    ({"prompt": ["a", 5]}, 400, "element 1"),
    ({"prompt": [1, 2.5]}, 400, "integer"),
    ({"prompt": [1, 999999]}, 400, "out of range"),
    ({"prompt": [-1]}, 400, "out of range"),
    ({"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "a", "max_tokens": 10**12}, 400, "max_tokens"),
    ({"prompt": "a", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "a", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "a", "top_p": 0}, 400, "top_p"),
    ({"prompt": "a", "top_k": -5}, 400, "top_k"),
    ({"prompt": "a", "n": 0}, 400, "'n'"),
    ({"prompt": "a", "n": 99}, 400, "'n'"),
    ({"prompt": "a", "stop": 5}, 400, "stop"),
    ({"prompt": "a", "stop": [""]}, 400, "stop"),
    ({"prompt": "a", "stream": "yes"}, 400, "stream"),
    ({"prompt": "a", "logprobs": 99}, 400, "logprobs"),
    ({"prompt": "a", "seed": "x"}, 400, "seed"),
    ({"prompt": "a", "model": 3}, 400, "model"),
    ({"prompt": list(range(1, 300))}, 400, f"at most {CTX - 1} tokens"),
    ({"prompt": "word " * 400}, 400, "context"),
]


@pytest.mark.parametrize("body, status, needle", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_bad_requests(server, body, status, needle):
    got, ans = post(server.port, "/v1/completions", body)
    assert_error(got, ans, status, needle)
    assert ans["error"]["type"] == "invalid_request_error"


def test_bad_chat_requests(server):
    for body, needle in [({"messages": []}, "messages"), ({"messages": [{"content": "x"}]}, "role"),
                         ({"messages": [{"role": "user", "content": 5}]}, "content"), ({}, "messages")]:
        got, ans = post(server.port, "/v1/chat/completions", body)
        assert_error(got, ans, 400, needle)
    got, ans = post(server.port, "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})
    assert_error(got, ans, 400, "logprobs")


def test_unknown_model_404(server):
    got, ans = post(server.port, "/v1/completions", {"model": "gpt-17", "prompt": "a"})
    assert_error(got, ans, 404, MODEL_ID)
    assert ans["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="nope", prompt="a", max_tokens=2)


def test_paths_and_methods(server):
    got, ans = post(server.port, "/v1/nothing", {"prompt": "a"})
    assert_error(got, ans, 404, "no such endpoint")
    status, body = get(server.port, "/nope")
    assert status == 404
    status, body = get(server.port, "/v1/completions")
    assert status == 405 and "POST" in json.loads(body)["error"]["message"]
    got, ans = post(server.port, "/health", {})
    assert_error(got, ans, 405)
    got, ans = post(server.port, "/v1/models", {}, method="DELETE")
    assert_error(got, ans, 405)


def test_body_too_large_413(server):
    body = json.dumps({"prompt": "a" * 70000, "max_tokens": 2}).encode()
    got, ans = post(server.port, "/v1/completions", body)
    assert_error(got, ans, 413, "65536")
    assert ans["error"]["code"] == "body_too_large"
    # chunked (no Content-Length): refused while it arrives
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    c.putrequest("POST", "/v1/completions")
    c.putheader("Transfer-Encoding", "chunked")
    c.endheaders()
    try:
        for _ in range(5):
            piece = b"x" * 20000
            c.send(b"%x\r\n%s\r\n" % (len(piece), piece))
        c.send(b"0\r\n\r\n")
    except OSError:
        pass  # the server may close once it has answered
    r = c.getresponse()
    assert r.status == 413
    c.close()
    assert get(server.port, "/health")[0] == 200


def test_api_key(slow_server):
    port = slow_server.port
    got, ans = post(port, "/v1/completions", {"prompt": "a", "max_tokens": 2})
    assert_error(got, ans, 401, "API key")
    got, ans = post(port, "/v1/completions", {"prompt": "a", "max_tokens": 2}, {"Authorization": "Bearer wrong"})
    assert_error(got, ans, 401)
    status, _ = get(port, "/v1/models")
    assert status == 401
    assert get(port, "/health")[0] == 200  # no key needed
    with pytest.raises(openai.AuthenticationError):
        slow_server.client(api_key="nope").completions.create(model=MODEL_ID, prompt="a", max_tokens=2)
    r = slow_server.client(api_key="sekrit").completions.create(model=MODEL_ID, prompt="a", max_tokens=2)
    assert r.usage.completion_tokens >= 1


def open_stream(port: int, body: dict, key: str | None = None):
    """Start a streamed request; returns (connection, response) after the first event."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    c.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), h)
    r = c.getresponse()
    assert r.status == 200
    return c, r


def test_full_queue_429_and_disconnect_frees_blocks(slow_server):
    srv = slow_server
    long = {"prompt": "def main", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    c1, r1 = open_stream(srv.port, long, "sekrit")
    r1.readline()  # the first event: it is running
    c2 = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    c2.request("POST", "/v1/completions", json.dumps({**long, "stream": True}),
               {"Content-Type": "application/json", "Authorization": "Bearer sekrit"})
    t_end = time.monotonic() + 10
    while srv.metrics()["colibri_requests_waiting"] < 1:
        assert time.monotonic() < t_end, "the second request never waited"
        time.sleep(0.02)
    m = srv.metrics()
    assert m["colibri_requests_running"] == 1 and m["colibri_kv_blocks_used"] > 0
    got, ans = post(srv.port, "/v1/completions", {"prompt": "a", "max_tokens": 2}, {"Authorization": "Bearer sekrit"})
    assert_error(got, ans, 429, "queue")
    cancelled_before = m["colibri_requests_cancelled_total"]
    # both clients leave: the running one mid-stream, the waiting one before its first token
    c1.sock.shutdown(socket.SHUT_RDWR)
    c1.close()
    c2.sock.shutdown(socket.SHUT_RDWR)
    c2.close()
    m = wait_idle(srv, timeout=10)
    assert m["colibri_requests_cancelled_total"] == cancelled_before + 2
    assert m["colibri_kv_blocks_used"] == 0
    # a non-streamed request whose client leaves is cancelled as well
    c3 = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    c3.request("POST", "/v1/completions", json.dumps(long),
               {"Content-Type": "application/json", "Authorization": "Bearer sekrit"})
    t_end = time.monotonic() + 10
    while srv.metrics()["colibri_requests_running"] < 1:
        assert time.monotonic() < t_end
        time.sleep(0.02)
    c3.sock.shutdown(socket.SHUT_RDWR)
    c3.close()
    m = wait_idle(srv, timeout=10)
    assert m["colibri_requests_cancelled_total"] == cancelled_before + 3
    r = srv.client(api_key="sekrit").completions.create(model=MODEL_ID, prompt="a", max_tokens=3)
    assert r.usage.completion_tokens >= 1


# ---- metrics -------------------------------------------------------------------------------


def test_metrics(server):
    server.client().completions.create(model=MODEL_ID, prompt="def main", max_tokens=8, temperature=0)
    m = wait_idle(server)
    status, body = get(server.port, "/metrics")
    text = body.decode()
    for name in ["colibri_requests_running", "colibri_requests_waiting", "colibri_kv_blocks_used",
                 "colibri_kv_blocks_total", "colibri_prompt_tokens_total", "colibri_generation_tokens_total"]:
        assert name in m, name
        assert f"# TYPE {name} " in text
    assert m["colibri_kv_blocks_total"] == 4 * CTX / 32
    assert m["colibri_prompt_tokens_total"] > 0 and m["colibri_generation_tokens_total"] >= 8
    for h in ["colibri_time_to_first_token_seconds", "colibri_time_per_output_token_seconds"]:
        assert f"# TYPE {h} histogram" in text
        buckets = m[f"{h}_bucket"]
        counts = [buckets[k] for k in buckets]
        assert counts == sorted(counts) and buckets[(("le", "+Inf"),)] == m[f"{h}_count"] > 0
        assert m[f"{h}_sum"] > 0
    ex = m["colibri_expert_tokens_total"]
    layers = sorted({int(dict(k)["layer"]) for k in ex})
    experts = sorted({int(dict(k)["expert"]) for k in ex})
    assert layers == [0, 1, 2, 3] and experts == list(range(8))
    per_layer = [sum(v for k, v in ex.items() if dict(k)["layer"] == str(la)) for la in layers]
    assert per_layer[0] > 0 and len(set(per_layer)) == 1  # every token is routed in every layer
    assert per_layer[0] % 2 == 0  # top-2
    # the expert counts grow by top_k x the tokens of a request
    before = per_layer[0]
    r = server.client().completions.create(model=MODEL_ID, prompt=[1, 2, 3, 4, 5], max_tokens=3, temperature=0,
                                           extra_body={"ignore_eos": True})
    ex = wait_idle(server)["colibri_expert_tokens_total"]
    after = sum(v for k, v in ex.items() if dict(k)["layer"] == "0")
    assert after - before == 2 * (5 + r.usage.completion_tokens - 1)  # the last token is not fed
    assert not [k for k in m if k.startswith("colibri_expert_cache")]  # no cache, no cache metrics


def test_expert_cache_server(server_path, model, server, tmp_path):
    """--expert_cache_slots 2 (of 8 experts): a greedy completion is the mapped server's, and
    /metrics counts the cache from the end of the warm-up: per layer hits + misses = top_k x
    the tokens fed, the totals the sums of the per-layer series."""
    srv = Server(server_path, model, tmp_path / "cache.log", "--parallel", "1", "--max_seq_len", "128",
                 "--expert_cache_slots", "2", "--expert_cache_policy", "predict")
    try:
        assert "expert cache: 2 slot(s) per MoE layer, policy predict" in srv.text()
        m = srv.metrics()
        assert m["colibri_expert_cache_slots"] == 2 and m["colibri_expert_cache_misses_total"] == 0
        body = {"prompt": "class Foo:\n    def", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        status, ans = post(srv.port, "/v1/completions", body)
        assert status == 200, ans
        status, want = post(server.port, "/v1/completions", body)
        assert status == 200, want
        assert ans["choices"][0]["text"] == want["choices"][0]["text"] and ans["usage"] == want["usage"]
        m = wait_idle(srv)
        text = get(srv.port, "/metrics")[1].decode()
        fed = ans["usage"]["prompt_tokens"] + ans["usage"]["completion_tokens"] - 1  # the last is not fed
        assert m["colibri_expert_cache_misses_total"] > 0 and m["colibri_expert_cache_bytes_read_total"] > 0
        assert m["colibri_expert_cache_prefetches_total"] > 0
        for name in ("hits", "misses", "prefetches", "prefetch_hits", "wasted_prefetches"):
            assert f"# TYPE colibri_expert_cache_{name}_total counter" in text, name
            assert f"# TYPE colibri_expert_cache_layer_{name}_total counter" in text, name
            per = m[f"colibri_expert_cache_layer_{name}_total"]
            assert sorted(int(dict(k)["layer"]) for k in per) == [0, 1, 2, 3], name
            assert sum(per.values()) == m[f"colibri_expert_cache_{name}_total"], name
        assert "# TYPE colibri_expert_cache_slots gauge" in text
        assert "# TYPE colibri_expert_cache_bytes_read_total counter" in text
        hits, misses = m["colibri_expert_cache_layer_hits_total"], m["colibri_expert_cache_layer_misses_total"]
        for layer in hits:
            assert hits[layer] + misses[layer] == 2 * fed, layer  # top-2
    finally:
        assert srv.stop() == 0, srv.text()


# ---- load and fuzz -------------------------------------------------------------------------


def test_load(server):
    """200 requests from 16 threads: streamed and not, some cancelled mid-stream, some
    malformed; all within 60 s, no error on a valid one, every block back at the end, RSS flat."""
    client = server.client()
    for _ in range(8):  # warm: thread stacks, buffers
        client.completions.create(model=MODEL_ID, prompt="warm", max_tokens=8)
    wait_idle(server)
    rss0 = server.rss_kb()
    t_end = time.monotonic() + 60
    lock = threading.Lock()
    stats = {"ok": 0, "cancelled": 0, "malformed": 0}
    errors: list[str] = []

    def job(i: int):
        rng = random.Random(i)
        kind = i % 10
        if kind == 0:  # malformed
            got, ans = post(server.port, "/v1/completions", b'{"prompt": [1, 2', timeout=30)
            assert got == 400 and "error" in ans
            with lock:
                stats["malformed"] += 1
            return
        body = {"model": MODEL_ID, "prompt": " ".join(rng.choice(["def", "x", "import", "(", "\n"])
                                                      for _ in range(rng.randint(1, 40))),
                "max_tokens": rng.randint(1, 48), "temperature": rng.choice([0, 0.7]), "seed": i}
        if kind == 1:  # cancelled mid-stream
            c, r = open_stream(server.port, {**body, "max_tokens": 200, "ignore_eos": True})
            r.readline()
            c.sock.shutdown(socket.SHUT_RDWR)
            c.close()
            with lock:
                stats["cancelled"] += 1
            return
        if kind in (2, 3):
            chunks = list(client.completions.create(**body, stream=True))
            assert chunks[-1].usage.completion_tokens <= body["max_tokens"]
        else:
            r = client.completions.create(**body)
            assert 1 <= r.usage.completion_tokens <= body["max_tokens"]
        with lock:
            stats["ok"] += 1

    def worker(w: int):
        for i in range(w, 200, 16):
            if time.monotonic() > t_end:
                errors.append("out of time")
                return
            try:
                job(i)
            except Exception as e:  # collected and reported
                errors.append(f"{i}: {e!r}")

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not errors, errors[:5]
    assert stats == {"ok": 160, "cancelled": 20, "malformed": 20}
    m = wait_idle(server, timeout=15)
    assert m["colibri_kv_blocks_used"] == 0
    assert get(server.port, "/health")[0] == 200
    assert server.rss_kb() - rss0 < 64 * 1024, (rss0, server.rss_kb())


def mutate(rng: random.Random, raw: bytes) -> bytes:
    b = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        if op == 0 and b:
            del b[rng.randrange(len(b))]
        elif op == 1:
            b.insert(rng.randrange(len(b) + 1), rng.randrange(256))
        elif op == 2 and b:
            b[rng.randrange(len(b))] = rng.choice(b'{}[]",:0123456789-.eE\\tfnu ')
        elif op == 3 and b:
            i = rng.randrange(len(b))
            b[i:i] = b[i : i + rng.randint(1, 16)]
        else:
            b = b[: rng.randrange(len(b) + 1)]
    return bytes(b)


def test_fuzz_request_bodies(server):
    """Seeded mutations of valid bodies (bytes dropped, inserted, duplicated, truncated) and
    structurally odd JSON, for at most 20 s / 600 bodies: every answer is 200 or a JSON
    error with a 4xx status, and the server stays up with every block free."""
    rng = random.Random(20261201)
    seeds = [
        {"model": MODEL_ID, "prompt": "def f(x):", "max_tokens": 3, "temperature": 0.5, "seed": 1},
        {"prompt": [1, 415, 2936], "max_tokens": 2, "stop": ["\n", "x"], "logprobs": 2, "echo": True},
        {"prompt": "a", "max_tokens": 2, "n": 2, "stream": True, "top_p": 0.9, "top_k": 5},
    ]
    odd = [b"", b"null", b"0", b'""', b"[" * 5000 + b"]" * 5000, b'{"prompt": "\\ud800"}', b'{"prompt": "a\\u0000b"}',
           b'{"prompt": "a", "max_tokens": 1e400}', b'{"prompt": "a", "max_tokens": 1.0}',
           b'{"prompt": "a", "prompt": 5}', b'{"prompt": "' + "é".encode() * 3000 + b'", "max_tokens": 1}',
           b'{"prompt": [' + b"1," * 5000 + b"1]}"]
    t_end = time.monotonic() + 20
    n = 0
    for i in range(600):
        if time.monotonic() > t_end:
            break
        if i < len(odd):
            body = odd[i]
        else:
            body = mutate(rng, json.dumps(rng.choice(seeds)).encode())
        path = "/v1/completions" if i % 5 else "/v1/chat/completions"
        c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        c.request("POST", path, body, {"Content-Type": "application/json"})
        r = c.getresponse()
        raw = r.read()
        c.close()
        n += 1
        if r.status == 200:
            continue
        assert 400 <= r.status < 500, (body, r.status, raw)
        err = json.loads(raw)["error"]
        assert isinstance(err["message"], str) and "type" in err and "param" in err and "code" in err
    assert n >= 100
    assert get(server.port, "/health")[0] == 200
    wait_idle(server)


# ---- the command line ----------------------------------------------------------------------


def test_help(server_path):
    r = subprocess.run([server_path, "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0
    for flag in ["--model", "--host", "--port", "--num_threads", "--max_batch_size", "--max_seq_len",
                 "--prefetch_batches", "--gpu_memory_fraction", "--parallel", "--max_batch_tokens", "--kv_tokens",
                 "--api-key", "--max_queue", "--timeout", "--max_body_bytes", "--precision", "--shutdown_timeout_s",
                 "--expert_cache_mb", "--expert_cache_slots", "--expert_cache_policy"]:
        assert flag in r.stdout, flag
    assert "has no effect on CPU" in r.stdout


@pytest.mark.parametrize("args, needle", [
    ([], "--model is required"),
    (["--model", "m.colibri", "--bogus", "1"], "unknown option"),
    (["--model", "m.colibri", "--gpu_memory_fraction", "0.9"], "give --backend cuda too"),
    (["--model", "m.colibri", "--parallel", "0"], "--parallel"),
    (["--model", "m.colibri", "--port", "70000"], "--port"),
    (["--model", "m.colibri", "--host", "127.0.0.1:x"], "port"),
    (["--model", "m.colibri", "--parallel", "2", "--max_batch_size", "4"], "--max_batch_size"),
    (["--model", "m.colibri", "--max_batch_tokens", "2"], "--max_batch_tokens"),
    (["--model", "m.colibri", "--precision", "half"], "--precision must be 'exact' or 'fast', got 'half'"),
    (["--model", "m.colibri", "--shutdown_timeout_s", "-1"], "--shutdown_timeout_s"),
    (["--model", "m.colibri", "--expert_cache_slots", "2", "--expert_cache_policy", "random"],
     "--expert_cache_policy must be 'lru', 'lfu', 'pinned' or 'predict', got 'random'"),
    (["--model", "m.colibri", "--expert_cache_policy", "lfu"], "needs an expert cache"),
    (["--model", "m.colibri", "--expert_cache_mb", "64", "--expert_cache_slots", "2"], "give one of them"),
    (["--model", "m.colibri", "--expert_cache_slots", "x"], "--expert_cache_slots"),
    (["--model"], "needs a value"),
    (["stray"], "unexpected argument"),
])  # fmt: skip
def test_usage_errors_exit_2(server_path, args, needle):
    r = subprocess.run([server_path, *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr


def test_engine_errors_exit_1(server_path, tmp_path, model):
    r = subprocess.run([server_path, "--model", str(tmp_path / "absent.colibri"), "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "absent.colibri" in r.stderr
    r = subprocess.run([server_path, "--model", str(model), "--port", "0", "--max_seq_len", "99999999"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "max_seq_len" in r.stderr
    with socket.socket() as s:  # a port in use
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = subprocess.run([server_path, "--model", str(model), "--host", f"127.0.0.1:{s.getsockname()[1]}"],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "cannot listen" in r.stderr


def test_health_503_while_loading_then_sigterm_exit_0(server_path, model, tmp_path):
    """/health is 503 before the model is ready (a big KV cache makes loading take a
    moment), 200 after; SIGTERM ends the server with status 0."""
    port = free_port()
    proc = subprocess.Popen([server_path, "--model", str(model), "--host", f"127.0.0.1:{port}", "--parallel", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seen = set()
    t_end = time.monotonic() + 60
    try:
        while time.monotonic() < t_end and 200 not in seen:
            try:
                status, body = get(port, "/health", timeout=5)
                seen.add(status)
                if status == 503:
                    assert json.loads(body)["status"] in ("loading", "stopping")
                    got, ans = post(port, "/v1/completions", {"prompt": "a", "max_tokens": 1})
                    if got != 200:  # it may have become ready in between
                        assert_error(got, ans, 503)
            except OSError:
                pass
            time.sleep(0.002)
        assert 200 in seen
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    assert rc == 0, proc.stderr.read().decode()


@pytest.mark.parametrize("second_signal", [False, True])
def test_sigterm_cancels_at_the_drain_deadline(server_path, model, tmp_path, second_signal):
    """SIGTERM while a stream and a plain request run that cannot finish within
    --shutdown_timeout_s: at the deadline (or at once on a second SIGTERM) the stream gets a
    503 error event and [DONE], the plain request a 503, and the server exits 0.
    (tests/test_failover.py has the drain itself: requests that finish in time do.)"""
    timeout_s = 30 if second_signal else 1
    srv = Server(server_path, model, tmp_path / "term.log", "--parallel", "2", "--max_seq_len", "4096",
                 "--shutdown_timeout_s", str(timeout_s))
    long = {"prompt": "def main", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    out = {}

    def plain():
        out["plain"] = post(srv.port, "/v1/completions", long, timeout=60)

    try:
        c, r = open_stream(srv.port, long)
        r.readline()
        t = threading.Thread(target=plain)
        t.start()
        t_end = time.monotonic() + 10
        while srv.metrics()["colibri_requests_running"] < 2:
            assert time.monotonic() < t_end
            time.sleep(0.02)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        if second_signal:
            time.sleep(0.2)
            assert srv.proc.poll() is None  # still draining
            srv.proc.send_signal(signal.SIGTERM)
        events = sse_events(r)
        c.close()
        t.join(timeout=30)
        assert events[-1] == "[DONE]" and events[-2]["error"]["message"].startswith("the server is shutting down")
        assert events[-2]["error"]["code"] == "server_shutting_down"
        status, body = out["plain"]
        assert_error(status, body, 503, "shutting down")
        assert srv.proc.wait(timeout=30) == 0
        # the deadline held (4000 tokens take several seconds here); a second signal is faster still
        assert time.monotonic() - t0 < (5 if second_signal else timeout_s + 5), srv.text()
        log = srv.text()
        assert "draining 2 running" in log, log
        assert ("a second signal came" if second_signal else "the drain deadline") in log, log
    finally:
        srv.stop()
