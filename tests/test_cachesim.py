"""The expert-cache simulator (colibri_lab.analysis.cachesim): the compiled kernel against the
plain-Python reference on random traces (every policy, every cache size, exact counts), hand
cases with known answers, Belady's bound, prediction bookkeeping, the argument checks, and
traces of the real engine on the embedded tiny Mixtral, and the engine's own expert-cache
counters against the simulator on the traces it records."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from colibri_lab import cachesim as C
from colibri_lab import diagnostics as D

REPO = Path(__file__).resolve().parents[1]


def _random_ids(rng, L, T, K, E, skew=None):
    """[L, T, K] distinct experts per token; skew: Dirichlet concentration of the popularity."""
    p = None if skew is None else rng.dirichlet(np.full(E, skew))
    if T == 0:
        return np.zeros((L, 0, K), np.int64)
    return np.stack([np.stack([rng.choice(E, K, replace=False, p=p) for _ in range(T)])
                     for _ in range(L)])


def _random_chunks(rng, T, most):
    out, left = [], T
    while left:
        n = int(rng.integers(1, min(left, most) + 1))
        out.append(n)
        left -= n
    return out


def _same(a: C.SimResult, b: C.SimResult):
    for k in a.counts():
        assert np.array_equal(a.counts()[k], b.counts()[k]), (k, a.counts(), b.counts())


def _uses(ids, moe):
    """Distinct experts per (token, layer), summed per layer (0 in dense layers)."""
    return np.array([sum(len({int(e) for e in row if e >= 0}) for row in ids[l]) if moe[l] else 0
                     for l in range(ids.shape[0])])


# --------------------------------------------------------------------------- kernel == reference

@pytest.mark.parametrize("policy", C.POLICIES)
def test_compiled_equals_reference(policy):
    """Random shapes (some dense layers, -1 holes, prefill chunks on a third of the traces,
    short LFU half-lives, predictions of another width, explicit pinned sets): the compiled
    simulation's five counters equal the reference's for every S from 1 to E."""
    for seed in range(20):
        rng = np.random.default_rng(1000 * seed + C.POLICIES.index(policy))
        L, T, E = int(rng.integers(1, 4)), int(rng.integers(0, 45)), int(rng.integers(1, 10))
        K = int(rng.integers(1, E + 1))
        ids = _random_ids(rng, L, T, K, E, skew=float(rng.choice([0.3, 1.0, 5.0])))
        ids = np.where(rng.random(ids.shape) < 0.08, -1, ids)
        moe = rng.random(L) < 0.8
        kw = dict(n_experts=E, layer_is_moe=moe, half_life=int(rng.integers(1, 7)))
        if seed % 3 == 1 and T:
            kw["chunks"] = _random_chunks(rng, T, 6)
        if policy == "predict":   # random guesses of another width, or mostly right ones
            kw["predicted"] = rng.integers(-1, E, (L, T, int(rng.integers(1, 4))))
            if seed % 2:
                kw["predicted"] = np.where(rng.random(ids.shape) < 0.6, ids, rng.integers(-1, E, ids.shape))
        for S in range(1, E + 1):
            args = dict(kw)
            if policy == "pinned" and seed % 2 and S > 1:
                pins = np.full((L, S - 1), -1)
                for l in range(L):
                    n = int(rng.integers(0, S))
                    pins[l, :n] = rng.permutation(E)[:n]
                args["pinned"] = pins
            _same(C.simulate(ids, S, policy, **args), C._simulate_reference(ids, S, policy, **args))


def test_compiled_equals_reference_per_layer_slots():
    rng = np.random.default_rng(7)
    ids = _random_ids(rng, 4, 60, 2, 6, skew=0.5)
    slots = np.array([1, 3, 2, 6])
    for policy in ("lru", "lfu", "pinned", "belady"):
        got = C.simulate(ids, slots, policy)
        _same(got, C._simulate_reference(ids, slots, policy))
        for l in range(4):   # each layer is its own cache
            alone = C.simulate(ids[l:l + 1], int(slots[l]), policy, n_experts=6)
            assert got.hits[l] == alone.hits[0] and got.misses[l] == alone.misses[0]
        assert np.array_equal(got.slots, slots)


# --------------------------------------------------------------------------- hand cases

def _seq(*experts):
    """One layer, K = 1: the given expert per token."""
    return np.array(experts)[None, :, None]


def test_lru_one_slot_alternating_never_hits():
    r = C.simulate(_seq(*[0, 1] * 10), 1, "lru")
    assert (r.hits[0], r.misses[0], r.hit_rate, r.events) == (0, 20, 0.0, 20)
    r = C.simulate(_seq(*[0, 1] * 10), 2, "lru")
    assert (r.hits[0], r.misses[0]) == (18, 2)


def test_lru_lfu_belady_hand_sequence():
    """a a a b c b c b c a with 2 slots (traced in the docstring rules by hand): LRU evicts a
    at c and keeps b/c; LFU keeps the thrice-used a and thrashes b and c until their counts
    reach a's; Belady evicts a (next use last)."""
    seq = _seq(0, 0, 0, 1, 2, 1, 2, 1, 2, 0)
    assert C.simulate(seq, 2, "lru").hits[0] == 6
    lfu = C.simulate(seq, 2, "lfu", half_life=1000)
    assert (lfu.hits[0], lfu.misses[0]) == (2, 8)
    assert C.simulate(seq, 2, "belady").hits[0] == 6


