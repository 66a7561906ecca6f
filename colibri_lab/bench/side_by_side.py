"""Side-by-side benchmark: Colibri, llama.cpp and transformers on one model, in one run.

    python -m colibri_lab.bench --make-model                 # the 791 M random Mixtral
    python -m colibri_lab.bench --model-dir DIR --dtype f32,bf16 --threads 2,1 --reps 3
    python -m colibri_lab.bench --smoke --engines colibri,transformers   # CI: seconds
    python -m colibri_lab.bench --model-dir DIR --dtype q8_0,q4_k_m --no-build  # quantized

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

Also measured in the same run: the streaming-READ bandwidth, on each thread count the
engines run with, by the engine's own C kernel (:func:`colibri_lab.bench.tuning.
measure_read_bandwidth`: every thread streams its slice of a large buffer with vector
loads, plain and non-temporal, the best variant counts), and the decode roofline it
implies: the weight bytes one decode token must read (attention + router + top-k experts +
lm_head + one embedding row + norms, at the run's dtype) divided by that bandwidth; each
engine's decode is reported as a fraction of it. A decode above the roofline means the
roofline is wrong (the bandwidth was measured low, or weights stayed in cache), and the
table says so in a warning line. The bandwidth is measured again just before each engine's
repetition (its best variant, once), and each repetition's decode is also divided by the
roofline at that figure (``roofline_fraction_adjacent``, the median of them; "adjacent" in
the table): on machines whose bandwidth moves within a run this is the fraction that means
something. The numpy copy figure of earlier runs (read + write bytes
per second, one thread) is still measured and reported, with its roofline beside the
read one (``roofline_copy``, ``copy_roofline_fraction``), for comparison: a copy is not a
ceiling for a stream that only reads.

llama.cpp is built from the ``llama-cpp-python`` sdist in ``--llama-cpp-dir`` (default
``~/.cache/colibri-lab/llama.cpp``): ``pip download --no-deps --no-binary :all:
--no-build-isolation llama-cpp-python`` (which needs ``pip install scikit-build-core cmake
ninja`` first), then CMake/Ninja for ``llama-bench llama-quantize llama-completion`` (about
6.5 minutes on two cores, once), and the GGUF is made with its ``convert_hf_to_gguf.py``
at the run's dtype. Nothing of llama.cpp enters this repository. An engine that cannot
run says why in its column ("not available: ...") instead of stopping the benchmark.

Quantized dtypes (``q8_0``, ``q4_k_m``; mixable with f32 and bf16): llama.cpp's GGUF is
``llama-quantize``'s Q8_0 / Q4_K_M of the ``--quant-from`` GGUF (f32 by default, the
lossless one, so every weight is rounded once), and Colibri runs that same GGUF imported
by :func:`colibri_lab.conversion.gguf.convert_gguf` (bytes copied, not requantized), so both
engines stream the very same weights. Only where no GGUF can be made (llama.cpp not
built, as in CI's smoke run) does Colibri fall back to its own converter (``convert
--dtype q8_0``), and the table says so. transformers has no such weights: its rows say
"not applicable". The roofline of a quantized run counts the bytes as stored, summed
over the file's tensor directory (:func:`colibri_lab.bench.tuning.file_decode_roofline`: each
tensor's own type, top-k experts of each MoE layer, one embedding row), so mixed files
(Q4_K_M holds Q4_K, Q5_K, Q6_K and Q8_0 tensors) are counted right; the f32 and bf16
rooflines stay :func:`colibri_lab.bench.tuning.decode_roofline`'s, from the config.

Timings are printed, never judged: no result of this tool passes or fails.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .models import DEEPSEEK_V3_800M, MIXTRAL_791M, QWEN3_MOE_A3B_3L, make_family_model, make_model
from .tuning import (decode_roofline, file_decode_roofline, machine_info, measure_bandwidth, measure_read_bandwidth,
                     read_hf_config)
from .common import DTYPES, ENGINES, SMOKE_SHAPE, _say, default_cache_dir
from .files import (colibri_file, colibri_from_gguf, drop_from_page_cache, hugepage_fraction,
                    source_info)
from .llama_cpp import (ISA_BUILDS, ISA_CPU_FLAGS, NO_REPACK, QUANT_BASES, QUANT_TYPES, LlamaBenchCrash, needs_bpe_stand_in,
                        ensure_llama_cpp, gguf_file, run_llama_bench)

# --make-model FAMILY: the random models of other families (transformers config keys)
# (folder, family, config, tokenizer): byte-level BPE where llama.cpp's converter for the
# family reads tokenizer.json (DeepSeek; Qwen's reads a SentencePiece model only through a
# tokenizer whose ids it then checks against the vocabulary size)
FAMILY_MODELS = {"deepseek_v3": ("deepseek_v3-800m", "deepseek_v3", DEEPSEEK_V3_800M, "auto"),
                 "qwen3_moe_a3b": ("qwen3_moe-a3b-3l", "qwen3_moe", QWEN3_MOE_A3B_3L, "bpe")}

#: Every dtype the benchmark runs: the float ones and llama.cpp's quantized types.
BENCH_DTYPES = tuple(DTYPES) + tuple(QUANT_TYPES)

#: The read-bandwidth buffer (MiB) of a full run: past the last-level cache (the Xeon VM of
#: docs/performance.md reports a 480 MiB L3, shared with the host; 256 MiB and 2 GiB read
#: alike there, 32 MiB about twice as fast).
READ_BW_MIB = 1024


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


def _colibri_worker(conn, path: str, threads: int, max_seq_len: int, precision: str = "exact"):
    from ..runtime._native import version
    from ..runtime.engine import Engine

    # the default load path, a user's: populate "auto" faults the whole file in at load
    # when it fits in half of the available memory, as llama.cpp's loader does (a MoE
    # warm-up touches only the experts it routes to; the rest would fault in during timed
    # runs), and leaves a model larger than that to fault in on demand
    eng = Engine(path, num_threads=threads, max_seq_len=max_seq_len, precision=precision)
    c = eng.config
    try:  # the kernel table in use ("reference", "avx2", ...), where the library reports it
        kernels = eng._get_string("kernels")
    except Exception:
        kernels = "not reported"
    conn.send({"ok": True, "threads_used": c.threads_used, "weight_dtype": c.weight_dtype,
               "vocab": c.vocab_size, "kernels": kernels, "version": version(),
               "precision": c.precision})  # fmt: skip
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
        # transformers 5's grouped_mm experts fail on the CPU for sizes that are not a
        # multiple of 4 floats (16-byte strides); the eager implementation takes any size
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


def _llama_rep(ent: dict, src: Path, gguf: Path, threads: int, n_pre: int, n_dec: int,
               isa: str = "native") -> dict:
    """One llama-bench repetition. If llama-bench dies of a signal with its defaults, the
    configuration is rerun, now and for its later repetitions, with ``--repack 0``
    (llama_cpp.NO_REPACK says why), and the entry records it (``llama_bench_args``,
    ``llama_bench_note``); the table names the row "llama.cpp (--repack 0)"."""
    try:
        return run_llama_bench(src, gguf, threads, n_pre, n_dec, ent.get("llama_bench_args", ()), isa)
    except LlamaBenchCrash as ex:
        if ent.get("llama_bench_args"):
            raise
        ent["llama_bench_args"] = list(NO_REPACK)
        ent["llama_bench_note"] = (f"{ex} with its default buffers (AMX / repacked weights); "
                                   f"rerun with {' '.join(NO_REPACK)}")  # fmt: skip
        _say(f"llama.cpp: {ent['llama_bench_note']}")
        return run_llama_bench(src, gguf, threads, n_pre, n_dec, ent["llama_bench_args"], isa)


def _model_files(engines, dtype: str, model_dir: Path, cache: Path, llama_src, llama_err,
                 quant_from: str, threads: int) -> tuple[dict, dict]:
    """Each engine's model file at `dtype` (a Path, or the exception that says why there
    is none), and what the JSON records of them (paths, how Colibri's was made).

    f32/bf16: Colibri's converter and llama.cpp's convert_hf_to_gguf.py, each from the
    checkpoint. Quantized: llama.cpp's GGUF (llama-quantize), which Colibri imports as it
    is; only without a GGUF (llama.cpp not built) Colibri's own converter, said so."""
    files: dict[str, object] = {}
    info: dict[str, object] = {}
    if dtype not in QUANT_TYPES:
        if "colibri" in engines:
            try:
                files["colibri"] = colibri_file(model_dir, dtype, cache)
                info["colibri_source"] = f"colibri_lab.convert --dtype {dtype}"
            except Exception as e:
                files["colibri"] = e
        if "llama.cpp" in engines and llama_src is not None:
            try:
                files["llama.cpp"] = gguf_file(llama_src, model_dir, dtype, cache)
            except Exception as e:
                files["llama.cpp"] = e
    else:
        gguf: object = RuntimeError(llama_err or "llama.cpp not found")
        if llama_src is not None and {"colibri", "llama.cpp"} & set(engines):
            try:
                gguf = gguf_file(llama_src, model_dir, dtype, cache, quant_from=quant_from,
                                 threads=threads)  # fmt: skip
            except Exception as e:
                gguf = e
        if isinstance(gguf, Path):
            info["gguf_source"] = (f"llama-quantize {QUANT_TYPES[dtype]} of the convert_hf_"
                                   f"to_gguf.py --outtype {quant_from} GGUF")  # fmt: skip
        if "llama.cpp" in engines and llama_src is not None:
            files["llama.cpp"] = gguf
        if "colibri" in engines:
            if isinstance(gguf, Path):
                try:
                    files["colibri"] = colibri_from_gguf(gguf, cache,
                                                         "none" if needs_bpe_stand_in(model_dir) else "auto")
                    info["colibri_source"] = f"gguf_import of {gguf.name} (llama.cpp's bytes)"
                except Exception as e:  # no fallback: the engines would run different weights
                    files["colibri"] = RuntimeError(f"importing {gguf.name} failed: {e}")
            else:
                why = (str(gguf).strip() or type(gguf).__name__).splitlines()[0]
                why = why.split(" (")[0]  # the reason, without the advice in parentheses
                try:
                    files["colibri"] = colibri_file(model_dir, dtype, cache)
                    info["colibri_source"] = (f"colibri_lab.convert --dtype {dtype}, not "
                                              f"llama.cpp's bytes (no GGUF: {why})")  # fmt: skip
                except Exception as e:
                    files["colibri"] = e
    for e, f in files.items():
        info[e] = str(f) if isinstance(f, Path) else None
    return files, info


def _roofline(hf_cfg: dict, dtype: str, bandwidth_gbs: float, files: dict) -> dict:
    """The decode roofline of a configuration. f32/bf16 Mixtral: from the config, as ever
    (:func:`decode_roofline`); quantized, or another family (latent attention, shared
    experts, dense layers): from the tensor directory of the file the engines run
    (Colibri's, else llama.cpp's GGUF: the same bytes where both exist)."""
    if dtype not in QUANT_TYPES and hf_cfg.get("model_type", "mixtral") == "mixtral":
        roof = decode_roofline(hf_cfg, dtype, bandwidth_gbs)
        roof["bits_per_weight"] = roof["bytes_per_token"] * 8 / roof["active_params"]
        return roof
    why = "no model file"
    for e in ("colibri", "llama.cpp"):
        f = files.get(e)
        if isinstance(f, Path):
            try:
                return file_decode_roofline(f, bandwidth_gbs)
            except Exception as ex:
                why = f"{f.name}: {ex}"
    return {"dtype": dtype, "roofline_tok_s": None, "bandwidth_gbs": bandwidth_gbs,
            "error": why}  # fmt: skip


def _adjacent_read_gbs(start: dict | None, threads: int, mib: int) -> float | None:
    """The read bandwidth just before an engine's repetition: the start's best variant,
    once. These machines' memory bandwidth moves with their neighbours within seconds
    (docs/performance.md, "How each figure is measured"), so a roofline from the start alone
    can sit far from what a repetition had; ``roofline_fraction_adjacent`` divides each
    repetition's decode by the roofline at this figure (median over the repetitions)."""
    if not start or not start.get("gbs") or not start.get("variant"):
        return None
    try:
        return measure_read_bandwidth(threads, mib << 20, reps=1, variants=(start["variant"],))["gbs"] or None
    except Exception:  # advisory: the start's roofline stands
        return None


def colibri_key(precision: str) -> str:
    """The engine name of Colibri in one numeric mode: "colibri" (exact), "colibri fast"."""
    return "colibri" if precision == "exact" else f"colibri {precision}"


def key_precision(key: str) -> str:
    return key.split(" ", 1)[1] if " " in key else "exact"


def _fast_vs_exact(path: Path, args, hf_cfg: dict, threads: int) -> dict:
    """The fast mode's accuracy against the exact one on this file (not timed): KL, top-1 and
    routing flips over the first repetition's prompt ids (quality.precision_agreement)."""
    from ..analysis.quality import precision_agreement

    _say(f"fast vs exact on {Path(path).name}")
    ids = _ids_for(args.seed, 0, args.prefill, hf_cfg["vocab"], 1)
    try:
        r = precision_agreement(path, ids, num_threads=threads, chunk=min(256, len(ids)))
    except Exception as ex:
        return {"error": f"{type(ex).__name__}: {ex}"}
    return {k: r[k] for k in ("kl_mean", "kl_max", "top1", "routing_flips", "n_tokens", "kernels")
            if k in r}


#: The environment that limits each engine's kernels to an instruction set (--isa): Colibri's
#: tables (registry: COLIBRI_KERNELS, COLIBRI_FAST_KERNELS), PyTorch's dispatch and oneDNN's.
#: llama.cpp is limited by its build instead (llama_cpp.ISA_BUILDS).
ISA_ENV = {"native": {},
           "avx2": {"COLIBRI_KERNELS": "avx2", "COLIBRI_FAST_KERNELS": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
                    "ONEDNN_MAX_CPU_ISA": "AVX2"}}


def isa_missing(isa: str, simd) -> list[str]:
    """The flags of llama_cpp.ISA_CPU_FLAGS[isa] that a machine's SIMD flags
    (tuning.machine_info) lack."""
    have = {f.lower() for f in simd}
    return [f for f in ISA_CPU_FLAGS.get(isa, ()) if f not in have]


def run(args) -> dict:
    """The benchmark (main's parsed arguments); under --isa, with ISA_ENV set for the run."""
    isa = getattr(args, "isa", "native")
    missing = isa_missing(isa, machine_info().get("simd", []))
    if missing:
        raise SystemExit(f"bench: --isa {isa} needs {', '.join(ISA_CPU_FLAGS[isa])}; this CPU lacks "
                         f"{', '.join(missing)}")  # fmt: skip
    saved = {k: os.environ.get(k) for k in ISA_ENV[isa]}
    os.environ.update(ISA_ENV[isa])  # the spawned workers inherit it
    try:
        return _run(args, isa)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run(args, isa: str) -> dict:
    cache = Path(args.cache_dir).expanduser()
    llama_root = Path(args.llama_cpp_dir).expanduser() if args.llama_cpp_dir else cache / "llama.cpp"
    engines, dtypes, threads = args.engines, args.dtype, args.threads
    if isinstance(args.precision, str):  # as main() splits it
        args.precision = [x.strip() for x in args.precision.split(",") if x.strip()]

    if args.model_dir:
        model_dir = Path(args.model_dir).expanduser()
        if not (model_dir / "config.json").is_file():
            raise SystemExit(f"bench: {model_dir} has no config.json; give a Hugging Face "
                             "checkpoint folder or use --make-model")  # fmt: skip
    elif args.smoke:
        model_dir = make_model(cache / "models" / "mixtral-smoke", SMOKE_SHAPE, seed=args.seed,
                               log=_say)
    else:
        which = args.make_model or "mixtral"
        if which != "mixtral":
            folder, family, config, tokenizer = FAMILY_MODELS[which]
            model_dir = make_family_model(cache / "models" / folder, family, config,
                                          seed=args.seed, log=_say, tokenizer=tokenizer)
        else:
            if not args.make_model and not (cache / "models" / "mixtral-791m" / "config.json").is_file():
                raise SystemExit("bench: no model: pass --model-dir DIR, or --make-model to generate "
                                 "the 791 M random Mixtral into the cache")  # fmt: skip
            model_dir = make_model(cache / "models" / "mixtral-791m", MIXTRAL_791M, seed=args.seed,
                                   log=_say)
    hf_cfg = read_hf_config(model_dir)
    n_pre, n_dec = args.prefill, args.decode
    from ..runtime._native import library_facts

    lib_facts = library_facts()  # the spawned Colibri workers load the same file
    _say(f"Colibri library: {lib_facts['path']} (built {lib_facts['built_utc']})")
    if lib_facts["stale"]:
        _say(f"WARNING: {lib_facts['stale']}")

    result = {
        "tool": "colibri_lab.bench",
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join([Path(sys.executable).name, "-m", "colibri_lab.bench", *sys.argv[1:]]),
        "machine": machine_info(),
        "loadavg_start": list(os.getloadavg()),
        "source": source_info(),
        "library": lib_facts,
        "model_dir": str(model_dir),
        "model": hf_cfg,
        "prefill_tokens": n_pre,
        "decode_tokens": n_dec,
        "reps": args.reps,
        "seed": args.seed,
        "precisions": list(args.precision),
        "isa": isa,
        "token_ids": "numpy PRNG seeded by (seed, rep), uniform over [3, vocab), BOS first; "
                     "the same ids for colibri and transformers; llama-bench draws its own "
                     "with std::rand()",
        "configs": [],
    }
    _say("measuring memory bandwidth (numpy copy)")
    bw = measure_bandwidth(args.bandwidth_mib << 20, reps=3 if args.smoke else 5)
    result["bandwidth"] = bw
    # the roofline's bandwidth: a C streaming read on each thread count the engines run with
    read_bw: dict[str, dict] = {}
    for nt in threads:
        _say(f"measuring read bandwidth ({nt} thread{'s' if nt > 1 else ''}, "
             f"{args.read_bandwidth_mib} MiB)")
        try:
            read_bw[str(nt)] = measure_read_bandwidth(nt, args.read_bandwidth_mib << 20,
                                                      reps=3 if args.smoke else 5)
        except Exception as ex:  # e.g. no memory for the buffer: the copy figure stands in
            read_bw[str(nt)] = {"gbs": None, "error": f"{type(ex).__name__}: {ex}"}
            _say(f"read bandwidth not measured: {read_bw[str(nt)]['error']}")
    result["read_bandwidth"] = read_bw
    result["warnings"] = []
    if lib_facts.get("stale"):
        result["warnings"].append(f"the Colibri library is older than its sources: {lib_facts['stale']}")

    llama_src, llama_err = None, None
    quant_from = getattr(args, "quant_from", "f32")
    if any(d in QUANT_TYPES for d in dtypes):
        result["quant_from"] = quant_from
    if "llama.cpp" in engines or any(d in QUANT_TYPES for d in dtypes):
        # a quantized dtype needs llama.cpp's converter and quantizer even for Colibri
        # alone (it runs the same GGUF); only a run of llama.cpp itself builds it
        try:
            llama_src = ensure_llama_cpp(llama_root, build="llama.cpp" in engines
                                         and not (args.smoke or args.no_build),
                                         isa=isa if "llama.cpp" in engines else "native")  # fmt: skip
        except Exception as e:
            llama_err = str(e)
        result["llama_cpp_dir"] = str(llama_src or llama_root)

    for dtype in dtypes:
        # model files first (conversion is not timed)
        files, file_info = _model_files(engines, dtype, model_dir, cache, llama_src, llama_err,
                                        quant_from, max(threads))  # fmt: skip
        roof_copy = _roofline(hf_cfg, dtype, bw["median_gbs"], files)
        for nt in threads:
            if read_bw[str(nt)].get("gbs"):
                roof = _roofline(hf_cfg, dtype, read_bw[str(nt)]["gbs"], files)
                roof["bandwidth"] = f"read, {nt} thread{'s' if nt > 1 else ''}"
            else:
                roof = dict(roof_copy, bandwidth="copy (the read bandwidth was not measured)")
            cfg = Config(dtype, nt)
            workers: dict[str, Worker] = {}
            # Colibri once per numeric mode: "colibri" (exact), "colibri fast"
            run_engines = [n for e in engines for n in
                           ([colibri_key(p) for p in args.precision] if e == "colibri" else [e])]
            # every engine loads its file cold (drop_from_page_cache says why)
            for f in files.values():
                if isinstance(f, Path):
                    drop_from_page_cache(f)
            for e in run_engines:
                cfg.engines[e] = {"reps": []}
                if e == "transformers" and dtype in QUANT_TYPES:
                    cfg.engines[e]["status"] = (f"not applicable: transformers has no {dtype} "
                                                "weights")  # fmt: skip
                    cfg.engines[e]["not_applicable"] = True
                    continue
                try:
                    if e.startswith("colibri"):
                        if isinstance(files["colibri"], Exception):
                            raise files["colibri"]
                        w = Worker("colibri", str(files["colibri"]), nt, n_pre + n_dec, key_precision(e))
                        cfg.engines[e].update({k: w.info[k] for k in
                                               ("threads_used", "kernels", "version",
                                                "weight_dtype", "precision")})  # fmt: skip
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
                for e in run_engines:
                    ent = cfg.engines[e]
                    if "error" in ent or ent.get("not_applicable"):
                        continue
                    bw_now = _adjacent_read_gbs(read_bw.get(str(nt)), nt, args.read_bandwidth_mib)
                    try:
                        if e == "llama.cpp":
                            r = _llama_rep(ent, llama_src, files["llama.cpp"], nt, n_pre, n_dec, isa)
                        else:
                            r = workers[e].run(prompt, dec)
                    except Exception as ex:
                        ent["error"] = str(ex)
                        continue
                    if bw_now and roof.get("roofline_tok_s") and r.get("decode_tok_s"):
                        r["read_gbs_before"] = bw_now
                        r["roofline_fraction_adjacent"] = r["decode_tok_s"] / (
                            roof["roofline_tok_s"] * bw_now / roof["bandwidth_gbs"])
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
                if ent.get("not_applicable"):
                    continue
                ent["prefill_tok_s"] = _median(ent["reps"], "prefill_tok_s")
                ent["decode_tok_s"] = _median(ent["reps"], "decode_tok_s")
                for k in ("prefill_cpu_ms_per_tok", "decode_cpu_ms_per_tok"):
                    if _median(ent["reps"], k) is not None:
                        ent[k] = _median(ent["reps"], k)
                p50, p99 = _median(ent["reps"], "decode_p50_ms"), _median(ent["reps"], "decode_p99_ms")
                if p50 and p99:
                    ent["decode_p99_over_p50"] = p99 / p50
                if ent["decode_tok_s"] and roof.get("roofline_tok_s"):
                    ent["roofline_fraction"] = ent["decode_tok_s"] / roof["roofline_tok_s"]
                    if ent["roofline_fraction"] > 1:
                        w = (f"{e} {dtype} {nt}t decodes {ent['decode_tok_s']:.1f} tok/s, "
                             f"{ent['roofline_fraction']:.0%} of the read roofline "
                             f"({roof['roofline_tok_s']:.1f} tok/s at "
                             f"{roof['bandwidth_gbs']:.1f} GB/s): the roofline is wrong "
                             "(bandwidth measured low, e.g. on a busy machine, or weights "
                             "served from cache)")  # fmt: skip
                        result["warnings"].append(w)
                        _say(f"warning: {w}")
                if _median(ent["reps"], "roofline_fraction_adjacent") is not None:
                    ent["roofline_fraction_adjacent"] = _median(ent["reps"], "roofline_fraction_adjacent")
                if ent["decode_tok_s"] and roof_copy.get("roofline_tok_s"):
                    ent["copy_roofline_fraction"] = ent["decode_tok_s"] / roof_copy["roofline_tok_s"]
                if (isa != "native" and e.startswith("colibri") and ent.get("kernels")
                        and not str(ent["kernels"]).startswith(ISA_ENV[isa]["COLIBRI_KERNELS"])):
                    w = f"{e} {dtype} ran the kernel table {ent['kernels']!r}, not the --isa {isa} one"
                    result["warnings"].append(w)
                    _say(f"warning: {w}")
                if "error" in ent and not ent["reps"]:
                    ent["status"] = f"not available: {ent['error']}"
                else:
                    ent["status"] = "ok" if "error" not in ent else f"partial: {ent['error']}"
            for p in args.precision:  # colibri_over_this_* (exact), colibri_fast_over_this_* ...
                col, pre = cfg.engines.get(colibri_key(p), {}), colibri_key(p).replace(" ", "_")
                for e, ent in cfg.engines.items():
                    if e.startswith("colibri"):
                        continue
                    for k in ("prefill_tok_s", "decode_tok_s"):
                        if col.get(k) and ent.get(k):
                            ent[f"{pre}_over_this_{k[:-6]}"] = col[k] / ent[k]
            entry = {"dtype": dtype, "threads": nt, "roofline": roof, "roofline_copy": roof_copy,
                     "files": file_info, "engines": cfg.engines}
            if ("colibri" in engines and "fast" in args.precision and nt == max(threads)
                    and not isinstance(files.get("colibri"), (Exception, type(None)))):
                entry["fast_vs_exact"] = _fast_vs_exact(files["colibri"], args, hf_cfg, nt)
            result["configs"].append(entry)
    result["loadavg_end"] = list(os.getloadavg())
    result["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return result


def _fmt(v, spec=".1f") -> str:
    return "—" if v is None else format(v, spec)


def _mb_bits(roof: dict) -> str:
    """The weight MB one decode token reads and their bits per weight: '148.8 (5.18)'."""
    b, bits = roof.get("bytes_per_token"), roof.get("bits_per_weight")
    if not b:
        return "—"
    return f"{b / 1e6:.1f}" + (f" ({bits:.2f})" if bits else "")


def _quant_lines(res: dict) -> list[str]:
    """One line per quantized dtype: the files each engine ran, and its bytes per token by
    tensor type."""
    out, seen = [], set()
    for c in res["configs"]:
        dt = c["dtype"]
        if dt in seen or dt not in QUANT_TYPES:
            continue
        seen.add(dt)
        f, roof = c.get("files") or {}, c["roofline"]
        parts = [f"{dt}:"]
        if f.get("gguf_source"):
            parts.append(f"GGUF = {f['gguf_source']};")
        if f.get("colibri_source"):
            parts.append(f"Colibri runs {f['colibri_source']};")
        if roof.get("bytes_per_token"):
            by = ", ".join(f"{k} {v / 1e6:.3g}"
                           for k, v in (roof.get("bytes_by_dtype") or {}).items())
            parts.append(f"weights per decode token {roof['bytes_per_token'] / 1e6:.1f} MB "
                         f"({by}), {roof['bits_per_weight']:.2f} bits/weight "
                         f"(whole file {roof.get('file_bits_per_weight', float('nan')):.2f}), "
                         f"from the tensor directory of {Path(roof.get('from_file', '?')).name}")
        else:
            parts.append(f"no roofline: {roof.get('error', '?')}")
        out.append(" ".join(parts))
    return out


def _read_bw_lines(res: dict) -> list[str]:
    """One line per thread count: the read bandwidth the roofline uses, and each variant's."""
    out = []
    for nt, r in (res.get("read_bandwidth") or {}).items():
        parts = []
        for name, v in r.get("variants", {}).items():
            parts.append(f"{name} {v['best_gbs']:.1f}" if "best_gbs" in v else f"{name} n/a")
        if r.get("error"):
            out.append(f"read bandwidth, {nt} thread(s): not measured ({r['error']}); the "
                       "roofline uses the copy bandwidth")
            continue
        out.append(f"read bandwidth, {nt} thread{'s' if str(nt) != '1' else ''}: "
                   f"{_fmt(r.get('gbs'))} GB/s ({r.get('variant')}; best of each variant: "
                   f"{', '.join(parts)}; {r.get('bytes', 0) >> 20} MiB, C streaming read; "
                   "the 'roofline' column)")
    return out


def render_table(res: dict) -> str:
    """The result as a Markdown table plus the facts it rests on."""
    m, bw = res["machine"], res["bandwidth"]
    lines = [
        f"machine: {m.get('cpu', '?')}, {m.get('cpus_usable')} usable CPUs, "
        f"SIMD {'/'.join(m.get('simd', [])) or '?'}, {m.get('mem_gib', '?')} GiB RAM",
        *_read_bw_lines(res),
        f"copy bandwidth: {bw['median_gbs']:.1f} GB/s median (max {bw['max_gbs']:.1f}; by the wall "
        f"clock {bw['wall_median_gbs']:.1f}; {bw['method']}; the 'copy roofline' column)",
        *([f"Colibri library: {res['library']['path']} (built {res['library']['built_utc']})"]
          if res.get("library") else []),
        f"model: {res['model_dir']} ({res['model']['model_type']}, {res['model']['layers']} layers, "
        f"hidden {res['model']['hidden']}, {res['model']['experts']} experts top-{res['model']['top_k']}, "
        f"vocab {res['model']['vocab']})",
        f"load average (1 min) at start {res['loadavg_start'][0]:.1f}, at end {res['loadavg_end'][0]:.1f}",
        *([f"instruction sets: {res['isa']} only, both engines (Colibri's {res['isa']} tables; llama.cpp "
           f"built for it in {ISA_BUILDS[res['isa']]}/)"] if res.get("isa", "native") != "native" else []),
        f"prefill {res['prefill_tokens']} tokens, decode {res['decode_tokens']} tokens after it; "
        f"median of {res['reps']} repetition(s), engines alternating",
        *_quant_lines(res),
        *[f"llama.cpp {c['dtype']} {c['threads']}t: {c['engines']['llama.cpp']['llama_bench_note']}"
          for c in res["configs"] if c["engines"].get("llama.cpp", {}).get("llama_bench_note")],
        *[f"fast vs exact, {c['dtype']} (Colibri, the prompt's {c['fast_vs_exact'].get('n_tokens', '?')} "
          f"positions): " + (f"mean KL {c['fast_vs_exact']['kl_mean']:.3g}, max KL "
                            f"{c['fast_vs_exact']['kl_max']:.3g}, top-1 agreement "
                            f"{c['fast_vs_exact']['top1']:.2%}, routing decisions changed "
                            f"{c['fast_vs_exact']['routing_flips']:.2%}"
                            if "kl_mean" in c["fast_vs_exact"] else c["fast_vs_exact"].get("error", "?"))
          for c in res["configs"] if c.get("fast_vs_exact")],
        *[f"WARNING: {w}" for w in res.get("warnings", [])],
        "",
        "| dtype | threads | engine | prefill tok/s | decode tok/s | decode P99/P50 "
        "| weight MB/token (bits/weight) | roofline tok/s | decode ÷ roofline "
        "| copy roofline tok/s | Colibri ÷ this (prefill, decode; exact; fast) | CPU ms/token (prefill, decode) "
        "| file in 2 MiB pages |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in res["configs"]:
        roof = c["roofline"].get("roofline_tok_s")
        roof_copy = (c.get("roofline_copy") or {}).get("roofline_tok_s")
        mb = _mb_bits(c["roofline"])
        for e, ent in c["engines"].items():
            if ent.get("status", "").startswith(("not available", "not applicable")):
                lines.append(f"| {c['dtype']} | {c['threads']} | {e} | {ent['status']} |"
                             + " |" * 9)
                continue
            name = e
            if e.startswith("colibri") and ent.get("kernels") not in (None, "not reported"):
                name += f" [{ent['kernels']}]"
            if e.startswith("colibri") and ent.get("threads_used") not in (None, c["threads"]):
                name += f" ({ent['threads_used']} thread used)"
            if e == "llama.cpp" and ent.get("llama_bench_args"):
                name += f" ({' '.join(ent['llama_bench_args'])})"
            if e == "transformers" and ent.get("experts_implementation") == "eager":
                name += " (eager experts)"
            adj = ""
            if ent.get("roofline_fraction_adjacent") is not None:
                adj = f" ({ent['roofline_fraction_adjacent']:.0%} adjacent)"
            ratio = "—"
            if not e.startswith("colibri"):
                ratio = "; ".join(
                    f"{'' if p == 'exact' else p + ' '}{_fmt(ent.get(f'{pre}_over_this_prefill'), '.2f')}, "
                    f"{_fmt(ent.get(f'{pre}_over_this_decode'), '.2f')}"
                    for p in res.get("precisions", ["exact"])
                    for pre in [colibri_key(p).replace(" ", "_")])  # fmt: skip
            lines.append(
                f"| {c['dtype']} | {c['threads']} | {name} | {_fmt(ent.get('prefill_tok_s'))} "
                f"| {_fmt(ent.get('decode_tok_s'))} | {_fmt(ent.get('decode_p99_over_p50'), '.2f')} "
                f"| {mb} | {_fmt(roof)} | {_fmt(ent.get('roofline_fraction'), '.0%')}{adj} "
                f"| {_fmt(roof_copy)} | {ratio} "
                f"| {_fmt(ent.get('prefill_cpu_ms_per_tok'), '.1f')}, "
                f"{_fmt(ent.get('decode_cpu_ms_per_tok'), '.1f')} "
                f"| {_fmt(ent.get('file_hugepage_fraction'), '.0%')} |"
            )
    return "\n".join(lines)


def isa_summary(simd) -> str:
    """The instruction sets a machine's kernels can use, in a few words (from its SIMD flags)."""
    s = {f.lower() for f in simd}
    if "avx512f" in s:
        extra = [name for flag, name in (("avx512_bf16", "BF16"), ("avx512_vnni", "VNNI"), ("avx512vnni", "VNNI"),
                                          ("amx_bf16", "AMX"), ("amx_tile", "AMX")) if flag in s]
        return "AVX-512" + (" + " + " + ".join(dict.fromkeys(extra)) if extra else "")
    if "avx2" in s:
        return "AVX2" + (" + FMA" if "fma" in s else "") + " (no AVX-512)"
    if "asimd" in s:
        extra = [name for flag, name in (("asimddp", "dotprod"), ("i8mm", "i8mm"), ("bf16", "bf16")) if flag in s]
        return "NEON" + (" + " + " + ".join(extra) if extra else "")
    return "/".join(simd) or "unknown ISA"


def render_summary(res: dict, machine: str | None = None) -> str:
    """One short Markdown table of a run, as the README shows it: a caption naming the machine,
    its ISA, the threads, the date and the commit, then a row per engine and weight type
    (prefill and decode tokens/s, medians; Colibri's rows name the kernel table that ran)."""
    m = res["machine"]
    date = (res.get("started_utc") or "")[:10] or "undated"
    head = (res.get("source") or {}).get("git_head") or "unknown commit"
    threads = sorted({c["threads"] for c in res["configs"]})
    isa = (isa_summary(m.get("simd", [])) if res.get("isa", "native") == "native"
           else f"{res['isa'].upper()} only (both engines; the CPU has {isa_summary(m.get('simd', []))})")
    lines = [f"**{machine or m.get('cpu', '?')}, {isa}, "
             f"{'/'.join(map(str, threads))} thread{'s' if threads != [1] else ''}, {date}, commit {head}**",
             "", "| engine, weights | prefill tok/s | decode tok/s |", "|---|---|---|"]
    for c in res["configs"]:
        for e, ent in c["engines"].items():
            if ent.get("status", "").startswith(("not available", "not applicable")):
                continue
            if e.startswith("colibri"):
                name = f"Colibri {key_precision(e)}, {c['dtype']}"
                if ent.get("kernels") not in (None, "not reported"):
                    name += f" [{ent['kernels']}]"
            elif e == "llama.cpp":
                name = f"llama.cpp, {c['dtype'].upper() if c['dtype'].startswith('q') else c['dtype']}"
            else:
                name = f"{e}, {c['dtype']}"
            if len(threads) > 1:
                name += f", {c['threads']} threads"
            lines.append(f"| {name} | {_fmt(ent.get('prefill_tok_s'))} | {_fmt(ent.get('decode_tok_s'))} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m colibri_lab.bench",
        description="Colibri vs llama.cpp vs transformers on one model: prefill and decode "
                    "tokens/s (medians, ratios), memory bandwidth and the decode roofline.",
    )  # fmt: skip
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model-dir", help="Hugging Face checkpoint folder (config.json + safetensors)")
    src.add_argument("--make-model", nargs="?", const="mixtral", default=None,
                     choices=["mixtral", *FAMILY_MODELS],
                     help="generate a random model (seeded) into the cache and use it: the 791 M "
                          "Mixtral (no value), deepseek_v3 (about 800 M, models.DEEPSEEK_V3_800M) or "
                          "qwen3_moe_a3b (Qwen3-30B-A3B's MoE shape, 3 layers, 2.0 G: "
                          "models.QWEN3_MOE_A3B_3L)")
    p.add_argument("--dtype", default="f32",
                   help="comma-separated f32, bf16, q8_0, q4_k_m, q4_0, q4_1, q5_0, q5_1, q3_k_m, q2_k, "
                        "iq4_nl, iq4_xs, iq2_xxs, iq2_xs, iq2_m, iq3_xxs, iq3_m, iq1_s, iq1_m "
                        "(llama.cpp's quantized types; Colibri runs the same GGUF, imported), "
                        "e.g. f32,bf16 (default f32)")
    p.add_argument("--quant-from", default="f32", choices=QUANT_BASES,
                   help="the GGUF outtype llama-quantize quantizes from (default f32: lossless "
                        "for f32 and bf16 checkpoints)")  # fmt: skip
    p.add_argument("--threads", default="2", help="threads per engine, e.g. 2 or 2,1 (default 2)")
    p.add_argument("--reps", type=int, default=3, help="repetitions per engine (default 3)")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help="comma-separated subset of colibri,llama.cpp,transformers (default all)")
    p.add_argument("--precision", default="exact,fast",
                   help="Colibri's numeric modes, each run as an engine of its own: exact, fast "
                        "or exact,fast (default; docs/kernels.md 'Numeric modes'); with fast, the "
                        "fast mode's KL / top-1 / routing flips against exact are printed too")
    p.add_argument("--prefill", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--decode", type=int, default=128, help="decoded tokens (default 128)")
    p.add_argument("--seed", type=int, default=0, help="seed of the token ids and the model")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="write the raw result as JSON to PATH ('-' or no value: stdout)")
    p.add_argument("--markdown", action="store_true",
                   help="also print the short table the README shows (machine, ISA, threads, date and "
                        "commit in its caption; a row per engine and weight type)")
    p.add_argument("--machine-label", default=None,
                   help="the machine's name in the --markdown caption (default: the CPU model the run read)")
    p.add_argument("--from-json", metavar="PATH", default=None,
                   help="run nothing: print the tables of a result saved with --json")
    p.add_argument("--smoke", action="store_true",
                   help="tiny model, 1 rep, 32+8 tokens, small bandwidth buffer, never builds "
                        "llama.cpp: a check that everything runs (what CI runs)")  # fmt: skip
    p.add_argument("--cache-dir", default=str(default_cache_dir()),
                   help="models, converted files and llama.cpp (default ~/.cache/colibri-lab, "
                        "or $COLIBRI_LAB_CACHE)")  # fmt: skip
    p.add_argument("--llama-cpp-dir", default=None,
                   help="llama.cpp cache: an unpacked sdist or source tree (default CACHE/llama.cpp)")
    p.add_argument("--no-build", action="store_true", help="do not download or build llama.cpp")
    p.add_argument("--isa", default="native", choices=tuple(ISA_ENV),
                   help="instruction sets both engines may use: native (default: all the CPU has) "
                        "or avx2 (an AVX2-only machine's, e.g. Zen 3, on a newer CPU: Colibri's "
                        "avx2 kernel tables, PyTorch's AVX2 dispatch, llama.cpp built again with "
                        "AVX-512 and AVX-VNNI off in its build-avx2 folder, once, about 5 min)")
    p.add_argument("--bandwidth-mib", type=int, default=512,
                   help="size of the numpy copy bandwidth buffer in MiB (default 512)")
    p.add_argument("--read-bandwidth-mib", type=int, default=READ_BW_MIB,
                   help=f"size of the read-bandwidth buffer in MiB, the roofline's (default "
                        f"{READ_BW_MIB}: several times a large last-level cache)")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.from_json:
        try:
            res = json.loads(Path(args.from_json).read_text())
            print(render_table(res))
            print()
            print(render_summary(res, args.machine_label))
        except (OSError, ValueError, KeyError) as e:
            print(f"error: {args.from_json}: not a saved result of this benchmark ({e})", file=sys.stderr)
            return 1
        return 0
    if args.smoke:
        if args.reps == p.get_default("reps"):
            args.reps = 1
        if args.prefill == p.get_default("prefill"):
            args.prefill = 32
        if args.decode == p.get_default("decode"):
            args.decode = 8
        if args.bandwidth_mib == p.get_default("bandwidth_mib"):
            args.bandwidth_mib = 32
        if args.read_bandwidth_mib == p.get_default("read_bandwidth_mib"):
            args.read_bandwidth_mib = 32
    if (args.reps < 1 or args.prefill < 1 or args.decode < 0 or args.bandwidth_mib < 1
            or args.read_bandwidth_mib < 1):
        p.error("--reps, --prefill, --bandwidth-mib and --read-bandwidth-mib must be >= 1, "
                "--decode >= 0")
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for e in args.engines:
        if e not in ENGINES:
            p.error(f"unknown engine {e!r}; choose from {', '.join(ENGINES)}")
    from ..runtime.engine import PRECISIONS

    args.precision = [x.strip() for x in args.precision.split(",") if x.strip()]
    if not args.precision or any(x not in PRECISIONS for x in args.precision):
        p.error(f"--precision takes {', '.join(PRECISIONS)} or a comma-separated list of them")
    args.dtype = [d.strip() for d in args.dtype.split(",") if d.strip()]
    for d in args.dtype:
        if d not in BENCH_DTYPES:
            p.error(f"unknown dtype {d!r}; choose from {', '.join(BENCH_DTYPES)}, e.g. f32,q8_0")
    try:
        args.threads = [int(t) for t in str(args.threads).split(",") if t.strip()]
    except ValueError:
        args.threads = []
    if not args.threads or min(args.threads) < 1:
        p.error("--threads takes integers >= 1, e.g. 2 or 2,1")
    res = run(args)
    table = render_table(res)
    if args.markdown:
        table += "\n\n" + render_summary(res, args.machine_label)
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
