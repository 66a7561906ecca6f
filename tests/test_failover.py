"""Two colibri_server replicas behind HAProxy (docs/deploy.md): failover when one is killed,
its rejoining when it comes back, and the graceful shutdown of SIGTERM (a drain: requests in
flight finish, new ones get 503, the process exits 0 within --shutdown_timeout_s).

HAProxy runs as a plain child process (`haproxy -db -f CFG`, no root, no system service) with
the configuration of docs/deploy.md: health checks on GET /health every 200 ms, a replica down
after 2 failed checks and up after 2 good ones, and `retry-on conn-failure empty-response 503`
with `option redispatch 1`, so a request whose replica refused the connection, died before
answering, or is draining is sent again to the other replica (a completion has no side effect,
so sending it again is safe). `option http-buffer-request` is what makes the last two work for
a POST: HAProxy retries at layer 7 only a request it has whole before sending it, and a client
that sends the body after the headers (http.client, httpx) would otherwise get the 503.

Only the loopback address is used; every request has a timeout and every loop is bounded in
count and in time. Without haproxy the tests are skipped, or fail when $CI is set.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

import colibri_lab
from colibri_lab.runtime.serving import parse_metrics, wait_healthy

REPO = Path(__file__).resolve().parents[1]
REQ_TIMEOUT = 20.0  # seconds, every request through the proxy

# every replica: 1 forward thread (two replicas share this machine's cores), 4 sequences
REPLICA_ARGS = ["--num_threads", "1", "--parallel", "4", "--max_seq_len", "1024"]


# ---- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def haproxy_path() -> str:
    """$HAPROXY, else haproxy on PATH, else Debian's /usr/sbin/haproxy (not on a user's PATH)."""
    p = os.environ.get("HAPROXY") or shutil.which("haproxy") or "/usr/sbin/haproxy"
    if not os.access(p, os.X_OK):
        msg = "haproxy is not installed: `make test` installs it (apt-get install haproxy)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return p


@pytest.fixture(scope="module")
def server_path() -> str:
    from conftest import find_tool

    return find_tool("colibri_server", "COLIBRI_SERVER", "install libmicrohttpd-dev and libjansson-dev, "
                     "then `pip install -e .` (make test does both)")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("failover") / "tiny-mixtral.colibri"
    colibri_lab.convert(REPO / "data" / "tiny-mixtral", out, dtype="f32", progress=False)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port: int, method: str, path: str, body=None, timeout: float = REQ_TIMEOUT):
    """(status, headers, body bytes); raises OSError on a connection failure or a timeout."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        c.request(method, path, data, {"Content-Type": "application/json"} if data is not None else {})
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        c.close()


