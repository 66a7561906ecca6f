"""The libFuzzer harnesses in a short smoke run (CI): native/tests/fuzz_server_api.c over
colibri_server's request handling and native/tests/fuzz_colibri.c over the file loader,
tokenizers and forward pass, each built with clang, libFuzzer, ASan and UBSan and run for
a few seconds from a small seed corpus. A crash, a leak, an out-of-bounds access or
undefined behaviour fails the test with libFuzzer's report. Longer runs by hand: the
commands at the top of each harness."""

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
SECONDS = int(os.environ.get("COLIBRI_FUZZ_SECONDS", "15"))


@pytest.fixture(scope="module")
def fuzzers() -> Path:
    if not shutil.which("clang"):
        if os.environ.get("CI"):
            pytest.fail("clang is missing: make test installs clang and libclang-rt-14-dev")
        pytest.skip("clang is not installed (make test installs it)")
    subprocess.run(["cmake", "-S", str(REPO / "native"), "-B", str(BUILD), "-DCMAKE_C_COMPILER=clang",
                    "-DCOLIBRI_FUZZ=ON", "-DCMAKE_BUILD_TYPE=RelWithDebInfo"], check=True, capture_output=True)
    r = subprocess.run(["cmake", "--build", str(BUILD), "-j", str(os.cpu_count() or 2), "--target",
                        "fuzz_server_api", "fuzz_colibri"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return BUILD


def _run(exe: Path, corpus: Path, env: dict, *extra: str) -> None:
    r = subprocess.run([str(exe), str(corpus), f"-max_total_time={SECONDS}", "-rss_limit_mb=3072",
                        "-print_final_stats=1", *extra], env={**os.environ, **env}, capture_output=True,
                       text=True, timeout=SECONDS + 300)
    assert r.returncode == 0, r.stderr[-6000:]
    assert "Done" in r.stderr and "stat::number_of_executed_units" in r.stderr, r.stderr[-3000:]


def test_fuzz_server_request_handling(fuzzers, tmp_path):
    from test_chat_template import MIXTRAL_8X7B_INSTRUCT

    hf = tmp_path / "hf"
    shutil.copytree(REPO / "data" / "tiny-mixtral", hf)
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    cfg["chat_template"] = MIXTRAL_8X7B_INSTRUCT
    (hf / "tokenizer_config.json").write_text(json.dumps(cfg))
    model = colibri_lab.convert(hf, tmp_path / "chat.colibri", dtype="bf16", progress=False)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    seeds = [
        (0, {"model": "fuzz", "prompt": "def f(x):", "max_tokens": 3, "temperature": 0.5, "seed": 1,
             "stop": ["\n", "x"], "logprobs": 2, "echo": True, "n": 2}),
        (0, {"prompt": [1, 415, 2936], "max_tokens": 2, "stream": True, "top_p": 0.9, "top_k": 5}),
        (1, {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi é"}],
             "max_tokens": 4, "logprobs": True, "top_logprobs": 3, "stream": True}),
        (1, {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                          {"role": "user", "content": "c"}], "stop": "c", "seed": 7}),
    ]
    for i, (kind, body) in enumerate(seeds):
        (corpus / f"seed{i}").write_bytes(bytes([kind]) + json.dumps(body).encode())
    _run(fuzzers / "fuzz_server_api", corpus, {"COLIBRI_FUZZ_MODEL": str(model)}, "-max_len=4096")


def test_fuzz_model_files(fuzzers, tmp_path):
    pytest.importorskip("torch")
    from hf_models import Shape, build_model, save_checkpoint

    folder = save_checkpoint(build_model(Shape(vocab=300, hidden=16, inter=8, layers=2, heads=2, kv_heads=1,
                                               experts=4, top_k=2)), tmp_path / "hf")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    colibri_lab.convert(folder, corpus / "small.colibri", dtype="bf16", quantize_router="int8", progress=False)
    # a version 2 seed: Q8_0 blocks and split FFNs (rows of 32, so the blocks are really used)
    folder2 = save_checkpoint(build_model(Shape(vocab=300, hidden=32, inter=32, layers=2, heads=2, kv_heads=1,
                                                experts=4, top_k=2, seed=1)), tmp_path / "hf2")
    q8 = colibri_lab.convert(folder2, corpus / "small-q8_0.colibri", dtype="q8_0", progress=False)
    assert colibri_lab.format.inspect(q8).version == 2
    _run(fuzzers / "fuzz_colibri", corpus, {}, "-max_len=200000")
