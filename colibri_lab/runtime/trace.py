"""What one or more forward passes did, stage by stage: the :class:`Trace` container.

A trace is recorded by the C engine into buffers that belong to the trace (see
``colibri_trace_*`` in ``colibri.h``) and copied into numpy arrays when the ``with
engine.trace()`` block ends, so a :class:`Trace` outlives its engine and can be saved to
and loaded from ``.npz``. Tokens are appended in the order the engine saw them, across
every forward (prefill chunks and decode steps alike).

Shapes (L layers, T traced tokens, E experts, K = top-k)::

    token_ids          [T]        int32   the ids fed to the engine
    positions          [T]        int64   their positions in their sequence
    seq_ids            [T]        int32   their sequence (0 for the single-sequence calls)
    token_texts        list[str]  T       each token's piece, as text (empty without a tokenizer)
    router_probs       [L, T, E]  float32 softmax over experts (NaN rows in dense layers)
    topk_ids           [L, T, K]  int32   chosen experts, best first (-1 in dense layers)
    topk_weights       [L, T, K]  float32 their combine weights (0 in dense layers)
    predicted_ids      [L, T, K]  int32   the expert predictor's top-k for layer l (layer l's
                                          router on layer l-1's FFN input; -1 at layer 0 and in
                                          dense layers): what the cache's "predict" policy reads ahead
    cache_hits, cache_misses, cache_prefetches, cache_prefetch_hits, cache_wasted_prefetches
                       [L]        int64   the expert cache's counters while traced (zeros
                                          without a cache; docs/expert_cache.md)
    routing_margins    [L, T, 2]  float32 how close each token was to being routed otherwise: the
                                          k-th minus the (k+1)-th largest router logit ([..., 0])
                                          and router probability ([..., 1]), computed by the
                                          engine (NaN in dense layers); see near_tie_fraction
    shared_gate        [L, T]     float32 the shared expert's scale sigmoid(g . x), 1.0 for an
                                          ungated shared expert, NaN where a layer has none
    group_sizes        [L, E]     int64   rows routed to each expert, summed over chunks
    padded_group_sizes [L, E]     int64   the same after padding each group to group_pad
    layer_is_moe       [L]        bool    False for dense-MLP layers
    timings_ns         [L, 5]     uint64  per layer and stage (STAGES), summed over forwards
    embedding_ns, lm_head_ns      int     the two stages outside the layers
    n_forwards                    int     forward chunks traced (a prefill of more than
                                          max_batch tokens is several chunks)
    dropped                       int     tokens seen after the trace was full (not recorded)
    prefix_cached                 int     positions taken from the prefix cache instead of
                                          computed (Sequence.reuse_prefix, generate): never
                                          recorded as tokens, since nothing ran for them
"""

from __future__ import annotations

import html
import io
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: The per-layer stages, in the order the engine runs them (columns of ``timings_ns``).
STAGES = ("attention", "router", "grouping", "expert_ffn", "combine")
#: Every stage of a forward, embedding and LM head included.
ALL_STAGES = ("embedding",) + STAGES + ("lm_head",)

_ARRAYS = (
    "token_ids",
    "positions",
    "seq_ids",
    "router_probs",
    "topk_ids",
    "topk_weights",
    "shared_gate",
    "group_sizes",
    "padded_group_sizes",
    "layer_is_moe",
    "timings_ns",
)
# Arrays that traces saved before the expert cache lack (None there).
_OPTIONAL_ARRAYS = (
    "predicted_ids",
    "cache_hits",
    "cache_misses",
    "cache_prefetches",
    "cache_prefetch_hits",
    "cache_wasted_prefetches",
    "routing_margins",
)
_SCALARS = (
    "dropped",
    "prefix_cached",
    "embedding_ns",
    "lm_head_ns",
    "n_forwards",
    "group_pad",
    "norm_topk_prob",
    "architecture",
    "model_name",
)


