"""Drive a running ``colibri_server`` (or any OpenAI-compatible server) from Python: start
one on 127.0.0.1, send streamed completions from concurrent clients and measure them, and
read its Prometheus ``/metrics``. Used by ``notebooks/04_serving.ipynb`` and by the serving
benchmark (``python -m colibri_lab.bench.serving``).

    with serving.start("model.colibri", parallel=8) as srv:
        r = serving.load(srv.port, concurrency=8, prompts=serving.prompts(64, 8, 40), max_tokens=32,
                         duration=10)
        r["output_tok_s"], r["ttft_p50_ms"], r["itl_p99_ms"]
        serving.metrics(srv.port)["colibri_kv_blocks_used"]
        system, users = serving.conversation_texts(4, 5, system_words=1000, user_words=30)
        m = serving.multiturn(srv.port, system, users, max_tokens=32)  # conversations resending history
        m["ttft_first_p50_ms"], m["ttft_follow_p50_ms"], m["cache_hit_rate"]

Only the loopback address is used; every request loop is bounded in count and time.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

WORDS = ("the of and to in is that for it as with was on be by at this are from or an have "
         "not which but all they one were there had been has their more can will would when "
         "what about time each some other into two model expert router token layer weight "
         "batch stream memory cache server request python engine matrix vector").split()


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    """n prompts of lo..hi words from a fixed list, seeded (the same list for every server)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def percentile(xs: list[float], q: float) -> float | None:
    """Linear interpolation between order statistics (numpy's default); None for no data."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    i = int(k)
    return xs[i] if i + 1 >= len(xs) else xs[i] + (xs[i + 1] - xs[i]) * (k - i)


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float, name: str = "colibri_server") -> None:
    """Poll http://127.0.0.1:port/health until it answers 200; RuntimeError if `proc` exits
    first or `timeout` seconds pass (each poll has a 2 s timeout of its own)."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with status {proc.returncode}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            try:
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    return
            finally:
                c.close()
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{name} did not become healthy in {timeout:.0f} s")


class Server:
    """A server process on 127.0.0.1 with /health polled until it answers 200."""

    def __init__(self, name: str, argv: list[str], port: int, log):
        self.name, self.port = name, port
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_healthy(self, timeout: float = 600) -> None:
        wait_healthy(self.proc, self.port, timeout, f"{self.name} ({self.log.name})")

    def stop(self) -> None:
        if self.proc.poll() is not None:
            self.log.close()
            return
        self.proc.terminate()  # SIGTERM drains: running requests get --shutdown_timeout_s (30 s by default)
        try:
            self.proc.wait(timeout=45)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _post_completion(port: int, body: str, timeout: float):
    """POST body to 127.0.0.1:port/v1/completions: (connection, response) for HTTP 200 (the
    caller reads the response and closes the connection), else a RuntimeError with the status
    and the start of the body."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        head = r.read()[:200]
        c.close()
        raise RuntimeError(f"HTTP {r.status}: {head!r}")
    return c, r


def request_stream(port: int, model: str, prompt: str, max_tokens: int, seed: int, timeout: float) -> dict:
    """One streamed completion: the token event times and the completion token count."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8,
                       "seed": seed, "stream": True, "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    c, r = _post_completion(port, body, timeout)
    times, n_usage = [], None
    for raw in r:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        ev = json.loads(data)
        if ev.get("usage"):
            n_usage = ev["usage"].get("completion_tokens")
        ch = ev.get("choices") or []
        if ch and (ch[0].get("text") or "") != "":
            times.append(time.perf_counter())
    c.close()
    return {"t0": t0, "times": times, "tokens": n_usage if n_usage is not None else len(times)}


def load(port: int, concurrency: int, prompts: list[str], max_tokens: int = 32, duration: float = 10.0,
         per_client: int = 1000, timeout: float = 300.0, model: str = "model", keep: bool = False) -> dict:
    """`concurrency` closed-loop clients streaming completions for `duration` seconds (or
    per_client requests each): output tokens/s, TTFT and inter-token latency P50/P99 (ms),
    requests done and failed. keep=True also returns every request's "ttft_s" and "itl_s" lists."""
    results, failures, lock = [], [], threading.Lock()
    t_start = time.perf_counter()
    t_end = t_start + duration

    def client(cid: int):
        for k in range(per_client):
            if time.perf_counter() >= t_end:
                return
            i = (cid * per_client + k) % len(prompts)
            try:
                res = request_stream(port, model, prompts[i], max_tokens, seed=1000 * cid + k, timeout=timeout)
                with lock:
                    results.append(res)
            except Exception as e:  # counted, reported; the load goes on
                with lock:
                    failures.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=duration + timeout + 30)
    wall = time.perf_counter() - t_start
    ttft = [r["times"][0] - r["t0"] for r in results if r["times"]]
    itl = [b - a for r in results for a, b in zip(r["times"], r["times"][1:])]
    tokens = sum(r["tokens"] for r in results)
    out = {
        "concurrency": concurrency, "requests": len(results), "failed": len(failures),
        "failures": failures[:5], "wall_s": wall, "output_tokens": tokens,
        "output_tok_s": tokens / wall if wall > 0 else 0.0,
        "ttft_p50_ms": 1e3 * percentile(ttft, 0.5) if ttft else None,
        "ttft_p99_ms": 1e3 * percentile(ttft, 0.99) if ttft else None,
        "itl_p50_ms": 1e3 * percentile(itl, 0.5) if itl else None,
        "itl_p99_ms": 1e3 * percentile(itl, 0.99) if itl else None,
    }
    if keep:
        out["ttft_s"], out["itl_s"] = ttft, itl
    return out


