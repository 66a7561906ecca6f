"""Interventions on the engine's forward: expert masks, forced routing, router bias and
activation patching (colibri.h, "Interventions"), applied in the C forward itself.

:meth:`Engine.intervene <colibri_lab.runtime.engine.Engine.intervene>` returns an
:class:`Intervention`, a context manager; inside its ``with`` block ``forward``,
``generate``, ``batch`` and stage runs compute under the interventions, and leaving the block
clears them::

    with eng.intervene(ablate={0: [3]}, force={(1, 5): ([2, 0], [0.7, 0.3])}):
        logits = eng.forward(ids)

    with eng.intervene(record=[("resid", 2, 4)]) as iv:
        eng.forward(prompt_a)
    with eng.intervene(patch={("resid", 2, 7): iv.recorded[("resid", 2, 4)]}):
        eng.forward(prompt_b)

Keys of activation points are ``(point, layer, pos)`` with point ``"resid"`` (the residual
entering ``layer``; ``layer = n_layers`` is the residual entering the final norm),
``"attn_out"`` (the attention output after its projection, before the residual add),
``"shared_out"`` (a MoE layer's shared-expert output as it is added to the routed sum: after
Qwen2-MoE's sigmoid gate), or ``(point, layer, pos, expert)`` with point ``"expert_out"`` (that expert's output for the
token, before its routing weight; applied only where the token chose the expert). Positions are
positions in the sequence.
"""

from __future__ import annotations

import ctypes

import numpy as np

from . import _native
from ._native import check, lib
from .ids import ENTRY_DTYPE, as_ids

ALL_SEQS = -1
MASK_MODES = {"exclude": 1, "zero": 2}
POINTS = {"resid": 0, "attn_out": 1, "expert_out": 2, "shared_out": 3}
_RECORD, _REPLACE, _ADD = 0, 1, 2


def _f32(a, n: int, what: str) -> np.ndarray:
    v = np.ascontiguousarray(np.asarray(a, dtype=np.float32).reshape(-1))
    if v.shape != (n,):
        raise _native.ColibriInvalidArgError(f"{what} must have {n} values, got shape {np.shape(a)}")
    return v


def _point_key(key) -> tuple[int, int, int, int]:
    """(point, layer, pos[, expert]) -> the C arguments (point, layer, expert, pos)."""
    if not isinstance(key, tuple) or len(key) not in (3, 4) or key[0] not in POINTS:
        raise _native.ColibriInvalidArgError(
            f"an activation key is (point, layer, pos) or ('expert_out', layer, pos, expert) with point one of "
            f"{sorted(POINTS)}, got {key!r}"
        )
    point = POINTS[key[0]]
    if (point == POINTS["expert_out"]) != (len(key) == 4):
        raise _native.ColibriInvalidArgError(f"only 'expert_out' keys (and all of them) name an expert: {key!r}")
    expert = int(key[3]) if len(key) == 4 else -1
    return point, int(key[1]), expert, int(key[2])


