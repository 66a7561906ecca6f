"""The measurement tools, in CI: colibri_bench (a subprocess on a tiny converted model: the
JSON fields and their arithmetic, the expert cache's report, exit codes) and ``python -m colibri_lab.bench --smoke``
(every engine it can run, a missing peer reported instead of crashing). Timings are not
judged: only that they exist, are positive and add up. The helpers the benchmark takes
from ``colibri_lab.bench.tuning`` (roofline, bandwidth, model making) are tested in
tests/test_tuning.py."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from colibri_lab.runtime import _native
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
    assert d["expert_cache"] is None  # no --expert_cache_*
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


@pytest.mark.parametrize("policy", ["predict", "lfu"])
def test_expert_cache_report(bench_exe, model, policy):
    """With a 2-slot cache the JSON has an "expert_cache" object whose counters cover the
    measured requests only: hits + misses = n_layers x top_k x the tokens they fed."""
    r = run(bench_exe, "--model", model[1], "--seq_len", 6, "--max_new_tokens", 3, "--num_requests", 2,
            "--warmup", 1, "--num_threads", 2, "--expert_cache_slots", 2, "--expert_cache_policy", policy,
            "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    ec = json.loads(r.stdout)["expert_cache"]
    assert set(ec) == {"slots_per_layer", "policy", "slot_bytes", "direct", "hits", "misses", "hit_rate",
                       "prefetches", "prefetch_hits", "wasted_prefetches", "bytes_read"}  # fmt: skip
    assert (ec["slots_per_layer"], ec["policy"]) == (2, policy)
    assert ec["slot_bytes"] > 0 and isinstance(ec["direct"], bool)
    assert ec["hits"] + ec["misses"] == 2 * 2 * 2 * (6 + 3) > 0
    assert ec["misses"] > 0 and ec["bytes_read"] >= ec["misses"] * 4096
    assert math.isclose(ec["hit_rate"], ec["hits"] / (ec["hits"] + ec["misses"]), rel_tol=1e-5)
    assert ec["prefetch_hits"] + ec["wasted_prefetches"] <= ec["prefetches"]
    assert (ec["prefetches"] > 0) == (policy == "predict")
    t = run(bench_exe, "--model", model[1], "--seq_len", 6, "--max_new_tokens", 3, "--num_requests", 1,
            "--warmup", 0, "--expert_cache_slots", 1)  # fmt: skip
    assert t.returncode == 0, t.stderr
    assert "expert cache: 1 slot(s) per MoE layer, policy lru, " in t.stdout
    assert "expert cache (measured requests): " in t.stdout and " misses (hit rate " in t.stdout


def test_help_exits_0(bench_exe):
    r = run(bench_exe, "--help")
    assert r.returncode == 0 and "--sequential_sequences" in r.stdout and "one after" in r.stdout
    assert "--expert_cache_mb" in r.stdout and "--expert_cache_slots" in r.stdout
    assert "--expert_cache_policy" in r.stdout and "lru, lfu, pinned" in r.stdout


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
        (["--model", "m.colibri", "--expert_cache_slots", "2", "--expert_cache_policy", "fifo"],
         "--expert_cache_policy must be 'lru', 'lfu', 'pinned' or 'predict', got 'fifo'"),
        (["--model", "m.colibri", "--expert_cache_policy", "predict"], "needs an expert cache"),
        (["--model", "m.colibri", "--expert_cache_mb", "4", "--expert_cache_slots", "1"], "give one of them"),
        (["--model", "m.colibri", "--expert_cache_mb", "-4"], "--expert_cache_mb"),
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
    # the roofline's bandwidth: the C streaming read, on the engines' thread count (2)
    (rd,) = res["read_bandwidth"].values()
    assert list(res["read_bandwidth"]) == ["2"] and rd["threads"] == 2 and rd["bytes"] == 32 << 20
    assert rd["gbs"] > 0 and rd["gbs"] == rd["variants"][rd["variant"]]["best_gbs"]
    assert {"plain", "avx2", "portable", "nt_prefetch", "nt_load"} == set(rd["variants"])
    assert rd["gbs"] == max(v.get("best_gbs", 0) for v in rd["variants"].values())
    (cfg,) = res["configs"]
    assert (cfg["dtype"], cfg["threads"]) == ("f32", 2)
    roof, copy = cfg["roofline"], cfg["roofline_copy"]
    assert roof["roofline_tok_s"] > 0 and roof["bandwidth_gbs"] == rd["gbs"]
    assert roof["bandwidth"] == "read, 2 threads"
    assert copy["bandwidth_gbs"] == res["bandwidth"]["median_gbs"]
    assert roof["bytes_per_token"] == copy["bytes_per_token"]  # one model, two bandwidths
    assert roof["roofline_tok_s"] / copy["roofline_tok_s"] == pytest.approx(
        rd["gbs"] / res["bandwidth"]["median_gbs"])
    for e in ("colibri", "transformers"):
        ent = cfg["engines"][e]
        assert ent["status"] == "ok", ent
        assert len(ent["reps"]) == 1 and ent["prefill_tok_s"] > 0 and ent["decode_tok_s"] > 0
        assert ent["roofline_fraction"] == pytest.approx(ent["decode_tok_s"] / roof["roofline_tok_s"])
        assert ent["copy_roofline_fraction"] == pytest.approx(
            ent["decode_tok_s"] / copy["roofline_tok_s"])
        # the bandwidth again just before the repetition, and the decode against it
        (rep,) = ent["reps"]
        assert rep["read_gbs_before"] > 0
        assert ent["roofline_fraction_adjacent"] == pytest.approx(
            rep["decode_tok_s"] / (roof["roofline_tok_s"] * rep["read_gbs_before"] / rd["gbs"]))
    assert "adjacent)" in r.stdout
    # a warning exactly for each engine above the read roofline
    above = [e for e, ent in cfg["engines"].items() if ent["roofline_fraction"] > 1]
    assert len([w for w in res["warnings"] if "the roofline is wrong" in w]) == len(above)
    assert res["library"]["path"].endswith("libcolibri.so") and "Colibri library: " in r.stdout
    assert "read bandwidth, 2 threads:" in r.stdout and "copy bandwidth:" in r.stdout
    t = cfg["engines"]["transformers"]
    assert t["colibri_over_this_decode"] == pytest.approx(
        cfg["engines"]["colibri"]["decode_tok_s"] / t["decode_tok_s"])
    assert "| colibri" in r.stdout and "| transformers" in r.stdout
    # the fast numeric mode runs as an engine of its own (--precision exact,fast, the default),
    # with its ratios to the peers and its accuracy against exact on the prompt
    assert res["precisions"] == ["exact", "fast"]
    fast = cfg["engines"]["colibri fast"]
    assert fast["status"] == "ok" and fast["precision"] == "fast" and " fast(int8 " in fast["kernels"]
    assert cfg["engines"]["colibri"]["precision"] == "exact"
    assert t["colibri_fast_over_this_prefill"] == pytest.approx(fast["prefill_tok_s"] / t["prefill_tok_s"])
    acc = cfg["fast_vs_exact"]  # f32 weights run the exact kernels in either mode
    assert acc["n_tokens"] == 31 and acc["top1"] == 1.0 and acc["kl_mean"] == 0.0
    assert acc["routing_flips"] == 0.0
    assert "fast vs exact, f32" in r.stdout and "| colibri fast [" in r.stdout


def test_prefill_rounds_tool(model, tmp_path):
    """tools/prefill_rounds.py: both engines' prefills alternate, one ratio a round, their
    median printed and written."""
    out = tmp_path / "rounds.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, str(REPO / "tools" / "prefill_rounds.py"), "--model", model[1],
                        "--hf-dir", model[0], "--rounds", "3", "--tokens", "24", "--dtype", "f32",
                        "--precision", "exact", "--json", out],
                       capture_output=True, text=True, timeout=240, cwd=REPO, env=env, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert len(res["rounds"]) == 3
    for x in res["rounds"]:
        assert x["colibri"] > 0 and x["transformers"] > 0
        assert math.isclose(x["ratio"], x["colibri"] / x["transformers"])
    assert math.isclose(res["medians"]["ratio"], sorted(x["ratio"] for x in res["rounds"])[1])
    assert "median of 3 rounds" in r.stdout and r.stdout.count("round ") >= 3


def test_precision_is_checked(tmp_path):
    r = _run_module("--smoke", "--precision", "exact,turbo", "--cache-dir", tmp_path)
    assert r.returncode == 2 and "--precision takes exact, fast" in r.stderr


def test_decode_above_the_roofline_is_warned(model, tmp_path, monkeypatch):
    """A read bandwidth far too low (faked: 1 MB/s) puts every decode above the roofline:
    the run records one warning per engine and the table prints them; the copy roofline
    stays beside it."""
    def slow(threads, nbytes, reps=5, variants=()):
        return {"threads": threads, "bytes": nbytes, "reps": reps, "gbs": 1e-3, "variant": "plain",
                "variants": {"plain": {"flags": 0, "best_gbs": 1e-3, "median_gbs": 1e-3,
                                       "samples_gbs": [1e-3] * reps}}}  # fmt: skip

    monkeypatch.setattr(side_by_side, "measure_read_bandwidth", slow)
    stale = "native/src/core/colibri.c changed after /x/libcolibri.so was built (1970-01-01T00:00:00Z)"
    monkeypatch.setattr(_native, "library_facts", lambda: {"path": "/x/libcolibri.so", "version": "v",
                                                           "built_utc": "1970-01-01T00:00:00Z", "stale": stale})
    args = side_by_side.build_parser().parse_args([
        "--smoke", "--engines", "colibri", "--model-dir", str(model[0]), "--cache-dir",
        str(tmp_path / "cache"), "--prefill", "8", "--decode", "4", "--reps", "1",
        "--bandwidth-mib", "8", "--read-bandwidth-mib", "8", "--no-build", "--precision", "exact"])  # fmt: skip
    args.engines, args.dtype, args.threads = ["colibri"], ["f32"], [2]  # as main() splits them
    res = side_by_side.run(args)
    (cfg,) = res["configs"]
    ent = cfg["engines"]["colibri"]
    assert ent["status"] == "ok" and ent["roofline_fraction"] > 1
    assert cfg["roofline"]["bandwidth_gbs"] == 1e-3
    assert ent["copy_roofline_fraction"] == pytest.approx(
        ent["decode_tok_s"] / cfg["roofline_copy"]["roofline_tok_s"])
    lw, w = res["warnings"]  # the stale library's first, then the engine above the roofline
    assert w.startswith("colibri f32 2t decodes") and "the roofline is wrong" in w
    assert lw == f"the Colibri library is older than its sources: {stale}"
    table = side_by_side.render_table(res)
    assert f"WARNING: {w}" in table and f"WARNING: {lw}" in table
    assert "Colibri library: /x/libcolibri.so (built 1970-01-01T00:00:00Z)" in table
    assert "read bandwidth, 2 threads: 0.0 GB/s (plain;" in table


def test_library_facts_name_a_library_older_than_its_sources(tmp_path, monkeypatch):
    """An editable install is not rebuilt when native/ changes: library_facts() names the
    newest native source when it is newer than the loaded library, and nothing otherwise."""
    fake = tmp_path / "libcolibri.so"
    fake.write_bytes(b"")
    os.utime(fake, (0, 0))  # "built" in 1970: every source of the checkout is newer
    monkeypatch.setattr(_native, "lib_path", fake)
    f = _native.library_facts()
    assert f["path"] == str(fake) and f["built_utc"] == "1970-01-01T00:00:00Z"
    assert f["version"] == _native.version()
    assert f["stale"].startswith("native/") and f"changed after {fake} was built" in f["stale"]
    newest = max((p for p in (REPO / "native").rglob("*") if p.is_file() and p.parts[len(REPO.parts) + 1]
                  in ("src", "include", "CMakeLists.txt")), key=lambda p: p.stat().st_mtime)
    assert f["stale"].startswith(str(newest.relative_to(REPO)) + " ")
    later = newest.stat().st_mtime + 60
    os.utime(fake, (later, later))
    assert _native.library_facts()["stale"] is None


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


def test_serving_multiturn_smoke(model, tmp_path):
    """--workload multiturn --smoke: 2 conversations x 3 turns, each turn resending the history;
    every turn answers, follow-up turns have a TTFT, and colibri_server reports prefix-cache
    hits (the shared system prompt and the earlier turns)."""
    out = tmp_path / "mt.json"
    r = subprocess.run([sys.executable, "-m", "colibri_lab.bench.serving", "--workload", "multiturn", "--smoke",
                        "--model-dir", str(model[0]), "--cache-dir", str(tmp_path / "cache"), "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    s = res["summary"]["colibri"]
    assert s["failed"] == 0 and s["output_tok_s"] > 0, s
    assert s["ttft_first_p50_ms"] > 0 and s["ttft_follow_p50_ms"] > 0
    assert s["cache_hit_rate"] > 0, s
    turns = res["runs"]["colibri"][0]["turns_detail"]
    assert len(turns) == 6 and all(t["tokens"] == 8 for t in turns)
    assert all(t["cached_tokens"] > 0 for t in turns if t["turn"] > 0)
    assert "| colibri |" in r.stdout


# ---------------------------------------------------------------------------------------
# Quantized dtypes: the roofline from a file's tensor directory, the table, the smoke path
# ---------------------------------------------------------------------------------------


def _stored_nbytes(dtype: str, shape) -> int:
    """Bytes of a tensor as stored, from the format's block table (by hand, not the reader)."""
    from colibri_lab.format import spec as fmt

    elems, block_bytes = fmt.DTYPE_BLOCKS[fmt.DTYPE_IDS[dtype]]
    assert shape[-1] % elems == 0
    return math.prod(shape[:-1]) * shape[-1] // elems * block_bytes


