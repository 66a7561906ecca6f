"""Plotly figures of what the engine did (a :class:`~colibri_lab.runtime.trace.Trace`) and of what a
``.colibri`` file holds (a :class:`~colibri_lab.format.reader.ColibriInfo`).

Every function returns a ``plotly.graph_objects.Figure``; wrap it in ``go.FigureWidget``
for live updates (see :mod:`colibri_lab.analysis.widgets`).

- :func:`routing_heatmap`       layer × token grid coloured by the chosen expert, or one
                                layer's token × expert router probabilities
- :func:`expert_load`           share of routed rows per expert and layer, uniform line
- :func:`group_size_histogram`  group sizes and the rows added by group padding
- :func:`stage_timings`         time per stage, stacked per layer, embedding, LM head
- :func:`shared_gate`           the shared expert's gate per token and layer (Qwen2-MoE)
- :func:`sink_share`            attention sinks' share of each head's softmax, per layer (gpt-oss)
- :func:`expert_groups`         share of routed rows per expert group and layer (DeepSeek)
- :func:`token_router_probs`    one token's router probabilities in every layer
- :func:`format_map`            the file's sections to scale and the annotated header

Token pieces are shown as the tokenizer spells them ('▁def', '<0x0A>'), HTML-escaped.
Dense-MLP layers are never hidden: they appear as grey rows labelled "dense" or are
named in a note.
"""

from __future__ import annotations

import colorsys
import html
import struct
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from . import diagnostics as _diag
from ..format import reader as _reader
from ..format import spec as _fmt
from ..runtime.trace import ALL_STAGES, STAGES, Trace

DENSE_COLOUR = "#b8b8b8"
_BASE_PALETTE = (
    # plotly's D3 + Dark24-ish qualitative colours: distinct, readable on white
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
    "#bcbd22", "#7f7f7f", "#2E91E5", "#E15F99", "#1CA71C", "#FB0D0D", "#DA16FF", "#B68100",
    "#750D86", "#EB663B", "#511CFB", "#00A08B", "#FB00D1", "#FC0080", "#B2828D", "#6C7C32",
)  # fmt: skip
_STAGE_COLOURS = {"embedding": "#636efa", "attention": "#00cc96", "router": "#ef553b",
                  "grouping": "#ab63fa", "expert_ffn": "#ffa15a", "combine": "#19d3f3",
                  "lm_head": "#ff6692"}  # fmt: skip
_SHADES = ((0.30, 0.80), (0.45, 0.75), (0.60, 0.80), (0.72, 0.85))   # (lightness, saturation)
_MAX_TICKS = 64
_KEY_PLOT_WIDTH = 520    # px of plot width the expert key is sized for (a 700 px figure)
_KEY_SYMBOL_PX = 30      # px of a key entry besides its text (symbol, gaps)
_KEY_ENTRY_GAP = 10      # px after a key entry's text: it reads as the square's, not the next
_KEY_ROW_PX = 19         # px of one key entry (plotly: max(text, 16) + 3)
_KEY_BAND_GAP = 8        # px between bands of key columns, should they wrap
_KEY_COLUMN_LENGTHS = (10, 16, 20, 25, 32, 40, 50, 64, 100, 128)   # entries per key column


