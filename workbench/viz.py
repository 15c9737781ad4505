"""Plotly figures drawn from the analysis DataFrames (never from raw tensors).

Each function takes the table an analysis call returned and gives a ``plotly`` Figure:
attention patterns (one head, or every head in one mosaic heatmap, or a change of them), the
logit-lens heatmap (and its clean-minus-changed difference), direct logit attribution bars
(and their difference), a layer x head heatmap for sweeps and head scores (clickable cells
for a page), patching heatmaps, per-token loss bars (one run or several side by side),
residual-stream norms across layers, loss curves from a checkpoint's ``metrics.csv``, a
token strip with hover details, a chart of any table column, ``side_by_side`` for any two
of them, and the figure of an HTML file plotly wrote. ``theme`` is ``"light"`` or ``"dark"``
(None: no template; the default is ``"light"``, see ``set_default_theme``); colour scales are
perceptually uniform so both read well, and text on heatmaps takes plotly's automatic
contrasting colour. Tokens on axes are
position-prefixed (``"3: the"``) so repeated tokens stay distinct; units are named by
``unit_label`` (``L1H4``), as everywhere else.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional, Union

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from workbench.analysis.common import check_choice, head_label, unique_labels, unit_label

THEMES = {"light": "plotly_white", "dark": "plotly_dark"}
SEQUENTIAL = "Viridis"
DIVERGING = "RdBu"
POSITIVE, NEGATIVE = "#2f6db5", "#d1495b"  # a blue and a red that read on white and on black
CORRECT, WRONG = "#2ca02c", "#d62728"
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
PAIR = ("#1f77b4", "#ff7f0e")  # model A and model B (or clean and ablated), the same on every figure
LAST_POSITION = "#e377c2"  # the frame around the position a prompt's answer is predicted at


_default_theme: Optional[str] = "light"


def set_default_theme(theme: Optional[str]) -> None:
    """The theme of figures whose call names none (``theme="default"``): "light", "dark", or None.

    None builds no template at all, for a program that styles figures itself (the app: its
    figures take Streamlit's light or dark theme). It also stops plotly from copying its own
    default template into every new figure, which costs more than building a small figure.
    """
    global _default_theme
    if theme is not None:
        check_choice("theme", theme, list(THEMES))
    _default_theme = theme
    pio.templates.default = "plotly" if theme is not None else None


def _template(theme: Optional[str]) -> Optional[str]:
    """The plotly template of ``theme`` ("default": the one ``set_default_theme`` chose; None: none)."""
    theme = _default_theme if theme == "default" else theme
    if theme is None:
        return None
    check_choice("theme", theme, list(THEMES))
    return THEMES[theme]


def _one_batch(frame: pd.DataFrame, batch: Optional[int]) -> pd.DataFrame:
    if "batch" not in frame or batch is None:
        return frame
    if batch not in set(frame["batch"]):
        raise ValueError(f"batch={batch} is not in the table; it has batches {sorted(set(frame['batch']))}")
    return frame[frame["batch"] == batch]


def _square(frame: pd.DataFrame) -> tuple[np.ndarray, list[str], list[str]]:
    """An attention pattern [query, key] (NaN above the diagonal) with unique token labels."""
    n = int(frame["query_pos"].max()) + 1
    z = np.full((n, n), np.nan)
    z[frame["query_pos"].to_numpy(), frame["key_pos"].to_numpy()] = frame["attention"].to_numpy()
    tokens = frame.drop_duplicates("query_pos").sort_values("query_pos")["query_token"].tolist()
    labels = unique_labels(tokens)
    return z, labels, labels


def _cell_points(fig: go.Figure, xs: list, ys: list, customdata: list, hovertemplate: str) -> None:
    """A clickable scatter point on every cell of a heatmap: plotly heatmaps emit no selection
    events, scatter points do, so a click on a cell selects its point (``customdata`` is what a
    page's selection event returns). Invisible until selected; hover moves from the heatmap here."""
    n_x, n_y = len(fig.data[0].x), len(fig.data[0].y)  # the heatmap's cells fill the axes: no padding for markers
    fig.update_xaxes(range=[-0.5, n_x - 0.5], autorange=False)
    fig.update_yaxes(range=[n_y - 0.5, -0.5] if fig.layout.yaxis.autorange == "reversed" else [-0.5, n_y - 0.5],
                     autorange=False)
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", customdata=customdata, hovertemplate=hovertemplate,
                             marker=dict(symbol="square-open", size=18, color="white", line=dict(width=3), opacity=0),
                             selected=dict(marker=dict(opacity=1)), unselected=dict(marker=dict(opacity=0)),
                             showlegend=False, name="cells"))
    fig.data[0].hoverinfo = "skip"
    fig.update_layout(hovermode="closest", hoverdistance=-1, clickmode="event+select", dragmode=False)


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


LENS_COLOURS = {"prob": ("top1_prob", "top-token probability"), "target_prob": ("target_prob", "next-token probability"),
                "rank": ("target_rank", "log10 rank of the next token"), "kl": ("kl_to_final", "KL to final (nats)")}
MAX_LENS_TEXT = 20  # positions: above this, cell text would shrink below reading size, so it moves to hover


def logit_lens_figure(lens: pd.DataFrame, batch: Optional[int] = 0, color: str = "prob",
                      theme: Optional[str] = "default", text: Optional[bool] = None) -> go.Figure:
    """Layers down, positions across, the lens' top token in each cell.

    ``color``: ``prob`` (the top token's probability), ``target_prob``, ``rank`` (the
    target's rank, log scale) or ``kl`` (KL to the final distribution, in nats). ``text``
    writes the top token in the cells (default: up to ``MAX_LENS_TEXT`` positions; beyond
    that plotly would shrink it to a few pixels, so it is on hover only). The last
    position, where a prompt's answer is predicted, is outlined.
    """
    check_choice("color", color, tuple(LENS_COLOURS))
    frame = _one_batch(lens, batch)
    column, units = LENS_COLOURS[color]
    grid = frame.pivot(index="layer", columns="pos", values=column).sort_index()
    top = frame.pivot(index="layer", columns="pos", values="top1").sort_index()
    tokens = frame.drop_duplicates("pos").sort_values("pos")["token"].tolist()
    rows = frame.drop_duplicates("layer").sort_values("layer")["layer_label"].tolist()
    z = grid.to_numpy(dtype=float)
    if color == "rank":
        z = np.log10(np.where(z > 0, z, np.nan))
    text = len(tokens) <= MAX_LENS_TEXT if text is None else text
    targets = frame.pivot(index="layer", columns="pos", values="target").sort_index().to_numpy()
    xs = unique_labels(tokens)
    fig = go.Figure(go.Heatmap(
        z=z, x=xs, y=rows, text=top.to_numpy(), texttemplate="%{text}" if text else None,
        textfont=dict(size=12),
        customdata=np.dstack([targets, grid.to_numpy()]),
        colorscale=SEQUENTIAL, reversescale=color in ("rank", "kl"),
        zmin=0 if color in ("prob", "target_prob") else None, zmax=1 if color in ("prob", "target_prob") else None,
        colorbar=dict(title=units),
        hovertemplate="%{y} at %{x}<br>top token %{text}<br>next token %{customdata[0]}<br>"
                      + f"{units} " + "%{customdata[1]:.3g}<extra></extra>",
    ))
    _outline_last_column(fig, xs, rows)
    fig.update_xaxes(title="position", tickangle=-60, type="category", tickmode="array", tickvals=xs, ticktext=xs)
    fig.update_yaxes(title="layer (stream entering it)", type="category")
    name = frame["lens"].iloc[0].capitalize()
    fig.update_layout(title=f"{name} lens" + ("" if text else " (hover a cell for its top token)"),
                      template=_template(theme), height=max(320, 48 * len(rows) + 220))
    return fig


def _outline_last_column(fig: go.Figure, xs: list[str], rows: list[str], row=None, col=None) -> None:
    """A frame around the last position: where the next token of the whole prompt is predicted."""
    if not xs:
        return
    fig.add_shape(type="rect", x0=len(xs) - 1.5, x1=len(xs) - 0.5, y0=-0.5, y1=len(rows) - 0.5,
                  line=dict(color=LAST_POSITION, width=3), fillcolor="rgba(0,0,0,0)", row=row, col=col)


