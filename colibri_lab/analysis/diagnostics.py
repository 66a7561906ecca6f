"""Routing-quality measures over a :class:`~colibri_lab.runtime.trace.Trace`: numbers that help
decide things (is an int8 router good enough? is the load balanced enough for the group
padding we use? do experts specialise on kinds of tokens? how often could a decode step
reuse the experts of the previous token or layer?).

Every function returns plain numbers, numpy arrays or dicts of them (no pandas). Per-layer
arrays have one entry per layer of the trace; dense-MLP layers (``layer_is_moe`` False)
hold NaN there, and the ``overall`` figures are taken over MoE layers only.

- :func:`router_agreement`  two traces of the same tokens: top-k set changes, top-1 agreement
- :func:`load_imbalance`    max/mean load, coefficient of variation, normalised entropy
- :func:`padding_waste`     rows added by group padding (``group_pad``), per layer
- :func:`expert_reuse`      consecutive tokens / consecutive layers sharing experts, vs chance
- :func:`select_experts`    numpy reference of group-limited routing (bias, n_group, topk_group)
- :func:`group_selection`   how many expert groups a token's experts span; load per group
- :func:`correction_bias_effect`  how often a score-correction bias changes the chosen set
- :func:`token_classes`     token pieces -> {whitespace, newline, keyword, name, number,
                            punctuation, other}
- :func:`specialisation`    mutual information I(expert; token class), bits and share of H(class)
- :func:`summary`, :func:`format_table`  one row per layer, for notebooks
- :func:`synthetic_trace`   a consistent Trace from routing choices (tests, what-if baselines)
"""

from __future__ import annotations

import keyword
import math
import re
import string
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..runtime.trace import STAGES, Trace

#: The token classes of :func:`token_classes`, in a fixed order.
CLASSES = ("whitespace", "newline", "keyword", "name", "number", "punctuation", "other")

_KEYWORDS = frozenset(keyword.kwlist)   # hard keywords only: "match", "type", "_" are names
_PUNCT = frozenset(string.punctuation)
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_NUMBER = re.compile(r"^(?:0[xX][0-9a-fA-F_]+|[0-9][0-9_]*\.?[0-9_]*(?:[eE][+-]?[0-9]+)?[jJ]?"
                     r"|\.[0-9][0-9_]*)$")


def _nan_layers(trace: Trace) -> np.ndarray:
    return np.full(trace.n_layers, np.nan)


def _sequence_pairs(trace: Trace) -> np.ndarray:
    """Indices t such that tokens t and t+1 are neighbours in one sequence."""
    pos = np.asarray(trace.positions, dtype=np.int64)
    if pos.size < 2:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(pos[1:] == pos[:-1] + 1)


# --------------------------------------------------------------------------- agreement

def router_agreement(trace_a: Trace, trace_b: Trace) -> dict[str, Any]:
    """How often two routers (e.g. int8 vs float) choose differently on the same tokens.

    Both traces must hold the same token ids in the same order and the same layers.
    Per MoE layer:

    - ``set_changed[l]``: share of tokens whose top-k *set* of experts differs (order
      ignored: a swap of ranks 1 and 2 changes the combine weights, not the experts run);
    - ``top1_agreement[l]``: share of tokens whose best expert is the same;
    - ``max_prob_diff[l]``: the largest |Δ| between the two routers' probabilities.

    ``overall_set_changed`` / ``overall_top1_agreement`` pool every (MoE layer, token).
    Identical routing gives set_changed 0 and top1_agreement 1.
    """
    if not np.array_equal(trace_a.token_ids, trace_b.token_ids):
        raise ValueError("router_agreement needs two traces of the same tokens "
                         f"({trace_a.n_tokens} vs {trace_b.n_tokens} tokens, or different ids)")
    if trace_a.topk_ids.shape != trace_b.topk_ids.shape or not np.array_equal(
            trace_a.layer_is_moe, trace_b.layer_is_moe):
        raise ValueError("router_agreement needs traces of the same model shape "
                         f"(topk_ids {trace_a.topk_ids.shape} vs {trace_b.topk_ids.shape})")
    moe = trace_a.moe_layers
    set_changed, top1, maxdiff = _nan_layers(trace_a), _nan_layers(trace_a), _nan_layers(trace_a)
    T = trace_a.n_tokens
    pooled_changed = pooled_top1 = 0
    for l in moe:
        a = np.sort(trace_a.topk_ids[l], axis=1)
        b = np.sort(trace_b.topk_ids[l], axis=1)
        changed = np.any(a != b, axis=1)
        same1 = trace_a.topk_ids[l, :, 0] == trace_b.topk_ids[l, :, 0]
        pooled_changed += int(changed.sum())
        pooled_top1 += int(same1.sum())
        if T:
            set_changed[l] = changed.mean()
            top1[l] = same1.mean()
            maxdiff[l] = float(np.max(np.abs(trace_a.router_probs[l].astype(np.float64)
                                              - trace_b.router_probs[l])))
    n = T * len(moe)
    return {
        "layers": moe,
        "n_tokens": T,
        "set_changed": set_changed,
        "top1_agreement": top1,
        "max_prob_diff": maxdiff,
        "overall_set_changed": pooled_changed / n if n else math.nan,
        "overall_top1_agreement": pooled_top1 / n if n else math.nan,
    }


