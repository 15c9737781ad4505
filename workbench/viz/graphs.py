"""Attribution graphs (``analysis.graphs``) and why a head attended: QK attribution over training and
as a heatmap."""

from __future__ import annotations

from typing import Optional

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


GRAPH_PLOT_WIDTH = 1100  # px: about the plot area of a figure across a wide page (the app's)
_GRAPH_GAP = 16  # px between the centres of two nodes of one cell, so each stays a target of its own
_GRAPH_CROWDED_SIZE = 12  # px: the largest node of a cell that needs its nodes in a grid
_CELL_WIDTH, _CELL_HEIGHT = 0.76, 0.6  # of a position's width and a layer's height: where a cell's nodes go


def _spread(n: int) -> np.ndarray:
    """``n`` offsets across [-1/2, 1/2], the middle ones first (the most influential in the middle)."""
    offsets = np.linspace(-0.5, 0.5, n) if n > 1 else np.zeros(1)
    return offsets[np.argsort(np.abs(offsets), kind="stable")]


def _graph_grid(nodes: pd.DataFrame, n_layers: int, width: int = GRAPH_PLOT_WIDTH):
    """(x, y, crowded, px per layer) of ``_graph_layout``: the nodes of one (layer, position) cell
    are spread across the cell, a row of them at most as many as stay ``_GRAPH_GAP`` px apart, then
    more rows within the layer's band (``crowded`` marks those nodes; the figure grows taller so the
    rows stay ``_GRAPH_GAP`` px apart too). The logits, in a row of their own, sit a position (or
    a node's width) apart leftwards from their position, the largest weight at it."""
    y = nodes["layer"].to_numpy(dtype=float).copy()
    y[(nodes["kind"] == "token").to_numpy()] = -1.0
    logit = (nodes["kind"] == "logit").to_numpy()
    y[logit] = float(n_layers)
    x = nodes["pos"].to_numpy(dtype=float).copy()
    positions = max(int(nodes["pos"].max()) + 1, 1) if len(nodes) else 1
    per_position = width / positions  # px
    across = max(1, int(_CELL_WIDTH * per_position / _GRAPH_GAP) + 1)
    weight = nodes["influence"].to_numpy(dtype=float).copy()
    if "logit_weight" in nodes:
        weight[logit] = nodes["logit_weight"].to_numpy(dtype=float)[logit]
    crowded = np.zeros(len(nodes), dtype=bool)
    rows_needed = 1
    for (row_y, _), index in nodes.groupby([y, x]).groups.items():
        rows = np.asarray([nodes.index.get_loc(i) for i in index])
        if len(rows) < 2:
            continue
        order = rows[np.argsort(-weight[rows], kind="stable")]
        if row_y == n_layers and logit[rows].all():  # the targets: their own row, a position apart
            step = max(1.0, 2 * _GRAPH_GAP / per_position)
            x[order] = x[order] - step * np.arange(len(order))
            continue
        cols = min(len(order), across)
        n_rows = -(-len(order) // cols)
        rows_needed = max(rows_needed, n_rows)
        x[order] += _CELL_WIDTH * _spread(cols)[np.arange(len(order)) % cols]
        if n_rows > 1:
            y[order] += _CELL_HEIGHT * _spread(n_rows)[np.arange(len(order)) // cols]
            crowded[order] = True
    per_layer = max(90.0, rows_needed * _GRAPH_GAP / _CELL_HEIGHT)
    return x, y, crowded, per_layer


def _graph_layout(nodes: pd.DataFrame, n_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """x = position (the nodes of one layer and position spread across its cell, in rows when they
    are many), y = layer (token embeddings below layer 0, the logits above the last layer, spread
    along their row)."""
    x, y, _, _ = _graph_grid(nodes, n_layers)
    return x, y


def attribution_graph_figure(nodes: pd.DataFrame, edges: pd.DataFrame, title: str = "Attribution graph",
                             selected: Optional[str] = None, str_tokens: Optional[list[str]] = None,
                             theme: Optional[str] = "default") -> go.Figure:
    """An attribution graph as circuit-tracer draws it, from ``Graph.to_frame()`` (usually of a pruned graph).

    x is the token position and y the layer (embeddings at the bottom, the logits at the top);
    a node's size follows its influence on the logits (a logit's: its weight), an edge's width
    |weight| and its colour the sign (blue excites, red inhibits). Each node point carries its id
    as ``customdata`` (what a page's selection event returns); ``selected`` is ringed.
    """
    missing = [c for c in ("id", "kind", "layer", "pos", "influence") if c not in nodes]
    missing += [c for c in ("source", "target", "weight") if c not in edges]
    if missing:
        raise ValueError(f"the tables need the columns of Graph.to_frame(); missing {missing}")
    nodes = nodes.reset_index(drop=True)
    inner = nodes["kind"].isin(["feature", "error", "supernode"])
    n_layers = int(nodes.loc[nodes["kind"] == "logit", "layer"].max()) if (nodes["kind"] == "logit").any() else \
        int(nodes.loc[inner, "layer"].max(initial=0)) + 1
    x, y, crowded, per_layer = _graph_grid(nodes, n_layers)
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
    size[crowded] = np.minimum(size[crowded], _GRAPH_CROWDED_SIZE)  # a grid of nodes: none covers its neighbour
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
    # A fixed y range and margins: a layer is then ``per_layer`` px tall, as the layout planned its rows.
    fig.update_yaxes(tickvals=list(range(-1, n_layers + 1)),
                     ticktext=["embed", *(f"L{layer}" for layer in range(n_layers)), "logits"], title_text="layer",
                     zeroline=False, range=[-1.5, n_layers + 0.5])
    fig.update_layout(title=title, template=_template(theme), height=int(180 + per_layer * (n_layers + 2)),
                      margin=dict(t=60, b=120), clickmode="event+select",
                      dragmode=False, hovermode="closest", legend=dict(orientation="h", yref="container", y=0.0, yanchor="bottom"))
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