def test_file_roofline_counts_each_tensor_as_stored(make_model):
    """A Q4_K_M file (hidden 256: real Q4_K and Q6_K tensors, f32 norms and routers): the
    bytes per decode token are the sum, tensor by tensor, of what one token reads."""
    from colibri_lab.format import reader as fmt_reader
    from colibri_lab import tuning

    L, H, I, E, K, V = 2, 256, 256, 4, 2, 512
    hf, path = make_model(dtype="q4_k_m", vocab=V, hidden=H, inter=I, layers=L, heads=4,
                          kv_heads=2, experts=E, top_k=K)  # fmt: skip
    info = fmt_reader.inspect(path)
    t = {x.name: x for x in info.tensors}
    for x in info.tensors:  # the directory's nbytes are the block table's
        assert x.nbytes == _stored_nbytes(x.dtype, x.shape), x.name
    assert {"q4_k", "q6_k", "f32"} <= {x.dtype for x in info.tensors}  # a real mix
    nb = lambda name: t[name].nbytes  # noqa: E731
    attn = sum(nb(f"blk.{n}.attn_{w}.weight") for n in range(L) for w in ("q", "k", "v", "output"))
    router = sum(nb(f"blk.{n}.ffn_gate_inp.weight") for n in range(L))
    experts = sum(nb(f"blk.{n}.ffn_{w}_exps") // E * K for n in range(L) for w in ("gate", "up", "down"))
    norms = sum(nb(f"blk.{n}.{w}_norm.weight") for n in range(L) for w in ("attn", "ffn"))
    norms += nb("output_norm.weight")
    lm_head, emb_row = nb("output.weight"), nb("token_embd.weight") // V
    assert router == L * E * H * 4 and norms == (2 * L + 1) * H * 4  # f32 in the mix
    want = attn + router + experts + norms + lm_head + emb_row

    roof = tuning.file_decode_roofline(path, 20.0)
    assert roof["bytes_per_token"] == want
    assert roof["parts_bytes"] == {"attention": attn, "router": router, "experts": experts,
                                   "lm_head": lm_head, "embedding_row": emb_row, "norms": norms,
                                   "other": 0}  # fmt: skip
    active = (L * (2 * H * H + 2 * H * H // 2 + E * H + K * 3 * H * I + 2 * H) + H + V * H + H)
    assert roof["active_params"] == active == tuning.decode_roofline(
        tuning.read_hf_config(hf), "f32", 1.0)["active_params"]
    assert roof["bits_per_weight"] == pytest.approx(want * 8 / active)
    assert 4.5 < roof["bits_per_weight"] < 6.6  # Q4_K is 4.5, Q6_K 6.56: between, not a name's
    assert sum(roof["bytes_by_dtype"].values()) == want
    assert roof["roofline_tok_s"] == pytest.approx(20e9 / want)
    assert roof["dtype"] == "q4_k_m" and roof["from_file"] == str(path)
    json.dumps(roof)


def test_file_roofline_of_a_float_file_is_the_config_one(make_model):
    """For an f32 file (tied embeddings: the LM head is token_embd read whole) the
    directory and the config give the same bytes; a quantized dtype name is refused."""
    from colibri_lab import tuning

    hf, path = make_model(tie=True)
    a = tuning.file_decode_roofline(path, 10.0)
    b = tuning.decode_roofline(tuning.read_hf_config(hf), "f32", 10.0)
    assert a["bytes_per_token"] == b["bytes_per_token"] and a["active_params"] == b["active_params"]
    assert a["parts_bytes"]["lm_head"] == b["parts_bytes"]["lm_head"] > 0
    assert a["bits_per_weight"] == 32.0 and a["roofline_tok_s"] == pytest.approx(b["roofline_tok_s"])
    with pytest.raises(ValueError, match="file_decode_roofline"):
        tuning.decode_roofline(tuning.read_hf_config(hf), "q8_0", 10.0)


def test_file_roofline_reads_a_gguf_directory(tmp_path):
    """The same sum over a GGUF's tensors (llama.cpp's names; top-k from
    {arch}.expert_used_count; no output.weight: tied), written with the gguf package."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import quantize

    from colibri_lab import tuning

    Q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    E, K, H, I, V = 4, 2, 64, 32, 96
    p = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_expert_count(E)
    w.add_expert_used_count(K)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    q8 = lambda *shape: quantize(rng.standard_normal(shape).astype(np.float32), Q.Q8_0)  # noqa: E731
    w.add_tensor("token_embd.weight", q8(V, H), raw_dtype=Q.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q8(H, H), raw_dtype=Q.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(H, np.float32))
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.ones((E, H), np.float32))
    w.add_tensor("blk.0.ffn_gate_exps.weight", q8(E, I, H), raw_dtype=Q.Q8_0)
    w.add_tensor("blk.0.ffn_down_exps.weight", q8(E, H, I), raw_dtype=Q.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    q8b = lambda *shape: _stored_nbytes("q8_0", shape)  # noqa: E731
    a = tuning.file_active_bytes(p)
    assert a["top_k"] == K and a["tied_embeddings"] and a["weight_dtype"] == "q8_0"
    assert a["parts_bytes"] == {"attention": q8b(H, H), "router": E * H * 4,
                                "experts": (q8b(E, I, H) + q8b(E, H, I)) // E * K,
                                "lm_head": q8b(V, H), "embedding_row": q8b(1, H),
                                "norms": 2 * H * 4, "other": 0}  # fmt: skip
    assert a["bytes_per_token"] == sum(a["parts_bytes"].values())
    assert a["bytes_by_dtype"]["f32"] == E * H * 4 + 2 * H * 4


def _quant_result() -> dict:
    bw = {"median_gbs": 20.0, "max_gbs": 21.0, "wall_median_gbs": 19.0, "method": "m"}
    roof = {"dtype": "q4_k_m", "bytes_per_token": 148_814_400, "bits_per_weight": 5.1765,
            "file_bits_per_weight": 4.93, "roofline_tok_s": 134.4, "from_file": "/c/m-q4_k_m.colibri",
            "bytes_by_dtype": {"q4_k": 87_294_528, "q6_k": 50_964_480, "f32": 331_776}}  # fmt: skip
    return {"machine": {}, "bandwidth": bw, "model_dir": "d",
            "model": {"model_type": "mixtral", "layers": 1, "hidden": 8, "experts": 2, "top_k": 1,
                      "vocab": 10},
            "loadavg_start": [0.0], "loadavg_end": [0.0], "prefill_tokens": 1, "decode_tokens": 1,
            "reps": 1,
            "configs": [
                {"dtype": "bf16", "threads": 2, "engines": {"colibri": {"status": "ok",
                                                                         "decode_tok_s": 50.0}},
                 "roofline": {"roofline_tok_s": 43.5, "bytes_per_token": 460_003_328,
                              "bits_per_weight": 16.0012}},
                {"dtype": "q4_k_m", "threads": 2, "roofline": roof,
                 "roofline_copy": dict(roof, roofline_tok_s=100.8),
                 "files": {"gguf_source": "llama-quantize Q4_K_M of the f32 GGUF",
                           "colibri_source": "gguf_import of m-q4_k_m.gguf (llama.cpp's bytes)"},
                 "engines": {
                     "colibri": {"status": "ok", "prefill_tok_s": 300.0, "decode_tok_s": 120.0,
                                 "roofline_fraction": 120.0 / 134.4},
                     "llama.cpp": {"status": "ok", "prefill_tok_s": 200.0, "decode_tok_s": 100.0,
                                   "colibri_over_this_prefill": 1.5, "colibri_over_this_decode": 1.2,
                                   "llama_bench_args": ["--repack", "0"],
                                   "llama_bench_note": "llama-bench died of SIGILL; rerun"},
                     "transformers": {"reps": [], "not_applicable": True,
                                      "status": "not applicable: transformers has no q4_k_m weights"},
                 }},
            ]}  # fmt: skip


def test_table_renders_quantized_rows():
    table = side_by_side.render_table(_quant_result())
    rows = [ln for ln in table.splitlines() if ln.startswith("| q4_k_m")]
    assert len(rows) == 3
    header = next(ln for ln in table.splitlines() if ln.startswith("| dtype"))
    n_cols = header.count("|")
    assert "weight MB/token (bits/weight)" in header
    assert all(r.count("|") == n_cols for r in rows), rows  # every row fills the columns
    col, llama, hf = rows
    assert "| 148.8 (5.18) | 134.4 | 89% | 100.8 |" in col  # read roofline, then the copy one
    assert "| llama.cpp (--repack 0) |" in llama and "| 1.50, 1.20 |" in llama
    assert "not applicable: transformers has no q4_k_m weights" in hf
    assert "| 460.0 (16.00) | 43.5 |" in table  # a float row gets the column too
    assert "| 43.5 | — | — |" in table  # no copy roofline given, no fraction: dashes
    assert "q4_k_m: GGUF = llama-quantize Q4_K_M" in table and "gguf_import of" in table
    assert "5.18 bits/weight" in table and "q4_k 87.3, q6_k 51" in table
    assert "llama.cpp q4_k_m 2t: llama-bench died of SIGILL" in table


def test_llama_bench_crash_reruns_without_repack(monkeypatch):
    """llama-bench killed by a signal (ggml's AMX kernels where the VM forbids AMX): the
    configuration reruns with --repack 0 and says so; a second crash is an error."""
    from colibri_lab.bench.llama_cpp import LlamaBenchCrash

    calls = []

    def fake(src, gguf, threads, n_pre, n_dec, extra=(), isa="native"):
        calls.append(tuple(extra))
        if not extra:
            raise LlamaBenchCrash("llama-bench died of SIGILL")
        return {"prefill_tok_s": 1.0, "decode_tok_s": 2.0}

    monkeypatch.setattr(side_by_side, "run_llama_bench", fake)
    ent = {"reps": []}
    assert side_by_side._llama_rep(ent, Path("s"), Path("g"), 2, 8, 4)["decode_tok_s"] == 2.0
    assert side_by_side._llama_rep(ent, Path("s"), Path("g"), 2, 8, 4)["decode_tok_s"] == 2.0
    assert calls == [(), ("--repack", "0"), ("--repack", "0")]
    assert ent["llama_bench_args"] == ["--repack", "0"] and "SIGILL" in ent["llama_bench_note"]

    def always(*a, **k):
        raise LlamaBenchCrash("llama-bench died of SIGSEGV")

    monkeypatch.setattr(side_by_side, "run_llama_bench", always)
    with pytest.raises(LlamaBenchCrash):
        side_by_side._llama_rep(ent, Path("s"), Path("g"), 2, 8, 4)


def test_side_by_side_smoke_quantized_without_llama_cpp(model, tmp_path):
    """--dtype q8_0,q4_k_m with no llama.cpp (CI): Colibri runs its own converter's file
    (and says so), transformers is not applicable, llama.cpp not available; the roofline
    is the Colibri file's directory sum."""
    from colibri_lab import tuning

    empty = tmp_path / "no-llama"
    empty.mkdir()
    out = tmp_path / "q.json"
    r = _run_module("--smoke", "--dtype", "q8_0,q4_k_m", "--model-dir", model[0],
                    "--cache-dir", tmp_path / "cache", "--llama-cpp-dir", empty, "--json", out)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [c["dtype"] for c in res["configs"]] == ["q8_0", "q4_k_m"] and res["quant_from"] == "f32"
    for cfg in res["configs"]:
        eng, files_ = cfg["engines"], cfg["files"]
        assert eng["colibri"]["status"] == "ok", eng["colibri"]
        assert eng["colibri"]["decode_tok_s"] > 0 and eng["colibri"]["prefill_tok_s"] > 0
        assert eng["transformers"]["status"].startswith("not applicable")
        assert eng["llama.cpp"]["status"].startswith("not available")
        assert files_["colibri_source"].startswith(f"colibri_lab.convert --dtype {cfg['dtype']}")
        assert "no GGUF" in files_["colibri_source"]
        roof = cfg["roofline"]
        want = tuning.file_decode_roofline(files_["colibri"], res["bandwidth"]["median_gbs"])
        assert roof["bytes_per_token"] == want["bytes_per_token"] and roof["bits_per_weight"] > 8
        assert eng["colibri"]["roofline_fraction"] == pytest.approx(
            eng["colibri"]["decode_tok_s"] / roof["roofline_tok_s"])
        # the int8 path runs in fast mode: another computation, measured close to exact
        assert eng["colibri fast"]["status"] == "ok" and eng["colibri fast"]["decode_tok_s"] > 0
        acc = cfg["fast_vs_exact"]
        assert 0 < acc["kl_mean"] < 1e-2 and acc["top1"] >= 0.9 and 0 <= acc["routing_flips"] < 0.2
    assert "| q8_0 | 2 | transformers | not applicable" in r.stdout
    assert "(8.5" in r.stdout  # Q8_0: 8.5 bits per weight, plus the f32 norms


def _local_llama_cpp() -> Path | None:
    from colibri_lab.bench.common import default_cache_dir
    from colibri_lab.bench.llama_cpp import _find_llama_src, _llama_bin

    root = Path(os.environ.get("COLIBRI_LLAMA_CPP_DIR", default_cache_dir() / "llama.cpp"))
    src = _find_llama_src(root) if root.is_dir() else None
    if src is None or not all(_llama_bin(src, b).is_file() for b in ("llama-bench", "llama-quantize")):
        return None
    return root


def test_side_by_side_smoke_quantized_with_llama_cpp(model, tmp_path):
    """Where llama.cpp is built locally (never in CI): the q8_0 GGUF is llama-quantize's,
    Colibri imports that very file, and the roofline of both files is the same."""
    root = _local_llama_cpp()
    if root is None:
        pytest.skip("llama.cpp (llama-bench, llama-quantize) is not built locally")
    from colibri_lab import tuning

    out = tmp_path / "q.json"
    r = _run_module("--smoke", "--dtype", "q8_0", "--engines", "colibri,llama.cpp", "--model-dir",
                    model[0], "--cache-dir", tmp_path / "cache", "--llama-cpp-dir", root,
                    "--json", out, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    (cfg,) = json.loads(out.read_text())["configs"]
    f = cfg["files"]
    assert f["llama.cpp"].endswith("-q8_0-from-f32.gguf") and "Q8_0" in f["gguf_source"]
    assert f["colibri_source"].startswith("gguf_import of " + Path(f["llama.cpp"]).name)
    a, b = (tuning.file_active_bytes(f[e]) for e in ("colibri", "llama.cpp"))
    assert a["bytes_per_token"] == b["bytes_per_token"] == cfg["roofline"]["bytes_per_token"]
    assert a["bytes_by_dtype"] == b["bytes_by_dtype"]
    assert cfg["engines"]["colibri"]["status"] == "ok", cfg["engines"]["colibri"]
    assert cfg["engines"]["llama.cpp"]["status"] == "ok", cfg["engines"]["llama.cpp"]


def test_unknown_dtype_is_a_usage_error(tmp_path):
    r = _run_module("--smoke", "--dtype", "f32,q3_k", "--cache-dir", tmp_path)
    assert r.returncode == 2 and "unknown dtype 'q3_k'" in r.stderr and "q4_k_m" in r.stderr


def test_llama_cpp_isa_flags_keep_amx_off():
    """A CPU that lists AMX gets llama.cpp built for its other extensions with AMX off (its AMX
    kernels fault on VMs that advertise AMX without granting it); others get -march=native."""
    from colibri_lab.bench.llama_cpp import isa_flags

    assert isa_flags("flags\t: fpu sse2 avx avx2 fma f16c\n") == ["-DGGML_NATIVE=ON"]
    got = isa_flags("processor: 0\nflags\t: avx avx2 fma f16c avx512f avx512_vnni amx_tile amx_int8\n")
    assert got[0] == "-DGGML_NATIVE=OFF"
    assert "-DGGML_AVX512=ON" in got and "-DGGML_AVX512_VNNI=ON" in got and "-DGGML_AVX512_BF16=OFF" in got
    assert "-DGGML_AMX_INT8=OFF" in got and "-DGGML_AMX_TILE=OFF" in got
    # --isa avx2: an AVX2-only machine's build whatever the CPU lists
    avx2 = isa_flags("flags\t: avx avx2 fma f16c avx512f avx512_vnni avx512_bf16 avx_vnni\n", isa="avx2")
    assert avx2[0] == "-DGGML_NATIVE=OFF"
    assert {"-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VNNI=OFF",
            "-DGGML_AVX512_BF16=OFF", "-DGGML_AVX_VNNI=OFF", "-DGGML_AMX_INT8=OFF"} <= set(avx2)


def test_isa_avx2_limits_colibri_to_its_avx2_tables(model, tmp_path, monkeypatch):
    """--isa avx2 (an AVX2-only machine's kernels on a newer CPU): Colibri's exact and fast rows
    run the avx2 tables, the result, its table and its caption say so, and the environment
    that limited them is put back after the run."""
    if side_by_side.isa_missing("avx2", side_by_side.machine_info().get("simd", [])):
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    monkeypatch.delenv("COLIBRI_KERNELS", raising=False)
    monkeypatch.setenv("COLIBRI_FAST_KERNELS", "reference")
    args = side_by_side.build_parser().parse_args([
        "--smoke", "--engines", "colibri", "--model-dir", str(model[0]), "--cache-dir",
        str(tmp_path / "cache"), "--prefill", "8", "--decode", "4", "--reps", "1", "--isa", "avx2",
        "--bandwidth-mib", "8", "--read-bandwidth-mib", "8", "--no-build"])  # fmt: skip
    args.engines, args.dtype, args.threads = ["colibri"], ["f32"], [2]  # as main() splits them
    res = side_by_side.run(args)
    assert res["isa"] == "avx2"
    (cfg,) = res["configs"]
    assert cfg["engines"]["colibri"]["kernels"] == "avx2"
    assert cfg["engines"]["colibri fast"]["kernels"].startswith("avx2 fast")
    assert not [w for w in res["warnings"] if "kernel table" in w]
    assert "COLIBRI_KERNELS" not in os.environ and os.environ["COLIBRI_FAST_KERNELS"] == "reference"
    assert "instruction sets: avx2 only, both engines" in side_by_side.render_table(res)
    assert "AVX2 only (both engines; the CPU has " in side_by_side.render_summary(res).splitlines()[0]


def test_markdown_summary_of_a_saved_run_names_machine_isa_date_and_commit(capsys):
    """`--from-json` re-prints a saved run's tables without running anything; the README's speed
    tables are this summary of the runs in docs/bench."""
    import json

    from colibri_lab.bench.side_by_side import isa_summary, main

    run = sorted((REPO / "docs" / "bench").glob("side_by_side_*zen4*.json"))[-1]
    res = json.loads(run.read_text())
    assert main(["--from-json", str(run), "--machine-label", "Zen 4 VM"]) == 0
    out = capsys.readouterr().out
    summary = out[out.index("**Zen 4 VM"):]
    caption = summary.splitlines()[0]
    assert res["source"]["git_head"] in caption and res["started_utc"][:10] in caption and "AVX-512" in caption
    rows = [line for line in summary.splitlines() if line.startswith("| ") and "tok/s" not in line]
    n = sum(1 for c in res["configs"] for e in c["engines"].values()
            if not e.get("status", "").startswith(("not available", "not applicable")))
    assert len(rows) == n and any(r.startswith("| Colibri exact, ") and "[" in r for r in rows)
    assert isa_summary(["avx2", "fma"]) == "AVX2 + FMA (no AVX-512)"
    assert isa_summary(["avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile"]) == "AVX-512 + BF16 + VNNI + AMX"
    assert main(["--from-json", str(REPO / "README.md")]) == 1