def test_lfu_halving():
    """With half_life 1 every count is halved before each step's hits: a's 3 uses have decayed
    to 0 when b and c compete, so LFU turns into LRU on this sequence."""
    seq = _seq(0, 0, 0, 1, 2, 1, 2, 1, 2, 0)
    assert C.simulate(seq, 2, "lfu", half_life=1).hits[0] == C.simulate(seq, 2, "lru").hits[0]


def test_enough_slots_only_compulsory_misses():
    rng = np.random.default_rng(3)
    ids = _random_ids(rng, 3, 200, 3, 7, skew=0.7)
    distinct = [len(np.unique(ids[l])) for l in range(3)]
    for policy in ("lru", "lfu", "belady", "pinned"):
        for S in (7, 9):
            r = C.simulate(ids, S, policy)
            pinned = (r.pinned >= 0).sum(axis=1) if policy == "pinned" else 0
            assert np.array_equal(r.misses, np.array(distinct) - pinned), policy
            assert np.array_equal(r.hits + r.misses, _uses(ids, [True] * 3))


def test_pinned_hand_case():
    """Expert 0 pinned in one of 2 slots: 1 and 2 take turns in the other, 0 always hits
    (preloaded: no miss); plain LRU cycles through the three and never hits."""
    seq = _seq(0, 1, 2, 0, 1, 2, 0)
    r = C.simulate(seq, 2, "pinned", pinned=[[0]])
    assert (r.hits[0], r.misses[0]) == (3, 4)
    assert C.simulate(seq, 2, "lru").hits[0] == 0
    # the default pinned set: the S // 2 most used experts (ties to the lower id)
    r = C.simulate(seq, 4, "pinned")
    assert r.pinned[0].tolist() == [0, 1] and r.misses[0] == 1   # only 2 is ever read
    assert C.hot_experts(seq, 3).tolist() == [[0, 1, 2]]
    assert C.hot_experts(_seq(2, 2, 1, 1, 0), 2).tolist() == [[1, 2]]
    assert C.hot_experts(_seq(0, 0), 3).tolist() == [[0, -1, -1]]   # unused experts not listed


def test_chunks_count_uses_per_token():
    """A prefill chunk serves the union of its experts in one step: expert 0 used by 3 tokens
    of a chunk is 1 miss and 2 hits; with one slot, a chunk needing 0 and 1 loads both (1
    evicts 0), and the next chunk's 0 misses again."""
    r = C.simulate(_seq(0, 0, 0), 1, "lru", chunks=[3])
    assert (r.hits[0], r.misses[0], r.n_steps) == (2, 1, 1)
    r = C.simulate(_seq(0, 1, 0), 1, "lru", chunks=[2, 1])
    assert (r.hits[0], r.misses[0]) == (0, 3)
    rng = np.random.default_rng(5)
    ids = _random_ids(rng, 2, 50, 2, 5)
    _same(C.simulate(ids, 3, "lfu", chunks=[1] * 50), C.simulate(ids, 3, "lfu"))


