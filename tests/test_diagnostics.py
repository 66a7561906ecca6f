"""Routing diagnostics (colibri_lab.analysis.diagnostics) on hand-computed small cases, on uniform
random routing (measures at their chance level), and on real int8-vs-float router traces
(against a plain per-token loop)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from colibri_lab import diagnostics as D


def _trace(ids, E, **kw):
    return D.synthetic_trace(np.asarray(ids), n_experts=E, **kw)


# --------------------------------------------------------------------------- agreement

def test_identical_traces_agree_fully():
    rng = np.random.default_rng(1)
    ids = np.argsort(rng.random((3, 17, 7)), axis=2)[:, :, :3]
    a = _trace(ids, 7, layer_is_moe=[True, False, True])
    r = D.router_agreement(a, _trace(ids, 7, layer_is_moe=[True, False, True]))
    assert r["overall_set_changed"] == 0.0 and r["overall_top1_agreement"] == 1.0
    assert list(r["layers"]) == [0, 2]
    assert np.isnan(r["set_changed"][1]) and np.isnan(r["top1_agreement"][1])
    assert r["set_changed"][0] == 0.0 and r["top1_agreement"][2] == 1.0
    assert r["max_prob_diff"][0] == 0.0


def test_agreement_hand_case():
    a = [[[0, 1], [2, 3], [0, 2], [1, 3]]]
    b = [[[1, 0],    # same set, other top-1
          [2, 3],    # identical
          [0, 3],    # set changed, same top-1
          [3, 1]]]   # same set, other top-1
    r = D.router_agreement(_trace(a, 4), _trace(b, 4))
    assert r["set_changed"][0] == pytest.approx(1 / 4)
    assert r["top1_agreement"][0] == pytest.approx(2 / 4)


def test_agreement_of_relabelled_experts():
    """A cyclic relabelling of the experts changes every top-k set and every top-1."""
    rng = np.random.default_rng(2)
    ids = np.argsort(rng.random((2, 40, 6)), axis=2)[:, :, :2]
    r = D.router_agreement(_trace(ids, 6), _trace((ids + 1) % 6, 6))
    assert r["overall_set_changed"] == 1.0 and r["overall_top1_agreement"] == 0.0
    # relabelling only experts 4 <-> 5: the tokens that use 4 or 5 (not both) change set
    perm = np.array([0, 1, 2, 3, 5, 4])
    r = D.router_agreement(_trace(ids, 6), _trace(perm[ids], 6))
    s = [set(x) for x in ids[0]]
    want = np.mean([(4 in x) != (5 in x) for x in s])
    assert r["set_changed"][0] == pytest.approx(want)


def test_agreement_refuses_different_tokens():
    a = _trace([[[0], [1]]], 2)
    b = _trace([[[0], [1]]], 2, token_ids=[7, 8])
    with pytest.raises(ValueError, match="same tokens"):
        D.router_agreement(a, b)


# --------------------------------------------------------------------------- load, padding

def test_load_imbalance_hand_cases():
    # layer 0: everything on expert 0; layer 1: perfectly even; layer 2 dense
    ids = [[[0], [0], [0], [0]], [[0], [1], [2], [3]], [[0], [0], [0], [0]]]
    r = D.load_imbalance(_trace(ids, 4, layer_is_moe=[True, True, False]))
    assert r["max_over_mean"][0] == pytest.approx(4.0)
    assert r["cv"][0] == pytest.approx(math.sqrt(3.0))
    assert r["entropy"][0] == pytest.approx(0.0)
    assert r["dead"][0] == 3
    assert r["max_over_mean"][1] == pytest.approx(1.0)
    assert r["cv"][1] == pytest.approx(0.0)
    assert r["entropy"][1] == pytest.approx(1.0)
    assert all(np.isnan(r[k][2]) for k in ("max_over_mean", "cv", "entropy"))


def test_padding_waste_hand_count():
    # expert rows: e0 3, e1 1, e2 0, e3 4 -> padded to 4: 4, 4, 0, 4 -> 4 padding rows of 12
    ids = [[[0, 1], [0, 3], [0, 3], [3, 3]]]
    tr = _trace(ids, 4, group_pad=4)
    assert tr.group_sizes.tolist() == [[3, 1, 0, 4]]
    w = D.padding_waste(tr)
    assert w["real_rows"].tolist() == [8] and w["padded_rows"].tolist() == [12]
    assert w["waste_rows"].tolist() == [4]
    assert w["waste_pct"][0] == pytest.approx(100 * 4 / 12)
    assert w["total_waste_pct"] == pytest.approx(100 * 4 / 12)


# --------------------------------------------------------------------------- reuse

def test_chance_share_any():
    assert D.chance_share_any(4, 2) == pytest.approx(1 - 1 / 6)
    assert D.chance_share_any(8, 1) == pytest.approx(1 / 8)
    assert D.chance_share_any(4, 3) == 1.0          # two 3-sets of 4 always meet


def test_expert_reuse_hand_case():
    # tokens 0-2 one sequence, token 3 starts another (pair 2-3 skipped)
    ids = [[[0, 1], [1, 2], [3, 2], [3, 2]],
           [[0, 1], [0, 3], [2, 1], [2, 3]]]
    tr = _trace(ids, 4, positions=[0, 1, 2, 0])
    r = D.expert_reuse(tr)
    assert r["n_pairs"] == 2
    # layer 0: {0,1}&{1,2} yes, {1,2}&{3,2} yes; layer 1: {0,1}&{0,3} yes, {0,3}&{2,1} no
    assert r["token_any"].tolist() == [1.0, 0.5]
    assert r["token_top1"].tolist() == [0.0, 0.5]
    # layers 0 -> 1 per token: |{0,1}&{0,1}|=2, |{1,2}&{0,3}|=0, |{3,2}&{2,1}|=1, |{3,2}&{2,3}|=2
    assert r["layer_overlap"][0] == pytest.approx(5 / 4 / 2)
    assert r["layer_top1"][0] == pytest.approx(1 / 4)
    assert np.isnan(r["layer_overlap"][1])
    assert r["chance_any"] == pytest.approx(5 / 6) and r["chance_top1"] == 0.25


def test_uniform_random_routing_sits_at_chance():
    E, K, T = 8, 2, 6000
    base = _trace(np.zeros((2, T, K), dtype=int) + [0, 1], E)
    rnd = D.random_routing(base, seed=3)
    r = D.expert_reuse(rnd)
    n = r["n_pairs"]
    for l in (0, 1):
        for key, p in (("token_any", r["chance_any"]), ("token_top1", r["chance_top1"])):
            assert abs(r[key][l] - p) < 5 * math.sqrt(p * (1 - p) / n), (key, l)
    imb = D.load_imbalance(rnd)
    assert imb["entropy"][0] > 0.99 and imb["max_over_mean"][0] < 1.15


# --------------------------------------------------------------------------- classes, MI

def test_token_classes():
    pieces = ["<s>", "▁def", "▁foo", "(", "x", "):", "<0x0A>", "▁▁▁", "▁return", "▁", "1",
              "▁3.14", "▁+=", "ĠClass", "Ċ", "ĊĠĠĠ", "▁é", "<0xC3>", "\t", "▁match", "_"]
    assert D.token_classes(pieces) == [
        "other", "keyword", "name", "punctuation", "name", "punctuation", "newline",
        "whitespace", "keyword", "whitespace", "number", "number", "punctuation", "name",
        "newline", "newline", "name", "other", "whitespace", "name", "name"]


def test_perfect_specialisation_gives_h_class():
    # 3 classes, each with its own pair of experts (top-2 of 6)
    rng = np.random.default_rng(4)
    classes = rng.integers(0, 3, 300)
    ids = np.stack([2 * classes, 2 * classes + 1], axis=1)[None]
    tr = _trace(ids, 6)
    names = [f"c{c}" for c in classes]
    r = D.specialisation(tr, names)
    counts = np.bincount(classes) / len(classes)
    h = float(-(counts * np.log2(counts)).sum())
    assert r["h_class_bits"] == pytest.approx(h)
    assert r["mi_bits"][0] == pytest.approx(h)
    assert r["ratio"][0] == pytest.approx(1.0)
    assert r["shuffled_bits"][0] < 0.05 * h


def test_random_routing_has_no_specialisation():
    rng = np.random.default_rng(5)
    T = 20000
    classes = [D.CLASSES[i] for i in rng.integers(0, len(D.CLASSES), T)]
    tr = D.random_routing(_trace(np.zeros((1, T, 2), dtype=int) + [0, 1], 8), seed=6)
    r = D.specialisation(tr, classes, n_shuffles=5)
    assert r["h_class_bits"] == pytest.approx(math.log2(len(D.CLASSES)), abs=0.01)
    assert r["mi_bits"][0] < 0.005 and r["ratio"][0] < 0.002
    assert abs(r["mi_bits"][0] - r["shuffled_bits"][0]) < 0.003


def test_specialisation_uses_token_texts_and_checks_lengths():
    tr = _trace([[[0], [1], [0]]], 2, token_texts=["▁def", "▁x", "▁if"])
    r = D.specialisation(tr)
    assert r["classes"] == ["keyword", "name"]
    assert r["ratio"][0] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="class labels"):
        D.specialisation(tr, ["a", "b"])
    with pytest.raises(ValueError, match="no token texts"):
        D.specialisation(_trace([[[0], [1]]], 2))


def test_summary_and_table():
    ids = [[[0, 1], [1, 2], [3, 2]], [[0, 1], [0, 1], [0, 1]]]
    tr = _trace(ids, 4, layer_is_moe=[True, False], token_texts=["▁a", "▁b", "▁c"],
                group_pad=2)
    rows = D.summary(tr)
    assert [r["kind"] for r in rows] == ["moe", "dense"]
    assert rows[0]["waste_pct"] == pytest.approx(100 * 2 / 8)      # 1,2,2,1 -> 2,2,2,2
    assert math.isnan(rows[1]["max_over_mean"])
    text = D.format_table(rows, columns=["layer", "kind", "waste_pct"])
    assert text.splitlines()[2].split() == ["0", "moe", "25.00"]
    assert text.splitlines()[3].split() == ["1", "dense", "-"]


# --------------------------------------------------------------------------- real traces

def test_int8_router_agreement_on_a_real_model(make_model, tmp_path):
    import colibri_lab

    hf_dir, f32 = make_model()
    i8 = tmp_path / "int8.colibri"
    colibri_lab.convert(hf_dir, i8, dtype="f32", quantize_router="int8", progress=False)
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    traces = []
    for path in (f32, i8):
        with colibri_lab.Engine(path) as eng:
            ids = eng.tokenizer.encode(text)
            with eng.trace() as tr:
                eng.forward(ids)
            traces.append(tr)
    a, b = traces
    r = D.router_agreement(a, b)
    # a plain loop over tokens as the reference
    for l in a.moe_layers:
        changed = [set(a.topk_ids[l, t]) != set(b.topk_ids[l, t]) for t in range(a.n_tokens)]
        same1 = [a.topk_ids[l, t, 0] == b.topk_ids[l, t, 0] for t in range(a.n_tokens)]
        assert r["set_changed"][l] == pytest.approx(np.mean(changed))
        assert r["top1_agreement"][l] == pytest.approx(np.mean(same1))
    # int8 quantisation moves probabilities a little, not a lot
    assert 0 < np.nanmax(r["max_prob_diff"]) < 0.05
    rows = D.summary(a)
    assert len(rows) == a.n_layers and all(r["kind"] == "moe" for r in rows)


# ------------------------------------------------------------------ family routing

def test_select_experts_group_limited_matches_transformers_rule():
    """select_experts against DeepSeek-V3's router written out with torch ops
    (transformers' DeepseekV3TopkRouter / get_topk_indices), biased and group-limited."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    T, E, K, G, TG = 37, 12, 3, 4, 2
    scores = rng.random((T, E)).astype(np.float32)
    bias = rng.uniform(-0.3, 0.3, E).astype(np.float32)
    s = torch.from_numpy(scores) + torch.from_numpy(bias)
    gs = s.view(T, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
    gidx = torch.topk(gs, k=TG, dim=-1, sorted=False)[1]
    gmask = torch.zeros_like(gs).scatter_(1, gidx, 1)
    smask = gmask.unsqueeze(-1).expand(T, G, E // G).reshape(T, E)
    want = torch.topk(s.masked_fill(~smask.bool(), 0.0), k=K, dim=-1, sorted=False)[1].numpy()
    got = D.select_experts(scores, K, bias=bias, n_group=G, topk_group=TG)
    assert np.array_equal(np.sort(got, axis=1), np.sort(want, axis=1))
    # every token's experts lie in at most TG groups; without groups: the plain top-k
    assert max(len(set((r // (E // G)).tolist())) for r in got) <= TG
    plain = D.select_experts(scores, K)
    assert np.array_equal(plain, np.argsort(-scores.astype(np.float64), axis=1, kind="stable")[:, :K])


def test_group_selection_and_bias_effect_on_a_synthetic_trace():
    rng = np.random.default_rng(6)
    T, E, K = 40, 8, 2
    scores = rng.random((T, E))
    bias = np.zeros((1, E))
    bias[0, 7] = 5.0   # expert 7 always wins a slot
    ids = D.select_experts(scores, K, bias=bias[0])
    tr = D.synthetic_trace(ids[None], n_experts=E)
    tr.router_probs[0] = scores.astype(np.float32)
    eff = D.correction_bias_effect(tr, bias)
    assert eff["engine_agrees"][0] == 1.0
    want = np.mean([7 not in r for r in np.argsort(-scores, axis=1)[:, :K]])
    assert eff["set_changed"][0] == pytest.approx(want) and want > 0.5
    g = D.group_selection(tr, 4)
    assert g["histogram"][0].sum() == pytest.approx(1.0)
    assert g["group_load"][0, 3] >= 0.5   # expert 7 is in the last group
    assert 1.0 <= g["groups_per_token"][0] <= 2.0
    with pytest.raises(ValueError, match="groups"):
        D.group_selection(tr, 3)