def _turn_stream(port: int, model: str, prompt: str, max_tokens: int, timeout: float) -> dict:
    """One turn of a conversation: a streamed greedy completion of `max_tokens` tokens (EOS
    ignored). Its text, TTFT, token count, and the prompt tokens the server says it took from
    its cache (OpenAI's usage.prompt_tokens_details.cached_tokens, or llama-server's
    timings.cache_n; None when the server says neither)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    c, r = _post_completion(port, body, timeout)
    text, first, n_usage, prompt_tokens, cached = [], None, None, None, None
    for raw in r:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        ev = json.loads(data)
        u = ev.get("usage")
        if u:
            n_usage, prompt_tokens = u.get("completion_tokens"), u.get("prompt_tokens")
            cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
        if ev.get("timings") and cached is None:
            cached = ev["timings"].get("cache_n")
        ch = ev.get("choices") or []
        if ch and (ch[0].get("text") or "") != "":
            if first is None:
                first = time.perf_counter()
            text.append(ch[0]["text"])
    c.close()
    return {"ttft_s": None if first is None else first - t0, "text": "".join(text),
            "tokens": n_usage if n_usage is not None else len(text), "prompt_tokens": prompt_tokens,
            "cached_tokens": cached}


def conversation_texts(conversations: int, turns: int, system_words: int, user_words: int,
                       seed: int = 0) -> tuple[str, list[list[str]]]:
    """A shared system prompt of `system_words` words and, per conversation, `turns` user
    messages of `user_words` words (seeded: the same for every server)."""
    rng = random.Random(seed)
    system = " ".join(rng.choice(WORDS) for _ in range(system_words))
    users = [[" ".join(rng.choice(WORDS) for _ in range(user_words)) for _ in range(turns)]
             for _ in range(conversations)]
    return system, users


def multiturn(port: int, system: str, users: list[list[str]], max_tokens: int = 32, timeout: float = 600.0,
              model: str = "model") -> dict:
    """Conversations at once, one client thread each: every turn sends the whole history (the
    shared system prompt, the earlier user messages and replies, the new message) as one
    streamed greedy completion of `max_tokens` tokens, then appends the reply. Returns TTFT of
    first turns and of follow-up turns (median, P90, ms), aggregate output tokens/s over the
    wall time, the prompt tokens the server reported cached (hit rate over the prompt tokens
    of the turns that reported), every turn's record, and failures."""
    turns_out, failures, lock = [], [], threading.Lock()
    t_start = time.perf_counter()

    def client(cid: int):
        history = system
        for t, msg in enumerate(users[cid]):
            history += f"\nUser: {msg}\nAssistant:"
            try:
                r = _turn_stream(port, model, history, max_tokens, timeout)
            except Exception as e:  # counted, reported; the conversation ends
                with lock:
                    failures.append(f"conversation {cid} turn {t}: {type(e).__name__}: {e}")
                return
            r.update(conversation=cid, turn=t)
            with lock:
                turns_out.append(r)
            history += r["text"]

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(len(users))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=timeout * max(1, max(len(u) for u in users)) + 30)
    wall = time.perf_counter() - t_start
    first = [r["ttft_s"] for r in turns_out if r["turn"] == 0 and r["ttft_s"] is not None]
    follow = [r["ttft_s"] for r in turns_out if r["turn"] > 0 and r["ttft_s"] is not None]
    tokens = sum(r["tokens"] for r in turns_out)
    rep = [r for r in turns_out if r["cached_tokens"] is not None and r["prompt_tokens"]]

    def ms(xs, q):
        return 1e3 * percentile(xs, q) if xs else None

    return {
        "conversations": len(users), "turns": max((len(u) for u in users), default=0),
        "requests": len(turns_out), "failed": len(failures), "failures": failures[:5], "wall_s": wall,
        "output_tokens": tokens, "output_tok_s": tokens / wall if wall > 0 else 0.0,
        "ttft_first_p50_ms": ms(first, 0.5), "ttft_first_p90_ms": ms(first, 0.9),
        "ttft_follow_p50_ms": ms(follow, 0.5), "ttft_follow_p90_ms": ms(follow, 0.9),
        "cache_hit_rate": (sum(r["cached_tokens"] for r in rep) / sum(r["prompt_tokens"] for r in rep)
                           if rep else None),
        "turns_detail": sorted(turns_out, key=lambda r: (r["conversation"], r["turn"])),
    }