def lens_difference_figure(diff: pd.DataFrame, batch: Optional[int] = 0, theme: Optional[str] = "default",
                           text: Optional[bool] = None) -> go.Figure:
    """A ``lens_difference`` table: clean - changed of its value per layer and position, on a
    diverging scale; a cell whose top token changed reads ``clean→changed`` (in the cell or on hover)."""
    frame = _one_batch(diff, batch)
    value = frame["value"].iloc[0]
    units = {"target_prob": "Δ next-token probability", "top1_prob": "Δ top-token probability",
             "kl_to_final": "Δ KL to final (nats)", "entropy": "Δ entropy (nats)"}[value]
    grid = frame.pivot(index="layer", columns="pos", values="difference").sort_index()
    clean = frame.pivot(index="layer", columns="pos", values="top1_clean").sort_index().to_numpy()
    changed = frame.pivot(index="layer", columns="pos", values="top1_changed").sort_index().to_numpy()
    label = np.where(clean == changed, clean, np.char.add(np.char.add(clean.astype(str), "→"), changed.astype(str)))
    tokens = frame.drop_duplicates("pos").sort_values("pos")["token"].tolist()
    rows = frame.drop_duplicates("layer").sort_values("layer")["layer_label"].tolist()
    xs = unique_labels(tokens)
    z = grid.to_numpy(dtype=float)
    limit = float(np.nanmax(np.abs(z))) if np.isfinite(z).any() else 0.0
    text = len(tokens) <= MAX_LENS_TEXT if text is None else text
    fig = go.Figure(go.Heatmap(
        z=z, x=xs, y=rows, text=label, texttemplate="%{text}" if text else None, textfont=dict(size=11),
        colorscale=DIVERGING, zmid=0, zmin=-(limit or 1.0), zmax=limit or 1.0, colorbar=dict(title=units),
        hovertemplate="%{y} at %{x}<br>top token %{text}<br>" + units + " %{z:.3g}<extra></extra>",
    ))
    _outline_last_column(fig, xs, rows)
    fig.update_xaxes(title="position", tickangle=-60, type="category", tickmode="array", tickvals=xs, ticktext=xs)
    fig.update_yaxes(title="layer (stream entering it)", type="category")
    fig.update_layout(title=f"{frame['lens'].iloc[0].capitalize() if 'lens' in frame else 'Logit'} lens, clean − ablated",
                      template=_template(theme), height=max(320, 48 * len(rows) + 220))
    return fig


DLA_KINDS = {"embed": "token embedding", "pos_embed": "position embedding", "head": "attention head",
             "attn_bias": "attention output bias", "attn": "attention layer", "mlp": "MLP",
             "final_bias": "final norm + unembedding bias"}
DLA_COLOURS = {"embed": "#7f7f7f", "pos_embed": "#bcbd22", "head": "#2f6db5", "attn_bias": "#9ecae1",
               "attn": "#2f6db5", "mlp": "#9467bd", "final_bias": "#8c564b"}


def _structural_zeros(frame: pd.DataFrame) -> pd.DataFrame:
    """Drop the bias parts that are exactly zero in every row: a model without biases still
    lists them (zero by structure, not by measurement), and a bar of 0 says nothing."""
    bias = frame["kind"].isin(["attn_bias", "final_bias"])
    zero = ~frame["attribution"].ne(0).groupby(frame["component"]).transform("any")
    return frame[~(bias & zero)]


def dla_figure(dla: pd.DataFrame, granularity: str = "layer", batch: Optional[int] = None,
               theme: Optional[str] = "default") -> go.Figure:
    """Direct logit attribution bars, one per component (averaged over the batch unless
    ``batch``), coloured by kind with a legend; bias parts that are zero by construction
    (no-bias models) are left out."""
    check_choice("granularity", granularity, ("head", "layer"))
    frame = _one_batch(dla, batch)
    frame = _structural_zeros(frame[frame["granularity"] == granularity])
    order = frame.drop_duplicates("component")["component"].tolist()
    kinds = frame.drop_duplicates("component").set_index("component")["kind"]
    mean = frame.groupby("component", sort=False)["attribution"].mean().reindex(order)
    total = frame.groupby("batch")["total"].first().mean()
    fig = go.Figure()
    for kind in dict.fromkeys(kinds.reindex(order)):
        names = [c for c in order if kinds[c] == kind]
        fig.add_bar(x=names, y=mean.reindex(names).to_numpy(), name=DLA_KINDS.get(kind, kind),
                    marker_color=DLA_COLOURS.get(kind), hovertemplate="%{x}<br>attribution %{y:.4f} logits<extra></extra>")
    fig.update_layout(title=f"Direct logit attribution (parts sum to {total:.3f})", template=_template(theme),
                      xaxis_title="component", yaxis_title="direct attribution (logits)", barmode="relative",
                      legend_title="part")
    fig.update_xaxes(type="category", categoryorder="array", categoryarray=order)
    return fig


def dla_difference_figure(diff: pd.DataFrame, granularity: str = "layer", batch: Optional[int] = None,
                          theme: Optional[str] = "default") -> go.Figure:
    """A ``dla_difference`` table: each component's attribution clean and changed (bars) and
    clean - changed (markers); structurally zero bias parts left out."""
    check_choice("granularity", granularity, ("head", "layer"))
    frame = _one_batch(diff, batch)
    frame = frame[frame["granularity"] == granularity]
    bias = frame["kind"].isin(["attn_bias", "final_bias"])
    zero = ~(frame["clean"].ne(0) | frame["changed"].ne(0)).groupby(frame["component"]).transform("any")
    frame = frame[~(bias & zero)]
    order = frame.drop_duplicates("component")["component"].tolist()
    mean = frame.groupby("component", sort=False)[["clean", "changed", "difference"]].mean().reindex(order)
    fig = go.Figure()
    fig.add_bar(x=order, y=mean["clean"], name="clean", marker_color=PAIR[0],
                hovertemplate="%{x}<br>clean %{y:.4f} logits<extra></extra>")
    fig.add_bar(x=order, y=mean["changed"], name="ablated", marker_color=PAIR[1],
                hovertemplate="%{x}<br>ablated %{y:.4f} logits<extra></extra>")
    fig.add_scatter(x=order, y=mean["difference"], name="clean − ablated", mode="markers",
                    marker=dict(symbol="diamond", size=10, color=NEGATIVE),
                    hovertemplate="%{x}<br>clean − ablated %{y:.4f} logits<extra></extra>")
    totals = frame.groupby("batch")[["total_clean", "total_changed"]].first().mean()
    fig.update_layout(title=f"Direct logit attribution: clean {totals['total_clean']:.3f}, "
                            f"ablated {totals['total_changed']:.3f}",
                      barmode="group", template=_template(theme), xaxis_title="component",
                      yaxis_title="direct attribution (logits)")
    fig.update_xaxes(type="category", categoryorder="array", categoryarray=order)
    return fig


