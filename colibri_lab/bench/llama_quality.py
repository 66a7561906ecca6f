"""llama.cpp's side of the quality measurement: run its own ``llama-perplexity`` on the
same text (``--kl-divergence-base`` with the f32 GGUF, then ``--kl-divergence`` with each
quantized GGUF) and read what it prints into the same :class:`QualityReport` fields as
:func:`colibri_lab.analysis.quality.compare` (:func:`llama_compare`,
:func:`parse_llama_perplexity`); read the token ids and log-probs of its base file
(:func:`read_llama_logits_header`, :func:`compare_to_llama_base`); make GGUFs of
llama.cpp's own making (:func:`llama_gguf`); and :func:`pad_mixtral`, a checkpoint widened
with zeros to K-quant multiples. A developer tool beside the benchmark's llama.cpp
drivers."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from ..analysis.quality import (DP_QUANTILES, KLD_QUANTILES, KLDAccumulator, QualityReport, engine_name, open_engine,
                                tokens_sha256)

def _pad_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_mixtral(src_dir: str | os.PathLike, out_dir: str | os.PathLike, *, multiple: int = 256) -> Path:
    """A Mixtral checkpoint widened with zeros so that the hidden and intermediate sizes
    are multiples of ``multiple`` (K-quant blocks hold 256 values: a model 96 wide gets
    no Q4_K at all, every tensor falls back), computing the same function in f32.

    Embeddings, attention inputs, routers and expert gate/up get zero columns, the
    attention output and expert down zero rows (the down projection also zero columns
    for the padded intermediate units, whose gate/up rows are zero: silu(0) * 0 = 0), so
    the padded hidden units stay 0 everywhere. RMSNorm then averages over more units: the
    norm weights are scaled by ``sqrt(H / H')`` and ``rms_norm_eps`` by ``H / H'``, which
    gives the same normalised values. ``head_dim`` is written out (it no longer equals
    hidden / heads); heads keep their size (RoPE depends on it), so the attention output
    projection keeps rows of ``heads x head_dim``. Weights are written as f32 (the norm
    scaling is not exact in bf16); tokenizer files are copied. Returns ``out_dir``."""
    from ..conversion.checkpoint import Checkpoint

    src, out = Path(src_dir), Path(out_dir)
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("model_type") != "mixtral":
        raise ValueError(f"{src}: pad_mixtral handles Mixtral checkpoints, not {cfg.get('model_type')!r}")
    H, I = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    H2, I2 = _pad_to(H, multiple), _pad_to(I, multiple)
    head_dim = int(cfg.get("head_dim") or H // int(cfg["num_attention_heads"]))
    ck = Checkpoint(str(src))
    from ..format import spec as fmt

    def pad(x: np.ndarray, rows: int | None, cols: int | None) -> np.ndarray:
        r = x.shape[0] if rows is None else rows
        if x.ndim == 1:
            y = np.zeros(r, np.float32)
            y[: x.shape[0]] = x
            return y
        c = x.shape[1] if cols is None else cols
        y = np.zeros((r, c), np.float32)
        y[: x.shape[0], : x.shape[1]] = x
        return y

    tensors: dict[str, np.ndarray] = {}
    norm_scale = np.float32(math.sqrt(H / H2))
    for name in sorted(ck.tensors):
        t = ck.tensors[name]
        x = fmt.stored_to_f32(t.read_flat(0, t.numel), t.dtype_id).reshape(t.shape)
        if name.endswith("norm.weight"):
            y = pad(x * norm_scale, H2, None)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight", "gate.weight")) or \
                name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            y = pad(x, None, H2)
        elif name.endswith("o_proj.weight"):
            y = pad(x, H2, None)
        elif name.endswith(("w1.weight", "w3.weight")):
            y = pad(x, I2, H2)
        elif name.endswith("w2.weight"):
            y = pad(x, H2, I2)
        else:
            raise ValueError(f"pad_mixtral: unexpected tensor {name}")
        tensors[name] = y
    out.mkdir(parents=True, exist_ok=True)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, y in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(y.shape), "data_offsets": [off, off + y.nbytes]}
        off += y.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for y in tensors.values():
            f.write(np.ascontiguousarray(y, "<f4").tobytes())
    cfg.update(hidden_size=H2, intermediate_size=I2, head_dim=head_dim, dtype="float32",
               rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)) * H / H2)
    cfg.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors") and f.is_file() and \
                not f.name.endswith((".safetensors", ".bin", ".index.json")):
            shutil.copy(f, out / f.name)
    return out


# --------------------------------------------------------------------------- llama.cpp side

_NUM = r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|-?inf))"
_PM = r"\s*(?:±|\+/-)\s*"
_LLAMA_LINES = {
    "ppl_test": rf"^Mean PPL\(Q\)\s*:\s*{_NUM}{_PM}{_NUM}",
    "ppl_ref": rf"^Mean PPL\(base\)\s*:\s*{_NUM}{_PM}{_NUM}",
    "ppl_cor": rf"^Cor\(ln\(PPL\(Q\)\), ln\(PPL\(base\)\)\)\s*:\s*{_NUM}\s*%",
    "ln_ppl_ratio": rf"^Mean ln\(PPL\(Q\)/PPL\(base\)\)\s*:\s*{_NUM}{_PM}{_NUM}",
    "ppl_ratio": rf"^Mean PPL\(Q\)/PPL\(base\)\s*:\s*{_NUM}{_PM}{_NUM}",
    "ppl_diff": rf"^Mean PPL\(Q\)-PPL\(base\)\s*:\s*{_NUM}{_PM}{_NUM}",
    "kld_mean": rf"^Mean\s+KLD:\s*{_NUM}{_PM}{_NUM}",
    "dp_mean": rf"^Mean\s+Δp:\s*{_NUM}{_PM}{_NUM}\s*%",
    "dp_rms": rf"^RMS Δp\s*:\s*{_NUM}{_PM}{_NUM}\s*%",
    "top1_agreement": rf"^Same top p:\s*{_NUM}{_PM}{_NUM}\s*%",
}
_LLAMA_Q_LABELS = {"max": "Maximum", "median": "Median", "min": "Minimum"}
_PERCENT = {"ppl_cor", "dp_mean", "dp_rms", "top1_agreement"}


class LlamaOutputError(ValueError):
    """llama-perplexity's output holds no (or incomplete) KL-divergence statistics."""


def parse_llama_perplexity(output: str, *, ref: str = "", test: str = "") -> QualityReport:
    """The statistics ``llama-perplexity --kl-divergence`` prints (its stdout and stderr
    together) as a :class:`QualityReport` (source "llama.cpp", no routing; percentages
    turned into fractions). Raises :class:`LlamaOutputError` when a line is missing
    (llama.cpp prints no statistics for fewer than 100 scored positions)."""
    text = output.replace("\r", "")
    vals: dict[str, Any] = {}
    missing = []
    for key, pat in _LLAMA_LINES.items():
        m = re.search(pat, text, re.M)
        if not m:
            missing.append(key)
            continue
        nums = [float(g) for g in m.groups()]
        scale = 0.01 if key in _PERCENT else 1.0
        vals[key] = nums[0] * scale
        if len(nums) > 1:
            vals[key + "_err"] = nums[1] * scale
    kq, dq = {}, {}
    for what, table, out, scale in (("KLD", KLD_QUANTILES, kq, 1.0), ("Δp", DP_QUANTILES, dq, 0.01)):
        for k, _ in table:
            label = _LLAMA_Q_LABELS.get(k) or (re.escape(f"{float(k):4.1f}") + "%")
            m = re.search(rf"^\s*{label}\s+{re.escape(what)}:\s*{_NUM}\s*%?\s*$", text, re.M)
            if not m:
                missing.append(f"{what} {k}")
                continue
            out[k] = float(m.group(1)) * scale
    if missing:
        raise LlamaOutputError("llama-perplexity output lacks: " + ", ".join(missing)
                               + " (fewer than 100 scored positions, or a failed run?)")
    m = re.search(r"kl_divergence: computing over (\d+) chunks, n_ctx=(\d+)", text)
    n_chunks, ctx = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    n_scored = n_chunks * (ctx - 1 - ctx // 2)
    return QualityReport(
        source="llama.cpp", ref=ref, test=test, ctx=ctx, n_chunks=n_chunks,
        n_tokens=n_chunks * ctx, n_scored=n_scored, kld_median=kq["median"], kld_p95=kq["95.0"],
        kld_p99=kq["99.0"], kld_max=kq["max"], kld_quantiles=kq, dp_quantiles=dq, **vals)  # fmt: skip


def read_llama_logits_header(path: str | os.PathLike) -> tuple[int, int, int, np.ndarray]:
    """``(n_ctx, n_vocab, n_chunk, tokens)`` of a ``--kl-divergence-base`` file: the ids
    (``n_chunk * n_ctx`` int32) llama-perplexity evaluated, before its BOS replacement."""
    with open(path, "rb") as f:
        if f.read(8) != b"_logits_":
            raise ValueError(f"{path}: not a llama-perplexity logits file")
        (n_ctx,) = np.frombuffer(f.read(4), "<u4")
        n_vocab, n_chunk = (int(x) for x in np.frombuffer(f.read(8), "<i4"))
        tokens = np.frombuffer(f.read(4 * int(n_ctx) * n_chunk), "<i4").copy()
    if tokens.size != int(n_ctx) * n_chunk:
        raise ValueError(f"{path}: truncated token list")
    return int(n_ctx), n_vocab, n_chunk, tokens


def read_llama_log_probs(path: str | os.PathLike) -> Iterable[np.ndarray]:
    """The base log-probabilities of a ``--kl-divergence-base`` file, one chunk at a time
    (``[n_ctx - 1 - n_ctx // 2, n_vocab]`` float32 each): llama.cpp stores them per row as
    16-bit steps ``scale * q + min`` (two floats, then the ``n_vocab`` (padded even) steps)."""
    n_ctx, n_vocab, n_chunk, _ = read_llama_logits_header(path)
    nv = 2 * ((n_vocab + 1) // 2) + 4
    rows = n_ctx - 1 - n_ctx // 2
    with open(path, "rb") as f:
        f.seek(20 + 4 * n_ctx * n_chunk)
        for _ in range(n_chunk):
            raw = np.frombuffer(f.read(rows * nv * 2), "<u2")
            if raw.size != rows * nv:
                raise ValueError(f"{path}: truncated log-probabilities")
            raw = raw.reshape(rows, nv)
            head = raw[:, :4].copy().view("<f4")       # [rows, 2]: scale, min_log_prob
            q = raw[:, 4:4 + n_vocab].astype(np.float32)
            yield q * head[:, :1] + head[:, 1:2]


def compare_to_llama_base(engine_or_path, base_logits: str | os.PathLike, *,
                          threads: int | None = None) -> QualityReport:
    """Our engine's logits against llama.cpp's own saved base log-probs (the reference),
    over the ids in the file, scored as llama-perplexity scores a quantized GGUF (the
    stored log-probs as they are, KL over the entries above -16): a check that the two
    engines' f32 models agree (the 16-bit storage of the base log-probs bounds how small
    the KL can get)."""
    n_ctx, n_vocab, n_chunk, tokens = read_llama_logits_header(base_logits)
    eng, own = open_engine(engine_or_path, threads, n_ctx)
    try:
        if eng.config.vocab_size != n_vocab:
            raise ValueError(f"vocabularies differ: {eng.config.vocab_size} against {n_vocab}")
        bos = eng.tokenizer.bos_id if eng._has_tokenizer() else -1
        first = n_ctx // 2
        acc = KLDAccumulator()
        for c, lp in enumerate(read_llama_log_probs(base_logits)):
            chunk = tokens[c * n_ctx:(c + 1) * n_ctx].copy()
            if bos >= 0:
                chunk[0] = bos
            tl = eng.forward(chunk)
            acc.add(lp, tl[first:n_ctx - 1], chunk[first + 1:], ref_log_probs=True,
                    kl_min_log_p=-16.0)
        st = acc.summary()
    finally:
        if own:
            eng.close()
    return QualityReport(source="colibri", ref=os.path.basename(os.fspath(base_logits)),
                         test=engine_name(engine_or_path), ctx=n_ctx, n_chunks=n_chunk,
                         n_tokens=n_chunk * n_ctx, tokens_sha256=tokens_sha256(tokens),
                         meta={"reference": "llama.cpp base log-probs (16-bit)"}, **st)  # fmt: skip


def find_llama_perplexity(root: str | os.PathLike | None = None, *, build: bool = False) -> Path:
    """llama-perplexity in the llama.cpp tree the benchmark uses (``root``, default
    ``<cache>/llama.cpp``; ``$LLAMA_PERPLEXITY`` wins), built once with
    ``cmake --build <src>/build --target llama-perplexity`` when ``build`` and missing."""
    env = os.environ.get("LLAMA_PERPLEXITY")
    if env:
        return Path(env)
    from ..bench.common import default_cache_dir
    from ..bench.llama_cpp import _find_llama_src, _llama_bin

    root = Path(root).expanduser() if root else default_cache_dir() / "llama.cpp"
    src = _find_llama_src(root) if root.is_dir() else None
    if src is None:
        raise FileNotFoundError(f"no llama.cpp source tree under {root} (python -m colibri_lab.bench "
                                "builds one; or set LLAMA_PERPLEXITY)")
    exe = _llama_bin(src, "llama-perplexity")
    if exe.is_file():
        return exe
    if not build or not (src / "build").is_dir():
        raise FileNotFoundError(f"{exe} is not built (cmake --build {src / 'build'} "
                                "--target llama-perplexity, or build=True)")
    subprocess.run(["cmake", "--build", str(src / "build"), "-j", "2", "--target",
                    "llama-perplexity"], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    return exe


def llama_gguf(model_dir: str | os.PathLike, qtype: str = "f32", *,
               root: str | os.PathLike | None = None, cache: str | os.PathLike | None = None) -> Path:
    """The Hugging Face checkpoint as a GGUF of llama.cpp's own making: "f32" (or "bf16",
    "f16") by its convert_hf_to_gguf.py, a quantized type ("Q8_0", "Q4_K_M", "Q4_K_S",
    any llama-quantize type) by llama-quantize from the f32 GGUF. Cached under
    ``<cache>/gguf`` (default: the benchmark's cache); ``root``: the llama.cpp tree
    (default ``<the benchmark's cache>/llama.cpp``)."""
    from ..bench.common import default_cache_dir
    from ..bench.files import _model_key
    from ..bench.llama_cpp import _find_llama_src, _llama_bin, gguf_file

    cache = Path(cache).expanduser() if cache else default_cache_dir()
    root = Path(root).expanduser() if root else default_cache_dir() / "llama.cpp"
    src = _find_llama_src(root) if root.is_dir() else None
    if src is None:
        raise FileNotFoundError(f"no llama.cpp source tree under {root}")
    model_dir = Path(model_dir).resolve()
    if qtype.lower() in ("f32", "f16", "bf16"):
        return gguf_file(src, model_dir, qtype.lower(), cache)
    base = gguf_file(src, model_dir, "f32", cache)
    out = cache / "gguf" / f"{_model_key(model_dir)}-{qtype.upper()}.gguf"
    if out.is_file():
        return out
    tmp = out.with_suffix(".tmp")
    r = subprocess.run([str(_llama_bin(src, "llama-quantize")), str(base), str(tmp), qtype.upper()],
                       capture_output=True, text=True, check=False)  # fmt: skip
    if r.returncode != 0 or not tmp.is_file():
        raise RuntimeError("llama-quantize failed: " + " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:]))
    tmp.rename(out)
    return out


def _run_llama(exe, args, timeout):
    r = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout, check=False)
    out = r.stdout + "\n" + r.stderr
    if r.returncode != 0:
        tail = " | ".join(out.strip().splitlines()[-4:])
        raise RuntimeError(f"llama-perplexity exited with {r.returncode}: {tail}")
    return out


def llama_compare(base_gguf: str | os.PathLike, test_ggufs, text_file: str | os.PathLike, *,
                  ctx: int = 512, n_chunks: int | None = None, threads: int | None = None,
                  exe: str | os.PathLike | None = None, base_logits: str | os.PathLike | None = None,
                  repack: bool = False, timeout: float = 3600) -> dict[str, Any]:
    """llama.cpp's own measurement on ``text_file``: ``llama-perplexity -f text
    --kl-divergence-base`` with ``base_gguf`` (the f32 GGUF), then ``--kl-divergence``
    with each of ``test_ggufs`` (a path or a list). Returns ``{"reports": {name:
    QualityReport}, "tokens": the ids llama.cpp evaluated (from the base file), "base_ppl":
    the base run's own "Final estimate", "outputs": {name: full output}}``.

    ``base_logits``: where the base log-probs go (default: a temporary file, removed;
    they take ``n_chunks x (ctx/2) x n_vocab x 2`` bytes). ``repack`` False passes
    ``--no-repack``: llama.cpp's repacked (AMX) Q8_0 kernels die with SIGILL on machines
    whose kernel does not grant AMX tiles to processes (seen on this VM); the plain
    kernels give the model's numbers all the same."""
    exe = Path(exe) if exe else find_llama_perplexity()
    tests = [test_ggufs] if isinstance(test_ggufs, (str, os.PathLike)) else list(test_ggufs)
    common = ["-c", str(int(ctx))]
    if threads:
        common += ["-t", str(int(threads))]
    if not repack:
        common += ["--no-repack"]
    tmpdir = None
    if base_logits is None:
        tmpdir = tempfile.mkdtemp(prefix="colibri-kld-")
        base_logits = os.path.join(tmpdir, "base.kld")
    try:
        args = ["-m", str(base_gguf), "-f", str(text_file), "--kl-divergence-base", str(base_logits),
                *common]
        if n_chunks:
            args += ["--chunks", str(int(n_chunks))]
        base_out = _run_llama(exe, args, timeout)
        m = re.search(rf"Final estimate: PPL = {_NUM} \+/- {_NUM}", base_out)
        base_ppl = (float(m.group(1)), float(m.group(2))) if m else None
        _, _, _, tokens = read_llama_logits_header(base_logits)
        reports, outputs = {}, {"base": base_out}
        for t in tests:
            out = _run_llama(exe, ["-m", str(t), "--kl-divergence-base", str(base_logits),
                                   "--kl-divergence", *common], timeout)  # fmt: skip
            name = os.path.basename(os.fspath(t))
            rep = parse_llama_perplexity(out, ref=os.path.basename(os.fspath(base_gguf)), test=name)
            rep.tokens_sha256 = tokens_sha256(tokens)
            rep.meta = {"exe": str(exe), "repack": repack}
            reports[name] = rep
            outputs[name] = out
    finally:
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)
    return {"reports": reports, "tokens": tokens, "base_ppl": base_ppl, "outputs": outputs}


