"""The CUDA backend builds (docs/backends.md): -DCOLIBRI_CUDA=ON with warnings as errors, on any
machine with nvcc, GPU or not.

Builds libcolibri.so with the CUDA backend into build/cuda-ci (incrementally when it is there;
only the library target, CMAKE_CUDA_ARCHITECTURES 80;90), then checks:
- the library exports colibri_abi_version and nothing but the colibri_* API (no CUDA runtime
  symbols leak out of the static cudart);
- backend="cuda" on data/tiny-mixtral (bf16): without a CUDA device, a clean
  COLIBRI_E_UNSUPPORTED whose message says "no CUDA device"; with one, it opens and says
  backend "cuda";
- the cpu backend of that same CUDA-built library gives the default build's logits, bitwise.

Each library is loaded in a child Python (COLIBRI_LIB set there), so this module never decides
which library the rest of the suite loads. Skipped, with one line saying why, without nvcc.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REF_BUILD = REPO / "build" / "cuda-ci-ref"


import builds  # noqa: E402

NVCC = builds.nvcc()
if NVCC is None:
    pytest.skip("nvcc not found (PATH, /usr/local/cuda/bin): the CUDA backend's build is not checked here",
                allow_module_level=True)  # fmt: skip


def _env() -> dict:
    return builds.cuda_env()


@pytest.fixture(scope="module")
def cuda_lib() -> Path:
    t0 = time.monotonic()
    try:
        build = builds.cuda()
    except builds.BuildError as e:
        pytest.fail(str(e))
    log = build / "build.log"
    assert log.is_file(), f"{log}: the build's compiler output is missing (remove {build} and run again)"
    warn = [ln for ln in log.read_text().splitlines() if "warning" in ln.lower() and "cuda" in ln.lower()]
    assert not warn, "warnings in the CUDA build:\n" + "\n".join(warn[:20])
    print(f"CUDA build: {time.monotonic() - t0:.1f} s (0 when make test built it in the background)")
    lib = build / "libcolibri.so"
    assert lib.is_file()
    return lib


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory) -> Path:
    import colibri_lab

    out = tmp_path_factory.mktemp("cuda_build") / "tiny-bf16.colibri"
    colibri_lab.convert(REPO / "data" / "tiny-mixtral", out, dtype="bf16", progress=False, tokenizer="none")
    return out


# The child: open the model with a backend through the low-level ctypes API, print JSON.
CHILD = r"""
import ctypes, json, sys
import numpy as np
from colibri_lab.runtime import _native as N
path, backend = sys.argv[1], int(sys.argv[2])
lib = N.lib
opt = N.ColibriOptions()
lib.colibri_options_init(ctypes.cast(ctypes.byref(opt), ctypes.c_void_p))
opt.backend = backend
opt.max_seq_len = 64
opt.num_threads = 1
ctx = N.ctx_p()
err = ctypes.create_string_buffer(1024)
st = lib.colibri_init_ex(path.encode(), ctypes.byref(opt), ctypes.byref(ctx), err, len(err))
out = {"lib": str(N.lib_path), "status": int(st), "message": err.value.decode(errors="replace")}
if st == 0:
    name = ctypes.c_char_p()
    lib.colibri_get_string(ctx, b"backend", ctypes.byref(name))
    out["backend"] = name.value.decode() if name.value else None
    ids = (ctypes.c_int32 * 5)(1, 415, 2936, 9060, 285)
    vocab = ctypes.c_int64()
    lib.colibri_get_int(ctx, b"vocab_size", ctypes.byref(vocab))
    logits = np.zeros((5, vocab.value), dtype=np.float32)
    fst = lib.colibri_forward(ctx, ids, 5, logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
    out["forward"] = int(fst)
    out["logits"] = logits.tobytes().hex() if fst == 0 else None
    lib.colibri_free(ctx)
print("RESULT " + json.dumps(out))
"""


def _child(lib: Path | None, model: Path, backend: int) -> dict:
    env = _env()
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if lib is None:
        env.pop("COLIBRI_LIB", None)
    else:
        env["COLIBRI_LIB"] = str(lib)
    r = subprocess.run([sys.executable, "-c", CHILD, str(model), str(backend)], capture_output=True, text=True,
                       env=env, timeout=300)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"child failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def _ref_lib() -> Path:
    """The default (CPU-only) library: the one colibri_lab loads by itself, else a build of it."""
    env = _env()
    env.pop("COLIBRI_LIB", None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", "from colibri_lab.runtime import _native; print(_native.lib_path)"],
                       capture_output=True, text=True, env=env)
    if r.returncode == 0 and r.stdout.strip() and Path(r.stdout.strip().splitlines()[-1]).is_file():
        return Path(r.stdout.strip().splitlines()[-1])
    for cmd in (["cmake", "-S", str(REPO / "native"), "-B", str(REF_BUILD), "-DCMAKE_BUILD_TYPE=Release"],
                ["cmake", "--build", str(REF_BUILD), "--target", "colibri_shared", "-j", str(os.cpu_count() or 2)]):
        subprocess.run(cmd, check=True, capture_output=True, env=env)
    return REF_BUILD / "libcolibri.so"


def test_exports(cuda_lib):
    r = subprocess.run(["nm", "-D", "--defined-only", str(cuda_lib)], capture_output=True, text=True, check=True)
    names = [ln.split()[-1] for ln in r.stdout.splitlines() if ln.strip()]
    assert "colibri_abi_version" in names
    stray = [n for n in names if not n.startswith("colibri_") and not n.startswith("_")]
    stray += [n for n in names if "cuda" in n.lower() or n.startswith("__cuda")]
    assert not stray, f"libcolibri.so exports more than the colibri_* API: {stray[:20]}"


def test_cuda_backend_opens_or_refuses(cuda_lib, tiny_bf16):
    res = _child(cuda_lib, tiny_bf16, 1)
    assert Path(res["lib"]).resolve() == cuda_lib.resolve()
    if res["status"] != 0:
        assert res["status"] == 6, res  # COLIBRI_E_UNSUPPORTED
        assert "no CUDA device" in res["message"], res["message"]
        assert "\n" not in res["message"]
    else:
        assert res["backend"] == "cuda"
        assert res["forward"] == 0, res


def test_cpu_backend_of_the_cuda_build(cuda_lib, tiny_bf16):
    ref = _child(_ref_lib(), tiny_bf16, 0)
    got = _child(cuda_lib, tiny_bf16, 0)
    assert ref["status"] == 0 and got["status"] == 0, (ref["message"], got["message"])
    assert got["backend"] == "cpu"
    assert ref["forward"] == 0 and got["forward"] == 0
    assert got["logits"] == ref["logits"], "the cpu backend of the CUDA build differs from the default build"
