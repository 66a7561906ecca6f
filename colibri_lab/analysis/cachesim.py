"""What an expert cache of a given size would hit on a routing trace: a simulator of the
engine's expert cache (``Engine(expert_cache_mb=, expert_cache_policy=)``), fast enough to
sweep cache sizes and policies over long traces.

    from colibri_lab.analysis import cachesim
    res = cachesim.simulate(trace, 4, "lru")        # 4 slots per MoE layer
    res.hit_rate, res.layer_hit_rate, res.misses_per_token
    rows = cachesim.sweep(trace, [2, 3, 4, 6], ("lru", "lfu", "belady"))
    print(cachesim.format_table(rows))

For models larger than memory the engine keeps the dense weights mapped and gives every
MoE layer ``S`` slots for its routed experts; an expert that is not in a slot when a token
needs it is read from the file into one (a miss). The simulator replays a
:class:`~colibri_lab.runtime.trace.Trace` (or a plain ``[L, T, K]`` array of expert ids) through
that cache with the engine's accounting: on the routing trace of a run with the engine's
cache, its five counters per layer equal the engine's (``trace.cache_hits``,
``trace.cache_misses``, ...; tests/test_cachesim.py checks decode and prefill).

**Steps.** Each layer has a cache of its own and is simulated on its own. Tokens are taken
in trace order, one *step* per token (the engine's decode of one sequence: one forward per
token). The engine's prefill runs a chunk of up to ``max_batch`` tokens in one forward, and
its cache then serves the *union* of the chunk's experts in one step; ``chunks=`` (the
token count of every forward, in order) makes the simulator do the same. In a step:

1. ``"predict"`` only, before the demand: the step's predicted experts (the distinct ids of
   ``predicted_ids[l]`` over the step's tokens, -1 ignored) are taken in ascending id, at
   most ``S`` of them (resident ones count towards the ``S``). One that is not resident is
   inserted: into the lowest empty slot, else the least recently used unpinned slot that
   does not hold a predicted expert of this step (any of them, also past the first ``S``;
   no such slot: the prefetch stops). The slot is marked *prefetched, unused* and touched.
   A resident predicted expert is left as it is (not touched).
2. Demand: the step's needed experts are the distinct ids of ``topk_ids[l]`` over its
   tokens (-1 ignored); an expert needed by R tokens of the step counts R uses. A resident
   needed expert gives R hits; if its slot is marked prefetched it is also one *prefetch
   hit* and the mark is cleared. Hits are touched in ascending id.
3. The misses, in ascending id, are loaded one at a time, each into the lowest empty slot,
   else into a victim chosen by the policy among the slots that are not pinned. The
   engine runs the resident experts first and a loaded miss at once, so every resident
   expert of the step has already run when a victim is chosen, and none is protected:
   with ``S`` below the number of needed experts a later miss of a step can evict an
   earlier one. A victim marked prefetched is a *wasted prefetch*. A miss counts 1 miss
   and R - 1 hits, and its slot is touched.

A touch sets the slot's recency to the layer's next touch count (a counter that increases
by one per touch), so no two slots of a layer have the same recency. Each touch also adds
the expert's uses in the step (0 for a prefetch) to its LFU count, which is kept for
experts out of the cache too; every ``half_life``-th step of a layer (steps 128, 256, ...
by default) halves all of them (integer halving) before its hits.

**Policies** (the victim among the candidate slots):

- ``"lru"``: the least recently used.
- ``"lfu"``: the lowest LFU count, ties to the least recently used.
- ``"pinned"``: a pinned set per layer (``pinned=`` ``[L, P]`` expert ids, -1 padded; by
  default the ``S // 2`` most used experts of each layer in the trace, :func:`hot_experts`)
  fills the first slots before the first step, as ``Engine.pin_experts`` does, and is never
  evicted; its uses are hits. The other slots run LRU. A layer's pinned set must leave one
  slot free.
- ``"predict"``: LRU with step 1, from ``predicted_ids`` (the experts the engine's predictor
  expects for layer l: layer l's router applied to the residual stream after layer l - 1;
  -1 where it has none: layer 0, dense layers).
- ``"belady"``: the resident expert whose next use in this layer is farthest in the future
  (never used again first, ties to the least recently used): Belady's MIN, which needs the
  future, so the engine cannot run it. While every step's needed experts fit in the slots
  (decode with ``S >= K``) no demand policy gets more hits from an empty cache. When a step
  needs more experts than there are slots (``S < K``, or a prefill chunk), resident experts
  run first whatever their order, the optimum is another problem, and LRU or LFU can beat
  this rule by a few hits. The pinned sets are loaded before the first step and their reads
  are not misses (as with ``Engine.pin_experts``), so ``"pinned"`` can exceed it by up to
  ``P`` hits per layer; and a prefetching policy's reads are not misses either, so
  ``"predict"`` can exceed it by far.

**Counts.** Per layer: ``hits + misses`` = uses (per token and layer, its distinct experts).
``hit_rate`` = hits / uses over the MoE layers, ``layer_hit_rate`` per layer (NaN for dense
layers and layers without uses); ``prefetches`` = experts inserted by step 1,
``prefetch_accuracy`` = prefetch hits / prefetches (NaN without prefetches). Reads from disk
are misses plus prefetches.

Also here: :func:`sweep` (every policy over a list of sizes), :func:`hot_experts` (the
default pinned sets), :func:`predictor_accuracy` (how often the predictor names the expert
that is then used), :func:`coactivation` (expert-to-expert transition probabilities between
two layers: the structure prediction exploits), :func:`predict_tokens_per_s` (a bandwidth
model of decode speed from a result). The simulation runs in numba-compiled code
(millions of uses per second on one core); :func:`_simulate_reference` is a plain-Python
implementation of the same rules that the tests compare it with.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numba
import numpy as np

#: The policies, in the order of their codes in the compiled simulation.
POLICIES = ("lru", "lfu", "pinned", "predict", "belady")
#: The policies a demand cache can run without knowing the future (``"belady"`` is the bound).
DEMAND_POLICIES = ("lru", "lfu", "pinned")
_LRU, _LFU, _PINNED, _PREDICT, _BELADY = range(5)
_NEVER = np.iinfo(np.int64).max   # the next use of an expert never used again
_STATS = ("hits", "misses", "prefetches", "prefetch_hits", "wasted_prefetches")


# --------------------------------------------------------------------------- the kernel

@numba.njit(cache=True, nogil=True)
def _victim(policy, S, slot_exp, slot_rec, slot_pin, lfu, nextuse, mark, stamp, lru_only):
    """The slot for a new expert: the lowest empty one, else by the policy among unpinned
    slots whose expert e has ``mark[e] != stamp``; -1 if there is none."""
    best = -1
    for s in range(S):
        e = slot_exp[s]
        if e < 0:
            return s
        if slot_pin[s] or mark[e] == stamp:
            continue
        if best < 0:
            best = s
            continue
        b = slot_exp[best]
        if lru_only or policy != _LFU and policy != _BELADY:
            if slot_rec[s] < slot_rec[best]:
                best = s
        elif policy == _LFU:
            if lfu[e] < lfu[b] or (lfu[e] == lfu[b] and slot_rec[s] < slot_rec[best]):
                best = s
        else:
            if nextuse[e] > nextuse[b] or (nextuse[e] == nextuse[b] and slot_rec[s] < slot_rec[best]):
                best = s
    return best


@numba.njit(cache=True, nogil=True)
def _assign(s, e, prefetched, slot_exp, slot_pf, where):
    """Slot s takes expert e (marked prefetched or not); 1 if the expert it held was a
    prefetch never used (a wasted prefetch), else 0."""
    old = slot_exp[s]
    wasted = 0
    if old >= 0:
        if slot_pf[s]:
            wasted = 1
        where[old] = -1
    slot_exp[s] = e
    slot_pf[s] = prefetched
    where[e] = s
    return wasted


@numba.njit(cache=True, nogil=True)
def _sort_head(a, n):
    """Sort a[:n] ascending in place (insertion sort: n is at most a step's experts)."""
    for i in range(1, n):
        v = a[i]
        j = i - 1
        while j >= 0 and a[j] > v:
            a[j + 1] = a[j]
            j -= 1
        a[j + 1] = v


@numba.njit(cache=True, nogil=True)
def _run(ids, pred, moe, slots, starts, policy, pinned, half_life, E, out):
    """Simulate every MoE layer; out[l] = hits, misses, prefetches, prefetch hits, wasted."""
    L, T, K = ids.shape
    Kp = pred.shape[2]
    n_steps = starts.shape[0] - 1
    cnt = np.zeros(E, np.int64)         # uses of each expert in the current step
    tokmark = np.empty(E, np.int64)      # last token that counted the expert (dedup)
    predmark = np.empty(E, np.int64)     # last step that predicted the expert
    where = np.empty(E, np.int64)        # slot of each expert, -1 not resident
    lfu = np.empty(E, np.int64)
    nextuse = np.empty(E, np.int64)      # belady: next step that uses a resident expert
    nu_step = np.empty(E, np.int64)      # belady: next use after the current step
    last = np.empty(E, np.int64)
    need = np.empty(E, np.int64)
    miss = np.empty(E, np.bool_)
    plist = np.empty(E, np.int64)
    nu = np.empty((T, K), np.int64)      # belady: per (token, k) the next step using the id
    for l in range(L):
        if not moe[l]:
            continue
        S = slots[l]
        slot_exp = np.full(S, -1, np.int64)
        slot_rec = np.zeros(S, np.int64)
        slot_pf = np.zeros(S, np.bool_)
        slot_pin = np.zeros(S, np.bool_)
        where[:] = -1
        lfu[:] = 0
        tokmark[:] = -1
        predmark[:] = -1
        nextuse[:] = _NEVER
        touch = 0
        hits = misses = prefetches = pf_hits = wasted = 0
        if policy == _BELADY:
            last[:] = _NEVER
            for st in range(n_steps - 1, -1, -1):
                for t in range(starts[st], starts[st + 1]):
                    for k in range(K):
                        e = ids[l, t, k]
                        if e >= 0:
                            nu[t, k] = last[e]
                for t in range(starts[st], starts[st + 1]):
                    for k in range(K):
                        e = ids[l, t, k]
                        if e >= 0:
                            last[e] = st
        if policy == _PINNED:
            n_pin = 0
            for i in range(pinned.shape[1]):
                e = pinned[l, i]
                if e < 0:
                    continue
                slot_exp[n_pin] = e
                slot_pin[n_pin] = True
                where[e] = n_pin
                touch += 1
                slot_rec[n_pin] = touch
                n_pin += 1
        for st in range(n_steps):
            t0 = starts[st]
            t1 = starts[st + 1]
            # 1. prefetch the predicted experts
            if policy == _PREDICT:
                n_pred = 0
                for t in range(t0, t1):
                    for k in range(Kp):
                        e = pred[l, t, k]
                        if e >= 0 and predmark[e] != st:
                            predmark[e] = st
                            plist[n_pred] = e
                            n_pred += 1
                _sort_head(plist, n_pred)
                for i in range(min(n_pred, S)):
                    e = plist[i]
                    if where[e] >= 0:
                        continue
                    s = _victim(policy, S, slot_exp, slot_rec, slot_pin, lfu, nextuse, predmark, st, True)
                    if s < 0:
                        break
                    wasted += _assign(s, e, True, slot_exp, slot_pf, where)
                    touch += 1
                    slot_rec[s] = touch
                    prefetches += 1
            # the step's needed experts and their uses
            n_need = 0
            for t in range(t0, t1):
                for k in range(K):
                    e = ids[l, t, k]
                    if e < 0 or tokmark[e] == t:
                        continue
                    tokmark[e] = t
                    if cnt[e] == 0:
                        need[n_need] = e
                        n_need += 1
                    cnt[e] += 1
                    if policy == _BELADY:
                        nu_step[e] = nu[t, k]
            _sort_head(need, n_need)
            if policy == _LFU and (st + 1) % half_life == 0:
                for e in range(E):
                    lfu[e] >>= 1
            # 2. hits
            for i in range(n_need):
                e = need[i]
                s = where[e]
                miss[i] = s < 0
                if s < 0:
                    continue
                hits += cnt[e]
                if slot_pf[s]:
                    pf_hits += 1
                    slot_pf[s] = False
                touch += 1
                slot_rec[s] = touch
                lfu[e] += cnt[e]
                nextuse[e] = nu_step[e]
            # 3. misses
            for i in range(n_need):
                e = need[i]
                if miss[i]:
                    s = _victim(policy, S, slot_exp, slot_rec, slot_pin, lfu, nextuse, predmark, -2, False)
                    wasted += _assign(s, e, False, slot_exp, slot_pf, where)
                    misses += 1
                    hits += cnt[e] - 1
                    touch += 1
                    slot_rec[s] = touch
                    lfu[e] += cnt[e]
                    nextuse[e] = nu_step[e]
                cnt[e] = 0
        out[l, 0] = hits
        out[l, 1] = misses
        out[l, 2] = prefetches
        out[l, 3] = pf_hits
        out[l, 4] = wasted


_compiled = False


def _compile() -> None:
    """Run the kernel once on a tiny input, so no timed call includes compilation."""
    global _compiled
    if _compiled:
        return
    ids = np.zeros((1, 1, 1), np.int32)
    _run(ids, np.full((1, 1, 1), -1, np.int32), np.ones(1, np.bool_), np.ones(1, np.int64),
         np.array([0, 1], np.int64), _LRU, np.full((1, 1), -1, np.int32), 128, 1,
         np.zeros((1, 5), np.int64))
    _compiled = True


# --------------------------------------------------------------------------- inputs

@dataclass
class _Inputs:
    """simulate()'s arguments, checked and in the kernel's dtypes."""

    ids: np.ndarray        # [L, T, K] int32, -1 in dense layers
    pred: np.ndarray       # [L, T, Kp] int32 (Kp = 1, all -1, without predictions)
    moe: np.ndarray        # [L] bool
    slots: np.ndarray      # [L] int64
    starts: np.ndarray     # [n_steps + 1] int64: token offsets of the steps
    policy: str
    pinned: np.ndarray     # [L, P] int32 (P = 1, all -1, unless "pinned")
    half_life: int
    n_experts: int


def _int_array(x: Any, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype == bool or not (np.issubdtype(a.dtype, np.integer) or
                               (a.size and np.all(np.mod(a, 1) == 0))):
        raise ValueError(f"{name} must hold whole numbers, got {x!r}")
    return a.astype(np.int64)


def _counts(ids: np.ndarray, E: int) -> np.ndarray:
    """[L, E] tokens that use each expert (each token's distinct ids, -1 ignored)."""
    L, T, K = ids.shape
    out = np.zeros((L, E), np.int64)
    for l in range(L):
        seen = np.zeros((T, E), bool)
        rows, ks = np.nonzero(ids[l] >= 0)
        seen[rows, ids[l][rows, ks]] = True
        out[l] = seen.sum(axis=0)
    return out


def hot_experts(trace, n, *, n_experts: int | None = None) -> np.ndarray:
    """[L, max n] int32: per layer the ``n`` (int, or [L]) experts used by the most tokens of
    the trace, most used first (ties to the lower id), -1 padded; experts the layer never
    uses are not listed, nor are any in dense layers. The default pinned sets of
    :func:`simulate` (``n = S // 2``); give a row to ``Engine.pin_experts`` to pin the same."""
    ids, moe, E = _routing(trace, n_experts)
    L = ids.shape[0]
    want = np.broadcast_to(_int_array(n, "n"), (L,))
    if np.any(want < 0):
        raise ValueError(f"n must be >= 0, got {n!r}")
    uses = _counts(ids, E)
    out = np.full((L, max(int(want.max(initial=0)), 1)), -1, np.int32)
    for l in range(L):
        if not moe[l]:
            continue
        order = np.lexsort((np.arange(E), -uses[l]))
        top = [int(e) for e in order[: want[l]] if uses[l, e] > 0]
        out[l, : len(top)] = top
    return out


def _routing(trace, n_experts: int | None = None, layer_is_moe=None):
    """(ids [L, T, K] int32 with -1 in dense layers, moe [L] bool, E) of a Trace or array."""
    if hasattr(trace, "topk_ids"):
        ids = np.array(trace.topk_ids, dtype=np.int64)
        moe = np.asarray(trace.layer_is_moe if layer_is_moe is None else layer_is_moe, bool)
        E = int(trace.n_experts if n_experts is None else n_experts)
    else:
        ids = np.array(trace, dtype=np.int64)
        if ids.ndim != 3:
            raise ValueError(f"a routing array must be [L, T, K], got shape {ids.shape}")
        moe = (np.ones(ids.shape[0], bool) if layer_is_moe is None
               else np.asarray(layer_is_moe, bool))
        E = int(ids.max(initial=-1)) + 1 if n_experts is None else int(n_experts)
    if ids.ndim != 3:
        raise ValueError(f"topk_ids must be [L, T, K], got shape {ids.shape}")
    if moe.shape != (ids.shape[0],):
        raise ValueError(f"layer_is_moe has shape {moe.shape}, expected ({ids.shape[0]},)")
    E = max(E, 1)
    ids[~moe] = -1
    if ids.size and ids.max() >= E:
        raise ValueError(f"expert id {int(ids.max())} out of range for {E} experts")
    ids[ids < 0] = -1
    return np.ascontiguousarray(ids, np.int32), moe, E


def _prepare(trace, slots, policy, *, predicted=None, pinned=None, chunks=None,
             half_life: int = 128, n_experts: int | None = None, layer_is_moe=None) -> _Inputs:
    if policy not in POLICIES:
        raise ValueError(f"unknown cache policy {policy!r}; the policies are "
                         f"{', '.join(map(repr, POLICIES))}")
    if n_experts is None and not hasattr(trace, "topk_ids"):   # an array: the largest id + 1
        n_experts = 1 + max(int(np.max(a, initial=-1)) for a in (trace, predicted, pinned)
                            if a is not None)
    ids, moe, E = _routing(trace, n_experts, layer_is_moe)
    L, T, K = ids.shape
    S = _int_array(slots, "slots")
    if S.shape not in ((), (L,)):
        raise ValueError(f"slots must be an int or [{L}] per-layer counts, got shape {S.shape}")
    S = np.broadcast_to(S, (L,)).copy()
    if np.any(S[moe] < 1):
        raise ValueError(f"slots must be >= 1 in every MoE layer, got {slots!r}")
    S[~moe] = np.maximum(S[~moe], 0)

    pred = np.full((L, T, 1), -1, np.int32)
    if policy == "predict":
        if predicted is None:
            predicted = getattr(trace, "predicted_ids", None)
        if predicted is None:
            raise ValueError("the 'predict' policy needs predictions, and the trace has no "
                             "predicted_ids (pass predicted= [L, T, K] expert ids)")
        p = np.array(predicted, dtype=np.int64)
        if p.ndim != 3 or p.shape[:2] != (L, T):
            raise ValueError(f"predicted must be [{L}, {T}, k], got shape {p.shape}")
        p[~moe] = -1
        p[p < 0] = -1
        if p.size and p.max() >= E:
            raise ValueError(f"predicted expert id {int(p.max())} out of range for {E} experts")
        pred = np.ascontiguousarray(p, np.int32)

    pin = np.full((L, 1), -1, np.int32)
    if policy == "pinned":
        if pinned is None:
            pin = hot_experts(ids, S // 2, n_experts=E)
        else:
            p = np.array(pinned, dtype=np.int64)
            if p.ndim != 2 or p.shape[0] != L:
                raise ValueError(f"pinned must be [{L}, P] expert ids (-1 padded), got shape {p.shape}")
            for l in np.flatnonzero(moe):
                row = p[l][p[l] >= 0]
                if row.size and row.max() >= E:
                    raise ValueError(f"pinned expert {int(row.max())} of layer {l} out of range "
                                     f"for {E} experts")
                if np.unique(row).size != row.size:
                    raise ValueError(f"layer {l} pins an expert twice: {row.tolist()}")
                if row.size >= S[l]:
                    raise ValueError(f"layer {l} pins {row.size} experts in {S[l]} slots: a pinned "
                                     f"set must leave at least one slot free")
            p[~moe] = -1
            p[p < 0] = -1
            pin = np.ascontiguousarray(p if p.shape[1] else np.full((L, 1), -1), np.int32)
    elif pinned is not None:
        raise ValueError(f"pinned= applies to the 'pinned' policy, not {policy!r}")

    if chunks is None:
        starts = np.arange(T + 1, dtype=np.int64)
    else:
        c = _int_array(chunks, "chunks").ravel()
        if np.any(c < 1) or int(c.sum()) != T:
            raise ValueError(f"chunks must be token counts >= 1 that sum to the trace's {T} "
                             f"tokens, got {c.size} chunks summing to {int(c.sum())}")
        starts = np.concatenate([[0], np.cumsum(c)]).astype(np.int64)
    if isinstance(half_life, bool) or int(half_life) != half_life or half_life < 1:
        raise ValueError(f"half_life must be a whole number of steps >= 1, got {half_life!r}")
    return _Inputs(ids=ids, pred=pred, moe=moe, slots=S, starts=starts, policy=policy,
                   pinned=pin, half_life=int(half_life), n_experts=E)


# --------------------------------------------------------------------------- results

@dataclass
class SimResult:
    """The counts of one simulation (per-layer arrays have one entry per layer; dense
    layers hold 0, or NaN in the rates)."""

    policy: str
    slots: np.ndarray               # [L] int64
    hits: np.ndarray                # [L] int64
    misses: np.ndarray              # [L] int64
    prefetches: np.ndarray          # [L] int64: experts inserted by prediction
    prefetch_hits: np.ndarray       # [L] int64
    wasted_prefetches: np.ndarray   # [L] int64: prefetched experts evicted unused
    layer_is_moe: np.ndarray        # [L] bool
    n_tokens: int
    n_steps: int
    n_experts: int
    seconds: float = 0.0            # wall time of the compiled run (0 for the reference)
    pinned: np.ndarray | None = None  # [L, P] the pinned sets ("pinned" policy)
    events: int = field(init=False)
    hit_rate: float = field(init=False)
    layer_hit_rate: np.ndarray = field(init=False)
    prefetch_accuracy: np.ndarray = field(init=False)

    def __post_init__(self):
        uses = self.hits + self.misses
        self.events = int(uses[self.layer_is_moe].sum())
        self.hit_rate = float(self.hits[self.layer_is_moe].sum() / self.events) if self.events else math.nan
        with np.errstate(invalid="ignore", divide="ignore"):
            self.layer_hit_rate = np.where(self.layer_is_moe & (uses > 0),
                                           self.hits / np.maximum(uses, 1), np.nan)
            self.prefetch_accuracy = np.where(self.prefetches > 0,
                                              self.prefetch_hits / np.maximum(self.prefetches, 1), np.nan)

    @property
    def events_per_s(self) -> float:
        """Uses simulated per second of the compiled run."""
        return self.events / self.seconds if self.seconds > 0 else math.nan

    @property
    def misses_per_token(self) -> float:
        """Experts read on demand per token, all layers together."""
        return float(self.misses.sum()) / self.n_tokens if self.n_tokens else math.nan

    @property
    def reads_per_token(self) -> float:
        """Experts read from disk per token: misses and prefetches."""
        return float(self.misses.sum() + self.prefetches.sum()) / self.n_tokens if self.n_tokens else math.nan

    @property
    def prefetch_accuracy_overall(self) -> float:
        n = int(self.prefetches.sum())
        return float(self.prefetch_hits.sum()) / n if n else math.nan

    def counts(self) -> dict[str, np.ndarray]:
        """The five per-layer counters by name (as the engine's ``expert_cache_stats``)."""
        return {k: getattr(self, k) for k in _STATS}

    def row(self) -> dict[str, Any]:
        """One line of :func:`format_table`."""
        S = self.slots[self.layer_is_moe]
        return {"policy": self.policy,
                "slots": int(S[0]) if S.size and np.all(S == S[0]) else "per layer",
                "hit_rate": self.hit_rate, "misses/token": self.misses_per_token,
                "reads/token": self.reads_per_token,
                "prefetch_acc": self.prefetch_accuracy_overall}

    def __repr__(self) -> str:
        r = self.row()
        return (f"SimResult({self.policy}, {r['slots']} slots: hit rate {self.hit_rate:.4f} over "
                f"{self.events} uses, {self.misses_per_token:.3f} misses/token)")


def _result(inp: _Inputs, out: np.ndarray, seconds: float) -> SimResult:
    out = np.asarray(out, np.int64)
    return SimResult(policy=inp.policy, slots=inp.slots.copy(),
                     **{k: out[:, i].copy() for i, k in enumerate(_STATS)},
                     layer_is_moe=inp.moe.copy(), n_tokens=int(inp.ids.shape[1]),
                     n_steps=int(inp.starts.shape[0] - 1), n_experts=inp.n_experts,
                     seconds=seconds, pinned=inp.pinned if inp.policy == "pinned" else None)


# --------------------------------------------------------------------------- simulate

def simulate(trace, slots, policy: str = "lru", *, predicted=None, pinned=None, chunks=None,
             half_life: int = 128, n_experts: int | None = None, layer_is_moe=None) -> SimResult:
    """Replay ``trace`` through an expert cache of ``slots`` slots per MoE layer (an int, or
    [L] per-layer counts) under ``policy`` (:data:`POLICIES`); see the module docstring.

    ``trace``: a :class:`~colibri_lab.runtime.trace.Trace`, or an ``[L, T, K]`` int array of expert
    ids (-1: none; then ``n_experts`` defaults to the largest id + 1 of it, ``predicted``
    and ``pinned``, and every layer counts as MoE unless ``layer_is_moe`` says otherwise).
    ``predicted`` ``[L, T, k]`` overrides ``trace.predicted_ids`` for ``"predict"``; ``pinned`` ``[L, P]`` the pinned sets for
    ``"pinned"``; ``chunks`` the token count of every step (default 1 each); ``half_life``
    the LFU halving period in steps of a layer. Raises ``ValueError`` for an unknown policy,
    a layer without a slot, ``"predict"`` without predictions and malformed arrays.
    """
    inp = _prepare(trace, slots, policy, predicted=predicted, pinned=pinned, chunks=chunks,
                   half_life=half_life, n_experts=n_experts, layer_is_moe=layer_is_moe)
    _compile()
    out = np.zeros((inp.ids.shape[0], 5), np.int64)
    t = time.perf_counter()
    _run(inp.ids, inp.pred, inp.moe, inp.slots, inp.starts, POLICIES.index(policy), inp.pinned,
         inp.half_life, inp.n_experts, out)
    return _result(inp, out, time.perf_counter() - t)


def sweep(trace, slots_list: Sequence, policies: Sequence[str] | None = None,
          **kw) -> list[SimResult]:
    """:func:`simulate` for every policy and every entry of ``slots_list`` (policy-major
    order). ``policies`` defaults to all of :data:`POLICIES`, less ``"predict"`` when the
    trace has no ``predicted_ids`` and no ``predicted=`` is given; keyword arguments go to
    every call (``pinned=`` only to the ``"pinned"`` ones)."""
    if policies is None:
        has_pred = kw.get("predicted") is not None or getattr(trace, "predicted_ids", None) is not None
        policies = tuple(p for p in POLICIES if p != "predict" or has_pred)
    out = []
    for pol in policies:
        args = dict(kw)
        if pol != "pinned":
            args.pop("pinned", None)
        if pol != "predict":
            args.pop("predicted", None)
        out += [simulate(trace, s, pol, **args) for s in slots_list]
    return out


def as_table(results: Sequence[SimResult]) -> dict[str, list]:
    """Columns of :meth:`SimResult.row` over ``results``: a dict of equal-length lists."""
    rows = [r.row() for r in results]
    return {k: [row[k] for row in rows] for k in (rows[0] if rows else ())}


def format_table(results: Sequence[SimResult], digits: int = 3) -> str:
    """A fixed-width text table of ``results`` (one :meth:`SimResult.row` each; NaN as '-')."""
    from .diagnostics import format_table as _fmt

    return _fmt([r.row() for r in results], digits=digits)


# --------------------------------------------------------------------------- routing structure

def predictor_accuracy(trace, predicted=None) -> np.ndarray:
    """[L] share of the used experts that were predicted: over the (token, layer) pairs that
    have a prediction (some ``predicted_ids[l, t] >= 0``), the distinct top-k experts that are
    among the token's predicted ones, divided by all its distinct top-k experts. NaN for
    layers without predictions (layer 0, dense layers) or when the trace has none."""
    ids, moe, E = _routing(trace)
    L, T, _ = ids.shape
    if predicted is None:
        predicted = getattr(trace, "predicted_ids", None)
    out = np.full(L, np.nan)
    if predicted is None:
        return out
    p = np.asarray(predicted)
    if p.ndim != 3 or p.shape[:2] != (L, T):
        raise ValueError(f"predicted must be [{L}, {T}, k], got shape {p.shape}")
    for l in np.flatnonzero(moe):
        have = (p[l] >= 0).any(axis=1)
        if not have.any():
            continue
        used = _one_hot(ids[l][have], E)
        guess = _one_hot(p[l][have], E)
        out[l] = float((used & guess).sum() / max(int(used.sum()), 1))
    return out


def _one_hot(ids: np.ndarray, E: int) -> np.ndarray:
    """[T, k] ids (-1 ignored, ids >= E ignored) -> [T, E] bool."""
    m = np.zeros((ids.shape[0], E + 1), bool)
    safe = np.where((ids >= 0) & (ids < E), ids, E)
    np.put_along_axis(m, safe, True, axis=1)
    return m[:, :E]


def coactivation(trace, layer: int) -> np.ndarray:
    """[E, E]: entry (i, j) = P(expert j is used at ``layer + 1`` | expert i is used at
    ``layer``), over the trace's tokens (row i NaN where expert i is never used); a row sums
    to K when every token has K distinct experts. Both layers must be MoE layers."""
    ids, moe, E = _routing(trace)
    L = ids.shape[0]
    if not (0 <= layer < L - 1) or not (moe[layer] and moe[layer + 1]):
        raise ValueError(f"layer {layer} and {layer + 1} must both be MoE layers of the "
                         f"{L}-layer trace")
    a = _one_hot(ids[layer], E).astype(np.int64)
    b = _one_hot(ids[layer + 1], E).astype(np.int64)
    joint = a.T @ b
    n = a.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n[:, None] > 0, joint / np.maximum(n, 1)[:, None], np.nan)


# --------------------------------------------------------------------------- speed model

def predict_tokens_per_s(result: SimResult, *, expert_bytes: float,
                         resident_bytes_per_token: float, disk_bw: float, mem_bw: float,
                         overlap: bool = False) -> float:
    """Decode tokens/s of a bandwidth model fed by ``result``'s counts.

    Per token, ``reads = (misses + prefetches) / T`` experts come from disk (a prefetch
    hides a read's latency, not its bytes; without prediction reads = misses per token):
    ``t_disk = reads * expert_bytes / disk_bw``; and ``resident_bytes_per_token`` (the dense
    weights plus the K active experts of every layer, all read from memory once per token)
    take ``t_mem = resident_bytes_per_token / mem_bw``. Returns ``1 / (t_disk + t_mem)``, or
    ``1 / max(t_disk, t_mem)`` with ``overlap=True`` (reads fully hidden behind compute,
    the best case of a prefetching engine). Bytes and bytes per second; the model ignores
    compute, latency and the disk's queue depth, so it is an upper bound for a
    bandwidth-bound decode."""
    for name, v in (("expert_bytes", expert_bytes), ("resident_bytes_per_token", resident_bytes_per_token)):
        if not v >= 0:
            raise ValueError(f"{name} must be >= 0, got {v!r}")
    for name, v in (("disk_bw", disk_bw), ("mem_bw", mem_bw)):
        if not v > 0:
            raise ValueError(f"{name} must be > 0, got {v!r}")
    reads = result.reads_per_token
    if math.isnan(reads):
        raise ValueError("the result has no tokens")
    t_disk = reads * float(expert_bytes) / float(disk_bw)
    t_mem = float(resident_bytes_per_token) / float(mem_bw)
    t = max(t_disk, t_mem) if overlap else t_disk + t_mem
    return math.inf if t == 0 else 1.0 / t


# --------------------------------------------------------------------------- reference

def _simulate_reference(trace, slots, policy: str = "lru", **kw) -> SimResult:
    """:func:`simulate` in plain Python, written from the module docstring's rules with no
    code shared with the compiled kernel (argument checks aside); slow, for the tests."""
    inp = _prepare(trace, slots, policy, **kw)
    L, T, K = inp.ids.shape
    starts = inp.starts.tolist()
    steps = [range(starts[i], starts[i + 1]) for i in range(len(starts) - 1)]
    out = np.zeros((L, 5), np.int64)
    for l in range(L):
        if not inp.moe[l]:
            continue
        S = int(inp.slots[l])
        # the step's needed experts with their uses (distinct per token)
        uses = []
        for rng in steps:
            u: dict[int, int] = {}
            for t in rng:
                for e in set(int(x) for x in inp.ids[l, t] if x >= 0):
                    u[e] = u.get(e, 0) + 1
            uses.append(u)

        def next_use(e: int, st: int) -> float:
            for j in range(st + 1, len(steps)):
                if e in uses[j]:
                    return j
            return math.inf

        expert = [None] * S       # slot -> expert
        rec = [0] * S
        pf = [False] * S
        pin = [False] * S
        freq: dict[int, int] = {}
        clock = [0]
        c = dict(hits=0, misses=0, prefetches=0, prefetch_hits=0, wasted_prefetches=0)

        def slot_of(e):
            return expert.index(e) if e in expert else None

        def touch(s, n):
            clock[0] += 1
            rec[s] = clock[0]
            freq[expert[s]] = freq.get(expert[s], 0) + n

        def place(e, protect, key):
            empty = [s for s in range(S) if expert[s] is None]
            if empty:
                return empty[0]
            cand = [s for s in range(S) if not pin[s] and expert[s] not in protect]
            return min(cand, key=key) if cand else None

        def put(s, e, prefetched):
            if expert[s] is not None and pf[s]:
                c["wasted_prefetches"] += 1
            expert[s], pf[s] = e, prefetched

        if policy == "pinned":
            for e in inp.pinned[l]:
                if e >= 0:
                    s = place(int(e), (), None)
                    expert[s], pin[s] = int(e), True
                    touch(s, 0)
        for st, rng in enumerate(steps):
            if policy == "predict":
                predicted = sorted(set(int(x) for t in rng for x in inp.pred[l, t] if x >= 0))
                for e in predicted[:S]:
                    if slot_of(e) is not None:
                        continue
                    s = place(e, set(predicted), key=lambda s: rec[s])
                    if s is None:
                        break
                    put(s, e, True)
                    touch(s, 0)
                    c["prefetches"] += 1
            if policy == "lfu" and (st + 1) % inp.half_life == 0:
                freq = {e: n // 2 for e, n in freq.items()}
            need = sorted(uses[st])
            missed = [e for e in need if slot_of(e) is None]
            for e in need:
                if e in missed:
                    continue
                s = slot_of(e)
                c["hits"] += uses[st][e]
                if pf[s]:
                    c["prefetch_hits"] += 1
                    pf[s] = False
                touch(s, uses[st][e])
            if policy == "lfu":
                key = lambda s: (freq.get(expert[s], 0), rec[s])  # noqa: E731
            elif policy == "belady":
                key = lambda s: (-next_use(expert[s], st), rec[s])  # noqa: E731
            else:
                key = lambda s: rec[s]  # noqa: E731
            for e in missed:
                s = place(e, (), key)
                put(s, e, False)
                c["misses"] += 1
                c["hits"] += uses[st][e] - 1
                touch(s, uses[st][e])
        out[l] = [c[k] for k in _STATS]
    return _result(inp, out, 0.0)