# --------------------------------------------------------------------------- load

def expert_load(trace: Trace) -> np.ndarray:
    """[L, E] share of each layer's routed rows that went to each expert (NaN rows for
    dense layers). Rows of an MoE layer sum to 1."""
    g = trace.group_sizes.astype(np.float64)
    tot = g.sum(axis=1, keepdims=True)
    out = np.full(g.shape, np.nan)
    ok = trace.layer_is_moe & (tot[:, 0] > 0)
    out[ok] = g[ok] / tot[ok]
    return out


def load_imbalance(trace: Trace) -> dict[str, Any]:
    """How unevenly each MoE layer spreads its routed rows over the experts.

    Per layer, with ``n_e`` the rows routed to expert e (``group_sizes``):

    - ``max_over_mean[l] = max_e n_e / mean_e n_e`` (1 = perfectly even; E = everything on
      one expert). The slowest expert sets the pace of a parallel expert step.
    - ``cv[l]``: coefficient of variation std_e n_e / mean_e n_e (population std).
    - ``entropy[l]``: entropy of the load distribution divided by log(E), in [0, 1]
      (1 = uniform, 0 = one expert takes all).
    - ``dead[l]``: experts that received no row at all.
    """
    g = trace.group_sizes.astype(np.float64)
    E = trace.n_experts
    mx, cv, ent, dead = (_nan_layers(trace) for _ in range(4))
    for l in trace.moe_layers:
        n = g[l]
        mean = n.mean()
        if mean <= 0:
            continue
        mx[l] = n.max() / mean
        cv[l] = n.std() / mean
        p = n / n.sum()
        nz = p[p > 0]
        ent[l] = float(-(nz * np.log(nz)).sum() / math.log(E)) if E > 1 else 1.0
        dead[l] = float((n == 0).sum())
    return {"layers": trace.moe_layers, "max_over_mean": mx, "cv": cv, "entropy": ent,
            "dead": dead}


def padding_waste(trace: Trace) -> dict[str, Any]:
    """Rows added by padding each expert's group to a multiple of ``trace.group_pad``.

    Per layer: ``real_rows[l]`` (routed rows, T·K), ``padded_rows[l]`` (rows the expert
    kernels process after padding), ``waste_rows[l] = padded - real`` and
    ``waste_pct[l] = 100 · waste / padded`` (share of the grouped rows spent on zeros;
    NaN for dense layers). ``total_*`` pool the MoE layers.
    """
    real = trace.group_sizes.sum(axis=1).astype(np.int64)
    padded = trace.padded_group_sizes.sum(axis=1).astype(np.int64)
    waste = padded - real
    pct = _nan_layers(trace)
    for l in trace.moe_layers:
        pct[l] = 100.0 * waste[l] / padded[l] if padded[l] else 0.0
    moe = trace.layer_is_moe
    tp, tw = int(padded[moe].sum()), int(waste[moe].sum())
    return {"group_pad": int(trace.group_pad), "real_rows": real, "padded_rows": padded,
            "waste_rows": waste, "waste_pct": pct, "total_real_rows": int(real[moe].sum()),
            "total_padded_rows": tp, "total_waste_rows": tw,
            "total_waste_pct": 100.0 * tw / tp if tp else 0.0}


