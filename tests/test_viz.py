"""Figures of colibri_lab.analysis.viz: each builds from synthetic traces (fast, exact) and from real
engine traces (a Mixtral with the real tokenizer, a Qwen2-MoE with a dense layer and a
gated shared expert); hover texts carry the token pieces; dense layers are marked; the
padding waste shown equals a hand count; the header hex view equals the file's bytes and
the field layout of docs/format.md."""

from __future__ import annotations

import re

import numpy as np
import plotly.graph_objects as go
import pytest

from colibri_lab import diagnostics as D
from colibri_lab.format import spec as fmt
from colibri_lab import viz
from colibri_lab.runtime.trace import STAGES

TEXTS = ["<s>", "▁def", "▁foo", "(", "x", "):", "<0x0A>", "▁▁▁", "▁return", "▁x"]


@pytest.fixture
def synth():
    """4 layers (layer 1 dense), 10 tokens, 6 experts, top-2, group_pad 4, timings."""
    rng = np.random.default_rng(7)
    L, T, E, K = 4, len(TEXTS), 6, 2
    ids = np.argsort(rng.random((L, T, E)), axis=2)[:, :, :K]
    timings = rng.integers(1_000, 50_000, size=(L, len(STAGES)))
    gate = rng.random((L, T)).astype(np.float32)
    gate[1] = np.nan
    tr = D.synthetic_trace(ids, n_experts=E, layer_is_moe=[True, False, True, True],
                           token_texts=TEXTS, group_pad=4, timings_ns=timings, shared_gate=gate)
    tr.embedding_ns, tr.lm_head_ns = 3_000, 70_000
    return tr


def _hover_strings(fig: go.Figure) -> list[str]:
    out = []
    for t in fig.data:
        text = getattr(t, "text", None)
        if text is None:
            continue
        arr = np.asarray(text, dtype=object).ravel()
        out.extend(str(x) for x in arr)
    return out


def _key(fig: go.Figure) -> list[tuple[str, str]]:
    """The routing heatmap's colour key: (label, colour) of each legend entry, in order."""
    return [(t.name, t.marker.color) for t in fig.data[1:] if t.showlegend]


def _cell_colour(hm, value: float) -> str:
    """The colour a heatmap with a banded (discrete) colour scale paints ``value`` with."""
    pos = (value - hm.zmin) / (hm.zmax - hm.zmin)
    stops = [(float(p), c) for p, c in hm.colorscale]
    for (p0, c0), (p1, c1) in zip(stops, stops[1:]):
        if p0 < pos < p1:
            assert c0 == c1, "value on a gradient, not in a band"
            return c0
    raise AssertionError(f"value {value} at a band edge ({pos})")


