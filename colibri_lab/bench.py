"""Side-by-side benchmark: Colibri, llama.cpp and transformers on one model, in one run.

    python -m colibri_lab.bench --make-model                 # the 791 M random Mixtral
    python -m colibri_lab.bench --model-dir DIR --dtype f32,bf16 --threads 2,1 --reps 3
    python -m colibri_lab.bench --smoke --engines colibri,transformers   # CI: seconds

For every (dtype, threads) configuration the engines take turns, one repetition each
(Colibri, llama.cpp, transformers, Colibri, ...), so slow drifts of the machine (other
jobs, thermal state, page cache) hit every engine alike. Each repetition is a prefill of
``--prefill`` tokens (a new sequence) and then ``--decode`` single-token steps that extend
it; both are timed separately and reported as tokens/s, the median over repetitions.

Token ids are drawn from a seeded PRNG over the vocabulary, fresh for every repetition,
so expert routing varies as it does on real text. Colibri and transformers get the very
same ids (prompt and decode tokens are fed, not sampled: teacher forcing, which costs the
same as sampling minus the sampler). llama.cpp runs through its own ``llama-bench``, which
in the vendored version (llama-cpp-python 0.3.36) also draws every prompt and decode token
with ``std::rand() % n_vocab`` (older versions repeated one token in ``tg``); its decode
is timed at depth ``--prefill`` (``-d``) so that it, too, attends over the prompt.

Also measured in the same run: the memory bandwidth (a numpy copy of a large buffer,
read + write bytes per second, one thread) and the decode roofline it implies: the weight
bytes one decode token must read (attention + router + top-k experts + lm_head + one
embedding row + norms, at the run's dtype) divided by the bandwidth; each engine's decode
is reported as a fraction of it.

llama.cpp is built from the ``llama-cpp-python`` sdist in ``--llama-cpp-dir`` (default
``~/.cache/colibri-lab/llama.cpp``): ``pip download --no-deps --no-binary :all:``, then
CMake/Ninja for ``llama-bench llama-quantize llama-completion`` (about 6.5 minutes on two
cores, once), and the GGUF is made with its ``convert_hf_to_gguf.py`` at the run's dtype.
Nothing of llama.cpp enters this repository. An engine that cannot run says why in its
column ("not available: ...") instead of stopping the benchmark.

Timings are printed, never judged: no result of this script passes or fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ENGINES = ("colibri", "llama.cpp", "transformers")
DTYPES = ("f32", "bf16")
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2}

# The reference model of docs/performance.md: a random-init Mixtral of 791 M parameters,
# about 230 M active per token.
BIG_SHAPE = dict(vocab=32000, hidden=1024, inter=3584, layers=8, heads=16, kv_heads=4,
                 experts=8, top_k=2, max_pos=4096)  # fmt: skip
# The smoke model: the real vocabulary (so the tokenizer is the real one), tiny elsewhere;
# sizes are multiples of 4 so transformers' grouped_mm experts work on the CPU.
SMOKE_SHAPE = dict(vocab=32000, hidden=64, inter=96, layers=2, heads=4, kv_heads=2,
                   experts=4, top_k=2, max_pos=1024)  # fmt: skip

LLAMA_TARGETS = ("llama-bench", "llama-quantize", "llama-completion")


def default_cache_dir() -> Path:
    return Path(os.environ.get("COLIBRI_LAB_CACHE", "~/.cache/colibri-lab")).expanduser()


def _say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# Model: generate, describe, convert
# ---------------------------------------------------------------------------------------


def _tokenizer_model_file() -> Path | None:
    """The Mixtral SentencePiece model: data/tokenizer.model.v1 in a checkout, else the
    copy inside the mistral-common wheel; None when neither exists."""
    p = Path(__file__).resolve().parents[1] / "data" / "tokenizer.model.v1"
    if p.is_file():
        return p
    try:
        import mistral_common
    except ImportError:
        return None
    p = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    return p if p.is_file() else None


def make_model(out_dir: str | os.PathLike, shape: dict | None = None, seed: int = 0) -> Path:
    """Write a seeded random-init MixtralForCausalLM (f32 safetensors, the real Mixtral
    tokenizer when the vocabulary is 32000) to `out_dir` with transformers, unless a
    complete one is already there. Returns the folder."""
    out = Path(out_dir)
    shape = dict(BIG_SHAPE if shape is None else shape)
    stamp = out / "colibri_bench_shape.json"
    want = json.dumps({**shape, "seed": seed}, sort_keys=True)
    if stamp.is_file() and stamp.read_text() == want and (out / "config.json").is_file():
        return out
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    _say(f"generating a random Mixtral {shape} (seed {seed}) in {out}")
    cfg = MixtralConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"],
        intermediate_size=shape["inter"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        num_local_experts=shape["experts"], num_experts_per_tok=shape["top_k"],
        max_position_embeddings=shape["max_pos"], rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norm weights: not all ones
                p.uniform_(0.5, 1.5)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok = _tokenizer_model_file()
    if shape["vocab"] == 32000 and tok is not None:
        shutil.copy(tok, tmp / "tokenizer.model")
    (tmp / "colibri_bench_shape.json").write_text(want)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def read_hf_config(model_dir: Path) -> dict:
    """The shape facts the roofline needs, from a Hugging Face config.json (both the
    transformers 4 and 5 spellings)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = {**cfg, **cfg["text_config"]}
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or hidden // heads
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    return dict(
        model_type=cfg.get("model_type", "?"),
        vocab=int(cfg["vocab_size"]),
        hidden=hidden,
        inter=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        layers=int(cfg["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        experts=experts,
        top_k=int(cfg.get("num_experts_per_tok") or 0),
        tie=bool(cfg.get("tie_word_embeddings", False)),
    )


def active_weights(c: dict) -> dict:
    """Weights one decode token reads, by part (element counts; norms separately, as they
    stay f32 in every engine). A MoE layer: q/k/v/o, the router and top_k experts of
    3 matrices each; plus the lm_head and one embedding row."""
    H, D = c["hidden"], c["head_dim"]
    attn = H * c["heads"] * D * 2 + H * c["kv_heads"] * D * 2
    router = H * c["experts"]
    experts = c["top_k"] * 3 * H * c["inter"]
    per_layer = attn + router + experts
    parts = {
        "attention": attn * c["layers"],
        "router": router * c["layers"],
        "experts": experts * c["layers"],
        "lm_head": c["vocab"] * H,
        "embedding_row": H,
    }
    return {"parts": parts, "matrices": sum(parts.values()), "norms_f32": (2 * c["layers"] + 1) * H,
            "per_layer": per_layer}  # fmt: skip


def decode_roofline(c: dict, dtype: str, bandwidth_gbs: float) -> dict:
    """Bytes per decode token at `dtype` and the tokens/s ceiling that bandwidth sets.
    The KV cache read (2 x layers x kv_heads x head_dim x context x 4 bytes) is reported
    beside it, not added: at a 640-token context it is ~1 % of the weights."""
    w = active_weights(c)
    nbytes = w["matrices"] * DTYPE_BYTES[dtype] + w["norms_f32"] * 4
    return {
        "dtype": dtype,
        "active_params": w["matrices"] + w["norms_f32"],
        "bytes_per_token": nbytes,
        "parts_bytes": {k: v * DTYPE_BYTES[dtype] for k, v in w["parts"].items()},
        "bandwidth_gbs": bandwidth_gbs,
        "roofline_tok_s": bandwidth_gbs * 1e9 / nbytes if nbytes else float("nan"),
    }


def _model_key(model_dir: Path) -> str:
    h = hashlib.sha256()
    h.update(str(Path(model_dir).resolve()).encode())
    for f in sorted(Path(model_dir).glob("*")):
        if f.suffix in (".json", ".safetensors", ".model"):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    return f"{Path(model_dir).name}-{h.hexdigest()[:10]}"


def colibri_file(model_dir: Path, dtype: str, cache: Path) -> Path:
    """The model converted to .colibri at `dtype`, cached under cache/converted."""
    from .convert import convert

    out = cache / "converted" / f"{_model_key(model_dir)}-{dtype}.colibri"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        _say(f"converting {model_dir} to {out}")
        convert(model_dir, out, dtype=dtype, progress=False)
    return out


# ---------------------------------------------------------------------------------------
# Machine facts and memory bandwidth
# ---------------------------------------------------------------------------------------


def source_info() -> dict:
    """The checkout this run measured: git HEAD and whether the working tree had changes
    (read-only git; empty when not in a git checkout)."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=False).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "native"],
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"git_head": head, "native_tree_modified": bool(dirty)} if head else {}


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpus_online": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count()}  # fmt: skip
    try:
        txt = Path("/proc/cpuinfo").read_text()
        m = re.search(r"^model name\s*:\s*(.+)$", txt, re.MULTILINE)
        if m:
            info["cpu"] = m.group(1).strip()
        fl = re.search(r"^flags\s*:\s*(.+)$", txt, re.MULTILINE)
        if fl:
            flags = set(fl.group(1).split())
            info["simd"] = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16")
                            if f in flags]  # fmt: skip
        mem = re.search(r"^MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
        if mem:
            info["mem_gib"] = round(int(mem.group(1)) / 2**20, 1)
    except OSError:
        pass
    return info


def drop_from_page_cache(path) -> bool:
    """Evict a (clean) file from the page cache, so that every engine loads its model file
    cold, the same way. Which page-cache folios a file sits in decides whether a mapping
    of it can use 2 MiB pages, and that changes decode speed by 10-25 % on this machine
    class: a file just written (by a converter) sits in small folios; one read back through
    a mapping comes in large ones. Returns False where the OS cannot do it."""
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def hugepage_fraction(path) -> float | None:
    """The share of a file that a fresh read-only mapping gets in 2 MiB pages (Linux
    `FilePmdMapped`), i.e. what every engine that maps the file now gets: one byte of
    every 2 MiB is touched, which maps a whole huge page where the page cache holds the
    range in a 2 MiB folio. None where /proc/self/smaps does not say."""
    import mmap

    size = os.path.getsize(path)
    if size < (2 << 20) or not os.path.exists("/proc/self/smaps"):
        return None
    real = os.path.realpath(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        for off in range(0, size, 2 << 20):
            m[off]
        pmd_kb, found = 0, False
        with open("/proc/self/smaps") as sm:
            inside = False
            for line in sm:
                head = re.match(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$", line)
                if head:
                    inside = head.group(1).strip() == real
                    found |= inside
                elif inside and line.startswith("FilePmdMapped:"):
                    pmd_kb += int(line.split()[1])
    return pmd_kb * 1024 / size if found else None


def measure_bandwidth(nbytes: int = 512 << 20, reps: int = 5) -> dict:
    """Copy a buffer of `nbytes` into another with numpy (one thread), `reps` times after
    one untimed pass; bandwidth = 2 x nbytes (read + write) / time, in GB/s (1e9 bytes).

    Timed twice: by the wall clock and by this thread's CPU time. Memory stalls count as
    CPU time but time spent descheduled does not, so on a shared, busy machine the CPU-time
    figure still measures the memory system while the wall-clock one measures the queue
    for a core. The roofline uses the CPU-time median ("median_gbs"); both are reported."""
    n = nbytes // 8
    src = np.random.default_rng(0).random(n)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    cpu, wall = [], []
    for _ in range(reps):
        w, c = time.perf_counter(), time.thread_time()
        np.copyto(dst, src)
        c, w = time.thread_time() - c, time.perf_counter() - w
        wall.append(2 * n * 8 / w / 1e9)
        cpu.append(2 * n * 8 / max(c, 1e-9) / 1e9)
    del src, dst
    return {"method": f"numpy copy of {nbytes >> 20} MiB, read+write bytes, 1 thread, "
                      "timed by thread CPU time",
            "median_gbs": statistics.median(cpu), "max_gbs": max(cpu),
            "wall_median_gbs": statistics.median(wall), "samples_gbs": cpu,
            "wall_samples_gbs": wall}  # fmt: skip


# ---------------------------------------------------------------------------------------
# Engine workers (one process each, kept for a configuration's repetitions)
# ---------------------------------------------------------------------------------------


def _ids_for(seed: int, rep: int, n: int, vocab: int, bos: int | None) -> np.ndarray:
    """n token ids from a PRNG seeded by (seed, rep) (rep -1: the warm-up), uniform over
    [3, vocab) (skipping the control ids), BOS first when given."""
    rng = np.random.default_rng([seed, rep + 1])
    ids = rng.integers(3 if vocab > 3 else 0, vocab, size=n, dtype=np.int64)
    if bos is not None and n:
        ids[0] = bos
    return ids.astype(np.int32)


def _colibri_worker(conn, path: str, threads: int, max_seq_len: int):
    from ._native import version
    from .engine import Engine

    # populate: fault the whole file in at load, as llama.cpp's loader does (a MoE warm-up
    # touches only the experts it routes to; the rest would fault in during timed runs)
    eng = Engine(path, num_threads=threads, max_seq_len=max_seq_len, populate=True)
    c = eng.config
    try:  # the kernel table in use ("reference", "avx2", ...), where the library reports it
        kernels = eng._get_string("kernels")
    except Exception:
        kernels = "not reported"
    conn.send({"ok": True, "threads_used": c.threads_used, "weight_dtype": c.weight_dtype,
               "vocab": c.vocab_size, "kernels": kernels, "version": version()})  # fmt: skip
    while True:
        msg = conn.recv()
        if msg is None:
            break
        prompt, dec = msg
        c0, t = time.process_time(), time.perf_counter()
        eng.forward(prompt, 0, last_only=True)  # the last row's logits, as the peers compute
        t_pre = time.perf_counter() - t
        c1 = time.process_time()
        steps = []
        n = len(prompt)
        for i, tok in enumerate(dec):
            t = time.perf_counter()
            eng.forward([int(tok)], n + i)
            steps.append(time.perf_counter() - t)
        conn.send({"prefill_s": t_pre, "decode_steps_s": steps, "prefill_cpu_s": c1 - c0,
                   "decode_cpu_s": time.process_time() - c1})  # fmt: skip
    eng.close()


def _hf_worker(conn, model_dir: str, dtype: str, threads: int):
    import inspect

    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(threads)
    tdt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=tdt).eval()
    # transformers 5.24 names the argument `cache`; earlier ones `past_key_values`
    params = inspect.signature(model.forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"
    impl = "default"
    try:
        with torch.inference_mode():
            model(torch.tensor([[1, 5, 9, 11]]), use_cache=False)
    except RuntimeError:
        # grouped_mm on the CPU needs 16-byte aligned strides (TOOLING.md)
        model.set_experts_implementation("eager")
        impl = "eager"
    conn.send({"ok": True, "experts_implementation": impl, "torch": torch.__version__,
               "threads_used": torch.get_num_threads()})  # fmt: skip
    while True:
        msg = conn.recv()
        if msg is None:
            break
        prompt, dec = msg
        with torch.inference_mode():
            # a fresh KV cache per sequence, filled in place; logits of the last row only
            # (what generate() asks for)
            kv = {cache_kw: DynamicCache(config=model.config)}
            x = torch.from_numpy(np.asarray(prompt, dtype=np.int64))[None]
            c0, t = time.process_time(), time.perf_counter()
            model(input_ids=x, use_cache=True, logits_to_keep=1, **kv)
            t_pre = time.perf_counter() - t
            c1 = time.process_time()
            steps = []
            for tok in dec:
                t = time.perf_counter()
                model(input_ids=torch.tensor([[int(tok)]]), use_cache=True, **kv)
                steps.append(time.perf_counter() - t)
        conn.send({"prefill_s": t_pre, "decode_steps_s": steps, "prefill_cpu_s": c1 - c0,
                   "decode_cpu_s": time.process_time() - c1})  # fmt: skip


def _worker_main(kind: str, conn, *args):
    try:
        {"colibri": _colibri_worker, "transformers": _hf_worker}[kind](conn, *args)
    except Exception as e:  # reported to the parent as "not available: ..."
        try:
            conn.send({"ok": False, "error": f"{type(e).__name__}: {e}",
                       "trace": traceback.format_exc(limit=3)})  # fmt: skip
        except Exception:
            pass


class Worker:
    """An engine in a child process (spawned: no shared threads or allocator state)."""

    def __init__(self, kind: str, *args, timeout: float = 1800):
        self.kind = kind
        self.timeout = timeout
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(kind, child, *args), daemon=True)
        self.proc.start()
        child.close()
        self.info = self._recv()
        if not self.info.get("ok"):
            self.close()
            raise RuntimeError(self.info.get("error", "worker failed"))

    def _recv(self) -> dict:
        if not self.conn.poll(self.timeout):
            raise RuntimeError(f"{self.kind} worker did not answer in {self.timeout:.0f} s")
        try:
            return self.conn.recv()
        except EOFError:
            raise RuntimeError(f"{self.kind} worker died (exit code {self.proc.exitcode}); "
                               "out of memory?") from None  # fmt: skip

    def run(self, prompt: np.ndarray, dec: np.ndarray) -> dict:
        self.conn.send((prompt, dec))
        r = self._recv()
        if "prefill_s" not in r:
            raise RuntimeError(r.get("error", "worker failed"))
        steps = r["decode_steps_s"]
        # CPU seconds (all threads of the engine's process) per token: not lowered by
        # time spent descheduled, raised by threads that spin while waiting
        out = {"prefill_tok_s": len(prompt) / r["prefill_s"],
               "prefill_cpu_ms_per_tok": r["prefill_cpu_s"] / len(prompt) * 1e3}
        if steps:
            out["decode_cpu_ms_per_tok"] = r["decode_cpu_s"] / len(steps) * 1e3
            out["decode_tok_s"] = len(steps) / sum(steps)
            out["decode_p50_ms"] = float(np.percentile(steps, 50) * 1e3)
            out["decode_p99_ms"] = float(np.percentile(steps, 99) * 1e3)
        return out

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(None)
                self.proc.join(30)
        except (OSError, BrokenPipeError):
            pass
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)


# ---------------------------------------------------------------------------------------
# llama.cpp: build from the llama-cpp-python sdist, convert, run llama-bench
# ---------------------------------------------------------------------------------------


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
            _say(f"downloading the llama-cpp-python sdist into {root}")
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                            ":all:", "llama-cpp-python", "-d", str(root)],
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


# ---------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------


@dataclass
class Config:
    dtype: str
    threads: int
    engines: dict = field(default_factory=dict)  # name -> {"reps": [...], "error": str}


def _median(reps: list, key: str) -> float | None:
    vals = [r[key] for r in reps if key in r]
    return statistics.median(vals) if vals else None


def run(args) -> dict:
    cache = Path(args.cache_dir).expanduser()
    llama_root = Path(args.llama_cpp_dir).expanduser() if args.llama_cpp_dir else cache / "llama.cpp"
    engines, dtypes, threads = args.engines, args.dtype, args.threads

    if args.model_dir:
        model_dir = Path(args.model_dir).expanduser()
        if not (model_dir / "config.json").is_file():
            raise SystemExit(f"bench: {model_dir} has no config.json; give a Hugging Face "
                             "checkpoint folder or use --make-model")  # fmt: skip
    elif args.smoke:
        model_dir = make_model(cache / "models" / "mixtral-smoke", SMOKE_SHAPE, seed=args.seed)
    else:
        if not args.make_model and not (cache / "models" / "mixtral-791m" / "config.json").is_file():
            raise SystemExit("bench: no model: pass --model-dir DIR, or --make-model to generate "
                             "the 791 M random Mixtral into the cache")  # fmt: skip
        model_dir = make_model(cache / "models" / "mixtral-791m", BIG_SHAPE, seed=args.seed)
    hf_cfg = read_hf_config(model_dir)
    n_pre, n_dec = args.prefill, args.decode

    result = {
        "tool": "colibri_lab.bench",
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join([Path(sys.executable).name, "-m", "colibri_lab.bench", *sys.argv[1:]]),
        "machine": machine_info(),
        "loadavg_start": list(os.getloadavg()),
        "source": source_info(),
        "model_dir": str(model_dir),
        "model": hf_cfg,
        "prefill_tokens": n_pre,
        "decode_tokens": n_dec,
        "reps": args.reps,
        "seed": args.seed,
        "token_ids": "numpy PRNG seeded by (seed, rep), uniform over [3, vocab), BOS first; "
                     "the same ids for colibri and transformers; llama-bench draws its own "
                     "with std::rand()",
        "configs": [],
    }
    _say("measuring memory bandwidth")
    bw = measure_bandwidth(args.bandwidth_mib << 20, reps=3 if args.smoke else 5)
    result["bandwidth"] = bw

    llama_src, llama_err = None, None
    if "llama.cpp" in engines:
        try:
            llama_src = ensure_llama_cpp(llama_root, build=not (args.smoke or args.no_build))
        except Exception as e:
            llama_err = str(e)
        result["llama_cpp_dir"] = str(llama_src or llama_root)

    for dtype in dtypes:
        roof = decode_roofline(hf_cfg, dtype, bw["median_gbs"])
        # model files first (conversion is not timed)
        files: dict[str, object] = {}
        if "colibri" in engines:
            try:
                files["colibri"] = colibri_file(model_dir, dtype, cache)
            except Exception as e:
                files["colibri"] = e
        if "llama.cpp" in engines and llama_src is not None:
            try:
                files["llama.cpp"] = gguf_file(llama_src, model_dir, dtype, cache)
            except Exception as e:
                files["llama.cpp"] = e
        for nt in threads:
            cfg = Config(dtype, nt)
            workers: dict[str, Worker] = {}
            # every engine loads its file cold (drop_from_page_cache says why)
            for f in files.values():
                if isinstance(f, Path):
                    drop_from_page_cache(f)
            for e in engines:
                cfg.engines[e] = {"reps": []}
                try:
                    if e == "colibri":
                        if isinstance(files["colibri"], Exception):
                            raise files["colibri"]
                        w = Worker("colibri", str(files["colibri"]), nt, n_pre + n_dec)
                        cfg.engines[e].update({k: w.info[k] for k in
                                               ("threads_used", "kernels", "version")})
                        workers[e] = w
                    elif e == "transformers":
                        w = Worker("transformers", str(model_dir), dtype, nt)
                        cfg.engines[e].update({k: w.info[k] for k in
                                               ("experts_implementation", "torch", "threads_used")})
                        workers[e] = w
                    elif e == "llama.cpp":
                        if llama_src is None:
                            raise RuntimeError(llama_err)
                        if isinstance(files["llama.cpp"], Exception):
                            raise files["llama.cpp"]
                        cfg.engines[e]["threads_used"] = nt
                except Exception as ex:
                    msg = str(ex).strip()
                    cfg.engines[e]["error"] = msg.splitlines()[0] if msg else type(ex).__name__
                    _say(f"{e} {dtype} {nt}t: not available: {cfg.engines[e]['error']}")
            # warm-up: fault the weights in, let lazy init happen (not counted)
            for e, w in workers.items():
                try:
                    warm = min(n_pre, 64)
                    w.run(_ids_for(args.seed, -1, warm, hf_cfg["vocab"], 1),
                          _ids_for(args.seed + 1, -1, min(n_dec, 4), hf_cfg["vocab"], None))
                except Exception as ex:
                    cfg.engines[e]["error"] = str(ex)
            for rep in range(args.reps):
                prompt = _ids_for(args.seed, rep, n_pre, hf_cfg["vocab"], 1)
                dec = _ids_for(args.seed + 1, rep, n_dec, hf_cfg["vocab"], None)
                for e in engines:
                    ent = cfg.engines[e]
                    if "error" in ent:
                        continue
                    try:
                        if e == "llama.cpp":
                            r = run_llama_bench(llama_src, files["llama.cpp"], nt, n_pre, n_dec)
                        else:
                            r = workers[e].run(prompt, dec)
                    except Exception as ex:
                        ent["error"] = str(ex)
                        continue
                    ent["reps"].append(r)
                    _say(f"{dtype} {nt}t rep {rep + 1}/{args.reps} {e}: "
                         f"prefill {r.get('prefill_tok_s', float('nan')):.1f} tok/s, "
                         f"decode {r.get('decode_tok_s', float('nan')):.1f} tok/s")
            for w in workers.values():
                w.close()
            for e, f in files.items():  # what each engine's mapping could use, after the run
                if isinstance(f, Path) and e in cfg.engines:
                    try:
                        cfg.engines[e]["file_hugepage_fraction"] = hugepage_fraction(f)
                    except OSError:
                        pass
            for e, ent in cfg.engines.items():
                ent["prefill_tok_s"] = _median(ent["reps"], "prefill_tok_s")
                ent["decode_tok_s"] = _median(ent["reps"], "decode_tok_s")
                for k in ("prefill_cpu_ms_per_tok", "decode_cpu_ms_per_tok"):
                    if _median(ent["reps"], k) is not None:
                        ent[k] = _median(ent["reps"], k)
                p50, p99 = _median(ent["reps"], "decode_p50_ms"), _median(ent["reps"], "decode_p99_ms")
                if p50 and p99:
                    ent["decode_p99_over_p50"] = p99 / p50
                if ent["decode_tok_s"]:
                    ent["roofline_fraction"] = ent["decode_tok_s"] / roof["roofline_tok_s"]
                if "error" in ent and not ent["reps"]:
                    ent["status"] = f"not available: {ent['error']}"
                else:
                    ent["status"] = "ok" if "error" not in ent else f"partial: {ent['error']}"
            col = cfg.engines.get("colibri", {})
            for e, ent in cfg.engines.items():
                if e == "colibri":
                    continue
                for k in ("prefill_tok_s", "decode_tok_s"):
                    if col.get(k) and ent.get(k):
                        ent[f"colibri_over_this_{k[:-6]}"] = col[k] / ent[k]
            result["configs"].append({"dtype": dtype, "threads": nt, "roofline": roof,
                                      "engines": cfg.engines})  # fmt: skip
    result["loadavg_end"] = list(os.getloadavg())
    result["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return result


def _fmt(v, spec=".1f") -> str:
    return "—" if v is None else format(v, spec)


def render_table(res: dict) -> str:
    """The result as a Markdown table plus the facts it rests on."""
    m, bw = res["machine"], res["bandwidth"]
    lines = [
        f"machine: {m.get('cpu', '?')}, {m.get('cpus_usable')} usable CPUs, "
        f"SIMD {'/'.join(m.get('simd', [])) or '?'}, {m.get('mem_gib', '?')} GiB RAM",
        f"memory bandwidth: {bw['median_gbs']:.1f} GB/s median (max {bw['max_gbs']:.1f}; by the wall "
        f"clock {bw['wall_median_gbs']:.1f}; {bw['method']})",
        f"model: {res['model_dir']} ({res['model']['model_type']}, {res['model']['layers']} layers, "
        f"hidden {res['model']['hidden']}, {res['model']['experts']} experts top-{res['model']['top_k']}, "
        f"vocab {res['model']['vocab']})",
        f"load average (1 min) at start {res['loadavg_start'][0]:.1f}, at end {res['loadavg_end'][0]:.1f}",
        f"prefill {res['prefill_tokens']} tokens, decode {res['decode_tokens']} tokens after it; "
        f"median of {res['reps']} repetition(s), engines alternating",
        "",
        "| dtype | threads | engine | prefill tok/s | decode tok/s | decode P99/P50 "
        "| roofline tok/s | decode ÷ roofline | Colibri ÷ this (prefill, decode) "
        "| CPU ms/token (prefill, decode) | file in 2 MiB pages |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in res["configs"]:
        roof = c["roofline"]["roofline_tok_s"]
        for e, ent in c["engines"].items():
            if ent.get("status", "").startswith("not available"):
                lines.append(f"| {c['dtype']} | {c['threads']} | {e} | {ent['status']} | | | | | | | |")
                continue
            name = e
            if e == "colibri" and ent.get("kernels") not in (None, "not reported"):
                name += f" [{ent['kernels']}]"
            if e == "colibri" and ent.get("threads_used") not in (None, c["threads"]):
                name += f" ({ent['threads_used']} thread used)"
            if e == "transformers" and ent.get("experts_implementation") == "eager":
                name += " (eager experts)"
            ratio = "—"
            if e != "colibri":
                ratio = (f"{_fmt(ent.get('colibri_over_this_prefill'), '.2f')}, "
                         f"{_fmt(ent.get('colibri_over_this_decode'), '.2f')}")  # fmt: skip
            lines.append(
                f"| {c['dtype']} | {c['threads']} | {name} | {_fmt(ent.get('prefill_tok_s'))} "
                f"| {_fmt(ent.get('decode_tok_s'))} | {_fmt(ent.get('decode_p99_over_p50'), '.2f')} "
                f"| {roof:.1f} | {_fmt(ent.get('roofline_fraction'), '.0%')} | {ratio} "
                f"| {_fmt(ent.get('prefill_cpu_ms_per_tok'), '.1f')}, "
                f"{_fmt(ent.get('decode_cpu_ms_per_tok'), '.1f')} "
                f"| {_fmt(ent.get('file_hugepage_fraction'), '.0%')} |"
            )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m colibri_lab.bench",
        description="Colibri vs llama.cpp vs transformers on one model: prefill and decode "
                    "tokens/s (medians, ratios), memory bandwidth and the decode roofline.",
    )  # fmt: skip
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model-dir", help="Hugging Face checkpoint folder (config.json + safetensors)")
    src.add_argument("--make-model", action="store_true",
                     help="generate the 791 M random Mixtral (seeded) into the cache and use it")
    p.add_argument("--dtype", default="f32", help="f32, bf16 or both: f32,bf16 (default f32)")
    p.add_argument("--threads", default="2", help="threads per engine, e.g. 2 or 2,1 (default 2)")
    p.add_argument("--reps", type=int, default=3, help="repetitions per engine (default 3)")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help="comma-separated subset of colibri,llama.cpp,transformers (default all)")
    p.add_argument("--prefill", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--decode", type=int, default=128, help="decoded tokens (default 128)")
    p.add_argument("--seed", type=int, default=0, help="seed of the token ids and the model")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="write the raw result as JSON to PATH ('-' or no value: stdout)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny model, 1 rep, 32+8 tokens, small bandwidth buffer, never builds "
                        "llama.cpp: a check that everything runs (what CI runs)")  # fmt: skip
    p.add_argument("--cache-dir", default=str(default_cache_dir()),
                   help="models, converted files and llama.cpp (default ~/.cache/colibri-lab, "
                        "or $COLIBRI_LAB_CACHE)")  # fmt: skip
    p.add_argument("--llama-cpp-dir", default=None,
                   help="llama.cpp cache: an unpacked sdist or source tree (default CACHE/llama.cpp)")
    p.add_argument("--no-build", action="store_true", help="do not download or build llama.cpp")
    p.add_argument("--bandwidth-mib", type=int, default=512,
                   help="size of the bandwidth test buffer in MiB (default 512)")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.smoke:
        if args.reps == p.get_default("reps"):
            args.reps = 1
        if args.prefill == p.get_default("prefill"):
            args.prefill = 32
        if args.decode == p.get_default("decode"):
            args.decode = 8
        if args.bandwidth_mib == p.get_default("bandwidth_mib"):
            args.bandwidth_mib = 32
    if args.reps < 1 or args.prefill < 1 or args.decode < 0 or args.bandwidth_mib < 1:
        p.error("--reps, --prefill and --bandwidth-mib must be >= 1, --decode >= 0")
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for e in args.engines:
        if e not in ENGINES:
            p.error(f"unknown engine {e!r}; choose from {', '.join(ENGINES)}")
    args.dtype = [d.strip() for d in args.dtype.split(",") if d.strip()]
    for d in args.dtype:
        if d not in DTYPES:
            p.error(f"unknown dtype {d!r}; choose f32, bf16 or f32,bf16")
    try:
        args.threads = [int(t) for t in str(args.threads).split(",") if t.strip()]
    except ValueError:
        args.threads = []
    if not args.threads or min(args.threads) < 1:
        p.error("--threads takes integers >= 1, e.g. 2 or 2,1")
    res = run(args)
    table = render_table(res)
    if args.json == "-":
        print(table, file=sys.stderr)
        json.dump(res, sys.stdout, indent=1)
        print()
    else:
        print(table)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