def head_scores_figure(scores: pd.DataFrame, theme: Optional[str] = "default") -> go.Figure:
    """A ``head_scores`` table (long form: layer, head, kind, score): one layer x head heatmap
    per kind of score, two to a row, every cell's score written in it."""
    for column in ("layer", "head", "kind", "score"):
        if column not in scores:
            raise ValueError(f"head_scores_figure takes the long head_scores table; it has no {column!r}")
    kinds = scores["kind"].nunique()
    rows = -(-kinds // 2)
    height = rows * max(200, 60 * scores["layer"].nunique() + 90) + 120
    # 110 px between rows: the tick labels and "head" of one row, then the next row's panel titles.
    fig = layer_head_figure(scores, "score", facet="kind", theme=theme, units="score", columns=2,
                            row_gap=min(0.4, 110 / height))
    fig.update_layout(title="Head scores (layer × head, one panel per kind)", height=height + 40 * (rows - 1))
    return fig


def patching_figure(frame: pd.DataFrame, site: str, value: str = "metric", tokens: Optional[list[str]] = None,
                    units: str = "", theme: Optional[str] = "default") -> go.Figure:
    """One site of an ``activation_patching`` table as a heatmap: layer x position for the
    residual / attention / MLP sites (``tokens`` label the positions), layer x head for ``head``.
    ``value``: ``metric`` or ``restored`` (the fraction of the clean-corrupted gap restored)."""
    part = frame[frame["site"] == site]
    if part.empty:
        raise ValueError(f"the table has no rows for site={site!r}; it has {sorted(frame['site'].unique())}")
    if value not in part:
        raise ValueError(f"the table has no column {value!r}")
    what = "fraction restored" if value == "restored" else (f"metric ({units})" if units else "metric")
    if site == "head":
        fig = layer_head_figure(part, value, units=what, theme=theme,
                                title=f"Patching each head's output (all positions): {what}")
        return fig
    grid = part.pivot_table(index="layer", columns="pos", values=value, aggfunc="mean")
    n = grid.shape[1]
    xs = unique_labels(tokens[:n]) if tokens else [str(p) for p in grid.columns]
    ys = [unit_label(l) for l in grid.index]
    z = grid.to_numpy(dtype=float)
    fig = go.Figure(go.Heatmap(
        z=z, x=xs, y=ys, colorscale=SEQUENTIAL if value == "restored" else DIVERGING,
        zmid=None if value == "restored" else float(np.nanmean([part["corrupted"].iloc[0], part["clean"].iloc[0]])),
        colorbar=dict(title=what), texttemplate="%{z:.2f}" if n <= 20 else None, textfont=dict(size=11),
        hovertemplate="%{y} at %{x}<br>" + what + " %{z:.4f}<extra></extra>",
    ))
    fig.update_xaxes(title="position", tickangle=-60, type="category", tickmode="array", tickvals=xs, ticktext=xs)
    fig.update_yaxes(title="layer", autorange="reversed", type="category")
    fig.update_layout(title=f"Patching {site} by layer and position: {what}", template=_template(theme),
                      height=max(300, 60 * len(ys) + 200))
    return fig


def prompt_spread_figure(frame: pd.DataFrame, value: str = "delta", by: str = "label", title: str = "",
                         units: str = "", theme: Optional[str] = "default") -> go.Figure:
    """The spread over prompts of a per-prompt table (``ablation_sweep(..., per_prompt=True)``):
    one box per ``by`` group with every prompt as a point (hover names the prompt), in the order
    the groups first appear."""
    for column in (by, value, "prompt"):
        if column not in frame:
            raise ValueError(f"the table has no column {column!r}; it has {list(frame.columns)}")
    fig = go.Figure()
    for name, part in frame.groupby(by, sort=False):
        fig.add_trace(go.Box(y=part[value], name=str(name), boxpoints="all", jitter=0.4, pointpos=0,
                             customdata=part["prompt"],
                             hovertemplate="%{x}<br>prompt %{customdata}: %{y:.4f}<extra></extra>"))
    fig.update_layout(title=title or f"{value} per prompt", yaxis_title=units or value, showlegend=False,
                      template=_template(theme), height=380)
    return fig


def subplot_spacing(rows: int, cols: int, vertical: float = 0.12, horizontal: float = 0.08) -> tuple[float, float]:
    """(horizontal_spacing, vertical_spacing) for ``make_subplots`` with ``rows`` x ``cols`` panels:
    the wanted gaps, narrowed as the panels grow in number so that all the gaps of a direction
    together take at most 40% of the figure. Plotly refuses a gap of 1 / (n - 1) or more
    (``ValueError: Vertical spacing cannot be greater than (1 / (rows - 1))``), which a fixed gap
    reaches at 10 rows of 0.12; a single row or column has no gap to size (its wanted value is kept).
    """
    if rows < 1 or cols < 1:
        raise ValueError(f"a figure needs at least one row and one column of panels; got {rows} x {cols}")

    def fit(want: float, n: int) -> float:
        return want if n < 2 else min(want, 0.4 / (n - 1))

    return fit(horizontal, cols), fit(vertical, rows)


def layer_head_figure(frame: pd.DataFrame, value: str = "delta", title: str = "",
                      facet: Optional[str] = None, theme: Optional[str] = "default", units: Optional[str] = None,
                      clickable: bool = False, text: Optional[bool] = None, columns: Optional[int] = None,
                      row_gap: float = 0.12) -> go.Figure:
    """A layer x head heatmap of ``value`` (e.g. an ablation sweep's ``delta``, or head scores).

    With ``facet`` (a column such as ``method`` or ``kind``), one panel per value of it,
    ``columns`` panels to a row (default: all in one row). ``units`` titles the colour bar (default: the column name). ``text`` writes each cell's
    value in it at 10 px (default: when all panels of a row have at most 12 heads together). ``row_gap``: the space
    between rows of panels, a fraction of the height (room for ticks, an axis title and the next
    panel's title). ``clickable`` lays a
    scatter point on every cell: plotly heatmaps emit no selection events, scatter points
    do, so a click on a cell selects that point (its ``customdata`` is [layer, head, value])
    and a page can act on it; the points also carry the hover text.
    """
    for column in ("layer", "head", value) + ((facet,) if facet else ()):
        if column not in frame:
            raise ValueError(f"the table has no column {column!r}; it has {list(frame.columns)}")
    # Stacked with tables that have no heads, the columns turn float (NaN there): back to whole numbers.
    frame = frame[frame["head"] >= 0].astype({"layer": int, "head": int})
    panels = sorted(frame[facet].unique()) if facet else [None]
    per_row = min(len(panels), columns or len(panels))
    n_rows = -(-len(panels) // per_row)
    across, down = subplot_spacing(n_rows, per_row, vertical=row_gap, horizontal=0.08)
    fig = make_subplots(rows=n_rows, cols=per_row, subplot_titles=[str(p) for p in panels] if facet else None,
                        horizontal_spacing=across if per_row > 1 else 0.06,
                        vertical_spacing=down if n_rows > 1 else 0.12)
    diverging = bool((frame[value] < 0).any() and (frame[value] > 0).any())
    limit = float(frame[value].abs().max()) or 1.0
    # 10 px cell text needs about 30 px a cell: up to 12 cells across the figure (hover has them all).
    text = frame["head"].nunique() * per_row <= 12 if text is None else text
    hover = "%{y} %{x}<br>" + value + " %{z:.4f}" + (f" {units}" if units else "") + "<extra></extra>"
    for i, panel in enumerate(panels):
        r, c = i // per_row + 1, i % per_row + 1
        part = frame if panel is None else frame[frame[facet] == panel]
        grid = part.pivot_table(index="layer", columns="head", values=value, aggfunc="mean")
        xs, ys = [head_label(h) for h in grid.columns], [unit_label(l) for l in grid.index]
        fig.add_trace(go.Heatmap(
            z=grid.to_numpy(), x=xs, y=ys, coloraxis="coloraxis",
            texttemplate="%{z:.2f}" if text else None, textfont=dict(size=10),
            hovertemplate=hover, hoverinfo="skip" if clickable else None,
        ), row=r, col=c)
        if clickable:
            layers, heads = np.meshgrid(grid.index.to_numpy(), grid.columns.to_numpy(), indexing="ij")
            values = grid.to_numpy()
            fig.add_trace(go.Scatter(
                x=[head_label(h) for h in heads.ravel()], y=[unit_label(l) for l in layers.ravel()], mode="markers",
                # A list, not an array: plotly sends arrays as typed arrays, and a browser hands a
                # clicked point's row of one back as {"0": .., "1": ..} instead of a list.
                customdata=np.stack([layers.ravel(), heads.ravel(), values.ravel()], axis=-1).tolist(),
                marker=dict(symbol="square-open", size=22, color="white", line=dict(width=3), opacity=0),
                selected=dict(marker=dict(opacity=1)), unselected=dict(marker=dict(opacity=0)),
                hovertemplate="%{y} %{x}<br>" + value + " %{customdata[2]:.4f}" + (f" {units}" if units else "")
                              + "<br>click to ablate<extra></extra>",
                showlegend=False, name="cells",
            ), row=r, col=c)
    axis = dict(colorscale=DIVERGING, cmid=0, cmin=-limit, cmax=limit) if diverging else dict(colorscale=SEQUENTIAL)
    fig.update_layout(coloraxis={**axis, "colorbar": dict(title=units or value)}, title=title or value,
                      template=_template(theme))
    if n_rows > 2:  # many rows of panels: each keeps about 200 px instead of sharing plotly's default 450
        fig.update_layout(height=120 + 220 * n_rows)
    if clickable:
        # Every click lands on the nearest cell's point, wherever in the cell it is.
        fig.update_layout(hovermode="closest", hoverdistance=-1, clickmode="event+select", dragmode=False)
    fig.update_xaxes(title="head", type="category")
    fig.update_yaxes(autorange="reversed", type="category")
    for r in range(1, n_rows + 1):
        fig.update_yaxes(title="layer", row=r, col=1)
    return fig


def loss_curves(metrics: Union[str, Path, pd.DataFrame], title: str = "Loss", log_x: bool = False,
                theme: Optional[str] = "default", colours: Optional[dict] = None) -> go.Figure:
    """Train and validation loss against step, from ``metrics.csv`` (a path, a checkpoint
    directory, or its DataFrame: step, train_loss, val_loss, ...). A ``run`` column gives
    one pair of curves per run, in one colour per run (train solid, validation dashed);
    ``colours`` maps run names to colours (default: plotly's sequence)."""
    if not isinstance(metrics, pd.DataFrame):
        from workbench.training import read_metrics  # the one reader of metrics.csv, beside its writer

        metrics = read_metrics(metrics)
    if "step" not in metrics:
        raise ValueError(f"metrics need a 'step' column; got {list(metrics.columns)}")
    runs = metrics.groupby("run", sort=False) if "run" in metrics else [("", metrics)]
    fig = go.Figure()
    for i, (run, part) in enumerate(runs):
        colour = (colours or {}).get(run, PALETTE[i % len(PALETTE)])
        for column, dash in (("train_loss", "solid"), ("val_loss", "dash")):
            if column in part and part[column].notna().any():
                rows = part[part[column].notna()]
                name = f"{run} {column}".strip()
                fig.add_trace(go.Scatter(x=rows["step"], y=rows[column], mode="lines", name=name,
                                         line=dict(dash=dash, color=colour), legendgroup=str(run)))
    fig.update_layout(title=title, xaxis_title="step", yaxis_title="loss (nats)", template=_template(theme),
                      xaxis_type="log" if log_x else None)
    return fig


def token_loss_figure(losses: Union[pd.DataFrame, dict[str, pd.DataFrame]], title: str = "Per-token loss",
                      batch: Optional[int] = 0, theme: Optional[str] = "default", colours: Optional[dict] = None) -> go.Figure:
    """Bars of the loss of predicting each token, placed at the token predicted (``"4: cat"``).

    ``losses``: a ``token_losses`` table (bars green where the top prediction was right, red
    where not; hover names the token before and the prediction), or a dict name -> table of
    the same tokens (grouped bars, one colour per name: e.g. clean and ablated, or two models;
    ``colours`` maps names to colours, so a model keeps its colour across figures).
    """
    single = isinstance(losses, pd.DataFrame)
    fig = go.Figure()
    for i, (name, frame) in enumerate(({"": losses} if single else losses).items()):
        frame = _one_batch(frame, batch)
        x = unique_labels(frame["next_token"].tolist(), positions=(frame["pos"] + 1).tolist())
        if not single:
            fig.add_bar(x=x, y=frame["loss"], name=name, marker_color=(colours or {}).get(name, PAIR[i % 2]),
                        hovertemplate=f"{name}<br>" + "%{x}<br>loss %{y:.3f} nats<extra></extra>")
            continue
        fig.add_bar(x=x, y=frame["loss"], marker_color=np.where(frame["correct"], CORRECT, WRONG),
                    customdata=np.stack([frame["predicted"], frame["token"]], axis=-1),
                    hovertemplate="%{x}<br>loss %{y:.3f}<br>after %{customdata[1]!r}, "
                                  "top prediction %{customdata[0]!r}<extra></extra>")
    fig.update_layout(title=title, barmode="group", yaxis_title="loss (nats)", template=_template(theme),
                      xaxis_title="token predicted" + (" (green: top-1 correct)" if single else ""),
                      height=340, margin=dict(t=40, b=10))
    fig.update_xaxes(type="category", tickangle=-60)
    return fig


def residual_norms_figure(norms: pd.DataFrame, title: str = "Residual-stream norm", batch: Optional[int] = 0,
                          theme: Optional[str] = "default") -> go.Figure:
    """A ``residual_norms`` table: the norm at every position across layers (thin lines, hover
    names the token), and their mean (thick).

    All positions share one trace (None breaks the line between them): one trace per
    position made this figure slow to build for long prompts.
    """
    frame = _one_batch(norms, batch).sort_values(["pos", "layer"])
    order = frame.drop_duplicates("layer")["layer_label"].tolist()
    x, y, text = [], [], []
    for pos, part in frame.groupby("pos", sort=True):
        x += part["layer_label"].tolist() + [None]
        y += part["norm"].tolist() + [None]
        text += unique_labels([part["token"].iloc[0]], positions=[pos]) * (len(order) + 1)
    fig = go.Figure()
    fig.add_scatter(x=x, y=y, text=text, mode="lines", line=dict(width=1), opacity=0.35, name="each position",
                    hovertemplate="%{text}<br>%{x}: %{y:.2f}<extra></extra>")
    mean = frame.groupby("layer", as_index=False).agg(norm=("norm", "mean"), layer_label=("layer_label", "first"))
    fig.add_scatter(x=mean["layer_label"], y=mean["norm"], mode="lines+markers", line=dict(width=3), name="mean")
    fig.update_layout(title=title, yaxis_title="L2 norm", template=_template(theme), height=340, margin=dict(t=40))
    fig.update_xaxes(type="category", categoryorder="array", categoryarray=order)
    return fig


def side_by_side(left: go.Figure, right: go.Figure, titles: Optional[tuple[str, str]] = None,
                 theme: Optional[str] = "default") -> go.Figure:
    """Two figures in one row (e.g. a model clean and ablated, or two models)."""
    for source in (left, right):
        if any(getattr(trace, "xaxis", None) not in (None, "x") for trace in source.data):
            raise ValueError("side_by_side takes single-panel figures; this one has several subplots")
    titles = titles or tuple((f.layout.title.text or "") for f in (left, right))
    spacing = 0.28  # room for the left panel's colour bar and the right panel's tick labels
    fig = make_subplots(rows=1, cols=2, subplot_titles=titles, horizontal_spacing=spacing)
    for col, source in ((1, left), (2, right)):
        for trace in source.data:
            trace = go.Figure(trace).data[0]  # a copy, so the source figure is left alone
            if isinstance(trace, go.Heatmap) and trace.coloraxis is None:
                trace.update(colorbar=dict(x=0.5 - spacing / 2 + 0.01 if col == 1 else 1.0, len=0.9, thickness=12))
            if isinstance(trace, go.Heatmap) and trace.coloraxis is not None:
                axis = source.layout.coloraxis
                trace.update(coloraxis=None, colorscale=axis.colorscale, zmin=axis.cmin, zmax=axis.cmax,
                             showscale=col == 2)
            fig.add_trace(trace, row=1, col=col)
        fig.update_xaxes(title=source.layout.xaxis.title.text, row=1, col=col)
        fig.update_yaxes(title=source.layout.yaxis.title.text, autorange=source.layout.yaxis.autorange, row=1, col=col)
    named = any(trace.name for trace in fig.data)
    fig.update_layout(template=_template(theme), showlegend=named)
    return fig


# ---- sparse dictionary features (tables from workbench.analysis.features) -----------------------
def feature_contexts_figure(contexts: pd.DataFrame, theme: Optional[str] = "default") -> go.Figure:
    """Max-activating contexts, one row each: every token coloured by the feature's activation there.

    Takes ``max_activating_contexts``' table; the activating token is in ``[[ ]]``.
    """
    for column in ("context_tokens", "context_acts", "context_max", "activation"):
        if column not in contexts:
            raise ValueError(f"the table has no column {column!r}; pass max_activating_contexts' table")
    if contexts.empty:
        raise ValueError("no contexts: the feature never fired on these tokens")
    width = max(len(t) for t in contexts["context_tokens"])
    z = np.full((len(contexts), width), np.nan)
    text = np.full((len(contexts), width), "", dtype=object)
    for r, (tokens, acts, at) in enumerate(zip(contexts["context_tokens"], contexts["context_acts"], contexts["context_max"])):
        z[r, : len(acts)] = acts
        text[r, : len(tokens)] = [f"[[{t.strip()}]]" if i == at else t.strip() for i, t in enumerate(tokens)]
    # Each row's label: its rank and the feature's activation at its [[token]] (what orders the rows).
    labels = [f"#{rank}: {act:.2f}" for rank, act in zip(contexts["rank"], contexts["activation"])]
    text = np.vectorize(lambda t: t.replace("\n", "⏎"), otypes=[object])(text)
    fig = go.Figure(go.Heatmap(
        z=z, text=text, texttemplate="%{text}", textfont=dict(size=11), x=list(range(width)), y=labels,
        colorscale="Oranges", zmin=0,
        hovertemplate="%{text}<br>activation %{z:.3f}<extra></extra>", colorbar=dict(title="activation"),
    ))
    feature = contexts["feature"].iloc[0] if "feature" in contexts else ""
    fig.update_layout(title=f"Feature {feature}: max-activating contexts", template=_template(theme),
                      height=max(250, 32 * len(contexts) + 120))
    fig.update_xaxes(showticklabels=False, title="token (the context around the activating [[token]])")
    fig.update_yaxes(autorange="reversed", type="category", title="rank: max activation")
    return fig


def feature_histogram_figure(histogram: pd.DataFrame, theme: Optional[str] = "default") -> go.Figure:
    """The activation histogram of one feature (``feature_histogram``'s table), its density in the title."""
    for column in ("bin_left", "bin_right", "count", "density"):
        if column not in histogram:
            raise ValueError(f"the table has no column {column!r}; pass feature_histogram's table")
    centers = (histogram["bin_left"] + histogram["bin_right"]) / 2
    fig = go.Figure(go.Bar(x=centers, y=histogram["count"], width=histogram["bin_right"] - histogram["bin_left"],
                           marker_color=POSITIVE, hovertemplate="activation %{x:.3f}<br>count %{y}<extra></extra>"))
    feature = histogram["feature"].iloc[0] if "feature" in histogram else ""
    fig.update_layout(title=f"Feature {feature}: activations when firing (density {histogram['density'].iloc[0]:.2%})",
                      xaxis_title="activation", yaxis_title="positions", template=_template(theme), bargap=0.02)
    return fig


def feature_logits_figure(effects: pd.DataFrame, theme: Optional[str] = "default") -> go.Figure:
    """Top and bottom logit effects of one feature (``feature_logit_effects``' table) as horizontal bars."""
    for column in ("direction", "token", "effect"):
        if column not in effects:
            raise ValueError(f"the table has no column {column!r}; pass feature_logit_effects' table")
    top = effects[effects["direction"] == "top"].sort_values("effect")
    bottom = effects[effects["direction"] == "bottom"].sort_values("effect", ascending=False)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("suppressed", "promoted"), horizontal_spacing=0.2)
    fig.add_trace(go.Bar(x=bottom["effect"], y=unique_labels(bottom["token"].tolist()), orientation="h",
                         marker_color=NEGATIVE, hovertemplate="%{y}: %{x:.3f}<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Bar(x=top["effect"], y=unique_labels(top["token"].tolist()), orientation="h",
                         marker_color=POSITIVE, hovertemplate="%{y}: %{x:.3f}<extra></extra>"), row=1, col=2)
    feature = effects["feature"].iloc[0] if "feature" in effects and len(effects) else ""
    fig.update_layout(title=f"Feature {feature}: logit effects (decoder direction through W_U)", showlegend=False,
                      template=_template(theme))
    return fig


def feature_density_figure(table: pd.DataFrame, theme: Optional[str] = "default") -> go.Figure:
    """How often the features fire: a histogram of log10 density over ``feature_table``'s rows (dead ones counted apart)."""
    if "density" not in table:
        raise ValueError(f"the table has no column 'density'; it has {list(table.columns)}")
    density = table["density"].to_numpy(dtype=float)
    alive = density[density > 0]
    fig = go.Figure(go.Histogram(x=np.log10(alive), nbinsx=40, marker_color=POSITIVE,
                                 hovertemplate="log10 density %{x}<br>features %{y}<extra></extra>"))
    fig.update_layout(title=f"Feature density ({len(density) - len(alive)} of {len(density)} never fired)",
                      xaxis_title="log10(fraction of tokens where the feature fires)", yaxis_title="features",
                      template=_template(theme))
    return fig


def feature_dla_figure(dla: pd.DataFrame, feature: Optional[int] = None, k: int = 12, batch: int = 0, title: str = "",
                       theme: Optional[str] = "default") -> go.Figure:
    """The ``k`` features with the largest |direct logit attribution| (``feature_dla``'s table, one
    batch row) as bars, ``feature`` highlighted (and added when it is not among the ``k``)."""
    for column in ("feature", "dla", "activation"):
        if column not in dla:
            raise ValueError(f"the table has no column {column!r}; pass feature_dla's table")
    frame = dla[dla["batch"] == batch] if "batch" in dla else dla
    shown = frame.reindex(frame["dla"].abs().sort_values(ascending=False).index).head(k)
    if feature is not None and feature not in set(shown["feature"]):
        shown = pd.concat([shown, frame[frame["feature"] == feature]])
    shown = shown.sort_values("dla")
    chosen = shown["feature"].to_numpy() == feature
    colours = np.where(chosen, LAST_POSITION, np.where(shown["dla"] >= 0, POSITIVE, NEGATIVE))
    fig = go.Figure(go.Bar(x=shown["dla"], y=[f"#{f}" for f in shown["feature"]], orientation="h",
                           marker_color=colours, customdata=shown["activation"],
                           hovertemplate="feature %{y}<br>DLA %{x:.3f}<br>activation %{customdata:.3f}<extra></extra>"))
    fig.update_layout(title=title or "Direct logit attribution of the firing features", template=_template(theme),
                      xaxis_title="direct logit attribution (logit units)", yaxis_title="feature",
                      height=max(260, 24 * len(shown) + 120), margin=dict(t=40))
    fig.update_yaxes(type="category")
    return fig


def token_values_figure(frame: pd.DataFrame, value: str, group: Optional[str] = None, title: str = "",
                        boundary: Optional[int] = None, units: str = "", theme: Optional[str] = "default",
                        colours: Optional[dict] = None) -> go.Figure:
    """A value per token (``project``'s projection, a feature's activation), one line per ``group``
    (e.g. clean and steered runs) against the position, each point hovering its token.
    ``boundary``: the first generated position, marked by a dashed line."""
    for column in ("pos", "token", value) + ((group,) if group else ()):
        if column not in frame:
            raise ValueError(f"the table has no column {column!r}; it has {list(frame.columns)}")
    fig = go.Figure()
    parts = frame.groupby(group, sort=False) if group else [("", frame)]
    for i, (name, part) in enumerate(parts):
        part = part.sort_values("pos")
        colour = (colours or {}).get(name, PAIR[i % 2] if group else POSITIVE)
        fig.add_scatter(x=part["pos"], y=part[value], mode="lines+markers", name=str(name), line=dict(color=colour),
                        text=part["token"].astype(str), hovertemplate=(f"{name}<br>" if group else "")
                        + "%{x}: %{text!r}<br>" + f"{value} " + "%{y:.3f}<extra></extra>")
    if boundary is not None:
        fig.add_vline(x=boundary - 0.5, line_dash="dash", line_color="#7f7f7f",
                      annotation_text="generated →", annotation_position="top right")
    fig.update_layout(title=title or value, template=_template(theme), xaxis_title="position",
                      yaxis_title=value + (f" ({units})" if units else ""), height=340, margin=dict(t=40),
                      showlegend=bool(group))
    return fig


# ---- over training (tables from analysis.over_training) ----------------------------------------
def _history_of(frame: pd.DataFrame, history: Optional[pd.DataFrame]) -> pd.DataFrame:
    history = frame.attrs.get("history") if history is None else history
    if isinstance(history, dict):  # over_training keeps the curve as columns (see there)
        history = pd.DataFrame(history)
    return history if isinstance(history, pd.DataFrame) else pd.DataFrame(columns=["step"])


def over_training_figure(frame: pd.DataFrame, value: Union[str, list, None] = None,
                         history: Optional[pd.DataFrame] = None, losses: Optional[pd.DataFrame] = None,
                         title: str = "", theme: str = "light") -> go.Figure:
    """A metric against training step above the loss curve, on one shared step axis.

    ``frame`` is ``analysis.over_training``'s table. With ``layer`` and ``head`` columns (head
    scores), each line is the best head at each step, one line per ``kind`` (hover names the
    head); otherwise one line per ``value`` column (default: ``score``, else every numeric
    column). The lower panel draws the run's loss curve (``history``, default the one
    ``over_training`` attached) and any columns of ``losses`` (a table with a ``step`` column,
    e.g. the loss on repeated tokens measured at each snapshot).
    """
    if "step" not in frame:
        raise ValueError(f"the table has no 'step' column (make it with analysis.over_training); it has {list(frame.columns)}")
    per_head = {"layer", "head"} <= set(frame.columns)
    skip = {"step", "layer", "head", "batch"}
    if value is None:
        value = "score" if "score" in frame else [c for c in frame.columns
                                                   if c not in skip and pd.api.types.is_numeric_dtype(frame[c])]
    values = [value] if isinstance(value, str) else list(value)
    for column in values:
        if column not in frame:
            raise ValueError(f"the table has no column {column!r}; it has {list(frame.columns)}")
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.6, 0.4], vertical_spacing=0.06)
    for column in values:
        groups = frame.groupby("kind", sort=False) if per_head and "kind" in frame else [(column, frame)]
        for name, part in groups:
            if per_head:  # the best head at each step, and which one it is
                best = part.loc[part.groupby("step")[column].idxmax()].sort_values("step")
                label = [f"L{l}H{h}" for l, h in zip(best["layer"], best["head"])]
                fig.add_trace(go.Scatter(x=best["step"], y=best[column], mode="lines+markers", name=f"{name} (best head)",
                                         text=label, hovertemplate="step %{x}<br>%{text}: %{y:.3f}<extra>" + str(name) + "</extra>"),
                              row=1, col=1)
            else:
                part = part.groupby("step", as_index=False)[column].mean()
                fig.add_trace(go.Scatter(x=part["step"], y=part[column], mode="lines+markers", name=column), row=1, col=1)
    curve = _history_of(frame, history)
    for column, dash in (("train_loss", "solid"), ("val_loss", "dot")):
        if column in curve and curve[column].notna().any():
            rows = curve[curve[column].notna()]
            fig.add_trace(go.Scatter(x=rows["step"], y=rows[column], mode="lines", name=column,
                                     line=dict(dash=dash, width=1.5)), row=2, col=1)
    for column in ([] if losses is None else [c for c in losses.columns if c != "step"]):
        rows = losses[losses[column].notna()]
        fig.add_trace(go.Scatter(x=rows["step"], y=rows[column], mode="lines+markers", name=column), row=2, col=1)
    fig.update_yaxes(title_text=values[0] if len(values) == 1 else "value", row=1, col=1)
    fig.update_yaxes(title_text="loss", row=2, col=1)
    fig.update_xaxes(title_text="training step", row=2, col=1)
    fig.update_layout(title=title or f"{', '.join(values)} over training", template=_template(theme),
                      hovermode="x unified", height=560)
    return fig