def test_duplicate_ids_in_a_token_count_once():
    ids = np.array([[[1, 1], [1, -1], [2, 2]]])
    r = C.simulate(ids, 2, "lru")
    assert (r.hits[0], r.misses[0], r.events) == (1, 2, 3)


def test_dense_layers_are_skipped():
    rng = np.random.default_rng(2)
    ids = _random_ids(rng, 3, 40, 2, 4)
    tr = D.synthetic_trace(ids, n_experts=4, layer_is_moe=[True, False, True])
    r = C.simulate(tr, 2, "lru")
    assert r.hits[1] == r.misses[1] == 0 and math.isnan(r.layer_hit_rate[1])
    assert not np.isnan(r.layer_hit_rate[[0, 2]]).any()
    assert r.hit_rate == pytest.approx(r.hits[[0, 2]].sum() / (r.hits + r.misses)[[0, 2]].sum())
    assert r.events == 2 * 40 * 2
    _same(r, C.simulate(tr.topk_ids, 2, "lru", layer_is_moe=[True, False, True], n_experts=4))


def test_belady_bounds_demand_policies():
    """Decode steps with S >= K from an empty cache: no demand policy hits more than Belady
    (pinned: up to its P preloaded experts more, their reads are not misses)."""
    for seed in range(60):
        rng = np.random.default_rng(seed)
        E = int(rng.integers(2, 11))
        K = int(rng.integers(1, E + 1))
        ids = _random_ids(rng, 2, int(rng.integers(1, 100)), K, E, skew=0.5)
        for S in range(K, E + 1):
            best = C.simulate(ids, S, "belady").hits
            for policy in C.DEMAND_POLICIES:
                r = C.simulate(ids, S, policy, half_life=int(rng.integers(1, 30)))
                slack = (r.pinned >= 0).sum(axis=1) if policy == "pinned" else 0
                assert np.all(r.hits <= best + slack), (seed, S, policy, r.hits, best)


# --------------------------------------------------------------------------- prediction

def test_perfect_predictions_hit_every_use():
    rng = np.random.default_rng(11)
    ids = _random_ids(rng, 3, 120, 2, 8, skew=0.5)
    for S in (2, 3, 5):
        r = C.simulate(ids, S, "predict", predicted=ids)
        assert np.array_equal(r.hits, _uses(ids, [True] * 3)) and r.misses.sum() == 0
        assert np.all(r.prefetches > 0) and np.array_equal(r.prefetch_hits, r.prefetches)
        assert np.all(r.prefetch_accuracy == 1.0) and r.wasted_prefetches.sum() == 0
        assert r.hit_rate == 1.0 > C.simulate(ids, S, "belady").hit_rate


def test_wrong_predictions_are_wasted():
    """Expert 0 always used, a different unused expert predicted every step. Two slots: each
    prefetch evicts the previous unused one (wasted), 0 stays. One slot: every prefetch is
    evicted by the demand for 0, which the next prefetch evicts."""
    T = 12
    ids = np.zeros((1, T, 1), np.int64)
    pred = (np.arange(T) % 3 + 1)[None, :, None]
    r = C.simulate(ids, 2, "predict", predicted=pred)
    assert (r.hits[0], r.misses[0], r.prefetches[0], r.prefetch_hits[0], r.wasted_prefetches[0]) == \
        (T - 1, 1, T, 0, T - 1)
    assert r.prefetch_accuracy[0] == 0.0
    r = C.simulate(ids, 1, "predict", predicted=pred)
    assert (r.hits[0], r.misses[0], r.prefetches[0], r.wasted_prefetches[0]) == (0, T, T, T)


