"""How far a quantized model is from its reference: perplexity, KL divergence, top-1
agreement and routing, measured as llama.cpp's ``llama-perplexity --kl-divergence`` does.

    from colibri_lab.analysis import quality
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

**llama.cpp's side** (:mod:`colibri_lab.bench.llama_quality`). :func:`llama_compare` runs llama.cpp's own ``llama-perplexity`` on
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

    python -m colibri_lab quality --ref a.colibri --test b.colibri --text held_out.txt \\
        --ctx 256 [--chunks N] [--threads N] [--json out.json]
    python -m colibri_lab quality --ref a.colibri --test b.colibri --random-tokens 8192
    python -m colibri_lab quality --precision-agreement a.colibri [--text F | --random-tokens N]
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Sequence

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
    eng, own = open_engine(engine_or_path, None, None)
    try:
        return np.asarray(eng.tokenizer.encode(text, add_bos=True), dtype=np.int32)
    finally:
        if own:
            eng.close()


def open_engine(engine_or_path, threads, max_seq_len):
    """(engine, owned): an open Engine as it is (not owned), or a path opened here (owned: the
    caller closes it)."""
    from ..runtime.engine import Engine

    if isinstance(engine_or_path, Engine):
        return engine_or_path, False
    return Engine(engine_or_path, num_threads=threads, max_seq_len=max_seq_len), True


def engine_name(engine_or_path) -> str:
    """The file name of an Engine's model or of a path (the report's ref / test labels)."""
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
    reng, rown = open_engine(ref, threads, ctx)
    try:
        teng, town = open_engine(test, threads, ctx)
    except BaseException:
        if rown:
            reng.close()
        raise
    try:
        return _compare(reng, teng, ids, ctx, total, add_bos, routing, progress,
                        engine_name(ref), engine_name(test))
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
    from ..format import reader

    info = reader.inspect(path)
    params = nbytes = 0
    dtypes: dict[str, int] = {}
    for t in info.tensors:
        params += t.numel
        nbytes += t.nbytes
        dtypes[t.dtype] = dtypes.get(t.dtype, 0) + t.numel
    return {"params": params, "bytes": nbytes, "bpw": 8.0 * nbytes / max(params, 1),
            "file_bytes": info.file_size, "dtypes": dict(sorted(dtypes.items()))}


# --------------------------------------------------------------------------- numeric modes

def held_out_text(summary: str | os.PathLike | None = None) -> str:
    """The tiny model's held-out text: the 50 standard-library files that
    ``docs/training/summary.json`` lists as held out (``corpus.heldout_file_list``), read
    from the running Python's standard library in that order and joined with ``\\n`` (the
    repository ships no copy). ``summary``: that file (default: the repository's, beside
    this package). Raises FileNotFoundError when it, or every listed file, is missing."""
    import sysconfig

    p = Path(summary) if summary else Path(__file__).resolve().parents[2] / "docs" / "training" / "summary.json"
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
    from ..runtime.engine import PRECISIONS, Engine
    from ..runtime.errors import ColibriInvalidArgError

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
        "weight_dtype": wdtype, "model": engine_name(path), "tokens_sha256": tokens_sha256(ids),
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
