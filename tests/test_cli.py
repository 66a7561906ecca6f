"""colibri_cli, run as a subprocess: the top-5 table, streamed generation (the same
tokens as Engine.generate), router-norm verification, the expert cache's flags (the same
output with a 1-slot cache, its figures under --verbose), and its exit codes (0 ok,
1 engine error with the engine's message, 2 usage error)."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from colibri_lab import Engine
from colibri_lab.format.spec import SECTION_ROUTER
from colibri_lab.format.reader import inspect

PROMPT = "The quick brown fox"
TOP_LINE = re.compile(r'^\s*(\d+)\s+id=(\d+)\s+p=([0-9.]+)\s+piece=(".*"|\(none\))$')


@pytest.fixture(scope="module")
def model(make_model):
    return make_model()[1]


def run(cli, *args, timeout=120):
    return subprocess.run([cli, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_help(cli_path):
    r = run(cli_path, "--help")
    assert r.returncode == 0 and "--max_new_tokens" in r.stdout and "--model" in r.stdout
    for flag in ("--expert_cache_mb", "--expert_cache_slots", "--expert_cache_policy"):
        assert flag in r.stdout, flag
    assert "lru, lfu, pinned" in r.stdout and "predict" in r.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        ([], "--model is required"),
        (["--model", "m.colibri"], "--prompt is required"),
        (["--model", "m.colibri", "--prompt", "hi", "--bogus", "1"], "unknown option"),
        (["--model", "m.colibri", "--prompt", "hi", "--max_new_tokens", "0"], "--max_new_tokens"),
        (["--model", "m.colibri", "--prompt", "hi", "--max_new_tokens", "ten"], "--max_new_tokens"),
        (["--model", "m.colibri", "--prompt", "hi", "--temperature", "-1"], "--temperature"),
        (["--model", "m.colibri", "--prompt", "hi", "--top_p", "1.5"], "--top_p"),
        (["--model", "m.colibri", "--prompt", "hi", "--seed", "-3"], "--seed"),
        (["--model", "m.colibri", "--prompt"], "needs a value"),
        (["--model", "m.colibri", "--prompt", "hi", "--precision", "turbo"],
         "--precision must be 'exact' or 'fast', got 'turbo'"),
        (["--model", "m.colibri", "--prompt", "hi", "--precision", ""], "--precision must be"),
        (["--model", "m.colibri", "--prompt", "hi", "--precision"], "needs a value"),
        (["--model", "m.colibri", "--prompt", "hi", "--expert_cache_slots", "1", "--expert_cache_policy", "mru"],
         "--expert_cache_policy must be 'lru', 'lfu', 'pinned' or 'predict', got 'mru'"),
        (["--model", "m.colibri", "--prompt", "hi", "--expert_cache_policy", "lru"], "needs an expert cache"),
        (["--model", "m.colibri", "--prompt", "hi", "--expert_cache_mb", "8", "--expert_cache_slots", "2"],
         "give one of them"),
        (["--model", "m.colibri", "--prompt", "hi", "--expert_cache_slots", "-1"], "--expert_cache_slots"),
        (["--model", "m.colibri", "--prompt", "hi", "--expert_cache_mb", "1.5"], "--expert_cache_mb"),
        (["stray"], "unexpected argument"),
    ],
)
def test_usage_errors_exit_2(cli_path, args, needle):
    r = run(cli_path, *args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and r.stdout == ""


def test_missing_model_exits_1(cli_path, tmp_path):
    r = run(cli_path, "--model", tmp_path / "absent.colibri", "--prompt", "hi")
    assert r.returncode == 1
    assert "absent.colibri" in r.stderr and r.stdout == ""


def test_top5(cli_path, model):
    r = run(cli_path, "--model", model, "--prompt", PROMPT, "--max_new_tokens", "1")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    with Engine(model) as eng:
        ids = eng.tokenizer.encode(PROMPT)
        row = eng.forward(ids)[-1].astype(np.float64)
        expect = np.argsort(-row, kind="stable")[:5]  # ties: the lower id first
        pieces = {i: eng.tokenizer.piece(i) for i in expect}
    assert lines[0] == f"top-5 next tokens after {len(ids)} prompt tokens:"
    p = np.exp(row - row.max())
    p /= p.sum()
    rows = [TOP_LINE.match(line) for line in lines[1:]]
    assert len(rows) == 5 and all(rows), r.stdout
    for rank, (m, want) in enumerate(zip(rows, expect, strict=True), start=1):
        assert int(m.group(1)) == rank
        assert int(m.group(2)) == want
        assert float(m.group(3)) == pytest.approx(p[want], abs=2e-6)
        shown = m.group(4)[1:-1]
        assert shown.encode().decode("unicode_escape").encode("latin-1").decode() == pieces[want]
    probs = [float(m.group(3)) for m in rows]
    assert probs == sorted(probs, reverse=True)


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.8", "--top_k", "40", "--seed", "7"]])
def test_streaming_matches_engine_generate(cli_path, model, sampling):
    r = run(cli_path, "--model", model, "--prompt", PROMPT, "--max_new_tokens", "10", *sampling)
    assert r.returncode == 0, r.stderr
    kw = {}
    if sampling:
        kw = dict(temperature=0.8, top_k=40, seed=7)
    with Engine(model) as eng:
        text = "".join(t.text for t in eng.generate(PROMPT, max_new_tokens=10, **kw))
    assert r.stdout == text + "\n"


def test_verbose_and_verify(cli_path, model):
    r = run(cli_path, "--model", model, "--prompt", PROMPT, "--max_new_tokens", "4",
            "--verbose", "--verify", "--num_threads", "1")  # fmt: skip
    assert r.returncode == 0, r.stderr
    for needle in ("load:", "prompt:", "prefill:", "decode:", "tok/s", "verify:"):
        assert needle in r.stderr, r.stderr


CACHE = ["--expert_cache_slots", "1", "--expert_cache_policy", "predict"]


def test_expert_cache_same_output(cli_path, model):
    """A 1-slot cache with read-ahead (every use evicts, reads, prefetches) gives the mapped
    run's text and top-5 table byte for byte; --verbose names the cache, then its counters."""
    base = ["--model", model, "--prompt", PROMPT, "--num_threads", "2"]
    for n in ("10", "1"):
        plain = run(cli_path, *base, "--max_new_tokens", n)
        cached = run(cli_path, *base, "--max_new_tokens", n, *CACHE, "--verbose")
        assert plain.returncode == 0 and cached.returncode == 0, cached.stderr
        assert cached.stdout == plain.stdout and plain.stdout
        lines = cached.stderr.splitlines()
        head = next(x for x in lines if x.startswith("expert cache: 1 slot(s)"))
        assert re.fullmatch(r"expert cache: 1 slot\(s\) per MoE layer, policy predict, \d+ bytes per slot, "
                            r"(O_DIRECT|buffered) reads.*", head), head
        m = re.fullmatch(r"expert cache: (\d+) hits, (\d+) misses \(hit rate [0-9.]+%\), (\d+) prefetches, "
                         r"(\d+) prefetch hits, (\d+) wasted prefetches, (\d+) bytes read \([0-9.]+ MiB\)",
                         lines[-1])
        assert m, cached.stderr
        hits, misses, pre, pre_hits, wasted, nbytes = map(int, m.groups())
        assert misses > 0 and nbytes > 0 and pre_hits + wasted <= pre
        # every token fed uses top_k = 2 experts in each of the 2 MoE layers; of the generated
        # ones all but the last are fed (unless EOS ended the run)
        n_prompt = int(next(x for x in lines if x.startswith("prompt:")).split()[1])
        dec = [x for x in lines if x.startswith("decode:")]
        n_gen = int(dec[0].split()[1]) if dec else 1
        fed = n_prompt + n_gen - (n_gen == int(n))
        assert hits + misses == 2 * 2 * fed
    r = run(cli_path, *base, "--max_new_tokens", "4", "--verbose")
    assert r.returncode == 0 and "expert cache" not in r.stderr  # no cache, no cache lines