class Intervention:
    """The settings of one :meth:`Engine.intervene` block (see the module's documentation).

    ``ablate={layer: [experts]}``: the router may not choose them (their logits are -inf
    before the top-k; the family's renormalisation then runs as usual). ``mode="zero"``
    gives ``ablate`` the other meaning, also available as ``zero={layer: [experts]}``: the
    router chooses as usual but the expert's output is zeroed. ``force={(layer, pos): (ids,
    weights)}``: exactly top_k distinct experts and their weights. ``router_bias={layer:
    array[n_experts]}``: added to the router logits. ``patch={key: vec}`` replaces an
    activation, ``add={key: vec}`` adds to it (steering), ``record=[key, ...]`` copies it into
    ``recorded[key]`` (float32 ``[hidden]``, filled by the forward). ``seq``: None for every
    sequence, or one sequence id (its settings replace the context-wide ones for its rows).
    """

    def __init__(self, engine, *, ablate=None, zero=None, mode: str = "exclude", force=None,
                 router_bias=None, patch=None, add=None, record=None, seq: int | None = None):  # fmt: skip
        if mode not in MASK_MODES:
            raise _native.ColibriInvalidArgError(f"mode must be one of {sorted(MASK_MODES)}, got {mode!r}")
        self._engine = engine
        self.seq = ALL_SEQS if seq is None else int(seq)
        self.ablate = {int(k): [int(e) for e in v] for k, v in (ablate or {}).items()}
        self.zero = {int(k): [int(e) for e in v] for k, v in (zero or {}).items()}
        self.mode = mode
        self.force = dict(force or {})
        self.router_bias = dict(router_bias or {})
        self.patch = dict(patch or {})
        self.add = dict(add or {})
        self.recorded: dict[tuple, np.ndarray] = {}
        self._record = list(record or [])
        self._active = False

    def __enter__(self) -> "Intervention":
        eng = self._engine
        ctx = eng._c()
        for other in eng._interventions:
            if other.seq == self.seq or self.seq == ALL_SEQS:
                raise _native.ColibriInvalidArgError(
                    "an intervene block for the same sequences is already active; put every setting in one "
                    "intervene call (blocks for distinct sequences, or one sequence's inside an all-sequence "
                    "block, may nest)"
                )
        cfg = eng.config
        E, H = cfg.n_experts, cfg.hidden_size
        try:
            masks = [(self.ablate, MASK_MODES[self.mode]), (self.zero, MASK_MODES["zero"])]
            for table, code in masks:
                for layer, experts in table.items():
                    ids = np.ascontiguousarray(experts, dtype=np.int32)
                    ptr = ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
                    check(lib.colibri_iv_mask(ctx, self.seq, layer, ptr, len(ids), code), ctx=ctx)
            for layer, bias in self.router_bias.items():
                b = _f32(bias, E, f"router_bias[{layer}]")
                check(lib.colibri_iv_router_bias(ctx, self.seq, int(layer),
                                                 b.ctypes.data_as(ctypes.POINTER(ctypes.c_float))), ctx=ctx)  # fmt: skip
            for key, (ids, weights) in self.force.items():
                layer, pos = (int(x) for x in key)
                ids = np.ascontiguousarray(ids, dtype=np.int32).reshape(-1)
                w = _f32(weights, len(ids), f"force[{key}] weights")
                check(lib.colibri_iv_force(ctx, self.seq, layer, pos, ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                                           w.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), len(ids)), ctx=ctx)  # fmt: skip
            for table, code in ((self.patch, _REPLACE), (self.add, _ADD)):
                for key, vec in table.items():
                    point, layer, expert, pos = _point_key(key)
                    v = _f32(vec, H, f"the vector of {key}")
                    check(lib.colibri_iv_patch(ctx, self.seq, point, layer, expert, pos, code,
                                               v.ctypes.data_as(ctypes.POINTER(ctypes.c_float))), ctx=ctx)  # fmt: skip
            for key in self._record:
                point, layer, expert, pos = _point_key(key)
                buf = np.full(H, np.nan, dtype=np.float32)  # NaN until a forward reaches it
                check(lib.colibri_iv_patch(ctx, self.seq, point, layer, expert, pos, _RECORD,
                                           buf.ctypes.data_as(ctypes.POINTER(ctypes.c_float))), ctx=ctx)  # fmt: skip
                self.recorded[tuple(key)] = buf
        except BaseException:
            lib.colibri_iv_clear(ctx, self.seq)
            raise
        self._active = True
        eng._interventions.append(self)
        return self

    def __exit__(self, *exc) -> None:
        eng = self._engine
        if not self._active:
            return
        self._active = False
        if self in eng._interventions:
            eng._interventions.remove(self)
        if not eng.closed:
            check(lib.colibri_iv_clear(eng._c(), self.seq), ctx=eng._c())
        # the recorded buffers stay with this object (the engine no longer writes them)


