"""Tuning and timing helpers: what the engine's knobs do on the machine at hand.

The plumbing behind ``notebooks/03_tuning.ipynb`` and the side-by-side benchmark
(``python -m colibri_lab.bench``), each piece one call::

    from colibri_lab import convert
    from colibri_lab.bench import models, tuning

    shape = dict(models.MIXTRAL_791M, hidden=256, inter=512, layers=4, heads=4, kv_heads=2)
    hf = models.make_model("small-mixtral", shape)         # a random Mixtral, ~30 M weights
    path = convert(hf, "small.colibri", dtype="f32", progress=False)
    tuning.machine_info()                                  # CPU, SIMD flags, usable CPUs
    bw = tuning.measure_bandwidth()                        # GB/s of a numpy copy
    rd = tuning.measure_read_bandwidth(2)                  # GB/s of a C streaming read, 2 threads
    tuning.roofline_table(tuning.read_hf_config(hf), bw["median_gbs"])
    tuning.sweep_threads(path, [1, 2])                     # prefill and decode tokens/s
    tuning.run_colibri_bench(path, seq_len=64)             # colibri_bench's JSON, parsed

- **Models**: :func:`read_hf_config` reads the shape back from a Hugging Face ``config.json``.
- **Machine**: :func:`machine_info`, :func:`measure_bandwidth` (a numpy copy),
  :func:`measure_read_bandwidth` (the engine's streaming-read kernel); the decode roofline
  (:func:`active_weights`, :func:`decode_roofline`, :func:`roofline_table`; for a
  quantized or mixed file, :func:`file_decode_roofline` from its tensor directory).
- **Timing an Engine**: :func:`timed_run` (one prefill, then decode steps),
  :func:`time_engine` (medians over repetitions), and the sweeps :func:`sweep_threads`,
  :func:`sweep_group_pad`, :func:`sweep_block_size`, :func:`sweep_seq_len`,
  :func:`stage_split`.
- **colibri_bench**: :func:`find_colibri_bench`, :func:`run_colibri_bench`,
  :func:`sweep_sequential_sequences`.

Results are plain dicts and lists of dicts (:class:`Facts`, :class:`Rows`) that print as
aligned text and serialise to JSON as they are. Timings are measured, never judged.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "DTYPE_BYTES",
    "Facts",
    "Rows",
    "active_weights",
    "decode_roofline",
    "file_active_bytes",
    "file_decode_roofline",
    "find_colibri_bench",
    "machine_info",
    "measure_bandwidth",
    "measure_read_bandwidth",
    "median_rates",
    "random_ids",
    "read_hf_config",
    "roofline_table",
    "run_colibri_bench",
    "stage_split",
    "sweep_block_size",
    "sweep_group_pad",
    "sweep_seq_len",
    "sweep_sequential_sequences",
    "sweep_threads",
    "time_engine",
    "timed_run",
]

#: Bytes per weight element of each weight dtype.
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2}



# ---------------------------------------------------------------------------------------
# Results that print
# ---------------------------------------------------------------------------------------


def _fmt(v: Any, spec: str | None = None) -> str:
    if v is None:
        return "—"
    if spec and isinstance(v, (int, float)) and not isinstance(v, bool):
        return format(v, spec)
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v):
            return "—"
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_fmt(x)}" for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return ", ".join(_fmt(x) for x in v)
    return str(v)


class Facts(dict):
    """A dict that prints as aligned ``key  value`` lines (and is a plain dict to JSON)."""

    def __str__(self) -> str:
        if not self:
            return "(none)"
        w = max(len(str(k)) for k in self)
        return "\n".join(f"{k:<{w}}  {_fmt(v)}" for k, v in self.items())

    def _repr_pretty_(self, p, cycle) -> None:  # IPython / Jupyter display
        p.text(str(self))


class Rows(list):
    """A list of dicts, one per measurement, that prints as a text table.

    ``title`` is printed above the table; ``formats`` maps a column to a format spec
    (e.g. ``{"padding_share": ".0%"}``); other floats get one decimal (three significant
    digits below 10). :meth:`column` and :meth:`plot` read the columns back.
    """

    def __init__(self, rows: Iterable[dict] = (), title: str = "",
                 formats: dict[str, str] | None = None):  # fmt: skip
        super().__init__(rows)
        self.title = title
        self.formats = dict(formats or {})

    def column(self, key: str) -> list:
        """The values of one column, in row order (None where a row lacks it)."""
        return [r.get(key) for r in self]

    def __str__(self) -> str:
        keys: list[str] = []
        for r in self:
            keys += [k for k in r if k not in keys]
        cells = [[_fmt(r.get(k), self.formats.get(k)) for k in keys] for r in self]
        width = [max([len(k)] + [len(c[i]) for c in cells]) for i, k in enumerate(keys)]
        lines = [self.title] if self.title else []
        lines.append("  ".join(k.rjust(w) for k, w in zip(keys, width)))
        lines += ["  ".join(c.rjust(w) for c, w in zip(row, width)) for row in cells]
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle) -> None:  # IPython / Jupyter display
        p.text(str(self))

    def plot(self, x: str, y: str | Sequence[str], *, kind: str = "bar", title: str | None = None,
             xaxis_title: str | None = None, yaxis_title: str = "tokens/s", log_x: bool = False,
             height: int = 320):  # fmt: skip
        """A plotly figure of columns ``y`` against column ``x``: grouped bars
        (``kind="bar"``) or lines with markers (``kind="line"``)."""
        import plotly.graph_objects as go

        ys = [y] if isinstance(y, str) else list(y)
        xs = self.column(x)
        if kind == "bar":
            traces = [go.Bar(name=k, x=[str(v) for v in xs], y=self.column(k)) for k in ys]
        elif kind == "line":
            traces = [go.Scatter(name=k, x=xs, y=self.column(k), mode="lines+markers") for k in ys]
        else:
            raise ValueError(f"kind must be 'bar' or 'line', not {kind!r}")
        fig = go.Figure(traces)
        fig.update_layout(title=title or self.title or None, xaxis_title=xaxis_title or x,
                          yaxis_title=yaxis_title, height=height, barmode="group",
                          showlegend=len(ys) > 1)  # fmt: skip
        if log_x:
            fig.update_xaxes(type="log")
        return fig


# ---------------------------------------------------------------------------------------
# Models: describe (the random-model factory is colibri_lab.bench.models)
# ---------------------------------------------------------------------------------------


def read_hf_config(model_dir: str | os.PathLike) -> Facts:
    """The shape facts the roofline needs, from a Hugging Face ``config.json`` (both the
    transformers 4 and 5 spellings): model_type, vocab, hidden, inter, layers, heads,
    kv_heads, head_dim, experts, top_k, tie."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = {**cfg, **cfg["text_config"]}
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or hidden // heads
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts")
                  or cfg.get("n_routed_experts") or 0)
    return Facts(
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


# ---------------------------------------------------------------------------------------
# Machine facts, memory bandwidth, the decode roofline
# ---------------------------------------------------------------------------------------


#: the /proc/cpuinfo flags that decide the kernel tables (docs/portability.md)
SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile",
              "amx_bf16", "amx_int8", "asimd", "asimddp", "i8mm", "bf16")