def _trace_with(n_experts: int, dense: bool, L: int = 4, T: int = 40, K: int = 2, seed: int = 3):
    """A synthetic trace that routes to every one of ``n_experts`` (layer 1 dense if asked)."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((L, T, n_experts)), axis=2)[:, :, :K]
    ids[0, :, 0] = np.arange(T) % n_experts            # rank 0 of layers 0, 2 and 3: all ids
    ids[2, :, 0] = (np.arange(T) + T) % n_experts
    ids[3, :, 0] = (np.arange(T) + 2 * T) % n_experts
    ids[:, :, 1] = np.where(ids[:, :, 1] == ids[:, :, 0], (ids[:, :, 0] + 1) % n_experts,
                            ids[:, :, 1])
    moe = [l != 1 or not dense for l in range(L)]
    return D.synthetic_trace(ids, n_experts=n_experts, layer_is_moe=moe,
                             token_texts=[f"t{t}" for t in range(T)])


# --------------------------------------------------------------------------- synthetic

def test_every_figure_builds(synth):
    figs = [viz.routing_heatmap(synth), viz.routing_heatmap(synth, slot=1),
            viz.routing_heatmap(synth, layer=0), viz.routing_heatmap(synth, layer=1),
            viz.expert_load(synth), viz.expert_load(synth, layer=2),
            viz.group_size_histogram(synth), viz.stage_timings(synth), viz.shared_gate(synth),
            viz.token_router_probs(synth, 3), viz.token_router_probs(synth, 3, layer=2)]
    for f in figs:
        assert isinstance(f, go.Figure)
        f.to_json()    # serialisable, as a notebook output is
    with pytest.raises(ValueError, match="slot"):
        viz.routing_heatmap(synth, slot=2)
    with pytest.raises(ValueError, match="layer 9"):
        viz.routing_heatmap(synth, layer=9)


def test_heatmap_hover_has_token_texts_and_topk(synth):
    fig = viz.routing_heatmap(synth)
    hm = fig.data[0]
    z = np.asarray(hm.z)
    assert z.shape == (4, len(TEXTS))
    hover = np.asarray(hm.text, dtype=object)
    for t, piece in enumerate(TEXTS):
        shown = repr(piece).replace("<", "&lt;").replace(">", "&gt;")
        assert shown in hover[0, t]
        ids, w = synth.topk_ids[0, t], synth.topk_weights[0, t]
        assert f"e{ids[0]} ({w[0]:.3f}), e{ids[1]} ({w[1]:.3f})" in hover[0, t]
    assert np.array_equal(z[0], synth.topk_ids[0, :, 0])
    assert np.array_equal(np.asarray(viz.routing_heatmap(synth, slot=1).data[0].z)[2],
                          synth.topk_ids[2, :, 1])
    ticks = list(fig.layout.xaxis.ticktext)
    assert "▁def" in ticks and "&lt;s&gt;" in ticks


def test_dense_layers_are_marked(synth):
    fig = viz.routing_heatmap(synth)
    hm = fig.data[0]
    z = np.asarray(hm.z)
    assert (z[1] == -1).all() and (z[[0, 2, 3]] >= 0).all()
    assert list(fig.layout.yaxis.ticktext)[1] == "layer 1 (dense)"
    assert _key(fig)[0] == ("dense", viz.DENSE_COLOUR)        # the key names the grey
    assert hm.colorscale[0][1] == viz.DENSE_COLOUR           # the band of value -1 is grey
    assert all("dense MLP" in h for h in np.asarray(hm.text, dtype=object)[1])
    # one colour per expert in the other bands
    bands = {c for _, c in hm.colorscale[2:]}
    assert len(bands) == synth.n_experts
    dense_layer = viz.routing_heatmap(synth, layer=1)
    assert "dense" in dense_layer.layout.annotations[0].text
    load = viz.expert_load(synth)
    assert [t.name for t in load.data] == ["layer 0", "layer 2", "layer 3"]
    assert any("dense layers" in a.text and "1" in a.text for a in load.layout.annotations)
    assert "(dense)" in " ".join(viz.stage_timings(synth).data[1].x)


@pytest.mark.parametrize("n_experts", [6, 8, 64, 128])
@pytest.mark.parametrize("dense", [True, False])
def test_heatmap_key_names_every_expert_once(n_experts, dense):
    import json

    tr = _trace_with(n_experts, dense)
    fig = viz.routing_heatmap(tr)
    assert fig.data[0].type == "heatmap"               # first: the explorer's click target
    want = (["dense"] if dense else []) + [f"e{e}" for e in range(n_experts)]
    labels = [label for label, _ in _key(fig)]
    assert labels == want                              # each expert named once, in order
    assert len(set(labels)) == len(labels)
    # the serialised figure (what a notebook shows) carries the key and no colour bar
    js = json.loads(fig.to_json())
    assert [t["name"] for t in js["data"][1:] if t.get("showlegend")] == want
    assert js["layout"]["showlegend"] is True
    assert js["data"][0]["showscale"] is False
    # "expert" is said once (the key's title), not again on every label
    title = fig.layout.legend.title.text
    assert title.count("expert") == 1 and "rank 1" in title
    assert not any("expert" in label for label in labels)
    # the key's entries draw nothing and toggle nothing
    for t in fig.data[1:]:
        assert t.type == "scatter" and list(t.x) == [None] and t.hoverinfo == "skip"
    assert fig.layout.legend.itemclick is False and fig.layout.legend.itemdoubleclick is False


@pytest.mark.parametrize("n_experts", [8, 64, 128])
@pytest.mark.parametrize("slot", [0, 1])
def test_heatmap_key_colours_are_the_cells_colours(n_experts, slot):
    tr = _trace_with(n_experts, dense=True)
    fig = viz.routing_heatmap(tr, slot=slot)
    hm = fig.data[0]
    key = dict(_key(fig))
    assert len(set(key.values())) == len(key)          # no two entries share a colour
    assert key["dense"] == viz.DENSE_COLOUR
    assert [key[f"e{e}"] for e in range(n_experts)] == viz.expert_colours(n_experts)
    # every cell is painted with its key entry's colour
    z = np.asarray(hm.z)
    for value in np.unique(z):
        label = "dense" if value == -1 else f"e{int(value)}"
        assert _cell_colour(hm, value) == key[label], label
    assert _cell_colour(hm, -1) == viz.DENSE_COLOUR
    for l, t in [(0, 0), (2, 5), (3, 39)]:
        e = int(tr.topk_ids[l, t, slot])
        assert int(z[l, t]) == e and _cell_colour(hm, e) == key[f"e{e}"]
        assert f"expert at rank {slot + 1}: e{e}<br>" in np.asarray(hm.text, dtype=object)[l, t]


def test_heatmap_key_layout():
    # a few experts: one flow of entries; more: columns of a round length, "dense" alone
    few = viz.routing_heatmap(_trace_with(8, dense=True))
    assert all(t.legendgroup in (None, "") for t in few.data[1:])
    assert few.layout.legend.orientation == "h"
    for n_experts, per_col in [(64, 10), (128, 16)]:
        fig = viz.routing_heatmap(_trace_with(n_experts, dense=n_experts == 64))
        groups = {}
        for t in fig.data[1:]:
            groups.setdefault(t.legendgroup, []).append(t.name)
        cols = [g for name, g in groups.items() if name != "dense"]
        assert all(g[0] == f"e{i * per_col}" and len(g) <= per_col for i, g in enumerate(cols))
        assert [name for g in cols for name in g] == [f"e{e}" for e in range(n_experts)]
        assert len(cols) == -(-n_experts // per_col)
        assert groups.get("dense", ["dense"]) == ["dense"]                # a column alone
        assert ("dense" in groups) == (n_experts == 64)
        # the key sits in room of its own under the token axis: the figure grows with it
        assert fig.layout.legend.yref == "container" and fig.layout.legend.y == 0
        assert fig.layout.height >= 260 + per_col * 19
        assert fig.layout.legend.font.size == 10
    assert few.layout.height < viz.routing_heatmap(_trace_with(64, dense=True)).layout.height


def test_expert_colours_stay_distinct():
    def rgb(h):
        return np.array([int(h[i:i + 2], 16) for i in (1, 3, 5)], dtype=float)

    for n in (8, 24, 25, 64, 128, 256):
        cols = viz.expert_colours(n)
        assert len(cols) == n and len(set(cols)) == n and viz.DENSE_COLOUR not in cols
        assert all(re.fullmatch(r"#[0-9a-fA-F]{6}", c) for c in cols)
        if n > 24:   # colour families: consecutive ids differ in shade, or in hue
            steps = [np.abs(rgb(a) - rgb(b)).sum() for a, b in zip(cols, cols[1:])]
            assert min(steps) > 60, n
        grey = rgb(viz.DENSE_COLOUR)
        assert min(np.abs(rgb(c) - grey).sum() for c in cols) > 40


def test_layer_view_has_no_expert_key(synth):
    fig = viz.routing_heatmap(synth, layer=2)
    assert fig.layout.showlegend is False and len(fig.data) == 2
    assert fig.data[0].colorbar.title.text == "p(expert)"


def test_layer_heatmap_is_the_router_probs(synth):
    fig = viz.routing_heatmap(synth, layer=2)
    assert np.allclose(np.asarray(fig.data[0].z), synth.router_probs[2].T)
    marks = fig.data[1]
    got = sorted(zip(marks.x, marks.y))
    want = sorted((t, int(e)) for t in range(synth.n_tokens) for e in synth.topk_ids[2, t])
    assert got == want
    assert any("▁return" in h for h in _hover_strings(fig))


def test_expert_load_shares(synth):
    fig = viz.expert_load(synth)
    for tr_ in fig.data:
        l = int(tr_.name.split()[1])
        want = synth.group_sizes[l] / synth.group_sizes[l].sum()
        assert np.allclose(tr_.y, want) and abs(sum(tr_.y) - 1) < 1e-12
    line = [s for s in fig.layout.shapes if s.type == "line"]
    assert line and line[0].y0 == pytest.approx(1 / synth.n_experts)


def test_padding_waste_equals_hand_count():
    # layer 0: expert rows 3, 1, 0, 4 -> padded 4, 4, 0, 4 (4 padding rows of 12)
    # layer 1: 2, 2, 2, 2 -> 4 each (8 padding rows of 16)
    ids = [[[0, 1], [0, 3], [0, 3], [3, 3]], [[0, 1], [2, 3], [0, 1], [2, 3]]]
    tr = D.synthetic_trace(np.asarray(ids), n_experts=4, group_pad=4,
                           token_texts=["a", "b", "c", "d"])
    fig = viz.group_size_histogram(tr)
    bars = [t for t in fig.data if t.type == "bar"]
    real, waste = bars
    assert list(real.y) == [8, 8]
    assert list(waste.y) == [4, 8] and list(waste.base) == [8, 8]
    assert list(waste.text) == ["33.3 %", "50.0 %"]
    assert "12 padding rows = 42.9 % of 28 grouped rows" in fig.layout.title.text
    heat = next(t for t in fig.data if t.type == "heatmap")
    assert np.asarray(heat.z).tolist() == [[3, 1, 0, 4], [2, 2, 2, 2]]
    assert np.asarray(heat.customdata)[0, :, 1].tolist() == [1, 3, 0, 0]    # padding rows
    hist = [t for t in fig.data if t.type == "histogram"]
    assert sorted(hist[0].x) == sorted([3, 1, 0, 4, 2, 2, 2, 2])
    assert sorted(hist[1].x) == sorted([4, 4, 0, 4, 4, 4, 4, 4])


def test_stage_timings_add_up(synth):
    fig = viz.stage_timings(synth)
    unit = fig.layout.yaxis.title.text
    div = {"µs": 1e3, "ms": 1e6}[unit]
    total = sum(v for t in fig.data for v in t.y if v is not None)
    assert total * div == pytest.approx(sum(synth.stage_totals().values()))
    assert [t.name for t in fig.data] == ["embedding", *STAGES, "lm_head"]


def test_shared_gate(synth):
    fig = viz.shared_gate(synth)
    z = np.asarray(fig.data[0].z, dtype=float)
    assert np.allclose(z[0], synth.shared_gate[0]) and np.isnan(z[1]).all()
    synth.shared_gate[:] = np.nan
    none = viz.shared_gate(synth)
    assert "no gated shared expert" in none.layout.annotations[0].text
    synth.shared_gate[:] = 1.0
    assert "without a gate" in viz.shared_gate(synth).layout.annotations[0].text


# --------------------------------------------------------------------------- format map

def _doc_header_offsets(repo_root) -> dict[str, int]:
    """Offset of every top-level header field in docs/format.md's header table."""
    text = (repo_root / "docs" / "format.md").read_text()
    table = text.split("## Header (256 bytes at offset 0)")[1].split("Each `section` entry")[0]
    out = {}
    for m in re.finditer(r"^\| (\d+) \| [^|]+ \| `?([a-z_0-9]+)`? \|", table, re.M):
        out[m.group(2)] = int(m.group(1))
    return out