def layer_head_over_training(frame: pd.DataFrame, value: str = "score", title: str = "",
                             theme: str = "light") -> go.Figure:
    """A layer x head heatmap of ``value`` per training step, with a slider over the steps.

    ``frame`` is ``analysis.over_training(series, analysis.head_scores, ...)``'s table; with a
    ``kind`` column, one panel per kind. The colour scale is fixed across steps, so a head
    that lights up is one that changed.
    """
    for column in ("step", "layer", "head", value):
        if column not in frame:
            raise ValueError(f"the table has no column {column!r}; it has {list(frame.columns)}")
    kinds = list(dict.fromkeys(frame["kind"])) if "kind" in frame else [None]
    steps = sorted(frame["step"].unique())
    fig = make_subplots(rows=1, cols=len(kinds), subplot_titles=[str(k) for k in kinds] if kinds[0] else None,
                        horizontal_spacing=subplot_spacing(1, len(kinds))[0])
    for i, step in enumerate(steps):
        for c, kind in enumerate(kinds, 1):
            part = frame[(frame["step"] == step) & ((frame["kind"] == kind) if kind is not None else True)]
            grid = part.pivot_table(index="layer", columns="head", values=value, aggfunc="mean")
            fig.add_trace(go.Heatmap(z=grid.to_numpy(), x=[f"H{h}" for h in grid.columns],
                                     y=[f"L{l}" for l in grid.index], coloraxis="coloraxis", visible=i == 0,
                                     hovertemplate=f"step {step}<br>" + "%{y} %{x}<br>" + value
                                                   + " %{z:.3f}<extra></extra>"), row=1, col=c)
    n = len(kinds)
    slider = [dict(method="update", label=str(step),
                   args=[{"visible": [j // n == i for j in range(len(steps) * n)]}, {"title.text": f"{title or value} at step {step}"}])
              for i, step in enumerate(steps)]
    low, high = float(frame[value].min()), float(frame[value].max())
    fig.update_layout(coloraxis=dict(colorscale=SEQUENTIAL, cmin=min(0.0, low), cmax=max(high, 1e-9),
                                     colorbar=dict(title=value)),
                      sliders=[dict(active=0, steps=slider, currentvalue=dict(prefix="step "), pad=dict(t=40))],
                      title=f"{title or value} at step {steps[0]}" if steps else title, template=_template(theme))
    fig.update_yaxes(autorange="reversed")
    return fig


# ---- circuits --------------------------------------------------------------------------------------
INPUT_COLOURS = {"q": "#2f6db5", "k": "#d1495b", "v": "#2ca02c", "mlp": "#9467bd", "logits": "#7f7f7f"}


def _circuit_position(label: str, n_layers: int, n_heads: int) -> tuple[float, float]:
    """Where a node sits: layers left to right (heads of layer l at 2l+1, its MLP half a step on),
    heads top to bottom, the MLP below them, embed and logits at the ends."""
    from workbench.analysis.common import parse_unit  # here, not at the top: this section is appended

    if label == "embed":
        return 0.0, (n_heads - 1) / 2
    if label == "logits":
        return 2.0 * n_layers + 1, (n_heads - 1) / 2
    layer, head, part = parse_unit(label)
    if head is not None:
        return 2.0 * layer + 1, float(head)
    return 2.0 * layer + 1.6, float(n_heads)


EDGE_BEND = 0.35  # how far apart (in heads) the middles of two edges between the same two nodes are drawn


def _edge_bends(edges: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(each edge's bend, whether it shares both ends with another edge): bend 0 for an edge alone
    between its two nodes; edges that share both ends (a head's q, k and v inputs from one sender,
    the K-composition among them) fan out EDGE_BEND apart, in the order q, k, v, MLP, logits, so
    none is drawn over another (the middle one of an odd count stays straight)."""
    order = {kind: j for j, kind in enumerate(INPUT_COLOURS)}
    groups: dict[tuple[str, str], list[int]] = {}
    for i in range(len(edges)):
        groups.setdefault((edges["sender"].iloc[i], edges["receiver"].iloc[i].split(".")[0]), []).append(i)
    bends, shared = np.zeros(len(edges)), np.zeros(len(edges), dtype=bool)
    for members in groups.values():
        shared[members] = len(members) > 1
        members = sorted(members, key=lambda i: order.get(edges["input"].iloc[i], len(order)))
        for j, i in enumerate(members):
            bends[i] = (j - (len(members) - 1) / 2) * EDGE_BEND
    return bends, shared


def _bent_edge(start: tuple[float, float], end: tuple[float, float], bend: float, points: int = 21):
    """(xs, ys) of the quadratic curve from ``start`` to ``end`` whose middle sits ``bend`` off the
    straight line (to its left, going from start to end); a straight line for bend 0."""
    (x0, y0), (x1, y1) = start, end
    if not bend:
        return [x0, x1], [y0, y1]
    length = float(np.hypot(x1 - x0, y1 - y0)) or 1.0
    nx, ny = -(y1 - y0) / length, (x1 - x0) / length
    cx, cy = (x0 + x1) / 2 + 2 * bend * nx, (y0 + y1) / 2 + 2 * bend * ny  # the curve's middle: half way to this
    t = np.linspace(0.0, 1.0, points)
    xs = (1 - t) ** 2 * x0 + 2 * (1 - t) * t * cx + t ** 2 * x1
    ys = (1 - t) ** 2 * y0 + 2 * (1 - t) * t * cy + t ** 2 * y1
    return xs.tolist(), ys.tolist()


def _middle(values: list) -> float:
    """The middle point's coordinate of a line drawn through ``values`` (an odd count has one)."""
    n = len(values)
    return float(values[n // 2]) if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def circuit_figure(edges: pd.DataFrame, title: str = "Circuit", theme: str = "light") -> go.Figure:
    """A circuit as a layered graph, from ``Circuit.to_frame()`` (or any table with sender, receiver,
    input and, optionally, score columns: line width follows |score|).

    Nodes sit by layer (left to right) and head (top to bottom); an edge's colour names the input it
    feeds (a head's q, k or v, an MLP, the logits), so K-composition reads as a red line between two
    heads. Every head of the model is drawn faintly when the table's ``attrs`` give n_layers and n_heads.
    Edges between the same two nodes (a head's q, k and v from one sender) are bent apart and each
    is named on its curve.
    """
    missing = [c for c in ("sender", "receiver", "input") if c not in edges]
    if missing:
        raise ValueError(f"the table needs columns sender, receiver and input (Circuit.to_frame()); missing {missing}")
    layers = [int(v) for v in pd.concat([edges.get("sender_layer", pd.Series(dtype=int)),
                                         edges.get("receiver_layer", pd.Series(dtype=int))]) if v >= 0]
    heads = [int(v) for v in pd.concat([edges.get("sender_head", pd.Series(dtype=int)),
                                        edges.get("receiver_head", pd.Series(dtype=int))]) if v >= 0]
    n_layers = int(edges.attrs.get("n_layers", max(layers, default=0) + 1))
    n_heads = int(edges.attrs.get("n_heads", max(heads, default=0) + 1))
    score = edges["score"].abs().fillna(0.0).to_numpy() if "score" in edges else np.zeros(len(edges))
    top = score.max() if len(score) and score.max() > 0 else 1.0
    fig = go.Figure()
    if "n_layers" in edges.attrs:
        xs, ys = zip(*[(2.0 * l + 1, float(h)) for l in range(n_layers) for h in range(n_heads)])
        fig.add_scatter(x=xs, y=ys, mode="markers", marker=dict(size=9, color="rgba(128,128,128,0.25)"),
                        hoverinfo="skip", showlegend=False)
    ends = [(_circuit_position(edges["sender"].iloc[i], n_layers, n_heads),
             _circuit_position(edges["receiver"].iloc[i].split(".")[0], n_layers, n_heads)) for i in range(len(edges))]
    bends, shared = _edge_bends(edges)
    curves = [_bent_edge(a, b, bend) for (a, b), bend in zip(ends, bends)]
    for kind, colour in INPUT_COLOURS.items():
        part = np.nonzero((edges["input"] == kind).to_numpy())[0]
        if not len(part):
            continue
        for i in part:  # one line per edge: widths differ
            xs, ys = curves[i]
            fig.add_scatter(x=xs, y=ys, mode="lines", line=dict(color=colour, width=1 + 5 * score[i] / top),
                            legendgroup=kind, name=kind, showlegend=bool(i == part[0]), hoverinfo="skip")
            if shared[i]:  # edges drawn apart between the same two nodes are each named on their line
                fig.add_annotation(x=_middle(xs), y=_middle(ys), text=kind, showarrow=False, font=dict(size=10, color=colour),
                                   bgcolor="rgba(255,255,255,0.8)", borderpad=0)
        mids = [(_middle(curves[i][0]), _middle(curves[i][1])) for i in part]
        text = [f"{edges['sender'].iloc[i]} -> {edges['receiver'].iloc[i]}"
                + (f"<br>score {edges['score'].iloc[i]:.4g}" if "score" in edges else "") for i in part]
        fig.add_scatter(x=[m[0] for m in mids], y=[m[1] for m in mids], mode="markers", text=text,
                        marker=dict(size=8, color=colour, opacity=0.01), legendgroup=kind, showlegend=False,
                        hovertemplate="%{text}<extra></extra>")
    nodes = list(dict.fromkeys([*edges["sender"], *(r.split(".")[0] for r in edges["receiver"])]))
    points = [_circuit_position(label, n_layers, n_heads) for label in nodes]
    fig.add_scatter(x=[p[0] for p in points], y=[p[1] for p in points], mode="markers", text=nodes,
                    marker=dict(size=14, color="#444", line=dict(width=1, color="white")),
                    showlegend=False, hovertemplate="%{text}<extra></extra>")
    # Labels as annotations on a pale box: plotly draws them above every trace, so no edge runs
    # through a node's name (a trace's own text sits among the lines).
    for label, (x, y) in zip(nodes, points):
        fig.add_annotation(x=x, y=y, text=label, showarrow=False, yshift=15, font=dict(size=11, color="#222"),
                           bgcolor="rgba(255,255,255,0.85)", borderpad=1)
    ticks = [0.0, *(2.0 * l + 1 for l in range(n_layers)), 2.0 * n_layers + 1]
    fig.update_xaxes(tickvals=ticks, ticktext=["embed", *(f"L{l}" for l in range(n_layers)), "logits"],
                     showgrid=False, zeroline=False)
    fig.update_yaxes(autorange="reversed", showticklabels=False, showgrid=False, zeroline=False)
    fig.update_layout(title=title, template=_template(theme), height=360 + 20 * n_heads, margin=dict(t=50),
                      legend_title_text="input")
    return fig


def circuit_benchmark_figure(results: pd.DataFrame, value: str = "edge_auroc", title: str = "",
                             theme: str = "light") -> go.Figure:
    """A method x model heatmap of one column of the circuit benchmark's table (values written in)."""
    missing = [c for c in ("model", "method", value) if c not in results]
    if missing:
        raise ValueError(f"the table needs columns model, method and {value!r}; missing {missing}")
    grid = results.pivot_table(index="method", columns="model", values=value, aggfunc="first", sort=False)
    fig = go.Figure(go.Heatmap(z=grid.to_numpy(), x=list(grid.columns), y=list(grid.index), zmin=0, zmax=1,
                               colorscale=SEQUENTIAL, text=np.round(grid.to_numpy(), 3), texttemplate="%{text}",
                               hovertemplate="%{y} on %{x}: %{z:.4f}<extra></extra>", colorbar=dict(title=value)))
    fig.update_layout(title=title or value, template=_template(theme), height=120 + 45 * len(grid),
                      margin=dict(t=50))
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(type="category")
    return fig


_SCRIPT_SRC = re.compile(r"""<script([^>]*?)\ssrc=["']([^"':]+?)["']([^>]*)>\s*</script>""", re.IGNORECASE)


def self_contained_html(html: str, folder: Union[str, Path]) -> str:
    """An HTML figure with the scripts it loads by a relative path written into the page.

    ``fig.write_html(..., include_plotlyjs="directory")`` (what the experiments write) loads
    ``plotly.min.js`` from next to the file; shown from a string (an iframe's ``srcdoc``),
    the page has no directory and draws nothing. Each ``<script src="NAME">`` naming a
    file directly in ``folder`` is inlined; ``plotly.min.js`` missing there is plotly's own
    bundle. Absolute URLs, other paths, and paths that leave ``folder`` are left as they are.
    """
    folder = Path(folder)

    def inline(match: re.Match) -> str:
        before, name, after = match.groups()
        if "/" in name or "\\" in name or name.startswith("."):
            return match.group(0)
        path = folder / name
        if path.is_file() and not path.is_symlink():
            code = path.read_text(encoding="utf-8", errors="replace")
        elif name == "plotly.min.js":
            from plotly.offline import get_plotlyjs

            code = get_plotlyjs()
        else:
            return match.group(0)
        # A script body ends at the first "</script"; escape any inside the code so it stays whole.
        code = re.sub(r"</(script)", r"<\\/\1", code, flags=re.IGNORECASE)
        return f"<script{before}{after}>{code}</script>"

    return _SCRIPT_SRC.sub(inline, html)


def figure_from_html(html: str) -> Optional[go.Figure]:
    """The figure inside an HTML file plotly wrote (``fig.write_html``), or None when the page
    holds anything other than exactly one ``Plotly.newPlot`` call with literal JSON arguments.

    A page can then draw the figure natively (in its own theme, without loading plotly.js
    a second time) and fall back to ``self_contained_html`` in an iframe for anything else.
    """
    calls = [m.end() for m in re.finditer(r"Plotly\.newPlot\(", html)]
    if len(calls) != 1:
        return None
    decoder, at, args = json.JSONDecoder(), calls[0], []
    try:
        for _ in range(3):  # the div id, the data, the layout
            while html[at] in " \t\r\n,":
                at += 1
            value, at = decoder.raw_decode(html, at)
            args.append(value)
        _, data, layout = args
        if not isinstance(data, list) or not isinstance(layout, dict):
            return None
        return go.Figure(data=data, layout=layout)
    except (ValueError, IndexError, TypeError):  # not literal JSON there, or not a figure plotly accepts
        return None


def table_chart(table: pd.DataFrame, x: str, y: str, color: Optional[str] = None, kind: str = "bar",
                theme: Optional[str] = "default") -> tuple[go.Figure, str]:
    """A bar, line or scatter chart of ``y`` against ``x`` (one trace per ``color`` value),
    and a note for the reader ("" when there is nothing to say).

    Bars never stack silently: where several rows share an x (and colour), each bar is
    their mean and the note says how many rows each bar averages; lines are drawn through
    the means the same way; a scatter shows every row.
    """
    check_choice("kind", kind, ("bar", "line", "scatter"))
    for column in (x, y) + ((color,) if color else ()):
        if column not in table:
            raise ValueError(f"the table has no column {column!r}; it has {list(table.columns)}")
    keys = [x] + ([color] if color and color != x else [])
    note = ""
    frame = table[keys + [y]].dropna(subset=[y])
    if kind != "scatter":
        counts = frame.groupby(keys, sort=False, dropna=False)[y].transform("size")
        if (counts > 1).any():
            most = int(counts.max())
            note = (f"Several rows share each {' and '.join(keys)} (up to {most}): each "
                    f"{'bar' if kind == 'bar' else 'point'} is their mean. Pick a colour column or filter "
                    "the rows to split them.")
            frame = frame.groupby(keys, sort=False, dropna=False, as_index=False)[y].mean()
    groups = frame.groupby(color, sort=False) if color else [(None, frame)]
    fig = go.Figure()
    for name, part in groups:
        label = None if name is None else str(name)
        if kind == "bar":
            fig.add_bar(x=part[x], y=part[y], name=label)
        else:
            fig.add_scatter(x=part[x], y=part[y], name=label, mode="lines+markers" if kind == "line" else "markers")
    fig.update_layout(barmode="group", template=_template(theme), xaxis_title=x, yaxis_title=y,
                      showlegend=color is not None, legend_title=color)
    return fig, note


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


# ---- the vocabulary (tables from analysis.vocab) ------------------------------------------------
def direct_path_figure(path: pd.DataFrame, token: str = "", theme: Optional[str] = "default") -> go.Figure:
    """Horizontal bars of the next tokens the direct path after ``token`` promotes (blue) and
    demotes (red), from ``analysis.direct_path``: logit minus the vocabulary's mean."""
    frame = path.sort_values("centred_logit")
    fig = go.Figure(go.Bar(
        x=frame["centred_logit"], y=[f"{t!r} ({i})" for t, i in zip(frame["token"], frame["id"])], orientation="h",
        marker_color=[POSITIVE if v >= 0 else NEGATIVE for v in frame["centred_logit"]],
        hovertemplate="%{y}: %{x:.3f} logits above the mean<extra></extra>"))
    fig.update_layout(title=f"Direct path after {token!r}: next tokens promoted and demoted", template=_template(theme),
                      xaxis_title="logit − mean logit (logits)", yaxis_title="next token",
                      height=max(300, 22 * len(frame) + 120), margin=dict(l=10))
    return fig


def neighbours_figure(neighbours: pd.DataFrame, token: str = "", space: str = "embed",
                      theme: Optional[str] = "default") -> go.Figure:
    """Bars of cosine similarity to ``token`` for its nearest tokens, from ``analysis.token_neighbours``."""
    frame = neighbours.sort_values("cosine")
    fig = go.Figure(go.Bar(x=frame["cosine"], y=[f"{t!r} ({i})" for t, i in zip(frame["token"], frame["id"])],
                           orientation="h", marker_color=PAIR[0],
                           hovertemplate="%{y}: cosine %{x:.3f}<extra></extra>"))
    fig.update_layout(title=f"Nearest tokens to {token!r} ({space}ding)", template=_template(theme),
                      xaxis_title="cosine similarity", yaxis_title="token", xaxis_range=[min(0.0, float(frame.cosine.min())), 1],
                      height=max(300, 22 * len(frame) + 120), margin=dict(l=10))
    return fig


# ---- the Training and Circuit pages (a step marked on any figure, runs compared, clickable circuits) ----
STEP_MARK = "#e377c2"


def live_loss_figure(history: list[dict], total_steps: int, max_points: int = 400,
                     theme: Optional[str] = "default", chance: Optional[float] = None) -> go.Figure:
    """The loss of a run in progress: ``history`` rows (``step``, ``train_loss``) on an x axis of
    the whole run (0 to ``total_steps``) from the first point, lines and markers so one point shows,
    at most ``max_points`` drawn (evenly thinned; the last row always). ``chance`` (ln of the
    vocabulary: a uniform guess, where an untrained model starts) is drawn as a dashed line, so a
    curve that has not left it reads as a model that has learned nothing yet."""
    if not history:
        raise ValueError("no rows yet: draw the figure once the run has logged a step")
    every = -(-len(history) // max_points)
    rows = history[::every] + ([history[-1]] if (len(history) - 1) % every else [])
    fig = go.Figure(go.Scatter(x=[r["step"] for r in rows], y=[r["train_loss"] for r in rows],
                               mode="lines+markers" if len(rows) < 60 else "lines", name="train loss",
                               hovertemplate="step %{x}<br>loss %{y:.4f}<extra></extra>"))
    fig.update_xaxes(title="step", range=[0, max(1, total_steps)], tickformat="d")
    fig.update_yaxes(title="train loss (nats)", rangemode="tozero")
    if chance is not None:
        fig.add_hline(y=chance, line=dict(color="#7f7f7f", dash="dash", width=1),
                      annotation_text=f"chance (uniform guess): {chance:.2f}", annotation_position="bottom right")
    fig.update_layout(title=f"Training loss, step {history[-1]['step']} of {total_steps}", height=280,
                      template=_template(theme), margin=dict(t=40, b=40))
    return fig


def thin_ticks(fig: go.Figure, max_labels: int = 16, axis: str = "x") -> go.Figure:
    """Label every k-th category of the figure's ``axis`` axes so at most ``max_labels`` show (for a
    figure drawn in a narrow column, where every token's label would pile onto its neighbours);
    every category keeps its hover."""
    for ax in fig.select_xaxes() if axis == "x" else fig.select_yaxes():
        values = list(ax.tickvals) if ax.tickvals is not None else None
        if not values or len(values) <= max_labels:
            continue
        step = -(-len(values) // max_labels)
        texts = list(ax.ticktext) if ax.ticktext is not None else values
        ax.update(tickvals=values[::step], ticktext=texts[::step])
    return fig


def mark_step(fig: go.Figure, step: Union[int, float], label: Optional[str] = None) -> go.Figure:
    """``fig`` with a dashed vertical line at ``step`` on its x axis, through every row of a
    figure whose rows share that axis (the loss curve under a score over training)."""
    fig.add_shape(type="line", xref="x", yref="paper", x0=step, x1=step, y0=0, y1=1,
                  line=dict(color=STEP_MARK, width=2, dash="dash"))
    fig.add_annotation(x=step, xref="x", y=1, yref="paper", yanchor="bottom", showarrow=False,
                       text=label if label is not None else f"step {step}", font=dict(color=STEP_MARK))
    return fig


def _best_per_step(frame: pd.DataFrame, value: str) -> pd.DataFrame:
    """The row of the highest ``value`` at each step (the best head, for per-head tables)."""
    return frame.loc[frame.groupby("step")[value].idxmax()].sort_values("step")


def runs_over_training_figure(tables: dict, value: str = "score", step: Union[int, float, None] = None, title: str = "",
                              theme: str = "light") -> go.Figure:
    """Several runs' ``over_training`` tables on one step axis: per run and ``kind``, the best
    head's ``value`` at each step (one colour per run, one dash per kind) above each run's
    training loss (from the tables' ``attrs["history"]``); ``step`` is marked when given."""
    if not tables:
        raise ValueError("tables is empty: pass {run name: over_training table}")
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.6, 0.4], vertical_spacing=0.06)
    dashes = ("solid", "dash", "dot", "dashdot")
    for i, (run, frame) in enumerate(tables.items()):
        for column in ("step", "layer", "head", value):
            if column not in frame:
                raise ValueError(f"the table of {run!r} has no column {column!r}; it has {list(frame.columns)}")
        colour = PALETTE[i % len(PALETTE)]
        groups = frame.groupby("kind", sort=False) if "kind" in frame else [(value, frame)]
        for j, (kind, part) in enumerate(groups):
            best = _best_per_step(part, value)
            fig.add_trace(go.Scatter(x=best["step"], y=best[value], mode="lines+markers", name=f"{run}: {kind}",
                                     line=dict(color=colour, dash=dashes[j % len(dashes)]), legendgroup=run,
                                     text=[f"L{l}H{h}" for l, h in zip(best["layer"], best["head"])],
                                     hovertemplate="step %{x}<br>%{text}: %{y:.3f}<extra>" + f"{run}: {kind}</extra>"),
                          row=1, col=1)
        curve = _history_of(frame, None)
        if "train_loss" in curve and curve["train_loss"].notna().any():
            rows = curve[curve["train_loss"].notna()]
            fig.add_trace(go.Scatter(x=rows["step"], y=rows["train_loss"], mode="lines", name=f"{run}: train_loss",
                                     line=dict(color=colour, width=1.5), legendgroup=run), row=2, col=1)
    fig.update_yaxes(title_text=f"best head's {value}", row=1, col=1)
    fig.update_yaxes(title_text="loss", row=2, col=1)
    fig.update_xaxes(title_text="training step", row=2, col=1)
    fig.update_layout(title=title or f"{value} over training, {len(tables)} runs aligned by step",
                      template=_template(theme), hovermode="x unified", height=560)
    return mark_step(fig, step) if step is not None else fig


def circuit_graph_figure(edges: pd.DataFrame, title: str = "Circuit", selected: Optional[str] = None,
                         theme: str = "light") -> go.Figure:
    """``circuit_figure`` whose nodes can be clicked: each node point carries its label as
    ``customdata`` (what a page's selection event returns), and ``selected`` is ringed."""
    fig = circuit_figure(edges, title=title, theme=theme)
    nodes = fig.data[-1]  # circuit_figure draws the nodes last, on top of the edges
    nodes.customdata = [[label] for label in (nodes.text or ())]
    nodes.hovertemplate = "%{text}<br>click for its attention and DLA<extra></extra>"
    if selected is not None and nodes.text is not None and selected in nodes.text:
        i = list(nodes.text).index(selected)
        fig.add_scatter(x=[nodes.x[i]], y=[nodes.y[i]], mode="markers", hoverinfo="skip", showlegend=False,
                        marker=dict(size=26, color="rgba(0,0,0,0)", line=dict(width=3, color=STEP_MARK)))
        fig.data = (*fig.data[:-2], fig.data[-1], fig.data[-2])  # the ring under the clickable nodes
    fig.update_layout(clickmode="event+select", dragmode=False, hovermode="closest")
    return fig


# ---- the grokking paper's figures (workbench.analysis.fourier) ------------------------------------
PHASE_LABELS = {"memorised": "memorised", "excluded_min": "circuit forms", "grokked": "grokked",
                "cleaned": "cleaned up"}


def _phase_lines(fig: go.Figure, phases: Optional[dict]) -> None:
    for i, (name, label) in enumerate(PHASE_LABELS.items()):
        step = (phases or {}).get(name)
        if step is not None and np.isfinite(step):  # labels alternate sides, so two phases at one step both read
            fig.add_vline(x=step, line=dict(color="#7f7f7f", width=1, dash="dash"), annotation_text=label,
                          annotation_position="top left" if i % 2 == 0 else "top right", annotation_font_size=10)


def grokking_figure(curve: pd.DataFrame, phases: Optional[dict] = None, columns: Optional[list] = None,
                    title: str = "", log_x: bool = False, theme: Optional[str] = "default") -> go.Figure:
    """Losses against epoch on a log axis (``fourier.progress_measures`` over training): by default train
    and test loss, or any ``columns`` (the restricted and excluded loss); one colour per column, one dash per
    ``seed`` when the table holds several; ``phases`` (``fourier.phase_epochs``) drawn as dashed lines."""
    columns = columns or ["train_loss", "test_loss"]
    missing = [c for c in ["step", *columns] if c not in curve]
    if missing:
        raise ValueError(f"the table has no column(s) {missing}; make it with over_training(series, "
                         "fourier.progress_measures, ...)")
    fig = go.Figure()
    groups = list(curve.groupby("seed", sort=True)) if "seed" in curve else [(None, curve)]
    dashes = ("solid", "dot", "dash", "dashdot", "longdash")
    for g, (seed, part) in enumerate(groups):
        part = part.sort_values("step")
        for c, column in enumerate(columns):
            name = column if seed is None else f"{column}, seed {seed}"
            fig.add_trace(go.Scatter(x=part["step"], y=part[column], mode="lines", name=name,
                                     line=dict(color=PALETTE[c % len(PALETTE)], dash=dashes[g % len(dashes)]),
                                     hovertemplate="epoch %{x}<br>%{y:.4g}<extra>" + name + "</extra>"))
    _phase_lines(fig, phases)
    fig.update_layout(title=title or "Loss over training", xaxis_title="epoch", yaxis_title="loss",
                      yaxis_type="log", template=_template(theme), legend=dict(orientation="h", y=-0.2))
    if log_x:
        fig.update_xaxes(type="log")
    return fig


def fourier_norms_figure(norms: pd.DataFrame, matrix: str = "embed", title: str = "",
                         theme: Optional[str] = "default") -> go.Figure:
    """Bars of a matrix's norm per Fourier frequency (``fourier.embedding_norms``), one panel per ``step``
    when the table has a step column (the embedding at a few points of training)."""
    if not {"matrix", "frequency", "norm"} <= set(norms.columns):
        raise ValueError(f"the table has no matrix/frequency/norm columns (make it with fourier.embedding_norms); "
                         f"it has {list(norms.columns)}")
    part = norms[norms.matrix == matrix]
    if part.empty:
        raise ValueError(f"no rows for matrix={matrix!r}; the table has {sorted(norms.matrix.unique())}")
    steps = sorted(part.step.unique()) if "step" in part else [None]
    fig = make_subplots(rows=len(steps), cols=1, shared_xaxes=True, vertical_spacing=subplot_spacing(len(steps), 1, 0.08)[1],
                        subplot_titles=[f"epoch {s}" if s is not None else "" for s in steps])
    for i, step in enumerate(steps, start=1):
        rows = part if step is None else part[part.step == step]
        fig.add_trace(go.Bar(x=rows["frequency"], y=rows["norm"], marker_color=POSITIVE, showlegend=False,
                             hovertemplate="frequency %{x}<br>norm %{y:.3g}<extra></extra>"), row=i, col=1)
    fig.update_xaxes(title_text="frequency k (0: constant)", row=len(steps), col=1)
    fig.update_layout(title=title or f"Norm of W_{'E' if matrix == 'embed' else 'U'} per Fourier frequency",
                      template=_template(theme), height=max(300, 220 * len(steps)))
    return fig


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
