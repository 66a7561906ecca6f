"""llama.cpp: built from the llama-cpp-python sdist, its GGUF converter and quantizer,
llama-bench."""

from __future__ import annotations

import importlib.util
import json
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

from .common import _say
from .files import _model_key

LLAMA_TARGETS = ("llama-bench", "llama-quantize", "llama-completion", "llama-server")

#: The benchmark's quantized dtypes and the llama-quantize type that makes each.
QUANT_TYPES = {"q8_0": "Q8_0", "q4_k_m": "Q4_K_M", "q4_0": "Q4_0", "q4_1": "Q4_1",
               "q5_0": "Q5_0", "q5_1": "Q5_1", "q3_k_m": "Q3_K_M", "q2_k": "Q2_K",
               "iq4_nl": "IQ4_NL", "iq4_xs": "IQ4_XS", "iq2_xxs": "IQ2_XXS", "iq2_xs": "IQ2_XS",
               "iq2_m": "IQ2_M", "iq3_xxs": "IQ3_XXS", "iq3_m": "IQ3_M", "iq1_s": "IQ1_S",
               "iq1_m": "IQ1_M"}
#: The types quantized with an importance matrix (llama-quantize refuses the IQ2 and IQ1 mixes
#: without one; published files of every grid type are made with one): `synthetic_imatrix`.
IMATRIX_TYPES = ("iq2_xxs", "iq2_xs", "iq2_m", "iq3_xxs", "iq3_m", "iq1_s", "iq1_m")
#: The outtypes of convert_hf_to_gguf.py a quantized GGUF can be made from.
QUANT_BASES = ("f32", "bf16")


def _find_llama_src(root: Path) -> Path | None:
    """The llama.cpp source tree under `root`: root itself, or an unpacked sdist's
    vendor/llama.cpp (real path: through a symlink its .git file breaks ninja)."""
    if (root / "convert_hf_to_gguf.py").is_file():
        return root.resolve()
    for cand in sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp"), reverse=True):
        if (cand / "convert_hf_to_gguf.py").is_file():
            return cand.resolve()
    return None


#: The instruction-set limits a benchmark can run both engines under (side_by_side --isa):
#: "native" is everything the CPU has; "avx2" is an AVX2-only machine's (AVX2, FMA, F16C,
#: BMI2: a Zen 2/3 or an Intel client core) on a newer CPU. Each has its own llama.cpp build
#: folder beside the source.
ISA_BUILDS = {"native": "build", "avx2": "build-avx2"}
#: The /proc/cpuinfo flags each limit needs and allows, AVX implied (native: whatever the CPU lists)
ISA_CPU_FLAGS = {"avx2": ("avx2", "fma", "f16c")}
_GGML_X86 = {"GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma", "GGML_F16C": "f16c",
             "GGML_AVX_VNNI": "avx_vnni", "GGML_AVX512": "avx512f", "GGML_AVX512_VBMI": "avx512vbmi",
             "GGML_AVX512_VNNI": "avx512_vnni", "GGML_AVX512_BF16": "avx512_bf16"}
_AMX_OFF = ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def _llama_bin(src: Path, name: str, isa: str = "native") -> Path:
    return src / ISA_BUILDS[isa] / "bin" / name


def isa_flags(cpuinfo: str | None = None, isa: str = "native") -> list[str]:
    """llama.cpp's CMake options for this CPU: -DGGML_NATIVE=ON, except on a CPU that lists
    AMX. There -march=native turns on ggml's AMX kernels, and on VMs that advertise AMX
    without granting its tile state (seen: 2-vCPU Xeons of this project's kind) llama-bench
    dies of SIGILL in its repacked quantized path; so the x86 extensions are named one by
    one from /proc/cpuinfo, AMX off. `cpuinfo`: the text of /proc/cpuinfo (tests).
    isa "avx2": AVX, AVX2, FMA, F16C and BMI2 on, every later extension off (ISA_BUILDS)."""
    if isa != "native":
        return (["-DGGML_NATIVE=OFF", "-DGGML_BMI2=ON"]
                + [f"-D{o}={'ON' if f in ('avx', *ISA_CPU_FLAGS[isa]) else 'OFF'}" for o, f in _GGML_X86.items()]
                + _AMX_OFF)
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ["-DGGML_NATIVE=ON"]
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if not any(f.startswith("amx") for f in flags):
        return ["-DGGML_NATIVE=ON"]
    return (["-DGGML_NATIVE=OFF"] + [f"-D{o}={'ON' if f in flags else 'OFF'}" for o, f in _GGML_X86.items()]
            + _AMX_OFF)