@dataclass
class Trace:
    """Per-layer routing, grouping and timing of the traced forward passes."""

    token_ids: np.ndarray
    positions: np.ndarray
    router_probs: np.ndarray
    topk_ids: np.ndarray
    topk_weights: np.ndarray
    shared_gate: np.ndarray
    group_sizes: np.ndarray
    padded_group_sizes: np.ndarray
    layer_is_moe: np.ndarray
    timings_ns: np.ndarray
    embedding_ns: int = 0
    lm_head_ns: int = 0
    n_forwards: int = 0
    dropped: int = 0
    prefix_cached: int = 0
    group_pad: int = 1
    norm_topk_prob: bool = True
    architecture: str = ""
    model_name: str = ""
    token_texts: list[str] = field(default_factory=list)
    seq_ids: np.ndarray | None = None  # [T]; None (traces saved before sequences): all 0
    predicted_ids: np.ndarray | None = None  # [L, T, K]; None in traces saved before it
    cache_hits: np.ndarray | None = None  # [L] each; None in traces saved before them
    cache_misses: np.ndarray | None = None
    cache_prefetches: np.ndarray | None = None
    cache_prefetch_hits: np.ndarray | None = None
    cache_wasted_prefetches: np.ndarray | None = None
    routing_margins: np.ndarray | None = None  # [L, T, 2]; None in traces saved before it

    def __post_init__(self):
        if self.seq_ids is None:
            self.seq_ids = np.zeros(self.token_ids.shape[0], np.int32)

    # ---- shape facts -------------------------------------------------------------------
    def near_tie_fraction(self, gap: float = 1e-3, by: str = "prob") -> np.ndarray:
        """Per layer, the fraction of traced tokens whose routing margin (``by`` "prob" or
        "logit") is below ``gap``: tokens a last-bit change of the router's input could send
        to another expert (NaN for dense layers)."""
        if self.routing_margins is None:
            raise ValueError("this trace has no routing margins (saved before the engine recorded them)")
        m = self.routing_margins[..., 0 if by == "logit" else 1]
        with np.errstate(invalid="ignore"):
            out = (m < gap).mean(axis=1) if m.shape[1] else np.full(m.shape[0], np.nan)
        out = out.astype(np.float64)
        out[~np.asarray(self.layer_is_moe, bool)] = np.nan
        return out

    @property
    def n_layers(self) -> int:
        return int(self.router_probs.shape[0])

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def n_experts(self) -> int:
        return int(self.router_probs.shape[2])

    @property
    def top_k(self) -> int:
        return int(self.topk_ids.shape[2])

    @property
    def moe_layers(self) -> np.ndarray:
        """Indices of the MoE layers (dense-MLP layers excluded)."""
        return np.flatnonzero(self.layer_is_moe)

    @property
    def padding_rows(self) -> np.ndarray:
        """[L, E] zero rows added by group padding (compute spent on nothing)."""
        return self.padded_group_sizes - self.group_sizes

    def stage_totals(self) -> dict[str, int]:
        """Nanoseconds spent in each of :data:`ALL_STAGES`, over all layers and forwards."""
        out = {"embedding": int(self.embedding_ns)}
        for i, name in enumerate(STAGES):
            out[name] = int(self.timings_ns[:, i].sum())
        out["lm_head"] = int(self.lm_head_ns)
        return out

    def check(self) -> None:
        """Raise ``ValueError`` if the arrays are not mutually consistent."""
        L, T, E, K = self.n_layers, self.n_tokens, self.n_experts, self.top_k
        want = {
            "token_ids": (T,),
            "positions": (T,),
            "seq_ids": (T,),
            "router_probs": (L, T, E),
            "topk_ids": (L, T, K),
            "topk_weights": (L, T, K),
            "shared_gate": (L, T),
            "group_sizes": (L, E),
            "padded_group_sizes": (L, E),
            "layer_is_moe": (L,),
            "timings_ns": (L, len(STAGES)),
        }
        for name, shape in want.items():
            got = getattr(self, name).shape
            if got != shape:
                raise ValueError(f"trace.{name} has shape {got}, expected {shape}")
        if self.token_texts and len(self.token_texts) != T:
            raise ValueError(f"trace has {len(self.token_texts)} token texts for {T} tokens")
        moe = self.moe_layers
        ids = self.topk_ids[moe]
        if ids.size and (ids.min() < 0 or ids.max() >= E):
            raise ValueError("trace.topk_ids holds an expert id out of range in an MoE layer")
        sums = self.group_sizes.sum(axis=1)
        expect = np.where(self.layer_is_moe, T * K, 0)
        if not np.array_equal(sums, expect):
            raise ValueError(f"group sizes sum to {sums.tolist()} per layer, expected {expect.tolist()}")
        if np.any(self.padded_group_sizes < self.group_sizes) or np.any(
            self.padded_group_sizes % max(self.group_pad, 1) != 0
        ):
            raise ValueError("padded group sizes are not group sizes rounded up to group_pad")

    # ---- persistence -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain dict of numpy arrays and Python scalars (``token_texts`` as a list)."""
        d: dict[str, Any] = {k: getattr(self, k) for k in _ARRAYS}
        d.update({k: getattr(self, k) for k in _OPTIONAL_ARRAYS if getattr(self, k) is not None})
        d.update({k: getattr(self, k) for k in _SCALARS})
        d["token_texts"] = list(self.token_texts)
        return d

    def save(self, path: str | os.PathLike | io.IOBase) -> None:
        """Write the trace as a compressed ``.npz`` (no pickles: texts as a unicode array)."""
        d = self.to_dict()
        arrays = {k: d[k] for k in _ARRAYS + _OPTIONAL_ARRAYS if k in d}
        for k in _SCALARS:
            arrays[k] = np.asarray(d[k])
        arrays["token_texts"] = np.asarray(d["token_texts"], dtype=np.str_)
        np.savez_compressed(path, **arrays)

    @classmethod
    def load(cls, path: str | os.PathLike | io.IOBase) -> "Trace":
        """Read a trace written by :meth:`save`."""
        with np.load(path, allow_pickle=False) as z:
            kw: dict[str, Any] = {k: z[k] for k in _ARRAYS + _OPTIONAL_ARRAYS if k in z.files}
            for k in _SCALARS:
                if k in z.files:  # traces saved before a scalar existed keep its default
                    kw[k] = z[k].item()
            kw["token_texts"] = [str(s) for s in z["token_texts"]]
        kw["norm_topk_prob"] = bool(kw["norm_topk_prob"])
        for k in ("embedding_ns", "lm_head_ns", "n_forwards", "dropped", "prefix_cached", "group_pad"):
            if k in kw:
                kw[k] = int(kw[k])
        tr = cls(**kw)
        tr.check()
        return tr

    # ---- display -----------------------------------------------------------------------
    def __repr__(self) -> str:
        return (f"Trace({self.architecture or 'model'}: {self.n_tokens} tokens, "
                f"{self.n_layers} layers ({int(self.layer_is_moe.sum())} MoE), "
                f"{self.n_experts} experts, top-{self.top_k}, {self.n_forwards} forward(s))")

    def _repr_html_(self) -> str:
        tot = self.stage_totals()
        all_ns = sum(tot.values()) or 1
        rows = "".join(
            f"<tr><td>{html.escape(k)}</td><td style='text-align:right'>{v / 1e6:.3f}</td>"
            f"<td style='text-align:right'>{100.0 * v / all_ns:.1f} %</td></tr>"
            for k, v in tot.items()
        )
        load = self.group_sizes[self.layer_is_moe]
        if load.size:
            mean = load.mean(axis=1, keepdims=True)
            imb = float(np.max(load.max(axis=1) / np.maximum(mean[:, 0], 1e-12)))
            waste = self.padding_rows.sum() / max(int(self.padded_group_sizes.sum()), 1)
            moe_line = (f"max expert load / mean: {imb:.2f}; padding waste: {100.0 * waste:.1f} % "
                        f"of grouped rows (group_pad {self.group_pad})")
        else:
            moe_line = "no MoE layer"
        preview = "".join(
            f"<code style='border:1px solid #ccc;margin:1px'>{html.escape(t)}</code>"
            for t in self.token_texts[:48]
        )
        more = " …" if len(self.token_texts) > 48 else ""
        return (
            f"<div><b>{html.escape(repr(self))}</b><br>{html.escape(moe_line)}<br>"
            f"<div style='margin:4px 0'>{preview}{more}</div>"
            f"<table><tr><th>stage</th><th>ms</th><th>share</th></tr>{rows}</table></div>"
        )
