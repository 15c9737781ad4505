"""Attribution graphs (``analysis.graphs``) and why a head attended: QK attribution over training and
as a heatmap."""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.viz._common import (
    DIVERGING, NEGATIVE, PALETTE, POSITIVE, STEP_MARK, _cell_points, _history_of, _template,
)


# ---- attribution graphs (workbench.analysis.graphs) ------------------------------------------------
GRAPH_SYMBOLS = {"token": "diamond", "feature": "circle", "error": "square", "logit": "star", "supernode": "hexagon"}
# Node colours apart from the edges' blue and red: grey embeddings, orange features, green errors, purple logits.
GRAPH_COLOURS = {"token": "#7f7f7f", "feature": "#ff7f0e", "error": "#2ca02c", "logit": "#9467bd", "supernode": "#8c564b"}
_WIDTH_BINS = 4  # edges are drawn in this many widths per sign: one trace each, not one per edge


# px: the plot area of a figure across the app's wide page in a 1400 px window (measured in Chromium: 862;
# it was taken as 1100, so the grid's gaps came out a fifth narrower on the page than planned)
GRAPH_PLOT_WIDTH = 860
# The figure fits one screen (a window 1000 px tall, less the page's own header), whatever the model's
# depth: circuit-tracer's and Neuronpedia's viewers draw into a canvas of fixed height too, and leave
# the detail to zooming (here plotly's: drag a box, double-click back). SmolLM2-135M's default graph (30
# layers, 128 feature rows) drew 4,446 px tall (7,006 at 512 rows and node threshold 0.95) when every
# layer got the crowdest layer's height.
GRAPH_MAX_HEIGHT = 900  # px
_GRAPH_MARGIN = (60, 120)  # px above the plot (the title) and below it (the token ticks and the legend)
_GRAPH_BAND = 90  # px per layer while every layer fits at that height (a shallow model's figure)
_GRAPH_GAP = 16  # px between the centres of two nodes of one cell, so each stays a target of its own
# px: the nearest two nodes get (a deep model's crowded graph) before the figure grows past
# GRAPH_MAX_HEIGHT instead; the Chromium check at 512 feature rows asks for 0.9 x 12 px on the page.
_GRAPH_MIN_GAP = 12
_CELL_WIDTH, _CELL_HEIGHT = 0.9, 0.6  # the most of a position's width a cell's nodes use; the share of a roomy band its rows spread over


class _GraphGrid(NamedTuple):
    """Where ``_graph_grid`` puts the nodes: centres in data units (x = position, y = the layer's band),
    the largest marker each node may have without covering a neighbour (px), the bands' edges in y
    (embeddings, layer 0, ..., the logits), the gap kept between neighbours (px) and the figure's height."""
    x: np.ndarray
    y: np.ndarray
    cap: np.ndarray
    edges: np.ndarray
    gap: int
    height: int


def _spread(n: int) -> np.ndarray:
    """``n`` offsets across [-1/2, 1/2], the middle ones first (the most influential in the middle)."""
    offsets = np.linspace(-0.5, 0.5, n) if n > 1 else np.zeros(1)
    return offsets[np.argsort(np.abs(offsets), kind="stable")]


def _fill(need: np.ndarray, room: float) -> np.ndarray:
    """Band heights of at least ``need`` that fill ``room``: the bands below a level t are raised to
    it (the roomiest layers share what the crowded ones leave), t at most ``_GRAPH_BAND``; ``need``
    itself when it does not fit (the figure then grows past the room)."""
    if need.sum() >= room:
        return need.astype(float)
    if np.maximum(need, _GRAPH_BAND).sum() <= room:
        return np.maximum(need, _GRAPH_BAND).astype(float)
    low, high = 0.0, float(_GRAPH_BAND)
    for _ in range(50):
        level = (low + high) / 2
        low, high = (level, high) if np.maximum(need, level).sum() <= room else (low, level)
    return np.maximum(need, low).astype(float)