def lens(engine, resid) -> np.ndarray:
    """The logit lens: the final norm and LM head on residual rows (``[n, hidden]`` or
    ``[hidden]``, as recorded at ``("resid", layer, pos)``), computed by the engine:
    float32 logits ``[n, vocab]``."""
    ctx = engine._c()
    H, V, B = engine.config.hidden_size, engine.vocab_size, engine.config.max_batch
    x = np.ascontiguousarray(np.asarray(resid, dtype=np.float32))
    x = x.reshape(-1, H) if x.size else x.reshape(0, H)
    out = np.empty((len(x), V), dtype=np.float32)
    for i in range(0, len(x), B):
        part = np.ascontiguousarray(x[i:i + B])
        check(lib.colibri_lens(ctx, part.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), len(part),
                               out[i:i + B].ctypes.data_as(ctypes.POINTER(ctypes.c_float))), ctx=ctx)  # fmt: skip
    return out


def unembedding(engine, token: int) -> np.ndarray:
    """The unembedding direction of ``token``: final-norm weight * its LM-head row, float32
    ``[hidden]`` (its logit is ``u . x / rms(x)`` for a final residual ``x``)."""
    ctx = engine._c()
    out = np.empty(engine.config.hidden_size, dtype=np.float32)
    check(lib.colibri_unembedding(ctx, int(token), out.ctypes.data_as(ctypes.POINTER(ctypes.c_float))), ctx=ctx)
    return out


def logit_lens(engine, token_ids, positions, *, target: int | None = None, k: int = 5) -> dict:
    """The logit lens at ``positions`` of one forward of ``token_ids`` (run here, as a new
    sequence 0): the residual after each layer (entering the next, the last one entering the
    final norm) through the final norm and LM head, by the engine.

    Returns ``layers`` (``[L]``: 0 .. L-1, the layer just done), ``positions``, ``top_ids``
    ``[L, P, k]`` and ``top_logits`` (best first), and with ``target`` its ``target_rank``
    ``[L, P]`` (0 = top) and ``target_logit``. The last layer's row is the model's own logits.
    """
    L = engine.config.n_layers
    positions = [int(p) for p in positions]
    keys = [("resid", layer + 1, p) for layer in range(L) for p in positions]
    with Intervention(engine, record=keys) as rec:
        engine.forward(token_ids)
    rows = np.stack([rec.recorded[key] for key in keys]) if keys else np.zeros((0, engine.config.hidden_size))
    logits = lens(engine, rows).reshape(L, len(positions), -1)
    order = np.argsort(-logits, axis=-1, kind="stable")[..., :k]
    out = {
        "layers": np.arange(L),
        "positions": np.array(positions),
        "top_ids": order,
        "top_logits": np.take_along_axis(logits, order, axis=-1),
        "logits": logits,
    }
    if target is not None:
        t = logits[..., int(target)]
        out["target_rank"] = (logits > t[..., None]).sum(axis=-1)
        out["target_logit"] = t
    return out


def expert_attribution(engine, token_ids, pos: int, target: int) -> dict:
    """Direct logit attribution at position ``pos`` of one forward of ``token_ids`` (run
    here, as sequence 0): for each MoE layer and each expert the token chose, its weighted
    output projected on ``target``'s unembedding direction, divided by the RMS of the final
    residual at ``pos`` (the final norm's scale, held fixed), so that it is that expert's
    additive share of the target's logit.

    Returns ``ids`` and ``weights`` ``[L, K]`` (-1 / 0 in dense layers), ``outputs`` ``[L, K,
    hidden]`` (the experts' outputs before their weight, recorded by the engine),
    ``attribution`` ``[L, K]``, ``rms`` and the ``logit`` of the target at ``pos``.
    """
    cfg = engine.config
    L, E, K, H = cfg.n_layers, cfg.n_experts, cfg.top_k, cfg.hidden_size
    moe = engine._layer_is_moe()
    pos = int(pos)
    keys = [("expert_out", layer, pos, e) for layer in range(L) if moe[layer] for e in range(E)]
    keys.append(("resid", L, pos))
    with Intervention(engine, record=keys) as rec, engine.trace() as tr:
        logits = engine.forward(token_ids)
    row = int(np.flatnonzero(tr.positions == pos)[0])
    ids = tr.topk_ids[:, row].copy()
    w = tr.topk_weights[:, row].copy()
    outputs = np.zeros((L, K, H), np.float32)
    for layer in range(L):
        for j in range(K):
            if moe[layer]:
                outputs[layer, j] = rec.recorded[("expert_out", layer, pos, int(ids[layer, j]))]
    x = rec.recorded[("resid", L, pos)].astype(np.float64)
    rms = float(np.sqrt(np.mean(x * x) + engine._get_float("rms_norm_eps")))
    u = unembedding(engine, target).astype(np.float64)
    attribution = (w[..., None] * outputs).astype(np.float64) @ u / rms
    return {"ids": ids, "weights": w, "outputs": outputs, "attribution": attribution, "rms": rms,
            "logit": float(logits[pos, int(target)])}  # fmt: skip


