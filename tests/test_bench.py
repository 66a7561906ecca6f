"""The measurement tools, in CI: colibri_bench (a subprocess on a tiny converted model: the
JSON fields and their arithmetic, exit codes) and ``python -m colibri_lab.bench --smoke``
(every engine it can run, a missing peer reported instead of crashing). Timings are not
judged: only that they exist, are positive and add up. The helpers the benchmark takes
from ``colibri_lab.tuning`` (roofline, bandwidth, model making) are tested in
tests/test_tuning.py."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from colibri_lab.bench import files, side_by_side

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench_exe(cli_path) -> str:
    """colibri_bench: $COLIBRI_BENCH, else beside colibri_cli (one build folder, or the
    venv's bin/ after pip install), else on PATH."""
    env = os.environ.get("COLIBRI_BENCH")
    if env:
        return env
    beside = Path(cli_path).parent / "colibri_bench"
    if beside.is_file():
        return str(beside)
    found = shutil.which("colibri_bench")
    if not found:
        pytest.fail("colibri_bench not found: build native/ (it sits beside colibri_cli) or set "
                    "COLIBRI_BENCH")  # fmt: skip
    return found


@pytest.fixture(scope="module")
def model(make_model):
    return make_model()  # (hf_dir, .colibri path); max_seq_len 256


def run(exe, *args, timeout=300):
    return subprocess.run([exe, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


def test_json_fields_and_arithmetic(bench_exe, model):
    r = run(bench_exe, "--model", model[1], "--sequential_sequences", 2, "--seq_len", 17,
            "--max_new_tokens", 5, "--num_requests", 3, "--warmup", 1, "--seed", 7,
            "--num_threads", 1, "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["tool"] == "colibri_bench"
    assert (d["vocab_size"], d["n_layers"], d["n_experts"], d["top_k"]) == (32000, 2, 4, 2)
    assert d["weight_dtype"] == "f32" and d["architecture"] == "mixtral"
    assert (d["sequential_sequences"], d["seq_len"], d["max_new_tokens"],
            d["num_requests"]) == (2, 17, 5, 3)  # fmt: skip
    assert d["seed"] == 7 and d["threads_used"] >= 1 and d["load_ms"] > 0
    # samples: one prefill latency per request, one decode latency per token step
    expect = {"prefill": (3, 3 * 2 * 17), "decode": (3 * 2 * 5, 3 * 2 * 5),
              "request": (3, 3 * 2 * (17 + 5))}  # fmt: skip
    for name, (n, tokens) in expect.items():
        s = d[name]
        assert s["n"] == n and s["tokens"] == tokens, name
        assert 0 < s["min_ms"] <= s["p50_ms"] <= s["p99_ms"] <= s["max_ms"], name
        assert s["min_ms"] <= s["mean_ms"] <= s["max_ms"] and s["std_ms"] >= 0, name
        assert math.isclose(s["p99_over_p50"], s["p99_ms"] / s["p50_ms"], rel_tol=1e-5)
        assert math.isclose(s["total_ms"], s["mean_ms"] * n, rel_tol=1e-5)
        assert math.isclose(s["tokens_per_s"], tokens / s["total_ms"] * 1e3, rel_tol=1e-5)
    assert math.isclose(d["prefill"]["requests_per_s"], 3 / d["prefill"]["total_ms"] * 1e3,
                        rel_tol=1e-5)  # fmt: skip
    # a request holds its prefills and decodes
    assert d["request"]["total_ms"] >= d["prefill"]["total_ms"] + d["decode"]["total_ms"] - 1e-3


def test_text_report_and_prefill_only(bench_exe, model):
    r = run(bench_exe, "--model", model[1], "--seq_len", 9, "--max_new_tokens", 0,
            "--num_requests", 2, "--warmup", 0, "--group_pad", 4)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "P99/P50" in r.stdout and "tok/s" in r.stdout and "group_pad 4" in r.stdout
    lines = {ln.split()[0] for ln in r.stdout.splitlines() if ln.strip()}
    assert "prefill" in lines and "decode" not in lines  # no decode steps asked for


def test_help_exits_0(bench_exe):
    r = run(bench_exe, "--help")
    assert r.returncode == 0 and "--sequential_sequences" in r.stdout and "one after" in r.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        ([], "--model is required"),
        (["--model", "m.colibri", "--bogus", "1"], "unknown option"),
        (["--model", "m.colibri", "--seq_len", "0"], "--seq_len"),
        (["--model", "m.colibri", "--seq_len", "ten"], "--seq_len"),
        (["--model", "m.colibri", "--sequential_sequences", "0"], "--sequential_sequences"),
        # no batching across sequences in this build: the name is refused, not reused
        (["--model", "m.colibri", "--batch_size", "2"], "--sequential_sequences 2"),
        (["--model", "m.colibri", "--num_requests", "-1"], "--num_requests"),
        (["--model", "m.colibri", "--warmup", "1.5"], "--warmup"),
        (["--model", "m.colibri", "--max_new_tokens", "-2"], "--max_new_tokens"),
        (["--model", "m.colibri", "--group_pad", "0"], "--group_pad"),
        (["--model", "m.colibri", "--num_threads", "99999"], "--num_threads"),
        (["--model", "m.colibri", "--seed", "-3"], "--seed"),
        (["--model", "m.colibri", "--seq_len"], "needs a value"),
        (["--model", "m.colibri", "--num_requests", "16777216", "--sequential_sequences", "1048576",
          "--max_new_tokens", "64"], "2^28"),
        (["stray"], "unexpected argument"),
    ],
)
def test_usage_errors_exit_2(bench_exe, args, needle):
    r = run(bench_exe, *args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "--help" in r.stderr and r.stdout == ""


def test_engine_errors_exit_1(bench_exe, model, tmp_path):
    r = run(bench_exe, "--model", tmp_path / "absent.colibri")
    assert r.returncode == 1 and "absent.colibri" in r.stderr and r.stdout == ""
    # 250 + 10 positions exceed the 256 the model was converted for
    r = run(bench_exe, "--model", model[1], "--seq_len", 250, "--max_new_tokens", 10)
    assert r.returncode == 1 and "max_seq_len" in r.stderr and r.stdout == ""


def test_page_cache_helpers(tmp_path):
    """The cold-load helpers: eviction works on a regular file (Linux), and the share of a
    file in 2 MiB pages is a fraction (None below one huge page)."""
    small = tmp_path / "small.bin"
    small.write_bytes(b"x" * 4096)
    assert files.hugepage_fraction(small) is None
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(6 << 20))
    if hasattr(os, "posix_fadvise"):
        assert files.drop_from_page_cache(big) is True
    assert files.drop_from_page_cache(tmp_path / "missing.bin") is False
    frac = files.hugepage_fraction(big)
    if os.path.exists("/proc/self/smaps"):
        assert frac is not None and 0.0 <= frac <= 1.0
    # the side-by-side table has the column
    res = {"machine": {}, "bandwidth": {"median_gbs": 1.0, "max_gbs": 1.0, "wall_median_gbs": 1.0,
                                        "method": "m"},
           "model_dir": "d", "model": {"model_type": "mixtral", "layers": 1, "hidden": 8,
                                       "experts": 2, "top_k": 1, "vocab": 10},
           "loadavg_start": [0.0], "loadavg_end": [0.0], "prefill_tokens": 1, "decode_tokens": 1,
           "reps": 1,
           "configs": [{"dtype": "f32", "threads": 1, "roofline": {"roofline_tok_s": 10.0},
                        "engines": {"colibri": {"status": "ok", "prefill_tok_s": 1.0,
                                                "decode_tok_s": 2.0,
                                                "file_hugepage_fraction": 0.5}}}]}  # fmt: skip
    table = side_by_side.render_table(res)
    assert "file in 2 MiB pages" in table and "| 50% |" in table


def test_bench_is_a_developer_tool_outside_the_runtime_package():
    """`import colibri_lab` leaves the benchmark alone, and the benchmark's package does
    not import its own modules (or torch) until asked."""
    code = "\n".join([
        "import sys",
        "import colibri_lab",
        "print(sorted(m for m in sys.modules if 'bench' in m))",
        "import colibri_lab.bench as b",
        "print(sorted(m for m in sys.modules if 'bench' in m))",
        "b.main, b.default_cache_dir  # the side-by-side modules, on first use",
        "print('torch' in sys.modules, 'colibri_lab.bench.side_by_side' in sys.modules)",
    ])  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["[]", "['colibri_lab.bench']", "False True"]


def _run_module(*args, timeout=240):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "colibri_lab.bench", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=env, check=False)  # fmt: skip


def test_side_by_side_smoke(model, tmp_path):
    out = tmp_path / "smoke.json"
    r = _run_module("--smoke", "--engines", "colibri,transformers", "--model-dir", model[0],
                    "--cache-dir", tmp_path / "cache", "--json", out)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["reps"] == 1 and res["prefill_tokens"] == 32 and res["decode_tokens"] == 8
    assert res["bandwidth"]["median_gbs"] > 0
    (cfg,) = res["configs"]
    assert (cfg["dtype"], cfg["threads"]) == ("f32", 2)
    assert cfg["roofline"]["roofline_tok_s"] > 0
    for e in ("colibri", "transformers"):
        ent = cfg["engines"][e]
        assert ent["status"] == "ok", ent
        assert len(ent["reps"]) == 1 and ent["prefill_tok_s"] > 0 and ent["decode_tok_s"] > 0
        assert ent["roofline_fraction"] == pytest.approx(
            ent["decode_tok_s"] / cfg["roofline"]["roofline_tok_s"])
    t = cfg["engines"]["transformers"]
    assert t["colibri_over_this_decode"] == pytest.approx(
        cfg["engines"]["colibri"]["decode_tok_s"] / t["decode_tok_s"])
    assert "| colibri" in r.stdout and "| transformers" in r.stdout


def test_missing_peer_is_reported_not_fatal(model, tmp_path):
    empty = tmp_path / "no-llama"
    empty.mkdir()
    r = _run_module("--smoke", "--engines", "llama.cpp", "--model-dir", model[0],
                    "--cache-dir", tmp_path / "cache", "--llama-cpp-dir", empty, "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    status = res["configs"][0]["engines"]["llama.cpp"]["status"]
    assert status.startswith("not available:") and "not built" in status
    assert "not available" in r.stderr  # the table goes to stderr with --json


def test_bad_engine_name_is_a_usage_error(tmp_path):
    r = _run_module("--smoke", "--engines", "colibri,vllm", "--cache-dir", tmp_path)
    assert r.returncode == 2 and "unknown engine 'vllm'" in r.stderr


def test_serving_benchmark_smoke(model, tmp_path):
    """python -m colibri_lab.bench.serving --smoke: colibri_server under 1 and 4 streaming
    clients (loopback only, bounded in time); the figures exist, no request fails."""
    out = tmp_path / "serving.json"
    r = subprocess.run([sys.executable, "-m", "colibri_lab.bench.serving", "--smoke", "--model-dir", str(model[0]),
                        "--cache-dir", str(tmp_path / "cache"), "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    for c in (1, 4):
        s = res["summary"][f"colibri@{c}"]
        assert s["failed"] == 0 and s["requests"] > 0, s
        assert s["output_tok_s"] > 0 and s["ttft_p50_ms"] > 0 and s["itl_p50_ms"] > 0
        assert s["ttft_p99_ms"] >= s["ttft_p50_ms"] and s["itl_p99_ms"] >= s["itl_p50_ms"]
    assert "| colibri | 4 |" in r.stdout