# --------------------------------------------------------------------------- family routing

def select_experts(scores: np.ndarray, top_k: int, *, bias: np.ndarray | None = None,
                   n_group: int = 1, topk_group: int | None = None,
                   group_score: str = "top2_sum") -> np.ndarray:
    """[T, top_k] the experts a group-limited router picks from per-expert scores [T, E]
    (a numpy reference of DeepSeek's routers, for what-if questions): ``bias`` [E] is added
    for the choice only (DeepSeek-V3's ``e_score_correction_bias``); with ``n_group`` > 1
    the experts form n_group equal consecutive groups, each group is scored by the sum of
    its top two (``"top2_sum"``, V3) or its maximum (``"max"``, V2's group-limited greedy),
    the ``topk_group`` best groups stay and top-k runs over their experts. Best first; ties
    go to the lower id (the engine's rule)."""
    sc = np.asarray(scores, np.float64)
    T, E = sc.shape
    choice = sc + (0.0 if bias is None else np.asarray(bias, np.float64)[None, :])
    if n_group > 1:
        if E % n_group:
            raise ValueError(f"{E} experts do not split into {n_group} groups")
        g = choice.reshape(T, n_group, E // n_group)
        if group_score == "top2_sum":
            gs = -np.sort(-g, axis=2)[:, :, :2].sum(axis=2)
        elif group_score == "max":
            gs = g.max(axis=2)
        else:
            raise ValueError(f"group_score {group_score!r}: choose top2_sum or max")
        keep = np.argsort(-gs, axis=1, kind="stable")[:, :topk_group or n_group]
        mask = np.zeros((T, n_group), bool)
        np.put_along_axis(mask, keep, True, axis=1)
        choice = np.where(np.repeat(mask, E // n_group, axis=1), choice, -np.inf)
    return np.argsort(-choice, axis=1, kind="stable")[:, :top_k].astype(np.int32)


def group_selection(trace: Trace, n_group: int) -> dict[str, Any]:
    """Which of ``n_group`` equal consecutive expert groups a token's experts came from
    (DeepSeek's group-limited routing keeps each token's experts in ``topk_group`` groups).

    Per MoE layer: ``groups_per_token[l]`` (mean distinct groups among a token's top-k),
    ``histogram[l, g]`` (share of tokens whose experts span g groups, g = 0..n_group) and
    ``group_load[l, g]`` (share of the layer's routed rows in group g)."""
    L, E = trace.n_layers, trace.n_experts
    if n_group < 1 or E % n_group:
        raise ValueError(f"{E} experts do not split into {n_group} groups")
    per = _nan_layers(trace)
    hist = np.full((L, n_group + 1), np.nan)
    load = np.full((L, n_group), np.nan)
    for l in trace.moe_layers:
        ids = trace.topk_ids[l]
        grp = ids // (E // n_group)
        span = np.array([len(set(r[r >= 0].tolist())) for r in grp]) if len(grp) else np.zeros(0)
        per[l] = float(span.mean()) if span.size else math.nan
        hist[l] = np.bincount(span, minlength=n_group + 1)[: n_group + 1] / max(1, span.size)
        load[l] = np.bincount(grp[grp >= 0].ravel(), minlength=n_group) / max(1, (grp >= 0).sum())
    return {"layers": trace.moe_layers, "n_group": n_group, "groups_per_token": per,
            "histogram": hist, "group_load": load}


def correction_bias_effect(trace: Trace, bias: np.ndarray, *, n_group: int = 1,
                           topk_group: int | None = None) -> dict[str, Any]:
    """How often the score-correction bias (DeepSeek-V3: added to the scores for the choice
    only) changes the chosen experts. ``bias`` [L, E] (rows of dense layers ignored); the
    trace's ``router_probs`` are the per-expert scores (sigmoid for V3).

    Per MoE layer: ``set_changed[l]`` (share of tokens whose top-k set differs with and
    without the bias, under the same group rule), ``engine_agrees[l]`` (share whose set
    with the bias is the engine's own choice: 1.0 unless ties), ``mean_swapped[l]`` (experts
    per token the bias swapped in)."""
    bias = np.asarray(bias, np.float64)
    changed, agrees, swapped = (_nan_layers(trace) for _ in range(3))
    K = trace.top_k
    for l in trace.moe_layers:
        sc = trace.router_probs[l]
        if not len(sc):
            continue
        with_b = select_experts(sc, K, bias=bias[l], n_group=n_group, topk_group=topk_group)
        without = select_experts(sc, K, n_group=n_group, topk_group=topk_group)
        a, b = np.sort(with_b, axis=1), np.sort(without, axis=1)
        changed[l] = float(np.mean(np.any(a != b, axis=1)))
        agrees[l] = float(np.mean(np.all(a == np.sort(trace.topk_ids[l], axis=1), axis=1)))
        swapped[l] = float(np.mean([len(set(x) - set(y)) for x, y in zip(a.tolist(), b.tolist())]))
    return {"layers": trace.moe_layers, "set_changed": changed, "engine_agrees": agrees,
            "mean_swapped": swapped}


# --------------------------------------------------------------------------- reuse

def chance_share_any(n_experts: int, top_k: int) -> float:
    """P(two independent uniform top-k sets share at least one expert)
    = 1 - C(E-K, K) / C(E, K)."""
    E, K = int(n_experts), int(top_k)
    return 1.0 - math.comb(E - K, K) / math.comb(E, K)


def expert_reuse(trace: Trace) -> dict[str, Any]:
    """How often the experts of one token are needed again by the next token, or by the
    same token in the next layer (what an expert cache or prefetcher could exploit).

    Along the sequence, per MoE layer, over pairs of neighbouring tokens (positions p and
    p+1 of one sequence; pairs across a sequence restart are skipped):

    - ``token_any[l]``: share of pairs whose top-k sets share ≥ 1 expert;
    - ``token_top1[l]``: share of pairs with the same top-1 expert.

    Across layers, per pair of consecutive MoE layers (l, l+1), keyed by l, over tokens:

    - ``layer_overlap[l]``: mean |ids(l) ∩ ids(l+1)| / K — expert ids of different layers
      are different weights, so this measures whether routers line up index-wise (a
      converter or a prefetch heuristic may rely on it), not weight reuse;
    - ``layer_top1[l]``: share of tokens with the same top-1 id in l and l+1.

    Chance levels for independent uniform routing: ``chance_any`` = 1 - C(E-K,K)/C(E,K),
    ``chance_top1`` = 1/E, ``chance_overlap`` = K/E.
    """
    E, K = trace.n_experts, trace.top_k
    pairs = _sequence_pairs(trace)
    tok_any, tok_top1 = _nan_layers(trace), _nan_layers(trace)
    lay_ov, lay_top1 = _nan_layers(trace), _nan_layers(trace)
    onehot = _onehot_sets(trace)          # [L, T, E] bool
    for l in trace.moe_layers:
        if pairs.size:
            inter = (onehot[l, pairs] & onehot[l, pairs + 1]).sum(axis=1)
            tok_any[l] = float((inter > 0).mean())
            tok_top1[l] = float((trace.topk_ids[l, pairs, 0]
                                 == trace.topk_ids[l, pairs + 1, 0]).mean())
        nxt = l + 1
        if nxt < trace.n_layers and trace.layer_is_moe[nxt] and trace.n_tokens:
            inter = (onehot[l] & onehot[nxt]).sum(axis=1)
            lay_ov[l] = float(inter.mean() / K)
            lay_top1[l] = float((trace.topk_ids[l, :, 0] == trace.topk_ids[nxt, :, 0]).mean())
    return {"layers": trace.moe_layers, "n_pairs": int(pairs.size),
            "token_any": tok_any, "token_top1": tok_top1,
            "layer_overlap": lay_ov, "layer_top1": lay_top1,
            "chance_any": chance_share_any(E, K), "chance_top1": 1.0 / E,
            "chance_overlap": K / E}


def _onehot_sets(trace: Trace) -> np.ndarray:
    """[L, T, E] True where the expert is in the token's top-k (all False in dense layers)."""
    L, T, E = trace.n_layers, trace.n_tokens, trace.n_experts
    out = np.zeros((L, T, E), dtype=bool)
    ids = trace.topk_ids
    ll, tt, _ = np.nonzero(ids >= 0)
    out[ll, tt, ids[ids >= 0]] = True
    return out


# --------------------------------------------------------------------------- specialisation

def _piece_to_text(piece: str) -> str:
    """A tokenizer piece as the text it stands for: '▁' (SentencePiece) and 'Ġ'
    (byte-level BPE) are spaces, 'Ċ' a newline, 'ĉ' a tab, '<0xNN>' one byte."""
    m = _BYTE_PIECE.match(piece)
    if m:
        b = int(m.group(1), 16)
        return chr(b) if b < 0x80 else "\ufffd"
    return piece.replace("\u2581", " ").replace("\u0120", " ").replace("\u010a", "\n") \
        .replace("\u0109", "\t")


def token_class(piece: str) -> str:
    """The :data:`CLASSES` entry of one token piece (see :func:`token_classes`)."""
    if piece in ("<s>", "</s>", "<unk>", "<pad>") or (piece.startswith("<|") and
                                                      piece.endswith("|>")):
        return "other"
    text = _piece_to_text(piece)
    if not text:
        return "other"
    if "\n" in text or "\r" in text:
        return "newline" if not text.strip() else "other"
    core = text.strip(" \t")
    if not core:
        return "whitespace"
    if core in _KEYWORDS:
        return "keyword"
    if core.isidentifier():
        return "name"
    if _NUMBER.match(core):
        return "number"
    if all(ch in _PUNCT for ch in core):
        return "punctuation"
    return "other"


def token_classes(token_texts: Sequence[str]) -> list[str]:
    """Map token pieces to coarse source-code classes, one of :data:`CLASSES`:

    ``whitespace`` (spaces / indentation only), ``newline`` (only line breaks and
    spaces), ``keyword`` (a Python keyword of ``keyword.kwlist``, after stripping a
    leading space; soft keywords such as ``match`` count as names), ``name`` (any other
    identifier piece, including word pieces of prose; ``"▁é"`` too, as Python allows it
    in identifiers), ``number``, ``punctuation`` (operators and brackets: all
    characters in ``string.punctuation``), ``other`` (special tokens, mixed pieces,
    non-ASCII bytes). Pieces use '▁' for a space (SentencePiece) or 'Ġ'/'Ċ' (byte-level
    BPE); '<0x0A>' style byte pieces are decoded first.
    """
    return [token_class(p) for p in token_texts]


def _entropy_bits(counts: np.ndarray) -> float:
    c = counts[counts > 0].astype(np.float64)
    if c.size == 0:
        return 0.0
    p = c / c.sum()
    return float(-(p * np.log2(p)).sum())


def _mutual_information_bits(joint: np.ndarray) -> float:
    """I(X; Y) in bits of a joint count table."""
    tot = joint.sum()
    if tot <= 0:
        return 0.0
    return (_entropy_bits(joint.sum(axis=1)) + _entropy_bits(joint.sum(axis=0))
            - _entropy_bits(joint.ravel()))


def specialisation(trace: Trace, classes: Sequence[str] | None = None, *,
                   n_shuffles: int = 20, seed: int = 0) -> dict[str, Any]:
    """Do experts specialise on kinds of tokens? Mutual information I(expert; class).

    Each routed row (token t sent to expert e, K rows per token) is one sample of the
    pair (e, class(t)); per MoE layer the joint count table gives the plug-in estimate
    I(expert; class) = H(class) + H(expert) - H(expert, class), in bits.
    ``ratio[l] = I / H(class)`` is the share of the class uncertainty the choice of
    expert removes: 1 when every class has experts of its own (perfect specialisation),
    about 0 for routing independent of the class.

    The plug-in estimate is biased upwards on few tokens, so ``shuffled_bits[l]`` gives
    the mean MI after shuffling the classes over the tokens ``n_shuffles`` times (a
    chance level for this number of tokens; ``seed`` fixes it). Compare ``mi_bits`` with
    it rather than with 0.

    ``classes``: one label per token (any hashable strings); default
    ``token_classes(trace.token_texts)``.
    """
    if classes is None:
        if len(trace.token_texts) != trace.n_tokens:
            raise ValueError("the trace has no token texts: pass classes= (one label per token)")
        classes = token_classes(trace.token_texts)
    classes = list(classes)
    if len(classes) != trace.n_tokens:
        raise ValueError(f"{len(classes)} class labels for {trace.n_tokens} tokens")
    names = sorted(set(classes), key=lambda c: (CLASSES.index(c) if c in CLASSES else
                                                len(CLASSES), str(c)))
    idx = {c: i for i, c in enumerate(names)}
    cls = np.array([idx[c] for c in classes], dtype=np.int64)
    C, E = len(names), trace.n_experts
    class_counts = np.bincount(cls, minlength=C)
    h_class = _entropy_bits(class_counts)
    mi, ratio, shuf = _nan_layers(trace), _nan_layers(trace), _nan_layers(trace)
    rng = np.random.default_rng(seed)
    perms = [rng.permutation(trace.n_tokens) for _ in range(n_shuffles)]
    joints = {}

    def joint_of(ids: np.ndarray, c: np.ndarray) -> np.ndarray:
        """[E, C] counts of routed rows: ids [T, K], c [T] class indices."""
        return np.bincount((ids * C + c[:, None]).ravel(), minlength=E * C).reshape(E, C)

    for l in trace.moe_layers:
        ids = trace.topk_ids[l].astype(np.int64)
        j = joint_of(ids, cls)
        joints[int(l)] = j
        mi[l] = _mutual_information_bits(j)
        ratio[l] = mi[l] / h_class if h_class > 0 else math.nan
        if perms:
            shuf[l] = float(np.mean([_mutual_information_bits(joint_of(ids, cls[p]))
                                     for p in perms]))
    return {"layers": trace.moe_layers, "classes": names, "class_counts": class_counts,
            "h_class_bits": h_class, "mi_bits": mi, "ratio": ratio, "shuffled_bits": shuf,
            "joint_counts": joints}


# --------------------------------------------------------------------------- summary

def summary(trace: Trace, classes: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """One row per layer (a list of dicts, no pandas): kind, load balance, reuse,
    padding waste, specialisation (when token texts or ``classes`` are there) and time.

    Keys: layer, kind ('moe'/'dense'), max_over_mean, cv, entropy, reuse_any, reuse_top1,
    next_layer_top1, waste_pct, mi_bits, mi_ratio, time_ms. NaN where a measure does not
    apply (dense layers, no texts).
    """
    imb = load_imbalance(trace)
    reuse = expert_reuse(trace)
    pad = padding_waste(trace)
    spec = None
    if classes is not None or len(trace.token_texts) == trace.n_tokens > 0:
        spec = specialisation(trace, classes, n_shuffles=0)
    rows = []
    for l in range(trace.n_layers):
        rows.append({
            "layer": l,
            "kind": "moe" if trace.layer_is_moe[l] else "dense",
            "max_over_mean": float(imb["max_over_mean"][l]),
            "cv": float(imb["cv"][l]),
            "entropy": float(imb["entropy"][l]),
            "reuse_any": float(reuse["token_any"][l]),
            "reuse_top1": float(reuse["token_top1"][l]),
            "next_layer_top1": float(reuse["layer_top1"][l]),
            "waste_pct": float(pad["waste_pct"][l]),
            "mi_bits": float(spec["mi_bits"][l]) if spec else math.nan,
            "mi_ratio": float(spec["ratio"][l]) if spec else math.nan,
            "time_ms": float(trace.timings_ns[l].sum()) / 1e6,
        })
    return rows


def format_table(rows: Sequence[dict[str, Any]], digits: int = 2,
                 columns: Sequence[str] | None = None) -> str:
    """A fixed-width text table of :func:`summary` rows (floats rounded to ``digits``,
    NaN shown as '-'), for printing in notebooks."""
    if not rows:
        return "(no rows)"
    cols = list(columns) if columns is not None else list(rows[0])

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "-" if math.isnan(v) else f"{v:.{digits}f}"
        return str(v)

    body = [[cell(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]
    def line(vals: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) for v, w in zip(vals, widths))

    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(b) for b in body])


# --------------------------------------------------------------------------- synthetic

def synthetic_trace(topk_ids: np.ndarray, *, n_experts: int,
                    router_probs: np.ndarray | None = None,
                    topk_weights: np.ndarray | None = None,
                    layer_is_moe: Sequence[bool] | None = None,
                    token_texts: Sequence[str] | None = None,
                    token_ids: Sequence[int] | None = None,
                    positions: Sequence[int] | None = None,
                    group_pad: int = 1,
                    shared_gate: np.ndarray | None = None,
                    timings_ns: np.ndarray | None = None) -> Trace:
    """A mutually consistent :class:`Trace` built from routing choices alone.

    ``topk_ids`` [L, T, K] (rows of dense layers are ignored and set to -1). Group sizes
    and padded sizes are counted from the ids; router probabilities default to a softmax
    that puts the chosen experts first; weights default to their renormalised probs.
    For tests, and for what-if baselines (uniform random routing at the same shape).
    """
    ids = np.array(topk_ids, dtype=np.int32, copy=True)
    if ids.ndim != 3:
        raise ValueError(f"topk_ids must be [L, T, K], got shape {ids.shape}")
    L, T, K = ids.shape
    E = int(n_experts)
    moe = (np.ones(L, dtype=bool) if layer_is_moe is None
           else np.asarray(layer_is_moe, dtype=bool))
    ids[~moe] = -1
    if router_probs is None:
        logits = np.zeros((L, T, E), dtype=np.float64)
        for k in range(K):
            np.put_along_axis(logits, np.maximum(ids[:, :, k:k + 1], 0), float(K - k + 1),
                              axis=2)
        p = np.exp(logits)
        router_probs = (p / p.sum(axis=2, keepdims=True)).astype(np.float32)
    router_probs = np.array(router_probs, dtype=np.float32, copy=True)
    router_probs[~moe] = np.nan
    if topk_weights is None:
        w = np.take_along_axis(router_probs, np.maximum(ids, 0), axis=2).astype(np.float64)
        w = w / np.maximum(w.sum(axis=2, keepdims=True), 1e-30)
        topk_weights = w.astype(np.float32)
    topk_weights = np.array(topk_weights, dtype=np.float32, copy=True)
    topk_weights[~moe] = 0.0
    gs = np.zeros((L, E), dtype=np.int64)
    for l in np.flatnonzero(moe):
        gs[l] = np.bincount(ids[l].ravel(), minlength=E)
    pad = max(int(group_pad), 1)
    padded = -(-gs // pad) * pad
    tr = Trace(
        token_ids=np.asarray(token_ids if token_ids is not None else np.arange(T) + 3,
                             dtype=np.int32),
        positions=np.asarray(positions if positions is not None else np.arange(T),
                             dtype=np.int64),
        router_probs=router_probs,
        topk_ids=ids,
        topk_weights=topk_weights,
        shared_gate=(np.full((L, T), np.nan, dtype=np.float32) if shared_gate is None
                     else np.asarray(shared_gate, dtype=np.float32)),
        group_sizes=gs,
        padded_group_sizes=padded,
        layer_is_moe=moe,
        timings_ns=(np.zeros((L, len(STAGES)), dtype=np.uint64) if timings_ns is None
                    else np.asarray(timings_ns, dtype=np.uint64)),
        n_forwards=1,
        group_pad=pad,
        architecture="synthetic",
        token_texts=list(token_texts) if token_texts is not None else [],
    )
    tr.check()
    return tr


def random_routing(trace: Trace, seed: int = 0) -> Trace:
    """The same shape, tokens and texts as ``trace`` with uniform random top-k routing
    (distinct experts per token): the chance baseline for every measure here."""
    rng = np.random.default_rng(seed)
    L, T, K, E = trace.n_layers, trace.n_tokens, trace.top_k, trace.n_experts
    ids = np.argsort(rng.random((L, T, E)), axis=2)[:, :, :K]
    return synthetic_trace(ids, n_experts=E, layer_is_moe=trace.layer_is_moe,
                           token_texts=trace.token_texts, token_ids=trace.token_ids,
                           positions=trace.positions, group_pad=trace.group_pad)