def target_logprobs(engine, work) -> list:
    """Log-probabilities of target tokens, computed by the engine (``colibri_batch_logprobs``):
    ``work`` is a list of ``(seq, token_ids, targets)``; each item's tokens continue sequence
    ``seq`` at its end (as :meth:`Engine.batch <colibri_lab.runtime.engine.Engine.batch>`; all
    items run in one batched forward), and ``targets[i]`` (same length as ``token_ids``; -1:
    none) is the token whose log-probability after ``token_ids[i]`` is wanted, e.g. the next
    token. Returns per item float32 ``[len(token_ids)]``: ``log softmax(logits)[target]``, NaN
    where the target is -1; no logits row leaves the engine. The values of one sequence are
    bitwise the same whatever else is in the batch (each sequence keeps its own interventions),
    and -mean(values) is the next-token loss when the targets are the next tokens.
    """

    ctx = engine._c()
    items = []
    for seq, ids, targets in work:
        ids = as_ids(ids)
        tg = np.ascontiguousarray(np.asarray(targets, dtype=np.int64).reshape(-1))
        if tg.shape != ids.shape:
            raise _native.ColibriInvalidArgError(
                f"targets must have one id per token ({len(ids)}), got {tg.shape[0]}"
            )
        items.append((int(seq), ids, tg))
    n = sum(len(ids) for _, ids, _ in items)
    if n == 0:
        raise _native.ColibriInvalidArgError("the batch has no tokens")
    entries = np.zeros(n, dtype=ENTRY_DTYPE)
    nxt: dict[int, int] = {}
    i = 0
    for seq, ids, tg in items:
        k = len(ids)
        start = nxt.get(seq)
        if start is None:
            start = int(lib.colibri_seq_len(ctx, seq))
            if start < 0:
                raise _native.ColibriInvalidArgError(
                    f"sequence {seq} is not in [0, {engine.config.max_seqs}); open the Engine with a larger max_seqs"
                )
        e = entries[i:i + k]
        e["token"], e["seq"], e["pos"], e["logits"] = ids, seq, np.arange(start, start + k), tg != -1
        nxt[seq] = start + k
        i += k
    all_targets = np.concatenate([tg for _, _, tg in items])
    want = all_targets != -1
    if ((all_targets < -1) | (all_targets > np.iinfo(np.int32).max)).any():
        bad = int(all_targets[(all_targets < -1) | (all_targets > np.iinfo(np.int32).max)][0])
        raise _native.ColibriInvalidArgError(f"target {bad} is neither a token id nor -1 (none)")
    tgt = np.ascontiguousarray(all_targets[want], dtype=np.int32)
    out = np.empty(len(tgt), dtype=np.float32)
    check(lib.colibri_batch_logprobs(ctx, entries.ctypes.data, n, tgt.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                                     out.ctypes.data_as(ctypes.POINTER(ctypes.c_float))), ctx=ctx)  # fmt: skip
    full = np.full(n, np.nan, dtype=np.float32)
    full[want] = out
    res, r = [], 0
    for _, ids, _ in items:
        res.append(full[r:r + len(ids)])
        r += len(ids)
    return res