def machine_info() -> Facts:
    """Platform, Python, CPUs online and usable (the affinity mask), the CPU model, the
    SIMD flags that matter to the kernels (x86: avx2, fma, f16c, avx512f, avx512bw,
    avx512_bf16; AArch64: asimd, asimddp, i8mm, bf16) and the RAM, from ``/proc`` where there
    is one."""
    info = Facts(platform=platform.platform(), python=platform.python_version(),
                 cpus_online=os.cpu_count(),
                 cpus_usable=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count())  # fmt: skip
    try:
        txt = Path("/proc/cpuinfo").read_text()
        m = re.search(r"^model name\s*:\s*(.+)$", txt, re.MULTILINE)
        if m:
            info["cpu"] = m.group(1).strip()
        fl = re.search(r"^(?:flags|Features)\s*:\s*(.+)$", txt, re.MULTILINE)  # x86 | AArch64
        if fl:
            flags = set(fl.group(1).split())
            info["simd"] = [f for f in SIMD_FLAGS if f in flags]
        mem = re.search(r"^MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
        if mem:
            info["mem_gib"] = round(int(mem.group(1)) / 2**20, 1)
    except OSError:
        pass
    return info


def measure_bandwidth(nbytes: int = 512 << 20, reps: int = 5) -> Facts:
    """Copy a buffer of ``nbytes`` into another with numpy (one thread), ``reps`` times
    after one untimed pass; bandwidth = 2 x nbytes (read + write) / time, in GB/s (1e9 bytes).

    Timed twice: by the wall clock and by this thread's CPU time. Memory stalls count as
    CPU time but time spent descheduled does not, so on a shared, busy machine the CPU-time
    figure still measures the memory system while the wall-clock one measures the queue
    for a core. The roofline uses the CPU-time median (``median_gbs``); both are reported,
    with every sample (``samples_gbs``, ``wall_samples_gbs``)."""
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
    return Facts({"method": f"numpy copy of {nbytes >> 20} MiB, read+write bytes, 1 thread, "
                            "timed by thread CPU time",
                  "median_gbs": statistics.median(cpu), "max_gbs": max(cpu),
                  "wall_median_gbs": statistics.median(wall), "samples_gbs": cpu,
                  "wall_samples_gbs": wall})  # fmt: skip


#: The variants of :func:`measure_read_bandwidth`: name -> ``colibri_read_bandwidth`` flags
#: (colibri.h). "plain": the widest vector loads the CPU has; "nt_prefetch": prefetchnta
#: ahead of them; "nt_load": (V)MOVNTDQA loads; "nt": both; "avx2": plain 32-byte loads on
#: an AVX-512 CPU too; "portable": the C loop the compiler makes of 64-bit loads.
READ_VARIANTS = {"plain": 0, "nt_prefetch": 1, "nt_load": 2, "nt": 3, "avx2": 8, "portable": 4}


def measure_read_bandwidth(threads: int = 0, nbytes: int = 1 << 30, reps: int = 5,
                           variants: Sequence[str] = ("plain", "avx2", "portable", "nt_prefetch",
                                                      "nt_load")) -> Facts:
    """The streaming-READ bandwidth of the machine on ``threads`` threads (0: one per
    physical core, the engine's default), measured by the engine's own C kernel
    (``colibri_read_bandwidth``): a buffer of ``nbytes`` (choose several times the
    last-level cache) is touched, read once untimed, then ``reps`` times, every thread
    streaming its own contiguous slice, timed by the wall clock around the whole parallel
    read. GB/s are 1e9 bytes *read* per second: a decode step reads its weights and writes
    next to nothing, so this, not a copy, is its ceiling.

    Every variant in ``variants`` (:data:`READ_VARIANTS`) is measured; ``gbs`` is the best
    repetition of the best variant (named in ``variant``), the figure a roofline should use;
    each variant keeps its best, median and samples. A variant the CPU cannot run records
    its ``error`` instead."""
    import ctypes

    from ..runtime import _native
    from ..runtime.errors import E_UNSUPPORTED

    res = Facts({"method": f"C streaming read (colibri_read_bandwidth) of {nbytes >> 20} MiB, "
                           f"{threads or 'physical-core'} thread(s), best of {reps} by the "
                           "wall clock, bytes read",
                 "threads": threads, "bytes": nbytes, "reps": reps, "variants": {}})  # fmt: skip
    best_name, best = None, 0.0
    for name in variants:
        if name not in READ_VARIANTS:
            raise ValueError(f"unknown read variant {name!r}; choose from {', '.join(READ_VARIANTS)}")
        out = ctypes.c_double()
        samples = (ctypes.c_double * reps)()
        err = ctypes.create_string_buffer(512)
        st = _native.lib.colibri_read_bandwidth(int(threads), int(nbytes), int(reps),
                                                READ_VARIANTS[name], ctypes.byref(out), samples,
                                                err, len(err))  # fmt: skip
        if st == E_UNSUPPORTED:  # e.g. "avx2" on a CPU without it
            res["variants"][name] = {"flags": READ_VARIANTS[name], "error": _native._text(err.value)}
            continue
        _native.check(st, err=err)
        vals = list(samples)
        res["variants"][name] = {"flags": READ_VARIANTS[name], "best_gbs": out.value,
                                 "median_gbs": statistics.median(vals), "samples_gbs": vals}
        if out.value > best:
            best_name, best = name, out.value
    res["gbs"] = best if best_name else None
    res["variant"] = best_name
    return res


def active_weights(c: dict) -> dict:
    """Weights one decode token reads, by part (element counts; norms separately, as they
    stay f32 in every engine). A MoE layer: q/k/v/o, the router and top_k experts of
    3 matrices each; plus the lm_head and one embedding row.

    ``c`` is a :func:`read_hf_config` result or a :func:`colibri_lab.bench.models.make_model` shape (head_dim
    defaults to hidden / heads)."""
    H = c["hidden"]
    D = c.get("head_dim") or H // c["heads"]
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


def decode_roofline(c: dict, dtype: str, bandwidth_gbs: float) -> Facts:
    """Bytes per decode token at ``dtype`` and the tokens/s ceiling that ``bandwidth_gbs``
    sets: ``roofline_tok_s = bandwidth / bytes_per_token``. The KV cache read
    (2 x layers x kv_heads x head_dim x context x 4 bytes) is left out: at a 640-token
    context it is ~2 % of the weights of the 791 M model (10.5 MB against 460 MB)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"decode_roofline takes a float dtype ({', '.join(DTYPE_BYTES)}); for "
                         f"{dtype!r} (block-quantized, mixed per tensor) use "
                         "file_decode_roofline(path) on the model file")
    w = active_weights(c)
    nbytes = w["matrices"] * DTYPE_BYTES[dtype] + w["norms_f32"] * 4
    return Facts({
        "dtype": dtype,
        "active_params": w["matrices"] + w["norms_f32"],
        "bytes_per_token": nbytes,
        "parts_bytes": {k: v * DTYPE_BYTES[dtype] for k, v in w["parts"].items()},
        "bandwidth_gbs": bandwidth_gbs,
        "roofline_tok_s": bandwidth_gbs * 1e9 / nbytes if nbytes else float("nan"),
    })  # fmt: skip


_EXPERTS_RE = re.compile(r"^blk\.\d+\.(ffn_experts|ffn_[a-z_]+_exps)(\.weight)?$")


def _tensor_part(name: str) -> str:
    """The roofline part a tensor belongs to, by its (llama.cpp-style) name, the same in a
    .colibri file and a GGUF: "experts" (routed experts: [E, ...], top_k of E read),
    "embedding" (token_embd: one row read), "lm_head", "norms", "router", "attention",
    or "other" (dense FFNs, shared experts: read whole)."""
    if _EXPERTS_RE.match(name):
        return "experts"
    if name == "token_embd.weight":
        return "embedding"
    if name == "output.weight":
        return "lm_head"
    if "norm" in name:
        return "norms"
    if ".ffn_gate_inp" in name or ".ffn_shared_gate" in name:
        return "router"
    if re.match(r"^blk\.\d+\.attn_", name):
        return "attention"
    return "other"


def _tensor_directory(path: str | os.PathLike) -> tuple[list[tuple], int, str]:
    """(name, dtype name, shape in numpy order, stored bytes) of every tensor of a
    .colibri file or a GGUF (by its magic), the top-k, and the file's weight-type name."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        from ..conversion.gguf import GgufFile  # the gguf package, memory-mapped

        g = GgufFile(path)
        arch = g.get("general.architecture")
        top_k = int(g.get(f"{arch}.expert_used_count") or 0)
        ftype = g.get("general.file_type")
        try:
            import gguf

            wname = gguf.LlamaFileType(int(ftype)).name.replace("MOSTLY_", "").lower()
        except Exception:
            wname = f"file_type {ftype}"
        rows = [(t.name, t.type_name.lower(), t.shape, int(t.raw.nbytes))
                for t in g.tensors.values()]  # fmt: skip
        return rows, top_k, wname
    from ..format import reader

    info = reader.inspect(path)
    rows = [(t.name, t.dtype, tuple(t.shape), t.nbytes) for t in info.tensors]
    return rows, int(info.header["top_k"]), str(info.metadata.get("model.weight_dtype", "?"))


def file_active_bytes(path: str | os.PathLike) -> Facts:
    """The bytes one decode token streams, summed over a model file's tensor directory
    (a .colibri file, or a GGUF), as stored: every tensor's own dtype and bytes, so a
    mixed file (Q4_K_M holds Q4_K, Q5_K, Q6_K, Q8_0 and f32 tensors) is counted right.

    Per token: attention (q/k/v/o, biases, q/k norms), routers, norms, dense FFNs and
    shared experts are read whole; of each routed-expert tensor (``blk.N.ffn_experts``,
    ``blk.N.ffn_{gate,up,down}_exps``: [E, ...]) top_k experts, ``top_k * nbytes / E``;
    of ``token_embd`` one row (``nbytes / vocab``), and all of it again as the LM head
    when the embeddings are tied (no ``output.weight``). The KV cache is left out, as in
    :func:`decode_roofline`; for an f32 or bf16 file the two agree.

    Returns bytes_per_token, active_params (elements read), bits_per_weight (of those),
    parts_bytes (attention, router, experts, lm_head, embedding_row, norms, other),
    bytes_by_dtype, file_bits_per_weight (all tensors of the file), top_k and
    weight_dtype (the file's own name for its mix)."""
    rows, top_k, wname = _tensor_directory(path)
    names = {r[0] for r in rows}
    tied = "output.weight" not in names
    parts = dict.fromkeys(("attention", "router", "experts", "lm_head", "embedding_row", "norms",
                           "other"), 0)  # fmt: skip
    by_dtype: dict[str, int] = {}
    elems = 0
    all_bytes = all_elems = 0
    for name, dt, shape, nbytes in rows:
        numel = math.prod(shape)
        all_bytes, all_elems = all_bytes + nbytes, all_elems + numel
        part = _tensor_part(name)
        if part == "experts":
            n_exp = shape[0]
            if nbytes % n_exp or numel % n_exp:
                raise ValueError(f"{path}: expert tensor {name} {list(shape)} of {nbytes} bytes "
                                 f"does not split into {n_exp} experts")
            k = min(top_k, n_exp)
            reads = [("experts", nbytes // n_exp * k, numel // n_exp * k)]
        elif part == "embedding":
            reads = [("embedding_row", nbytes // shape[0], numel // shape[0])]
            if tied:
                reads.append(("lm_head", nbytes, numel))
        else:
            reads = [(part, nbytes, numel)]
        for p, b, n in reads:
            parts[p] += b
            by_dtype[dt] = by_dtype.get(dt, 0) + b
            elems += n
    total = sum(parts.values())
    return Facts({
        "weight_dtype": wname,
        "active_params": elems,
        "bytes_per_token": total,
        "bits_per_weight": total * 8 / elems if elems else float("nan"),
        "parts_bytes": parts,
        "bytes_by_dtype": dict(sorted(by_dtype.items(), key=lambda kv: -kv[1])),
        "file_bits_per_weight": all_bytes * 8 / all_elems if all_elems else float("nan"),
        "top_k": top_k,
        "tied_embeddings": tied,
    })  # fmt: skip


def file_decode_roofline(path: str | os.PathLike, bandwidth_gbs: float) -> Facts:
    """:func:`decode_roofline` for a model file as stored (a .colibri file or a GGUF):
    :func:`file_active_bytes` per token and ``roofline_tok_s = bandwidth /
    bytes_per_token``. The way to get the roofline of a block-quantized or mixed model,
    whose bytes per weight no dtype name gives."""
    a = file_active_bytes(path)
    nbytes = a["bytes_per_token"]
    return Facts({
        "dtype": a["weight_dtype"],
        "active_params": a["active_params"],
        "bytes_per_token": nbytes,
        "bits_per_weight": a["bits_per_weight"],
        "parts_bytes": a["parts_bytes"],
        "bytes_by_dtype": a["bytes_by_dtype"],
        "file_bits_per_weight": a["file_bits_per_weight"],
        "bandwidth_gbs": bandwidth_gbs,
        "roofline_tok_s": bandwidth_gbs * 1e9 / nbytes if nbytes else float("nan"),
        "from_file": os.fspath(path),
    })  # fmt: skip


def roofline_table(c: dict, bandwidth_gbs: float, dtypes: Sequence[str] = ("f32", "bf16")) -> Rows:
    """:func:`decode_roofline` for each dtype as one table: active weights, MB per token
    (and by part), and the decode ceiling in tokens/s at ``bandwidth_gbs``."""
    rows = []
    for dt in dtypes:
        r = decode_roofline(c, dt, bandwidth_gbs)
        rows.append({"dtype": dt, "active_weights": r["active_params"],
                     "MB_per_token": r["bytes_per_token"] / 1e6,
                     **{f"{k}_MB": v / 1e6 for k, v in r["parts_bytes"].items()},
                     "roofline_tok_s": r["roofline_tok_s"]})  # fmt: skip
    return Rows(rows, title=f"decode roofline at {bandwidth_gbs:g} GB/s")


# ---------------------------------------------------------------------------------------
# Timing an Engine
# ---------------------------------------------------------------------------------------


def random_ids(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    """``n`` token ids, int32, uniform over [3, vocab) (past the control ids), seeded."""
    return np.random.default_rng(seed).integers(3, vocab, size=n).astype(np.int32)


def timed_run(engine, n_prefill: int = 128, n_decode: int = 16, seed: int = 0) -> tuple[float, float]:
    """One prefill of ``n_prefill`` random ids (a new sequence, every row's logits), then
    ``n_decode`` single-token steps that extend it. Returns (prefill tokens/s, decode
    tokens/s); decode is NaN when ``n_decode`` is 0."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, engine.vocab_size, size=n_prefill).astype(np.int32)
    t = time.perf_counter()
    engine.forward(ids)
    t_pre = time.perf_counter() - t
    dec = rng.integers(3, engine.vocab_size, size=n_decode)
    t = time.perf_counter()
    for i, tok in enumerate(dec):
        engine.forward([int(tok)], start_pos=n_prefill + i)
    t_dec = time.perf_counter() - t
    return n_prefill / t_pre, (n_decode / t_dec if n_decode else float("nan"))


def median_rates(runs: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """The median prefill and the median decode rate of (prefill, decode) pairs, each
    over the runs where it is a number (NaN where none is)."""
    cols = list(zip(*runs)) or [(), ()]
    out = []
    for col in cols:
        vals = [float(v) for v in col if not math.isnan(v)]
        out.append(statistics.median(vals) if vals else float("nan"))
    return out[0], out[1]


def time_engine(engine, reps: int = 2, *, n_prefill: int = 128, n_decode: int = 16,
                warmup: bool = True) -> Facts:  # fmt: skip
    """Medians over ``reps`` :func:`timed_run` repetitions (seeds 0, 1, ...), after one
    untimed warm-up (16 + 2 tokens). Returns prefill_tok_s, decode_tok_s and reps."""
    if reps < 1:
        raise ValueError("reps must be >= 1")
    if warmup:
        timed_run(engine, n_prefill=min(16, n_prefill), n_decode=min(2, n_decode))
    runs = [timed_run(engine, n_prefill, n_decode, seed=r) for r in range(reps)]
    pre, dec = median_rates(runs)
    return Facts(prefill_tok_s=pre, decode_tok_s=dec, reps=reps)


def _engine(path, **kw):
    from ..runtime.engine import Engine

    return Engine(path, **kw)


def sweep_threads(path, threads: Sequence[int] = (1, 2), *, reps: int = 2, n_prefill: int = 128,
                  n_decode: int = 16) -> Rows:  # fmt: skip
    """Prefill and decode tokens/s (:func:`time_engine`) for each ``num_threads``, with
    the thread count the engine actually used."""
    rows = []
    for nt in threads:
        with _engine(path, num_threads=nt) as eng:
            r = time_engine(eng, reps, n_prefill=n_prefill, n_decode=n_decode)
            rows.append({"num_threads": nt, "threads_used": eng.config.threads_used,
                         "prefill_tok_s": r["prefill_tok_s"], "decode_tok_s": r["decode_tok_s"]})
    return Rows(rows, title=f"prefill {n_prefill} tokens, decode {n_decode} steps; "
                            f"median of {reps}")  # fmt: skip


def sweep_group_pad(path, pads: Sequence[int] = (1, 4, 8, 16), *, num_threads: int = 2,
                    reps: int = 2, n_prefill: int = 128, seed: int = 1) -> Rows:  # fmt: skip
    """For each ``group_pad``: the prefill tokens/s (median of ``reps``) and, from a trace
    of one prefill of ``n_prefill`` random ids, the padding rows the experts computed
    against the real rows routed to them."""
    rows = []
    for gp in pads:
        with _engine(path, num_threads=num_threads, group_pad=gp) as eng:
            ids = random_ids(n_prefill, eng.vocab_size, seed)
            r = time_engine(eng, reps, n_prefill=n_prefill, n_decode=0)
            with eng.trace() as tr:
                eng.forward(ids)
        real, pad = int(tr.group_sizes.sum()), int(tr.padding_rows.sum())
        rows.append({"group_pad": gp, "prefill_tok_s": r["prefill_tok_s"], "padding_rows": pad,
                     "real_rows": real, "padding_share": pad / real if real else float("nan")})
    return Rows(rows, title=f"prefill {n_prefill} tokens, {num_threads} threads",
                formats={"padding_share": ".0%"})  # fmt: skip


def sweep_block_size(hf_dir, sizes: Sequence[int] = (8, 64), *, dtype: str = "f32",
                     num_threads: int = 2, reps: int = 2, n_prefill: int = 128, n_decode: int = 16,
                     workdir: str | os.PathLike | None = None) -> Rows:  # fmt: skip
    """Convert the Hugging Face checkpoint ``hf_dir`` once per packed-expert
    ``block_size`` (into ``workdir``, a temporary folder by default; each file removed
    after its run) and time prefill and decode on it."""
    from ..conversion.hf import convert

    rows = []
    with tempfile.TemporaryDirectory(dir=workdir, prefix="block-size-") as tmp:
        for bs in sizes:
            p = convert(hf_dir, Path(tmp) / f"b{bs}.colibri", dtype=dtype, block_size=bs,
                        progress=False)  # fmt: skip
            with _engine(p, num_threads=num_threads) as eng:
                r = time_engine(eng, reps, n_prefill=n_prefill, n_decode=n_decode)
            os.remove(p)
            rows.append({"block_size": bs, "prefill_tok_s": r["prefill_tok_s"],
                         "decode_tok_s": r["decode_tok_s"]})
    return Rows(rows, title=f"{dtype}, {num_threads} threads, median of {reps}")


def sweep_seq_len(path, lengths: Sequence[int] = (16, 64, 256), *, num_threads: int = 2,
                  reps: int = 2) -> Rows:  # fmt: skip
    """Prefill tokens/s by prompt length (one engine, median of ``reps`` per length)."""
    with _engine(path, num_threads=num_threads) as eng:
        rows = [{"seq_len": n, "prefill_tok_s":
                 time_engine(eng, reps, n_prefill=n, n_decode=0)["prefill_tok_s"]}
                for n in lengths]  # fmt: skip
    return Rows(rows, title=f"{num_threads} threads, median of {reps}")


def stage_split(path, *, n_prefill: int = 128, n_decode: int = 16, num_threads: int = 2,
                seed: int = 1) -> Rows:  # fmt: skip
    """Where the time goes: from a trace, the milliseconds and the share of each stage
    (summed over layers) in one prefill of ``n_prefill`` random ids and in the
    ``n_decode`` single-token steps after it, after an untimed warm-up."""
    with _engine(path, num_threads=num_threads) as eng:
        ids = random_ids(n_prefill, eng.vocab_size, seed)
        timed_run(eng, n_prefill=16, n_decode=2)  # warm-up
        with eng.trace() as tr:
            eng.forward(ids)
        pre = tr.stage_totals()
        with eng.trace() as tr:
            for i in range(n_decode):
                eng.forward([int(ids[i % n_prefill])], start_pos=n_prefill + i)
        dec = tr.stage_totals()
    tp, td = sum(pre.values()) or 1, sum(dec.values()) or 1
    rows = [{"stage": k, "prefill_ms": pre[k] / 1e6, "prefill_share": pre[k] / tp,
             "decode_ms": dec.get(k, 0) / 1e6, "decode_share": dec.get(k, 0) / td} for k in pre]
    return Rows(rows, title=f"prefill {n_prefill} tokens, {n_decode} decode steps, "
                            f"{num_threads} threads",
                formats={"prefill_share": ".0%", "decode_share": ".0%",
                         "prefill_ms": ".2f", "decode_ms": ".2f"})  # fmt: skip


# ---------------------------------------------------------------------------------------
# colibri_bench (the C tool)
# ---------------------------------------------------------------------------------------


def find_colibri_bench() -> str | None:
    """The ``colibri_bench`` executable: ``$COLIBRI_BENCH``, else beside ``$COLIBRI_CLI``,
    else beside this Python (pip installs it into the environment's bin/), else on PATH;
    None when there is none."""
    cands = [os.environ.get("COLIBRI_BENCH")]
    if os.environ.get("COLIBRI_CLI"):
        cands.append(str(Path(os.environ["COLIBRI_CLI"]).parent / "colibri_bench"))
    cands += [str(Path(sys.executable).parent / "colibri_bench"), shutil.which("colibri_bench")]
    return next((c for c in cands if c and Path(c).is_file()), None)


def run_colibri_bench(model, *, sequential_sequences: int = 1, seq_len: int = 64,
                      max_new_tokens: int = 8, num_requests: int = 2, num_threads: int = 2,
                      warmup: int | None = None, seed: int | None = None,
                      group_pad: int | None = None, precision: str | None = None,
                      exe: str | None = None, timeout: float = 600) -> dict:  # fmt: skip
    """Run ``colibri_bench --json`` on a ``.colibri`` file and return its parsed JSON.

    Each of the ``num_requests`` requests is ``sequential_sequences`` sequences of
    ``seq_len`` prompt tokens plus ``max_new_tokens`` decode steps, run one after another
    (the engine holds one sequence per context: nothing is batched into one matrix
    product). ``warmup``, ``seed``, ``group_pad`` and ``precision`` ("exact" or "fast")
    are passed on when given. ``exe``
    defaults to :func:`find_colibri_bench`. Raises FileNotFoundError without an
    executable and RuntimeError (with its stderr) when it fails.
    """
    exe = exe or find_colibri_bench()
    if exe is None:
        raise FileNotFoundError("colibri_bench not found: build native/ or pip install the "
                                "package (or set COLIBRI_BENCH)")  # fmt: skip
    args = [exe, "--model", os.fspath(model),
            "--sequential_sequences", str(sequential_sequences),  # run one after another
            "--seq_len", str(seq_len), "--max_new_tokens", str(max_new_tokens),
            "--num_requests", str(num_requests), "--num_threads", str(num_threads), "--json"]  # fmt: skip
    for flag, v in (("--warmup", warmup), ("--seed", seed), ("--group_pad", group_pad),
                    ("--precision", precision)):
        if v is not None:
            args += [flag, str(v)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"colibri_bench exited with {r.returncode}: {r.stderr.strip()}")
    return json.loads(r.stdout)


def sweep_sequential_sequences(model, counts: Sequence[int] = (1, 2), **kw) -> Rows:
    """:func:`run_colibri_bench` for each number of sequences per request (run one after
    another): the request latency P50, prefill and decode tokens/s and the decode P99/P50.
    Other keywords go to :func:`run_colibri_bench`."""
    rows = []
    for n in counts:
        d = run_colibri_bench(model, sequential_sequences=n, **kw)
        rows.append({"sequential_sequences": n, "request_p50_ms": d["request"]["p50_ms"],
                     "prefill_tok_s": d["prefill"]["tokens_per_s"],
                     "decode_tok_s": d["decode"]["tokens_per_s"],
                     "decode_p99_over_p50": d["decode"]["p99_over_p50"]})  # fmt: skip
    return Rows(rows, formats={"decode_p99_over_p50": ".2f"})
