"""The sanitizer job: the engine built with ASan + UBSan (``-DCOLIBRI_SANITIZE=ON``, into
build/asan) runs the C tests, then a slice of this suite (the bad-input, format, tokenizer
and parity tests) runs against that library, with leak detection on.

The Python slice runs the interpreter with the sanitizer runtimes preloaded. The
interpreter and the libraries it loads (torch, numpy, OpenSSL, ...) never free some memory
at exit, and LeakSanitizer reports all of it; so every report is read back and sorted: an
ASan error or a UBSan ``runtime error`` fails the test wherever it is, and a leak fails it
when the memory was allocated by the engine (the allocating frame, the first after the
sanitizer's own, is in libcolibri.so or native/src). Reports go to files (``log_path``), not into the
tests' output."""

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
BUILD = REPO / "build" / "asan"
SLICE = ("tests/test_bad_input.py", "tests/test_format.py", "tests/test_tokenizer_spm.py",
         "tests/test_tokenizer_bpe.py", "tests/test_parity_mixtral.py")
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
    r = subprocess.run(["cmake", "-S", str(REPO / "native"), "-B", str(BUILD), "-DCOLIBRI_SANITIZE=ON",
                        "-DCOLIBRI_BUILD_TESTS=ON", "-DCOLIBRI_WERROR=ON", "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
                        # -O1: the SIMD kernel files take 6 min to compile at -O2 under ASan on 2
                        # cores, 1 min at -O1
                        "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    tests = sorted(p.stem for p in (REPO / "native" / "tests").glob("test_*.c"))
    r = subprocess.run(["cmake", "--build", str(BUILD), "-j", str(os.cpu_count() or 2), "--target",
                        "colibri_shared", *tests], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return BUILD


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


def test_python_slice_under_asan_ubsan(asan_build, tmp_path):
    """The slice against the sanitized library: every test passes, no ASan error, no UBSan
    runtime error, no leak allocated by the engine."""
    env = dict(os.environ, **SAN_OPTIONS)
    for k in ("ASAN_OPTIONS", "UBSAN_OPTIONS"):
        env[k] += f":log_path={tmp_path / 'san'}"
    env["COLIBRI_LIB"] = str(asan_build / "libcolibri.so")
    env["LD_PRELOAD"] = " ".join(filter(None, [_runtime("libasan.so"), _runtime("libubsan.so")]))
    env.pop("PYTEST_ADDOPTS", None)
    junit = tmp_path / "slice.xml"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                        *SLICE], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    errors, leaks = _reports(tmp_path)
    assert not errors, "\n".join(errors)
    assert not leaks, "\n".join(leaks)
    assert junit.exists(), f"pytest did not finish (rc {r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n, fails, errs = (int(suite.get(a, 0)) for a in ("tests", "failures", "errors"))
    assert fails == 0 and errs == 0, r.stdout[-6000:]
    assert n - int(suite.get("skipped", 0)) >= 20, f"only {n} tests ran:\n{r.stdout[-3000:]}"