@pytest.fixture(scope="module")
def q8_model(make_model):
    """The default test model in q8_0: the weights whose activations fast mode quantizes."""
    return make_model(dtype="q8_0")[1]


@pytest.mark.parametrize("precision", ["fast", "exact"])
def test_precision_flag(cli_path, q8_model, precision):
    """--precision reaches the engine (the --verbose line names the mode and its kernels) and
    the CLI then gives Engine(precision=...)'s tokens and top-5 probabilities."""
    r = run(cli_path, "--model", q8_model, "--prompt", PROMPT, "--max_new_tokens", "10", "--precision",
            precision, "--verbose", "--num_threads", "2")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stderr.splitlines() if x.startswith("precision:"))
    assert line.startswith(f"precision: {precision} (kernels ")
    assert (" fast(int8 " in line) == (precision == "fast"), line
    with Engine(q8_model, precision=precision) as eng:
        assert eng.config.precision == precision
        text = "".join(t.text for t in eng.generate(PROMPT, max_new_tokens=10))
        row = eng.forward(eng.tokenizer.encode(PROMPT))[-1].astype(np.float64)
    assert r.stdout == text + "\n"
    top = run(cli_path, "--model", q8_model, "--prompt", PROMPT, "--max_new_tokens", "1",
              f"--precision={precision}")
    assert top.returncode == 0, top.stderr
    rows = [TOP_LINE.match(x) for x in top.stdout.splitlines()[1:]]
    p = np.exp(row - row.max())
    p /= p.sum()
    assert [int(m.group(2)) for m in rows] == np.argsort(-row, kind="stable")[:5].tolist()
    for m in rows:
        assert float(m.group(3)) == pytest.approx(p[int(m.group(2))], abs=2e-6)


def test_prompt_too_long_exits_1(cli_path, model):
    r = run(cli_path, "--model", model, "--prompt", "word " * 50, "--max_seq_len", "8")
    assert r.returncode == 1
    assert "error" in r.stderr and r.stdout == ""


def test_router_norm_mismatch_exits_1(cli_path, model, tmp_path):
    """Damage the first router tensor: colibri_cli must refuse to run."""
    bad = tmp_path / "bad-router.colibri"
    shutil.copy(model, bad)
    info = inspect(bad)
    router = [t for t in info.tensors if t.name == "blk.0.ffn_gate_inp.weight"][0]
    assert info.sections[SECTION_ROUTER].offset <= router.offset
    with open(bad, "r+b") as f:
        f.seek(router.offset)
        f.write(np.full(8, 100.0, dtype="<f4").tobytes())
    r = run(cli_path, "--model", bad, "--prompt", PROMPT, "--max_new_tokens", "1")
    assert r.returncode == 1
    assert "router" in r.stderr and r.stdout == ""