def expert_colours(n_experts: int) -> list[str]:
    """One distinct colour per expert: the qualitative palette up to 24 experts, beyond it
    colour families: ``ceil(n / 4)`` evenly spaced hues, each in four shades (dark to
    light) for four consecutive experts, so that neighbouring ids never look alike."""
    if n_experts <= len(_BASE_PALETTE):
        return list(_BASE_PALETTE[:n_experts])
    n_hues = -(-n_experts // len(_SHADES))
    out = []
    for i in range(n_experts):
        hue, shade = divmod(i, len(_SHADES))
        r, g, b = colorsys.hls_to_rgb(hue / n_hues, *_SHADES[shade])
        out.append(f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}")
    return out


def _esc(text: str) -> str:
    return html.escape(text, quote=False)


def _texts(trace: Trace) -> list[str]:
    """Token pieces for display (the id when the trace has no texts)."""
    if len(trace.token_texts) == trace.n_tokens:
        return [str(t) for t in trace.token_texts]
    return [f"#{int(i)}" for i in trace.token_ids]


def _short(s: str, n: int = 12) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def _token_axis(trace: Trace) -> dict[str, Any]:
    """x-axis ticks: token pieces at integer positions (thinned for long traces)."""
    T = trace.n_tokens
    step = max(1, -(-T // _MAX_TICKS))
    vals = list(range(0, T, step))
    texts = _texts(trace)
    return dict(tickmode="array", tickvals=vals, ticktext=[_esc(_short(texts[t])) for t in vals],
                tickangle=-60, title="token")


def _layer_label(trace: Trace, l: int) -> str:
    return f"layer {l}" if trace.layer_is_moe[l] else f"layer {l} (dense)"


def _topk_text(trace: Trace, l: int, t: int) -> str:
    ids, w = trace.topk_ids[l, t], trace.topk_weights[l, t]
    return ", ".join(f"e{int(e)} ({float(x):.3f})" for e, x in zip(ids, w))


def _note(fig: go.Figure, text: str, y: float = 1.0, yanchor: str = "bottom") -> None:
    fig.add_annotation(text=text, xref="paper", yref="paper", x=0, y=y, xanchor="left",
                       yanchor=yanchor, showarrow=False, font=dict(size=11, color="#555"),
                       align="left")


def _empty(title: str, message: str, height: int = 260) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=title, height=height, xaxis=dict(visible=False),
                      yaxis=dict(visible=False))
    fig.add_annotation(text=message, xref="paper", yref="paper", x=0.5, y=0.5,
                       showarrow=False, font=dict(size=14))
    return fig


# --------------------------------------------------------------------------- routing

def routing_heatmap(trace: Trace, layer: int | None = None, slot: int = 0) -> go.Figure:
    """Which expert each token went to.

    ``layer=None``: a layer × token grid coloured by the expert at rank ``slot`` (0 = the
    best), one colour per expert; dense layers are grey rows labelled "(dense)". A
    discrete key under the plot names every colour ("dense" when the trace has dense
    layers, then e0 … e{E-1}; in columns e0–e9 | e10–e19 | … beyond 20 experts). Hover:
    the token piece, its position, and every top-k id with its combine weight.

    ``layer=l``: that layer's token × expert router probabilities, the chosen experts
    marked with their rank (what the explorer widget's layer control switches to).
    """
    if trace.n_tokens == 0:
        return _empty("Routing", "the trace holds no tokens")
    if layer is not None:
        return _layer_probs_heatmap(trace, int(layer))
    L, T, E, K = trace.n_layers, trace.n_tokens, trace.n_experts, trace.top_k
    if not 0 <= slot < K:
        raise ValueError(f"slot {slot} out of range: the trace has top-{K}")
    texts = _texts(trace)
    moe = trace.layer_is_moe
    has_dense = bool((~moe).any())
    z = np.where(moe[:, None], trace.topk_ids[:, :, slot], -1).astype(float)
    hover = []
    for l in range(L):
        row = []
        for t in range(T):
            head = (f"token {t} <b>{_esc(repr(texts[t]))}</b> (pos {int(trace.positions[t])})"
                    f"<br>{_layer_label(trace, l)}")
            if moe[l]:
                row.append(f"{head}<br>expert at rank {slot + 1}: e{int(z[l, t])}"
                           f"<br>top-{K}: {_topk_text(trace, l, t)}")
            else:
                row.append(f"{head}<br>dense MLP: no routing")
        hover.append(row)
    # a discrete colour scale: one band per value (-1 = dense, then experts 0..E-1)
    colours = expert_colours(E)
    bands = ([DENSE_COLOUR] if has_dense else []) + colours
    lo = -1 if has_dense else 0
    n = len(bands)
    scale = []
    for i, c in enumerate(bands):
        scale += [[i / n, c], [(i + 1) / n, c]]
    fig = go.Figure(go.Heatmap(
        z=z, x=list(range(T)), y=list(range(L)), text=hover,
        hovertemplate="%{text}<extra></extra>", colorscale=scale, zmin=lo - 0.5,
        zmax=E - 0.5, xgap=1, ygap=1, showscale=False, name="routing",
    ))
    key_height = _expert_key(fig, colours, dense=has_dense,
                             title=f"colour: the expert at rank {slot + 1}")
    fig.update_layout(
        title=(f"Routing: expert at rank {slot + 1} of top-{K} ({E} experts), "
               f"{T} tokens × {L} layers"),
        xaxis=_token_axis(trace),
        yaxis=dict(tickmode="array", tickvals=list(range(L)),
                   ticktext=[_layer_label(trace, l) for l in range(L)], autorange="reversed"),
        height=max(260, 120 + 28 * L) + key_height, margin=dict(b=90),
    )
    return fig


def _expert_key(fig: go.Figure, colours: list[str], title: str, dense: bool) -> int:
    """A discrete colour key under the plot that names every colour: one legend entry (a
    small square and its label: "dense" when ``dense``, then e0 … e{E-1}) per colour. Up to
    20 experts the entries flow in rows; more stand in columns of a round length (e0–e9 |
    e10–e19 | …, the shortest that fits a 700 px figure), "dense" in a column of its own.
    The entries are marker-only Scatter traces without points, added after the figure's
    traces (``fig.data[0]`` stays the plotted one); clicking them does nothing. Returns
    the height the key adds to the figure (px)."""
    E = len(colours)
    font = 10 if E > 32 else 12

    def width(label: str) -> int:      # a label's text and the gap to the next entry (px)
        return int(0.6 * font * len(label)) + _KEY_ENTRY_GAP

    dense_col = (_KEY_SYMBOL_PX + width("dense")) if dense else 0
    col = _KEY_SYMBOL_PX + width(f"e{E - 1}")
    per_col = 0                        # 0: entries flow in rows
    if E > 20:
        per_col = next((c for c in _KEY_COLUMN_LENGTHS
                        if dense_col + -(-E // c) * col <= _KEY_PLOT_WIDTH), -(-E // 6))
    entries = [("dense", DENSE_COLOUR, "dense" if per_col else "")] if dense else []
    entries += [(f"e{e}", c, f"e{e - e % per_col}" if per_col else "")
                for e, c in enumerate(colours)]
    flow_width = max(width(f"e{E - 1}"), width("dense") if dense else 0)
    for label, colour, group in entries:
        fig.add_trace(go.Scatter(
            x=[None], y=[None], mode="markers", name=label, showlegend=True, hoverinfo="skip",
            legendgroup=group or None, legendwidth=width(label) if per_col else None,
            marker=dict(symbol="square", size=10 if font == 10 else 12, color=colour,
                        line=dict(width=0.5, color="#555")),
        ))
    fig.update_layout(
        showlegend=True,
        legend=dict(orientation="h", title=dict(text=title, side="top"), font=dict(size=font),
                    entrywidth=None if per_col else flow_width, entrywidthmode="pixels",
                    indentation=-15, itemwidth=30, tracegroupgap=_KEY_BAND_GAP,
                    itemclick=False, itemdoubleclick=False, maxheight=1.0,
                    x=0, xanchor="left", yref="container", y=0, yanchor="bottom"),
    )
    # its height in a 700 px figure (a wider one may need fewer rows of entries)
    if per_col:
        rows = per_col
    else:
        per_row = max(1, _KEY_PLOT_WIDTH // (_KEY_SYMBOL_PX + flow_width))
        rows = -(-len(entries) // per_row)
    return rows * _KEY_ROW_PX + int(1.2 * font) + 24          # + the title and padding


def _layer_probs_heatmap(trace: Trace, layer: int) -> go.Figure:
    L, T, E, K = trace.n_layers, trace.n_tokens, trace.n_experts, trace.top_k
    if not 0 <= layer < L:
        raise ValueError(f"layer {layer} out of range: the trace has {L} layers")
    if not trace.layer_is_moe[layer]:
        return _empty(f"Router probabilities, layer {layer}",
                      f"layer {layer} is a dense MLP layer (dense): it has no router")
    texts = _texts(trace)
    probs = trace.router_probs[layer].T          # [E, T]
    rank = np.full((E, T), -1)
    for k in range(K):
        rank[trace.topk_ids[layer, :, k], np.arange(T)] = k
    hover = [[(f"token {t} <b>{_esc(repr(texts[t]))}</b><br>expert {e}: p = {probs[e, t]:.4f}"
               + (f"<br>chosen, rank {rank[e, t] + 1}, weight "
                  f"{float(trace.topk_weights[layer, t, rank[e, t]]):.4f}"
                  if rank[e, t] >= 0 else "<br>not chosen"))
              for t in range(T)] for e in range(E)]
    fig = go.Figure(go.Heatmap(
        z=probs, x=list(range(T)), y=list(range(E)), text=hover,
        hovertemplate="%{text}<extra></extra>", colorscale="Viridis", zmin=0.0,
        zmax=float(np.nanmax(probs)) if np.isfinite(probs).any() else 1.0,
        colorbar=dict(title="p(expert)"), name=f"layer {layer}",
    ))
    tt, ee = np.nonzero(rank.T >= 0)
    fig.add_trace(go.Scatter(   # ranks written in the circles while they are legible
        x=tt, y=ee, mode="markers+text" if T <= 48 else "markers",
        text=[str(rank[e, t] + 1) for t, e in zip(tt, ee)],
        textfont=dict(color="white", size=9), hoverinfo="skip", name="chosen (rank)",
        # circles about one cell wide (a figure of ~860 px, the height set below)
        marker=dict(symbol="circle-open", size=max(5, min(14, 600 // max(T, 1),
                                                           200 // max(E, 1))),
                    color="white", line=dict(width=1.5)),
    ))
    fig.update_layout(
        title=f"Router probabilities, layer {layer} (circled: the top-{K}"
              + (", with their rank)" if T <= 48 else ")"),
        xaxis=_token_axis(trace),
        yaxis=dict(title="expert", tickmode="array", tickvals=list(range(E)),
                   ticktext=[f"e{e}" for e in range(E)], autorange="reversed"),
        height=max(300, 160 + 28 * E), showlegend=False, margin=dict(b=90),
    )
    return fig


def token_router_probs(trace: Trace, token: int, layer: int | None = None) -> go.Figure:
    """One token's router probabilities: in every layer (layer × expert heatmap, its top-k
    circled) or, with ``layer``, in that layer only (bars, the chosen experts coloured)."""
    L, T, E, K = trace.n_layers, trace.n_tokens, trace.n_experts, trace.top_k
    if not 0 <= token < T:
        raise ValueError(f"token {token} out of range: the trace has {T} tokens")
    text = _esc(repr(_texts(trace)[token]))
    if layer is not None:
        layer = int(layer)
        if not 0 <= layer < L:
            raise ValueError(f"layer {layer} out of range: the trace has {L} layers")
        if not trace.layer_is_moe[layer]:
            return _empty(f"Router probabilities of token {token} {text}, layer {layer}",
                          f"layer {layer} is a dense MLP layer (dense): it has no router")
        p = trace.router_probs[layer, token]
        chosen = {int(e): k for k, e in enumerate(trace.topk_ids[layer, token])}
        colours = ["#d62728" if e in chosen else "#9fb7d6" for e in range(E)]
        fig = go.Figure(go.Bar(
            x=[f"e{e}" for e in range(E)], y=p, marker_color=colours, name="p",
            text=[f"rank {chosen[e] + 1}" if e in chosen else "" for e in range(E)],
            textposition="outside",
            hovertemplate="%{x}: p = %{y:.4f}<extra></extra>",
        ))
        fig.add_hline(y=1.0 / E, line_dash="dot", line_color="#666",
                      annotation_text=f"uniform 1/{E}", annotation_position="top right")
        fig.update_layout(title=(f"Router probabilities of token {token} {text}, layer {layer} "
                                 f"(red: the top-{K})"),
                          xaxis_title="expert", yaxis_title="p(expert)", height=320,
                          yaxis_range=[0, max(1.0 / E, float(np.nanmax(p))) * 1.15])
        return fig
    p = trace.router_probs[:, token, :]          # [L, E], NaN rows for dense layers
    hover = [[(f"{_layer_label(trace, l)}, expert {e}: p = {p[l, e]:.4f}"
               if trace.layer_is_moe[l] else f"{_layer_label(trace, l)}: no router")
              for e in range(E)] for l in range(L)]
    fig = go.Figure(go.Heatmap(
        z=p, x=list(range(E)), y=list(range(L)), text=hover, hovertemplate="%{text}<extra></extra>",
        colorscale="Viridis", zmin=0.0, zmax=1.0, colorbar=dict(title="p"), name="probs",
    ))
    moe = trace.moe_layers
    xs = [int(trace.topk_ids[l, token, k]) for l in moe for k in range(K)]
    ys = [int(l) for l in moe for _ in range(K)]
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", hoverinfo="skip", name="top-k",
                             marker=dict(symbol="circle-open", size=14, color="white",
                                         line=dict(width=1.5))))
    fig.update_layout(
        title=f"Router probabilities of token {token} {text} (circled: top-{K})",
        xaxis=dict(title="expert", tickmode="array", tickvals=list(range(E)),
                   ticktext=[f"e{e}" for e in range(E)]),
        yaxis=dict(tickmode="array", tickvals=list(range(L)),
                   ticktext=[_layer_label(trace, l) for l in range(L)], autorange="reversed"),
        height=max(240, 120 + 26 * L), showlegend=False,
    )
    return fig


# --------------------------------------------------------------------------- load

def expert_load(trace: Trace, layer: int | None = None) -> go.Figure:
    """Share of each MoE layer's routed rows that each expert received (grouped bars, one
    colour per layer), with the uniform share 1/E as a dashed line. Dense layers have no
    routing: they are skipped and named in a note. ``layer`` shows one layer only."""
    E = trace.n_experts
    load = _diag.expert_load(trace)
    layers = list(trace.moe_layers) if layer is None else [int(layer)]
    dense = [int(l) for l in np.flatnonzero(~trace.layer_is_moe)]
    fig = go.Figure()
    for l in layers:
        if not trace.layer_is_moe[l]:
            continue
        g = trace.group_sizes[l]
        fig.add_trace(go.Bar(
            x=[f"e{e}" for e in range(E)], y=load[l], name=f"layer {l}",
            customdata=np.stack([g, np.full(E, g.sum())], axis=1),
            hovertemplate=(f"layer {l}, %{{x}}: %{{y:.3f}} of the routed rows "
                           "(%{customdata[0]} of %{customdata[1]})<extra></extra>"),
        ))
    fig.add_hline(y=1.0 / E, line_dash="dash", line_color="#444",
                  annotation_text=f"uniform 1/{E}", annotation_position="top right")
    what = "all MoE layers" if layer is None else f"layer {layer}"
    fig.update_layout(title=f"Expert load: share of routed rows per expert ({what})",
                      barmode="group", xaxis_title="expert", yaxis_title="share of rows",
                      height=360, legend_title="layer")
    notes = []
    if dense:
        notes.append(f"dense layers (no routing, skipped): {', '.join(map(str, dense))}")
    if layer is not None and not trace.layer_is_moe[layer]:
        notes.append(f"layer {layer} is dense: no expert load")
    if notes:
        _note(fig, "; ".join(notes), y=-0.22, yanchor="top")
        fig.update_layout(margin=dict(b=90))
    return fig


def group_size_histogram(trace: Trace) -> go.Figure:
    """Group sizes and what padding them costs.

    Top: rows per (MoE layer, expert) group as a heatmap (hover: routed rows, rows after
    padding to a multiple of ``trace.group_pad``, padding rows). Bottom left: the
    histogram of group sizes, before and after padding. Bottom right: per MoE layer the
    routed rows with the padding rows on top, labelled with the waste as a share of the
    grouped (padded) rows; the title gives the total (:func:`diagnostics.padding_waste`).
    """
    pad = _diag.padding_waste(trace)
    moe = trace.moe_layers
    E = trace.n_experts
    fig = make_subplots(rows=2, cols=2, column_widths=[0.45, 0.55], row_heights=[0.45, 0.55],
                        vertical_spacing=0.2,
                        specs=[[{"colspan": 2}, None], [{}, {}]],
                        subplot_titles=("rows per expert and layer (routed, before padding)",
                                        "rows per (layer, expert) group",
                                        "padding rows per layer"))
    g, gp = trace.group_sizes[moe], trace.padded_group_sizes[moe]
    fig.add_trace(go.Heatmap(
        z=g, x=[f"e{e}" for e in range(E)], y=[f"layer {l}" for l in moe],
        customdata=np.stack([gp, gp - g], axis=2) if len(moe) else None,
        colorscale="Blues", colorbar=dict(title="rows", len=0.4, y=0.8), name="group sizes",
        hovertemplate=("%{y}, %{x}: %{z} routed rows, %{customdata[0]} after padding "
                       "(+%{customdata[1]})<extra></extra>"),
        texttemplate="%{z}" if E * len(moe) <= 400 else None, xgap=1, ygap=1,
    ), row=1, col=1)
    fig.update_yaxes(autorange="reversed", row=1, col=1)
    fig.add_trace(go.Histogram(x=g.ravel(), name="routed rows", opacity=0.75,
                               marker_color="#1f77b4"), row=2, col=1)
    if trace.group_pad > 1:
        fig.add_trace(go.Histogram(x=gp.ravel(), name=f"after padding to {trace.group_pad}",
                                   opacity=0.6, marker_color="#ff7f0e"), row=2, col=1)
    xs = [f"layer {l}" for l in moe]
    fig.add_trace(go.Bar(x=xs, y=pad["real_rows"][moe], name="routed rows (real)",
                         marker_color="#1f77b4", showlegend=False,
                         hovertemplate="%{x}: %{y} routed rows<extra></extra>"), row=2, col=2)
    fig.add_trace(go.Bar(     # drawn on top of the routed rows (base), not overlaid
        x=xs, y=pad["waste_rows"][moe], base=pad["real_rows"][moe], name="padding rows",
        marker_color="#d62728",
        text=[f"{p:.1f} %" for p in pad["waste_pct"][moe]], textposition="outside",
        customdata=np.stack([pad["waste_rows"][moe], pad["padded_rows"][moe],
                             pad["waste_pct"][moe]], axis=1) if len(moe) else None,
        hovertemplate=("%{x}: %{customdata[0]} padding rows of %{customdata[1]} grouped "
                       "rows (%{customdata[2]:.1f} %)<extra></extra>"),
    ), row=2, col=2)
    fig.update_layout(
        barmode="overlay", height=max(620, 420 + 22 * len(moe)), legend=dict(y=0.45),
        title=(f"Group padding to multiples of {pad['group_pad']}: {pad['total_waste_rows']} "
               f"padding rows = {pad['total_waste_pct']:.1f} % of {pad['total_padded_rows']} "
               "grouped rows"),
    )
    fig.update_xaxes(title_text="rows in group", row=2, col=1)
    fig.update_yaxes(title_text="groups", row=2, col=1)
    fig.update_yaxes(title_text="rows", row=2, col=2)
    dense = np.flatnonzero(~trace.layer_is_moe)
    if dense.size:
        _note(fig, f"dense layers (no groups): {', '.join(map(str, dense))}", y=-0.12,
              yanchor="top")
        fig.update_layout(margin=dict(b=80))
    return fig


# --------------------------------------------------------------------------- timings

def stage_timings(trace: Trace) -> go.Figure:
    """Time per stage (summed over the traced forwards), stacked per layer, with the
    embedding and the LM head as bars of their own; µs or ms as the sizes call for."""
    L = trace.n_layers
    per_layer = trace.timings_ns.astype(np.float64)            # [L, S]
    biggest = max(float(per_layer.sum(axis=1).max(initial=0.0)), float(trace.embedding_ns),
                  float(trace.lm_head_ns))
    unit, div = ("ms", 1e6) if biggest >= 1e6 else ("µs", 1e3)
    xs = ["embedding"] + [_layer_label(trace, l) for l in range(L)] + ["LM head"]
    fig = go.Figure()
    for name in ALL_STAGES:
        if name == "embedding":
            y = [trace.embedding_ns / div] + [None] * (L + 1)
        elif name == "lm_head":
            y = [None] * (L + 1) + [trace.lm_head_ns / div]
        else:
            y = [None] + list(per_layer[:, STAGES.index(name)] / div) + [None]
        fig.add_trace(go.Bar(x=xs, y=y, name=name, marker_color=_STAGE_COLOURS[name],
                             hovertemplate=f"%{{x}}, {name}: %{{y:.2f}} {unit}<extra></extra>"))
    total = sum(trace.stage_totals().values())
    fig.update_layout(
        barmode="stack", height=380, yaxis_title=unit, legend_title="stage",
        title=(f"Time per stage: {total / 1e6:.2f} ms in all over {trace.n_forwards} "
               f"forward(s), {trace.n_tokens} tokens"),
    )
    return fig


# --------------------------------------------------------------------------- shared expert

def shared_gate(trace: Trace) -> go.Figure:
    """The shared expert's gate sigmoid(g·x) per token and layer (Qwen2-MoE). A model
    without a gated shared expert gets an empty figure saying so."""
    g = trace.shared_gate.astype(np.float64)
    finite = np.isfinite(g)
    gated = finite & (g != 1.0)
    if not gated.any():
        why = ("a shared expert without a gate (scale 1.0)" if finite.any()
               else "no shared expert")
        return _empty("Shared-expert gate", f"no gated shared expert in this model ({why})")
    texts = _texts(trace)
    L, T = g.shape
    hover = [[(f"token {t} <b>{_esc(repr(texts[t]))}</b><br>{_layer_label(trace, l)}<br>"
               + (f"gate {g[l, t]:.4f}" if finite[l, t] else "no shared expert"))
              for t in range(T)] for l in range(L)]
    fig = go.Figure(go.Heatmap(z=g, x=list(range(T)), y=list(range(L)), text=hover,
                               hovertemplate="%{text}<extra></extra>", colorscale="Cividis",
                               zmin=0.0, zmax=1.0, colorbar=dict(title="gate")))
    fig.update_layout(
        title=f"Shared-expert gate per token and layer (mean {np.nanmean(g):.3f})",
        xaxis=_token_axis(trace),
        yaxis=dict(tickmode="array", tickvals=list(range(L)),
                   ticktext=[_layer_label(trace, l) for l in range(L)], autorange="reversed"),
        height=max(260, 120 + 28 * L), margin=dict(b=90),
    )
    return fig


def sink_share(shares: list[np.ndarray], windows: list[int] | None = None) -> go.Figure:
    """The attention sinks' share of each head's softmax (gpt-oss): ``shares[l]`` is the
    ``sink_share`` stage tensor [T, Hq] of layer l (``Engine.stages(ids)``'s
    ``attention()``); the heatmap is the mean over tokens, layer × head, with each layer's
    window (0 = full attention) in its label when ``windows`` is given. A share near 1
    means the head attends to almost nothing."""
    if not shares:
        return _empty("Attention sinks", "no layer with attention sinks")
    z = np.stack([np.asarray(s, np.float64).mean(axis=0) for s in shares])
    L, Hq = z.shape
    labels = [f"layer {l}" + (f" (window {windows[l]})" if windows and windows[l] else
                              " (full)" if windows else "") for l in range(L)]
    fig = go.Figure(go.Heatmap(z=z, x=list(range(Hq)), y=list(range(L)), colorscale="Viridis",
                               zmin=0.0, zmax=1.0, colorbar=dict(title="sink share"),
                               hovertemplate="%{y}, head %{x}: %{z:.3f}<extra></extra>"))
    fig.update_layout(title=f"Attention sinks' share of the softmax, mean over tokens "
                            f"(overall {z.mean():.3f})",
                      xaxis=dict(title="query head", dtick=1),
                      yaxis=dict(tickmode="array", tickvals=list(range(L)), ticktext=labels,
                                 autorange="reversed"),
                      height=max(240, 110 + 28 * L))
    return fig


def expert_groups(selection: dict) -> go.Figure:
    """``diagnostics.group_selection``'s load per expert group, layer × group (DeepSeek's
    group-limited routing), with the mean number of groups a token's experts span."""
    load = np.asarray(selection["group_load"], np.float64)
    layers = [int(l) for l in selection["layers"]]
    if not layers:
        return _empty("Expert groups", "no MoE layer")
    z = load[layers]
    per = selection["groups_per_token"]
    fig = go.Figure(go.Heatmap(z=z, x=list(range(z.shape[1])), y=list(range(len(layers))),
                               colorscale="Blues", zmin=0.0, colorbar=dict(title="share of rows"),
                               hovertemplate="%{y}, group %{x}: %{z:.3f}<extra></extra>"))
    fig.update_layout(title=f"Routed rows per expert group ({selection['n_group']} groups)",
                      xaxis=dict(title="group", dtick=1),
                      yaxis=dict(tickmode="array", tickvals=list(range(len(layers))),
                                 ticktext=[f"layer {l}: {per[l]:.2f} groups/token" for l in layers],
                                 autorange="reversed"),
                      height=max(240, 110 + 28 * len(layers)))
    return fig


# --------------------------------------------------------------------------- file format

def _decode_field(name: str, code: str, raw: bytes, info: _reader.ColibriInfo) -> str:
    if code.endswith("s") and name == "magic":
        return repr(raw)[1:]
    if code.endswith("s"):
        return "all zero" if not any(raw) else "NOT ZERO"
    (v,) = struct.unpack("<" + code, raw)
    if name == "flags":
        on = [k for k, b in info.flags.items() if b]
        return f"{v:#x} ({', '.join(on) or 'none'})"
    if name == "header_crc32":
        with open(info.path, "rb") as f:
            head = f.read(_fmt.HDR_CRC_OFFSET)
        ok = _fmt.crc32(head) == v
        return f"{v:08x} ({'matches bytes 0..251' if ok else 'MISMATCH'})"
    if name.endswith(".crc32"):
        return f"{v:08x}"
    if name.endswith((".offset", ".size")) or name == "file_size":
        return f"{v:,}"
    return str(v)


def _human_bytes(n: int) -> str:
    for unit, div in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def header_fields(info: _reader.ColibriInfo) -> list[dict[str, Any]]:
    """Every header field of ``info``'s file, read from its first 256 bytes: a list of
    dicts (offset, size, name, hex, value), value decoded for reading. The layout is
    :data:`colibri_lab.format.spec.HEADER_LAYOUT`."""
    with open(info.path, "rb") as f:
        hdr = f.read(_fmt.HEADER_SIZE)
    if len(hdr) != _fmt.HEADER_SIZE:
        raise _fmt.FormatError(f"{info.path}: shorter than the {_fmt.HEADER_SIZE}-byte header")
    rows = []
    for off, size, name, code in _fmt.HEADER_LAYOUT:
        raw = hdr[off:off + size]
        hx = (f"00 × {size}" if size > 16 and not any(raw)
              else " ".join(f"{b:02x}" for b in raw))
        rows.append({"offset": off, "size": size, "name": name, "hex": hx,
                     "value": _decode_field(name, code, raw, info)})
    return rows


def format_map(info: _reader.ColibriInfo) -> go.Figure:
    """The file to scale (header, the six sections and the alignment gaps between them;
    hover for offset, size and CRC) above the 256-byte header as an annotated hex dump:
    one row per field with its offset, its bytes in hex, its name and its decoded value."""
    regions = [("header", 0, _fmt.HEADER_SIZE, f"crc32 {info.header_crc32:08x}")]
    prev = _fmt.HEADER_SIZE
    for s in info.sections:
        if s.offset > prev:
            regions.append(("alignment gap", prev, s.offset - prev, "zero bytes"))
        ok = {None: "not checked", True: "checked ok", False: "MISMATCH"}[s.crc_ok]
        regions.append((s.name, s.offset, s.size, f"crc32 {s.crc32:08x} ({ok})"))
        prev = s.offset + s.size
    if info.file_size > prev:
        regions.append(("alignment gap", prev, info.file_size - prev, "zero bytes"))
    rows = header_fields(info)
    fig = make_subplots(rows=3, cols=1, row_heights=[0.07, 0.07, 0.86], vertical_spacing=0.04,
                        specs=[[{"type": "xy"}], [{"type": "xy"}], [{"type": "table"}]],
                        subplot_titles=(f"to scale: byte offsets 0 … {info.file_size:,}",
                                        "in file order (not to scale)",
                                        "header (256 bytes), field by field"))
    palette = {"header": "#444444", "alignment gap": "#e8e8e8"}
    colours = iter(_BASE_PALETTE)
    seen_gap = False
    slot = 0
    for name, off, size, extra in regions:
        colour = palette.get(name) or next(colours)
        gap = name == "alignment gap"
        hover = (f"<b>{name}</b><br>offset {off:,}<br>size {size:,} bytes"
                 f"<br>end {off + size:,}<br>{extra}<extra></extra>")
        fig.add_trace(go.Bar(
            y=["file"], x=[size], base=[off], orientation="h", name=name,
            legendgroup=name, showlegend=not (gap and seen_gap), marker_color=colour,
            marker_line=dict(width=0.5, color="white"), hovertemplate=hover,
        ), row=1, col=1)
        seen_gap = seen_gap or gap
        if not gap:
            fig.add_trace(go.Bar(
                y=["order"], x=[1], base=[slot], orientation="h", name=name, legendgroup=name,
                showlegend=False, marker_color=colour, marker_line=dict(width=1, color="white"),
                text=[f"{name}<br>{_human_bytes(size)}"], textposition="inside",
                insidetextanchor="middle", hovertemplate=hover,
            ), row=2, col=1)
            slot += 1
    fig.update_xaxes(range=[0, info.file_size], row=1, col=1)
    fig.update_xaxes(range=[0, slot], visible=False, row=2, col=1)
    fig.update_yaxes(showticklabels=False, row=1, col=1)
    fig.update_yaxes(showticklabels=False, row=2, col=1)
    mono = dict(family="monospace", size=11)
    fig.add_trace(go.Table(
        columnwidth=[50, 190, 190, 170],
        header=dict(values=["offset", "bytes (hex)", "field", "value"], align="left",
                    font=dict(size=12)),
        cells=dict(values=[[r["offset"] for r in rows], [r["hex"] for r in rows],
                           [r["name"] for r in rows], [_esc(r["value"]) for r in rows]],
                   align="left", font=mono, height=20),
    ), row=3, col=1)
    fig.update_layout(barmode="overlay", height=300 + 22 * (len(rows) + 2),
                      legend=dict(orientation="h", y=1.04),
                      title=f"{_esc(info.path)}: .colibri v{info.version}")
    return fig


__all__ = ["expert_colours", "expert_load", "format_map", "group_size_histogram",
           "header_fields", "routing_heatmap", "shared_gate", "stage_timings",
           "token_router_probs"]


# --------------------------------------------------------------------------- quantization quality
# Figures of colibri_lab.analysis.quality reports (QualityReport / RoutingReport), one per weight type.

import math  # noqa: E402  (the quality figures' log axis)


def _reports(reports) -> list[tuple[str, Any]]:
    return list(reports.items()) if isinstance(reports, dict) else [(r.test, r) for r in reports]


def routing_flip_heatmap(reports, *, top1: bool = False) -> go.Figure:
    """Weight type × MoE layer: the share (%) of (token, layer) routing decisions whose
    top-k set of experts differs from the reference's (``top1``: whose best expert
    differs). ``reports``: ``{label: QualityReport}`` (or a list, labelled by file)."""
    items = [(k, r) for k, r in _reports(reports) if r.routing is not None]
    if not items:
        return _empty("Routing flips", "no report has routing (dense model, or routing=False)")
    layers = items[0][1].routing.layers
    z = np.array([[100.0 * f for f in (r.routing.top1_flip_rate if top1 else r.routing.flip_rate)]
                  for _, r in items])
    counts = np.array([r.routing.top1_flips if top1 else r.routing.set_flips for _, r in items])
    n = np.array([[r.routing.n_tokens] * len(layers) for _, r in items])
    what = "best expert" if top1 else f"top-{items[0][1].routing.top_k} set"
    fig = go.Figure(go.Heatmap(
        z=z, x=[f"layer {l}" for l in layers], y=[_esc(k) for k, _ in items],
        colorscale="Reds", zmin=0, zmax=max(float(z.max()), 1e-9),
        text=[[f"{v:.2f}" for v in row] for row in z], texttemplate="%{text}",
        customdata=np.stack([counts, n], axis=-1), colorbar=dict(title="%"),
        hovertemplate=("%{y}, %{x}: %{z:.3f} % of decisions<br>(%{customdata[0]} of "
                       "%{customdata[1]} tokens)<extra></extra>"),
    ))
    fig.update_layout(title=f"Routing flips: {what} differs from the reference (% of tokens)",
                      xaxis_title="MoE layer", yaxis=dict(autorange="reversed"),
                      height=160 + 40 * len(items))
    return fig


def expert_load_shift(reports, *, share: bool = True) -> go.Figure:
    """Per weight type a layer × expert grid of how the test model's expert load differs
    from the reference's: red = the expert gains tokens, blue = it loses them. ``share``
    (default): in percentage points of the layer's routed rows; else in tokens."""
    items = [(k, r) for k, r in _reports(reports) if r.routing is not None]
    if not items:
        return _empty("Expert load shift", "no report has routing (dense model, or routing=False)")
    grids = [(100.0 * r.routing.load_share_delta()) if share else r.routing.load_delta()
             for _, r in items]
    lim = max(float(np.abs(np.stack(grids)).max()), 1e-9)
    fig = make_subplots(rows=1, cols=len(items), subplot_titles=[_esc(k) for k, _ in items],
                        shared_yaxes=True, horizontal_spacing=0.03)
    unit = "pp of routed rows" if share else "tokens"
    for i, ((k, r), g) in enumerate(zip(items, grids)):
        rt = r.routing
        E = rt.n_experts
        ref, test = np.asarray(rt.load_ref), np.asarray(rt.load_test)
        fig.add_trace(go.Heatmap(
            z=g, x=[f"e{e}" for e in range(E)], y=[f"layer {l}" for l in rt.layers],
            zmin=-lim, zmax=lim, colorscale="RdBu_r", showscale=(i == 0),
            colorbar=dict(title=unit), customdata=np.stack([ref, test], axis=-1),
            hovertemplate=(f"{_esc(k)}, %{{y}}, %{{x}}: %{{z:+.3f}} {unit}<br>reference "
                           "%{customdata[0]} tokens, test %{customdata[1]}<extra></extra>"),
        ), row=1, col=i + 1)
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title="Expert load shift against the reference (red: gains, blue: loses)",
                      height=200 + 28 * len(items[0][1].routing.layers),
                      width=max(700, 260 * len(items)))
    return fig


def quality_vs_size(reports, bits: dict[str, float]) -> go.Figure:
    """Mean KL divergence (log scale, with its standard error) against bits per weight,
    one point per weight type: ``reports`` {label: QualityReport}, ``bits`` {label: bpw}.
    A KL of exactly 0 (a lossless type) is drawn on the x axis' floor and named."""
    items = [(k, r) for k, r in _reports(reports) if k in bits]
    pos = [r.kld_mean for _, r in items if r.kld_mean > 0]
    floor = min(pos) / 10 if pos else 1e-6
    fig = go.Figure(go.Scatter(
        x=[bits[k] for k, _ in items], y=[max(r.kld_mean, floor) for _, r in items],
        mode="markers+text", text=[_esc(k) for k, _ in items], textposition="top center",
        error_y=dict(type="data", array=[r.kld_mean_err for _, r in items]),
        customdata=[[r.kld_mean, 100 * r.top1_agreement, r.ppl_ratio] for _, r in items],
        hovertemplate=("%{text}: %{x:.2f} bits/weight<br>KL %{customdata[0]:.3g}, same top-1 "
                       "%{customdata[1]:.2f} %, PPL ratio %{customdata[2]:.4f}<extra></extra>"),
    ))
    ys = [max(r.kld_mean, floor) for _, r in items] or [floor]
    fig.update_layout(title="Quality against size: mean KL(reference ‖ test) per weight type",
                      xaxis_title="bits per weight", yaxis_title="mean KL (nats)",
                      yaxis=dict(type="log", range=[math.log10(min(ys)) - 0.4, math.log10(max(ys)) + 0.6]),
                      height=400)
    zero = [k for k, r in items if r.kld_mean <= 0]
    if zero:
        _note(fig, f"KL exactly 0 (drawn at {floor:.1g}): {', '.join(zero)}", y=-0.25, yanchor="top")
        fig.update_layout(margin=dict(b=90))
    return fig


__all__ += ["expert_load_shift", "quality_vs_size", "routing_flip_heatmap"]


# ---- interventions and readouts (colibri_lab.runtime.interventions) -------------------------


def routing_margins(trace: Trace, by: str = "prob") -> go.Figure:
    """The routing margin of every (layer, token) beside the routing heatmap: left, the expert
    at rank 1 (as :func:`routing_heatmap`); right, the k-th minus (k+1)-th router probability
    (``by="prob"``) or logit (``by="logit"``), dark where the token was close to being routed
    to another expert. Dense layers are blank."""
    if trace.n_tokens == 0 or trace.routing_margins is None:
        return _empty("Routing margins", "the trace holds no tokens or no routing margins")
    L, T = trace.n_layers, trace.n_tokens
    m = trace.routing_margins[..., 0 if by == "logit" else 1].astype(float)
    texts = _texts(trace)
    hover = [[f"token {t} <b>{_esc(repr(texts[t]))}</b><br>{_layer_label(trace, l)}<br>margin {m[l, t]:.4g}"
              for t in range(T)] for l in range(L)]  # fmt: skip
    left = routing_heatmap(trace)
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.08,
                        subplot_titles=("expert at rank 1", f"margin ({by}): k-th − (k+1)-th"))  # fmt: skip
    fig.add_trace(left.data[0], row=1, col=1)
    fig.add_trace(go.Heatmap(z=m, x=list(range(T)), y=list(range(L)), text=hover, colorscale="Viridis",
                             hovertemplate="%{text}<extra></extra>", xgap=1, ygap=1,
                             colorbar=dict(title="margin", x=1.02), name="margin"), row=1, col=2)  # fmt: skip
    ticks = dict(tickmode="array", tickvals=list(range(L)), ticktext=[_layer_label(trace, l) for l in range(L)],
                 autorange="reversed")  # fmt: skip
    fig.update_yaxes(**ticks)
    frac = trace.near_tie_fraction(gap=0.01 if by == "prob" else 0.05, by=by)
    fig.update_layout(title=f"Routing and its margins, {T} tokens × {L} layers; near-ties per layer: "
                      + ", ".join("–" if np.isnan(f) else f"{100 * f:.0f} %" for f in frac),
                      height=max(260, 120 + 28 * L))  # fmt: skip
    return fig


def logit_lens_table(lens: dict, tokenizer=None, position: int | None = None) -> go.Figure:
    """The logit lens (``interventions.logit_lens``) as a table: one row per layer, the top-k
    tokens after that layer at one position (the first asked by default) with their logits, and
    the target's rank when one was given."""
    p = 0 if position is None else list(lens["positions"]).index(int(position))
    top, lg = lens["top_ids"][:, p], lens["top_logits"][:, p]

    def name(i: int) -> str:
        return repr(tokenizer.piece(int(i))) if tokenizer is not None else str(int(i))

    cols = {"layer": [f"after layer {int(l)}" for l in lens["layers"]]}
    for j in range(top.shape[1]):
        cols[f"top {j + 1}"] = [f"{name(top[l, j])} ({lg[l, j]:.2f})" for l in range(top.shape[0])]
    if "target_rank" in lens:
        cols["target rank"] = [int(r) for r in lens["target_rank"][:, p]]
    fig = go.Figure(go.Table(header=dict(values=list(cols)), cells=dict(values=list(cols.values()))))
    fig.update_layout(title=f"Logit lens at position {int(lens['positions'][p])}",
                      height=120 + 30 * top.shape[0])  # fmt: skip
    return fig


def expert_attribution(attr: dict) -> go.Figure:
    """Direct logit attribution (``interventions.expert_attribution``): per layer, one bar per
    chosen expert (rank order), its weighted output's share of the target's logit."""
    a, ids = np.asarray(attr["attribution"]), np.asarray(attr["ids"])
    L, K = a.shape
    colours = expert_colours(int(max(ids.max(), 0)) + 1)
    fig = go.Figure()
    for j in range(K):
        fig.add_trace(go.Bar(x=[f"layer {l}" for l in range(L)], y=a[:, j], name=f"rank {j + 1}",
                             marker_color=[colours[i] if i >= 0 else DENSE_COLOUR for i in ids[:, j]],
                             text=[f"e{i}" if i >= 0 else "" for i in ids[:, j]],
                             hovertemplate="%{x}, %{text}: %{y:.4g}<extra></extra>"))  # fmt: skip
    fig.update_layout(barmode="group", title=f"Expert attribution to the target's logit ({attr['logit']:.3g})",
                      yaxis_title="weighted output · unembedding / rms", height=360)  # fmt: skip
    return fig