def _build(root: Path, src: Path, isa: str, targets) -> None:
    """`targets` of llama.cpp built in src/ISA_BUILDS[isa] with isa_flags(isa=isa), the log in
    root; raises RuntimeError when no llama-bench came of it."""
    log = root / ("build.log" if isa == "native" else f"build-{isa}.log")
    with open(log, "ab") as f:
        subprocess.run(["cmake", "-S", str(src), "-B", str(src / ISA_BUILDS[isa]), "-G", "Ninja",
                        "-DCMAKE_BUILD_TYPE=Release", *isa_flags(isa=isa), "-DLLAMA_OPENSSL=OFF",
                        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"],
                       check=True, stdout=f, stderr=subprocess.STDOUT)  # fmt: skip
        subprocess.run(["cmake", "--build", str(src / ISA_BUILDS[isa]), "-j", "2", "--target", *targets],
                       check=True, stdout=f, stderr=subprocess.STDOUT)  # fmt: skip
    if not _llama_bin(src, "llama-bench", isa).is_file():
        raise RuntimeError(f"the {isa} llama.cpp build left no llama-bench (see {log})")


def _build_isa(root: Path, src: Path, isa: str) -> None:
    """llama-bench alone, limited to `isa` (about 5 min on 2 cores, once)."""
    _say(f"building llama.cpp's llama-bench for {isa} in {src / ISA_BUILDS[isa]} (once; about 5 min on 2 cores)")
    _build(root, src, isa, ("llama-bench",))


def ensure_llama_cpp(root: Path, build: bool, isa: str = "native") -> Path:
    """The llama.cpp source tree with llama-bench built; downloads the sdist and builds
    when `build` (raises RuntimeError saying why when it cannot). isa other than "native":
    the native build (its converter tools make the GGUFs) and llama-bench for that ISA."""
    root = Path(root).expanduser()
    src = _find_llama_src(root) if root.is_dir() else None
    if src and _llama_bin(src, "llama-bench").is_file():
        if isa != "native" and not _llama_bin(src, "llama-bench", isa).is_file():
            if not build:
                raise RuntimeError(f"llama.cpp's {isa} llama-bench is not built in {src / ISA_BUILDS[isa]} "
                                   "(a run without --no-build builds it, about 5 min on 2 cores)")
            _build_isa(root, src, isa)
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
    _build(root, src, "native", LLAMA_TARGETS)
    if isa != "native":
        _build_isa(root, src, isa)
    return src


# llama.cpp's DeepSeek converter writes GPT-2 BPE vocabularies only and names the
# pre-tokenizer by hashing its output on a probe text; the random models of the bench
# (models.make_family_model) carry a byte-level BPE trained on this package's source, whose
# hash it does not know. For them (a colibri_bench_shape.json beside the weights) the
# converter is run with the pre-tokenizer named "default": the prefill and decode speed
# of random ids does not depend on it.
_BPE_STAND_IN = (
    "import runpy, sys\n"
    "sys.argv = sys.argv[1:]\n"
    "sys.path.insert(0, __import__('os').path.dirname(sys.argv[0]))\n"
    "import conversion.base as b\n"
    "b.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'default'\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def needs_bpe_stand_in(model_dir: Path) -> bool:
    """Whether `model_dir` is one of the bench's random models with a byte-level BPE
    (tokenizer.json, no SentencePiece model): its GGUF is made with the "default"
    pre-tokenizer (see _BPE_STAND_IN), not the model's own, so colibri imports its weights
    only."""
    d = Path(model_dir)
    return ((d / "colibri_bench_shape.json").is_file() and (d / "tokenizer.json").is_file()
            and not (d / "tokenizer.model").is_file())


def gguf_file(src: Path, model_dir: Path, dtype: str, cache: Path, *, quant_from: str = "f32",
              threads: int = 2) -> Path:
    """The model as GGUF at `dtype`, made with llama.cpp's convert_hf_to_gguf.py (its own
    gguf-py; needs torch, sentencepiece, protobuf>=5), cached under cache/gguf. A quantized
    dtype (:data:`QUANT_TYPES`) is llama-quantize's output from the `quant_from` GGUF
    (f32 by default: the lossless copy of f32 or bf16 checkpoints, so the weights are
    rounded once), cached as ``KEY-q4_k_m-from-f32.gguf``."""
    if dtype in QUANT_TYPES:
        return quantized_gguf(src, model_dir, dtype, cache, quant_from=quant_from, threads=threads)
    out = cache / "gguf" / f"{_model_key(model_dir)}-{dtype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    _say(f"converting {model_dir} to {out}")
    argv = [str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", dtype, "--outfile", str(tmp)]
    if needs_bpe_stand_in(model_dir):
        argv = ["-c", _BPE_STAND_IN, *argv]
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, check=False)
    if r.returncode != 0 or not tmp.is_file():
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise RuntimeError("convert_hf_to_gguf.py failed: " + " | ".join(tail))
    tmp.rename(out)
    return out


def quantized_gguf(src: Path, model_dir: Path, dtype: str, cache: Path, *, quant_from: str = "f32",
                   threads: int = 2) -> Path:
    """llama-quantize's `dtype` (q8_0: Q8_0, q4_k_m: Q4_K_M, llama.cpp's own per-tensor
    mix) of the model's `quant_from` GGUF (made by :func:`gguf_file` first), cached; the grid
    types with a synthetic importance matrix (`synthetic_imatrix`)."""
    if dtype not in QUANT_TYPES:
        raise ValueError(f"no llama-quantize type for {dtype!r}; known: {', '.join(QUANT_TYPES)}")
    if quant_from not in QUANT_BASES:
        raise ValueError(f"quantize from {quant_from!r}? choose {' or '.join(QUANT_BASES)}")
    out = cache / "gguf" / f"{_model_key(model_dir)}-{dtype}-from-{quant_from}.gguf"
    if out.is_file():
        return out
    exe = _llama_bin(src, "llama-quantize")
    if not exe.is_file():
        raise RuntimeError(f"llama-quantize is not built in {src / 'build'} (cmake --build "
                           f"{src / 'build'} --target llama-quantize)")  # fmt: skip
    base = gguf_file(src, model_dir, quant_from, cache)
    tmp = out.with_suffix(".tmp")
    _say(f"quantizing {base.name} to {QUANT_TYPES[dtype]}: {out}")
    im = []
    if dtype in IMATRIX_TYPES:
        im = ["--imatrix", str(synthetic_imatrix(base, out.with_suffix(".imatrix.dat")))]
    r = subprocess.run([str(exe), *im, str(base), str(tmp), QUANT_TYPES[dtype], str(max(1, threads))],
                       capture_output=True, text=True, check=False)  # fmt: skip
    if r.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise RuntimeError("llama-quantize failed: " + " | ".join(tail))
    tmp.rename(out)
    return out


def synthetic_imatrix(f32_gguf: Path, out: Path, seed: int = 0) -> Path:
    """An importance matrix in llama-imatrix's legacy format (.dat) for every matrix of
    `f32_gguf`: per tensor its row width (times the experts of a 3-D one) of positive random
    mean squares of activations, standing in for one measured on text (the random models
    have no text to measure it on). llama-quantize reads it with `--imatrix`."""
    import struct

    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    entries = []
    for t in gguf.GGUFReader(f32_gguf).tensors:
        if len(t.shape) < 2:
            continue
        nval = int(t.shape[0]) * (int(t.shape[2]) if len(t.shape) > 2 else 1)   # ne0 x ne2
        vals = (0.2 + rng.random(nval) ** 2 * 4).astype("<f4")
        name = t.name.encode()
        entries.append(struct.pack("<i", len(name)) + name + struct.pack("<ii", 1, nval) + vals.tobytes())
    out.write_bytes(struct.pack("<i", len(entries)) + b"".join(entries))
    return out


class LlamaBenchCrash(RuntimeError):
    """llama-bench was killed by a signal (SIGILL, SIGSEGV, ...), not a usage error."""


#: What a configuration whose llama-bench crashes is rerun with: no extra CPU buffer
#: types (ggml's AMX and repacked-weight buffers). ggml's AMX kernels for Q4_K / Q8_0 ...
#: die of SIGILL or SIGSEGV where the CPU reports AMX but the (virtual) machine does not
#: let a process use it; --repack 0 also turns off the repacked kernels, which can be
#: slower, so a row that needed it says so.
NO_REPACK = ("--repack", "0")


def run_llama_bench(src: Path, gguf: Path, threads: int, n_prompt: int, n_gen: int,
                    extra: tuple | list = (), isa: str = "native") -> dict:
    """One llama-bench repetition: pp at depth 0 and tg at depth n_prompt (-r 1 each,
    llama-bench's own warm-up run first), with `extra` arguments, from the `isa` build.
    Returns tokens/s; raises LlamaBenchCrash when llama-bench dies of a signal."""
    exe = str(_llama_bin(src, "llama-bench", isa))
    out = {}

    def one(args):
        r = subprocess.run([exe, "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json",
                            *extra, *args], capture_output=True, text=True, timeout=3600,
                           check=False)  # fmt: skip
        if r.returncode != 0:
            tail = " | ".join(r.stderr.strip().splitlines()[-3:])
            if r.returncode < 0:
                try:
                    sig = signal.Signals(-r.returncode).name
                except ValueError:
                    sig = f"signal {-r.returncode}"
                raise LlamaBenchCrash(f"llama-bench died of {sig}" + (f": {tail}" if tail else ""))
            raise RuntimeError(f"llama-bench failed (exit {r.returncode})"
                               + (f": {tail}" if tail else ""))
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