def test_header_layout_matches_the_spec(repo_root):
    doc = _doc_header_offsets(repo_root)
    assert len(doc) >= 14
    ours = {name: off for off, _, name, _ in fmt.HEADER_LAYOUT}
    for name, off in doc.items():
        if name == "sections":
            assert ours["sections.metadata.offset"] == off
        else:
            assert ours[name] == off, name
    ends = [off + size for off, size, _, _ in fmt.HEADER_LAYOUT]
    starts = [off for off, _, _, _ in fmt.HEADER_LAYOUT]
    assert starts[0] == 0 and starts[1:] == ends[:-1] and ends[-1] == fmt.HEADER_SIZE


def test_format_map_hex_view(make_model):
    from colibri_lab import inspect

    _, path = make_model()
    info = inspect(path)
    raw = path.read_bytes()[: fmt.HEADER_SIZE]
    rows = viz.header_fields(info)
    assert len(rows) == len(fmt.HEADER_LAYOUT)
    for r in rows:
        b = raw[r["offset"]: r["offset"] + r["size"]]
        if r["hex"].startswith("00 ×"):
            assert not any(b)
        else:
            assert bytes.fromhex(r["hex"].replace(" ", "")) == b
    by = {r["name"]: r for r in rows}
    assert by["magic"]["hex"] == "43 4f 4c 49 42 52 49 00"
    assert by["n_experts"]["value"] == str(info.header["n_experts"])
    assert by["sections.experts.offset"]["value"] == f"{info.section('experts').offset:,}"
    assert by["header_crc32"]["value"].startswith(f"{info.header_crc32:08x} (matches")
    assert by["file_size"]["value"] == f"{info.file_size:,}"
    fig = viz.format_map(info)
    table = [t for t in fig.data if t.type == "table"][0]
    assert list(table.cells.values[2]) == [r["name"] for r in rows]
    bars = [t for t in fig.data if t.type == "bar" and t.y[0] == "file"]
    names = [b.name for b in bars if b.name != "alignment gap"]
    assert names == ["header", *fmt.SECTION_NAMES]
    # to scale: the bars tile the file exactly
    spans = sorted((b.base[0], b.base[0] + b.x[0]) for b in bars)
    assert spans[0][0] == 0 and spans[-1][1] == info.file_size
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    crc = f"{info.section('router').crc32:08x}"
    assert any(crc in b.hovertemplate for b in bars)