def test_prefetch_hit_later_and_prediction_limits():
    # predicted at step 0, used at step 2: still a prefetch hit (the mark lasts until used)
    r = C.simulate(_seq(0, 0, 1), 3, "predict", predicted=np.array([[[1], [-1], [-1]]]))
    assert (r.hits[0], r.misses[0], r.prefetches[0], r.prefetch_hits[0]) == (2, 1, 1, 1)
    # at most S predicted experts per step, in ascending id; resident ones count
    r = C.simulate(_seq(3), 2, "predict", predicted=np.array([[[2, 1, 0]]]))
    assert r.prefetches[0] == 2 and r.wasted_prefetches[0] == 1   # 0 and 1 in; 3 evicts 0
    # no prediction (-1): plain LRU
    rng = np.random.default_rng(4)
    ids = _random_ids(rng, 2, 80, 2, 6)
    _same(C.simulate(ids, 3, "predict", predicted=np.full(ids.shape, -1)), C.simulate(ids, 3, "lru"))


def test_predictions_from_the_trace_and_override():
    rng = np.random.default_rng(8)
    ids = _random_ids(rng, 2, 60, 2, 6)
    tr = D.synthetic_trace(ids, n_experts=6)
    good = ids.copy()
    good[0] = -1
    bad = (ids + 1) % 6
    tr.predicted_ids = good
    from_trace = C.simulate(tr, 3, "predict")
    _same(from_trace, C.simulate(ids, 3, "predict", predicted=good))
    _same(C.simulate(tr, 3, "predict", predicted=bad), C.simulate(ids, 3, "predict", predicted=bad))
    assert from_trace.prefetches[0] == 0 and np.isnan(from_trace.prefetch_accuracy[0])
    acc = C.predictor_accuracy(tr)
    assert math.isnan(acc[0]) and acc[1] == 1.0
    assert C.predictor_accuracy(tr, bad)[1] == pytest.approx(
        np.mean([len(set(ids[1, t]) & set(bad[1, t])) / 2 for t in range(60)]))


def test_predictor_accuracy_hand_case():
    ids = np.array([[[0, 1], [2, 3], [0, 2]], [[0, 1], [2, 3], [0, 2]]])
    pred = np.array([[[-1, -1]] * 3, [[1, 0], [2, -1], [-1, -1]]])
    acc = C.predictor_accuracy(ids, pred)
    assert math.isnan(acc[0]) and acc[1] == pytest.approx(3 / 4)   # the third token: no prediction
    assert np.isnan(C.predictor_accuracy(D.synthetic_trace(ids, n_experts=4))).all()


def test_coactivation_hand_case():
    ids = np.array([[[0, 1], [0, 2], [1, 2]],
                    [[2, 3], [0, 3], [3, 1]]])
    m = C.coactivation(ids, 0)
    assert m.shape == (4, 4)
    assert m[0].tolist() == [0.5, 0.0, 0.5, 1.0]      # expert 0 at tokens 0, 1
    assert m[1].tolist() == [0.0, 0.5, 0.5, 1.0]      # tokens 0, 2
    assert np.isnan(m[3]).all()                        # expert 3 never used at layer 0
    assert np.allclose(np.nansum(m, axis=1)[:3], 2.0)  # rows sum to K
    with pytest.raises(ValueError, match="MoE layers"):
        C.coactivation(ids, 1)
    with pytest.raises(ValueError, match="MoE layers"):
        C.coactivation(D.synthetic_trace(ids, n_experts=4, layer_is_moe=[True, False]), 0)


# --------------------------------------------------------------------------- results and speed model

def test_sweep_and_tables():
    rng = np.random.default_rng(9)
    ids = _random_ids(rng, 2, 50, 2, 6)
    tr = D.synthetic_trace(ids, n_experts=6)
    rows = C.sweep(tr, [1, 3, 6])                     # no predictions: predict left out
    assert [(r.policy, int(r.slots[0])) for r in rows] == \
        [(p, s) for p in ("lru", "lfu", "pinned", "belady") for s in (1, 3, 6)]
    rows = C.sweep(tr, [2], predicted=ids)
    assert [r.policy for r in rows] == list(C.POLICIES)
    table = C.as_table(rows)
    assert table["policy"] == list(C.POLICIES) and table["hit_rate"] == [r.hit_rate for r in rows]
    text = C.format_table(rows)
    assert text.splitlines()[0].split() == list(rows[0].row())
    assert len(text.splitlines()) == 2 + len(C.POLICIES)
    assert "hit rate" in repr(rows[0])