def _graph_grid(nodes: pd.DataFrame, n_layers: int, width: int = GRAPH_PLOT_WIDTH,
                max_height: int = GRAPH_MAX_HEIGHT) -> _GraphGrid:
    """The layout of ``attribution_graph_figure``: one band per layer (the embeddings below layer 0,
    the logits above the last), one column per position.

    The nodes of one (layer, position) cell are spread across the cell, a row of them at most as many
    as stay ``gap`` px apart, then more rows, ``gap`` px apart or more, in the layer's band. A shallow
    model's bands are all as tall (``_GRAPH_BAND`` px, or its crowdest layer's rows). When that is
    taller than ``max_height``, each band is as tall as its own rows need (rows packed by layer, the
    spare height shared by the sparsest layers), the gap narrowed from ``_GRAPH_GAP`` down to
    ``_GRAPH_MIN_GAP`` px until they fit; past that the figure grows, so nodes never pile onto one spot.
    (circuit-tracer widens a crowded position's column instead; here a column stays a position, and the
    token ticks stay evenly spaced.) The logits, in a row of their own, sit a position (or two gaps)
    apart leftwards from their position, the largest weight at it."""
    kind = nodes["kind"].to_numpy()
    logit = kind == "logit"
    band = nodes["layer"].to_numpy(dtype=int) + 1
    band[kind == "token"] = 0
    band[logit] = n_layers + 1
    n_bands = n_layers + 2
    x = nodes["pos"].to_numpy(dtype=float).copy()
    positions = max(int(nodes["pos"].max()) + 1, 1) if len(nodes) else 1
    per_position = width / positions  # px
    weight = nodes["influence"].to_numpy(dtype=float).copy()
    if "logit_weight" in nodes:
        weight[logit] = nodes["logit_weight"].to_numpy(dtype=float)[logit]
    cells = [(b, index[np.argsort(-weight[index], kind="stable")])
             for (b, _), index in nodes.groupby([band, x]).indices.items()]
    most = np.zeros(n_bands, dtype=int)  # the most nodes in one cell of each band (the logits: one row)
    for b, order in cells:
        if b != n_layers + 1:
            most[b] = max(most[b], len(order))

    def rows(gap: int):  # (rows of each band, nodes across a cell, a cell's width in px) at this gap
        cell = max(0.0, min(_CELL_WIDTH * per_position, per_position - gap))  # neighbouring cells' nodes gap px apart
        across = int(cell / gap) + 1
        return np.maximum(1, -(-most // across)), across, cell

    room = float(max_height - sum(_GRAPH_MARGIN))
    gap = _GRAPH_GAP
    n_rows, across, cell = rows(gap)
    uniform = max(_GRAPH_BAND, int(n_rows.max()) * gap)
    if uniform * n_bands <= room:
        heights = np.full(n_bands, float(uniform))
    else:
        while gap > _GRAPH_MIN_GAP and (n_rows * gap).sum() > room:
            gap -= 1
            n_rows, across, cell = rows(gap)
        heights = _fill(n_rows * gap, room)
    unit = heights.sum() / n_bands  # px per unit of y: the axis spans n_bands units, as when bands are even
    edges = -1.5 + np.concatenate([[0.0], np.cumsum(heights)]) / unit
    y = ((edges[:-1] + edges[1:]) / 2)[band]
    cap = heights[band] - 2  # px: a lone node stays inside its band (its neighbours' too)
    for b, order in cells:
        k = np.arange(len(order))
        if b == n_layers + 1:  # the targets: their own row, a position apart
            step = max(1.0, 2 * _GRAPH_GAP / per_position)
            x[order] = x[order] - step * k
            continue
        if len(order) < 2:
            continue
        cols = min(len(order), across)
        r = -(-len(order) // cols)
        pitch = max(gap, _CELL_HEIGHT * heights[b] / r)  # px between rows; rows/band px >= gap keeps it <= band/rows
        across_px = cell * _spread(cols)[k % cols]
        x[order] += across_px / per_position
        y[order] += _spread(r)[k // cols] * (r - 1) * pitch / unit
        spacing = min(cell / (cols - 1) if cols > 1 else np.inf, pitch if r > 1 else np.inf)
        # none covers a neighbour in its cell, nor the centre of the nearest the next cell can have
        clear = 2 * (per_position - np.abs(across_px) - cell / 2)
        cap[order] = np.minimum(cap[order], np.minimum(spacing, clear) - 2)
    return _GraphGrid(x, y, cap, edges, gap, int(round(heights.sum() + sum(_GRAPH_MARGIN))))


def _graph_layout(nodes: pd.DataFrame, n_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """x = position (the nodes of one layer and position spread across its cell, in rows when they
    are many), y = the layer's band (token embeddings below layer 0, the logits above the last layer,
    spread along their row)."""
    grid = _graph_grid(nodes, n_layers)
    return grid.x, grid.y


def attribution_graph_figure(nodes: pd.DataFrame, edges: pd.DataFrame, title: str = "Attribution graph",
                             selected: Optional[str] = None, str_tokens: Optional[list[str]] = None,
                             theme: Optional[str] = "default") -> go.Figure:
    """An attribution graph as circuit-tracer draws it, from ``Graph.to_frame()`` (usually of a pruned graph).

    x is the token position and y the layer (embeddings at the bottom, the logits at the top), each
    layer a band shaded every other one; a node's size follows its influence on the logits (a logit's:
    its weight), at most its spacing to its neighbours, an edge's width |weight| and its colour the
    sign (blue excites, red inhibits). The figure is at most ``GRAPH_MAX_HEIGHT`` px tall for any
    depth (``_graph_grid``: a deep model's layers get the height their own nodes need), and opens in
    plotly's box zoom (drag a box to zoom in, double-click to zoom out; a redraw with the same title
    keeps the zoom). Each node point carries its id as ``customdata`` (what a page's selection event
    returns); ``selected`` is ringed.
    """
    missing = [c for c in ("id", "kind", "layer", "pos", "influence") if c not in nodes]
    missing += [c for c in ("source", "target", "weight") if c not in edges]
    if missing:
        raise ValueError(f"the tables need the columns of Graph.to_frame(); missing {missing}")
    nodes = nodes.reset_index(drop=True)
    inner = nodes["kind"].isin(["feature", "error", "supernode"])
    n_layers = int(nodes.loc[nodes["kind"] == "logit", "layer"].max()) if (nodes["kind"] == "logit").any() else \
        int(nodes.loc[inner, "layer"].max(initial=0)) + 1
    grid = _graph_grid(nodes, n_layers)
    x, y = grid.x, grid.y
    fig = go.Figure()
    weight = edges["weight"].to_numpy(dtype=float)
    top = float(np.abs(weight).max()) if len(weight) else 1.0
    top = top if top > 0 else 1.0
    bins = np.minimum((np.abs(weight) / top * _WIDTH_BINS).astype(int), _WIDTH_BINS - 1)
    src, dst = edges["source"].to_numpy(dtype=int), edges["target"].to_numpy(dtype=int)
    for sign, colour, name in ((1, POSITIVE, "excites"), (-1, NEGATIVE, "inhibits")):
        shown = False
        for b in range(_WIDTH_BINS):
            part = np.nonzero((np.sign(weight) == sign) & (bins == b))[0]
            if not len(part):
                continue
            xs = np.stack([x[src[part]], x[dst[part]], np.full(len(part), np.nan)], 1).ravel()
            ys = np.stack([y[src[part]], y[dst[part]], np.full(len(part), np.nan)], 1).ravel()
            fig.add_scatter(x=xs, y=ys, mode="lines", hoverinfo="skip", name=name, legendgroup=name,
                            showlegend=not shown, line=dict(color=colour, width=0.5 + 1.5 * b),
                            opacity=0.35 + 0.15 * b)
            shown = True
    influence = nodes["influence"].to_numpy(dtype=float).copy()
    if "logit_weight" in nodes:
        logit = (nodes["kind"] == "logit").to_numpy()
        influence[logit] = nodes["logit_weight"].to_numpy(dtype=float)[logit]
    scale = float(influence.max()) if len(influence) and influence.max() > 0 else 1.0
    size = 7 + 23 * np.sqrt(np.clip(influence, 0, None) / scale)
    size = np.minimum(size, grid.cap)  # a grid of nodes, or a thin band: none covers its neighbour
    labels = nodes["label"].astype(str) if "label" in nodes else pd.Series([""] * len(nodes))
    for kind, symbol in GRAPH_SYMBOLS.items():
        part = np.nonzero((nodes["kind"] == kind).to_numpy())[0]
        if not len(part):
            continue
        text = [f"{nodes['id'][i]}" + (f" {labels[i]!r}" if labels[i] else "")
                + (f"<br>activation {nodes['activation'][i]:.3g}" if "activation" in nodes else "")
                + f"<br>influence {influence[i]:.3g}" for i in part]
        fig.add_scatter(x=x[part], y=y[part], mode="markers", name=kind, text=text,
                        customdata=[[nodes["id"][i]] for i in part], hovertemplate="%{text}<extra></extra>",
                        marker=dict(size=size[part], symbol=symbol, color=GRAPH_COLOURS[kind],
                                    line=dict(width=1, color="white")))
    if selected is not None and selected in set(nodes["id"]):
        i = int(np.nonzero((nodes["id"] == selected).to_numpy())[0][0])
        fig.add_scatter(x=[x[i]], y=[y[i]], mode="markers", hoverinfo="skip", showlegend=False,
                        marker=dict(size=size[i] + 12, color="rgba(0,0,0,0)", line=dict(width=3, color=STEP_MARK)))
    positions = sorted(set(nodes["pos"].tolist()))
    ticktext = [f"{p}: {str_tokens[p]!r}" if str_tokens is not None and p < len(str_tokens) else str(p) for p in positions]
    fig.update_xaxes(tickvals=positions, ticktext=ticktext, title_text="position", showgrid=False, zeroline=False)
    # A fixed y range and margins: each band is then as many px tall as the layout planned its rows for.
    names = ["embed", *(f"L{layer}" for layer in range(n_layers)), "logits"]
    middles = (grid.edges[:-1] + grid.edges[1:]) / 2
    # A band thinner than a tick label (14 px) names its layer only when it is even, as circuit-tracer's
    # viewer names every other layer: two thin bands in a row are then labelled 24 px apart or more.
    band_px = np.diff(grid.edges) * (grid.height - sum(_GRAPH_MARGIN)) / len(names)
    tick_labels = [name if px >= 14 or i in (0, len(names) - 1) or i % 2 else "" for i, (name, px) in
              enumerate(zip(names, band_px))]  # band i is layer i - 1: odd i, even layer
    fig.update_yaxes(tickvals=middles.tolist(), ticktext=tick_labels, title_text="layer", zeroline=False, showgrid=False,
                     range=[float(grid.edges[0]), float(grid.edges[-1])],
                     tickfont=dict(size=10) if band_px.min() < 14 else None)
    # Every other layer's band shaded (named after its layer), as circuit-tracer's viewer shades its rows.
    bands = [dict(type="rect", xref="paper", x0=0, x1=1, y0=float(low), y1=float(high), layer="below", name=name,
                  line_width=0, fillcolor="rgba(128,128,128,0.09)" if i % 2 else "rgba(0,0,0,0)")
             for i, (name, low, high) in enumerate(zip(names, grid.edges[:-1], grid.edges[1:]))]
    top_margin, bottom_margin = _GRAPH_MARGIN
    fig.update_layout(title=title, template=_template(theme), height=grid.height, shapes=bands,
                      margin=dict(t=top_margin, b=bottom_margin), clickmode="event+select", dragmode="zoom",
                      uirevision=title, hovermode="closest",
                      legend=dict(orientation="h", yref="container", y=0.0, yanchor="bottom"))
    return fig


# ---- why a head attended: QK attribution (analysis.graphs.qk_attribution, qk_training) --------------
def _band(fig: go.Figure, x, low, high, colour: str, name: str, row: int) -> None:
    """A filled interval behind a line (one polygon trace, skipped by hover)."""
    x, low, high = np.asarray(x, float), np.asarray(low, float), np.asarray(high, float)
    keep = np.isfinite(low) & np.isfinite(high)
    if not keep.any():
        return
    x, low, high = x[keep], low[keep], high[keep]
    r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    fig.add_trace(go.Scatter(x=np.r_[x, x[::-1]], y=np.r_[high, low[::-1]], fill="toself", mode="lines",
                             line=dict(width=0), fillcolor=f"rgba({r},{g},{b},0.18)", hoverinfo="skip",
                             name=name, showlegend=False), row=row, col=1)


def qk_over_training_figure(summary: pd.DataFrame, head: Optional[int] = None, phase: Optional[dict] = None,
                            history: Optional[pd.DataFrame] = None, title: str = "",
                            theme: Optional[str] = "default") -> go.Figure:
    """Why a head attends, over training, above the loss curve (``qk_training.qk_summary``'s table).

    Top panel: the top QK pair's contribution to the score (each prompt's rank-1 pair; hover names
    the commonest and its share of prompts) and the followed pair's (``summary.attrs["pair"]``, e.g.
    the K-composition pairs: the best of them, and all of them summed, dashed), each mean over prompts
    with its interval as a band. Middle: the
    followed pair's median rank among the pairs (1 = the top pair; log axis) and its share of prompts
    where it is the top pair. Bottom: the run's loss curve (``history``, default the one
    ``over_training`` attached). ``phase`` (``qk_training.loss_drop``) is shaded on every panel.
    """
    need = {"step", "head", "top_contribution", "pair_contribution", "pair_rank", "pair_is_top", "top_pair"}
    missing = need - set(summary.columns)
    if missing:
        raise ValueError(f"the table lacks {sorted(missing)}: make it with qk_training.qk_summary")
    heads = sorted(summary["head"].unique())
    head = heads[0] if head is None else head
    if head not in heads:
        raise ValueError(f"head {head} is not in the table (heads {heads})")
    part = summary[summary["head"] == head].sort_values("step")
    pair = str(part["pair"].iloc[0]) if "pair" in part else summary.attrs.get("pair", "pair")
    layer = int(part["layer"].iloc[0]) if "layer" in part else None
    confidence = summary.attrs.get("confidence", 0.95)
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, row_heights=[0.42, 0.25, 0.33], vertical_spacing=0.05,
                        specs=[[{}], [{"secondary_y": True}], [{}]])
    steps = part["step"]
    top_text = [f"{p} on {s:.0%} of prompts" for p, s in zip(part["top_pair"], part["top_pair_share"])] \
        if "top_pair_share" in part else list(part["top_pair"])
    several = "/" in pair or " + " in pair
    lines = [("top_contribution", "top pair", PALETTE[0], "solid", top_text),
             ("pair_best_contribution", f"best of {pair}" if several else pair, PALETTE[1], "solid", None)]
    if several:
        lines.append(("pair_contribution", f"{pair}, summed", PALETTE[1], "dash", None))
    for column, name, colour, dash, text in lines:
        if column not in part:
            continue
        if f"{column}_low" in part:
            _band(fig, steps, part[f"{column}_low"], part[f"{column}_high"], colour,
                  f"{name}, {confidence:.0%} interval", 1)
        fig.add_trace(go.Scatter(x=steps, y=part[column], mode="lines+markers", name=name,
                                 line=dict(color=colour, dash=dash), text=text,
                                 hovertemplate="step %{x}<br>%{y:.3f}" + ("<br>%{text}" if text else "")
                                 + f"<extra>{name}</extra>"), row=1, col=1)
    fig.add_trace(go.Scatter(x=steps, y=part["pair_rank"], mode="lines+markers", name=f"{pair}: median rank",
                             line=dict(color=PALETTE[1], dash="dot"),
                             hovertemplate="step %{x}<br>median rank %{y:g}<extra></extra>"), row=2, col=1)
    fig.add_trace(go.Scatter(x=steps, y=part["pair_is_top"], mode="lines+markers", name=f"{pair}: share top",
                             line=dict(color=PALETTE[2]),
                             hovertemplate="step %{x}<br>top pair on %{y:.0%} of prompts<extra></extra>"),
                  row=2, col=1, secondary_y=True)
    curve = _history_of(summary, history)
    for column, dash in (("train_loss", "solid"), ("val_loss", "dot")):
        if column in curve and curve[column].notna().any():
            rows = curve[curve[column].notna()]
            fig.add_trace(go.Scatter(x=rows["step"], y=rows[column], mode="lines", name=column,
                                     line=dict(dash=dash, width=1.5, color=PALETTE[7])), row=3, col=1)
    if phase:
        for row in (1, 2, 3):
            fig.add_vrect(x0=phase["start"], x1=phase["end"], fillcolor=STEP_MARK, opacity=0.12, line_width=0,
                          row=row, col=1)
        fig.add_annotation(x=(phase["start"] + phase["end"]) / 2, y=1, xref="x", yref="paper", yanchor="bottom",
                           showarrow=False, text="loss drop", font=dict(color=STEP_MARK))
    where = f"L{layer}H{head}" if layer is not None else f"head {head}"
    fig.update_yaxes(title_text="contribution to the score", row=1, col=1)
    fig.update_yaxes(title_text="median rank", type="log", autorange="reversed", row=2, col=1, secondary_y=False)
    fig.update_yaxes(title_text="share top", range=[0, 1.05], tickformat=".0%", tick0=0, dtick=0.5, showgrid=False,
                     row=2, col=1,
                     secondary_y=True)
    fig.update_yaxes(title_text="loss", row=3, col=1)
    fig.update_xaxes(title_text="training step", row=3, col=1)
    fig.update_layout(title=title or f"{where}: why it attends, over training", template=_template(theme),
                      hovermode="x unified", height=680, legend=dict(orientation="h", y=-0.12))
    return fig


def qk_heatmap_figure(table: pd.DataFrame, title: str = "", theme: Optional[str] = "default") -> go.Figure:
    """A query-node x key-node heatmap of ``qk_attribution``'s contributions (pairs the table does not
    hold are blank); a click on a cell selects it (``customdata`` [query node, key node, contribution])."""
    for column in ("query_node", "key_node", "contribution"):
        if column not in table:
            raise ValueError(f"the table has no column {column!r} (make it with analysis.qk_attribution)")
    queries = list(dict.fromkeys(table["query_node"]))
    keys = list(dict.fromkeys(table["key_node"]))
    grid = table.pivot_table(index="query_node", columns="key_node", values="contribution", aggfunc="sum")
    grid = grid.reindex(index=queries, columns=keys)
    z = grid.to_numpy(float)
    top = float(np.nanmax(np.abs(z))) if np.isfinite(z).any() else 1.0
    fig = go.Figure(go.Heatmap(z=z, x=keys, y=queries, colorscale=DIVERGING, zmid=0, zmin=-top, zmax=top,
                               colorbar=dict(title="contribution"), hoverongaps=False))
    fig.update_xaxes(title_text="key-side node", type="category")
    fig.update_yaxes(title_text="query-side node", type="category", autorange="reversed")
    cells = [(q, k, z[i, j]) for i, q in enumerate(queries) for j, k in enumerate(keys) if np.isfinite(z[i, j])]
    _cell_points(fig, [k for _, k, _ in cells], [q for q, _, _ in cells], [[q, k, float(v)] for q, k, v in cells],
                 "query %{y}<br>key %{x}<br>contribution %{customdata[2]:.4f}<br>click to remove its key node"
                 "<extra></extra>")
    fig.update_layout(title=title or "QK pairs", template=_template(theme), height=220 + 24 * len(queries))
    return fig
