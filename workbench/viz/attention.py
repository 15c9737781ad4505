"""Attention patterns: one head, every head in one mosaic, and a token strip with hover details."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from workbench.analysis.common import head_label, unique_labels, unit_label
from workbench.viz._common import DIVERGING, SEQUENTIAL, _cell_points, _one_batch, _square, _template


def attention_figure(patterns: pd.DataFrame, layer: int, head: int, batch: Optional[int] = 0,
                     theme: Optional[str] = "default", difference: bool = False, clickable: bool = False) -> go.Figure:
    """One head's pattern: query tokens down, key tokens across (every token labelled), hover
    shows both and the weight. ``difference``: the table holds a change of attention
    (``pattern_difference``: clean - changed), drawn on a diverging scale around 0. ``clickable``:
    a click on a cell selects it (``customdata`` [query_pos, key_pos, weight]: the attention edge)."""
    frame = _one_batch(patterns, batch)
    frame = frame[(frame["layer"] == layer) & (frame["head"] == head)]
    if frame.empty:
        raise ValueError(f"no pattern for layer {layer} head {head} in the table")
    z, ys, xs = _square(frame)
    if difference:
        limit = float(np.nanmax(np.abs(z))) if np.isfinite(z).any() else 0.0
        scale = dict(colorscale=DIVERGING, zmid=0, zmin=-(limit or 1.0), zmax=limit or 1.0,
                     colorbar=dict(title="Δ attention"))
        what = "attention change"
    else:
        scale = dict(colorscale=SEQUENTIAL, zmin=0, zmax=1, colorbar=dict(title="attention"))
        what = "attention"
    fig = go.Figure(go.Heatmap(
        z=z, x=xs, y=ys, **scale, hoverongaps=False,
        hovertemplate="query %{y}<br>key %{x}<br>" + what + " %{z:.3f}<extra></extra>",
    ))
    n = len(xs)
    fig.update_yaxes(autorange="reversed", title="query", type="category", tickmode="array", tickvals=ys, ticktext=ys)
    if clickable:
        q, k = np.tril_indices(n)
        _cell_points(fig, [xs[j] for j in k], [ys[i] for i in q],
                     [[int(i), int(j), float(z[i, j])] for i, j in zip(q, k)],
                     "query %{y}<br>key %{x}<br>" + what + " %{customdata[2]:.3f}<br>click to open this edge<extra></extra>")
    fig.update_xaxes(title="key", tickangle=-60, type="category", tickmode="array", tickvals=xs, ticktext=xs)
    fig.update_layout(title=f"{'Attention change' if difference else 'Attention'} {unit_label(layer, head)}",
                      template=_template(theme), height=max(360, min(900, 18 * n + 180)),
                      font=dict(size=11 if n <= 40 else 9))
    return fig


def attention_grid(patterns: pd.DataFrame, batch: Optional[int] = 0, theme: Optional[str] = "default") -> go.Figure:
    """Every head's pattern, layers down, heads across, on one colour scale.

    One heatmap trace laid out as a mosaic (an empty row and column between the tiles), not
    one subplot per head: plotly builds a subplot in milliseconds, so a grid of 32 heads took
    over a second. Each row and column has its own category label (``L1 · query 3: b``,
    ``H2 · key 1: a``), so hover names the layer, head, query token, key token and weight
    without a per-cell hover array (which would dominate the figure's size and build time);
    the tick labels name the heads and layers at the centre of their tiles.
    """
    frame = _one_batch(patterns, batch)
    layers, heads = sorted(frame["layer"].unique()), sorted(frame["head"].unique())
    n = int(frame["query_pos"].max()) + 1
    tokens = frame.drop_duplicates("query_pos").sort_values("query_pos")["query_token"].tolist()
    labels = unique_labels(tokens)
    step = n + 1  # a tile and the gap after it
    rows = np.searchsorted(layers, frame["layer"].to_numpy()) * step + frame["query_pos"].to_numpy()
    cols = np.searchsorted(heads, frame["head"].to_numpy()) * step + frame["key_pos"].to_numpy()
    z = np.full((len(layers) * step - 1, len(heads) * step - 1), np.nan)
    z[rows, cols] = frame["attention"].to_numpy()

    def axis(units: list[str], role: str) -> list[str]:
        out = []
        for i, unit in enumerate(units):
            out += [f"{unit} · {role} {label}" for label in labels] + ([f"gap {i}"] if i < len(units) - 1 else [])
        return out

    ys, xs = axis([unit_label(l) for l in layers], "query"), axis([head_label(h) for h in heads], "key")
    fig = go.Figure(go.Heatmap(
        z=z, x=xs, y=ys, coloraxis="coloraxis", hoverongaps=False,
        hovertemplate="%{y}<br>%{x}<br>attention %{z:.3f}<extra></extra>",
    ))
    centre = (n - 1) // 2
    fig.update_xaxes(type="category", tickvals=xs[centre::step], ticktext=[head_label(h) for h in heads],
                     showgrid=False, side="top", title="key →")
    fig.update_yaxes(type="category", tickvals=ys[centre::step], ticktext=[unit_label(l) for l in layers],
                     showgrid=False, autorange="reversed", title="query ↓")
    fig.update_layout(coloraxis=dict(colorscale=SEQUENTIAL, cmin=0, cmax=1, colorbar=dict(title="attention")),
                      title="Attention patterns", template=_template(theme),
                      height=max(360, 260 * len(layers)), width=max(500, 260 * len(heads)))
    return fig


def token_hover_figure(lens: pd.DataFrame, patterns: pd.DataFrame, layer: int, head: int, k: int = 3,
                       batch: Optional[int] = 0, theme: Optional[str] = "default", per_row: int = 10) -> go.Figure:
    """The prompt as a row of tokens; hovering one shows (as CircuitsVis' token views do) the
    model's top-``k`` next-token predictions there, the ``k`` tokens head ``layer``/``head``
    attends to from it, and the ``k`` tokens that attend to it most. Tokens are shaded by
    the probability of the model's top prediction. ``lens``: a ``logit_lens``/``tuned_lens``
    table (its final layer is the model); ``patterns``: an ``attention_patterns`` table. A long
    prompt wraps onto rows of ``per_row`` tokens, read like text, instead of squashing into one.
    """
    frame = _one_batch(lens, batch)
    final = frame[frame["layer"] == frame["layer"].max()].sort_values("pos")
    tops = [c for c in final.columns if c.startswith("top") and c[3:].isdigit()][:k]
    pat = _one_batch(patterns, batch)
    pat = pat[(pat["layer"] == layer) & (pat["head"] == head)]
    if pat.empty:
        raise ValueError(f"no pattern for layer {layer} head {head} in the table")
    tokens = final["token"].tolist()
    labels = unique_labels(tokens)
    where = unit_label(layer, head)
    square, _, _ = _square(pat)  # [query, key], NaN above the diagonal

    def listed(weights: np.ndarray, offset: int = 0) -> str:
        order = np.argsort(-np.nan_to_num(weights, nan=-1.0), kind="stable")[:k]
        return ", ".join(f"{labels[offset + int(i)]!r} {weights[i]:.2f}" for i in order if not np.isnan(weights[i]))

    words = {c: final[c].tolist() for c in tops}
    probs = {c: final[c + "_prob"].to_numpy() for c in tops}
    hover = []
    for pos in range(len(tokens)):
        predictions = ", ".join(f"{words[c][pos]!r} {probs[c][pos]:.2f}" for c in tops)
        hover.append(f"<b>{labels[pos]!r}</b><br>predicts: {predictions}<br>"
                     f"{where} attends to: {listed(square[pos, : pos + 1]) or 'none'}<br>"
                     f"attended by: {listed(square[pos:, pos], offset=pos) or 'none'}")
    rows = -(-len(tokens) // per_row)
    shown = [t if len(t) <= 8 else t[:7] + "…" for t in tokens]  # the whole token is in the hover
    fig = go.Figure(go.Scatter(
        x=[p % per_row for p in range(len(tokens))], y=[p // per_row for p in range(len(tokens))],
        mode="markers+text", text=shown, textposition="middle center", textfont=dict(size=12),
        marker=dict(symbol="square", size=30, color=final["top1_prob"].to_numpy(), colorscale=SEQUENTIAL, cmin=0,
                    cmax=1, opacity=0.35, colorbar=dict(title=dict(text="top-1 prob.", side="right"), thickness=10)),
        hovertext=hover, hovertemplate="%{hovertext}<extra></extra>",
    ))
    fig.update_xaxes(visible=False, range=[-0.6, min(per_row, len(tokens)) - 0.4])
    fig.update_yaxes(visible=False, range=[rows - 0.5, -0.5])
    fig.update_layout(title=f"Tokens (hover one: predictions, and {where}'s attention from and to it)",
                      template=_template(theme), height=70 + 40 * rows, margin=dict(t=40, b=10, l=10, r=10))
    return fig