def server_exe() -> str | None:
    """colibri_server: $COLIBRI_SERVER, beside this Python (pip installs it there), or on PATH."""
    cands = [os.environ.get("COLIBRI_SERVER"), str(Path(sys.executable).parent / "colibri_server"),
             shutil.which("colibri_server")]
    return next((c for c in cands if c and Path(c).is_file()), None)


def start(path, *, parallel: int = 4, threads: int = 2, max_seq_len: int | None = None,
          kv_tokens: int | None = None, precision: str | None = None, extra: list[str] | None = None,
          log=None, timeout: float = 300.0) -> Server:
    """Start colibri_server on 127.0.0.1 (a free port) for `path` and wait until /health says 200.
    `precision`: "exact" or "fast" (--precision; None: the server's default, exact). Use as a
    context manager, or call .stop()."""
    if precision is not None and precision not in ("exact", "fast"):
        raise ValueError(f"precision must be 'exact' or 'fast', got {precision!r}")
    exe = server_exe()
    if exe is None:
        raise FileNotFoundError("colibri_server not found: pip install . builds it when libmicrohttpd "
                                "and jansson are installed (make test installs them); or set COLIBRI_SERVER")
    port = free_port()
    argv = [exe, "--model", os.fspath(path), "--host", f"127.0.0.1:{port}", "--num_threads", str(threads),
            "--parallel", str(parallel), "--max_batch_size", str(parallel), "--alias", "model"]
    if max_seq_len:
        argv += ["--max_seq_len", str(max_seq_len)]
    if kv_tokens:
        argv += ["--kv_tokens", str(kv_tokens)]
    if precision is not None:
        argv += ["--precision", precision]
    srv = Server("colibri_server", argv + list(extra or []), port, log or os.devnull)
    try:
        srv.wait_healthy(timeout)
    except Exception:
        srv.stop()
        raise
    return srv


def metrics(port: int, timeout: float = 10.0) -> dict:
    """/metrics parsed: {name: value} for plain samples and {name: {labels: value}} for labelled
    ones, labels as a tuple of (key, value) pairs; histogram buckets under NAME_bucket."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("GET", "/metrics")
    r = c.getresponse()
    text = r.read().decode()
    c.close()
    if r.status != 200:
        raise RuntimeError(f"/metrics answered {r.status}")
    return parse_metrics(text)


_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict:
    """Prometheus text format: {name: value} for plain samples and {name: {labels: value}}
    for labelled ones, labels as a tuple of (key, value) pairs."""
    out: dict = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        if "{" in name_labels:
            name, _, lab = name_labels.partition("{")
            # quoted values may hold commas, spaces and escapes (\\, \", \n)
            labels = tuple(
                (k, re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), v))
                for k, v in _LABEL.findall(lab.removesuffix("}"))
            )
            out.setdefault(name, {})[labels] = float(value)
        else:
            out[name_labels] = float(value)
    return out


def sample_metrics(port: int, names: list[str], period: float, stop: threading.Event) -> list[dict]:
    """Poll /metrics every `period` seconds until `stop` is set: [{"t": s, name: value, ...}]."""
    rows, t0 = [], time.perf_counter()
    while not stop.is_set():
        try:
            m = metrics(port)
            rows.append({"t": time.perf_counter() - t0, **{n: m.get(n) for n in names}})
        except OSError:
            pass
        stop.wait(period)
    return rows


def post(port: int, path: str, body: dict, timeout: float = 300.0, headers: dict | None = None) -> tuple[int, dict]:
    """POST a JSON body to 127.0.0.1:port/path; (status, parsed JSON answer)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, json.loads(data) if data else {}


def complete(port: int, prompt, timeout: float = 300.0, **fields) -> dict:
    """One non-streamed /v1/completions request (fields as the OpenAI API names them);
    raises RuntimeError with the server's error message on a non-200 answer."""
    status, ans = post(port, "/v1/completions", {"model": "model", "prompt": prompt, **fields}, timeout)
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {ans.get('error', {}).get('message', ans)}")
    return ans