# --------------------------------------------------------------------------- real traces

@pytest.fixture(scope="module")
def real_traces(make_model, tmp_path_factory):
    """A Mixtral trace with real token pieces, and a Qwen2-MoE trace with a dense layer
    and a gated shared expert."""
    pytest.importorskip("torch")
    import colibri_lab
    from colibri_lab.bench.models import FamilyShape, build_model, save_checkpoint

    _, mix = make_model()
    with colibri_lab.Engine(mix) as eng:
        with eng.trace() as t_mix:
            eng.forward(eng.tokenizer.encode("def add(a, b):\n    return a + b\n"))
    shape = FamilyShape("qwen2_moe", vocab=1001, hidden=40, inter=24, dense_inter=48,
                        shared_inter=32, layers=3, heads=4, kv_heads=2, experts=6, top_k=2,
                        mlp_only_layers=(1,), seed=5)
    folder = save_checkpoint(build_model(shape), tmp_path_factory.mktemp("qwen2viz"))
    qpath = folder.parent / "qwen2viz.colibri"
    colibri_lab.convert(folder, qpath, dtype="f32", progress=False)
    with colibri_lab.Engine(qpath, group_pad=4) as eng:
        with eng.trace() as t_qwen:
            eng.forward(list(range(5, 25)))
    return t_mix, t_qwen