class Replica:
    """A colibri_server on a fixed loopback port, so that it can be restarted on the same one."""

    def __init__(self, exe: str, model: Path, logdir: Path, name: str, *args: str):
        self.exe, self.model, self.name, self.args = exe, model, name, args
        self.port = free_port()
        self.log_path = logdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self):
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([self.exe, "--model", str(self.model), "--host", f"127.0.0.1:{self.port}",
                                      *REPLICA_ARGS, *self.args], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        try:
            wait_healthy(self.proc, self.port, 30, self.name)
        except RuntimeError as e:
            raise RuntimeError(f"{e}: {self.text()}") from None

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def metrics(self) -> dict:
        status, _, body = request(self.port, "GET", "/metrics", timeout=5)
        assert status == 200
        return parse_metrics(body.decode())

    def finished(self) -> int:
        return int(self.metrics()["colibri_requests_finished_total"])

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


HAPROXY_CFG = """\
global
    maxconn 256
    stats socket {sock} mode 600 level user

defaults
    mode http
    timeout connect 1s
    timeout client 30s
    timeout server 30s
    timeout check 1s
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response 503
    option http-buffer-request

frontend api
    bind 127.0.0.1:{port}
    default_backend colibri

backend colibri
    balance roundrobin
    option httpchk GET /health
    http-check expect status 200
    default-server inter 200ms fastinter 100ms downinter 200ms fall 2 rise 2
{servers}
"""


class HAProxy:
    def __init__(self, exe: str, tmp: Path, replicas: list[Replica]):
        self.port = free_port()
        self.sock = tmp / "haproxy.sock"
        self.cfg = tmp / "haproxy.cfg"
        servers = "\n".join(f"    server {r.name} 127.0.0.1:{r.port} check" for r in replicas)
        self.cfg.write_text(HAPROXY_CFG.format(sock=self.sock, port=self.port, servers=servers))
        check = subprocess.run([exe, "-c", "-f", str(self.cfg)], capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stdout + check.stderr
        self.log_path = tmp / "haproxy.log"
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([exe, "-db", "-f", str(self.cfg)], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.wait_status({r.name: "UP" for r in replicas})

    def stat(self) -> dict:
        """`show stat` on the stats socket: {server name: its CSV row as a dict}."""
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(str(self.sock))
            s.sendall(b"show stat\n")
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
        lines = raw.decode().splitlines()
        head = lines[0].lstrip("# ").split(",")
        rows = [dict(zip(head, ln.split(","))) for ln in lines[1:] if ln]
        return {r["svname"]: r for r in rows if r["pxname"] == "colibri"}

    def wait_status(self, want: dict, timeout: float = 10):
        t_end = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited {self.proc.returncode}: {self.log_path.read_text()}")
            try:
                st = self.stat()
                got = {k: st[k]["status"] for k in want}
                if all(got[k].startswith(v) for k, v in want.items()):
                    return st
            except OSError:
                got = "no stats socket yet"
            if time.monotonic() > t_end:
                raise AssertionError(f"haproxy: wanted {want}, have {got}")
            time.sleep(0.05)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def cluster(haproxy_path, server_path, model, tmp_path):
    """Two fresh replicas (r1, r2) and HAProxy in front of them; all stopped afterwards."""
    made: list = []
    try:
        r1 = Replica(server_path, model, tmp_path, "r1", "--shutdown_timeout_s", "20")
        made.append(r1)
        r2 = Replica(server_path, model, tmp_path, "r2", "--shutdown_timeout_s", "20")
        made.append(r2)
        proxy = HAProxy(haproxy_path, tmp_path, [r1, r2])
        made.append(proxy)
        yield r1, r2, proxy
    finally:
        for p in reversed(made):
            p.stop()


# ---- the load ----------------------------------------------------------------------------


def completion(i: int, max_tokens: int = 48) -> dict:
    return {"prompt": f"def f{i}(x):", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def run_load(port: int, n_threads: int, per_thread: int, on_progress=None, bad_every: int = 0,
             max_tokens: int = 48, budget_s: float = 40) -> list[dict]:
    """n_threads × per_thread plain completions through `port`; every `bad_every`-th one is a
    malformed body (it must get a 400). Bounded in count and in time (`budget_s`: a thread
    stops starting requests once it is spent). Returns one record per request sent."""
    out: list[dict] = []
    lock = threading.Lock()
    t_stop = time.monotonic() + budget_s

    def worker(w: int):
        for k in range(per_thread):
            if time.monotonic() > t_stop:
                return
            i = w * per_thread + k
            bad = bad_every > 0 and i % bad_every == bad_every - 1
            body = b'{"prompt": "def f(", "max_tokens": ' if bad else completion(i, max_tokens)
            t0 = time.monotonic()
            rec = {"i": i, "bad": bad}
            try:
                status, hdr, raw = request(port, "POST", "/v1/completions", body)
                rec.update(status=status, body=raw, type=hdr.get("content-type", ""))
            except Exception as e:  # noqa: BLE001  (a connection error or a timeout: recorded, asserted on)
                rec.update(status=None, exc=repr(e))
            rec["secs"] = time.monotonic() - t0
            with lock:
                out.append(rec)
                done = len(out)
            if on_progress:
                on_progress(done)

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=budget_s + REQ_TIMEOUT + 10)
        assert not t.is_alive(), "a load thread hung"
    return out


def check_outcomes(recs: list[dict], max_tokens: int = 48) -> tuple[int, int]:
    """Every request: a completion of max_tokens tokens, a malformed one a 400, anything else
    an HTTP error status with a body; none raised or ran past its timeout. (ok, errors)."""
    ok = errors = 0
    for r in recs:
        assert r["status"] is not None, f"request {r['i']} got no HTTP answer: {r.get('exc')} after {r['secs']:.1f} s"
        assert r["secs"] < REQ_TIMEOUT + 1, r
        if r["bad"]:
            assert r["status"] == 400 and json.loads(r["body"])["error"]["message"], r
        elif r["status"] == 200:
            ans = json.loads(r["body"])
            assert ans["usage"]["completion_tokens"] == max_tokens, ans
            ok += 1
        else:
            assert r["status"] >= 500 and r["body"], r  # a clean error: status and body
            errors += 1
    return ok, errors


# ---- the tests ---------------------------------------------------------------------------


def test_kill_one_replica_failover_then_rejoin(cluster, capsys):
    """SIGKILL r1 under load through HAProxy: every request still gets an answer (retried on
    r2 where r1 died under it), nearly all succeed; afterwards every request succeeds on r2
    alone; r1 restarted on its port is marked up again and gets traffic again."""
    r1, r2, proxy = cluster
    killed = threading.Event()

    def kill_at(done):  # a quarter of the way in, with requests in flight on both replicas
        if done >= 20 and not killed.is_set():
            killed.set()
            r1.proc.send_signal(signal.SIGKILL)

    recs = run_load(proxy.port, n_threads=4, per_thread=20, on_progress=kill_at, bad_every=10)
    assert killed.is_set() and r1.proc.wait(timeout=10) == -signal.SIGKILL
    ok, errors = check_outcomes(recs)
    valid = sum(not r["bad"] for r in recs)
    assert len(recs) == 80 and ok >= 0.9 * valid, (ok, errors, valid)

    # r1 is marked down; new requests all succeed, on r2
    st = proxy.wait_status({"r1": "DOWN", "r2": "UP"})
    # the kill landed in the load: requests r1 held or was handed before it was marked down
    # were sent again to r2 (a retry after a refused connection or an empty response)
    resent = int(st["BACKEND"]["wretr"] or 0) + int(st["BACKEND"]["wredis"] or 0)
    assert resent >= 1, st["BACKEND"]
    before = r2.finished()
    after_kill = run_load(proxy.port, n_threads=2, per_thread=6)
    ok2, err2 = check_outcomes(after_kill)
    assert ok2 == 12 and err2 == 0
    assert r2.finished() - before == 12

    # r1 comes back on the same port: HAProxy's checks bring it up, and it serves again
    r1.start()
    st = proxy.wait_status({"r1": "UP", "r2": "UP"})
    stot_before = int(st["r1"]["stot"])
    rejoin = run_load(proxy.port, n_threads=2, per_thread=10)
    st_end = proxy.stat()
    ok3, err3 = check_outcomes(rejoin)
    assert ok3 == 20 and err3 == 0
    r1_served = r1.finished()  # counters of the new process
    stot_after = int(st_end["r1"]["stot"])
    assert r1_served >= 5 and stot_after - stot_before >= 5, (r1_served, stot_before, stot_after)
    with capsys.disabled():
        print(f"\nfailover: {len(recs)} requests ({valid} valid): {ok} ok, {errors} HTTP errors, "
              f"{len(recs) - valid} malformed -> 400, HAProxy retries {st['BACKEND']['wretr']} / redispatches "
              f"{st['BACKEND']['wredis']}; after the kill {ok2}/12 ok on r2; "
              f"after the restart r1 served {r1_served} of 20 (HAProxy stot +{stot_after - stot_before})")


def test_sigterm_drains(cluster, capsys):
    """SIGTERM r2 while it runs long requests and load goes through HAProxy: its requests in
    flight complete, /health and new requests on r2 get 503 during the drain, r2 exits 0
    within --shutdown_timeout_s, and no request through the proxy fails (the draining
    replica's 503s are retried on r1)."""
    r1, r2, proxy = cluster
    long_tokens = 600  # about a second or more on a busy core: the drain has something to wait for
    direct: list = []

    def long_request(i):
        t0 = time.monotonic()
        status, _, raw = request(r2.port, "POST", "/v1/completions", completion(100 + i, long_tokens))
        direct.append((status, json.loads(raw), time.monotonic() - t0))

    longs = [threading.Thread(target=long_request, args=(i,), daemon=True) for i in range(2)]
    for t in longs:
        t.start()
    t_end = time.monotonic() + 10
    while r2.metrics()["colibri_requests_running"] < 2:
        assert time.monotonic() < t_end, "the long requests did not start"
        time.sleep(0.02)

    termed = threading.Event()
    t_term: list = []
    seen_during_drain: dict = {}

    def term_at(done):
        if done >= 8 and not termed.is_set():
            termed.set()
            t_term.append(time.monotonic())
            r2.proc.send_signal(signal.SIGTERM)
            # straight to r2 while it drains: not ready (the signal thread has to run first:
            # /health is polled for it, bounded), and nothing new admitted
            try:
                t_end = time.monotonic() + 5
                while True:
                    seen_during_drain["health"] = request(r2.port, "GET", "/health", timeout=5)
                    if seen_during_drain["health"][0] != 200 or time.monotonic() > t_end:
                        break
                    time.sleep(0.005)
                seen_during_drain["new"] = request(r2.port, "POST", "/v1/completions", completion(0), timeout=5)
            except OSError as e:  # recorded; the assertions below say what was expected
                seen_during_drain["error"] = repr(e)

    recs = run_load(proxy.port, n_threads=3, per_thread=12, on_progress=term_at)
    for t in longs:
        t.join(timeout=30)
    assert termed.is_set()
    rc = r2.proc.wait(timeout=25)
    t_exit = time.monotonic() - t_term[0]

    assert "error" not in seen_during_drain, seen_during_drain
    status, hdr, body = seen_during_drain["health"]
    assert status == 503 and json.loads(body) == {"status": "stopping"}
    status, hdr, body = seen_during_drain["new"]
    err = json.loads(body)["error"]
    assert status == 503 and err["code"] == "server_shutting_down" and "shutting down" in err["message"], body
    assert hdr.get("connection", "").lower() == "close"
    # the requests in flight on r2 ran to their end
    assert len(direct) == 2
    for status, ans, _ in direct:
        assert status == 200, ans
        assert ans["usage"]["completion_tokens"] == long_tokens and ans["choices"][0]["finish_reason"] == "length"
    assert rc == 0, r2.text()
    assert t_exit < 20, f"r2 took {t_exit:.1f} s to exit (--shutdown_timeout_s 20)"
    # the drain had something to wait for: at least the two long requests ran at the signal
    drained = re.search(r"draining (\d+) running", r2.text())
    assert drained and int(drained.group(1)) >= 2 and "cancelling" not in r2.text(), r2.text()
    # and through the proxy nothing failed
    ok, errors = check_outcomes(recs)
    assert ok == len(recs) == 36 and errors == 0, [(r["status"], r["body"][:300]) for r in recs if r["status"] != 200]
    proxy.wait_status({"r2": "DOWN", "r1": "UP"})
    with capsys.disabled():
        print(f"\ndrain: r2 exited 0 {t_exit:.2f} s after SIGTERM; its 2 requests in flight finished "
              f"({', '.join(f'{d[2]:.2f} s' for d in direct)}); {ok}/{len(recs)} ok through HAProxy")
