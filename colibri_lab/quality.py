"""How far a quantized model is from its reference: perplexity, KL divergence, top-1
agreement and routing, measured as llama.cpp's ``llama-perplexity --kl-divergence`` does.

    from colibri_lab import quality
    rep = quality.compare("tiny-f32.colibri", "tiny-q8_0.colibri", tokens, ctx=512)
    rep                      # a readable summary; rep.to_dict() / rep.to_json()
    rep.kld_mean, rep.top1_agreement, rep.routing.flip_rate

**The measurement.** The token sequence is cut into ``len(tokens) // ctx`` chunks of
``ctx`` tokens; each chunk is a fresh sequence whose first token is replaced by BOS (when
the model has one, as llama-perplexity does). Only the second half of each chunk is
scored: the logits at positions ``ctx//2 .. ctx-2`` predict tokens ``ctx//2+1 .. ctx-1``
(``ctx - 1 - ctx//2`` positions per chunk), so every scored token has at least half a
context before it. Per scored position, with p the reference's and q the test model's
softmax (in float64):

    KL(p || q) = sum_v p_v (log p_v - log q_v)       nll = -log q[target]
    same top   = argmax p == argmax q                Δp  = q[target] - p[target]

and the report gives what llama.cpp prints: perplexity of both with uncertainties, the
ratio ``PPL(Q)/PPL(base)``, its log and the difference (with the covariance of the two
models' log-likelihoods), the mean KL with its standard error, its median and
percentiles (llama.cpp's linear interpolation), the share of positions whose top-1
agrees ("Same top p"), and mean / RMS / percentiles of Δp. Statistics are accumulated
per chunk (running sums in float64, plus one KL and one Δp value per scored position for
the percentiles): memory is one chunk's logits, whatever the length of the text.

Two differences from llama.cpp: the reference log-probabilities are used exactly (llama.cpp
stores the base model's as 16-bit integers, so its KL can come out slightly negative and
its PPL(base) differs a little from the base run's own), and KL sums every vocabulary
entry (llama.cpp skips entries with log p < -16).

**Routing** (MoE models). Both engines run the chunks under a trace (every position of
every chunk); per MoE layer the report counts the (token, layer) decisions whose top-k
*set* of experts differs from the reference's (and those whose best expert differs), and
the load of every expert (tokens routed to it) in both models, so a caller sees which
experts lose or gain load. From the second layer on, a flip mixes the layer's own
rounding with the error that reached it from below: it is what the quantized model does,
not a per-layer isolation.

**llama.cpp's side.** :func:`llama_compare` runs llama.cpp's own ``llama-perplexity`` on
the same text: ``--kl-divergence-base`` with the f32 GGUF (saves the base log-probs and
the token ids it evaluated), then ``--kl-divergence`` with each quantized GGUF, and
:func:`parse_llama_perplexity` turns its printed statistics into the same
:class:`QualityReport` fields. :func:`read_llama_logits_header` reads the token ids from
the base file, so ours can score exactly the same ids (:func:`compare` with those tokens)
and the two tokenizers can be checked against each other. llama-perplexity tokenizes text
itself: the random-token mode of the CLI has no llama.cpp counterpart.

**Numeric modes.** :func:`precision_agreement` measures one file's fast numeric mode
(``Engine(precision="fast")``: int8 / bf16 activations into the weight matmuls) against its
exact mode on the same ids, every position scored: mean and max KL, top-1 agreement, routing
flips (docs/quantization.md, "Fast mode accuracy").

CLI::

    python -m colibri_lab.quality --ref a.colibri --test b.colibri --text held_out.txt \\
        --ctx 256 [--chunks N] [--threads N] [--json out.json]
    python -m colibri_lab.quality --ref a.colibri --test b.colibri --random-tokens 8192
    python -m colibri_lab.quality --precision-agreement a.colibri [--text F | --random-tokens N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

#: The KL percentiles llama-perplexity prints, as (key, fraction); "median" is the middle.
KLD_QUANTILES = (("max", 1.0), ("99.9", 0.999), ("99.0", 0.99), ("95.0", 0.95), ("90.0", 0.90),
                 ("median", None), ("10.0", 0.10), ("5.0", 0.05), ("1.0", 0.01), ("0.1", 0.001),
                 ("min", 0.0))  # fmt: skip
#: The Δp percentiles llama-perplexity prints.
DP_QUANTILES = (("max", 1.0), ("99.9", 0.999), ("99.0", 0.99), ("95.0", 0.95), ("90.0", 0.90),
                ("75.0", 0.75), ("median", None), ("25.0", 0.25), ("10.0", 0.10), ("5.0", 0.05),
                ("1.0", 0.01), ("0.1", 0.001), ("min", 0.0))  # fmt: skip

_ROW_BLOCK = 64  # logits rows turned into float64 log-probabilities at a time


# --------------------------------------------------------------------------- statistics


def _id_array(ids, name: str) -> np.ndarray:
    """ids as a 1-D integer array, or ValueError naming the argument."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be a 1-D sequence of integer ids")
    return arr


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (``[n, V]`` -> ``[n, V]``)."""
    x = np.asarray(logits, dtype=np.float64)
    z = x - x.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def token_stats(ref_logits: np.ndarray, test_logits: np.ndarray, targets: Sequence[int], *,
                ref_log_probs: bool = False, kl_min_log_p: float | None = None) -> dict:
    """Per-position statistics of two ``[n, V]`` logits arrays whose row i predicts
    ``targets[i]``: ``kld`` KL(ref || test), ``nll_ref`` / ``nll_test`` the negative
    log-likelihood of the target, ``same_top`` whether the argmaxes agree, ``dp`` the
    test probability of the target minus the reference's. Float64 (bool for same_top).

    ``ref_log_probs``: ``ref_logits`` are log-probabilities already, used as they are (not
    renormalised); ``kl_min_log_p``: KL sums only the entries whose reference log-prob is
    above it. Both are for llama.cpp's stored base log-probs (its KL uses -16)."""
    ref = np.asarray(ref_logits)
    test = np.asarray(test_logits)
    tgt = np.asarray(targets, dtype=np.int64)
    if ref.ndim != 2 or ref.shape != test.shape or tgt.shape != (ref.shape[0],):
        raise ValueError(f"logits of shapes {ref.shape} and {test.shape} with {tgt.shape} targets")
    if tgt.size and (tgt.min() < 0 or tgt.max() >= ref.shape[1]):
        raise ValueError("a target id is outside the vocabulary")
    lp = np.asarray(ref, dtype=np.float64) if ref_log_probs else log_softmax(ref)
    lq = log_softmax(test)
    rows = np.arange(len(tgt))
    terms = np.exp(lp) * (lp - lq)
    if kl_min_log_p is not None:
        terms[lp <= kl_min_log_p] = 0.0
    kld = terms.sum(axis=1)
    nll_ref, nll_test = -lp[rows, tgt], -lq[rows, tgt]
    return {"kld": kld, "nll_ref": nll_ref, "nll_test": nll_test,
            "same_top": ref.argmax(axis=1) == test.argmax(axis=1),
            "dp": np.exp(-nll_test) - np.exp(-nll_ref)}


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama-perplexity's percentile: linear interpolation at ``fraction * (n - 1)`` of the
    sorted values (``fraction`` 0 / 1: the minimum / maximum)."""
    v = np.asarray(sorted_values)
    if v.size == 0:
        return math.nan
    if fraction <= 0:
        return float(v[0])
    if fraction >= 1:
        return float(v[-1])
    p = fraction * (v.size - 1)
    ip = int(p)
    p -= ip
    return float((1 - p) * v[ip] + p * v[min(ip + 1, v.size - 1)])


def median(sorted_values: np.ndarray) -> float:
    """The middle value (the mean of the two middle ones for an even count), as llama.cpp."""
    v = np.asarray(sorted_values)
    if v.size == 0:
        return math.nan
    n = v.size
    return float(v[n // 2]) if n % 2 else float(0.5 * (v[n // 2] + v[n // 2 - 1]))


def mean_and_uncertainty(s: float, s2: float, count: int) -> tuple[float, float]:
    """Mean of values with sum ``s`` and sum of squares ``s2``, and its standard error
    ``sqrt((s2/n - mean^2) / (n - 1))`` (0 for 10 values or fewer), as llama.cpp."""
    if count < 1:
        return 0.0, 0.0
    f = s / count
    df = s2 / count - f * f
    df = math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0
    return f, df


def _covariance(sa: float, sb: float, sab: float, count: int) -> float:
    """Covariance of the two means (llama.cpp's: 0 below 10 values)."""
    if count < 10:
        return 0.0
    return (sab / count - (sa / count) * (sb / count)) / (count - 1)


class KLDAccumulator:
    """Running statistics of scored positions, fed chunk by chunk (:meth:`add`), summed
    as llama-perplexity's ``kl_divergence_result``; :meth:`summary` gives the report's
    fields. Keeps one KL and one Δp value per position (for the percentiles), no logits."""

    _SUMS = ("nll", "nll2", "nll_ref", "nll_ref2", "nll_nll_ref", "kld", "kld2", "dp", "dp2",
             "dp4")  # fmt: skip

    def __init__(self):
        self.sums = dict.fromkeys(self._SUMS, 0.0)
        self.count = 0
        self.n_same_top = 0
        self._kld: list[np.ndarray] = []
        self._dp: list[np.ndarray] = []

    def add(self, ref_logits: np.ndarray, test_logits: np.ndarray, targets: Sequence[int],
            **kw) -> None:
        """Score rows of logits (row i predicts ``targets[i]``), a block of rows at a time;
        ``kw`` go to :func:`token_stats`."""
        tgt = np.asarray(targets, dtype=np.int64)
        for r0 in range(0, len(tgt), _ROW_BLOCK):
            r1 = min(r0 + _ROW_BLOCK, len(tgt))
            self.add_stats(token_stats(ref_logits[r0:r1], test_logits[r0:r1], tgt[r0:r1], **kw))

    def add_stats(self, st: dict) -> None:
        """Add per-position statistics as :func:`token_stats` returns them."""
        nll, nll_ref, kld, dp = st["nll_test"], st["nll_ref"], st["kld"], st["dp"]
        s = self.sums
        s["nll"] += float(nll.sum())
        s["nll2"] += float((nll * nll).sum())
        s["nll_ref"] += float(nll_ref.sum())
        s["nll_ref2"] += float((nll_ref * nll_ref).sum())
        s["nll_nll_ref"] += float((nll * nll_ref).sum())
        s["kld"] += float(kld.sum())
        s["kld2"] += float((kld * kld).sum())
        dp2 = dp * dp
        s["dp"] += float(dp.sum())
        s["dp2"] += float(dp2.sum())
        s["dp4"] += float((dp2 * dp2).sum())
        self.count += int(len(nll))
        self.n_same_top += int(np.count_nonzero(st["same_top"]))
        self._kld.append(np.asarray(kld, dtype=np.float64).copy())
        self._dp.append(np.asarray(dp, dtype=np.float64).copy())

    def summary(self) -> dict[str, Any]:
        """The report's statistics (llama-perplexity's formulas; fractions, not percent)."""
        s, n = self.sums, self.count
        if n == 0:
            raise ValueError("no position was scored")
        lq, lq_err = mean_and_uncertainty(s["nll"], s["nll2"], n)
        lb, lb_err = mean_and_uncertainty(s["nll_ref"], s["nll_ref2"], n)
        cov = _covariance(s["nll"], s["nll_ref"], s["nll_nll_ref"], n)
        ppl_q, ppl_b = math.exp(lq), math.exp(lb)
        ppl_q_err, ppl_b_err = ppl_q * lq_err, ppl_b * lb_err
        ln_ratio = lq - lb
        ln_ratio_err = math.sqrt(max(lq_err ** 2 + lb_err ** 2 - 2.0 * cov, 0.0))
        ratio = math.exp(ln_ratio)
        diff_err = math.sqrt(max(ppl_q_err ** 2 + ppl_b_err ** 2 - 2.0 * ppl_q * ppl_b * cov, 0.0))
        cor = cov / (lq_err * lb_err) if lq_err > 0 and lb_err > 0 else math.nan
        kl, kl_err = mean_and_uncertainty(s["kld"], s["kld2"], n)
        dp, dp_err = mean_and_uncertainty(s["dp"], s["dp2"], n)
        mse, mse_err = mean_and_uncertainty(s["dp2"], s["dp4"], n)
        rms = math.sqrt(mse)
        rms_err = 0.5 / rms * mse_err if rms > 0 else 0.0
        top = self.n_same_top / n
        top_err = math.sqrt(top * (1 - top) / (n - 1)) if n > 1 else 0.0
        kv = np.sort(np.concatenate(self._kld))
        dv = np.sort(np.concatenate(self._dp))
        kq = {k: (median(kv) if f is None else percentile(kv, f)) for k, f in KLD_QUANTILES}
        dq = {k: (median(dv) if f is None else percentile(dv, f)) for k, f in DP_QUANTILES}
        return dict(
            n_scored=n, ppl_ref=ppl_b, ppl_ref_err=ppl_b_err, ppl_test=ppl_q, ppl_test_err=ppl_q_err,
            ppl_ratio=ratio, ppl_ratio_err=ratio * ln_ratio_err, ln_ppl_ratio=ln_ratio,
            ln_ppl_ratio_err=ln_ratio_err, ppl_diff=ppl_q - ppl_b, ppl_diff_err=diff_err,
            ppl_cor=cor, kld_mean=kl, kld_mean_err=kl_err, kld_median=kq["median"],
            kld_p95=kq["95.0"], kld_p99=kq["99.0"], kld_max=kq["max"], kld_quantiles=kq,
            top1_agreement=top, top1_agreement_err=top_err, dp_mean=dp, dp_mean_err=dp_err,
            dp_rms=rms, dp_rms_err=rms_err, dp_quantiles=dq,
        )  # fmt: skip


def routing_flips(ref_topk: np.ndarray, test_topk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token flags of two top-k id arrays ``[..., T, K]``: ``set_differs`` (the sets of
    chosen experts differ, whatever their order) and ``top1_differs`` (the best expert,
    column 0, differs)."""
    a, b = np.asarray(ref_topk), np.asarray(test_topk)
    if a.shape != b.shape or a.ndim < 2:
        raise ValueError(f"top-k arrays of shapes {a.shape} and {b.shape}")
    set_differs = np.any(np.sort(a, axis=-1) != np.sort(b, axis=-1), axis=-1)
    return set_differs, a[..., 0] != b[..., 0]


def expert_load(topk: np.ndarray, n_experts: int) -> np.ndarray:
    """Tokens routed to each expert: ``[T, K]`` -> ``[E]``, ``[L, T, K]`` -> ``[L, E]``."""
    ids = np.asarray(topk)
    if ids.ndim == 2:
        return np.bincount(ids.reshape(-1), minlength=n_experts)[:n_experts].astype(np.int64)
    return np.stack([expert_load(x, n_experts) for x in ids])


# --------------------------------------------------------------------------- report

@dataclass
class RoutingReport:
    """Routing of the test model against the reference's, per MoE layer (``layers`` are
    their indices; every list below has one entry per MoE layer)."""

    layers: list[int]
    n_experts: int
    top_k: int
    n_tokens: int             # routing decisions per layer (every position of every chunk)
    set_flips: list[int]      # decisions whose top-k set differs from the reference's
    top1_flips: list[int]     # decisions whose best expert differs
    flip_rate: list[float]
    top1_flip_rate: list[float]
    flip_rate_overall: float  # over all (token, MoE layer) decisions
    load_ref: list[list[int]]   # [layer][expert] tokens routed, reference
    load_test: list[list[int]]  # the same, test model

    def load_delta(self) -> np.ndarray:
        """[MoE layers, experts] tokens the test model routes to each expert minus the
        reference's: positive = the expert gains load."""
        return np.asarray(self.load_test, np.int64) - np.asarray(self.load_ref, np.int64)

    def load_share_delta(self) -> np.ndarray:
        """The same as a change of each expert's share of the layer's routed rows."""
        rows = max(self.n_tokens * self.top_k, 1)
        return self.load_delta() / rows


@dataclass
class QualityReport:
    """A test model measured against a reference (see the module doc). Probabilities,
    agreement and Δp are fractions (llama.cpp prints them in percent). ``source`` is
    "colibri" (:func:`compare`) or "llama.cpp" (:func:`parse_llama_perplexity`)."""

    source: str
    ref: str
    test: str
    ctx: int
    n_chunks: int
    n_tokens: int             # tokens evaluated (n_chunks x ctx)
    n_scored: int             # positions scored (n_chunks x (ctx - 1 - ctx // 2))
    ppl_ref: float
    ppl_ref_err: float
    ppl_test: float
    ppl_test_err: float
    ppl_ratio: float          # PPL(test) / PPL(ref)
    ppl_ratio_err: float
    ln_ppl_ratio: float
    ln_ppl_ratio_err: float
    ppl_diff: float           # PPL(test) - PPL(ref)
    ppl_diff_err: float
    ppl_cor: float            # correlation of the two models' ln PPL
    kld_mean: float
    kld_mean_err: float
    kld_median: float
    kld_p95: float
    kld_p99: float
    kld_max: float
    top1_agreement: float     # "Same top p"
    top1_agreement_err: float
    dp_mean: float            # Δp of the correct token: p_test - p_ref
    dp_mean_err: float
    dp_rms: float
    dp_rms_err: float
    kld_quantiles: dict[str, float] = field(default_factory=dict)
    dp_quantiles: dict[str, float] = field(default_factory=dict)
    routing: RoutingReport | None = None
    tokens_sha256: str = ""   # of the evaluated ids (int32, before the BOS replacement)
    meta: dict[str, Any] = field(default_factory=dict)

    # -- persistence
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (NaN stays a float: ``json`` writes it as NaN)."""
        return asdict(self)

    def to_json(self, path: str | os.PathLike | None = None, indent: int = 2) -> str:
        """The report as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "QualityReport":
        d = dict(d)
        r = d.get("routing")
        d["routing"] = RoutingReport(**r) if r else None
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike) -> "QualityReport":
        s = str(text_or_path)
        text = Path(s).read_text() if not s.lstrip().startswith("{") else s
        return cls.from_dict(json.loads(text))

    # -- presentation
    def summary(self) -> str:
        """A few lines: perplexities, KL, top-1, Δp, routing."""
        pct = 100.0
        lines = [
            f"QualityReport ({self.source}): {self.test} against {self.ref}",
            f"  {self.n_chunks} chunks x {self.ctx} tokens = {self.n_tokens} tokens, "
            f"{self.n_scored} scored (the second half of each chunk)",
            f"  PPL ref {self.ppl_ref:.4f} ± {self.ppl_ref_err:.4f}   test {self.ppl_test:.4f} ± "
            f"{self.ppl_test_err:.4f}   ratio {self.ppl_ratio:.6f} ± {self.ppl_ratio_err:.6f}   "
            f"diff {self.ppl_diff:+.4f} ± {self.ppl_diff_err:.4f}",
            f"  KL mean {self.kld_mean:.6f} ± {self.kld_mean_err:.6f}   median {self.kld_median:.6f}"
            f"   P95 {self.kld_p95:.6f}   P99 {self.kld_p99:.6f}   max {self.kld_max:.6f}",
            f"  same top-1 {pct * self.top1_agreement:.3f} ± {pct * self.top1_agreement_err:.3f} %"
            f"   Δp mean {pct * self.dp_mean:+.3f} ± {pct * self.dp_mean_err:.3f} %   RMS "
            f"{pct * self.dp_rms:.3f} ± {pct * self.dp_rms_err:.3f} %",
        ]
        r = self.routing
        if r is not None:
            per = "  ".join(f"L{l} {pct * f:.2f}" for l, f in zip(r.layers, r.flip_rate))
            lines.append(f"  routing: top-{r.top_k} set differs in {pct * r.flip_rate_overall:.3f} % "
                         f"of {r.n_tokens * len(r.layers)} (token, layer) decisions;"
                         f" per layer (%): {per}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()

    def _repr_pretty_(self, p, cycle) -> None:  # IPython
        p.text(self.summary())


def format_table(reports: dict[str, QualityReport] | Sequence[QualityReport]) -> str:
    """Reports side by side, one row each: PPL, ratio, KL mean / median / P99, same
    top-1, RMS Δp, routing flips. ``reports``: {label: report} or a list (labelled by
    their test file)."""
    items = list(reports.items()) if isinstance(reports, dict) else [(r.test, r) for r in reports]
    head = (f"{'':<24} {'PPL(test)':>10} {'PPL ratio':>10} {'KL mean':>10} {'KL median':>10} "
            f"{'KL P99':>10} {'same top1':>10} {'RMS Δp':>8} {'flips':>8}")
    out = [head]
    for name, r in items:
        flips = "-" if r.routing is None else f"{100 * r.routing.flip_rate_overall:.2f}%"
        out.append(f"{name[:24]:<24} {r.ppl_test:>10.4f} {r.ppl_ratio:>10.5f} {r.kld_mean:>10.6f} "
                   f"{r.kld_median:>10.6f} {r.kld_p99:>10.6f} {100 * r.top1_agreement:>9.3f}% "
                   f"{100 * r.dp_rms:>7.3f}% {flips:>8}")
    return "\n".join(out)


# --------------------------------------------------------------------------- colibri side

def tokens_sha256(tokens: Sequence[int] | np.ndarray) -> str:
    """sha256 of the ids as little-endian int32 (how both sides fingerprint what they scored)."""
    return hashlib.sha256(np.ascontiguousarray(np.asarray(tokens), dtype="<i4").tobytes()).hexdigest()


def random_tokens(n: int, vocab_size: int, *, seed: int = 0, low: int = 3) -> np.ndarray:
    """``n`` ids drawn uniformly from ``[low, vocab_size)`` (seeded; ``low`` skips the
    SentencePiece specials unk/bos/eos)."""
    return np.random.default_rng(seed).integers(low, vocab_size, size=int(n), dtype=np.int64).astype(np.int32)


def text_tokens(engine_or_path, text: str) -> np.ndarray:
    """The ids llama-perplexity scores for a text file holding ``text``: BOS + the encoded
    text, one trailing newline dropped first (llama.cpp's ``-f`` reader drops it)."""
    if text.endswith("\n"):
        text = text[:-1]
    eng, own = _open(engine_or_path, None, None)
    try:
        return np.asarray(eng.tokenizer.encode(text, add_bos=True), dtype=np.int32)
    finally:
        if own:
            eng.close()


def _open(engine_or_path, threads, max_seq_len):
    from .engine import Engine

    if isinstance(engine_or_path, Engine):
        return engine_or_path, False
    return Engine(engine_or_path, num_threads=threads, max_seq_len=max_seq_len), True


def _name(engine_or_path) -> str:
    p = getattr(engine_or_path, "path", engine_or_path)
    return os.path.basename(os.fspath(p))


def compare(ref, test, tokens: Sequence[int] | np.ndarray, *, ctx: int = 512,
            n_chunks: int | None = None, threads: int | None = None, add_bos: bool = True,
            routing: bool = True,
            progress: Callable[[int, int], None] | bool | None = None) -> QualityReport:  # fmt: skip
    """Measure ``test`` against ``ref`` (each a ``.colibri`` path or an open
    :class:`~colibri_lab.Engine`) over ``tokens`` in chunks of ``ctx`` (see the module
    doc). ``n_chunks`` caps the chunks (llama-perplexity's ``--chunks``); ``threads`` is
    the engines' thread count for paths (None: the engine's default); ``add_bos`` puts
    the reference's BOS in each chunk's first position (when it has a tokenizer with
    one); ``routing`` traces both engines (MoE models). ``progress``: True prints a line
    per chunk to stderr, or a callable ``(chunk_done, n_chunks)``. Deterministic: the
    engine's forward gives the same bits for the same ids, and the statistics are summed
    in a fixed order."""
    ctx = int(ctx)
    if ctx < 4:
        raise ValueError(f"ctx {ctx}: at least 4 tokens")
    ids = _id_array(tokens, "tokens")
    total = len(ids) // ctx
    if n_chunks is not None:
        total = min(total, int(n_chunks))
    if total < 1:
        raise ValueError(f"{len(ids)} tokens make no chunk of {ctx}: give at least ctx tokens")
    ids = ids[: total * ctx].astype(np.int32)
    if progress is True:
        progress = lambda i, n: print(f"[quality] chunk {i}/{n}", file=sys.stderr, flush=True)  # noqa: E731
    reng, rown = _open(ref, threads, ctx)
    try:
        teng, town = _open(test, threads, ctx)
    except BaseException:
        if rown:
            reng.close()
        raise
    try:
        return _compare(reng, teng, ids, ctx, total, add_bos, routing, progress,
                        _name(ref), _name(test))
    finally:
        if town:
            teng.close()
        if rown:
            reng.close()


def _compare(reng, teng, ids, ctx, total, add_bos, routing, progress, ref_name, test_name):
    rc, tc = reng.config, teng.config
    if rc.vocab_size != tc.vocab_size:
        raise ValueError(f"vocabularies differ: {rc.vocab_size} against {tc.vocab_size}")
    if ids.size and (ids.min() < 0 or ids.max() >= rc.vocab_size):
        raise ValueError(f"a token id is outside the vocabulary of {rc.vocab_size}")
    for c in (rc, tc):
        if c.max_seq_len < ctx:
            raise ValueError(f"{c.path}: max_seq_len {c.max_seq_len} < ctx {ctx}")
    bos = -1
    if add_bos and reng._has_tokenizer():
        bos = reng.tokenizer.bos_id
    moe = reng._layer_is_moe()
    do_routing = bool(routing and moe.any() and rc.n_layers == tc.n_layers
                      and rc.n_experts == tc.n_experts and rc.top_k == tc.top_k
                      and np.array_equal(moe, teng._layer_is_moe()))
    layers = np.flatnonzero(moe)
    E, K = rc.n_experts, rc.top_k
    acc = KLDAccumulator()
    set_flips = np.zeros(len(layers), np.int64)
    top1_flips = np.zeros(len(layers), np.int64)
    load_ref = np.zeros((len(layers), E), np.int64)
    load_test = np.zeros((len(layers), E), np.int64)
    first = ctx // 2
    for c in range(total):
        chunk = ids[c * ctx:(c + 1) * ctx].copy()
        if bos >= 0:
            chunk[0] = bos
        if do_routing:
            with reng.trace(capacity=ctx) as rtr:
                rl = reng.forward(chunk)
            with teng.trace(capacity=ctx) as ttr:
                tl = teng.forward(chunk)
            a, b = rtr.topk_ids[layers], ttr.topk_ids[layers]
            sd, td = routing_flips(a, b)
            set_flips += sd.sum(axis=1)
            top1_flips += td.sum(axis=1)
            load_ref += expert_load(a, E)
            load_test += expert_load(b, E)
        else:
            rl = reng.forward(chunk)
            tl = teng.forward(chunk)
        acc.add(rl[first:ctx - 1], tl[first:ctx - 1], chunk[first + 1:])
        del rl, tl
        if progress:
            progress(c + 1, total)
    st = acc.summary()
    rr = None
    if do_routing:
        n_dec = total * ctx
        rr = RoutingReport(
            layers=[int(x) for x in layers], n_experts=E, top_k=K, n_tokens=n_dec,
            set_flips=set_flips.tolist(), top1_flips=top1_flips.tolist(),
            flip_rate=(set_flips / n_dec).tolist(), top1_flip_rate=(top1_flips / n_dec).tolist(),
            flip_rate_overall=float(set_flips.sum() / (n_dec * len(layers))),
            load_ref=load_ref.tolist(), load_test=load_test.tolist())
    meta = {"ref_weight_dtype": rc.weight_dtype, "test_weight_dtype": tc.weight_dtype,
            "bos_id": int(bos), "kernels": rc.kernels}
    return QualityReport(source="colibri", ref=ref_name, test=test_name, ctx=ctx, n_chunks=total,
                         n_tokens=total * ctx, routing=rr, tokens_sha256=tokens_sha256(ids),
                         meta=meta, **st)  # fmt: skip


def weight_bits(path: str | os.PathLike) -> dict[str, Any]:
    """Size of a ``.colibri`` file's weights: ``params`` and ``bytes`` of its weight
    tensors (every tensor but the int8 router's scale/zero rows is counted by its
    elements), ``bpw`` = 8 x bytes / params, ``file_bytes``, and ``dtypes``: parameters
    per stored dtype (what a mix really used, fallbacks included)."""
    from . import format as fmt

    info = fmt.inspect(path)
    params = nbytes = 0
    dtypes: dict[str, int] = {}
    for t in info.tensors:
        params += t.numel
        nbytes += t.nbytes
        dtypes[t.dtype] = dtypes.get(t.dtype, 0) + t.numel
    return {"params": params, "bytes": nbytes, "bpw": 8.0 * nbytes / max(params, 1),
            "file_bytes": info.file_size, "dtypes": dict(sorted(dtypes.items()))}


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
    from .convert import Checkpoint

    src, out = Path(src_dir), Path(out_dir)
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("model_type") != "mixtral":
        raise ValueError(f"{src}: pad_mixtral handles Mixtral checkpoints, not {cfg.get('model_type')!r}")
    H, I = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    H2, I2 = _pad_to(H, multiple), _pad_to(I, multiple)
    head_dim = int(cfg.get("head_dim") or H // int(cfg["num_attention_heads"]))
    ck = Checkpoint(str(src))
    from . import format as fmt

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


# --------------------------------------------------------------------------- numeric modes

def held_out_text(summary: str | os.PathLike | None = None) -> str:
    """The tiny model's held-out text: the 50 standard-library files that
    ``docs/training/summary.json`` lists as held out (``corpus.heldout_file_list``), read
    from the running Python's standard library in that order and joined with ``\\n`` (the
    repository ships no copy). ``summary``: that file (default: the repository's, beside
    this package). Raises FileNotFoundError when it, or every listed file, is missing."""
    import sysconfig

    p = Path(summary) if summary else Path(__file__).resolve().parents[1] / "docs" / "training" / "summary.json"
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no training summary (held-out text needs the repository checkout)")
    files = json.loads(p.read_text())["corpus"]["heldout_file_list"]
    lib = Path(sysconfig.get_paths()["stdlib"])
    found = [lib / f for f in files if (lib / f).is_file()]
    if not found:
        raise FileNotFoundError(f"none of the {len(files)} held-out files is in {lib}")
    return "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in found)


def precision_agreement(path: str | os.PathLike, token_ids: Sequence[int] | np.ndarray, *,
                        num_threads: int | None = None, chunk: int = 256, max_chunks: int | None = None,
                        ref: str = "exact", test: str = "fast", add_bos: bool = True,
                        progress: Callable[[int, int], None] | bool | None = None) -> dict[str, Any]:
    """How far the engine's ``test`` numeric mode (default "fast") is from its ``ref``
    mode (default "exact") on one ``.colibri`` file: two engines on the same file, the
    same ids.

    The ids are cut into chunks of ``chunk`` tokens (the last one may be shorter; at most
    ``max_chunks``), each a fresh sequence whose first id is replaced by the model's BOS
    (``add_bos``, when it has one). **Every** position of a chunk but its last is scored
    (the logits at position i predict id i+1): KL(p_ref || p_test) over the whole
    vocabulary in float64, and whether the argmaxes agree; both engines run under a trace,
    and every (token, MoE layer) routing decision of every position is compared: a flip
    is a top-k *set* of experts that differs (the order inside it is free), as
    :func:`compare` counts them between two files.

    Returns a dict (JSON-able): ``kl_mean``, ``kl_max``, ``top1`` (the share of scored
    positions whose top-1 agrees), ``routing_flips`` (the share of routing decisions whose
    top-k set differs; 0.0 for a model without routers), ``n_tokens`` (scored positions),
    and ``kl_median``, ``kl_p99``, ``kl_min``, ``routing_top1_flips``, ``routing_flips_per_layer``,
    ``moe_layers``, ``n_routing_decisions``, ``ppl_ref``, ``ppl_test``, ``n_chunks``,
    ``chunk``, ``ref``, ``test``, ``kernels`` (the test engine's), ``weight_dtype``,
    ``model``, ``tokens_sha256``. Deterministic: the engine gives the same bits for the
    same ids in either mode, and the sums run in a fixed order."""
    from .engine import PRECISIONS, Engine
    from .errors import ColibriInvalidArgError

    for what, mode in (("ref", ref), ("test", test)):
        if mode not in PRECISIONS:
            raise ColibriInvalidArgError(f"{what} precision must be one of "
                                         f"{', '.join(map(repr, PRECISIONS))}, got {mode!r}")
    chunk = int(chunk)
    if chunk < 2:
        raise ValueError(f"chunk {chunk}: at least 2 tokens (a position and the id it predicts)")
    ids = _id_array(token_ids, "token_ids")
    ids = ids.astype(np.int64)
    starts = [s for s in range(0, len(ids), chunk) if len(ids) - s >= 2]
    if max_chunks is not None:
        starts = starts[: max(int(max_chunks), 0)]
    if not starts:
        raise ValueError(f"{len(ids)} token id(s): at least 2 are needed")
    ids = ids[: min(len(ids), starts[-1] + chunk)]
    if progress is True:
        progress = lambda i, n: print(f"[precision] chunk {i}/{n}", file=sys.stderr, flush=True)  # noqa: E731
    opts = dict(num_threads=num_threads, max_seq_len=min(chunk, max(len(ids), 2)))
    with Engine(path, precision=ref, **opts) as reng, Engine(path, precision=test, **opts) as teng:
        cfg = reng.config
        if ids.size and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
            raise ValueError(f"a token id is outside the vocabulary of {cfg.vocab_size}")
        bos = reng.tokenizer.bos_id if add_bos and reng._has_tokenizer() else -1
        layers = np.flatnonzero(reng._layer_is_moe())
        acc = KLDAccumulator()
        set_flips = np.zeros(len(layers), np.int64)
        top1_flips = np.zeros(len(layers), np.int64)
        n_dec = 0
        for c, s in enumerate(starts):
            ch = ids[s:s + chunk].astype(np.int32)
            if bos >= 0:
                ch[0] = bos
            n = len(ch)
            if len(layers):
                with reng.trace(capacity=n) as rtr:
                    rl = reng.forward(ch)
                with teng.trace(capacity=n) as ttr:
                    tl = teng.forward(ch)
                sd, td = routing_flips(rtr.topk_ids[layers, :n], ttr.topk_ids[layers, :n])
                set_flips += sd.sum(axis=1)
                top1_flips += td.sum(axis=1)
                n_dec += n
            else:
                rl, tl = reng.forward(ch), teng.forward(ch)
            acc.add(rl[: n - 1], tl[: n - 1], ch[1:])
            del rl, tl
            if progress:
                progress(c + 1, len(starts))
        st = acc.summary()
        kernels, wdtype = teng.config.kernels, cfg.weight_dtype
    kv = np.sort(np.concatenate(acc._kld))
    n_decisions = n_dec * len(layers)
    return {
        "kl_mean": st["kld_mean"], "kl_max": st["kld_max"], "top1": st["top1_agreement"],
        "routing_flips": float(set_flips.sum() / n_decisions) if n_decisions else 0.0,
        "n_tokens": st["n_scored"],
        "kl_median": st["kld_median"], "kl_p99": st["kld_p99"], "kl_min": float(kv[0]),
        "routing_top1_flips": float(top1_flips.sum() / n_decisions) if n_decisions else 0.0,
        "routing_flips_per_layer": (set_flips / n_dec).tolist() if n_dec else [],
        "moe_layers": [int(x) for x in layers], "n_routing_decisions": int(n_decisions),
        "ppl_ref": st["ppl_ref"], "ppl_test": st["ppl_test"],
        "n_chunks": len(starts), "chunk": chunk, "ref": ref, "test": test, "kernels": kernels,
        "weight_dtype": wdtype, "model": _name(path), "tokens_sha256": tokens_sha256(ids),
    }  # fmt: skip


def format_agreement(results: dict[str, dict[str, Any]]) -> str:
    """:func:`precision_agreement` results side by side, one row per {label: result}."""
    w = max([12, *map(len, results)])
    head = (f"{'':<{w}} {'KL mean':>10} {'KL P99':>10} {'KL max':>10} {'same top1':>10} "
            f"{'flips':>8} {'tokens':>7}")
    out = [head]
    for name, r in results.items():
        out.append(f"{name:<{w}} {r['kl_mean']:>10.3g} {r['kl_p99']:>10.3g} {r['kl_max']:>10.3g} "
                   f"{100 * r['top1']:>9.3f}% {100 * r['routing_flips']:>7.3f}% {r['n_tokens']:>7}")
    return "\n".join(out)


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
    eng, own = _open(engine_or_path, threads, n_ctx)
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
                         test=_name(engine_or_path), ctx=n_ctx, n_chunks=n_chunk,
                         n_tokens=n_chunk * n_ctx, tokens_sha256=tokens_sha256(tokens),
                         meta={"reference": "llama.cpp base log-probs (16-bit)"}, **st)  # fmt: skip


def find_llama_perplexity(root: str | os.PathLike | None = None, *, build: bool = False) -> Path:
    """llama-perplexity in the llama.cpp tree the benchmark uses (``root``, default
    ``<cache>/llama.cpp``; ``$LLAMA_PERPLEXITY`` wins), built once with
    ``cmake --build <src>/build --target llama-perplexity`` when ``build`` and missing."""
    env = os.environ.get("LLAMA_PERPLEXITY")
    if env:
        return Path(env)
    from .bench.common import default_cache_dir
    from .bench.llama_cpp import _find_llama_src, _llama_bin

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
    from .bench.common import default_cache_dir
    from .bench.files import _model_key
    from .bench.llama_cpp import _find_llama_src, _llama_bin, gguf_file

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


# --------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m colibri_lab.quality",
        description="Measure a (quantized) .colibri model against a reference as llama-perplexity "
                    "--kl-divergence does: PPL, KL divergence, top-1 agreement, Δp and MoE "
                    "routing flips.")
    p.add_argument("--ref", help="the reference .colibri (normally the f32 conversion)")
    p.add_argument("--test", help="the .colibri measured against it")
    p.add_argument("--precision-agreement", action="append", default=[], metavar="FILE",
                   help="instead: the engine's fast numeric mode against its exact mode on FILE "
                        "(repeatable); tokens from --text, --random-tokens, else the tiny model's "
                        "held-out text; --ctx is the chunk length (default 256 here), every position scored")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", help="a text file, tokenized as llama-perplexity -f does (BOS + text)")
    src.add_argument("--random-tokens", type=int, metavar="N",
                     help="N uniformly random ids instead (no llama.cpp counterpart)")
    p.add_argument("--seed", type=int, default=0, help="seed of --random-tokens (default 0)")
    p.add_argument("--ctx", type=int, default=None, help="tokens per chunk (default 512; 256 with "
                   "--precision-agreement)")
    p.add_argument("--chunks", type=int, default=None, help="at most this many chunks")
    p.add_argument("--threads", type=int, default=None, help="engine threads (default: physical cores)")
    p.add_argument("--no-routing", action="store_true", help="skip the routing comparison")
    p.add_argument("--llama-base", help="also run llama-perplexity: the f32 GGUF (needs --text)")
    p.add_argument("--llama-test", action="append", default=[],
                   help="a quantized GGUF for llama-perplexity --kl-divergence (repeatable)")
    p.add_argument("--llama-perplexity", help="the llama-perplexity program (default: the bench's build)")
    p.add_argument("--json", help='write {"colibri": report, "llama.cpp": {name: report}} here')
    p.add_argument("--quiet", action="store_true", help="no per-chunk progress")
    a = p.parse_args(argv)
    if a.precision_agreement:
        if a.ref or a.test or a.llama_base or a.llama_test:
            p.error("--precision-agreement measures one file's two numeric modes: leave out --ref, --test "
                    "and the llama.cpp options")
        return _precision_main(a)
    if not (a.ref and a.test):
        p.error("the arguments --ref and --test are required (or --precision-agreement FILE)")
    if not (a.text or a.random_tokens is not None):
        p.error("one of the arguments --text --random-tokens is required")
    a.ctx = 512 if a.ctx is None else a.ctx
    if (a.llama_base or a.llama_test) and not (a.text and a.llama_base and a.llama_test):
        p.error("the llama.cpp comparison needs --text, --llama-base and at least one --llama-test")
    try:
        from .engine import Engine

        with Engine(a.ref, num_threads=a.threads, max_seq_len=a.ctx) as ref:
            if a.text:
                tokens = text_tokens(ref, Path(a.text).read_text(encoding="utf-8"))
            else:
                tokens = random_tokens(a.random_tokens, ref.vocab_size, seed=a.seed)
            rep = compare(ref, a.test, tokens, ctx=a.ctx, n_chunks=a.chunks, threads=a.threads,
                          routing=not a.no_routing, progress=not a.quiet)
        print(rep.summary())
        out: dict[str, Any] = {"colibri": rep.to_dict()}
        if a.llama_base:
            res = llama_compare(a.llama_base, a.llama_test, a.text, ctx=a.ctx, n_chunks=rep.n_chunks,
                                threads=a.threads, exe=a.llama_perplexity)
            n = min(len(res["tokens"]), len(tokens))
            same = bool(np.array_equal(res["tokens"][:n], tokens[:n]))
            print(f"\nllama.cpp scored {len(res['tokens'])} ids; the same as ours: {same}")
            for r in res["reports"].values():
                print(r.summary())
            print()
            print(format_table({f"colibri {rep.test}": rep,
                                **{f"llama.cpp {k}": v for k, v in res["reports"].items()}}))
            out["llama.cpp"] = {k: v.to_dict() for k, v in res["reports"].items()}
            out["same_tokens"] = same
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _precision_main(a) -> int:
    """--precision-agreement FILE ...: fast against exact on each file, a table, --json."""
    chunk = 256 if a.ctx is None else a.ctx
    results: dict[str, dict[str, Any]] = {}
    try:
        text = None
        if a.text:
            text = Path(a.text).read_text(encoding="utf-8")
        elif a.random_tokens is None:
            text = held_out_text()
        for f in a.precision_agreement:
            if text is not None:
                tokens = text_tokens(f, text)
            else:
                from .engine import Engine

                with Engine(f, max_seq_len=2) as eng:
                    tokens = random_tokens(a.random_tokens, eng.vocab_size, seed=a.seed)
            r = precision_agreement(f, tokens, num_threads=a.threads, chunk=chunk, max_chunks=a.chunks,
                                    progress=not a.quiet)
            results[f] = r
            print(f"{f}: {r['weight_dtype']}, kernels {r['kernels']}: fast against exact over {r['n_tokens']} "
                  f"positions ({r['n_chunks']} chunks of <= {chunk}): KL mean {r['kl_mean']:.3g}, max "
                  f"{r['kl_max']:.3g}; same top-1 {100 * r['top1']:.3f} %; routing flips "
                  f"{100 * r['routing_flips']:.3f} % of {r['n_routing_decisions']} decisions")
        print()
        print(format_agreement({os.path.basename(k): v for k, v in results.items()}))
        if a.json:
            Path(a.json).write_text(json.dumps({"precision_agreement": results}, indent=2) + "\n")
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
