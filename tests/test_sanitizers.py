"""The sanitizer job: the engine built with ASan + UBSan (``-DCOLIBRI_SANITIZE=ON``, into
build/asan) runs the C tests with leak detection on; then a slice of this suite (SLICE: the
bad-input, format, tokenizer and parity tests that run every line of the engine's sources
those files run) runs against that library; then a script that drives the Python binding
over every entry point without torch runs with leak detection on.

The Python runs put the interpreter under the sanitizer runtimes (preloaded). The slice
imports torch, whose heap LeakSanitizer takes about two minutes to scan at exit on two
cores, so the slice checks for ASan and UBSan errors only, and leaks are checked by the
torch-free script (and by the C tests). The interpreter and the libraries it loads never free
some memory at exit, and LeakSanitizer reports all of it; so every report is read back and
sorted: an ASan error or a UBSan ``runtime error`` fails the test wherever it is, and a leak
fails it when the memory was allocated by the engine (the allocating frame, the first after
the sanitizer's own, is in libcolibri.so or native/src). Reports go to files (``log_path``),
not into the tests' output."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The slice: the tests of the bad-input, format, tokenizer and Mixtral parity files that,
# together, run every line of native/src/ that the five whole files run (4215 lines, measured
# with a --coverage build of the library: per test, the lines whose gcov counts grew; then the
# cheapest set of tests whose union is the whole). The other tests of those files repeat lines
# these already run (more shapes and lengths through the same kernels, the same tokenizer
# paths on other text) and run without the sanitizers in the suite itself. A test renamed
# here fails the slice (pytest finds no such test).
SLICE = (
    "tests/test_bad_input.py::test_missing_file_and_directory",
    "tests/test_bad_input.py::test_bad_token_ids_and_lengths_lose_nothing",
    "tests/test_bad_input.py::test_header_errors",
    "tests/test_bad_input.py::test_duplicate_names_are_refused",
    "tests/test_bad_input.py::test_fuzzed_metadata_and_directory",
    "tests/test_bad_input.py::test_truncated_at_many_points",
    "tests/test_format.py::test_engine_refuses_quantized_dtype_in_a_version_1_file",
    "tests/test_tokenizer_spm.py::test_basic",
    "tests/test_tokenizer_spm.py::test_errors_and_buffers",
    "tests/test_tokenizer_spm.py::test_corrupt_sections_are_refused_or_safe",
    "tests/test_tokenizer_spm.py::test_other_normalizer_flags_and_user_defined",
    "tests/test_tokenizer_bpe.py::test_invalid_utf8_and_random_decode",
    "tests/test_tokenizer_bpe.py::test_corrupt_sections_refused",
    "tests/test_tokenizer_bpe.py::test_gptoss_style_parity",
    "tests/test_tokenizer_bpe.py::test_dsv3_style_parity",
    "tests/test_tokenizer_bpe.py::test_qwen_style_parity",
    "tests/test_tokenizer_bpe.py::test_gpt2_style_parity",
    "tests/test_tokenizer_bpe.py::test_dsllm_style_parity",
    "tests/test_tokenizer_bpe.py::test_llama3_style_parity",
    "tests/test_tokenizer_bpe.py::test_tekken_parity[tekken_240911.json]",
    "tests/test_tokenizer_kimi.py::test_tiktoken_folder_encodes_as_tiktoken",   # Kimi's Han rules
    "tests/test_tokenizer_kimi.py::test_long_texts_are_encoded_in_the_class_parts",   # its parts
    "tests/test_parity_mixtral.py::test_incremental_equals_full[window-tied]",
    "tests/test_parity_mixtral.py::test_group_padding_does_not_change_logits",
    "tests/test_parity_mixtral.py::test_logits_f32[64-gqa1-e4k1]",
    "tests/test_parity_mixtral.py::test_greedy_generation_equals_transformers[window-tied]",
    "tests/test_parity_mixtral.py::test_logits_f16_weights",
    "tests/test_parity_mixtral.py::test_int8_router_runs_and_mostly_agrees",
    "tests/test_parity_mixtral.py::test_prefill_in_chunks_equals_one_chunk",
    "tests/test_parity_mixtral.py::test_logits_bf16_checkpoint[gqa2-e16k3]",
    "tests/test_parity_mixtral.py::test_greedy_generation_equals_transformers[gqa4-e8k2-v32000]",
)
SAN_OPTIONS = {
    # exitcode=0: the interpreter's own leaks must not fail the child processes the slice
    # starts (test_bad_input opens files in children); every report is read from the logs
    "ASAN_OPTIONS": "detect_leaks=1:halt_on_error=1:abort_on_error=0:exitcode=0:symbolize=1",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1:exitcode=87",
}


def _runtime(name: str) -> str:
    out = subprocess.run(["cc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return out if os.path.isabs(out) and os.path.exists(out) else ""


@pytest.fixture(scope="module")
def asan_build() -> Path:
    if not shutil.which("cmake") or not shutil.which("cc"):
        pytest.skip("cmake and a C compiler are needed")
    if not _runtime("libasan.so") or not _runtime("libubsan.so"):
        if os.environ.get("CI"):
            pytest.fail("the compiler's libasan / libubsan are missing")
        pytest.skip("the compiler has no libasan / libubsan")
    import builds

    try:
        return builds.asan()
    except builds.BuildError as e:
        pytest.fail(str(e))


def _reports(log_dir: Path) -> tuple[list[str], list[str]]:
    """(errors, engine leaks) in the sanitizer logs under log_dir."""
    errors, leaks = [], []
    for f in sorted(log_dir.glob("san.*")):
        text = f.read_text(errors="replace")
        for m in re.finditer(r"^.*(ERROR: AddressSanitizer|runtime error:).*$", text, re.M):
            errors.append(f"{f.name}: {m.group(0)}\n" + text[m.start():m.start() + 3000])
        # one block per leak: "Direct leak of N byte(s) ... allocated from:\n    #0 ...\n    #1 ..."
        for blk in re.split(r"\n(?=(?:Direct|Indirect) leak of )", text):
            if not re.match(r"(?:Direct|Indirect) leak of ", blk):
                continue
            frames = re.findall(r"^\s+#\d+ 0x[0-9a-f]+ (?:in )?(.*)$", blk, re.M)
            own = [fr for fr in frames if not re.search(r"libsanitizer|asan_|interceptor", fr)]
            if own and ("libcolibri" in own[0] or "/native/src/" in own[0]):
                leaks.append(blk[:2000])
    return errors, leaks


def test_c_tests_under_asan_ubsan(asan_build, tmp_path):
    env = dict(os.environ, **SAN_OPTIONS)
    env["ASAN_OPTIONS"] += f":log_path={tmp_path / 'san'}"
    env["UBSAN_OPTIONS"] += f":log_path={tmp_path / 'san'}"
    r = subprocess.run(["ctest", "--output-on-failure", "--timeout", "600"], cwd=asan_build, env=env,
                       capture_output=True, text=True)
    errors, leaks = _reports(tmp_path)
    assert not errors, "\n".join(errors)
    assert not leaks, "\n".join(leaks)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "tests passed" in r.stdout


def _python_env(asan_build: Path, log_dir: Path, leaks: bool) -> dict:
    """The environment of a Python child under the sanitized library, reports into log_dir."""
    env = dict(os.environ, **SAN_OPTIONS)
    if not leaks:
        env["ASAN_OPTIONS"] = env["ASAN_OPTIONS"].replace("detect_leaks=1", "detect_leaks=0")
    for k in ("ASAN_OPTIONS", "UBSAN_OPTIONS"):
        env[k] += f":log_path={log_dir / 'san'}"
    env["COLIBRI_LIB"] = str(asan_build / "libcolibri.so")
    env["LD_PRELOAD"] = " ".join(filter(None, [_runtime("libasan.so"), _runtime("libubsan.so")]))
    env.pop("PYTEST_ADDOPTS", None)
    return env


def test_python_slice_under_asan_ubsan(asan_build, tmp_path):
    """The slice against the sanitized library: every test passes, no ASan error, no UBSan
    runtime error (leaks: test_binding_leaks_nothing below)."""
    env = _python_env(asan_build, tmp_path, leaks=False)
    # HF's reference ids of the tokenizer parity tests, from an unsanitized run of those tests
    # (tests/test_tokenizer_bpe.py _reference): the sanitized run then only runs the engine
    refs = tmp_path / "refs"
    refs.mkdir()
    env["COLIBRI_TEST_REF_CACHE"] = str(refs)
    parity = [t for t in SLICE if t.startswith("tests/test_tokenizer_bpe.py::") and "_parity" in t]
    plain = dict(os.environ, COLIBRI_TEST_REF_CACHE=str(refs))
    plain.pop("PYTEST_ADDOPTS", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *parity], cwd=REPO,
                       env=plain, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    junit = tmp_path / "slice.xml"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                        # the tokenizer's speed report measures nothing under ASan
                        "-k", "not speed_report", *SLICE],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)  # fmt: skip
    errors, leaks = _reports(tmp_path)
    assert not errors, "\n".join(errors)
    assert not leaks, "\n".join(leaks)
    assert junit.exists(), f"pytest did not finish (rc {r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n, fails, errs = (int(suite.get(a, 0)) for a in ("tests", "failures", "errors"))
    assert fails == 0 and errs == 0, r.stdout[-6000:]
    assert n - int(suite.get("skipped", 0)) >= 20, f"only {n} tests ran:\n{r.stdout[-3000:]}"


# Every entry point of the binding, torch-free, on small files the test converts (f32, bf16,
# q8_0; exact and fast; an expert cache): loads, forwards, decode, batches and forks, traces,
# stage runs, generation, the tokenizer, and the error paths (bad ids, an over-long prompt, a
# corrupt and a truncated file, a bad option).
BINDING_SCRIPT = r"""
import sys
from pathlib import Path
import numpy as np
import colibri_lab
from colibri_lab import ColibriError, Engine

