"""The routing explorer (colibri_lab.analysis.widgets) headless: built on a real engine, its
controls set from Python change the figures' data, Run re-traces the new prompt, and an
error lands in the status line instead of raising."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("anywidget")   # plotly's FigureWidget needs it

import colibri_lab  # noqa: E402
from colibri_lab import widgets as W  # noqa: E402


@pytest.fixture
def engine(make_model):
    _, path = make_model()
    with colibri_lab.Engine(path) as eng:
        yield eng


def test_explorer_runs_and_reacts(engine):
    prompt = "for i in range(10):\n    print(i)\n"
    ex = W.explorer(engine, prompt=prompt)
    ids = engine.tokenizer.encode(prompt)
    tr = ex.trace
    assert tr is not None and tr.token_ids.tolist() == ids
    assert len(ex.token.options) == len(ids)
    assert "Trace(" in ex.status.value
    z_all = np.asarray(ex.heatmap.data[0].z)
    assert z_all.shape == (engine.config.n_layers, len(ids))
    assert np.array_equal(z_all, tr.topk_ids[:, :, 0])

    # layer control: the heatmap becomes that layer's token x expert router probs
    ex.layer.value = 1
    z1 = np.asarray(ex.heatmap.data[0].z)
    assert z1.shape == (engine.config.n_experts, len(ids))
    assert np.allclose(z1, tr.router_probs[1].T)
    assert "layer 1" in ex.load.layout.title.text and len(ex.load.data) == 1
    assert np.allclose(ex.probs.data[0].y, tr.router_probs[1, 0])

    # token control: the selected token's probabilities and the highlight follow
    ex.token.value = 3
    assert np.allclose(ex.probs.data[0].y, tr.router_probs[1, 3])
    assert ex.heatmap.layout.shapes[0].x0 == pytest.approx(2.5)
    ex.layer.value = W.ALL_LAYERS
    assert np.asarray(ex.probs.data[0].z).shape == (engine.config.n_layers,
                                                    engine.config.n_experts)
    assert np.array_equal(np.asarray(ex.heatmap.data[0].z), z_all)

    # Run with another prompt: a new trace, new token list, redrawn heatmap
    ex.prompt.value = "x = 1"
    ex.run_button.click()
    ids2 = engine.tokenizer.encode("x = 1")
    assert ex.trace is not tr and ex.trace.token_ids.tolist() == ids2
    assert [v for _, v in ex.token.options] == list(range(len(ids2)))
    assert np.asarray(ex.heatmap.data[0].z).shape == (engine.config.n_layers, len(ids2))


def test_explorer_heatmap_key_and_click(engine):
    from plotly.callbacks import InputDeviceState, Points

    ex = W.explorer(engine, prompt="def add(a, b):\n    return a + b\n")
    E = engine.config.n_experts
    hm = ex.heatmap.data[0]
    assert hm.type == "heatmap" and hm.showscale is False
    key = [t.name for t in ex.heatmap.data[1:] if t.showlegend]
    assert key == [f"e{e}" for e in range(E)] and ex.heatmap.layout.showlegend
    # a click on a cell of the heatmap (trace 0) selects that token
    hm._dispatch_on_click(Points(point_inds=[[0, 4]], xs=[4], ys=[0], trace_index=0),
                          InputDeviceState())
    assert ex.token.value == 4
    assert ex.heatmap.layout.shapes[0].x0 == pytest.approx(3.5)
    # the layer view has no key; back on all layers the key returns, the click still works
    ex.layer.value = 0
    assert not ex.heatmap.layout.showlegend and len(ex.heatmap.data) == 2
    ex.layer.value = W.ALL_LAYERS
    assert [t.name for t in ex.heatmap.data[1:]] == key
    ex.heatmap.data[0]._dispatch_on_click(Points(xs=[2], ys=[1], trace_index=0),
                                          InputDeviceState())
    assert ex.token.value == 2


def test_explorer_generates_and_reports_errors(engine):
    ex = W.explorer(engine, prompt="def f(x):", max_new_tokens=3)
    n = len(engine.tokenizer.encode("def f(x):"))
    # the prompt, then 2 decode steps (the 3rd token is sampled, never fed back)
    assert ex.trace.n_tokens == n + 2 and ex.trace.n_forwards == 3
    before = ex.trace
    engine.close()
    assert ex.run() is None
    assert "error" in ex.status.value and "closed" in ex.status.value
    assert ex.trace is before