def test_real_traces(real_traces):
    t_mix, t_qwen = real_traces
    fig = viz.routing_heatmap(t_mix)
    hover = np.asarray(fig.data[0].text, dtype=object)
    assert "▁return" in t_mix.token_texts
    for t, piece in enumerate(t_mix.token_texts):
        assert repr(piece).replace("<", "&lt;").replace(">", "&gt;") in hover[0, t]
    assert [label for label, _ in _key(fig)] == [f"e{e}" for e in range(t_mix.n_experts)]
    q = viz.routing_heatmap(t_qwen)
    assert list(q.layout.yaxis.ticktext)[1] == "layer 1 (dense)"
    assert [label for label, _ in _key(q)] == ["dense"] + [f"e{e}" for e in range(6)]
    assert (np.asarray(q.data[0].z)[1] == -1).all()
    gate = viz.shared_gate(t_qwen)
    z = np.asarray(gate.data[0].z, dtype=float)
    assert np.isnan(z[1]).all() and ((z[[0, 2]] > 0) & (z[[0, 2]] < 1)).all()
    assert "no gated shared expert" in viz.shared_gate(t_mix).layout.annotations[0].text
    g = viz.group_size_histogram(t_qwen)
    waste = D.padding_waste(t_qwen)
    assert list(g.data[-1].y) == list(waste["waste_rows"][[0, 2]])
    assert (t_qwen.padded_group_sizes % 4 == 0).all()
    for f in (viz.stage_timings(t_qwen), viz.expert_load(t_qwen),
              viz.token_router_probs(t_mix, 2), viz.routing_heatmap(t_qwen, layer=2)):
        f.to_json()


def test_package_import_does_not_load_plotly():
    import subprocess
    import sys

    code = ("import sys, colibri_lab; assert 'plotly' not in sys.modules; "
            "colibri_lab.viz.routing_heatmap; assert 'plotly' in sys.modules; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_sink_share_and_expert_groups():
    """The gpt-oss sink-share heatmap is the per-head mean over tokens; the expert-group
    heatmap is group_selection's load; both say so when there is nothing to show."""
    rng = np.random.default_rng(3)
    shares = [rng.random((7, 5)) for _ in range(3)]
    fig = viz.sink_share(shares, windows=[4, 0, 4])
    z = np.asarray(fig.data[0].z)
    np.testing.assert_allclose(z, np.stack([s.mean(axis=0) for s in shares]))
    assert "window 4" in fig.layout.yaxis.ticktext[0] and "full" in fig.layout.yaxis.ticktext[1]
    assert "no layer" in str(viz.sink_share([]).layout.annotations[0].text)
    ids = D.select_experts(rng.random((30, 8)), 2, n_group=4, topk_group=2)
    tr = D.synthetic_trace(ids[None], n_experts=8)
    sel = D.group_selection(tr, 4)
    fig = viz.expert_groups(sel)
    np.testing.assert_allclose(np.asarray(fig.data[0].z), sel["group_load"][[0]])
    assert "groups/token" in fig.layout.yaxis.ticktext[0]