def test_predict_tokens_per_s():
    ids = np.zeros((2, 10, 1), np.int64)          # 2 layers, 10 tokens: 1 miss per layer
    r = C.simulate(ids, 1, "lru")
    assert r.misses_per_token == pytest.approx(0.2) == r.reads_per_token
    kw = dict(expert_bytes=100.0, resident_bytes_per_token=1000.0, disk_bw=10.0, mem_bw=1000.0)
    # t_disk = 0.2 * 100 / 10 = 2 s, t_mem = 1 s
    assert C.predict_tokens_per_s(r, **kw) == pytest.approx(1 / 3)
    assert C.predict_tokens_per_s(r, **kw, overlap=True) == pytest.approx(1 / 2)
    # prefetched reads cost bandwidth too: 10 steps of a wrong prediction, 1 slot
    p = C.simulate(ids[:1], 1, "predict", predicted=np.ones((1, 10, 1), np.int64), n_experts=2)
    assert p.reads_per_token == pytest.approx((p.misses.sum() + p.prefetches.sum()) / 10) == 2.0
    assert C.predict_tokens_per_s(p, **kw) == pytest.approx(1 / (2.0 * 100 / 10 + 1))
    with pytest.raises(ValueError, match="disk_bw"):
        C.predict_tokens_per_s(r, **{**kw, "disk_bw": 0})


# --------------------------------------------------------------------------- errors

def test_errors():
    ids = _seq(0, 1, 0)
    with pytest.raises(ValueError, match="'lru'.*'belady'"):
        C.simulate(ids, 2, "fifo")
    with pytest.raises(ValueError, match="slots must be >= 1"):
        C.simulate(ids, 0, "lru")
    with pytest.raises(ValueError, match="slots must be >= 1"):
        C.simulate(np.concatenate([ids, ids]), [2, 0], "lru")
    with pytest.raises(ValueError, match="whole numbers"):
        C.simulate(ids, 1.5, "lru")
    with pytest.raises(ValueError, match="no predicted_ids"):
        C.simulate(ids, 2, "predict")
    tr = D.synthetic_trace(ids, n_experts=2)
    with pytest.raises(ValueError, match="no predicted_ids"):
        C.simulate(tr, 2, "predict")
    tr.predicted_ids = None
    with pytest.raises(ValueError, match="no predicted_ids"):
        C.simulate(tr, 2, "predict")
    with pytest.raises(ValueError, match="predicted must be"):
        C.simulate(ids, 2, "predict", predicted=np.zeros((1, 2, 1)))
    with pytest.raises(ValueError, match="out of range"):
        C.simulate(ids, 2, "lru", n_experts=1)
    with pytest.raises(ValueError, match="one slot free"):
        C.simulate(ids, 2, "pinned", pinned=[[0, 1]])
    with pytest.raises(ValueError, match="twice"):
        C.simulate(ids, 3, "pinned", pinned=[[1, 1]])
    with pytest.raises(ValueError, match="'pinned' policy"):
        C.simulate(ids, 3, "lru", pinned=[[1]])
    with pytest.raises(ValueError, match="chunks"):
        C.simulate(ids, 2, "lru", chunks=[1, 1])
    with pytest.raises(ValueError, match="half_life"):
        C.simulate(ids, 2, "lfu", half_life=0)
    with pytest.raises(ValueError, match=r"\[L, T, K\]"):
        C.simulate(np.zeros((3, 2)), 2, "lru")


# --------------------------------------------------------------------------- the real engine

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import colibri_lab

    out = tmp_path_factory.mktemp("cachesim")
    return colibri_lab.convert(REPO / "data" / "tiny-mixtral", out / "tiny-f32.colibri", dtype="f32",
                               progress=False)


