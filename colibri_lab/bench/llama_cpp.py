"""llama.cpp: built from the llama-cpp-python sdist, its GGUF converter, llama-bench."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from .common import _say
from .files import _model_key

LLAMA_TARGETS = ("llama-bench", "llama-quantize", "llama-completion", "llama-server")


def _find_llama_src(root: Path) -> Path | None:
    """The llama.cpp source tree under `root`: root itself, or an unpacked sdist's
    vendor/llama.cpp (real path: through a symlink its .git file breaks ninja)."""
    if (root / "convert_hf_to_gguf.py").is_file():
        return root.resolve()
    for cand in sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp"), reverse=True):
        if (cand / "convert_hf_to_gguf.py").is_file():
            return cand.resolve()
    return None


def _llama_bin(src: Path, name: str) -> Path:
    return src / "build" / "bin" / name


def ensure_llama_cpp(root: Path, build: bool) -> Path:
    """The llama.cpp source tree with llama-bench built; downloads the sdist and builds
    when `build` (raises RuntimeError saying why when it cannot)."""
    root = Path(root).expanduser()
    src = _find_llama_src(root) if root.is_dir() else None
    if src and _llama_bin(src, "llama-bench").is_file():
        return src
    if not build:
        raise RuntimeError(f"llama.cpp is not built in {root} (a full run without --smoke "
                           "and without --no-build builds it, about 6.5 min on 2 cores)")
    for tool in ("cmake", "ninja"):
        if not shutil.which(tool):
            raise RuntimeError(f"{tool} not found on PATH (pip install {tool})")
    root.mkdir(parents=True, exist_ok=True)
    if src is None:
        sdists = sorted(root.glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            # pip prepares the sdist's metadata with its build backend; in an isolated
            # build environment --no-binary :all: would hold for that backend (and cmake,
            # ninja) too, so the installed scikit-build-core does it instead
            if importlib.util.find_spec("scikit_build_core") is None:
                raise RuntimeError("scikit-build-core is not installed (pip install "
                                   "scikit-build-core cmake ninja)")  # fmt: skip
            _say(f"downloading the llama-cpp-python sdist into {root}")
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                            ":all:", "--no-build-isolation", "llama-cpp-python", "-d", str(root)],
                           check=True, stdout=subprocess.DEVNULL)  # fmt: skip
            sdists = sorted(root.glob("llama_cpp_python-*.tar.gz"))
            if not sdists:
                raise RuntimeError("pip download gave no llama-cpp-python sdist")
        with tarfile.open(sdists[-1]) as tf:
            tf.extractall(root, filter="data") if sys.version_info >= (3, 12) else tf.extractall(root)
        src = _find_llama_src(root)
        if src is None:
            raise RuntimeError(f"{sdists[-1]} holds no vendor/llama.cpp")
    _say(f"building llama.cpp in {src}/build (once; about 6.5 min on 2 cores)")
    log = root / "build.log"
    with open(log, "ab") as f:
        subprocess.run(["cmake", "-S", str(src), "-B", str(src / "build"), "-G", "Ninja",
                        "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_OPENSSL=OFF",
                        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"],
                       check=True, stdout=f, stderr=subprocess.STDOUT)  # fmt: skip
        subprocess.run(["cmake", "--build", str(src / "build"), "-j", "2", "--target",
                        *LLAMA_TARGETS], check=True, stdout=f, stderr=subprocess.STDOUT)
    if not _llama_bin(src, "llama-bench").is_file():
        raise RuntimeError(f"the llama.cpp build left no llama-bench (see {log})")
    return src


def gguf_file(src: Path, model_dir: Path, dtype: str, cache: Path) -> Path:
    """The model as GGUF at `dtype`, made with llama.cpp's convert_hf_to_gguf.py (its own
    gguf-py; needs torch, sentencepiece, protobuf>=5), cached under cache/gguf."""
    out = cache / "gguf" / f"{_model_key(model_dir)}-{dtype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    _say(f"converting {model_dir} to {out}")
    r = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir),
                        "--outtype", dtype, "--outfile", str(tmp)],
                       capture_output=True, text=True, check=False)  # fmt: skip
    if r.returncode != 0 or not tmp.is_file():
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise RuntimeError("convert_hf_to_gguf.py failed: " + " | ".join(tail))
    tmp.rename(out)
    return out


def run_llama_bench(src: Path, gguf: Path, threads: int, n_prompt: int, n_gen: int) -> dict:
    """One llama-bench repetition: pp at depth 0 and tg at depth n_prompt (-r 1 each,
    llama-bench's own warm-up run first). Returns tokens/s."""
    exe = str(_llama_bin(src, "llama-bench"))
    out = {}

    def one(args):
        r = subprocess.run([exe, "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json",
                            *args], capture_output=True, text=True, timeout=3600, check=False)  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError("llama-bench failed: " + " | ".join(r.stderr.strip().splitlines()[-3:]))
        rows = json.loads(r.stdout)
        return rows[0]

    if n_prompt:
        row = one(["-p", str(n_prompt), "-n", "0"])
        out["prefill_tok_s"] = float(row["avg_ts"])
        out["build_commit"] = row.get("build_commit")
    if n_gen:
        row = one(["-p", "0", "-n", str(n_gen), "-d", str(n_prompt)])
        out["decode_tok_s"] = float(row["avg_ts"])
    return out
