"""An interactive routing explorer for notebooks: type a prompt, run the engine under
``engine.trace()``, and look at the routing layer by layer and token by token.

    from colibri_lab.analysis.widgets import explorer
    ex = explorer(eng, prompt="def add(a, b):\\n    return a + b\\n")
    ex                      # shows the controls and three live plotly figures

The box works headless too (tests, scripts): set ``ex.layer.value`` / ``ex.token.value``
/ ``ex.prompt.value`` and call ``ex.run()``, then read ``ex.trace`` and the figures'
``data``. Figures are ``plotly.graph_objects.FigureWidget`` (they need ``anywidget``).
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from . import viz
from ..runtime.errors import ColibriError
from ..runtime.trace import Trace

ALL_LAYERS = -1


def _replace(fw: go.FigureWidget, fig: go.Figure) -> None:
    """Make ``fw`` show ``fig`` (traces and layout), in place. A FigureWidget does not
    stretch to its cell, so it gets a width that fits a notebook cell."""
    fig.update_layout(width=860)
    with fw.batch_update():
        fw.layout = fig.layout
    fw.data = []
    fw.add_traces(list(fig.data))


class Explorer(widgets.VBox):
    """The widget of :func:`explorer`. Attributes: ``prompt`` (Textarea), ``run_button``,
    ``layer`` (Dropdown: ``ALL_LAYERS`` or a layer index), ``token`` (Dropdown of token
    indices), ``status`` (HTML), ``heatmap`` / ``load`` / ``probs`` (FigureWidgets), and
    ``trace`` (the :class:`Trace` of the last run, or None)."""

    def __init__(self, engine: Any, prompt: str = "", *, max_new_tokens: int = 0,
                 slot: int = 0, add_bos: bool = True):
        self.engine = engine
        self.max_new_tokens = int(max_new_tokens)
        self.slot = int(slot)
        self.add_bos = bool(add_bos)
        self.trace: Trace | None = None
        self._busy = False
        n_layers = engine.config.n_layers
        self.prompt = widgets.Textarea(value=prompt, description="prompt",
                                       layout=widgets.Layout(width="70%", height="4.5em"))
        self.run_button = widgets.Button(description="Run", button_style="primary",
                                         tooltip="run the engine on the prompt under trace()")
        self.layer = widgets.Dropdown(   # relabelled with "(dense)" once a trace tells
            options=[("all layers", ALL_LAYERS)] + [(f"layer {l}", l) for l in range(n_layers)],
            value=ALL_LAYERS, description="layer")
        self.token = widgets.Dropdown(options=[("(run first)", 0)], value=0, description="token")
        self.status = widgets.HTML()
        self.heatmap = go.FigureWidget()
        self.load = go.FigureWidget()
        self.probs = go.FigureWidget()
        self.run_button.on_click(lambda _b: self.run())
        self.layer.observe(self._on_layer, names="value")
        self.token.observe(self._on_token, names="value")
        super().__init__([
            widgets.HBox([self.prompt, self.run_button]),
            widgets.HBox([self.layer, self.token]),
            self.status,
            self.heatmap,
            self.load,
            self.probs,
        ])
        self.add_class("colibri-explorer")
        self.run()

    # -- running ------------------------------------------------------------------
    def run(self) -> Trace | None:
        """Tokenize the prompt, run it (and ``max_new_tokens`` greedy tokens) under
        ``engine.trace()``, and redraw everything. Errors go to ``status``."""
        eng = self.engine
        try:
            ids = eng.tokenizer.encode(self.prompt.value, add_bos=self.add_bos)
            if not ids:
                raise ValueError("the prompt is empty: type some text")
            ids = ids[: eng.config.max_seq_len]
            with eng.trace(capacity=len(ids) + self.max_new_tokens) as tr:
                if self.max_new_tokens > 0:
                    for _ in eng.generate(ids, self.max_new_tokens, stop_at_eos=False, reuse_prefix=False):
                        pass
                else:
                    eng.forward(ids)
        except (ColibriError, ValueError) as e:
            self.status.value = f"<span style='color:#b00'>error: {html.escape(str(e))}</span>"
            return None
        self.trace = tr
        self._busy = True
        try:
            texts = tr.token_texts or [str(int(i)) for i in tr.token_ids]
            layer = self.layer.value
            self.layer.options = [("all layers", ALL_LAYERS)] + [
                (f"layer {l}" + ("" if tr.layer_is_moe[l] else " (dense)"), l)
                for l in range(tr.n_layers)]
            self.layer.value = layer
            keep = min(self.token.value or 0, tr.n_tokens - 1)
            self.token.options = [(f"{t}: {texts[t]!r}", t) for t in range(tr.n_tokens)]
            self.token.value = max(keep, 0)
        finally:
            self._busy = False
        self.status.value = html.escape(repr(tr))
        self._redraw_all()
        return tr

    # -- drawing ------------------------------------------------------------------
    @property
    def selected_layer(self) -> int | None:
        return None if self.layer.value == ALL_LAYERS else int(self.layer.value)

    def _draw_heatmap(self) -> None:
        tr, layer = self.trace, self.selected_layer
        fig = viz.routing_heatmap(tr, layer=layer, slot=self.slot)
        t = int(self.token.value)
        if tr.n_tokens and (layer is None or tr.layer_is_moe[layer]):
            fig.add_vrect(x0=t - 0.5, x1=t + 0.5, line_width=2, line_color="black",
                          fillcolor="rgba(0,0,0,0)")
        _replace(self.heatmap, fig)
        if self.heatmap.data:
            self.heatmap.data[0].on_click(self._on_click)

    def _draw_load(self) -> None:
        _replace(self.load, viz.expert_load(self.trace, layer=self.selected_layer))

    def _draw_probs(self) -> None:
        _replace(self.probs, viz.token_router_probs(self.trace, int(self.token.value),
                                                    layer=self.selected_layer))

    def _redraw_all(self) -> None:
        if self.trace is None or self.trace.n_tokens == 0:
            return
        self._draw_heatmap()
        self._draw_load()
        self._draw_probs()

    # -- events -------------------------------------------------------------------
    def _on_layer(self, _change) -> None:
        if not self._busy and self.trace is not None:
            self._redraw_all()

    def _on_token(self, _change) -> None:
        if not self._busy and self.trace is not None:
            self._draw_heatmap()
            self._draw_probs()

    def _on_click(self, _trace, points, _state) -> None:
        """A click on a heatmap cell selects its token."""
        if points.xs:
            self.token.value = int(points.xs[0])


def explorer(engine: Any, prompt: str = "def add(a, b):\n    return a + b\n", *,
             max_new_tokens: int = 0, slot: int = 0) -> Explorer:
    """An :class:`Explorer` box for ``engine``: prompt, Run button, layer and token
    controls, and three live figures (routing heatmap — all layers or one layer's router
    probabilities —, expert load, the selected token's router probabilities). It runs the
    prompt once on construction; Run re-runs it under ``engine.trace()``."""
    return Explorer(engine, prompt, max_new_tokens=max_new_tokens, slot=slot)