assert "torch" not in sys.modules
files = [Path(p) for p in sys.argv[1:]]
for path, kw in [(p, kw) for p in files for kw in ({}, {"precision": "fast"})] + [
        (files[0], {"expert_cache_slots": 3, "expert_cache_policy": "predict"})]:
    with Engine(path, num_threads=2, max_seq_len=96, max_batch=16, max_seqs=4, **kw) as eng:
        V = eng.vocab_size
        ids = np.random.default_rng(0).integers(3, V, size=40).tolist()
        full = eng.forward(ids)
        eng.forward(ids[:20])
        for p in range(20, 24):
            eng.forward(ids[p:p + 1], p)
        a = eng.sequence(1)
        a.append(ids[:10])
        b = a.fork(2)
        b.truncate(5)
        eng.batch([(1, ids[10:12]), (2, ids[5:9]), (3, ids[:3])], logits="all")
        with eng.trace() as tr:
            eng.forward(ids[:12])
        assert tr.topk_ids.shape[1] == 12
        run = eng.stages(ids[:6])
        run.run()
        out = run.finish()
        toks = [t.id for t in eng.generate(ids[:8], 6, temperature=0.8, top_k=20, seed=1)]
        if eng._has_tokenizer():
            tok = eng.tokenizer
            tok.decode(tok.encode("The quick brown fox"))
        for bad in ([V + 5], [-1], list(range(3, 200))):
            try:
                eng.forward(bad)
            except ColibriError:
                pass
            else:
                raise AssertionError(f"{bad[:3]}... was accepted")
    eng2 = Engine(path)  # closed by the garbage collector, not by close()
    eng2.forward(ids[:4])
    del eng2
