"""The logit and tuned lens (tables from ``analysis.lens``): the heatmap, its clean-minus-changed
difference, and the residual stream's norm across layers."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from workbench.analysis.common import check_choice, unique_labels
from workbench.viz._common import DIVERGING, LAST_POSITION, SEQUENTIAL, _one_batch, _template


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
