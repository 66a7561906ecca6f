"""The libFuzzer targets in a short smoke run (CI), from the seed corpus kept in the repository.

Five targets (native/tests/): fuzz_loader (the .colibri file loader, forward pass and the
model's tokenizer), fuzz_tokenizer (the SentencePiece-BPE and byte-level BPE tokenizers from a
section), fuzz_grammar (the JSON-schema compiler and the grammar's token masks), fuzz_server_api
(colibri_server's request handling) and fuzz_chat_output (colibri_server's parser of reasoning
and tool calls, and the required-call constraint), built by `tools/fuzz.sh build`
with clang, libFuzzer, ASan and UBSan into build/fuzz/bin. Each runs COLIBRI_FUZZ_SECONDS
(default 6) from a copy of native/tests/fuzz_corpus/<target>/ (CI never writes into the
repository), and every committed seed and regression input (…/<target>/regressions/) is run
once. A crash, a leak, an out-of-bounds access, undefined behaviour or a timeout fails the
test with libFuzzer's report. Long runs by hand: `make fuzz` (tools/fuzz.sh, 600 s a target)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import colibri_lab

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "build" / "fuzz"
CORPUS = REPO / "native" / "tests" / "fuzz_corpus"
SECONDS = int(os.environ.get("COLIBRI_FUZZ_SECONDS", "6"))
TARGETS = {"loader": ("fuzz_loader", 70000), "tokenizer": ("fuzz_tokenizer", 32768),
           "grammar": ("fuzz_grammar", 4096), "server": ("fuzz_server_api", 4096),
           "chat": ("fuzz_chat_output", 4096)}


def _files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".") and p.suffix != ".md")


@pytest.fixture(scope="module")
def fuzzers() -> Path:
    if not shutil.which("clang"):
        if os.environ.get("CI"):
            pytest.fail("clang is missing: make test installs clang and libclang-rt-14-dev")
        pytest.skip("clang is not installed (make test installs it)")
    r = subprocess.run(["bash", str(REPO / "tools" / "fuzz.sh"), "build"], capture_output=True, text=True,
                       env={**os.environ, "FUZZ_BUILD": str(BUILD)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return BUILD / "bin"


@pytest.fixture(scope="module")
def server_model(tmp_path_factory) -> Path:
    """data/tiny-mixtral (SentencePiece tokenizer) with the Mixtral-Instruct chat template."""
    from test_chat_template import MIXTRAL_8X7B_INSTRUCT

    tmp = tmp_path_factory.mktemp("fuzz-model")
    hf = tmp / "hf"
    shutil.copytree(REPO / "data" / "tiny-mixtral", hf)
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    cfg["chat_template"] = MIXTRAL_8X7B_INSTRUCT
    (hf / "tokenizer_config.json").write_text(json.dumps(cfg))
    return Path(colibri_lab.convert(hf, tmp / "chat.colibri", dtype="bf16", progress=False))


def _exe(fuzzers: Path, target: str, request) -> tuple[Path, dict]:
    exe = fuzzers / TARGETS[target][0]
    if not exe.exists():
        if target in ("server", "chat") and not os.environ.get("CI"):
            pytest.skip(f"{exe.name} not built (jansson missing: apt-get install libjansson-dev)")
        pytest.fail(f"{exe} was not built")
    env = {"COLIBRI_FUZZ_MODEL": str(request.getfixturevalue("server_model"))} if target == "server" else {}
    return exe, env


def _libfuzzer(exe: Path, args: list[str], env: dict, cwd: Path, timeout: int) -> str:
    r = subprocess.run([str(exe), *args], env={**os.environ, **env}, cwd=cwd, capture_output=True, text=True,
                       errors="replace", timeout=timeout)
    assert r.returncode == 0, f"{exe.name} exited {r.returncode}:\n{r.stderr[-8000:]}"
    return r.stderr


def test_corpus_is_committed_and_small():
    total = 0
    for target in TARGETS:
        seeds = _files(CORPUS / target)
        assert len(seeds) >= 2, f"no seeds in {CORPUS / target}"
        assert (CORPUS / target / "regressions").is_dir(), f"{target}/regressions/ is missing"
        total += sum(p.stat().st_size for p in seeds + _files(CORPUS / target / "regressions"))
    assert total < 1 << 20, f"the committed corpus is {total} bytes (keep it under 1 MiB)"


@pytest.mark.parametrize("target", list(TARGETS))
def test_seeds_and_regressions_replay(fuzzers, target, request, tmp_path):
    """Every committed seed and every regression input (a crash once found) runs clean."""
    exe, env = _exe(fuzzers, target, request)
    files = _files(CORPUS / target) + _files(CORPUS / target / "regressions")
    err = _libfuzzer(exe, [f"-artifact_prefix={tmp_path}/", "-rss_limit_mb=3072", "-timeout=60",
                           *map(str, files)], env, tmp_path, 600)
    assert err.count("Executed ") == len(files), err[-3000:]


@pytest.mark.parametrize("target", list(TARGETS))
def test_fuzz_smoke(fuzzers, target, request, tmp_path):
    """COLIBRI_FUZZ_SECONDS of fuzzing from a copy of the committed seeds."""
    exe, env = _exe(fuzzers, target, request)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for p in _files(CORPUS / target):
        shutil.copy(p, corpus / p.name)
    err = _libfuzzer(exe, [str(corpus), f"-max_total_time={SECONDS}", f"-max_len={TARGETS[target][1]}",
                           "-rss_limit_mb=3072", "-timeout=60", f"-artifact_prefix={tmp_path}/",
                           "-print_final_stats=1"], env, tmp_path, SECONDS + 300)
    assert "Done" in err and "stat::number_of_executed_units" in err, err[-3000:]
