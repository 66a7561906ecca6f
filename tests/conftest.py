"""Session fixtures shared by the test files: the repository root and a factory of small
random Mixtral checkpoints converted to .colibri.

    def test_x(make_model):
        hf_dir, path = make_model()                       # the default small model
        hf_dir, path = make_model(vocab=1003, dtype="bf16")

``make_model(**shape)`` takes the fields of ``colibri_lab.bench.models.MixtralShape`` (vocab, hidden, inter,
layers, heads, kv_heads, head_dim, experts, top_k, sliding_window, tie, max_pos, std,
seed) plus ``dtype`` ("f32", "f16", "bf16") for the converter. The Hugging Face folder is
built once per shape and the .colibri file once per (shape, dtype), for the whole session.
A 32000-entry vocabulary gets the real Mixtral tokenizer (tokenizer.model).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# The default test model: the real Mixtral vocabulary (so text round-trips through the
# real tokenizer), everything else tiny. Sizes are multiples of 4 so transformers' CPU
# grouped_mm works on it as well.
DEFAULT_SHAPE = dict(vocab=32000, hidden=64, inter=96, layers=2, heads=4, kv_heads=2,
                     experts=4, top_k=2, max_pos=256, seed=0)  # fmt: skip


def pytest_sessionstart(session):
    """Refuse to test a library older than the checkout's native sources: an editable install
    is not rebuilt when native/ changes, and every test of the engine would then pass or fail
    on code that is not this tree's (runtime._native.library_facts names the newer file)."""
    if hasattr(session.config, "workerinput"):  # xdist workers: the controller checked
        return
    try:
        from colibri_lab.runtime._native import library_facts

        stale = library_facts()["stale"]
    except Exception:  # no library at all: the tests that need one say so themselves
        return
    if stale:
        pytest.exit(f"the Colibri library under test is stale: {stale}", returncode=4)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


NATIVE_TESTS_BUILD = REPO_ROOT / "build" / "native"  # the folder `make test` builds (pip and ctest)


@pytest.fixture(scope="session")
def native_tests() -> Path:
    """The C test programs that need a model file (test_noalloc, test_format), built from
    THIS tree: `make test`'s build folder is configured and built again (incrementally:
    seconds when it is current), so a stale build left by another checkout or an older
    commit is never what gets tested."""
    from builds import build_lock

    flags = ["-DCOLIBRI_BUILD_TESTS=ON", "-DCOLIBRI_WERROR=ON", "-DCMAKE_BUILD_TYPE=Release"]
    with build_lock(NATIVE_TESTS_BUILD):
        subprocess.run(["cmake", "-S", str(REPO_ROOT / "native"), "-B", str(NATIVE_TESTS_BUILD), *flags],
                       check=True, capture_output=True)
        subprocess.run(["cmake", "--build", str(NATIVE_TESTS_BUILD), "--target", "test_noalloc",
                        "test_format"], check=True, capture_output=True)
    return NATIVE_TESTS_BUILD


def _tokenizer_model() -> Path:
    """The Mixtral SentencePiece model: data/tokenizer.model.v1, else the copy inside the
    mistral-common wheel (a test dependency)."""
    p = REPO_ROOT / "data" / "tokenizer.model.v1"
    if p.is_file():
        return p
    import mistral_common

    return Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"


@pytest.fixture(scope="session")
def tokenizer_model() -> Path:
    p = _tokenizer_model()
    if not p.is_file():
        pytest.fail(f"the Mixtral tokenizer model is missing ({p})")
    return p


@pytest.fixture(scope="session")
def make_model(tmp_path_factory, tokenizer_model):
    """Factory: make_model(**shape) -> (hf_dir, colibri_path), cached per shape."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import colibri_lab
    from colibri_lab.bench.models import MixtralShape, build_model

    folders: dict[tuple, Path] = {}
    files: dict[tuple, Path] = {}

    def make(**kw) -> tuple[Path, Path]:
        dtype = kw.pop("dtype", "f32")
        shape = MixtralShape(**{**DEFAULT_SHAPE, **kw})
        key = tuple(sorted((k, repr(v)) for k, v in vars(shape).items()))
        if key not in folders:
            d = tmp_path_factory.mktemp("hf")
            model = build_model(shape)
            model.save_pretrained(d)
            if shape.vocab == 32000:
                shutil.copy(tokenizer_model, d / "tokenizer.model")
            folders[key] = d
        hf_dir = folders[key]
        if (key, dtype) not in files:
            out = hf_dir.parent / f"{hf_dir.name}-{dtype}.colibri"
            colibri_lab.convert(hf_dir, out, dtype=dtype, progress=False)
            files[(key, dtype)] = out
        return hf_dir, files[(key, dtype)]

    return make


@pytest.fixture(scope="session")
def gguf_models(tmp_path_factory):
    """The GGUFs llama.cpp's convert_hf_to_gguf.py makes for test_gguf_import.py and
    test_gguf_families.py: one converter process per session, whichever xdist worker asks
    first (tests/gguf_shared.py)."""
    pytest.importorskip("torch")
    pytest.importorskip("tokenizers")
    pytest.importorskip("gguf")
    from gguf_shared import shared_ggufs

    return shared_ggufs(tmp_path_factory)


def find_tool(name: str, env_var: str, how: str) -> str:
    """A program of the package: $env_var, else beside this Python (pip puts the package's
    programs in the venv's bin/), else on PATH; a test failure saying `how` to get it."""
    env = os.environ.get(env_var)
    if env:
        return env
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} not found: {how}, or set {env_var}")
    return found


@pytest.fixture(scope="session")
def cli_path() -> str:
    """colibri_cli: $COLIBRI_CLI, else beside this Python, else on PATH."""
    return find_tool("colibri_cli", "COLIBRI_CLI", "install the package with `pip install -e .`")


# `make test` hands whole files to the workers (pytest -n, --dist loadfile) in this order:
# the longest first, so that no long file starts last and leaves one core alone at the end (and
# test_gguf_import's download of llama.cpp's source overlaps the builds).
LONGEST_FIRST = ("test_sanitizers.py", "test_aarch64.py", "test_cuda_build.py", "test_gguf_import.py", "test_bench.py",
                 "test_browser.py", "03_tuning.ipynb", "test_fuzz.py", "test_server.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: order within a file kept