raw = files[0].read_bytes()
bad_dir = files[0].parent / "bad"
bad_dir.mkdir(exist_ok=True)
for name, data in (("truncated", raw[: len(raw) // 3]),
                   ("corrupt", raw[:4096] + bytes(b ^ 0x5A for b in raw[4096:8192]) + raw[8192:])):
    f = bad_dir / f"{name}.colibri"
    f.write_bytes(data)
    try:
        Engine(f, verify_checksums=True).forward([3])
    except ColibriError:
        pass
    else:
        assert name == "corrupt", "a truncated file opened"
try:
    Engine(files[0], max_seq_len=-3)
except (ColibriError, ValueError):
    pass
print("binding ok")
"""


def test_binding_leaks_nothing(asan_build, tmp_path):
    """The Python binding over the sanitized library, leak detection on: no ASan error, no
    UBSan runtime error, no leak allocated by the engine, through every entry point and the
    error paths (BINDING_SCRIPT)."""
    from colibri_lab.conversion.hf import convert

    files = []
    for dtype in ("f32", "bf16", "q8_0"):
        out = tmp_path / f"tiny-{dtype}.colibri"
        convert(REPO / "data" / "tiny-mixtral", out, dtype=dtype, progress=False)
        files.append(str(out))
    logs = tmp_path / "logs"
    logs.mkdir()
    r = subprocess.run([sys.executable, "-c", BINDING_SCRIPT, *files], cwd=REPO,
                       env=_python_env(asan_build, logs, leaks=True), capture_output=True, text=True,
                       timeout=900)  # fmt: skip
    errors, leaks = _reports(logs)
    assert not errors, "\n".join(errors)
    assert not leaks, "\n".join(leaks)
    assert r.returncode == 0 and "binding ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