PROMPT = "def parse(self, text):\n    for line in text.splitlines():\n"


def test_engine_trace(tiny):
    """A generate() of the tiny Mixtral (one prefill chunk, then one forward per token),
    simulated with every policy, one step per token and with the engine's chunks."""
    from colibri_lab import Engine

    with Engine(tiny) as eng:
        n_prompt = len(eng.tokenizer.encode(PROMPT))
        with eng.trace() as tr:
            list(eng.generate(PROMPT, max_new_tokens=40, stop_at_eos=False))
    T, E, K = tr.n_tokens, tr.n_experts, tr.top_k
    assert T > n_prompt + 30
    uses = _uses(tr.topk_ids, tr.layer_is_moe)
    policies = [p for p in C.POLICIES if p != "predict" or getattr(tr, "predicted_ids", None) is not None]
    for chunks in (None, [n_prompt] + [1] * (T - n_prompt)):
        for S in range(1, E + 1):
            res = {p: C.simulate(tr, S, p, chunks=chunks) for p in policies}
            for p, r in res.items():
                assert np.array_equal(r.hits + r.misses, uses), p
                assert 0.0 <= r.hit_rate <= 1.0 and r.events == uses.sum()
                _same(r, C._simulate_reference(tr, S, p, chunks=chunks))
            if S >= E:
                distinct = [len(np.unique(tr.topk_ids[l])) for l in range(tr.n_layers)]
                assert np.array_equal(res["lru"].misses, distinct)
            if S >= K and chunks is None:
                for p in ("lru", "lfu"):
                    assert np.all(res[p].hits <= res["belady"].hits), (S, p)


def test_engine_cache_counters_match(tiny):
    """The engine's own expert cache, fed one token per forward, counts what the simulator
    predicts on the trace it records: the same five counters in every layer."""
    from colibri_lab import Engine

    with Engine(tiny) as eng:
        ids = eng.tokenizer.encode(PROMPT * 3)
    for policy in ("lru", "lfu", "pinned", "predict"):
        with Engine(tiny, expert_cache_mb=2, expert_cache_policy=policy) as eng:
            S = eng.config.expert_cache_slots
            assert S >= 1
            pins = None
            if policy == "pinned" and S > 1:
                with Engine(tiny) as plain, plain.trace() as warm:
                    plain.forward(ids)
                pins = C.hot_experts(warm, S // 2)
                for l in warm.moe_layers:
                    eng.pin_experts(int(l), [int(e) for e in pins[l] if e >= 0])
            with eng.trace() as tr:
                for i, t in enumerate(ids):
                    eng.forward([t], start_pos=i)
        sim = C.simulate(tr, S, policy, pinned=pins)
        assert np.array_equal(tr.cache_hits, sim.hits), policy
        assert np.array_equal(tr.cache_misses, sim.misses), policy
        if policy == "predict":
            assert np.array_equal(tr.cache_prefetches, sim.prefetches)
            assert np.array_equal(tr.cache_prefetch_hits, sim.prefetch_hits)
            assert np.array_equal(tr.cache_wasted_prefetches, sim.wasted_prefetches)


def test_engine_cache_counters_match_prefill(tiny):
    """The same for a prompt run as one forward: the cache serves the chunk's union of experts
    in one step per layer (simulate(..., chunks=[n]))."""
    from colibri_lab import Engine

    for policy in ("lru", "predict"):
        with Engine(tiny, expert_cache_mb=2, expert_cache_policy=policy) as eng:
            ids = eng.tokenizer.encode(PROMPT * 3)
            assert len(ids) <= eng.config.max_batch
            with eng.trace() as tr:
                eng.forward(ids)
                eng.forward(ids[:5], start_pos=len(ids))
            sim = C.simulate(tr, eng.config.expert_cache_slots, policy, chunks=[len(ids), 5])
        for k, v in sim.counts().items():
            assert np.array_equal(getattr(tr, "cache_" + k), v), (policy, k)
